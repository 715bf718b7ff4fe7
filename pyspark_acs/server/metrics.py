"""Metrics of every server process, on ``prometheus-client``: one declaration table, one HTTP endpoint.

Every metric a server exports is declared once here (:data:`CACHE_METRICS`, :data:`COPY_METRICS`,
:data:`TIER_METRICS`),
with its kind, help text and label names; nothing else spells a metric's type or help. Each server
object owns its own :class:`~prometheus_client.CollectorRegistry` (never the global one: tests run
several servers in one process, and two cache servers must not add up each other's counters).

Two ways to feed a registry:

- :class:`Metrics` -- push: counters, gauges and histograms updated as things happen (the copy
  daemon's operations, bytes and errors), by short name: ``metrics.inc("bytes_total", n, stream=...)``.
- :class:`StatsCollector` -- pull: a callable read at each scrape (the cache server's store stats,
  which the store keeps in its own counters under its own lock).

:class:`MetricsEndpoint` serves a registry over HTTP, on a background thread:

- ``GET /metrics``: the registry in the Prometheus text format 0.0.4 (OpenMetrics when the scraper
  asks for it in ``Accept``; gzip when it accepts it);
- ``GET /healthz``: a JSON object ``{"healthy": true|false, ...details}`` from the server's health
  callable, status 200 when healthy, 503 when not (or when the callable fails).

With a token in the server's :class:`~pyspark_acs.security.SecuritySettings` both paths require
``Authorization: Bearer <token>`` (401 without it; Prometheus sends it with
``authorization: {credentials_file: ...}``); with a certificate they are served over HTTPS.
Requests are served by at most :data:`METRICS_THREADS` threads, each connection with a
:data:`METRICS_REQUEST_TIMEOUT_S` socket timeout (a slow or idle client cannot pile up threads).

Counters export no ``_created`` series (:func:`prometheus_client.disable_created_metrics` is called
on import): nothing reads them, and they doubled every scrape.
"""

from __future__ import annotations

import gzip
import http.server
import json
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import prometheus_client

from pyspark_acs.security import SecuritySettings, token_matches
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, generate_latest, gzip_accepted
from prometheus_client.registry import Collector

__all__ = [
    "CACHE_CALL_METRICS",
    "CACHE_METRICS",
    "COPY_METRICS",
    "Metrics",
    "MetricsEndpoint",
    "StatsCollector",
    "TIER_METRICS",
]

log = logging.getLogger(__name__)

prometheus_client.disable_created_metrics()


@dataclass(frozen=True)
class MetricSpec:
    """One declared metric.

    Parameters
    ----------
    kind : {"counter", "gauge", "histogram"}
    help : str
        The ``# HELP`` text.
    labels : tuple of str
        Label names besides the registry's constant labels (e.g. ``cluster``), in this order.
    buckets : tuple of float, optional
        Upper bounds of a histogram's buckets.
    """

    kind: str
    help: str
    labels: Tuple[str, ...] = ()
    buckets: Optional[Tuple[float, ...]] = None


#: Delivery delays run from milliseconds (a hop on one machine) to minutes (a rate-capped
#: backlog); buckets cover both ends.
COPY_DELAY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

