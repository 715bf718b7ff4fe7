"""Settings every daemon declares alike: one text and one parser each.

``acs-cache-server``, ``acs-tier-mover`` and ``acs-copy-daemon`` (and ``acs up`` for the
servers it starts) take the same metrics port, log level, interface, security and parent
flags; each daemon's options dataclass declares them with these factories, so a flag reads
the same, takes the same values and says the same in ``--help`` everywhere.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pyspark_acs.errors import AcsOptionError
from pyspark_acs.options import choice_parser, option, parse_bool, parse_int, parse_str

__all__ = [
    "DEFAULT_HOST",
    "LOG_LEVELS",
    "configure_logging",
    "host_option",
    "insecure_option",
    "log_level_option",
    "metrics_port_option",
    "parent_pid_option",
    "parse_port",
]

#: Interface a daemon binds unless told otherwise: loopback.
DEFAULT_HOST = "127.0.0.1"
#: Levels of ``--log-level``.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "INFO"
#: The one description of every daemon's ``--metrics-port``.
METRICS_PORT_DOC = "HTTP port of /metrics and /healthz: 0 picks a free port, -1 serves none"


def parse_port(value: Any, name: str) -> int:
    """A TCP port, 0-65535 (0: a free one)."""
    try:
        port = int(str(value).strip())
    except ValueError:
        raise AcsOptionError(f"{name}: {value!r} is not a port number (0-65535)", option=name) from None
    if not 0 <= port <= 65535:
        raise AcsOptionError(f"{name}: {port} is not a port number (0-65535)", option=name)
    return port


def parse_parent_pid(value: Any, name: str) -> int:
    """A process id (>= 1)."""
    try:
        pid = int(str(value).strip())
    except ValueError:
        raise AcsOptionError(f"{name}: {value!r} is not a process id", option=name) from None
    if pid < 1:
        raise AcsOptionError(f"{name}: {pid} is not a process id", option=name)
    return pid


def metrics_port_option(name: str = "metrics_port") -> Any:
    return option(name, 0, parse=parse_int(-1, 65535), metavar="PORT", doc=METRICS_PORT_DOC)


def log_level_option(name: str = "log_level") -> Any:
    return option(name, DEFAULT_LOG_LEVEL, parse=choice_parser(*LOG_LEVELS, upper=True),
                  doc="least severe log messages written to stderr")


def host_option(doc: str, name: str = "host") -> Any:
    return option(name, DEFAULT_HOST, parse=parse_str, doc=doc)


def insecure_option(name: str = "insecure") -> Any:
    return option(name, False, parse=parse_bool,
                  doc="allow a non-loopback --host without TLS and a token (anyone who reaches it can read and "
                      "forge messages; not recommended)")


def parent_pid_option(name: str = "parent_pid") -> Any:
    return option(name, None, parse=parse_parent_pid, metavar="PID",
                  doc="stop when this process exits (local deployments and spark-submit launchers pass theirs)")


def configure_logging(level: str) -> None:
    """Log to stderr at ``level`` (one of :data:`LOG_LEVELS`), one format for every daemon."""
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
