"""Promotion (``acs promote``) and the epoch rule, on real stores with no daemons: the longest
prefix any reachable cluster holds is brought to the new source and sealed there, the cut is
recorded, the topology re-rooted, a copy from before the promotion refused; a promotion that
stops at any step and is run again ends in the same state. Daemons and live readers:
tests/integration/test_promote_live.py."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Dict, List

import pytest

from pyspark_acs.errors import AcsError, AcsOptionError, StaleEpochError, StoreError, TopologyError
from pyspark_acs.format.block import encode_block, encode_seal
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.copy import promote as promote_mod
from pyspark_acs.server.copy.promote import promote
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.producer import Producer

from tests.helpers import free_port, msg, read_history

STREAM = "orders"
FILE1 = "20261203T100000000000Z-000000000000000a.acs"
FILE2 = "20261203T100500000000Z-000000000000000b.acs"


def _history() -> Dict[str, bytes]:
    """A's history of shard 0: FILE1 (messages 0-9, sealed), FILE2 (messages 10-19, open)."""
    one = b"".join(encode_block([msg(i)], first_index=i) for i in range(10)) + encode_seal(10)
    two = b"".join(encode_block([msg(10 + i)], first_index=i) for i in range(10))
    return {FILE1: one, FILE2: two}


def _block_end(data: bytes, blocks: int) -> int:
    """Where the first ``blocks`` blocks of FILE2 end (every block of it has the same size)."""
    return len(data) // 10 * blocks


def _write(root: Path, files: Dict[str, bytes], copied_from=None) -> None:
    store = DurableStore(str(root))
    try:
        store.create_stream(STREAM, 1, copied_from=copied_from)
        for name, data in files.items():
            a = store.open_appender(f"{shard_dir(STREAM, 0)}/{name}")
            a.write(data)
            a.close()
    finally:
        store.close()


@pytest.fixture
def site(tmp_path):
    """Three clusters' stores: A the source (whole history), B and C copies of it that lag:
    B holds FILE2's first 4 blocks, C its first 7. A topology file names them (caches and
    daemons at ports nothing listens on: promotion shadows into B's caches when it can and
    waits only for daemons that answer)."""
    h = _history()
    two = h[FILE2]
    roots = {c: tmp_path / f"root-{c}" for c in "ABC"}
    _write(roots["A"], h)
    _write(roots["B"], {FILE1: h[FILE1], FILE2: two[:_block_end(two, 4)]}, copied_from="A")
    _write(roots["C"], {FILE1: h[FILE1], FILE2: two[:_block_end(two, 7)]}, copied_from="B")
    topo = {
        "clusters": {c: {"root": str(roots[c]), "data_cache": f"127.0.0.1:{free_port()}",
                         "metadata_cache": f"127.0.0.1:{free_port()}", "copy_daemon": f"127.0.0.1:{free_port()}"}
                     for c in "ABC"},
        "links": [{"from": "A", "to": "B", "cost": 1}, {"from": "B", "to": "C", "cost": 1},
                  {"from": "A", "to": "C", "cost": 5}],
        "streams": {STREAM: {"source": "A", "destinations": ["B", "C"], "tree": {"B": "A", "C": "B"}}},
    }
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(topo, indent=1))
    return {"roots": roots, "topology": path, "history": h}


@contextlib.contextmanager
def lost(*roots: Path):
    """The clusters' stores gone for the block (moved away: the tests may run as root, whom
    no file mode keeps out), back after it."""
    for root in roots:
        root.rename(root.with_name(root.name + ".lost"))
    try:
        yield
    finally:
        for root in roots:
            root.with_name(root.name + ".lost").rename(root)


def _meta(root: Path) -> dict:
    return json.loads((root / STREAM / "_stream.json").read_text())


def _read_all(root: Path) -> List[bytes]:
    """Every message of the (one-shard) stream a fresh reader of ``root`` reads now."""
    return read_history(root, STREAM).get(0, [])


def _state(site) -> dict:
    """Everything promotion changes: B's and C's files and stream metadata (the record's
    time left out), and the topology's stream entry."""
    out = {}
    for c in "BC":
        root = site["roots"][c]
        meta = _meta(root)
        meta["promotions"] = [{k: v for k, v in r.items() if k not in ("at", "id")} for r in meta.get("promotions", [])]
        files = {p.name: p.read_bytes() for p in sorted((root / shard_dir(STREAM, 0)).iterdir())
                 if p.name.endswith(".acs")}
        out[c] = (meta, files)
    out["topology"] = json.loads(site["topology"].read_text())["streams"][STREAM]
    return out