#: Cache-server metrics, ``acs_cache_<name>{role}``; read from the store at each scrape.
#: Names are the keys of :meth:`pyspark_acs.server.cache.store.Store.stats`, so the gRPC ``Stats``
#: call and ``/metrics`` agree (durations in seconds here: its ``default_ttl_ms`` is exported as
#: ``default_ttl_seconds``), plus the server's ``uptime_seconds``.
CACHE_METRICS: Dict[str, MetricSpec] = {
    "entries": MetricSpec("gauge", "Entries held (expired ones not yet swept included)."),
    "used_bytes": MetricSpec("gauge", "Charged bytes held: key + value + per-entry overhead."),
    "capacity_bytes": MetricSpec("gauge", "Configured capacity in charged bytes."),
    "gc_start_bytes": MetricSpec("gauge", "GC starts above this many charged bytes."),
    "gc_low_bytes": MetricSpec("gauge", "GC evicts down to this many charged bytes."),
    "max_entry_bytes": MetricSpec("gauge", "Largest charged size one entry may have."),
    "entry_overhead_bytes": MetricSpec("gauge", "Bytes charged per entry on top of key and value."),
    "default_ttl_seconds": MetricSpec("gauge", "TTL of puts that carry none, in seconds."),
    "ttl_groups": MetricSpec("gauge", "Distinct TTLs in use."),
    "rss_bytes": MetricSpec("gauge", "Resident set size of the server process."),
    "uptime_seconds": MetricSpec("gauge", "Seconds since the server started."),
    "gets_total": MetricSpec("counter", "Keys asked for by Get calls."),
    "hits_total": MetricSpec("counter", "Keys Get found."),
    "misses_total": MetricSpec("counter", "Keys Get did not find (absent or expired)."),
    "read_bytes_total": MetricSpec("counter", "Value bytes answered by Get."),
    "puts_total": MetricSpec("counter", "Keys offered by Put calls."),
    "stored_total": MetricSpec("counter", "Keys Put stored."),
    "stale_total": MetricSpec("counter", "Keys Put refused because a newer version is held."),
    "too_large_total": MetricSpec("counter", "Keys Put refused because the entry can never fit."),
    "written_bytes_total": MetricSpec("counter", "Value bytes stored by Put and CompareAndSet."),
    "cas_total": MetricSpec("counter", "CompareAndSet calls."),
    "cas_swapped_total": MetricSpec("counter", "CompareAndSet calls that swapped."),
    "deletes_total": MetricSpec("counter", "Keys asked to be deleted."),
    "deleted_total": MetricSpec("counter", "Keys deleted that were present."),
    "expired_total": MetricSpec("counter", "Entries dropped when their TTL ran out."),
    "evicted_total": MetricSpec("counter", "Entries evicted by GC to make room."),
    "gc_runs_total": MetricSpec("counter", "GC runs."),
    "watch_streams": MetricSpec("gauge", "Watch push streams open now (metadata readers)."),
    "follow_streams": MetricSpec("gauge", "Follow push streams open now (data readers)."),
    "put_streams": MetricSpec("gauge", "PutStream calls open now (writers: one per client process)."),
    "pushed_messages_total": MetricSpec("counter", "Messages sent on push streams."),
    "pushed_bytes_total": MetricSpec("counter", "File bytes sent on Follow streams."),
    "push_kept_bytes": MetricSpec("gauge", "Bytes of Follow messages kept to be sent again to streams at "
                                           "the same cursor (at most SENT_KEPT_BYTES)."),
    "pushed_shared_total": MetricSpec("counter", "Follow messages sent again as built for another stream "
                                                 "at the same cursor (no store read, no encode)."),
    "follow_latest_total": MetricSpec("counter", "Files a Follow stream took at latest, from the boundary a "
                                                 "writer marked here."),
    "follow_latest_unknown_total": MetricSpec("counter", "Files a Follow stream asked for at latest that had no "
                                                         "boundary here (the reader joined by lengths)."),
}

#: A cache call takes microseconds when the server is idle and tens of milliseconds when its
#: loop is backed up; the buckets cover both (the client's deadline is 0.5 s).
CACHE_LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                         0.25, 0.5, 1.0)

#: Cache-server metrics updated per call, ``acs_cache_<name>{role, method}``.
CACHE_CALL_METRICS: Dict[str, MetricSpec] = {
    "request_seconds": MetricSpec(
        "histogram", "Seconds the server spent handling one request, by method (Get: reads; Put, "
        "CompareAndSet, Delete: writes; a put on a PutStream counts as a Put).", ("method",), CACHE_LATENCY_BUCKETS),
}

