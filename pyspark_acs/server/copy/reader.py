"""The reader side of a copy operation: poll the source file, read new blocks, stream them.

A :class:`LengthPoller` (one background thread per daemon) reads the lengths of every file
being copied in one batched consistent read of this cluster's metadata cache every poll
interval (50 ms); for files the metadata cache does not know, or while it is down, the
durable store's lengths are used (paper section 2.4, "Readers"). This daemon's own writer
also reports every length it publishes (:meth:`LengthPoller.notify`), so in an intermediate
cluster the next hop starts at once instead of at the next poll.

A :class:`CopyOperation` copies one file to one storage of one child cluster over ONE
long-lived bidirectional gRPC stream: a hello, answered with the destination length to
continue from, then deltas of whole blocks. Durable operations wait for each acknowledgement
(sequential appends); cache operations keep up to ``cache_window`` deltas in flight. Bytes
come from the data cache first with the durable store as fallback (cache operations; durable
reads beyond the cache length are postponed by Algorithm 1) or from the durable store with
opportunistic cache reads (durable operations). An operation ends when it has copied a
sealed file to its end (the seal rule, :mod:`pyspark_acs.read.positions`: a file is finished
only at its seal; a torn block is copied with the recovery seal that voids it).

Catch-up mode: a cache operation more than ``catchup_bytes`` behind jumps to the chunk at
the source's head, so a backlog is copied durable to durable and never floods the caches.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Set, Tuple

import grpc

from pyspark_acs.format.block import HEADER_SIZE, parse_header, scan_blocks
from pyspark_acs.read.cachepath import DelayedDurableReads
from pyspark_acs.cache.chunks import CHUNK_SIZE, ChunkReader
from pyspark_acs.errors import AcsError, CacheError, CorruptFileError
from pyspark_acs.read.positions import ends_with_seal, skip_void
from pyspark_acs.read.readpath import DurableReadPath, RateLimiter
from pyspark_acs.server.copy.cluster import CACHE, DURABLE, ClusterIO, OpKey
from pyspark_acs.server.copy.metrics import CopyMetrics
from pyspark_acs.server.copy.options import CopyDaemonOptions
from pyspark_acs.server.copy.proto import copy_pb2, copy_pb2_grpc

__all__ = ["ACK_TIMEOUT_S", "DURABLE_POLL_INTERVAL_S", "CopyOperation", "LengthPoller", "OperationEnded"]

log = logging.getLogger(__name__)

#: How long a reader waits for any acknowledgement before it reconnects.
ACK_TIMEOUT_S = 10.0
#: The poller also reads every followed file's length from the durable store this often.
DURABLE_POLL_INTERVAL_S = 1.0
#: Largest delta a local writer hands to the next hop's readers with its notification (the
#: last one per file is kept while the file is followed); larger ones are read from the cache.
RECENT_MAX_BYTES = 1024 * 1024
#: After a metadata-cache failure the poller uses store lengths for this long.
_META_RETRY_S = 1.0


class OperationEnded(Exception):
    """Internal: the operation must stop (stopped, poisoned)."""


def _max_len(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None:
        return b
    return a if b is None else max(a, b)


class LengthPoller:
    """One thread polling the source lengths of all files being copied.

    ``lengths(rel)`` returns ``(cache length or None, durable length or None)``. Every
    follower registers a wake-up event, set after every poll round and whenever this
    daemon's own copy writer published a new length of the file (:meth:`notify`): an
    intermediate cluster's reader sends a delta as soon as its writer wrote it, without
    waiting for the next poll. ``_lock`` guards ``_rels``, ``_lengths`` and ``_round``.
    """

    def __init__(self, io: ClusterIO, interval: float) -> None:
        self.io = io
        self.interval = interval
        self._lock = threading.Lock()
        self._rels: Dict[str, List[threading.Event]] = {}
        self._lengths: Dict[str, Tuple[Optional[int], Optional[int]]] = {}
        self._recent: Dict[str, Tuple[int, bytes]] = {}
        self._round = 0
        self._meta_down_until = 0.0
        self._store_polled = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="acs-copy-poller", daemon=True)

    def start(self) -> None:
        """Start the polling thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop polling, wake every follower, and wait (up to 5 s) for the thread to end."""
        self._stop.set()
        self._wake_all()
        self._thread.join(timeout=5)

    def follow(self, rel: str, wake: Optional[threading.Event] = None) -> threading.Event:
        """Poll ``rel`` from now on; ``wake`` (returned; a new event if None) is set on news."""
        wake = wake if wake is not None else threading.Event()
        with self._lock:
            self._rels.setdefault(rel, []).append(wake)
        return wake

    def unfollow(self, rel: str, wake: Optional[threading.Event] = None) -> None:
        """Undo one :meth:`follow` of ``rel``; when its last follower is gone, forget its lengths.

        ``wake`` is the follower's event; when it is None or not registered, the most recently
        registered event of ``rel`` is dropped instead.
        """
        with self._lock:
            events = self._rels.get(rel)
            if events is None:
                return
            if wake is not None and wake in events:
                events.remove(wake)
            elif events:
                events.pop()
            if not events:
                self._rels.pop(rel, None)
                self._lengths.pop(rel, None)
                self._recent.pop(rel, None)

    def lengths(self, rel: str) -> Tuple[Optional[int], Optional[int]]:
        """``(cache length, durable length)`` of ``rel`` in bytes as last seen (``None``: unknown)."""
        with self._lock:
            return self._lengths.get(rel, (None, None))

    @property
    def rounds(self) -> int:
        """How many poll rounds have completed."""
        with self._lock:
            return self._round

    def notify(self, rel: str, cache_length: Optional[int] = None, durable_length: Optional[int] = None,
               data: Optional[Tuple[int, bytes]] = None) -> None:
        """This daemon's writer published a length of ``rel`` (a majority write, so a
        consistent read would return it): raise the known lengths and wake its followers.
        ``data`` = ``(start, bytes)``: the bytes it just wrote there, kept for :meth:`recent`."""
        with self._lock:
            events = self._rels.get(rel)
            if not events:
                return
            c, d = self._lengths.get(rel, (None, None))
            self._lengths[rel] = (_max_len(c, cache_length), _max_len(d, durable_length))
            if data is not None and 0 < len(data[1]) <= RECENT_MAX_BYTES:
                self._recent[rel] = (data[0], bytes(data[1]))
            events = list(events)
        for e in events:
            e.set()

    def recent(self, rel: str, start: int, end: int) -> Optional[bytes]:
        """Bytes ``[start, end)`` of ``rel`` if the last local write of it covers them."""
        with self._lock:
            got = self._recent.get(rel)
        if got is None or not (got[0] <= start and end <= got[0] + len(got[1])):
            return None
        return got[1][start - got[0]: end - got[0]]

    def _wake_all(self) -> None:
        with self._lock:
            events = [e for es in self._rels.values() for e in es]
        for e in events:
            e.set()

    def poll_once(self) -> None:
        """One poll round: read every followed file's lengths, raise the known ones, wake all followers.

        Known lengths never shrink. After a metadata-cache failure, store lengths are used for a
        second; every ``DURABLE_POLL_INTERVAL_S`` all files are also checked in the store. Not
        meant to run concurrently with itself (the polling thread calls it).

        Raises
        ------
        StoreError
            When the durable store cannot be asked.
        """
        with self._lock:
            rels = list(self._rels)
        if not rels:
            return
        published: Dict[str, Tuple[Optional[int], Optional[int]]] = {}
        now = time.monotonic()
        if now >= self._meta_down_until:
            uris = [self.io.uri(r) for r in rels]
            try:
                got = self.io.meta.lengths(uris)
                published = {r: got[u] for r, u in zip(rels, uris)}
            except CacheError as exc:
                self._meta_down_until = now + _META_RETRY_S
                log.warning("metadata cache of %s unavailable, copying from durable lengths: %s", self.io.name, exc)
        # Files the metadata cache does not know (or all, while it is down): the store's lengths.
        # Every DURABLE_POLL_INTERVAL_S all files are checked in the store too: a writer killed
        # between its append and its publish leaves a published length behind the file.
        if now - self._store_polled >= DURABLE_POLL_INTERVAL_S:
            self._store_polled = now
            unknown = rels
        else:
            unknown = [r for r in rels if published.get(r, (None, None))[1] is None]
        durable = self.io.store.lengths(unknown) if unknown else {}
        out = {}
        for r in rels:
            c, d = published.get(r, (None, None))
            if r in durable and durable[r] is not None:
                d = max(d or 0, durable[r])
            out[r] = (c, d)
        with self._lock:
            for r, (c, d) in out.items():
                if r in self._rels:
                    # Lengths never shrink: a notify() newer than this round's read stays.
                    old_c, old_d = self._lengths.get(r, (None, None))
                    self._lengths[r] = (_max_len(old_c, c), _max_len(old_d, d))
            self._round += 1
        self._wake_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
            except AcsError as exc:
                log.warning("length poll of %s failed: %s", self.io.name, exc)
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))


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
    poller : LengthPoller
    stub_for : callable
        ``stub_for(cluster name) -> CopyStub`` of the child's daemon.
    is_source : bool
        This cluster is the stream's source.
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
        poller: LengthPoller,
        stub_for: Callable[[str], copy_pb2_grpc.CopyStub],
        options: CopyDaemonOptions,
        metrics: CopyMetrics,
        operation_prefix: str,
        is_source: bool = False,
    ) -> None:
        self.key = key
        self.is_source = is_source
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
        self.limiter = RateLimiter(options.max_bytes_per_second or None)
        self.chunks = ChunkReader(io.data)
        self.delay = DelayedDurableReads()
        #: Positions known to be block boundaries of the source (acked delta ends).
        self._boundaries: Set[int] = {0}
        self._source_path = DurableReadPath(io.store)  # for the seal rule's checks (store is the truth)
        self._tail_checked = -1
        self._tail_sealed = False
        #: Set by the poller (a round, or a length this daemon's writer published) and by acks.
        self._wake = threading.Event()
        #: Set once a hello was answered OK: for a durable operation the file exists at the
        #: destination from then on (the scheduler orders file creation by it).
        self.opened = threading.Event()
        #: The destination length last acknowledged (the scheduler parks caught-up idle operations).
        self.acked = 0

    def stop(self) -> None:
        """Ask the operation to stop; :meth:`run` returns soon after. Thread-safe; does not wait."""
        self.stop_event.set()
        self._wake.set()

    # -- thread body -----------------------------------------------------------------------

    def run(self) -> None:
        """Copy until finished, poisoned or stopped; reconnect after errors."""
        self.poller.follow(self.rel, self._wake)
        self.metrics.inc("operations", 1, role="reader", storage=self.key.storage)
        try:
            while not self.stop_event.is_set():
                try:
                    self._session()
                    return
                except OperationEnded:
                    return
                except (ConnectionError, AcsError, grpc.RpcError) as exc:
                    self.metrics.inc("errors_total", kind="reader")
                    log.info("%s: %s; retrying in %.2f s", self.key, exc, self.options.retry)
                    self.stop_event.wait(self.options.retry)
        finally:
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
        session = _Session(self.stub_for(self.key.child), self._wake)
        try:
            session.send(self._request(hello=True))
            ack = session.next_ack(ACK_TIMEOUT_S + 3 * self.options.lease_seconds)
            self._check(ack)
            self.acked = ack.length
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
        """Whether the file is finished although no delta we sent carried its seal (the
        destination already had the bytes when this operation started): the source ends with
        a seal at ``pos``. Nothing else finishes a file."""
        # The store is the truth here (a published length can lag it).
        durable = self.io.store.lengths([self.rel])[self.rel] or 0
        if pos < durable or durable == 0:
            return False
        if durable != self._tail_checked:
            self._tail_checked = durable
            self._tail_sealed = ends_with_seal(self._source_path, self.rel, durable)
        return self._tail_sealed

    # -- reading the source ----------------------------------------------------------------

    def _read(self, start: int, end: int, cache_len: int, durable_len: int) -> bytes:
        """Source bytes ``[start, end)``: cache chunks first, durable for the rest.

        Stops short (returns a prefix) when the durable store does not have the bytes yet or
        Algorithm 1 postpones a durable read.
        """
        parts = []
        at = start
        cache_end = min(end, cache_len)
        local = self.poller.recent(self.rel, start, cache_end) if cache_end > start else None
        if local is not None:
            # This daemon's writer just wrote these bytes to the cache: no cache read needed.
            parts.append(local)
            at = cache_end
        elif cache_end > start:
            try:
                chunks = self.chunks.read(self.uri, start, cache_end)
            except CacheError:
                chunks = [(start, cache_end, None)]
            run = None
            for s, e, data in chunks + [(cache_end, cache_end, b"")]:
                if data is None:
                    run = s if run is None else run
                    continue
                if run is not None:
                    got = self.io.store.read(self.rel, run, s)  # one read per missing run (Fig. 6)
                    parts.append(got)
                    at = run + len(got)
                    run = None
                    if at < s:
                        return b"".join(parts)
                if data:
                    parts.append(data)
                    at = e
        if end > at:
            if self.key.storage == DURABLE or self.delay.should_read_durable(cache_len, durable_len):
                parts.append(self.io.store.read(self.rel, at, end))
        return b"".join(parts)

    def _send_delta(self, session: _Session, pos: int, source_len: int, cache_len: int, durable_len: int,
                    inflight: Deque[int]) -> Tuple[int, bool]:
        """Send the whole blocks in ``[pos, source_len)``; return (new position, sealed)."""
        if pos not in self._boundaries:
            return self._resync(session, pos, source_len, cache_len, durable_len, inflight)
        want = min(source_len, pos + self.options.max_delta_bytes)
        data = self._read(pos, want, cache_len, durable_len)
        corrupt: Optional[CorruptFileError] = None
        try:
            blocks = list(scan_blocks(data, path=self.uri, base=pos))
            if not blocks and len(data) >= HEADER_SIZE:
                header = parse_header(data, 0, path=self.uri, position=pos)
                if pos + header.size <= source_len and len(data) < header.size:
                    data = self._read(pos, pos + header.size, cache_len, durable_len)  # one block > max delta
                    blocks = list(scan_blocks(data, path=self.uri, base=pos))
        except CorruptFileError as exc:
            blocks, corrupt = [], exc
        if not blocks:
            # A torn block: copied byte for byte together with the recovery seal that voids it
            # (readers downstream skip them by the same rule), never before that seal exists.
            void_end = skip_void(self._source_path, self.rel, pos, source_len) if source_len - pos >= HEADER_SIZE else None
            if void_end is None:
                if corrupt is not None:
                    raise corrupt
                return pos, False
            data = self.io.store.read(self.rel, pos, void_end)
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

    def _resync(self, session: _Session, pos: int, source_len: int, cache_len: int, durable_len: int,
                inflight: Deque[int]) -> Tuple[int, bool]:
        """The destination stopped inside a block (a torn append, a jump): find the block
        boundaries of the source from its start and send up to the next one."""
        data = self.io.store.read(self.rel, 0, durable_len)
        end = 0
        last_ts = 0
        sealed = False
        for at, header in scan_blocks(data, path=self.uri):
            end = at + header.size
            self._boundaries.add(end)
            if end > pos:
                last_ts = header.last_ts if header.count else 0
                sealed = header.sealed
                break
        if end <= pos:
            return pos, False
        self._emit(session, pos, data[pos:end], last_ts, sealed, inflight)
        return end, sealed

    def _jump(self, session: _Session, pos: int, cache_len: int, inflight: Deque[int]) -> int:
        """Catch-up mode: restart the cache copy at the chunk holding the source's cache length."""
        chunk_start = cache_len - cache_len % CHUNK_SIZE
        if chunk_start < pos:
            return pos
        data = self._read(chunk_start, cache_len, cache_len, cache_len) if cache_len > chunk_start else b""
        if len(data) < cache_len - chunk_start:
            return pos  # the bytes are not readable yet; try again next round
        log.info("%s: %d bytes behind; the cache copy jumps to byte %d (catch-up mode)", self.key,
                 cache_len - pos, chunk_start)
        self.metrics.inc("errors_total", kind="catchup_jump")
        self._emit(session, chunk_start, data, 0, False, inflight, jump=True)
        self._boundaries.add(cache_len)
        return cache_len

    def _emit(self, session: _Session, start: int, data: bytes, last_ts: int, sealed: bool,
              inflight: Deque[int], jump: bool = False) -> None:
        self.limiter.acquire(len(data))
        session.send(self._request(start=start, data=data, last_timestamp_us=last_ts, sealed=sealed, jump=jump))
        inflight.append(start + len(data))