def test_promotion_brings_the_new_source_to_the_longest_prefix_and_seals_it(site, tmp_path):
    with lost(site["roots"]["A"]):
        lines: List[str] = []
        report = promote(str(site["topology"]), STREAM, "B", settle=0, progress=lines.append)
    two = site["history"][FILE2]
    seven = _block_end(two, 7)
    assert report.unreachable.keys() == {"A"}
    assert report.copied == [(0, FILE2, "C", _block_end(two, 4), seven)]
    sealed_length = seven + len(encode_seal(7))
    assert report.sealed == [(0, FILE2, sealed_length)]
    assert report.cut == {0: (FILE2, sealed_length)}
    assert report.epoch == 1 and report.previous == "A" and report.source == "B"
    # B: the history up to the longest prefix, then the seal; producers may write there now.
    assert _read_all(site["roots"]["B"]) == [msg(i) for i in range(17)]
    b = _meta(site["roots"]["B"])
    assert "copied_from" not in b and b["epoch"] == 1
    assert b["promotions"][-1]["state"] == "cut"
    assert b["promotions"][-1]["cut"] == {"0": {"file": FILE2, "length": sealed_length}}
    # C (reachable): fenced and told the cut, still a copy.
    c = _meta(site["roots"]["C"])
    assert c["epoch"] == 1 and c["copied_from"] == "B" and c["promotions"] == b["promotions"]
    # The topology: B the source, A a destination, the pinned tree gone.
    entry = json.loads(site["topology"].read_text())["streams"][STREAM]
    assert entry == {"source": "B", "destinations": ["C", "A"]}
    assert any("bytes [" in line and "copied from C" in line for line in lines)
    assert report.daemons == {c: "not reachable (UNAVAILABLE); not waited for" for c in "ABC"}
    # A Producer in B continues the shard in a new file after the cut.
    p = Producer(str(site["roots"]["B"]), STREAM, shards=1)
    p.send(msg(100))
    p.close()
    assert _read_all(site["roots"]["B"]) == [msg(i) for i in range(17)] + [msg(100)]


def test_promotion_run_again_changes_nothing(site):
    with lost(site["roots"]["A"]):
        first = promote(str(site["topology"]), STREAM, "B", settle=0)
        state = _state(site)
        again = promote(str(site["topology"]), STREAM, "B", settle=0)
    assert again.cut == first.cut and again.copied == [] and again.sealed == []
    assert _state(site) == state


