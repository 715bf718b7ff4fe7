"""Pushed file bytes, one receiver per process and data cache (docs/cache.md, "Bytes").

Readers that tail files (Consumers, the copy daemon's operations) follow them here: the
:class:`ChunkFeed` keeps one :class:`~pyspark_acs.cache.push.FollowStream` per data replica,
asks one of the file's replicas (:func:`pick_replica`) to push the file's bytes from the
reader's position, and keeps what arrives in a bounded buffer per file. A read of bytes the
buffer holds needs no request at all; anything else (bytes before the buffer, a replica that
does not hold a chunk, a stream that is down) is read from the cache as without push, and the
feed is moved on to where the reader is.

What a reader gets from the feed is the cache's bytes, which are the file's bytes: the read
path still reads only below the published length, so the seal rule, prefix safety and
Algorithm 1 stay where they are (:mod:`pyspark_acs.read.cachepath`).

Memory: per file about ``max_bytes`` (:data:`FEED_MAX_BYTES` unless the feed is given
another; never more than twice that), and the part of
the oldest pushed run that is already read (runs are kept whole, see ``_File``); bytes every
follower of the file has read are dropped at once. When every follower of a file is that far
behind, its push stops until they have read half of it (``ChunkFeed._overflow``); a follower
behind another that keeps up makes the file's buffer drop its oldest bytes, which that follower
then reads from the cache.

Load: a process follows each file on one of the file's replicas picked by process and file
(:func:`pick_replica`), so many reader processes spread their streams over the replicas instead
of all pushing from the primary. Bytes the cache holds but the live feed has not pushed yet are
waited for (:meth:`ChunkFeed.waiting`, at most :data:`PUSH_GRACE_S` without the feed growing)
rather than asked for: when a busy replica's pushes lag, Gets from its readers for the same
bytes delay the pushes further.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
import zlib
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from pyspark_acs.cache.chunks import CHUNK_SIZE, chunk_key, file_id
from pyspark_acs.cache.client import CacheClient
from pyspark_acs.security import SecuritySettings, resolve_security

if TYPE_CHECKING:
    from pyspark_acs.cache.push import FollowStream

__all__ = [
    "ChunkFeed",
    "PUSH_GRACE_S",
    "holds_whole_files",
]

#: Most bytes buffered per followed file by default (a caught-up reader needs a few KiB;
#: ``ChunkFeed(max_bytes=)``).
FEED_MAX_BYTES = 8 * 1024 * 1024
#: How long a reader waits for bytes a live feed has not pushed yet while the feed does not
#: grow (seconds), before it asks the cache for them: a replica that lacks a chunk stops its
#: run there and never pushes past it.
PUSH_GRACE_S = 0.2
#: How long :meth:`ChunkFeed.wait_read` waits for pushed bytes after the replica answered the
#: subscription (seconds): a replica pushes what it holds right after its answer.
ANSWERED_GRACE_S = 0.05
#: How long a file's stream may leave its subscription unanswered (seconds) while the file's
#: readers read past the feed by asking, before the file moves to its next replica, as a
#: broken stream's files do. A replica answers a new or changed subscription at once with an
#: empty message, so silence this long is a replica that is stalled (alive but silent, which
#: gRPC's keepalive notices only after 30 s) or was never reachable. Ten grace periods: on a
#: starved machine a healthy replica's answer can take a good part of a second.
FEED_STALL_S = 10 * PUSH_GRACE_S
#: How long :meth:`ChunkFeed.follow_latest` waits for a replica's answer before it asks the
#: file's next replica (seconds); a replica that left one unanswered is passed over for
#: :data:`LATEST_SKIP_S` by the process's later joins. Under a spike of 64 joins on 2 cores a
#: healthy replica answered in 0.3 s (p50), 0.4 s (p90).
LATEST_ANSWER_S = 1.0
LATEST_SKIP_S = 10.0
#: A stalled replica is reported at most this often (seconds; each of its files moves).
_WARN_INTERVAL_S = 10.0

log = logging.getLogger(__name__)


def holds_whole_files(client: CacheClient) -> bool:
    """Whether every replica of a file's first chunk holds all of the file's chunks: no more
    data replicas than copies per chunk. Otherwise a file's chunks are spread (each 4 KiB chunk
    placed by its own key) and a feed's replica lacks some of them."""
    return client.holds_every_key()


