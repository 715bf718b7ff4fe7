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
our/Redis ratios; and it writes a PNG scale sheet (``--plot``): p99, delivered MB/s, server
CPU per GB and consumer CPU per GB against N, one panel each.

    .venv/bin/python benchmarks/fanout.py [--consumers 8,32,64] [--seconds 10] [--rate-mb 2]
    .venv/bin/python benchmarks/fanout.py --consumers 8,32,64,96 --rate-mb 1 --columns caches,redis  # scale sheet
    .venv/bin/python benchmarks/fanout.py --consumers 4 --seconds 3       # smoke run
    .venv/bin/python benchmarks/fanout.py --consumers 32 --producer-acknowledge durable   # ack at the durable append
    .venv/bin/python benchmarks/fanout.py --consumers 64 --columns caches,redis --hog 1   # a busy machine
    .venv/bin/python benchmarks/fanout.py --mode spike --consumers 32 --columns caches,redis  # all join at once
    .venv/bin/python benchmarks/fanout.py --producer default --consumers 32 --columns caches,redis

Per column and N it also prints, per second of the run (by send time), the largest delay and
how many consumers passed ``SLOW_MS`` in it: whether a p99 came from a start-up burst, a
stall of everyone at once (the producer or a server) or a few slow consumers. ``--hog K``
runs K processes spinning on the CPU beside every point, the same for every column: the
machine's busy phases (other tenants) made repeatable.

