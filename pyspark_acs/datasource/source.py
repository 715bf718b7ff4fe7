"""The ``acs`` Spark source: micro-batch stream reader and batch reader.

Offsets are the consumer offsets of docs/overview.md section 1 (docs/format.md section 5), one
entry per shard::

    {"orders": {"0": {"file": "20261122T091242032052Z-5f2c.acs", "length": 4096}, ...}}

The driver (``latestOffset``) finds each shard's newest readable block boundary from the
metadata cache's published lengths (durable listing and lengths when it is down) and, under
``maxBytesPerTrigger`` / ``maxRowsPerTrigger``, walks block headers to cut each shard's share
of the budget, split in proportion to the shards' backlogs. Each Spark task reads one shard's
range through the Consumer's read path (data cache first, durable store as fallback) and
returns Arrow record batches.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceReader,
    DataSourceStreamReader,
    EqualNullSafe,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    IsNotNull,
    LessThan,
    LessThanOrEqual,
    StringContains,
    StringEndsWith,
    StringStartsWith,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from pyspark_acs.read.consumer import ShardTailer, earliest_offset
from pyspark_acs.errors import AcsError, AcsOptionError, DataLossError
from pyspark_acs.format.block import BlockHeader, timestamp_bounds, timestamps_section
from pyspark_acs.format.offsets import Offset, OffsetMap, format_offsets, parse_offsets, parse_timestamps
from pyspark_acs.read.positions import (
    BoundaryCache,
    ShardExtent,
    _read_now,
    advance,
    block_end,
    carries_messages,
    latest_offset,
    offset_for_timestamp,
    shard_extent,
    walk_blocks,
)
from pyspark_acs.read.batches import READ_BATCH_BYTES, coalesce_batches
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.readpath import RateLimiter, ReadPath, open_read_path
from pyspark_acs.datasource.options import SourceOptions

__all__ = [
    "AcsBatchReader",
    "AcsPruningBatchReader",
    "AcsStreamReader",
    "SCHEMA_DDL",
    "SCHEMA_WITH_HEADERS_DDL",
    "pushdown_enabled",
]

log = logging.getLogger(__name__)

SCHEMA_DDL = (
    "stream string, shard int, file string, position long, timestamp timestamp, key binary, value binary"
)
#: The schema with option ``includeHeaders``: Kafka's ``headers`` column.
SCHEMA_WITH_HEADERS_DDL = SCHEMA_DDL + ", headers array<struct<key: string, value: binary>>"
#: How long ``latestOffset`` of an idle stream (nothing new) waits for a published length to
#: move before answering (it answers at once when one moves). Spark asks again every 10 ms
#: (spark.sql.streaming.pollingDelay) while a query has no data: an idle query cost about half
#: a core of this 2-core machine doing so, a quarter with the wait. It bounds how late a change
#: that reaches the driver by no push (a new file's first length) is seen.
IDLE_WAIT_S = 0.1


class AcsPartition(InputPartition):
    """One shard's byte range: plain, picklable data (no channels or files)."""

    def __init__(self, stream: str, shard: int, start: Tuple[Any, ...], end: Tuple[Any, ...],
                 before_us: Optional[int] = None) -> None:
        super().__init__((stream, shard, tuple(start)))
        self.stream = stream
        self.shard = shard
        self.start = tuple(start)
        self.end = tuple(end)
        self.before_us = before_us  # endingTimestamp in µs: rows stamped at or after it are dropped

    def __repr__(self) -> str:
        return f"AcsPartition({self.stream}/{self.shard} {self.start} -> {self.end})"


def source_read_path(opts: SourceOptions) -> ReadPath:
    """The read path for the source options (caches when configured, else the durable store),
    with the options' token and TLS settings."""
    return open_read_path(
        opts.root, data_cache=opts.data_cache, metadata_cache=opts.metadata_cache, security=opts.security(),
        tier_read_policy=opts.tier_read_policy,
    )


# Read paths of this Python worker process, one per (root, caches, token, TLS files, tier read
# policy), kept open for the process's life: Spark reuses a worker for task after task
# (spark.python.worker.reuse), so a micro-batch's tasks find their cache channels connected
# instead of setting them up and tearing them down every time. _task_paths_lock guards _task_paths.
_task_paths_lock = threading.Lock()
_task_paths: Dict[Tuple[Any, ...], ReadPath] = {}


