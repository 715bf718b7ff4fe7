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
probed again by one real request after a back-off that starts at
:data:`~pyspark_acs.cache.replicas.DOWN_BACKOFF_INITIAL_S` and doubles up to
:data:`~pyspark_acs.cache.replicas.DOWN_BACKOFF_MAX_S`; a success clears it. gRPC errors become
:class:`~pyspark_acs.errors.CacheError` subclasses naming the endpoints (``raise ... from``).

This module holds the client itself: its channels, its I/O pool and its calls. How a call's
keys are spread over their replicas and their answers counted is :mod:`pyspark_acs.cache.fanout`;
each replica's health and back-off is :mod:`pyspark_acs.cache.replicas`; endpoint lists and the
environment variables naming a cache are :mod:`pyspark_acs.cache.endpoints`.

The client is thread-safe and meant to be shared: one lazily created gRPC channel per endpoint,
and one small I/O thread pool that runs the calls of a fan-out in parallel (see
:meth:`CacheClient._send` for why a pool rather than gRPC futures). Importing this module does
not import grpc; the first call does. The client is never pickled: code that ships work to
Spark executors pickles the endpoint string and builds a client there.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from pyspark_acs import _fork
from pyspark_acs.security import SecuritySettings, resolve_security
from pyspark_acs.errors import AcsOptionError, CacheError, CacheTimeoutError, CacheUnavailableError, ClosedError
from pyspark_acs.cache import wire
from pyspark_acs.cache.endpoints import parse_endpoints
from pyspark_acs.cache.fanout import (
    MAX_BATCH_BYTES,
    MAX_BATCH_KEYS,
    Entry,
    QuorumRead,
    QuorumWrite,
    majority,
    read_anywhere,
)
from pyspark_acs.cache.pipeline import PipelinedCall
from pyspark_acs.cache.replicas import CHANNEL_OPTIONS, Down, Replica, code_name, deadline_error, describe
from pyspark_acs.cache.ring import DEFAULT_VNODES, HashRing

__all__ = ["CacheClient", "client_for"]

DEFAULT_REPLICATION = 3
#: Deadline of every cache call (the paper's "strict sub-second deadlines").
DEFAULT_DEADLINE_S = 0.5
#: A relaxed read still unanswered after this long is also sent to a second replica.
DEFAULT_HEDGE_AFTER_S = 0.03

#: Threads of a client's I/O pool: gRPC calls in flight at once (they wait on the network,
#: not the CPU; a hung replica holds one for at most the deadline).
IO_THREADS = 32
#: A client's first call waits this long at most, once, for its channels to connect (or fail to:
#: a refused connection ends the wait at once) before its deadline clock starts. Importing grpc
#: and connecting are no call: on a loaded machine they take seconds, and counted against the
#: first call's 0.5 s deadline they make healthy replicas look down (DEADLINE_EXCEEDED).
CONNECT_TIMEOUT_S = 1.0


class _TooLarge(Exception):
    """Stands for a put the replica refused as too large for its capacity."""

    def __init__(self, count: int) -> None:
        super().__init__(f"refused {count} entr{'y' if count == 1 else 'ies'} too large for its capacity")


