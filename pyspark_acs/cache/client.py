"""The client of the replicated in-memory caches: the only way pyspark_acs talks to cache servers.

Every key lives on ``r`` replicas chosen by consistent hashing (:class:`~pyspark_acs.cache.ring.HashRing`).
The client implements the replication the paper gets from CliqueMap (section 2.2):

- **Writes** (:meth:`CacheClient.put`, :meth:`~CacheClient.delete`,
  :meth:`~CacheClient.compare_and_set`) go to all ``r`` replicas of each key, batched per replica,
  in parallel, and succeed on a majority of acknowledgements.
- **Relaxed reads** (:meth:`CacheClient.get`) ask one replica per key and are hedged to a second
  one after ``hedge_after`` seconds (30 ms, section 2.4). A miss is an answer; a dead replica
  is not, so its keys fall over to the next replica.
- **Consistent reads** (``get(..., consistent=True)``) ask a majority and return the highest
  version: with ``r = 3`` the majority that acknowledged the last write and the majority read
  overlap, so the newest acknowledged value is seen.

Failure handling: every call has a sub-second deadline. A replica that fails at the transport
level (unavailable, deadline exceeded) is marked down and skipped at once by later calls, then
probed again by one real request after a back-off that starts at :data:`DOWN_BACKOFF_INITIAL_S`
and doubles up to :data:`DOWN_BACKOFF_MAX_S`; a success clears it. gRPC errors become
:class:`~pyspark_acs.errors.CacheError` subclasses naming the endpoints (``raise ... from``).

The client is thread-safe and meant to be shared: one lazily created gRPC channel per endpoint,
and one small I/O thread pool that runs the calls of a fan-out in parallel (see
:meth:`CacheClient._send` for why a pool rather than gRPC futures). Importing this module does
not import grpc; the first call does. The client is never pickled: code that ships work to
Spark executors pickles the endpoint string and builds a client there.
"""

from __future__ import annotations

import functools
import os
import queue
import random
import re
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from pyspark_acs import _fork
from pyspark_acs.security import SecuritySettings, resolve_security
from pyspark_acs.errors import AcsOptionError, CacheError, CacheTimeoutError, CacheUnavailableError, ClosedError
from pyspark_acs.cache import wire
from pyspark_acs.cache.pipeline import PipelinedCall
from pyspark_acs.cache.ring import DEFAULT_VNODES, HashRing

__all__ = [
    "CacheClient",
    "DATA_CACHE_ENV",
    "Entry",
    "METADATA_CACHE_ENV",
    "NO_CACHE",
    "cache_endpoints",
    "client_for",
    "parse_endpoints",
]

DEFAULT_REPLICATION = 3
#: Environment variable holding the shared token when none is passed (servers read it too).
TOKEN_ENV = "ACS_CACHE_TOKEN"
#: Environment variables naming the cache endpoints an entry point uses when it is given none
#: (``acs up`` prints ``export`` lines for them): the CLI, the Producer, the Consumer and the Spark
#: options all resolve them through :func:`cache_endpoints`.
DATA_CACHE_ENV = "ACS_DATA_CACHE"
METADATA_CACHE_ENV = "ACS_METADATA_CACHE"
#: The value that turns a cache off even when its environment variable is set.
NO_CACHE = "none"
#: Deadline of every cache call (the paper's "strict sub-second deadlines").
DEFAULT_DEADLINE_S = 0.5
#: A relaxed read still unanswered after this long is also sent to a second replica.
DEFAULT_HEDGE_AFTER_S = 0.03
#: A replica that failed is skipped this long before one request probes it again ...
DOWN_BACKOFF_INITIAL_S = 1.0
#: ... doubling after each failed probe up to this.
DOWN_BACKOFF_MAX_S = 10.0
#: Batches to one replica are split above this many value bytes (puts) ...
MAX_BATCH_BYTES = 4 * 1024**2
#: ... or this many keys (gets and puts; 1024 chunks of 4 KiB = 4 MiB per reply), so a large
#: call becomes several RPCs the server works on in parallel.
MAX_BATCH_KEYS = 1024
#: Threads of a client's I/O pool: gRPC calls in flight at once (they wait on the network,
#: not the CPU; a hung replica holds one for at most the deadline).
IO_THREADS = 32
#: A client's first call waits this long at most, once, for its channels to connect (or fail to:
#: a refused connection ends the wait at once) before its deadline clock starts. Importing grpc
#: and connecting are no call: on a loaded machine they take seconds, and counted against the
#: first call's 0.5 s deadline they make healthy replicas look down (DEADLINE_EXCEEDED).
CONNECT_TIMEOUT_S = 1.0
#: Largest gRPC message accepted or sent; equal to the server's.
MAX_MESSAGE_BYTES = 64 * 1024**2

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A restarted replica must be reachable again within about a second, not after gRPC's
    # default reconnect back-off of up to two minutes. Not "grpc.min_reconnect_backoff_ms":
    # gRPC takes it as the connect timeout too, and with 100 ms every connection whose
    # HTTP/2 handshake needs longer (a 300 ms round trip, a slow TLS handshake) failed with
    # "timed out before receiving SETTINGS frame" and the replica was marked down (test:
    # test_cache_connect.py, through a relay that delays every byte).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Each channel connects on its own. gRPC otherwise shares one connection per address among
    # a process's channels with the same settings, and with it the connection's failure: a client
    # made after a replica came back on its address failed at once with the "Connection refused"
    # of an older client's back-off (tests/test_cache_connect.py).
    ("grpc.use_local_subchannel_pool", 1),
    # Failover and hedging happen here, across replicas; gRPC retrying one replica would only
    # spend the deadline.
    ("grpc.enable_retries", 0),
    ("grpc.keepalive_time_ms", 30000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Server-streaming calls (Follow: pushed file bytes) are read on the calling thread, not
    # through the channel's spin thread: one thread wake less per pushed message
    # (pyspark_acs.cache.push).
    ("SingleThreadedUnaryStream", 1),
]

# Status codes that say "this replica is not answering" (mark it down); others (a refused
# token, a bad request) come from a live replica.
_TRANSPORT_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})

_ENDPOINT = re.compile(r"^(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)):(?P<port>[0-9]{1,5})$")


class Entry(NamedTuple):
    """A cache value and its version."""

    value: bytes
    version: int


