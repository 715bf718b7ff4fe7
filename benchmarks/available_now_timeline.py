"""Timeline of one ``Trigger.AvailableNow`` query of the ``acs`` source, start() to termination.

Where does a short streaming query spend the time that is not its micro-batches? This script
runs AvailableNow queries of the acs source (and of Spark's text source over the same bytes,
for comparison) on ``local[2]`` and prints, per query, on one clock (wall time relative to
``start()``):

* the driver side: ``start()`` returning, each micro-batch's start and Spark's ``durationMs``
  phases (from the query's progress), termination;
* the planner process Spark starts for the query (``python_streaming_source_runner``), started
  through a wrapper interpreter (``PYSPARK_PYTHON``) that stamps its exec, its interpreter being
  up, pyspark imported, the connection to the JVM, Spark's bootstrap steps (spark files, the
  data source unpickled), the reader's construction, every call Spark makes into the reader
  (initialOffset, latestOffset, prepareForTriggerAvailableNow, partitions, commit, ...) with its
  duration, and which heavy modules (grpc, pandas, pyarrow.compute, ...) it has imported by then.

The planner calls are recorded by a subclass of the acs source registered as ``acs_traced``
(same code, each method wrapped); the trace goes to a file every process appends to.

Usage::

    .venv/bin/python benchmarks/available_now_timeline.py [--messages 200000] [--repeat 2]
        [--importtime] [--compile] [--no-pyspark-zip] [--text] [--batch] [--conf key=value ...]

``--importtime`` starts the planner process through a wrapper that runs it with
``python -X importtime`` (its import tree is written next to the trace and summarised).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from typing import Dict, List

from _common import progress

from pyspark_acs import Producer

from _acs_traced import TRACE_ENV, TracedSource  # by name: the planner imports it, not a pickled copy
from spark_source import build_spark, package_bytecode, spark_home_without_zip

SIZE = 1024
SHARDS = 2
def write_inputs(base: str, n: int) -> Dict[str, str]:
    root = os.path.join(base, "acs")
    text_dir = os.path.join(base, "text")
    if os.path.exists(os.path.join(base, "done")):
        return {"root": root, "text": text_dir}
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(text_dir)
    filler = (b"abcdefghijklmnopqrstuvwxyz0123456789" * 40)[:SIZE]
    progress(f"writing {n} messages of {SIZE} B (acs, {SHARDS} shards, and text)")
    files = [open(os.path.join(text_dir, f"part-{s}.txt"), "wb") for s in range(SHARDS)]
    with Producer(root, "bench", shards=SHARDS) as p:
        for i in range(n):
            m = (b"%012d " % i) + filler[: SIZE - 13]
            p.send(m, shard=i % SHARDS)
            files[i % SHARDS].write(m + b"\n")
        p.flush()
    for f in files:
        f.close()
    open(os.path.join(base, "done"), "w").close()
    return {"root": root, "text": text_dir}


BOOT = """\
import json, os, sys, time
t_up = time.time()
def trace(event):
    with open(os.environ["{env}"], "a") as f:
        f.write(json.dumps({{"t": time.time(), "pid": os.getpid(), "event": event}}) + "\\n")
trace("planner: interpreter up (site imported)")
import pyspark.sql.streaming.python_streaming_source_runner as runner
trace("planner: runner module imported (pyspark)")
from pyspark.worker_util import get_sock_file_to_executor
def traced(name, fn):
    def call(*a, **k):
        trace(f"planner: {{name}} begins")
        try:
            return fn(*a, **k)
        finally:
            trace(f"planner: {{name}} returned")
    return call
runner.read_command = traced("read_command (data source unpickled)", runner.read_command)
runner.setup_spark_files = traced("setup_spark_files", runner.setup_spark_files)
runner.check_python_version = traced("check_python_version (first read from the JVM)", runner.check_python_version)
runner._streamReader = traced("_streamReader", runner._streamReader)
import pyspark.worker_util as wu, importlib
wu.add_path = traced("add_path", wu.add_path)
importlib.invalidate_caches = traced("invalidate_caches", importlib.invalidate_caches)
with get_sock_file_to_executor(timeout=None) as sock_file:
    trace("planner: connected to the JVM")
    runner.main(sock_file, sock_file)
trace("planner: main returned")
"""


def python_wrapper(tmp: str, importtime: bool) -> str:
    """A PYSPARK_PYTHON that starts the streaming planner process through a bootstrap that
    traces its start-up (optionally under ``python -X importtime``)."""
    boot = os.path.join(tmp, "planner_boot.py")
    with open(boot, "w") as f:
        f.write(BOOT.format(env=TRACE_ENV))
    path = os.path.join(tmp, "python-wrapper.sh")
    flag = "-X importtime" if importtime else ""
    with open(path, "w") as f:
        f.write(f"""#!/bin/bash
for a in "$@"; do
  if [ "$a" = pyspark.sql.streaming.python_streaming_source_runner ]; then
    echo '{{"t": '$(date +%s.%N)', "pid": '$$', "event": "planner: process exec"}}' >> "${TRACE_ENV}"
    exec {sys.executable} {flag} {boot} 2>{tmp}/importtime-$$.txt
  fi
