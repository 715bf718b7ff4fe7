"""One background length poller per process and metadata cache (docs/overview.md section 5).

Every reader in a process (Consumers, Spark read tasks in one Python worker) that follows
files through the same metadata cache shares one :class:`LengthPoller`: a daemon thread that
reads the published lengths of *all* followed files in one batched consistent read every
``interval``. Readers take the latest polled values instead of each issuing its own reads, so
the metadata cache sees one request per process per interval however many readers there are.

A file asked for the first time is fetched at once (no interval of delay for a new file);
files nobody asked for during ``forget_after_s`` (:data:`FORGET_AFTER_S`) are dropped from the poll, unless a
reader follows them explicitly (:meth:`LengthPoller.follow`, with an event set whenever the
file's length moves: the copy daemon's operations and its scheduler's parked operations). A
length this process published itself (the copy daemon's writer) is handed in with
:meth:`LengthPoller.notify`, so readers of the next hop move at once instead of at the next
poll. The thread starts on first use and stops when nothing is followed, so importing this
module starts no thread. The copy daemon uses this poller too: one per process.

**Push** (docs/cache.md): the poller also keeps one :class:`~pyspark_acs.cache.push.WatchStream`
per metadata replica, watching the length keys of every file it polls; a replica pushes a
length the moment a put stores it, and readers wake at once. A file whose two length keys a
majority of their replicas' live streams have confirmed is no longer polled every
``interval`` but every :data:`PUSH_SAFETY_POLL_S` (a safety net): the metadata cache then sees
no request per poll round at all, only pushed changes. Any replica's length is safe to take (a
length is published only after every byte below it is written), and with a majority of a key's
replicas watched every acknowledged (majority) write reaches at least one of them, so this is
as fresh as the consistent read it replaces; with fewer, the file is polled as before. A file
whose bytes a feed pushes (:meth:`LengthPoller.cover`) needs no watch: pushed bytes raise its
length; it is polled every round only once its feed has not moved for
:data:`~pyspark_acs.cache.feed.PUSH_GRACE_S` while behind the longest length known here
(:meth:`LengthPoller._fed_recently`).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.fanout import majority
from pyspark_acs.cache.feed import PUSH_GRACE_S
from pyspark_acs.errors import CacheError, ClosedError
from pyspark_acs.cache.metadata import MetadataCache, length_keys, parse_length_key
from pyspark_acs.security import SecuritySettings, resolve_security

if TYPE_CHECKING:
    from pyspark_acs.cache.push import WatchStream

__all__ = [
    "DEFAULT_POLL_INTERVAL_S",
    "LengthPoller",
    "PUSH_SAFETY_POLL_S",
    "safety_period",
]

#: How often a reader looks for new bytes: the shared poller's reads of all followed lengths
#: and a Consumer's (and the Spark source's) default poll interval.
DEFAULT_POLL_INTERVAL_S = 0.01
#: A file no reader asked about for this long is no longer polled (the default of
#: ``LengthPoller(forget_after_s=)``).
FORGET_AFTER_S = 5.0
#: How often a file whose lengths push streams deliver is polled all the same (seconds, on
#: average: each wait is drawn from +-PUSH_SAFETY_JITTER of it).
PUSH_SAFETY_POLL_S = 1.0
#: Spread of the safety poll's period (fraction). Readers started together (a fleet of
#: consumers, a job's tasks) otherwise poll in step forever, and their synchronized consistent
#: reads reach the metadata replicas in one burst that stalls the producer's length puts.
PUSH_SAFETY_JITTER = 0.5

Lengths = Tuple[Optional[int], Optional[int]]  # (cache length, durable length)


def safety_period() -> float:
    """One period of a pushed reader's safety net (seconds): :data:`PUSH_SAFETY_POLL_S` on
    average, drawn from +-:data:`PUSH_SAFETY_JITTER` of it each time, so that readers started
    together (or woken by the same push) do not poll, or look at the store, in step."""
    return PUSH_SAFETY_POLL_S * random.uniform(1.0 - PUSH_SAFETY_JITTER, 1.0 + PUSH_SAFETY_JITTER)


def _max_known(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None:
        return b
    return a if b is None else max(a, b)


class LengthPoller:
    """Shared poller of published file lengths for one metadata cache.

    Use :meth:`shared` to get the process-wide instance for a set of endpoints.

    Parameters
    ----------
    endpoints : tuple of str
        The metadata cache's replicas.
    interval : float
        Seconds between poll rounds (default :data:`DEFAULT_POLL_INTERVAL_S`).
    token, security
        As for :class:`~pyspark_acs.cache.client.CacheClient`.
    push : bool
        Watch the polled lengths on push streams (default on).
    forget_after_s : float
        A file nobody asked about for this long is no longer polled (default
        :data:`FORGET_AFTER_S`).
    clock : callable
        Monotonic seconds (``time.monotonic``): the clock of the forget rule, the safety poll
        and the feed's grace (:meth:`_fed_recently`). The thread's waits stay real ones;
        :meth:`wake` ends the current one.
    """

    _registry: Dict[Tuple[Tuple[str, ...], SecuritySettings], "LengthPoller"] = {}
    _registry_lock = threading.Lock()  # guards _registry

    def __init__(
        self, endpoints: Tuple[str, ...], interval: float = DEFAULT_POLL_INTERVAL_S, token: Optional[str] = None,
        push: bool = True, security: Any = None, *, forget_after_s: float = FORGET_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoints = endpoints
        self.forget_after_s = forget_after_s
        self.clock = clock
        self.interval = interval
        self.push = push
        self._client = CacheClient(endpoints, name="metadata cache", token=token, security=security)
        self.meta = MetadataCache(self._client)
        # The push streams, by endpoint, and the files whose keys they watch (poller thread only).
        self._streams: Dict[str, "WatchStream"] = {}
        self._watched: Dict[str, Tuple[Tuple[bytes, Tuple[str, ...]], ...]] = {}
        #: When the next safety poll is due (``clock``; poller thread only).
        self._next_full_poll = 0.0
        #: Set when the poller thread must look again before its next round: a file asked for
        #: the first time (to watch it), a push stream broke (to poll what it covered).
        self._kick = threading.Event()
        #: Files whose bytes a live feed pushes to this process (guarded by _lock): uri ->
        #: [count of readers, predicate "the feed's stream is live"]. Pushed bytes raise their
        #: cache length (CachedReadPath._grown), so they need no Watch while the feed is live.
        self._fed: Dict[str, list] = {}
        self.pushed = 0
        #: uri -> when its feed last grew (``notify(fed=True)``; monotonic, guarded by _lock),
        #: whether or not a poll knew a longer length already: a fed file whose feed flows
        #: skips the safety poll (:meth:`_flowing`), and one whose feed moves is not polled
        #: every round while it is behind (:meth:`_fed_recently`).
        self._fed_at: Dict[str, float] = {}
        #: uri -> how far a feed held a covered file before its first lengths were read
        #: (``notify(fed=True)`` before :meth:`lengths` first saw it: a reader follows a file
        #: in the feed as soon as it moves to it); merged into that first read (guarded by _lock).
        self._early: Dict[str, int] = {}
        #: uri -> when a consistent read outside the poller thread last brought its lengths (a
        #: first sight, :meth:`seed`): the thread's next safety poll need not read them again
        #: for half a safety period (guarded by _lock).
        self._read_at: Dict[str, float] = {}
        # _lock guards _values, _asked, _followers, _error, _thread, _generation, _fed, _early,
        # _read_at and _waiting: the wake queues of the readers blocked in wait_for_change (see
        # there).
        self._lock = threading.Lock()
        self._generation = 0
        self._waiting: Set["queue.SimpleQueue[None]"] = set()
        self._wakes = threading.local()  # each reader thread's own wake queue
        self._values: Dict[str, Lengths] = {}
        self._asked: Dict[str, float] = {}
        # uri -> events of explicit followers (polled while followed, whatever forget_after_s)
        self._followers: Dict[str, List[threading.Event]] = {}
        self._error: Optional[CacheError] = None
        self._thread: Optional[threading.Thread] = None
        self.polls = 0

    @classmethod
    def shared(
        cls, endpoints: Sequence[str], token: Optional[str] = None, interval: Optional[float] = None,
        security: Optional[SecuritySettings] = None,
    ) -> "LengthPoller":
        """The process-wide poller for these metadata-cache endpoints and these token and TLS
        settings (``security`` with ``token``; without ``security``, the environment's): readers
        with other settings get a poller of their own, never one whose calls carry another token.

        ``interval`` (seconds, default :data:`DEFAULT_POLL_INTERVAL_S`) is the poll interval
        when this call creates the poller; a later caller asking for a shorter one shortens it
        (every reader of the process then gets news at least as often as it asked for).
        """
        settings = (security if security is not None else resolve_security()).with_token(token)
        key = (tuple(endpoints), settings)
        with cls._registry_lock:
            poller = cls._registry.get(key)
            if poller is None:
                poller = cls._registry[key] = cls(
                    tuple(endpoints), interval=DEFAULT_POLL_INTERVAL_S if interval is None else interval,
                    security=settings,
                )
            elif interval is not None and interval < poller.interval:
                poller.interval = interval
            return poller

    def follow(self, uri: str, wake: Optional[threading.Event] = None) -> threading.Event:
        """Poll ``uri`` until :meth:`unfollow`; ``wake`` (returned; a new event if None) is set
        whenever its polled or notified length moves."""
        wake = wake if wake is not None else threading.Event()
        with self._lock:
            self._followers.setdefault(uri, []).append(wake)
            self._asked[uri] = self.clock()
            self._ensure_thread()
        self._kick.set()
        return wake

    def unfollow(self, uri: str, wake: Optional[threading.Event] = None) -> None:
        """Undo one :meth:`follow` of ``uri`` (``wake``: the follower's event; None drops the
        latest). The file is then polled only while readers keep asking for it."""
        with self._lock:
            events = self._followers.get(uri)
            if events is None:
                return
            if wake is not None and wake in events:
                events.remove(wake)
            elif events:
                events.pop()
            if not events:
                del self._followers[uri]

    def release(self, uris: Sequence[str]) -> None:
        """A reader closed: stop polling ``uris`` unless someone follows them (another reader
        asking for one again gets it fetched at once), so the thread stops soon after the
        last reader of the process closed."""
        with self._lock:
            for u in uris:
                if u not in self._followers:
                    self._asked.pop(u, None)
                    self._values.pop(u, None)
                    self._fed_at.pop(u, None)
                    self._read_at.pop(u, None)

    def followed(self, uri: str) -> bool:
        """Whether a reader follows ``uri`` explicitly."""
        with self._lock:
            return uri in self._followers

    def notify(self, uri: str, cache_length: Optional[int] = None, durable_length: Optional[int] = None,
               *, fed: bool = False) -> None:
        """A length of ``uri`` this process published itself (a majority write, so a consistent
        read would return it): raise the known lengths at once and wake its readers, without
        waiting for the next poll. Ignored for files nobody polls. ``fed``: the length is how
        far a feed of this process holds the file (``CachedReadPath._grown``): the feed moved."""
        with self._lock:
            if uri not in self._values and uri not in self._followers:
                if fed and cache_length is not None and uri in self._fed:
                    # Pushed before the file's first lengths were read: dropped, a reader whose
                    # producer then went idle would wait for the next safety poll.
                    self._early[uri] = max(self._early.get(uri, 0), cache_length)
                return
            if fed:
                self._fed_at[uri] = self.clock()
            c, d = self._values.get(uri, (None, None))
            new = (_max_known(c, cache_length), _max_known(d, durable_length))
            if new != (c, d):
                self._values[uri] = new
                self._moved([uri])

    def lengths(self, uris: Sequence[str]) -> Dict[str, Lengths]:
        """Latest polled ``(cache length, durable length)`` of each file (None = unknown).

        Raises
        ------
        CacheError
            When the last poll failed (the metadata cache is down) and a file asked for is not
            pushed (:meth:`_covered`): callers fall back to durable lengths, as without a
            poller. Pushed files need no poll: safety polls timing out on overloaded metadata
            replicas would send readers of live feeds to the store, making the overload worse.
        """
        now = self.clock()
        with self._lock:
            for u in uris:
                self._asked[u] = now
            error = self._error
            new = [u for u in uris if u not in self._values]
            self._ensure_thread()
        if error is not None and not new and not all(self._covered(u) for u in uris):
            raise error
        if new:  # first sight of a file: do not make the reader wait for the next poll
            self._kick.set()
            self._take(self.meta.lengths(new))
        with self._lock:
            return {u: self._values.get(u, (None, None)) for u in uris}

    def seed(self, uri: str, lengths: Lengths, *, fed: bool = False) -> None:
        """``uri``'s lengths as a consistent read through this poller's client just returned
        them (a reader joining at the published length), or as a feed's replica answered them
        (``fed``: a reader joining at its boundary, the file covered by the feed): taken as the
        file's first poll, so that the reader's first :meth:`lengths` and the thread's next
        safety poll do not read them again. A join of many readers at once otherwise sent
        three consistent reads of the same keys per reader to the metadata replicas they all
        wait on."""
        now = self.clock()
        with self._lock:
            self._asked.setdefault(uri, now)
        self._take({uri: lengths})
        with self._lock:
            self._ensure_thread()
        if not fed:
            # A round now: it watches the file if no feed covers it. A fed file needs none, and
            # a round before the feed's first push would find it not covered yet and read it.
            self._kick.set()

    def _take(self, got: Dict[str, Lengths]) -> None:
        """Lengths a consistent read outside the poller thread brought (see :meth:`seed`)."""
        now = self.clock()
        with self._lock:
            for u, (c, d) in got.items():
                # Lengths only grow: merged with what a push or a poll brought meanwhile.
                old = self._values.get(u, (None, None))
                early = self._early.pop(u, None)
                self._values[u] = (_max_known(_max_known(old[0], c), early), _max_known(old[1], d))
                self._read_at[u] = now

    def change_token(self) -> int:
        """A token for :meth:`wait_for_change`: take it *before* looking at lengths, so a change
        that lands between the look and the wait still ends the wait at once."""
        with self._lock:
            return self._generation

    def wait_for_change(self, timeout: Optional[float], since: Optional[int] = None) -> None:
        """Block until a poll or push moves a followed length, or ``timeout`` seconds pass
        (``None``: no limit).

        Readers wait here instead of sleeping a fixed interval, so a new length reaches them
        as soon as the poller reads it (the poll intervals do not add up). ``since`` (a
        :meth:`change_token`) makes it return at once if anything moved after the token.
        """
        # Each waiting thread blocks on its own SimpleQueue, which _moved() puts to after it
        # moved the generation (and takes out of _waiting itself). A woken reader thus goes on at
        # once: with a Condition on _lock it woke up to wait again for _lock, still held by the
        # pushed bytes' thread that woke it -- a second sleep and wake-up per pushed message.
        wake = getattr(self._wakes, "queue", None)
        if wake is None:
            wake = self._wakes.queue = queue.SimpleQueue()
        while not wake.empty():  # a wake-up that came after an earlier wait timed out
            wake.get_nowait()
        with self._lock:
            if since is not None and self._generation != since:
                return
            self._waiting.add(wake)
        woken = False
        try:
            # put only after the generation moved; ``timeout`` None: until then
            wake.get(timeout=None if timeout is None else max(0.0, timeout))
            woken = True
        except queue.Empty:
            pass
        finally:
            if not woken:  # timed out, or interrupted: _moved() did not take it out
                with self._lock:
                    self._waiting.discard(wake)

    def wake(self) -> None:
        """Have the poller thread start its next round now if it waits for a safety poll, a
        new file or a broken stream (a round every ``interval`` is not shortened)."""
        self._kick.set()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="acs-length-poller", daemon=True)
            self._thread.start()

    def _moved(self, uris: Sequence[str]) -> None:
        """Wake readers of files whose lengths moved. Caller holds _lock."""
        self._generation += 1
        if self._waiting:
            waiting, self._waiting = self._waiting, set()
            for wake in waiting:
                wake.put(None)
        for u in uris:
            for e in self._followers.get(u, ()):
                e.set()

    # -- push ----------------------------------------------------------------------------------

    def cover(self, uri: str, live: Callable[[int], bool]) -> None:
        """A reader of this process has ``uri``'s bytes pushed (a feed): while
        ``live(known length)`` is true (the feed is up and holds the file at least up to the
        longest length known here) the file needs no Watch of its lengths and is polled only
        every :data:`PUSH_SAFETY_POLL_S` (pushed bytes raise its cache length and wake its
        readers)."""
        with self._lock:
            entry = self._fed.get(uri)
            if entry is None:
                self._fed[uri] = [1, live]
            else:
                entry[0] += 1
        self._kick.set()

    def uncover(self, uri: str) -> None:
        """Undo one :meth:`cover` of ``uri``."""
        with self._lock:
            entry = self._fed.get(uri)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    del self._fed[uri]
                    self._early.pop(uri, None)
        self._kick.set()

    def _stream(self, endpoint: str) -> "WatchStream":
        stream = self._streams.get(endpoint)
        if stream is None:
            from pyspark_acs.cache.push import WatchStream  # imports grpc: only once something is followed

            stream = self._streams[endpoint] = WatchStream(self._client, endpoint, self._on_entries,
                                                           self._on_stream_state)
        return stream

    def _update_watches(self, uris: Sequence[str]) -> None:
        """Watch the length keys of ``uris`` on their replicas and stop watching the rest.
        Poller thread only."""
        with self._lock:
            current = {u for u in uris if u not in self._fed}
        add: Dict[str, List[bytes]] = {}
        remove: Dict[str, List[bytes]] = {}
        for u in [u for u in self._watched if u not in current]:
            for key, eps in self._watched.pop(u):
                for ep in eps:
                    remove.setdefault(ep, []).append(key)
        for u in current.difference(self._watched):
            placed = tuple((key, self._client.replicas_for(key)) for key in length_keys(u))
            self._watched[u] = placed
            for key, eps in placed:
                for ep in eps:
                    add.setdefault(ep, []).append(key)
        for ep in set(add) | set(remove):
            self._stream(ep).watch(add.get(ep, ()), remove.get(ep, ()))

    def all_pushed(self, uris: Sequence[str]) -> bool:
        """Whether push streams deliver every length change of ``uris`` (each is covered: see
        :meth:`_covered`), so a reader of them may wait for a wake instead of polling."""
        return bool(uris) and all(self._covered(u) for u in uris)

    def _covered(self, uri: str) -> bool:
        """Whether live push streams of a majority of the replicas of both length keys of
        ``uri`` have confirmed them, or a live feed pushes its bytes (then a poll round may
        skip it)."""
        with self._lock:
            fed = self._fed.get(uri)
            c, d = self._values.get(uri, (None, None))
        if fed is not None:
            # Only while the feed is not behind what the cache last said: bytes that do not
            # reach the data cache (failed chunk writes) must not leave readers waiting for
            # the safety poll.
            return bool(fed[1](max(c or 0, d or 0)))
        placed = self._watched.get(uri)
        if not placed:
            return False
        streams = self._streams  # one look: the poller thread may swap the dict meanwhile
        for key, eps in placed:
            live = sum(1 for ep in eps if ep in streams and streams[ep].confirmed(key))
            if live < majority(len(eps)):
                return False
        return True

    def _flowing(self, uri: str, now: float) -> bool:
        """Whether the safety poll may skip ``uri``: a live feed covers it and moved within
        :data:`~pyspark_acs.cache.feed.PUSH_GRACE_S` before ``now`` (:meth:`_fed_recently`), and
        no reader follows it explicitly. Pushed bytes are the cache's, and a
        replica pushes a file's bytes in order and never past a chunk it lacks, so a feed that
        flows is a cache that holds the file up to where it got: the failures the safety poll
        is there for (chunk writes that never reach the cache, a stream that stalls) stop the
        feed, and a feed stopped for longer than the grace is polled as before. Explicit
        followers (the copy daemon's operations) are polled all the same: a durable copy reads
        the durable length, which only a poll brings."""
        return self._fed_recently(uri, now) and self._covered(uri)

    def _just_read(self, uri: str, now: float) -> bool:
        """Whether a consistent read outside the thread brought ``uri``'s lengths within half a
        safety period before ``now`` (:meth:`seed`, a first sight): as fresh as the safety poll."""
        with self._lock:
            at = self._read_at.get(uri)
        return at is not None and now - at < PUSH_SAFETY_POLL_S * (1.0 - PUSH_SAFETY_JITTER)

    def _fed_recently(self, uri: str, now: float) -> bool:
        """Whether a feed of ``uri`` grew within :data:`~pyspark_acs.cache.feed.PUSH_GRACE_S`
        before ``now`` (and no reader follows it explicitly). Such a file is not polled every
        round even while its feed is behind the longest length known here (not
        :meth:`_covered`): the feed is catching up, and a poll brings lengths, not its bytes.
        Its readers still look every poll interval (they are not :meth:`all_pushed`), and a
        feed that stops for the grace is polled every round again. On a CPU-starved machine
        every feed trails the lengths the safety polls bring by a push or more; polling them
        every round then feeds the overload."""
        with self._lock:
            moved = self._fed_at.get(uri) if uri in self._fed and uri not in self._followers else None
        return moved is not None and now - moved < PUSH_GRACE_S

    def _on_entries(self, endpoint: str, keys: Sequence[bytes], found: Sequence[bool], versions: Sequence[int]) -> None:
        """A replica pushed length entries (its stream's thread): lengths only grow."""
        moved = []
        with self._lock:
            for key, ok, version in zip(keys, found, versions):
                if not ok:
                    continue
                parsed = parse_length_key(key)
                if parsed is None:
                    continue
                uri, which = parsed
                if uri not in self._values and uri not in self._asked:
                    continue  # dropped meanwhile
                old = self._values.get(uri, (None, None))
                new = (_max_known(old[0], version), old[1]) if which == 0 else (old[0], _max_known(old[1], version))
                if new != old:
                    self._values[uri] = new
                    moved.append(uri)
            self.pushed += 1
            if moved:
                self._moved(moved)

    def _on_stream_state(self, endpoint: str, live: bool) -> None:
        if not live:
            self._kick.set()  # what the stream covered is polled again at once

    def _close_streams(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        self._watched.clear()
        for stream in streams:
            stream.close()

    def _run(self) -> None:
        while True:
            started = self.clock()
            with self._lock:
                for u in list(self._followers):
                    self._asked[u] = started  # followed files stay polled
                for u in [u for u, t in self._asked.items() if started - t > self.forget_after_s]:
                    del self._asked[u]
                    self._values.pop(u, None)
                    self._fed_at.pop(u, None)
                    self._read_at.pop(u, None)
                uris = list(self._asked)
                if not uris:
                    self._thread = None
                    self._close_streams()
                    return  # nothing followed: stop; the next lengths() call restarts it
            poll = uris
            feeds_behind = False  # a file was skipped only because its feed moves (see below)
            if self.push:
                try:
                    self._update_watches(uris)
                except ClosedError:
                    with self._lock:
                        self._thread = None
                    return
                if started >= self._next_full_poll:
                    self._next_full_poll = started + safety_period()
                    poll = [u for u in uris if not self._flowing(u, started) and not self._just_read(u, started)]
                else:
                    behind = [u for u in uris if not self._covered(u)]
                    poll = [u for u in behind if not self._fed_recently(u, started)]
                    feeds_behind = len(poll) < len(behind)
            try:
                got = self.meta.lengths(poll) if poll else {}
                error = None
            except CacheError as exc:
                got, error = {}, exc
            except ClosedError:
                with self._lock:
                    self._thread = None
                    self._close_streams()
                return  # the client was closed (process shutting down): nothing left to poll
            with self._lock:
                # Lengths never shrink: a notify() or push newer than this poll's read stays.
                moved = []
                for u, (c, d) in got.items():
                    old = self._values.get(u, (None, None))
                    new = (_max_known(old[0], c), _max_known(old[1], d))
                    if new != old:
                        self._values[u] = new
                        moved.append(u)
                if poll or error is None:
                    self._error = error
                self.polls += 1
                if moved:
                    self._moved(moved)
            if self.push and not poll and uris:
                # Every file is pushed: nothing to do until the safety poll, a new file or a
                # broken stream (a round every interval costs a tailing reader ~10 % of its CPU);
                # a feed behind that moves is looked at again within PUSH_GRACE_S, so one that
                # stops is polled every round from then on, not from the next safety poll.
                wait = max(0.0, self._next_full_poll - self.clock())
                self._kick.wait(min(wait, PUSH_GRACE_S) if feeds_behind else wait)
                self._kick.clear()
            else:
                time.sleep(max(0.0, self.interval - (self.clock() - started)))
