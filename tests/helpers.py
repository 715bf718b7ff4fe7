"""Helpers the test modules share, and benchmarks/soak.py and scripts/fuzz.py use.

Sections, in order:

* Ports and paths: :data:`ROOT` (the checkout), :func:`free_port` (safe across xdist workers).
* Waiting: :func:`wait_until`, the one bounded wait on a condition.
* Deployments: :func:`deployments`, the one factory of real cache servers per cluster.
* Messages through the caches: :func:`msg`, :class:`Collector`, :class:`Sender`, :func:`assert_exact`.
* Clusters: the cross-cluster harness (:class:`Env`, copy daemons started as a user starts
  them, producers in the source cluster, consumers that follow in every cluster while faults
  happen, :func:`check_histories`). Every wait is bounded.
* Races: deposed writers' files that appear at the worst moment (:func:`later_files_at_first_open`).
* Processes: :func:`stop_process` (SIGSTOP, waited for), :data:`LOCK_HOLDER`.
* Spark: :func:`start_query` past Spark's own start-up fault, :func:`read_acs`.
* Fuzzing: hypothesis strategies and checks of forged blocks and raw RPC bodies.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
from hypothesis import strategies as st

from pyspark_acs.errors import AcsError, CorruptFileError, StoreError
from pyspark_acs.format.block import (FLAG_END_OF_FILE, FLAG_HEADERS, HEADER_SIZE, decode_block,
                                      encode_block, scan_blocks)
from pyspark_acs.format.names import next_file_name, shard_dir
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.copy.writer import validate_delta
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.producer import Producer
from pyspark_acs.write.shard import ShardWriter

# ---------------------------------------------------------------------------------------------
# Ports and paths

#: The checkout (the folder holding pyspark_acs/ and tests/).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: How many ports below the kernel's ephemeral range :func:`free_port` picks from.
PICKED_PORTS = 8000
_picked_lock = threading.Lock()
_next_pick = [0]  # the next candidate port (0: not started yet); guarded by _picked_lock


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _worker_slice() -> tuple:
    """``(index, count)`` of this process among the suite's parallel workers (``(0, 1)`` alone).

    pytest-xdist names its workers gw0, gw1, ... and tells each the count."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        index = int(name[2:]) if name.startswith("gw") else 0
    except ValueError:
        return 0, 1
    return (index, count) if 0 <= index < count else (0, 1)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a server a test starts later.

    Picked below the kernel's ephemeral range: binds to port 0 (every cache server's) and
    outgoing connections take their ports from that range, so a port picked there could be
    taken between picking it and the server binding it (a copy daemon of a full run once failed
    to start that way). Each parallel worker picks from its own slice of the range (two workers
    could otherwise both pick a port before either binds it). Ports are handed out in turn from
    a random start, each checked free and never twice in this process.
    """
    index, count = _worker_slice()
    span = PICKED_PORTS // count
    low = max(1024, _ephemeral_low() - PICKED_PORTS) + index * span
    with _picked_lock:
        if _next_pick[0] == 0:
            _next_pick[0] = low + random.randrange(span)
        for _ in range(span):
            port = _next_pick[0]
            _next_pick[0] = low + (port + 1 - low) % span
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no free port in 127.0.0.1:{low}-{low + span - 1}")

# ---------------------------------------------------------------------------------------------
# Waiting


def wait_until(predicate: Callable[[], object], timeout: float = 5.0,
               what: Union[str, Callable[[], str]] = "the condition", interval: float = 0.02):
    """Poll ``predicate`` every ``interval`` s until it returns something true, and return that;
    AssertionError naming ``what`` after ``timeout`` s (a callable: called then, so the message
    can say where things stood)."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")
        time.sleep(interval)



class FakeClock:
    """Monotonic seconds moved by hand: pass it as a component's ``clock`` and call
    :meth:`advance` where the test would otherwise sleep, so a timing rule is tested without
    waiting for it. Thread-safe (a component's own thread may read it)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock on by ``seconds`` and return the new time."""
        with self._lock:
            self._now += seconds
            return self._now

# ---------------------------------------------------------------------------------------------
# Deployments

#: The clusters of the cross-cluster tests.
CLUSTERS = ("A", "B", "C")


def start_caches(base: Union[str, os.PathLike], clusters: Iterable[str] = CLUSTERS, replicas: int = 1,
                 capacity: str = "64MiB", **settings) -> Dict[str, LocalDeployment]:
    """One running cache deployment per cluster (``replicas`` data + ``replicas`` metadata servers
    unless ``settings`` name ``data_replicas``/``metadata_replicas``), in ``base/<cluster>``.

    ``settings`` go to :class:`LocalDeployment` as they are. The caller stops them; a fixture
    uses :func:`deployments`, which does."""
    settings.setdefault("data_replicas", replicas)
    settings.setdefault("metadata_replicas", replicas)
    deps: Dict[str, LocalDeployment] = {}
    try:
        for name in clusters:
            deps[name] = LocalDeployment(Path(base) / name, capacity=capacity, **settings).start()
    except BaseException:
        for dep in deps.values():
            dep.stop()
        raise
    return deps


