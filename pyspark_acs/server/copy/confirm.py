"""Confirmations: how far each destination holds each file, told to the stream's source.

A durable copy operation's acknowledgements say how far the child cluster holds the file in
its store. :class:`Confirmer` passes them on to the metadata cache of the stream's *source*
cluster (from the topology this daemon runs, so after a promotion to the new source's),
where a writer with ``acknowledge="clusters:K"`` reads them (:mod:`pyspark_acs.write.confirm`).
Every daemon confirms for its own children, so a grandchild's copy reaches the source without
being relayed hop by hop. The source cluster's daemon also puts the stream's destinations
there (:meth:`Confirmer.announce`), so a writer knows whose confirmations to read.

Confirmations are sent by one thread, coalesced per (file, child): a slow or unreachable
source cache delays them, never a copy.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from cachetools import LRUCache

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.metadata import MetadataCache
from pyspark_acs.errors import AcsError

__all__ = [
    "Confirmer",
]

log = logging.getLogger(__name__)

#: Deadline of a confirmation put to a source cluster's metadata cache (seconds).
CONFIRM_DEADLINE_S = 1.0
#: How long a failed put waits before the pending confirmations are sent again (seconds).
CONFIRM_RETRY_S = 0.2
#: How often the source cluster's daemon puts each stream's destinations again (seconds): the
#: entry lives 24 h, and a restarted metadata cache comes back empty.
ANNOUNCE_EVERY_S = 60.0
#: How many confirmations sent lately are kept to be sent again every ``confirm_resend``
#: (seconds, a daemon setting): a source cache that restarted (empty) learns them again, also
#: for sealed files whose copy operations have ended (a flush waiting on them would wait for ever).
RESEND_KEPT = 4096


class Confirmer:
    """Sends this daemon's children's durable lengths to each stream's source cluster.

    Parameters
    ----------
    cluster : str
        This daemon's cluster.
    topology : callable
        Returns the topology the daemon runs now.
    store_of : callable
        ``store_of(cluster)``: that cluster's store (for the URI of a file there).
    security : SecuritySettings, optional
        Of the cache clients.
    resend : float
        How often the confirmations sent lately are sent again (seconds).
    """

    def __init__(self, cluster: str, topology: Callable[[], Any], store_of: Callable[[str], Any],
                 security: Any = None, resend: float = 30.0) -> None:
        self.cluster = cluster
        self.resend = resend
        self.topology = topology
        self.store_of = store_of
        self.security = security
        # _lock guards _pending, _clients and _announced; _wake (on it) wakes the sender.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        #: (stream, rel, child) -> the longest durable length to confirm.
        self._pending: Dict[Tuple[str, str, str], int] = {}
        #: The confirmations sent lately, sent again every ``resend`` s (newest kept).
        self._sent: "LRUCache[Tuple[str, str, str], int]" = LRUCache(maxsize=RESEND_KEPT)
        self._clients: Dict[str, MetadataCache] = {}
        #: stream -> (destinations, monotonic time put).
        self._announced: Dict[str, Tuple[Tuple[str, ...], float]] = {}
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"acs-copy-confirm-{self.cluster}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Send what is pending (one try), then stop."""
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            pending, self._pending = self._pending, {}
        if pending:
            self._send(pending)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for m in clients:
            m.client.close()

    def confirm(self, stream: str, rel: str, child: str, length: int) -> None:
        """``child`` holds ``rel`` durably up to ``length`` (an acknowledgement said so)."""
        key = (stream, rel, child)
        with self._wake:
            if length > self._pending.get(key, -1):
                self._pending[key] = length
                self._wake.notify_all()

    def announce(self, stream: str, destinations: List[str], now: float) -> None:
        """This cluster is the stream's source: put its destinations into its own metadata
        cache when they changed or :data:`ANNOUNCE_EVERY_S` passed."""
        dests = tuple(sorted(destinations))
        with self._lock:
            known = self._announced.get(stream)
            if known is not None and known[0] == dests and now - known[1] < ANNOUNCE_EVERY_S:
                return
        try:
            self._meta(self.cluster).set_destinations(self.store_of(self.cluster).uri(stream), list(dests))
        except AcsError as exc:
            log.debug("%s: stream %s: destinations not put: %s", self.cluster, stream, exc)
            return
        with self._lock:
            self._announced[stream] = (dests, now)

    def _meta(self, cluster: str) -> MetadataCache:
        with self._lock:
            meta = self._clients.get(cluster)
        if meta is None:
            endpoints = self.topology().cluster(cluster).metadata_cache
            meta = MetadataCache(CacheClient(endpoints, name=f"metadata cache of {cluster}",
                                             deadline=CONFIRM_DEADLINE_S, security=self.security))
            with self._lock:
                if self._stopped:
                    meta.client.close()
                    raise AcsError(f"{self.cluster}: confirmations stopped")
                meta = self._clients.setdefault(cluster, meta)
        return meta

    def _run(self) -> None:
        resend_at = time.monotonic() + self.resend
        while True:
            with self._wake:
                while not self._pending and not self._stopped and time.monotonic() < resend_at:
                    self._wake.wait(max(0.0, resend_at - time.monotonic()))
                if self._stopped:
                    return
                if time.monotonic() >= resend_at:
                    resend_at = time.monotonic() + self.resend
                    for key, length in self._sent.items():
                        if length > self._pending.get(key, -1):
                            self._pending[key] = length
                pending, self._pending = self._pending, {}
            failed = self._send(pending)
            with self._lock:
                for key, length in pending.items():
                    if key not in failed and length >= self._sent.get(key, -1):
                        self._sent[key] = length
            if failed:
                with self._wake:
                    for key, length in failed.items():
                        if length > self._pending.get(key, -1):
                            self._pending[key] = length
                    self._wake.wait(CONFIRM_RETRY_S)

    def _send(self, pending: Dict[Tuple[str, str, str], int]) -> Dict[Tuple[str, str, str], int]:
        """Put ``pending`` into each stream's source cluster; return what failed."""
        by_source: Dict[str, List[Tuple[Tuple[str, str, str], int]]] = {}
        topology = self.topology()
        for key, length in pending.items():
            spec = topology.streams.get(key[0])
            if spec is None:
                continue  # the stream left the topology
            by_source.setdefault(spec.source, []).append((key, length))
        failed: Dict[Tuple[str, str, str], int] = {}
        for source, items in by_source.items():
            try:
                store = self.store_of(source)
                self._meta(source).confirm_many([(store.uri(rel), child, n) for (_, rel, child), n in items])
            except AcsError as exc:
                log.debug("%s: confirmations to %s not sent (again in %.1f s): %s", self.cluster, source,
                          CONFIRM_RETRY_S, exc)
                failed.update(dict(items))
        return failed
