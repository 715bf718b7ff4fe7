"""The writer side of a copy operation: the child cluster's daemon serves the ``Copy`` RPC.

One bidirectional stream is one operation (a file, one storage). The first request is a
hello: the writer takes the operation's lease in its metadata cache (poisoning an older
operation for the same file and storage: make-before-break), works out where the copy
continues and answers with that length. Every later request is a delta of whole blocks;
the writer writes it, publishes the new length, and acknowledges it.

Both kinds write through the one file writer of the package (:mod:`pyspark_acs.write.file`):

Durable operations (paper section 2.4, "Writers"): single-threaded appends through a
:class:`~pyspark_acs.write.file.FileWriter` without a data cache: the fenced append of
:class:`~pyspark_acs.write.file.DurableFile` (the delta must start exactly at the destination
file's length, checked under the file's append lock together with the append, so two
operations on one file, e.g. a stale one and its successor, cannot both append: the
check-then-append is atomic -- a lock held past ``LOCK_WAIT_SECONDS`` fails the delta, nothing
appended --; and verified after it), then ``durable_length`` published in the
metadata cache (a failure there is logged and counted, never fails the delta). A gap or
overlap is answered with RESTART and the destination length, and the reader continues from
there. Seals are bytes like any other: a source's recovery seal reaches every hop.

Cache operations: a :class:`~pyspark_acs.write.file.CacheMirror` per file writes complete
chunks in parallel and rewrites the partial last chunk from its start, serialized; the
``cache_length`` is published after every chunk below it is written (here a cache failure
fails the delta: the cache is the operation's only storage). Where the destination cache
lost the file (no cache length), the copy starts at the destination's durable length with
the prefix of that chunk read back from the durable store by the mirror (paper section 3,
"Start position for cache copies"); a reader in catch-up mode may instead jump ahead to a
chunk boundary near the head.

Both kinds set the shard's head key and make sure the stream's ``_stream.json`` exists, so
consumers in the destination cluster find the stream.

What a writer accepts (the ``Copy`` RPC is the way into a cluster's store; docs/security.md):

* **The source vouches for the file.** Before the hello creates anything, the source
  cluster's durable store (found through the topology) must hold the file; a durable delta
  may not reach past the source file's length. A hello for a file the source does not hold
  is answered FAILED and creates nothing.
* **Nothing follows a seal, in either storage** (:meth:`_OpWriter.after_seal`, the one rule
  both writers ask): a file ends at its first seal, so a delta reaching past the seal the
  file is known to have is refused. Where the file's blocks end and whether it is sealed
  there is found by a header walk at the hello (and, for a cache copy, through the bytes a
  catch-up jump skips), through this cluster's durable copy and past it the source's store
  (:meth:`_OpWriter.walk`): a cache copy resuming after its seal (a reader reconnecting after
  the seal's acknowledgement was lost) cannot write a deposed writer's late block past it.
* **Every durable delta is whole, valid blocks** (:func:`validate_delta`): header and body
  checksums, ``first_index`` continuing the blocks before it, nothing after a seal; a torn
  block only together with the recovery seal that voids it. A delta that resumes inside a
  block is checked together with the block's bytes the destination already holds. Cache
  deltas from the known block boundary are checked alike; after a jump, or a resume inside
  a block, they are not. A refused delta is answered FAILED (``delta_refused``) and nothing of
  it is written or published.
* **A bounded number of streams** (:data:`COPY_STREAMS_RESERVE`): ``Copy`` streams beyond the
  server's threads minus a reserve are refused with RESOURCE_EXHAUSTED at once, so ``Files``
  and ``Health`` always find a thread, and a stream that sends no hello within
  :data:`HELLO_TIMEOUT_S` is cancelled.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from pyspark_acs._grpc import grpc
from cachetools import LRUCache

from pyspark_acs.cache.chunks import CHUNK_SIZE, ChunkReader
from pyspark_acs.errors import (AcsError, AcsOptionError, CacheError, CorruptFileError, LeasePoisonedError,
                                StaleEpochError, StoreError, TruncatedBlockError, WriterConflictError)
from pyspark_acs.format.block import HEADER_SIZE, check_body, find_recovery_seal, parse_header
from pyspark_acs.cache.metadata import MetadataLease
from pyspark_acs.format.names import parse_file_name, shard_dir, validate_shard, validate_stream
from pyspark_acs.read.positions import QUARANTINE_CHECK_S, ends_with_seal, quarantine_entries, walk_blocks
from pyspark_acs.read.readpath import DurableReadPath
from pyspark_acs.server.copy.cluster import CACHE, DURABLE, ClusterIO, publish_delay
from pyspark_acs.server.copy.metrics import CopyMetrics
from pyspark_acs.server.copy.options import CopyDaemonOptions
from pyspark_acs.server.copy.proto import copy_pb2, copy_pb2_grpc
from pyspark_acs.storage.store import DurableStore, record_time, stream_epoch
from pyspark_acs.storage.tier import raise_retention_floor, retention_floor, tiered_store
from pyspark_acs.errors import AppendConflictError, AppendLockBusyError
from pyspark_acs.write.file import CacheMirror, FileWriter

__all__ = [
    "COPY_STREAMS_RESERVE",
    "CopyServicer",
]

log = logging.getLogger(__name__)

#: How often a writer records the delivery delay in the metadata cache (per operation).
DELAY_PUBLISH_INTERVAL_S = 0.5
#: How many files found sealed the Files RPC remembers (files; each entry is a name and a length).
SEALED_FILES_REMEMBERED = 100_000
_STORAGE_NAMES = {copy_pb2.DURABLE: DURABLE, copy_pb2.CACHE: CACHE}
#: Server threads kept free of ``Copy`` streams, so ``Files`` and ``Health`` always answer (threads).
COPY_STREAMS_RESERVE = 8
#: A ``Copy`` stream that sends no hello within this many seconds is cancelled (an idle
#: stream would hold a server thread for nothing).
HELLO_TIMEOUT_S = 10.0
#: How long a stream's promotion count read here stands before it is read again (seconds):
#: an operation from before a promotion is poisoned within this long of its fence.
EPOCH_RECHECK_S = 0.25
#: How long a quarantine waits between recording its ranges and moving the files (seconds):
#: four times the readers' look at the record (``read/positions.py`` QUARANTINE_CHECK_S), so a
#: reader before a range stops at its start instead of reading on through bytes it buffered.
QUARANTINE_SETTLE_S = 4 * QUARANTINE_CHECK_S


def validate_delta(prefix: bytes, data: bytes, *, base: int, path: str = "",
                   next_index: Optional[int] = None) -> Tuple[bool, Optional[int], List[int]]:
    """Check that ``prefix + data`` (file bytes from ``base``, a block boundary; ``prefix`` is
    what the destination already holds of the block ``data`` resumes) is whole, valid blocks.

    Each block needs valid header and body checksums and, where known, a ``first_index``
    continuing the one before it; a torn block passes only together with the recovery seal
    that voids it; nothing may follow a seal.

    Returns
    -------
    (sealed, next_index, blocks) : whether the bytes end with a seal, the message index after
    them (``None`` when unknown), and the offsets in ``prefix + data`` of the whole blocks.

    Raises
    ------
    CorruptFileError
        Naming ``path`` and the byte position of the first bad block.
    """
    buf = memoryview(prefix + data) if prefix else memoryview(data)
    at = 0
    blocks: List[int] = []
    while at < len(buf):
        try:
            header = parse_header(buf, at, path=path, position=base + at)
            if at + header.size > len(buf):
                raise TruncatedBlockError(f"{path} at byte {base + at}: the delta ends inside a block of "
                                          f"{header.size} bytes", path=path, position=base + at)
            check_body(buf, at, header, path=path, position=base + at)
        except CorruptFileError:
            # A torn block: acceptable only up to the recovery seal that voids it, which must
            # end the delta (nothing follows a seal).
            found = find_recovery_seal(buf[at:], base + at, base=base + at, path=path)
            if found is None or at + found[0] + found[1].size != len(buf):
                raise
            return True, None, blocks
        if next_index is not None and header.first_index != next_index:
            raise CorruptFileError(
                f"{path} at byte {base + at}: block first_index {header.first_index} does not continue the "
                f"file (expected {next_index})", path=path, position=base + at)
        next_index = header.first_index + header.count
        blocks.append(at)
        at += header.size
        if header.sealed:
            if at != len(buf):
                raise CorruptFileError(f"{path} at byte {base + at}: {len(buf) - at} bytes after the seal",
                                       path=path, position=base + at)
            return True, next_index, blocks
    return False, next_index, blocks


def _ack(status: int, length: int, message: str = "", durable_length: int = 0) -> copy_pb2.CopyAck:
    return copy_pb2.CopyAck(status=status, length=length, message=message, durable_length=durable_length)


class _Generations:
    """Per (file, storage) generation counters of this process: a newer operation for the
    same target makes older ones in this process stop even when the metadata cache (and its
    leases) is down. ``_lock`` guards ``_gen``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gen: Dict[Tuple[str, str], int] = {}

    def claim(self, target: Tuple[str, str]) -> int:
        with self._lock:
            n = self._gen.get(target, 0) + 1
            self._gen[target] = n
            return n

    def current(self, target: Tuple[str, str]) -> int:
        with self._lock:
            return self._gen.get(target, 0)