@contextlib.contextmanager
def deployments(base: Union[str, os.PathLike], clusters: Iterable[str] = CLUSTERS, **settings
                ) -> Iterator[Dict[str, LocalDeployment]]:
    """The one factory of the tests' cache deployments: :func:`start_caches`, stopped on exit.

    Examples
    --------
    >>> @pytest.fixture(scope="module")
    ... def caches(tmp_path_factory):
    ...     with deployments(tmp_path_factory.mktemp("caches"), clusters=("A", "B")) as deps:
    ...         yield deps
    """
    deps = start_caches(base, clusters, **settings)
    try:
        yield deps
    finally:
        for dep in deps.values():
            dep.stop()

# ---------------------------------------------------------------------------------------------
# Messages through the caches

PAD = b"." * 180


def msg(i: int, tag: bytes = b"m") -> bytes:
    return tag + b"%08d|" % i + PAD


def seq(value: bytes) -> int:
    return int(value[1:9])


class Collector:
    """Polls a Consumer and keeps every value in delivery order."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.values: List[bytes] = []

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._poll()

    def _poll(self) -> bool:
        got = self.consumer.poll()
        for b in got:
            self.values.extend(b.column("value").to_pylist())
        if not got:
            time.sleep(self.consumer.poll_interval)
        return bool(got)

    def until(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout} s waiting for {what}; have {len(self.values)} messages, "
                    f"stats {self.consumer.stats()}"
                )
            self._poll()

    def stat(self, name: str) -> int:
        return self.consumer.stats()[name]


class Sender(threading.Thread):
    """Sends numbered messages continuously (a burst of 20 every 5 ms) until stopped."""

    def __init__(self, producer: Producer, tag: bytes = b"m") -> None:
        super().__init__(daemon=True)
        self.producer = producer
        self.tag = tag
        self.sent = 0
        self.error: Optional[BaseException] = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                for _ in range(20):
                    self.producer.send(msg(self.sent, self.tag))
                    self.sent += 1
                time.sleep(0.005)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def stop(self) -> int:
        self._halt.set()
        self.join(10)
        assert not self.is_alive(), "sender thread did not stop"
        if self.error is not None:
            raise self.error
        self.producer.flush(timeout=20)
        return self.sent


def assert_exact(values: List[bytes], count: int, tag: bytes = b"m") -> None:
    assert len(values) == count, f"expected {count} messages, got {len(values)}"
    bad = [i for i, v in enumerate(values) if v != msg(i, tag)]
    assert not bad, f"first out-of-order/duplicated/corrupt message at {bad[0]}: {values[bad[0]][:16]!r}"



# ---------------------------------------------------------------------------------------------
# Clusters

#: Upper bound of every wait for copies to arrive.
ARRIVE_S = 30.0
DAEMON_SETTINGS = [
    "poll_interval=20ms", "listing_interval=300ms", "health_interval=300ms", "unhealthy_after=1.5s",
    "lease_seconds=1.5s", "retry=200ms",
]
CHAIN = [("A", "B", 1), ("B", "C", 1), ("A", "C", 5)]
STAR = [("A", "B", 1), ("A", "C", 1), ("B", "C", 5)]


class Env:
    """Clusters of one test: roots, topology file, daemons (subprocesses)."""

    def __init__(self, tmp: Path, caches: Dict[str, LocalDeployment], links, stream: str, dests, tree=None,
                 clusters: Sequence[str] = CLUSTERS, settings: Sequence[str] = DAEMON_SETTINGS,
                 extra_streams: Sequence[str] = ()) -> None:
        self.tmp = Path(tmp)
        self.caches = caches
        self.stream = stream
        self.clusters = tuple(clusters)
        self.roots = {c: str(self.tmp / f"root-{c}") for c in self.clusters}
        self.ports = {c: free_port() for c in self.clusters}
        self.links = links
        self.dests = list(dests)
        self.tree = tree
        self.settings = list(settings)
        #: More streams in the topology file, copied like ``stream`` (same source and destinations).
        self.extra_streams = list(extra_streams)
        self.healthy = {c: True for c in self.clusters}
        self.topology = self.tmp / "topology.json"
        self.daemons: Dict[str, List[subprocess.Popen]] = {}
        self._started: Dict[str, int] = {}
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.write_topology()

    def write_topology(self) -> None:
        clusters = {}
        for c in self.clusters:
            clusters[c] = {
                "root": self.roots[c],
                "data_cache": self.caches[c].data_endpoints,
                "metadata_cache": self.caches[c].metadata_endpoints,
                "copy_daemon": f"127.0.0.1:{self.ports[c]}",
                "healthy": self.healthy[c],
            }
        stream = {"source": self.clusters[0], "destinations": self.dests}
        if self.tree:
            stream["tree"] = self.tree
        data = {
            "clusters": clusters,
            "links": [{"from": a, "to": b, "cost": cost} for a, b, cost in self.links],
            "streams": {name: stream for name in [self.stream] + self.extra_streams},
        }
        tmp = self.topology.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.topology)
        # Make sure the mtime moves even within one timestamp tick.
        st = os.stat(self.topology)
        os.utime(self.topology, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))

    def start_daemon(self, cluster: str, *extra: str) -> subprocess.Popen:
        """Start ``python -m pyspark_acs.server.copy.daemon`` for ``cluster`` and wait for its banner."""
        n = self._started.get(cluster, 0)
        self._started[cluster] = n + 1
        log_path = self.tmp / f"daemon-{cluster}-{n}.log"
        log = open(log_path, "ab")
        # ACS_TEST_DAEMON_ROOT runs the daemons from another checkout (to show a test fails on old code).
        code = os.environ.get("ACS_TEST_DAEMON_ROOT", ROOT)
        env = dict(os.environ, PYTHONPATH=code + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "pyspark_acs.server.copy.daemon", "--topology", str(self.topology),
               "--cluster", cluster, "--parent-pid", str(os.getpid()), "--metrics-port", "0"]
        for s in self.settings:
            cmd += ["--set", s]
        cmd += list(extra)
        # cwd: ``python -m`` imports from the working folder first.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=code)
        log.close()
        line = _readline(proc, 30.0)
        if not line.startswith(f"acs-copy-daemon cluster={cluster} listening on"):
            proc.kill()
            proc.wait()
            raise AssertionError(f"copy daemon {cluster} did not start (port {self.ports.get(cluster)}; first line "
                                 f"{line!r}); its log:\n{log_path.read_text(errors='replace')[-4000:]}")
        proc.banner = line
        self.daemons.setdefault(cluster, []).append(proc)
        return proc

    def kill_daemon(self, cluster: str, sig=signal.SIGKILL) -> None:
        for proc in self.daemons.pop(cluster, []):
            proc.send_signal(sig)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def stop(self) -> None:
        for c in list(self.daemons):
            self.kill_daemon(c, signal.SIGTERM)

    def producer(self, **kw) -> Producer:
        kw.setdefault("roll_bytes", 20_000)
        kw.setdefault("max_batch_delay", 0.001)
        kw.setdefault("shards", 2)
        src = self.clusters[0]
        return Producer(self.roots[src], self.stream, data_cache=self.caches[src].data_endpoints,
                        metadata_cache=self.caches[src].metadata_endpoints, **kw)

    def consumer(self, cluster: str, **kw) -> Consumer:
        return Consumer(self.roots[cluster], self.stream, data_cache=self.caches[cluster].data_endpoints,
                        metadata_cache=self.caches[cluster].metadata_endpoints, **kw)

    def files(self, cluster: str, stream: Optional[str] = None) -> Dict[str, bytes]:
        """``{rel: bytes}`` of every file of ``stream`` (default: the main stream) in ``cluster``."""
        stream = stream or self.stream
        store = DurableStore(self.roots[cluster])
        out = {}
        try:
            shards = store.stream_shards(stream) or 0
            for shard in range(shards):
                for f in store.list_files(stream, shard):
                    rel = f"{shard_dir(stream, shard)}/{f}"
                    out[rel] = store.read(rel, 0, store.length(rel))
        finally:
            store.close()
        return out

    def differences(self, cluster: str, stream: Optional[str] = None) -> Tuple[Dict[str, Tuple[int, int]], List[str]]:
        """Files of the source that ``cluster`` lacks or has shorter/different, and extra files there."""
        src, dst = self.files(self.clusters[0], stream), self.files(cluster, stream)
        diff = {k: (len(v), len(dst.get(k, b""))) for k, v in src.items() if dst.get(k) != v}
        return diff, sorted(set(dst) - set(src))

    def wait_same(self, cluster: str, timeout: float = ARRIVE_S, stream: Optional[str] = None) -> None:
        """Wait until every file of ``stream`` (default: the main stream) at the source is
        byte-exact in ``cluster``."""
        deadline = time.monotonic() + timeout
        while True:
            diff, extra = self.differences(cluster, stream)
            if not diff and not extra and self.files(self.clusters[0], stream):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{cluster} differs from the source after {timeout} s: {diff} extra={extra}\n"
                                     f"{self.logs()}")
            time.sleep(0.1)

    def check_prefixes(self, cluster: str) -> None:
        """Every file in ``cluster`` is a prefix of the source's (no gap, no duplicate, no foreign bytes)."""
        src = self.files(self.clusters[0])
        for rel, data in self.files(cluster).items():
            assert rel in src, rel
            assert src[rel][: len(data)] == data, f"{cluster}:{rel} is not a prefix of the source's file"

    def logs(self, lines: int = 30) -> str:
        out = []
        for p in sorted(self.tmp.glob("daemon-*.log")):
            text = p.read_text(errors="replace").splitlines()
            out.append(f"--- {p.name}\n" + "\n".join(text[-lines:]))
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


