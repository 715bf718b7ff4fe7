"""Batch reads that prune (pushFilters) and split (minPartitions), and the read path's batches.

The stream is written with known blocks: per shard, BLOCKS blocks of PER_BLOCK messages (one
producer flush each), block k stamped BASE + k * STEP (+ i µs per message), files rolled every
few blocks. One block of shard 1 is stamped out of order: its first and last messages lie
outside the filtered time range, a middle one inside -- a reader that trusted the header's
first/last stamps would lose that message.
"""

from __future__ import annotations

import datetime as dt
from typing import Dict, List, Set, Tuple

import pytest
from pyspark.sql import functions as F
from pyspark.sql.datasource import EqualTo, GreaterThanOrEqual, In, IsNotNull, LessThan, StringStartsWith

from pyspark_acs import Producer
from pyspark_acs.datasource.options import parse_source_options
from pyspark_acs.datasource.source import (
    AcsBatchReader,
    AcsPartition,
    AcsPruningBatchReader,
    Pruning,
    read_partition,
)
from pyspark_acs.format.block import scan_blocks
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.batches import READ_BATCH_BYTES, batch_bytes, coalesce_batches
from pyspark_acs.read.readpath import DurableReadPath
from pyspark_acs.storage.store import open_store

SHARDS = 2
BLOCKS = 12
PER_BLOCK = 10
SIZE = 200
BASE_US = 1_700_000_000_000_000
STEP_US = 1_000_000_000  # 1000 s between blocks
ODD_SHARD, ODD_BLOCK = 1, 2  # the block stamped out of order
PUSHDOWN = "spark.sql.python.filterPushdown.enabled"


