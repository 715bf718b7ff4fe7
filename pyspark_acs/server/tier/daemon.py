"""``acs-tier-mover``: run :class:`~pyspark_acs.server.tier.mover.TierMover` passes forever.

    acs-tier-mover --root /data/acs [--stream orders ...] [--interval 10s] [--once]
                   [--log-level INFO]
                   [--host 127.0.0.1] [--metrics-port 0] [--token-file F] [--tls-cert C --tls-key K]

Once serving it prints one line on stdout (parents parse it)::

    acs-tier-mover root=/data/acs interval=10s metrics=http://127.0.0.1:PORT/metrics

``/metrics`` serves the ``acs_tier_*`` series (:data:`~pyspark_acs.server.metrics.TIER_METRICS`:
files and bytes tiered, upload and verify failures, retention deletions per tier, swept
objects, pass durations, and the tier lag per stream: sealed files and bytes not yet tiered);
``/healthz`` answers healthy while passes keep completing (details: last pass age and
duration, streams whose last pass failed, lag per stream). Security as every server
(docs/security.md): with a token (``--token-file``, ``$ACS_TOKEN_FILE``, ``$ACS_CACHE_TOKEN``)
both paths require it, with a certificate they are served over HTTPS, and a non-loopback
``--host`` needs both, or ``--insecure``.

Exit status: 0 after SIGTERM/SIGINT or a clean ``--once`` pass; 2 for a bad flag or root;
1 when a ``--once`` pass failed for some stream (logged on stderr, e.g. another mover holds
its tier lease, or its secondary store is unreachable), or the metrics port cannot be bound.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from pyspark_acs.errors import AcsError, AcsOptionError
from pyspark_acs.options import add_option_flags, options_from_flags
from pyspark_acs.security import SecuritySettings, check_bind, resolve_security
from pyspark_acs.server.lifetime import watch_parent
from pyspark_acs.server.metrics import MetricsEndpoint
from pyspark_acs.server.settings import DEFAULT_HOST, configure_logging
from pyspark_acs.server.tier.mover import PassReport, TierMover
from pyspark_acs.server.tier.options import DEFAULT_INTERVAL_S, TierMoverOptions

__all__ = [
    "main",
]

log = logging.getLogger(__name__)

#: ``/healthz`` turns unhealthy when no pass has ended for this many intervals ...
HEALTH_STALE_PASSES = 3
#: ... and at least this many seconds (a short interval must not flap on one slow pass).
HEALTH_STALE_MIN_S = 60.0


class TierMoverDaemon:
    """The mover's pass loop with its ``/metrics`` and ``/healthz`` endpoint.

    Parameters
    ----------
    mover : TierMover
        What each pass runs; its ``metrics`` registry is what ``/metrics`` serves.
    interval : float
        Seconds between the end of one pass and the start of the next.
    host : str
        Interface of the metrics endpoint.
    metrics_port : int
        Its port; 0 picks a free one, -1 serves none.
    security : SecuritySettings, optional
        Token and TLS of the endpoint (default: none).
    insecure : bool
        Allow a non-loopback ``host`` without a token and TLS.
    """

    def __init__(self, mover: TierMover, interval: float, *, host: str = DEFAULT_HOST, metrics_port: int = 0,
                 security: Optional[SecuritySettings] = None, insecure: bool = False) -> None:
        self.mover = mover
        self.interval = interval
        self.host = host
        self.metrics_port = metrics_port
        self.security = security or SecuritySettings()
        self.insecure = insecure
        self._http: Optional[MetricsEndpoint] = None
        self.stop_event = threading.Event()
        # _lock guards the pass state below (the pass loop writes it, /healthz reads it).
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._passes = 0
        self._pass_started: Optional[float] = None
        self._last_end: Optional[float] = None
        self._last_seconds = 0.0

    def start(self) -> "TierMoverDaemon":
        """Bind and serve the metrics endpoint (unless ``metrics_port`` is -1).

        Raises
        ------
        AcsOptionError
            A non-loopback host without a token and TLS (and not ``insecure``).
        OSError
            When the port cannot be bound (the message names it).
        """
        check_bind(self.host, self.security, self.insecure, what="acs-tier-mover")
        if self.metrics_port >= 0:
            self._http = MetricsEndpoint(self.mover.metrics.registry, self.healthz, self.host, self.metrics_port,
                                         name="acs-tier-metrics", security=self.security).start()
        return self

    @property
    def metrics_url(self) -> Optional[str]:
        """``http(s)://host:port/metrics`` once started, ``None`` when off."""
        return self._http.url if self._http is not None else None

    def banner(self, root: str) -> str:
        """The start-up line printed on stdout (parents parse it)."""
        return f"acs-tier-mover root={root} interval={self.interval:g}s metrics={self.metrics_url or 'off'}"

    def run_pass(self) -> PassReport:
        """One pass, with its state recorded for ``/healthz``."""
        with self._lock:
            self._pass_started = time.monotonic()
        try:
            return self.mover.run_once()
        finally:
            with self._lock:
                now = time.monotonic()
                self._last_seconds = now - (self._pass_started or now)
                self._pass_started = None
                self._last_end = now
                self._passes += 1

    def run(self) -> None:
        """Run passes until :attr:`stop_event` is set."""
        while not self.stop_event.is_set():
            report = self.run_pass()
            if report.uploaded_files or report.hot_deleted or report.swept_objects:
                log.info("pass: %s", vars(report))
            self.stop_event.wait(self.interval)

    def healthz(self) -> Tuple[bool, Mapping[str, Any]]:
        """``/healthz``: healthy while passes keep ending (within :data:`HEALTH_STALE_PASSES`
        intervals, at least :data:`HEALTH_STALE_MIN_S`) or one is under way; details name the
        streams whose last pass failed and the tier lag per stream."""
        stale_after = max(HEALTH_STALE_PASSES * self.interval, HEALTH_STALE_MIN_S)
        now = time.monotonic()
        with self._lock:
            running = None if self._pass_started is None else now - self._pass_started
            since = now - (self._last_end if self._last_end is not None else self._started)
            details: Dict[str, Any] = {
                "passes": self._passes,
                "last_pass_age_seconds": None if self._last_end is None else round(since, 3),
                "last_pass_seconds": round(self._last_seconds, 3),
                "pass_running_seconds": None if running is None else round(running, 3),
            }
        details["failed_streams"] = self.mover.last_failed  # stream -> error of its last pass
        details["lag"] = {s: {"files": f, "bytes": b} for s, (f, b) in self.mover.lag().items()}
        healthy = not self.stop_event.is_set() and (running is not None or since < stale_after)
        if not healthy and not self.stop_event.is_set():
            details["error"] = f"no tier pass ended for {since:.0f} s (more than {stale_after:g} s)"
        return healthy, details

    def stop(self) -> None:
        """Stop the loop and the endpoint, and give up the tier leases. Idempotent."""
        self.stop_event.set()
        if self._http is not None:
            self._http.stop()
            self._http = None
        self.mover.close()