def produce(p: Producer, start: int, n: int, size: int = 300, pause: float = 0.0) -> None:
    for i in range(start, start + n):
        p.send(f"m{i:06d}-".encode() + b"x" * size, key=str(i % 7).encode())
        if pause:
            time.sleep(pause)
    p.flush(timeout=20)


def consume_all(env: Env, cluster: str, expected: int, timeout: float = ARRIVE_S) -> List[bytes]:
    c = env.consumer(cluster)
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


class Background:
    """Produce ``n`` messages in a thread, paced, so faults hit mid-stream."""

    def __init__(self, p: Producer, start: int, n: int, pause: float = 0.004, size: int = 300) -> None:
        self.error: Optional[BaseException] = None

        def run() -> None:
            try:
                produce(p, start, n, pause=pause, size=size)
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
    token = os.environ.get("ACS_CACHE_TOKEN")  # token-protected daemons want it on /metrics too
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    text = urllib.request.urlopen(req, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"acs_copy_{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class LiveConsumer:
    """A Consumer following the stream in one cluster from as early as possible, in a thread.

    It starts at ``earliest`` the moment the stream exists in the cluster (a consumer that
    waits for the stream, as a user's would) and records every message's value per shard.
    Errors are kept in :attr:`errors` (a consumer must never fail).
    """

    def __init__(self, env: Env, cluster: str, poll: float = 0.01) -> None:
        self.env = env
        self.cluster = cluster
        self.poll = poll
        self.values: Dict[int, List[bytes]] = {}
        self.errors: List[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"live-consumer-{cluster}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        consumer = None
        try:
            while not self._stop.is_set():
                if consumer is None:
                    store = DurableStore(self.env.roots[self.cluster])
                    try:
                        exists = store.stream_shards(self.env.stream) is not None
                    finally:
                        store.close()
                    if not exists:
                        self._stop.wait(self.poll)
                        continue
                    consumer = self.env.consumer(self.cluster)
                got = consumer.poll()
                with self._lock:
                    for batch in got:
                        shards = batch.column("shard").to_pylist()
                        for shard, value in zip(shards, batch.column("value").to_pylist()):
                            self.values.setdefault(shard, []).append(value)
                if not got:
                    self._stop.wait(self.poll)
        except (AcsError, OSError, RuntimeError) as exc:
            self.errors.append(f"consumer in {self.cluster}: {type(exc).__name__}: {exc}")
        finally:
            if consumer is not None:
                consumer.close()

    def snapshot(self) -> Dict[int, List[bytes]]:
        with self._lock:
            return {s: list(v) for s, v in self.values.items()}

    def count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self.values.values())

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)


