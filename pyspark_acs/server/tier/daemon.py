"""``acs-tier-mover``: run :class:`~pyspark_acs.server.tier.mover.TierMover` passes forever.

    acs-tier-mover --root /data/acs [--stream orders ...] [--interval 10s] [--once]

Exit status: 0 after SIGTERM/SIGINT or a clean ``--once`` pass; 2 for a bad flag or root;
1 when a ``--once`` pass failed for some stream (logged on stderr, e.g. another mover holds
its tier lease, or its secondary store is unreachable).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Optional, Sequence

from pyspark_acs.errors import AcsError, AcsOptionError
from pyspark_acs.server.lifetime import parent_pid_flag, watch_parent
from pyspark_acs.server.tier.mover import DEFAULT_BATCH_BYTES, DEFAULT_ORPHAN_GRACE_S, DEFAULT_TIER_LEASE_S, TierMover
from pyspark_acs.units import parse_bytes, parse_duration

__all__ = ["DEFAULT_INTERVAL_S", "build_parser", "main"]

log = logging.getLogger(__name__)

#: Seconds between passes.
DEFAULT_INTERVAL_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags of ``acs-tier-mover``."""
    p = argparse.ArgumentParser(prog="acs-tier-mover", description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="hot durable store root (URI or path)")
    p.add_argument("--stream", action="append", default=None, help="serve only this stream (repeatable; "
                   "default every stream with a tier configured)")
    p.add_argument("--interval", default=str(DEFAULT_INTERVAL_S), help="time between passes (default 10s)")
    p.add_argument("--batch-bytes", default=str(DEFAULT_BATCH_BYTES),
                   help="pack sealed files per object up to this (64MiB)")
    p.add_argument("--upload-rate", default=None, help="upload bytes per second cap (default none)")
    p.add_argument("--orphan-grace", default=str(DEFAULT_ORPHAN_GRACE_S),
                   help="delete unrecorded objects older than this (default 3600s)")
    p.add_argument("--lease", default=str(DEFAULT_TIER_LEASE_S),
                   help="tier lease per stream; a dead mover holds it this long (default 30s)")
    p.add_argument("--once", action="store_true", help="run one pass and exit")
    p.add_argument("--parent-pid", type=parent_pid_flag, default=None,
                   help="stop when this process exits (spark-submit launchers pass their JVM)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``acs-tier-mover``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        interval = parse_duration(args.interval, option="--interval", minimum=0.01)
        mover = TierMover(
            args.root, args.stream,
            batch_bytes=parse_bytes(args.batch_bytes, option="--batch-bytes", minimum=1),
            upload_bytes_per_second=(parse_bytes(args.upload_rate, option="--upload-rate", minimum=1)
                                     if args.upload_rate else None),
            orphan_grace_s=parse_duration(args.orphan_grace, option="--orphan-grace"),
            lease_seconds=parse_duration(args.lease, option="--lease", minimum=0.1),
        )
    except AcsOptionError as exc:
        print(f"acs-tier-mover: error: {exc}", file=sys.stderr)
        return 2
    if args.once:
        try:
            report = mover.run_once()
        except AcsError as exc:
            print(f"acs-tier-mover: error: {exc}", file=sys.stderr)
            return 1
        finally:
            mover.close()
        print(f"acs-tier-mover: {vars(report)}", flush=True)
        return 1 if report.failed_streams else 0
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda s, f: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        print(f"acs-tier-mover root={args.root} interval={interval:g}s", flush=True)
        if args.parent_pid is not None:
            watch_parent(args.parent_pid, stop)
        while not stop.is_set():
            report = mover.run_once()
            if report.uploaded_files or report.hot_deleted or report.swept_objects:
                log.info("pass: %s", vars(report))
            stop.wait(interval)
        return 0
    finally:
        mover.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
