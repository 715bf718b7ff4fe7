"""Copy daemon end to end: real cache server processes per cluster (LocalDeployment), real
``acs-copy-daemon`` processes, a Producer in the source cluster, consumers downstream.

Clusters are tmp folders plus loopback ports. The cache deployments are shared by the whole
module (each test uses its own stream); daemons are started per test. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from pyspark_acs.read.consumer import Consumer
from pyspark_acs.format.names import shard_dir
from pyspark_acs.write.producer import Producer
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.store import DurableStore

from conftest import ROOT, free_port

pytestmark = pytest.mark.slow

CLUSTERS = ("A", "B", "C")
#: Upper bound of every wait for copies to arrive.
ARRIVE_S = 30.0
DAEMON_SETTINGS = [
    "poll_interval=20ms", "listing_interval=300ms", "health_interval=300ms", "unhealthy_after=1.5s",
    "lease_seconds=1.5s", "retry=200ms",
]


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """One data and one metadata cache server per cluster, for the whole module."""
    base = tmp_path_factory.mktemp("caches")
    deps = {}
    try:
        for name in CLUSTERS:
            deps[name] = LocalDeployment(base / name, data_replicas=1, metadata_replicas=1, capacity="64MiB").start()
        yield deps
    finally:
        for dep in deps.values():
            dep.stop()


class Env:
    """Clusters of one test: roots, topology file, daemons."""

    def __init__(self, tmp: Path, caches: Dict[str, LocalDeployment], links, stream: str, dests, tree=None):
        self.tmp = tmp
        self.caches = caches
        self.stream = stream
        self.roots = {c: str(tmp / f"root-{c}") for c in CLUSTERS}
        self.ports = {c: free_port() for c in CLUSTERS}
        self.links = links
        self.dests = list(dests)
        self.tree = tree
        self.healthy = {c: True for c in CLUSTERS}
        self.topology = tmp / "topology.json"
        self.daemons: Dict[str, List[subprocess.Popen]] = {}
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.write_topology()

    def write_topology(self) -> None:
        clusters = {}
        for c in CLUSTERS:
            clusters[c] = {
                "root": self.roots[c],
                "data_cache": self.caches[c].data_endpoints,
                "metadata_cache": self.caches[c].metadata_endpoints,
                "copy_daemon": f"127.0.0.1:{self.ports[c]}",
                "healthy": self.healthy[c],
            }
        stream = {"source": "A", "destinations": self.dests}
        if self.tree:
            stream["tree"] = self.tree
        data = {
            "clusters": clusters,
            "links": [{"from": a, "to": b, "cost": cost} for a, b, cost in self.links],
            "streams": {self.stream: stream},
        }
        tmp = self.topology.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.topology)
        # Make sure the mtime moves even within one timestamp tick.
        st = os.stat(self.topology)
        os.utime(self.topology, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))

    def start_daemon(self, cluster: str, *extra: str) -> subprocess.Popen:
        log = open(self.tmp / f"daemon-{cluster}-{len(self.daemons.get(cluster, []))}.log", "ab")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "pyspark_acs.server.copy.daemon", "--topology", str(self.topology),
               "--cluster", cluster, "--parent-pid", str(os.getpid()), "--metrics-port", "0"]
        for s in DAEMON_SETTINGS:
            cmd += ["--set", s]
        cmd += list(extra)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env)
        line = _readline(proc, 20.0)
        assert line.startswith(f"acs-copy-daemon cluster={cluster} listening on"), line
        proc.banner = line
        self.daemons.setdefault(cluster, []).append(proc)
        return proc

    def kill_daemon(self, cluster: str, sig=signal.SIGKILL) -> None:
        for proc in self.daemons.pop(cluster, []):
            proc.send_signal(sig)
            proc.wait(timeout=10)

    def stop(self) -> None:
        for c in list(self.daemons):
            self.kill_daemon(c, signal.SIGTERM)

    def producer(self, **kw) -> Producer:
        kw.setdefault("roll_bytes", 20_000)
        return Producer(self.roots["A"], self.stream, shards=2, data_cache=self.caches["A"].data_endpoints,
                        metadata_cache=self.caches["A"].metadata_endpoints, max_batch_delay=0.001, **kw)

    def files(self, cluster: str) -> Dict[str, bytes]:
        store = DurableStore(self.roots[cluster])
        out = {}
        shards = store.stream_shards(self.stream) or 0
        for shard in range(shards):
            for f in store.list_files(self.stream, shard):
                rel = f"{shard_dir(self.stream, shard)}/{f}"
                out[rel] = store.read(rel, 0, store.length(rel))
        store.close()
        return out

    def wait_same(self, cluster: str, timeout: float = ARRIVE_S) -> None:
        """Wait until every file of A is byte-exact in ``cluster``."""
        deadline = time.monotonic() + timeout
        while True:
            src, dst = self.files("A"), self.files(cluster)
            if src and src == dst:
                return
            if time.monotonic() > deadline:
                diff = {k: (len(v), len(dst.get(k, b""))) for k, v in src.items() if dst.get(k) != v}
                extra = sorted(set(dst) - set(src))
                pytest.fail(f"{cluster} differs from A after {timeout} s: {diff} extra={extra}\n{self.logs()}")
            time.sleep(0.1)

    def check_prefixes(self, cluster: str) -> None:
        """Every file in ``cluster`` is a prefix of A's (no gap, no duplicate, no foreign bytes)."""
        src = self.files("A")
        for rel, data in self.files(cluster).items():
            assert rel in src, rel
            assert src[rel][: len(data)] == data, f"{cluster}:{rel} is not a prefix of A's file"

    def logs(self) -> str:
        out = []
        for p in sorted(self.tmp.glob("daemon-*.log")):
            text = p.read_text(errors="replace").splitlines()
            out.append(f"--- {p.name}\n" + "\n".join(text[-30:]))
        return "\n".join(out)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    result: List[str] = []
    t = threading.Thread(target=lambda: result.append(proc.stdout.readline().decode()), daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        proc.kill()
        raise AssertionError(f"daemon did not start within {timeout} s")
    return result[0].strip()


CHAIN = [("A", "B", 1), ("B", "C", 1), ("A", "C", 5)]
STAR = [("A", "B", 1), ("A", "C", 1), ("B", "C", 5)]

_counter = [0]


@pytest.fixture
def make_env(tmp_path, caches):
    envs = []

    def make(links=CHAIN, dests=("B", "C"), tree=None) -> Env:
        _counter[0] += 1
        env = Env(tmp_path / f"env{_counter[0]}", caches, links, f"s{os.getpid()}x{_counter[0]}", dests, tree)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.stop()


def produce(p: Producer, start: int, n: int, size: int = 300, pause: float = 0.0) -> None:
    for i in range(start, start + n):
        p.send(f"m{i:06d}-".encode() + b"x" * size, key=str(i % 7).encode())
        if pause:
            time.sleep(pause)
    p.flush(timeout=20)


def consume_all(env: Env, cluster: str, expected: int, timeout: float = ARRIVE_S) -> List[bytes]:
    c = Consumer(env.roots[cluster], env.stream, data_cache=env.caches[cluster].data_endpoints,
                 metadata_cache=env.caches[cluster].metadata_endpoints)
    values: List[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while len(values) < expected and time.monotonic() < deadline:
            for batch in c.poll():
                values.extend(batch.column("value").to_pylist())
            time.sleep(0.01)
    finally:
        c.close()
    return values


def check_order(values: List[bytes], n: int) -> None:
    got = sorted(int(v[1:7]) for v in values)
    assert got == list(range(n)), f"{len(values)} messages, expected {n} distinct"
    # Within a shard (same key -> same shard), order is kept.
    by_key: Dict[int, List[int]] = {}
    for v in values:
        i = int(v[1:7])
        by_key.setdefault(i % 7, []).append(i)
    for seq in by_key.values():
        assert seq == sorted(seq)


# -- tests ---------------------------------------------------------------------------------------


def test_chain_copy_durable_and_cache(make_env):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    # Small blocks: the files roll over at 20 kB even when a loaded machine lets the
    # producer batch all pending messages of a shard into one block.
    with env.producer(max_block_bytes=4096) as p:
        produce(p, 0, 300, pause=0.001)
    env.wait_same("B")
    env.wait_same("C")
    values = consume_all(env, "C", 300)
    check_order(values, 300)
    assert len(env.files("C")) > 2  # files rolled over on the way

    from pyspark_acs.server.copy.status import copy_status, format_status
    from pyspark_acs.server.copy.topology import load_topology

    # The cache copy publishes its length independently of the durable copy: wait for both.
    deadline = time.monotonic() + 30
    while True:
        rows = copy_status(load_topology(env.topology), env.stream)
        settled = all(r["bytes_behind"] == 0 and r["cache_length"] == r["durable_length"] for r in rows)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r["shard"], r["cluster"], r["parent"]) for r in rows] == [
        (s, c, p) for s in (0, 1) for c, p in (("A", None), ("B", "A"), ("C", "B"))
    ]
    for r in rows:
        assert r["bytes_behind"] == 0 and r["cache_length"] == r["durable_length"], r
    # Delay records are best effort (a metric): at least one per downstream cluster.
    for c in ("B", "C"):
        assert any(r["cache_delay_s"] is not None for r in rows if r["cluster"] == c), format_status(rows)
    assert any(r["hop_delay_s"] is not None for r in rows if r["cluster"] == "C"), format_status(rows)
    assert "hop" in format_status(rows)
    acs = os.path.join(os.path.dirname(sys.executable), "acs")
    out = subprocess.run([acs, "copy-status", "--topology", str(env.topology), "--stream", env.stream],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.count("\n") == 7, out.stderr
    out = subprocess.run([acs, "tree", "--topology", str(env.topology)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "└── C" in out.stdout, out.stderr


def test_cache_copy_after_complete_durable_copy_publishes_cache_length(make_env):
    """Regression: the durable copy of a file was complete in the destination before its
    cache operation said hello (a loaded machine delays one of the two operations). The cache
    copy started at the durable length and the reader ended at once, with no delta to
    publish the cache length: the destination's metadata cache never had one. The writer now
    publishes the start position (and writes the partial chunk there) at the hello."""
    import datetime as dt

    from pyspark_acs.format.block import encode_block, encode_seal
    from pyspark_acs.cache.chunks import CHUNK_SIZE, ChunkReader
    from pyspark_acs.format.names import file_name
    from pyspark_acs.server.copy.cluster import ClusterIO
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.writer import CopyServicer
    from pyspark_acs.server.copy.proto import copy_pb2
    from pyspark_acs.server.copy.topology import load_topology

    env = make_env(CHAIN, dests=("B",))
    io = ClusterIO(load_topology(env.topology).cluster("B"), cache_deadline=5.0)
    try:
        name = file_name(dt.datetime.now(dt.timezone.utc), "t1")
        rel = f"{shard_dir(env.stream, 0)}/{name}"
        data = encode_block([b"x" * 100] * 50, first_index=0) + encode_seal(50)
        assert len(data) % CHUNK_SIZE  # ends inside a chunk
        io.store.create_stream(env.stream, 1)
        appender = io.store.open_appender(rel)
        appender.write(data)  # the durable copy is complete
        appender.close()
        servicer = CopyServicer(io, CopyDaemonOptions(lease_seconds=1.5), CopyMetrics("B"))
        hello = copy_pb2.CopyRequest(hello=True, stream=env.stream, shard=0, file=name, storage=copy_pb2.CACHE,
                                     shards=1, operation="t1", source_cluster="A")
        acks = list(servicer.Copy(iter([hello]), None))
        assert [(a.status, a.length) for a in acks] == [(copy_pb2.OK, len(data))]
        uri = io.uri(rel)
        assert io.meta.lengths([uri])[uri][0] == len(data)
        start = len(data) - len(data) % CHUNK_SIZE
        assert ChunkReader(io.data).read(uri, start, len(data)) == [(start, len(data), data[start:])]
        # A second hello (a reconnecting reader) continues from the published length.
        acks = list(servicer.Copy(iter([hello]), None))
        assert [(a.status, a.length) for a in acks] == [(copy_pb2.OK, len(data))]
    finally:
        io.close()


def test_poller_notify_wakes_followers_of_the_file_only():
    """A length this daemon's writer published wakes the next hop's readers of that file at
    once (no poll wait per intermediate hop) and hands them the bytes; lengths only grow;
    other files stay asleep."""
    from pyspark_acs.server.copy.reader import LengthPoller

    poller = LengthPoller(io=None, interval=0.05)  # never started: no poll rounds
    a, b = poller.follow("s/00000/a"), poller.follow("s/00000/b")
    poller.notify("s/00000/a", durable_length=100)
    assert a.is_set() and not b.is_set()
    assert poller.lengths("s/00000/a") == (None, 100)
    a.clear()
    poller.notify("s/00000/a", cache_length=100, durable_length=50)
    assert a.is_set() and poller.lengths("s/00000/a") == (100, 100)
    poller.notify("s/00000/a", cache_length=300, data=(100, b"y" * 200))  # bytes the writer wrote
    assert poller.recent("s/00000/a", 150, 300) == b"y" * 150
    assert poller.recent("s/00000/a", 50, 300) is None and poller.recent("s/00000/a", 100, 301) is None
    poller.notify("s/00000/zzz", cache_length=1)  # not followed: ignored
    assert poller.lengths("s/00000/zzz") == (None, None)
    poller.unfollow("s/00000/a", a)
    poller.notify("s/00000/a", cache_length=400)
    assert poller.lengths("s/00000/a") == (None, None) and poller.recent("s/00000/a", 150, 300) is None


class Background:
    """Produce ``n`` messages in a thread, paced, so faults hit mid-stream."""

    def __init__(self, p: Producer, start: int, n: int, pause: float = 0.004) -> None:
        self.error: Optional[BaseException] = None

        def run() -> None:
            try:
                produce(p, start, n, pause=pause)
            except BaseException as exc:  # reported by join()
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 60.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "producer thread did not finish"
        if self.error:
            raise self.error


def metric(proc: subprocess.Popen, name: str, **labels: str) -> float:
    import urllib.request

    url = proc.banner.split(" metrics=", 1)[1]
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"acs_copy_{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_tree_copy_with_live_consumer_in_c(make_env):
    env = make_env(STAR)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer() as p:
        produce(p, 0, 50)
        env.wait_same("C")  # the stream exists in C before the consumer starts
        bg = Background(p, 50, 250, pause=0.002)
        values = consume_all(env, "C", 300)
        bg.join()
    check_order(values, 300)
    env.wait_same("B")
    env.wait_same("C")
    assert metric(env.daemons["C"][0], "bytes_total", source="A", target="C", storage="cache") > 0


def test_kill_b_daemon_mid_stream_then_restart(make_env):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer() as p:
        bg = Background(p, 0, 400)
        time.sleep(0.6)
        env.kill_daemon("B")  # kill -9
        time.sleep(1.0)
        env.start_daemon("B")
        bg.join()
    env.wait_same("B")
    env.wait_same("C")
    check_order(consume_all(env, "C", 400), 400)


def test_kill_b_data_caches_durable_keeps_c_complete(make_env, caches):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer() as p:
        produce(p, 0, 100)
        env.wait_same("C")
        caches["B"].kill("data", 0)
        try:
            produce(p, 100, 150, pause=0.002)
            env.wait_same("B")
            env.wait_same("C")
        finally:
            caches["B"].restart("data", 0)
        produce(p, 250, 150, pause=0.002)
        env.wait_same("C")
    check_order(consume_all(env, "C", 400), 400)
    # The cache path resumed: C's metadata cache publishes the cache length of its newest file.
    store = DurableStore(env.roots["C"])
    from pyspark_acs.cache.client import CacheClient
    from pyspark_acs.cache.metadata import MetadataCache

    meta = MetadataCache(CacheClient(caches["C"].metadata_endpoints))
    try:
        deadline = time.monotonic() + ARRIVE_S
        while True:
            ok = True
            for shard in range(2):
                rel = f"{shard_dir(env.stream, shard)}/{store.list_files(env.stream, shard)[-1]}"
                c_len, _ = meta.lengths([store.uri(rel)])[store.uri(rel)]
                ok = ok and c_len == store.length(rel)
            if ok:
                break
            assert time.monotonic() < deadline, "cache copies did not resume in C"
            time.sleep(0.1)
    finally:
        meta.client.close()


def test_kill_a_metadata_cache_copy_continues_from_durable(make_env, caches):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer() as p:
        produce(p, 0, 100)
        env.wait_same("C")
        caches["A"].kill("metadata", 0)
        try:
            produce(p, 100, 200, pause=0.002)
            env.wait_same("B")
            env.wait_same("C")
        finally:
            caches["A"].restart("metadata", 0)
    env.wait_same("C")
    check_order(consume_all(env, "C", 300), 300)


def test_stale_replica_dueling_writers_stay_byte_exact(make_env):
    env = make_env(CHAIN, dests=("B",))
    env.start_daemon("A")
    env.start_daemon("A")  # a stale replica owning the same operations
    env.start_daemon("B")
    with env.producer(roll_bytes=1_000_000) as p:  # long-lived files: both readers meet on them
        produce(p, 0, 300, pause=0.005)
    env.wait_same("B")
    a1, a2 = env.daemons["A"]
    poisoned = metric(a1, "errors_total", kind="poisoned") + metric(a2, "errors_total", kind="poisoned")
    assert poisoned > 0, "one of the two readers should have been stopped by the lease"
    check_order(consume_all(env, "B", 300), 300)


def test_unhealthy_b_rebuilds_tree_and_c_continues(make_env):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer(roll_bytes=200_000) as p:
        produce(p, 0, 100)
        env.wait_same("C")
        env.healthy["B"] = False
        env.write_topology()
        time.sleep(1.0)  # the daemons reread the file within listing_interval
        produce(p, 100, 200, pause=0.002)
        env.wait_same("C")
        env.wait_same("B")
    # C is now fed by A: C's writer saw bytes from A.
    assert metric(env.daemons["C"][0], "bytes_total", source="A", target="C") > 0
    check_order(consume_all(env, "C", 300), 300)


def test_bad_topology_and_unknown_cluster_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bad = tmp_path / "bad.json"
    bad.write_text('{"clusters": {"A": {"root": "/tmp/x"}}}')
    base = [sys.executable, "-m", "pyspark_acs.server.copy.daemon", "--topology"]
    r = subprocess.run(base + [str(bad), "--cluster", "A"], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2 and "missing required field" in r.stderr, r.stderr
    good = Path(ROOT) / "examples" / "topology.json"
    r = subprocess.run(base + [str(good), "--cluster", "Z"], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2 and "unknown cluster 'Z'" in r.stderr, r.stderr
    r = subprocess.run(base + [str(good), "--cluster", "A", "--set", "nope=1"], capture_output=True, text=True,
                       env=env, timeout=30)
    assert r.returncode == 2 and "unknown option 'nope'" in r.stderr, r.stderr
    r = subprocess.run(base + [str(tmp_path / "missing.json"), "--cluster", "A"], capture_output=True, text=True,
                       env=env, timeout=30)
    assert r.returncode == 2 and "cannot read topology file" in r.stderr, r.stderr
