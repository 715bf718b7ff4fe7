"""Fan-out: one producer, N consumer processes, ours through the caches vs the durable store
alone vs Redis Streams, the same load in one run (figures: benchmarks/RESULTS.md).

One producer sends 1 KiB messages carrying their send time at a fixed rate (default 2 MB/s);
each of N consumer processes receives all of them (so each consumer receives 2 MB/s). The
consumers start first and say they are ready; then the producer runs for ``--seconds``; then
the consumers get up to ``--drain`` more seconds to catch up. Three columns:

- ``caches``: our Producer and Consumers through a 3 data + 3 metadata deployment of
  ``acs-cache-server`` processes (push streams: lengths and bytes are pushed);
- ``durable``: the same, through the durable store (local files) alone;
- ``redis``: Debian's ``redis-server``, one stream, ``XADD`` (pipelined per 10 ms) and
  ``XREAD BLOCK`` per consumer. Skipped with a note when redis-server or the ``redis`` client
  is missing (as root: ``apt-get install -y redis-server``; ``pip install redis``);
- ``grpc``: the grpcio floor (``_grpc_floor.py``), one grpc.aio server that does nothing but
  relay: each flush is one acknowledged message on the producer's stream and one pushed
  message on each consumer's stream, raw bytes, no replication, lengths or store. It shows what
  the fixed transport (grpcio in Python) costs for this load before any of our work;
- ``grpc3``: the same floor in the shape of our 3 data + 3 metadata deployment: six relay
  servers; the producer publishes each flush to the three "data" relays, waits for their
  acknowledgements, then publishes an 8-byte length to the three "metadata" relays and waits
  for theirs (our flush: chunks to a majority, then lengths); consumer i follows data relay
  i mod 3. The cheapest a replicated grpcio deployment of this shape can be.

For N in ``--consumers`` (default 8,32,64) it prints delivered MB/s (all consumers together,
over the time from the first send to the last message received), the delay p50/p99 (receive
time minus send time, from up to 20,000 samples per consumer drawn from all its delays, leaving out messages sent in the
first 3 seconds: start-up), messages missing at the end,
bytes our consumers read from the durable store (in all, and in the steady state: after the
same first 3 seconds, with the store holds of each), server CPU seconds per GB delivered (utime +
stime of the cache servers, or of redis-server, from /proc), the consumers' own CPU seconds per
GB (all consumer processes, from /proc), what the producer achieved, and
our/Redis ratios; and it writes a PNG plot (``--plot``) of p99 and MB/s against N.

    .venv/bin/python benchmarks/fanout.py [--consumers 8,32,64] [--seconds 10] [--rate-mb 2]
    .venv/bin/python benchmarks/fanout.py --consumers 4 --seconds 3       # smoke run
    .venv/bin/python benchmarks/fanout.py --consumers 32 --producer-acknowledge durable   # ack at the durable append
    .venv/bin/python benchmarks/fanout.py --consumers 64 --columns caches,redis --hog 1   # a busy machine

Per column and N it also prints, per second of the run (by send time), the largest delay and
how many consumers passed ``SLOW_MS`` in it: whether a p99 came from a start-up burst, a
stall of everyone at once (the producer or a server) or a few slow consumers. ``--hog K``
runs K processes spinning on the CPU beside every point, the same for every column: the
machine's busy phases (other tenants) made repeatable.

No assertion is timed here; an honest miss is printed as it is.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _grpc_floor  # noqa: E402
from _common import RedisServer, percentile, progress  # noqa: E402
from pyspark_acs.server.local.cpu import cpu_seconds  # noqa: E402
from pyspark_acs.write.producer import ACKNOWLEDGE_MODES, DEFAULT_ACKNOWLEDGE  # noqa: E402

#: Message size (bytes) and how often the producer flushes / pipelines (seconds).
MESSAGE_BYTES = 1024
FLUSH_EVERY_S = 0.01
#: Delay samples each consumer reports (drawn from all of its delays at the end).
SAMPLES = 20_000
#: Messages sent in the first seconds are left out of the delays, for every column alike: they
#: include start-up (the producer's lease, first file and channels while N consumer processes
#: import and connect on the same cores: the first flushes take up to ~0.6 s).
WARMUP_S = 3.0
#: How often a consumer whose push stream blocks looks at the board for the stop (seconds).
STOP_CHECK_S = 0.1
#: A delay above this (ms) counts a consumer as slow in that second of the timeline.
SLOW_MS = 50.0
COLUMNS = ("caches", "durable", "redis", "grpc", "grpc3")


# -- child processes --------------------------------------------------------------------------


def _floor_payload(count: int, now_us: int) -> bytes:
    """``count`` messages for the grpc floor column: each starts with its send time as 8 bytes
    (little-endian microseconds), read back vectorized."""
    one = now_us.to_bytes(8, "little") + b"x" * (MESSAGE_BYTES - 8)
    return one * count


def _payload(i: int, now_us: int) -> bytes:
    head = b"%d %d " % (now_us, i)
    return head + b"x" * (MESSAGE_BYTES - len(head))


class _Tally:
    """A consumer's count, bytes and delays (ms).

    Every column counts the same way, a batch at a time (:meth:`add_many`): the tally is the
    benchmark's instrument, not the system under test, so it costs each column as little as it
    can -- one slice copy per batch into a buffer that doubles as it fills (a run of 20 s at
    2 MB/s is ~40k delays, 160 KB). A reservoir sampled per batch (random draws and a
    ``numpy.unique`` each) cost a consumer ~200 us per batch, a fifth of ours at 2 MB/s; a
    Python step per message before that about a tenth. The delays sent to the parent are a
    uniform sample of at most :data:`SAMPLES` of them, drawn once at the end. What each
    column's client hands out per message (redis-py's tuple per entry) stays in its own loop.
    """

    def __init__(self, board: "_Board", index: int) -> None:
        self.board = board
        self.index = index
        self.n = 0
        self.nbytes = 0
        self._delays = np.empty(SAMPLES, dtype=np.float32)
        self._filled = 0
        self.last_at = 0.0
        self.first_sent_us: Optional[int] = None
        #: Whether a message sent after the warm-up came (the steady state began).
        self.warm = False
        self._rng = np.random.default_rng(os.getpid())
        #: Largest delay (ms) of the messages sent in each second of the run, by that second
        #: (counted from the first message): where a p99 came from, printed per column.
        self.worst: Dict[int, float] = {}

    @property
    def samples(self) -> List[float]:
        """At most :data:`SAMPLES` of the delays, drawn uniformly without replacement."""
        kept = self._delays[: self._filled]
        if len(kept) > SAMPLES:
            kept = self._rng.choice(kept, SAMPLES, replace=False)
        return kept.astype(np.float64).tolist()

    def add_many(self, sent_us: "Any", now_us: int, nbytes: int) -> None:
        """A batch of messages (``sent_us``: a numpy int64 array of send times, µs) received
        at ``now_us``, ``nbytes`` of values in all."""
        n = len(sent_us)
        if not n:
            return
        self.n += n
        self.nbytes += nbytes
        if self.first_sent_us is None:
            self.first_sent_us = int(sent_us[0])
        # A batch spans a few flushes: its oldest message has its largest delay. The timeline
        # has the warm-up's seconds too, so that a start-up burst shows where it began.
        first = int((int(sent_us[0]) - self.first_sent_us) // 1_000_000)
        self.worst[first] = max(self.worst.get(first, 0.0), (now_us - int(sent_us[0])) / 1000.0)
        kept = sent_us[sent_us - self.first_sent_us >= WARMUP_S * 1e6]
        k = len(kept)
        if k:
            self.warm = True
            if self._filled + k > len(self._delays):
                grown = np.empty(max(2 * len(self._delays), self._filled + k), dtype=np.float32)
                grown[: self._filled] = self._delays[: self._filled]
                self._delays = grown
            delays = self._delays[self._filled : self._filled + k]
            delays[:] = now_us - kept  # in int64 (the stamps are ~1.8e15 us), then as float32 ms
            delays /= 1000.0
            self._filled += k

    def tick(self) -> None:
        """Show the running count to the parent (a store into shared memory)."""
        self.board.set_count(self.index, self.n)


class _Board:
    """What the parent and a point's consumers share, in one memory-mapped file of int64
    slots: slot 0 the parent's stop, slot 1 + i consumer i's running count.

    A store into mapped memory, no system call. A count file per consumer (open, write, rename
    over the last one every 0.25 s) blocks on ext4, which starts writing a file's data back when
    it is renamed over another: at N=64 such an instrument holds up the system it measures.
    """

    def __init__(self, path: str, consumers: Optional[int] = None) -> None:
        if consumers is not None:  # the parent makes it
            with open(path, "wb") as f:
                f.truncate(8 * (consumers + 1))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self._slots = memoryview(self._map).cast("q")  # aligned 8-byte stores: never torn on x86-64

    def set_count(self, index: int, n: int) -> None:
        self._slots[1 + index] = n

    def count(self, index: int) -> int:
        return self._slots[1 + index]

    def stop(self) -> None:
        self._slots[0] = 1

    def stopped(self) -> bool:
        return self._slots[0] != 0


def run_consumer(args: argparse.Namespace) -> int:
    board = _Board(args.board)
    tally = _Tally(board, args.index)
    stopped = board.stopped
    extra: Dict[str, object] = {}
    if args.kind == "redis":
        import redis  # type: ignore

        client = redis.Redis(host="127.0.0.1", port=args.redis_port)
        last = "0-0"
        print("ready", flush=True)
        while not stopped():
            got = client.xread({args.stream: last}, count=2000, block=100)
            now_us = time.time_ns() // 1000
            for _, entries in got or ():
                sent = []
                nbytes = 0
                for entry_id, fields in entries:
                    last = entry_id
                    value = fields[b"v"]
                    sent.append(int(value.split(b" ", 1)[0]))
                    nbytes += len(value)
                tally.add_many(np.array(sent, dtype=np.int64), now_us, nbytes)
                tally.last_at = time.time()
            tally.tick()
    elif args.kind in ("grpc", "grpc3"):
        import _grpc_floor

        relays = args.floor_endpoint.split(",")
        ch = _grpc_floor.channel(relays[args.index % 3] if args.kind == "grpc3" else relays[0])
        pushed = _grpc_floor.follow(ch)
        done = threading.Event()

        def watch_stop() -> None:  # the push stream blocks: end it when the parent says so
            while not stopped():
                time.sleep(STOP_CHECK_S)
            done.set()
            pushed.cancel()

        threading.Thread(target=watch_stop, daemon=True).start()
        print("ready", flush=True)
        try:
            for message in pushed:
                now_us = time.time_ns() // 1000
                sent = np.frombuffer(message, dtype=np.int64).reshape(-1, MESSAGE_BYTES // 8)[:, 0]
                tally.add_many(sent, now_us, len(message))
                tally.last_at = time.time()
                tally.tick()
        except Exception:
            if not done.is_set():
                raise
        ch.close()
    else:
        from pyspark_acs import Consumer

        kw = {}
        if args.kind == "caches":
            kw = {"data_cache": args.data_cache, "metadata_cache": args.metadata_cache}
        with Consumer(args.root, args.stream, **kw) as c:
            print("ready", flush=True)
            # The read path's counters when the steady state began (the first batch holding a
            # message sent after WARMUP_S): the store bytes and holds after it are the steady
            # state's (0 when the caches keep up), apart from a start-up burst.
            at_warm: Optional[Dict[str, int]] = None
            while not stopped():
                # batches() waits for news (the cached path wakes on a pushed length) instead
                # of spinning; it returns after 0.2 s without data so the stop is seen.
                for b in c.batches(timeout=0.2):
                    now_us = time.time_ns() // 1000
                    # Arrow batches are counted vectorized, as their users would: no per-message
                    # Python (Redis hands out one Python tuple per entry, so that column cannot).
                    values = b.column("value")
                    offsets = np.frombuffer(values.buffers()[1], dtype=np.int32, count=len(values) + 1,
                                            offset=4 * values.offset)
                    # The int64 microseconds under the timestamp column, viewed without a copy
                    # (a compute cast per batch cost a caught-up consumer ~10 % of its CPU).
                    stamps = b.column("timestamp")
                    sent = np.frombuffer(stamps.buffers()[1], dtype=np.int64, count=len(stamps),
                                         offset=8 * stamps.offset)
                    tally.add_many(sent, now_us, int(offsets[-1] - offsets[0]))
                    tally.last_at = time.time()
                    if at_warm is None and tally.warm:
                        at_warm = c.stats()
                    tally.tick()
                    if stopped():
                        break
                tally.tick()
            extra = c.stats()
            base = at_warm if at_warm is not None else {}  # never warm: all of it counts
            extra["steady_durable_bytes"] = extra.get("durable_bytes", 0) - base.get("durable_bytes", 0)
            extra["steady_store_holds"] = extra.get("store_holds", 0) - base.get("store_holds", 0)
    tally.tick()
    result = {"n": tally.n, "bytes": tally.nbytes, "samples": tally.samples, "last_at": tally.last_at,
              "durable_bytes": extra.get("durable_bytes", 0), "pushed_bytes": extra.get("pushed_bytes", 0), "store_holds": extra.get("store_holds", 0),
              "worst": tally.worst, "steady_durable_bytes": extra.get("steady_durable_bytes", 0),
              "steady_store_holds": extra.get("steady_store_holds", 0)}
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0


def run_producer(args: argparse.Namespace) -> int:
    rate = args.rate_mb * 1_000_000 / MESSAGE_BYTES  # messages per second
    sent = 0
    flushes: List[float] = []  # ms from send_many to flush's return, after WARMUP_S
    started = time.monotonic()
    first_send = time.time()
    end = started + args.seconds
    if args.kind == "redis":
        import redis  # type: ignore

        client = redis.Redis(host="127.0.0.1", port=args.redis_port)
        while time.monotonic() < end:
            due = int((time.monotonic() - started) * rate)
            if due > sent:
                pipe = client.pipeline(transaction=False)
                now_us = time.time_ns() // 1000
                for i in range(sent, due):
                    pipe.xadd(args.stream, {b"v": _payload(i, now_us)})
                pipe.execute()
                sent = due
            time.sleep(FLUSH_EVERY_S)
    elif args.kind in ("grpc", "grpc3"):
        import _grpc_floor

        channels = [_grpc_floor.channel(ep) for ep in args.floor_endpoint.split(",")]
        pubs = [_grpc_floor.publisher(ch) for ch in channels]
        # grpc: one relay. grpc3: the flush to the three data relays, then a length to the three
        # metadata relays, each acknowledged by all three before the next step.
        steps = [pubs] if args.kind == "grpc" else [pubs[:3], pubs[3:]]
        while time.monotonic() < end:
            due = int((time.monotonic() - started) * rate)
            if due > sent:
                payload = _floor_payload(due - sent, time.time_ns() // 1000)
                t0 = time.monotonic()
                for step, message in zip(steps, (payload, due.to_bytes(8, "little"))):
                    for pub in step:
                        pub.send(message)
                    for pub in step:
                        pub.ack()
                if t0 - started >= WARMUP_S:  # as the delays: start-up left out
                    flushes.append((time.monotonic() - t0) * 1000.0)
                sent = due
            time.sleep(FLUSH_EVERY_S)
        for ch in channels:
            ch.close()
    else:
        from pyspark_acs import Producer

        kw = {}
        if args.kind == "caches":
            kw = {"data_cache": args.data_cache, "metadata_cache": args.metadata_cache}
        value = b"x" * MESSAGE_BYTES
        with Producer(args.root, args.stream, shards=1, acknowledge=args.producer_acknowledge, **kw) as p:
            while time.monotonic() < end:
                due = int((time.monotonic() - started) * rate)
                if due > sent:
                    t0 = time.monotonic()
                    p.send_many([value] * (due - sent))  # stamped with the send time
                    p.flush()
                    if t0 - started >= WARMUP_S:  # as the delays: start-up left out
                        flushes.append((time.monotonic() - t0) * 1000.0)
                    sent = due
                time.sleep(FLUSH_EVERY_S)
    elapsed = time.monotonic() - started
    print(json.dumps({"sent": sent, "elapsed": elapsed, "first_send": first_send,
                      "flush_p50": percentile(flushes, 50), "flush_p99": percentile(flushes, 99)}), flush=True)
    return 0


# -- the parent -------------------------------------------------------------------------------


def _child(args: argparse.Namespace, role: str, kind: str, stream: str, extra: List[str]) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--role", role, "--kind", kind, "--stream", stream, "--root", args.root,
           "--rate-mb", str(args.rate_mb), "--seconds", str(args.seconds),
           "--producer-acknowledge", args.producer_acknowledge] + extra
    if kind == "caches":
        cmd += ["--data-cache", args.data_cache, "--metadata-cache", args.metadata_cache]
    if kind == "redis":
        cmd += ["--redis-port", str(args.redis_port)]
    if kind == "grpc":
        cmd += ["--floor-endpoint", args.floor_endpoint]
    if kind == "grpc3":
        cmd += ["--floor-endpoint", args.floor3_endpoints]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)


def run_point(args: argparse.Namespace, kind: str, n: int, servers: Dict[str, List[int]]) -> Dict[str, float]:
    """One column at one N. ``servers``: the server processes' pids by role, for CPU per GB."""
    stream = f"fan_{kind}_{n}_{time.monotonic_ns()}"
    if kind in ("caches", "durable"):
        from pyspark_acs.storage.store import DurableStore

        store = DurableStore(args.root)
        store.create_stream(stream, 1)
        store.close()
    work = Path(tempfile.mkdtemp(prefix="fanout-"))
    board = _Board(str(work / "board"), n)
    consumers: List[subprocess.Popen] = []
    hogs: List[subprocess.Popen] = []
    try:
        for i in range(n):
            consumers.append(_child(args, "consumer", kind, stream,
                                    ["--board", str(work / "board"), "--result", str(work / f"c{i}.json"),
                                     "--index", str(i)]))
        for proc in consumers:
            line = proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"a {kind} consumer did not start: {line!r}")
        progress(f"{kind}: {n} consumers ready; producing {args.rate_mb} MB/s for {args.seconds} s")
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
                for _ in range(args.hog)]
        cpu0 = {role: cpu_seconds(pids, descendants=False) for role, pids in servers.items()}
        ccpu0 = cpu_seconds([c.pid for c in consumers], descendants=False)
        producer = _child(args, "producer", kind, stream, [])
        out, _ = producer.communicate(timeout=args.seconds + 120)
        prod = json.loads(out.strip().splitlines()[-1])
        sent = prod["sent"]
        # Drain: until every consumer has everything, nothing moved for 3 s, or --drain passed.
        deadline = time.monotonic() + args.drain
        last_total, still_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            counts = [board.count(i) for i in range(n)]
            total = sum(counts)
            if min(counts) >= sent:
                break
            if total != last_total:
                last_total, still_since = total, time.monotonic()
            elif time.monotonic() - still_since > 3.0:
                break
            time.sleep(0.2)
        cpu1 = {role: cpu_seconds(pids, descendants=False) for role, pids in servers.items()}
        ccpu1 = cpu_seconds([c.pid for c in consumers], descendants=False)
        for hog in hogs:
            hog.kill()
            hog.wait()
        board.stop()
        results = []
        for i, proc in enumerate(consumers):
            proc.wait(timeout=60)
            results.append(json.loads((work / f"c{i}.json").read_text()))
    finally:
        for proc in consumers + hogs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    samples = [s for r in results for s in r["samples"]]
    by_second: Dict[int, List[float]] = {}
    for r in results:
        for second, ms in r.get("worst", {}).items():
            by_second.setdefault(int(second), []).append(ms)
    delivered = sum(r["bytes"] for r in results)
    last = max((r["last_at"] for r in results), default=0.0)
    span = max(1e-9, last - prod["first_send"])
    return {
        "sent": sent,
        "producer_mb_s": sent * MESSAGE_BYTES / prod["elapsed"] / 1e6,
        "flush_p50": prod["flush_p50"],
        "flush_p99": prod["flush_p99"],
        "mb_s": delivered / span / 1e6,
        "p50": percentile(samples, 50),
        "p99": percentile(samples, 99),
        "missing": sum(max(0, sent - r["n"]) for r in results),
        "durable_bytes": sum(r["durable_bytes"] for r in results),
        "pushed_bytes": sum(r["pushed_bytes"] for r in results),
        "store_holds": sum(r.get("store_holds", 0) for r in results),
        "steady_durable_bytes": sum(r.get("steady_durable_bytes", 0) for r in results),
        "steady_store_holds": sum(r.get("steady_store_holds", 0) for r in results),
        "cpu_per_gb": sum(cpu1[r] - cpu0[r] for r in servers) / max(delivered / 1e9, 1e-9),
        "cpu_per_gb_by_role": {r: (cpu1[r] - cpu0[r]) / max(delivered / 1e9, 1e-9) for r in servers},
        "client_cpu_per_gb": (ccpu1 - ccpu0) / max(delivered / 1e9, 1e-9),
        # second of the run -> (largest delay in ms, consumers whose delay passed SLOW_MS)
        "timeline": {sec: (max(v), sum(ms > SLOW_MS for ms in v)) for sec, v in sorted(by_second.items())},
    }


