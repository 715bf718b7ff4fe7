"""The copy scheduler: which operations this daemon runs (paper section 2.3).

Per stream in which this cluster is a parent in the copy tree, the scheduler discovers the
files of every shard (the shard head keys of this cluster's metadata cache, every poll
interval, so a new file is copied at once; a durable listing every ``listing_interval`` as
the fallback) and runs one :class:`~pyspark_acs.server.copy.reader.CopyOperation` per
(file, storage in {durable, cache}, child cluster). Several daemon replicas of one cluster
split the operations by hash (``--replica i/n``).

Rules the scheduler owns (one place each):

* **File order at a child** (:meth:`CopyScheduler._plan`): a file's operations start only
  once every earlier file of its shard exists in the child's durable store (a durable
  operation's answered hello created it there). Files of a shard are therefore created at
  every hop in name order, and a reader that leaves a file at its seal and takes the next
  name never skips a file still being copied. Files are still copied side by side.
* **The seal rule**: an operation finishes only at its file's seal; no newer file finishes
  it (a take-over producer seals its predecessor's file, and that seal is copied).
* **What a child already has** (:meth:`CopyScheduler._survey`): when the scheduler starts
  feeding a child (a daemon restart, a tree change) it asks the child's daemon once per shard
  which files it holds (the ``Files`` RPC): those exist there (file order), and those sealed
  there are complete (their operations are done), and files older than the oldest it holds
  were deleted there by its own retention (never copied there again). Without it a restarted
  daemon would run one operation per file, one file at a time, before it reached the files
  still being written.
* **Idle operations yield** (:meth:`CopyScheduler._park`): an operation that has copied
  everything of an unsealed file that stopped growing is parked when other operations wait
  for a worker slot, and started again once the file's length moves (its seal moves it), so
  abandoned files never hold the ``workers`` slots.

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
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

from pyspark_acs._grpc import grpc

from pyspark_acs.errors import AcsError, CacheError, TopologyError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.server.copy.cluster import DURABLE, STORAGES, ClusterIO, OpKey
from pyspark_acs.server.copy.metrics import CopyMetrics
from pyspark_acs.server.copy.options import CopyDaemonOptions
from pyspark_acs.server.copy.proto import copy_pb2
from pyspark_acs.server.copy.reader import CopyOperation, SourceFiles
from pyspark_acs.server.copy.tree import CopyTree, build_copy_tree
from pyspark_acs.server.copy.topology import Topology, load_topology
from pyspark_acs.storage.store import DurableStore, stream_epoch
from pyspark_acs.storage.tier import tiered_store

__all__ = [
    "CopyScheduler",
]

log = logging.getLogger(__name__)

#: How long an operation that lost its lease to a newer one stays unscheduled.
YIELD_S = 10.0
#: Bounded wait for operation threads at shutdown.
_JOIN_S = 5.0
#: A shard head naming a file the store does not hold is checked again after this long (seconds).
HEAD_RECHECK_S = 1.0
#: Deadline of one ``Files`` call to a child's daemon (seconds).
SURVEY_TIMEOUT_S = 10.0



def _created_key(key: OpKey) -> Tuple[str, int, str, str]:
    return (key.stream, key.shard, key.file, key.child)


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
                 options: CopyDaemonOptions, metrics: CopyMetrics, stub_for: Callable, operation_prefix: str,
                 confirmer: Optional[Any] = None) -> None:
        self.cluster = cluster
        #: Passes the children's durable acknowledgements to each stream's source, and, where
        #: this cluster is the source, puts the stream's destinations there
        #: (:class:`~pyspark_acs.server.copy.confirm.Confirmer`; None: neither).
        self.confirmer = confirmer
        self.topology_path = topology_path
        self.io = io
        self.options = options
        self.metrics = metrics
        self.stub_for = stub_for
        self.operation_prefix = operation_prefix
        self.poller = SourceFiles(io, options.poll_interval)
        # _lock guards everything below but _child_stores; operation threads never take it.
        self._lock = threading.Lock()
        self._topology = topology
        self._mtime = self._stat_mtime()
        self._unhealthy: FrozenSet[str] = frozenset()
        self._trees: Dict[str, CopyTree] = {}
        self._children: Dict[str, Tuple[str, ...]] = {}
        self._files: Dict[Tuple[str, int], List[str]] = {}
        #: Per shard, a head the store did not hold when listed, and when (listed again for it
        #: at most every HEAD_RECHECK_S: a copy's cache operation may set the head of a file
        #: just before its durable operation creates it).
        self._rejected_heads: Dict[Tuple[str, int], Tuple[str, float]] = {}
        self._shards: Dict[str, int] = {}
        #: The stream's promotion epoch here when last listed (:meth:`_note_epoch`).
        self._epochs: Dict[str, int] = {}
        self._ops: Dict[OpKey, Tuple[CopyOperation, threading.Thread]] = {}
        self._done: Set[OpKey] = set()
        self._yielded: Dict[OpKey, float] = {}
        #: (stream, shard, file, child) known to exist in the child's durable store.
        self._created: Set[Tuple[str, int, str, str]] = set()
        #: (stream, shard, child) whose files at the child were asked for (:meth:`_survey`).
        self._surveyed: Set[Tuple[str, int, str]] = set()
        #: (stream, shard, child) -> the oldest file the child held when surveyed: files before
        #: it that it lacks were deleted there by its own retention (THE FILE ORDER RULE creates
        #: files at a child oldest first), and are never copied there again.
        self._floors: Dict[Tuple[str, int, str], str] = {}
        #: Running operations caught up with their source file, since when (monotonic).
        self._idle_since: Dict[OpKey, float] = {}
        #: Parked operations: (acknowledged length, the poller wake event following the file).
        self._parked: Dict[OpKey, Tuple[int, threading.Event]] = {}
        #: Replica mode only: the children's stores, by root (scheduling thread only).
        self._child_stores: Dict[str, DurableStore] = {}
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
        for store in self._child_stores.values():
            store.close()

    def set_unhealthy(self, unhealthy: FrozenSet[str]) -> None:
        """Health changed: rebuild the trees and move operations."""
        with self._lock:
            self._unhealthy = frozenset(unhealthy)
        self._rebuild()
        self._wake.set()

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
                # A child fed again later is asked again what it has (it may have been fed by another parent).
                self._surveyed = {k for k in self._surveyed if k[2] in children.get(k[0], ())}
                self._floors = {k: v for k, v in self._floors.items() if k in self._surveyed}
            stale = [op for key, (op, _) in self._ops.items() if key.child not in children.get(key.stream, ())]
            for key in [k for k in self._parked if k.child not in children.get(k.stream, ())]:
                self._unpark(key)
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
                    self._announce(now)
                self._reap()
                self._discover(listing)
            except AcsError as exc:
                log.warning("copy scheduling round failed: %s", exc)
            except Exception:  # the scheduling thread must survive anything: it is the only one
                log.exception("copy scheduling round failed unexpectedly")
            self._wake.wait(self.options.poll_interval)
            self._wake.clear()

    def _note_epoch(self, stream: str, epoch: int) -> None:
        """A promotion changed the stream's epoch here: what this scheduler learnt of its
        children's files before (surveys, completed and yielded operations, creations, retention
        floors) may be stale -- a child that took the new history moved files aside -- so it
        is learnt again."""
        with self._lock:
            before = self._epochs.get(stream)
            self._epochs[stream] = epoch
            if before is None or before == epoch:
                return
            self._surveyed = {k for k in self._surveyed if k[0] != stream}
            self._floors = {k: v for k, v in self._floors.items() if k[0] != stream}
            self._done = {k for k in self._done if k.stream != stream}
            self._yielded = {k: v for k, v in self._yielded.items() if k.stream != stream}
            self._created = {k for k in self._created if k[0] != stream}
        log.info("stream %s: epoch %d here now (was %d): its children's files are surveyed again", stream, epoch,
                 before)

    def _announce(self, now: float) -> None:
        """Where this cluster is a stream's source, put the stream's destinations (the
        topology's) into its metadata cache for ``acknowledge="clusters:K"`` writers."""
        if self.confirmer is None:
            return
        topology = self.topology
        for stream, spec in topology.streams.items():
            if spec.source == self.cluster:
                self.confirmer.announce(stream, [d for d in spec.destinations if d != self.cluster], now)

    def _reap(self) -> None:
        with self._lock:
            ended = [(k, op) for k, (op, t) in self._ops.items() if not t.is_alive()]
            for key, op in ended:
                del self._ops[key]
                self._idle_since.pop(key, None)
                if key.storage == DURABLE and op.opened.is_set():
                    self._created.add(_created_key(key))
                if op.finished:
                    self._done.add(key)
                    self._unpark(key)
                elif op.poisoned or op.gave_up:
                    # A poisoned operation yields to the newer one; one that could not make
                    # progress frees its worker and is tried again after YIELD_S.
                    self._yielded[key] = time.monotonic()
                    self._unpark(key)
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
                meta = self.poller.store.stream_meta(stream)
                if meta is None:
                    continue  # no producer has created the stream here yet
                shards = self._shards[stream] = int(meta["shards"])
                self._note_epoch(stream, stream_epoch(meta))
            for shard in range(shards):
                if listing:
                    self._rejected_heads.pop((stream, shard), None)
                    self._add_files(stream, shard, self.poller.store.list_files(stream, shard))
                shard_uris.append((stream, shard, self.io.shard_uri(stream, shard)))
        if shard_uris:
            try:
                heads = self.io.meta.heads([u for _, _, u in shard_uris])
            except CacheError:
                heads = {}
            for stream, shard, uri in shard_uris:
                head = heads.get(uri)
                rejected = self._rejected_heads.get((stream, shard))
                if rejected is not None and rejected[0] == head and time.monotonic() - rejected[1] < HEAD_RECHECK_S:
                    continue
                if head and not self._known(stream, shard, head):
                    # A head names a file the scheduler has not seen: list the shard now, so
                    # every older file of it is known before this one may be created at a child
                    # (files appear here in name order, so the listing has all older ones).
                    # Only files the store holds are copied: the head is a hint anyone who can
                    # write the metadata cache can set, the store is the truth. A head the
                    # listing does not hold is not listed again until it changes or the next
                    # full listing (a file created since is found then).
                    names = self.poller.store.list_files(stream, shard)
                    self._add_files(stream, shard, names)
                    if head not in names:
                        self._rejected_heads[(stream, shard)] = (head, time.monotonic())
                        self.metrics.inc("errors_total", kind="head_not_in_store")
                        log.debug("%s/%d: the head names %r, which this cluster's store does not hold; ignored",
                                    stream, shard, head)
        self._survey(feeding)
        self._schedule(feeding)

    def _known(self, stream: str, shard: int, name: str) -> bool:
        with self._lock:
            return name in self._files.get((stream, shard), ())

    def _add_files(self, stream: str, shard: int, names: List[str]) -> None:
        with self._lock:
            files = self._files.setdefault((stream, shard), [])
            new = set(names).difference(files)
            if new:
                files.extend(new)
                files.sort()

    # -- file order at the children and idle operations ------------------------------------

    def _source_length(self, key: OpKey) -> int:
        """What this cluster has of ``key``'s file for its storage, as the poller last saw it."""
        cache, durable = self.poller.lengths(key.rel)
        if key.storage == DURABLE:
            return durable or 0
        return max(cache or 0, durable or 0)

    def _note_progress(self, now: float) -> None:
        """Record files now created at children, and since when running operations are idle.

        A durable operation whose hello was answered has created its file at the child (the
        writer opens the file for appending at the hello). An operation is idle while it has
        copied everything its source file holds; the file being unsealed (else it finishes).
        """
        with self._lock:
            ops = [(key, op) for key, (op, _) in self._ops.items()]
        for key, op in ops:
            if not op.opened.is_set():
                continue
            caught_up = op.acked >= self._source_length(key)
            with self._lock:
                if key.storage == DURABLE:
                    self._created.add(_created_key(key))
                if caught_up:
                    self._idle_since.setdefault(key, now)
                else:
                    self._idle_since.pop(key, None)

    def _runnable(self, key: OpKey, now: float) -> bool:
        """Whether ``key`` may start now, ignoring file order and the worker budget. Caller holds _lock."""
        if key in self._done or key in self._ops or not owns(key, self.options.replica):
            return False
        if now - self._yielded.get(key, -YIELD_S) < YIELD_S:
            return False
        parked = self._parked.get(key)
        if parked is not None:
            position, _ = parked
            if self._source_length(key) <= position:
                return False  # still idle: the file has not grown (nor been sealed)
        return True

    def _plan(self, feeding: Dict[str, Tuple[str, ...]], now: float) -> Tuple[List[OpKey], List[OpKey]]:
        """Operations that may start now, oldest file first, and durable operations of files
        whose existence at the child another replica knows. Caller holds _lock.

        THE FILE ORDER RULE: both operations of a file start only once every earlier file of
        its shard exists at the child, so a reader there that leaves a file at its seal and
        takes the next file in name order never skips one still being copied.
        """
        ready: List[OpKey] = []
        foreign: List[OpKey] = []
        for stream, children in sorted(feeding.items()):
            for shard in range(self._shards.get(stream, 0)):
                files = self._files.get((stream, shard), [])
                for child in children:
                    floor = self._floors.get((stream, shard, child), "")
                    for file in files:
                        if file < floor:
                            continue  # deleted at the child by its retention (see _floors)
                        for storage in STORAGES:
                            key = OpKey(stream, shard, file, storage, child)
                            if self._runnable(key, now):
                                ready.append(key)
                        durable = OpKey(stream, shard, file, DURABLE, child)
                        if _created_key(durable) not in self._created:
                            if not owns(durable, self.options.replica):
                                foreign.append(durable)
                            break  # later files wait until this one exists at the child
        ready.sort(key=lambda k: (k.file, STORAGES.index(k.storage), k.stream, k.shard, k.child))
        return ready, foreign

    def _survey(self, feeding: Dict[str, Tuple[str, ...]]) -> None:
        """Ask each child not yet asked which files of each shard it holds (one ``Files`` call
        per shard): present files count as created there (THE FILE ORDER RULE needs no
        operation to learn it), sealed ones as done for both storages (a copy is a prefix of
        the source's file, so a copy that ends with a seal is the whole file; readers there
        read what the cache lacks from the durable copy). A child that cannot answer is asked
        again next round; meanwhile operations learn it file by file."""
        for stream, children in sorted(feeding.items()):
            for shard in range(self._shards.get(stream, 0)):
                for child in children:
                    target = (stream, shard, child)
                    with self._lock:
                        if target in self._surveyed or child not in self._children.get(stream, ()):
                            continue
                    try:
                        reply = self.stub_for(child).Files(
                            copy_pb2.FilesRequest(stream=stream, shard=shard, source_cluster=self.io.name,
                                                  shards=self._shards.get(stream, 0),
                                                  **self.io.epoch_fields(stream)), timeout=SURVEY_TIMEOUT_S)
                    except grpc.RpcError as exc:
                        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older daemon: learn file by file
                            with self._lock:
                                self._surveyed.add(target)
                        else:
                            log.debug("%s/%d: cannot ask %s which files it has: %s", stream, shard, child, exc)
                        continue
                    complete = 0
                    with self._lock:
                        self._surveyed.add(target)
                        if reply.files:
                            self._floors[target] = min(f.name for f in reply.files)
                        else:
                            self._floors.pop(target, None)
                        for f in reply.files:
                            self._created.add((stream, shard, f.name, child))
                            if self.confirmer is not None and f.durable_length:
                                # The child's store holds it: a flush waiting on a file whose
                                # operation ended before (a restart, a lost confirmation) learns it.
                                self.confirmer.confirm(stream, f"{shard_dir(stream, shard)}/{f.name}", child,
                                                       f.durable_length)
                            if f.sealed:
                                complete += 1
                                for storage in STORAGES:
                                    self._done.add(OpKey(stream, shard, f.name, storage, child))
                    if reply.files:
                        log.info("%s/%d: %s holds %d files, %d of them complete", stream, shard, child,
                                 len(reply.files), complete)
                    self.metrics.inc("files_surveyed_total", complete, state="complete")
                    self.metrics.inc("files_surveyed_total", len(reply.files) - complete, state="present")

    def _park(self, count: int, now: float) -> None:
        """Stop up to ``count`` operations idle for ``park_after`` (longest idle first); each is
        started again once its file's length moves (the poller keeps following the file)."""
        with self._lock:
            idle = sorted(
                (since, key) for key, since in self._idle_since.items()
                if key in self._ops and key not in self._parked and now - since >= self.options.park_after
            )[:count]
            parked = []
            for _, key in idle:
                op = self._ops[key][0]
                wake = threading.Event()
                self._parked[key] = (op.acked, wake)
                parked.append((key, op, wake))
        for key, op, wake in parked:
            self.poller.follow(key.rel, wake)
            log.info("%s: idle at %d bytes (file unsealed, not growing); parked to free a worker slot", key, op.acked)
            self.metrics.inc("errors_total", kind="parked")
            op.stop()

    def _unpark(self, key: OpKey) -> None:
        """Forget that ``key`` is parked. Caller holds _lock."""
        parked = self._parked.pop(key, None)
        if parked is not None:
            self.poller.unfollow(key.rel, parked[1])

    def _check_foreign(self, keys: List[OpKey]) -> None:
        """Replica mode: whether files another replica copies exist at the child (its store)."""
        for key in keys:
            try:
                exists = self._child_store(key.child).exists(key.rel)
            except (AcsError, TopologyError) as exc:
                log.debug("%s: cannot check the child's store: %s", key, exc)
                continue
            if exists:
                with self._lock:
                    self._created.add(_created_key(key))

    def _child_store(self, child: str) -> DurableStore:
        root = self.topology.cluster(child).root
        store = self._child_stores.get(root)
        if store is None:  # files in either tier: a child's own tier mover may have moved them
            store = self._child_stores[root] = tiered_store(DurableStore(root))
        return store

    def _schedule(self, feeding: Dict[str, Tuple[str, ...]]) -> None:
        now = time.monotonic()
        self._note_progress(now)
        start: List[CopyOperation] = []
        with self._lock:
            # A tree rebuild may have run since _discover read the children: plan only for
            # children this cluster still feeds (a stale op would never be stopped).
            feeding = {s: tuple(c for c in cs if c in self._children.get(s, ())) for s, cs in feeding.items()}
            ready, foreign = self._plan(feeding, now)
            budget = self.options.workers - len(self._ops)
            waiting = len(ready) - max(0, budget)
            for key in ready[:max(0, budget)]:
                self._unpark(key)
                tree = self._trees[key.stream]
                op = CopyOperation(
                    key, self._shards[key.stream], self.io, self.poller, self.stub_for,
                    self.options, self.metrics, self.operation_prefix, is_source=tree.source == self.cluster,
                    confirm=self.confirmer.confirm if self.confirmer is not None else None,
                )
                thread = threading.Thread(target=op.run, name=f"acs-copy-{key.storage}-{key.child}", daemon=True)
                self._ops[key] = (op, thread)
                self._idle_since.pop(key, None)
                start.append(op)
        for op in start:
            log.info("%s: scheduled", op.key)
            self._ops_thread(op.key).start()
        if waiting > 0:
            self._park(waiting, now)
        if foreign:
            self._check_foreign(foreign)

    def _ops_thread(self, key: OpKey) -> threading.Thread:
        with self._lock:
            return self._ops[key][1]
