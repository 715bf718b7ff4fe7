"""The sink's exactly-once state across a promotion: its marks in the shards' bytes.

Two clusters' real stores and the real promotion (``acs promote``'s function, A lost); the
copy is modelled as in tests/server/test_failover_model.py (B takes the stream as its copy
daemon's hello does, then bytes of A's files are appended to B's, up to a chosen length: the
cut). The sink is driven as Spark drives it (``write`` per task, ``commit`` per batch id), so a
crash between two appends is exact; test_spark_connector.py has the query restarted against B.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

import pyspark_acs.datasource.commit as commit_mod
from pyspark_acs.datasource.commit_log import STATE_FILE, Segment, sink_dir
from pyspark_acs.datasource.options import parse_sink_options
from pyspark_acs.datasource.sink import AcsStreamWriter
from pyspark_acs.errors import AcsError
from pyspark_acs.datasource.marks import mark_payload
from pyspark_acs.format.block import encode_mark, mark_body, scan_blocks
from pyspark_acs.format.names import shard_dir
from pyspark_acs.server.copy.promote import promote
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.shard import ShardWriter

from tests.helpers import free_port, read_history

SCHEMA = StructType([StructField("shard", IntegerType()), StructField("value", BinaryType())])
STREAM = "out"


class Clusters:
    """A -> B with a topology file, a stream of 2 shards written by the sink in A."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.roots = {c: tmp / f"root-{c}" for c in "AB"}
        for r in self.roots.values():
            r.mkdir()
        self.topology = tmp / "topology.json"
        self.topology.write_text(json.dumps({
            "clusters": {c: {"root": str(self.roots[c]), "data_cache": f"127.0.0.1:{free_port()}",
                             "metadata_cache": f"127.0.0.1:{free_port()}",
                             "copy_daemon": f"127.0.0.1:{free_port()}"} for c in "AB"},
            "links": [{"from": "A", "to": "B", "cost": 1}],
            "streams": {STREAM: {"source": "A", "destinations": ["B"]}},
        }))

    def writer(self, cluster: str, commit_append_bytes: Optional[int] = None, **extra) -> AcsStreamWriter:
        opts = parse_sink_options({"root": str(self.roots[cluster]), "stream": STREAM, "shards": "2",
                                   "checkpointLocation": "/ck/q1", **extra})
        if commit_append_bytes is None:
            return AcsStreamWriter(opts, SCHEMA)
        return AcsStreamWriter(opts, SCHEMA, commit_append_bytes=commit_append_bytes)

    def copy(self, cut: Optional[Dict[int, int]] = None) -> None:
        """B's copy daemon: the stream, then A's bytes of every file (of shard s, up to
        ``cut[s]`` bytes in all: the rest never reached B)."""
        from tests.server.test_failover_model import _servicer

        servicer = _servicer(self.topology, "B", self.roots)
        try:
            servicer.ensure_stream(STREAM, 2, "A", 0, [])
        finally:
            servicer.io.close()
        src = DurableStore(str(self.roots["A"]))
        try:
            for shard in range(2):
                folder = shard_dir(STREAM, shard)
                (self.roots["B"] / folder).mkdir(parents=True, exist_ok=True)
                budget = None if cut is None or shard not in cut else cut[shard]
                for name in src.list_files(STREAM, shard):
                    data = (self.roots["A"] / folder / name).read_bytes()
                    if budget is not None:
                        data, budget = data[:budget], max(0, budget - len(data))
                    if data:
                        (self.roots["B"] / folder / name).write_bytes(data)
        finally:
            src.close()

    def lose_a_and_promote_b(self) -> None:
        self.roots["A"].rename(self.roots["A"].with_name("root-A.lost"))
        promote(str(self.topology), STREAM, "B", settle=0, timeout=1)

    def history(self, cluster: str) -> Dict[int, List[bytes]]:
        return read_history(str(self.roots[cluster]), STREAM)


def batch(values, shards):
    return pa.RecordBatch.from_arrays([pa.array(shards, pa.int32()), pa.array(values, pa.binary())],
                                      names=["shard", "value"])


def rows(b: int, n: int = 4):
    """Batch ``b``'s rows: ``n`` values alternating between the two shards."""
    return [b"b%d-%d" % (b, i) for i in range(n)], [i % 2 for i in range(n)]


