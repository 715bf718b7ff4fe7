"""Cluster health as one copy daemon sees it (paper section 2.3: outages push clusters to leaves).

Every ``health_interval`` the monitor probes each other cluster's copy daemon (its ``Health``
RPC) and every cluster's data and metadata caches (a majority of replicas must answer). A
cluster failing its probes continuously for ``unhealthy_after`` is unhealthy; one good
probe makes it healthy again. The daemon's own copy service is not probed (it is this
process), its caches are, so every daemon judges a cluster the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, FrozenSet, Optional

from pyspark_acs._grpc import grpc

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.errors import AcsError
from pyspark_acs.security import SecuritySettings
from pyspark_acs.server.copy.proto import copy_pb2, copy_pb2_grpc
from pyspark_acs.server.copy.topology import Topology

__all__ = [
    "HealthMonitor",
]

log = logging.getLogger(__name__)

#: Deadline of one probe of a copy daemon.
HEALTH_RPC_TIMEOUT_S = 0.5


def _majority_up(client: CacheClient) -> bool:
    answers = client.health()
    return sum(answers.values()) * 2 > len(answers)


class HealthMonitor:
    """Tracks which clusters are unhealthy.

    Parameters
    ----------
    self_cluster : str
    interval, unhealthy_after : float
        Seconds.
    stub_for : callable
        ``stub_for(cluster) -> CopyStub``.
    on_change : callable
        Called with the new frozenset of unhealthy clusters when it changes.
    security : SecuritySettings, optional
        Token and TLS of the cache clients it probes with (default: the environment).
    """

    def __init__(self, self_cluster: str, interval: float, unhealthy_after: float,
                 stub_for: Callable[[str], copy_pb2_grpc.CopyStub],
                 on_change: Callable[[FrozenSet[str]], None], security: Optional[SecuritySettings] = None) -> None:
        self.self_cluster = self_cluster
        self.security = security
        self.interval = interval
        self.unhealthy_after = unhealthy_after
        self.stub_for = stub_for
        self.on_change = on_change
        # _lock guards _topology, _clients, _failing_since and _unhealthy.
        self._lock = threading.Lock()
        self._topology: Optional[Topology] = None
        self._clients: Dict[str, tuple] = {}
        self._failing_since: Dict[str, float] = {}
        self._unhealthy: FrozenSet[str] = frozenset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="acs-copy-health", daemon=True)

    @property
    def unhealthy(self) -> FrozenSet[str]:
        """The clusters judged unhealthy now (thread-safe)."""
        with self._lock:
            return self._unhealthy

    def set_topology(self, topology: Topology) -> None:
        """Probe the clusters of ``topology`` from now on; closes the cache clients of the previous one."""
        with self._lock:
            old, self._topology = self._clients, topology
            self._clients = {}
        for data, meta in old.values():
            data.close()
            meta.close()

    def start(self) -> None:
        """Start the probe thread: :meth:`check_once` every ``interval`` seconds (first after one)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the probe thread (waiting up to 5 s) and close the cache clients."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            clients, self._clients = self._clients, {}
        for data, meta in clients.values():
            data.close()
            meta.close()

    def _caches(self, name: str) -> tuple:
        with self._lock:
            pair = self._clients.get(name)
            if pair is None:
                c = self._topology.cluster(name)
                pair = (
                    CacheClient(c.data_cache, name=f"data cache of {name}", deadline=HEALTH_RPC_TIMEOUT_S,
                                security=self.security),
                    CacheClient(c.metadata_cache, name=f"metadata cache of {name}", deadline=HEALTH_RPC_TIMEOUT_S,
                                security=self.security),
                )
                self._clients[name] = pair
            return pair

    def probe(self, name: str) -> bool:
        """One probe of a cluster: its daemon (unless it is us) and its caches answer."""
        try:
            if name != self.self_cluster:
                answer = self.stub_for(name).Health(copy_pb2.HealthRequest(), timeout=HEALTH_RPC_TIMEOUT_S)
                if not answer.serving:
                    return False
            data, meta = self._caches(name)
            return _majority_up(data) and _majority_up(meta)
        except grpc.RpcError:
            return False
        except AcsError as exc:
            log.debug("health probe of %s failed: %s", name, exc)
            return False

    def check_once(self) -> None:
        """Probe every cluster once, update the unhealthy set, and call ``on_change`` if it changed.

        A cluster becomes unhealthy once its probes have failed for ``unhealthy_after`` seconds;
        one good probe makes it healthy again. Does nothing before :meth:`set_topology`.
        ``on_change`` runs in the calling thread.
        """
        with self._lock:
            topology = self._topology
        if topology is None:
            return
        now = time.monotonic()
        results = {name: self.probe(name) for name in topology.clusters}
        with self._lock:
            for name, ok in results.items():
                if ok:
                    self._failing_since.pop(name, None)
                else:
                    self._failing_since.setdefault(name, now)
            bad = frozenset(n for n, t in self._failing_since.items()
                            if n in topology.clusters and now - t >= self.unhealthy_after)
            changed = bad != self._unhealthy
            self._unhealthy = bad
        if changed:
            log.warning("cluster health changed: unhealthy = %s", sorted(bad) or "none")
            self.on_change(bad)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check_once()
            except Exception as exc:  # the monitor must survive anything; it logs and goes on
                log.error("health check failed: %s", exc, exc_info=True)
