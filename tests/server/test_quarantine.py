"""The quarantine's motions (a review's findings, each a test that failed before its fix): a
cluster that missed two promotions, a reader at byte 0 of a file the new history lacks, a
deposed writer's empty file, a parent's survey of a child that moved a kept file, a reader
with the old file's lengths and bytes in memory, a quarantine stopped between its moves.
Stores and copy servicers in-process; real cache servers where a reader's memory matters."""
from __future__ import annotations

import json
import time

import pytest

from pyspark_acs.errors import DataLossError, StoreError
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.format.block import encode_block, encode_seal
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.positions import QUARANTINE_CHECK_S
from pyspark_acs.server.copy.promote import promote
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.producer import Producer
from tests.helpers import msg
from tests.server.test_promote import (FILE1, FILE2, STREAM, _adopt, _consumer_at, _copy, _meta,  # noqa: F401
                                       _poll_until_error, _read_all, lost, site)

FILE3 = "20261203T101500000000Z-000000000000000d.acs"


def test_a_cluster_that_missed_two_promotions_quarantines_past_the_first_cut(site):
    """A is away for promotion 1 (A->B) and promotion 2 (B->C). Back at epoch 2, the first
    record's cut decides A's FILE2 (the second's sealed_through is past it)."""
    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
        with Producer(str(roots["B"]), STREAM, shards=1) as p:   # B's history goes on
            p.send(msg(100))
            p.flush(timeout=10)
        _copy(site, "C", parent="B")
        promote(str(site["topology"]), STREAM, "C", settle=0)      # planned move B -> C
    assert _meta(roots["C"])["epoch"] == 2
    _adopt(site, "A", parent="C")
    meta = _meta(roots["A"])
    assert meta["epoch"] == 2
    assert [e["file"] for e in meta["quarantined"]] == [FILE2]  # past the first cut
    _copy(site, "A", parent="C")
    assert _read_all(roots["A"]) == _read_all(roots["C"]) == [msg(i) for i in range(17)] + [msg(100)]


def _sealed_two(site):
    """FILE2 whole and sealed everywhere; A alone holds FILE3 (one block): B and C lag by a file."""
    two = site["history"][FILE2] + encode_seal(10)
    for c in "ABC":
        (site["roots"][c] / shard_dir(STREAM, 0) / FILE2).write_bytes(two)
    (site["roots"]["A"] / shard_dir(STREAM, 0) / FILE3).write_bytes(encode_block([msg(90)], first_index=0))


def test_a_reader_at_byte_0_of_a_file_the_new_history_lacks_goes_on_with_the_new_history(site):
    """A reader in A at (FILE3, 0) has read exactly B's history (through FILE2's seal) and
    nothing of FILE3: it goes on with B's next file, no DataLossError."""
    roots = site["roots"]
    _sealed_two(site)
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    reader = _consumer_at(roots["A"], FILE3, 0)
    _adopt(site, "A")
    with Producer(str(roots["B"]), STREAM, shards=1) as p:
        p.send(msg(100))
        p.flush(timeout=10)
    _copy(site, "A")
    got = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got += [v for b in reader.poll() for v in b.column("value").to_pylist()]
        time.sleep(0.01)
    reader.close()
    assert got == [msg(100)]


def test_a_deposed_writers_empty_file_is_moved_and_its_append_not_acknowledged(site):
    """A's producer (A unreachable at the promotion) has just rolled to a new, empty file when
    A takes the new history: the file moves too, and the writer's next append fails (nothing
    created again at its path), so A's readers never read it."""
    from pyspark_acs.write.shard import ShardWriter

    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    w = ShardWriter(DurableStore(str(roots["A"])), STREAM, 0, "deposed")
    name = w.open_new()                          # empty file, after A's FILE2
    _adopt(site, "A")
    assert name not in DurableStore(str(roots["A"])).list_files(STREAM, 0)
    with pytest.raises(StoreError):
        w.append(encode_block([msg(501)], first_index=0), 1)
    assert name not in DurableStore(str(roots["A"])).list_files(STREAM, 0)
    _copy(site, "A")
    assert _read_all(roots["A"]) == _read_all(roots["B"])


