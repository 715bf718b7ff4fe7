"""The sink's commit protocol without Spark's engine: staging, intents, replays, failures.

The Spark-level behaviour (a real query restarted from its checkpoint) is covered in
test_spark_connector.py; here each step is driven directly so the failure cases are exact.
"""

from __future__ import annotations

import datetime
import json
import os

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

from pyspark_acs.read.consumer import Consumer
from pyspark_acs.datasource.options import parse_sink_options
from pyspark_acs.datasource.commit import SinkCommitter, abort_batch, commit_batch
from pyspark_acs.datasource.commit_log import Intent, Piece, Segment, SinkState, batch_manifest_rel
from pyspark_acs.datasource.sink import AcsStreamWriter
from pyspark_acs.datasource.staging import Stager
from pyspark_acs.errors import AcsError, AcsOptionError
from pyspark_acs.format.block import scan_blocks
from pyspark_acs.format.names import file_name, next_file_name, parse_file_name
from pyspark_acs.storage.store import open_store
from pyspark_acs.write.file import scan_file

from tests.helpers import later_files_at_first_open
from pyspark_acs.write.shard import ShardWriter

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
        calls.append(seg.file)
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


# -- a stream column: one batch, several streams (review findings) -------------------------------


def _routed(root):
    from pyspark_acs.datasource import sink as K

    opts = parse_sink_options({"root": root, "shards": "1", "sinkId": "q1", "maxBlockBytes": "1KiB"})
    sid = K._sink_id(opts)

    def stage(rows):
        b = pa.RecordBatch.from_pydict({"stream": [s for s, _ in rows], "value": [v for _, v in rows]})
        return Stager(opts, sid, {}).write(iter([b]))

    return opts, sid, stage


def _values(root, stream):
    c = Consumer(root, stream)
    got = [r["value"] for b in c.batches(timeout=0.3) for r in b.to_pylist()]
    c.close()
    return got


@pytest.mark.parametrize("lose_manifest", [False, True])
def test_a_replay_that_routes_no_rows_to_a_stream_still_completes_it(root, monkeypatch, lose_manifest):
    """Batch 1 commits stream a, then fails part way through stream b; its replay routes rows
    only to a. b's batch is completed from its intent (the batch's manifest lists b), not left
    half-written -- and without the manifest, b's next batch completes it first."""
    from pyspark_acs.write import shard as W

    opts, sid, stage = _routed(root)
    rows = [("a" if i % 2 else "b", b"%04d" % i + b"." * 300) for i in range(40)]
    commit_batch(opts, sid, [stage(rows[:10])], 0)
    real, calls = W.ShardWriter.append, {"b": 0}

    def flaky(self, data, count):
        if self.stream == "b":
            calls["b"] += 1
            if calls["b"] == 2:
                raise OSError("disk gone")
        return real(self, data, count)

    monkeypatch.setattr(W.ShardWriter, "append", flaky)
    first = [stage(rows[10:25]), stage(rows[25:40])]
    with pytest.raises(OSError, match="disk gone"):
        # one append per staged piece (append_bytes=1; the commit joins a shard's pieces up to
        # it), so the second one fails part way through stream b
        commit_batch(opts, sid, first, 1, append_bytes=1)
    abort_batch(opts, sid, first, 1, "batch 1 failed")
    monkeypatch.setattr(W.ShardWriter, "append", real)
    if lose_manifest:
        os.remove(os.path.join(root, batch_manifest_rel(sid, 1)))
    commit_batch(opts, sid, [stage([r for r in rows[10:40] if r[0] == "a"])], 1)
    commit_batch(opts, sid, [stage([("a", b"late-a"), ("b", b"late-b")])], 2)
    for s in "ab":
        assert _values(root, s) == [v for name, v in rows if name == s] + [b"late-" + s.encode()], s
    assert not os.path.exists(os.path.join(root, batch_manifest_rel(sid, 2)))
    assert [n for n in os.listdir(os.path.join(root, "b", "_sinks", sid)) if n.startswith("intent-")] == []


def test_header_bytes_count_towards_the_sink_block_size(root):
    """Review finding: the sink split blocks by value and key bytes only, so 2000 rows with 10 KB
    headers made one 20 MB block at maxBlockBytes=64KiB (at scale: past 2 GiB, a failed task)."""
    from pyspark_acs.datasource import sink as K
    from pyspark_acs.format.block import HEADERS_TYPE, scan_blocks

    opts = parse_sink_options({"root": root, "stream": "hdr", "shards": "1", "sinkId": "h", "maxBlockBytes": "64KiB"})
    sid = K._sink_id(opts)
    K._prepare(opts)
    rows = 2000
    batch = pa.RecordBatch.from_arrays(
        [pa.array([b"v"] * rows, pa.binary()),
         pa.array([[{"key": "big", "value": b"h" * 10_000}]] * rows, HEADERS_TYPE)], names=["value", "headers"])
    message = Stager(opts, sid, {"hdr": 1}).write(iter([batch]))
    (staged,) = message.streams["hdr"].staged
    data = open(os.path.join(root, staged[1]), "rb").read()
    sizes = [h.size for _, h in scan_blocks(data)]
    assert sum(h.count for _, h in scan_blocks(data)) == rows
    assert max(sizes) < 2 * 64 * 1024, max(sizes)


