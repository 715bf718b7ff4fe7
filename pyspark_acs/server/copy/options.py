"""Settings of the copy daemon: one frozen options dataclass, parsed from ``name=value`` strings.

Every setting has a named default with its unit. ``acs-copy-daemon`` takes the common ones
as flags (``--workers``, ``--replica``) and any of them as ``--set name=value``; unknown
names are refused with the list of valid ones (:func:`pyspark_acs.options.parse_options`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

from pyspark_acs.errors import AcsOptionError
from pyspark_acs.options import bytes_parser, duration_parser, option, parse_int, parse_str
from pyspark_acs.server.settings import host_option, metrics_port_option

__all__ = [
    "CopyDaemonOptions",
]

#: Concurrently running operations per daemon (threads; each tails one file to one storage
#: of one child).
DEFAULT_WORKERS = 64
#: How often a copy reader polls the source lengths (paper: 50 ms for copy readers; a
#: consumer's is :data:`~pyspark_acs.cache.poller.DEFAULT_POLL_INTERVAL_S`).
COPY_POLL_INTERVAL_S = 0.05
#: How often the daemon sends the confirmations it sent lately again (server/copy/confirm.py).
DEFAULT_CONFIRM_RESEND_S = 30.0
#: How often the scheduler lists the durable store for files the head keys did not name.
DEFAULT_LISTING_INTERVAL_S = 1.0
#: How often the daemon probes other clusters' daemons and caches.
DEFAULT_HEALTH_INTERVAL_S = 1.0
#: A cluster failing every probe for this long is unhealthy (pushed to a leaf of the tree).
DEFAULT_UNHEALTHY_AFTER_S = 3.0
#: An operation this many bytes behind copies durable only and starts its cache copy near
#: the head (catch-up mode, so a backlog does not flood the caches).
DEFAULT_CATCHUP_BYTES = 8 * 1024 * 1024
#: Chunk TTL of the data cache: cache bytes older than this are useless to copy.
DEFAULT_CHUNK_TTL_S = 60.0
#: Largest delta per message (whole blocks; a single larger block is sent whole).
DEFAULT_MAX_DELTA_BYTES = 4 * 1024 * 1024
#: Cache deltas in flight (sent, not yet acknowledged) per cache operation.
DEFAULT_CACHE_WINDOW = 16
#: The copy writer's lease per (file, storage), shorter than the store's writer lease
#: (:data:`~pyspark_acs.storage.leases.WRITER_LEASE_S`): a dead copy writer is superseded within ~1 s.
COPY_FILE_LEASE_S = 3.0
#: Back-off of an operation after an error before it reconnects.
DEFAULT_RETRY_S = 0.5
#: An operation that has copied everything of an unsealed file that has not grown for this
#: long is idle: when other operations wait for a worker slot it gives its slot up (it is
#: parked) and is started again when the file's length moves (a seal moves it too).
DEFAULT_PARK_AFTER_S = 1.0


def parse_replica(value: Any, name: str = "replica") -> Tuple[int, int]:
    """Parse ``"i/n"`` (replica ``i`` of ``n``, ``0 <= i < n``) into ``(i, n)``."""
    if isinstance(value, tuple):
        i, n = value
    else:
        text = str(value).strip()
        left, sep, right = text.partition("/")
        try:
            i, n = int(left), int(right)
        except ValueError:
            raise AcsOptionError(f"{name}: {value!r} is not i/n (e.g. 0/2)", option=name) from None
        if not sep:
            raise AcsOptionError(f"{name}: {value!r} is not i/n (e.g. 0/2)", option=name)
    if n < 1 or not 0 <= i < n:
        raise AcsOptionError(f"{name}: {value!r} needs n >= 1 and 0 <= i < n", option=name)
    return (i, n)


def _rate(value: Any, name: str) -> int:
    """Bytes per second; 0 means no cap."""
    return bytes_parser(0)(value, name)


@dataclass(frozen=True)
class CopyDaemonOptions:
    """Validated copy-daemon settings (names as given to ``--set name=value``)."""

    host: str = host_option("interface to bind (gRPC and metrics)")
    workers: int = option("workers", DEFAULT_WORKERS, parse=parse_int(1, 4096), metavar="N",
                          doc="concurrent operations")
    replica: Tuple[int, int] = option(
        "replica", (0, 1), parse=parse_replica, metavar="I/N", doc="i/n: this replica owns hash range i of n of the operations"
    )
    poll_interval: float = option(
        "poll_interval", COPY_POLL_INTERVAL_S, parse=duration_parser(0.001), doc="source length polling interval"
    )
    listing_interval: float = option(
        "listing_interval", DEFAULT_LISTING_INTERVAL_S, parse=duration_parser(0.01),
        doc="durable listing interval for file discovery",
    )
    health_interval: float = option(
        "health_interval", DEFAULT_HEALTH_INTERVAL_S, parse=duration_parser(0.01), doc="health probe interval"
    )
    unhealthy_after: float = option(
        "unhealthy_after", DEFAULT_UNHEALTHY_AFTER_S, parse=duration_parser(0.01),
        doc="failing probes for this long make a cluster unhealthy",
    )
    max_bytes_per_second: int = option(
        "max_bytes_per_second", 0, parse=_rate, doc="rate cap per operation in bytes/s (0 = none)"
    )
    catchup_bytes: int = option(
        "catchup_bytes", DEFAULT_CATCHUP_BYTES, parse=bytes_parser(1),
        doc="an operation further behind copies durable only; its cache copy starts near the head",
    )
    chunk_ttl: float = option(
        "chunk_ttl", DEFAULT_CHUNK_TTL_S, parse=duration_parser(0.001, unit_required=True),
        doc="data cache chunk TTL (with its unit, e.g. 60s)"
    )
    max_delta_bytes: int = option(
        "max_delta_bytes", DEFAULT_MAX_DELTA_BYTES, parse=bytes_parser(4096), doc="largest delta per message"
    )
    cache_window: int = option(
        "cache_window", DEFAULT_CACHE_WINDOW, parse=parse_int(1, 1024), doc="unacknowledged cache deltas in flight"
    )
    lease_seconds: float = option(
        "lease_seconds", COPY_FILE_LEASE_S, parse=duration_parser(0.1), doc="writer lease duration"
    )
    retry: float = option("retry", DEFAULT_RETRY_S, parse=duration_parser(0.001), doc="back-off after an error")
    park_after: float = option(
        "park_after", DEFAULT_PARK_AFTER_S, parse=duration_parser(0.01),
        doc="an idle operation (caught up, file unsealed and not growing) this long yields its slot to waiting ones",
    )
    confirm_resend: float = option(
        "confirm_resend", DEFAULT_CONFIRM_RESEND_S, parse=duration_parser(0.1),
        doc="every confirmation sent lately (acknowledge=clusters:K) is sent again this often: a restarted source "
            "metadata cache learns them again",
    )
    metrics_port: int = metrics_port_option()
    port: int = option(
        "port", -1, parse=parse_int(-1, 65535), metavar="PORT",
        doc="gRPC port to listen on instead of the topology's (-1: the topology's); for a second replica of "
            "the cluster's daemon on the same host -- two daemons never share a port",
    )
