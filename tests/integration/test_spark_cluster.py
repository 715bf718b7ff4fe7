"""The connector on a real Spark standalone cluster, launched with ``spark-submit``.

A Spark standalone master and a worker are started from the pyspark package itself
(``spark-class org.apache.spark.deploy.master.Master`` / ``...deploy.worker.Worker`` on
loopback); the worker runs two one-core executors, so every executor is a JVM of its own,
apart from the driver. Two acs clusters: A (cache servers as plain processes) and B, whose
data-cache server and copy daemon are launched with ``spark-submit jars-free/...`` against that
master (one launch of each launcher; B's metadata cache and A's copy daemon are the same
programs run as plain processes). A producer writes stream ``orders`` in A; the copy daemons
tail-copy it to B; a streaming job submitted with ``spark-submit --master spark://...`` reads it
in B with ``format("acs")`` through B's caches (``minPartitions`` > shards, so tasks split
shards) and writes it with the sink to stream ``echo`` in B. Every shard of ``echo`` must hold
exactly the messages of the same shard of ``orders`` in A -- values, keys and timestamps, in
order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

import pytest

import pyspark

from tests.helpers import ROOT, free_port
from pyspark_acs import Producer
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.store import open_store

pytestmark = [pytest.mark.slow, pytest.mark.spark]

SPARK_HOME = os.path.dirname(pyspark.__file__)
SHARDS = 2
FIRST, SECOND = 300, 300  # messages before the job starts, and while it runs
#: How long the master and workers, a banner line, or the job may take on a busy 2-core machine.
START_S = 120.0
JOB_S = 300.0

JOB = textwrap.dedent('''
    """Submitted with spark-submit: acs source (cluster B, through its caches) -> acs sink."""
    import json, sys, time
    from pyspark.sql import SparkSession

    cfg = json.loads(sys.argv[1])
    spark = SparkSession.builder.appName("acs-cluster-round-trip").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    deadline = time.time() + 120
    while len(tracker.getExecutorInfos()) < 3 and time.time() < deadline:  # the driver + 2 executors
        time.sleep(0.5)

    def jvm(_):
        # the JVM this Python worker runs under: the nearest "java" ancestor process
        import os
        pid = os.getpid()
        while pid > 1:
            with open(f"/proc/{pid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
            if head.split("(", 1)[1] == "java":
                return pid
            pid = int(tail.split()[1])
        return None

    import os
    executors = sorted(set(spark.sparkContext.parallelize(range(8), 8).map(jvm).collect()))
    driver = jvm(None)
    caches = {"dataCache": cfg["data"], "metadataCache": cfg["metadata"]}
    source = (spark.readStream.format("acs").option("root", cfg["root"]).option("stream", "orders")
              .option("startingOffsets", "earliest").option("minPartitions", "4").options(**caches).load())
    writer = (source.writeStream.format("acs").option("root", cfg["root"]).option("stream", "echo")
              .option("shards", str(cfg["shards"])).options(**caches)
              .option("checkpointLocation", cfg["checkpoint"]).trigger(processingTime="200 milliseconds"))
    # Started again when Spark's Python planner did not connect back within its fixed 10 s (a
    # loaded machine); the job runs from the checkout, so the suite's own helper is at hand.
    from tests.helpers import start_query
    query = start_query(writer)
    deadline = time.time() + cfg["timeout"]
    rows = 0
    while rows < cfg["expected"] and time.time() < deadline and query.exception() is None:
        time.sleep(0.5)
        rows = sum(p["numInputRows"] for p in query.recentProgress)
    error = query.exception()
    query.stop()
    print("RESULT " + json.dumps({"rows": rows, "executors": executors, "driver": driver,
                                  "error": str(error) if error else None}),
          flush=True)
    spark.stop()
''')


def _env(tmp: Path) -> Dict[str, str]:
    conf = tmp / "conf"
    conf.mkdir(exist_ok=True)
    return dict(
        os.environ,
        SPARK_HOME=SPARK_HOME,
        SPARK_CONF_DIR=str(conf),  # nothing from the machine's Spark configuration
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(tmp / "logs"),
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
    )


class Processes:
    """The processes this test started (each with its log file), stopped in reverse order."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = _env(tmp)
        self.procs: List[subprocess.Popen] = []

    def start(self, name: str, cmd: List[str], stdout=None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen(cmd, stdout=stdout or log, stderr=log, env=self.env, cwd=ROOT)
        log.close()
        proc.name = name
        self.procs.append(proc)
        return proc

    def spark_submit(self, name: str, master: str, script: str, *args: str, stdout=None) -> subprocess.Popen:
        return self.start(name, [os.path.join(SPARK_HOME, "bin", "spark-submit"), "--master", master,
                                 "--conf", f"spark.pyspark.python={sys.executable}",
                                 "--conf", "spark.executor.memory=512m", "--conf", "spark.executor.cores=1",
                                 "--conf", "spark.ui.enabled=false",
                                 script, *args], stdout=stdout)

    def banner(self, proc: subprocess.Popen, prefix: str) -> str:
        """Wait for the line starting with ``prefix`` on a process's stdout (other lines skipped)."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode(errors="replace")
            if line.startswith(prefix):
                return line.strip()
            if not line and proc.poll() is not None:
                break
        raise AssertionError(f"{proc.name}: no {prefix!r} line; log:\n{self.log(proc.name)}")

    def log(self, name: str, lines: int = 40) -> str:
        path = self.tmp / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _alive_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as r:
            return int(json.loads(r.read()).get("aliveworkers", 0))
    except OSError:
        return 0
    except ValueError:
        # A master still starting answered /json/ with its HTML page (seen in a full run on a
        # loaded machine): not up yet; the caller's deadline bounds the wait.
        return 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A standalone master and one two-core worker on loopback: ``(master URL, Processes)``.

    One worker, not two: each JVM costs seconds of CPU to start on a 2-core machine, and two
    one-core executors of one worker are two executor JVMs all the same."""
    tmp = tmp_path_factory.mktemp("spark-cluster")
    procs = Processes(tmp)
    port, ui = free_port(), free_port()
    spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
    try:
        procs.start("master", [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)])
        master = f"spark://127.0.0.1:{port}"
        work = tmp / "work"
        work.mkdir()
        procs.start("worker", [spark_class, "org.apache.spark.deploy.worker.Worker", master, "--host",
                               "127.0.0.1", "--cores", "2", "--memory", "1536m", "--webui-port",
                               str(free_port()), "--work-dir", str(work)])
        deadline = time.monotonic() + START_S
        while _alive_workers(ui) < 1:
            dead = [p.name for p in procs.procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, (
                f"standalone cluster did not come up ({dead or 'timeout'}):\n"
                + "\n".join(procs.log(p.name, 15) for p in procs.procs))
            time.sleep(0.5)
        yield master, procs
    finally:
        procs.stop()


def _messages(root: str, stream: str) -> Dict[int, List[tuple]]:
    """Every message of every shard, in order: ``(value, key, timestamp µs)``."""
    out: Dict[int, List[tuple]] = {s: [] for s in range(SHARDS)}
    with Consumer(root, stream, start="earliest", data_cache="none", metadata_cache="none") as c:
        for batch in c.batches(timeout=1.0):
            ts = batch.column("timestamp").cast("int64").to_pylist()
            for shard, value, key, t in zip(batch.column("shard").to_pylist(), batch.column("value").to_pylist(),
                                            batch.column("key").to_pylist(), ts):
                out[shard].append((value, key, t))
    return out


@pytest.mark.timeout(900)
def test_round_trip_on_a_standalone_cluster(cluster, tmp_path):
    master, procs = cluster
    roots = {c: str(tmp_path / f"root-{c}") for c in "AB"}
    caches_a = LocalDeployment(tmp_path / "caches-A", data_replicas=1, metadata_replicas=1, capacity="64MiB").start()
    try:
        # cluster B's cache servers and both clusters' copy daemons, all four at once on ports
        # picked beforehand: B's data cache and copy daemon with spark-submit jars-free/... on
        # the Spark cluster, the other two with the same launchers under plain Python (each
        # spark-submit is a JVM start: seconds of CPU on a 2-core machine)
        endpoints = {role: f"127.0.0.1:{free_port()}" for role in ("data", "metadata")}
        topology = tmp_path / "topology.json"
        daemon_ports = {c: free_port() for c in "AB"}
        topology.write_text(json.dumps({
            "clusters": {
                "A": {"root": roots["A"], "data_cache": caches_a.data_endpoints,
                      "metadata_cache": caches_a.metadata_endpoints, "copy_daemon": f"127.0.0.1:{daemon_ports['A']}"},
                "B": {"root": roots["B"], "data_cache": endpoints["data"], "metadata_cache": endpoints["metadata"],
                      "copy_daemon": f"127.0.0.1:{daemon_ports['B']}"},
            },
            "links": [{"from": "A", "to": "B", "cost": 1}],
            "streams": {"orders": {"source": "A", "destinations": ["B"]}},
        }))

        def launch(name: str, submitted: bool, script: str, *args: str) -> subprocess.Popen:
            if submitted:
                return procs.spark_submit(name, master, script, *args, stdout=subprocess.PIPE)
            return procs.start(name, [sys.executable, script, *args], stdout=subprocess.PIPE)

        launched = []
        for role, submitted in (("data", True), ("metadata", False)):
            port = endpoints[role].rsplit(":", 1)[1]
            launched.append((launch(
                f"cache-B-{role}", submitted, "jars-free/cache_server.py", "--role", role, "--host", "127.0.0.1",
                "--port", port, "--capacity", "64MiB", "--metrics-port", "-1"),
                f"acs-cache-server role={role} listening on {endpoints[role]}"))
        for c, submitted in (("A", False), ("B", True)):
            launched.append((launch(
                f"copy-{c}", submitted, "jars-free/copy_daemon.py", "--topology", str(topology), "--cluster", c,
                "--metrics-port", "-1"), f"acs-copy-daemon cluster={c} listening on"))
        for proc, banner in launched:
            procs.banner(proc, banner)

        producer = Producer(roots["A"], "orders", shards=SHARDS, data_cache=caches_a.data_endpoints,
                            metadata_cache=caches_a.metadata_endpoints, roll_bytes=64 * 1024)
        try:
            for i in range(FIRST):
                producer.send(b"m%05d-" % i + bytes(range(256)) * 2, key=b"k%d" % (i % 7), shard=i % SHARDS)
            producer.flush()
            deadline = time.monotonic() + START_S
            store_b = open_store(roots["B"])
            while store_b.stream_shards("orders") is None:
                assert time.monotonic() < deadline, procs.log("copy-A") + procs.log("copy-B")
                time.sleep(0.2)
            job_file = tmp_path / "round_trip_job.py"
            job_file.write_text(JOB)
            cfg = {"root": roots["B"], "data": endpoints["data"], "metadata": endpoints["metadata"],
                   "shards": SHARDS, "checkpoint": str(tmp_path / "checkpoint"), "expected": FIRST + SECOND,
                   "timeout": JOB_S}
            job = procs.spark_submit("job", master, str(job_file), json.dumps(cfg), stdout=subprocess.PIPE)
            # the rest is produced while the job runs: it tails the copy through B's caches
            for i in range(FIRST, FIRST + SECOND):
                producer.send(b"m%05d-" % i + bytes(range(256)) * 2, key=b"k%d" % (i % 7), shard=i % SHARDS)
                if i % 50 == 0:
                    producer.flush()
                    time.sleep(0.2)
            producer.flush()
        finally:
            producer.close()
        result_line = procs.banner(job, "RESULT ")
        job.wait(timeout=120)
        result = json.loads(result_line[len("RESULT "):])
        assert result["error"] is None, result["error"] + "\n" + procs.log("job")
        assert result["rows"] == FIRST + SECOND, (result, procs.log("job"))
        # tasks ran in two executor JVMs, neither of them the driver's
        assert len(result["executors"]) == 2 and result["driver"] not in result["executors"], result
        assert job.returncode == 0, procs.log("job")

        sent = _messages(roots["A"], "orders")
        echoed = _messages(roots["B"], "echo")
        assert sum(len(v) for v in sent.values()) == FIRST + SECOND
        for shard in range(SHARDS):
            assert echoed[shard] == sent[shard], f"shard {shard} differs"
    finally:
        caches_a.stop()
