"""The copy scheduler: which operations this daemon runs (paper section 2.3).

Per stream in which this cluster is a parent in the copy tree, the scheduler discovers the
files of every shard (the shard head keys of this cluster's metadata cache, every poll
interval, so a new file is copied at once; a durable listing every ``listing_interval`` as
the fallback) and runs one :class:`~pyspark_acs.server.copy.reader.CopyOperation` per
(file, storage in {durable, cache}, child cluster). Several daemon replicas of one cluster
split the operations by hash (``--replica i/n``).

The trees are rebuilt when cluster health changes or the topology file changes (it is
reread when its modification time moves). Operations for a child this cluster no longer
feeds are stopped; the new parent's operations take the files over from the child's
lengths, poisoning any lease still held (make-before-break). An operation poisoned by a
newer one yields: it is not scheduled again for :data:`YIELD_S` unless the tree changes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from typing import Callable, Dict, FrozenSet, List, Set, Tuple

from pyspark_acs.errors import AcsError, CacheError, TopologyError
from pyspark_acs.server.copy.cluster import STORAGES, ClusterIO, OpKey
from pyspark_acs.server.copy.metrics import CopyMetrics
from pyspark_acs.server.copy.options import CopyDaemonOptions
from pyspark_acs.server.copy.reader import CopyOperation, LengthPoller
from pyspark_acs.server.copy.tree import CopyTree, build_copy_tree
from pyspark_acs.server.copy.topology import Topology, load_topology

__all__ = ["YIELD_S", "CopyScheduler", "owns"]

log = logging.getLogger(__name__)

#: How long an operation that lost its lease to a newer one stays unscheduled.
YIELD_S = 10.0
#: Bounded wait for operation threads at shutdown.
_JOIN_S = 5.0


def owns(key: OpKey, replica: Tuple[int, int]) -> bool:
    """Whether replica ``(i, n)`` owns operation ``key`` (a stable hash range split)."""
    i, n = replica
    return n == 1 or zlib.crc32(str(key).encode()) % n == i


class CopyScheduler:
    """Discovers files and runs operations for the hops this cluster feeds.

    Parameters
    ----------
    cluster : str
    topology_path : str
        Reread when its modification time changes.
    topology : Topology
        The already loaded file.
    io : ClusterIO
    options : CopyDaemonOptions
    metrics : CopyMetrics
    stub_for : callable
        ``stub_for(cluster) -> CopyStub``.
    operation_prefix : str
        Identifies this daemon replica in lease records.
    """

    def __init__(self, cluster: str, topology_path: str, topology: Topology, io: ClusterIO,
                 options: CopyDaemonOptions, metrics: CopyMetrics, stub_for: Callable, operation_prefix: str) -> None:
        self.cluster = cluster
        self.topology_path = topology_path
        self.io = io
        self.options = options
        self.metrics = metrics
        self.stub_for = stub_for
        self.operation_prefix = operation_prefix
        self.poller = LengthPoller(io, options.poll_interval)
        # _lock guards everything below; operation threads only read through is_final().
        self._lock = threading.Lock()
        self._topology = topology
        self._mtime = self._stat_mtime()
        self._unhealthy: FrozenSet[str] = frozenset()
        self._trees: Dict[str, CopyTree] = {}
        self._children: Dict[str, Tuple[str, ...]] = {}
        self._files: Dict[Tuple[str, int], List[str]] = {}
        self._shards: Dict[str, int] = {}
        self._ops: Dict[OpKey, Tuple[CopyOperation, threading.Thread]] = {}
        self._done: Set[OpKey] = set()
        self._yielded: Dict[OpKey, float] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="acs-copy-scheduler", daemon=True)
        self.topology_listeners: List[Callable[[Topology], None]] = []
        self._rebuild()

    # -- public ----------------------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        """The topology in use (replaced when the topology file changes and is valid)."""
        with self._lock:
            return self._topology

    def trees(self) -> Dict[str, CopyTree]:
        """The current copy tree of each stream, by name (a copy); streams without one are left out."""
        with self._lock:
            return dict(self._trees)

    def running(self) -> int:
        """How many operations (readers) run now."""
        with self._lock:
            return len(self._ops)

    def start(self) -> None:
        """Start the length poller and the scheduling thread."""
        self.poller.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop scheduling and every operation, wait (bounded) for their threads, then stop the poller."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=_JOIN_S)
        with self._lock:
            ops = list(self._ops.values())
        for op, _ in ops:
            op.stop()
        deadline = time.monotonic() + _JOIN_S
        for _, thread in ops:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.poller.stop()

    def set_unhealthy(self, unhealthy: FrozenSet[str]) -> None:
        """Health changed: rebuild the trees and move operations."""
        with self._lock:
            self._unhealthy = frozenset(unhealthy)
        self._rebuild()
        self._wake.set()

    def is_final(self, stream: str, shard: int, file: str) -> bool:
        """A newer file exists in the shard (so ``file`` will not grow any more)."""
        with self._lock:
            files = self._files.get((stream, shard), [])
            return bool(files) and files[-1] > file

    # -- trees -----------------------------------------------------------------------------

    def _stat_mtime(self) -> float:
        try:
            return os.stat(self.topology_path).st_mtime
        except OSError:
            return 0.0

    def _rebuild(self) -> None:
        with self._lock:
            topology, unhealthy = self._topology, self._unhealthy
        trees: Dict[str, CopyTree] = {}
        for name in topology.streams:
            try:
                trees[name] = build_copy_tree(topology, name, unhealthy_clusters=unhealthy & set(topology.clusters))
            except TopologyError as exc:
                log.error("stream %s: no copy tree: %s", name, exc)
        children = {
            name: (tree.children(self.cluster) if self.cluster in tree.clusters else ()) for name, tree in trees.items()
        }
        with self._lock:
            changed = children != self._children
            self._trees = trees
            self._children = children
            if changed:
                self._yielded.clear()
            stale = [op for key, (op, _) in self._ops.items() if key.child not in children.get(key.stream, ())]
        if changed:
            self.metrics.inc("tree_rebuilds_total")
            for name in sorted(trees):
                log.info("copy tree of %s:\n%s", name, trees[name].render().rstrip())
        for op in stale:
            log.info("%s: %s no longer feeds %s; stopping", op.key, self.cluster, op.key.child)
            op.stop()

    def _reload_topology(self) -> None:
        mtime = self._stat_mtime()
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            topology = load_topology(self.topology_path)
            topology.cluster(self.cluster)
        except TopologyError as exc:
            log.error("topology file changed but is not usable; keeping the previous one: %s", exc)
            return
        log.info("topology file %s reloaded", self.topology_path)
        with self._lock:
            self._topology = topology
        for listener in self.topology_listeners:
            listener(topology)
        self._rebuild()

    # -- discovery and operations ----------------------------------------------------------

    def _run(self) -> None:
        last_listing = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            listing = now - last_listing >= self.options.listing_interval
            try:
                if listing:
                    last_listing = now
                    self._reload_topology()
                self._reap()
                self._discover(listing)
            except AcsError as exc:
                log.warning("copy scheduling round failed: %s", exc)
            self._wake.wait(self.options.poll_interval)
            self._wake.clear()

    def _reap(self) -> None:
        with self._lock:
            ended = [(k, op) for k, (op, t) in self._ops.items() if not t.is_alive()]
            for key, op in ended:
                del self._ops[key]
                if op.finished:
                    self._done.add(key)
                elif op.poisoned:
                    self._yielded[key] = time.monotonic()
        for key, op in ended:
            if op.finished:
                log.info("%s: complete", key)

    def _discover(self, listing: bool) -> None:
        with self._lock:
            feeding = {s: c for s, c in self._children.items() if c}
        if not feeding:
            return
        shard_uris: List[Tuple[str, int, str]] = []
        for stream in sorted(feeding):
            shards = self._shards.get(stream)
            if shards is None or listing:
                shards = self.io.store.stream_shards(stream)
                if shards is None:
                    continue  # no producer has created the stream here yet
                self._shards[stream] = shards
            for shard in range(shards):
                if listing:
                    self._add_files(stream, shard, self.io.store.list_files(stream, shard))
                shard_uris.append((stream, shard, self.io.shard_uri(stream, shard)))
        if shard_uris:
            try:
                heads = self.io.meta.heads([u for _, _, u in shard_uris])
            except CacheError:
                heads = {}
            for stream, shard, uri in shard_uris:
                head = heads.get(uri)
                if head:
                    self._add_files(stream, shard, [head])
        self._schedule(feeding)

    def _add_files(self, stream: str, shard: int, names: List[str]) -> None:
        with self._lock:
            files = self._files.setdefault((stream, shard), [])
            new = [n for n in names if n not in files]
            if new:
                files.extend(new)
                files.sort()

    def _schedule(self, feeding: Dict[str, Tuple[str, ...]]) -> None:
        now = time.monotonic()
        start: List[CopyOperation] = []
        with self._lock:
            budget = self.options.workers - len(self._ops)
            for stream, children in sorted(feeding.items()):
                shards = self._shards.get(stream, 0)
                for shard in range(shards):
                    for file in self._files.get((stream, shard), []):
                        for child in children:
                            for storage in STORAGES:
                                key = OpKey(stream, shard, file, storage, child)
                                if key in self._done or key in self._ops or not owns(key, self.options.replica):
                                    continue
                                if now - self._yielded.get(key, -YIELD_S) < YIELD_S:
                                    continue
                                if budget <= 0:
                                    break
                                op = CopyOperation(
                                    key, shards, self.io, self.poller, self.stub_for,
                                    lambda s=stream, h=shard, f=file: self.is_final(s, h, f),
                                    self.options, self.metrics, self.operation_prefix,
                                    is_source=self._trees[stream].source == self.cluster,
                                )
                                thread = threading.Thread(target=op.run, name=f"acs-copy-{key.storage}-{child}", daemon=True)
                                self._ops[key] = (op, thread)
                                budget -= 1
                                start.append(op)
        for op in start:
            log.info("%s: scheduled", op.key)
            self._ops_thread(op.key).start()

    def _ops_thread(self, key: OpKey) -> threading.Thread:
        with self._lock:
            return self._ops[key][1]
