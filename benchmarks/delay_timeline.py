"""Per-burst timeline of the sink -> source delay (what ``spark_source.py``'s delay run measures).

The same two queries as ``spark_source.py --skip-throughput`` (``rate`` -> acs sink with caches;
acs source with caches -> ``foreachBatch``; both at ``processingTime="0 seconds"``, local[2]),
with the connector's calls traced (``_acs_traced``: the sink's task writes, its driver-side
commit and the moment it publishes the batch's lengths, the source planner's ``latestOffset``
answers and ``partitions`` calls, the read tasks) and both queries' progress kept. The rate
source emits its rows once a second: each second's rows are one burst, written by one sink
micro-batch and read by (usually) one source micro-batch. Per burst, on one clock (ms after the
sink micro-batch began)::

    sink tasks end | commit begins | lengths published | commit ends | sink batch ends |
    source latestOffset answers (moved) | source batch begins | partitions() | read tasks |
    foreachBatch arrival | delay of the burst's rows (max)

The bursts are printed worst first (by their rows' largest delay), then the median burst, then
per stretch the p50 and p90 over all bursts -- what the p99 bursts spent more time on.

Usage::

    .venv/bin/python benchmarks/delay_timeline.py [--seconds 60] [--rate 1000] [--compile]
        [--conf KEY=VALUE ...] [--show 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Dict, List

from _common import percentile, progress

from _acs_traced import TRACE_ENV
from _acs_traced_delay import TracedSinkSource  # by name: Spark's Python processes import it
from spark_source import SHARDS, build_spark, package_bytecode, start_delay_queries

from pyspark_acs.server.local.deploy import LocalDeployment


def _ts(s: str) -> float:
    return datetime.datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def run(spark, tmp: str, dep: LocalDeployment, seconds: float, rate: int) -> Dict:
    from pyspark_acs.storage.store import open_store

    root = os.path.join(tmp, "delay")
    opts = {"root": root, "stream": "live", "dataCache": dep.data_endpoints, "metadataCache": dep.metadata_endpoints}
    open_store(root).create_stream("live", SHARDS)
    lock = threading.Lock()
    arrivals: List[Dict] = []

    def collect(df, batch_id):
        began = time.time()
        ts = df.select("timestamp").toArrow().column("timestamp").cast("int64").to_pylist()
        now = time.time()
        if ts:
            with lock:
                arrivals.append({"batch": batch_id, "begin": began, "at": now, "rows": len(ts),
                                 "ts_min": min(ts) / 1e6, "ts_max": max(ts) / 1e6})

    source, sink = start_delay_queries(spark, opts, collect, os.path.join(tmp, "ckpt"), rate, fmt="acs_traced")
    progress(f"sink ({rate} rows/s) and source running for {seconds:.0f} s")
    start = time.time()
    try:
        while time.time() - start < seconds:
            for q in (source, sink):
                if q.exception():
                    raise RuntimeError(str(q.exception()))
            time.sleep(1)
    finally:
        sink.stop()
        source.stop()
    return {"arrivals": arrivals, "sink": [json.loads(p.json) for p in sink.recentProgress],
            "source": [json.loads(p.json) for p in source.recentProgress], "start": start}


def analyse(r: Dict, trace: str, warmup: float, show: int) -> None:
    events = [json.loads(line) for line in open(trace)]
    first = min((a["at"] for a in r["arrivals"]), default=r["start"])
    sink_batches = [p for p in r["sink"] if p["numInputRows"]]
    source_batches = [p for p in r["source"] if p["numInputRows"]]
    bursts = []
    for p in sink_batches:
        b0 = _ts(p["timestamp"])
        b1 = b0 + p["durationMs"].get("triggerExecution", 0) / 1000
        writes = [e for e in events if e["event"] == "write" and b0 <= e["begin"] <= b1]
        commit = [e for e in events if e["event"] == "commit" and e.get("batch") == p["batchId"]]
        if not writes or not commit:
            continue
        c = commit[-1]
        c_end = c["begin"] + c["dur"]
        pub = [e for e in events if e["event"] == "sink lengths published" and c["begin"] <= e["begin"] <= c_end]
        # The burst's rows: stamped while its tasks ran
        w0 = min(e["begin"] for e in writes)
        w1 = max(e["begin"] + e["dur"] for e in writes)
        got = [a for a in r["arrivals"] if a["ts_max"] >= w0 - 0.001 and a["ts_min"] <= w1 + 0.001]
        if not got or got[0]["at"] < first + warmup:
            continue
        arrive = max(a["at"] for a in got)
        answers = [e for e in events if e["event"] == "latestOffset answer" and e.get("moved")
                   and e["begin"] + e["dur"] >= c_end - 0.5 and e["begin"] + e["dur"] <= arrive]
        src = [s for s in source_batches if any(a["batch"] == s["batchId"] for a in got)]
        parts = [e for e in events if e["event"] == "partitions" and src and e["begin"] >= _ts(src[0]["timestamp"])
                 and e["begin"] <= arrive]
        reads = [e for e in events if e["event"] == "read" and e.get("rows") and parts
                 and parts[0]["begin"] <= e["begin"] <= arrive]
        rel = lambda t: (t - b0) * 1000  # noqa: E731
        row = {
            "sink batch": p["batchId"],
            "tasks end": rel(w1),
            "commit begins": rel(c["begin"]),
            "published": rel(pub[-1]["begin"] + pub[-1]["dur"]) if pub else float("nan"),
            "commit ends": rel(c_end),
            "sink batch ends": rel(b1),
            "LO answers": rel(answers[0]["begin"] + answers[0]["dur"]) if answers else float("nan"),
            "src batch begins": rel(_ts(src[0]["timestamp"])) if src else float("nan"),
            "partitions": rel(parts[0]["begin"]) if parts else float("nan"),
            "collect begins": rel(min(a["begin"] for a in got)),
            "reads begin": rel(min(e["begin"] for e in reads)) if reads else float("nan"),
            "reads end": rel(max(e["begin"] + e["dur"] for e in reads)) if reads else float("nan"),
            "arrival": rel(arrive),
            "delay max": (arrive - w0) * 1000,
            "src batches": len(got),
            "src phases": [s["durationMs"] for s in src],
            "sink phases": p["durationMs"],
            "encode": rel(w0),
        }
        bursts.append(row)
    if not bursts:
        print("no bursts matched")
        return
    keys = ["encode", "tasks end", "commit begins", "published", "commit ends", "sink batch ends", "LO answers",
            "src batch begins", "partitions", "collect begins", "reads begin", "reads end", "arrival", "delay max"]
    print(f"\n== {len(bursts)} bursts; times in ms after the sink micro-batch began")
    print("  " + " | ".join(f"{k[:10]:>10}" for k in ["sink batch"] + keys) + " | src batches")

    def line(b):
        return "  " + " | ".join(f"{b[k]:>10.0f}" for k in ["sink batch"] + keys) + f" | {b['src batches']}"

    ordered = sorted(bursts, key=lambda b: -b["delay max"])
    for b in ordered[:show]:
        print(line(b))
        print(f"      sink: {b['sink phases']}")
        for s in b["src phases"]:
            print(f"      src:  {s}")
    print("  median burst:")
    print(line(ordered[len(ordered) // 2]))
    print("\n== stretches over all bursts (ms): p50 / p90 / max")
    pairs = [("encode", "tasks end"), ("tasks end", "commit begins"), ("commit begins", "published"),
             ("published", "commit ends"), ("commit ends", "sink batch ends"), ("published", "LO answers"),
             ("LO answers", "src batch begins"), ("src batch begins", "partitions"), ("partitions", "collect begins"),
             ("collect begins", "reads begin"),
             ("reads begin", "reads end"), ("reads end", "arrival"), ("published", "arrival"), ("encode", "arrival")]
    for a, b in pairs:
        v = [x[b] - x[a] for x in bursts if x[a] == x[a] and x[b] == x[b]]
        if v:
            print(f"  {a:>16} -> {b:<16} {percentile(v, 50):7.0f} {percentile(v, 90):7.0f} {max(v):7.0f}  (n={len(v)})")
    for who in ("sink", "src"):
        print(f"  {who} phases p50 / p90:", end="")
        phases = [b["sink phases"]] if False else None
        rows = [b["sink phases"] for b in bursts] if who == "sink" else [s for b in bursts for s in b["src phases"]]
        for k in ("triggerExecution", "latestOffset", "walCommit", "queryPlanning", "addBatch", "commitOffsets"):
            v = [d.get(k, 0) for d in rows]
            print(f" {k} {percentile(v, 50):.0f}/{percentile(v, 90):.0f}", end="")
        print()
    idle = [e["dur"] * 1000 for e in events if e["event"] == "latestOffset answer" and not e.get("moved")]
    moved = [e["dur"] * 1000 for e in events if e["event"] == "latestOffset answer" and e.get("moved")]
    parts = [e["dur"] * 1000 for e in events if e["event"] == "partitions"]
    commits = [e["dur"] * 1000 for e in events if e["event"] == "commit"]
    print(f"  latestOffset moved: p50 {percentile(moved, 50):.1f} ms p90 {percentile(moved, 90):.1f} (n={len(moved)});"
          f" idle: p50 {percentile(idle, 50):.1f} (n={len(idle)}); partitions p50 {percentile(parts, 50):.1f} ms;"
          f" sink commit p50 {percentile(commits, 50):.1f} p90 {percentile(commits, 90):.1f} ms")
    print("  worst row of each burst, in order (sink batch: ms): "
          + " ".join(f"{b['sink batch']}:{b['delay max']:.0f}" for b in bursts))
    split = [b for b in bursts if b["src batches"] > 1]
    print(f"  bursts read in more than one source micro-batch: {len(split)} of {len(bursts)}; their worst rows: "
          + (", ".join(f"{b['delay max']:.0f}" for b in split) or "-") + " ms")
    delays = [(a["at"] - a["ts_min"]) * 1000 for a in r["arrivals"] if a["at"] >= first + warmup]
    print(f"  worst row of each source batch: p50 {percentile(delays, 50):.0f} ms, p90 {percentile(delays, 90):.0f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rate", type=int, default=1000)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--show", type=int, default=8, help="worst bursts to print (default 8)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--compile", action="store_true", help="compile pyspark_acs's bytecode up front (as pip does)")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="acs-delay-timeline-")
    progress(f"pyspark_acs bytecode: {package_bytecode(args.compile)}")
    trace = os.path.join(tmp, "trace.jsonl")
    open(trace, "w").close()
    os.environ[TRACE_ENV] = trace
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    dep = LocalDeployment(os.path.join(tmp, "servers"), capacity="512MiB").start()
    spark = None
    try:
        spark = build_spark(["spark.sql.streaming.numRecentProgressUpdates=1000"] + args.conf,
                            app="acs-delay-timeline")
        spark.dataSource.register(TracedSinkSource)
        r = run(spark, tmp, dep, args.seconds, args.rate)
        analyse(r, trace, args.warmup, args.show)
        print(f"  load average {os.getloadavg()[0]:.2f}; extra settings: {', '.join(args.conf) or 'none'}")
    finally:
        if spark is not None:
            spark.stop()
        dep.stop()
        shutil.copy(trace, "/tmp/acs-delay-trace.jsonl")
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
