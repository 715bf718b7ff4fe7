"""The cache server: one process per replica of the data or the metadata cache.

Run it as ``acs-cache-server`` or ``python -m pyspark_acs.server.cache``::

    python -m pyspark_acs.server.cache --role data --port 0 --capacity 1GiB --ttl 60s

Its flags are generated from :class:`~pyspark_acs.server.cache.options.CacheServerOptions`.

It serves the gRPC ``Cache`` service of ``proto/acs.proto`` (batched get and put,
compare-and-set, delete, stats, health) over a :class:`~pyspark_acs.server.cache.store.Store`, and a
small HTTP endpoint with ``/metrics`` (Prometheus text format) and ``/healthz`` (JSON)
(:class:`~pyspark_acs.server.metrics.MetricsEndpoint`; the series are declared in
:data:`~pyspark_acs.server.metrics.CACHE_METRICS`). Once both
listen, it prints exactly one line on stdout, which a parent process parses for the ports::

    acs-cache-server role=data listening on 127.0.0.1:PORT metrics=http://127.0.0.1:MPORT/metrics

It binds 127.0.0.1 unless ``--host`` says otherwise, stops gracefully on SIGTERM or SIGINT
(in-flight calls get :data:`CACHE_STOP_GRACE_S` to finish) and exits with status 2 and a message
naming the flag when a flag is bad. With a token (``--token-file``, ``$ACS_TOKEN_FILE`` or
``$ACS_CACHE_TOKEN``; ``--token`` is deprecated: ``ps`` shows it) every call must carry the
metadata ``authorization: Bearer <token>`` (the bare token is accepted too), else it fails with
``UNAUTHENTICATED``; ``/metrics`` and ``/healthz`` answer 401 without it. With a certificate
(``--tls-cert``/``--tls-key`` or ``$ACS_TLS_*``) both endpoints use TLS. A non-loopback
``--host`` needs TLS and a token, or ``--insecure`` (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import sys
import threading
import time
from concurrent import futures
from typing import Callable, Dict, List, Optional, Sequence

from pyspark_acs._fork import open_grpc
from pyspark_acs._grpc import grpc

from pyspark_acs.errors import AcsOptionError
from pyspark_acs.security import SecuritySettings, check_bind, metadata_has_token, resolve_security
from pyspark_acs.options import add_option_flags, options_from_flags
from pyspark_acs.server.cache.options import (DEFAULT_CAPACITY_BYTES, MIN_CAPACITY_BYTES, ROLES, ROLE_DEFAULT_TTL_S,
                                              CacheServerOptions)
from pyspark_acs.server.settings import DEFAULT_HOST, configure_logging
from pyspark_acs.cache import wire
from pyspark_acs.cache.wire import CACHE_MAX_MESSAGE_BYTES
from pyspark_acs.cache.proto import acs_pb2, acs_pb2_grpc
from pyspark_acs.server.cache.store import PutResult, Store
from pyspark_acs.server.cache.watch import FileFollow, KeyWatch, Run, Watchers
from pyspark_acs.server.strict import add_servicer
from pyspark_acs.server.lifetime import watch_parent
from pyspark_acs.server.malloc import tune_malloc
from pyspark_acs.server.metrics import CACHE_CALL_METRICS, CACHE_METRICS, Metrics, MetricsEndpoint, StatsCollector

__all__ = [
    "main",
]

#: Prefix of every cache-server metric.
CACHE_PREFIX = "acs_cache_"
#: Most keys one Get, Put or Delete may name (the client sends at most MAX_BATCH_KEYS = 1024):
#: bounds how long one call holds the store's lock.
MAX_KEYS_PER_CALL = 16_384
#: Most keys one Watch stream may watch at once: a process watches two length keys per
#: followed file per replica, so this covers ~100k files while bounding what one stream can
#: make a server hold (~100 bytes per key). A Follow stream's subscription is one message:
#: at most MAX_KEYS_PER_CALL files.
MAX_KEYS_PER_STREAM = 262_144
#: Most value bytes one Get answer may hold, checked before it is assembled (the client splits
#: batches at 4 MiB; below CACHE_MAX_MESSAGE_BYTES so an answer is never built only to be refused).
MAX_RESPONSE_BYTES = 32 * 1024**2
#: How often expired entries are swept (in bounded slices, off the request path).
EXPIRY_SWEEP_INTERVAL_S = 1.0
#: In-flight calls get this long to finish on SIGTERM/SIGINT.
CACHE_STOP_GRACE_S = 1.0
_SERVER_OPTIONS = [
    # Two servers must never silently share a port (a restarted replica must own its port).
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", CACHE_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", CACHE_MAX_MESSAGE_BYTES),
    # Cache clients keep one channel per server for the life of a process; let them keep alive.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
]


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Refused(Exception):
    """A request the servicer refuses, with the status to end its call with (by default
    RESOURCE_EXHAUSTED: a request over a bound)."""

    def __init__(self, message: str, status: "grpc.StatusCode" = grpc.StatusCode.RESOURCE_EXHAUSTED) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _encode_runs(runs: List[Run]) -> bytes:
    """A Follow stream's message (``FileBytes``) carrying ``runs``, encoded once
    (:func:`pyspark_acs.cache.wire.encode`: each run's pieces are copied once, into it)."""
    sizes = [r[3] for r in runs]
    return wire.encode(acs_pb2.FileBytes(files=[r[0] for r in runs], starts=[r[1] for r in runs], sizes=sizes),
                       [piece for r in runs for piece in r[2]], sum(sizes))


def _decode_put(raw: bytes) -> "wire.WithData":
    """A ``PutRequest`` body split from its ``data`` (:func:`pyspark_acs.cache.wire.split`; a
    view of the body, the client sends it first): :meth:`CacheServicer._put` copies each value
    once out of the body, where the generated parser copied them into the message and again
    when ``.data`` was read, and then the values were cut out of that."""
    return wire.split(raw, acs_pb2.PutRequest, view=True)


class CacheServicer(acs_pb2_grpc.CacheServicer):
    """The gRPC handlers: thin translations between protobuf messages and :class:`Store` calls.

    Every handler runs on the server's event loop (grpc.aio): the unary ones call the store
    and return, the two push streams (:meth:`Watch`, :meth:`Follow`) wait on their marks
    (:mod:`pyspark_acs.server.cache.watch`). One thread does all of it, so a put marks the
    streams that watch its keys without a lock or a thread hand-off.
    """

    def __init__(self, store: Store, role: str, metrics: Optional[Metrics] = None) -> None:
        self.store = store
        self.role = role
        self.started_at = time.monotonic()
        self.watchers = Watchers(store)
        # Open PutStream calls (the event loop's thread alone touches it).
        self.put_streams = 0
        # The latency histogram's series per method, looked up once (observed on every call).
        metrics = metrics or Metrics(CACHE_PREFIX, CACHE_CALL_METRICS, {"role": role})
        self._latency = {m: metrics.series("request_seconds", method=m)
                         for m in ("Get", "Put", "CompareAndSet", "Delete")}

    async def Get(self, request, context):  # noqa: N802 (gRPC method name)
        """Batched get: per key ``found``, ``versions`` and ``sizes``, the values concatenated in ``data``.

        Absent or expired keys answer ``found=False``, size 0 and version 0.
        """
        started = time.perf_counter()
        if len(request.keys) > MAX_KEYS_PER_CALL:  # counted before listing: a huge request is refused at once
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"get: {len(request.keys)} keys in one call; at most {MAX_KEYS_PER_CALL}")
        # A list, once: each pass over a repeated field builds its bytes objects anew.
        keys = list(request.keys)
        unique = dict.fromkeys(keys)
        if len(unique) < len(keys):
            # Each key is looked up once however often it is named.
            names = list(unique)
            at = {k: i for i, k in enumerate(names)}
            found_u, values_u, versions_u = self.store.read_many(names)
            idx = [at[k] for k in keys]
            found = [found_u[i] for i in idx]
            values = [values_u[i] for i in idx]
            versions = [versions_u[i] for i in idx]
        else:
            found, values, versions = self.store.read_many(keys)
        sizes = [len(v) for v in values]
        # Bound the response before assembling it: a small request naming big values many
        # times must not make the server build a huge message (docs/security.md).
        total = sum(sizes)
        if total > MAX_RESPONSE_BYTES:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"get: the answer would hold {total} bytes; at most {MAX_RESPONSE_BYTES} per call")
        answer = wire.encode(acs_pb2.GetResponse(found=found, sizes=sizes, versions=versions), values, total)
        # The handler's time includes building the answer (before cache/wire.py, grpc built it
        # after the handler returned, outside this figure).
        self._latency["Get"].observe(time.perf_counter() - started)
        return answer

    def _put(self, put: "wire.WithData") -> "acs_pb2.PutResponse":
        """Store one batched put (the one rule of :meth:`Put` and :meth:`PutStream`): the
        request split from its ``data`` by :func:`_decode_put`.

        Raises
        ------
        _Refused
            With the status to end the call with: more keys than ``MAX_KEYS_PER_CALL``
            (``RESOURCE_EXHAUSTED``), or counts of keys, sizes and versions, or the sizes and
            the data length, that disagree (``INVALID_ARGUMENT``).
        """
        started = time.perf_counter()
        request, data = put
        if len(request.keys) > MAX_KEYS_PER_CALL:
            raise _Refused(f"put: {len(request.keys)} keys in one call; at most {MAX_KEYS_PER_CALL}")
        keys, sizes, versions = list(request.keys), list(request.sizes), request.versions
        ends = list(itertools.accumulate(sizes))
        total = ends[-1] if ends else 0
        if not (len(keys) == len(sizes) == len(versions)) or total != len(data):
            raise _Refused(
                f"put: {len(keys)} keys, {len(sizes)} sizes and {len(versions)} versions, "
                f"sizes summing to {total} for {len(data)} data bytes; they must agree",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        # Each value copied once, out of the request's body (data is a view of it), at C speed.
        values = list(map(bytes, map(data.__getitem__, map(slice, [0, *ends[:-1]], ends))))
        ttl_s = request.ttl_ms / 1000.0 if request.ttl_ms else None
        results = self.store.put_many(zip(keys, values, versions), ttl_s=ttl_s)
        if not self.watchers.idle:
            self.watchers.stored(k for k, r in zip(keys, results) if r == PutResult.STORED)
        self._latency["Put"].observe(time.perf_counter() - started)
        return acs_pb2.PutResponse(status=results)

    async def Put(self, request, context):  # noqa: N802
        """Batched versioned put; answers one ``PutStatus`` per key.

        Values come concatenated in ``data`` and are split by ``sizes``; ``ttl_ms`` 0 means the
        server's default TTL. Aborts with ``INVALID_ARGUMENT`` when the counts of keys, sizes and
        versions, or the sizes and the data length, disagree. Stored keys that a push stream
        watches or follows are marked for it.
        """
        try:
            return self._put(request)
        except _Refused as exc:
            refused = exc
        await context.abort(refused.status, refused.message)

    async def PutStream(self, requests, context):  # noqa: N802
        """:meth:`Put` pipelined: one ``PutResponse`` per request, in order, on one long-lived
        stream. A refused request ends the stream with its status (requests after it in the
        stream are not stored: the client fails them with that status)."""
        self.put_streams += 1
        try:
            async for request in requests:
                try:
                    response = self._put(request)
                except _Refused as exc:
                    refused = exc
                    break
                yield response
            else:
                return
        finally:
            self.put_streams -= 1
        await context.abort(refused.status, refused.message)

    async def CompareAndSet(self, request, context):  # noqa: N802
        """Set a key to ``value`` if it holds ``expected`` (or is absent, with ``expect_absent``).

        Answers whether it swapped and the entry stored after the call. Aborts with
        ``INVALID_ARGUMENT`` when the entry could never fit in the store.
        """
        started = time.perf_counter()
        ttl_s = request.ttl_ms / 1000.0 if request.ttl_ms else None
        expected = None if request.expect_absent else request.expected
        try:
            swapped, entry = self.store.compare_and_set(
                request.key, expected, request.value, version=request.version, ttl_s=ttl_s
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"compare_and_set: {exc}")
        if swapped and not self.watchers.idle:
            self.watchers.stored([request.key])
        self._latency["CompareAndSet"].observe(time.perf_counter() - started)
        if entry is None:
            return acs_pb2.CompareAndSetResponse(swapped=swapped, found=False)
        return acs_pb2.CompareAndSetResponse(
            swapped=swapped, found=True, value=entry.value, version=entry.version
        )

    async def Delete(self, request, context):  # noqa: N802
        """Delete keys; answers how many were present."""
        started = time.perf_counter()
        if len(request.keys) > MAX_KEYS_PER_CALL:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"delete: {len(request.keys)} keys in one call; at most {MAX_KEYS_PER_CALL}")
        deleted = self.store.delete_many(request.keys)
        self.watchers.deleted(request.keys)
        self._latency["Delete"].observe(time.perf_counter() - started)
        return acs_pb2.DeleteResponse(deleted=deleted)

    def stats_values(self) -> Dict[str, int]:
        """The store's stats, the push streams' counters and this process's ``rss_bytes``."""
        values = self.store.stats()
        values.update(self.watchers.counts)
        values["push_kept_bytes"] = self.watchers.kept_bytes
        values["put_streams"] = self.put_streams
        values["rss_bytes"] = _rss_bytes()
        return values

    async def Stats(self, request, context):  # noqa: N802
        """The role, :meth:`stats_values` and the uptime in seconds."""
        return acs_pb2.StatsResponse(
            role=self.role,
            values=self.stats_values(),
            uptime_s=time.monotonic() - self.started_at,
        )

    async def Health(self, request, context):  # noqa: N802
        """Serving (always, while the process answers), with the role and the uptime in seconds."""
        return acs_pb2.HealthResponse(
            serving=True, role=self.role, uptime_s=time.monotonic() - self.started_at
        )

    async def Watch(self, request_iterator, context):  # noqa: N802
        """Push the newest entries of the keys this stream watches whenever a put stores one
        (batched per message; added keys are sent at once, found or not). Ends when the
        reader closes its side."""
        w = KeyWatch()
        await context.send_initial_metadata(())  # the stream is up: the reader may count on it

        def apply(req) -> None:
            if len(req.add) > MAX_KEYS_PER_CALL or len(w.keys) + len(req.add) > MAX_KEYS_PER_STREAM:
                raise _Refused(f"watch: {len(req.add)} keys added to {len(w.keys)} watched; at most "
                               f"{MAX_KEYS_PER_CALL} per message and {MAX_KEYS_PER_STREAM} per stream")
            self.watchers.watch(w, req.add, req.remove)

        async for keys, entries in self._push(request_iterator, w, apply, "watch_streams",
                                              lambda: w.take(self.store), self.watchers.drop_watch, context):
            values = [e[0] if e is not None else b"" for e in entries]
            yield acs_pb2.WatchEvent(
                keys=keys, found=[e is not None for e in entries], data=b"".join(values),
                sizes=[len(v) for v in values], versions=[e[1] if e is not None else 0 for e in entries],
            )

    async def Follow(self, request, context):  # noqa: N802
        """Push the bytes of the subscribed files from each file's offset as chunks land here
        (contiguous runs, at most :data:`~pyspark_acs.server.cache.watch.MAX_PUSH_BYTES` per
        message), after an empty first message. Ends when the reader cancels (a reader whose
        subscription changes opens a new stream)."""
        f = FileFollow()
        if len(request.follow) != len(request.offsets):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"follow: {len(request.follow)} files but {len(request.offsets)} offsets")
        if len(request.follow) + len(request.latest) > MAX_KEYS_PER_CALL:  # the whole subscription is one message
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"follow: {len(request.follow) + len(request.latest)} files; "
                                f"at most {MAX_KEYS_PER_CALL} per stream")
        latest, ends, cursors = self.watchers.latest(request.latest, request.latest_back)
        # The stream is up: a reader following a file at its end, to which nothing is pushed
        # yet, may count on the stream (and wait for pushes instead of polling). The first
        # message names where each `latest` file is followed from.
        yield acs_pb2.FileBytes(latest_files=latest, latest_ends=ends)
        self.watchers.follow(f, list(request.follow) + latest, list(request.offsets) + cursors, ())
        counts = self.watchers.counts
        async for message, size in self._push(None, f, None, "follow_streams",
                                              lambda: self.watchers.next_message(f, _encode_runs),
                                              self.watchers.drop_follow, context):
            counts["pushed_bytes_total"] += size
            yield message

    async def _push(self, request_iterator, stream, apply, gauge: str, take, drop, context=None):
        """The loop of one push stream: apply the reader's requests as they come (a
        bidirectional stream; ``request_iterator`` None: a server-streaming one, which lives
        until the reader cancels), and yield ``take()`` whenever the stream has marks.
        Level-triggered: nothing is queued."""
        counts = self.watchers.counts
        counts[gauge] += 1

        async def pump() -> None:
            async for req in request_iterator:
                apply(req)

        reader = (asyncio.ensure_future(pump()) if request_iterator is not None
                  else asyncio.get_running_loop().create_future())
        # The reader's end wakes the sender too, so the sender waits on one event only: a task
        # and asyncio.wait() per pushed message cost more CPU than the message itself.
        reader.add_done_callback(lambda _: stream.wake.set())
        try:
            while not reader.done():
                if not stream.marked:
                    stream.wake.clear()
                    await stream.wake.wait()
                    continue
                first, second = take()
                if first:
                    counts["pushed_messages_total"] += 1
                    yield first, second
            failed = reader.exception() if not reader.cancelled() else None
            if failed is not None and context is not None:
                # A refused or malformed request ends the stream with a status naming why.
                code = failed.status if isinstance(failed, _Refused) else grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, str(failed))
        finally:
            reader.cancel()
            counts[gauge] -= 1
            drop(stream)


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose ``authorization`` metadata is not the shared token (the comparison
    is :func:`pyspark_acs.security.metadata_has_token`: constant-time)."""

    def __init__(self, token: str) -> None:
        self._token = token

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cache token")

        async def deny_stream(request_or_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cache token")
            yield  # pragma: no cover - never reached; makes this an async generator

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        # The Cache service's streaming methods are denied with a handler of their own shape.
        self._deny_streams = {"Watch": grpc.stream_stream_rpc_method_handler(deny_stream),
                              "PutStream": grpc.stream_stream_rpc_method_handler(deny_stream),
                              "Follow": grpc.unary_stream_rpc_method_handler(deny_stream)}

    async def intercept_service(self, continuation, handler_call_details):
        if metadata_has_token(handler_call_details.invocation_metadata, self._token):
            return await continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]
        return self._deny_streams.get(method, self._deny)


class CacheServer:
    """One cache replica: gRPC server + store + metrics endpoint + expiry sweeper.

    ``/metrics`` serves :data:`~pyspark_acs.server.metrics.CACHE_METRICS` (label ``role``),
    read from the store at each scrape, and the standard ``process_*`` metrics, from a registry
    of this server's own (:attr:`registry`).

    Parameters
    ----------
    role : {"data", "metadata"}
    host : str
        Interface to bind (both gRPC and metrics).
    port : int
        gRPC port; 0 picks a free one (see :attr:`port` after :meth:`start`).
    capacity_bytes : int
    ttl_s : float
        Default TTL of entries.
    metrics_port : int or None
        HTTP metrics port; 0 picks a free one, ``None`` disables the endpoint.
    token : str, optional
        Shared token every call must carry (default: ``security``'s).
    security : SecuritySettings, optional
        Token and TLS of the gRPC and metrics endpoints; default: none (plain, no token).

    The gRPC server is grpc.aio on an event loop of its own thread (:meth:`start` returns
    once it listens): many long-lived push streams cost no worker thread each, and a put
    marks the streams that watch its keys on the same thread.
    """

    def __init__(
        self,
        role: str,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        capacity_bytes: Optional[int] = None,
        ttl_s: Optional[float] = None,
        metrics_port: Optional[int] = 0,
        token: Optional[str] = None,
        security: Optional[SecuritySettings] = None,
    ) -> None:
        if role not in ROLES:
            raise AcsOptionError(f"role: {role!r} is not a role; use one of: {', '.join(ROLES)}", option="role")
        self.role = role
        self.host = host
        self.requested_port = port
        self.store = Store(
            capacity_bytes if capacity_bytes is not None else DEFAULT_CAPACITY_BYTES[role],
            ttl_s if ttl_s is not None else ROLE_DEFAULT_TTL_S[role],
        )
        # A registry of this server's own (with the standard process_* metrics): store stats read
        # at scrape time, and per-call latency histograms the handlers observe.
        self.registry = Metrics(CACHE_PREFIX, {}).registry
        StatsCollector(CACHE_PREFIX, CACHE_METRICS, self.metric_values, {"role": role}, registry=self.registry)
        calls = Metrics(CACHE_PREFIX, CACHE_CALL_METRICS, {"role": role}, registry=self.registry)
        self.servicer = CacheServicer(self.store, role, calls)
        self.metrics_port_requested = metrics_port
        self.security = (security or SecuritySettings()).with_token(token)
        self.token = self.security.token
        self.port = 0
        self.metrics_port: Optional[int] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[threading.Thread] = None
        self._grace: "Optional[asyncio.Future[float]]" = None  # set by stop(): the grace seconds
        self._http: Optional[MetricsEndpoint] = None
        self._stopping = threading.Event()
        self._threads: List[threading.Thread] = []

    @property
    def endpoint(self) -> str:
        """``host:port`` of the gRPC service (after :meth:`start`)."""
        return format_endpoint(self.host, self.port)

    @property
    def metrics_url(self) -> Optional[str]:
        """URL of ``/metrics`` (after :meth:`start`), or ``None`` when disabled."""
        if self.metrics_port is None:
            return None
        scheme = "https" if self.security.server_tls else "http"
        return f"{scheme}://{format_endpoint(self.host, self.metrics_port)}/metrics"

    def metric_values(self) -> Dict[str, float]:
        """What ``/metrics`` exports: :meth:`CacheServicer.stats_values` (durations in seconds, as
        Prometheus names them: the store's ``default_ttl_ms`` is ``default_ttl_seconds``) and
        ``uptime_seconds``."""
        values: Dict[str, float] = dict(self.servicer.stats_values())
        values["default_ttl_seconds"] = values.pop("default_ttl_ms") / 1000.0
        values["uptime_seconds"] = round(time.monotonic() - self.servicer.started_at, 3)
        return values

    def healthz(self):
        """``/healthz``: healthy while the server is not stopping; names the role and the uptime."""
        uptime = round(time.monotonic() - self.servicer.started_at, 3)
        return not self._stopping.is_set(), {"role": self.role, "uptime_s": uptime}

    def start(self) -> None:
        """Bind and start serving.

        Raises
        ------
        OSError
            If a port cannot be bound; the message names it.
        """
        address = format_endpoint(self.host, self.requested_port)
        listening: "futures.Future[int]" = futures.Future()
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._serve, args=(loop, address, listening), name="acs-cache-grpc",
                                  daemon=True)
        thread.start()
        try:
            self.port = listening.result()
        except BaseException:
            thread.join(timeout=5.0)
            raise
        self._loop, self._loop_thread = loop, thread
        if self.metrics_port_requested is not None:
            try:
                self._http = MetricsEndpoint(self.registry, self.healthz, self.host, self.metrics_port_requested,
                                             name="acs-cache-metrics", security=self.security)
            except OSError:  # the message names the metrics port
                self.stop(0)
                raise
            self.metrics_port = self._http.port
            self._http.start()
        self._spawn("acs-cache-expiry", self._sweep_expired)

    def _serve(self, loop: asyncio.AbstractEventLoop, address: str, listening: "futures.Future[int]") -> None:
        """The gRPC thread: run the aio server on ``loop`` until :meth:`stop`."""
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(address, listening))
        except BaseException as exc:  # a bind failure is reported through ``listening``
            if not listening.done():
                listening.set_exception(exc)
        finally:
            loop.close()

    async def _main(self, address: str, listening: "futures.Future[int]") -> None:
        interceptors = [_TokenInterceptor(self.token)] if self.token else []
        server = open_grpc("cache server", lambda: grpc.aio.server(options=_SERVER_OPTIONS, interceptors=interceptors))
        add_servicer(acs_pb2_grpc.add_CacheServicer_to_server, self.servicer, server, aio=True,
                     decoders={"Put": _decode_put, "PutStream": _decode_put})
        try:
            port = self.security.add_port(server, address)
        except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind ...")
            raise OSError(f"cannot bind the cache gRPC port {address}: {exc}") from exc
        if port == 0:  # older grpc releases report failure as port 0
            raise OSError(f"cannot bind the cache gRPC port {address} (in use or not a local address?)")
        grace = asyncio.get_running_loop().create_future()
        self._grace = grace
        await server.start()
        listening.set_result(port)
        seconds = await grace
        await server.stop(seconds)

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _sweep_expired(self) -> None:
        while not self._stopping.wait(EXPIRY_SWEEP_INTERVAL_S):
            self.store.expire()

    def stop(self, grace: float = CACHE_STOP_GRACE_S) -> None:
        """Stop serving; in-flight calls get ``grace`` seconds (push streams end). Idempotent."""
        self._stopping.set()
        loop, thread, self._loop, self._loop_thread = self._loop, self._loop_thread, None, None
        if loop is not None and thread is not None:
            def finish() -> None:
                if not self._grace.done():
                    self._grace.set_result(grace)
            try:
                loop.call_soon_threadsafe(finish)
            except RuntimeError:
                pass  # the loop already ended
            thread.join(timeout=grace + 5.0)
        if self._http is not None:
            self._http.stop()
            self._http = None
        for t in self._threads:
            t.join(timeout=grace + 1.0)
        self._threads = []

    def banner(self) -> str:
        """The one start-up line parents parse (see the module docstring)."""
        metrics = self.metrics_url or "off"
        return f"acs-cache-server role={self.role} listening on {self.endpoint} metrics={metrics}"


# -- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``acs-cache-server`` argument parser: one flag per :class:`CacheServerOptions` option."""
    parser = argparse.ArgumentParser(
        prog="acs-cache-server",
        description="Run one replica of the pyspark_acs data or metadata cache (gRPC).",
    )
    add_option_flags(parser, CacheServerOptions)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``acs-cache-server``; returns the exit status (2 for bad flags)."""
    args = build_parser().parse_args(argv)  # exits 2 with a message naming the flag
    opts = options_from_flags(CacheServerOptions, args)
    configure_logging(opts.log_level)
    tune_malloc()  # large answers from the heap, not a fresh mmap each (server/malloc.py)
    token = opts.token
    if token is not None:
        print("acs-cache-server: warning: --token shows in ps to every user of this machine; "
              "use --token-file or $ACS_TOKEN_FILE", file=sys.stderr)
    try:
        security = resolve_security(token=token, token_file=opts.token_file, tls_cert=opts.tls_cert,
                                    tls_key=opts.tls_key, tls_ca=opts.tls_ca, mtls=opts.mtls)
        check_bind(opts.host, security, opts.insecure, what="acs-cache-server")
    except AcsOptionError as exc:
        print(f"acs-cache-server: error: {exc}", file=sys.stderr)
        return 2
    server = CacheServer(
        opts.role,
        host=opts.host,
        port=opts.port,
        capacity_bytes=opts.capacity,
        ttl_s=opts.ttl,
        metrics_port=None if opts.metrics_port == -1 else opts.metrics_port,
        security=security,
    )
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server.start()
        except OSError as exc:
            print(f"acs-cache-server: error: {exc}", file=sys.stderr)
            return 1
        print(server.banner(), flush=True)
        if opts.parent_pid is not None:
            watch_parent(opts.parent_pid, stop)
        while not stop.wait(0.5):  # a timed wait keeps the main thread responsive to signals
            pass
        print(f"acs-cache-server role={server.role} {server.endpoint} stopping", file=sys.stderr, flush=True)
        server.stop()
        print(f"acs-cache-server role={server.role} {server.endpoint} stopped", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