def stamp(k: int, i: int) -> int:
    if (k, i) == (ODD_BLOCK, PER_BLOCK // 2):
        return BASE_US + 9 * STEP_US + 500  # inside the 8..10 window, in block 2
    return BASE_US + k * STEP_US + i


def as_dt(us: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(microseconds=us)


@pytest.fixture(scope="module")
def stream_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("pruning") / "store")
    # rolls every ~4 blocks: several files per shard
    with Producer(root, "events", shards=SHARDS, roll_bytes=4 * PER_BLOCK * (SIZE + 24)) as p:
        for k in range(BLOCKS):
            for shard in range(SHARDS):
                for i in range(PER_BLOCK):
                    us = stamp(k, i) if shard == ODD_SHARD else BASE_US + k * STEP_US + i
                    p.send(b"%d/%02d/%d " % (shard, k, i) + b"x" * (SIZE - 12), shard=shard, timestamp=us)
            p.flush()
    return root


def opts(root: str, **extra: str):
    return parse_source_options(dict({"root": root, "stream": "events"}, **extra))


class RecordingPath(DurableReadPath):
    """The durable read path, recording every byte range a read task asks for."""

    def __init__(self, root: str) -> None:
        super().__init__(open_store(root))
        self.ranges: List[Tuple[str, int, int]] = []

    def read(self, rel: str, start: int, end: int, **kw) -> bytes:
        self.ranges.append((rel, start, end))
        return super().read(rel, start, end, **kw)


def all_blocks(root: str) -> Dict[Tuple[str, int], Tuple[int, int, int]]:
    """(rel, position) -> (shard, block number k, size) of every message block."""
    store = open_store(root)
    out = {}
    for shard in range(SHARDS):
        k = 0
        for name in store.list_files("events", shard):
            rel = f"{shard_dir('events', shard)}/{name}"
            data = store.read(rel, 0, store.lengths([rel])[rel])
            for at, h in scan_blocks(data, final=True):
                if h.count:
                    out[(rel, at)] = (shard, k, h.size)
                    k += 1
    store.close()
    return out


def opened_blocks(root: str, reader: AcsBatchReader) -> Tuple[Set[Tuple[int, int]], List[bytes]]:
    """(shard, k) of every block whose bytes the read tasks read, and the values read."""
    path = RecordingPath(root)
    values: List[bytes] = []
    for part in reader.partitions():
        for batch in read_partition(reader.opts, part, path):
            values.extend(batch.column("value").to_pylist())
    blocks = all_blocks(root)
    opened = {
        (shard, k)
        for (rel, at), (shard, k, size) in blocks.items()
        for r, start, end in path.ranges
        if r == rel and start < at + size and at < end
    }
    return opened, values


def pruned(root: str, filters, **extra: str) -> Tuple[AcsPruningBatchReader, list]:
    reader = AcsPruningBatchReader(opts(root, **extra))
    rest = list(reader.pushFilters(filters))
    return reader, rest


def test_time_filter_opens_only_the_blocks_it_needs(stream_root):
    lo, hi = as_dt(BASE_US + 8 * STEP_US), as_dt(BASE_US + 10 * STEP_US)
    filters = [GreaterThanOrEqual(("timestamp",), lo), LessThan(("timestamp",), hi)]
    reader, rest = pruned(stream_root, filters)
    assert rest == filters  # rows are still filtered by Spark: blocks are pruned, not rows
    opened, values = opened_blocks(stream_root, reader)
    # blocks 8 and 9 of each shard, and shard 1's block 2 (a middle message is in range)
    assert opened == {(0, 8), (0, 9), (1, 8), (1, 9), (ODD_SHARD, ODD_BLOCK)}
    assert b"%d/%02d/%d " % (ODD_SHARD, ODD_BLOCK, PER_BLOCK // 2) in {v[:7] for v in values}

    full, _ = opened_blocks(stream_root, AcsBatchReader(opts(stream_root)))
    assert len(full) == SHARDS * BLOCKS  # without filters every block is read


def test_shard_and_file_filters_skip_shards_and_files(stream_root):
    reader, rest = pruned(stream_root, [EqualTo(("shard",), 1), IsNotNull(("file",))])
    assert rest == []  # applied exactly
    opened, values = opened_blocks(stream_root, reader)
    assert {s for s, _ in opened} == {1} and len(opened) == BLOCKS
    assert len(values) == BLOCKS * PER_BLOCK

    store = open_store(stream_root)
    files = store.list_files("events", 0)
    assert len(files) >= 3
    reader, rest = pruned(stream_root, [In(("file",), (files[1],)), EqualTo(("stream",), "events")])
    assert rest == []
    opened, values = opened_blocks(stream_root, reader)
    second = {k for (rel, _), (s, k, _) in all_blocks(stream_root).items() if rel.endswith(files[1])}
    assert opened == {(0, k) for k in second} and len(values) == len(second) * PER_BLOCK

    reader, rest = pruned(stream_root, [EqualTo(("stream",), "other")])
    assert reader.partitions() == [] or opened_blocks(stream_root, reader)[0] == set()

    prefix = StringStartsWith(("file",), files[0][:8])
    reader, rest = pruned(stream_root, [prefix, EqualTo(("shard",), 0)])
    assert rest == [] and len(opened_blocks(stream_root, reader)[0]) == BLOCKS


def test_filters_it_cannot_use_go_back_to_spark():
    p = Pruning()
    other = [EqualTo(("value",), b"x"), EqualTo(("shard",), "1"), GreaterThanOrEqual(("timestamp",), 5)]
    assert [f for f in other if not p.push(f)] == other
    assert not p.exact and not p.by_time


def test_min_partitions_splits_at_block_boundaries(stream_root):
    plain = AcsBatchReader(opts(stream_root)).partitions()
    assert len(plain) == SHARDS
    reader = AcsBatchReader(opts(stream_root, minPartitions="6"))
    parts = reader.partitions()
    assert len(parts) >= 6 and all(isinstance(p, AcsPartition) for p in parts)
    store = open_store(stream_root)
    boundaries = set()
    for shard in range(SHARDS):
        for name in store.list_files("events", shard):
            rel = f"{shard_dir('events', shard)}/{name}"
            boundaries.add((name, 0))
            for at, h in scan_blocks(store.read(rel, 0, store.lengths([rel])[rel]), final=True):
                boundaries.add((name, at + h.size))
    values = []
    for p in parts:
        assert p.start[:2] in boundaries and p.end[:2] in boundaries  # cuts are block boundaries
        assert p.start[2:] == p.end[2:] == (0,)  # (file, length, position): no position in a split
        values.extend(v for b in read_partition(reader.opts, p, RecordingPath(stream_root))
                      for v in b.column("value").to_pylist())
    assert sorted(values) == sorted(v for p in plain for b in read_partition(reader.opts, p, RecordingPath(stream_root))
                                    for v in b.column("value").to_pylist())
    assert len(values) == SHARDS * BLOCKS * PER_BLOCK


def test_coalesced_batches_keep_order_and_bound_size(stream_root):
    part = AcsBatchReader(opts(stream_root)).partitions()[0]
    raw = list(read_partition(opts(stream_root), part, RecordingPath(stream_root)))
    assert len(raw) == 1  # 12 small blocks, one Arrow batch
    assert raw[0].column("value").to_pylist() == [
        b"0/%02d/%d " % (k, i) + b"x" * (SIZE - 12) for k in range(BLOCKS) for i in range(PER_BLOCK)]
    pieces = [raw[0].slice(i, 7) for i in range(0, raw[0].num_rows, 7)]
    small = list(coalesce_batches(pieces, max_bytes=3000))
    assert 1 < len(small) < len(pieces) and all(b.nbytes <= 3000 for b in small)
    assert [v for b in small for v in b.column("value").to_pylist()] == raw[0].column("value").to_pylist()
    assert READ_BATCH_BYTES >= 1024 * 1024


def test_batch_bytes_counts_a_slice_by_its_own_rows(stream_root):
    """The size coalescing caps is read from offsets and widths (RecordBatch.nbytes walked every
    column: ~13-20 us a block): what the rows take once concatenated, for a slice of a larger
    batch too, every column counted (a long stream name made batches ~3x the cap when only key
    and value were), validity bitmaps left out."""
    import pyarrow as pa

    from pyspark_acs.format.block import HEADERS_TYPE

    part = AcsBatchReader(opts(stream_root)).partitions()[0]
    whole = list(read_partition(opts(stream_root), part, RecordingPath(stream_root)))[0]

    def copied(b):  # the rows in fresh buffers of their own: what a concat makes of them
        return pa.RecordBatch.from_pylist(b.to_pylist(), schema=b.schema).nbytes

    def close(b):
        slack = b.num_columns * (b.num_rows // 8 + 4)  # validity bitmaps, a null key's offsets
        return copied(b) - slack <= batch_bytes(b) <= copied(b) + slack

    for b in (whole, whole.slice(0, 1), whole.slice(5, 9), whole.slice(whole.num_rows - 3)):
        assert close(b), (batch_bytes(b), copied(b))
    assert batch_bytes(whole.slice(5, 9)) < batch_bytes(whole) // 2
    assert batch_bytes(whole.slice(0, 0)) == 0
    long_names = pa.RecordBatch.from_pydict({"stream": ["s" * 128] * 100, "key": [b""] * 100, "value": [b""] * 100},
                                            schema=pa.schema([("stream", pa.string()), ("key", pa.binary()),
                                                              ("value", pa.binary())]))
    assert close(long_names) and batch_bytes(long_names) >= 128 * 100
    with_headers = pa.RecordBatch.from_arrays(
        [pa.array([b"k"], pa.binary()), pa.array([b"v"], pa.binary()),
         pa.array([[{"key": "h", "value": b"x" * 5000}]], HEADERS_TYPE)], names=["key", "value", "headers"])
    assert batch_bytes(with_headers) >= 5000 + 2  # nested columns count their buffers
    words = pa.array(["w" * 1000, "w" * 1000, None]).dictionary_encode()  # indices and values
    as_dictionary = pa.RecordBatch.from_arrays([words], names=["word"])
    assert batch_bytes(as_dictionary) >= 1000
    assert batch_bytes(pa.RecordBatch.from_arrays([pa.nulls(3)], names=["nothing"])) >= 0  # no buffers: counted, not raised
    no_offsets = pa.Array.from_buffers(pa.binary(), 0, [None, pa.py_buffer(b""), pa.py_buffer(b"")])
    assert batch_bytes(pa.RecordBatch.from_arrays([no_offsets], names=["value"])) == 0


def test_spark_pushdown_same_rows_as_without(spark, stream_root):
    df = spark.read.format("acs").option("root", stream_root).option("stream", "events")
    lo, hi = as_dt(BASE_US + 8 * STEP_US), as_dt(BASE_US + 10 * STEP_US)
    queries = [
        lambda d: d.where((F.col("timestamp") >= F.lit(lo)) & (F.col("timestamp") < F.lit(hi))),
        lambda d: d.where((F.col("shard") == 1) & (F.col("timestamp") > F.lit(lo))),
        lambda d: d.where(F.col("shard").isin(0) | (F.col("position") == 3)),  # an OR stays with Spark
    ]
    before = spark.conf.get(PUSHDOWN, "false")
    try:
        spark.conf.set(PUSHDOWN, "false")
        expected = [sorted(bytes(r.value) for r in q(df.load()).collect()) for q in queries]
        spark.conf.set(PUSHDOWN, "true")
        got = [sorted(bytes(r.value) for r in q(df.load()).collect()) for q in queries]
        # pruned at planning: the one shard left is the one task there is
        assert df.load().where(F.col("shard") == 1).rdd.getNumPartitions() == 1
        split = df.option("minPartitions", "5").load()
        assert split.rdd.getNumPartitions() >= 5 and split.count() == SHARDS * BLOCKS * PER_BLOCK
    finally:
        spark.conf.set(PUSHDOWN, before)
    assert got == expected
    assert len(expected[0]) == 2 * SHARDS * PER_BLOCK + 1  # blocks 8, 9 and the odd message