def _task_read_path(opts: SourceOptions) -> ReadPath:
    key = (os.getpid(), opts.root, opts.data_cache, opts.metadata_cache, opts.security(), opts.tier_read_policy)
    with _task_paths_lock:
        path = _task_paths.get(key)
        if path is None:
            path = _task_paths[key] = source_read_path(opts)
        return path


def read_partition(opts: SourceOptions, partition: AcsPartition,
                   path: Optional[ReadPath] = None) -> Iterator[pa.RecordBatch]:
    """Read one partition's range, in order, as Arrow record batches (runs in a Spark task).

    Blocks are decoded without copying and coalesced into batches of up to
    :data:`READ_BATCH_BYTES`. ``path`` is the read path to use (default: this process's
    shared one for the options, see :func:`_task_read_path`).

    Raises
    ------
    DataLossError
        When bytes in the range are gone (``failOnDataLoss=true``), or published bytes did
        not become readable within ``readTimeout``.
    """
    if not isinstance(partition, AcsPartition):
        # Spark hands a bare InputPartition to read() when partitions() planned none (an empty
        # range: an empty stream, or startingOffsets=latest): nothing to read.
        return
    yield from coalesce_batches(_read_range(opts, partition, path or _task_read_path(opts)))


def _read_range(opts: SourceOptions, partition: AcsPartition, path: ReadPath) -> Iterator[pa.RecordBatch]:
    end = Offset(*partition.end)
    cut: Optional[Offset] = None
    if end.position:
        # An end inside a block (endingOffsets a Consumer took mid-batch): that block is read
        # and its messages from the end's position on are dropped.
        cut = end
        end = Offset(end.file, block_end(path, f"{shard_dir(partition.stream, partition.shard)}/{end.file}",
                                         end.length))
    tailer = ShardTailer(
        path,
        partition.stream,
        partition.shard,
        Offset(*partition.start),
        fail_on_data_loss=opts.fail_on_data_loss,
        limiter=RateLimiter(opts.max_bytes_per_second),
        include_headers=opts.include_headers,
    )
    try:
        waited_since: Optional[float] = None
        while tailer.offset < end:
            batches = tailer.step(end=end)
            if batches:
                waited_since = None
                if partition.before_us is not None:
                    batches = [_before(b, partition.before_us) for b in batches]
                if cut is not None and tailer.offset >= end:
                    batches = [_up_to(b, cut) for b in batches]
                yield from batches
                continue
            if tailer.offset >= end:
                break
            now = time.monotonic()
            waited_since = waited_since or now
            if tailer.copy_wait is not None:
                # This cluster's copy has not brought the range yet (a batch planned in another
                # cluster, run again here): its bytes come with the copy, as for a Consumer; the
                # tailer says so after TailTiming.stuck_warn_after_s. readTimeout is for bytes
                # published here that do not become readable.
                waited_since = now
            elif now - waited_since > opts.read_timeout:
                raise DataLossError(
                    f"stream {partition.stream!r} shard {partition.shard}: bytes from {tailer.offset.file} "
                    f"byte {tailer.offset.length} up to {end.file} byte {end.length} were published but are "
                    f"readable neither in the data cache nor in the durable store after {opts.read_timeout:.0f} s",
                    stream=partition.stream,
                    shard=partition.shard,
                    file=tailer.offset.file,
                    start=tailer.offset.length,
                    end=end.length if end.file == tailer.offset.file else -1,
                )
            time.sleep(opts.poll_interval)
    finally:
        # The path outlives the task: drop the per-file state of the file the task ended in.
        if tailer.rel and hasattr(path, "forget"):
            path.forget(tailer.rel)


def _up_to(batch: pa.RecordBatch, end: Offset) -> pa.RecordBatch:
    """The rows of ``batch`` before ``end`` (an offset with a position in ``batch``'s file)."""
    if batch.num_rows == 0 or batch.column("file")[0].as_py() != end.file:
        return batch
    import pyarrow.compute as pc  # see _before

    return batch.filter(pc.less(batch.column("position"), end.position))


