"""Acknowledgements that survive a cluster: ``acknowledge="clusters:K"``.

A message acknowledged in the source cluster alone is lost with that cluster. With
``clusters:K`` a writer's flush returns once the bytes are durable in K clusters: the source
and K-1 of its destinations. The copy daemons confirm what each destination acknowledged
durably in the source cluster's metadata cache (``server/copy/confirm.py``); the source's own
daemon puts the stream's destinations there from its topology
(:meth:`~pyspark_acs.cache.metadata.MetadataCache.set_destinations`). :func:`wait_confirmed` reads
both until enough clusters hold every byte the flush covers.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

from pyspark_acs.errors import AcsOptionError, AcsTimeoutError, CacheError

__all__ = [
    "CLUSTERS_PREFIX",
    "clusters_needed",
    "wait_confirmed",
]

#: ``acknowledge="clusters:K"``: the prefix of the mode.
CLUSTERS_PREFIX = "clusters:"
#: Between two reads of the confirmations while a flush waits (seconds, doubling up to the most).
CONFIRM_POLL_MIN_S = 0.001
CONFIRM_POLL_MAX_S = 0.02


def clusters_needed(mode: str, name: str = "acknowledge") -> int:
    """K of ``"clusters:K"`` (the clusters that must hold the bytes durably, the source
    included); 1 for the other modes.

    Raises
    ------
    AcsOptionError
        ``K`` is not a whole number from 1 to 64 (naming the option).
    """
    if not mode.startswith(CLUSTERS_PREFIX):
        return 1
    raw = mode[len(CLUSTERS_PREFIX):]
    if not raw.isdigit() or not 1 <= int(raw) <= 64:
        raise AcsOptionError(f"{name}: {mode!r}: K in 'clusters:K' is a whole number from 1 to 64 (the clusters "
                             f"that must hold the bytes durably, the source included), e.g. 'clusters:2'", option=name)
    return int(raw)


def wait_confirmed(meta: Any, stream_uri: str, needed: Dict[str, int], k: int, *, deadline: Optional[float],
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                   what: str = "flush") -> Dict[str, List[str]]:
    """Wait until ``k - 1`` destinations of the stream hold every file of ``needed`` (``{file
    uri: length}``) durably up to its length, by the confirmations in the source cluster's
    metadata cache ``meta`` (a :class:`~pyspark_acs.cache.metadata.MetadataCache`); return
    ``{file uri: clusters that confirmed it}``.

    A cluster counts once it confirmed every file: the bytes are in K stores only when one
    store holds them all.

    Raises
    ------
    AcsTimeoutError
        ``deadline`` (monotonic seconds) passed first: naming each destination and how far
        it confirmed each file, or that no copy daemon put the stream's destinations here.
    """
    want = k - 1
    if want <= 0 or not needed:
        return {}
    pause = CONFIRM_POLL_MIN_S
    uris = sorted(needed)
    last_error: Optional[BaseException] = None
    destinations: Optional[List[str]] = None
    got: Dict[str, Dict[str, int]] = {}
    while True:
        try:
            if destinations is None or len(destinations) < want:
                destinations = meta.destinations(stream_uri)
            if destinations:
                got = meta.confirmations(uris, destinations)
                full = [c for c in destinations if all(got[u].get(c, -1) >= n for u, n in needed.items())]
                if len(full) >= want:
                    return {u: [c for c in full] for u in uris}
            last_error = None
        except CacheError as exc:
            last_error = exc
        now = clock()
        if deadline is not None and now >= deadline:
            raise AcsTimeoutError(_timeout_message(what, stream_uri, needed, k, destinations, got, last_error))
        sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))
        pause = min(CONFIRM_POLL_MAX_S, pause * 2)


def _timeout_message(what: str, stream_uri: str, needed: Dict[str, int], k: int,
                     destinations: Optional[List[str]], got: Dict[str, Dict[str, int]],
                     error: Optional[BaseException]) -> str:
    head = (f"{what}: acknowledge='clusters:{k}' needs the bytes durable in {k - 1} destination(s) of "
            f"{stream_uri} besides this cluster")
    if error is not None:
        return f"{head}; this cluster's metadata cache did not answer: {error}"
    if not destinations:
        return (f"{head}, and no copy daemon of this cluster has put the stream's destinations into its metadata "
                f"cache: run the copy daemon here with a topology that names this cluster the stream's source")
    if len(destinations) < k - 1:
        return f"{head}, but the topology gives it only {len(destinations)}: {', '.join(destinations)}"
    parts = []
    for c in destinations:
        short = [f"{u} at byte {got.get(u, {}).get(c)} of {n}" if got.get(u, {}).get(c) is not None
                 else f"{u} not at all (of {n} bytes)" for u, n in sorted(needed.items())
                 if got.get(u, {}).get(c, -1) < n]
        parts.append(f"{c} confirmed " + ("everything" if not short else "; ".join(short)))
    return f"{head}; not confirmed in time: " + ". ".join(parts)
