"""One message file's writer: append at an expected position, verify against seals (the
fence), then mirror to the data cache and publish lengths in the metadata cache.

This is the single place where bytes enter a message file (docs/overview.md section 6). The shard
writer (:mod:`pyspark_acs.write.shard`: Producer, Spark sink) and the copy writer
(:mod:`pyspark_acs.server.copy.writer`) append through it.

The fence
---------
A writer acknowledges bytes only once it knows they lie before any seal of the file. When a
writer takes a shard over, it first seals its predecessor's file at that file's durable
length (a *recovery seal*); a deposed writer that appends afterwards must find out and fail.
:meth:`DurableFile.append` therefore

1. takes the file's append lock where the filesystem has one (local files: ``flock`` on
   the file; HDFS allows one appender per file by itself; ``pyarrow.fs`` offers nothing
   for other filesystems), and checks the file still ends where this writer expects;
2. appends;
3. checks that the file's size is the expected end. If it is not, it reads the bytes from
   the expected start and finds where its bytes landed: first (ours are acknowledged; the
   file has something after them, so the next append fails) or after foreign bytes such as
   a seal (:class:`AppendConflictError` naming the file and the byte range, and the
   messages when the caller gave them). Those bytes lie after a seal: readers never see
   them.

With the lock the check-then-append is atomic among writers of this package on one
machine, so a second writer (a deposed producer, a stale copy operation) never appends at
all. Without it the post-append check is the fence: it cannot tell two writers that
appended *identical* bytes concurrently apart (a stale copy writer and its successor copy
the same source bytes; a sink batch continued from its intent is the same bytes again); HDFS
refuses the second appender.

The lock waits at most :data:`~pyspark_acs.storage.leases.LOCK_WAIT_SECONDS` (a holder
stopped inside its append must not block a take-over forever). Going on without it is safe
only for a recovery seal (``past_a_stopped_writer``): the stopped holder has checked the
length already, so its bytes land after whatever we append once it resumes, and after a
seal nothing is read. Any other append whose lock is held that long is refused
(:class:`AppendLockBusyError`, nothing appended): the holder's identical bytes would land
right after ours and pass its post-append check, and readers would get them twice.

Only verified bytes are mirrored to the data cache (so a deposed writer never puts bytes
into the cache at positions a seal occupies) and only then are lengths published. A cache
failure never fails a write: it is reported to ``on_cache_error`` (logged and counted by
the caller) and readers fall back to the durable store.

Bursts
------
A writer with more blocks right behind this one (a Producer's ``send_many`` backlog) may
append with ``more_follows=True``: the verified bytes are handed to the file's shadow thread,
which mirrors and publishes them (coalescing what queued while it was busy) while the writer
verifies its next block; it waits :data:`SHADOW_IDLE_S` for the next burst before it ends, and
the writer's close ends it. The order of each byte's steps is unchanged (durable and verified,
then chunks, then lengths: the thread only gets verified bytes, and publishes the durable
length they end at); what overlaps is one block's cache writes with the next appends. The
writer waits once :data:`SHADOW_MAX_BYTES` wait for the thread (so less than that plus one
block wait, and the durable store leads the caches by at most that and one block more).
Every append without ``more_follows`` (the last block of a burst, a seal) first waits until
the thread has published everything queued, then appends and publishes inline, so when a
burst's writer returns its lengths are out, as after a plain append. An unexpected error of
the thread (a cache error is not one: it goes to ``on_cache_error``) fails the writer's next
append before that appends anything, and every append after it. A Producer with
``acknowledge="durable"`` appends every block with ``more_follows`` and counts it acknowledged
after the durable append: its cache writes never hold up a flush but at a roll (the seal waits
for the thread). That is not the default: cached lengths lagging the durable ones send
Algorithm 1's readers to the store (docs/cache.md, "Writes").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

from pyspark_acs.errors import AppendConflictError, AppendLockBusyError, CacheError, CorruptFileError
from pyspark_acs.format.block import HEADER_SIZE, RECOVERY_SEAL_SIZE, find_recovery_seal, parse_header
from pyspark_acs.storage.leases import exclusive, lock_wait
from pyspark_acs.storage.store import Appender, DurableStore

__all__ = [
    "CacheMirror",
    "DurableFile",
    "FileTail",
    "FileWriter",
    "scan_file",
]

log = logging.getLogger(__name__)

#: Bytes read at a time when walking a file's block headers.
SCAN_WINDOW_BYTES = 1024 * 1024

#: Verified bytes a :class:`FileWriter` holds for its shadow thread at most (``more_follows``
#: appends); the writer waits when more are queued. 4 MiB is one data-cache put request
#: (``cache.fanout.MAX_BATCH_BYTES``) and four default blocks: enough to keep the thread busy
#: through a block's durable append, and how far a burst's cached length trails its durable one.
SHADOW_MAX_BYTES = 4 * 1024 * 1024
#: How long an idle shadow thread waits for the next burst before it ends (seconds). A thread
#: started per burst makes every burst wait for the new thread's first time slice, and Linux
#: schedules a new thread after the runnable ones (on a busy machine, behind every consumer).
SHADOW_IDLE_S = 1.0


class FileTail(NamedTuple):
    """What a walk over a file's block headers found (see :func:`scan_file`)."""

    #: File length the walk covered.
    length: int
    #: End of the last complete data block before any seal (where valid bytes end).
    end: int
    #: Message index after those blocks.
    next_index: int
    #: Position of the first seal block, or None when the file is not sealed.
    sealed_at: Optional[int]

    @property
    def sealed(self) -> bool:
        """Whether the file ends with a seal (readers leave it there)."""
        return self.sealed_at is not None

    @property
    def torn(self) -> bool:
        """Unsealed and with bytes after its last complete block (a crashed writer's block)."""
        return self.sealed_at is None and self.end < self.length