def source_history(env: Env) -> Dict[int, List[bytes]]:
    """The one true history: what a fresh reader of the source cluster reads (after quiescence)."""
    return read_history(env.roots[env.clusters[0]], env.stream)


def read_history(root: str, stream: str) -> Dict[int, List[bytes]]:
    """Every message value a fresh store-only reader of ``root`` reads now, per shard."""
    out: Dict[int, List[bytes]] = {}
    c = Consumer(str(root), stream)
    try:
        while True:
            got = c.poll()
            if not got:
                break
            for batch in got:
                for shard, value in zip(batch.column("shard").to_pylist(), batch.column("value").to_pylist()):
                    out.setdefault(shard, []).append(value)
    finally:
        c.close()
    return out


def check_histories(history: Dict[int, List[bytes]], consumers: Sequence[LiveConsumer],
                    acknowledged: Iterable[bytes] = (), complete: bool = True) -> None:
    """The invariant of every cross-cluster fault test.

    Every consumer's sequence per shard is a prefix of the one true history (nothing skipped,
    duplicated or reordered), every acknowledged message is in that history, and (``complete``)
    every consumer has all of it.
    """
    problems = []
    for live in consumers:
        problems.extend(live.errors)
        got = live.snapshot()
        for shard in sorted(set(got) | set(history)):
            seq, true = got.get(shard, []), history.get(shard, [])
            if seq != true[: len(seq)]:
                at = next((i for i, (a, b) in enumerate(zip(seq, true)) if a != b), min(len(seq), len(true)))
                problems.append(
                    f"{live.cluster} shard {shard}: not a prefix of the history at message {at} "
                    f"(got {seq[at][:12] if at < len(seq) else None!r}, history has "
                    f"{true[at][:12] if at < len(true) else None!r}); {len(seq)} read, {len(true)} in history"
                )
            elif complete and len(seq) != len(true):
                problems.append(f"{live.cluster} shard {shard}: {len(seq)} of {len(true)} messages")
    everything = {v for seq in history.values() for v in seq}
    lost = [v for v in acknowledged if v not in everything]
    if lost:
        problems.append(f"{len(lost)} acknowledged messages are not in the history, e.g. {lost[0][:12]!r}")
    assert not problems, "\n".join(problems)


