"""The sink's commit protocol without Spark's engine: staging, intents, replays, failures.

The Spark-level behaviour (a real query restarted from its checkpoint) is covered in
test_spark_connector.py; here each step is driven directly so the failure cases are exact.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

from pyspark_acs.read.consumer import Consumer
from pyspark_acs.datasource.options import parse_sink_options
from pyspark_acs.datasource.sink import AcsStreamWriter, SinkCommitter
from pyspark_acs.errors import AcsError, AcsOptionError

SCHEMA = StructType([StructField("shard", IntegerType()), StructField("value", BinaryType())])


def writer(root, **extra):
    opts = parse_sink_options({"root": root, "stream": "out", "shards": "2", "checkpointLocation": "/ck/q1", **extra})
    return AcsStreamWriter(opts, SCHEMA)


def batch(values, shards):
    return pa.RecordBatch.from_arrays(
        [pa.array(shards, pa.int32()), pa.array(values, pa.binary())], names=["shard", "value"]
    )


def stream_values(root):
    c = Consumer(root, "out")
    rows = [r for b in c.batches(timeout=0.3) for r in b.to_pylist()]
    c.close()
    return {s: [r["value"] for r in rows if r["shard"] == s] for s in (0, 1)}


def test_replay_of_the_last_batch_writes_nothing_and_order_is_kept(root):
    w = writer(root)
    for batch_id in range(3):
        msgs = [w.write(iter([batch([b"b%d-%d" % (batch_id, i) for i in range(4)], [0, 1, 0, 1])]))]
        w.commit(msgs, batch_id)
    replay = [w.write(iter([batch([b"again"], [0])]))]
    w.commit(replay, 2)  # Spark replays the last batch after a restart: nothing lands
    got = stream_values(root)
    assert got[0] == [b"b%d-%d" % (b, i) for b in range(3) for i in (0, 2)]
    assert got[1] == [b"b%d-%d" % (b, i) for b in range(3) for i in (1, 3)]


def test_failed_commit_then_abort_then_retry_completes_exactly_once(root, monkeypatch):
    w = writer(root)
    w.commit([w.write(iter([batch([b"a0", b"a1"], [0, 1])]))], 0)
    first = [w.write(iter([batch([b"x0", b"x1"], [0, 1])]))]
    real = SinkCommitter._append_shard

    def fail_on_shard_1(self, store, shard, plan):
        if shard == 1:
            raise AcsError("injected: the driver died while appending shard 1")
        return real(self, store, shard, plan)

    monkeypatch.setattr(SinkCommitter, "_append_shard", fail_on_shard_1)
    with pytest.raises(AcsError, match="injected"):
        w.commit(first, 1)
    w.abort(first, 1)  # what Spark does after a failed commit: the intent's staging stays
    monkeypatch.setattr(SinkCommitter, "_append_shard", real)
    retry = [w.write(iter([batch([b"x0", b"x1"], [0, 1])]))]  # the restarted query's attempt
    w.commit(retry, 1)
    assert stream_values(root) == {0: [b"a0", b"x0"], 1: [b"a1", b"x1"]}


def test_an_older_batch_id_is_refused_not_dropped(root):
    w = writer(root)
    w.commit([w.write(iter([batch([b"v"], [0])]))], 5)
    with pytest.raises(AcsError, match="older than the last committed batch 5"):
        w.commit([w.write(iter([batch([b"w"], [0])]))], 0)


def test_sink_needs_an_identity(root):
    opts = parse_sink_options({"root": root, "stream": "out", "shards": "2"})
    with pytest.raises(AcsOptionError, match="checkpointLocation"):
        AcsStreamWriter(opts, SCHEMA)


def test_out_of_range_shard_is_refused_even_next_to_nulls(root):
    w = writer(root)
    with pytest.raises(AcsOptionError, match="shard 99 is out of range"):
        w.write(iter([batch([b"a", b"b"], [None, 99])]))


def test_a_large_batch_rolls_over_to_new_files_and_resumes_exactly(root, monkeypatch):
    w = writer(root, rollBytes="3KiB", maxBlockBytes="1KiB")
    tasks = [[b"t%d-%03d" % (t, i) + b"." * 200 for i in range(12)] for t in range(3)]
    msgs = [w.write(iter([batch(vals, [0] * len(vals))])) for vals in tasks]
    real = SinkCommitter._append_segment
    calls = []

    def crash_on_second_segment(self, store, shard, seg, lease):
        calls.append(seg["file"])
        if len(calls) == 2:
            raise AcsError("injected: driver died between two files")
        return real(self, store, shard, seg, lease)

    monkeypatch.setattr(SinkCommitter, "_append_segment", crash_on_second_segment)
    with pytest.raises(AcsError, match="injected"):
        w.commit(msgs, 0)
    w.abort(msgs, 0)
    monkeypatch.setattr(SinkCommitter, "_append_segment", real)
    w.commit([w.write(iter([batch([b"ignored"], [0])]))], 0)  # the retry finishes from the intent
    files = [f for f in sorted(os.listdir(os.path.join(root, "out", "00000"))) if f.endswith(".acs")]
    assert len(files) >= 3  # ~7.5 KiB of blocks with 3 KiB files
    assert stream_values(root)[0] == [v for vals in tasks for v in vals]