done
exec {sys.executable} "$@"
""")
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def run_query(spark, make, ckpt: str, trace: str) -> Dict:
    open(trace, "w").close()
    t0 = time.time()
    q = make().writeStream.format("noop").option("checkpointLocation", ckpt).trigger(availableNow=True).start()
    t_started = time.time()
    q.awaitTermination(900)
    t_end = time.time()
    if q.exception():
        raise RuntimeError(str(q.exception()))
    events = [json.loads(line) for line in open(trace)]
    return {"t0": t0, "started": t_started, "end": t_end, "progress": [json.loads(p.json) for p in q.recentProgress],
            "events": events}


def _ts(s: str) -> float:
    import datetime

    return datetime.datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def show(name: str, r: Dict) -> None:
    t0 = r["t0"]
    lines = [(0.0, "start() called")]
    lines.append((r["started"] - t0, "start() returned"))
    for p in r["progress"]:
        d = p["durationMs"]
        at = _ts(p["timestamp"]) - t0
        lines.append((at, f"batch {p['batchId']} begins: rows {p['numInputRows']}, "
                          + ", ".join(f"{k} {v}" for k, v in d.items())))
        lines.append((at + d.get("triggerExecution", 0) / 1000, f"batch {p['batchId']} ends"))
    for e in r["events"]:
        if e["event"] == "reader init begin":
            lines.append((e["t"] - t0, f"pid {e['pid']}: reader init (modules {e['modules']}, heavy loaded: {e['loaded']})"))
        elif e["event"].startswith("planner: "):
            lines.append((e["t"] - t0, f"{e['event']} (pid {e['pid']})"))
        elif "begin" in e:
            lines.append((e["begin"] - t0, f"pid {e['pid']}: {e['event']} {e['dur'] * 1000:.1f} ms"))
    lines.append((r["end"] - t0, "terminated (awaitTermination returned)"))
    print(f"\n== {name}: total {r['end'] - t0:.3f} s, in micro-batches "
          f"{sum(p['durationMs'].get('triggerExecution', 0) for p in r['progress']) / 1000:.3f} s")
    for at, what in sorted(lines, key=lambda x: x[0]):
        print(f"  {at * 1000:8.1f} ms  {what}")
    sys.stdout.flush()


def summarise_importtime(path: str, top: int = 25) -> None:
    rows = []
    for line in open(path):
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, rest = line.split(":", 1)
        self_us, cum_us, mod = rest.split("|")
        rows.append((int(cum_us), int(self_us), mod.rstrip()))
    top_level = [r for r in rows if not r[2].startswith("  ")]
    print(f"\n== planner import tree ({os.path.basename(path)}): {len(rows)} modules, "
          f"{sum(r[1] for r in rows) / 1000:.0f} ms self time in all")
    for cum, self_us, mod in sorted(top_level, reverse=True)[:top]:
        print(f"  {cum / 1000:8.1f} ms  {mod.strip()}")
    for wanted in ("grpc", "google.protobuf", "pandas", "pyarrow", "numpy", "pyspark_acs"):
        hits = [r for r in rows if r[2].strip() == wanted]
        if hits:
            print(f"  imported: {wanted} ({hits[0][0] / 1000:.1f} ms cumulative)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--data", default="/tmp/acs-timeline-data", help="input folder (reused when complete)")
    p.add_argument("--importtime", action="store_true")
    p.add_argument("--text", action="store_true", help="also run Spark's text source")
    p.add_argument("--batch", action="store_true", help="also time a batch read of the same acs stream")
    p.add_argument("--conf", action="append", default=[], help="extra Spark conf key=value")
    p.add_argument("--compile", action="store_true", help="compile pyspark_acs's bytecode up front (as pip does)")
    p.add_argument("--no-pyspark-zip", action="store_true", help="a SPARK_HOME without python/lib/pyspark.zip")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="acs-timeline-")
    progress(f"pyspark_acs bytecode: {package_bytecode(args.compile)}")
    if args.no_pyspark_zip:
        os.environ["SPARK_HOME"] = spark_home_without_zip(tmp)
        progress("no pyspark.zip on the Python workers' path")
    trace = os.path.join(tmp, "trace.jsonl")
    os.environ[TRACE_ENV] = trace
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    python = python_wrapper(tmp, args.importtime)
    paths = write_inputs(f"{args.data}-{args.messages}", args.messages)
    confs = list(args.conf)
    spark = build_spark(confs, python=python, app="acs-available-now-timeline")
    try:
        spark.dataSource.register(TracedSource)
        opts = {"root": paths["root"], "stream": "bench", "startingOffsets": "earliest"}
        # warm the Python workers once (as the benchmark's up-front count does)
        spark.read.format("acs").options(**opts).load().count()
        if args.batch:
            for i in range(args.repeat):
                t0 = time.time()
                spark.read.format("acs").options(**opts).load().write.format("noop").mode("overwrite").save()
                print(f"acs batch read: {time.time() - t0:.3f} s")
        for i in range(args.repeat):
            r = run_query(spark, lambda: spark.readStream.format("acs_traced").options(**opts).load(),
                          os.path.join(tmp, f"ckpt-acs-{i}"), trace)
            show(f"acs AvailableNow run {i + 1} (load {os.getloadavg()[0]:.2f})", r)
            if args.text:
                r = run_query(spark, lambda: spark.readStream.text(paths["text"]), os.path.join(tmp, f"ckpt-text-{i}"),
                              trace)
                show(f"text AvailableNow run {i + 1} (load {os.getloadavg()[0]:.2f})", r)
    finally:
        spark.stop()
    if args.importtime:
        for f in sorted(os.listdir(tmp)):
            if f.startswith("importtime-"):
                summarise_importtime(os.path.join(tmp, f))
                shutil.copy(os.path.join(tmp, f), "/tmp/")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
