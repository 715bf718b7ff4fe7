"""End-to-end demo of pyspark_acs on an embedded local deployment (what ``make demo`` runs).

What it does, in order:

1. Starts cluster A: 3 data-cache + 3 metadata-cache server processes (LocalDeployment) and
   a durable store root, all in a temporary folder.
2. If the copy daemon is installed (``pyspark_acs.server.copy.daemon``), also starts cluster
   B (1 data + 1 metadata cache server, its own root) and one copy daemon per cluster, with a
   topology file that copies the demo stream A -> B. If the daemons do not start, the demo
   says so and goes on with cluster A alone (``--copy on`` makes that an error, ``--copy off``
   skips cluster B).
3. Starts a local SparkSession, warms up its Python workers (a small batch write and read of
   another stream), and starts a Spark *source* query,
   ``spark.readStream.format("acs")`` on cluster A with its caches, into a ``foreachBatch``
   sink at ``processingTime="0 seconds"`` that records every row and when it arrived.
4. Starts a Spark *sink* query: Spark's built-in ``rate`` source, mapped to deterministic
   key/value bytes (``value`` = row number, its sha256 and padding), written with
   ``writeStream.format("acs")`` through cluster A's caches.
5. Prints progress while messages flow, then checks, and exits non-zero on any difference:
   * every produced row number 0..N-1 arrived exactly once, byte-exact (key and value
     recomputed in Python, independently of the SQL that wrote them), in order per shard,
     in the shard its key hashes to;
   * a batch read (``spark.read.format("acs")``) of the durable store equals the streamed rows;
   * cluster B (when running) holds the same messages, byte-exact.
6. Prints the delivery delay p50/p99: the time a row arrived in the source query's
   ``foreachBatch`` minus the message timestamp the sink wrote (and the same for cluster B,
   read with a plain Consumer), writes a PNG of that delay over time per cluster (``--plot``;
   skipped with a note when matplotlib is not installed), and stops everything - queries,
   Spark, daemons, servers - also on error or Ctrl-C.

Run::

    .venv/bin/python examples/demo.py                 # or: make demo
    .venv/bin/python examples/demo.py --messages 5000 --rate 1000 --copy off

Exit status: 0 when everything matched, 1 on a mismatch (the message says what differs),
2 on any other failure (a timeout, a query that failed, a server that did not start).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

STREAM = "demo"
KEYS = 16
#: Bytes of the value before the padding: 12 digits, ':', 64 hex digits of sha256.
VALUE_HEAD = 77
#: The demo's JVM compiles with C1 only. The demo is a one-minute run on (here) 2 cores, and
#: in its first minute the JVM's JIT compiler threads took about half of the JVM's CPU (25 of
#: 53 core-seconds, per-thread /proc), CPU the queries lacked: in the same hour, the JVM used
#: 11.8 core-seconds while the queries ran instead of 20.5, and the steady-state delay p99 was
#: 484 ms instead of 722. A long-running job is better served by the default tiered
#: compilation: do not copy this setting into one. (C1 alone also shrinks the code cache to
#: 48 MB; it keeps the tiered default's 240 MB here.)
DEMO_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
#: Messages written in the first seconds are left out of the steady-state delay figures.
WARMUP_S = 5.0

T0 = time.monotonic()


class Mismatch(Exception):
    """The data read back differs from what was written."""


class DemoError(Exception):
    """Anything else went wrong (a timeout, a failed query, a server that did not start)."""


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# -- the messages -------------------------------------------------------------------------------


def expected_key(v: int) -> bytes:
    return f"key-{v % KEYS}".encode()


def expected_value(v: int, value_bytes: int) -> bytes:
    head = f"{v:012d}:{hashlib.sha256(str(v).encode()).hexdigest()}"
    return (head + "." * (value_bytes - VALUE_HEAD)).encode()


def message_columns(df, value_bytes: int):
    """The rate source's rows as key/value bytes (the SQL twin of expected_key/expected_value)."""
    from pyspark.sql import functions as F

    v = F.col("value")
    return df.select(
        F.concat(F.lit("key-"), (v % KEYS).cast("string")).cast("binary").alias("key"),
        F.concat(
            F.lpad(v.cast("string"), 12, "0"),
            F.lit(":"),
            F.sha2(v.cast("string"), 256),
            F.repeat(F.lit("."), value_bytes - VALUE_HEAD),  # a long literal bloats plan strings
        ).cast("binary").alias("value"),
    )