#: Copy-daemon metrics, ``acs_copy_<name>{cluster, ...}`` (``cluster`` is the daemon's own).
COPY_METRICS: Dict[str, MetricSpec] = {
    "bytes_total": MetricSpec(
        "counter", "Bytes written into the target cluster, per hop and storage.",
        ("stream", "source", "target", "storage")),
    "operations": MetricSpec("gauge", "Copy operations running now.", ("role", "storage")),
    "operations_finished_total": MetricSpec(
        "counter", "Copy operations that copied a whole sealed file.", ("storage",)),
    "lag_bytes": MetricSpec(
        "gauge", "Bytes the target is behind the source file (reader side).",
        ("stream", "shard", "target", "storage")),
    "delay_seconds": MetricSpec(
        "gauge", "Producer-to-this-cluster delivery delay of the newest bytes written here.",
        ("stream", "shard", "storage")),
    "delivery_delay_seconds": MetricSpec(
        "histogram", "Producer-to-this-cluster delivery delay of each delta written here.",
        ("storage",), COPY_DELAY_BUCKETS),
    "errors_total": MetricSpec("counter", "Errors by kind (restart, poisoned, connect, ...).", ("kind",)),
    "source_read_bytes_total": MetricSpec(
        "counter", "Bytes this daemon's operations read from its own cluster, by way: pushed (the data "
        "cache pushed them, no request), asked (chunk reads of the data cache), durable (the store).",
        ("way",)),
    "store_holds_total": MetricSpec(
        "counter", "Times the caches failed this daemon's reads of its own cluster (a failed data-cache read, "
        "a cache trailing the store past maxDelay, an unreadable metadata cache) and it read from the store "
        "alone for a hold."),
    "tree_rebuilds_total": MetricSpec("counter", "Copy-tree rebuilds after health or topology changes."),
    "quarantined_bytes": MetricSpec(
        "gauge", "Bytes of this cluster's files past a promotion's cut, moved aside into the shard's "
        "_quarantine folder when this cluster took the new history (docs/copy.md, \"Quarantine\").",
        ("stream", "shard")),
    "files_surveyed_total": MetricSpec(
        "counter", "Files a child reported holding when this daemon started feeding it (Files RPC), "
        "by state: complete (sealed there, no operation needed) or present (exists, copy goes on).", ("state",)),
}

#: A tier pass takes milliseconds when nothing is sealed and minutes when it uploads a backlog.
TIER_PASS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

#: Tier-mover metrics, ``acs_tier_<name>{...}`` (:mod:`pyspark_acs.server.tier`).
TIER_METRICS: Dict[str, MetricSpec] = {
    "files_tiered_total": MetricSpec(
        "counter", "Files uploaded, verified and recorded in the secondary store.", ("stream",)),
    "bytes_tiered_total": MetricSpec(
        "counter", "Bytes of the files uploaded, verified and recorded in the secondary store.", ("stream",)),
    "objects_total": MetricSpec("counter", "Objects (batches of files) recorded in the secondary store.", ("stream",)),
    "upload_failures_total": MetricSpec(
        "counter", "Uploads that failed, whether or not their bytes landed (ambiguous): each was abandoned and "
        "the batch uploaded again under a new object name (non-stop-write).", ("stream",)),
    "verify_failures_total": MetricSpec(
        "counter", "Uploaded objects whose read-back (size, crc32, block checksums) differed from the hot files: "
        "abandoned, the batch uploaded again under a new object name.", ("stream",)),
    "retention_deleted_total": MetricSpec(
        "counter", "Files deleted by retention, per tier (hot: a verified file's hot copy; secondary: a file "
        "past the secondary retention, from both tiers).", ("stream", "tier")),
    "swept_objects_total": MetricSpec(
        "counter", "Objects no tier record names (abandoned uploads) deleted after the grace period.", ("stream",)),
    "failed_passes_total": MetricSpec(
        "counter", "Passes over a stream that failed (retried next pass): another mover holds its tier lease, "
        "a store is unreachable, ...", ("stream",)),
    "lag_files": MetricSpec(
        "gauge", "Sealed files not yet tiered (waiting for upload), per stream.", ("stream",)),
    "lag_bytes": MetricSpec(
        "gauge", "Bytes of the sealed files not yet tiered, per stream.", ("stream",)),
    "waiting_unsealed": MetricSpec(
        "gauge", "Shards whose oldest untiered file is not sealed yet (it and every later file wait).", ("stream",)),
    "pass_seconds": MetricSpec(
        "histogram", "Seconds one pass over every served stream took.", (), TIER_PASS_BUCKETS),
    "last_pass_timestamp_seconds": MetricSpec(
        "gauge", "When the last pass ended (seconds since the epoch)."),
}

_TYPES = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}

#: ``{(short name, ((label, value), ...)): value}``, labels sorted, constant labels left out.
Snapshot = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