def test_a_kept_file_a_child_moved_aside_is_copied_there_again(site):
    """C (down at the promotion) holds FILE1 whole and 2 blocks of FILE2; B held FILE1 short
    (7 blocks, unsealed) and the promotion sealed it there. When B's scheduler surveys C, C
    quarantines FILE1 (kept) and lists it present and empty: B copies the new history's FILE1
    to C (no retention floor above it)."""
    import grpc

    from pyspark_acs.server.copy.cluster import DURABLE, ClusterIO, OpKey
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.scheduler import CopyScheduler
    from pyspark_acs.server.copy.topology import load_topology
    from tests.server.test_promote import _block_end, _servicer

    roots, one, two = site["roots"], site["history"][FILE1], site["history"][FILE2]
    rel1, rel2 = f"{shard_dir(STREAM, 0)}/{FILE1}", f"{shard_dir(STREAM, 0)}/{FILE2}"
    body = len(one) - len(encode_seal(10))
    (roots["B"] / rel1).write_bytes(one[:body // 10 * 7])
    (roots["C"] / rel2).write_bytes(two[:_block_end(two, 2)])
    with lost(roots["A"], roots["C"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)

    c = _servicer(site, "C")

    class Ctx:
        def abort(self, code, why):
            raise AssertionError(f"{code}: {why}")

    class Down(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    class Stub:
        def __init__(self, child):
            self.child = child

        def Files(self, request, timeout=None):  # noqa: N802
            if self.child != "C":
                raise Down()
            return c.Files(request, Ctx())

    topo = load_topology(str(site["topology"]))
    io = ClusterIO(topo.cluster("B"), cache_deadline=0.2)
    sched = CopyScheduler("B", str(site["topology"]), topo, io, CopyDaemonOptions(), CopyMetrics("B"),
                          Stub, "b-test")
    try:
        sched._shards[STREAM] = 1
        sched._add_files(STREAM, 0, io.store.list_files(STREAM, 0))
        feeding = {s: ch for s, ch in sched._children.items() if ch}
        assert "C" in feeding[STREAM]
        sched._survey(feeding)
        assert [e["file"] for e in _meta(roots["C"])["quarantined"]] == [FILE1]   # moved, kept
        with sched._lock:
            ready, _ = sched._plan(feeding, time.monotonic())
        assert OpKey(STREAM, 0, FILE1, DURABLE, "C") in ready, (sched._floors, ready)
    finally:
        sched.poller.stop()
        io.close()
        c.io.close()


@pytest.fixture(scope="module")
def a_caches(tmp_path_factory):
    from tests.helpers import deployments

    with deployments(tmp_path_factory.mktemp("review-caches"), clusters=("A",)) as deps:
        yield deps["A"]


def test_a_cached_reader_behind_the_cut_stops_at_it_and_reads_the_new_history(site, a_caches):
    """A reader in A (with A's caches) at FILE2 block 2, behind the cut (7 blocks), has the old
    file's length and pushed bytes in memory. A's daemon records the quarantine, waits, moves
    the files and purges the caches while the reader polls; B's FILE2 is copied in. The
    reader stops at the cut meanwhile, reads the new file anew, and ends with message 16 and
    B's next file: never A's 17-19."""
    roots = site["roots"]
    topo = json.loads(site["topology"].read_text())
    topo["clusters"]["A"].update(data_cache=a_caches.data_endpoints, metadata_cache=a_caches.metadata_endpoints)
    site["topology"].write_text(json.dumps(topo))
    two = site["history"][FILE2]
    block = len(two) // 10
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    reader = Consumer(str(roots["A"]), STREAM, data_cache=a_caches.data_endpoints,
                      metadata_cache=a_caches.metadata_endpoints, max_read_bytes=block, poll_interval=0.01,
                      start={STREAM: {"0": {"file": FILE2, "length": 2 * block}}})
    got = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got += [v for b in reader.poll() for v in b.column("value").to_pylist()]
        time.sleep(0.01)
    assert got == [msg(12)]
    import threading

    from pyspark_acs.cache.chunks import boundary_key, file_id
    from pyspark_acs.cache.client import CacheClient

    # The old writer's last boundary of FILE2, past the cut: purged with the file's chunks.
    marked = boundary_key(file_id(DurableStore(str(roots["A"])).uri(f"{shard_dir(STREAM, 0)}/{FILE2}")))
    with CacheClient(a_caches.data_endpoints) as data:
        data.put([(marked, b"", len(two))])
    adopting = threading.Thread(target=lambda: (_adopt(site, "A", settle=2.0), _copy(site, "A")))
    adopting.start()
    # The reader, slow, polls again only once the ranges are recorded (had it read on before,
    # it would have read A's history then, past the cut, and get the DataLossError after).
    deadline = time.monotonic() + 10
    while "files" not in (_meta(roots["A"]).get("quarantine") or {}) and time.monotonic() < deadline:
        time.sleep(0.005)
    # A reader looks at the record every QUARANTINE_CHECK_S: what it reads before its next look
    # it reads as A's history (and then gets the DataLossError); this one is slower than that.
    time.sleep(QUARANTINE_CHECK_S)
    try:
        while adopting.is_alive():
            got += [v for b in reader.poll() for v in b.column("value").to_pylist()]
            time.sleep(0.01)
        adopting.join()
        with CacheClient(a_caches.data_endpoints) as data:
            assert data.get([marked], consistent=True) == [None]
        with Producer(str(roots["B"]), STREAM, shards=1) as p:
            p.send(msg(100))
            p.flush(timeout=10)
        _copy(site, "A")
        deadline = time.monotonic() + 10
        while msg(100) not in got and time.monotonic() < deadline:
            got += [v for b in reader.poll() for v in b.column("value").to_pylist()]
            time.sleep(0.01)
    except DataLossError as exc:
        got.append(f"DataLossError {exc.start}-{exc.end}")
    reader.close()
    assert got == [msg(i) for i in range(12, 17)] + [msg(100)], \
        " ".join(g if isinstance(g, str) else g[:9].decode() for g in got)


def test_a_reader_behind_the_cut_waits_through_a_quarantine_stopped_after_a_move(site, monkeypatch):
    """The ranges are in _stream.json before any file moves: with the daemon killed after the
    first move, a reader at FILE2 block 2 (behind the cut, which the new history holds) waits
    for the copy instead of taking FILE2's absence for a loss, and reads on once it comes."""
    roots = site["roots"]
    two = site["history"][FILE2]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    (roots["A"] / shard_dir(STREAM, 0) / FILE3).write_bytes(encode_block([msg(90)], first_index=0))
    reader = _consumer_at(roots["A"], FILE2, len(two) // 10 * 2)
    real, moves = DurableStore.move, []

    def once(self, rel, to):
        if moves:
            raise StoreError("killed")
        moves.append(rel)
        real(self, rel, to)
    monkeypatch.setattr(DurableStore, "move", once)
    with pytest.raises(StoreError):
        _adopt(site, "A")
    monkeypatch.undo()
    try:
        assert _poll_until_error(reader, timeout=1) == []  # waits: FILE2 is being moved, not lost
        _adopt(site, "A")
        _copy(site, "A")
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 5 and time.monotonic() < deadline:
            got += [v for b in reader.poll() for v in b.column("value").to_pylist()]
            time.sleep(0.01)
        assert got == [msg(i) for i in range(12, 17)]
    finally:
        reader.close()


def test_a_reader_of_the_new_history_at_a_kept_files_seal_gets_no_data_loss(site):
    """A (lost at the promotion) holds FILE2's 10 blocks; the cut is at 7 (C's), B seals
    FILE2 there. A quarantines FILE2 [7 blocks, 10 blocks), kept, and the copy brings B's FILE2
    (7 blocks + seal). A fresh reader in A reads the new history to FILE2's seal and waits for
    B's next file: its position (FILE2, 7 blocks + seal) is past the range's start, so the
    next quarantine look reports a loss although it read nothing past the cut."""
    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    _adopt(site, "A")
    _copy(site, "A")
    assert [e["file"] for e in _meta(roots["A"])["quarantined"]] == [FILE2]
    reader = Consumer(str(roots["A"]), STREAM, poll_interval=0.01)
    got, error = [], None
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            got += [v for b in reader.poll() for v in b.column("value").to_pylist()]
            time.sleep(0.01)
    except DataLossError as exc:
        error = exc
    finally:
        reader.close()
    assert got == [msg(i) for i in range(17)]
    assert error is None, f"false DataLossError after reading exactly the new history: {error}"


def test_no_producer_starts_in_a_stream_being_quarantined(site):
    """Between the quarantine's fence and its adoption the stream is still this cluster's own
    history by its metadata: a new Producer is refused it all the same."""
    from pyspark_acs.errors import AcsOptionError

    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    DurableStore(str(roots["A"])).update_stream_meta(STREAM, lambda m: dict(m, quarantine={"epoch": 1}))
    with pytest.raises(AcsOptionError, match="is taking a promotion's new history"):
        Producer(str(roots["A"]), STREAM, shards=1)
