"""Cache endpoints: ``host:port`` lists, and the environment variables that name a cache."""

from __future__ import annotations

import os
import re
from typing import Any, List, Sequence, Tuple, Union

from pyspark_acs.errors import AcsOptionError

__all__ = [
    "DATA_CACHE_ENV",
    "METADATA_CACHE_ENV",
    "NO_CACHE",
    "cache_endpoints",
    "parse_endpoints",
]

#: Environment variables naming the cache endpoints an entry point uses when it is given none
#: (``acs up`` prints ``export`` lines for them): the CLI, the Producer, the Consumer and the Spark
#: options all resolve them through :func:`cache_endpoints`.
DATA_CACHE_ENV = "ACS_DATA_CACHE"
METADATA_CACHE_ENV = "ACS_METADATA_CACHE"
#: The value that turns a cache off even when its environment variable is set.
NO_CACHE = "none"

_ENDPOINT = re.compile(r"^(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)):(?P<port>[0-9]{1,5})$")


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