def parse_endpoints(endpoints: Union[str, Sequence[str]], *, option: str = "endpoints") -> Tuple[str, ...]:
    """Validate ``"host:port,host:port"`` (or a sequence of ``host:port``) into a tuple.

    Raises
    ------
    AcsOptionError
        Naming the bad item and the expected form, for an empty list, a malformed item,
        a port outside 1-65535 or a duplicate.
    """
    if isinstance(endpoints, (bytes, bytearray)):
        raise AcsOptionError(f"{option}: expected 'host:port,host:port', got bytes", option=option)
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out: List[str] = []
    for raw in items:
        if not isinstance(raw, str):
            raise AcsOptionError(
                f"{option}: {raw!r} is not an endpoint; expected 'host:port' (e.g. 127.0.0.1:7001)",
                option=option,
            )
        item = raw.strip()
        match = _ENDPOINT.match(item)
        if not match or not 1 <= int(match.group("port")) <= 65535:
            raise AcsOptionError(
                f"{option}: {raw!r} is not an endpoint; expected 'host:port' with a port 1-65535 "
                f"(e.g. 127.0.0.1:7001 or [::1]:7001), several separated by commas",
                option=option,
            )
        if item in out:
            raise AcsOptionError(f"{option}: endpoint {item!r} is listed twice", option=option)
        out.append(item)
    if not out:
        raise AcsOptionError(
            f"{option}: no endpoints given; expected 'host:port,host:port'", option=option
        )
    return tuple(out)


def cache_endpoints(value: Any, env: str) -> Any:
    """The cache an entry point uses: the explicit value wins, else the environment's.

    The one rule for cache settings that carry (``acs up``'s ``export`` lines reach every entry
    point). Resolved where options are parsed -- on the Spark driver, never in a task -- so the
    planner and its tasks read through the same caches.

    Parameters
    ----------
    value : str, sequence of str, CacheClient or None
        What the caller was given. ``None`` means "not given": ``$env`` is used when set.
        ``""`` or ``"none"`` means "no cache", whatever the environment says.
    env : str
        :data:`DATA_CACHE_ENV` or :data:`METADATA_CACHE_ENV`.

    Returns
    -------
    The value to use: a validated ``host:port,...`` string from the environment, the explicit
    value unchanged, or None for no cache.

    Raises
    ------
    AcsOptionError
        If the environment variable holds something that is not an endpoint list (it is named).
    """
    if value is None:
        text = os.environ.get(env, "").strip()
        if not text or text.lower() == NO_CACHE:
            return None
        return ",".join(parse_endpoints(text, option=f"${env}"))
    if isinstance(value, str) and value.strip().lower() in ("", NO_CACHE):
        return None
    return value


def _majority(n: int) -> int:
    return n // 2 + 1