_CALLS = re.compile(r'^acs_cache_request_seconds_count\{[^}]*method="(\w+)"[^}]*\} (\S+)$', re.M)
_PUSHED = re.compile(r"^acs_cache_pushed_messages_total(?:\{[^}]*\})? (\S+)$", re.M)


def server_calls(dep: Any) -> Dict[str, Dict[str, float]]:
    """Requests handled so far by method, and push messages sent, summed over each role's
    servers (from their /metrics): what the servers spend their CPU on, per point."""
    import urllib.request

    out: Dict[str, Dict[str, float]] = {}
    for role in ("data", "metadata"):
        counts: Dict[str, float] = {}
        for server in dep.servers.get(role, []):
            if not server.metrics_url:
                continue
            try:
                text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
            except OSError:
                continue
            for method, value in _CALLS.findall(text):
                counts[method] = counts.get(method, 0.0) + float(value)
            for value in _PUSHED.findall(text):
                counts["pushed"] = counts.get("pushed", 0.0) + float(value)
        out[role] = counts
    return out


def plot(path: str, table: Dict[str, Dict[int, Dict[str, float]]]) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: pip install matplotlib (the bench extra)"
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, points in table.items():
        ns = sorted(points)
        a.plot(ns, [points[n]["p99"] for n in ns], marker="o", label=kind)
        b.plot(ns, [points[n]["mb_s"] for n in ns], marker="o", label=kind)
    a.set(xlabel="consumers", ylabel="delay p99 (ms)", yscale="log", title="delay p99")
    b.set(xlabel="consumers", ylabel="delivered MB/s", title="delivered MB/s")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--consumers", default="8,32,64", help="consumer counts, comma-separated (default 8,32,64)")
    p.add_argument("--seconds", type=float, default=10.0, help="producing time per point (default 10)")
    p.add_argument("--drain", type=float, default=None, help="most seconds to wait for consumers (default 2x seconds)")
    p.add_argument("--rate-mb", type=float, default=2.0, help="MB/s produced = received per consumer (default 2)")
    p.add_argument("--columns", default=",".join(COLUMNS), help=f"which of {','.join(COLUMNS)} (default all)")
    p.add_argument("--plot", default=str(Path(__file__).with_name("fanout.png")), help="PNG output")
    p.add_argument("--hog", type=int, default=0,
                   help="processes that spin on the CPU during every point, the same for every column: a busy "
                        "machine made repeatable (default 0)")
    p.add_argument("--producer-acknowledge", default=DEFAULT_ACKNOWLEDGE, choices=ACKNOWLEDGE_MODES,
                   help="our Producer's acknowledge mode (default published; see Producer)")
    # child-process arguments
    p.add_argument("--role", default="parent", choices=["parent", "consumer", "producer"], help=argparse.SUPPRESS)
    p.add_argument("--kind", default="caches", help=argparse.SUPPRESS)
    p.add_argument("--stream", default="", help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    p.add_argument("--board", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--data-cache", default="", help=argparse.SUPPRESS)
    p.add_argument("--metadata-cache", default="", help=argparse.SUPPRESS)
    p.add_argument("--redis-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--floor-endpoint", default="", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "consumer":
        return run_consumer(args)
    if args.role == "producer":
        return run_producer(args)

    from pyspark_acs.server.local.deploy import LocalDeployment

    ns = [int(x) for x in args.consumers.split(",")]
    columns = [c for c in args.columns.split(",") if c]
    args.drain = 2 * args.seconds if args.drain is None else args.drain
    base = Path(tempfile.mkdtemp(prefix="acs-fanout-"))
    args.root = str(base / "store")
    notes: List[str] = []
    redis_server = None
    floor_server = None
    floor3: List[Any] = []
    table: Dict[str, Dict[int, Dict[str, float]]] = {}
    dep = LocalDeployment(base / "caches", data_replicas=3, metadata_replicas=3, capacity="1GiB")
    try:
        if "caches" in columns:
            dep.start()
            args.data_cache, args.metadata_cache = dep.data_endpoints, dep.metadata_endpoints
        cache_pids = {role: [s.pid for s in dep.servers[role] if s.pid] for role in ("data", "metadata")}
        if "redis" in columns:
            binary = shutil.which("redis-server")
            try:
                import redis  # type: ignore  # noqa: F401
            except ImportError:
                binary = None
            if binary is None:
                notes.append("redis column skipped: install redis-server (as root: apt-get install -y redis-server) "
                              "and the redis client (pip install redis)")
                columns.remove("redis")
            else:
                import redis  # type: ignore

                redis_server = RedisServer(binary)
                redis_server.wait(redis)
                args.redis_port = redis_server.port
        if "grpc" in columns:
            floor_server = _grpc_floor.FloorServer()
            args.floor_endpoint = floor_server.endpoint
        if "grpc3" in columns:
            floor3 = [_grpc_floor.FloorServer() for _ in range(6)]
            args.floor3_endpoints = ",".join(f.endpoint for f in floor3)
        for n in ns:
            for kind in columns:
                pids = {"caches": cache_pids, "redis": {"redis": [redis_server.proc.pid] if redis_server else []},
                        "grpc": {"relay": [floor_server.pid] if floor_server else []},
                        "grpc3": {"data": [f.pid for f in floor3[:3]], "metadata": [f.pid for f in floor3[3:]]},
                        }.get(kind, {})
                calls0 = server_calls(dep) if kind == "caches" else None
                table.setdefault(kind, {})[n] = run_point(args, kind, n, pids)
                r = table[kind][n]
                if calls0 is not None:
                    calls1 = server_calls(dep)
                    progress(f"{kind} N={n} server requests (pushed: push messages): " + "; ".join(
                        f"{role} " + ", ".join(f"{m} {calls1[role][m] - calls0[role].get(m, 0.0):.0f}"
                                               for m in sorted(calls1[role]))
                        for role in calls1))
                progress(f"{kind} N={n} per second sent, largest delay ms (consumers over {SLOW_MS:g} ms): "
                         + " ".join(f"{sec}:{ms:.0f}({slow})" for sec, (ms, slow) in r["timeline"].items()))
                progress(f"{kind} N={n}: {r['mb_s']:.1f} MB/s, p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms, "
                         f"missing {r['missing']}"
                         + (f", producer flush p50 {r['flush_p50']:.1f} ms p99 {r['flush_p99']:.1f} ms"
                            if r["flush_p50"] == r["flush_p50"] else ""))
    except KeyboardInterrupt:
        notes.append("interrupted")
    finally:
        if redis_server is not None:
            redis_server.stop()
        for f in ([floor_server] if floor_server is not None else []) + floor3:
            f.stop()
        dep.stop()
        shutil.rmtree(base, ignore_errors=True)

    print(f"\n== fan-out: 1 producer of {MESSAGE_BYTES} B messages at {args.rate_mb} MB/s, N consumers, "
          f"{args.seconds:g} s per point" + (f", {args.hog} spinning processes beside" if args.hog else ""))
    header = (f"{'column':<8} {'N':>3} {'MB/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'missing':>8} {'durable B':>10} "
              f"{'steady B':>10} {'pushed MB':>9} {'holds':>7} {'CPU s/GB':>9} {'client s/GB':>11} {'producer MB/s':>13}")
    print(header)
    print(f"  (durable B: bytes our consumers read from the store; steady B and the holds after the '/': those "
          f"after the warm-up, {WARMUP_S:g} s of sending, that the delays leave out too)")
    for n in ns:
        for kind in table:
            r = table[kind].get(n)
            if r is None:
                continue
            cpu = f"{r['cpu_per_gb']:.1f}" if kind != "durable" else "-"
            print(f"{kind:<8} {n:>3} {r['mb_s']:>7.1f} {r['p50']:>8.1f} {r['p99']:>8.1f} {r['missing']:>8} "
                  f"{r['durable_bytes']:>10} {r['steady_durable_bytes']:>10} {r['pushed_bytes'] / 1e6:>9.1f} "
                  f"{str(r['store_holds']) + '/' + str(r['steady_store_holds']):>7} {cpu:>9} "
                  f"{r['client_cpu_per_gb']:>11.1f} {r['producer_mb_s']:>13.2f}")
    roles = [f"  {kind} N={n}: " + ", ".join(f"{role} {v:.2f}" for role, v in r["cpu_per_gb_by_role"].items())
             for kind in table for n, r in table[kind].items() if len(r["cpu_per_gb_by_role"]) > 1]
    if roles:
        print("\nserver CPU s/GB by role")
        print("\n".join(roles))
    for peer in ("redis", "grpc", "grpc3"):
        if peer not in table:
            continue
        print(f"\n{'ours' if peer == 'redis' else 'ours and redis'} / {peer} "
              "(MB/s: higher is better; p99 and CPU/GB: lower is better)")
        for kind in [k for k in ("caches", "durable", "grpc", "grpc3", "redis") if k != peer]:
            for n in ns:
                if peer == "redis" and kind.startswith("grpc"):
                    continue  # printed under the grpc floor, as redis / grpc
                r, q = table.get(kind, {}).get(n), table[peer].get(n)
                if r is None or q is None:
                    continue
                cpu = f"{r['cpu_per_gb'] / q['cpu_per_gb']:.2f}" if kind != "durable" and q["cpu_per_gb"] else "-"
                client = r["client_cpu_per_gb"] / max(q["client_cpu_per_gb"], 1e-9)
                print(f"  {kind:<8} N={n:>3}: MB/s {r['mb_s'] / max(q['mb_s'], 1e-9):.2f}x  "
                      f"p99 {r['p99'] / max(q['p99'], 1e-9):.2f}x  server CPU/GB {cpu}x  client CPU/GB {client:.2f}x")
    # Where the CPU goes: the cores the asked load (N x rate) needs by each column's measured
    # CPU per GB -- on this machine the sum must stay below os.cpu_count() to keep up.
    print(f"\nCPU the asked load needs ({os.cpu_count()} cores here): consumers + servers, in cores")
    for n in ns:
        gb_s = n * args.rate_mb / 1000.0
        parts = []
        for kind in table:
            r = table[kind].get(n)
            if r is not None:
                server = r["cpu_per_gb"] * gb_s if kind != "durable" else 0.0
                parts.append(f"{kind} {r['client_cpu_per_gb'] * gb_s:.2f} + {server:.2f}")
        print(f"  N={n:>3}: " + "   ".join(parts))
    note = plot(args.plot, table) if table else None
    if note:
        notes.append(note)
    elif table:
        print(f"\nplot: {args.plot}")
    for line in notes:
        print(f"note: {line}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