def expected(batches, n: int = 4) -> Dict[int, List[bytes]]:
    return {s: [b"b%d-%d" % (b, i) for b in batches for i in range(n) if i % 2 == s] for s in (0, 1)}


@pytest.fixture
def clusters(tmp_path):
    return Clusters(tmp_path)


def crash_while(monkeypatch, commit, appends: int, shard: Optional[int] = None) -> None:
    """Run ``commit()`` with the sink's durable appends (of ``shard``, or of any shard) failing
    from the ``appends``-th on (0: the first), as when the driver or the old source is lost there."""
    real = ShardWriter.append
    seen = []

    def fail(self, data, *a, **k):
        if shard is None or self.shard == shard:
            seen.append(self.shard)
            if len(seen) > appends:
                raise AcsError("injected: lost while appending")
        return real(self, data, *a, **k)

    monkeypatch.setattr(ShardWriter, "append", fail)
    try:
        with pytest.raises(AcsError, match="injected"):
            commit()
    finally:
        monkeypatch.setattr(ShardWriter, "append", real)


def test_a_batch_the_sink_committed_in_a_is_not_written_again_in_the_promoted_b(clusters):
    wa = clusters.writer("A")
    for b in range(2):
        wa.commit([wa.write(iter([batch(*rows(b))]))], b)
    clusters.copy()
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")  # the query restarted with its checkpoint against B
    assert not (clusters.roots["B"] / sink_dir(STREAM, wb.sink_id) / STATE_FILE).exists()
    wb.commit([wb.write(iter([batch(*rows(1))]))], 1)  # its replay of the last batch: nothing lands
    wb.commit([wb.write(iter([batch(*rows(2))]))], 2)
    assert clusters.history("B") == expected([0, 1, 2])
    state = json.loads((clusters.roots["B"] / sink_dir(STREAM, wb.sink_id) / STATE_FILE).read_text())
    assert state["last_batch"] == 2 and state["epoch"] == 1
    with pytest.raises(AcsError, match="older than the last committed batch 2"):
        wb.commit([wb.write(iter([batch(*rows(0))]))], 0)


def test_each_shard_begins_and_ends_a_batch_with_marks_naming_the_sink_and_batch(clusters):
    w = clusters.writer("A")
    for b in range(3):
        w.commit([w.write(iter([batch(*rows(b))]))], b)
    for shard in range(2):
        folder = clusters.roots["A"] / shard_dir(STREAM, shard)
        data = b"".join(p.read_bytes() for p in sorted(folder.glob("*.acs")))
        marks = [json.loads(mark_body(data, at, h)) for at, h in scan_blocks(data) if mark_body(data, at, h)]
        assert marks == [{"at": at, "batch": b, "sink": w.sink_id} for b in range(3) for at in ("begin", "end")]


def test_a_batch_half_appended_when_a_was_lost_is_completed_in_b_exactly_once(clusters, monkeypatch):
    """Batch 1 crashed in A after shard 0 got its rows and mark, and after shard 1 got the
    first two of its three tasks' pieces (one append each); B has all of it. The replay in B
    appends shard 1's third piece alone."""
    wa = clusters.writer("A", commit_append_bytes=1)
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    tasks = [[b"b1-t%d-%d" % (t, i) for i in range(2)] for t in range(3)]
    staged = [wa.write(iter([batch(vals, [0, 1])])) for vals in tasks]
    crash_while(monkeypatch, lambda: wa.commit(staged, 1), appends=2, shard=1)
    clusters.copy()
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch(vals, [0, 1])])) for vals in tasks], 1)  # Spark's replay: same rows
    wb.commit([wb.write(iter([batch(*rows(2))]))], 2)
    got = clusters.history("B")
    b0, b2 = expected([0]), expected([2])
    assert got[0] == b0[0] + [t[0] for t in tasks] + b2[0]
    assert got[1] == b0[1] + [t[1] for t in tasks] + b2[1]