def test_a_routed_stream_with_another_shard_count_is_refused(root):
    from pyspark_acs.datasource import sink as K

    Consumer  # noqa: B018 (imported above for the other tests)
    from pyspark_acs.storage.store import open_store

    open_store(root).create_stream("two", 2)
    opts = parse_sink_options({"root": root, "shards": "3", "sinkId": "r"})
    batch = pa.RecordBatch.from_pydict({"stream": ["two"], "value": [b"x"]})
    with pytest.raises(AcsOptionError, match=r"stream 'two' \(column 'stream'\) has 2 shards, but option shards=3"):
        Stager(opts, K._sink_id(opts), {}).write(iter([batch]))


def test_a_deposed_writers_later_file_redirects_the_batch_not_fails_it(root, monkeypatch):
    """The race of test_fencing's lease-holder test, met by the sink: right after the sink
    creates its planned file, a deposed writer's file named after it appears. The sink holds
    the lease, so the batch goes on in a new file after that one (a redirect, as after a
    seal) instead of failing the query; every row lands once, in order."""
    late = later_files_at_first_open(monkeypatch, ShardWriter, ["x"])
    w = writer(root)
    w.commit([w.write(iter([batch([b"a0", b"a1", b"a2"], [0, 1, 0])]))], 0)
    w.commit([w.write(iter([batch([b"b0", b"b1"], [0, 1])]))], 1)
    assert late
    assert stream_values(root) == {0: [b"a0", b"a2", b"b0"], 1: [b"a1", b"b1"]}
    files = os.listdir(os.path.join(root, "out", "00000"))
    assert late[0] in files and max(f for f in files if f.endswith(".acs")) > late[0]


def _unsealed(root):
    store = open_store(root)
    return [f for f in store.list_files("out", 0) if not scan_file(store, f"out/00000/{f}").sealed]


def test_a_stray_before_the_sinks_file_is_sealed_at_its_next_commit(root):
    """A deposed writer's empty file named before the sink's file, created after the sink's
    claim (its writer died before sealing it): the sink makes a new ShardWriter per commit,
    so only recovery can seal it -- it seals every empty file (hostile review of ea781a5,
    finding 1). Readers from the start then get every committed row."""
    w = writer(root)
    w.commit([w.write(iter([batch([b"a0", b"a1"], [0, 1])]))], 0)
    folder = os.path.join(root, "out", "00000")
    planned = max(f for f in os.listdir(folder) if f.endswith(".acs"))
    stray = file_name(parse_file_name(planned).created - datetime.timedelta(microseconds=1), "d")
    open(os.path.join(folder, stray), "wb").close()
    for batch_id in range(1, 3):
        w.commit([w.write(iter([batch([b"b%d" % batch_id], [0])]))], batch_id)
    assert _unsealed(root) in ([], [planned])  # the sink's own file may stay open for its next batch
    assert stream_values(root)[0] == [b"a0", b"b1", b"b2"]


def test_two_later_files_redirect_the_batch_and_are_both_sealed(root, monkeypatch):
    """Two deposed writers' files appear right after the sink creates its planned file: the
    batch is redirected after them and both are sealed (the redirect's recovery seals every
    empty file, not only the newest; hostile review of c06cc8a, finding 2)."""
    late = later_files_at_first_open(monkeypatch, ShardWriter, ["x", "y"])
    w = writer(root)
    w.commit([w.write(iter([batch([b"a0", b"a1", b"a2"], [0, 1, 0])]))], 0)
    assert not set(late) & set(_unsealed(root))
    assert stream_values(root) == {0: [b"a0", b"a2"], 1: [b"a1"]}