class Metrics:
    """Push metrics of one server object, in its own registry.

    Parameters
    ----------
    prefix : str
        Prepended to every short name (``"acs_copy_"``).
    specs : mapping of str to MetricSpec
        The declarations (e.g. :data:`COPY_METRICS`); every one is created up front, so a scrape
        shows each metric's ``# HELP``/``# TYPE`` even before its first sample.
    const_labels : mapping of str to str, optional
        Labels every series carries (e.g. ``{"cluster": "B"}``).
    registry : CollectorRegistry, optional
        Defaults to a new one (never the process-global registry), which also gets the standard
        ``process_*`` metrics (resident memory, CPU seconds, open files, start time).

    Notes
    -----
    Thread-safe: ``prometheus_client`` guards each metric's children and values with its own locks.
    """

    def __init__(self, prefix: str, specs: Mapping[str, MetricSpec],
                 const_labels: Optional[Mapping[str, str]] = None,
                 registry: Optional[CollectorRegistry] = None) -> None:
        self.prefix = prefix
        self.specs = dict(specs)
        self.const_labels = {k: str(v) for k, v in (const_labels or {}).items()}
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
        self.registry = registry
        const_names = tuple(self.const_labels)
        self._metrics: Dict[str, object] = {}
        for name, spec in self.specs.items():
            kwargs = {"buckets": spec.buckets} if spec.buckets is not None else {}
            self._metrics[name] = _TYPES[spec.kind](
                prefix + name, spec.help, const_names + spec.labels, registry=self.registry, **kwargs)

    def _child(self, name: str, labels: Mapping[str, object], kinds: Sequence[str]):
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"metric {self.prefix}{name} is not declared; declare it in pyspark_acs/server/metrics.py")
        if spec.kind not in kinds:
            raise TypeError(f"metric {self.prefix}{name} is a {spec.kind}; this call needs a {' or '.join(kinds)}")
        values = dict(self.const_labels)
        for key, value in labels.items():
            value = str(value)
            if key in self.const_labels:
                if value != self.const_labels[key]:
                    raise ValueError(f"metric {self.prefix}{name}: label {key}={value!r} contradicts this "
                                     f"registry's constant {key}={self.const_labels[key]!r}")
                continue
            values[key] = value
        if len(values) != len(self.const_labels) + len(spec.labels) or any(k not in values for k in spec.labels):
            raise ValueError(f"metric {self.prefix}{name} takes the labels {', '.join(spec.labels) or '(none)'}; "
                             f"got {', '.join(sorted(labels)) or '(none)'}")
        metric = self._metrics[name]
        return metric.labels(**values) if values else metric

    def series(self, name: str, **labels: object):
        """The ``prometheus_client`` child of ``name{labels}``, for hot paths that update one series
        many times (look it up once, then ``.observe``/``.inc`` it). Checked as :meth:`inc` is."""
        spec = self.specs.get(name)
        kinds = (spec.kind,) if spec is not None else ("counter",)
        return self._child(name, labels, kinds)

    def register(self, collector: Collector) -> None:
        """Export ``collector`` (e.g. a :class:`StatsCollector`) from this registry too."""
        self.registry.register(collector)

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        """Add ``amount`` to the series ``name{labels}`` (a gauge may go down: negative ``amount``).

        Label values are compared as strings; their order does not matter.

        Raises
        ------
        KeyError
            For a name not declared in the table.
        ValueError
            For labels other than the declared ones, or a negative amount on a counter.
        """
        self._child(name, labels, ("counter", "gauge")).inc(amount)

    def set(self, name: str, value: float, **labels: object) -> None:
        """Set the gauge ``name{labels}`` to ``value``."""
        self._child(name, labels, ("gauge",)).set(value)

    def observe(self, name: str, value: float, **labels: object) -> None:
        """Record ``value`` in the histogram ``name{labels}``."""
        self._child(name, labels, ("histogram",)).observe(value)

    def remove(self, name: str, **labels: object) -> None:
        """Drop the series ``name{labels}``, so it is no longer exported (missing is fine)."""
        self._child(name, labels, ("counter", "gauge", "histogram"))  # validates the labels
        spec = self.specs[name]
        values = [self.const_labels[k] for k in self.const_labels] + [str(labels[k]) for k in spec.labels]
        if not values:
            return
        try:
            self._metrics[name].remove(*values)
        except KeyError:
            pass

    def _samples(self, names: Iterable[str]) -> Iterator[Tuple[str, Dict[str, str], float]]:
        for name in names:
            for family in self._metrics[name].collect():
                for sample in family.samples:
                    labels = {k: v for k, v in sample.labels.items() if k not in self.const_labels}
                    yield sample.name[len(self.prefix):], labels, sample.value

    def get(self, name: str, **labels: object) -> float:
        """The value of the series ``name{labels}`` (0 if it does not exist); a histogram's count."""
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"metric {self.prefix}{name} is not declared; declare it in pyspark_acs/server/metrics.py")
        want = {k: str(v) for k, v in labels.items() if k not in self.const_labels}
        sample_name = name + "_count" if spec.kind == "histogram" else name
        for short, got, value in self._samples([name]):
            if short == sample_name and got == want:
                return value
        return 0

    def snapshot(self) -> Snapshot:
        """Every series now: ``{(short name, sorted (label, value) pairs): value}``, constant labels left out.

        A histogram contributes its ``_bucket`` (with ``le``), ``_count`` and ``_sum`` series.
        """
        return {(short, tuple(sorted(labels.items()))): value for short, labels, value in self._samples(self.specs)}

    def render(self) -> str:
        """The registry in the Prometheus text format 0.0.4 (what ``/metrics`` serves by default)."""
        return generate_latest(self.registry).decode()


