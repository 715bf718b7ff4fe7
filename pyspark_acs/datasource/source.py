"""The ``acs`` Spark source: micro-batch stream reader and batch reader.

Offsets are the consumer offsets of DESIGN.md, one entry per shard::

    {"orders": {"0": {"file": "20261122T091242032052Z-5f2c.acs", "length": 4096}, ...}}

The driver (``latestOffset``) finds each shard's newest readable block boundary from the
metadata cache's published lengths (durable listing and lengths when it is down) and, under
``maxBytesPerTrigger`` / ``maxRowsPerTrigger``, walks block headers to cut each shard's share
of the budget, split in proportion to the shards' backlogs. Each Spark task reads one shard's
range through the Consumer's read path (data cache first, durable store as fallback) and
returns Arrow record batches.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from pyspark_acs.read.consumer import ShardTailer, earliest_offset
from pyspark_acs.errors import AcsError, AcsOptionError, DataLossError
from pyspark_acs.format.offsets import Offset, OffsetMap, format_offsets, parse_offsets, parse_timestamps
from pyspark_acs.read.positions import (
    BoundaryCache,
    advance,
    carries_messages,
    latest_offset,
    offset_for_timestamp,
    shard_extent,
)
from pyspark_acs.read.readpath import RateLimiter, ReadPath, open_read_path
from pyspark_acs.datasource.options import SourceOptions

__all__ = ["SCHEMA_DDL", "SCHEMA_WITH_HEADERS_DDL", "AcsBatchReader", "AcsPartition", "AcsStreamReader", "source_read_path", "read_partition"]

log = logging.getLogger(__name__)

SCHEMA_DDL = (
    "stream string, shard int, file string, position long, timestamp timestamp, key binary, value binary"
)
#: The schema with option ``includeHeaders``: Kafka's ``headers`` column.
SCHEMA_WITH_HEADERS_DDL = SCHEMA_DDL + ", headers array<struct<key: string, value: binary>>"


class AcsPartition(InputPartition):
    """One shard's byte range: plain, picklable data (no channels or files)."""

    def __init__(self, stream: str, shard: int, start: Tuple[str, int], end: Tuple[str, int],
                 before_us: Optional[int] = None) -> None:
        super().__init__((stream, shard))
        self.stream = stream
        self.shard = shard
        self.start = tuple(start)
        self.end = tuple(end)
        self.before_us = before_us  # endingTimestamp in µs: rows stamped at or after it are dropped

    def __repr__(self) -> str:
        return f"AcsPartition({self.stream}/{self.shard} {self.start} -> {self.end})"


def source_read_path(opts: SourceOptions) -> ReadPath:
    """The read path for the source options (caches when configured, else the durable store)."""
    return open_read_path(
        opts.root, data_cache=opts.data_cache, metadata_cache=opts.metadata_cache, token=opts.cache_token,
        tier_read_policy=opts.tier_read_policy,
    )


def read_partition(opts: SourceOptions, partition: AcsPartition) -> Iterator[pa.RecordBatch]:
    """Read one partition's range, in order, as Arrow record batches (runs in a Spark task).

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
    path = source_read_path(opts)
    try:
        end = Offset(*partition.end)
        tailer = ShardTailer(
            path,
            partition.stream,
            partition.shard,
            Offset(*partition.start),
            fail_on_data_loss=opts.fail_on_data_loss,
            limiter=RateLimiter(opts.max_bytes_per_second),
            include_headers=opts.include_headers,
        )
        waited_since: Optional[float] = None
        while tailer.offset < end:
            batches = tailer.step(end=end)
            if batches:
                waited_since = None
                if partition.before_us is not None:
                    batches = [_before(b, partition.before_us) for b in batches]
                yield from batches
                continue
            if tailer.offset >= end:
                break
            now = time.monotonic()
            waited_since = waited_since or now
            if now - waited_since > opts.read_timeout:
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
        path.close()


def _before(batch: pa.RecordBatch, before_us: int) -> pa.RecordBatch:
    """The rows of ``batch`` stamped before ``before_us`` (µs since the epoch)."""
    stamps = batch.column("timestamp").cast(pa.int64())
    return batch.filter(pc.less(stamps, before_us))


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
            out[s] = max(extent.latest(self._boundaries, self.path, begin), begin)
        return out

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
        latest = {s: max(extents[s].latest(self._boundaries, self.path, start[s]), start[s]) for s in shards}
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

    def partitions(self, start: OffsetMap, end: OffsetMap, before_us: Optional[int] = None) -> List[AcsPartition]:
        parts = []
        for s in sorted(end):
            a = start.get(s, Offset())
            b = end[s]
            if b > a:
                parts.append(AcsPartition(s[0], s[1], tuple(a), tuple(b), before_us))
        return parts


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
        """End offsets of the next micro-batch from ``start`` under ``limit`` (block boundaries per shard)."""
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
        for s, o in end.items():
            # A range of nothing but a seal (and an empty next file) is no batch: the offset
            # moves on with the next message, so no empty micro-batch runs after each file.
            # When a budget cut the range right after a seal or voided bytes while messages
            # follow, it takes the next message block too: a seal never holds a shard back.
            path, extent = self.planner.path, self.planner.extents[s]
            if o > begin[s] and not carries_messages(path, extent, begin[s], o):
                limit = latest_cap.get(s, o)
                if limit > o and carries_messages(path, extent, o, limit):
                    end[s] = advance(path, extent, begin[s], limit, max_rows=1)
                else:
                    end[s] = begin[s]
        return format_offsets(end)

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

    def partitions(self) -> Sequence[InputPartition]:
        """One partition per shard between ``startingOffsets`` and ``endingOffsets``."""
        start = self.planner.start_offsets(self.opts.starting_offsets, "earliest")
        if self.opts.ending_offsets and self.opts.ending_offsets != "latest":
            given = parse_offsets(self.opts.ending_offsets, option="endingOffsets")
            latest = self.planner.latest(sorted(start), start)
            for s, off in given.items():
                if s in latest and off > latest[s]:
                    raise AcsOptionError(
                        f"endingOffsets: {s[0]}/{s[1]} {off.to_json()} is past the end of the shard "
                        f"({latest[s].to_json()})",
                        option="endingOffsets",
                    )
            end = {s: given.get(s, latest[s]) for s in start}
        else:
            end = self.planner.latest(sorted(start), start)
        before_us = None
        if self.opts.ending_timestamp is not None:
            before_us = self.opts.ending_timestamp * 1000
            by_time = {s: offset_for_timestamp(self.planner.path, s[0], s[1], before_us, ending=True) for s in end}
            end = {s: max(start[s], min(end[s], by_time[s])) for s in end}
        parts = self.planner.partitions(start, end, before_us)
        if self.planner._path is not None:
            self.planner._path.close()
            self.planner._path = None
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Read one shard's range in order as Arrow record batches (runs in a Spark task)."""
        return read_partition(self.opts, partition)