def scan_file(store: DurableStore, rel: str, *, start: int = 0, first_index: int = 0,
              length: Optional[int] = None, window: int = SCAN_WINDOW_BYTES) -> FileTail:
    """Walk the block headers of ``rel`` from ``start`` (a block boundary) to its length.

    Bodies are not read (a large block is skipped by its header), so the cost is about the
    number of blocks. Bytes that do not form a complete block (a torn block, a header cut
    short, or bytes that are not a header) end the walk: they are the torn tail, and the file
    is sealed only if a recovery seal voiding them follows (the read side's rule,
    :func:`~pyspark_acs.format.block.find_recovery_seal`; bytes of the torn block are never
    taken for one). Without that, every take-over sealed such a file again. Headers are read
    ``window`` bytes at a time.
    """
    uri = store.uri(rel)
    if length is None:
        length = store.lengths([rel]).get(rel) or 0
    at, index = start, first_index
    buf_start, buf = start, b""
    while length - at >= HEADER_SIZE:
        if at + HEADER_SIZE > buf_start + len(buf):
            buf_start, buf = at, store.read(rel, at, min(length, at + window))
            if len(buf) < HEADER_SIZE:
                break
        try:
            header = parse_header(buf, at - buf_start, path=uri, position=at)
        except CorruptFileError as exc:
            log.warning("%s: bytes from %d on are not a block (%s); treating them as a torn tail", uri, at, exc)
            break
        if at + header.size > length:
            break
        if header.sealed:
            return FileTail(length, at, index, at)
        index = header.first_index + header.count
        at += header.size
    sealed_at = _recovery_seal_after(store, rel, at, length, uri, window) if length - at >= HEADER_SIZE else None
    return FileTail(length, at, index, sealed_at)


def _recovery_seal_after(store: DurableStore, rel: str, at: int, length: int, uri: str,
                         window: int) -> Optional[int]:
    """Where the recovery seal that voids the torn tail from ``at`` begins (None: none before
    ``length``), searched window by window: a corrupt header early in a large file, or a
    large block still landing, would otherwise be read whole at once. Windows overlap by a
    recovery seal's size, so a seal across a window's end is whole in the next one."""
    start = at
    while start < length:
        end = min(length, start + window)
        found = find_recovery_seal(store.read(rel, start, end), at, base=start, path=uri)
        if found is not None:
            return start + found[0]
        if end == length:
            return None
        start = end - RECOVERY_SEAL_SIZE
    return None


def append_lock(store: DurableStore, rel: str) -> "contextlib.AbstractContextManager[bool]":
    """The append lock of ``rel``: ``flock`` on the file itself where the filesystem is local
    (:func:`~pyspark_acs.storage.leases.exclusive`), nothing elsewhere (``pyarrow.fs`` has no
    lock; HDFS itself allows one appender per file). Yields whether it is held (False on a
    local file: its holder kept it past ``LOCK_WAIT_SECONDS``). A file gone from its path (a
    quarantine moved it aside) is not created again: StoreFileNotFoundError, nothing appended."""
    return exclusive(store, rel, create=False)