class StatsCollector(Collector):
    """Pull metrics: ``values()`` is called at each scrape and its entries exported by the table.

    Parameters
    ----------
    prefix : str
        Prepended to every name (``"acs_cache_"``).
    specs : mapping of str to MetricSpec
        Declarations of the names ``values()`` returns (counters and gauges; no labels of their own).
    values : callable
        ``values() -> {name: number}``. A name missing from ``specs`` is still exported (a counter if
        it ends in ``_total``, else a gauge) so a new stat is never silently dropped.
    const_labels : mapping of str to str, optional
        Labels of every series (e.g. ``{"role": "data"}``).
    registry : CollectorRegistry, optional
        Registers itself there when given.
    """

    def __init__(self, prefix: str, specs: Mapping[str, MetricSpec], values: Callable[[], Mapping[str, float]],
                 const_labels: Optional[Mapping[str, str]] = None,
                 registry: Optional[CollectorRegistry] = None) -> None:
        self.prefix = prefix
        self.specs = dict(specs)
        self.values = values
        self.const_labels = {k: str(v) for k, v in (const_labels or {}).items()}
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterator[Metric]:
        """One metric family per value, ``# HELP`` and ``# TYPE`` from the table (registry API)."""
        names = list(self.const_labels)
        label_values = [self.const_labels[k] for k in names]
        for name, value in sorted(self.values().items()):
            spec = self.specs.get(name) or MetricSpec(
                "counter" if name.endswith("_total") else "gauge", name.replace("_", " "))
            family_type = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = family_type(self.prefix + name, spec.help, labels=names)
            family.add_metric(label_values, value)
            yield family


#: ``() -> (healthy, details)``: what ``/healthz`` answers; ``details`` go into the JSON body.
HealthCheck = Callable[[], Tuple[bool, Mapping[str, object]]]


#: Threads serving ``/metrics`` and ``/healthz`` at once (connections beyond them wait in the
#: listen backlog, bounded by the kernel).
METRICS_THREADS = 4
#: Socket timeout of one metrics connection (seconds): an idle client is dropped after it.
METRICS_REQUEST_TIMEOUT_S = 3.0
#: Connections accepted and not yet served beyond which new ones are closed at once.
METRICS_MAX_PENDING = 64


