"""Flush latency of ``acknowledge="clusters:2"`` against ``"published"``, in one run.

Three clusters on this machine (tmp folders + loopback ports), chained A -> B -> C, each with
its own data and metadata cache server and its own copy daemon at its default settings. A
Producer in A sends one 1 KiB message and flushes, at 1, 10 and 100 flushes per second; the
same schedule runs once with ``published`` (durable and published in A) and once with
``clusters:2`` (also durable in one destination, as the daemons confirm in A's metadata
cache), alternating per rate. Printed: p50/p99 flush latency per mode and rate, and the ratio.
The floor of ``clusters:2`` is ``published`` plus one copy hop to B's store and the
confirmation's put and read.

    .venv/bin/python benchmarks/ack_clusters.py [--seconds 10] [--rates 1,10,100]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import Chain, percentile, progress, report  # noqa: E402

CLUSTERS = ("A", "B", "C")
STREAM = "ackbench"


def _run(root: str, deps: Dict, mode: str, rate: float, seconds: float) -> List[float]:
    """Flush latencies (ms) of one message per flush at ``rate`` flushes/s for ``seconds``."""
    from pyspark_acs.write.producer import Producer

    value = b"v" * 1024
    out: List[float] = []
    with Producer(root, STREAM, shards=1, acknowledge=mode, data_cache=deps["A"].data_endpoints,
                  metadata_cache=deps["A"].metadata_endpoints) as p:
        for _ in range(3):  # the file exists and the copy operations run before measuring
            p.send(value)
            p.flush(timeout=30)
        interval = 1.0 / rate
        next_at = time.monotonic()
        end = next_at + seconds
        while next_at < end:
            p.send(value)
            started = time.perf_counter()
            p.flush(timeout=30)
            out.append((time.perf_counter() - started) * 1000)
            next_at += interval
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per mode and rate (default 10)")
    ap.add_argument("--rates", default="1,10,100", help="flushes per second (default 1,10,100)")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="acs-ack-clusters-"))
    try:
        with Chain(tmp, CLUSTERS, STREAM) as chain:  # the daemons at their default settings
            results: Dict[tuple, List[float]] = {}
            for rate in rates:
                for mode in ("published", "clusters:2"):
                    progress(f"{mode}: one message per flush at {rate:g} flushes/s for {args.seconds:g} s")
                    results[(mode, rate)] = _run(chain.roots["A"], chain.deps, mode, rate, args.seconds)
        rows = {}
        for rate in rates:
            pub, two = results[("published", rate)], results[("clusters:2", rate)]
            p50p, p99p = percentile(pub, 50), percentile(pub, 99)
            p50c, p99c = percentile(two, 50), percentile(two, 99)
            rows[f"{rate:g} flushes/s"] = (
                f"published p50 {p50p:.2f} / p99 {p99p:.2f} ms (n={len(pub)}); clusters:2 p50 {p50c:.2f} / p99 "
                f"{p99c:.2f} ms (n={len(two)}); ratio p50 {p50c / p50p:.1f}x, p99 {p99c / p99p:.1f}x")
        report("flush latency, one 1 KiB message per flush (chain A -> B -> C, one machine)", rows)
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