class _ShortAnswer(Exception):
    """Stands for a put answer with fewer statuses than the request had keys: the keys without
    one are not acknowledged (our servers answer one per key; this is a replica off protocol)."""

    def __init__(self, got: int, keys: int) -> None:
        super().__init__(f"answered {got} statuses for {keys} keys (one per key expected)")


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
        # _lock guards _replicas' channel/stub creation, every Replica's down state, _executor
        # creation and _closed.
        self._lock = threading.Lock()
        self._replicas: Dict[str, Replica] = {ep: Replica(ep, self._lock, self.deadline) for ep in self.endpoints}
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

    def _stub(self, rep: Replica):
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
                rep.channel = self.security.channel(rep.endpoint, CHANNEL_OPTIONS)
                stub = acs_pb2_grpc.CacheStub(rep.channel)
                # The byte-carrying answers are split from their data by hand (cache/wire.py).
                for method, (request, _, shape, _view) in _SPLIT_ANSWERS.items():
                    setattr(stub, method, getattr(rep.channel, shape)(
                        _method_path(acs_pb2, method), request_serializer=getattr(acs_pb2, request).SerializeToString,
                        response_deserializer=_answer_parser(acs_pb2, method), _registered_method=True))
                rep.stub = stub
            return rep.stub

    def _raw_call(self, rep: Replica, method: str):
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

    def _put_stream(self, rep: Replica) -> PipelinedCall:
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
                    expired=lambda: deadline_error(rep.endpoint, self.deadline),
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

    def _send(self, rep: Replica, method: str, request: Any, end: float, out: "queue.SimpleQueue", tag: Any,
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
                rep.mark(None)
            elif judged or code_name(exc) != "DEADLINE_EXCEEDED":
                rep.mark(exc, sent)
            out.put((tag, rep, response, exc))

        if method == "Put" and not rep.unary_puts:
            payload = request if isinstance(request, bytes) else request.SerializeToString()

            def streamed(response: Any, exc: Optional[BaseException]) -> None:
                if exc is not None and code_name(exc) == "UNIMPLEMENTED":
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
            f"{ep} ({describe(errors[ep])})" if ep in errors else f"{ep} (no answer)" for ep in endpoints
        )
        message = f"{self.name}: {op} failed: {summary}; replicas: {reasons}"
        kinds = {code_name(errors[ep]) for ep in endpoints if ep in errors}
        too_large = [errors[ep] for ep in endpoints if isinstance(errors.get(ep), (_TooLarge, _ShortAnswer))]
        if too_large or kinds & {"UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT"}:
            error: CacheError = CacheError(message, endpoints=tuple(endpoints))
        elif kinds == {"DEADLINE_EXCEEDED"}:
            error = CacheTimeoutError(message, endpoints=tuple(endpoints))
        else:
            error = CacheUnavailableError(message, endpoints=tuple(endpoints))
        cause = next(
            (errors[ep] for ep in endpoints
             if ep in errors and not isinstance(errors[ep], (Down, _TooLarge, _ShortAnswer))),
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
        # Replicas the one-call read below asked and that failed, with their errors: the
        # quorum read fails over to the others and reports these as they failed.
        tried_first: Dict[str, BaseException] = {}
        if not consistent and n <= MAX_BATCH_KEYS and self.holds_every_key():
            good = read_anywhere(self, keys, pb, start, end, tried_first)
            if good is not None:
                if joined:
                    got = good.message
                    return good.data, [size if found else -1 for found, size in zip(got.found, got.sizes)]
                return _entries(good)
        best = QuorumRead(self, keys, pb, consistent, start, end, tried_first).run()
        if joined:
            return b"".join(e.value for e in best if e is not None), [len(e.value) if e is not None else -1 for e in best]
        return best

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
        """Send to every replica of every key; return once each key has a majority of acks
        (:class:`~pyspark_acs.cache.fanout.QuorumWrite`: ``build`` and ``acked`` are its)."""
        self._check_open()
        start = time.monotonic()
        QuorumWrite(self, op, keys, method, build, acked, start, start + self.deadline).run(grace)

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
        need = majority(len(reps))
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
            if rep.usable(start):
                self._send(rep, "CompareAndSet", request, end, out, None)
                pending += 1
            else:
                errors[ep] = rep.down(start)
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
                errors[ep] = deadline_error(ep, self.deadline)
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
            results.setdefault(ep, (None, deadline_error(ep, self.deadline)))
        return results

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Per endpoint, the server's stats: ``role``, ``uptime_s`` and its gauges and counters
        (``entries``, ``used_bytes``, ``capacity_bytes``, ``rss_bytes``, ``gets_total``, ...);
        ``{"error": "..."}`` for an endpoint that did not answer."""
        pb = self._pb2()
        stats: Dict[str, Dict[str, Any]] = {}
        for ep, (response, exc) in self._ask_all("Stats", pb.StatsRequest()).items():
            if exc is not None or response is None:
                stats[ep] = {"error": describe(exc) if exc is not None else "cancelled"}
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



def client_for(
    value: "Union[str, Sequence[str], CacheClient, None]",
    name: str,
    owned: List["CacheClient"],
    token: Optional[str] = None,
    security: Optional[SecuritySettings] = None,
) -> Optional["CacheClient"]:
    """The client for an option that is an endpoint string or a ready :class:`CacheClient`.

    ``None`` or ``""`` gives None. A client created here (with ``token`` and ``security``,
    default: the environment's, :func:`~pyspark_acs.security.resolve_security`) is appended to ``owned``: the caller closes those (and only those)
    when it closes.
    """
    if value is None or value == "":
        return None
    if isinstance(value, CacheClient):
        return value
    client = CacheClient(value, name=name, token=token, security=security)
    owned.append(client)
    return client