@pytest.mark.parametrize("torn", [0, 30], ids=["at-a-block", "inside-a-block"])
def test_the_cut_inside_a_batch_leaves_b_the_first_rows_and_the_replay_the_rest(clusters, torn):
    """A committed batch 1, but only shard 1's first block of it reached B before A was lost
    (the cut falls inside the batch, before its mark; ``torn``: and 30 bytes of the next block,
    which the promotion's recovery seal voids): the replay appends the rest."""
    wa = clusters.writer("A", maxBlockBytes="1KiB")
    wa.commit([wa.write(iter([batch(*rows(0, 2))]))], 0)
    folder = clusters.roots["A"] / shard_dir(STREAM, 1)
    before = sum(p.stat().st_size for p in folder.glob("*.acs"))
    values = [b"b1-%02d" % i + b"." * 400 for i in range(6)]
    wa.commit([wa.write(iter([batch(values, [1] * 6)]))], 1)
    data = b"".join(p.read_bytes() for p in sorted(folder.glob("*.acs")))
    blocks = [(at, h) for at, h in scan_blocks(data) if at >= before]
    assert len(blocks) > 4 and not blocks[0][1].count and blocks[1][1].count, blocks  # begin, blocks, end
    cut = blocks[2][0] + torn  # B holds batch 1's beginning and first block of shard 1
    clusters.copy({1: cut})
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B", maxBlockBytes="1KiB")
    wb.commit([wb.write(iter([batch(values, [1] * 6)]))], 1)
    assert clusters.history("B")[1] == [b"b0-1"] + values


def test_a_split_block_is_encoded_again_when_the_replay_blocks_its_rows_otherwise(clusters):
    wa = clusters.writer("A", maxBlockBytes="1KiB")
    values = [b"v%02d" % i + b"." * 400 for i in range(4)]
    wa.commit([wa.write(iter([batch(values, [0] * 4)]))], 0)
    folder = clusters.roots["A"] / shard_dir(STREAM, 0)
    data = b"".join(p.read_bytes() for p in sorted(folder.glob("*.acs")))
    first = next(iter(scan_blocks(data)))[1]
    clusters.copy({0: first.size})  # B holds the first block: one row
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B", maxBlockBytes="1MiB")  # the replay stages the four rows as one block
    wb.commit([wb.write(iter([batch(values, [0] * 4)]))], 0)
    assert clusters.history("B")[0] == values


def test_a_replay_with_other_rows_is_refused_naming_the_file_and_nothing_lands(clusters, monkeypatch):
    """Shard 0 got the first of batch 0's two pieces before A was lost; the replay's first row
    is another: neither appending nor skipping is exactly once."""
    wa = clusters.writer("A", commit_append_bytes=1)
    staged = [wa.write(iter([batch([v], [0])])) for v in (b"x0", b"x1")]
    crash_while(monkeypatch, lambda: wa.commit(staged, 0), appends=1)
    clusters.copy()
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    before = clusters.history("B")
    assert before == {0: [b"x0"]}
    with pytest.raises(AcsError, match=r"shard 0 holds 1 message of batch 0 after its beginning \(.*acs from "
                                       r"byte \d+\).*differs from them from message 0 on.*new checkpointLocation"):
        wb.commit([wb.write(iter([batch([v], [0])])) for v in (b"y0", b"x1")], 0)
    assert clusters.history("B") == before


def test_a_state_file_of_an_earlier_epoch_gives_way_to_the_marks(clusters):
    """The sink wrote batches 0-1 in B after a promotion, B's state file is of epoch 1; the
    stream is promoted back to A (which held B's copy): A's state file from epoch 0 says batch 0,
    but the marks A now holds say batch 1."""
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    clusters.copy()
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch(*rows(1))]))], 1)
    # A comes back holding B's history (as its copy daemon would bring it after quarantine):
    # here, A's root is B's bytes plus A's old sink folder with its state of epoch 0.
    lost = clusters.roots["A"].with_name("root-A.lost")
    old_state = (lost / sink_dir(STREAM, wa.sink_id) / STATE_FILE).read_bytes()
    import shutil

    shutil.copytree(clusters.roots["B"], clusters.roots["A"])
    (clusters.roots["A"] / sink_dir(STREAM, wa.sink_id) / STATE_FILE).write_bytes(old_state)
    meta_path = clusters.roots["A"] / STREAM / "_stream.json"
    meta = json.loads(meta_path.read_text())
    meta["epoch"] = 2  # promoted back
    meta.pop("copied_from", None)
    meta_path.write_text(json.dumps(meta))
    wa2 = clusters.writer("A")
    wa2.commit([wa2.write(iter([batch(*rows(1))]))], 1)  # the replay of batch 1: already there
    wa2.commit([wa2.write(iter([batch(*rows(2))]))], 2)
    assert clusters.history("A") == expected([0, 1, 2])