def _describe(start: int, end: int, messages: Optional[Tuple[int, int]]) -> str:
    text = f"bytes [{start}, {end})"
    if messages is not None and messages[1] > 0:
        first, count = messages
        text += f" (messages {first}..{first + count - 1} of the file)"
    return text


class DurableFile:
    """Appends to one file of the durable store at expected positions, fenced by seals.

    Parameters
    ----------
    store : DurableStore
    rel : str
        The file, relative to the store root (created if missing).
    position : int, optional
        Where this writer expects the file to end (default: its length now).

    Not thread-safe: one writer thread.
    """

    def __init__(self, store: DurableStore, rel: str, position: Optional[int] = None) -> None:
        self.store = store
        self.rel = rel
        self.uri = store.uri(rel)
        self._appender: Optional[Appender] = store.open_appender(rel)
        self.position = self._appender.position if position is None else position

    def append(self, data: bytes, *, messages: Optional[Tuple[int, int]] = None,
               past_a_stopped_writer: bool = False) -> int:
        """Append ``data`` at :attr:`position`; return the new position once verified.

        Parameters
        ----------
        data : bytes
            Whole blocks (or the rest of one, when completing a planned append).
        messages : (first index, count), optional
            The messages ``data`` holds, for the error message.
        past_a_stopped_writer : bool
            ``data`` is a recovery seal: appended even when the append lock's holder keeps it
            past ``LOCK_WAIT_SECONDS`` (what it appends after the seal is never read).

        Raises
        ------
        AppendLockBusyError
            The append lock was held too long and ``data`` is not a recovery seal (nothing
            was appended).
        AppendConflictError
            The file does not end at :attr:`position` (nothing was appended), or the bytes
            landed after foreign bytes (not acknowledged; they lie after a seal).
        """
        start, end = self.position, self.position + len(data)
        with append_lock(self.store, self.rel) as locked:
            if self.store.local:
                actual = self.store.length(self.rel)
                if not locked and not past_a_stopped_writer:
                    raise AppendLockBusyError(
                        f"{self.uri}: {_describe(start, end, messages)} not appended: another writer holds the "
                        f"file's append lock for more than {lock_wait(self.store):.1f} s (stopped or hung inside "
                        f"its append, which lands once it resumes; identical bytes appended now would be "
                        f"read twice)", path=self.uri, start=start, end=end, actual_length=actual)
                if actual != start:
                    raise self._conflict(start, end, actual, messages, appended=False)
            if data:
                self._appender.write(data)
            actual = self.store.length(self.rel)
        if actual != end:
            landed = self.store.read(self.rel, start, min(actual, end))
            if actual < end or landed != bytes(data):
                raise self._conflict(start, end, actual, messages, appended=True)
            # Ours came first; foreign bytes follow (a seal): acknowledged, and the next
            # append fails because the file no longer ends at our position.
            log.warning("%s: another writer appended %d bytes right after %s", self.uri, actual - end,
                        _describe(start, end, messages))
        self.position = end
        return end

    def _conflict(self, start: int, end: int, actual: int, messages: Optional[Tuple[int, int]],
                  appended: bool) -> AppendConflictError:
        seal_at = None
        if actual > start:
            tail = scan_file(self.store, self.rel, start=start, length=actual)
            seal_at = tail.sealed_at
        what = _describe(start, end, messages)
        if seal_at is not None:
            why = (f"another writer sealed the file at byte {seal_at} (it took the shard over), so "
                   f"{'they landed after the seal and' if appended else 'they were not appended and'} "
                   f"readers never see them")
        else:
            why = (f"the file is {actual} bytes long where this writer expected {start}: another writer "
                   f"appended to it{' first' if appended else ''}")
        return AppendConflictError(
            f"{self.uri}: {what} not acknowledged: {why}", path=self.uri, start=start, end=end,
            actual_length=actual, seal_at=seal_at,
        )

    def close(self) -> None:
        """Close the append stream (idempotent)."""
        if self._appender is not None:
            self._appender.close()
            self._appender = None


