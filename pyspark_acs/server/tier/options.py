"""Settings of ``acs-tier-mover``: one frozen options dataclass; its flags are generated.

:func:`pyspark_acs.server.tier.daemon.build_parser` makes one ``--flag`` per option
(:func:`pyspark_acs.options.add_option_flags`), with the help text and default declared here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from pyspark_acs.format.names import validate_stream
from pyspark_acs.errors import AcsOptionError
from pyspark_acs.options import bytes_parser, duration_parser, option, parse_bool, parse_str
from pyspark_acs.server.settings import (host_option, insecure_option, log_level_option, metrics_port_option,
                                         parent_pid_option)
from pyspark_acs.server.tier.mover import DEFAULT_BATCH_BYTES, DEFAULT_ORPHAN_GRACE_S, DEFAULT_TIER_LEASE_S

__all__ = [
    "DEFAULT_INTERVAL_S",
    "TierMoverOptions",
]

#: Seconds between passes.
DEFAULT_INTERVAL_S = 10.0


def _stream(value: object, name: str) -> str:
    try:
        return validate_stream(str(value).strip())
    except ValueError as exc:
        raise AcsOptionError(f"{name}: {exc}", option=name) from None


@dataclass(frozen=True)
class TierMoverOptions:
    """Validated ``acs-tier-mover`` settings (flag ``--name-in-kebab-case`` per option)."""

    root: str = option("root", parse=parse_str, required=True, doc="hot durable store root (URI or path)")
    streams: Tuple[str, ...] = option(
        "stream", (), parse=_stream, many=True, metavar="STREAM", shown="every stream with a tier configured",
        doc="serve only this stream (repeatable)",
    )
    interval: float = option("interval", DEFAULT_INTERVAL_S, parse=duration_parser(0.01),
                             doc="time between passes")
    batch_bytes: int = option("batch_bytes", DEFAULT_BATCH_BYTES, parse=bytes_parser(1),
                              doc="pack sealed files per object up to this size")
    upload_rate: Optional[int] = option("upload_rate", None, parse=bytes_parser(1), shown="no cap",
                                        doc="upload bytes per second cap")
    orphan_grace: float = option("orphan_grace", DEFAULT_ORPHAN_GRACE_S, parse=duration_parser(0.0),
                                 doc="delete unrecorded objects older than this")
    lease: float = option("lease", DEFAULT_TIER_LEASE_S, parse=duration_parser(0.1),
                          doc="tier lease per stream; a dead mover holds it this long")
    once: bool = option("once", False, parse=parse_bool, doc="run one pass and exit (no metrics endpoint)")
    host: str = host_option("interface of /metrics and /healthz")
    metrics_port: int = metrics_port_option()
    token_file: Optional[str] = option(
        "token_file", None, parse=parse_str, metavar="FILE",
        doc="file holding the token scrapers must send as 'Authorization: Bearer TOKEN' "
            "(default: $ACS_CACHE_TOKEN, else the file $ACS_TOKEN_FILE, else no check)",
    )
    tls_cert: Optional[str] = option("tls_cert", None, parse=parse_str, metavar="PEM",
                                     doc="serve HTTPS with this certificate (default $ACS_TLS_CERT)")
    tls_key: Optional[str] = option("tls_key", None, parse=parse_str, metavar="PEM",
                                    doc="its private key (default $ACS_TLS_KEY)")
    insecure: bool = insecure_option()
    parent_pid: Optional[int] = parent_pid_option()
    log_level: str = log_level_option()