def pick_replica(replicas: Tuple[str, ...], uri: str) -> str:
    """The replica this process follows ``uri`` on: one of the file's replicas, by process id
    and file, so reader processes spread their push streams over every replica."""
    return replicas[(os.getpid() + zlib.crc32(uri.encode())) % len(replicas)]


class _File:
    """A followed file's buffer: the pushed runs as they came, ``pieces[i]`` starting at byte
    ``starts[i]`` of the file, and ``base``, the first byte still held (inside ``pieces[0]``).

    Runs are kept as the ``bytes`` objects the stream handed over, not joined into one buffer: a
    caught-up reader reads exactly the run the last push brought, and gets that object itself
    (a bytearray copied each run in and twice out, four copies of every pushed byte in all).
    """

    __slots__ = ("uri", "replicas", "endpoint", "since", "base", "pieces", "starts", "readers", "reached",
                 "listeners", "short_since", "paused", "latest", "boundary")

    def __init__(self, uri: str, replicas: Tuple[str, ...], since: float = 0.0) -> None:
        self.uri = uri
        self.replicas = replicas
        self.endpoint = pick_replica(replicas, uri)
        #: Since when the file is followed on ``endpoint`` (the feed's clock): its stream's
        #: silence counts as a stall of this file only after it (ChunkFeed._stalled).
        self.since = since
        #: Since when a reader has waited for bytes past ``end`` (monotonic; None: nobody is).
        self.short_since: Optional[float] = None
        self.base = 0
        self.pieces: List[bytes] = []
        self.starts: List[int] = []
        self.readers: Dict[int, int] = {}  # reader id -> position
        self.reached: Dict[int, int] = {}  # reader id -> how far its last read went
        self.listeners: Dict[int, Callable[[str, int], None]] = {}  # reader id -> on_grow
        #: Whether the push is stopped because every reader is far behind (ChunkFeed._on_bytes).
        self.paused = False
        #: A file asked for at latest (ChunkFeed.follow_latest): its ``back`` while the replica
        #: has not answered, then None (the file is followed from a position, as any other).
        self.latest: Optional[int] = None
        #: The boundary the replica answered for it at latest (None: it had none, or never asked).
        self.boundary: Optional[int] = None

    @property
    def end(self) -> int:
        """The position after the last byte held (``base`` when none is)."""
        return self.starts[-1] + len(self.pieces[-1]) if self.pieces else self.base

    def restart(self, position: int) -> None:
        """Hold nothing; the next pushed byte is expected at ``position`` (pushed again)."""
        self.base = position
        self.pieces = []
        self.starts = []
        self.paused = False

    def append(self, start: int, data: bytes) -> bool:
        """Add pushed bytes ``data`` of the file from ``start``: only what extends ``end``
        without a gap. Returns whether ``end`` moved."""
        end = self.end
        if start > end or start + len(data) <= end:
            return False  # a gap (the cursor moved past it) or bytes already held
        if start < end:
            data = data[end - start:]
        self.pieces.append(data)
        self.starts.append(end)
        return True

    def trim(self, max_bytes: int) -> None:
        """Hold at most ``max_bytes``: drop the oldest bytes above it."""
        self.drop_to(self.end - max_bytes)

    def drop_to(self, position: int) -> None:
        """Hold nothing below ``position`` (taken as ``end`` when past it)."""
        self.base = max(self.base, min(position, self.end))
        starts, pieces = self.starts, self.pieces
        gone = 0
        while gone < len(pieces) and starts[gone] + len(pieces[gone]) <= self.base:
            gone += 1
        if gone:
            del pieces[:gone], starts[:gone]

    def take(self, start: int, end: int) -> bytes:
        """The held bytes from ``start`` (``base <= start < self.end``) up to ``end``: the
        pushed run itself when it is exactly that range, otherwise one copy."""
        stop = min(end, self.end)
        i = bisect.bisect_right(self.starts, start) - 1
        piece, at = self.pieces[i], self.starts[i]
        if start == at and stop == at + len(piece):
            return piece
        if stop <= at + len(piece):
            return piece[start - at:stop - at]
        parts = [memoryview(piece)[start - at:]]
        for piece, at in zip(self.pieces[i + 1:], self.starts[i + 1:]):
            if at >= stop:
                break
            parts.append(piece if at + len(piece) <= stop else memoryview(piece)[:stop - at])
        return b"".join(parts)