class _OpWriter:
    """State shared by durable and cache writers. Used by one server thread only."""

    storage = ""

    def __init__(self, servicer: "CopyServicer", hello: copy_pb2.CopyRequest) -> None:
        self.s = servicer
        self.io: ClusterIO = servicer.io
        self.stream = validate_stream(hello.stream)
        self.shard = validate_shard(hello.shard)
        parse_file_name(hello.file)
        self.file = hello.file
        self.rel = f"{shard_dir(self.stream, self.shard)}/{self.file}"
        self.uri = self.io.uri(self.rel)
        self.shard_uri = self.io.shard_uri(self.stream, self.shard)
        self.shards = hello.shards
        self.operation = hello.operation or "unknown"
        self.source = hello.source_cluster or "?"
        #: The stream's promotion count in the source cluster when the operation began, and its
        #: promotion records: a promotion here since poisons the operation (:meth:`superseded`).
        self.epoch = int(hello.epoch)
        try:
            self.promotions = json.loads(hello.promotions_json) if hello.promotions_json else []
        except ValueError as exc:
            raise AcsOptionError(f"promotions_json: not JSON: {exc}", option="promotions_json") from exc
        self.target = (self.rel, self.storage)
        self.lease: Optional[MetadataLease] = None
        self.generation = 0
        self.position = 0
        #: The last block boundary of the file known at or before where this operation writes
        #: (a header walk, :meth:`walk`, or the end of a checked delta), whether the file is
        #: sealed there, and the message index after it (``None``: unknown; a file's first block
        #: holds its message 0). Once ``sealed``, nothing goes after ``boundary`` (:meth:`after_seal`).
        self.boundary = 0
        self.sealed = False
        self.next_index: Optional[int] = 0
        self._delay_published = 0.0

    def what(self) -> str:
        return f"copy of {self.uri} [{self.storage}] from {self.source}"

    def walk(self, stop: int) -> None:
        """Walk the file's block headers from :attr:`boundary` towards ``stop`` (the read side's
        block walk, :func:`walk_blocks`), moving :attr:`boundary`, :attr:`sealed` and
        :attr:`next_index`: through this cluster's durable copy of the file, then, past its
        end, through the source's store, which vouches for the file (a cache copy may lead the
        durable copy here, or be the only one). Stops at the file's first seal, or where
        neither store holds more."""
        paths = [self.s.durable_path]
        if self.s.source_store is not None:
            paths.append(DurableReadPath(self.s.source_store(self.source)))
        for path in paths:
            if self.sealed or self.boundary >= stop:
                return
            held = path.lengths([self.rel])[self.rel] or 0
            if held <= self.boundary:
                continue
            self.boundary, rows, _, self.sealed = walk_blocks(path, self.rel, self.boundary, min(stop, held))
            if self.next_index is not None:
                self.next_index += rows

    def after_seal(self, end: int) -> Optional[str]:
        """Why the bytes of a delta ending at ``end`` must not be written, or ``None``: the one
        rule of both writers that nothing may follow a seal. A file ends at its first seal
        (:mod:`pyspark_acs.read.positions`); bytes after it (a deposed writer's late block) are
        no part of the file, in no storage."""
        if self.sealed and end > self.boundary:
            return f"{self.uri} is sealed at byte {self.boundary}; nothing may follow the seal"
        return None

    def refuse(self, why: str) -> copy_pb2.CopyAck:
        """The answer to a delta that must not be written (nothing of it was written or
        published): FAILED, counted as ``delta_refused``, the same for both writers."""
        self.s.metrics.inc("errors_total", kind="delta_refused")
        log.warning("%s: delta refused: %s", self.what(), why)
        return _ack(copy_pb2.FAILED, self.position, f"delta refused: {why}")

    def vouch(self) -> Optional[int]:
        """The source's durable length of the file: the source must hold it (before anything
        is created here). ``None`` when this servicer has no way to ask (no topology).

        Raises
        ------
        AcsError
            When the source cluster is unknown or does not hold the file.
        """
        store_for = self.s.source_store
        if store_for is None:
            return None
        store = store_for(self.source)
        length = store.lengths([self.rel])[self.rel]
        if length is None:
            raise WriterConflictError(f"{self.what()}: the source cluster {self.source} does not hold this file")
        return length

    def take_lease(self) -> None:
        """Poison and take over the lease of an older operation on the same target."""
        self.generation = self.s.generations.claim(self.target)
        lease = self.io.meta.lease(
            f"{self.uri}#{self.storage}", self.operation, self.what(), seconds=self.s.options.lease_seconds
        )
        try:
            lease.acquire(timeout=3 * self.s.options.lease_seconds)
            self.lease = lease
        except CacheError as exc:
            # Availability first (paper section 3): leases only optimise; the start-position
            # check and the per-process generation keep a second writer from clobbering.
            log.warning("%s: metadata cache unavailable for the lease, writing without it: %s", self.what(), exc)

    def promoted_since(self) -> bool:
        """Whether the stream's epoch here is newer than this operation's, read afresh: asked
        right before bytes are written, after the checks that may wait on the source's store,
        so no delta begun before an ``acs promote`` fence lands after its settle wait."""
        return self.s.stream_epoch(self.stream, fresh=True) > self.epoch

    def refuse_stale(self) -> None:
        """Refuse an operation from an older epoch than the stream's here before it takes the
        lease (which would poison a current operation) or moves the retention floor."""
        here = self.s.stream_epoch(self.stream, fresh=True)
        if here > self.epoch:
            self.s.metrics.inc("errors_total", kind="stale_epoch")
            raise StaleEpochError(f"{self.what()}: a copy from cluster {self.source!r} at epoch {self.epoch}; the "
                                  f"stream is at epoch {here} here (promoted since): refused")

    def superseded(self) -> bool:
        """True when a newer operation took this target over (here or in another process)."""
        if self.s.generations.current(self.target) != self.generation:
            return True
        if self.s.stream_epoch(self.stream) > self.epoch:
            return True  # promoted since this operation began (storage/store.py create_stream)
        if self.lease is not None and self.lease.due():
            try:
                self.lease.check()
            except LeasePoisonedError:
                return True
            except CacheError as exc:
                log.debug("%s: lease check skipped, metadata cache unavailable: %s", self.what(), exc)
        return False

    def prepare_destination(self) -> None:
        """Make the stream findable in this cluster: _stream.json and the shard head."""
        if self.shards > 0:
            self.s.ensure_stream(self.stream, self.shards, self.source, self.epoch, self.promotions)
        try:
            self.io.meta.set_head(self.shard_uri, self.file)
        except CacheError as exc:
            log.debug("%s: head not set, metadata cache unavailable: %s", self.what(), exc)

    def note_delay(self, req: copy_pb2.CopyRequest, nbytes: int) -> None:
        self.s.metrics.inc("bytes_total", nbytes, stream=self.stream, source=self.source,
                           target=self.io.name, storage=self.storage)
        if req.last_timestamp_us <= 0:
            return
        delay = max(0.0, time.time() - req.last_timestamp_us / 1e6)
        self.s.metrics.set("delay_seconds", delay, stream=self.stream, shard=self.shard,
                           cluster=self.io.name, storage=self.storage)
        now = time.monotonic()
        if now - self._delay_published >= DELAY_PUBLISH_INTERVAL_S:
            self._delay_published = now
            try:
                publish_delay(self.io.meta, self.shard_uri, self.storage, delay, self.source)
            except CacheError:
                pass  # a metric only; the next delta tries again

    def open(self) -> copy_pb2.CopyAck:
        raise NotImplementedError

    def write(self, req: copy_pb2.CopyRequest) -> copy_pb2.CopyAck:
        raise NotImplementedError

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class _DurableWriter(_OpWriter):
    storage = DURABLE

    def __init__(self, servicer: "CopyServicer", hello: copy_pb2.CopyRequest) -> None:
        super().__init__(servicer, hello)
        self.out: Optional[FileWriter] = None

    def _publish_failed(self, what: str, exc: Exception) -> None:
        # Never fails the delta: readers of this cluster fall back to the store's length.
        self.s.metrics.inc("errors_total", kind="durable_publish")
        log.debug("%s: %s not published, metadata cache unavailable: %s", self.what(), what, exc)

    def open(self) -> copy_pb2.CopyAck:
        self.refuse_stale()
        self.vouch()
        self.take_lease()
        held = self._tiered_here()
        if held is not None:
            return held
        self._carry_retention_floor()
        self.prepare_destination()
        # Reopen the destination file: the length on disk is the truth (a restarted writer
        # may have left a partial delta; its bytes are a correct prefix of the source's).
        self.out = FileWriter(self.io.store, self.rel, meta=self.io.meta, on_cache_error=self._publish_failed)
        self.position = self.out.position
        # Where the blocks the destination holds end (a header walk): deltas are checked from there.
        self.walk(self.position)
        if self.position:
            # A writer killed between append and publish left the published length behind.
            self.out.publish()
            self.s.published(self.rel, durable_length=self.position)
        return _ack(copy_pb2.OK, self.position, durable_length=self.position)

    def _carry_retention_floor(self) -> None:
        """Files the source's retention deleted before this cluster copied them are missing
        here too: when this shard's newest file is older than the source's retention floor and
        the file about to be created is newer, record that floor here first, so a reader
        stepping from its file to the new one reports the loss (storage/tier.py
        retention_gap) instead of stepping over the gap."""
        store_for = self.s.source_store
        if store_for is None:
            return
        floor = retention_floor(store_for(self.source), self.stream, self.shard)
        if floor is None or self.file <= floor:
            return
        have = self.s.files.list_files(self.stream, self.shard)  # either tier
        if not have or have[-1] < floor:
            raise_retention_floor(self.io.store, self.stream, self.shard, floor)
            log.warning("%s: the source %s deleted files up to %s by retention before they were copied here "
                        "(readers here report the loss)", self.what(), self.source, floor)

    def _tiered_here(self) -> Optional[copy_pb2.CopyAck]:
        """The answer to a hello for a file this cluster's own tier mover tiered (which only
        sealed, whole files are): the whole length, and nothing opened or created in the hot
        store (the parent's reader then finishes the operation at the seal). ``None`` for any
        other file.

        The record decides, not the hot copy: the mover may delete the hot copy at any moment,
        and a hot copy found a moment ago and then opened for appending would be created again,
        empty, and the whole file asked for again from byte 0."""
        record = self.s.files.record(self.rel, fresh=True)
        if record is None:
            return None
        self.position = self.boundary = record.length
        self.sealed = True
        self.s.metrics.inc("errors_total", kind="tiered_here")
        log.info("%s: tiered here already (%d bytes, sealed); nothing to copy", self.what(), record.length)
        return _ack(copy_pb2.OK, record.length, durable_length=record.length)

    def _restart(self, start: int, actual: int) -> copy_pb2.CopyAck:
        kind = "gap" if start > actual else "overlap"
        self.s.metrics.inc("errors_total", kind=f"durable_{kind}")
        return _ack(copy_pb2.RESTART, actual, f"{kind}: delta starts at {start}, file has {actual} bytes")

    def write(self, req: copy_pb2.CopyRequest) -> copy_pb2.CopyAck:
        if self.out is None:  # _tiered_here: the file is complete here; never appended to
            return _ack(copy_pb2.FAILED, self.position, f"{self.what()}: the file is tiered here, complete "
                                                        f"at {self.position} bytes; nothing is appended to it")
        if self.superseded():
            return _ack(copy_pb2.POISONED, self.position, "a newer operation took this file over")
        if not req.data:
            actual = self.position = self.io.store.length(self.rel)
            if req.start != actual:
                return self._restart(req.start, actual)
            return _ack(copy_pb2.OK, actual)
        if req.start != self.position:
            actual = self.position = self.io.store.length(self.rel)
            if req.start != actual:
                return self._restart(req.start, actual)
        refused = self._check_delta(req)
        if refused is not None:
            return self.refuse(refused)
        if self.promoted_since():
            return _ack(copy_pb2.POISONED, self.position, "the stream was promoted since this operation began")
        # The delta must land exactly at the file's end: checked and appended under the
        # file's append lock, verified after, then the durable length is published
        # (FileWriter.append).
        self.out.durable.position = req.start
        try:
            self.position = self.out.append(req.data)
        except AppendLockBusyError as exc:
            # A writer stopped inside its append (an older operation's daemon, frozen) may
            # still land the same bytes: nothing is appended until it did or died.
            self.s.metrics.inc("errors_total", kind="durable_lock_busy")
            return _ack(copy_pb2.FAILED, self.position, str(exc))
        except AppendConflictError as exc:
            self.position = exc.actual_length
            return self._restart(req.start, exc.actual_length)
        self.boundary, self.sealed, self.next_index = self.position, self._delta_sealed, self._delta_next
        # The store has the bytes: this daemon's readers of the next hop may send them now.
        self.s.published(self.rel, durable_length=self.position)
        self.note_delay(req, len(req.data))
        return _ack(copy_pb2.OK, self.position)

    def _check_delta(self, req: copy_pb2.CopyRequest) -> Optional[str]:
        """Why the delta at ``req.start`` (the file's end) must not be appended, or ``None``."""
        end = req.start + len(req.data)
        refused = self.after_seal(end)
        if refused is not None:
            return refused
        source_length = self.vouch()
        if source_length is not None and end > source_length:
            return (f"the delta ends at byte {end} of {self.uri} but the source {self.source} holds "
                    f"{source_length} bytes of it")
        try:
            prefix = self.io.store.read(self.rel, self.boundary, req.start) if req.start > self.boundary else b""
            self._delta_sealed, self._delta_next, blocks = validate_delta(
                prefix, req.data, base=self.boundary, path=self.uri,
                next_index=self.next_index if req.start == self.boundary else None)
        except CorruptFileError as exc:
            return str(exc)
        if source_length is not None:
            # Each block's header (its lengths, index and both checksums) must be the source's
            # at the same position: 48 bytes read per block, not the delta again.
            store = self.s.source_store(self.source)
            buf = prefix + req.data
            for at in blocks:
                position = self.boundary + at
                if position < req.start:
                    continue  # the block the destination already holds the start of
                if store.read(self.rel, position, position + HEADER_SIZE) != buf[at:at + HEADER_SIZE]:
                    return (f"{self.uri} at byte {position}: the block differs from the source {self.source}'s "
                            f"block at that position")
        return None

    def close(self) -> None:
        if self.out is not None:
            try:
                self.out.close()
            except StoreError as exc:
                log.warning("%s: close failed: %s", self.what(), exc)
            self.out = None
        super().close()