@pytest.mark.spark
def test_a_spark_query_restarted_against_the_promoted_b_replays_its_last_batch_exactly_once(spark, clusters):
    """A real streaming query writes the stream in A; its last batch's commit is forgotten in
    the checkpoint (the driver died after the sink committed, before Spark logged it); A is
    lost and B promoted; the query restarted with the same checkpoint against B's root replays
    that batch (nothing lands again) and goes on: every row once, in order per shard."""
    from pyspark_acs import Producer
    from tests.helpers import read_acs, start_query

    src = str(clusters.tmp / "src")
    ckpt = str(clusters.tmp / "ckpt")

    def produce(first: int, n: int) -> None:
        with Producer(src, "src", shards=2, max_block_bytes=2048) as p:
            for i in range(first, first + n):
                p.send(b"v%04d" % i, shard=i % 2)

    def run(cluster: str) -> None:
        q = start_query(
            spark.readStream.format("acs").option("root", src).option("stream", "src")
            .option("startingOffsets", "earliest").option("maxRowsPerTrigger", 100).load()
            .select("shard", "value")
            .writeStream.format("acs").option("root", str(clusters.roots[cluster])).option("stream", STREAM)
            .option("shards", 2).option("checkpointLocation", ckpt).trigger(availableNow=True))
        q.awaitTermination(180)
        assert q.exception() is None

    produce(0, 300)
    run("A")
    commits = Path(ckpt) / "commits"
    last = max(int(n) for n in os.listdir(commits) if n.isdigit())
    for name in (str(last), f".{last}.crc"):
        if (commits / name).exists():
            (commits / name).unlink()
    clusters.copy()
    clusters.lose_a_and_promote_b()
    produce(300, 200)
    run("B")
    got = read_acs(spark, str(clusters.roots["B"]), STREAM).orderBy("shard", "file", "position").collect()
    for shard in (0, 1):
        assert [r.value for r in got if r.shard == shard] == [b"v%04d" % i for i in range(shard, 500, 2)]


def test_a_replay_routing_no_rows_to_a_shard_holding_its_first_rows_is_refused(clusters):
    """B holds shard 1's row of batch 1 but not its mark (the cut), and nothing of it in shard 0;
    the replay routes its rows to shard 0 alone: it is not the batch that ran."""
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)

    def size(shard):
        return sum(p.stat().st_size for p in (clusters.roots["A"] / shard_dir(STREAM, shard)).glob("*.acs"))

    before = {s: size(s) for s in (0, 1)}
    wa.commit([wa.write(iter([batch([b"x0", b"x1"], [0, 1])]))], 1)
    mark = len(encode_mark(0, mark_payload(wa.sink_id, 1)))
    clusters.copy({0: before[0], 1: size(1) - mark})
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    held = clusters.history("B")
    assert held[1][-1] == b"x1" and held[0][-1] != b"x0"
    with pytest.raises(AcsError, match=r"shard 1 holds 1 message of batch 1 after its beginning.*the replay has only 0 "
                                       r"rows for the shard"):
        wb.commit([wb.write(iter([batch([b"x0"], [0])]))], 1)
    assert clusters.history("B") == held


def _shard_marks(root, shard):
    """[(byte offset over the shard's concatenated files, payload)] of the marks in a shard."""
    folder = root / shard_dir(STREAM, shard)
    data = b"".join(p.read_bytes() for p in sorted(folder.glob("*.acs")))
    out = []
    for at, h in scan_blocks(data):
        body = mark_body(data, at, h)
        if body is not None:
            out.append((at, json.loads(body)))
    return out


def _second_promotion(clusters, cluster, sink_id):
    """Model a later promotion of a byte copy of ``cluster`` (C holds its bytes, not its sink
    folder): the stream's epoch goes up by one and the sink state is gone."""
    meta_path = clusters.roots[cluster] / STREAM / "_stream.json"
    meta = json.loads(meta_path.read_text())
    meta["epoch"] = int(meta.get("epoch") or 0) + 1
    meta_path.write_text(json.dumps(meta))
    (clusters.roots[cluster] / sink_dir(STREAM, sink_id) / STATE_FILE).unlink()


# -- Found by review: a shard holding all of a batch's rows but not its end; rows of an earlier
# batch after its beginning; files of a version before marks.