class CacheMirror:
    """Mirrors a file's verified bytes to the data cache as 4 KiB chunks (Fig. 7), from a
    start position whose chunk prefix is read back from the durable store when not given.

    Parameters
    ----------
    client : CacheClient
        The data cache.
    uri : str
        The file's URI (chunk keys derive from it).
    position : int
        Where mirroring starts.
    prefix : bytes, optional
        The ``position % 4096`` bytes before ``position``; read from ``store``/``rel`` if None.
    boundaries : bool
        Every append ends at a block boundary (a :class:`FileWriter`'s: whole blocks only,
        docs/format.md; not a copy's): the chunks carry the file's boundary key, where a reader
        joining at ``latest`` is followed from (:class:`~pyspark_acs.cache.chunks.ChunkWriter`).
    """

    def __init__(self, client: Any, uri: str, position: int, prefix: Optional[bytes] = None, *,
                 store: Optional[DurableStore] = None, rel: str = "", ttl: Optional[float] = None,
                 boundaries: bool = False) -> None:
        from pyspark_acs.cache.chunks import CHUNK_SIZE, ChunkWriter

        need = position % CHUNK_SIZE
        if prefix is None:
            prefix = store.read(rel, position - need, position) if (need and store is not None) else b""
        self.chunks = ChunkWriter(client, uri, position, prefix, ttl=ttl, boundaries=boundaries)

    @property
    def position(self) -> int:
        """Bytes of the file the mirror has written (or tried to)."""
        return self.chunks.position

    def append(self, data: bytes) -> int:
        """Write ``data`` (the bytes at :attr:`position`); return the new position.

        Raises CacheError when a majority of replicas did not take every chunk.
        """
        return self.chunks.append(data)


