"""Shared harness of the cross-cluster tests: real cache servers per cluster (LocalDeployment),
real ``acs-copy-daemon`` processes started as a user starts them, producers in the source
cluster, and consumers that follow the stream in every cluster while faults happen.

Used by tests/test_copy_daemon.py, tests/test_cross_cluster.py, tests/test_model.py and
benchmarks/soak.py. Every wait is bounded.
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
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from pyspark_acs.errors import AcsError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.producer import Producer

from conftest import ROOT, free_port  # noqa: E402  (tests/ is on sys.path under pytest and soak.py)

__all__ = [
    "ARRIVE_S",
    "CHAIN",
    "CLUSTERS",
    "DAEMON_SETTINGS",
    "ROOT",
    "STAR",
    "Background",
    "Env",
    "LiveConsumer",
    "ProducerProcess",
    "check_histories",
    "check_order",
    "consume_all",
    "free_port",
    "message",
    "metric",
    "produce",
    "source_history",
    "start_caches",
]

CLUSTERS = ("A", "B", "C")
#: Upper bound of every wait for copies to arrive.
ARRIVE_S = 30.0
DAEMON_SETTINGS = [
    "poll_interval=20ms", "listing_interval=300ms", "health_interval=300ms", "unhealthy_after=1.5s",
    "lease_seconds=1.5s", "retry=200ms",
]
CHAIN = [("A", "B", 1), ("B", "C", 1), ("A", "C", 5)]
STAR = [("A", "B", 1), ("A", "C", 1), ("B", "C", 5)]


def start_caches(base: Path, clusters: Iterable[str] = CLUSTERS, replicas: int = 1,
                 capacity: str = "64MiB") -> Dict[str, LocalDeployment]:
    """One cache deployment (``replicas`` data + ``replicas`` metadata servers) per cluster."""
    deps: Dict[str, LocalDeployment] = {}
    try:
        for name in clusters:
            deps[name] = LocalDeployment(Path(base) / name, data_replicas=replicas, metadata_replicas=replicas,
                                         capacity=capacity).start()
    except BaseException:
        for dep in deps.values():
            dep.stop()
        raise
    return deps


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

    def files(self, cluster: str) -> Dict[str, bytes]:
        store = DurableStore(self.roots[cluster])
        out = {}
        try:
            shards = store.stream_shards(self.stream) or 0
            for shard in range(shards):
                for f in store.list_files(self.stream, shard):
                    rel = f"{shard_dir(self.stream, shard)}/{f}"
                    out[rel] = store.read(rel, 0, store.length(rel))
        finally:
            store.close()
        return out

    def differences(self, cluster: str) -> Tuple[Dict[str, Tuple[int, int]], List[str]]:
        """Files of the source that ``cluster`` lacks or has shorter/different, and extra files there."""
        src, dst = self.files(self.clusters[0]), self.files(cluster)
        diff = {k: (len(v), len(dst.get(k, b""))) for k, v in src.items() if dst.get(k) != v}
        return diff, sorted(set(dst) - set(src))

    def wait_same(self, cluster: str, timeout: float = ARRIVE_S) -> None:
        """Wait until every file of the source is byte-exact in ``cluster``."""
        deadline = time.monotonic() + timeout
        while True:
            diff, extra = self.differences(cluster)
            if not diff and not extra and self.files(self.clusters[0]):
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
    out: Dict[int, List[bytes]] = {}
    c = Consumer(env.roots[env.clusters[0]], env.stream)
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
             lease_seconds=cfg["lease_seconds"], max_batch_delay=0.001, max_block_bytes=cfg["max_block_bytes"])
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "send":
        tag, first, n, size = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
        try:
            for i in range(first, first + n):
                p.send(("%s-%06d-" % (tag, i)).encode() + b"p" * ((i * 7919) % size), key=str(i % 5).encode())
            p.flush(timeout=60)
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
                 max_block_bytes: int = 8192, shards: int = 2) -> None:
        import queue

        self.tag = tag
        self.next = 0
        self.acknowledged: List[bytes] = []
        self.errors: List[str] = []
        self.pending: Optional[Tuple[int, int, int]] = None
        src = env.clusters[0]
        cfg = {"root": env.roots[src], "stream": env.stream, "shards": shards,
               "data_cache": env.caches[src].data_endpoints, "metadata_cache": env.caches[src].metadata_endpoints,
               "roll_bytes": roll_bytes, "lease_seconds": lease_seconds, "max_block_bytes": max_block_bytes}
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
