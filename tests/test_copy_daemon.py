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

from pyspark_acs.consumer import Consumer
from pyspark_acs.names import shard_dir
from pyspark_acs.producer import Producer
from pyspark_acs.server.deploy import LocalDeployment
from pyspark_acs.store import DurableStore

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
        cmd = [sys.executable, "-m", "pyspark_acs.server.copy_daemon", "--topology", str(self.topology),
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
    with env.producer() as p:
        produce(p, 0, 300, pause=0.001)
    env.wait_same("B")
    env.wait_same("C")
    values = consume_all(env, "C", 300)
    check_order(values, 300)
    assert len(env.files("C")) > 2  # files rolled over on the way