def test_a_replay_that_trims_a_shard_to_nothing_still_ends_it(clusters):
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    wa.commit([wa.write(iter([batch(*rows(1))]))], 1)
    mark_at = [at for at, m in _shard_marks(clusters.roots["A"], 1) if m["batch"] == 1 and m["at"] == "end"][0]
    clusters.copy({1: mark_at})  # B holds every row of batch 1 in shard 1, not its mark
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch(*rows(1))]))], 1)  # Spark's replay
    assert clusters.history("B") == expected([0, 1])  # fine so far
    assert [(m["at"], m["batch"]) for _, m in _shard_marks(clusters.roots["B"], 1)] == [
        ("begin", 0), ("end", 0), ("begin", 1), ("end", 1)]


def test_a_replay_holding_all_its_rows_ends_the_shard_so_a_later_batch_lands_after_it(clusters):
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    wa.commit([wa.write(iter([batch(*rows(1))]))], 1)
    mark_at = [at for at, m in _shard_marks(clusters.roots["A"], 1) if m["batch"] == 1 and m["at"] == "end"][0]
    clusters.copy({1: mark_at})
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch(*rows(1))]))], 1)          # replay: shard 1 trimmed to nothing
    wb.commit([wb.write(iter([batch([b"b2-0"], [0])]))], 2)     # batch 2: shard 0 only
    _second_promotion(clusters, "B", wb.sink_id)                # B -> C later (C = B's bytes)
    wc = clusters.writer("B")
    wc.commit([wc.write(iter([batch(*rows(3))]))], 3)           # a NEW batch, not a replay
    assert clusters.history("B")[1] == expected([0, 1, 3])[1]


def test_a_later_batch_with_equal_rows_is_not_taken_for_a_replay(clusters):
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    wa.commit([wa.write(iter([batch([b"hb", b"hb"], [1, 1])]))], 1)  # e.g. heartbeats
    mark_at = [at for at, m in _shard_marks(clusters.roots["A"], 1) if m["batch"] == 1 and m["at"] == "end"][0]
    clusters.copy({1: mark_at})
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch([b"hb", b"hb"], [1, 1])]))], 1)
    wb.commit([wb.write(iter([batch([b"b2-0"], [0])]))], 2)
    _second_promotion(clusters, "B", wb.sink_id)
    wc = clusters.writer("B")
    wc.commit([wc.write(iter([batch([b"hb", b"hb", b"b3-new"], [1, 1, 1])]))], 3)
    assert clusters.history("B")[1] == [b"b0-1", b"b0-3", b"hb", b"hb", b"hb", b"hb", b"b3-new"]


def _partial_committed_batch(clusters, values1):
    """Batch 1 committed in A (Spark logged it), only its first shard-1 row reached B."""
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    before = [at for at, m in _shard_marks(clusters.roots["A"], 1) if m["batch"] == 0 and m["at"] == "end"][0]
    wa.commit([wa.write(iter([batch([v], [1])])) for v in values1], 1)  # a block per task
    folder = clusters.roots["A"] / shard_dir(STREAM, 1)
    data = b"".join(p.read_bytes() for p in sorted(folder.glob("*.acs")))
    blocks = [(at, h) for at, h in scan_blocks(data) if at > before and h.count]
    return blocks[0][0] + blocks[0][1].size  # the end of batch 1's first block in shard 1


def test_next_batch_after_a_copy_lagged_batch_with_nothing_of_it_held(clusters):
    _partial_committed_batch(clusters, [b"x"])
    folder = clusters.roots["A"] / shard_dir(STREAM, 1)
    data = b"".join(p.read_bytes() for p in sorted(folder.glob("*.acs")))
    mark0_end = [at + h.size for at, h in scan_blocks(data) if mark_body(data, at, h)][1]  # batch 0's end
    clusters.copy({1: mark0_end})  # shard 1: through batch 0's mark, nothing of batch 1 (control)
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch(*rows(2))]))], 2)  # no tail: fine
    assert clusters.history("B")[1] == expected([0])[1] + expected([2])[1]


def test_next_batch_after_a_copy_lagged_committed_batch_with_its_first_row_held(clusters):
    cut = _partial_committed_batch(clusters, [b"x", b"y"])
    clusters.copy({1: cut})  # shard 1 holds batch 1's first row (the copy lagged; Spark logged 1)
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch(*rows(2))]))], 2)  # Spark's NEXT batch (1 is committed)
    assert clusters.history("B")[1] == expected([0])[1] + [b"x"] + expected([2])[1]