class _HTTPServer(http.server.HTTPServer):
    """An HTTP server whose requests run on a fixed pool of :data:`METRICS_THREADS` threads."""

    def __init__(self, *args, **kwargs) -> None:
        # Before binding: a failed bind calls server_close.
        self._pool = ThreadPoolExecutor(max_workers=METRICS_THREADS, thread_name_prefix="acs-metrics-req")
        self.ssl_context = None
        self.request_timeout = METRICS_REQUEST_TIMEOUT_S
        # _pending_lock guards _pending (connections submitted to the pool and not finished).
        self._pending_lock = threading.Lock()
        self._pending = 0
        super().__init__(*args, **kwargs)

    def get_request(self):
        sock, addr = super().get_request()
        sock.settimeout(self.request_timeout)
        if self.ssl_context is not None:
            # The handshake runs on the pool thread (do_handshake_on_connect=False), never here.
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def process_request(self, request, client_address) -> None:
        with self._pending_lock:
            full = self._pending >= METRICS_MAX_PENDING
            if not full:
                self._pending += 1
        if full:  # shed load: a flood of connections must not queue without bound
            self.shutdown_request(request)
            return
        self._pool.submit(self._work, request, client_address)

    def _work(self, request, client_address) -> None:
        try:
            if hasattr(request, "do_handshake"):
                request.do_handshake()
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._pending_lock:
                self._pending -= 1

    def handle_error(self, request, client_address) -> None:  # a broken client is no server error
        log.debug("metrics request from %s failed", client_address, exc_info=True)

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class MetricsEndpoint:
    """``/metrics`` and ``/healthz`` of one server over HTTP, on a background thread.

    The socket is bound at construction (see :attr:`port`); :meth:`start` serves it.

    Parameters
    ----------
    registry : CollectorRegistry
        What ``/metrics`` exports.
    health : callable
        ``health() -> (healthy, details)`` for ``/healthz``; details must be JSON-serialisable.
    host : str
        Interface to bind; an IPv6 literal (with or without brackets) binds IPv6.
    port : int
        0 picks a free port.
    name : str
        What the server is, for error messages and the thread's name (e.g. ``"acs-cache-metrics"``).
    security : SecuritySettings, optional
        With a token, both paths require it; with a certificate, HTTPS.
    request_timeout : float
        Socket timeout of one connection (seconds, default :data:`METRICS_REQUEST_TIMEOUT_S`):
        an idle client is dropped after it.

    Raises
    ------
    OSError
        When the port cannot be bound; the message names host and port.
    """

    def __init__(self, registry: CollectorRegistry, health: HealthCheck, host: str, port: int,
                 name: str = "acs-metrics", security: Optional["SecuritySettings"] = None,
                 request_timeout: float = METRICS_REQUEST_TIMEOUT_S) -> None:
        self.registry = registry
        self.request_timeout = request_timeout
        self.token = security.token if security is not None else None
        self.health = health
        self.name = name
        bare = host.strip("[]")
        server_class = _HTTPServer6 if ":" in bare else _HTTPServer
        try:
            self._http = server_class((bare, port), _handler(self))
        except OSError as exc:
            where = f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"
            raise OSError(f"cannot bind the metrics port {where} ({name}): {exc}") from exc
        self._http.ssl_context = security.ssl_context() if security is not None else None
        self._http.request_timeout = request_timeout
        self.host = bare
        self.port: int = self._http.server_address[1]
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        """``http://host:port/metrics`` (``https`` with TLS)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self._http.ssl_context is not None else "http"
        return f"{scheme}://{host}:{self.port}/metrics"

    def start(self) -> "MetricsEndpoint":
        """Serve on a daemon thread; returns self."""
        # A short poll interval keeps stop() (on SIGTERM) quick.
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._http.server_close()

    # -- request handling (on the server's per-request threads) --------------------------------

    def metrics_body(self, accept: str = "", accept_encoding: str = "") -> Tuple[bytes, List[Tuple[str, str]]]:
        """The ``/metrics`` body and its headers for a request's ``Accept`` and ``Accept-Encoding``."""
        encoder, content_type = choose_encoder(accept)
        body = encoder(self.registry)
        headers = [("Content-Type", content_type)]
        if gzip_accepted(accept_encoding):
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        return body, headers

    def health_body(self) -> Tuple[int, bytes]:
        """The ``/healthz`` status and JSON body; a failing health callable is reported as unhealthy."""
        try:
            healthy, details = self.health()
            doc = {"healthy": bool(healthy), **dict(details)}
        except Exception as exc:  # the endpoint must answer; the failure is the answer
            healthy, doc = False, {"healthy": False, "error": f"{type(exc).__name__}: {exc}"}
        return (200 if healthy else 503), (json.dumps(doc, sort_keys=True, default=str) + "\n").encode()


def _handler(endpoint: MetricsEndpoint) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = endpoint.request_timeout

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            path = self.path.split("?", 1)[0]
            if endpoint.token and not token_matches(self.headers.get("Authorization"), endpoint.token):
                status, body = 401, b"missing or wrong token (send 'Authorization: Bearer TOKEN')\n"
                headers = [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", "Bearer")]
            elif path == "/metrics":
                try:
                    body, headers = endpoint.metrics_body(self.headers.get("Accept", ""),
                                                          self.headers.get("Accept-Encoding", ""))
                    status = 200
                except Exception as exc:  # a failing collector: say so instead of dropping the connection
                    log.warning("%s: /metrics failed: %s", endpoint.name, exc, exc_info=True)
                    status, body = 500, f"metrics failed: {type(exc).__name__}: {exc}\n".encode()
                    headers = [("Content-Type", "text/plain; charset=utf-8")]
            elif path == "/healthz":
                status, body = endpoint.health_body()
                headers = [("Content-Type", "application/json")]
            else:
                status, body = 404, b"not found; try /metrics or /healthz\n"
                headers = [("Content-Type", "text/plain; charset=utf-8")]
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - scrapes every few seconds
            return

    return Handler