class FileWriter:
    """Append to one message file: durable first (fenced), then chunks, then lengths.

    Parameters
    ----------
    store : DurableStore
    rel : str
        The file, relative to the root.
    data : CacheClient, optional
        Data cache: verified bytes are mirrored there.
    meta : MetadataCache, optional
        Metadata cache: cache and durable lengths are published there after each append.
    position : int, optional
        Where the file is expected to end (default: its length now).
    on_cache_error : callable(what, exc), optional
        Called for each cache failure (default: log a warning). Never raised. Called from the
        shadow thread for a burst's blocks (``more_follows``), so it must be thread-safe.
    chunk_ttl : float, optional
        Time to live of the data-cache chunks (default: the server's).
    """

    def __init__(self, store: DurableStore, rel: str, *, data: Any = None, meta: Any = None,
                 position: Optional[int] = None, on_cache_error: Optional[Callable[[str, Exception], None]] = None,
                 chunk_ttl: Optional[float] = None) -> None:
        self.durable = DurableFile(store, rel, position)
        self.uri = self.durable.uri
        self.meta = meta
        self._on_cache_error = on_cache_error or self._log_cache_error
        self.mirror: Optional[CacheMirror] = None
        if data is not None:
            try:
                self.mirror = CacheMirror(data, self.uri, self.durable.position, store=store, rel=rel, ttl=chunk_ttl,
                                          boundaries=True)
            except CacheError as exc:  # pragma: no cover - constructing reads only the store
                self._on_cache_error("chunks", exc)
        # _shadow guards the shadow thread's state below: the verified bytes queued for it, their
        # size (counted until they are published), the durable length they end at, whether the
        # thread has work (queued or being published), whether it exists (it idles for
        # SHADOW_IDLE_S between bursts), whether the writer closes, and an unexpected error it
        # met (raised by the next settle()).
        self._shadow = threading.Condition()
        self._queued: List[bytes] = []
        self._queued_bytes = 0
        self._queued_end = 0
        self._shadow_running = False
        self._shadow_alive = False
        self._closing = False
        self._shadow_error: Optional[BaseException] = None

    @property
    def position(self) -> int:
        """The verified length of the file (this writer's bytes end there)."""
        return self.durable.position

    def shadows(self, more_follows: bool) -> bool:
        """Whether an append with this ``more_follows`` hands its cache writes to the shadow
        thread: a burst's block, when there are caches to write."""
        return more_follows and (self.mirror is not None or self.meta is not None)

    def append(self, data: bytes, *, messages: Optional[Tuple[int, int]] = None,
               past_a_stopped_writer: bool = False, more_follows: bool = False) -> int:
        """Append ``data`` (fenced, see :class:`DurableFile`), mirror it, publish; return the length.

        ``more_follows``: the caller appends again right away (a burst); the cache writes of
        ``data`` then run on the shadow thread while it does (see the module's "Bursts").
        Without it, everything queued is published first and ``data`` inline.

        Raises
        ------
        AppendConflictError
            From :meth:`DurableFile.append`: nothing is mirrored or published then.
        """
        shadowed = self.shadows(more_follows)
        # An unexpected error of the shadow thread fails this append before its bytes are
        # appended (they are not acknowledged); without more_follows, everything queued is
        # published first, so this block's cache writes come after them.
        if shadowed:
            self._raise_shadow_error()
        else:
            self.settle()
        end = self.durable.append(data, messages=messages, past_a_stopped_writer=past_a_stopped_writer)
        if shadowed:
            self._hand_over(data, end)
        else:
            self.publish(data)
        return end

    def publish(self, data: bytes = b"", durable_length: Optional[int] = None) -> None:
        """Mirror ``data`` (the verified bytes ending at ``durable_length``, by default
        :attr:`position`) and publish both lengths."""
        cache_length = None
        if self.mirror is not None:
            try:
                cache_length = self.mirror.append(data)
            except CacheError as exc:
                self._on_cache_error("chunks", exc)
        if self.meta is not None:
            try:
                self.meta.publish(self.uri, cache_length=cache_length,
                                  durable_length=self.position if durable_length is None else durable_length)
            except CacheError as exc:
                self._on_cache_error("lengths", exc)

    def settle(self) -> None:
        """Wait until the shadow thread has published every byte handed to it.

        Raises
        ------
        Exception
            An unexpected error the thread met (cache errors go to ``on_cache_error``). The
            writer stays failed: every later append raises it too, before appending.
        """
        with self._shadow:
            while self._shadow_running:
                self._shadow.wait()
        self._raise_shadow_error()

    def _raise_shadow_error(self) -> None:
        with self._shadow:
            error = self._shadow_error
        if error is not None:
            raise error

    def _hand_over(self, data: bytes, end: int) -> None:
        """Queue verified ``data`` (ending at ``end``) for the shadow thread; start it if idle.

        After an unexpected error of the thread nothing is queued: ``data`` is durable and
        acknowledged, its lengths are not published (as after a cache failure), and the next
        append raises the error.
        """
        with self._shadow:
            while self._queued_bytes >= SHADOW_MAX_BYTES and self._shadow_running:
                self._shadow.wait()
            if self._shadow_error is not None:
                return
            self._queued.append(data)
            self._queued_bytes += len(data)
            self._queued_end = end
            if self._shadow_running:
                return
            self._shadow_running = True
            if self._shadow_alive:
                self._shadow.notify_all()  # the idle thread takes it
                return
            self._shadow_alive = True
        try:
            threading.Thread(target=self._shadow_run, name=f"acs-shadow {self.uri}", daemon=True).start()
        except RuntimeError:  # no thread to be had (the process is at its limit): publish here
            with self._shadow:
                self._shadow_alive = False
            self._shadow_run(linger=False)

    def _shadow_run(self, linger: bool = True) -> None:
        """The shadow thread: publish what is queued, coalesced, in order; when none is, wait
        for more (at most :data:`SHADOW_IDLE_S`, and not once the writer closes; not at all
        without ``linger``), then end; end at an unexpected error (kept for the writer; what is
        queued then is not published: the mirror's position may no longer be where those bytes
        start)."""
        while True:
            with self._shadow:
                if not self._queued:
                    self._shadow_running = False
                    self._shadow.notify_all()
                    until = time.monotonic() + SHADOW_IDLE_S
                    while linger and not self._queued and not self._closing:
                        left = until - time.monotonic()
                        if left <= 0:
                            break
                        self._shadow.wait(left)
                    if not self._queued:
                        if linger:
                            self._shadow_alive = False
                        return
                pieces, end, size = self._queued, self._queued_end, self._queued_bytes
                self._queued = []
            try:
                self.publish(pieces[0] if len(pieces) == 1 else b"".join(pieces), durable_length=end)
            except BaseException as exc:  # raised by the writer's next append, settle() or close()
                with self._shadow:
                    self._shadow_error = exc
                    self._queued = []
                    self._queued_bytes = 0
                    self._shadow_running = False
                    if linger:
                        self._shadow_alive = False
                    self._shadow.notify_all()
                return
            with self._shadow:
                self._queued_bytes -= size
                self._shadow.notify_all()

    def _log_cache_error(self, what: str, exc: Exception) -> None:
        log.warning("%s: cache write of %s failed, readers use the durable store: %s", self.uri, what, exc)

    def close(self) -> None:
        """Publish what the shadow thread holds, end the thread, then close the durable append
        stream."""
        try:
            self.settle()
        finally:
            with self._shadow:
                self._closing = True
                self._shadow.notify_all()
            self.durable.close()
