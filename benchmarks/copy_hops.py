"""Delivery delay added per copy hop, against producer -> consumer delay in one cluster.

Four clusters on this machine (tmp folders + loopback ports), chained A -> B -> C -> D by
link costs; each has its own data and metadata cache servers and its own copy daemon. A
producer in A sends 1 KiB messages at a fixed rate; one consumer per cluster (separate
processes, through that cluster's caches) records, for every message, receive time minus
the producer timestamp. Printed: p50/p99 delivery delay in every cluster, the delay added
per hop (difference of consecutive clusters), and ratios against the single-cluster delay.

    .venv/bin/python benchmarks/copy_hops.py [--rate 200] [--seconds 15] [--poll-interval 50ms]

The paper reports ~25 ms added per hop (50 ms copy-reader polling).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import Chain, delays_ms, percentile, progress, report  # noqa: E402

CLUSTERS = ("A", "B", "C", "D")
STREAM = "bench"


def _consume(root: str, data: str, meta: str, seconds: float, warmup: float, out: "mp.Queue") -> None:
    from pyspark_acs.read.consumer import Consumer

    deadline = time.time() + seconds
    while time.time() < deadline:  # the stream appears when the first copy arrives
        try:
            c = Consumer(root, STREAM, data_cache=data, metadata_cache=meta, start="earliest")
            break
        except ValueError:
            time.sleep(0.05)
    else:
        out.put((root, []))
        return
    samples: List[float] = []
    start_after_us = int((time.time() + warmup) * 1e6)
    while time.time() < deadline:
        for batch in c.poll():
            now = time.time_ns() // 1000
            for d, ts in zip(delays_ms(batch, now), batch.column("timestamp").cast("int64").to_pylist()):
                if ts >= start_after_us:
                    samples.append(d)
        time.sleep(0.002)
    c.close()
    out.put((root, samples))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=200.0, help="messages per second (default 200)")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds (default 15)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds ignored at the start (default 3)")
    ap.add_argument("--poll-interval", default="50ms", help="copy readers' poll interval (default 50ms)")
    args = ap.parse_args()

    from pyspark_acs.write.producer import Producer

    tmp = Path(tempfile.mkdtemp(prefix="acs-copy-hops-"))
    chain = Chain(tmp, CLUSTERS, STREAM, extra=["--set", f"poll_interval={args.poll_interval}"]).__enter__()
    deps = chain.deps
    try:
        producer = Producer(str(tmp / "root-A"), STREAM, shards=1, data_cache=deps["A"].data_endpoints,
                            metadata_cache=deps["A"].metadata_endpoints)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        total = args.warmup + args.seconds
        procs = [
            ctx.Process(target=_consume, args=(str(tmp / f"root-{c}"), deps[c].data_endpoints,
                                                deps[c].metadata_endpoints, total + 3.0, args.warmup, out))
            for c in CLUSTERS
        ]
        for pr in procs:
            pr.start()
        time.sleep(1.0)
        progress(f"producing 1 KiB messages at {args.rate:.0f}/s for {total:.0f} s")
        value = b"v" * 1024
        interval = 1.0 / args.rate
        next_at = time.monotonic()
        end = next_at + total
        while time.monotonic() < end:
            producer.send(value)
            next_at += interval
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        producer.close()
        results = {}
        for _ in procs:
            root, samples = out.get(timeout=total + 60)
            results[Path(root).name.split("-")[-1]] = samples
        for pr in procs:
            pr.join(timeout=10)

        rows = {}
        base50 = percentile(results["A"], 50)
        base99 = percentile(results["A"], 99)
        prev = None
        for c in CLUSTERS:
            s = results.get(c, [])
            p50, p99 = percentile(s, 50), percentile(s, 99)
            hop = ""
            if prev is not None:
                hop = f"  (+{p50 - prev[0]:.1f} ms p50, +{p99 - prev[1]:.1f} ms p99 for hop into {c})"
            rows[f"cluster {c} ({CLUSTERS.index(c)} hops)"] = f"p50 {p50:.1f} ms  p99 {p99:.1f} ms  n={len(s)}{hop}"
            prev = (p50, p99)
        report("delivery delay (producer timestamp -> consumer)", rows)
        d50 = percentile(results["D"], 50)
        d99 = percentile(results["D"], 99)
        hops = len(CLUSTERS) - 1
        report("per hop", {
            "mean added p50 per hop": f"{(d50 - base50) / hops:.1f} ms (paper: ~25 ms)",
            "mean added p99 per hop": f"{(d99 - base99) / hops:.1f} ms",
            "D / A p50 ratio": f"{d50 / base50:.1f}x" if base50 > 0 else "n/a",
            "D / A p99 ratio": f"{d99 / base99:.1f}x" if base99 > 0 else "n/a",
        })
        return 0
    finally:
        chain.__exit__()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