class ChunkFeed:
    """Receives pushed bytes of followed files from a data cache (one per process and cache).

    Use :meth:`shared`. Thread-safe.

    Parameters
    ----------
    endpoints : sequence of str
        The data cache's replicas.
    token, security
        As for :class:`~pyspark_acs.cache.client.CacheClient`.
    max_bytes : int
        Most bytes buffered per followed file (default :data:`FEED_MAX_BYTES`; tests pass a
        smaller one).
    clock : callable
        Monotonic seconds (``time.monotonic``): the clock of the stall and grace rules
        (:data:`FEED_STALL_S`, :data:`PUSH_GRACE_S`), shared with the feed's streams.
    """

    _registry: Dict[Tuple[Tuple[str, ...], SecuritySettings], "ChunkFeed"] = {}
    _registry_lock = threading.Lock()  # guards _registry

    def __init__(self, endpoints: Sequence[str], token: Optional[str] = None, security: Any = None, *,
                 max_bytes: int = FEED_MAX_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.clock = clock
        self.client = CacheClient(tuple(endpoints), name="data cache", token=token, security=security)
        # Decided once: then every chunk of a followed file is on its replica (_placed is true
        # without a per-call key hash and ring lookup on the readers' hot path).
        self._whole_files = holds_whole_files(self.client)
        # _lock guards _files, _by_fid and _streams; _grew (on it) wakes wait_read's callers
        # whenever a buffer grows.
        self._lock = threading.Lock()
        self._grew = threading.Condition(self._lock)
        self._files: Dict[str, _File] = {}
        self._by_fid: Dict[bytes, _File] = {}
        self._streams: Dict[str, "FollowStream"] = {}
        #: Bytes received by push and bytes served from the buffer (since creation), and how
        #: often a file moved to another replica (its stream broke or stalled).
        self.received = 0
        self.served = 0
        self.moves = 0
        self._warned: Dict[str, float] = {}  # endpoint -> when its stall was last reported (under _lock)
        #: endpoint -> when it left a follow_latest unanswered for LATEST_ANSWER_S (under _lock).
        self._silent_at: Dict[str, float] = {}

    @classmethod
    def shared(cls, endpoints: Sequence[str], token: Optional[str] = None,
               security: Optional[SecuritySettings] = None) -> "ChunkFeed":
        """The process-wide feed for these data-cache endpoints and these token and TLS settings
        (``security`` with ``token``; without ``security``, the environment's): readers with
        other settings get a feed of their own, never one whose streams carry another token."""
        settings = (security if security is not None else resolve_security()).with_token(token)
        key = (tuple(endpoints), settings)
        with cls._registry_lock:
            feed = cls._registry.get(key)
            if feed is None:
                feed = cls._registry[key] = cls(tuple(endpoints), security=settings)
            return feed

    # -- readers ---------------------------------------------------------------------------

    def follow(self, uri: str, reader: int, position: int,
               on_grow: Optional[Callable[[str, int], None]] = None) -> None:
        """Reader ``reader`` reads ``uri`` from ``position`` on: have its bytes pushed. A
        position outside what the buffer holds or will get next moves the file's cursor there,
        unless another reader of the file reads at or past it (a reader joining far behind, e.g. a
        copy to a destination added late, must not make the replica push the file again and
        the readers at the tail wait for that: it reads from the cache until it reaches the
        buffer, as a slow follower does; :meth:`consumed` moves the cursor on when every
        reader is past the buffer).

        ``on_grow(uri, end)`` is called (on the stream's thread) whenever pushed bytes extend
        the buffer to ``end``: every byte below it is in the data cache, so it is a length the
        reader may read up to (the read path raises its known cache length and wakes).
        """
        with self._lock:
            f = self._files.get(uri)
            if f is None:
                fid = file_id(uri)
                f = self._files[uri] = _File(uri, self.client.replicas_for(chunk_key(uri, 0, file_id=fid)), self.clock())
                self._by_fid[fid] = f
                f.base = position
                f.readers[reader] = f.reached[reader] = position
                if on_grow is not None:
                    f.listeners[reader] = on_grow
                self._stream(f.endpoint).follow(fid, position)
                return
            if f.latest is not None:
                # Asked for at latest, not answered: followed from this position instead (the
                # reader waiting in follow_latest joins by lengths).
                f.latest = None
                for r in f.readers:
                    f.readers[r] = f.reached[r] = position
                f.readers[reader] = f.reached[reader] = position
                if on_grow is not None:
                    f.listeners[reader] = on_grow
                f.restart(position)
                self._stream(f.endpoint).follow(file_id(uri), position)
                self._grew.notify_all()
                return
            f.readers[reader] = f.reached[reader] = position
            if on_grow is not None:
                f.listeners[reader] = on_grow
            # Another reader reads at or past the buffer: by its position, or by where its last
            # read went (a reader that read past the feed by asking stands at that read's start,
            # below the base of the feed followed on from the read's end).
            ahead = any(max(at, f.reached.get(r, at)) >= f.base for r, at in f.readers.items() if r != reader)
            if not (f.base <= position <= f.end) and not ahead:
                f.restart(position)
                self._stream(f.endpoint).follow(file_id(uri), position)
            else:
                self._resume_if_due(f)

    def follow_latest(self, uri: str, reader: int, back: int, timeout: float = FEED_STALL_S,
                      on_grow: Optional[Callable[[str, int], None]] = None) -> Optional[int]:
        """Reader ``reader`` joins ``uri`` at its end: the replica follows it from the last block
        boundary a writer marked there (:func:`~pyspark_acs.cache.chunks.boundary_key`), less
        ``back`` bytes, with no lengths asked first. Returns that boundary (the reader stands
        ``back`` bytes before it, or at 0); ``None`` when the file is followed in this process
        already, when the replica has no boundary for it, or when no replica answers within
        ``timeout`` seconds -- the reader then joins by the published lengths, and the file is
        not followed for it. A replica silent for :data:`LATEST_ANSWER_S` is left for the
        file's next one, and this process's later joins pass it over for
        :data:`LATEST_SKIP_S`.

        A boundary is not a length the reader may read to: it is where the writer's last append
        ended, and the bytes below it are in the replica only if its puts reached it.
        """
        fid = file_id(uri)
        with self._lock:
            if uri in self._files:
                return None
            f = self._files[uri] = _File(uri, self.client.replicas_for(chunk_key(uri, 0, file_id=fid)), self.clock())
            self._by_fid[fid] = f
            f.latest = back
            f.readers[reader] = f.reached[reader] = 0
            if on_grow is not None:
                f.listeners[reader] = on_grow
            for _ in f.replicas[1:]:
                silent = self._silent_at.get(f.endpoint)
                if silent is None or self.clock() - silent >= LATEST_SKIP_S:
                    break
                f.endpoint = f.replicas[(f.replicas.index(f.endpoint) + 1) % len(f.replicas)]
            self._stream(f.endpoint).follow_latest(fid, back)
            now = time.monotonic()
            deadline, hop = now + timeout, now + LATEST_ANSWER_S
            while f.latest is not None and self._files.get(uri) is f:
                now = time.monotonic()
                if now >= deadline:
                    break
                if now >= hop and len(f.replicas) > 1:
                    # Silent: ask the next replica (a stalled one answers no one; gRPC's
                    # keepalive notices it only after 30 s), and pass it over for a while.
                    self._silent_at[f.endpoint] = self.clock()
                    self._move(f)
                    hop = now + LATEST_ANSWER_S
                self._grew.wait(min(deadline, hop) - now)
            if self._files.get(uri) is f and f.latest is None and f.boundary is not None:
                return f.boundary
        self.unfollow(uri, reader)
        return None

    def _on_latest(self, fid: bytes, end: Optional[int]) -> None:
        """The replica answered a :meth:`follow_latest` (stream thread): the file is followed
        from ``end`` less its back, or (``end`` None) not at all."""
        with self._lock:
            f = self._by_fid.get(fid)
            if f is None or f.latest is None:
                return
            back, f.latest, f.boundary = f.latest, None, end
            if end is not None:
                cursor = max(0, end - back)
                f.restart(cursor)
                for r in f.readers:
                    f.readers[r] = f.reached[r] = cursor
            self._grew.notify_all()

    def read(self, uri: str, start: int, end: int) -> bytes:
        """The bytes of ``[start, end)`` the buffer holds from ``start`` on (maybe fewer, maybe none)."""
        with self._lock:
            f = self._files.get(uri)
            if f is None or not (f.base <= start < f.end):
                return b""
            got = f.take(start, end)
            self.served += len(got)
            return got

    def wait_read(self, uri: str, start: int, end: int, timeout: float) -> bytes:
        """The bytes ``[start, end)`` once the buffer holds all of them, waiting at most
        ``timeout`` seconds for their push; ``b""`` when they do not come in that time or are
        not on their way (the file is not followed from ``start`` or before, its push is
        paused, or its replica is not placed on the chunk the buffer ends in), or when the
        replica answered the subscription and pushed nothing within :data:`ANSWERED_GRACE_S`
        (it does not hold them: a file idle past the data cache's time to live)."""
        deadline = time.monotonic() + timeout
        answered: Optional[float] = None  # since when the replica has answered the subscription
        with self._lock:
            while True:
                f = self._files.get(uri)
                if f is None or f.base > start or f.paused:
                    return b""
                if f.end >= end:
                    got = f.take(start, end)
                    self.served += len(got)
                    return got
                now = time.monotonic()
                if now >= deadline or not self._placed(f):
                    return b""
                stream = self._streams.get(f.endpoint)
                if stream is not None and stream.live.is_set() and stream.asked_at is None:
                    answered = answered if answered is not None else now
                    if now - answered >= ANSWERED_GRACE_S:
                        return b""
                self._grew.wait(min(deadline - now, ANSWERED_GRACE_S))

    def waiting(self, uri: str, position: int, now: Optional[float] = None) -> bool:
        """Whether a reader at ``position`` (where the buffer ends) should wait for the feed to
        push the bytes after it instead of asking for them: the file's stream is live, the
        feed's next bytes start there, the followed replica is placed on the chunk they are in
        (:meth:`_placed`), and the feed has grown within :data:`PUSH_GRACE_S` of the first
        reader waiting at its end."""
        now = self.clock() if now is None else now
        with self._lock:
            f = self._files.get(uri)
            if f is None or f.end != position:
                return False
            if not self._placed(f):
                return False
            stream = self._streams.get(f.endpoint)
            if stream is None or not stream.live.is_set():
                return False
            if f.short_since is None:
                f.short_since = now
            return now - f.short_since < PUSH_GRACE_S

    def consumed(self, uri: str, reader: int, position: int, through: Optional[int] = None) -> None:
        """Reader ``reader`` of ``uri`` needs no byte below ``position`` any more (it reads on
        from there) and has read up to ``through`` (default ``position``): drop the bytes every
        reader is past; move the file's cursor when every reader went past what the feed has
        (it read them from the cache).

        A reader reads again from where it stands, which can be before the end of what it read
        last (the bytes after its last complete block): the read path passes the start of each
        read as ``position`` and its end as ``through``. Dropping up to the end would make a
        reader of blocks larger than one push (MAX_PUSH_BYTES) ask for every such block again.
        """
        through = position if through is None else through
        with self._lock:
            f = self._files.get(uri)
            if f is None or reader not in f.readers:
                return
            f.readers[reader] = position
            f.reached[reader] = through
            others = [at for r, at in f.readers.items() if r != reader]
            low = min([position] + others)
            ahead = min([through] + others)
            if ahead <= f.end:
                if low > f.base:
                    f.drop_to(low)
                self._resume_if_due(f)
                return
            # Every reader is past the feed (the replica lacked bytes, or its stream is down
            # or stalled): follow from where they are, on the next replica if this one stalled.
            f.restart(ahead)
            if not self._stalled(f):
                self._stream(f.endpoint).follow(file_id(uri), ahead)
                return
            stalled = f.endpoint
            self._move(f)
            now = self.clock()
            if now - self._warned.get(stalled, -_WARN_INTERVAL_S) < _WARN_INTERVAL_S:
                return
            self._warned[stalled] = now
            moved_to = f.endpoint
        # Outside the lock: a log handler may write.
        log.warning("data cache replica %s left a Follow subscription unanswered for %.0f s (stalled?): "
                    "%s is pushed by %s from byte %d; until then its readers asked for its bytes "
                    "(said at most every %.0f s per replica)", stalled, FEED_STALL_S, uri, moved_to, ahead,
                    _WARN_INTERVAL_S)

    def unfollow(self, uri: str, reader: int) -> None:
        """Reader ``reader`` left ``uri``; the last one to leave stops its push."""
        with self._lock:
            f = self._files.get(uri)
            if f is None:
                return
            f.readers.pop(reader, None)
            f.reached.pop(reader, None)
            f.listeners.pop(reader, None)
            if f.readers:
                return
            del self._files[uri]
            fid = file_id(uri)
            self._by_fid.pop(fid, None)
            stream = self._streams.get(f.endpoint)
        if stream is not None:
            stream.unfollow(fid)

    def live(self, uri: str, at_least: int = 0) -> bool:
        """Whether ``uri`` is followed, the stream that pushes it is up (has pushed since it
        connected), the file's bytes have arrived up to ``at_least`` and the feed can push on
        from its end (its replica is placed on the chunk there: otherwise no pushed byte, hence
        no length, would ever come)."""
        with self._lock:
            f = self._files.get(uri)
            if f is None or f.end < at_least or not self._placed(f):
                return False
            stream = self._streams.get(f.endpoint)
        return stream is not None and stream.live.is_set()

    def _placed(self, f: _File) -> bool:
        """Whether the replica ``f`` is followed on is a replica of the chunk holding the feed's
        next byte (with more data replicas than the replication factor a file's chunks are
        spread, and a replica never pushes past a chunk it is not placed on)."""
        return self._whole_files or f.endpoint in self.client.replicas_for(chunk_key(f.uri, f.end // CHUNK_SIZE))

    def follows(self, uri: str) -> bool:
        """Whether some reader of this process has ``uri``'s bytes pushed now."""
        with self._lock:
            return uri in self._files

    def following(self) -> int:
        """How many files are followed now."""
        with self._lock:
            return len(self._files)

    # -- streams ---------------------------------------------------------------------------

    def _stream(self, endpoint: str) -> "FollowStream":
        """The stream to ``endpoint`` (caller holds _lock)."""
        stream = self._streams.get(endpoint)
        if stream is None:
            from pyspark_acs.cache.push import FollowStream  # imports grpc: only once a file is followed

            stream = self._streams[endpoint] = FollowStream(self.client, endpoint, self._on_bytes, self._on_state,
                                                            clock=self.clock, on_latest=self._on_latest)
        return stream

    def _on_bytes(self, fid: bytes, start: int, data: bytes) -> None:
        with self._lock:
            f = self._by_fid.get(fid)
            if f is None or f.latest is not None:
                return
            self.received += len(data)
            if not f.append(start, data):
                return  # a gap (the cursor moved past it) or bytes the buffer already has
            f.short_since = None  # it grows: readers waiting at its end wait on
            self._grew.notify_all()
            if f.end - f.base > self.max_bytes:
                self._overflow(f, fid)
            uri, end, listeners = f.uri, f.end, list(f.listeners.values())
        for on_grow in listeners:
            on_grow(uri, end)

    def _overflow(self, f: _File, fid: bytes) -> None:
        """``f`` holds more than ``max_bytes`` (caller holds _lock). While a reader
        keeps up with the pushed bytes (within half of that of the end), the oldest are dropped
        and the readers behind read them by asking, as a slow follower of a shared file does
        (the copy daemon's destinations). When every reader is that far behind, the push stops
        instead, until :meth:`_resume_if_due` (from :meth:`consumed` and :meth:`follow`) finds
        half of it read or a reader at the head: dropping bytes nobody had read would make a
        lagging reader ask for all of them, and the feed then start over from where it was and
        push them again, on replicas already too busy to push in time."""
        if self._at_head(f) or f.end - f.base > 2 * self.max_bytes:
            f.trim(self.max_bytes)
        elif not f.paused:
            f.paused = True
            stream = self._streams.get(f.endpoint)
            if stream is not None:
                stream.unfollow(fid)

    def _at_head(self, f: _File) -> bool:
        """Whether some reader of ``f`` keeps up with its end: it stands, or its last read
        went, within half of ``max_bytes`` of it (a reader inside a block larger than
        the buffer stands at the block's start but reads up to the end: the feed cannot hold
        that block, so such a reader is at the head and the oldest bytes go)."""
        lead = max([f.base] + list(f.readers.values()) + list(f.reached.values()))
        return f.end - lead <= self.max_bytes // 2

    def _resume_if_due(self, f: _File) -> None:
        """Push a paused file again (caller holds _lock) once its readers have read half its
        buffer, or once one of them is at the head (another reader caught up, or one joined
        there): then what is above the cap is dropped for the readers behind, as when the
        push never stopped."""
        if not f.paused:
            return
        if f.end - f.base <= self.max_bytes // 2 or self._at_head(f):
            f.trim(self.max_bytes)
            f.paused = False
            self._stream(f.endpoint).follow(file_id(f.uri), f.end)

    def _stalled(self, f: _File) -> bool:
        """Whether ``f``'s replica is stalled for it (caller holds _lock; its readers just went
        past the feed by asking): the stream has left a subscription unanswered for
        :data:`FEED_STALL_S`, counted from when the file came to the replica at the earliest.
        A quiet stream is not stalled: nothing it was asked waits for an answer."""
        if len(f.replicas) < 2:
            return False
        stream = self._streams.get(f.endpoint)
        asked = stream.asked_at if stream is not None else None
        return asked is not None and self.clock() - max(asked, f.since) > FEED_STALL_S

    def _move(self, f: _File) -> None:
        """Follow ``f`` on its next replica from where its buffer ends (caller holds _lock):
        hedging off a replica whose stream broke or stalled. A paused file is followed there
        when it resumes."""
        fid = file_id(f.uri)
        old = self._streams.get(f.endpoint)
        if old is not None:
            old.unfollow(fid)
        f.endpoint = f.replicas[(f.replicas.index(f.endpoint) + 1) % len(f.replicas)]
        f.since = self.clock()
        self.moves += 1
        if f.latest is not None:
            self._stream(f.endpoint).follow_latest(fid, f.latest)  # not answered: asked again there
        elif not f.paused:
            self._stream(f.endpoint).follow(fid, f.end)

    def _on_state(self, endpoint: str, live: bool) -> None:
        """A stream came up or broke. A broken one's files move to their next replica (hedging),
        resuming where their buffers end; the stream itself keeps reconnecting."""
        if live:
            return
        with self._lock:
            for f in list(self._files.values()):
                if f.endpoint == endpoint and len(f.replicas) >= 2:
                    self._move(f)

    def close(self) -> None:
        """Close every stream and the client (the shared feed is dropped from the registry)."""
        with self._registry_lock:
            for key, feed in list(self._registry.items()):
                if feed is self:
                    del self._registry[key]
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            self._files.clear()
            self._by_fid.clear()
        for stream in streams:
            stream.close()
        self.client.close()
