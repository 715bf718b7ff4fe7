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

import threading
import time
from typing import Any, Callable, Dict, List, Optional

from pyspark_acs.errors import AcsOptionError, AcsTimeoutError, CacheError

__all__ = [
    "CLUSTERS_PREFIX",
    "ConfirmWatch",
    "clusters_needed",
    "wait_confirmed",
]

#: ``acknowledge="clusters:K"``: the prefix of the mode.
CLUSTERS_PREFIX = "clusters:"
#: Between two reads of the confirmations while a flush waits without a live watch (seconds,
#: doubling up to the most): a read is a consistent get on every metadata replica.
CONFIRM_POLL_MIN_S = 0.002
CONFIRM_POLL_MAX_S = 0.05
#: With a live watch, how long a flush waits for a push before it reads the confirmations
#: itself (seconds): a push missed while a stream reconnects is caught up then.
CONFIRM_WATCH_RECHECK_S = 0.25


class ConfirmWatch:
    """Confirmations pushed by the metadata replicas (``Watch``; no request per look), for the
    flushes of one writer. A confirmation is a fact once any replica holds it (a copy daemon
    puts it only after the destination's store acknowledged the bytes), so the highest version
    any replica pushes counts. Thread-safe.

    Parameters
    ----------
    client : CacheClient
        The source cluster's metadata cache client (channels and token).
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._cond = threading.Condition()  # guards _known, _streams, _users
        self._known: Dict[bytes, int] = {}
        self._streams: Dict[str, Any] = {}
        self._users: Dict[bytes, int] = {}

    def _on_entries(self, endpoint: str, keys: Any, found: Any, versions: Any) -> None:
        with self._cond:
            for k, f, v in zip(keys, found, versions):
                if f and v > self._known.get(k, -1):
                    self._known[k] = v
            self._cond.notify_all()

    def watch(self, keys: List[bytes]) -> None:
        """Watch ``keys`` on every replica (:meth:`unwatch` each once done)."""
        from pyspark_acs.cache.push import WatchStream

        with self._cond:
            for k in keys:
                self._users[k] = self._users.get(k, 0) + 1
            for endpoint in self.client.endpoints:
                if endpoint not in self._streams:
                    self._streams[endpoint] = WatchStream(self.client, endpoint, self._on_entries)
            streams = list(self._streams.values())
        for stream in streams:
            stream.watch(add=keys)

    def unwatch(self, keys: List[bytes]) -> None:
        with self._cond:
            gone = []
            for k in keys:
                n = self._users.get(k, 0) - 1
                if n > 0:
                    self._users[k] = n
                else:
                    self._users.pop(k, None)
                    self._known.pop(k, None)
                    gone.append(k)
            streams = list(self._streams.values())
        for stream in streams:
            stream.watch(remove=gone)

    def live(self) -> bool:
        """Whether a stream is up (its pushes come)."""
        with self._cond:
            return any(s.live.is_set() for s in self._streams.values())

    def known(self, key: bytes) -> int:
        with self._cond:
            return self._known.get(key, -1)

    def wait(self, timeout: float) -> None:
        """Wait for the next push, at most ``timeout`` seconds."""
        with self._cond:
            self._cond.wait(timeout)

    def close(self) -> None:
        with self._cond:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()


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
                   what: str = "flush", watch: Optional[ConfirmWatch] = None) -> Dict[str, List[str]]:
    """Wait until ``k - 1`` destinations of the stream hold every file of ``needed`` (``{file
    uri: length}``) durably up to its length, by the confirmations in the source cluster's
    metadata cache ``meta`` (a :class:`~pyspark_acs.cache.metadata.MetadataCache`); return
    ``{file uri: clusters that confirmed it}``.

    A cluster counts once it confirmed every file: the bytes are in K stores only when one
    store holds them all. With ``watch``, the confirmations come pushed once the destinations
    are known: the metadata cache is read again only every :data:`CONFIRM_WATCH_RECHECK_S`, or
    at the poll interval while no watch stream is up.

    Raises
    ------
    AcsTimeoutError
        ``deadline`` (monotonic seconds) passed first: naming each destination and how far
        it confirmed each file, or that no copy daemon put the stream's destinations here.
    """
    from pyspark_acs.cache.metadata import confirm_key

    want = k - 1
    if want <= 0 or not needed:
        return {}
    pause = CONFIRM_POLL_MIN_S
    uris = sorted(needed)
    last_error: Optional[BaseException] = None
    destinations: Optional[List[str]] = None
    got: Dict[str, Dict[str, int]] = {}
    watched: List[bytes] = []
    read_at = -1.0
    try:
        while True:
            try:
                if destinations is None or len(destinations) < want:
                    destinations = meta.destinations(stream_uri)
                    if destinations and watch is not None:
                        watched = [confirm_key(u, c) for u in uris for c in destinations]
                        watch.watch(watched)
                if destinations:
                    now = clock()
                    if watch is None or not watch.live() or now - read_at >= CONFIRM_WATCH_RECHECK_S:
                        got = meta.confirmations(uris, destinations)
                        read_at = now
                    if watch is not None:
                        for u in uris:
                            for c in destinations:
                                v = watch.known(confirm_key(u, c))
                                if v > got[u].get(c, -1):
                                    got[u][c] = v
                    full = [c for c in destinations if all(got[u].get(c, -1) >= n for u, n in needed.items())]
                    if len(full) >= want:
                        return {u: list(full) for u in uris}
                last_error = None
            except CacheError as exc:
                last_error = exc
            now = clock()
            if deadline is not None and now >= deadline:
                raise AcsTimeoutError(_timeout_message(what, stream_uri, needed, k, destinations, got, last_error))
            if watch is not None and watched and watch.live():
                left = CONFIRM_WATCH_RECHECK_S if deadline is None else max(0.0, min(CONFIRM_WATCH_RECHECK_S,
                                                                                     deadline - now))
                watch.wait(left)
                continue
            sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))
            pause = min(CONFIRM_POLL_MAX_S, pause * 2)
    finally:
        if watched and watch is not None:
            watch.unwatch(watched)


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