def _code_name(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return code().name
        except (AttributeError, TypeError):
            return "UNKNOWN"
    return type(exc).__name__


def _describe(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    text = " ".join(str(text or "").split())
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{_code_name(exc)}: {text}" if text else _code_name(exc)


class _Down(Exception):
    """Stands for a replica skipped because it is marked down (never raised to callers)."""

    def __init__(self, retry_in: float) -> None:
        super().__init__(f"marked down after a failure; next probe in {retry_in:.1f} s")

    def code(self):  # so _code_name() reports it like a gRPC status
        return _DownCode


class _DownCode:
    name = "UNAVAILABLE"


class _TooLarge(Exception):
    """Stands for a put the replica refused as too large for its capacity."""

    def __init__(self, count: int) -> None:
        super().__init__(f"refused {count} entr{'y' if count == 1 else 'ies'} too large for its capacity")


class _ShortAnswer(Exception):
    """Stands for a put answer with fewer statuses than the request had keys: the keys without
    one are not acknowledged (our servers answer one per key; this is a replica off protocol)."""

    def __init__(self, got: int, keys: int) -> None:
        super().__init__(f"answered {got} statuses for {keys} keys (one per key expected)")


class _Replica:
    """Per-endpoint connection and health state; fields guarded by ``CacheClient._lock``."""

    __slots__ = ("endpoint", "channel", "stub", "raw", "puts", "unary_puts", "down_until", "backoff", "marked_at")

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.channel = None
        self.stub = None
        self.raw: Dict[str, Any] = {}  # method -> multicallable taking serialized requests
        self.puts: Optional[PipelinedCall] = None  # the PutStream every Put to it goes on
        self.unary_puts = False  # it answered PutStream UNIMPLEMENTED (a server from before it)
        self.down_until = 0.0  # 0: up; else monotonic time before which it is skipped
        self.backoff = DOWN_BACKOFF_INITIAL_S
        self.marked_at = 0.0  # monotonic time it was last marked down


class CacheClient:
    """Client of one replicated cache (the data cache or the metadata cache of a cluster).

    Parameters
    ----------
    endpoints : str or sequence of str
        ``"host:port,host:port"`` or a sequence of ``"host:port"``.
    replication : int, default 3
        Replicas per key (fewer when there are fewer endpoints).
    deadline : float, default 0.5
        Seconds every call may take, failover and hedging included.
    hedge_after : float, default 0.03
        Seconds after which a relaxed read still unanswered is also sent to another replica;
        ``0`` disables hedging.
    token : str, optional
        Shared token sent as ``authorization: Bearer <token>``; default ``security``'s, else
        ``$ACS_CACHE_TOKEN`` / ``$ACS_TOKEN_FILE``.
    security : SecuritySettings, optional
        Token and TLS (CA bundle, client certificate with mTLS); default: the environment
        (:func:`~pyspark_acs.security.resolve_security`).
    name : str, default "cache"
        Named in error messages (e.g. ``"data cache"``).

    Raises
    ------
    AcsOptionError
        For malformed endpoints or out-of-range numbers.
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        *,
        replication: int = DEFAULT_REPLICATION,
        deadline: float = DEFAULT_DEADLINE_S,
        hedge_after: float = DEFAULT_HEDGE_AFTER_S,
        token: Optional[str] = None,
        name: str = "cache",
        security: Optional[SecuritySettings] = None,
    ) -> None:
        self.endpoints: Tuple[str, ...] = parse_endpoints(endpoints)
        if not isinstance(replication, int) or replication < 1:
            raise AcsOptionError(f"replication: must be a whole number >= 1, got {replication!r}", option="replication")
        if not deadline > 0:
            raise AcsOptionError(f"deadline: must be > 0 seconds, got {deadline!r}", option="deadline")
        if hedge_after is None or hedge_after < 0:
            raise AcsOptionError(f"hedge_after: must be >= 0 seconds, got {hedge_after!r}", option="hedge_after")
        self.replication = replication
        self.deadline = float(deadline)
        self.hedge_after = float(hedge_after)
        self.name = name
        # The same variables the servers read, so one setting covers both.
        self.security = (security if security is not None else resolve_security()).with_token(token)
        self._metadata = self.security.call_metadata()
        self._ring = HashRing(self.endpoints, vnodes=DEFAULT_VNODES)
        # _lock guards _replicas' channel/stub creation, every _Replica's down state, _executor
        # creation and _closed.
        self._lock = threading.Lock()
        self._replicas: Dict[str, _Replica] = {ep: _Replica(ep) for ep in self.endpoints}
        self._closed = False
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pb: Any = None  # the acs_pb2 module, imported on first use (keeps import cheap)
        # _connect_lock serialises the one-time connect of _connect; _connected is set under it.
        self._connect_lock = threading.Lock()
        self._connected = False

    # -- plumbing ----------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"CacheClient({','.join(self.endpoints)!r}, replication={self.replication}, name={self.name!r})"

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError(
            "CacheClient is not picklable: pickle its endpoint string and build a client where it is used"
        )

    def close(self) -> None:
        """Close every channel. Later calls raise :class:`~pyspark_acs.errors.ClosedError`."""
        if _fork.forked_from is not None:
            # A child forked while gRPC was open: its channels are the parent's (closing them
            # hangs in gRPC's core) and _lock may be one a parent's thread held. Drop them only.
            self._closed = True
            return
        with self._lock:
            self._closed = True
            channels = [rep.channel for rep in self._replicas.values() if rep.channel is not None]
            streams = [rep.puts for rep in self._replicas.values() if rep.puts is not None]
            for rep in self._replicas.values():
                rep.channel = rep.stub = rep.puts = None
                rep.raw = {}
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)  # stragglers end by their deadline
        for stream in streams:
            stream.close()
        for channel in channels:
            channel.close()

    def holds_every_key(self) -> bool:
        """Whether every replica holds every key: no more endpoints than copies per key (the
        data cache's default three of three, or one server). The one rule for it: a relaxed
        read is then one call to any replica, and a feed's replica holds whole files."""
        return len(self.endpoints) <= self.replication

    def replicas_for(self, key: bytes) -> Tuple[str, ...]:
        """The endpoints holding ``key``, primary first."""
        return self._ring.replicas_for(key, self.replication)

    def down_endpoints(self) -> Tuple[str, ...]:
        """Endpoints currently marked down (skipped until their next probe)."""
        with self._lock:
            return tuple(ep for ep, rep in self._replicas.items() if rep.down_until)

    def _stub(self, rep: _Replica):
        # Caller holds no lock. Channels are created once per endpoint and shared by all threads.
        if _fork.forked_from is not None:  # before any lock: a parent's thread may have held one
            _fork.check_not_forked(self.name)
        stub = rep.stub
        if stub is not None:
            return stub
        from pyspark_acs._grpc import grpc  # deferred: importing pyspark_acs must not import grpc

        from pyspark_acs.cache.proto import acs_pb2, acs_pb2_grpc

        with self._lock:
            if self._closed:
                raise ClosedError(f"{self.name}: client is closed")
            if rep.stub is None:
                self._pb = acs_pb2
                rep.channel = self.security.channel(rep.endpoint, _CHANNEL_OPTIONS)
                stub = acs_pb2_grpc.CacheStub(rep.channel)
                # The byte-carrying answers are split from their data by hand (cache/wire.py).
                for method, (request, _, shape, _view) in _SPLIT_ANSWERS.items():
                    setattr(stub, method, getattr(rep.channel, shape)(
                        _method_path(acs_pb2, method), request_serializer=getattr(acs_pb2, request).SerializeToString,
                        response_deserializer=_answer_parser(acs_pb2, method), _registered_method=True))
                rep.stub = stub
            return rep.stub

    def _raw_call(self, rep: _Replica, method: str):
        """``method`` on ``rep`` taking an already serialized request (bytes): a write sent to
        several replicas is serialized once, not once per replica."""
        call = rep.raw.get(method)
        if call is None:
            pb = self._pb2()
            path = _method_path(pb, method)
            with self._lock:
                if self._closed or rep.channel is None:
                    raise ClosedError(f"{self.name}: client is closed")
                call = rep.raw.get(method)
                if call is None:
                    call = rep.raw[method] = rep.channel.unary_unary(
                        path, request_serializer=None,
                        response_deserializer=_answer_parser(pb, method))
        return call

    def _put_stream(self, rep: _Replica) -> PipelinedCall:
        """The PutStream of ``rep``, made once: every Put to it is pipelined on it."""
        puts = rep.puts
        if puts is not None:
            return puts
        pb = self._pb2()
        path = _method_path(pb, "PutStream")
        metadata = self._metadata
        with self._lock:
            if self._closed or rep.channel is None:
                raise ClosedError(f"{self.name}: client is closed")
            if rep.puts is None:
                call = rep.channel.stream_stream(path, request_serializer=None,
                                                 response_deserializer=pb.PutResponse.FromString)
                rep.puts = PipelinedCall(
                    lambda requests: call(requests, metadata=metadata),
                    name=f"acs-{self.name.replace(' ', '-')}-puts",
                    expired=lambda: _deadline_error(rep.endpoint, self.deadline),
                    closed=lambda: ClosedError(f"{self.name}: client is closed"),
                )
            return rep.puts

    def _pb2(self):
        if self._pb is None:
            from pyspark_acs.cache.proto import acs_pb2

            self._pb = acs_pb2
        return self._pb

    def connect(self) -> None:
        """Connect now instead of at the first call: import gRPC, open every replica's channel
        and wait (at most :data:`CONNECT_TIMEOUT_S`) for each to answer a Health call. Never
        raises for a replica that does not answer (calls find it out, and mark it down);
        raises :class:`~pyspark_acs.errors.ClosedError` after :meth:`close`."""
        self._check_open()

    def _check_open(self) -> None:
        """Raise after :meth:`close`; before the first call, connect (every call comes here
        before it starts its deadline clock)."""
        if self._closed:
            raise ClosedError(f"{self.name}: client is closed")
        if not self._connected:
            self._connect()

    def _connect(self) -> None:
        """Once per client: import grpc, create every replica's channel and connect it with one
        Health call per replica, in parallel, waiting at most :data:`CONNECT_TIMEOUT_S`.

        A refused connection answers at once; a replica that does not answer in that time is
        left to the call's deadline (which marks it down) as before. Outcomes mark nothing: this
        only keeps set-up work out of the first call's deadline. (A Health call rather than
        gRPC's connectivity API: a subscribed channel left grpc's exit hook waiting forever.)
        """
        with self._connect_lock:
            if self._connected:
                return
            pb = self._pb2()
            out: "queue.SimpleQueue" = queue.SimpleQueue()
            for rep in self._replicas.values():
                call = self._stub(rep).Health
                self._pool().submit(lambda call=call: out.put(_try(call, pb.HealthRequest(), CONNECT_TIMEOUT_S,
                                                                   self._metadata)))
            end = time.monotonic() + CONNECT_TIMEOUT_S
            for _ in self._replicas:
                try:
                    out.get(timeout=max(0.0, end - time.monotonic()))
                except queue.Empty:
                    break
            self._connected = True

    def _usable(self, rep: _Replica, now: float) -> bool:
        """Whether to send to ``rep`` now; lets one probe through once a down replica's back-off ends."""
        with self._lock:
            if rep.down_until == 0.0:
                return True
            if now >= rep.down_until:
                # This caller probes; others keep skipping it until the probe's deadline passes.
                rep.down_until = now + self.deadline
                return True
            return False

    def _retry_in(self, rep: _Replica, now: float) -> float:
        with self._lock:
            return max(0.0, rep.down_until - now)

    def _mark(self, rep: _Replica, exc: Optional[BaseException], sent: Optional[float] = None) -> None:
        """Record the outcome of a call to ``rep`` sent at ``sent`` (runs in gRPC callback threads too).

        A transport failure marks the replica down for its back-off. The back-off doubles only
        when a call sent while the replica was already down fails (a failed probe): calls that
        were in flight when the first failure marked it down say nothing new. Counting each of
        them doubled it to the 10 s maximum after a stall of one deadline (a writer putting every
        10 ms has ~30 puts in flight), leaving a recovered replica out of every call that long.
        Nor does such a call mark the replica down again when it fails after the replica
        recovered (a straggler of the old failure): a new failure shows in the calls sent since.
        """
        with self._lock:
            if exc is None:
                rep.down_until = 0.0
                rep.backoff = DOWN_BACKOFF_INITIAL_S
            elif _code_name(exc) in _TRANSPORT_CODES:
                was_down = rep.down_until != 0.0
                if sent is not None and sent < rep.marked_at:
                    return  # in flight before the mark: the same failure, already counted
                now = time.monotonic()
                rep.down_until = now + rep.backoff
                rep.marked_at = now
                if was_down:  # a failed probe: wait longer next time
                    rep.backoff = min(rep.backoff * 2.0, DOWN_BACKOFF_MAX_S)

    def _pool(self) -> ThreadPoolExecutor:
        pool = self._executor
        if pool is None:
            with self._lock:
                if self._closed:
                    raise ClosedError(f"{self.name}: client is closed")
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(
                        max_workers=IO_THREADS, thread_name_prefix=f"acs-{self.name.replace(' ', '-')}"
                    )
                pool = self._executor
        return pool

    def _send(self, rep: _Replica, method: str, request: Any, end: float, out: "queue.SimpleQueue", tag: Any,
              *, inline: bool = False):
        """Start ``method`` on ``rep``; its outcome lands in ``out`` as ``(tag, rep, response, exc)``.

        ``inline``: make the call on this thread and return once its outcome is in ``out``, for a
        caller with nothing to do meanwhile (no hedge to send): the hand-off to a pool thread and
        back is two thread wakes per call, which cost a 1 MiB read from one replica about a
        tenth of its client CPU. Not for puts (they are pipelined anyway).

        Blocking gRPC calls on a shared thread pool are cheaper than gRPC futures
        (``stub.Get.future``), for batched and small reads alike, because gRPC starts a channel
        polling thread whenever a channel goes from zero to one call in flight. Calls are never
        cancelled: a straggler runs to its deadline and its outcome still marks the replica up or
        down.

        Puts are pipelined on the replica's one PutStream (:mod:`pyspark_acs.cache.pipeline`:
        half a unary Put's server CPU); a replica that answers it UNIMPLEMENTED gets unary Puts.
        """
        stub = self._stub(rep)
        sent = time.monotonic()
        left = end - sent
        timeout = max(0.001, left)
        # A call sent once its deadline passed (a read failing over when the keys' earlier
        # replicas timed out at it) gets gRPC's minimum: missing that says nothing of the
        # replica, and marking it down took the one healthy replica out of every read for a
        # back-off. Its other failures (a refused connection) still count.
        judged = left > 0
        metadata = self._metadata

        def outcome(response: Any, exc: Optional[BaseException]) -> None:
            if exc is None:
                self._mark(rep, None)
            elif judged or _code_name(exc) != "DEADLINE_EXCEEDED":
                self._mark(rep, exc, sent)
            out.put((tag, rep, response, exc))

        if method == "Put" and not rep.unary_puts:
            payload = request if isinstance(request, bytes) else request.SerializeToString()

            def streamed(response: Any, exc: Optional[BaseException]) -> None:
                if exc is not None and _code_name(exc) == "UNIMPLEMENTED":
                    # A replica from before PutStream (a rolling upgrade): unary Puts from now on.
                    rep.unary_puts = True
                    try:
                        self._send(rep, method, payload, end, out, tag)
                    except ClosedError as closed:
                        out.put((tag, rep, None, closed))
                    return
                outcome(response, exc)

            self._put_stream(rep).send(payload, end, streamed)
            return
        call = self._raw_call(rep, method) if isinstance(request, bytes) else getattr(stub, method)

        def run() -> None:
            try:
                response = call(request, timeout=timeout, metadata=metadata)
            except Exception as exc:  # grpc.RpcError mostly; handed to the waiting caller
                outcome(None, exc)
                return
            outcome(response, None)

        if inline:
            run()
            return
        try:
            self._pool().submit(run)
        except RuntimeError as exc:  # close() shut the pool down between _pool() and submit
            raise ClosedError(f"{self.name}: client is closed") from exc

    def _error(
        self,
        op: str,
        summary: str,
        endpoints: Sequence[str],
        errors: Dict[str, BaseException],
    ) -> CacheError:
        """The CacheError for a call that failed on ``endpoints``; chained to a gRPC error."""
        endpoints = sorted(set(endpoints))
        reasons = "; ".join(
            f"{ep} ({_describe(errors[ep])})" if ep in errors else f"{ep} (no answer)" for ep in endpoints
        )
        message = f"{self.name}: {op} failed: {summary}; replicas: {reasons}"
        kinds = {_code_name(errors[ep]) for ep in endpoints if ep in errors}
        too_large = [errors[ep] for ep in endpoints if isinstance(errors.get(ep), (_TooLarge, _ShortAnswer))]
        if too_large or kinds & {"UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT"}:
            error: CacheError = CacheError(message, endpoints=tuple(endpoints))
        elif kinds == {"DEADLINE_EXCEEDED"}:
            error = CacheTimeoutError(message, endpoints=tuple(endpoints))
        else:
            error = CacheUnavailableError(message, endpoints=tuple(endpoints))
        cause = next(
            (errors[ep] for ep in endpoints
             if ep in errors and not isinstance(errors[ep], (_Down, _TooLarge, _ShortAnswer))),
            None,
        )
        error.__cause__ = cause
        return error

    # -- reads -------------------------------------------------------------------------------

    def get(self, keys: Sequence[bytes], *, consistent: bool = False) -> List[Optional[Entry]]:
        """Read ``keys``; ``None`` for a miss.

        Parameters
        ----------
        keys : sequence of bytes
        consistent : bool, default False
            ``False`` (relaxed): one replica per key, hedged to a second after ``hedge_after``;
            a miss is an answer and is not retried elsewhere (the caller decides), a dead replica
            is not, and its keys fall over to the next replica.
            ``True``: a majority of each key's replicas; the highest version wins.

        Returns
        -------
        list of Entry or None
            One per key, in order.

        Raises
        ------
        CacheUnavailableError
            If some key got fewer answers than needed (one relaxed, a majority consistent);
            names the replicas and why each failed. :class:`CacheTimeoutError` when they all
            timed out; plain :class:`CacheError` when a replica refused the token.
        ClosedError
            After :meth:`close`.
        """
        return self._get(list(keys), consistent, joined=False)

    def get_joined(self, keys: Sequence[bytes]) -> Tuple[Union[bytes, memoryview], List[int]]:
        """A relaxed :meth:`get` of ``keys`` as ``(values concatenated, size of each)``, the size
        ``-1`` for a miss: the values of a run of chunks as one bytes-like object, with no Python
        object per key (per-key bookkeeping is a large share of a 256-key read's client CPU).
        When one replica answered every key (the common case) it is a memoryview of that
        answer, not a copy of it. Raises as :meth:`get`."""
        return self._get(list(keys), False, joined=True)

    def _get(self, keys: List[bytes], consistent: bool, joined: bool) -> Any:
        """:meth:`get` (``joined`` False) or :meth:`get_joined` (True)."""
        n = len(keys)
        if n == 0:
            return (b"", []) if joined else []
        self._check_open()
        pb = self._pb2()
        start = time.monotonic()
        end = start + self.deadline
        # Replicas the one-call read below asked and that failed, with their errors: the general
        # path fails over to the others and reports these as they failed (not as the down mark
        # their failure left, which would lose the cause and call a timeout "unavailable").
        tried_first: Dict[str, BaseException] = {}
        if not consistent and n <= MAX_BATCH_KEYS and self.holds_every_key():
            good = self._get_anywhere(keys, pb, start, end, tried_first)
            if good is not None:
                if joined:
                    got = good.message
                    return good.data, [size if found else -1 for found, size in zip(got.found, got.sizes)]
                return _entries(good)
        ring_reps = self._ring.replicas_for_many(keys, self.replication)

        # Candidate order per distinct replica tuple: usable replicas, rotated by a random offset
        # per call so hot keys spread their reads over all replicas (the paper reads "a random
        # replica"); replicas marked down are left out and reported if nothing else answers.
        rotation = random.randrange(self.replication)
        distinct = set(ring_reps)
        alive: Dict[str, bool] = {}
        skipped: Dict[str, BaseException] = {}
        for ep in {ep for reps in distinct for ep in reps}:
            rep = self._replicas[ep]
            if ep in tried_first:  # asked already; the same request would fail the same way
                alive[ep] = False
                skipped[ep] = tried_first[ep]
                continue
            alive[ep] = self._usable(rep, start)
            if not alive[ep]:
                skipped[ep] = _Down(self._retry_in(rep, start))
        orders: Dict[Tuple[str, ...], List[_Replica]] = {}
        for reps in distinct:
            usable = [self._replicas[ep] for ep in reps if alive[ep]]
            k = rotation % len(usable) if usable else 0
            orders[reps] = usable[k:] + usable[:k]

        need = [(_majority(len(reps)) if consistent else 1) for reps in ring_reps]
        answers = [0] * n
        inflight = [0] * n
        tried = [0] * n  # how many of the key's candidates were sent to
        best: List[Optional[Entry]] = [None] * n
        done = [False] * n
        remaining = n
        errors: Dict[str, BaseException] = dict(skipped)
        out: "queue.SimpleQueue" = queue.SimpleQueue()
        pending = 0

        def dispatch(groups: Dict[_Replica, List[int]]) -> None:
            nonlocal pending
            for rep, idxs in groups.items():
                for lo in range(0, len(idxs), MAX_BATCH_KEYS):
                    batch = idxs[lo : lo + MAX_BATCH_KEYS]
                    request = pb.GetRequest(keys=[keys[i] for i in batch])
                    self._send(rep, "Get", request, end, out, batch)
                    pending += 1
                    for i in batch:
                        inflight[i] += 1

        def advance(idxs: Sequence[int], extra: bool) -> Dict[_Replica, List[int]]:
            """Pick the next candidate for keys that need one more attempt."""
            groups: Dict[_Replica, List[int]] = defaultdict(list)
            for i in idxs:
                if done[i]:
                    continue
                order = orders[ring_reps[i]]
                wanted = need[i] - answers[i] - inflight[i] + (1 if extra else 0)
                while wanted > 0 and tried[i] < len(order):
                    groups[order[tried[i]]].append(i)
                    tried[i] += 1
                    wanted -= 1
            return groups

        def give_up(i: int) -> bool:
            return answers[i] + inflight[i] < need[i] and tried[i] >= len(orders[ring_reps[i]])

        failed: List[int] = []
        first: Dict[_Replica, List[int]] = defaultdict(list)
        for i in range(n):
            order = orders[ring_reps[i]]
            take = min(need[i], len(order))
            for j in range(take):
                first[order[j]].append(i)
            tried[i] = take
        dispatch(first)
        # Keys with fewer usable replicas than answers needed fail now, not after the deadline.
        for i in range(n):
            if give_up(i):
                done[i] = True
                failed.append(i)
                remaining -= 1

        hedge_at = start + self.hedge_after if self.hedge_after > 0 else None
        # Stragglers (hedges answered elsewhere) are left to finish on their own.
        while remaining > 0 and pending > 0:
            now = time.monotonic()
            wait_until = hedge_at if hedge_at is not None else end + 0.25
            try:
                batch, rep, response, exc = out.get(timeout=max(0.0, wait_until - now))
            except queue.Empty:
                if hedge_at is not None:
                    hedge_at = None
                    dispatch(advance([i for i in range(n) if not done[i]], extra=True))
                    continue
                break  # gRPC deadlines fire at `end`; this is only a safety bound
            pending -= 1
            if exc is not None:
                errors[rep.endpoint] = exc
                for i in batch:
                    inflight[i] -= 1
                dispatch(advance(batch, extra=False))
                for i in batch:
                    if not done[i] and give_up(i):
                        done[i] = True
                        failed.append(i)
                        remaining -= 1
                continue
            data, got = response.data, response.message
            offset = 0
            for i, found, size, version in zip(batch, got.found, got.sizes, got.versions):
                start_at = offset
                offset += size
                inflight[i] -= 1
                if done[i]:
                    continue
                answers[i] += 1
                if found:
                    current = best[i]
                    if current is None or version > current.version:
                        best[i] = Entry(bytes(data[start_at:offset]), version)
                if answers[i] >= need[i]:
                    done[i] = True
                    remaining -= 1
        if remaining > 0:
            failed.extend(i for i in range(n) if not done[i])
        if failed:
            involved = sorted({ep for i in failed for ep in ring_reps[i]})
            bad = [ep for ep in involved if ep in errors] or involved
            for ep in bad:
                if ep not in errors:
                    errors[ep] = _deadline_error(ep, self.deadline)
            mode = "consistent" if consistent else "relaxed"
            raise self._error(
                f"{mode} get",
                f"{len(failed)} of {n} keys got fewer answers than needed "
                f"({'a majority' if consistent else 'one'} of their replicas)",
                bad,
                errors,
            )
        if joined:
            return b"".join(e.value for e in best if e is not None), [len(e.value) if e is not None else -1 for e in best]
        return best

    def _get_anywhere(self, keys: List[bytes], pb: Any, start: float, end: float,
                      failed: Dict[str, BaseException]) -> Any:
        """A relaxed get where every replica holds every key (:meth:`holds_every_key`): one
        call to one usable replica picked at random -- hedged to a second one after
        ``hedge_after``, the first answer wins -- answered without the per-key bookkeeping of
        :meth:`get` (which cost about as much client CPU as the call itself on a 256-key
        read). ``None`` when every call sent failed, each replica's error then in ``failed``
        (unanswered ones as timed out): the caller runs the general path, which fails over to
        the replicas not asked or raises naming what each said.

        A replica whose back-off ended is asked first: :meth:`_usable` gave this call its probe
        (and holds other calls off it for a deadline), so the probe must go out; a still dead
        one fails at once, a stalled one is hedged like any other.

        Returns the answering replica's ``GetResponse`` (:func:`_entries` reads it)."""
        usable: List[_Replica] = []
        probes: List[_Replica] = []
        for rep in self._replicas.values():
            was_down = rep.down_until != 0.0  # read without _lock: it only orders the picks
            if self._usable(rep, start):
                (probes if was_down else usable).append(rep)
        if not usable and not probes:
            return None
        random.shuffle(usable)
        usable = probes + usable
        request = pb.GetRequest(keys=keys)
        out: "queue.SimpleQueue" = queue.SimpleQueue()
        hedge_at = start + self.hedge_after if self.hedge_after > 0 and len(usable) > 1 else None
        # With no hedge to send the answer is waited for anyway: on this thread.
        self._send(usable[0], "Get", request, end, out, None, inline=hedge_at is None)
        sent = [usable[0]]
        answered = 0
        good = None
        while answered < len(sent):
            wait_until = hedge_at if hedge_at is not None else end + 0.25
            try:
                _, rep, response, exc = out.get(timeout=max(0.0, wait_until - time.monotonic()))
            except queue.Empty:
                if hedge_at is None:
                    break  # past the deadline (gRPC's fire at `end`: only a safety bound)
                hedge_at = None
                self._send(usable[1], "Get", request, end, out, None)
                sent.append(usable[1])
                continue
            answered += 1
            if exc is None and len(response.message.found) == len(keys):
                good = response
                break
            if exc is not None:
                failed[rep.endpoint] = exc
        if good is None:
            for rep in sent:
                if rep.endpoint not in failed and answered < len(sent):
                    failed[rep.endpoint] = _deadline_error(rep.endpoint, self.deadline)
        return good

    # -- writes ------------------------------------------------------------------------------

    def _write(
        self,
        op: str,
        keys: Sequence[bytes],
        method: str,
        build: Callable[[List[int]], List[Tuple[Any, List[int]]]],
        acked: Callable[[Any, List[int]], Tuple[Optional[List[int]], Optional[BaseException]]],
        grace: bool = True,
    ) -> None:
        """Send to every replica of every key; return once each key has a majority of acks.

        ``build(idxs)`` makes the requests for the keys of one cohort (split into batches);
        ``acked(response, batch)`` returns the batch indexes acknowledged (``None``: all of
        them) and, when some were not, why (the replica's error for the message). Once every key
        has its majority, stragglers get ``hedge_after`` more to finish (``grace`` False: none);
        after that they are left running (not cancelled), so a slow third replica still gets
        the write.
        """
        n = len(keys)
        self._check_open()
        start = time.monotonic()
        end = start + self.deadline
        # Keys by the replicas that hold them (cohorts). Every replica holds every key when the
        # replication covers them all (the data cache's three of three): one cohort, no key to
        # hash.
        if self.holds_every_key():
            cohorts: Dict[Tuple[str, ...], List[int]] = {tuple(self.endpoints): list(range(n))}
        else:
            cohorts = defaultdict(list)
            for i, reps in enumerate(self._ring.replicas_for_many(keys, self.replication)):
                cohorts[reps].append(i)
        # Whom to send to, asked once per replica per write (letting a down replica's probe
        # through marks it probed).
        usable: Dict[str, bool] = {}
        for reps in cohorts:
            for ep in reps:
                if ep not in usable:
                    usable[ep] = self._usable(self._replicas[ep], start)
        errors: Dict[str, BaseException] = {
            ep: _Down(self._retry_in(self._replicas[ep], start)) for ep, ok in usable.items() if not ok}
        # Acknowledgements are counted per batch (one request's keys, all of one cohort, sent
        # alike to each of its replicas), not per key and replica: that Python step was a third
        # of a producer's CPU for its chunk puts (256 chunks a MiB, three replicas). A replica
        # that acknowledges some keys of a batch only (too large, a short answer) counts for
        # those keys alone (``extra``, per batch). Every key is in exactly one batch.
        batches: List[List[int]] = []
        b_reps: List[Tuple[str, ...]] = []
        b_need: List[int] = []
        b_acks: List[int] = []  # replicas that acknowledged every key of the batch
        b_inflight: List[int] = []
        extra: Dict[int, Dict[int, int]] = {}  # batch -> key index -> acknowledgements of it alone
        out: "queue.SimpleQueue" = queue.SimpleQueue()
        pending = 0
        for reps_key, idxs in cohorts.items():
            targets = [self._replicas[ep] for ep in reps_key if usable[ep]]
            need = _majority(len(reps_key))
            for request, batch in build(idxs):
                slot = len(batches)
                batches.append(batch)
                b_reps.append(reps_key)
                b_need.append(need)
                b_acks.append(0)
                b_inflight.append(len(targets))
                # The replicas of a cohort get the same request, serialized once.
                payload = request if isinstance(request, bytes) or len(targets) <= 1 else request.SerializeToString()
                for rep in targets:
                    self._send(rep, method, payload, end, out, slot)
                    pending += 1

        def acks_of(slot: int) -> int:
            """The fewest acknowledgements a key of batch ``slot`` has."""
            alone = extra.get(slot)
            if alone is None:
                return b_acks[slot]
            return b_acks[slot] + min(alone.get(i, 0) for i in batches[slot])

        remaining = sum(1 for slot in range(len(batches)) if acks_of(slot) < b_need[slot])
        hopeless = any(acks_of(slot) + b_inflight[slot] < b_need[slot] for slot in range(len(batches)))
        grace_until: Optional[float] = None
        while pending > 0 and not hopeless:
            if remaining == 0:
                # Quorum reached. Give the other replicas a short grace (hedge_after) to finish
                # too, so a relaxed read right after this put rarely meets a replica that has
                # not stored it yet; a slow replica still costs at most that grace.
                if grace_until is None:
                    grace_until = min(end, time.monotonic() + (self.hedge_after if grace else 0.0))
                wait = grace_until - time.monotonic()
                if wait <= 0:
                    break
            else:
                wait = end + 0.25 - time.monotonic()  # safety bound only: gRPC deadlines fire at `end`
            try:
                slot, rep, response, exc = out.get(timeout=max(0.0, wait))
            except queue.Empty:
                break
            pending -= 1
            b_inflight[slot] -= 1
            was_done = acks_of(slot) >= b_need[slot]
            if exc is not None:
                errors[rep.endpoint] = exc
            else:
                ok, refusal = acked(response, batches[slot])
                if refusal is not None:
                    errors[rep.endpoint] = refusal
                if ok is None:
                    b_acks[slot] += 1
                else:
                    alone = extra.setdefault(slot, {})
                    for i in ok:
                        alone[i] = alone.get(i, 0) + 1
            now_acks = acks_of(slot)
            if not was_done and now_acks >= b_need[slot]:
                remaining -= 1
            hopeless = now_acks + b_inflight[slot] < b_need[slot]
        if remaining == 0:
            return
        # A write gives up as soon as one key cannot get its majority any more: keys still in
        # flight then are not failed (their replicas may store them), only not acknowledged.
        short = unanswered = 0
        involved: set = set()
        for slot, batch in enumerate(batches):
            if acks_of(slot) >= b_need[slot]:
                continue
            involved.update(b_reps[slot])
            alone = extra.get(slot, {})
            for i in batch:
                got = b_acks[slot] + alone.get(i, 0)
                if got < b_need[slot]:
                    short += 1
                    unanswered += got + b_inflight[slot] >= b_need[slot]
        failed = [ep for ep in sorted(involved) if ep in errors] or sorted(involved)
        for ep in failed:
            if ep not in errors:
                errors[ep] = _deadline_error(ep, self.deadline)
        raise self._error(
            op,
            f"{short} of {n} keys got fewer than a majority of acknowledgements"
            + (f" ({unanswered} of them still unanswered when it gave up)" if unanswered else ""),
            failed,
            errors,
        )

    def put(self, items: Sequence[Tuple[bytes, bytes, int]], *, ttl: Optional[float] = None,
            grace: bool = True) -> None:
        """Write ``(key, value, version)`` triples to all replicas of each key.

        Batched per replica, sent in parallel; succeeds once every key has a majority of
        acknowledgements (the remaining replica gets ``hedge_after`` more to finish before the
        call returns, unless ``grace`` is False; it is never cancelled). A replica stores an
        entry only if its version is ``>=`` the stored one; a refusal because it holds a newer
        version counts as an acknowledgement.

        Parameters
        ----------
        items : sequence of (bytes, bytes-like, int)
            Versions are unsigned 64-bit. A value may be any bytes-like object (a
            ``memoryview`` of a larger buffer: it is copied once, into the request).
        ttl : float, optional
            Seconds to live; default: the server's role default (60 s data, 24 h metadata).
        grace : bool, default True
            Wait up to ``hedge_after`` past the majority for the other replicas, so that a
            relaxed read right after the put rarely meets one that has not stored it yet. A
            writer whose next write waits on this one (a producer's flush: its chunks, then its
            lengths) passes False: its readers are pushed the bytes, and a relaxed read that
            meets a lagging replica reads the chunk again from a majority (Fig. 5).

        Raises
        ------
        CacheUnavailableError
            If some key got fewer than a majority of acknowledgements; names the replicas that
            failed. :class:`CacheError` when a replica refused an entry as too large for its
            capacity or refused the token.
        """
        items = list(items)
        if not items:
            return
        pb = self._pb2()
        ttl_ms = _ttl_ms(ttl)
        keys = [item[0] for item in items]

        def build(idxs: List[int]) -> List[Tuple[Any, List[int]]]:
            requests = []
            batch: List[int] = []
            size = 0
            for i in idxs:
                value_len = len(items[i][1])
                if batch and (size + value_len > MAX_BATCH_BYTES or len(batch) >= MAX_BATCH_KEYS):
                    requests.append(batch)
                    batch, size = [], 0
                batch.append(i)
                size += value_len
            if batch:
                requests.append(batch)
            out = []
            for b in requests:
                values = [items[i][1] for i in b]
                sizes = [len(v) for v in values]
                # Encoded by hand (wire.encode: the values copied once, into the body; the
                # generated way copied them into the message and again when serializing it).
                head = pb.PutRequest(keys=[items[i][0] for i in b], sizes=sizes,
                                     versions=[items[i][2] for i in b], ttl_ms=ttl_ms)
                # Data first: the server finds it without walking a record per key.
                out.append((wire.encode(head, values, sum(sizes), data_first=True), b))
            return out

        too_large_code = pb.TOO_LARGE

        def acked(response: Any, batch: List[int]) -> Tuple[Optional[List[int]], Optional[BaseException]]:
            statuses = list(response.status)  # at C speed; STORED and STALE both acknowledge
            if len(statuses) == len(batch) and too_large_code not in statuses:
                return None, None
            # A key without a status (an answer shorter than the batch) is not acknowledged.
            ok = [i for i, status in zip(batch, statuses) if status != too_large_code]
            refused = statuses.count(too_large_code)
            if len(statuses) < len(batch):
                return ok, _ShortAnswer(len(statuses), len(batch))
            return ok, _TooLarge(refused)

        self._write("put", keys, "Put", build, acked, grace)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys`` from all their replicas; succeeds on a majority per key.

        Raises
        ------
        CacheUnavailableError
            If some key got fewer than a majority of acknowledgements.
        """
        keys = list(keys)
        if not keys:
            return
        pb = self._pb2()

        def build(idxs: List[int]) -> List[Tuple[Any, List[int]]]:
            return [
                (pb.DeleteRequest(keys=[keys[i] for i in idxs[lo : lo + MAX_BATCH_KEYS]]), idxs[lo : lo + MAX_BATCH_KEYS])
                for lo in range(0, len(idxs), MAX_BATCH_KEYS)
            ]

        self._write("delete", keys, "Delete", build, lambda response, batch: (None, None))

    def compare_and_set(
        self,
        key: bytes,
        expected: Optional[bytes],
        value: bytes,
        *,
        version: int = 0,
        ttl: Optional[float] = None,
    ) -> Tuple[bool, Optional[Entry]]:
        """Set ``key`` to ``value`` where its value is exactly ``expected`` (``None``: absent).

        Sent to all replicas of the key. Replicas compare and swap independently, so after a
        replica outage or a duel they may disagree; the lease code built on this treats a
        minority swap as a failure and reads again.

        Returns
        -------
        (bool, Entry or None)
            ``(True, Entry(value, version))`` when a majority swapped; otherwise ``False`` and
            the highest-version entry the answering replicas hold (``None`` if none holds one).

        Raises
        ------
        CacheUnavailableError
            If fewer than a majority of the key's replicas answered.
        """
        self._check_open()
        pb = self._pb2()
        ttl_ms = _ttl_ms(ttl)
        reps = self._ring.replicas_for(key, self.replication)
        need = _majority(len(reps))
        request = pb.CompareAndSetRequest(
            key=key,
            expect_absent=expected is None,
            expected=expected or b"",
            value=value,
            version=version,
            ttl_ms=ttl_ms,
        )
        start = time.monotonic()
        end = start + self.deadline
        out: "queue.SimpleQueue" = queue.SimpleQueue()
        errors: Dict[str, BaseException] = {}
        pending = 0
        for ep in reps:
            rep = self._replicas[ep]
            if self._usable(rep, start):
                self._send(rep, "CompareAndSet", request, end, out, None)
                pending += 1
            else:
                errors[ep] = _Down(self._retry_in(rep, start))
        swapped = answered = 0
        best: Optional[Entry] = None
        while pending > 0:
            # Decided once a majority swapped, or once a majority cannot swap any more.
            if swapped >= need or (answered - swapped) > len(reps) - need:
                break
            try:
                _, rep, response, exc = out.get(timeout=max(0.0, end + 0.25 - time.monotonic()))
            except queue.Empty:
                break
            pending -= 1
            if exc is not None:
                errors[rep.endpoint] = exc
                continue
            answered += 1
            if response.swapped:
                swapped += 1
            elif response.found and (best is None or response.version > best.version):
                best = Entry(response.value, response.version)
        if swapped >= need:
            return True, Entry(value, version)
        if answered >= need or (answered - swapped) > len(reps) - need:
            if best is None and swapped:
                best = Entry(value, version)  # a minority swapped: that is what it holds now
            return False, best
        failed = [ep for ep in reps if ep in errors] or list(reps)
        for ep in failed:
            if ep not in errors:
                errors[ep] = _deadline_error(ep, self.deadline)
        raise self._error(
            "compare_and_set", f"{answered} of {len(reps)} replicas answered, {need} needed", failed, errors
        )

    # -- introspection -----------------------------------------------------------------------

    def _ask_all(self, method: str, request: Any) -> Dict[str, Tuple[Any, Optional[BaseException]]]:
        """Call ``method`` on every endpoint in parallel (down ones too: these are probes)."""
        self._check_open()
        end = time.monotonic() + self.deadline
        out: "queue.SimpleQueue" = queue.SimpleQueue()
        for ep in self.endpoints:
            self._send(self._replicas[ep], method, request, end, out, ep)
        results: Dict[str, Tuple[Any, Optional[BaseException]]] = {}
        while len(results) < len(self.endpoints):
            try:
                ep, _, response, exc = out.get(timeout=max(0.0, end + 0.25 - time.monotonic()))
            except queue.Empty:
                break
            results[ep] = (response, exc)
        for ep in self.endpoints:
            results.setdefault(ep, (None, _deadline_error(ep, self.deadline)))
        return results

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Per endpoint, the server's stats: ``role``, ``uptime_s`` and its gauges and counters
        (``entries``, ``used_bytes``, ``capacity_bytes``, ``rss_bytes``, ``gets_total``, ...);
        ``{"error": "..."}`` for an endpoint that did not answer."""
        pb = self._pb2()
        stats: Dict[str, Dict[str, Any]] = {}
        for ep, (response, exc) in self._ask_all("Stats", pb.StatsRequest()).items():
            if exc is not None or response is None:
                stats[ep] = {"error": _describe(exc) if exc is not None else "cancelled"}
            else:
                values: Dict[str, Any] = dict(response.values)
                values["role"] = response.role
                values["uptime_s"] = response.uptime_s
                stats[ep] = values
        return stats

    def health(self) -> Dict[str, bool]:
        """Per endpoint, whether it answered the Health call within the deadline."""
        pb = self._pb2()
        return {
            ep: exc is None and response is not None and bool(response.serving)
            for ep, (response, exc) in self._ask_all("Health", pb.HealthRequest()).items()
        }


def _try(call: Callable[..., Any], request: Any, timeout: float, metadata: Any) -> Optional[BaseException]:
    """Run one gRPC call; its error, or None (for :meth:`CacheClient._connect`)."""
    try:
        call(request, timeout=timeout, metadata=metadata)
    except Exception as exc:  # grpc.RpcError mostly: the caller only waits for an outcome
        return exc
    return None


def _ttl_ms(ttl: Optional[float]) -> int:
    if ttl is None:
        return 0
    if not ttl > 0:
        raise AcsOptionError(f"ttl: must be > 0 seconds (or None for the server default), got {ttl!r}", option="ttl")
    return max(1, int(round(ttl * 1000)))


class _DeadlineCode:
    name = "DEADLINE_EXCEEDED"


class _NoAnswer(Exception):
    def code(self):
        return _DeadlineCode


#: Methods whose answers carry a run of bytes: split from their data by hand
#: (:func:`pyspark_acs.cache.wire.split`) instead of parsed into a message whose ``.data``
#: copies the bytes once more. Method: (request type, answer type, the channel's call shape,
#: whether ``data`` is a memoryview of the answer). A Get's is: :meth:`CacheClient.get_joined`
#: hands it out as it is and :meth:`CacheClient.get` copies each value out once (with bytes,
#: the split copied the whole run first: one copy of every byte more). A Follow push stays
#: ``bytes``: the feed keeps the runs and hands them to readers whole.
_SPLIT_ANSWERS = {"Get": ("GetRequest", "GetResponse", "unary_unary", True),
                  "Follow": ("FollowRequest", "FileBytes", "unary_stream", False)}


def _method_path(pb: Any, method: str) -> str:
    """The gRPC path of the cache service's ``method``."""
    return f"/{pb.DESCRIPTOR.services_by_name['Cache'].full_name}/{method}"


def _answer_parser(pb: Any, method: str) -> Callable[[bytes], Any]:
    """The response deserializer of ``method``: a :class:`~pyspark_acs.cache.wire.WithData`
    for the methods of :data:`_SPLIT_ANSWERS`, the generated ``FromString`` for the others."""
    split = _SPLIT_ANSWERS.get(method)
    if split is None:
        return getattr(pb, f"{method}Response").FromString
    return functools.partial(wire.split, message_type=getattr(pb, split[1]), view=split[3])


def _entries(response: "wire.WithData") -> List[Optional[Entry]]:
    """The entries of one ``GetResponse`` (split from its data), in the order of its keys
    (``None`` for a miss)."""
    data, got = response.data, response.message
    result: List[Optional[Entry]] = []
    append = result.append
    offset = 0
    for found, size, version in zip(got.found, got.sizes, got.versions):
        append(Entry(bytes(data[offset:offset + size]), version) if found else None)
        offset += size
    return result


def _deadline_error(endpoint: str, deadline: float) -> BaseException:
    return _NoAnswer(f"no answer from {endpoint} within {deadline:.3f} s")


def client_for(
    value: "Union[str, Sequence[str], CacheClient, None]",
    name: str,
    owned: List["CacheClient"],
    token: Optional[str] = None,
    security: Optional[SecuritySettings] = None,
) -> Optional["CacheClient"]:
    """The client for an option that is an endpoint string or a ready :class:`CacheClient`.

    ``None`` or ``""`` gives None. A client created here (with ``token`` and ``security``,
    default: the process's, :func:`~pyspark_acs.security.resolve_security`) is appended to ``owned``: the caller closes those (and only those)
    when it closes.
    """
    if value is None or value == "":
        return None
    if isinstance(value, CacheClient):
        return value
    client = CacheClient(value, name=name, token=token, security=security)
    owned.append(client)
    return client
