"""The reader side of a copy operation: poll the source file, read new blocks, stream them.

Operations read through the one read path of the package
(:class:`~pyspark_acs.read.cachepath.CachedReadPath`, held by :class:`SourceFiles`): lengths
from the process's one :class:`~pyspark_acs.cache.poller.LengthPoller` of this cluster's
metadata cache, the store's lengths for files it does not know or while it is down, and the
store's real size when a published length stands still; bytes from the data cache with one
durable read per missing run, durable reads past the cache postponed by Algorithm 1. This
daemon's own writer reports every length it publishes (:meth:`SourceFiles.notify`), so in an
intermediate cluster the next hop starts at once instead of at the next poll.

A :class:`CopyOperation` copies one file to one storage of one child cluster over ONE
long-lived bidirectional gRPC stream: a hello, answered with the destination length to
continue from, then deltas of whole blocks. Durable operations wait for each acknowledgement
(sequential appends); cache operations keep up to ``cache_window`` deltas in flight. Bytes
come from that read path (durable operations read past the cache length at once). Blocks are
taken with :func:`~pyspark_acs.read.positions.read_blocks`, the read side's one block walk.
An operation ends when it has copied a sealed file to its end (the seal rule,
:mod:`pyspark_acs.read.positions`: a file is finished only at its seal; a torn block is copied
with the recovery seal that voids it).

Catch-up mode: a cache operation more than ``catchup_bytes`` behind jumps to the chunk at
the source's head, so a backlog is copied durable to durable and never floods the caches.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
from collections import deque
from typing import Callable, Deque, Dict, Optional, Set, Tuple

from pyspark_acs._grpc import grpc

from pyspark_acs.cache.chunks import CHUNK_SIZE
from pyspark_acs.cache.poller import LengthPoller
from pyspark_acs.errors import AcsError, StaleEpochError
from pyspark_acs.read.cachepath import CachedReadPath
from pyspark_acs.read.positions import read_blocks, skip_void, walk_blocks
from pyspark_acs.read.readpath import RateLimiter, open_read_path
from pyspark_acs.server.copy.cluster import CACHE, DURABLE, ClusterIO, OpKey
from pyspark_acs.server.copy.metrics import CopyMetrics
from pyspark_acs.server.copy.options import CopyDaemonOptions
from pyspark_acs.server.copy.proto import copy_pb2, copy_pb2_grpc

__all__ = [
    "CopyOperation",
    "SourceFiles",
]

log = logging.getLogger(__name__)

#: How long a reader waits for any acknowledgement before it reconnects.
ACK_TIMEOUT_S = 10.0
#: Sessions in a row that fail without progress before an operation gives up (its worker is
#: freed; the scheduler tries the file again after YIELD_S).
MAX_FRUITLESS_SESSIONS = 30


class OperationEnded(Exception):
    """Internal: the operation must stop (stopped, poisoned)."""


class SourceFiles:
    """The files this daemon copies, read through the one read path of its cluster.

    Holds one :class:`~pyspark_acs.read.cachepath.CachedReadPath` over the cluster's store and
    caches, fed by the process's shared :class:`~pyspark_acs.cache.poller.LengthPoller` of
    the metadata cache (no polling thread of its own). Operations and the scheduler's parked
    operations :meth:`follow` their file with an event that is set when its length moves.
    ``_lock`` guards ``_follows`` and ``_accounted``.

    Parameters
    ----------
    io : ClusterIO
        This (source) cluster.
    interval : float
        Poll interval of the metadata cache (the shared poller keeps the shortest asked for).
    """

    def __init__(self, io: ClusterIO, interval: float) -> None:
        self.io = io
        self.poller = LengthPoller.shared(io.meta_client.endpoints, interval=interval, security=io.meta_client.security)
        # push: the operations tail growing files, so the source's data cache pushes their
        # bytes as chunks land (one Follow stream per replica for the whole daemon) instead of
        # each operation asking for every flush (docs/cache.md).
        self.path: CachedReadPath = open_read_path(
            io.store, data_cache=io.data, metadata_cache=io.meta_client, poller=self.poller, push=True
        )
        self._lock = threading.Lock()
        self._follows: Dict[str, int] = {}
        self._accounted: Dict[Tuple[str, Optional[str]], int] = {}  # read-path counts already added to the metrics

    @property
    def store(self):
        """This cluster's files in either tier (the read path's
        :class:`~pyspark_acs.storage.tier.TieredStore`): the scheduler lists through it, so a
        sealed file the tier mover moved to the secondary store and deleted from the hot store
        is still found and copied (a destination added late, or whose daemon was down)."""
        return self.path.store

    def start(self) -> None:
        """Nothing to start: the shared poller runs while files are followed."""

    def stop(self) -> None:
        """Stop following every file (the shared poller stops once nothing is followed)."""
        with self._lock:
            follows, self._follows = self._follows, {}
        for rel, n in follows.items():
            for _ in range(n):
                self.poller.unfollow(self.io.uri(rel))

    def account(self, metrics: "CopyMetrics") -> None:
        """Add the bytes read through the read path since the last call to
        ``source_read_bytes_total`` by way (pushed, asked, durable), and its store holds to
        ``store_holds_total``."""
        stats = self.path.stats()
        now = {("source_read_bytes_total", "pushed"): stats["pushed_bytes"],
               ("source_read_bytes_total", "asked"): stats["cache_bytes"] - stats["pushed_bytes"],
               ("source_read_bytes_total", "durable"): stats["durable_bytes"],
               ("store_holds_total", None): stats["store_holds"]}
        with self._lock:
            last, self._accounted = self._accounted, now
        for (name, way), value in now.items():
            added = value - last.get((name, way), 0)
            if added > 0:
                metrics.inc(name, added, **({"way": way} if way else {}))

    def follow(self, rel: str, wake: Optional[threading.Event] = None) -> threading.Event:
        """Follow ``rel`` from now on; ``wake`` (returned; a new event if None) is set when its
        length moves (a poll, or a length this daemon's writer published)."""
        with self._lock:
            self._follows[rel] = self._follows.get(rel, 0) + 1
        self.path.lengths([rel])  # known to the read path from now on (notify raises it)
        return self.poller.follow(self.io.uri(rel), wake)

    def unfollow(self, rel: str, wake: Optional[threading.Event] = None) -> None:
        """Undo one :meth:`follow` of ``rel``; when its last follower is gone, the read path
        forgets the file."""
        with self._lock:
            n = self._follows.get(rel, 0) - 1
            if n < 0:
                return
            if n:
                self._follows[rel] = n
            else:
                del self._follows[rel]
        self.poller.unfollow(self.io.uri(rel), wake)
        if n == 0:
            self.path.forget(rel)

    def lengths(self, rel: str) -> Tuple[Optional[int], Optional[int]]:
        """``(cache length, durable length)`` of ``rel`` in bytes now (``None``: unknown),
        through the read path (the store's real size included when the published length
        stands still)."""
        self.path.lengths([rel])
        return self.path.published(rel)

    def notify(self, rel: str, cache_length: Optional[int] = None, durable_length: Optional[int] = None,
               data: Optional[Tuple[int, bytes]] = None) -> None:
        """This daemon's writer published a length of ``rel``: raise the known lengths and wake
        its followers at once; ``data`` = ``(start, bytes)`` it just wrote to the cache. Files
        this daemon does not copy are ignored."""
        with self._lock:
            if rel not in self._follows:
                return
        self.path.notify(rel, cache_length, durable_length, data)


class _Session:
    """One gRPC stream: requests go through a queue, acknowledgements come back on another."""

    _END = object()

    def __init__(self, stub: copy_pb2_grpc.CopyStub, wake: Optional[threading.Event] = None) -> None:
        self._requests: "queue.Queue" = queue.Queue()
        self.acks: "queue.Queue" = queue.Queue()
        self._wake = wake
        self.call = stub.Copy(self._iter_requests())
        self._thread = threading.Thread(target=self._pump, name="acs-copy-acks", daemon=True)
        self._thread.start()

    def _iter_requests(self):
        while True:
            item = self._requests.get()
            if item is self._END:
                return
            yield item

    def _pump(self) -> None:
        try:
            for ack in self.call:
                self._put(ack)
            self._put(None)
        except grpc.RpcError as exc:
            self._put(exc)

    def _put(self, item: object) -> None:
        self.acks.put(item)
        if self._wake is not None:
            self._wake.set()  # the operation waits for news of any kind on one event

    def send(self, req: copy_pb2.CopyRequest) -> None:
        self._requests.put(req)

    def next_ack(self, timeout: float) -> copy_pb2.CopyAck:
        try:
            item = self.acks.get(timeout=timeout)
        except queue.Empty:
            raise ConnectionError(f"no acknowledgement within {timeout:.1f} s") from None
        if item is None:
            raise ConnectionError("the writer closed the operation")
        if isinstance(item, grpc.RpcError):
            code = item.code() if hasattr(item, "code") else None
            raise ConnectionError(f"copy stream failed ({getattr(code, 'name', code)}): {item.details() if hasattr(item, 'details') else item}") from item
        return item

    def close(self) -> None:
        self._requests.put(self._END)
        self.call.cancel()
        self._thread.join(timeout=2)


class CopyOperation:
    """Copy one file to one storage of one child cluster until the file is complete there.

    Parameters
    ----------
    key : OpKey
    shards : int
        Shard count of the stream (sent so the writer can create the stream).
    io : ClusterIO
        This (source) cluster.
    poller : SourceFiles
        The daemon's source files (lengths and bytes through the one read path).
    stub_for : callable
        ``stub_for(cluster name) -> CopyStub`` of the child's daemon.
    is_source : bool
        This cluster is the stream's source.
    confirm : callable, optional
        ``confirm(stream, rel, child, length)`` with every durable length the child
        acknowledged (:meth:`~pyspark_acs.server.copy.confirm.Confirmer.confirm`).
    options : CopyDaemonOptions
    metrics : CopyMetrics
    operation_prefix : str
        Identifies this daemon replica in lease records.
    """

    def __init__(
        self,
        key: OpKey,
        shards: int,
        io: ClusterIO,
        poller: SourceFiles,
        stub_for: Callable[[str], copy_pb2_grpc.CopyStub],
        options: CopyDaemonOptions,
        metrics: CopyMetrics,
        operation_prefix: str,
        is_source: bool = False,
        confirm: Optional[Callable[[str, str, str, int], None]] = None,
    ) -> None:
        self.key = key
        self.is_source = is_source
        self._confirm = confirm if key.storage == DURABLE else None
        self.shards = shards
        self.io = io
        self.poller = poller
        self.stub_for = stub_for
        self.options = options
        self.metrics = metrics
        self.operation = f"{operation_prefix}_{secrets.token_hex(4)}"
        self.rel = key.rel
        self.uri = io.uri(self.rel)
        self.stop_event = threading.Event()
        self.finished = False
        self.poisoned = False
        #: Set when the operation gave up after MAX_FRUITLESS_SESSIONS failed sessions.
        self.gave_up = False
        self.limiter = RateLimiter(options.max_bytes_per_second or None)
        #: The one read path of this cluster (shared by every operation of the daemon), as this
        #: operation reads it: its position in the path's feed is its own (two destinations of
        #: one file read it at different positions).
        self.path = poller.path.for_reader(self.operation)
        #: Positions known to be block boundaries of the source (acked delta ends).
        self._boundaries: Set[int] = {0}
        self._tail_checked: Tuple[int, int] = (-1, -1)
        self._tail_sealed = False
        #: Where the last catch-up jump ended (the source's cache length then): not a position
        #: this operation reached by reading blocks, so it may be the file's seal.
        self._jumped_to = -1
        #: Set when the file's length moves (a poll, a length this daemon's writer published) and by acks.
        self._wake = threading.Event()
        #: Set once a hello was answered OK: for a durable operation the file exists at the
        #: destination from then on (the scheduler orders file creation by it).
        self.opened = threading.Event()
        #: The destination length last acknowledged (the scheduler parks caught-up idle operations).
        self.acked = 0
        #: The source store's size of the file when last looked at (a durable operation looks
        #: when the cache is ahead of every durable length it knows).
        self._stat_len = 0

    def stop(self) -> None:
        """Ask the operation to stop; :meth:`run` returns soon after. Thread-safe; does not wait."""
        self.stop_event.set()
        self._wake.set()

    # -- thread body -----------------------------------------------------------------------

    def run(self) -> None:
        """Copy until finished, poisoned or stopped; reconnect after errors. After
        :data:`MAX_FRUITLESS_SESSIONS` sessions in a row that failed without the destination
        acknowledging a byte more, give up (:attr:`gave_up`): the scheduler frees the worker
        slot and tries the file again later, so operations that cannot progress never hold
        every worker."""
        self.poller.follow(self.rel, self._wake)
        self.metrics.inc("operations", 1, role="reader", storage=self.key.storage)
        fruitless, best = 0, -1
        try:
            while not self.stop_event.is_set():
                try:
                    self._session()
                    return
                except OperationEnded:
                    return
                except (ConnectionError, AcsError, grpc.RpcError) as exc:
                    self.metrics.inc("errors_total", kind="reader")
                    if self.acked > best:
                        fruitless, best = 0, self.acked
                    fruitless += 1
                    if fruitless >= MAX_FRUITLESS_SESSIONS:
                        self.gave_up = True
                        self.metrics.inc("errors_total", kind="gave_up")
                        log.warning("%s: %d attempts in a row made no progress (last: %s); giving up for now",
                                    self.key, fruitless, exc)
                        return
                    log.info("%s: %s; retrying in %.2f s", self.key, exc, self.options.retry)
                    self.stop_event.wait(self.options.retry)
        finally:
            self.path.leave(self.rel)
            self.poller.unfollow(self.rel, self._wake)
            self.metrics.inc("operations", -1, role="reader", storage=self.key.storage)
            self.metrics.remove("lag_bytes", stream=self.key.stream, shard=self.key.shard,
                                target=self.key.child, storage=self.key.storage)

    # -- one stream ------------------------------------------------------------------------

    def _request(self, **fields) -> copy_pb2.CopyRequest:
        k = self.key
        return copy_pb2.CopyRequest(
            stream=k.stream, shard=k.shard, file=k.file,
            storage=copy_pb2.DURABLE if k.storage == DURABLE else copy_pb2.CACHE,
            shards=self.shards, operation=self.operation, source_cluster=self.io.name, **fields,
        )

    def _session(self) -> None:
        if self.is_source:
            meta = self.io.store.stream_meta(self.key.stream) or {}
            if meta.get("copied_from"):
                # This daemon's topology names its cluster the source, but a promotion made the
                # stream here a copy: copied on from here, the new history would fork its tree.
                self.metrics.inc("errors_total", kind="stale_topology")
                raise StaleEpochError(
                    f"stream {self.key.stream!r}: this daemon's topology names {self.io.name} its source, but "
                    f"{self.io.name} keeps a copy of it from {meta['copied_from']!r} (promotion epoch "
                    f"{meta.get('epoch', 0)}); not copied from here: give the daemon the current topology file")
        session = _Session(self.stub_for(self.key.child), self._wake)
        try:
            session.send(self._request(hello=True, **self.io.epoch_fields(self.key.stream)))
            ack = session.next_ack(ACK_TIMEOUT_S + 3 * self.options.lease_seconds)
            self._check(ack)
            self.acked = ack.length
            if self._confirm is not None:
                self._confirm(self.key.stream, self.rel, self.key.child, ack.length)
            self.opened.set()
            self._copy(session, ack.length)
        finally:
            session.close()

    def _check(self, ack: copy_pb2.CopyAck) -> None:
        if ack.status == copy_pb2.POISONED:
            self.poisoned = True
            self.metrics.inc("errors_total", kind="poisoned")
            log.info("%s: a newer operation took the file over; this one stops", self.key)
            raise OperationEnded()
        if ack.status == copy_pb2.FAILED:
            raise ConnectionError(f"writer failed: {ack.message}")

    def _source_lengths(self) -> Tuple[int, int]:
        c, d = self.poller.lengths(self.rel)
        return (c or 0), (d or 0)

    def _take_ack(self, ack: object, inflight: Deque[int]) -> int:
        """Apply one acknowledgement; return the acknowledged length."""
        if ack is None or isinstance(ack, grpc.RpcError):
            raise ConnectionError(f"copy stream ended: {ack!r}") from (ack if isinstance(ack, BaseException) else None)
        self._check(ack)
        if ack.status == copy_pb2.RESTART:
            log.info("%s: writer asks to restart at %d (%s)", self.key, ack.length, ack.message)
            self.metrics.inc("errors_total", kind="restart")
            # Later in-flight deltas would be refused too: reconnect, the hello says where to go on.
            raise ConnectionError(f"restart at {ack.length}: {ack.message}")
        inflight.popleft()
        self._boundaries.add(ack.length)
        if self._confirm is not None:
            self._confirm(self.key.stream, self.rel, self.key.child, ack.length)
        return ack.length

    def _copy(self, session: _Session, position: int) -> None:
        pos = acked = position
        inflight: Deque[int] = deque()
        window = 1 if self.key.storage == DURABLE else self.options.cache_window
        sealed = False
        while True:
            if self.stop_event.is_set():
                raise OperationEnded()
            # Cleared before looking: news arriving from here on (a poll round, a length our
            # own writer published, an ack) ends the wait below at once.
            self._wake.clear()
            # Collect acknowledgements that arrived; block while the window is full.
            while inflight:
                try:
                    if len(inflight) >= window:
                        ack = session.acks.get(timeout=ACK_TIMEOUT_S)
                    else:
                        ack = session.acks.get_nowait()
                except queue.Empty:
                    if len(inflight) >= window:
                        raise ConnectionError(f"no acknowledgement within {ACK_TIMEOUT_S:.1f} s") from None
                    break
                acked = self.acked = self._take_ack(ack, inflight)
            cache_len, durable_len = self._source_lengths()
            if self.key.storage == DURABLE and cache_len > max(durable_len, self._stat_len):
                # The feed pushed bytes the published durable length does not cover yet (a
                # pushed file is not watched): the store's own size says whether they are
                # durable, at once instead of when the length has stood still.
                self._stat_len = self.path.durable_length(self.rel) or 0
            if self.key.storage == DURABLE:
                durable_len = max(durable_len, self._stat_len)
            source_len = durable_len if self.key.storage == DURABLE else max(cache_len, durable_len)
            self.metrics.set("lag_bytes", max(0, source_len - acked), stream=self.key.stream, shard=self.key.shard,
                             target=self.key.child, storage=self.key.storage)
            if not inflight and pos == acked and (sealed or self._complete(pos)):
                self.finished = True
                self.metrics.inc("operations_finished_total", storage=self.key.storage)
                return
            sent = False
            if source_len > pos and len(inflight) < window and not sealed:
                if self.key.storage == CACHE and source_len - pos > self.options.catchup_bytes and cache_len > pos:
                    new_pos = self._jump(session, pos, cache_len, inflight)
                    sealed_now = False
                else:
                    new_pos, sealed_now = self._send_delta(session, pos, source_len, cache_len, durable_len, inflight)
                sent = new_pos > pos
                pos = new_pos
                sealed = sealed or sealed_now
            if sent:
                continue
            # Nothing to send now: sleep until a poll round, a local publish or an ack.
            self._wake.wait(self.options.poll_interval * 2)

    def _complete(self, pos: int) -> bool:
        """Whether the file is finished at ``pos`` although no delta we sent carried its seal
        (the destination already had the bytes when this operation started): the source's
        first seal lies at or below ``pos`` by the read side's seal rule (the header walk,
        :func:`walk_blocks`, passed it). A file ends at its FIRST seal, so this asks about
        ``pos``, not about the source's length: bytes after the seal (a deposed writer's late
        block) are no part of the file and never copied. Nothing else finishes a file."""
        # The store is the truth here (a published length can lag it): the seal must be in it,
        # and then the bytes below it never change, so one answer per (pos, store length) holds.
        # The position may lie past the seal, or past the store's length altogether: a cache
        # writer whose data cache lost the partial chunk at its cache length resumes at the next
        # chunk boundary (readers fetch the gap from the durable store), which may be past the
        # end of a file sealed below it; nothing is left to copy then either.
        durable = self.path.durable_length(self.rel) or 0
        at = min(pos, durable)
        if at == 0:
            return False
        if (pos, at) != self._tail_checked:
            self._tail_checked = (pos, at)
            # Walk from the last block boundary known before it, and remember where the walk
            # ended (a whole-file walk each time the copy catches up would cost O(n^2) on a
            # long file, e.g. a cache copy ahead of the store, whose acknowledged boundaries
            # lie past it); the walk stops after the file's first seal (the seal rule).
            start = max((b for b in self._boundaries if b < at), default=0)
            end, _, _, self._tail_sealed = walk_blocks(self.path, self.rel, start, at)
            self._boundaries.add(end)
        return self._tail_sealed

    # -- reading the source ----------------------------------------------------------------

    def _send_delta(self, session: _Session, pos: int, source_len: int, cache_len: int, durable_len: int,
                    inflight: Deque[int]) -> Tuple[int, bool]:
        """Send the whole blocks in ``[pos, source_len)``; return (new position, sealed)."""
        if pos not in self._boundaries:
            return self._resync(session, pos, source_len, inflight)
        if pos == self._jumped_to and self._complete(pos):
            # The jump, maybe still unacknowledged (the window lets deltas follow it at once),
            # ended at the file's seal: what follows it (a deposed writer's late block) is no
            # part of the file. read_blocks stops after a seal, but cannot know it starts at one.
            return pos, True
        data, blocks, corrupt, short = read_blocks(self.path, self.rel, pos, source_len,
                                                   self.options.max_delta_bytes, postpone=self.key.storage == CACHE)
        if not blocks and short and corrupt is None:
            return pos, False  # the read path cut the read short: the bytes come later, no torn block
        if not blocks:
            # A torn block: copied byte for byte together with the recovery seal that voids it
            # (readers downstream skip them by the same rule), never before that seal exists.
            void_end = skip_void(self.path, self.rel, pos, source_len)
            if void_end is None:
                if corrupt is not None:
                    raise corrupt
                return pos, False
            data = self.path.read(self.rel, pos, void_end, postpone=False)
            if len(data) < void_end - pos:
                return pos, False
            self._emit(session, pos, data, 0, True, inflight)
            self._boundaries.add(void_end)
            return void_end, True
        at, last = blocks[-1]
        end = at + last.size
        sealed = any(h.sealed for _, h in blocks)
        last_ts = max((h.last_ts for _, h in blocks if h.count), default=0)  # a seal block has no timestamp
        self._emit(session, pos, data[:end], last_ts, sealed, inflight)
        self._boundaries.add(pos + end)
        return pos + end, sealed

    def _resync(self, session: _Session, pos: int, source_len: int, inflight: Deque[int]) -> Tuple[int, bool]:
        """The destination stopped inside a block (a torn append, a jump): find the block
        boundary of the source at or before ``pos`` (a header walk from the start) and send the
        rest of the block that spans ``pos``."""
        boundary, _, _, sealed = walk_blocks(self.path, self.rel, 0, pos)
        self._boundaries.add(boundary)
        if boundary == pos or sealed:
            return pos, False  # a boundary after all (the next round sends from here), or past a seal
        data, blocks, _, _ = read_blocks(self.path, self.rel, boundary, source_len, pos - boundary + 1,
                                         postpone=False)
        if not blocks:
            return pos, False  # the block spanning pos is not complete yet
        end = boundary + blocks[0][1].size
        header = blocks[0][1]
        self._emit(session, pos, data[pos - boundary:end - boundary], header.last_ts if header.count else 0,
                   header.sealed, inflight)
        self._boundaries.add(end)
        return end, header.sealed

    def _jump(self, session: _Session, pos: int, cache_len: int, inflight: Deque[int]) -> int:
        """Catch-up mode: restart the cache copy at the chunk holding the source's cache length."""
        chunk_start = cache_len - cache_len % CHUNK_SIZE
        if chunk_start < pos:
            return pos
        data = self.path.read(self.rel, chunk_start, cache_len) if cache_len > chunk_start else b""
        if len(data) < cache_len - chunk_start:
            return pos  # the bytes are not readable yet; try again next round
        log.info("%s: %d bytes behind; the cache copy jumps to byte %d (catch-up mode)", self.key,
                 cache_len - pos, chunk_start)
        self.metrics.inc("errors_total", kind="catchup_jump")
        self._emit(session, chunk_start, data, 0, False, inflight, jump=True)
        self._boundaries.add(cache_len)
        self._jumped_to = cache_len
        return cache_len

    def _emit(self, session: _Session, start: int, data: bytes, last_ts: int, sealed: bool,
              inflight: Deque[int], jump: bool = False) -> None:
        self.limiter.acquire(len(data))
        session.send(self._request(start=start, data=data, last_timestamp_us=last_ts, sealed=sealed, jump=jump))
        inflight.append(start + len(data))
        self.poller.account(self.metrics)