_PRODUCER_SCRIPT = r"""
import json, sys
from pyspark_acs.write.producer import Producer
cfg = json.loads(sys.argv[1])
p = Producer(cfg["root"], cfg["stream"], shards=cfg["shards"], data_cache=cfg["data_cache"],
             metadata_cache=cfg["metadata_cache"], roll_bytes=cfg["roll_bytes"],
             lease_seconds=cfg["lease_seconds"], max_batch_delay=0.001, max_block_bytes=cfg["max_block_bytes"],
             acknowledge=cfg["acknowledge"])
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "send":
        tag, first, n, size = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
        try:
            for i in range(first, first + n):
                p.send(("%s-%06d-" % (tag, i)).encode() + b"p" * ((i * 7919) % size), key=str(i % 5).encode())
            p.flush(timeout=cfg["flush_timeout"])
            print("ack %d %d" % (first, first + n), flush=True)
        except Exception as exc:
            print(("err %s: %s" % (type(exc).__name__, exc)).replace("\n", " "), flush=True)
    elif cmd[0] == "close":
        try:
            p.close()
            print("closed", flush=True)
        except Exception as exc:
            print(("err %s: %s" % (type(exc).__name__, exc)).replace("\n", " "), flush=True)
        break
"""


def message(tag: str, i: int, size: int) -> bytes:
    """The value a :class:`ProducerProcess` sends as message ``i`` (the same formula as its script)."""
    return f"{tag}-{i:06d}-".encode() + b"p" * ((i * 7919) % size)


class ProducerProcess:
    """A Producer in its own process, so it can be SIGKILLed (a crash at any point, e.g. between
    its durable append and publishing the length) or SIGSTOPped (a stall) like a user's.

    ``send(n, size)`` sends ``n`` messages and waits for the flush; the values of the messages
    whose flush returned are added to :attr:`acknowledged`.
    """

    def __init__(self, env: Env, tag: str, roll_bytes: int = 20_000, lease_seconds: float = 1.5,
                 max_block_bytes: int = 8192, shards: int = 2, acknowledge: str = "published",
                 flush_timeout: float = 60.0) -> None:
        import queue

        self.tag = tag
        self.next = 0
        self.acknowledged: List[bytes] = []
        self.errors: List[str] = []
        self.pending: Optional[Tuple[int, int, int]] = None
        src = env.clusters[0]
        cfg = {"root": env.roots[src], "stream": env.stream, "shards": shards,
               "data_cache": env.caches[src].data_endpoints, "metadata_cache": env.caches[src].metadata_endpoints,
               "roll_bytes": roll_bytes, "lease_seconds": lease_seconds, "max_block_bytes": max_block_bytes,
               "acknowledge": acknowledge, "flush_timeout": flush_timeout}
        environ = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log_path = env.tmp / f"producer-{tag}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-c", _PRODUCER_SCRIPT, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, env=environ)
        log.close()
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        line = self._line(30.0)
        if line != "ready":
            self.proc.kill()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"producer {tag} did not start within 30 s: {line!r}; its log ends:\n{tail}")

    def _pump(self) -> None:
        for raw in self.proc.stdout:
            self._lines.put(raw.decode().strip())
        self._lines.put(None)

    def _line(self, timeout: float) -> Optional[str]:
        import queue

        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def start_send(self, n: int, size: int = 2000) -> None:
        """Ask for ``n`` messages; :meth:`result` waits for the flush."""
        first, self.next = self.next, self.next + n
        self.pending = (first, n, size)
        self.proc.stdin.write(f"send {self.tag} {first} {n} {size}\n".encode())
        self.proc.stdin.flush()

    def result(self, timeout: float = 60.0) -> bool:
        """Wait for the pending send; True if it was acknowledged."""
        if self.pending is None:
            return False
        first, n, size = self.pending
        line = self._line(timeout)
        if line is None:
            return False  # still stalled or dead: never acknowledged
        self.pending = None
        if line.startswith("ack"):
            self.acknowledged.extend(message(self.tag, i, size) for i in range(first, first + n))
            return True
        self.errors.append(line)
        return False

    def send(self, n: int, size: int = 2000, timeout: float = 60.0) -> bool:
        try:
            self.start_send(n, size)
        except OSError:  # the process is gone
            return False
        return self.result(timeout)

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def pause(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)

    def close(self, timeout: float = 60.0) -> bool:
        """Close the producer (seals its files); True when it closed cleanly."""
        if not self.alive:
            return False
        if self.pending is not None:
            self.result(timeout)
        try:
            self.proc.stdin.write(b"close\n")
            self.proc.stdin.flush()
        except OSError:
            return False
        line = self._line(timeout)
        self.proc.wait(timeout=timeout)
        return line == "closed"


# ---------------------------------------------------------------------------------------------
# Races