class _CacheWriter(_OpWriter):
    storage = CACHE

    def __init__(self, servicer: "CopyServicer", hello: copy_pb2.CopyRequest) -> None:
        super().__init__(servicer, hello)
        self.mirror: Optional[CacheMirror] = None
        #: ``(sealed, next_index)`` after the delta being written, when it was checked from the
        #: known block boundary (it then becomes the boundary once written).
        self._checked: Optional[Tuple[bool, Optional[int]]] = None

    def _check_delta(self, req: copy_pb2.CopyRequest) -> Optional[str]:
        """Why a cache delta (or jump) must not be written, or ``None``.

        Nothing may follow the file's seal (:meth:`after_seal`, the durable writer's rule); a
        jump first walks the bytes it skips and its own (:meth:`walk`). From the known block
        boundary a delta must also be whole valid blocks continuing the file
        (:func:`validate_delta`), each header equal to the source's where the source's store
        already holds it; elsewhere (a jump, a resume inside a block the walk could not reach)
        its bytes are not checked."""
        end = req.start + len(req.data)
        if req.jump:
            self.walk(end)
        refused = self.after_seal(end)
        if refused is not None or req.jump or req.start != self.boundary:
            return refused
        try:
            sealed, next_index, blocks = validate_delta(b"", req.data, base=req.start, path=self.uri,
                                                        next_index=self.next_index)
        except CorruptFileError as exc:
            return str(exc)
        if self.s.source_store is not None:
            store = self.s.source_store(self.source)
            held = store.lengths([self.rel])[self.rel] or 0
            for at in blocks:
                position = req.start + at
                if position + HEADER_SIZE <= held and \
                        store.read(self.rel, position, position + HEADER_SIZE) != req.data[at:at + HEADER_SIZE]:
                    return (f"{self.uri} at byte {position}: the block differs from the source {self.source}'s "
                            f"block at that position")
        self._checked = (sealed, next_index)
        return None

    def _mirror(self, position: int, prefix: Optional[bytes] = b"") -> CacheMirror:
        """The file's chunks from ``position``; ``prefix=None`` reads that chunk's first bytes
        back from the durable store (the destination's durable copy is a prefix of the source)."""
        return CacheMirror(self.io.data, self.uri, position, prefix, store=self.io.store, rel=self.rel,
                           ttl=self.s.options.chunk_ttl)

    def open(self) -> copy_pb2.CopyAck:
        self.refuse_stale()
        self.vouch()
        self.take_lease()
        self.prepare_destination()
        durable = self.io.store.lengths([self.rel])[self.rel] or 0
        try:
            cache_len = self.io.meta.lengths([self.uri])[self.uri][0]
        except CacheError as exc:
            log.warning("%s: metadata cache unavailable: %s", self.what(), exc)
            cache_len = None
        position, prefix = durable, None
        if cache_len is not None and cache_len >= durable:
            need = cache_len % CHUNK_SIZE
            if need == 0:
                position, prefix = cache_len, b""
            else:
                # The partial chunk at the cache length is still in the cache, normally.
                try:
                    got = ChunkReader(self.io.data).read(self.uri, cache_len - need, cache_len)
                    if got and got[0][2] is not None:
                        position, prefix = cache_len, bytes(got[0][2])  # a view of the cache's answer
                except CacheError:
                    pass
                if prefix is None:
                    # Lost: continue from the next chunk boundary (never below the length
                    # already published; readers fetch the gap from the durable store).
                    position, prefix = cache_len - need + CHUNK_SIZE, b""
        jumped = prefix is None
        if jumped:
            # The cache lost the file (or never had it, or lags the durable copy): jump to the
            # durable position with that chunk's prefix from the durable store (paper section 3).
            position = durable
        self.mirror = self._mirror(position, prefix)
        self.position = position
        # Where the file's blocks end below the position, and whether it is sealed there: the
        # copy may resume after the seal (a reader reconnecting after its acknowledgement was
        # lost); nothing may follow it.
        self.walk(position)
        if jumped and position > (cache_len or 0):
            # "... and the length in the metadata cache is updated accordingly" (paper
            # section 3): publish the jump now. Waiting for the next delta is not enough: when
            # the durable copy already holds the whole (sealed) file no delta follows, the
            # reader ends at once, and the cache length would never be published.
            try:
                self.mirror.append(b"")  # the partial chunk at the position, from its start
                self.io.meta.publish(self.uri, cache_length=position)
                self.s.published(self.rel, cache_length=position)
            except CacheError as exc:
                self.s.metrics.inc("errors_total", kind="cache_write")
                return _ack(copy_pb2.FAILED, position, f"cache start at the durable length {position} not published: {exc}")
        return _ack(copy_pb2.OK, position, durable_length=durable)

    def write(self, req: copy_pb2.CopyRequest) -> copy_pb2.CopyAck:
        if self.superseded():
            return _ack(copy_pb2.POISONED, self.position, "a newer operation took this file over")
        if req.jump:
            if req.start % CHUNK_SIZE or req.start < self.position:
                return _ack(copy_pb2.RESTART, self.position, f"bad jump to {req.start}")
        elif req.start != self.position:
            self.s.metrics.inc("errors_total", kind="cache_restart")
            return _ack(copy_pb2.RESTART, self.position, f"delta starts at {req.start}, cache copy is at {self.position}")
        self._checked = None
        refused = self._check_delta(req) if req.data or req.jump else None
        if refused is not None:
            return self.refuse(refused)  # before the mirror moves: nothing written, nothing published
        if self.promoted_since():
            return _ack(copy_pb2.POISONED, self.position, "the stream was promoted since this operation began")
        if req.jump:
            self.mirror = self._mirror(req.start)
            self.position = req.start
        try:
            if req.data:
                self.mirror.append(req.data)
            self.io.meta.publish(self.uri, cache_length=self.mirror.position)
        except CacheError as exc:
            # Not every chunk below the new length is known written: do not publish; the
            # reader reconnects and the hello works out the start again.
            self.s.metrics.inc("errors_total", kind="cache_write")
            return _ack(copy_pb2.FAILED, self.position, f"cache write failed: {exc}")
        self.position = self.mirror.position
        if self._checked is not None:
            self.boundary = self.position
            self.sealed, self.next_index = self._checked
        self.s.published(self.rel, cache_length=self.position, data=(req.start, req.data))
        self.note_delay(req, len(req.data))
        return _ack(copy_pb2.OK, self.position)