``--producer`` picks our columns' producer: ``tuned`` (default) is ``send_many`` of the
messages due and ``flush()`` every 10 ms; ``default`` is how an application that never tunes
would send: about every 1 ms, one ``send()`` per message that is due, never ``flush()`` (the
Producer's own batching cuts the blocks; ``close()`` flushes at the end). Redis keeps its
``XADD`` pipeline every 10 ms either way, its normal use.

``--mode spike`` (default ``steady``: all of the above) measures N consumers joining a running
stream at once. The N consumer processes start first with everything imported (pyspark_acs,
grpc and the generated protobuf modules, or redis) but nothing connected, say ready and wait
on the board (the shared memory map) for the join. The parent starts the producer, waits ``--join-after`` seconds
(default 3: past the producer's start-up), stores the join time and sets the join; every
consumer then creates ``Consumer(root, stream, start="latest", data_cache=...,
metadata_cache=...)`` at once, its connect included (Redis: ``XREAD`` from ``$`` until entries
come, then from the last id). The producer goes on until ``--seconds`` after the join. Every
message carries its sequence (ours in the value's first 8 bytes, Redis in its payload) and
send time; the producer keeps each message's send time (taken right before the call that
sends it). Per column and N it prints:

- delay p50/p99 over the messages sent from the join to ``--seconds`` after it (sampled as
  above), and the largest of all their delays;
- settle s: seconds from the join until the p99 of every later second (by send second,
  counted from the join) stays under 1.5x Redis's p99 of the same N (Redis against itself;
  ``>S`` when the last second is still over);
- delivered MB/s, all bytes received over the time from the join to the last receipt;
- durable B: bytes our consumers read from the durable store, and as % of the bytes
  delivered; the store holds;
- missing: a consumer at latest rightly skips what was sent before it could receive; it owes
  every message sent after that moment -- for ours when ``Consumer()`` returned, for Redis
  when its first ``XREAD`` from ``$`` returned entries (the first moment a Redis client knows
  where ``$`` put it; a later moment than ours, so Redis is counted no stricter). Missing are
  the owed sequences it did not receive, summed over the consumers;
- connect ms: from the join to that moment, p50 and max over the consumers (for Redis it
  includes waiting for the next pipeline, up to 10 ms).

``grpc3`` joins in our deployment's shape: each consumer connects to all six relays (a
Consumer's connect: 3 data + 3 metadata replicas) and follows one from its next flush on; ready
when the follow is up. ``grpc`` (one relay) is skipped in a spike.

No assertion is timed here; an honest miss is printed as it is.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import resource
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
#: ``--mode``: consumers there from the start (steady), or all joining a running producer (spike).
MODES = ("steady", "spike")
#: The columns a spike runs (the one-relay grpc floor has no shape of ours to join in).
SPIKE_COLUMNS = ("caches", "durable", "redis", "grpc3")
#: ``--producer`` (our columns): send_many + flush every FLUSH_EVERY_S, or send() per message.
PRODUCERS = ("tuned", "default")
#: How long a consumer may take to stop after the end before it is killed (seconds).
STOP_WAIT_S = 60.0
#: How often the ``default`` producer sends the messages that are due (seconds).
SEND_EVERY_S = 0.001
#: How often a consumer waiting for the spike's join looks at the board (seconds): the join is
#: seen within this, which its connect time includes.
JOIN_CHECK_S = 0.002
#: A column has settled once every later second's p99 stays under this times Redis's p99.
SETTLE_FACTOR = 1.5
#: Seconds a spike's producer goes on past join_after + seconds when the join never comes.
JOIN_LATE_S = 60.0


# -- child processes --------------------------------------------------------------------------


def _floor_payload(count: int, now_us: int, first: int = 0) -> bytes:
    """``count`` messages for the grpc floor column: each starts with its send time and its
    sequence (from ``first``), 8 bytes each (little-endian), read back vectorized."""
    stamp, fill = now_us.to_bytes(8, "little"), b"x" * (MESSAGE_BYTES - 16)
    return b"".join(stamp + (first + i).to_bytes(8, "little") + fill for i in range(count))


def _payload(i: int, now_us: int) -> bytes:
    head = b"%d %d " % (now_us, i)
    return head + b"x" * (MESSAGE_BYTES - len(head))


_FILL = b"x" * (MESSAGE_BYTES - 8)


def _seq_value(i: int) -> bytes:
    """Our columns' message in a spike: its sequence as 8 bytes (little-endian), read back
    vectorized; the send time is the Producer's timestamp, as in the steady state."""
    return i.to_bytes(8, "little") + _FILL


def _seqs(values: "Any", offsets: "Any") -> "Any":
    """The sequences at the start of every value of an Arrow binary array (``offsets``: its
    int32 offsets, as viewed by the consumer)."""
    data = np.frombuffer(values.buffers()[2], dtype=np.uint8)
    at = offsets[:-1].astype(np.int64)[:, None] + np.arange(8)
    return data[at].view("<i8").ravel()


def _own_cpu() -> float:
    """This process's CPU seconds (user + system, all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _runs(seqs: "Any") -> List[List[int]]:
    """Sorted distinct sequences as ``[first, end)`` runs: what a consumer received, compact."""
    if not len(seqs):
        return []
    u = np.unique(seqs)
    cut = np.flatnonzero(np.diff(u) != 1) + 1
    return [[int(run[0]), int(run[-1]) + 1] for run in np.split(u, cut)]


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
        #: In a spike, the send second (since the join) of each kept delay, beside it.
        self._seconds = np.empty(SAMPLES, dtype=np.int32)
        self._filled = 0
        #: A spike's window of send times whose delays count, ``[join, join + seconds)`` in µs
        #: (:meth:`spike`); None in the steady state (all after the warm-up count).
        self.window: Optional[tuple] = None
        #: In a spike: when the consumer could receive (Consumer() returned; Redis: the first
        #: XREAD from ``$`` that returned entries), µs; the sequences received, per batch.
        self.ready_us: Optional[int] = None
        #: In a spike: when the first message sent after the join was received (µs).
        self.first_us: Optional[int] = None
        #: This process's CPU seconds at the join, when it could receive and at the first message.
        self.cpu_join = self.cpu_ready = self.cpu_first = float("nan")
        self._seq_parts: List[Any] = []
        self.next_seq = 0
        self.last_at = 0.0
        self.first_sent_us: Optional[int] = None
        #: Whether a message sent after the warm-up came (the steady state began).
        self.warm = False
        self._rng = np.random.default_rng(os.getpid())
        #: Largest delay (ms) of the messages sent in each second of the run, by that second
        #: (counted from the first message): where a p99 came from, printed per column.
        self.worst: Dict[int, float] = {}

    def spike(self, join_us: int, seconds: float) -> None:
        """Count, from now on, the delays of the messages sent in ``[join, join + seconds)``,
        with their seconds counted from the join, and the sequences received."""
        self.window = (join_us, join_us + int(seconds * 1e6))
        self.cpu_join = _own_cpu()
        self.first_sent_us = join_us  # the timeline's origin

    @property
    def samples(self) -> List[float]:
        """At most :data:`SAMPLES` of the delays, drawn uniformly without replacement."""
        return self.draw()[0]

    def draw(self) -> "tuple":
        """At most :data:`SAMPLES` of the delays (ms) and their send seconds (spike), drawn
        uniformly without replacement, as lists."""
        at = np.arange(self._filled)
        if len(at) > SAMPLES:
            at = self._rng.choice(at, SAMPLES, replace=False)
        return self._delays[at].astype(np.float64).tolist(), self._seconds[at].tolist()

    @property
    def largest(self) -> float:
        """The largest of all the delays kept (ms), not only of the drawn ones."""
        return float(self._delays[: self._filled].max()) if self._filled else float("nan")

    @property
    def runs(self) -> List[List[int]]:
        return _runs(np.concatenate(self._seq_parts)) if self._seq_parts else []

    def add_many(self, sent_us: "Any", now_us: int, nbytes: int, seqs: "Any" = None) -> None:
        """A batch of messages (``sent_us``: a numpy int64 array of send times, µs) received
        at ``now_us``, ``nbytes`` of values in all (``seqs``: their sequences, in a spike)."""
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
        if self.window is None:
            kept = sent_us[sent_us - self.first_sent_us >= WARMUP_S * 1e6]
        else:
            kept = sent_us[(sent_us >= self.window[0]) & (sent_us < self.window[1])]
            if self.first_us is None and len(kept):
                self.first_us = now_us
                self.cpu_first = _own_cpu()
            if seqs is not None and len(seqs):
                self._seq_parts.append(np.array(seqs, dtype=np.int64))  # a copy: not the batch's buffer
                self.next_seq = max(self.next_seq, int(self._seq_parts[-1].max()) + 1)
        k = len(kept)
        if k:
            self.warm = True
            if self._filled + k > len(self._delays):
                size = max(2 * len(self._delays), self._filled + k)
                for name, dtype in (("_delays", np.float32), ("_seconds", np.int32)):
                    grown = np.empty(size, dtype=dtype)
                    grown[: self._filled] = getattr(self, name)[: self._filled]
                    setattr(self, name, grown)
            delays = self._delays[self._filled : self._filled + k]
            delays[:] = now_us - kept  # in int64 (the stamps are ~1.8e15 us), then as float32 ms
            delays /= 1000.0
            if self.window is not None:
                self._seconds[self._filled : self._filled + k] = (kept - self.window[0]) // 1_000_000
            self._filled += k

    def tick(self) -> None:
        """Show the progress to the parent (a store into shared memory): the running count, or
        in a spike the next sequence (consumers joining at latest do not receive them all)."""
        self.board.set_count(self.index, self.n if self.window is None else self.next_seq)


class _Board:
    """What the parent, a point's producer and its consumers share, in one memory-mapped file
    of int64 slots: slot 0 the parent's stop, slot 1 a spike's join, slot 2 the join's time
    (µs, stored before the join), slot 3 + i consumer i's progress (:meth:`_Tally.tick`).

    A store into mapped memory, no system call. A count file per consumer (open, write, rename
    over the last one every 0.25 s) blocks on ext4, which starts writing a file's data back when
    it is renamed over another: at N=64 such an instrument holds up the system it measures.
    """

    FIRST = 3  # the first consumer's slot

    def __init__(self, path: str, consumers: Optional[int] = None) -> None:
        if consumers is not None:  # the parent makes it
            with open(path, "wb") as f:
                f.truncate(8 * (consumers + _Board.FIRST))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self._slots = memoryview(self._map).cast("q")  # aligned 8-byte stores: never torn on x86-64

    def set_count(self, index: int, n: int) -> None:
        self._slots[self.FIRST + index] = n

    def count(self, index: int) -> int:
        return self._slots[self.FIRST + index]

    def join(self, join_us: int) -> None:
        self._slots[2] = join_us  # before the flag: whoever sees the join sees its time
        self._slots[1] = 1

    def joined(self) -> Optional[int]:
        """The join's time (µs) once the parent set it, else None."""
        return self._slots[2] if self._slots[1] else None

    def wait_join(self) -> Optional[int]:
        """Wait for the join (None: the parent stopped first)."""
        while not self._slots[1]:
            if self.stopped():
                return None
            time.sleep(JOIN_CHECK_S)
        return self._slots[2]

    def stop(self) -> None:
        self._slots[0] = 1

    def stopped(self) -> bool:
        return self._slots[0] != 0


def run_consumer(args: argparse.Namespace) -> int:
    board = _Board(args.board)
    tally = _Tally(board, args.index)
    stopped = board.stopped
    extra: Dict[str, object] = {}
    spike = args.mode == "spike"

    def join() -> bool:
        """Spike: say ready (imported, nothing connected) and wait for the join; False when
        the parent stopped first."""
        print("ready", flush=True)
        join_us = board.wait_join()
        if join_us is None:
            return False
        tally.spike(join_us, args.seconds)
        return True

    if args.kind == "redis":
        import redis  # type: ignore

        if spike and not join():
            return _write_result(args, tally, extra)
        client = redis.Redis(host="127.0.0.1", port=args.redis_port)  # connects at its first call
        # A spike reads from "$" (what arrives after the call) until the first entries come,
        # then on from the last id.
        last = "$" if spike else "0-0"
        if not spike:
            print("ready", flush=True)
        while not stopped():
            got = client.xread({args.stream: last}, count=2000, block=100)
            now_us = time.time_ns() // 1000
            for _, entries in got or ():
                sent = []
                seqs: Optional[List[int]] = [] if spike else None
                nbytes = 0
                for entry_id, fields in entries:
                    last = entry_id
                    value = fields[b"v"]
                    if seqs is None:
                        sent.append(int(value.split(b" ", 1)[0]))
                    else:
                        stamp, seq, _ = value.split(b" ", 2)
                        sent.append(int(stamp))
                        seqs.append(int(seq))
                    nbytes += len(value)
                if spike and tally.ready_us is None:
                    tally.ready_us = now_us  # where "$" put it is known from now on
                    tally.cpu_ready = _own_cpu()
                tally.add_many(np.array(sent, dtype=np.int64), now_us, nbytes, seqs)
                tally.last_at = time.time()
            tally.tick()
    elif args.kind in ("grpc", "grpc3"):
        import _grpc_floor

        relays = args.floor_endpoint.split(",")
        import grpc._channel  # noqa: F401  (imported before the join, as ours)

        if spike and not join():
            return _write_result(args, tally, extra)
        ch = _grpc_floor.channel(relays[args.index % 3] if args.kind == "grpc3" else relays[0])
        others: List[Any] = []
        if spike:
            # A join in our deployment's shape: connected to all six servers (as a Consumer's
            # connect: 3 data + 3 metadata replicas), then following one. The floor's least.
            from pyspark_acs._grpc import grpc

            others = [_grpc_floor.channel(ep) for ep in relays if ep != relays[args.index % 3]]
            for other in others:
                grpc.channel_ready_future(other).result(timeout=30)
        pushed = _grpc_floor.follow(ch)
        if spike:
            tally.ready_us = time.time_ns() // 1000  # subscribed: every later flush comes
            tally.cpu_ready = _own_cpu()
        done = threading.Event()

        def watch_stop() -> None:  # the push stream blocks: end it when the parent says so
            while not stopped():
                time.sleep(STOP_CHECK_S)
            done.set()
            pushed.cancel()

        threading.Thread(target=watch_stop, daemon=True).start()
        if not spike:
            print("ready", flush=True)
        try:
            for message in pushed:
                now_us = time.time_ns() // 1000
                heads = np.frombuffer(message, dtype=np.int64).reshape(-1, MESSAGE_BYTES // 8)
                tally.add_many(heads[:, 0], now_us, len(message), heads[:, 1] if spike else None)
                tally.last_at = time.time()
                tally.tick()
        except Exception:
            if not done.is_set():
                raise
        for c in [ch] + others:
            c.close()
    else:
        from pyspark_acs import Consumer

        kw: Dict[str, Any] = {}
        if args.kind == "caches":
            kw = {"data_cache": args.data_cache, "metadata_cache": args.metadata_cache}
        if spike:
            if args.kind == "caches":
                # Imported before the join, as in a process that was running already: its
                # Consumer's connect (channels to the six servers) is what the join measures.
                import pyspark_acs.read.cachepath  # noqa: F401
                from pyspark_acs._grpc import grpc  # noqa: F401
                # The generated protobuf modules and the push streams too: what the first call
                # imports (half a Consumer()'s CPU here when left to the join).
                import grpc._channel  # noqa: F401
                import pyspark_acs.cache.push  # noqa: F401
                from pyspark_acs.cache.proto import acs_pb2_grpc  # noqa: F401
            if not join():
                return _write_result(args, tally, extra)
            kw["start"] = "latest"
        with Consumer(args.root, args.stream, **kw) as c:
            if spike:
                tally.ready_us = time.time_ns() // 1000
                tally.cpu_ready = _own_cpu()
            else:
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
                    tally.add_many(sent, now_us, int(offsets[-1] - offsets[0]),
                                   _seqs(values, offsets) if spike else None)
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
    return _write_result(args, tally, extra)


def _write_result(args: argparse.Namespace, tally: _Tally, extra: Dict[str, Any]) -> int:
    tally.tick()
    samples, seconds = tally.draw()
    result = {"n": tally.n, "bytes": tally.nbytes, "samples": samples, "last_at": tally.last_at,
              "durable_bytes": extra.get("durable_bytes", 0), "pushed_bytes": extra.get("pushed_bytes", 0), "store_holds": extra.get("store_holds", 0),
              "worst": tally.worst, "steady_durable_bytes": extra.get("steady_durable_bytes", 0),
              "steady_store_holds": extra.get("steady_store_holds", 0)}
    if tally.window is not None:
        result.update(sample_seconds=seconds, largest=tally.largest, ready_us=tally.ready_us, runs=tally.runs,
                      first_us=tally.first_us, cpu_join=tally.cpu_join, cpu_ready=tally.cpu_ready,
                      cpu_first=tally.cpu_first)
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
    spike = args.mode == "spike"
    # A spike: every message's send time (µs, taken right before the call that sends it; our
    # Producer stamps it a little later), for the parent to tell what each consumer owed.
    stamps: List[int] = []
    if spike:
        board = _Board(args.board)
        late = started + args.join_after + args.seconds + JOIN_LATE_S

        def producing() -> bool:  # until `seconds` after the join
            join_us = board.joined()
            if join_us is None:
                return time.monotonic() < late
            return time.time_ns() // 1000 < join_us + int(args.seconds * 1e6)
    else:
        def producing() -> bool:
            return time.monotonic() < end
    if args.kind == "redis":
        import redis  # type: ignore

        client = redis.Redis(host="127.0.0.1", port=args.redis_port)
        while producing():
            due = int((time.monotonic() - started) * rate)
            if due > sent:
                pipe = client.pipeline(transaction=False)
                now_us = time.time_ns() // 1000
                for i in range(sent, due):
                    pipe.xadd(args.stream, {b"v": _payload(i, now_us)})
                pipe.execute()
                if spike:
                    stamps.extend([now_us] * (due - sent))
                sent = due
            time.sleep(FLUSH_EVERY_S)
    elif args.kind in ("grpc", "grpc3"):
        import _grpc_floor

        channels = [_grpc_floor.channel(ep) for ep in args.floor_endpoint.split(",")]
        pubs = [_grpc_floor.publisher(ch) for ch in channels]
        # grpc: one relay. grpc3: the flush to the three data relays, then a length to the three
        # metadata relays, each acknowledged by all three before the next step.
        steps = [pubs] if args.kind == "grpc" else [pubs[:3], pubs[3:]]
        while producing():
            due = int((time.monotonic() - started) * rate)
            if due > sent:
                now_us = time.time_ns() // 1000
                payload = _floor_payload(due - sent, now_us, sent)
                if spike:
                    stamps.extend([now_us] * (due - sent))
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
            if args.producer == "default":
                # As an application would: one send() per message as it is due, never flush();
                # the Producer's own batching decides the blocks. close() flushes at the end.
                while producing():
                    due = int((time.monotonic() - started) * rate)
                    for i in range(sent, due):
                        if spike:
                            stamps.append(time.time_ns() // 1000)
                            p.send(_seq_value(i))
                        else:
                            p.send(value)
                    sent = max(sent, due)
                    time.sleep(SEND_EVERY_S)
            else:
                while producing():
                    due = int((time.monotonic() - started) * rate)
                    if due > sent:
                        t0 = time.monotonic()
                        if spike:
                            stamps.extend([time.time_ns() // 1000] * (due - sent))
                            p.send_many([_seq_value(i) for i in range(sent, due)])
                        else:
                            p.send_many([value] * (due - sent))  # stamped with the send time
                        p.flush()
                        if t0 - started >= WARMUP_S:  # as the delays: start-up left out
                            flushes.append((time.monotonic() - t0) * 1000.0)
                        sent = due
                    time.sleep(FLUSH_EVERY_S)
    elapsed = time.monotonic() - started
    if spike:
        np.asarray(stamps, dtype=np.int64).tofile(args.result)
    print(json.dumps({"sent": sent, "elapsed": elapsed, "first_send": first_send,
                      "first_send_us": stamps[0] if stamps else None,
                      "flush_p50": percentile(flushes, 50), "flush_p99": percentile(flushes, 99)}), flush=True)
    return 0


# -- the parent -------------------------------------------------------------------------------


def _child(args: argparse.Namespace, role: str, kind: str, stream: str, extra: List[str]) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--role", role, "--kind", kind, "--stream", stream, "--root", args.root,
           "--rate-mb", str(args.rate_mb), "--seconds", str(args.seconds),
           "--producer-acknowledge", args.producer_acknowledge, "--mode", args.mode, "--producer", args.producer,
           "--join-after", str(args.join_after)] + extra
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
        spike = args.mode == "spike"
        if spike:
            progress(f"{kind}: {n} consumers imported; producing {args.rate_mb} MB/s, they join after "
                     f"{args.join_after:g} s, then {args.seconds:g} s more")
        else:
            progress(f"{kind}: {n} consumers ready; producing {args.rate_mb} MB/s for {args.seconds} s")
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
                for _ in range(args.hog)]
        cpu0 = {role: cpu_seconds(pids, descendants=False) for role, pids in servers.items()}
        ccpu0 = cpu_seconds([c.pid for c in consumers], descendants=False)
        producer = _child(args, "producer", kind, stream,
                          ["--board", str(work / "board"), "--result", str(work / "sent.bin")] if spike else [])
        join_us = 0
        if spike:
            time.sleep(args.join_after)
            # The CPU from the join: what the spike and the run after it cost.
            cpu0 = {role: cpu_seconds(pids, descendants=False) for role, pids in servers.items()}
            ccpu0 = cpu_seconds([c.pid for c in consumers], descendants=False)
            join_us = time.time_ns() // 1000
            board.join(join_us)
        out, _ = producer.communicate(timeout=args.join_after + args.seconds + JOIN_LATE_S + 120)
        prod = json.loads(out.strip().splitlines()[-1])
        sent = prod["sent"]
        stamps = np.fromfile(work / "sent.bin", dtype=np.int64) if spike else None
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
        final_counts = [board.count(i) for i in range(n)]
        board.stop()
        results = []
        stuck: List[int] = []
        for i, proc in enumerate(consumers):
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                # Past capacity a consumer may still be catching up: its figures are lost, what it
                # lacks counts as missing (from the board).
                proc.kill()
                proc.wait()
                stuck.append(i)
                continue
            results.append(json.loads((work / f"c{i}.json").read_text()))
        if stuck:
            progress(f"{kind} N={n}: {len(stuck)} consumers had not stopped {STOP_WAIT_S:.0f} s after the end and "
                     "were killed; their delays and store bytes are left out, what they lacked counts as missing")
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
    span = max(1e-9, last - (join_us / 1e6 if spike else prod["first_send"]))
    point: Dict[str, Any] = {}
    if spike:
        point = _spike_figures(results, stamps, join_us, delivered)
        if prod["first_send_us"] is None or prod["first_send_us"] > join_us:
            progress(f"{kind} N={n}: the producer had not sent before the join (--join-after is shorter than its "
                     "start-up): the consumers joined an idle stream")
    return {
        "sent": sent,
        "producer_mb_s": sent * MESSAGE_BYTES / prod["elapsed"] / 1e6,
        "flush_p50": prod["flush_p50"],
        "flush_p99": prod["flush_p99"],
        "mb_s": delivered / span / 1e6,
        "p50": percentile(samples, 50),
        "p99": percentile(samples, 99),
        "missing": sum(max(0, sent - r["n"]) for r in results) + sum(max(0, sent - final_counts[i]) for i in stuck),
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
        **point,  # a spike's: its missing count replaces the steady state's
    }


def _spike_figures(results: List[Dict[str, Any]], stamps: "Any", join_us: int, delivered: int) -> Dict[str, Any]:
    """A spike's figures from its consumers' results and the producer's send times (µs, by
    sequence): the largest delay, each second's p99 (by send second from the join), the
    connect times and what each consumer missed of what it owed (every message sent after
    it could receive, ``ready_us``)."""
    per_second: Dict[int, List[float]] = {}
    for r in results:
        for ms, sec in zip(r["samples"], r["sample_seconds"]):
            per_second.setdefault(sec, []).append(ms)
    missing = 0
    connect: List[float] = []
    first_ms: List[float] = []  # from ready to the first message received
    for r in results:
        if r["ready_us"] is not None and r.get("first_us") is not None:
            first_ms.append((r["first_us"] - r["ready_us"]) / 1000.0)
        # A consumer that never could receive (Redis: no entries came) owed all after the join.
        ready = r["ready_us"] if r["ready_us"] is not None else join_us
        if r["ready_us"] is not None:
            connect.append((r["ready_us"] - join_us) / 1000.0)
        got = np.zeros(len(stamps), dtype=bool)
        for first, end in r["runs"]:
            got[first:end] = True
        missing += int(np.count_nonzero((stamps > ready) & ~got))
    largest = [r["largest"] for r in results if r["largest"] == r["largest"]]
    return {
        "max_ms": max(largest) if largest else float("nan"),
        "second_p99": {sec: percentile(v, 99) for sec, v in sorted(per_second.items())},
        "missing": missing,
        "connect_p50": percentile(connect, 50),
        "connect_max": max(connect) if connect else float("nan"),
        "connect_cpu_ms": _cpu_p50(results, "cpu_join", "cpu_ready"),
        "first_cpu_ms": _cpu_p50(results, "cpu_ready", "cpu_first"),
        "first_p50": percentile(first_ms, 50),
        "first_max": max(first_ms) if first_ms else float("nan"),
        "durable_pct": 100.0 * sum(r["durable_bytes"] for r in results) / max(delivered, 1),
    }


def _cpu_p50(results: List[Dict[str, Any]], since: str, until: str) -> float:
    """The consumers' median CPU ms between two of their marks (those that reached both)."""
    spans = [1e3 * (r[until] - r[since]) for r in results if r.get(since) is not None and r.get(until) is not None]
    return percentile([x for x in spans if x == x], 50)


def settle_seconds(r: Dict[str, Any], limit: float, seconds: float) -> str:
    """Seconds from the join until every later second's p99 (by send second) stays under
    ``limit`` ms: "0" when it never passed it, ">S" when the last second still did."""
    over = [sec for sec, p99 in r["second_p99"].items() if p99 >= limit]
    if not over:
        return "0"
    last = max(over) + 1
    return f">{seconds:g}" if last >= seconds else str(last)


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
    # The scale sheet: how delay and cost grow with N, one panel each (durable has no servers).
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    panels = (("p99", "delay p99 (ms)", True), ("mb_s", "delivered MB/s", False),
              ("cpu_per_gb", "server CPU s per GB delivered", False),
              ("client_cpu_per_gb", "consumer CPU s per GB delivered", False))
    for ax, (field, label, log_scale) in zip(axes.flat, panels):
        for kind, points in table.items():
            ns = [n for n in sorted(points) if field != "cpu_per_gb" or kind != "durable"]
            if ns:
                ax.plot(ns, [points[n][field] for n in ns], marker="o", label=kind)
        ax.set(xlabel="consumers", ylabel=label, title=label)
        if log_scale:
            ax.set_yscale("log")
        ax.legend()
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
    p.add_argument("--mode", default="steady", choices=MODES,
                   help="steady: consumers there from the start; spike: all join a running producer at once, "
                        "at latest (default steady)")
    p.add_argument("--join-after", type=float, default=3.0,
                   help="spike: seconds from the producer's start to the join, past its start-up (default 3)")
    p.add_argument("--producer", default="tuned", choices=PRODUCERS,
                   help="our columns' producer: tuned = send_many + flush every 10 ms; default = one send() "
                        "per message as it is due, never flush() (default tuned)")
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
    notes: List[str] = []
    if args.mode == "spike":
        skipped = [c for c in columns if c not in SPIKE_COLUMNS]
        if skipped:
            notes.append(f"{','.join(skipped)} skipped in a spike: the one-relay floor has no shape of ours to join in "
                         "nor sequences to count missing messages by")
        columns = [c for c in columns if c in SPIKE_COLUMNS]
    args.drain = 2 * args.seconds if args.drain is None else args.drain
    base = Path(tempfile.mkdtemp(prefix="acs-fanout-"))
    args.root = str(base / "store")
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
                since = "since the join" if args.mode == "spike" else "sent"
                progress(f"{kind} N={n} per second {since}, largest delay ms (consumers over {SLOW_MS:g} ms): "
                         + " ".join(f"{sec}:{ms:.0f}({slow})" for sec, (ms, slow) in r["timeline"].items()))
                if args.mode == "spike":
                    progress(f"{kind} N={n} per second since the join, p99 ms: "
                             + " ".join(f"{sec}:{ms:.1f}" for sec, ms in r["second_p99"].items())
                             + f"; connect p50 {r['connect_p50']:.0f} ms, max {r['connect_max']:.0f} ms"
                             + f"; first message after it p50 {r['first_p50']:.0f} ms, max {r['first_max']:.0f} ms"
                             + f"; consumer CPU p50 to connect {r['connect_cpu_ms']:.1f} ms, then to the first "
                             f"message {r['first_cpu_ms']:.1f} ms")
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
    ours = {"tuned": f"send_many + flush every {FLUSH_EVERY_S * 1000:g} ms",
            "default": "send() per message as due, no flush"}[args.producer]
    print(f"mode {args.mode}, producer {args.producer} (ours: {ours}; redis: XADD pipelined every "
          f"{FLUSH_EVERY_S * 1000:g} ms)" + (f", join after {args.join_after:g} s at latest" if args.mode == "spike"
                                            else ""))
    if args.mode == "spike":
        print_spike(args, ns, table)
    else:
        print_steady(ns, table)
    print_ratios(ns, table)
    print_cpu(args, ns, table)
    note = plot(args.plot, table) if table else None
    if note:
        notes.append(note)
    elif table:
        print(f"\nplot: {args.plot}")
    for line in notes:
        print(f"note: {line}")
    return 0


def print_spike(args: argparse.Namespace, ns: List[int], table: Dict[str, Dict[int, Dict[str, Any]]]) -> None:
    print(f"{'column':<8} {'N':>3} {'MB/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'settle s':>8} "
          f"{'missing':>8} {'durable B':>10} {'durable %':>9} {'holds':>6} {'connect ms':>11} {'producer MB/s':>13}")
    print(f"  (delays of the messages sent in the {args.seconds:g} s from the join; settle s: from the join until "
          f"each later second's p99 stays under {SETTLE_FACTOR:g}x redis's p99; missing: of the messages sent after "
          "each consumer could receive; connect ms: from the join to that, p50/max)")
    for n in ns:
        limit = SETTLE_FACTOR * table["redis"][n]["p99"] if n in table.get("redis", {}) else None
        for kind in table:
            r = table[kind].get(n)
            if r is None:
                continue
            settle = settle_seconds(r, limit, args.seconds) if limit is not None else "-"
            connect = f"{r['connect_p50']:.0f}/{r['connect_max']:.0f}"
            print(f"{kind:<8} {n:>3} {r['mb_s']:>7.1f} {r['p50']:>8.1f} {r['p99']:>8.1f} {r['max_ms']:>8.1f} "
                  f"{settle:>8} {r['missing']:>8} {r['durable_bytes']:>10} {r['durable_pct']:>9.1f} "
                  f"{r['store_holds']:>6} {connect:>11} {r['producer_mb_s']:>13.2f}")


def print_steady(ns: List[int], table: Dict[str, Dict[int, Dict[str, Any]]]) -> None:
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


def print_ratios(ns: List[int], table: Dict[str, Dict[int, Dict[str, Any]]]) -> None:
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


def print_cpu(args: argparse.Namespace, ns: List[int], table: Dict[str, Dict[int, Dict[str, Any]]]) -> None:
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


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
