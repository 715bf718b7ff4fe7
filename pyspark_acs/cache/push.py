"""Push streams, the reader's side: one long-lived stream per (process, replica) (docs/cache.md).

A :class:`WatchStream` tells a metadata replica which keys to watch and hands every entry it
pushes to a callback; a :class:`FollowStream` tells a data replica which files to follow from
which offset and hands every run of bytes it pushes to a callback. Each stream owns its
subscription (the keys, the files and their cursors), so when the stream breaks (the replica
died or restarted) it reconnects by itself with back-off and sends the whole subscription again
-- resuming each file at the cursor the bytes reached.

Watch is bidirectional (key changes go on the open stream). Follow is server-streaming and
read on its own thread by gRPC's single-threaded unary-stream mode: a pushed run wakes that
thread directly, where a bidirectional stream goes through gRPC's channel thread first (one
thread wake less per push, an eighth of a tailing consumer's CPU per pushed batch). A
subscription change (a file followed from a new offset, or left) reopens the stream with the
whole subscription, which happens per file, not per push. While a stream is
down its owner reads as it would without push (the length poller polls, the read path asks for
chunks): push only ever saves requests, it never decides what is correct.

The streams use the :class:`~pyspark_acs.cache.client.CacheClient`'s channels (and its token).
Callbacks run on the stream's thread and must be quick.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Sequence, Set

from pyspark_acs.cache.client import CacheClient

__all__ = [
    "FollowStream",
    "WatchStream",
]

log = logging.getLogger(__name__)

#: First wait before reconnecting a broken stream; doubled on each failure up to the max.
RECONNECT_INITIAL_S = 0.05
RECONNECT_MAX_S = 2.0
_END = object()


class _PushStream:
    """One reconnecting push stream to one replica (bidirectional, or server-streaming with
    :meth:`_open` overridden). Subclasses own the subscription."""

    method = ""

    def __init__(self, client: CacheClient, endpoint: str, on_state: Optional[Callable[[str, bool], None]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.client = client
        #: Monotonic seconds :attr:`asked_at` is taken on (its reader's clock: the feed's).
        self.clock = clock
        self.endpoint = endpoint
        self.on_state = on_state
        # _lock guards the subscription of subclasses, _requests and _closed; a request queued
        # under it reaches the current stream or is part of the next one's first request.
        self._lock = threading.Lock()
        self._requests: Optional["queue.SimpleQueue[Any]"] = None
        self._call: Any = None
        self._closed = False
        #: Set (under _lock) when the subscription changed and the current call is being
        #: replaced by one carrying the new subscription (server-streaming subclasses).
        self._restart = False
        #: Set while the stream is up and has answered since it (re)connected.
        self.live = threading.Event()
        #: Since when a subscription sent (a call opened, or reopened with a new subscription)
        #: is unanswered: not even the replica's first, empty message has come since
        #: (monotonic; None when nothing is waiting for an answer). Written by any thread that
        #: changes the subscription and by the stream's thread, read by the feed: a stalled
        #: replica (alive but silent, SIGSTOP) keeps a stream "live" until keepalive ends it
        #: after 30 s, and one that never answered was never live at all, so the feed judges
        #: a stall by this (ChunkFeed._stalled).
        self.asked_at: Optional[float] = None
        #: Set (under _lock) by a new subscription and by close(): wakes a broken stream that
        #: subscribes to nothing, which waits for it instead of reconnecting (see _run).
        self._wanted = threading.Event()
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, name=f"acs-push-{self.method.lower()}-{endpoint}",
                                        daemon=True)
        self._thread.start()

    # -- subclass hooks ----------------------------------------------------------------------

    def _initial(self) -> Any:
        """The request that restores the whole subscription (caller holds _lock)."""
        raise NotImplementedError

    def _handle(self, message: Any) -> None:
        raise NotImplementedError

    def _reset(self) -> None:
        """The stream broke: forget what it had confirmed (caller holds no lock)."""

    def _subscribed(self) -> bool:
        """Whether the subscription holds anything (caller holds _lock)."""
        return True

    def _open(self, stub: Any, requests: "queue.SimpleQueue[Any]") -> Any:
        """Start the call (bidirectional: its requests are ``requests``); return it once the
        replica accepted it, or ended it."""
        call = getattr(stub, self.method)(self._iterate(requests), metadata=self.client._metadata)
        with self._lock:
            self._call = call
        call.initial_metadata()  # blocks until the replica accepted the stream, or it ended
        if not call.done():
            self._up()
        return call

    # -- plumbing ----------------------------------------------------------------------------

    def _up(self) -> None:
        """The replica accepted the stream: it is live (its subscription reaches the replica)."""
        if not self.live.is_set():
            self.live.set()
            if self.on_state is not None:
                self.on_state(self.endpoint, True)

    def _send(self, request: Any) -> None:
        """Queue ``request`` on the current stream. Caller holds _lock."""
        if self._requests is not None:
            self._requests.put(request)

    def _resubscribe(self) -> None:
        """End the current call, not as a failure: the stream reopens at once with the whole
        subscription, or holds no call while it has none (see :meth:`_run`). Caller holds
        _lock. Requests queued after this reach the next call as part of its first request."""
        self._restart = True
        self._asked()
        if self._requests is not None:
            self._requests.put(_END)
            self._requests = None
        if self._call is not None:
            self._call.cancel()

    def _asked(self) -> None:
        """A subscription is being sent: the stream waits for an answer from now, unless it
        waited already (a replica that answers none of a series of re-subscriptions has been
        silent since the first). Caller holds _lock."""
        if self.asked_at is None:
            self.asked_at = self.clock()

    def close(self) -> None:
        """End the stream and its thread (does not wait)."""
        with self._lock:
            self._closed = True
            requests, call = self._requests, self._call
            self._requests = None
            self._wanted.set()
        if requests is not None:
            requests.put(_END)
        if call is not None:
            call.cancel()

    def _iterate(self, requests: "queue.SimpleQueue[Any]") -> Iterator[Any]:
        while True:
            item = requests.get()
            if item is _END:
                return
            yield item

    def _run(self) -> None:
        from pyspark_acs._grpc import grpc  # deferred like the client's own import

        wait = RECONNECT_INITIAL_S
        stop = threading.Event()
        while True:
            with self._lock:
                if self._closed:
                    return
                idle = not self._subscribed()
                if idle:
                    self._wanted.clear()  # under _lock: a subscription made after this sets it
                    self.asked_at = None  # no call, nothing asked
                else:
                    requests: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
                    requests.put(self._initial())
                    self._requests = requests
                    self._restart = False
                    self._asked()
            if idle:
                # Nothing to follow or watch: hold no call open (an open idle call costs a
                # tailing consumer CPU: grpc's waits on it wake ten times a second)
                # and, when the replica is gone, do not reconnect every RECONNECT_MAX_S for
                # ever. A process keeps its shared feeds and pollers (ChunkFeed.shared,
                # LengthPoller.shared) after its readers of a cluster are gone, and that
                # cluster's replicas may be gone for good. The next subscription wakes it.
                self._down(announce=False)
                self._wanted.wait()
                wait = RECONNECT_INITIAL_S
                continue
            try:
                stub = self.client._stub(self.client._replicas[self.endpoint])
                call = self._open(stub, requests)
                if self.live.is_set():
                    wait = RECONNECT_INITIAL_S  # up: the next break backs off from the start
                for message in call:
                    self.asked_at = None  # answered
                    if self._restart:
                        continue  # the old subscription's call ending: its bytes may be stale
                    self._up()  # a replica that sends no headers first is up with its first message
                    wait = RECONNECT_INITIAL_S
                    self._handle(message)
            except grpc.RpcError as exc:
                if not self._closed and not self._restart:
                    log.debug("%s push stream to %s broke: %s", self.method, self.endpoint, exc)
            except Exception:  # a stream thread must never die silently: log it, then reconnect
                if self._closed:
                    return
                log.exception("%s push stream to %s failed", self.method, self.endpoint)
            with self._lock:
                self._requests = None
                self._call = None
                if self._closed:
                    return
                restart = self._restart
                idle = not self._subscribed()
            requests.put(_END)
            if restart or idle:
                continue  # a new subscription, or none, not a failure: reopen at once (or idle)
            self._down()
            self.reconnects += 1
            stop.wait(wait)
            wait = min(wait * 2.0, RECONNECT_MAX_S)

    def _down(self, announce: bool = True) -> None:
        """The stream is not up: forget what it had confirmed. A break is announced once
        (``on_state``: the feed moves its files to their next replica, the poller polls what
        the stream covered); going idle is not (it covers nothing, and a file followed
        meanwhile must not be moved off a replica that did not fail)."""
        if self.live.is_set():
            self.live.clear()
            if announce and self.on_state is not None:
                self.on_state(self.endpoint, False)
        self._reset()


class WatchStream(_PushStream):
    """Watches keys on one metadata replica.

    Parameters
    ----------
    client : CacheClient
        The metadata cache's client (channel and token).
    endpoint : str
        The replica.
    on_entries : callable
        ``on_entries(endpoint, keys, found, versions)`` for every pushed event: the newest entry
        of each key (``found`` False: absent), on the stream's thread.
    on_state : callable, optional
        ``on_state(endpoint, live)`` when the stream comes up (its first event) or breaks.
    """

    method = "Watch"

    def __init__(self, client: CacheClient, endpoint: str,
                 on_entries: Callable[[str, Sequence[bytes], Sequence[bool], Sequence[int]], None],
                 on_state: Optional[Callable[[str, bool], None]] = None) -> None:
        self._keys: Set[bytes] = set()
        #: Keys this stream has pushed since it (re)connected (guarded by _lock).
        self._confirmed: Set[bytes] = set()
        self.on_entries = on_entries
        super().__init__(client, endpoint, on_state)

    def watch(self, add: Iterable[bytes] = (), remove: Iterable[bytes] = ()) -> None:
        """Start watching ``add`` and stop watching ``remove`` (entries of added keys come at once)."""
        add = [k for k in add]
        remove = [k for k in remove]
        with self._lock:
            add = [k for k in add if k not in self._keys]
            remove = [k for k in remove if k in self._keys]
            if not add and not remove:
                return
            self._keys.update(add)
            self._keys.difference_update(remove)
            self._confirmed.difference_update(remove)
            if not self._keys:
                self._resubscribe()  # nothing left to watch: hold no call (see _run)
            else:
                self._send(self.client._pb2().WatchRequest(add=add, remove=remove))
            if add:
                self._wanted.set()

    def confirmed(self, key: bytes) -> bool:
        """Whether this live stream has pushed ``key`` since it (re)connected (so later changes
        of it are pushed too)."""
        with self._lock:
            return key in self._confirmed and self.live.is_set()

    def _initial(self) -> Any:
        return self.client._pb2().WatchRequest(add=sorted(self._keys))

    def _subscribed(self) -> bool:
        return bool(self._keys)

    def _handle(self, message: Any) -> None:
        with self._lock:
            self._confirmed.update(k for k in message.keys if k in self._keys)
        self.on_entries(self.endpoint, message.keys, message.found, message.versions)

    def _reset(self) -> None:
        with self._lock:
            self._confirmed.clear()


class FollowStream(_PushStream):
    """Follows files on one data replica, each from a cursor that moves as bytes arrive.

    Parameters
    ----------
    client : CacheClient
        The data cache's client.
    endpoint : str
        The replica.
    on_bytes : callable
        ``on_bytes(file id, start, data)`` for every pushed run, on the stream's thread.
    clock : callable
        Monotonic seconds (``time.monotonic``) :attr:`asked_at` is taken on.
    on_latest : callable, optional
        ``on_latest(file id, end)`` when the replica answered a :meth:`follow_latest`: the
        boundary the file is followed from (less its ``back``), or None when the replica has
        none for it (the file is then not followed), on the stream's thread.
    """

    method = "Follow"

    def __init__(self, client: CacheClient, endpoint: str, on_bytes: Callable[[bytes, int, bytes], None],
                 on_state: Optional[Callable[[str, bool], None]] = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_latest: Optional[Callable[[bytes, Optional[int]], None]] = None) -> None:
        self._cursors: Dict[bytes, int] = {}
        #: Files asked for at latest and not answered yet: file id -> back (guarded by _lock).
        self._latest: Dict[bytes, int] = {}
        #: The latest files the current call asked for: its first message answers them.
        self._asking: Set[bytes] = set()
        self.on_bytes = on_bytes
        self.on_latest = on_latest
        super().__init__(client, endpoint, on_state, clock)

    def follow(self, fid: bytes, offset: int) -> None:
        """Follow file ``fid`` from byte ``offset`` (moves the cursor of a followed file; a
        file asked for at latest is followed from ``offset`` instead, and never answered)."""
        with self._lock:
            if self._cursors.get(fid) == offset and fid not in self._latest:
                return
            self._latest.pop(fid, None)
            self._cursors[fid] = offset
            self._resubscribe()
            self._wanted.set()

    def follow_latest(self, fid: bytes, back: int) -> None:
        """Follow file ``fid`` from the last block boundary its replica holds, less ``back``
        bytes; ``on_latest`` says which boundary (or that there is none). A stream that breaks
        first asks again when it reconnects."""
        with self._lock:
            if fid in self._cursors or fid in self._latest:
                return
            self._latest[fid] = back
            self._resubscribe()
            self._wanted.set()

    def unfollow(self, fid: bytes) -> None:
        with self._lock:
            latest = self._latest.pop(fid, None) is not None
            if self._cursors.pop(fid, None) is not None or latest:
                self._resubscribe()

    def following(self) -> int:
        with self._lock:
            return len(self._cursors)


    def _open(self, stub: Any, requests: "queue.SimpleQueue[Any]") -> Any:
        call = stub.Follow(requests.get(), metadata=self.client._metadata)
        with self._lock:
            self._call = call
            if self._restart or self._closed:
                # The subscription changed, or the stream was closed, while this call was being
                # made: close() had no call to cancel, and nothing else ends a server-streaming
                # call (a bidirectional one ends with its requests).
                call.cancel()
        return call  # up with its first (empty) message

    def _subscribed(self) -> bool:
        return bool(self._cursors) or bool(self._latest)

    def _initial(self) -> Any:
        fids = sorted(self._cursors)
        self._asking = set(self._latest)
        # One back for the call: every caller asks for the same (the read path's seal look).
        return self.client._pb2().FollowRequest(follow=fids, offsets=[self._cursors[f] for f in fids],
                                                latest=sorted(self._latest),
                                                latest_back=max(self._latest.values(), default=0))

    def _answer_latest(self, runs: Any) -> None:
        """The call's first message: where the files it asked for at latest are followed from."""
        answered = dict(zip(runs.latest_files, runs.latest_ends))
        told = []
        with self._lock:
            asking, self._asking = self._asking, set()
            if self._restart:
                return  # a new subscription's call asks again
            for fid in asking:
                back = self._latest.pop(fid, None)
                if back is None:
                    continue  # followed from an offset, or left, meanwhile
                end = answered.get(fid)
                if end is not None:
                    self._cursors[fid] = max(0, end - back)
                told.append((fid, end))
        if self.on_latest is not None:
            for fid, end in told:
                self.on_latest(fid, end)

    def _handle(self, message: Any) -> None:
        offset = 0
        data, runs = message.data, message.message  # a FileBytes split from its data (cache/wire.py)
        if self._asking:
            self._answer_latest(runs)
        for fid, start, size in zip(runs.files, runs.starts, runs.sizes):
            run = data[offset:offset + size]
            offset += size
            with self._lock:
                if fid not in self._cursors or self._restart:
                    continue  # unfollowed meanwhile, or the subscription is being replaced
                self._cursors[fid] = start + size  # a reconnect resumes here
            self.on_bytes(fid, start, run)
