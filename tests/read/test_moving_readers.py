"""Readers that move between clusters at the same offsets (docs/copy.md, "Moving a reader").

Files are byte-identical in every cluster, so an offset taken in one names the same message in
every other; a destination may just not hold it yet. The rule (read/positions.py
``missing_at``): in a destination a position past what the copy brought waits for it, unless
the bytes can no longer come (retention deleted the file, a later file is here, or the local
copy is sealed before the position: another history); in the source it is loss. Real files in
two roots here, the copy done by hand; the copy daemons' version is in
tests/integration/test_cross_cluster.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest

from pyspark_acs.errors import DataLossError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.format.offsets import Offset
from pyspark_acs.read.consumer import Consumer, TailTiming
from pyspark_acs.read.positions import BoundaryCache, shard_extent
from pyspark_acs.read.readpath import DurableReadPath
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.storage.tier import raise_retention_floor
from pyspark_acs.write.producer import Producer

from tests.read.test_producer_consumer import WAIT_S, _block_starts, _numbers, consume, rows_of

STREAM = "mv"


def _source(tmp_path, n=30):
    """A source root with ``n`` messages, one per block, about four blocks per file."""
    root = str(tmp_path / "A")
    with Producer(root, STREAM, roll_bytes=600, max_block_bytes=1024) as p:
        for i in range(n):
            p.send(b"msg-%05d" % i + b"v" * 90)
            p.flush(timeout=WAIT_S)
    files = DurableStore(root).list_files(STREAM, 0)
    assert len(files) >= 3
    return root, files


def _path(root, name):
    return os.path.join(root, shard_dir(STREAM, 0), name)


def _copy(src, dst, name, upto=None):
    """Copy file ``name`` (its first ``upto`` bytes) from root ``src`` to root ``dst``."""
    data = open(_path(src, name), "rb").read()
    with open(_path(dst, name), "wb") as f:
        f.write(data if upto is None else data[:upto])


def _destination(tmp_path):
    root = str(tmp_path / "C")
    DurableStore(root).create_stream(STREAM, 1, copied_from="A")
    return root


def _inside_second_file(src, files, k=1):
    """Offsets at the second block of file ``k`` (default the second; as a reader of the source
    takes them)."""
    second = _block_starts(_path(src, files[k]))[1]
    return {STREAM: {"0": {"file": files[k], "length": second}}}


def test_a_reader_moved_to_a_destination_that_lags_waits_there_for_the_copy(tmp_path, caplog):
    """B's offsets in C, whose copy of the position's file holds only its first block (and of
    the later files nothing): no DataLossError, one warning after the bound naming the file and
    what C holds, and once the copy arrives every later message exactly once, in order."""
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    _copy(src, dst, files[0])
    start = _inside_second_file(src, files)
    first_block = _block_starts(_path(src, files[1]))[1]
    _copy(src, dst, files[1], upto=first_block - 10)  # short of the position
    with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.consumer"):
        with Consumer(dst, STREAM, start=start, timing=TailTiming(stuck_warn_after_s=0.3)) as c:
            deadline = time.monotonic() + WAIT_S
            while not any("waiting for the copy" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the wait was never reported"
                assert rows_of(c.poll()) == []
                time.sleep(0.02)
            for name in files[1:]:
                _copy(src, dst, name)
            rows = consume(c, 30 - _count_before(src, files, start))
            assert rows_of(c.poll()) == []
    assert _numbers(rows) == list(range(_count_before(src, files, start), 30))
    warnings = [r.getMessage() for r in caplog.records if "waiting for the copy" in r.getMessage()]
    assert len(warnings) == 1 and files[1] in warnings[0] and f"holds {first_block - 10} bytes" in warnings[0]


def _count_before(src, files, start):
    """Messages of the source before the offsets ``start`` (one per block)."""
    at = start[STREAM]["0"]
    before = 0
    for name in files:
        starts = _block_starts(_path(src, name))[:-1]  # the last block is the seal
        if name < at["file"]:
            before += len(starts)
        elif name == at["file"]:
            before += sum(1 for s in starts if s < at["length"])
    return before


def test_a_reader_moved_to_a_destination_without_the_file_yet_waits_for_it(tmp_path):
    """The position's file is not in C at all yet (nor any later one): the reader waits, then
    reads on from the same offset once the files come."""
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    _copy(src, dst, files[0])
    start = _inside_second_file(src, files, k=2)
    before = _count_before(src, files, start)
    with Consumer(dst, STREAM, start=start) as c:
        time.sleep(0.3)
        assert rows_of(c.poll()) == []
        for name in files[1:]:
            _copy(src, dst, name)
        rows = consume(c, 30 - before)
        assert rows_of(c.poll()) == []
    assert _numbers(rows) == list(range(before, 30))


def test_a_reader_moved_to_a_destination_that_is_ahead_reads_on_at_once(tmp_path):
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    for name in files:
        _copy(src, dst, name)
    start = _inside_second_file(src, files)
    before = _count_before(src, files, start)
    with Consumer(dst, STREAM, start=start) as c:
        rows = consume(c, 30 - before)
        assert rows_of(c.poll()) == []
    assert _numbers(rows) == list(range(before, 30))


def test_a_position_past_the_local_seal_is_loss_naming_the_range(tmp_path):
    """An offset from another history: the destination's copy of the file is whole and sealed
    at S, the position lies past S. DataLossError naming [S, position), never a wait."""
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    for name in files:
        _copy(src, dst, name)
    sealed_at = os.path.getsize(_path(dst, files[0]))
    at = sealed_at + 200
    with Consumer(dst, STREAM, start={STREAM: {"0": {"file": files[0], "length": at}}}) as c:
        with pytest.raises(DataLossError) as err:
            for _ in range(100):
                c.poll()
                time.sleep(0.01)
    e = err.value
    assert (e.file, e.start, e.end) == (files[0], sealed_at, at)
    assert f"[{sealed_at}, {at})" in str(e) and "seal" in str(e)


def test_a_file_missing_before_later_copied_files_is_loss_in_a_destination(tmp_path):
    """A destination creates a shard's files in order: the position's file missing while a
    later one is here can no longer come."""
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    for name in files[:1] + files[2:]:
        _copy(src, dst, name)
    with Consumer(dst, STREAM, start=_inside_second_file(src, files)) as c:
        with pytest.raises(DataLossError, match=f"holds the later file {files[2]}") as err:
            for _ in range(100):
                c.poll()
                time.sleep(0.01)
    assert err.value.file == files[1]


def test_a_file_retention_deleted_is_loss_in_a_destination(tmp_path):
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    store = DurableStore(dst)
    raise_retention_floor(store, STREAM, 0, files[1])
    with Consumer(dst, STREAM, start=_inside_second_file(src, files)) as c:
        with pytest.raises(DataLossError, match=f"retention deleted the files up to {files[1]}"):
            for _ in range(100):
                c.poll()
                time.sleep(0.01)


def test_the_same_short_file_is_loss_in_the_source(tmp_path):
    src, files = _source(tmp_path)
    start = _inside_second_file(src, files)
    with open(_path(src, files[1]), "r+b") as f:
        f.truncate(start[STREAM]["0"]["length"] - 10)
    with Consumer(src, STREAM, start=start) as c:
        with pytest.raises(DataLossError, match="source cluster"):
            for _ in range(100):
                c.poll()
                time.sleep(0.01)


def test_the_planner_waits_at_a_start_a_destination_has_not_copied_and_fails_it_in_the_source(tmp_path):
    """The Spark source's planner (ShardExtent.latest) applies the same rule to a checkpoint's
    start: in a lagging destination the micro-batch ends where it starts (nothing planned until
    the copy comes), in the source the same start is loss."""
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    _copy(src, dst, files[0])
    start = Offset(**_inside_second_file(src, files)[STREAM]["0"])
    path = DurableReadPath(DurableStore(dst))
    assert shard_extent(path, STREAM, 0, start).latest(BoundaryCache(), path, start) == start
    for name in files[1:]:
        _copy(src, dst, name)
    assert shard_extent(path, STREAM, 0, start).latest(BoundaryCache(), path, start) > start
    shutil.rmtree(os.path.join(src, shard_dir(STREAM, 0)))
    os.makedirs(os.path.join(src, shard_dir(STREAM, 0)))
    spath = DurableReadPath(DurableStore(src))
    with pytest.raises(DataLossError, match="is gone from the store"):
        shard_extent(spath, STREAM, 0, start).latest(BoundaryCache(), spath, start)


def test_a_file_the_copy_creates_with_its_successor_between_two_looks_is_not_loss(tmp_path, monkeypatch):
    """Review finding (hostile read of df18f30): the tailer reads the file's length, then the
    rule lists the shard; a copy that creates the file and then the next one in between made a
    file still arriving look removed (a later file is here), and failOnDataLoss=false skipped
    its messages. The rule reads the length again after the listing."""
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    _copy(src, dst, files[0])
    start = _inside_second_file(src, files)
    before = _count_before(src, files, start)
    real = DurableReadPath.durable_length
    copied = []

    def durable_length(self, rel):
        n = real(self, rel)
        if rel.endswith(files[1]) and n is None and not copied:
            copied.append(True)  # the copy, right after this look: the file, then its successor
            for name in files[1:]:
                _copy(src, dst, name)
        return n

    monkeypatch.setattr(DurableReadPath, "durable_length", durable_length)
    with Consumer(dst, STREAM, start=start, fail_on_data_loss=False) as c:
        rows = consume(c, 30 - before)
    assert copied and _numbers(rows) == list(range(before, 30))


def test_a_wait_for_a_copy_ends_in_loss_once_the_stream_is_no_copy(tmp_path):
    """Review finding: a reader waiting for bytes of a copy kept waiting after the stream
    stopped being one (its copied_from removed at a failover, docs/copy.md): the rule is
    worked out again every MISSING_RECHECK_S while the length stands."""
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    _copy(src, dst, files[0])
    start = _inside_second_file(src, files)
    _copy(src, dst, files[1], upto=start[STREAM]["0"]["length"] - 10)
    with Consumer(dst, STREAM, start=start) as c:
        time.sleep(0.2)
        assert rows_of(c.poll()) == []  # waits: a copy still coming
        meta_path = os.path.join(dst, STREAM, "_stream.json")
        meta = json.load(open(meta_path))
        del meta["copied_from"]
        json.dump(meta, open(meta_path, "w"))
        deadline = time.monotonic() + WAIT_S
        with pytest.raises(DataLossError, match="source cluster"):
            while time.monotonic() < deadline:
                c.poll()
                time.sleep(0.05)


def test_a_task_replaying_a_batch_planned_elsewhere_waits_for_the_copy(tmp_path):
    """Review finding: a micro-batch planned in A and run again after the checkpoint moved to
    C, whose copy lacks the batch's start, failed its task after readTimeout with "published
    but readable neither in the data cache nor in the durable store", whatever failOnDataLoss
    said. The task now waits for the copy, as a Consumer does, and reads the range whole."""
    import threading

    from pyspark_acs.datasource.options import parse_source_options
    from pyspark_acs.datasource.source import AcsPartition, read_partition

    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    _copy(src, dst, files[0])
    start = _inside_second_file(src, files)
    at = start[STREAM]["0"]["length"]
    _copy(src, dst, files[1], upto=at - 10)
    end = (files[2], _block_starts(_path(src, files[2]))[1], 0)
    opts = parse_source_options({"root": dst, "stream": STREAM, "readTimeout": "1s"})
    later = threading.Timer(2.0, lambda: [_copy(src, dst, name) for name in files[1:]])
    later.start()
    try:
        batches = list(read_partition(opts, AcsPartition(STREAM, 0, (files[1], at, 0), end),
                                      DurableReadPath(DurableStore(dst))))
    finally:
        later.join()
    got = [int(v[4:9]) for b in batches for v in b.column("value").to_pylist()]
    first = _count_before(src, files, start)
    assert got == list(range(first, _count_before(src, files, {STREAM: {"0": {"file": end[0], "length": end[1]}}})))


def test_the_planner_works_out_a_loss_once_not_at_every_trigger(tmp_path, caplog):
    """Review finding (LOW): with failOnDataLoss=false and no later file yet, the planner read
    the file from byte 0 (proving its local seal) and logged the loss at every trigger; the
    answer stands per (file, position, length) for MISSING_RECHECK_S in its BoundaryCache."""
    src, files = _source(tmp_path)
    dst = _destination(tmp_path)
    for name in files:
        _copy(src, dst, name)
    sealed_at = os.path.getsize(_path(dst, files[-1]))
    start = Offset(files[-1], sealed_at + 100)  # past the newest file's seal: another history
    path = DurableReadPath(DurableStore(dst))
    boundaries = BoundaryCache()
    reads = []
    real = path.read
    path.read = lambda rel, a, b, **kw: reads.append((a, b)) or real(rel, a, b, **kw)
    with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.positions"):
        for _ in range(5):
            assert shard_extent(path, STREAM, 0, start).latest(boundaries, path, start,
                                                                fail_on_data_loss=False) == start
    warnings = [r for r in caplog.records if "past" in r.getMessage() or "seal" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert [a for a, _ in reads].count(0) == 1, reads  # one walk from byte 0 proved the seal