def _before(batch: pa.RecordBatch, before_us: int) -> pa.RecordBatch:
    """The rows of ``batch`` stamped before ``before_us`` (µs since the epoch)."""
    # pyarrow.compute is imported here, not with the module: the streaming planner process
    # Spark starts for every query imports this module and never filters (~20 ms of its start).
    import pyarrow.compute as pc

    stamps = batch.column("timestamp").cast(pa.int64())
    return batch.filter(pc.less(stamps, before_us))


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_COMPARISONS = {EqualTo: "=", EqualNullSafe: "=", GreaterThan: ">", GreaterThanOrEqual: ">=", LessThan: "<",
                LessThanOrEqual: "<="}
_STRING_TESTS = {StringStartsWith: str.startswith, StringEndsWith: str.endswith, StringContains: str.__contains__}


def _micros(value: Any) -> Optional[int]:
    """A pushed timestamp filter value in µs since the epoch (naive datetimes are UTC)."""
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return (value - _EPOCH) // datetime.timedelta(microseconds=1)
    if isinstance(value, datetime.date):
        return _micros(datetime.datetime(value.year, value.month, value.day))
    return None


class Pruning:
    """What a batch read's pushed filters let it skip before reading: plain data (it crosses
    Spark pickled, with the reader).

    Filters on ``stream``, ``shard`` and ``file`` (comparisons, ``IN``, string prefix / suffix /
    contains on the string columns) are applied exactly, to whole shards and files: Spark does
    not evaluate them again. Filters on ``timestamp`` (comparisons, ``IN``) only narrow the
    time range of the blocks read -- a block is skipped when none of its messages can match --
    and stay with Spark for the rows. Anything else (``OR``, ``NOT``, other columns) stays with
    Spark untouched.
    """

    def __init__(self) -> None:
        self.exact: List[Tuple[str, str, Any]] = []  # (column, test, value) on stream / shard / file
        self.ts_min: Optional[int] = None  # µs: messages stamped before it are not wanted
        self.ts_max: Optional[int] = None  # µs: messages stamped after it are not wanted

    def push(self, f: Filter) -> bool:
        """Take ``f`` into the pruning; True when it is applied exactly (Spark may drop it)."""
        column = f.attribute[0] if len(getattr(f, "attribute", ())) == 1 else None
        if column in ("stream", "shard", "file"):
            want = int if column == "shard" else str
            if isinstance(f, IsNotNull):
                return True  # these columns are never null
            if type(f) in _COMPARISONS and isinstance(f.value, want) and not isinstance(f.value, bool):
                self.exact.append((column, _COMPARISONS[type(f)], f.value))
                return True
            if isinstance(f, In) and all(isinstance(v, want) and not isinstance(v, bool) for v in f.value):
                self.exact.append((column, "in", tuple(f.value)))
                return True
            if type(f) in _STRING_TESTS and want is str and isinstance(f.value, str):
                self.exact.append((column, type(f).__name__, f.value))
                return True
            return False
        if column == "timestamp":
            values = [f.value] if type(f) in _COMPARISONS else list(f.value) if isinstance(f, In) else []
            stamps = [_micros(v) for v in values]
            if not stamps or None in stamps:
                return False
            op = "in" if isinstance(f, In) else _COMPARISONS[type(f)]
            lo = min(stamps) + (1 if op == ">" else 0) if op in ("=", "in", ">", ">=") else None
            hi = max(stamps) - (1 if op == "<" else 0) if op in ("=", "in", "<", "<=") else None
            if lo is not None:
                self.ts_min = lo if self.ts_min is None else max(self.ts_min, lo)
            if hi is not None:
                self.ts_max = hi if self.ts_max is None else min(self.ts_max, hi)
        return False

    @property
    def by_block(self) -> bool:
        """Whether files or blocks are pruned (not only whole shards)."""
        return self.by_time or any(column == "file" for column, _, _ in self.exact)

    @property
    def by_time(self) -> bool:
        return self.ts_min is not None or self.ts_max is not None

    def _holds(self, column: str, value: Any) -> bool:
        for col, test, want in self.exact:
            if col != column:
                continue
            if test == "in":
                ok = value in want
            elif test in ("StringStartsWith", "StringEndsWith", "StringContains"):
                ok = _STRING_TESTS[{"StringStartsWith": StringStartsWith, "StringEndsWith": StringEndsWith,
                                    "StringContains": StringContains}[test]](value, want)
            else:
                ok = {"=": value == want, ">": value > want, ">=": value >= want, "<": value < want,
                      "<=": value <= want}[test]
            if not ok:
                return False
        return True

    def wants_shard(self, stream: str, shard: int) -> bool:
        """Whether rows of this shard can match."""
        return self._holds("stream", stream) and self._holds("shard", shard)

    def wants_file(self, name: str) -> bool:
        """Whether rows of this file (a name in the ``file`` column) can match."""
        return self._holds("file", name)

    def wants_time(self, lo: int, hi: int) -> bool:
        """Whether a message stamped within ``[lo, hi]`` (µs) can match."""
        return (self.ts_min is None or hi >= self.ts_min) and (self.ts_max is None or lo <= self.ts_max)

    def __repr__(self) -> str:
        return f"Pruning(exact={self.exact}, timestamp=[{self.ts_min}, {self.ts_max}] µs)"