def later_files_at_first_open(monkeypatch, target: Union[ShardWriter, type], writer_ids: Sequence[str],
                              *, shard: int = 0, refuse_first: bool = False) -> List[str]:
    """Right after ``target`` (one ShardWriter, or the class: every writer of ``shard``, as the
    sink makes one per commit) opens its first file, empty files named after it by the
    deposed writers ``writer_ids`` appear, each sorting after the one before: created while
    its writer stalled, which then died before its claim could seal them.

    ``refuse_first``: the store refuses to open the first of them for append, as HDFS does
    while the dead writer's stream still holds the file.

    Returns the names, filled in once they appear.
    """
    late: List[str] = []
    on_class = isinstance(target, type)
    original = target._open

    def appear(writer: ShardWriter, name: str) -> None:
        if late or writer.shard != shard:
            return
        for writer_id in writer_ids:
            late.append(next_file_name([late[-1] if late else name], writer_id))
            writer.store.write_small(f"{writer.dir}/{late[-1]}", b"")

    if on_class:
        def open_on_class(self, name, length, index):
            original(self, name, length, index)
            appear(self, name)

        monkeypatch.setattr(ShardWriter, "_open", open_on_class)
    else:
        def open_on_writer(name, length, index):
            original(name, length, index)
            appear(target, name)

        monkeypatch.setattr(target, "_open", open_on_writer)
    if refuse_first:
        appender = DurableStore.open_appender

        def refusing(self, rel):
            if late and rel.endswith(late[0]):
                raise StoreError(f"open {rel} for append: AlreadyBeingCreatedException (simulated)")
            return appender(self, rel)

        monkeypatch.setattr(DurableStore, "open_appender", refusing)
    return late


def stall_at_next_lease_check(writer: ShardWriter) -> threading.Event:
    """Make ``writer``'s thread stall at its next lease check (a writer stopped or hung past
    its lease, its file left as it was) until the returned event is set; the check then runs
    as usual (and finds the lease taken over)."""
    resumed = threading.Event()
    check = writer.check_leases

    def stalled(every: bool = False) -> None:
        resumed.wait(30)
        check(every=every)

    writer.check_leases = stalled
    return resumed


# ---------------------------------------------------------------------------------------------
# Processes