#: What ``acs-tier-mover --help`` says before the flags (plain text: argparse prints it as is).
DESCRIPTION = (
    "Run tier mover passes forever: upload the sealed files of tiered streams (acs tier) to their "
    "secondary store, verify them, and apply the streams' retention. /metrics serves the acs_tier_* "
    "series, /healthz answers healthy while passes keep completing (docs/tiered.md). Exit status: 0 "
    "after SIGTERM/SIGINT or a clean --once pass; 2 for a bad flag or root; 1 when a --once pass failed "
    "for some stream or the metrics port cannot be bound."
)


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags of ``acs-tier-mover``: one per :class:`TierMoverOptions` option."""
    p = argparse.ArgumentParser(prog="acs-tier-mover", description=DESCRIPTION)
    add_option_flags(p, TierMoverOptions)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``acs-tier-mover``; returns the exit status."""
    args = build_parser().parse_args(argv)  # exits 2 with a message naming the flag
    opts = options_from_flags(TierMoverOptions, args)
    configure_logging(opts.log_level)
    try:
        mover = TierMover(
            opts.root, list(opts.streams) or None,
            batch_bytes=opts.batch_bytes,
            upload_bytes_per_second=opts.upload_rate,
            orphan_grace_s=opts.orphan_grace,
            lease_seconds=opts.lease,
        )
        daemon = TierMoverDaemon(
            mover, opts.interval, host=opts.host, metrics_port=opts.metrics_port, insecure=opts.insecure,
            security=resolve_security(token_file=opts.token_file, tls_cert=opts.tls_cert, tls_key=opts.tls_key),
        )
    except AcsOptionError as exc:
        print(f"acs-tier-mover: error: {exc}", file=sys.stderr)
        return 2
    if opts.once:
        try:
            report = mover.run_once()
        except AcsError as exc:
            print(f"acs-tier-mover: error: {exc}", file=sys.stderr)
            return 1
        finally:
            mover.close()
        print(f"acs-tier-mover: {vars(report)}", flush=True)
        return 1 if report.failed_streams else 0
    previous = {sig: signal.signal(sig, lambda s, f: daemon.stop_event.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            daemon.start()
        except AcsOptionError as exc:
            print(f"acs-tier-mover: error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"acs-tier-mover: error: {exc}", file=sys.stderr)
            return 1
        print(daemon.banner(opts.root), flush=True)
        if opts.parent_pid is not None:
            watch_parent(opts.parent_pid, daemon.stop_event)
        daemon.run()
        return 0
    finally:
        daemon.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