class CopyServicer(copy_pb2_grpc.CopyServicer):
    """The ``Copy`` gRPC service of one cluster's daemon.

    Parameters
    ----------
    io : ClusterIO
        This (destination) cluster's storage.
    options : CopyDaemonOptions
    metrics : CopyMetrics
    reading : callable
        Returns how many operations this daemon reads now (for Health).
    on_published : callable, optional
        ``on_published(rel, cache_length=None, durable_length=None, data=None)`` after every length a
        writer published (the daemon's :meth:`SourceFiles.notify
        <pyspark_acs.server.copy.reader.SourceFiles.notify>`: the readers of the next hop
        send the bytes at once instead of at their next poll).
    """

    def __init__(self, io: ClusterIO, options: CopyDaemonOptions, metrics: CopyMetrics, reading=lambda: 0,
                 on_published: Optional[Callable[..., None]] = None,
                 source_store: Optional[Callable[[str], DurableStore]] = None,
                 max_streams: Optional[int] = None) -> None:
        #: ``source_store(cluster)``: that cluster's durable store, which vouches for the files
        #: and lengths its copies send (``None``: not checked).
        self.source_store = source_store
        #: Copy streams served at once at most (``None``: unbounded).
        self.max_streams = max_streams
        self.io = io
        self.options = options
        self.metrics = metrics
        self.generations = _Generations()
        self._reading = reading
        self._on_published = on_published
        # _lock guards _streams (streams whose _stream.json exists here), _refused (streams this
        # cluster's own history keeps from being copies: said once), _writing and _sealed_files.
        self._lock = threading.Lock()
        self._streams: Dict[str, Tuple[tuple, float]] = {}
        #: stream -> (epoch, monotonic time read): :meth:`stream_epoch`.
        self._epochs: Dict[str, Tuple[int, float]] = {}
        self._refused: Set[str] = set()
        #: One quarantine per stream at a time (:meth:`_quarantine`), and its wait between
        #: recording the ranges and moving the files.
        self._quarantine_locks: Dict[str, threading.Lock] = {}
        self.quarantine_settle = QUARANTINE_SETTLE_S
        #: Files found sealed here, with their length (a sealed file never changes).
        self._sealed_files: LRUCache = LRUCache(maxsize=SEALED_FILES_REMEMBERED)
        #: This cluster's files in either tier (its own tier mover may have moved sealed files
        #: to the secondary store): what :meth:`Files` lists, and the seal walks read
        #: (never closed: the store is io's). Writes go to ``io.store``, the hot store.
        self.files = tiered_store(io.store)
        self.durable_path = DurableReadPath(self.files)
        self._writing = 0
        self._streams_open = 0
        self.serving = True
        #: The topology file this daemon runs (:attr:`Topology.sha256`), for Health.
        self.topology_sha256 = ""

    def published(self, rel: str, cache_length: Optional[int] = None, durable_length: Optional[int] = None,
                  data: Optional[Tuple[int, bytes]] = None) -> None:
        """A writer published a length of ``rel`` (or appended it to the store); ``data`` =
        ``(start, bytes)`` it wrote to the cache."""
        if self._on_published is not None:
            try:
                self._on_published(rel, cache_length=cache_length, durable_length=durable_length, data=data)
            except Exception:  # a wake-up only: never fail a write for it
                log.exception("on_published hook failed for %s", rel)

    def stream_epoch(self, stream: str, fresh: bool = False) -> int:
        """The stream's promotion count here (``_stream.json`` ``epoch``), read again at most
        every :data:`EPOCH_RECHECK_S`: an operation begun at an older epoch is poisoned within
        that long of an ``acs promote`` (which waits longer before it measures the prefixes)."""
        now = time.monotonic()
        with self._lock:
            known = self._epochs.get(stream)
        if known is not None and not fresh and now - known[1] < EPOCH_RECHECK_S:
            return known[0]
        try:
            meta = self.io.store.stream_meta(stream) or {}
        except AcsError as exc:
            log.debug("%s: stream %s: epoch not read again: %s", self.io.name, stream, exc)
            return known[0] if known is not None else 0
        epoch = stream_epoch(meta)
        with self._lock:
            self._epochs[stream] = (epoch, now)
        self.note_quarantine(stream, meta)
        return epoch

    def note_quarantine(self, stream: str, meta: Optional[dict] = None) -> None:
        """Set ``quarantined_bytes`` of the stream's shards from its ``_stream.json`` (read when
        not given): the metric shows what this cluster holds quarantined, whichever process
        moved it (the daemon reads every stream's metadata when it starts)."""
        if meta is None:
            try:
                meta = self.io.store.stream_meta(stream) or {}
            except AcsError as exc:
                log.debug("%s: stream %s: quarantine not read: %s", self.io.name, stream, exc)
                return
        by_shard: Dict[int, int] = {}
        for e in quarantine_entries(meta, moved_only=True):
            by_shard[int(e["shard"])] = by_shard.get(int(e["shard"]), 0) + int(e["end"]) - int(e["start"])
        for shard, total in by_shard.items():
            self.metrics.set("quarantined_bytes", total, stream=stream, shard=shard)

    def _quarantine(self, stream: str, epoch: int, promotions: Sequence[dict]) -> Optional[List[dict]]:
        """Before this cluster takes the newer ``epoch`` from its parent: move its bytes past
        the cut of every promotion it missed aside, in the order of
        :mod:`pyspark_acs.server.copy.quarantine` (fence, seal its own open files, find,
        record, let readers see the record, move, purge the caches). Returns the entries the
        adoption records (None: nothing to quarantine, or this cluster is refused anyway).
        One per stream at a time; a run that stopped is taken up where it was."""
        from pyspark_acs.server.copy.promote import seal_open_files
        from pyspark_acs.server.copy.quarantine import describe, entries, move_past_cut, past_cuts

        with self._lock:
            lock = self._quarantine_locks.setdefault(stream, threading.Lock())
        with lock:
            store = self.io.store
            meta = store.stream_meta(stream)
            here = stream_epoch(meta)
            if meta is None or here >= epoch:
                return None
            missed = [r for r in promotions if int(r.get("epoch") or 0) > here]
            own = not meta.get("copied_from")
            if own and not any(r.get("previous") == self.io.name for r in missed):
                return None  # this cluster's own history, not the deposed source: refused as such
            shards = int(meta["shards"])
            pending = meta.get("quarantine") or {}
            if int(pending.get("epoch") or 0) != epoch or "files" not in pending:
                when = record_time()
                # 1. Fence: no writer starts a file here from now on (ShardWriter._start_file).
                store.update_stream_meta(stream, lambda m: dict(m, quarantine={"epoch": epoch, "at": when}))
                if own:  # this cluster's writers: sealed out, as at a take-over
                    for shard in range(shards):
                        seal_open_files(store, stream, shard, self.io, None, lambda line: log.info("%s", line),
                                        who=f"quarantine_{self.io.name}")
                # 2-3. Find, record; then readers stop at each range's start.
                found = past_cuts(self.files, stream, shards, missed)
                moving = entries(found, stream, missed[-1], when)
                store.update_stream_meta(stream, lambda m: dict(
                    m, quarantine={"epoch": epoch, "at": when, "files": moving, "since": time.time()}))
                pending = {"files": moving, "since": time.time()}
            moving = list(pending["files"])
            if not moving:
                return []
            left = self.quarantine_settle - (time.time() - float(pending.get("since") or 0))
            if left > 0:
                time.sleep(min(left, self.quarantine_settle))
            # 4. Move, then drop the moved files' cache entries.
            move_past_cut(store, stream, moving)
            with self._lock:
                for entry in moving:
                    self._sealed_files.pop(f"{shard_dir(stream, int(entry['shard']))}/{entry['file']}", None)
            self._purge_caches(stream, moving)
            log.error("%s: stream %s: bytes past the cut of promotion epoch %s (new source %s) are a history that "
                      "did not happen; moved aside, never copied on or served: %s. Readers positioned in them get "
                      "a DataLossError naming them; the new history is copied here from byte 0 of each such file",
                      self.io.name, stream, epoch, moving[-1].get("source"), describe(moving, store.uri))
            return moving

    def _adoptable(self, stream: str, moved: Optional[List[dict]]) -> Callable[[dict], Optional[Dict[str, object]]]:
        """The keys the adoption of a newer epoch writes besides it: the quarantine's entries
        kept as ``quarantined`` (with those of earlier epochs), the fence removed."""

        def adopt(existing: dict) -> Optional[Dict[str, object]]:
            if moved is None and "quarantine" not in existing:
                return None
            done = moved or []
            epochs = {e.get("epoch") for e in done}
            kept = [e for e in existing.get("quarantined") or [] if e.get("epoch") not in epochs]
            out: Dict[str, object] = {"quarantine": None}
            if kept or done:
                out["quarantined"] = kept + done
            self.note_quarantine(stream, {"quarantined": kept + done})
            return out

        return adopt

    def _purge_caches(self, stream: str, moved: Sequence[dict]) -> None:
        """Drop this cluster's cached chunks, boundary keys, lengths and shard heads of the quarantined files:
        lengths only grow in the cache (versioned by length) and chunks are keyed by file, so
        the new history's shorter copy of a file would otherwise be read with the old bytes.
        A cache that does not answer is logged (its entries expire with their time to live)."""
        from pyspark_acs.cache.chunks import boundary_key, chunk_keys, chunk_range, file_id
        from pyspark_acs.cache.metadata import head_key, length_keys

        chunks: List[bytes] = []
        meta: List[bytes] = []
        for entry in moved:
            uri = self.io.uri(f"{shard_dir(stream, int(entry['shard']))}/{entry['file']}")
            chunks += chunk_keys(uri, chunk_range(0, int(entry["end"]) + CHUNK_SIZE))
            chunks.append(boundary_key(file_id(uri)))  # the old writer's: a reader at latest would join there
            meta += list(length_keys(uri))
        for shard in sorted({int(e["shard"]) for e in moved}):
            meta.append(head_key(self.io.shard_uri(stream, shard)))
        for client, keys in ((self.io.data, chunks), (self.io.meta_client, meta)):
            try:
                client.delete(keys)
            except CacheError as exc:
                log.warning("%s: stream %s: quarantined files' entries not removed from %s (they expire with "
                            "their time to live; until then a reader there may be told a file is longer than it "
                            "is): %s", self.io.name, stream, client.name, exc)

    def ensure_stream(self, stream: str, shards: int, source: str, epoch: int = 0,
                      promotions: Sequence[dict] = ()) -> None:
        """Create ``stream`` with ``shards`` shards in this cluster's store, or check that it matches.

        ``source`` (the cluster it is copied from) goes into a stream created here, so that a
        Producer or sink is refused it; ``epoch`` and ``promotions`` are the source cluster's
        (the epoch rule: :meth:`DurableStore.create_stream`). Remembered per servicer for
        :data:`EPOCH_RECHECK_S`: a stream just checked with these values is not asked again.

        Raises
        ------
        AcsOptionError
            If the stream exists with another shard count.
        StoreError
            If the store fails.
        """
        checked = (shards, source, epoch, json.dumps(list(promotions)))
        with self._lock:
            known = self._streams.get(stream)
            if known is not None and known[0] == checked and time.monotonic() - known[1] < EPOCH_RECHECK_S:
                return
        try:
            moved = self._quarantine(stream, epoch, promotions) if epoch else None
            self.io.store.create_stream(stream, shards, copied_from=source, epoch=epoch, promotions=promotions,
                                        cluster=self.io.name, on_adopt=self._adoptable(stream, moved))
        except StaleEpochError as exc:
            self.metrics.inc("errors_total", kind="stale_epoch")
            with self._lock:
                first = stream not in self._refused
                self._refused.add(stream)
            (log.error if first else log.debug)("%s: %s", self.io.name, exc)
            raise
        except AcsOptionError as exc:
            with self._lock:
                first = stream not in self._refused
                self._refused.add(stream)
            if first:  # each operation is refused again; the log says it once per stream
                log.error("%s: %s", self.io.name, exc)
            raise
        with self._lock:
            self._streams[stream] = (checked, time.monotonic())
            self._refused.discard(stream)

    def Copy(self, request_iterator: Iterator[copy_pb2.CopyRequest], context: grpc.ServicerContext):  # noqa: N802
        """Serve one copy operation: a hello, then deltas, each answered with one acknowledgement.

        The hello takes the operation's lease and is answered with the length to continue from.
        Each delta is answered OK, RESTART (it does not start where the copy is: continue from
        the acknowledged length), POISONED (a newer operation took the file over) or FAILED;
        the stream ends after POISONED or FAILED. Store and cache errors are reported as FAILED
        acknowledgements, not raised.
        """
        with self._lock:
            if self.max_streams is not None and self._streams_open >= self.max_streams:
                full = True
            else:
                full = False
                self._streams_open += 1
        if full:
            self.metrics.inc("errors_total", kind="streams_exhausted")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"copy daemon of {self.io.name}: {self.max_streams} copy streams open; try again later")
        try:
            yield from self._copy(request_iterator, context)
        finally:
            with self._lock:
                self._streams_open -= 1

    def _copy(self, request_iterator: Iterator[copy_pb2.CopyRequest], context: grpc.ServicerContext):
        # An idle stream that never says hello would hold a server thread: cancel it.
        timer = threading.Timer(HELLO_TIMEOUT_S, context.cancel) if context is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            hello = next(request_iterator)
        except (StopIteration, grpc.RpcError):  # ended, or cancelled by the timer
            return
        finally:
            if timer is not None:
                timer.cancel()
        if not hello.hello:
            yield _ack(copy_pb2.FAILED, 0, "the first message of an operation must be a hello")
            return
        cls = _DurableWriter if hello.storage == copy_pb2.DURABLE else _CacheWriter
        try:
            writer = cls(self, hello)
        except (AcsError, ValueError) as exc:
            yield _ack(copy_pb2.FAILED, 0, f"bad operation: {exc}")
            return
        with self._lock:
            self._writing += 1
        self.metrics.inc("operations", 1, role="writer", storage=writer.storage)
        try:
            try:
                ack = writer.open()
            except WriterConflictError as exc:
                if not isinstance(exc, StaleEpochError):  # counted as stale_epoch where it is refused
                    self.metrics.inc("errors_total", kind="lease_conflict")
                yield _ack(copy_pb2.FAILED, 0, str(exc))
                return
            except AcsError as exc:
                self.metrics.inc("errors_total", kind="writer_open")
                yield _ack(copy_pb2.FAILED, 0, f"cannot open {writer.what()}: {exc}")
                return
            yield ack
            if ack.status != copy_pb2.OK:
                return
            for req in request_iterator:
                try:
                    ack = writer.write(req)
                except AcsError as exc:
                    log.warning("%s: write failed: %s", writer.what(), exc)
                    self.metrics.inc("errors_total", kind="writer_write")
                    ack = _ack(copy_pb2.FAILED, writer.position, f"write failed: {exc}")
                yield ack
                if ack.status in (copy_pb2.POISONED, copy_pb2.FAILED):
                    return
        finally:
            writer.close()
            self.metrics.inc("operations", -1, role="writer", storage=writer.storage)
            with self._lock:
                self._writing -= 1

    def Files(self, request: copy_pb2.FilesRequest, context: grpc.ServicerContext) -> copy_pb2.FilesResponse:  # noqa: N802
        """The files of one shard in this cluster (hot or tiered): name, length, sealed.

        A parent asks once when it starts feeding this cluster (a restart, a tree change), so it
        need not run one operation per file to learn which files exist here (the file order
        rule) and which are complete. Whether a file is sealed follows the read side's seal
        rule (:func:`pyspark_acs.read.positions.ends_with_seal`); a sealed file never changes,
        so the answer is remembered.
        """
        try:
            stream = validate_stream(request.stream)
            shard = validate_shard(request.shard)
        except (AcsError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad Files request: {exc}")
        if request.epoch and request.source_cluster and request.shards and self.stream_epoch(stream) < request.epoch:
            # Take the parent's newer epoch first (quarantining bytes past its cut), so the
            # files listed are the new history's: a file listed sealed here is never copied.
            try:
                promotions = json.loads(request.promotions_json or "[]")
                if self.io.store.stream_meta(stream) is not None:
                    self.ensure_stream(stream, request.shards, request.source_cluster, request.epoch, promotions)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad Files request: promotions_json: {exc}")
            except AcsError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        try:
            names = self.files.list_files(stream, shard)
            rels = [f"{shard_dir(stream, shard)}/{name}" for name in names]
            lengths = self.files.lengths(rels) if rels else {}
            files = []
            for name, rel in zip(names, rels):
                length = lengths.get(rel)
                if length is None:
                    continue  # deleted since the listing
                files.append(copy_pb2.FileState(name=name, durable_length=length, sealed=self._sealed(rel, length)))
            # A kept file a quarantine moved aside is the new history's, to be copied again from
            # byte 0: listed as present and empty, so the parent copies it (it is neither done
            # here nor below a retention floor).
            listed = set(names)
            for entry in quarantine_entries(self.io.store.stream_meta(stream), shard):
                if entry.get("kept") and entry["file"] not in listed:
                    listed.add(entry["file"])
                    files.append(copy_pb2.FileState(name=entry["file"], durable_length=0, sealed=False))
            files.sort(key=lambda f: f.name)
        except AcsError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot list {self.io.shard_uri(stream, shard)}: {exc}")
        return copy_pb2.FilesResponse(files=files)

    def _sealed(self, rel: str, length: int) -> bool:
        with self._lock:
            if self._sealed_files.get(rel) == length:
                return True
        if length == 0 or not ends_with_seal(self.durable_path, rel, length):
            return False
        with self._lock:
            self._sealed_files[rel] = length
        return True

    def Health(self, request: copy_pb2.HealthRequest, context: grpc.ServicerContext) -> copy_pb2.HealthResponse:  # noqa: N802
        """Whether this daemon serves (False once stopping), its cluster, and its running operations.

        ``reading`` and ``writing`` count the operations it reads (as a parent) and writes now;
        ``topology_sha256`` names the topology file it runs.
        """
        with self._lock:
            writing = self._writing
        return copy_pb2.HealthResponse(
            serving=self.serving, cluster=self.io.name, reading=int(self._reading()), writing=writing,
            topology_sha256=self.topology_sha256,
        )