LOCK_HOLDER = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("LOCKED", flush=True)
time.sleep(120)
"""


def process_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (or gone). A SIGSTOP wakes one
    thread, which stops the others once it runs: on a loaded machine the rest of the process
    (a server's polling thread) runs on, and answers calls, for a while after kill returned."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # the thread exited meanwhile
            continue
    return bool(states) and all(state in "TtZX" for state in states)


def stop_process(child: Union[subprocess.Popen, int], timeout: float = 20.0) -> None:
    """SIGSTOP the child process (a Popen, or a pid) and wait until the kernel shows every
    thread of it stopped."""
    pid = child if isinstance(child, int) else child.pid
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not process_stopped(pid):
        assert time.monotonic() < deadline, f"process {pid} never stopped"
        time.sleep(0.005)



# ---------------------------------------------------------------------------------------------
# Spark

#: The message of Spark's ``SparkException`` when a Python worker did not connect back in time.
SPARK_WORKER_START_FAULT = "Python worker failed to connect back"

#: Status messages of a query whose sources are not initialized yet (StreamExecution): the first
#: is what ``start()`` returns with, before the query's thread has begun.
_INITIALIZING = ("Initializing StreamExecution", "Initializing sources")

#: How long a query may take to initialize its sources before the start counts as done (s).
START_WAIT_S = 120.0

#: Starts per query: the fault is rare, two in a row would be a finding of its own.
START_ATTEMPTS = 4
#: Seconds between starts, times the attempt: Spark gives its Python planner a fixed 10 s to
#: connect back, which a loaded machine (a standalone cluster's JVMs starting beside) missed
#: three times in a row when the starts followed each other at once.
START_PAUSE_S = 5.0


def start_query(writer, attempts: int = START_ATTEMPTS, sleep: Callable[[float], None] = time.sleep):
    """``writer.start()``, started again if Spark's Python planner failed to connect back.

    Parameters
    ----------
    writer : pyspark.sql.streaming.DataStreamWriter
        The configured writer; ``start()`` is called on it once per attempt.
    attempts : int
        Starts at most.
    sleep : callable
        How to pause between attempts (the tests of this helper pass one that returns at once).

    Returns
    -------
    pyspark.sql.streaming.StreamingQuery
        The query, once it is past initializing its sources (or finished).
    """
    for attempt in range(1, attempts + 1):
        query = writer.start()
        deadline = time.monotonic() + START_WAIT_S
        while (query.isActive and query.status.get("message") in _INITIALIZING
               and time.monotonic() < deadline):
            time.sleep(0.05)
        if query.isActive or attempt == attempts:
            return query
        error = query.exception()
        if error is None or SPARK_WORKER_START_FAULT not in str(error):
            return query
        warnings.warn(f"start {attempt} of query {query.name!r}: Spark's Python planner did not "
                      f"connect back ({SPARK_WORKER_START_FAULT}); starting it again")
        _forget_uncommitted_start(query)
        sleep(START_PAUSE_S * attempt)
    raise AssertionError("unreachable")


def _forget_uncommitted_start(query) -> None:
    """Remove the empty ``offsets`` and ``commits`` logs a query that failed before its first
    batch left in its checkpoint: a sink that cannot recover (the memory sink outside complete
    mode) refuses to start where an ``offsets`` directory exists, even an empty one."""
    try:
        root = query._jsq.streamingQuery().resolvedCheckpointRoot()
    except Exception:  # noqa: BLE001 - not a StreamExecution (or gone): nothing to tidy
        return
    path = Path(root.split(":", 1)[1] if root.startswith("file:") else root)
    for log_dir in ("offsets", "commits"):
        d = path / log_dir
        if d.is_dir() and not any(not f.name.startswith(".") for f in d.iterdir()):
            shutil.rmtree(d)


def read_acs(spark, root, stream, **opts):
    reader = spark.read.format("acs").option("root", root).option("stream", stream)
    for k, v in opts.items():
        reader = reader.option(k, v)
    return reader.load()



# ---------------------------------------------------------------------------------------------
# Fuzzing

_HEADER = struct.Struct("<4sBBHIIIIQqq")
_U32 = st.integers(0, 2**32 - 1)
_I32 = st.integers(-(2**31), 2**31 - 1)
_U64_EDGE = st.sampled_from([0, 1, 2**31, 2**32, 2**62, 2**63 - 2, 2**63 - 1, 2**63, 2**64 - 1])


def _sign(header: bytearray, body: bytes) -> bytes:
    """Recompute both checksums of ``header + body`` (the forger knows the algorithm)."""
    struct.pack_into("<I", header, 16, zlib.crc32(body))
    struct.pack_into("<I", header, 20, 0)
    struct.pack_into("<I", header, 20, zlib.crc32(bytes(header[:HEADER_SIZE])))
    return bytes(header) + body


@st.composite
def forged_blocks(draw) -> bytes:
    """A block with valid checksums whose fields and body an attacker chose."""
    n = draw(st.integers(1, 6))
    values = draw(st.lists(st.binary(max_size=20), min_size=n, max_size=n))
    keys = draw(st.one_of(st.none(), st.lists(st.binary(max_size=8), min_size=n, max_size=n)))
    headers = draw(st.one_of(st.none(), st.lists(
        st.lists(st.tuples(st.text(max_size=4), st.binary(max_size=4)), max_size=2), min_size=n, max_size=n)))
    raw = bytearray(encode_block(values, keys=keys, headers=headers, first_index=draw(st.integers(0, 1000))))
    header, body = raw[:HEADER_SIZE], bytearray(raw[HEADER_SIZE:])
    # Hostile body words: overwrite int32s anywhere in the body (offsets, counts, lengths).
    for _ in range(draw(st.integers(0, 4))):
        if len(body) >= 4:
            at = draw(st.integers(0, (len(body) - 4) // 4)) * 4
            struct.pack_into("<i", body, at, draw(st.one_of(_I32, st.sampled_from([-1, -8, 2**31 - 1]))))
    # Hostile header fields.
    field = draw(st.sampled_from(["none", "count", "first_index", "flags", "body_len", "ts"]))
    if field == "count":
        struct.pack_into("<I", header, 8, draw(st.one_of(_U32, st.integers(0, 64))))
    elif field == "first_index":
        struct.pack_into("<Q", header, 24, draw(st.one_of(_U64_EDGE, st.integers(0, 2**64 - 1))))
    elif field == "flags":
        struct.pack_into("<B", header, 5, draw(st.sampled_from([0, FLAG_HEADERS, FLAG_END_OF_FILE,
                                                                 FLAG_HEADERS | FLAG_END_OF_FILE])))
    elif field == "body_len":
        cut = draw(st.integers(0, len(body)))
        body = body[:cut]
    elif field == "ts":
        struct.pack_into("<qq", header, 32, draw(st.integers(-(2**63), 2**63 - 1)), draw(st.integers(-(2**63), 2**63 - 1)))
    struct.pack_into("<I", header, 12, len(body))
    return _sign(header, bytes(body))


def check_decoder(data: bytes, path: str = "mem://fuzz/file.acs", position: int = 4096) -> str:
    """Run the decoders over ``data``; return ``"ok"`` or ``"corrupt"``; raise AssertionError
    on any other exception or an error that does not name the file and position."""
    outcome = "ok"
    for call in (
        lambda: decode_block(data, path=path, position=position, headers=True),
        lambda: decode_block(data, path=path, position=position, headers=False),
        lambda: list(scan_blocks(data, path=path, base=position, final=True)),
        lambda: validate_delta(b"", data, base=position, path=path, next_index=None),
    ):
        try:
            result = call()
            if isinstance(result, tuple) and len(result) == 2:  # decode_block: touch every column
                header, batch = result
                batch.validate(full=True)
                batch.column(0).to_pylist()
        except CorruptFileError as exc:
            outcome = "corrupt"
            assert path in str(exc) and exc.path == path, f"the error does not name the file: {exc!r}"
            assert exc.position >= position, f"the error names no byte position: {exc!r}"
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            raise AssertionError(f"foreign exception {type(exc).__name__}: {exc}") from exc
    return outcome


# -- raw RPC bodies -------------------------------------------------------------------------------------

#: (method, kind): kind "uu" unary-unary, "us" unary-stream, "ss" stream-stream.
CACHE_METHODS: List[Tuple[str, str]] = [("Get", "uu"), ("Put", "uu"), ("CompareAndSet", "uu"), ("Delete", "uu"),
                                        ("Stats", "uu"), ("Health", "uu"), ("Watch", "ss"), ("Follow", "us")]
COPY_METHODS: List[Tuple[str, str]] = [("Copy", "ss"), ("Files", "uu"), ("Health", "uu")]
#: What a server may answer a hostile body with. UNKNOWN (an exception escaped a handler) is not here.
ALLOWED_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED,  # a push stream waiting for news
                 grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION}


def _message_bodies(message_class) -> st.SearchStrategy:
    """Serialized messages of ``message_class`` with random scalar and repeated fields."""
    fields = message_class.DESCRIPTOR.fields

    @st.composite
    def build(draw):
        msg = message_class()
        for f in fields:
            if not draw(st.booleans()):
                continue
            repeated = getattr(f, "is_repeated", None)
            if repeated is None:  # older protobuf
                repeated = f.label == f.LABEL_REPEATED
            if f.type in (f.TYPE_BYTES,):
                value = st.binary(max_size=64)
            elif f.type == f.TYPE_STRING:
                value = st.one_of(st.text(max_size=40), st.sampled_from(["../../etc/hostname", "a/../b", "x" * 300]))
            elif f.type == f.TYPE_BOOL:
                value = st.booleans()
            elif f.type in (f.TYPE_INT32, f.TYPE_SINT32, f.TYPE_ENUM):
                value = st.integers(-(2**31), 2**31 - 1)
            elif f.type in (f.TYPE_UINT32, f.TYPE_FIXED32):
                value = st.integers(0, 2**32 - 1)
            elif f.type in (f.TYPE_INT64, f.TYPE_SINT64, f.TYPE_SFIXED64):
                value = st.integers(-(2**63), 2**63 - 1)
            elif f.type in (f.TYPE_UINT64, f.TYPE_FIXED64):
                value = st.integers(0, 2**64 - 1)
            else:
                continue  # nested messages stay empty
            try:
                if repeated:
                    getattr(msg, f.name).extend(draw(st.lists(value, max_size=5)))
                else:
                    setattr(msg, f.name, draw(value))
            except (TypeError, ValueError, AttributeError):
                pass  # a value the field cannot hold (or a map): leave it unset
        return msg.SerializeToString()

    return build()


def raw_bodies(request_class) -> st.SearchStrategy:
    """Random bytes or a random instance of ``request_class``, serialized."""
    return st.one_of(st.binary(max_size=200), _message_bodies(request_class))


def check_rpc(channel: grpc.Channel, service: str, method: str, kind: str, bodies: List[bytes],
              metadata=None, timeout: float = 2.0) -> grpc.StatusCode:
    """Send raw ``bodies`` to ``/service/method``; return the status; raise AssertionError for
    a status outside :data:`ALLOWED_CODES`."""
    name = f"/{service}/{method}"
    try:
        if kind == "uu":
            channel.unary_unary(name)(bodies[0], metadata=metadata, timeout=timeout)
        elif kind == "us":
            for _ in channel.unary_stream(name)(bodies[0], metadata=metadata, timeout=timeout):
                pass
        else:
            call = channel.stream_stream(name)(iter(bodies), metadata=metadata, timeout=timeout)
            for _ in call:
                pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in ALLOWED_CODES, f"{name}: {code} {exc.details()}"
    return code


def request_classes() -> Dict[str, Dict[str, type]]:
    """Request message class per service and method."""
    from pyspark_acs.cache.proto import acs_pb2
    from pyspark_acs.server.copy.proto import copy_pb2

    return {
        "pyspark_acs.cache.Cache": {"Get": acs_pb2.GetRequest, "Put": acs_pb2.PutRequest,
                      "CompareAndSet": acs_pb2.CompareAndSetRequest, "Delete": acs_pb2.DeleteRequest,
                      "Stats": acs_pb2.StatsRequest, "Health": acs_pb2.HealthRequest,
                      "Watch": acs_pb2.WatchRequest, "Follow": acs_pb2.FollowRequest},
        "pyspark_acs.copy.Copy": {"Copy": copy_pb2.CopyRequest, "Files": copy_pb2.FilesRequest,
                          "Health": copy_pb2.HealthRequest},
    }