def test_next_batch_whose_first_row_equals_an_earlier_batchs_held_rows_lands_whole(clusters):
    cut = _partial_committed_batch(clusters, [b"x", b"y"])
    clusters.copy({1: cut})
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch([b"x", b"z"], [1, 1])]))], 2)  # batch 2 starts with an equal row
    assert clusters.history("B")[1] == expected([0])[1] + [b"x", b"x", b"z"]


def test_state_file_missing_on_unpromoted_stream_with_markless_files(clusters, monkeypatch):
    real = Segment
    monkeypatch.setattr(commit_mod, "Segment", lambda *a, mark=False, begin=False, **k: real(*a, **k))  # the version before
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    monkeypatch.setattr(commit_mod, "Segment", real)  # upgrade
    (clusters.roots["A"] / sink_dir(STREAM, wa.sink_id) / STATE_FILE).unlink()
    wa.commit([wa.write(iter([batch(*rows(1))]))], 1)  # before d051c76: appended (no state: fresh)
    assert clusters.history("A") == expected([0, 1])


def test_upgrade_then_promotion_a_shard_untouched_since_the_upgrade_takes_new_batches(clusters, monkeypatch):
    real = Segment
    monkeypatch.setattr(commit_mod, "Segment", lambda *a, mark=False, begin=False, **k: real(*a, **k))
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)  # the released version: both shards
    monkeypatch.setattr(commit_mod, "Segment", real)
    wa.commit([wa.write(iter([batch([b"b1-0"], [0])]))], 1)  # upgraded: batch 1 in shard 0 only
    clusters.copy()
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch(*rows(2))]))], 2)  # a NEW batch (1 committed), both shards
    assert clusters.history("B")[1] == expected([0])[1] + expected([2])[1]


# -- Found by a second review: records written before they carried an epoch, a batch that
# rolled over files, a fresh sink's listing, a redirect after the beginning mark.

def _old_version(monkeypatch):
    """The released version before d051c76: no marks (as the repo's own upgrade tests model it)."""
    real = Segment
    monkeypatch.setattr(commit_mod, "Segment", lambda *a, mark=False, begin=False, **k: real(*a, **k))
    return real


def _strip_epoch(path):
    """A record as the version before d051c76 wrote it: no "epoch" field."""
    raw = json.loads(path.read_text())
    raw.pop("epoch", None)
    path.write_text(json.dumps(raw))


def test_after_an_upgrade_a_state_file_without_an_epoch_written_since_the_promotion_stands(clusters, monkeypatch):
    real = _old_version(monkeypatch)
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    clusters.copy()
    clusters.lose_a_and_promote_b()          # epoch 1 (6046b94 already had epochs)
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch(*rows(1))]))], 1)   # old version, in B, after the promotion
    state = clusters.roots["B"] / sink_dir(STREAM, wb.sink_id) / STATE_FILE
    _strip_epoch(state)                       # what the old version wrote
    monkeypatch.setattr(commit_mod, "Segment", real)   # upgrade, query restarted
    wb.commit([wb.write(iter([batch(*rows(1))]))], 1)   # Spark's replay of its last batch
    assert clusters.history("B") == expected([0, 1])


def test_after_an_upgrade_an_intent_without_an_epoch_written_since_the_promotion_is_completed(clusters, monkeypatch):
    real = _old_version(monkeypatch)
    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    clusters.copy()
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B", commit_append_bytes=1)
    folder = clusters.roots["B"] / sink_dir(STREAM, wb.sink_id)
    staged = [wb.write(iter([batch([v], [0])])) for v in (b"x0", b"x1")]
    crash_while(monkeypatch, lambda: wb.commit(staged, 1), appends=1)
    _strip_epoch(folder / "intent-1.json")    # the old version's intent
    monkeypatch.setattr(commit_mod, "Segment", real)   # upgrade
    wb.commit([wb.write(iter([batch([v], [0])])) for v in (b"x0", b"x1")], 1)  # the retry
    assert clusters.history("B")[0] == expected([0])[0] + [b"x0", b"x1"]