# -- helpers ------------------------------------------------------------------------------------


def percentile(samples: List[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, int(round(q / 100.0 * (len(ordered) - 1)))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_daemon_available() -> bool:
    try:
        import pyspark_acs.server.copy.daemon  # noqa: F401
    except Exception:  # missing module, or a broken one: the demo runs without cluster B
        return False
    return True


def readline_within(proc: subprocess.Popen, timeout: float) -> str:
    """The first stdout line of ``proc`` (or '' after ``timeout`` or on exit)."""
    out: List[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline().decode("utf-8", "replace")), daemon=True)
    reader.start()
    reader.join(timeout)
    return out[0].strip() if out else ""


class Collector:
    """The source query's foreachBatch: keeps every row (Arrow) and its arrival time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tables: List[Tuple[float, object]] = []  # (arrival unix seconds, pyarrow.Table)
        self.rows = 0
        self.batches = 0

    def __call__(self, df, batch_id: int) -> None:
        table = df.select("shard", "position", "file", "timestamp", "key", "value").toArrow()
        arrived = time.time()
        with self.lock:
            self.batches += 1
            if table.num_rows:
                self.tables.append((arrived, table))
                self.rows += table.num_rows

    def delays_ms(self, after_us: Optional[float] = None) -> List[float]:
        """Delay of every row in ms (only rows stamped after ``after_us`` when given)."""
        import pyarrow as pa

        out: List[float] = []
        with self.lock:
            for arrived, table in self.tables:
                stamps = table.column("timestamp").cast(pa.int64()).to_pylist()
                out.extend((arrived * 1e6 - ts) / 1000.0 for ts in stamps if after_us is None or ts > after_us)
        return out

    def points(self) -> List[Tuple[float, float]]:
        """(message timestamp in s, delay in ms) of every row, for the plot."""
        import pyarrow as pa

        out: List[Tuple[float, float]] = []
        with self.lock:
            for arrived, table in self.tables:
                stamps = table.column("timestamp").cast(pa.int64()).to_pylist()
                out.extend((ts / 1e6, arrived * 1e3 - ts / 1e3) for ts in stamps)
        return out

    def first_stamp_us(self) -> Optional[int]:
        import pyarrow.compute as pc

        with self.lock:
            firsts = [pc.min(t.column("timestamp")).cast("int64").as_py() for _, t in self.tables]
        return min(firsts) if firsts else None


class ClusterBReader(threading.Thread):
    """Follows the demo stream in cluster B with a plain Consumer; keeps rows and arrival times."""

    def __init__(self, root: str, data_cache: str, metadata_cache: str, shards: int) -> None:
        super().__init__(name="cluster-B-reader", daemon=True)
        self.root, self.data_cache, self.metadata_cache, self.shards = root, data_cache, metadata_cache, shards
        self.stop_event = threading.Event()
        self.rows: Dict[Tuple[int, str, int], Tuple[bytes, bytes]] = {}
        self.delays: List[float] = []
        self.points: List[Tuple[float, float]] = []  # (message timestamp in s, delay in ms), for the plot
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        import pyarrow as pa

        from pyspark_acs import Consumer
        from pyspark_acs.storage.store import open_store

        try:
            store = open_store(self.root)
            while store.stream_shards(STREAM) is None:  # the copy daemon creates it with the first copy
                if self.stop_event.wait(0.1):
                    return
            consumer = Consumer(self.root, STREAM, start="earliest", data_cache=self.data_cache,
                                metadata_cache=self.metadata_cache)
            try:
                while not self.stop_event.is_set():
                    for batch in consumer.poll():
                        now_us = time.time() * 1e6
                        cols = batch.to_pydict()
                        stamps = batch.column("timestamp").cast(pa.int64()).to_pylist()
                        self.delays.extend((now_us - ts) / 1000.0 for ts in stamps)
                        self.points.extend((ts / 1e6, (now_us - ts) / 1000.0) for ts in stamps)
                        for shard, f, pos, key, value in zip(cols["shard"], cols["file"], cols["position"],
                                                             cols["key"], cols["value"]):
                            self.rows[(shard, f, pos)] = (key, value)
                    self.stop_event.wait(0.005)
            finally:
                consumer.close()
        except BaseException as exc:  # reported by the main thread
            self.error = exc


# -- the plot -----------------------------------------------------------------------------------

#: Width of the time bins the plot takes the median and p99 delay of.
PLOT_BIN_S = 1.0


def write_plot(path: str, series: Dict[str, List[Tuple[float, float]]]) -> str:
    """Write a PNG of delivery delay over time, one median line (and a dashed p99) per cluster.

    ``series`` maps a label to ``(message timestamp in s, delay in ms)`` points. Returns the
    line the demo prints: where the plot is, or why there is none (matplotlib is in the bench
    extra, not a dependency of the package).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return ("delay plot: skipped, matplotlib is not installed "
                "(.venv/bin/pip install matplotlib, or pip install -e '.[bench]')")
    series = {label: pts for label, pts in series.items() if pts}
    if not series:
        return "delay plot: skipped, no messages arrived"
    t0 = min(ts for pts in series.values() for ts, _ in pts)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    for label, pts in series.items():
        bins: Dict[int, List[float]] = {}
        for ts, delay in pts:
            bins.setdefault(int((ts - t0) // PLOT_BIN_S), []).append(delay)
        xs = [(b + 0.5) * PLOT_BIN_S for b in sorted(bins)]
        line = ax.plot(xs, [percentile(bins[b], 50) for b in sorted(bins)], label=f"{label} p50")[0]
        ax.plot(xs, [percentile(bins[b], 99) for b in sorted(bins)], linestyle="--", color=line.get_color(),
                alpha=0.6, label=f"{label} p99")
    ax.set_xlabel("message timestamp, seconds since the first message")
    ax.set_ylabel("delivery delay (ms)")
    ax.set_yscale("log")
    ax.set_title(f"pyspark_acs demo: delivery delay per cluster ({PLOT_BIN_S:g} s bins)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"delay plot: {path}"


# -- the demo -----------------------------------------------------------------------------------


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.timeout
        self.tmp = Path(args.workdir or tempfile.mkdtemp(prefix="acs-demo-"))
        self.root_a = str(self.tmp / "A" / "store")
        self.root_b = str(self.tmp / "B" / "store")
        self.deps: Dict[str, object] = {}
        self.daemons: List[subprocess.Popen] = []
        self.spark = None
        self.queries: List[object] = []
        self.collector = Collector()
        self.b_reader: Optional[ClusterBReader] = None

    def remaining(self, cap: float) -> float:
        return max(0.0, min(cap, self.deadline - time.monotonic()))

    # -- start-up --

    def start_clusters(self) -> None:
        from pyspark_acs.server.local.deploy import LocalDeployment

        say(f"work folder {self.tmp}")
        dep = LocalDeployment(self.tmp / "A" / "servers", data_replicas=3, metadata_replicas=3, capacity="128MiB")
        self.deps["A"] = dep
        dep.start()
        say(f"cluster A: 3 data caches {dep.data_endpoints}")
        say(f"cluster A: 3 metadata caches {dep.metadata_endpoints}")

        want = self.args.copy
        if want == "off":
            say("cluster B: skipped (--copy off)")
            return
        if not copy_daemon_available():
            if want == "on":
                raise DemoError("--copy on, but pyspark_acs.server.copy.daemon cannot be imported")
            say("cluster B: skipped (pyspark_acs.server.copy.daemon is not installed)")
            return
        try:
            self.start_cluster_b(dep)
        except Exception as exc:
            if want == "on":
                raise
            # --copy auto: cluster B is optional; the demo goes on with cluster A alone.
            say(f"cluster B: skipped, it did not start: {exc}")
            self.stop_cluster_b()

    def start_cluster_b(self, dep) -> None:
        from pyspark_acs.server.local.deploy import LocalDeployment

        dep_b = LocalDeployment(self.tmp / "B" / "servers", data_replicas=1, metadata_replicas=1, capacity="128MiB")
        self.deps["B"] = dep_b
        dep_b.start()
        say(f"cluster B: data cache {dep_b.data_endpoints}, metadata cache {dep_b.metadata_endpoints}")
        topology = {
            "_comment": "written by examples/demo.py: stream 'demo' is produced in A and copied to B",
            "clusters": {
                name: {
                    "root": root,
                    "data_cache": d.data_endpoints,
                    "metadata_cache": d.metadata_endpoints,
                    "copy_daemon": f"127.0.0.1:{free_port()}",
                }
                for name, root, d in (("A", self.root_a, dep), ("B", self.root_b, dep_b))
            },
            "links": [{"from": "A", "to": "B", "cost": 1}],
            "streams": {STREAM: {"source": "A", "destinations": ["B"], "shards": self.args.shards}},
        }
        path = self.tmp / "topology.json"
        path.write_text(json.dumps(topology, indent=2))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        for cluster in ("A", "B"):
            log = open(self.tmp / f"copy-daemon-{cluster}.log", "ab")
            proc = subprocess.Popen(
                [sys.executable, "-m", "pyspark_acs.server.copy.daemon", "--topology", str(path), "--cluster", cluster,
                 "--parent-pid", str(os.getpid()), "--metrics-port", "-1", "--log-level", "WARNING",
                 # The daemons' default poll interval (COPY_POLL_INTERVAL_S, 50 ms): at 10 ms
                 # their polls took 9.2 of the run's 64 core-seconds and the caches' 8.7 (4.1 and
                 # 4.4 at 50 ms), CPU that Spark lacked on 2 cores; cluster B's delay was no lower.
                 "--set", "listing_interval=300ms"],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )
            log.close()
            self.daemons.append(proc)
            line = readline_within(proc, self.remaining(30.0))
            if " listening on " not in line:
                tail = (self.tmp / f"copy-daemon-{cluster}.log").read_text(errors="replace").strip().splitlines()[-5:]
                raise DemoError(f"copy daemon of cluster {cluster} did not start (exit {proc.poll()}): "
                                + " | ".join(tail))
            say(f"cluster {cluster}: {line}")
        say("copy tree of stream 'demo': A -> B")

    def stop_cluster_b(self) -> None:
        for proc in self.daemons:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.daemons:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.daemons.clear()
        dep_b = self.deps.pop("B", None)
        if dep_b is not None:
            dep_b.stop()

    def start_spark(self) -> None:
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession

        say("starting Spark (local[2])")
        self.spark = (
            SparkSession.builder.master("local[2]")
            .appName("pyspark_acs-demo")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.python.worker.reuse", "true")
            .config("spark.sql.streaming.stopTimeout", "30s")
            .config("spark.driver.extraJavaOptions", DEMO_JAVA_OPTIONS)
            .getOrCreate()
        )
        self.spark.sparkContext.setLogLevel("ERROR")
        say(f"Spark {self.spark.version} ready")

    def cache_options(self) -> Dict[str, str]:
        dep = self.deps["A"]
        return {"root": self.root_a, "stream": STREAM, "dataCache": dep.data_endpoints, "metadataCache": dep.metadata_endpoints}

    def warm_up(self) -> None:
        """Start Spark's Python workers (and import pyspark_acs in them) with a small batch write
        and read of a separate stream, so the measured queries do not pay for it."""
        from pyspark.sql import functions as F

        opts = {"root": str(self.tmp / "A" / "warmup-store"), "stream": "warmup"}
        df = self.spark.range(0, 1000, numPartitions=2).select(F.col("id").cast("string").cast("binary").alias("value"))
        df.write.format("acs").options(**opts).option("shards", 2).mode("append").save()
        got = self.spark.read.format("acs").options(**opts).load().count()
        if got != 1000:
            raise DemoError(f"warm-up: wrote 1000 messages with a batch write, read back {got}")
        say("warm-up: batch write + read of 1000 messages done; Python workers are running")

    def start_source(self) -> None:
        from pyspark_acs.storage.store import open_store

        # The stream must exist before a source query starts; the sink would create it too.
        open_store(self.root_a).create_stream(STREAM, self.args.shards)
        reader = self.spark.readStream.format("acs").options(**self.cache_options()).option("startingOffsets", "earliest")
        query = (
            reader.load()
            .writeStream.queryName("acs_source")
            .foreachBatch(self.collector)
            .option("checkpointLocation", str(self.tmp / "checkpoints" / "source"))
            .trigger(processingTime="0 seconds")
            .start()
        )
        self.queries.append(query)
        say("source query: spark.readStream.format('acs') -> foreachBatch, processingTime='0 seconds'")
        # The first micro-batch starts the query's planner process; wait for it.
        while query.lastProgress is None:
            self.check_queries()
            if time.monotonic() > self.deadline:
                raise DemoError("the source query did not finish its first micro-batch in time")
            time.sleep(0.2)
        say("source query: first (empty) micro-batch done")

    def start_sink(self) -> None:
        a = self.args
        rate = (
            self.spark.readStream.format("rate")
            .option("rowsPerSecond", a.rate)
            .option("numPartitions", 1)  # one task per batch: row order = value order in every shard
            .load()
            .where(f"value < {a.messages}")
        )
        query = (
            message_columns(rate, a.value_bytes)
            .writeStream.queryName("acs_sink").format("acs")
            .options(**self.cache_options())
            .option("shards", a.shards)
            .option("checkpointLocation", str(self.tmp / "checkpoints" / "sink"))
            .trigger(processingTime="0 seconds")
            .start()
        )
        self.queries.append(query)
        say(f"sink query: rate source ({a.rate} rows/s, {a.messages} rows of {a.value_bytes} B) -> "
            f"writeStream.format('acs'), {a.shards} shards")

    def check_queries(self) -> None:
        for q in self.queries:
            exc = q.exception()
            if exc is not None:
                raise DemoError(f"query {q.name or q.id} failed: {exc}")
            if not q.isActive:
                raise DemoError(f"query {q.name or q.id} stopped unexpectedly")
        if self.b_reader is not None and self.b_reader.error is not None:
            raise DemoError(f"cluster B reader failed: {self.b_reader.error!r}")

    # -- the flow --

    def flow(self) -> None:
        n = self.args.messages
        sink = self.queries[-1]
        last_print = 0.0
        while True:
            self.check_queries()
            now = time.monotonic()
            rows = self.collector.rows
            b_rows = len(self.b_reader.rows) if self.b_reader else None
            done = rows >= n and (b_rows is None or b_rows >= n)
            if now - last_print >= 3.0 or done:
                last_print = now
                progress = sink.lastProgress
                sink_batch = progress["batchId"] if progress else "-"
                recent = self.collector.delays_ms()[-500:]
                delay = f", recent delay p50 {percentile(recent, 50):.0f} ms" if recent else ""
                extra = f", cluster B {b_rows}/{n}" if b_rows is not None else ""
                say(f"progress: sink batch {sink_batch}, source got {rows}/{n} rows in "
                    f"{self.collector.batches} batches{delay}{extra}")
            if done:
                return
            if rows > n:
                raise Mismatch(f"the source query got {rows} rows, more than the {n} written (duplicates)")
            if now > self.deadline:
                raise DemoError(
                    f"timed out after {self.args.timeout:.0f} s: the source query got {rows} of {n} rows"
                    + (f", cluster B {b_rows} of {n}" if b_rows is not None else "")
                )
            time.sleep(0.2)

    # -- checks --

    def verify_stream(self) -> Dict[Tuple[int, str, int], Tuple[bytes, bytes, int]]:
        """Byte-exact check of the streamed rows; returns them by (shard, file, position)."""
        n, vb, shards = self.args.messages, self.args.value_bytes, self.args.shards
        rows: Dict[Tuple[int, str, int], Tuple[bytes, bytes, int]] = {}
        seen = set()
        for _, table in self.collector.tables:
            cols = table.to_pydict()
            ts_us = table.column("timestamp").cast("int64").to_pylist()
            for shard, pos, f, ts, key, value in zip(cols["shard"], cols["position"], cols["file"], ts_us,
                                                     cols["key"], cols["value"]):
                where = f"shard {shard} file {f} position {pos}"
                if (shard, f, pos) in rows:
                    raise Mismatch(f"{where} arrived twice")
                try:
                    v = int(value[:12])
                except ValueError:
                    raise Mismatch(f"{where}: value {value[:40]!r}... is not a demo message") from None
                if value != expected_value(v, vb):
                    raise Mismatch(f"message {v} ({where}): value differs from what was written: "
                                   f"got {value[:90]!r}..., expected {expected_value(v, vb)[:90]!r}...")
                if key != expected_key(v):
                    raise Mismatch(f"message {v} ({where}): key {key!r}, expected {expected_key(v)!r}")
                if shard != zlib.crc32(key) % shards:
                    raise Mismatch(f"message {v}: in shard {shard}, but its key hashes to shard {zlib.crc32(key) % shards}")
                if v in seen:
                    raise Mismatch(f"message {v} arrived twice")
                seen.add(v)
                rows[(shard, f, pos)] = (key, value, ts)
        everything = set(range(n))
        if seen != everything:
            lost = sorted(everything - seen)
            raise Mismatch(f"{len(lost)} messages missing (first: {lost[:10]}), {len(seen - everything)} unexpected")
        # Order: per shard, (file, position) order = increasing message numbers (one writer task per batch),
        # and positions 0, 1, 2, ... in every file.
        by_shard: Dict[int, List[Tuple[str, int]]] = {}
        for shard, f, pos in sorted(rows):
            by_shard.setdefault(shard, []).append((f, pos))
        for shard, places in by_shard.items():
            numbers = [int(rows[(shard, f, p)][1][:12]) for f, p in places]
            if numbers != sorted(numbers):
                raise Mismatch(f"shard {shard}: messages out of order: {numbers[:20]}...")
            per_file: Dict[str, List[int]] = {}
            for f, p in places:
                per_file.setdefault(f, []).append(p)
            for f, ps in per_file.items():
                if ps != list(range(len(ps))):
                    raise Mismatch(f"shard {shard} file {f}: positions are not 0..{len(ps) - 1}")
        return rows

    def verify_batch_read(self, rows: Dict[Tuple[int, str, int], Tuple[bytes, bytes, int]]) -> None:
        # Read from the durable store alone (no cache options): an independent path to the
        # bytes. (With the caches, a batch read can stop short of the end where the data cache
        # misses chunks - reported as a library bug - while a stream catches up next batch.)
        table = (
            self.spark.read.format("acs").option("root", self.root_a).option("stream", STREAM)
            .load()
            .select("shard", "position", "file", "timestamp", "key", "value")
            .toArrow()
        )
        cols = table.to_pydict()
        ts_us = table.column("timestamp").cast("int64").to_pylist()
        batch = {(s, f, p): (k, v, t) for s, p, f, t, k, v in zip(cols["shard"], cols["position"], cols["file"], ts_us,
                                                                   cols["key"], cols["value"])}
        if len(batch) != table.num_rows:
            raise Mismatch("the batch read returned a (shard, file, position) twice")
        if batch != rows:
            diff = sorted(set(batch) ^ set(rows))[:5] or [k for k in sorted(rows) if batch.get(k) != rows[k]][:5]
            raise Mismatch(f"the batch read ({len(batch)} rows) differs from the streamed rows ({len(rows)}); e.g. at {diff}")

    def verify_cluster_b(self, rows: Dict[Tuple[int, str, int], Tuple[bytes, bytes, int]]) -> None:
        got = self.b_reader.rows
        want = {k: (v[0], v[1]) for k, v in rows.items()}
        if got != want:
            diff = sorted(set(got) ^ set(want))[:5] or [k for k in sorted(want) if got.get(k) != want[k]][:5]
            raise Mismatch(f"cluster B ({len(got)} messages) differs from cluster A ({len(want)}); e.g. at {diff}")

    # -- main --

    def run(self) -> None:
        self.start_clusters()
        self.start_spark()
        self.warm_up()
        self.start_source()
        if "B" in self.deps:
            dep_b = self.deps["B"]
            self.b_reader = ClusterBReader(self.root_b, dep_b.data_endpoints, dep_b.metadata_endpoints, self.args.shards)
            self.b_reader.start()
            say("cluster B: a Consumer follows the copied stream")
        self.start_sink()
        from pyspark_acs.server.local.cpu import cpu_measurable, cpu_seconds

        parts = self.cpu_parts()

        jvm = parts["Spark (JVM, Python workers)"]

        def cpu_now() -> Dict[str, float]:
            now = {k: cpu_seconds(v) for k, v in parts.items()}
            now["of which the JVM"] = cpu_seconds(jvm, descendants=False)
            own = os.times()  # this process alone: its children are the parts above
            now["this process (driver, cluster B's Consumer)"] = own.user + own.system
            return now

        cpu_before, wall_before = cpu_now(), time.monotonic()
        self.flow()
        cpu_used = {k: v - cpu_before[k] for k, v in cpu_now().items()}
        wall = time.monotonic() - wall_before
        # The rate source never ends, so stop() interrupts the sink's micro-batch past the last
        # message (its rows are filtered out); Spark logs that write's abort with stack traces
        # at ERROR, also after stop() returned (the executor kills the task on its own thread).
        # Nothing of ours is in it: Spark's log stays off from here on. What follows (the batch
        # read that verifies the store) reports a failure as the exception it raises.
        self.spark.sparkContext.setLogLevel("OFF")
        for q in reversed(self.queries):
            q.stop()
        for q in self.queries:  # one that failed after the last look, before the stop
            if q.exception() is not None:
                raise DemoError(f"query {q.name or q.id} failed: {q.exception()}")
        self.queries.clear()
        if self.b_reader is not None:
            self.b_reader.stop_event.set()
            self.b_reader.join(10)
        say("both queries stopped; verifying")
        rows = self.verify_stream()
        n = self.args.messages
        say(f"byte-exact: {n}/{n} messages match what the sink wrote (keys, values, one copy each, "
            f"in order per shard, right shard)")
        self.verify_batch_read(rows)
        say(f"byte-exact: a batch read of the durable store equals the {n} streamed rows")
        if self.b_reader is not None:
            self.verify_cluster_b(rows)
            say(f"byte-exact: cluster B holds the same {n} messages, copied by the copy daemons")
        delays = self.collector.delays_ms()
        say(f"delivery delay (source row arrival - message timestamp), all {len(delays)} messages: "
            f"p50 {percentile(delays, 50):.0f} ms  p99 {percentile(delays, 99):.0f} ms  max {max(delays):.0f} ms")
        warm = self.collector.delays_ms(after_us=self.collector.first_stamp_us() + WARMUP_S * 1e6)
        if warm:
            say(f"delivery delay, {len(warm)} messages written after the first {WARMUP_S:.0f} s (steady state): "
                f"p50 {percentile(warm, 50):.0f} ms  p99 {percentile(warm, 99):.0f} ms")
        if self.b_reader is not None and self.b_reader.delays:
            d = self.b_reader.delays
            say(f"delivery delay in cluster B (Consumer arrival - message timestamp): p50 {percentile(d, 50):.0f} ms  "
                f"p99 {percentile(d, 99):.0f} ms")
        if cpu_measurable():
            say(f"CPU while the queries ran ({wall:.0f} s, {os.cpu_count()} cores: {wall * (os.cpu_count() or 1):.0f} "
                f"core-seconds): " + ", ".join(f"{k} {v:.1f} s" for k, v in cpu_used.items()))
        if self.args.plot != "none":
            series = {"cluster A (Spark source query)": self.collector.points()}
            if self.b_reader is not None:
                series["cluster B (copy daemons, Consumer)"] = list(self.b_reader.points)
            say(write_plot(self.args.plot, series))

    def cpu_parts(self) -> Dict[str, List[int]]:
        """The processes of each part of the demo, by name (their descendants count with them)."""
        parts: Dict[str, List[int]] = {
            "Spark (JVM, Python workers)": [self.spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()],
        }
        for name, dep in self.deps.items():
            parts[f"cluster {name} cache servers"] = [
                s.pid for role in ("data", "metadata") for s in dep.servers.get(role, []) if s.pid]
        if self.daemons:
            parts["copy daemons"] = [p.pid for p in self.daemons]
        return parts

    def close(self) -> None:
        """Stop everything that was started; never raises."""
        for q in self.queries:
            try:
                q.stop()
            except Exception as exc:
                say(f"warning: stopping query {q.name}: {exc}")
        if self.b_reader is not None:
            self.b_reader.stop_event.set()
        if self.spark is not None:
            try:
                self.spark.stop()
            except Exception as exc:
                say(f"warning: stopping Spark: {exc}")
        try:
            self.stop_cluster_b()
        except Exception as exc:
            say(f"warning: stopping cluster B: {exc}")
        for dep in self.deps.values():
            try:
                dep.stop()
            except Exception as exc:
                say(f"warning: stopping cache servers: {exc}")
        if not self.args.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            say(f"kept {self.tmp}")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=30_000, help="messages the sink query writes (default 30000)")
    p.add_argument("--rate", type=int, default=1_000, help="rows per second of the rate source (default 1000)")
    p.add_argument("--value-bytes", type=int, default=256, help=f"value size, >= {VALUE_HEAD} (default 256)")
    p.add_argument("--shards", type=int, default=4, help="shards of the demo stream (default 4)")
    p.add_argument("--copy", choices=("auto", "on", "off"), default="auto",
                   help="run cluster B fed by the copy daemon: auto (default) = when it is installed and starts, "
                   "on = required, off = never")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds (default 300)")
    p.add_argument("--workdir", help="folder for stores, logs and checkpoints (default: a new temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--plot", default=os.path.join(tempfile.gettempdir(), "acs-demo-delay.png"), metavar="PNG",
                   help="write a plot of delivery delay over time per cluster here, or none "
                        "(default: acs-demo-delay.png in the temp folder; needs matplotlib)")
    args = p.parse_args(argv)
    if args.value_bytes < VALUE_HEAD:
        p.error(f"--value-bytes must be >= {VALUE_HEAD}")
    if args.messages < 1 or args.rate < 1 or args.shards < 1:
        p.error("--messages, --rate and --shards must be >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    demo = Demo(args)
    status = 0
    try:
        demo.run()
        say("demo OK")
    except Mismatch as exc:
        say(f"MISMATCH: {exc}")
        status = 1
    except KeyboardInterrupt as exc:
        say(f"interrupted ({exc or 'Ctrl-C'}); stopping")
        status = 130
    except Exception as exc:  # noqa: BLE001 - report any failure in one line, then clean up
        say(f"FAILED: {type(exc).__name__}: {exc}")
        status = 2
    finally:
        say("stopping queries, Spark, copy daemons and cache servers")
        demo.close()
        say("stopped")
    return status


if __name__ == "__main__":
    sys.exit(main())