@pytest.mark.parametrize("step", ["fence", "copy", "seal", "cut", "reroot", "wait"])
def test_a_promotion_stopped_at_any_step_and_run_again_ends_in_the_same_state(site, tmp_path, monkeypatch, step):
    """In-process model of a kill: the step raises (after the fence, the first copy, the first
    seal, the first cut record, the topology write, or while waiting), then the command runs
    again unchanged. The end state is byte for byte the one of a promotion never stopped (run
    on a copy of the same stores)."""
    import shutil

    clean = tmp_path / "clean"
    shutil.copytree(site["roots"]["B"].parent, clean, ignore=shutil.ignore_patterns("clean"), symlinks=True)
    other = {"roots": {c: clean / f"root-{c}" for c in "ABC"}, "topology": clean / "topology.json"}
    text = site["topology"].read_text().replace(str(site["roots"]["A"].parent), str(clean))
    other["topology"].write_text(text)

    class Killed(Exception):
        pass

    def kill_after(name):
        real = getattr(promote_mod, name)

        def wrapped(*a, **kw):
            real(*a, **kw)
            raise Killed(name)
        monkeypatch.setattr(promote_mod, name, wrapped)

    def kill_in_copy():
        from pyspark_acs.write import file as file_mod
        real = file_mod.FileWriter.append

        def half_then_killed(self, data, **kw):
            real(self, data[:len(data) // 2], **kw)  # a torn append: half a block may land
            raise Killed("copy")
        monkeypatch.setattr(file_mod.FileWriter, "append", half_then_killed)

    with lost(site["roots"]["A"], other["roots"]["A"]):
        promote(str(other["topology"]), STREAM, "B", settle=0)
        if step == "fence":
            kill_after("_fence")
        elif step == "copy":
            kill_in_copy()
        elif step == "seal":
            from pyspark_acs.write import shard as shard_mod
            real = shard_mod.ShardWriter.seal_file

            def sealed_then_killed(self, name):
                real(self, name)
                raise Killed("seal")
            monkeypatch.setattr(shard_mod.ShardWriter, "seal_file", sealed_then_killed)
        elif step == "cut":
            kill_after("_record_cut")
        elif step == "reroot":
            kill_after("_reroot")
        else:
            kill_after("_wait_daemons")
        with pytest.raises(Killed):
            promote(str(site["topology"]), STREAM, "B", settle=0)
        monkeypatch.undo()
        promote(str(site["topology"]), STREAM, "B", settle=0)
    assert _state(site) == _state(other)


def test_a_copy_from_before_the_promotion_is_refused_and_a_newer_epoch_adopted(site):
    with lost(site["roots"]["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    c = DurableStore(str(site["roots"]["C"]))
    records = _meta(site["roots"]["B"])["promotions"]
    # A's daemon, back with the old topology: its copies are at epoch 0.
    with pytest.raises(StaleEpochError, match=r"promoted \(epoch 1: source 'B'.*copy from cluster 'A' at epoch 0"):
        c.create_stream(STREAM, 1, copied_from="A")
    assert _meta(site["roots"]["C"])["copied_from"] == "B"
    # B's, at the new epoch: accepted (the same records), and a copy's parent may change.
    c.create_stream(STREAM, 1, copied_from="B", epoch=1, promotions=records)
    # Producers stay refused in a copy.
    with pytest.raises(AcsOptionError, match="is a copy"):
        c.create_stream(STREAM, 1)


def _servicer(site, cluster: str):
    """The copy servicer of ``cluster``'s daemon (its caches at ports nothing listens on)."""
    from pyspark_acs.server.copy.cluster import ClusterIO
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.topology import load_topology
    from pyspark_acs.server.copy.writer import CopyServicer

    io = ClusterIO(load_topology(str(site["topology"])).cluster(cluster), cache_deadline=0.2)
    return CopyServicer(io, CopyDaemonOptions(), CopyMetrics(cluster),
                        source_store=lambda c: DurableStore(str(site["roots"][c])))


def _adopt(site, cluster: str, parent: str = "B", settle: float = 0.0) -> None:
    """``cluster``'s daemon takes the new epoch from ``parent``'s hello (as a Copy or Files call does)."""
    meta = _meta(site["roots"][parent])
    servicer = _servicer(site, cluster)
    servicer.quarantine_settle = settle
    try:
        servicer.ensure_stream(STREAM, 1, parent, meta["epoch"], meta["promotions"])
    finally:
        servicer.io.close()


def _copy(site, cluster: str, parent: str = "B") -> None:
    """The copy from ``parent`` brought ``cluster`` up to date (file by file, appending what it lacks)."""
    src, dst = site["roots"][parent] / shard_dir(STREAM, 0), site["roots"][cluster] / shard_dir(STREAM, 0)
    for f in sorted(src.glob("*.acs")):
        have = (dst / f.name).read_bytes() if (dst / f.name).exists() else b""
        data = f.read_bytes()
        assert data.startswith(have), f"{cluster}'s {f.name} is no prefix of {parent}'s"
        with open(dst / f.name, "ab") as out:
            out.write(data[len(have):])


def _consumer_at(root: Path, file: str, length: int) -> Consumer:
    return Consumer(str(root), STREAM, start={STREAM: {"0": {"file": file, "length": length}}}, poll_interval=0.01)


def _poll_until_error(c: Consumer, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    got = []
    while time.monotonic() < deadline:
        for b in c.poll():
            got += b.column("value").to_pylist()
        time.sleep(0.01)
    return got


def test_a_returning_source_quarantines_its_bytes_past_the_cut_and_takes_the_new_history(site):
    """A, unreachable at the promotion, wrote on: FILE2 past the cut, and a later FILE3. Back
    as a destination, its daemon takes the new epoch: both move into the shard's quarantine
    with a record (file, range), the stream's metadata names them, and the copy brings B's
    FILE2 from byte 0. A reader that had read A's tail gets a DataLossError naming the range;
    one at or before the cut reads on into the new history; a fresh reader reads B's history."""
    from pyspark_acs.errors import DataLossError

    roots, two = site["roots"], site["history"][FILE2]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    file3 = "20261203T101500000000Z-000000000000000d.acs"
    (roots["A"] / shard_dir(STREAM, 0) / file3).write_bytes(encode_block([msg(90)], first_index=0))
    records = _meta(roots["B"])["promotions"]
    cut = records[-1]["cut"]["0"]
    seven = cut["length"] - len(encode_seal(7))
    assert cut["file"] == FILE2 and records[-1]["sealed"]["0"][FILE2] == [seven, cut["length"]]
    a = DurableStore(str(roots["A"]))
    # A is its own history and not named as the deposed source: refused as such, nothing moved.
    with pytest.raises(AcsOptionError, match="holds files written in this cluster"):
        a.create_stream(STREAM, 1, copied_from="B", epoch=1, promotions=records)
    # Readers of A's old history, already past the cut and at it.
    past = _consumer_at(roots["A"], FILE2, len(two))
    at_cut = _consumer_at(roots["A"], FILE2, _block_end(two, 5))
    assert [v for b in at_cut.poll() for v in b.column("value").to_pylist()] == [msg(15), msg(16), msg(17),
                                                                                 msg(18), msg(19)]
    at_cut.close()
    at_cut = _consumer_at(roots["A"], FILE2, seven)

    _adopt(site, "A")
    meta = _meta(roots["A"])
    assert meta["epoch"] == 1 and meta["copied_from"] == "B"
    folder = f"{shard_dir(STREAM, 0)}/_quarantine/epoch-1"
    entries = {e["file"]: (e["start"], e["end"], e["kept"], e["moved_to"]) for e in meta["quarantined"]}
    seal = len(encode_seal(0))  # the quarantine sealed A's open files first (its writers' fence)
    assert entries == {FILE2: (seven, len(two) + seal, True, f"{folder}/{FILE2}"),
                       file3: (0, len(encode_block([msg(90)], first_index=0)) + seal, False, f"{folder}/{file3}")}
    assert (roots["A"] / folder / FILE2).read_bytes()[:len(two)] == two
    assert json.loads((roots["A"] / folder / "record.json").read_text())["files"] == sorted(
        meta["quarantined"], key=lambda e: e["file"])
    assert a.list_files(STREAM, 0) == [FILE1]  # nothing quarantined is listed, copied on or served

    with pytest.raises(DataLossError, match=rf"byte {len(two)} of file {FILE2}, but bytes \[{seven}, "
                                            rf"{len(two) + seal}\) of it are a history that did not happen") as err:
        _poll_until_error(past)
    assert (err.value.file, err.value.start, err.value.end) == (FILE2, seven, len(two) + seal)
    assert "_quarantine/epoch-1" in str(err.value)
    past.close()
    # At byte 0 of A's later file: it passed FILE2's range to get there.
    with pytest.raises(DataLossError, match=rf"byte 0 of file {file3}, but bytes \[{seven}, .* of file {FILE2}, "
                                            rf"which the reader passed to get there"):
        _poll_until_error(_consumer_at(roots["A"], file3, 0), timeout=3)
    # At the cut, FILE2 still missing here: the reader waits for the copy, then reads on.
    assert _poll_until_error(at_cut, timeout=0.5) == []
    _copy(site, "A")
    assert _read_all(roots["A"]) == _read_all(roots["B"]) == [msg(i) for i in range(17)]
    with Producer(str(roots["B"]), STREAM, shards=1) as pb:  # the new history goes on in B
        pb.send(msg(300))
        pb.flush(timeout=10)
    _copy(site, "A")
    got: List[bytes] = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got += [v for b in at_cut.poll() for v in b.column("value").to_pylist()]
        time.sleep(0.01)
    assert got == [msg(300)]  # nothing of A's old tail: B's seal, then B's next file
    at_cut.close()
    # Run again (the daemon's next hello): the same state.
    before = _meta(roots["A"])
    _adopt(site, "A")
    assert _meta(roots["A"]) == before


def test_a_quarantine_stopped_between_its_moves_ends_in_the_same_state(site, monkeypatch):
    """The record is written before any file moves: a daemon killed after the first move and
    started again moves the rest and keeps the first one's range."""
    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    file3 = "20261203T101500000000Z-000000000000000d.acs"
    (roots["A"] / shard_dir(STREAM, 0) / file3).write_bytes(encode_block([msg(90)], first_index=0))
    real = DurableStore.move
    moves = []

    def once(self, rel, to):
        if moves:
            raise StoreError(f"killed before moving {rel}")
        moves.append(rel)
        real(self, rel, to)

    monkeypatch.setattr(DurableStore, "move", once)
    with pytest.raises(StoreError, match="killed before moving"):
        _adopt(site, "A")
    assert "epoch" not in _meta(roots["A"]) and len(moves) == 1
    monkeypatch.setattr(DurableStore, "move", real)
    _adopt(site, "A")
    meta = _meta(roots["A"])
    assert sorted(e["file"] for e in meta["quarantined"]) == [FILE2, file3]
    assert DurableStore(str(roots["A"])).list_files(STREAM, 0) == [FILE1]


def test_a_file_sealed_where_the_promotion_sealed_it_is_not_quarantined(site):
    """A wrote nothing past the cut and sealed FILE2 there (its successor's seal): the same
    bytes as the new history's, so A adopts without moving anything, and a destination
    behind the cut (it holds less) keeps its files too."""
    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    rel = roots["A"] / shard_dir(STREAM, 0) / FILE2
    rel.write_bytes((roots["B"] / shard_dir(STREAM, 0) / FILE2).read_bytes())
    _adopt(site, "A")
    meta = _meta(roots["A"])
    assert meta["epoch"] == 1 and not meta.get("quarantined")
    assert _read_all(roots["A"]) == _read_all(roots["B"])


def test_a_file_the_promotion_sealed_before_the_cut_file_is_quarantined_too(site):
    """Review finding: B's older file was unsealed and behind (copies run side by side), and
    the promotion sealed it short; a cluster that held it whole quarantines it from there."""
    from pyspark_acs.server.copy.quarantine import PastCut, past_cut
    from pyspark_acs.storage.tier import tiered_store

    one = site["history"][FILE1]
    rel = f"{shard_dir(STREAM, 0)}/{FILE1}"
    body = len(one) - len(encode_seal(10))
    short = body // 10 * 7  # B holds FILE1's first 7 blocks, no seal
    (site["roots"]["B"] / rel).write_bytes(one[:short])
    down = site["roots"]["C"]
    with lost(site["roots"]["A"], down):
        report = promote(str(site["topology"]), STREAM, "B", settle=0)
    assert (0, FILE1, short + len(encode_seal(7))) in report.sealed
    record = _meta(site["roots"]["B"])["promotions"][-1]
    assert record["sealed_through"] == {"0": ""}
    c = tiered_store(DurableStore(str(down)))
    two = site["history"][FILE2]
    four, seven = _block_end(two, 4), _block_end(two, 7)
    seal = len(encode_seal(0))
    assert past_cut(c, STREAM, 1, record) == [PastCut(0, FILE1, short, len(one), True, short + seal),
                                              PastCut(0, FILE2, four, seven, True, four + seal)]
    # A record from before the sealed map: the cut file's length alone decides.
    old = {k: v for k, v in record.items() if k != "sealed"}
    assert past_cut(c, STREAM, 1, old) == [PastCut(0, FILE2, four + seal, seven, True, four + seal)]


def test_at_one_epoch_only_the_same_promotion_passes_and_the_source_is_never_made_a_copy(site):
    """Review findings: a copy at the new source's epoch from a cluster not told the cut yet
    must not make the new source a copy again; two promotions at one epoch must not mix."""
    with lost(site["roots"]["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    b = DurableStore(str(site["roots"]["B"]))
    records = _meta(site["roots"]["B"])["promotions"]
    fenced_only = [dict(records[-1], state="fenced")]
    fenced_only[-1].pop("cut")
    with pytest.raises(AcsOptionError, match="holds files written in this cluster"):
        b.create_stream(STREAM, 1, copied_from="C", epoch=1, promotions=fenced_only)
    assert "copied_from" not in _meta(site["roots"]["B"])
    c = DurableStore(str(site["roots"]["C"]))
    other = [dict(records[-1], id="another", source="C")]
    with pytest.raises(StaleEpochError, match="another promotion at epoch 1"):
        c.create_stream(STREAM, 1, copied_from="B", epoch=1, promotions=other)


def test_of_two_promotions_run_at_once_the_later_stands_and_the_earlier_stops(site):
    """A promotion to C is under way (fenced, in its settle wait) when someone promotes B to
    the end. The later one stands; the earlier stops at its next step with an error naming
    it, before it seals anything in C or re-roots the topology."""
    before = {p.name: p.read_bytes() for p in (site["roots"]["C"] / shard_dir(STREAM, 0)).iterdir()}
    topo = str(site["topology"])
    with lost(site["roots"]["A"]), pytest.raises(AcsError, match="C records another promotion since this one began"):
        promote(topo, STREAM, "C", settle=1, sleep=lambda s: promote(topo, STREAM, "B", settle=0))
    assert json.loads(site["topology"].read_text())["streams"][STREAM]["source"] == "B"
    assert "copied_from" not in _meta(site["roots"]["B"]) and _meta(site["roots"]["B"])["epoch"] == 2
    assert {p.name: p.read_bytes() for p in (site["roots"]["C"] / shard_dir(STREAM, 0)).iterdir()} == before


def test_a_reachable_old_source_is_fenced_and_an_empty_file_reaches_the_new_source(site):
    """Review findings: in a planned move a producer still running in A is sealed out (its
    next flush fails instead of being acknowledged and lost), and a file only another
    cluster holds, even empty, is created and sealed in B so its readers pass it."""
    from pyspark_acs.errors import WriterConflictError

    empty = "20261203T101000000000Z-000000000000000c.acs"
    (site["roots"]["C"] / shard_dir(STREAM, 0) / empty).write_bytes(b"")
    p = Producer(str(site["roots"]["A"]), STREAM, shards=1)
    p.send(msg(200))
    p.flush()
    report = promote(str(site["topology"]), STREAM, "B", settle=0)
    assert report.previous == "A" and not report.unreachable
    assert _meta(site["roots"]["A"])["copied_from"] == "B"
    p.send(msg(201))
    try:
        with pytest.raises(WriterConflictError):
            p.flush(timeout=10)
    finally:
        with contextlib.suppress(WriterConflictError):
            p.close(timeout=10)  # its writer thread stops; the failed flush is its last word
    got = _read_all(site["roots"]["B"])
    assert got == [msg(i) for i in range(20)] + [msg(200)], got[-3:]
    assert (site["roots"]["B"] / shard_dir(STREAM, 0) / empty).exists()


def test_promotion_refuses_what_it_cannot_do(site, tmp_path):
    topo = str(site["topology"])
    with pytest.raises(TopologyError, match="no stream 'nope'"):
        promote(topo, "nope", "B", settle=0)
    with pytest.raises(TopologyError, match="A is already the source of 'orders' and no promotion to it"):
        promote(topo, STREAM, "A", settle=0)
    with pytest.raises(TopologyError, match="unknown cluster 'Z'"):
        promote(topo, STREAM, "Z", settle=0)
    toml = tmp_path / "t.toml"
    toml.write_text("")
    with pytest.raises(TopologyError, match="writes JSON only"):
        promote(str(toml), STREAM, "B", settle=0)
    with lost(site["roots"]["B"]), pytest.raises(AcsError, match="cannot promote B: its store"):
        promote(topo, STREAM, "B", settle=0)


@pytest.fixture(scope="module")
def b_caches(tmp_path_factory):
    from tests.helpers import deployments

    with deployments(tmp_path_factory.mktemp("promote-caches"), clusters=("B",)) as deps:
        yield deps["B"]


def test_what_a_cache_holds_beyond_its_durable_copy_is_in_the_prefix(site, b_caches):
    """Review finding: a reader in B following through the cache has delivered what B's cache
    holds past B's durable copy; promotion takes it into the prefix (from the cache, checked
    as whole blocks) and seals after it, so B's readers, through the cache or the store,
    read one history: every delivered message, then what B's producer writes next."""
    from pyspark_acs.cache.chunks import ChunkWriter
    from pyspark_acs.cache.client import CacheClient
    from pyspark_acs.cache.metadata import MetadataCache

    topo = json.loads(site["topology"].read_text())
    topo["clusters"]["B"].update(data_cache=b_caches.data_endpoints, metadata_cache=b_caches.metadata_endpoints)
    site["topology"].write_text(json.dumps(topo))
    two = site["history"][FILE2]
    seven = _block_end(two, 7)
    store = DurableStore(str(site["roots"]["B"]))
    uri = store.uri(f"{shard_dir(STREAM, 0)}/{FILE2}")
    data, meta = CacheClient(b_caches.data_endpoints), CacheClient(b_caches.metadata_endpoints)
    try:
        ChunkWriter(data, uri).append(two[:seven])  # B's cache copy ran ahead of its durable one (4 blocks)
        MetadataCache(meta).publish(uri, cache_length=seven, durable_length=_block_end(two, 4))
        follower = Consumer(str(site["roots"]["B"]), STREAM, data_cache=b_caches.data_endpoints,
                            metadata_cache=b_caches.metadata_endpoints, start="earliest")
        delivered = []
        deadline = time.monotonic() + 30  # a loaded machine: the cache's bytes come when they come
        while len(delivered) < 17 and time.monotonic() < deadline:
            delivered += [v for b in follower.poll() for v in b.column("value").to_pylist()]
            time.sleep(0.05)
        assert delivered == [msg(i) for i in range(17)]  # messages 14-16 from the cache alone
        with lost(site["roots"]["A"], site["roots"]["C"]):
            report = promote(str(site["topology"]), STREAM, "B", settle=0)
        assert report.copied == [(0, FILE2, "B", _block_end(two, 4), seven)]
        with Producer(str(site["roots"]["B"]), STREAM, shards=1, data_cache=b_caches.data_endpoints,
                      metadata_cache=b_caches.metadata_endpoints) as p:
            p.send(msg(100))
        more = []
        deadline = time.monotonic() + 30
        while not more and time.monotonic() < deadline:
            more += [v for b in follower.poll() for v in b.column("value").to_pylist()]
            time.sleep(0.05)
        follower.close()
        assert more == [msg(100)]
        assert _read_all(site["roots"]["B"]) == [msg(i) for i in range(17)] + [msg(100)]
    finally:
        data.close()
        meta.close()


def test_a_delta_begun_before_the_fence_does_not_land_after_it(site):
    """Review finding: a copy delta from A, past the epoch check when the fence is written but
    held up checking A's store (a flaky source is why one promotes), must not land after the
    promotion measured the prefixes: it is poisoned, and C stays a prefix of B."""
    import queue
    import threading

    from pyspark_acs.server.copy.cluster import ClusterIO
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.proto import copy_pb2
    from pyspark_acs.server.copy.topology import load_topology
    from pyspark_acs.server.copy.writer import CopyServicer

    class Held:
        """A's store as C's daemon reads it: its lengths may hang."""

        def __init__(self, store):
            self.store, self.hang, self.release, self.entered = store, False, threading.Event(), threading.Event()

        def lengths(self, rels):
            if self.hang:
                self.entered.set()
                self.release.wait(30)
            return self.store.lengths(rels)

        def __getattr__(self, name):
            return getattr(self.store, name)

    roots, two = site["roots"], site["history"][FILE2]
    seven, nine = _block_end(two, 7), _block_end(two, 9)
    io = ClusterIO(load_topology(str(site["topology"])).cluster("C"), cache_deadline=0.2)
    a_store = Held(DurableStore(str(roots["A"])))
    servicer = CopyServicer(io, CopyDaemonOptions(lease_seconds=0.5), CopyMetrics("C"),
                            source_store=lambda c: a_store if c == "A" else DurableStore(str(roots[c])))
    requests: "queue.Queue" = queue.Queue()
    acks: List = []

    def feed():
        while True:
            r = requests.get()
            if r is None:
                return
            yield r

    t = threading.Thread(target=lambda: acks.extend(servicer.Copy(feed(), None)), daemon=True)
    t.start()
    try:
        requests.put(copy_pb2.CopyRequest(hello=True, stream=STREAM, shard=0, file=FILE2, storage=copy_pb2.DURABLE,
                                          shards=1, operation="a-op", source_cluster="A"))
        deadline = time.monotonic() + 10
        while not acks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert acks and acks[0].length == seven
        a_store.hang = True
        requests.put(copy_pb2.CopyRequest(stream=STREAM, shard=0, file=FILE2, storage=copy_pb2.DURABLE, start=seven,
                                          data=two[seven:nine]))
        assert a_store.entered.wait(5)
        topo = json.loads(site["topology"].read_text())
        topo["clusters"]["A"]["root"] = str(roots["A"]) + ".gone"  # A unreachable for the promotion
        site["topology"].write_text(json.dumps(topo))
        report = promote(str(site["topology"]), STREAM, "B", timeout=1)
        a_store.hang = False
        a_store.release.set()
        while len(acks) < 2 and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        assert copy_pb2.AckStatus.Name(acks[1].status) == "POISONED", acks[1]
    finally:
        a_store.release.set()
        requests.put(None)
        t.join(5)
        io.close()
    c_len = DurableStore(str(roots["C"])).length(f"{shard_dir(STREAM, 0)}/{FILE2}")
    assert c_len == seven < report.cut[0][1]


def test_a_producer_still_running_in_a_returning_source_is_deposed(site):
    """A producer in A (unreachable at the promotion) writes on; when A takes the new history
    its files past the cut are moved away under it: its next flush is not acknowledged (the
    file it appends to is gone from its path), a new file of its is refused, and a new
    Producer in A is refused the copy."""
    from pyspark_acs.errors import WriterConflictError

    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    p = Producer(str(roots["A"]), STREAM, shards=1)
    try:
        p.send(msg(500))
        p.flush(timeout=10)  # acknowledged in A alone: past the cut
        _adopt(site, "A")
        moved = {e["file"] for e in _meta(roots["A"])["quarantined"]}
        assert FILE2 in moved and len(moved) == 2
        p.send(msg(501))
        with pytest.raises((WriterConflictError, StoreError)):
            p.flush(timeout=10)
    finally:
        with contextlib.suppress(AcsError):
            p.close(timeout=10)
    with pytest.raises(AcsOptionError, match="is a copy"):
        Producer(str(roots["A"]), STREAM, shards=1)
    _copy(site, "A")
    assert _read_all(roots["A"]) == _read_all(roots["B"])


def test_a_new_file_of_a_deposed_writer_is_refused(site):
    """The writer's file-creation check: once the stream here is a copy, no writer starts a
    file in it (its messages would be read as the copy's)."""
    from pyspark_acs.write.shard import ShardWriter

    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    w = ShardWriter(DurableStore(str(roots["A"])), STREAM, 0, "stale_writer")
    _adopt(site, "A")
    with pytest.raises(StaleEpochError, match=r"is a copy of 'B' now \(promotion epoch 1\).*stale_writer"):
        w.open_new()
    assert DurableStore(str(roots["A"])).list_files(STREAM, 0) == [FILE1]


def test_a_stale_source_daemon_does_not_copy_a_stream_that_is_a_copy_here(site):
    """A's daemon still runs the topology that names A the source, but A took the new history:
    its copy operations stop before their hello instead of forking B's tree."""
    import types

    from pyspark_acs.server.copy.cluster import DURABLE, ClusterIO, OpKey
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.reader import CopyOperation
    from pyspark_acs.server.copy.topology import load_topology

    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    _adopt(site, "A")
    io = ClusterIO(load_topology(str(site["topology"])).cluster("A"), cache_deadline=0.2)
    metrics = CopyMetrics("A")
    try:
        poller = types.SimpleNamespace(path=types.SimpleNamespace(for_reader=lambda op: None))
        op = CopyOperation(OpKey(STREAM, 0, FILE1, DURABLE, "C"), 1, io, poller, lambda c: None,
                           CopyDaemonOptions(), metrics, "a-op", is_source=True)
        with pytest.raises(StaleEpochError, match="names A its source, but A keeps a copy of it from 'B'"):
            op._session()
        assert metrics.get("errors_total", kind="stale_topology") == 1
    finally:
        io.close()


def test_a_cluster_that_missed_a_promotion_takes_no_part_in_the_next(site):
    """The model test's findings: A, lost at the promotion to B, comes back holding its own
    tail; the next promotion (to C, B reachable) neither fences A nor reads it for the longest
    prefix (its bytes past the first cut would enter the new history), and promoting A, which
    missed both, is refused -- also promoting B after it missed a later one, although B
    records an older promotion to itself."""
    roots = site["roots"]
    with lost(roots["A"]):
        promote(str(site["topology"]), STREAM, "B", settle=0)
    assert _meta(roots["A"]).get("epoch") is None  # A missed it
    _copy(site, "C")  # C holds B's history
    report = promote(str(site["topology"]), STREAM, "C", settle=0)
    assert "behind" in report.unreachable.get("A", "")
    assert _meta(roots["A"]).get("epoch") is None and "copied_from" not in _meta(roots["A"])
    assert _read_all(roots["C"]) == _read_all(roots["B"]) == [msg(i) for i in range(17)]
    with pytest.raises(AcsError, match=r"cannot promote A: it holds the stream at epoch 0, while B, C hold\(s\) "
                                       r"epoch 2: A missed a promotion"):
        promote(str(site["topology"]), STREAM, "A", settle=0)
    # Back to B (planned), then to C with B lost: B, back, records the promotion to itself at
    # epoch 3 but missed epoch 4.
    promote(str(site["topology"]), STREAM, "B", settle=0)
    with lost(roots["B"]):
        promote(str(site["topology"]), STREAM, "C", settle=0)
    with pytest.raises(AcsError, match=r"cannot promote B: it holds the stream at epoch 3, while C hold\(s\) "
                                       r"epoch 4: B missed a promotion"):
        promote(str(site["topology"]), STREAM, "B", settle=0)