def test_a_driver_that_dies_right_after_a_redirect_retries_exactly_once(root, monkeypatch):
    """The redirect of the test above, with the driver dying right after it (before the intent
    holds the new segments): Spark aborts, the restarted query retries batch 0 and replays
    batch 1; every row lands once, in order (hostile review of c06cc8a)."""
    later_files_at_first_open(monkeypatch, ShardWriter, ["x"])
    real_redirect = SinkCommitter._redirect
    calls = []

    def redirect_then_die(self, *args, **kwargs):
        out = real_redirect(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            raise AcsError("injected: the driver died right after the redirect")
        return out

    monkeypatch.setattr(SinkCommitter, "_redirect", redirect_then_die)
    w = writer(root)
    first = [w.write(iter([batch([b"a0", b"a1", b"a2"], [0, 1, 0])]))]
    with pytest.raises(AcsError, match="injected"):
        w.commit(first, 0)
    w.abort(first, 0)
    w.commit([w.write(iter([batch([b"a0", b"a1", b"a2"], [0, 1, 0])]))], 0)
    w.commit([w.write(iter([batch([b"b0"], [0])]))], 1)
    w.commit([w.write(iter([batch([b"b0"], [0])]))], 1)  # Spark's replay after a restart
    assert stream_values(root) == {0: [b"a0", b"a2", b"b0"], 1: [b"a1"]}


def test_a_copy_is_refused_to_the_sink(root):
    """A stream the copy daemon keeps (its _stream.json names the cluster it is copied from) is
    refused to the sink, whether the stream is its option or a row's column (hostile review
    of f5f4808, finding 2: only a missing stream was checked)."""
    from pyspark_acs.datasource import sink as K

    open_store(root).create_stream("out", 2, copied_from="A")
    with pytest.raises(AcsOptionError, match="copied from cluster 'A'") as err:
        writer(root)
    assert err.value.option == "stream"
    opts = parse_sink_options({"root": root, "shards": "2", "sinkId": "r"})
    routed = pa.RecordBatch.from_pydict({"stream": ["out"], "value": [b"x"]})
    with pytest.raises(AcsOptionError, match="copied from cluster 'A'"):
        Stager(opts, K._sink_id(opts), {}).write(iter([routed]))


# -- the commit log's files (docs/format.md section 7) ----------------------------------------

#: An intent as 0.1.0 wrote it: no "format", each staged piece a list [path, length, rows(, skip)].
INTENT_0_1_0 = {
    "batch": 7,
    "shards": {
        "1": [{"file": "20261122T091242032052Z-sinkab.acs", "start_length": 96, "start_index": 4,
               "staged": [["out/_sinks/ab/staging/t1-0/00001.blk", 900, 7],
                          ["out/_sinks/ab/staging/t2-1/00001.blk", 800, 3, 500]], "seal": True},
              {"file": "20261122T091242032053Z-sinkab.acs", "start_length": 0, "start_index": 0,
               "staged": [["out/_sinks/ab/staging/t3-2/00001.blk", 300, 2]], "seal": False}],
        "0": [{"file": "20261122T091242032052Z-sinkab.acs", "start_length": 0, "start_index": 0,
               "staged": [], "seal": False}],
    },
    "staging_dirs": ["out/_sinks/ab/staging/t1-0", "out/_sinks/ab/staging/t2-1", "out/_sinks/ab/staging/t3-2"],
}


def _sink_file(root, w, name):
    return os.path.join(root, "out", "_sinks", w.sink_id, name)


def test_an_intent_of_0_1_0_reads_as_typed_records_and_is_written_in_the_named_form():
    intent = Intent.from_json(json.loads(json.dumps(INTENT_0_1_0)))
    first, second = intent.shards[1]
    assert first == Segment("20261122T091242032052Z-sinkab.acs", 96, 4, (
        Piece("out/_sinks/ab/staging/t1-0/00001.blk", 900, 7),
        Piece("out/_sinks/ab/staging/t2-1/00001.blk", 800, 3, skip=500)), seal=True)
    assert [p.size for p in first.pieces] == [900, 300] and second.pieces[0].skip == 0
    assert list(intent.shards) == [1, 0] and intent.shards[0][0].pieces == ()  # in the file's order
    assert intent.batch == 7 and intent.staging_dirs == tuple(INTENT_0_1_0["staging_dirs"])
    new = intent.to_json()
    assert new["format"] == 2
    assert new["shards"]["1"][0]["staged"][1] == {
        "path": "out/_sinks/ab/staging/t2-1/00001.blk", "length": 800, "rows": 3, "skip": 500}
    # the fields around the pieces are 0.1.0's
    assert {k: v for k, v in new["shards"]["1"][1].items() if k != "staged"} == {
        k: v for k, v in INTENT_0_1_0["shards"]["1"][1].items() if k != "staged"}
    assert Intent.from_json(json.loads(json.dumps(new))) == intent  # the named form round-trips


def test_a_state_file_of_0_1_0_round_trips_unchanged():
    raw = {"last_batch": 3, "shards": {"1": {"file": "20261122T091242032052Z-sinkab.acs", "length": 4096,
                                             "next_index": 17, "sealed": False},
                                       "0": {"file": "20261122T091242032053Z-sinkab.acs", "length": 56,
                                             "next_index": 0, "sealed": True}},
           "updated": 1795000000.25}
    state = SinkState.from_json(raw)
    assert state.last_batch == 3 and state.shards[1].next_index == 17 and state.shards[0].sealed
    assert json.dumps(state.to_json()) == json.dumps(raw)


def test_a_batch_whose_driver_died_after_a_0_1_0_intent_is_completed_from_it(root):
    """A driver of 0.1.0 wrote its intent (positional pieces; shard 1's piece skips its first
    block, as after a redirect) and died before appending: this version's retry of the batch
    appends exactly what the intent plans, and its own attempt's rows are not used."""
    w = writer(root, maxBlockBytes="1KiB")
    values = [b"v%02d" % i + b"." * 300 for i in range(12)]
    staged = w.write(iter([batch(values, [i % 2 for i in range(12)])])).streams["out"]
    pieces = {shard: [rel, nbytes, rows] for shard, rel, nbytes, rows in staged.staged}
    rel1, nbytes1, rows1 = pieces[1]
    (_, first_block), *rest = scan_blocks(open(os.path.join(root, rel1), "rb").read())
    assert rest  # shard 1's piece holds more than one block
    name = next_file_name([], f"sink{w.sink_id}")
    old = {"batch": 0, "shards": {
        "0": [{"file": name, "start_length": 0, "start_index": 0, "staged": [pieces[0]], "seal": False}],
        "1": [{"file": name, "start_length": 0, "start_index": 0,
               "staged": [[rel1, nbytes1, rows1 - first_block.count, first_block.size]], "seal": False}]},
        "staging_dirs": [staged.staging_dir]}
    with open(_sink_file(root, w, "intent-0.json"), "w") as f:
        json.dump(old, f)
    w.commit([w.write(iter([batch([b"ignored"], [0])]))], 0)
    assert stream_values(root) == {0: values[0::2], 1: values[1::2][first_block.count:]}
    with open(_sink_file(root, w, "state.json")) as f:
        state = json.load(f)
    assert state["last_batch"] == 0 and state["shards"]["1"]["next_index"] == 6 - first_block.count
    assert not os.path.exists(_sink_file(root, w, "intent-0.json"))
    assert not os.path.exists(os.path.join(root, staged.staging_dir))  # the intent's staging is deleted
    w.commit([w.write(iter([batch([b"replayed"], [0])]))], 0)  # a replay writes nothing
    assert stream_values(root)[0] == values[0::2]


def test_a_commit_that_dies_leaves_an_intent_in_the_named_form_that_its_retry_completes(root, monkeypatch):
    w = writer(root)
    first = [w.write(iter([batch([b"x0", b"x1", b"x2"], [0, 1, 0])]))]

    def die(self, store, shard, plan):
        raise AcsError("injected: the driver died right after writing its intent")

    monkeypatch.setattr(SinkCommitter, "_append_shard", die)
    with pytest.raises(AcsError, match="injected"):
        w.commit(first, 0)
    monkeypatch.undo()
    with open(_sink_file(root, w, "intent-0.json")) as f:
        raw = json.load(f)
    assert raw["format"] == 2 and raw["batch"] == 0 and sorted(raw["shards"]) == ["0", "1"]
    (seg,) = raw["shards"]["0"]
    (piece,) = seg["staged"]
    assert sorted(piece) == ["length", "path", "rows", "skip"] and piece["rows"] == 2 and piece["skip"] == 0
    assert Intent.from_json(raw).to_json() == raw
    w.commit([w.write(iter([batch([b"ignored"], [0])]))], 0)
    assert stream_values(root) == {0: [b"x0", b"x2"], 1: [b"x1"]}


def test_an_intent_of_a_newer_format_is_refused_naming_the_file(root):
    w = writer(root)
    os.makedirs(os.path.dirname(_sink_file(root, w, "intent-0.json")), exist_ok=True)
    with open(_sink_file(root, w, "intent-0.json"), "w") as f:
        json.dump({**INTENT_0_1_0, "format": 3}, f)
    with pytest.raises(AcsError, match=r"intent-0\.json: sink intent of format 3, newer than this version"):
        w.commit([w.write(iter([batch([b"v"], [0])]))], 0)
    assert stream_values(root) == {0: [], 1: []}  # nothing appended


def test_a_malformed_intent_is_refused_naming_the_file(root):
    w = writer(root)
    os.makedirs(os.path.dirname(_sink_file(root, w, "intent-0.json")), exist_ok=True)
    with open(_sink_file(root, w, "intent-0.json"), "w") as f:
        json.dump({"batch": 0, "shards": {"0": [{"file": "x.acs"}]}, "staging_dirs": []}, f)
    with pytest.raises(AcsError, match=r"intent-0\.json: corrupt sink record: 'start_length'"):
        w.commit([w.write(iter([batch([b"v"], [0])]))], 0)
