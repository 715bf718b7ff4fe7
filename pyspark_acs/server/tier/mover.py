"""The tier mover: sealed files of tiered streams go to the secondary store, then retention.

One pass over a stream (:meth:`TierMover.run_stream`), under the stream's tier lease:

1. **Upload.** Per shard, the files not yet recorded, oldest first, up to the first file the
   read side's seal rule does not prove sealed at its end
   (:class:`~pyspark_acs.read.positions.BoundaryCache`, the walk ``ShardExtent.latest`` uses;
   an unsealed file and everything after it wait). Consecutive sealed files are packed into
   one object up to ``batch_bytes`` (the RocketMQ tiered-storage article's batched uploads:
   fewer requests per byte); pyarrow uploads large objects as multipart uploads, which S3
   shows only once complete.
2. **Verify.** The object is read back: its size, the whole-file crc32 of every file in it
   against the crc32 of the hot bytes, and each block's body checksum
   (:func:`~pyspark_acs.format.block.check_block_bodies`).
3. **Record** (data before index): only a verified object gets tier records in the shard's
   ``_tiered.json``. Readers never read an object no record names, so a partial object (a
   mover killed mid-upload, an upload whose outcome is unknown) is never seen.
4. **Non-stop-write** (the RocketMQ article, section 3.3): an upload that fails, whether or not its bytes
   landed, or fails verification, is abandoned -- never retried over the same object -- and
   the batch goes up at once under a new object name. Abandoned objects are swept once no
   record names them and they are older than ``orphan_grace_s``.
5. **Retention** (:class:`~pyspark_acs.storage.tier.TierSettings`): a hot copy is deleted
   only when its file has a record (verified) whose length equals the hot file's, and it is
   older than ``hot_retention_s`` or the stream's hot bytes exceed ``hot_retention_bytes``
   (a shard's newest file always stays hot: writers name new files after it);
   files older than ``secondary_retention_s`` leave both tiers (hot copy, then record, then
   the object once unreferenced).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pyarrow.fs as pafs

from pyspark_acs.errors import AcsError, CorruptFileError, StoreError
from pyspark_acs.format.block import HEADER_SIZE, check_block_bodies, parse_header, scan_blocks
from pyspark_acs.format.checksum import crc32
from pyspark_acs.format.names import new_writer_id, shard_dir
from pyspark_acs.read.positions import BoundaryCache
from pyspark_acs.read.readpath import DurableReadPath, RateLimiter
from pyspark_acs.server.metrics import TIER_METRICS, Metrics
from pyspark_acs.storage.leases import StoreLease
from pyspark_acs.storage.store import DurableStore, _translate, open_store  # noqa: F401 (DurableStore: annotations)
from pyspark_acs.storage.tier import (
    TierRecord,
    TierSettings,
    TierStore,
    TierUploadError,
    encode_header_index,
    raise_retention_floor,
    read_manifest,
    stream_tier_settings,
    write_manifest,
)

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DEFAULT_ORPHAN_GRACE_S",
    "DEFAULT_TIER_LEASE_S",
    "PassReport",
    "TierMover",
]

log = logging.getLogger(__name__)

#: Consecutive sealed files of a shard are packed into one object up to this many bytes.
DEFAULT_BATCH_BYTES = 64 * 1024 * 1024
#: Bytes read from the hot store and written to the upload at a time (pyarrow turns the
#: stream into a multipart upload of 10 MiB parts on S3).
UPLOAD_PART_BYTES = 8 * 1024 * 1024
#: Uploads of one batch per pass (each under a new object name) before waiting for the next pass.
DEFAULT_UPLOAD_ATTEMPTS = 3
#: Objects no record names are deleted once older than this (seconds): longer than any
#: upload in flight, so the sweep never takes an object whose record is about to be written.
DEFAULT_ORPHAN_GRACE_S = 3600.0
#: How long a stream's tier lease lasts (seconds); renewed every third of it.
DEFAULT_TIER_LEASE_S = 30.0
#: The stream's tier lease (one mover per stream), in the stream folder of the hot store.
TIER_LEASE_FILE = "_tier.lease"


#: Prefix of every tier-mover metric (declared in :data:`pyspark_acs.server.metrics.TIER_METRICS`).
TIER_PREFIX = "acs_tier_"


@dataclass
class PassReport:
    """What one pass over a stream did (counts).

    ``abandoned_objects`` = ``upload_failures`` (the upload failed; its bytes may have landed)
    + ``verify_failures`` (the object read back differs from the hot files).
    """

    uploaded_files: int = 0
    uploaded_bytes: int = 0
    objects: int = 0
    abandoned_objects: int = 0
    upload_failures: int = 0
    verify_failures: int = 0
    hot_deleted: int = 0
    secondary_deleted: int = 0
    swept_objects: int = 0
    waiting_unsealed: int = 0
    failed_streams: int = 0

    def add(self, other: "PassReport") -> None:
        """Add ``other``'s counts to this report."""
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)