def pushdown_enabled() -> bool:
    """Whether Spark is asking for a reader to push filters into (it does so in a planner
    worker of its own, run only with ``spark.sql.python.filterPushdown.enabled=true``).

    A reader that implements ``pushFilters`` is refused by Spark when that setting is false
    (``DATA_SOURCE_PUSHDOWN_DISABLED``), and the setting cannot be read from the worker; so the
    source hands out its pruning reader only when the pushdown worker asks for one.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if os.path.basename(frame.f_code.co_filename) == "data_source_pushdown_filters.py":
            return True
        frame = frame.f_back
    return False


class _Planner:
    """Driver-side offset logic shared by the stream and batch readers."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._path: Optional[ReadPath] = None
        self._boundaries = BoundaryCache()
        self.extents: Dict[Tuple[str, int], Any] = {}  # of the last limited(): ShardExtent per shard

    # Spark pickles readers to ship read(); drop live clients and rebuild them lazily.
    def __getstate__(self) -> Dict[str, Any]:
        return {"opts": self.opts}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["opts"])

    @property
    def path(self) -> ReadPath:
        if self._path is None:
            self._path = source_read_path(self.opts)
        return self._path

    def shards(self) -> List[Tuple[str, int]]:
        out = []
        store = self.path.store
        for stream in self.opts.streams:
            count = store.stream_shards(stream)
            if count is None:
                raise AcsOptionError(f"stream: no stream {stream!r} in {store.root}", option="stream")
            out.extend((stream, shard) for shard in range(count))
        return out

    def start_offsets(self, spec: Optional[str], default: str) -> OffsetMap:
        """Where a query starts, per shard: ``startingTimestamp``, else ``startingOffsetsByTimestamp``
        for the shards it names and ``startingOffsets`` (else ``default``) for the others."""
        opts = self.opts
        spec = spec or default
        shards = self.shards()
        if opts.starting_timestamp is not None:
            ts_us = opts.starting_timestamp * 1000
            return {s: offset_for_timestamp(self.path, s[0], s[1], ts_us) for s in shards}
        by_time = parse_timestamps(opts.starting_by_timestamp, option="startingOffsetsByTimestamp") \
            if opts.starting_by_timestamp else {}
        missing = sorted(set(by_time) - set(shards))
        if missing:
            raise AcsOptionError(
                f"startingOffsetsByTimestamp: {missing[0][0]}/{missing[0][1]} is not a shard of the stream",
                option="startingOffsetsByTimestamp",
            )
        rest = [s for s in shards if s not in by_time]
        if spec == "earliest":
            out = {s: earliest_offset(self.path.store, *s) for s in rest}
        elif spec == "latest":
            out = self.latest(rest)
        else:
            given = parse_offsets(spec, option="startingOffsets")
            out = {s: given.get(s) or earliest_offset(self.path.store, *s) for s in rest}
        for s, ms in by_time.items():
            out[s] = offset_for_timestamp(self.path, s[0], s[1], ms * 1000)
        return out

    def latest(self, shards: Sequence[Tuple[str, int]], start: Optional[OffsetMap] = None) -> OffsetMap:
        """How far each shard can be read now: from ``start`` through sealed files up to the last
        complete block of the first unsealed one (the seal rule); without a start, the end of
        the newest file (``startingOffsets=latest``)."""
        out: OffsetMap = {}
        for s in shards:
            begin = (start or {}).get(s)
            if begin is None:
                out[s] = latest_offset(self.path, s[0], s[1])
                continue
            extent = shard_extent(self.path, s[0], s[1], begin)
            out[s] = max(self._latest(extent, begin), begin)
        return out

    def _latest(self, extent: ShardExtent, start: Offset) -> Offset:
        return extent.latest(self._boundaries, self.path, start, fail_on_data_loss=self.opts.fail_on_data_loss,
                             hint=" (set failOnDataLoss=false to skip to the next available data)")

    def limited(self, start: OffsetMap, limit: ReadLimit) -> Tuple[OffsetMap, OffsetMap]:
        """End offsets from ``start`` under ``limit`` (plus the other configured budget), and
        the latest offsets (for progress reporting)."""
        shards = sorted(start)
        max_bytes = max_rows = None
        if not isinstance(limit, ReadAllAvailable):
            if isinstance(limit, ReadMaxBytes):
                max_bytes, max_rows = limit.max_bytes, self.opts.max_rows_per_trigger
            elif isinstance(limit, ReadMaxRows):
                max_rows, max_bytes = limit.max_rows, self.opts.max_bytes_per_trigger
            else:
                raise AcsError(
                    f"acs source: Spark asked for read limit {limit!r}; this source supports "
                    f"maxBytesPerTrigger (ReadMaxBytes) and maxRowsPerTrigger (ReadMaxRows)"
                )
        extents = self.extents = {s: shard_extent(self.path, s[0], s[1], start[s]) for s in shards}
        latest = {s: max(self._latest(extents[s], start[s]), start[s]) for s in shards}
        if max_bytes is None and max_rows is None:
            return latest, latest
        backlog = {s: extents[s].backlog(start[s]) for s in shards}
        total = sum(backlog.values())
        end: OffsetMap = {}
        for s in shards:
            if not backlog[s] or latest[s] <= start[s]:
                end[s] = start[s]
                continue
            share = backlog[s] / total
            end[s] = advance(
                self.path,
                extents[s],
                start[s],
                latest[s],
                max_bytes=None if max_bytes is None else max(1, int(max_bytes * share)),
                max_rows=None if max_rows is None else max(1, int(max_rows * share)),
            )
        return end, latest

    def partitions(self, start: OffsetMap, end: OffsetMap, before_us: Optional[int] = None,
                   pruning: Optional["Pruning"] = None) -> List[AcsPartition]:
        """The read tasks of ``start`` .. ``end``: one per shard with data in between, fewer
        when ``pruning`` drops shards, files or blocks (then one per run of blocks kept), more
        with ``minPartitions`` (ranges split at block boundaries in proportion to their bytes,
        as Kafka's ``minPartitions``)."""
        ranges: List[Tuple[Tuple[str, int], Offset, Offset]] = []
        for s in sorted(end):
            a = start.get(s, Offset())
            b = end[s]
            if b > a and (pruning is None or pruning.wants_shard(*s)):
                ranges.append((s, a, b))
        extents: Dict[Tuple[str, int], ShardExtent] = {}
        if pruning is not None and pruning.by_block:
            ranges = [r for s, a, b in ranges for r in self._kept_runs(s, a, b, pruning, extents)]
        want = self.opts.min_partitions
        if want and 0 < len(ranges) < want:
            ranges = self._split(ranges, want, extents)
        return [AcsPartition(s[0], s[1], tuple(a), tuple(b), before_us) for s, a, b in ranges]

    def _extent(self, s: Tuple[str, int], a: Offset, extents: Dict[Tuple[str, int], ShardExtent]) -> ShardExtent:
        known = extents.get(s)
        if known is None or not known.files or known.files[0][0] > a.file:
            known = extents[s] = shard_extent(self.path, s[0], s[1], a)
        return known

    def _kept_runs(self, s: Tuple[str, int], a: Offset, b: Offset, pruning: "Pruning",
                   extents: Dict[Tuple[str, int], ShardExtent]) -> List[Tuple[Tuple[str, int], Offset, Offset]]:
        """The runs of consecutive blocks between ``a`` and ``b`` that the filters may want:
        files they exclude are skipped whole; with a time filter, blocks whose messages all lie
        outside it too (a header walk, and for blocks whose first and last stamps miss the
        filter, a read of the block's timestamps alone)."""
        runs: List[Tuple[Tuple[str, int], Offset, Offset]] = []

        def at(name: str, length: int) -> Offset:  # a run starting where `a` does keeps its position
            return a if (name, length) == (a.file, a.length) else Offset(name, length)

        for name, rel, begin, stop in self._extent(s, a, extents).ranges(a, b):
            if stop <= begin or not pruning.wants_file(name):
                continue
            if not pruning.by_time:
                runs.append((s, at(name, begin), Offset(name, stop)))
                continue
            headers: List[BlockHeader] = []
            walk_blocks(self.path, rel, begin, stop, stop_before=lambda h: (headers.append(h), False)[1])
            pos = begin
            run: Optional[List[int]] = None  # [start, end) of the run being built
            for h in headers:
                if h.count and self._block_wanted(rel, pos, h, pruning):
                    if run is not None and run[1] == pos:
                        run[1] = pos + h.size
                    else:
                        if run is not None:
                            runs.append((s, at(name, run[0]), Offset(name, run[1])))
                        run = [pos, pos + h.size]
                pos += h.size
            if run is not None:
                runs.append((s, at(name, run[0]), Offset(name, run[1])))
        if b.position and pruning.wants_file(b.file):
            # An end inside a block (a position): the ranges stop before that block, which the
            # task reads and cuts at the position (_read_range). Kept whatever the time filter
            # says (Spark filters its rows again); the file filter is exact, so it decides.
            if runs and runs[-1][2] == b.boundary:
                runs[-1] = (s, runs[-1][1], b)
            else:
                runs.append((s, a if a.boundary == b.boundary else b.boundary, b))
        return runs

    def _block_wanted(self, rel: str, at: int, h: BlockHeader, pruning: "Pruning") -> bool:
        # Keeping a block is always safe (Spark filters its rows again): read the stamps only
        # when the header's first and last stamps say nothing wanted.
        if pruning.wants_time(min(h.first_ts, h.last_ts), max(h.first_ts, h.last_ts)):
            return True
        offset, size = timestamps_section(h)
        section = _read_now(self.path, rel, at + offset, at + offset + size)
        lo, hi = timestamp_bounds(section, h, path=self.path.store.uri(rel), position=at)
        return pruning.wants_time(lo, hi)

    def _split(self, ranges: List[Tuple[Tuple[str, int], Offset, Offset]], want: int,
               extents: Dict[Tuple[str, int], ShardExtent]) -> List[Tuple[Tuple[str, int], Offset, Offset]]:
        sized = []
        for s, a, b in ranges:
            extent = self._extent(s, a, extents)
            sized.append((s, a, b, extent, sum(max(0, stop - begin) for _, _, begin, stop in extent.ranges(a, b))))
        total = sum(size for *_, size in sized) or 1
        out: List[Tuple[Tuple[str, int], Offset, Offset]] = []
        for s, a, b, extent, size in sized:
            parts = max(1, -(-size * want // total))  # rounded up: at least `want` in all
            piece = -(-size // parts)
            at = a
            for _ in range(parts - 1):
                cut = self._next_file_start(extent, advance(self.path, extent, at, b, max_bytes=piece), b)
                if cut <= at or cut >= b:
                    break
                out.append((s, at, cut))
                at = cut
            out.append((s, at, b))
        return out

    @staticmethod
    def _next_file_start(extent: ShardExtent, cut: Offset, b: Offset) -> Offset:
        """A cut at the readable end of a file the range goes past (so: its seal) is the start
        of the next file, so the next task need not prove that seal again by a header walk."""
        names = [name for name, _ in extent.files]
        lengths = dict(extent.files)
        if cut.file < b.file and cut.length == lengths.get(cut.file):
            later = [n for n in names if n > cut.file]
            if later:
                return Offset(later[0], 0)
        return cut


class AcsStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reader of ``spark.readStream.format("acs")`` (see :class:`~pyspark_acs.datasource.AcsDataSource`)."""

    def __init__(self, opts: SourceOptions) -> None:
        for name, value in (("endingOffsets", opts.ending_offsets), ("endingTimestamp", opts.ending_timestamp)):
            if value is not None:
                raise AcsOptionError(
                    f"{name}: batch reads only (spark.read); a streaming query runs until it is stopped -- to "
                    f"stop at the data there is when it starts, use trigger(availableNow=True)",
                    option=name,
                )
        self.opts = opts
        self.planner = _Planner(opts)
        self._available_now: Optional[OffsetMap] = None
        self._reported: Optional[OffsetMap] = None

    def initialOffset(self) -> dict:
        """Offsets a new query starts at: ``startingOffsets`` / ``startingTimestamp`` (default latest)."""
        return format_offsets(self.planner.start_offsets(self.opts.starting_offsets, "latest"))

    def getDefaultReadLimit(self) -> ReadLimit:
        """``ReadMaxRows`` / ``ReadMaxBytes`` from ``maxRowsPerTrigger`` / ``maxBytesPerTrigger``, else all."""
        if self.opts.max_rows_per_trigger is not None:
            return ReadMaxRows(self.opts.max_rows_per_trigger)
        if self.opts.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.opts.max_bytes_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Record the latest offsets now: an AvailableNow query reads up to them and stops."""
        shards = self.planner.shards()
        self._available_now = self.planner.latest(shards)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """End offsets of the next micro-batch from ``start`` under ``limit`` (block boundaries per shard).

        With caches, when nothing new is readable it first waits up to :data:`IDLE_WAIT_S` for
        a published length to move (woken at once when one does), then looks again. When some
        shards moved and others did not, and a length moved while it looked, it looks once more
        (see :meth:`_look`)."""
        waited = relooked = False
        while True:
            token = self._change_token()  # before looking: a change from now on is noticed
            begin, end = self._look(start, limit)
            if end == begin:
                if token is None or waited:
                    return format_offsets(end)
                # Nothing new: wait for the caches to push a length change before answering, so
                # an idle query (processingTime=0 asks again every 10 ms) costs a call per change
                # or per IDLE_WAIT_S rather than a hundred a second -- the CPU its writers need.
                # The token was taken before looking: a change since then ends the wait at once.
                self.planner.path.wait(IDLE_WAIT_S, since=token)
                waited = True
                continue
            if (token is None or relooked or all(end[s] > begin[s] for s in end)
                    or self.planner.path.change_token() == token):
                return format_offsets(end)
            # Lengths published together (a sink's batch, all its shards in one write) reach
            # this process as separate pushes (their keys live on different replicas): answered
            # on the first, the other shards' rows would wait a whole micro-batch more. One
            # arrived while we looked: look again.
            relooked = True

    def _look(self, start: dict, limit: ReadLimit) -> Tuple[OffsetMap, OffsetMap]:
        """``(begin, end)``: the micro-batch from ``start`` under ``limit`` as the lengths stand now."""
        begin = parse_offsets(start, option="start offset")
        for s in self.planner.shards():  # shards a stream gained since the checkpoint
            if s not in begin:
                begin[s] = earliest_offset(self.planner.path.store, *s)
        end, self._reported = self.planner.limited(begin, limit)
        latest_cap = dict(self._reported)  # how far each shard may go (AvailableNow: its bound)
        if self._available_now is not None:
            latest_cap = {s: min(o, self._available_now.get(s, begin[s])) for s, o in latest_cap.items()}
            end = {s: min(o, self._available_now.get(s, begin[s])) if o > begin[s] else o for s, o in end.items()}
            end = {s: max(o, begin[s]) for s, o in end.items()}
        path, boundaries = self.planner.path, self.planner._boundaries  # its walk to `latest` just now
        for s, o in end.items():
            # A range of nothing but a seal (and an empty next file) is no batch: the offset
            # moves on with the next message, so no empty micro-batch runs after each file.
            # When a budget cut the range right after a seal or voided bytes while messages
            # follow, it takes the next message block too: a seal never holds a shard back.
            extent = self.planner.extents[s]
            if o > begin[s] and not carries_messages(path, extent, begin[s], o, boundaries):
                cap = latest_cap.get(s, o)
                if cap > o and carries_messages(path, extent, o, cap, boundaries):
                    end[s] = advance(path, extent, begin[s], cap, max_rows=1)
                else:
                    end[s] = begin[s]
        return begin, end

    def _change_token(self) -> Optional[int]:
        """A change token of the metadata cache's lengths (see :meth:`latestOffset`), taken
        before looking; None: answer at once (no metadata cache, or AvailableNow: its end is
        fixed)."""
        if self._available_now is not None or self.opts.metadata_cache is None:
            return None
        take = getattr(self.planner.path, "change_token", None)
        return take() if take is not None else None

    def reportLatestOffset(self) -> Optional[dict]:
        """The newest readable offsets seen by the last ``latestOffset`` (for query progress)."""
        return format_offsets(self._reported) if self._reported else None

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        """One partition per shard with data between ``start`` and ``end``; none when they are equal."""
        return self.planner.partitions(parse_offsets(start, option="start offset"), parse_offsets(end, option="end offset"))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Read one shard's range in order as Arrow record batches (runs in a Spark task)."""
        return read_partition(self.opts, partition)

    def commit(self, end: dict) -> None:
        """Nothing to do: message files are kept by retention, not by consumer commits."""

    def stop(self) -> None:
        """Close the driver-side read path."""
        if self.planner._path is not None:
            self.planner._path.close()
            self.planner._path = None


class AcsBatchReader(DataSourceReader):
    """Batch reader of ``spark.read.format("acs")``: ``startingOffsets`` .. ``endingOffsets``
    (default earliest .. latest)."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.planner = _Planner(opts)
        self.pruning: Optional[Pruning] = None  # set by AcsPruningBatchReader.pushFilters

    def partitions(self) -> Sequence[InputPartition]:
        """One partition per shard between ``startingOffsets`` and ``endingOffsets``."""
        start = self.planner.start_offsets(self.opts.starting_offsets, "earliest")
        given: OffsetMap = {}
        if self.opts.ending_offsets and self.opts.ending_offsets != "latest":
            given = parse_offsets(self.opts.ending_offsets, option="endingOffsets")
        before_us = None
        by_time: OffsetMap = {}
        if self.opts.ending_timestamp is not None:
            before_us = self.opts.ending_timestamp * 1000
            by_time = {s: offset_for_timestamp(self.planner.path, s[0], s[1], before_us, ending=True) for s in start}
        latest = self._latest(start, given, by_time)
        if given:
            for s, off in given.items():
                if s in latest and off > latest[s]:
                    raise AcsOptionError(
                        f"endingOffsets: {s[0]}/{s[1]} {off.to_json()} is past the end of the shard "
                        f"({latest[s].to_json()})",
                        option="endingOffsets",
                    )
            end = {s: given.get(s, latest[s]) for s in start}
        else:
            end = latest
        if by_time:
            end = {s: max(start[s], min(end[s], by_time[s])) for s in end}
        parts = self.planner.partitions(start, end, before_us, self.pruning)
        if self.planner._path is not None:
            self.planner._path.close()
            self.planner._path = None
        return parts

    def _latest(self, start: OffsetMap, given: OffsetMap, by_time: OffsetMap) -> OffsetMap:
        """How far each shard can be read from ``start`` (:meth:`_Planner.latest`). A damaged
        file (DataLossError) after the range the read asks for (``endingOffsets`` ``given``,
        ``endingTimestamp``'s ``by_time``) is no loss of this read: the shard's end is then
        where the damage begins."""
        latest: OffsetMap = {}
        for s in sorted(start):
            try:
                latest.update(self.planner.latest([s], start))
            except DataLossError as exc:
                loss = Offset(exc.file, exc.start)
                # A timestamp's end stops at an unsealed file's last block (offset_for_timestamp),
                # so one exactly at the loss may lie past it: only one before the loss counts.
                if not ((s in given and given[s] <= loss) or (s in by_time and by_time[s] < loss)):
                    raise
                latest[s] = max(loss, given.get(s, loss))  # the read ends before the loss
        return latest

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Read one shard's range in order as Arrow record batches (runs in a Spark task)."""
        return read_partition(self.opts, partition)


class AcsPruningBatchReader(AcsBatchReader):
    """:class:`AcsBatchReader` with filter pushdown (``spark.sql.python.filterPushdown.enabled=true``):
    filters on ``stream``, ``shard``, ``file`` and ``timestamp`` prune whole shards, files and
    blocks before they are read (see :class:`Pruning`)."""

    def pushFilters(self, filters: List[Filter]) -> Iterable[Filter]:
        """Keep the filters the read can prune by; return those Spark must still evaluate
        (every filter on ``timestamp`` among them: blocks are pruned, rows are not)."""
        pruning = Pruning()
        rest = [f for f in filters if not pruning.push(f)]
        self.pruning = pruning if (pruning.exact or pruning.by_time) else None
        return rest