def test_a_rolled_batch_cut_in_its_second_file_is_not_replayed_with_other_rows(clusters):
    wa = clusters.writer("A", rollBytes="1KiB", maxBlockBytes="1KiB")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    values = [b"b1-%02d" % i + b"." * 400 for i in range(6)]
    tasks = [values[i:i + 2] for i in range(0, 6, 2)]   # a piece per task: the batch rolls between them
    wa.commit([wa.write(iter([batch(t, [1, 1])])) for t in tasks], 1)
    folder = clusters.roots["A"] / shard_dir(STREAM, 1)
    files = sorted(folder.glob("*.acs"))
    assert len(files) >= 3  # batch 1 began in one file and rolled on
    sizes = [f.stat().st_size for f in files]
    clusters.copy({1: sum(sizes[:-1]) + 300})  # B: batch 1's beginning, rows, and part of its last file
    clusters.lose_a_and_promote_b()
    held = clusters.history("B")
    assert held[1][-1].startswith(b"b1-")
    wb = clusters.writer("B", rollBytes="1KiB", maxBlockBytes="1KiB")
    with pytest.raises(AcsError, match="holds .* of batch 1 after its beginning"):
        wb.commit([wb.write(iter([batch([b"other"], [0])]))], 1)   # like e8031c1's test, rolled


def test_a_fresh_sink_lists_only_the_shards_it_writes(tmp_path, monkeypatch):
    from pyspark_acs.datasource.options import parse_sink_options
    from pyspark_acs.datasource.sink import AcsBatchWriter
    from tests.datasource.test_sink_promote import SCHEMA

    root = str(tmp_path / "r")
    DurableStore(root).create_stream(STREAM, 256)
    listed = []
    real = DurableStore.list_files
    monkeypatch.setattr(DurableStore, "list_files", lambda self, s, sh: (listed.append(sh), real(self, s, sh))[1])
    opts = parse_sink_options({"root": root, "stream": STREAM, "shards": "256", "sinkId": "job-1"})
    w = AcsBatchWriter(opts, SCHEMA, False)
    w.commit([w.write(iter([batch([b"x"], [0])]))])   # a df.write with sinkId: a fresh sink each job
    assert len(set(listed)) <= 2, f"{len(set(listed))} shards listed for a one-shard write"


def test_a_redirect_after_the_beginning_mark_alone_landed_begins_no_second_time(clusters, monkeypatch):
    from pyspark_acs.datasource.marks import mark_payload
    from pyspark_acs.format.block import encode_mark

    wa = clusters.writer("A")
    wa.commit([wa.write(iter([batch(*rows(0))]))], 0)
    staged = [wa.write(iter([batch(*rows(1))]))]
    crash_while(monkeypatch, lambda: wa.commit(staged, 1), appends=0)
    intent = json.loads((clusters.roots["A"] / sink_dir(STREAM, wa.sink_id) / "intent-1.json").read_text())
    seg = intent["shards"]["0"][0]
    path = clusters.roots["A"] / shard_dir(STREAM, 0) / seg["file"]
    piece = seg["staged"][0]
    head = (clusters.roots["A"] / piece["path"]).read_bytes()[piece.get("skip", 0):][:10]
    with open(path, "ab") as f:  # the torn durable append: the beginning mark and 10 bytes of the piece
        f.write(encode_mark(seg["start_index"], mark_payload(wa.sink_id, 1, "begin")) + head)
    store = DurableStore(str(clusters.roots["A"]))
    other = ShardWriter(store, STREAM, 0, "other")   # takes the shard over: recovery seal
    other.acquire()
    other.recover()
    other.close(seal=False)
    wa.commit([wa.write(iter([batch(*rows(1))]))], 1)   # retry from the intent: redirected
    assert clusters.history("A") == expected([0, 1])
    from pyspark_acs.datasource.marks import _walk
    from pyspark_acs.format.block import mark_body
    marks = []
    for f in sorted((clusters.roots["A"] / shard_dir(STREAM, 0)).glob("*.acs")):
        d = f.read_bytes()
        marks += [json.loads(mark_body(d, at, h)) for at, h in _walk(d, str(f)) if mark_body(d, at, h)]
    marks = [(m["at"], m["batch"]) for m in marks]
    assert marks == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1)], marks
    clusters.copy()
    clusters.lose_a_and_promote_b()
    wb = clusters.writer("B")
    wb.commit([wb.write(iter([batch(*rows(1))]))], 1)   # replay in B: nothing lands
    wb.commit([wb.write(iter([batch(*rows(2))]))], 2)
    assert clusters.history("B") == expected([0, 1, 2])
