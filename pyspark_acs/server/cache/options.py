"""Settings of ``acs-cache-server``: one frozen options dataclass; its flags are generated.

:func:`pyspark_acs.server.cache.server.build_parser` makes one ``--flag`` per option
(:func:`pyspark_acs.options.add_option_flags`), with the help text and default declared here;
``acs up`` takes its per-server defaults (capacity, TTL) from the same constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from pyspark_acs.options import bytes_parser, choice_parser, duration_parser, option, parse_bool, parse_str
from pyspark_acs.server.cache.store import DATA_TTL_S, METADATA_TTL_S
from pyspark_acs.server.settings import (host_option, insecure_option, log_level_option, metrics_port_option,
                                         parent_pid_option, parse_port)
from pyspark_acs.units import format_duration, format_size

__all__ = [
    "CacheServerOptions",
    "DEFAULT_CAPACITY_BYTES",
    "MIN_CAPACITY_BYTES",
    "ROLES",
    "ROLE_DEFAULT_TTL_S",
]

#: The two kinds of cache replicas: chunks of files (data); lengths, heads and leases (metadata).
ROLES = ("data", "metadata")
#: Default TTL by role: chunks live a minute, lengths/heads/leases a day.
ROLE_DEFAULT_TTL_S: Dict[str, float] = {"data": DATA_TTL_S, "metadata": METADATA_TTL_S}
#: Default capacity by role, of a server started alone and of each one ``acs up`` starts; the
#: metadata cache holds a few entries per file, so it needs little.
DEFAULT_CAPACITY_BYTES: Dict[str, int] = {"data": 256 * 1024**2, "metadata": 64 * 1024**2}
#: Smallest capacity accepted: below this not even a handful of 4 KiB chunks fit.
MIN_CAPACITY_BYTES = 64 * 1024


def _by_role(values: Dict[str, str]) -> str:
    return ", ".join(f"{role} {v}" for role, v in values.items())


@dataclass(frozen=True)
class CacheServerOptions:
    """Validated ``acs-cache-server`` settings (flag ``--name-in-kebab-case`` per option)."""

    role: str = option("role", parse=choice_parser(*ROLES), required=True, doc="which cache this replica serves")
    port: int = option("port", 0, parse=parse_port, metavar="PORT",
                       doc="gRPC port; 0 picks a free port (the start-up line names it)")
    host: str = host_option("interface to bind")
    capacity: Optional[int] = option(
        "capacity", None, parse=bytes_parser(MIN_CAPACITY_BYTES),
        shown=_by_role({r: format_size(b) for r, b in DEFAULT_CAPACITY_BYTES.items()}),
        doc="memory for entries, e.g. 1GiB; GC starts at 80% and evicts least-recently-modified entries down "
            "to 70%",
    )
    ttl: Optional[float] = option(
        "ttl", None, parse=duration_parser(0.001, unit_required=True),
        shown=_by_role({r: format_duration(s) for r, s in ROLE_DEFAULT_TTL_S.items()}),
        doc="default time to live of entries, with its unit, e.g. 60s",
    )
    metrics_port: int = metrics_port_option()
    token: Optional[str] = option(
        "token", None, parse=parse_str, metavar="TOKEN",
        doc="DEPRECATED (shows in ps): use --token-file or $ACS_TOKEN_FILE / $ACS_CACHE_TOKEN",
    )
    token_file: Optional[str] = option(
        "token_file", None, parse=parse_str, metavar="FILE",
        doc="file holding the shared token clients must send as 'authorization: Bearer TOKEN' "
            "(default: $ACS_CACHE_TOKEN, else the file $ACS_TOKEN_FILE, else no check)",
    )
    tls_cert: Optional[str] = option("tls_cert", None, parse=parse_str, metavar="PEM",
                                     doc="server certificate chain (default $ACS_TLS_CERT)")
    tls_key: Optional[str] = option("tls_key", None, parse=parse_str, metavar="PEM",
                                    doc="its private key (default $ACS_TLS_KEY)")
    tls_ca: Optional[str] = option("tls_ca", None, parse=parse_str, metavar="PEM",
                                   doc="CA bundle verifying client certificates with --mtls (default $ACS_TLS_CA)")
    mtls: Optional[bool] = option("mtls", None, parse=parse_bool,
                                  doc="require client certificates (default $ACS_TLS_MTLS)")
    insecure: bool = insecure_option()
    parent_pid: Optional[int] = parent_pid_option()
    log_level: str = log_level_option()
