"""The cached read path: lengths from the metadata cache, bytes from the data cache,
the durable store as fallback (docs/overview.md section 5, paper section 2.4 and Algorithm 1).

- Lengths: one batched consistent read of the metadata cache per poll round for all
  followed files. When the metadata cache is down, or knows nothing of a file, durable
  lengths are taken from the store (at most every ``durable_poll_interval`` while the
  cache is down, so a dead cache does not turn every poll into a store listing).
- Bytes below the published cache length: chunks from the data cache (relaxed, then
  consistent for short chunks); chunks still missing come from one durable range read per
  contiguous run.
- Bytes only the durable store has (the cache lags): read from the store only when
  Algorithm 1 says the cache is late by more than ``max_delay``; until then the read stops
  at the cache length so a momentarily lagging cache does not push readers onto the store.
- When the caches fail a reader (a data-cache read fails, Algorithm 1 sends a read to the
  store, the metadata cache cannot be read), the path reads lengths and bytes from the store
  alone for a hold (:class:`StoreHold`) and stops its pushes, then tries the caches again.
  Without it, a reader of overloaded caches would wait for pushes, then ask, then time out,
  then read the store -- all four, on every read.
- Caches that only time out (every replica asked gave no answer in time: loaded) do not fail
  a reader at once: for :data:`OVERLOAD_PATIENCE_S` it waits for them (lengths stand, reads
  stop short and are asked again at the next round), and only caches that keep timing out
  longer, or refuse calls, start a hold. Overload thus slows readers instead of sending them
  all to the store together, which cost more CPU and slowed the caches further.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Sequence, Set, Tuple, Union

from pyspark_acs import _fork
from pyspark_acs.cache.client import CacheClient, client_for
from pyspark_acs.cache.chunks import ChunkReader
from pyspark_acs.cache.endpoints import parse_endpoints
from pyspark_acs.cache.feed import ChunkFeed, holds_whole_files
from pyspark_acs.errors import CacheError, CacheTimeoutError
from pyspark_acs.cache.metadata import MetadataCache
from pyspark_acs.cache.poller import LengthPoller
from pyspark_acs.security import SecuritySettings
from pyspark_acs.storage.store import DurableStore

__all__ = [
    "CachedReadPath",
]

log = logging.getLogger(__name__)

#: Algorithm 1's maxDelay: how long the cache may trail the durable store before readers
#: go to the store.
DEFAULT_MAX_DELAY_S = 1.0
#: How often durable lengths are polled from the store while the metadata cache is down, and
#: how often the store's real size of a file is checked while its published length stands
#: still (the paper's ``colossus.size()``: a writer that crashed between its durable append and
#: publishing the length must not stall readers until the metadata entry expires).
DEFAULT_DURABLE_POLL_INTERVAL_S = 1.0
#: Largest write a process hands to its own readers with :meth:`CachedReadPath.notify` (the
#: last one per file is kept); larger ones are read from the cache.
RECENT_MAX_BYTES = 1024 * 1024
#: Repeated data-cache failures are logged at most this often.
_WARN_INTERVAL_S = 10.0
#: After a metadata-cache failure, retry it no sooner than this.
_METADATA_RETRY_S = 1.0
#: The first time the caches fail a reader, it reads from the store alone for this long
#: (seconds; :class:`StoreHold`).
STORE_HOLD_MIN_S = 1.0
#: Failing again soon after a hold doubles the next one, up to this (seconds): as a replica's
#: back-off, short enough that readers are back on the caches soon after an outage ends.
STORE_HOLD_MAX_S = 8.0
#: A failure this long (seconds) after the last hold ended starts again at the shortest hold.
STORE_HOLD_RESET_S = 2 * STORE_HOLD_MAX_S
#: How long the caches may keep timing out (every replica asked gave no answer in time: loaded,
#: or hung) before a reader reads from the store alone (a store hold). Until then it waits for
#: them: its lengths stand and its reads stop short, as a Redis client waits for a busy server.
#: Going to the store at the first expired deadline turned an overloaded cache into a storm of
#: store reads, which cost more CPU, which slowed the cache further (64 readers joining at once
#: on 2 cores). A cache that refuses calls (down) is failed over at once.
OVERLOAD_PATIENCE_S = 3.0
#: While the caches time out within the patience, the metadata cache is asked again after this
#: long, doubling up to :data:`SLOW_RETRY_MAX_S`: a reader waiting on a loaded cache asks it less.
SLOW_RETRY_MIN_S = 0.1
SLOW_RETRY_MAX_S = 1.0
#: How long a reader that looks at a few bytes once (a joining reader's look for a seal) waits
#: for the feed to push them before it asks the data cache: the file is followed from there,
#: so the push brings them with the first messages, where a Get under load costs a round trip
#: (hundreds of ms on a starved machine) and a replica's read of its own.
JOIN_PUSH_WAIT_S = 1.0
#: Each hold is drawn within +-25 % of its length, so the readers of overloaded caches, which
#: fail together, do not all come back to them at the same moment.
STORE_HOLD_JITTER = 0.25


def _max_known(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None:
        return b
    return a if b is None else max(a, b)


class DelayedDurableReads:
    """Algorithm 1 of the paper for one file: postpone durable reads while the cache catches up."""

    def __init__(self, max_delay: float = DEFAULT_MAX_DELAY_S) -> None:
        self.max_delay = max_delay
        self._history: Deque[Tuple[float, int]] = collections.deque()  # (time, durable size)
        self._cache_moved: Optional[Tuple[int, float]] = None  # (cache size, when it was first seen)

    def should_read_durable(self, cache_size: int, durable_size: int, now: Optional[float] = None) -> bool:
        """Whether a read past the cache length should go to the durable store now.

        Records ``durable_size``; returns True once the cache has trailed a recorded durable size
        for more than ``max_delay`` seconds (and then starts over), False while the cache is caught
        up or may still catch up. Not thread-safe.

        Parameters
        ----------
        cache_size, durable_size : int
            The file's current cache and durable lengths, in bytes.
        now : float, optional
            A ``time.monotonic()`` timestamp; defaults to the current time.
        """
        now = time.monotonic() if now is None else now
        if self._cache_moved is None or self._cache_moved[0] != cache_size:
            self._cache_moved = (cache_size, now)
        self._history.append((now, durable_size))
        while self._history and self._history[0][1] <= cache_size:
            self._history.popleft()  # positions the cache has caught up with
        if not self._history:
            return False  # the cache is caught up
        if now > self._history[0][0] + self.max_delay:
            self._history.clear()
            return True  # the cache is late: go to the store
        return False  # the cache may catch up soon

    def cache_stood(self, now: float) -> bool:
        """Whether the cache size given to :meth:`should_read_durable` stood still for
        ``max_delay`` up to ``now``: a cache that still grows is catching up (loaded), one that
        stood is not getting the bytes (down, or the writer lost them)."""
        return self._cache_moved is not None and now - self._cache_moved[1] >= self.max_delay


class StoreHold:
    """How long a reader that the caches failed reads from the durable store alone.

    A circuit breaker with a doubling hold: :meth:`trip` starts a hold of
    :data:`STORE_HOLD_MIN_S`, doubled (up to :data:`STORE_HOLD_MAX_S`) when the previous hold
    ended less than :data:`STORE_HOLD_RESET_S` ago, each drawn within
    :data:`STORE_HOLD_JITTER`. Not thread-safe.
    """

    def __init__(self, min_hold: float = STORE_HOLD_MIN_S, max_hold: float = STORE_HOLD_MAX_S) -> None:
        self.min_hold = min_hold
        self.max_hold = max_hold
        self.hold = 0.0  # the length of the last hold before its jitter (0: none yet)
        self.until = float("-inf")  # when the current or last hold ends (the caller's clock)

    def holding(self, now: float) -> bool:
        """Whether a hold runs at ``now`` (read from the store alone)."""
        return now < self.until

    def trip(self, now: float) -> Optional[float]:
        """The caches failed a reader at ``now``: start a hold and return its length in
        seconds, or None while one runs already."""
        if now < self.until:
            return None
        soon = self.hold > 0 and now - self.until < STORE_HOLD_RESET_S
        self.hold = min(self.hold * 2, self.max_hold) if soon else self.min_hold
        seconds = self.hold * random.uniform(1.0 - STORE_HOLD_JITTER, 1.0 + STORE_HOLD_JITTER)
        self.until = now + seconds
        return seconds


class CachedReadPath:
    """A :class:`~pyspark_acs.read.readpath.ReadPath` through the caches of one cluster.

    Parameters
    ----------
    store : DurableStore
        The cluster's durable store.
    data_cache, metadata_cache : str or CacheClient, optional
        Endpoint strings (``host:port,...``) or clients. Without a data cache, bytes come
        from the store; without a metadata cache, lengths do.
    max_delay : float
        Algorithm 1's maxDelay (default 1 s).
    token : str, optional
        Shared token of token-protected cache servers (default ``$ACS_CACHE_TOKEN``).
    security : SecuritySettings, optional
        Token and TLS settings of the cache clients (default: the environment's,
        :func:`~pyspark_acs.security.resolve_security`).
    shared_poller : bool
        Take metadata lengths from the process's shared :class:`~pyspark_acs.cache.poller.LengthPoller`
        (one batched read per interval for every reader of the process; default) instead of
        reading them on every call.
    poller : LengthPoller, optional
        The process's poller to take lengths from when ``metadata_cache`` is a ready client
        (the copy daemon passes the shared poller of its cluster's metadata cache).
    durable_poll_interval : float
        Durable-length polling interval while the metadata cache is down (default 1 s).
    push : bool
        Have the bytes of files this path reads pushed by the data cache (the process's shared
        :class:`~pyspark_acs.cache.feed.ChunkFeed`): for readers that tail files (Consumers,
        the copy daemon). Reads the feed holds need no request; the rest is read as without.
        Only with no more data replicas than the replication factor (each holds every chunk).
    feed : ChunkFeed, optional
        The feed to have bytes pushed through when ``push`` is on (default: the process's
        shared one for the data cache; tests pass one with their own buffer size or clock).
    clock : callable
        Monotonic seconds (``time.monotonic``): the clock of the metadata cache's retry, the
        durable poll interval, Algorithm 1's delay, the store hold and the warning interval.
    """

    def __init__(
        self,
        store: DurableStore,
        *,
        data_cache: Union[str, CacheClient, None] = None,
        metadata_cache: Union[str, CacheClient, None] = None,
        max_delay: float = DEFAULT_MAX_DELAY_S,
        durable_poll_interval: float = DEFAULT_DURABLE_POLL_INTERVAL_S,
        shared_poller: bool = True,
        token: Optional[str] = None,
        poller: Optional[LengthPoller] = None,
        push: bool = False,
        security: Optional[SecuritySettings] = None,
        feed: Optional[ChunkFeed] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.clock = clock
        #: The process that made this path: the only one with its feed's and poller's threads.
        self._made = _fork.mark()
        self._own = []
        # Readers given endpoint strings share the process's poller and feed, and read through
        # their clients: one channel per replica in the process, not one per client (a
        # joining reader's connect is most of what it costs, and each channel is a connection
        # every replica serves). A caller-made client (tests, the copy daemon's own poller) is
        # read directly.
        given = {"data": _endpoint_string(data_cache), "meta": _endpoint_string(metadata_cache)}
        self.poller: Optional[LengthPoller] = poller
        if poller is None and shared_poller and given["meta"]:
            self.poller = LengthPoller.shared(given["meta"], token=token, security=security)
            meta: Optional[CacheClient] = self.poller.meta.client
        else:
            meta = client_for(metadata_cache, "metadata cache", self._own, token, security)
        self.meta = MetadataCache(meta) if meta else None
        # Bytes are pushed only where the replica a feed follows holds every chunk of a file
        # (no more data replicas than the replication factor). With more, a file's chunks are
        # spread over them; the feed stops at each chunk its replica lacks, and each reader
        # passing one would reopen the Follow call many times a second: such a deployment
        # reads by asking, its lengths still pushed.
        self.feed: Optional[ChunkFeed] = None
        if push and feed is None and given["data"]:
            shared = ChunkFeed.shared(given["data"], token=token, security=security)
            self.data: Optional[CacheClient] = shared.client
            if holds_whole_files(self.data):
                self.feed = shared
        else:
            self.data = client_for(data_cache, "data cache", self._own, token, security)
            if push and self.data and holds_whole_files(self.data):
                self.feed = feed if feed is not None else ChunkFeed.shared(self.data.endpoints,
                                                                           security=self.data.security)
        self.chunks = ChunkReader(self.data) if self.data else None
        # rel -> the readers of it this path follows in the feed (guarded by _lock)
        self._fed: Dict[str, Set[Hashable]] = {}
        self._closed = False  # set by close(): expect() follows nothing after it
        self.max_delay = max_delay
        self.durable_poll_interval = durable_poll_interval
        # _lock guards _fed, _published, _polled, _recent, _delays, _durable_cache, _standing,
        # _meta_down_until, _hold, the _slow_* fields and _stats.
        self._lock = threading.Lock()
        self._published: Dict[str, Tuple[Optional[int], Optional[int]]] = {}
        # files asked of the shared poller (released when this path closes)
        self._polled: Set[str] = set()
        # rel -> (start, bytes) this process just wrote to the data cache (notify): served
        # from memory instead of a cache round trip (the copy daemon's next hop).
        self._recent: Dict[str, Tuple[int, bytes]] = {}
        self._delays: Dict[str, DelayedDurableReads] = {}
        self._durable_cache: Dict[str, Tuple[float, Optional[int]]] = {}
        # rel -> (published length, when it last moved or the store was last asked)
        self._standing: Dict[str, Tuple[int, float]] = {}
        self._meta_down_until = 0.0
        self._hold = StoreHold()
        # The caches' timeouts within OVERLOAD_PATIENCE_S: per cache ("data", "metadata"), when
        # the first of a run came (absent: its last call answered; each cache's own answers end
        # its run, so a metadata cache that answers does not keep readers waiting on a hung data
        # cache), and until when lengths stand before the metadata cache is asked again
        # (_slow_retry: the next such wait).
        self._slow_since: Dict[str, float] = {}
        self._slow_until = float("-inf")
        self._slow_retry = SLOW_RETRY_MIN_S
        self._warned_at = float("-inf")  # last data-cache warning (clock)
        self._stats = {"durable_bytes": 0, "durable_fallbacks": 0, "metadata_fallbacks": 0, "pushed_bytes": 0,
                       "store_holds": 0, "cache_waits": 0}

    def connect(self, *, at_latest: bool = False) -> None:
        """Set up now what the first read would: gRPC imported, channels to every replica of
        the caches this path asks open (the clients it reads through: the shared poller's,
        and its data client unless a feed pushes its bytes). A tailing reader calls it when
        it starts, so that work is not charged to its first messages -- nor, when many reader
        processes start together, done by all of them at the moment the first file appears.
        Replicas that do not answer are left to the calls (see :meth:`CacheClient.connect`).

        ``at_latest``: the reader joins at the end of the files (:meth:`join_latest`). A
        pushing path then connects nothing: the replica its feed follows on says where the
        reader joins, and the metadata cache is connected at its first call, if one comes
        (the fed reader's lengths come by push). Its three channels and Health calls were
        half of a joining reader's CPU, paid at once by every reader of a spike."""
        if at_latest and self.feed is not None:
            return
        # A pushing path reads bytes from its feed, whose stream opens the one channel it
        # follows on when it follows a file: the data cache's other channels and their Health
        # calls would be a third of a joining reader's CPU, for Gets it seldom makes.
        clients = [self.data if self.feed is None else None, self.meta.client if self.meta is not None else None,
                   self.poller.meta.client if self.poller is not None else None]
        unique = list({id(c): c for c in clients if c is not None}.values())
        errors: List[BaseException] = []

        def run(client: CacheClient) -> None:
            try:
                client.connect()
            except BaseException as exc:  # raised below, in the caller's thread
                errors.append(exc)

        # In parallel: each waits at most CONNECT_TIMEOUT_S for replicas that do not answer.
        threads = [threading.Thread(target=run, args=(c,), name="acs-connect", daemon=True) for c in unique]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    # -- lengths ---------------------------------------------------------------------------

    def lengths(self, rels: Sequence[str]) -> Dict[str, Optional[int]]:
        """Readable length per file: the larger of the published cache and durable lengths."""
        self._check_process()
        rels = list(rels)
        published: Dict[str, Tuple[Optional[int], Optional[int]]] = {}
        now = self.clock()
        meta_down = self.meta is not None and now < self._meta_down_until
        holding = self.holding(now)  # store lengths, fresh at every call, as without caches
        slow = self.meta is not None and not holding and now < self._slow_until
        if self.meta is not None and rels and not meta_down and not holding and not slow:
            uris = [self.store.uri(r) for r in rels]
            if self.poller is not None:
                with self._lock:
                    self._polled.update(rels)
            try:
                got = self.poller.lengths(uris) if self.poller is not None else self.meta.lengths(uris)
                published = {r: got[u] for r, u in zip(rels, uris)}
                self._answered("metadata")
            except CacheError as exc:
                if self._bends("metadata", exc, now):
                    slow = True
                    with self._lock:
                        self._slow_until = now + self._slow_retry
                        self._slow_retry = min(SLOW_RETRY_MAX_S, 2 * self._slow_retry)
                else:
                    meta_down = True
                    with self._lock:
                        self._meta_down_until = now + _METADATA_RETRY_S
                        self._stats["metadata_fallbacks"] += 1
                    self._trip(f"metadata cache unavailable: {exc}")
        if slow:
            # The metadata cache is loaded: the lengths it gave last stand (the store is not
            # asked for files it knows, nor does Algorithm 1 learn that the store is ahead).
            with self._lock:
                published = {r: self._published[r] for r in rels if r in self._published}
        unknown = [r for r in rels if published.get(r, (None, None)) == (None, None)]
        # While the metadata cache is down, durable lengths are polled less often; files it
        # simply does not know (written without caches) are read from the store each time.
        durable = self._durable_lengths(unknown, cached=meta_down and not holding)
        # Published lengths that stood still for a poll interval: ask the store for its real
        # size (Algorithm 1 is fed by it; the read path postpones durable reads by maxDelay).
        stalled = [] if slow else self._stalled([r for r in rels if r not in durable], published, now)
        if stalled:
            durable.update(self.store.lengths(stalled))
        out: Dict[str, Optional[int]] = {}
        with self._lock:
            for r in rels:
                c, d = published.get(r, (None, None))
                if c is None and d is None:
                    d = durable.get(r)
                    if d is None:
                        out[r] = None
                        continue
                else:
                    d = _max_known(d, durable.get(r))
                # Files only grow: never let a length go below one already seen (a durable
                # length cached before the metadata cache went down, or a lagging replica,
                # would otherwise look like the file shrank).
                c0, d0 = self._published.get(r, (None, None))
                c, d = _max_known(c, c0), _max_known(d, d0)
                self._published[r] = (c, d)
                out[r] = max(c or 0, d or 0)
        return out

    def _stalled(self, rels: Sequence[str], published: Dict[str, Tuple[Optional[int], Optional[int]]],
                 now: float) -> list:
        """Files whose published length has not moved for ``durable_poll_interval`` (and whose
        store size was not asked for within it)."""
        out = []
        with self._lock:
            for r in rels:
                c, d = published.get(r, (None, None))
                value = max(c or 0, d or 0)
                seen = self._standing.get(r)
                if seen is None or seen[0] != value:
                    self._standing[r] = (value, now)
                elif now - seen[1] >= self.durable_poll_interval:
                    self._standing[r] = (value, now)
                    out.append(r)
        return out

    def _durable_lengths(self, rels: Sequence[str], cached: bool) -> Dict[str, Optional[int]]:
        """Store lengths; while the metadata cache is down they are reused for a poll interval."""
        if not rels:
            return {}
        now = self.clock()
        out: Dict[str, Optional[int]] = {}
        ask = []
        with self._lock:
            for r in rels:
                hit = self._durable_cache.get(r)
                if cached and hit is not None and now - hit[0] < self.durable_poll_interval:
                    out[r] = hit[1]
                else:
                    ask.append(r)
        if ask:
            fresh = self.store.lengths(ask)
            with self._lock:
                for r, n in fresh.items():
                    self._durable_cache[r] = (now, n)
                    out[r] = n
        return out

    def change_token(self) -> Optional[int]:
        """Take before reading lengths; pass to :meth:`wait` (see :meth:`LengthPoller.change_token`)."""
        return self.poller.change_token() if self.poller is not None else None

    def wait(self, timeout: float, since: Optional[int] = None) -> None:
        """Wait until published lengths may have moved (the shared poller saw a change since
        the token ``since``, or since now), at most ``timeout`` seconds; without a poller, sleep."""
        if self.poller is not None:
            self.poller.wait_for_change(timeout, since)
        else:
            time.sleep(timeout)

    def pushed(self, rels: Sequence[str]) -> bool:
        """Whether every change of these files' lengths reaches this process by push (live
        streams or a feed), so its readers need not poll them (:meth:`wait` wakes them)."""
        if self.poller is None or not rels or self.holding():
            return False
        return self.poller.all_pushed([self.store.uri(r) for r in rels])

    def published_boundary(self, rel: str) -> Optional[int]:
        """A length of ``rel`` a writer published in the metadata cache (the cache length, else
        the durable one), by one consistent read: a block boundary where a Producer or sink
        published it (docs/format.md), not always in a copy, where the copy daemon may publish
        the end of a torn append (:func:`latest_offset` asks only in source clusters); None without a metadata cache, while it is down or held off, or when
        it knows nothing of the file. Not a readable length: bytes a store holds past it are
        not counted (they may end in a torn block)."""
        self._check_process()
        if self.meta is None or self.holding() or self.clock() < self._meta_down_until:
            return None
        uri = self.store.uri(rel)
        if self.feed is not None:
            # A pushing reader follows the file next (its look for a seal): covered first, the
            # poller's round that the seed below starts opens no Watch calls on three replicas
            # that would go idle moments later.
            self._cover(rel, uri, self.feed)
        try:
            c, d = self.meta.lengths([uri])[uri]
        except CacheError:
            return None  # the caller walks the file's headers instead
        with self._lock:  # known from now on: reads below them go to the cache
            c0, d0 = self._published.get(rel, (None, None))
            self._published[rel] = (_max_known(c, c0), _max_known(d, d0))
            if self.poller is not None:
                self._polled.add(rel)
        if self.poller is not None:
            self.poller.seed(uri, (c, d))  # the reader's first lengths need no read of their own
        # The cache length when there is one: the bytes below it (the seal check's too) are
        # read from the cache, not the store; blocks durable past it are new to the reader.
        return c if c else d

    def join_latest(self, rel: str, back: int) -> Optional[int]:
        """Follow ``rel`` from its end without asking for lengths: the last block boundary a
        writer marked in the replica the feed follows on (:meth:`ChunkFeed.follow_latest`),
        pushed from ``back`` bytes before it (the caller's look for a seal). The boundary is a
        block boundary (a Producer's or sink's append ended there; a copy marks none) and
        every byte below it is durable, so it is taken as the file's cache length here.

        Returns None without a feed, while the store holds this path, when this path follows
        the file already, when the replica has no boundary for the file (a restarted replica,
        a file idle past the data cache's time to live, a copy) or does not answer: the caller
        then joins by the published lengths (:meth:`published_boundary`)."""
        self._check_process()
        feed = self.feed
        if feed is None or self._closed or self.holding():
            return None
        uri = self.store.uri(rel)
        rid = id(self)
        readers = self._cover(rel, uri, feed)
        with self._lock:
            if rid in readers:
                return None
        end = feed.follow_latest(uri, rid, back, on_grow=self._grown if self.poller is not None else None)
        if end is None:
            return None
        with self._lock:
            readers.add(rid)
            c0, d0 = self._published.get(rel, (None, None))
            self._published[rel] = (_max_known(end, c0), d0)
            if self.poller is not None:
                self._polled.add(rel)
        if self.poller is not None:
            # Its first lengths: the reader's first look needs no consistent read of its own.
            self.poller.seed(uri, (end, None), fed=True)
        return end

    def durable_length(self, rel: str) -> Optional[int]:
        """The durable store's length of ``rel`` in bytes (``None`` if missing), bypassing the caches."""
        return self.store.lengths([rel])[rel]

    def published(self, rel: str) -> Tuple[Optional[int], Optional[int]]:
        """``(cache length, durable length)`` of ``rel`` as the last :meth:`lengths` saw them
        (``None``: unknown); the durable one includes the store's real size when it was asked."""
        with self._lock:
            return self._published.get(rel, (None, None))

    def notify(self, rel: str, cache_length: Optional[int] = None, durable_length: Optional[int] = None,
               data: Optional[Tuple[int, bytes]] = None) -> None:
        """A length of ``rel`` this process published itself (the copy daemon's writer): raise
        the known lengths and wake readers at once (through the poller). ``data`` =
        ``(start, bytes)`` it just wrote to the data cache, kept (up to
        :data:`RECENT_MAX_BYTES`) so the next read of them needs no cache round trip. Call it
        only for files this path's readers follow; :meth:`forget` drops the state."""
        with self._lock:
            c, d = self._published.get(rel, (None, None))
            self._published[rel] = (_max_known(c, cache_length), _max_known(d, durable_length))
            if data is not None and 0 < len(data[1]) <= RECENT_MAX_BYTES:
                self._recent[rel] = (data[0], bytes(data[1]))
        if self.poller is not None:
            self.poller.notify(self.store.uri(rel), cache_length, durable_length)

    def _recent_bytes(self, rel: str, start: int, end: int) -> Optional[bytes]:
        with self._lock:
            got = self._recent.get(rel)
        if got is None or not (got[0] <= start and end <= got[0] + len(got[1])):
            return None
        return got[1][start - got[0]: end - got[0]]

    # -- bytes -----------------------------------------------------------------------------

    def read(self, rel: str, start: int, end: int, *, postpone: bool = True,
             reader: Optional[Hashable] = None) -> bytes:
        """Bytes ``[start, end)``, cache first; may stop short while Algorithm 1 postpones
        a durable read (the caller retries at its next poll).

        With ``push``, bytes the data cache pushed come first (no request), the rest as below.
        ``postpone=False`` reads bytes past the cache length from the store at once (a durable
        copy must not wait for the cache). ``reader`` names one of several readers of a file
        sharing this path (:meth:`for_reader`): the feed keeps bytes until each has read them.
        """
        self._check_process()
        if end > start and self.holding():
            return self._durable(rel, start, end)
        feed = self.feed
        if feed is None or end <= start:
            return self._read(rel, start, end, postpone)
        uri = self.store.uri(rel)
        rid = self._follow(feed, rel, uri, reader, start)
        # The pushed bytes are the cache's, i.e. the file's own (a chunk is written only
        # after the durable append it mirrors was verified); the caller reads only below the
        # readable length, so they may even be ahead of the published cache length.
        got = feed.read(uri, start, end)
        if got:
            with self._lock:
                self._stats["pushed_bytes"] += len(got)
        # Bytes the live feed is about to push are waited for, not asked for (a busy replica
        # asked for what it is pushing falls further behind); a durable copy does not wait.
        if start + len(got) < end and not (postpone and feed.waiting(uri, start + len(got))):
            got += self._read(rel, start + len(got), end, postpone)
        feed.consumed(uri, rid, start, start + len(got))  # it reads on from its last complete block
        return got

    def read_pushed(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` read once, without postponing (as ``read(postpone=False)``),
        but taken from the feed's push when it brings them within :data:`JOIN_PUSH_WAIT_S`:
        the file is followed from ``start`` (if this path does not follow it yet), and the
        bytes come with the replica's first push instead of by a request of their own."""
        self._check_process()
        feed = self.feed
        if feed is None or end <= start or self.holding():
            return self.read(rel, start, end, postpone=False)
        uri = self.store.uri(rel)
        rid = self._follow(feed, rel, uri, None, start)
        got = feed.wait_read(uri, start, end, JOIN_PUSH_WAIT_S)
        if len(got) < end - start:
            return self.read(rel, start, end, postpone=False)
        with self._lock:
            self._stats["pushed_bytes"] += len(got)
        feed.consumed(uri, rid, start, end)
        return got

    def expect(self, rel: str, position: int, *, reader: Optional[Hashable] = None) -> None:
        """This path's reader (a Consumer's tailer) moved to ``rel`` at ``position`` and reads
        on from there: follow the file in the feed now, before its first length is known,
        rather than at the first read that finds bytes.

        A file the feed covers from the start is never watched: its first bytes, and with them
        its length, come by push. Followed at the first read instead, a new file (length 0)
        would be watched first, and the three Watch calls opened for its lengths would go idle
        moments later when the feed covered it: about half of a consumer's CPU for its first
        message, paid at once by every consumer started together.
        """
        self._check_process()
        feed = self.feed
        if feed is None or self._closed or self.holding():
            return
        self._follow(feed, rel, self.store.uri(rel), reader, start=position)

    def _follow(self, feed: ChunkFeed, rel: str, uri: str, reader: Optional[Hashable], start: int) -> Hashable:
        """Have ``rel``'s bytes pushed to ``reader`` (None: this path's own) from ``start``
        (once per reader and file: later reads tell the feed where the reader stands), and
        cover the file in the poller when it is the path's first reader of it. Returns the
        reader's id in the feed."""
        rid = id(self) if reader is None else reader
        readers = self._cover(rel, uri, feed)
        with self._lock:
            new = rid not in readers
            readers.add(rid)
        if new:
            # Pushed bytes raise the file's known cache length and wake its readers: they are
            # in the data cache, i.e. mirrored after their durable append was verified (the
            # write path's order), so a reader may take them before the length is published.
            feed.follow(uri, rid, start, self._grown if self.poller is not None else None)
        return rid

    def _cover(self, rel: str, uri: str, feed: ChunkFeed) -> Set[Hashable]:
        """The readers of ``rel`` this path follows in the feed; the first call per file tells
        the poller that the feed covers it (:meth:`LengthPoller.cover`, undone by :meth:`forget`)."""
        with self._lock:
            readers = self._fed.get(rel)
            first = readers is None
            if first:
                readers = self._fed[rel] = set()
        if first and self.poller is not None:
            self.poller.cover(uri, lambda known: feed.live(uri, known))
        return readers

    def for_reader(self, reader: Hashable) -> "ReaderView":
        """This path as one of several readers sharing it sees it (the copy daemon's
        operations: two destinations of one file read it at different positions). Its reads
        move that reader's position in the feed, not a position shared with the others (which
        made the feed drop bytes a lagging reader still needed: asked for instead of pushed).
        Call :meth:`ReaderView.leave` when the reader is done with a file."""
        return ReaderView(self, reader)

    def leave(self, rel: str, reader: Hashable) -> None:
        """Reader ``reader`` is done with ``rel``: the feed no longer keeps bytes for it (the
        file's other state stays until :meth:`forget`)."""
        with self._lock:
            readers = self._fed.get(rel)
            if readers is not None:
                readers.discard(reader)  # an empty set stays: the poller's cover goes with forget()
        if self.feed is not None:
            # Also when not recorded: a forget() (the file's last other reader leaving, on its
            # thread) may land between a read recording the reader and following the file in
            # the feed (outside _lock); the feed would follow the file for nobody.
            self.feed.unfollow(self.store.uri(rel), reader)

    def _grown(self, uri: str, end: int) -> None:
        """The feed holds ``uri``'s bytes up to ``end`` (stream thread): a cache length."""
        self.poller.notify(uri, cache_length=end, fed=True)

    def _read(self, rel: str, start: int, end: int, postpone: bool) -> bytes:
        with self._lock:
            cache_len, durable_len = self._published.get(rel, (None, None))
        cache_len = cache_len or 0
        if self.chunks is None or cache_len <= start:
            cache_end = start
        else:
            cache_end = min(end, cache_len)
        parts = []
        local = self._recent_bytes(rel, start, cache_end) if cache_end > start else None
        if local is not None:
            parts.append(local)  # this process just wrote these bytes to the cache
        elif cache_end > start:
            uri = self.store.uri(rel)
            try:
                chunks = self.chunks.read(uri, start, cache_end)
                self._answered("data")
            except CacheError as exc:
                if self._bends("data", exc, self.clock()):
                    if postpone:
                        return b""  # wait for the loaded cache: read again at the next round
                    # A read that must not wait (a joining reader's look for a seal, a durable
                    # copy) takes these bytes from the store, and only these: a hold of every
                    # read at the first expired deadline sent each of many readers joining a
                    # loaded cache to the store for a second or more.
                else:
                    self._trip(f"data cache read failed: {exc}")
                chunks = [(start, cache_end, None)]
            run_start = None
            for s, e, data in chunks + [(cache_end, cache_end, b"")]:
                if data is None:
                    if run_start is None:
                        run_start = s
                    continue
                if run_start is not None:
                    # One durable read for the whole run of missing chunks (Fig. 6).
                    got = self._durable(rel, run_start, s)
                    parts.append(got)
                    if len(got) < s - run_start:
                        # The store does not have these bytes yet (the cache can lead it):
                        # stop here so the result stays a prefix; later chunks must not
                        # be joined on after a gap.
                        return b"".join(parts)
                    run_start = None
                if data:
                    parts.append(data)
        if end > cache_end:
            delay = self._delay(rel)
            now = self.clock()
            with self._lock:  # DelayedDurableReads is not thread-safe; readers may share a file
                late = (self.chunks is not None and postpone
                        and delay.should_read_durable(cache_len, durable_len or end, now))
                go_durable = self.chunks is None or not postpone or late
                # A late read holds the path to the store only when the cache stood still.
                stood = late and delay.cache_stood(now)
            if stood:
                self._trip(f"the data cache trails the store by more than {self.max_delay:g} s")
            if go_durable:
                parts.append(self._durable(rel, cache_end, end))
        return b"".join(parts)

    def _bends(self, cache: str, exc: CacheError, now: float) -> bool:
        """Whether the path waits for ``cache`` ("data" or "metadata") after ``exc`` instead of
        failing over to the store: ``exc`` is a timeout (no replica asked answered in time) and
        that cache has not been timing out for :data:`OVERLOAD_PATIENCE_S` yet."""
        if not isinstance(exc, CacheTimeoutError):
            return False
        with self._lock:
            since = self._slow_since.setdefault(cache, now)
            if now - since >= OVERLOAD_PATIENCE_S:
                return False
            self._stats["cache_waits"] += 1
            return True

    def _answered(self, cache: str) -> None:
        """A call to ``cache`` succeeded: its run of timeouts is over."""
        if cache in self._slow_since:  # read without the lock: a benign race
            with self._lock:
                self._slow_since.pop(cache, None)
                if cache == "metadata":
                    self._slow_retry = SLOW_RETRY_MIN_S

    def holding(self, now: Optional[float] = None) -> bool:
        """Whether the path reads from the durable store alone now: the caches failed it
        within a hold (:class:`StoreHold`)."""
        now = self.clock() if now is None else now
        with self._lock:
            return self._hold.holding(now)

    def _trip(self, reason: str) -> None:
        """The caches failed this path: read lengths and bytes from the store alone for a hold,
        and stop what the caches push to it (the feed's bytes, the poller's watches of its
        files), so an overloaded cache gets less work, not more. After the hold, the next
        :meth:`read` follows its file in the feed again and :meth:`lengths` asks the poller."""
        now = self.clock()
        with self._lock:
            seconds = self._hold.trip(now)
            if seconds is None:
                return
            self._stats["store_holds"] += 1
            fed, self._fed = self._fed, {}
            polled, self._polled = list(self._polled), set()
            due = now - self._warned_at >= _WARN_INTERVAL_S
            if due:
                self._warned_at = now
        # A read of another thread that recorded its reader before the swap may still follow
        # the file in the feed after this: the feed then pushes to it until the path forgets
        # the file or closes (bounded by FEED_MAX_BYTES); it does not change what is read.
        for r, readers in fed.items():
            self._unfeed(r, readers)
        if self.poller is not None and polled:
            self.poller.release([self.store.uri(r) for r in polled])
        if due:  # at most every _WARN_INTERVAL_S: a reader of failing caches trips again and again
            log.warning("%s; reading from the durable store alone for %.1f s", reason, seconds)

    def _delay(self, rel: str) -> DelayedDurableReads:
        with self._lock:
            d = self._delays.get(rel)
            if d is None:
                d = self._delays[rel] = DelayedDurableReads(self.max_delay)
            return d

    def _durable(self, rel: str, start: int, end: int) -> bytes:
        data = self.store.read(rel, start, end)
        with self._lock:
            self._stats["durable_bytes"] += len(data)
            self._stats["durable_fallbacks"] += 1
        return data

    def stats(self) -> Dict[str, int]:
        """``cache_bytes`` (from the data cache: asked for, or pushed), ``pushed_bytes`` (of
        those, pushed), ``relaxed_chunks``, ``consistent_chunks``, ``missing_chunks``,
        ``durable_bytes``, ``durable_fallbacks``, ``metadata_fallbacks``, ``store_holds`` (how
        often the caches failed the path and it read from the store alone for a while),
        ``cache_waits`` (how often it waited for caches that timed out instead)."""
        with self._lock:
            out = dict(self._stats)
        base = self.chunks.stats() if self.chunks else {"cache_bytes": 0, "relaxed_chunks": 0, "consistent_chunks": 0, "missing_chunks": 0}
        out.update(base)
        out["cache_bytes"] += out["pushed_bytes"]
        return out

    def forget(self, rel: str) -> None:
        """Drop per-file state once a reader left the file."""
        with self._lock:
            fed = self._fed.pop(rel, None)
            self._published.pop(rel, None)
            self._polled.discard(rel)
            self._recent.pop(rel, None)
            self._delays.pop(rel, None)
            self._durable_cache.pop(rel, None)
            self._standing.pop(rel, None)
        if fed is not None:
            self._unfeed(rel, fed)

    def _unfeed(self, rel: str, readers: Set[Hashable]) -> None:
        """Stop following ``rel`` in the feed for ``readers`` and undo the poller's cover of it
        (the path's last state of the file there: :meth:`forget`, :meth:`close`)."""
        if self.feed is None:
            return
        uri = self.store.uri(rel)
        for reader in readers:
            self.feed.unfollow(uri, reader)
        if self.poller is not None:
            self.poller.uncover(uri)

    def _check_process(self) -> None:
        """Refuse a forked child (before any lock: a parent's thread may have held one)."""
        if not _fork.made_here(self._made):
            raise _fork.made_elsewhere(self._made, "CachedReadPath (a Consumer's, through the caches)")

    def close(self) -> None:
        """Close the cache clients this path created from endpoint strings, and the store's open files.

        Clients passed in as :class:`~pyspark_acs.cache.client.CacheClient` objects stay open.
        The shared poller stops polling the files this path asked for (unless others follow them).
        In a child forked after the path was made, nothing is this process's to close: it does
        nothing (the locks and calls are the parent's).
        """
        if not _fork.made_here(self._made):
            return
        self._closed = True  # expect() follows nothing from now on
        if self.poller is not None:
            with self._lock:
                rels, self._polled = list(self._polled), set()
            self.poller.release([self.store.uri(r) for r in rels])
        if self.feed is not None:
            with self._lock:
                fed, self._fed = self._fed, {}
            for r, readers in fed.items():
                self._unfeed(r, readers)
        for c in self._own:
            c.close()
        self.store.close()


class ReaderView:
    """A :class:`CachedReadPath` as one of several readers sharing it sees it
    (:meth:`CachedReadPath.for_reader`): reads carry the reader's name to the feed; everything
    else is the path's."""

    def __init__(self, path: CachedReadPath, reader: Hashable) -> None:
        self.path = path
        self.reader = reader

    def read(self, rel: str, start: int, end: int, *, postpone: bool = True) -> bytes:
        """:meth:`CachedReadPath.read` as this reader."""
        return self.path.read(rel, start, end, postpone=postpone, reader=self.reader)

    def leave(self, rel: str) -> None:
        """This reader is done with ``rel`` (:meth:`CachedReadPath.leave`)."""
        self.path.leave(rel, self.reader)

    def expect(self, rel: str, position: int) -> None:
        """:meth:`CachedReadPath.expect` as this reader."""
        self.path.expect(rel, position, reader=self.reader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.path, name)


def _endpoint_string(value: Any) -> Optional[Tuple[str, ...]]:
    """The endpoints of a cache option given as endpoints (a string or a sequence of
    ``host:port``), validated; None for no cache or a caller-made client."""
    if value is None or value == "" or isinstance(value, CacheClient):
        return None
    return parse_endpoints(value)
