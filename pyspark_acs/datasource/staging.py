"""The sink's task side: rows routed to streams and shards, encoded into blocks and staged as files."""

from __future__ import annotations

import bisect
import uuid
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import WriterCommitMessage

from pyspark_acs.datasource.commit_log import sink_dir
from pyspark_acs.datasource.options import SinkOptions
from pyspark_acs.errors import AcsOptionError
from pyspark_acs.format.block import encode_block
from pyspark_acs.format.names import validate_stream
from pyspark_acs.storage.store import DurableStore, open_store
from pyspark_acs.write.shard import shard_for_key

__all__ = [
    "AcsCommitMessage",
    "StagedStream",
    "Stager",
    "staging_root",
]


def staging_root(stream: str, sink_id: str) -> str:
    """The folder of a sink identity's staged files in ``stream`` (one subfolder per task
    attempt), relative to the root."""
    return f"{sink_dir(stream, sink_id)}/staging"


class StagedStream(NamedTuple):
    """What one task staged for one stream: ``[(shard, staged file path relative to the root,
    bytes, rows)]`` in its staging folder."""

    staged: List[Tuple[int, str, int, int]]
    staging_dir: str


class AcsCommitMessage(WriterCommitMessage):
    """What one task staged, per stream (plain data): ``{stream: StagedStream}``."""

    def __init__(self, streams: Dict[str, StagedStream]) -> None:
        self.streams = streams


def _column(batch: pa.RecordBatch, name: str) -> Optional[pa.Array]:
    for i, field in enumerate(batch.schema):
        if field.name.lower() == name:
            return batch.column(i)
    return None


