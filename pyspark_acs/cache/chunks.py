"""File bytes as 4 KiB chunks in the replicated data cache (paper section 2.2, Figs. 5-7).

Chunk ``n`` of a file holds bytes ``[n * 4096, (n + 1) * 4096)`` under a key derived from the
file's URI and ``n``; the consistent-hash ring of :class:`~pyspark_acs.cache.client.CacheClient`
spreads the chunks of one file over all replicas. A chunk's *version* is the number of valid
bytes in it, so a replica never replaces a longer prefix with a shorter one.

Every chunk is always written from its beginning: reading any part of a chunk that is
present yields the right bytes, even if the chunk is only partly filled.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.errors import CacheError, CacheTimeoutError

__all__ = [
    "CHUNK_SIZE",
    "ChunkReader",
    "ChunkWriter",
    "boundary_key",
    "chunk_key",
    "chunk_keys",
    "file_id",
    "parse_chunk_key",
]

#: Bytes per chunk: the paper's 4 KB (a chunk fits one packet of the cluster fabric).
CHUNK_SIZE = 4096
#: How long a writer puts chunks again that no replica took in time (every call timed out: a
#: loaded cache, or a hung one) before it gives them up (readers then read those bytes from the
#: store); later puts that time out in the same run are given up at once. A put given up at
#: the first expired deadline left bytes only in the store, and every reader of a loaded cache
#: read them there at once (64 readers joining on 2 cores: most of a store-read storm).
PUT_PATIENCE_S = 3.0
#: The wait before a timed-out put is sent again, doubling up to PUT_RETRY_MAX_S.
PUT_RETRY_MIN_S = 0.05
PUT_RETRY_MAX_S = 0.5


#: Most chunks asked for in one Get (1 MiB): a reader catching up reads its range in pieces,
#: each answered within the client's deadline even by a loaded replica (a 16 MiB Get missed
#: its 0.5 s deadline on every replica at 32 consumers on 2 cores, sending it all to the store).
READ_PIECE_CHUNKS = 256
#: Pieces of one long read in flight at once, each on a replica picked for it: one piece at a
#: time would leave the reader waiting on each round trip in turn.
READ_PIECES_IN_FLIGHT = 4

#: Bytes of a file id (the blake2b digest of its URI) in its chunk keys.
FILE_ID_BYTES = 16
_CHUNK_KEY_BYTES = 1 + FILE_ID_BYTES + 8


def file_id(uri: str) -> bytes:
    """The 16-byte id of the file ``uri`` in its chunk keys (and in push streams)."""
    return hashlib.blake2b(uri.encode("utf-8"), digest_size=FILE_ID_BYTES).digest()


def chunk_key(uri: str, n: int, *, file_id: Optional[bytes] = None) -> bytes:
    """The data-cache key of chunk ``n`` of the file ``uri``: ``b"c" + blake2b(uri) + n``
    (give ``file_id`` instead of computing it from ``uri``)."""
    return _key_prefix(uri, file_id) + n.to_bytes(8, "big")


def _key_prefix(uri: str, file_id: Optional[bytes]) -> bytes:
    return b"c" + (file_id or _digest(uri))


def chunk_keys(uri: str, numbers: range, *, file_id: Optional[bytes] = None) -> List[bytes]:
    """:func:`chunk_key` of each chunk number in ``numbers`` (the file id computed once)."""
    prefix = _key_prefix(uri, file_id)
    return [prefix + n.to_bytes(8, "big") for n in numbers]


def parse_chunk_key(key: bytes) -> Optional[Tuple[bytes, int]]:
    """``(file id, chunk number)`` of a chunk key; ``None`` for any other key."""
    if len(key) != _CHUNK_KEY_BYTES or key[:1] != b"c":
        return None
    return key[1:1 + FILE_ID_BYTES], int.from_bytes(key[1 + FILE_ID_BYTES:], "big")


def boundary_key(file_id: bytes) -> bytes:
    """The data-cache key of a file's last block boundary, ``b"e" + file id``: a valueless
    entry whose version is the boundary (a longer one replaces a shorter one, as a chunk's
    prefix does). A writer of whole blocks puts it with each append's chunks
    (``ChunkWriter(boundaries=True)``); a replica follows a reader from it at ``latest``
    (docs/cache.md, "Joining at `latest`")."""
    return b"e" + file_id


_digest = file_id  # chunk_key's parameter shadows the function's name


def chunk_range(start: int, end: int) -> range:
    """Chunk numbers that cover bytes ``[start, end)``."""
    if end <= start:
        return range(0)
    return range(start // CHUNK_SIZE, (end - 1) // CHUNK_SIZE + 1)


class ChunkWriter:
    """Writes one growing file's bytes to the data cache as they are appended.

    The writer keeps the bytes of the last, partial chunk so each write can rewrite that
    chunk from its start (Fig. 7). Complete chunks of one append go out in one batched,
    parallel put; appends of one file are serialized by ``_lock``, which orders the rewrites
    of the partial chunk.

    Parameters
    ----------
    client : CacheClient
        The data cache.
    uri : str
        The file's URI (globally unique; the chunk keys derive from it).
    position : int
        File length this writer starts at.
    prefix : bytes
        The bytes of the chunk that contains ``position``, from the chunk's start up to
        ``position`` (``position % 4096`` bytes); empty when ``position`` is a chunk boundary.
    ttl : float, optional
        Time to live of the chunks (default: the server's, 60 s).
    boundaries : bool
        Every append ends at a block boundary (a Producer's or sink's file writer, never a copy,
        whose appends may end inside a block): each put also carries the file's
        :func:`boundary_key` at the append's end.
    """

    def __init__(self, client: CacheClient, uri: str, position: int = 0, prefix: bytes = b"", ttl: Optional[float] = None,
                 *, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 boundaries: bool = False):
        if len(prefix) != position % CHUNK_SIZE:
            raise ValueError(f"prefix must hold the {position % CHUNK_SIZE} bytes before position {position}")
        self.client = client
        self.uri = uri
        self.ttl = ttl
        self.clock = clock
        self._sleep = sleep
        #: When the current run of timed-out puts began (None: the last put was taken).
        self._slow_since: Optional[float] = None
        #: Puts sent again after a timeout (all of this writer's).
        self.retries = 0
        self._id = file_id(uri)
        self._boundary = boundary_key(self._id) if boundaries else None
        # _lock serialises appends: it guards position and _tail.
        self._lock = threading.Lock()
        self.position = position
        self._tail = bytes(prefix)

    def append(self, data: "bytes | bytearray | memoryview") -> int:
        """Write ``data`` (the bytes at ``position``, any C-contiguous bytes-like object) to
        the cache; return the new position. The chunks are views of ``data`` until the put
        has encoded them: a caller must not change a mutable ``data`` during the call.

        A put that times out on every replica (a loaded cache) is sent again, for up to
        :data:`PUT_PATIENCE_S` from the first timeout of a run (chunk puts are idempotent: a
        chunk's version is its length); a cache that refuses calls fails the put at once.

        Raises
        ------
        CacheError
            When a majority of replicas did not take every chunk. The writer's own position
            still advances (the durable store has the bytes; readers fall back to it), and
            the next append rewrites the partial chunk it holds from its start.
        """
        with self._lock:
            tail = self._tail
            start = self.position - len(tail)
            # The chunks are views of ``data`` (the first one completes the held tail): each
            # byte is copied once, into the put's body (joining the tail and the data, then
            # slicing chunks out of that, would copy every byte twice more).
            view = memoryview(data).cast("B")
            lead = CHUNK_SIZE - len(tail) if tail else 0
            pieces: List[Any] = [tail + bytes(view[:lead])] if tail else []
            pieces += [view[i : i + CHUNK_SIZE] for i in range(lead, len(view), CHUNK_SIZE)]
            first = start // CHUNK_SIZE
            keys = chunk_keys(self.uri, range(first, first + len(pieces)), file_id=self._id)
            # A chunk's version is its length: a longer prefix of the chunk replaces a shorter one.
            items = list(zip(keys, pieces, map(len, pieces)))
            end = start + len(tail) + len(view)
            if self._boundary is not None and items:
                # Last: a put split over several requests (large appends) ends with it.
                items.append((self._boundary, b"", end))
            self.position = end
            self._tail = bytes(pieces[-1]) if end % CHUNK_SIZE else b""
            if items:
                # No grace for the third replica: the writer's lengths and next flush wait on
                # this put (CacheClient.put's ``grace``).
                self._put(items)
            return end

    def _put(self, items: List[Any]) -> None:
        wait = PUT_RETRY_MIN_S
        while True:
            try:
                self.client.put(items, ttl=self.ttl, grace=False)
            except CacheTimeoutError:
                now = self.clock()
                if self._slow_since is None:
                    self._slow_since = now
                if now - self._slow_since >= PUT_PATIENCE_S:
                    raise  # the run outlasted the patience: given up, as every later one until a put is taken
                self.retries += 1
                self._sleep(wait)
                wait = min(PUT_RETRY_MAX_S, 2 * wait)
                continue
            self._slow_since = None
            return


# Threads that wait for the pieces of long reads (each piece's Get waits for its answer), one
# pool per process, created at first use (a forked Spark worker makes its own).
# _piece_pool_lock guards _piece_pool_state.
_piece_pool_lock = threading.Lock()
_piece_pool_state: Dict[int, ThreadPoolExecutor] = {}


def _piece_pool() -> ThreadPoolExecutor:
    import os

    pid = os.getpid()
    with _piece_pool_lock:
        pool = _piece_pool_state.get(pid)
        if pool is None:
            _piece_pool_state.clear()  # a parent's pool does not survive a fork
            pool = _piece_pool_state[pid] = ThreadPoolExecutor(
                max_workers=4 * READ_PIECES_IN_FLIGHT, thread_name_prefix="acs-chunk-pieces")
        return pool


class ChunkReader:
    """Reads byte ranges of files from the data cache: relaxed first, then consistent.

    ``read`` returns, per chunk, the bytes the cache holds for the requested range or None;
    callers fetch the None runs from the durable store. Counters (guarded by ``_lock``):
    ``relaxed_chunks``, ``consistent_chunks``, ``cache_bytes``, ``missing_chunks``.
    """

    def __init__(self, client: CacheClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self.counters: Dict[str, int] = {"relaxed_chunks": 0, "consistent_chunks": 0, "cache_bytes": 0, "missing_chunks": 0}

    def read(self, uri: str, start: int, end: int) -> List[Tuple[int, int, Optional[Union[bytes, memoryview]]]]:
        """Runs covering ``[start, end)`` in order, as ``(run_start, run_end, bytes or None)``.

        ``bytes`` is exactly ``[run_start, run_end)``: bytes-like, often a memoryview of a
        cache answer (:meth:`CacheClient.get_joined`), to be joined or copied by the caller.
        A run is a whole piece of :data:`READ_PIECE_CHUNKS` chunks (clipped to the range) when every chunk of it was
        there in full, else one chunk; a chunk absent or shorter than needed after a
        consistent read is a run of its own with None.

        Raises
        ------
        CacheError
            Only when no replica of some chunk answered at all (all dead).
        """
        fid = file_id(uri)
        numbers = chunk_range(start, end)
        if not numbers:
            return []
        keys = chunk_keys(uri, numbers, file_id=fid)
        out: List[Optional[Tuple[int, int, Optional[bytes]]]] = []
        short: List[Tuple[int, int]] = []  # (index in out, chunk number) to read again, consistently
        got = 0
        at = numbers[0]  # the next piece's first chunk
        for data, sizes in self._pieces(keys):
            k = len(sizes)
            base = at * CHUNK_SIZE
            lo, hi = max(start, base), min(end, (at + k) * CHUNK_SIZE)
            if sizes[:-1].count(CHUNK_SIZE) == k - 1 and sizes[-1] >= hi - (at + k - 1) * CHUNK_SIZE:
                # Every chunk but the last is full and the last reaches the range's end: the
                # values, joined, are the file's bytes from the piece's first chunk on.
                out.append((lo, hi, data[lo - base:hi - base]))
                got += hi - lo
            else:
                offset = 0
                for n in range(at, at + k):
                    size = sizes[n - at]
                    chunk = n * CHUNK_SIZE
                    s, e = max(start, chunk), min(end, chunk + CHUNK_SIZE)
                    if size < e - chunk:  # a miss (-1) or an older, shorter version
                        short.append((len(out), n))
                        out.append(None)
                    else:
                        out.append((s, e, data[offset + s - chunk:offset + e - chunk]))
                        got += e - s
                    offset += max(size, 0)
            at += k
        unanswered = numbers.stop - at  # pieces after one that failed
        for n in range(at, numbers.stop):
            out.append((max(start, n * CHUNK_SIZE), min(end, (n + 1) * CHUNK_SIZE), None))
        missing = unanswered
        if short:
            # A lagging replica answered an older (shorter) version, or missed: ask a majority (Fig. 5).
            again = self.client.get([keys[n - numbers[0]] for _, n in short], consistent=True)
            for (i, n), ent in zip(short, again):
                chunk = n * CHUNK_SIZE
                s, e = max(start, chunk), min(end, chunk + CHUNK_SIZE)
                if ent is None or len(ent.value) < e - chunk:
                    out[i] = (s, e, None)
                    missing += 1
                else:
                    out[i] = (s, e, ent.value[s - chunk:e - chunk])
                    got += e - s
        with self._lock:
            self.counters["relaxed_chunks"] += len(numbers)
            self.counters["consistent_chunks"] += len(short)
            self.counters["cache_bytes"] += got
            self.counters["missing_chunks"] += missing
        return out  # type: ignore[return-value]  (every None was filled in above)

    def _pieces(self, keys: Sequence[bytes]) -> List[Tuple[Union[bytes, memoryview], List[int]]]:
        """Relaxed reads of ``keys`` in pieces of :data:`READ_PIECE_CHUNKS`, up to
        :data:`READ_PIECES_IN_FLIGHT` at once, answered in order, each as
        :meth:`CacheClient.get_joined` gives it. The pieces before the first that failed;
        the caller reads the rest as missing (from the store), so one slow piece does not
        void the others.

        Raises
        ------
        CacheError
            When the first piece failed.
        """
        if len(keys) <= READ_PIECE_CHUNKS:
            return [self.client.get_joined(keys)]
        pieces = [keys[at:at + READ_PIECE_CHUNKS] for at in range(0, len(keys), READ_PIECE_CHUNKS)]
        pool = _piece_pool()
        waiting: Deque["Future[Tuple[Union[bytes, memoryview], List[int]]]"] = collections.deque()
        answers: List[Tuple[Union[bytes, memoryview], List[int]]] = []
        sent = 0
        try:
            while sent < len(pieces) or waiting:
                while sent < len(pieces) and len(waiting) < READ_PIECES_IN_FLIGHT:
                    waiting.append(pool.submit(self.client.get_joined, pieces[sent]))
                    sent += 1
                try:
                    answers.append(waiting.popleft().result())
                except CacheError:
                    if not answers:
                        raise
                    break
        finally:
            for f in waiting:  # after a failure: pieces not started are not sent
                f.cancel()
        return answers

    def stats(self) -> Dict[str, int]:
        """A snapshot of the counters since creation.

        ``relaxed_chunks``, ``consistent_chunks``, ``cache_bytes``, ``missing_chunks``.
        """
        with self._lock:
            return dict(self.counters)