#: The report fields exported as metrics: field -> (metric of TIER_METRICS, its labels besides
#: ``stream``). :meth:`TierMover._count` adds to both, so the report and /metrics agree.
_REPORT_METRICS: Dict[str, Tuple[str, Dict[str, str]]] = {
    "uploaded_files": ("files_tiered_total", {}),
    "uploaded_bytes": ("bytes_tiered_total", {}),
    "objects": ("objects_total", {}),
    "upload_failures": ("upload_failures_total", {}),
    "verify_failures": ("verify_failures_total", {}),
    "hot_deleted": ("retention_deleted_total", {"tier": "hot"}),
    "secondary_deleted": ("retention_deleted_total", {"tier": "secondary"}),
    "swept_objects": ("swept_objects_total", {}),
    "failed_streams": ("failed_passes_total", {}),
}


def tier_metrics() -> Metrics:
    """A new registry of the tier mover's metrics (``acs_tier_*``)."""
    return Metrics(TIER_PREFIX, TIER_METRICS)


class TierMover:
    """Moves sealed files of tiered streams to their secondary store, and applies retention.

    Parameters
    ----------
    root : str or DurableStore
        The hot store.
    streams : list of str, optional
        Streams to serve (default: every stream with a tier configured).
    batch_bytes : int
        Pack consecutive sealed files up to this many bytes per object.
    upload_bytes_per_second : float, optional
        Upload rate cap (default none).
    orphan_grace_s : float
        Age after which an object no record names is deleted.
    upload_attempts : int
        New-object uploads of one batch per pass.
    tier_factory : callable, optional
        ``uri -> TierStore`` (default :class:`TierStore`): how the secondary store is opened.
    clock : callable
        ``time.time`` (retention ages).
    lease_seconds : float
        The stream's tier lease: a mover that died holds it this long.
    metrics : Metrics, optional
        Where counts, tier lag and pass durations go (default: a registry of its own,
        :func:`tier_metrics`); ``acs-tier-mover`` serves it on ``/metrics``.
    """

    def __init__(
        self,
        root: "str | DurableStore",
        streams: Optional[List[str]] = None,
        *,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        upload_bytes_per_second: Optional[float] = None,
        orphan_grace_s: float = DEFAULT_ORPHAN_GRACE_S,
        upload_attempts: int = DEFAULT_UPLOAD_ATTEMPTS,
        tier_factory: Optional[Callable[[str], TierStore]] = None,
        clock: Callable[[], float] = time.time,
        lease_seconds: float = DEFAULT_TIER_LEASE_S,
        metrics: Optional[Metrics] = None,
    ) -> None:
        self.store = open_store(root, create=False)
        self.path = DurableReadPath(self.store)  # the seal rule is proven on the hot store itself
        self._boundaries = BoundaryCache()  # per file: the last block boundary walked to, sealed or not
        self.streams = streams
        self.batch_bytes = batch_bytes
        self.limiter = RateLimiter(upload_bytes_per_second)
        self.orphan_grace_s = orphan_grace_s
        self.upload_attempts = max(1, upload_attempts)
        self._tier_factory = tier_factory or TierStore
        self._tiers: Dict[str, TierStore] = {}
        self.clock = clock
        self.writer = new_writer_id()
        self._leases: Dict[str, StoreLease] = {}
        self.lease_seconds = lease_seconds
        self.metrics = metrics if metrics is not None else tier_metrics()
        # _lag_lock guards _lag and last_failed (the pass thread writes them, /healthz reads them).
        self._lag_lock = threading.Lock()
        #: Per stream, per shard: sealed files not yet tiered, their bytes, and whether the shard
        #: waits for an unsealed file (the lag gauges sum them per stream).
        self._lag: Dict[str, Dict[int, Tuple[int, int, int]]] = {}
        #: Streams whose pass failed in the last :meth:`run_once`, with the error.
        self.last_failed: Dict[str, str] = {}

    # -- the daemon loop ------------------------------------------------------------------------

    def run_once(self) -> PassReport:
        """One pass over every served stream; a stream whose pass fails is logged and skipped
        (the next pass retries it). Returns the summed counts."""
        started = time.monotonic()
        total = PassReport()
        failed: Dict[str, str] = {}
        for stream in self.streams if self.streams is not None else self.store.list_streams():
            try:
                settings = stream_tier_settings(self.store, stream)
                if not settings.enabled:
                    self._forget_lag(stream)
                    continue
                total.add(self.run_stream(stream, settings))
            except AcsError as exc:
                self._count(total, stream, "failed_streams")
                failed[stream] = str(exc)
                log.warning("tier pass of stream %r failed (retried next pass): %s", stream, exc)
        with self._lag_lock:
            self.last_failed = failed
        self.metrics.observe("pass_seconds", time.monotonic() - started)
        self.metrics.set("last_pass_timestamp_seconds", time.time())
        return total

    # -- counts and lag -------------------------------------------------------------------------

    def _count(self, report: PassReport, stream: str, field: str, n: int = 1) -> None:
        """Add ``n`` to ``report.field`` and to its metric (:data:`_REPORT_METRICS`)."""
        setattr(report, field, getattr(report, field) + n)
        metric = _REPORT_METRICS.get(field)
        if metric is not None and n:
            self.metrics.inc(metric[0], n, stream=stream, **metric[1])

    def _set_lag(self, stream: str, shard: int, files: int, nbytes: int, unsealed: int) -> None:
        """Record a shard's tier lag and export the stream's sums."""
        with self._lag_lock:
            shards = self._lag.setdefault(stream, {})
            shards[shard] = (files, nbytes, unsealed)
            sums = [sum(v[i] for v in shards.values()) for i in range(3)]
        self.metrics.set("lag_files", sums[0], stream=stream)
        self.metrics.set("lag_bytes", sums[1], stream=stream)
        self.metrics.set("waiting_unsealed", sums[2], stream=stream)

    def _forget_lag(self, stream: str) -> None:
        """A stream this mover does not tier (any more): no lag series for it."""
        with self._lag_lock:
            known = self._lag.pop(stream, None) is not None
        if known:
            for name in ("lag_files", "lag_bytes", "waiting_unsealed"):
                self.metrics.remove(name, stream=stream)

    def lag(self) -> Dict[str, Tuple[int, int]]:
        """Per stream: ``(files, bytes)`` sealed and not yet tiered, as the last pass saw them
        (thread-safe)."""
        with self._lag_lock:
            return {stream: (sum(v[0] for v in shards.values()), sum(v[1] for v in shards.values()))
                    for stream, shards in self._lag.items()}

    def close(self) -> None:
        """Give up the tier leases this mover holds."""
        for lease in self._leases.values():
            try:
                lease.release()
            except AcsError as exc:
                log.warning("releasing %s: %s", lease.what, exc)
        self._leases.clear()

    def _lease(self, stream: str) -> StoreLease:
        lease = self._leases.get(stream)
        if lease is None:
            lease = StoreLease(self.store, f"{stream}/{TIER_LEASE_FILE}", self.writer,
                               f"tier mover of stream {stream!r}", seconds=self.lease_seconds)
            lease.acquire()  # WriterConflictError: another mover serves it
            self._leases[stream] = lease
        elif lease.due():
            lease.renew()
        return lease

    def _tier(self, uri: str) -> TierStore:
        t = self._tiers.get(uri)
        if t is None:
            t = self._tiers[uri] = self._tier_factory(uri)
        return t

    # -- one stream ---------------------------------------------------------------------------------

    def run_stream(self, stream: str, settings: Optional[TierSettings] = None) -> PassReport:
        """Upload, verify and record the sealed files of ``stream``, then apply its retention."""
        settings = settings or stream_tier_settings(self.store, stream)
        report = PassReport()
        if not settings.enabled:
            self._forget_lag(stream)
            return report
        lease = self._lease(stream)
        tier = self._tier(settings.uri)
        owner = settings.owner or "x"  # settings written before owner ids: sweeps stay within "x"
        shards = self.store.stream_shards(stream) or 0
        manifests = {}
        for shard in range(shards):
            manifests[shard] = self._upload_shard(stream, shard, tier, lease, report, owner)
        self._retention(stream, settings, manifests, report)
        self._sweep(stream, tier, manifests, report, owner)
        return report

    def _upload_shard(self, stream: str, shard: int, tier: TierStore, lease: StoreLease,
                      report: PassReport, owner: str) -> Dict[str, TierRecord]:
        records = read_manifest(self.store, stream, shard)
        folder = shard_dir(stream, shard)
        pending = [f for f in self.store.list_files(stream, shard) if f not in records]
        lengths = self.store.lengths([f"{folder}/{f}" for f in pending])
        ready: List[Tuple[str, int]] = []
        unsealed = 0
        for name in pending:
            n = lengths.get(f"{folder}/{name}")
            if n is None:
                continue  # gone meanwhile
            # The read side's seal rule; the walk resumes where the last pass left the file.
            end, sealed = self._boundaries.boundary(self.path, f"{folder}/{name}", n)
            if not sealed:
                report.waiting_unsealed += 1
                unsealed = 1
                break  # the seal rule: this file and every later one wait
            # The file ends at its seal: bytes after it (a deposed writer's late append on a
            # store without the local append lock) are never read, so they are not tiered, and
            # they must not hold this file and every later one back as if it were unsealed.
            ready.append((name, end))
        lag_files, lag_bytes = len(ready), sum(n for _, n in ready)
        self._set_lag(stream, shard, lag_files, lag_bytes, unsealed)
        for batch in self._batches(ready):
            if lease.due():
                lease.renew()
            new = self._move_batch(stream, shard, tier, batch, report, owner)
            if new is None:
                break  # keep order: later files wait for this batch
            records.update(new)
            write_manifest(self.store, stream, shard, records)  # the index, after the data
            nbytes = sum(n for _, n in batch)
            self._count(report, stream, "uploaded_files", len(new))
            self._count(report, stream, "uploaded_bytes", nbytes)
            self._count(report, stream, "objects")
            lag_files, lag_bytes = lag_files - len(new), lag_bytes - nbytes
            self._set_lag(stream, shard, lag_files, lag_bytes, unsealed)
        return records

    def _batches(self, files: List[Tuple[str, int]]) -> Iterator[List[Tuple[str, int]]]:
        batch: List[Tuple[str, int]] = []
        size = 0
        for name, n in files:
            if batch and size + n > self.batch_bytes:
                yield batch
                batch, size = [], 0
            batch.append((name, n))
            size += n
        if batch:
            yield batch

    def _move_batch(self, stream: str, shard: int, tier: TierStore, batch: List[Tuple[str, int]],
                    report: PassReport, owner: str) -> Optional[Dict[str, TierRecord]]:
        """Upload and verify one batch, each attempt under a new object name (non-stop-write)."""
        folder = shard_dir(stream, shard)
        for attempt in range(self.upload_attempts):
            # A fresh name per attempt, carrying the stream's owner id (the sweep takes only its own).
            key = f"{folder}/{batch[0][0]}.{owner}.{secrets.token_hex(6)}.pack"
            crcs: List[int] = []
            try:
                tier.put(key, self._parts(folder, batch, crcs))
                records, headers = self._verify(folder, tier, key, batch, crcs)
                records = self._put_index(tier, key, headers, records)
            except (TierUploadError, CorruptFileError) as exc:
                self._count(report, stream, "abandoned_objects")
                self._count(report, stream, "verify_failures" if isinstance(exc, CorruptFileError) else "upload_failures")
                log.warning("tier upload of %s (%d files) to %s abandoned, uploading under a new name: %s",
                            folder, len(batch), key, exc)
                continue
            return records
        return None

    def _parts(self, folder: str, batch: List[Tuple[str, int]], crcs: List[int]) -> Iterator[bytes]:
        for name, n in batch:
            crc = 0
            at = 0
            while at < n:
                data = self.store.read(f"{folder}/{name}", at, min(n, at + UPLOAD_PART_BYTES))
                if not data:
                    raise StoreError(f"{self.store.uri(folder + '/' + name)}: shorter than its sealed length {n}")
                self.limiter.acquire(len(data))
                crc = crc32(data, crc)
                at += len(data)
                yield data
            crcs.append(crc)

    def _put_index(self, tier: TierStore, key: str, headers: List[Tuple[int, bytes]],
                   records: Dict[str, TierRecord]) -> Dict[str, TierRecord]:
        """Upload the object's header index (before any record names it). A failed index
        upload is no failed move: the records go without it (headers are then read from the
        object), and the abandoned index object is swept."""
        index_key = key[: -len(".pack")] + ".idx"
        data = encode_header_index(headers)
        try:
            tier.put(index_key, [data])
            if tier.size(index_key) != len(data):
                raise TierUploadError(f"{tier.where()}/{index_key}: size differs after upload")
        except TierUploadError as exc:
            log.warning("header index of %s not uploaded (headers will be read from the object): %s", key, exc)
            return records
        return {name: replace(rec, index=index_key) for name, rec in records.items()}

    def _verify(self, folder: str, tier: TierStore, key: str, batch: List[Tuple[str, int]],
                crcs: List[int]) -> Tuple[Dict[str, TierRecord], List[Tuple[int, bytes]]]:
        """Read the object back: size, whole-file crc32 and block checksums. Returns the
        records and the block headers found (offset in the object, header bytes)."""
        total = sum(n for _, n in batch)
        where = f"{tier.where()}/{key}"
        size = tier.size(key)
        if size != total or len(crcs) != len(batch):
            raise CorruptFileError(f"{where}: {size} bytes uploaded, expected {total}", path=where)
        with _translate(f"stat files of {self.store.uri(folder)}"):
            infos = self.store.fs.get_file_info([self.store.path(f"{folder}/{name}") for name, _ in batch])
        now = self.clock()
        out: Dict[str, TierRecord] = {}
        headers: List[Tuple[int, bytes]] = []
        offset = 0
        for (name, n), crc, info in zip(batch, crcs, infos):
            blocks = self._verify_file(tier, key, where, name, offset, n, crc, headers)
            mtime = info.mtime.timestamp() if info.mtime is not None else now
            out[name] = TierRecord(key, offset, n, crc, blocks, mtime, now)
            offset += n
        return out, headers

    @staticmethod
    def _verify_file(tier: TierStore, key: str, where: str, name: str, offset: int, n: int, crc: int,
                     headers: List[Tuple[int, bytes]]) -> int:
        """Read one file back from the object in parts (memory: one part plus one block):
        its crc32 must equal the hot bytes', and every complete block's body its header's
        checksum (:func:`~pyspark_acs.format.block.check_block_bodies`). Appends the block
        headers found to ``headers``; returns the number of blocks verified.

        A block whose checksum fails in a copy whose crc32 equals the hot copy's fails in the
        hot copy too: the file's own (a torn block its writer never finished, voided by the
        next writer's recovery seal); block checks stop there, the crc32 covers the rest.
        """
        got_crc = 0
        blocks = 0
        buf, buf_at = b"", 0  # unchecked bytes and the file position of buf[0]
        checking = True
        mismatch: Optional[CorruptFileError] = None
        at = 0
        while at < n:
            piece = tier.read(key, offset + at, offset + min(n, at + UPLOAD_PART_BYTES))
            if not piece:
                break
            got_crc = crc32(piece, got_crc)
            at += len(piece)
            if not checking:
                continue
            buf += piece
            try:
                count, end = check_block_bodies(buf, path=f"{where}[{name}]", base=buf_at)
            except CorruptFileError as exc:  # a body checksum mismatch
                mismatch, checking = exc, False
                continue
            for pos, _ in scan_blocks(memoryview(buf)[:end]):
                headers.append((offset + buf_at + pos, bytes(buf[pos: pos + HEADER_SIZE])))
            blocks += count
            if end == 0 and len(buf) >= HEADER_SIZE:
                try:
                    parse_header(buf, 0)
                except CorruptFileError:
                    checking = False  # no block header here: past a torn block
                    continue
            buf, buf_at = buf[end:], buf_at + end
        if at != n or got_crc != crc:
            raise CorruptFileError(f"{where}: bytes of {name} at {offset} differ from the hot copy "
                                   f"({at} of {n} bytes read back)", path=where, position=offset)
        if mismatch is not None:
            log.warning("%s: a block fails its checksum in the hot copy too (a voided torn block); "
                        "tiered as is: %s", name, mismatch)
        return blocks

    # -- retention ----------------------------------------------------------------------------------

    def _retention(self, stream: str, settings: TierSettings, manifests: Dict[int, Dict[str, TierRecord]],
                   report: PassReport) -> None:
        now = self.clock()
        hot: List[Tuple[float, str, int, int]] = []  # (mtime, name, shard, size) of hot files
        for shard in manifests:
            sel = pafs.FileSelector(self.store.path(shard_dir(stream, shard)), allow_not_found=True)
            with _translate(f"list {self.store.uri(shard_dir(stream, shard))}"):
                infos = self.store.fs.get_file_info(sel)
            for info in infos:
                if info.type == pafs.FileType.File and info.base_name.endswith(".acs"):
                    mtime = info.mtime.timestamp() if info.mtime is not None else now
                    hot.append((mtime, info.base_name, shard, int(info.size)))
        hot.sort()
        total = sum(h[3] for h in hot)
        # A shard's newest file stays hot: writers name their next file after the files they
        # list in the hot store (write/shard.py), so the newest name must stay listed there.
        newest: Dict[int, str] = {}
        for _, name, shard, _ in hot:
            newest[shard] = max(newest.get(shard, ""), name)
        # Secondary retention: whole files older than secondary_retention_s leave both tiers.
        if settings.secondary_retention_s is not None:
            for shard, records in manifests.items():
                old = [n for n, r in records.items()
                       if now - r.mtime > settings.secondary_retention_s and n != newest.get(shard)]
                if not old:
                    continue
                # The floor first: a reader that finds these files gone also finds the floor and
                # reports the loss instead of stepping over the gap (storage/tier.py retention_gap).
                raise_retention_floor(self.store, stream, shard, max(old))
                for name in old:
                    self.store.delete(f"{shard_dir(stream, shard)}/{name}")  # hot copy first
                    self._count(report, stream, "hot_deleted",
                                1 if any(h[1] == name and h[2] == shard for h in hot) else 0)
                    del records[name]
                    self._count(report, stream, "secondary_deleted")
                hot = [h for h in hot if not (h[2] == shard and h[1] in old)]
                write_manifest(self.store, stream, shard, records)
            total = sum(h[3] for h in hot)
        for mtime, name, shard, size in hot:
            rec = manifests[shard].get(name)
            # Never delete a hot file that is not verified in the secondary store (one longer
            # than its record holds only bytes after its seal, which are never read).
            if rec is None or rec.length > size:
                continue
            if name == newest.get(shard):
                continue
            too_old = settings.hot_retention_s is not None and now - mtime > settings.hot_retention_s
            too_big = settings.hot_retention_bytes is not None and total > settings.hot_retention_bytes
            if too_old or too_big:
                self.store.delete(f"{shard_dir(stream, shard)}/{name}")
                total -= size
                self._count(report, stream, "hot_deleted")

    def _sweep(self, stream: str, tier: TierStore, manifests: Dict[int, Dict[str, TierRecord]],
               report: PassReport, owner: str) -> None:
        """Delete this stream's objects (named with its ``owner`` id) no record names, once
        older than the grace period; objects of other owners under the prefix are left alone."""
        named = {k for records in manifests.values() for r in records.values() for k in (r.object, r.index) if k}
        now = self.clock()
        for key, _, mtime in tier.list(stream):
            ours = key.endswith((".pack", ".idx")) and f".{owner}." in key.rsplit("/", 1)[-1]
            if key in named or not ours:
                continue
            if mtime is not None and now - mtime < self.orphan_grace_s:
                continue
            tier.delete(key)
            self._count(report, stream, "swept_objects")