class Stager:
    """Task side: route rows to streams, encode them into blocks per shard and stage them in the
    durable store."""

    def __init__(self, opts: SinkOptions, sink_id: str, shards: Dict[str, int]) -> None:
        self.opts = opts
        self.sink_id = sink_id
        self.shards = dict(shards)  # stream -> shard count; streams met in rows are added

    def write(self, batches: Iterator[pa.RecordBatch]) -> AcsCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        pid = ctx.partitionId() if ctx else 0
        store = open_store(self.opts.root)
        attempt = f"{uuid.uuid4().hex}-{pid}"
        appenders: Dict[Tuple[str, int], Any] = {}
        counts: Dict[Tuple[str, int], List[int]] = {}
        rows: Dict[str, int] = {}
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                for stream, sub in self._route(batch, store):
                    shard_ids = self._shards_of(sub, stream, pid, rows.get(stream, 0))
                    rows[stream] = rows.get(stream, 0) + sub.num_rows
                    for shard, part in self._split(sub, shard_ids, self.shards[stream]):
                        app = appenders.get((stream, shard))
                        if app is None:
                            rel = f"{self._staging(stream, attempt)}/{shard:05d}.blk"
                            app = appenders[(stream, shard)] = store.open_appender(rel)
                            counts[(stream, shard)] = [0, 0]
                        for block, n in self._blocks(part):
                            app.write(block)
                            counts[(stream, shard)][0] += len(block)
                            counts[(stream, shard)][1] += n
        finally:
            for app in appenders.values():
                app.close()
            store.close()
        out: Dict[str, StagedStream] = {}
        for stream, shard in sorted(appenders):
            staging = self._staging(stream, attempt)
            entry = out.setdefault(stream, StagedStream([], staging))
            entry.staged.append((shard, f"{staging}/{shard:05d}.blk", *counts[(stream, shard)]))
        return AcsCommitMessage(out)

    def _staging(self, stream: str, attempt: str) -> str:
        return f"{staging_root(stream, self.sink_id)}/{attempt}"

    def _route(self, batch: pa.RecordBatch, store: DurableStore) -> Iterator[Tuple[str, pa.RecordBatch]]:
        """``(stream, rows)`` pairs of a batch, row order kept within each stream: option
        ``stream`` takes every row (it overrides a ``stream`` column, as Kafka's ``topic``
        option does), else the ``stream`` column routes each row."""
        if self.opts.stream is not None:
            self._check_stream(self.opts.stream, store)
            yield self.opts.stream, batch
            return
        column = _column(batch, "stream")
        if column.null_count:
            row = pc.index(pc.is_null(column), True).as_py()
            raise AcsOptionError(
                f"acs sink: column 'stream' is null in a row (number {row} of a batch of this task); every row "
                f"needs a target stream, or give option 'stream' to write all rows to one",
                option="stream",
            )
        names = sorted(pc.unique(column).to_pylist())
        for name in names:
            self._check_stream(name, store)
        if len(names) == 1:
            yield names[0], batch
            return
        for name in names:
            yield name, batch.filter(pc.equal(column, name))

    def _check_stream(self, stream: str, store: DurableStore) -> None:
        """A stream met in a ``stream`` column: a safe name, and known (or created with option
        ``shards``)."""
        if stream in self.shards:
            return
        try:
            validate_stream(stream)
        except ValueError as exc:
            raise AcsOptionError(f"acs sink: column 'stream': {exc}", option="stream") from None
        existing = store.writer_shards(stream)
        if existing is None:
            if self.opts.shards is None:
                raise AcsOptionError(
                    f"acs sink: stream {stream!r} (column 'stream') does not exist in {self.opts.root}; give "
                    f"option 'shards' to create streams the column names",
                    option="shards",
                )
            existing = store.create_stream(stream, self.opts.shards)
        elif self.opts.shards is not None and self.opts.shards != existing:
            raise AcsOptionError(
                f"shards: stream {stream!r} (column 'stream') has {existing} shards, but option shards="
                f"{self.opts.shards}", option="shards",
            )
        self.shards[stream] = existing

    def _shards_of(self, batch: pa.RecordBatch, stream: str, pid: int, row: int) -> pa.Array:
        n = batch.num_rows
        count = self.shards[stream]
        shard = _column(batch, "shard")
        if shard is not None:
            shard = pc.cast(shard, pa.int64())
            bad = pc.fill_null(pc.or_(pc.less(shard, 0), pc.greater_equal(shard, count)), False)
            if pc.any(bad).as_py():
                value = pc.filter(shard, bad)[0].as_py()
                raise AcsOptionError(
                    f"acs sink: shard {value} is out of range for stream {stream!r} with "
                    f"{count} shards (allowed 0..{count - 1})",
                    option="shard",
                )
            if shard.null_count == 0:
                return shard
        key = _column(batch, "key")
        if key is not None and key.null_count < n:
            if pa.types.is_string(key.type) or pa.types.is_large_string(key.type):
                key = key.cast(pa.binary())
            rr = (row + pid) % count
            ids = [
                shard_for_key(k, count) if k is not None else (rr + i) % count
                for i, k in enumerate(key.to_pylist())
            ]
            base = pa.array(ids, pa.int64())
        else:
            # No key: spread rows round-robin, starting where this task left off.
            seq = pc.add(pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), n)), row + pid - 1)
            base = pc.subtract(seq, pc.multiply(pc.divide(seq, count), count))  # seq mod shards
        if shard is not None:  # explicit shard where given, hash/round-robin for nulls
            return pc.if_else(pc.is_null(shard), base, shard)
        return base

    def _split(self, batch: pa.RecordBatch, shard_ids: pa.Array, count: int) -> Iterator[Tuple[int, pa.RecordBatch]]:
        if count == 1:
            yield 0, batch
            return
        order = pc.sort_indices(shard_ids)  # stable: keeps the row order within a shard
        sorted_ids = pc.take(shard_ids, order)
        table = batch.take(order)
        counts = pc.value_counts(sorted_ids)
        at = 0
        for item in sorted(counts.to_pylist(), key=lambda d: d["values"]):
            yield int(item["values"]), table.slice(at, item["counts"])
            at += item["counts"]

    def _blocks(self, part: pa.RecordBatch) -> Iterator[Tuple[bytes, int]]:
        values = _column(part, "value")
        keys = _column(part, "key")
        stamps = _column(part, "timestamp")
        headers = _column(part, "headers")
        sizes = pc.binary_length(values.cast(pa.binary()) if not pa.types.is_binary(values.type) else values)
        if keys is not None:
            ksizes = pc.binary_length(keys.cast(pa.binary()) if not pa.types.is_binary(keys.type) else keys)
            sizes = pc.add(pc.fill_null(sizes, 0), pc.fill_null(ksizes, 0))
        if headers is not None:  # header keys and values count towards the block size too
            pairs = headers.flatten()
            pair_sizes = pc.add(pc.fill_null(pc.binary_length(pairs.field("key")), 0),
                                pc.fill_null(pc.binary_length(pairs.field("value")), 0))
            per_row = pc.fill_null(pc.list_value_length(headers), 0).cast(pa.int64())
            offsets = pc.cumulative_sum(per_row).to_pylist()
            csum = pc.cumulative_sum(pair_sizes).to_pylist() if len(pair_sizes) else []
            row_bytes, prev = [], 0
            for end_pair in offsets:  # bytes of each row's headers, from the running pair sums
                total = csum[end_pair - 1] if end_pair else 0
                row_bytes.append(total - prev)
                prev = total
            sizes = pc.add(pc.fill_null(sizes, 0), pa.array(row_bytes, pa.int64()))
        cum = pc.cumulative_sum(pc.add(pc.fill_null(sizes, 0), 16)).to_pylist()
        start, n, base = 0, part.num_rows, 0
        limit = self.opts.max_block_bytes
        while start < n:
            end = bisect.bisect_right(cum, base + limit, lo=start)
            end = max(end, start + 1)
            ts = None
            if stamps is not None:
                ts = stamps.slice(start, end - start)
                if pa.types.is_timestamp(ts.type) and ts.type.tz is None:
                    ts = ts.cast(pa.timestamp("us"))
            yield (
                encode_block(
                    values.slice(start, end - start),
                    None if keys is None else keys.slice(start, end - start),
                    ts,
                    headers=None if headers is None else headers.slice(start, end - start),
                ),
                end - start,
            )
            base = cum[end - 1]
            start = end
