"""Producer and Consumer on real files: round trips, live tails, restarts, bad bytes, crashes,
one writer per shard, bad options and data loss."""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import random
import signal
import subprocess
import tempfile
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspark_acs.format.block import HEADER_SIZE, encode_block, encode_seal, scan_blocks
from pyspark_acs.format.offsets import Offset
from pyspark_acs.read.consumer import Consumer, ConsumerOptions, TailTiming
from pyspark_acs.errors import (
    AcsOptionError,
    ChecksumMismatchError,
    ClosedError,
    CorruptFileError,
    DataLossError,
    InvalidNameError,
    WriterConflictError,
)
from pyspark_acs.format.names import file_name, shard_dir
from pyspark_acs.write.producer import Producer, shard_for_key
from pyspark_acs.storage.store import DurableStore

MiB = 1024 * 1024
WAIT_S = 20.0  # upper bound of every wait; tests normally finish far sooner


def rows_of(batches):
    """Flatten record batches into dicts (one per message)."""
    out = []
    for b in batches:
        d = b.to_pydict()
        for i in range(b.num_rows):
            out.append({k: d[k][i] for k in d})
    return out


def consume(consumer, n, timeout=WAIT_S):
    """Poll until ``n`` messages arrived (fail after ``timeout`` s); return their rows."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} messages arrived within {timeout} s"
        batches = consumer.poll()
        if batches:
            got.extend(rows_of(batches))
        else:
            time.sleep(0.005)
    return got


def assert_quiet(consumer, seconds=0.2):
    """Nothing more arrives for a while."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert rows_of(consumer.poll()) == []
        time.sleep(0.01)


def shard_files(root, stream, shard=0):
    return DurableStore(root).list_files(stream, shard)


def file_path(root, stream, name, shard=0):
    return os.path.join(root, shard_dir(stream, shard), name)


def new_file(root, stream, writer, shard=0, offset_s=0.0):
    """Path of a fresh message file (named as a Producer would) for hand-made contents."""
    created = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=offset_s)
    return file_path(root, stream, file_name(created, writer), shard)


# -- round trip --------------------------------------------------------------------------------

size_st = st.one_of(
    st.integers(0, 64), st.integers(0, 64), st.integers(0, 5000), st.sampled_from([0, 1, MiB - 1, 2 * MiB]),
    st.integers(0, 2 * MiB),
)
key_st = st.one_of(st.none(), st.binary(max_size=12), st.text(max_size=6))
ts_st = st.one_of(st.none(), st.integers(0, 2**53))
message_st = st.tuples(size_st, key_st, ts_st)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    flushes=st.lists(st.lists(message_st, max_size=6), min_size=1, max_size=4),
    shards=st.integers(1, 3),
    roll_bytes=st.sampled_from([1, 3000, 64 * 1024, 8 * MiB]),
    max_block_bytes=st.sampled_from([1024, 4096, MiB]),
    max_read_bytes=st.sampled_from([100, 64 * 1024, 16 * MiB]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(flushes, shards, roll_bytes, max_block_bytes, max_read_bytes, seed):
    rnd = random.Random(seed)
    budget = 10 * MiB  # keep one example to a few MiB whatever sizes hypothesis draws
    with tempfile.TemporaryDirectory() as root:
        expected = {s: [] for s in range(shards)}
        producer = Producer(root, "rt", shards=shards, roll_bytes=roll_bytes, max_block_bytes=max_block_bytes)
        total = 0
        for group in flushes:
            for size, key, ts in group:
                size = min(size, budget)
                budget -= size
                value = rnd.randbytes(size)
                before = time.time_ns() // 1000
                shard = producer.send(value, key=key, timestamp=ts)
                after = time.time_ns() // 1000
                kb = key.encode() if isinstance(key, str) else key
                if kb is not None:
                    assert shard == shard_for_key(kb, shards)
                expected[shard].append((kb, value, ts, before, after))
                total += 1
            producer.flush(timeout=WAIT_S)
        producer.close()
        # max_read_bytes below a block's size reads that block whole
        with Consumer(root, "rt", max_read_bytes=max_read_bytes) as consumer:
            got = consume(consumer, total)
            assert_quiet(consumer, 0.02)
        by_shard = {s: [r for r in got if r["shard"] == s] for s in range(shards)}
        store = DurableStore(root)
        for s in range(shards):
            rows, exp = by_shard[s], expected[s]
            assert len(rows) == len(exp)
            for row, (key, value, ts, before, after) in zip(rows, exp):
                assert row["stream"] == "rt"
                assert row["key"] == key
                assert row["value"] == value  # byte-exact, in send order
                stamp = (row["timestamp"] - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)) // dt.timedelta(
                    microseconds=1
                )
                if ts is None:
                    assert before <= stamp <= after
                else:
                    assert stamp == ts
            # positions count messages within each file, from 0, with no gap
            files = store.list_files("rt", s)
            assert [r["file"] for r in rows] == sorted(r["file"] for r in rows)
            for f in files:
                positions = [r["position"] for r in rows if r["file"] == f]
                assert positions == list(range(len(positions)))
            # every file a closed producer leaves is sealed, and each roll started a new file
            for f in files:
                data = open(file_path(root, "rt", f, s), "rb").read()
                blocks = list(scan_blocks(data, final=True))
                assert blocks[-1][1].sealed and sum(1 for _, h in blocks if h.sealed) == 1
                if roll_bytes == 1:
                    assert sum(1 for _, h in blocks if h.count) <= 1
            if roll_bytes == 1:
                assert len(files) == len({r["file"] for r in rows})


def test_rollover_by_size_and_age_and_stats(root):
    with Producer(root, "roll", roll_bytes=2000, max_block_bytes=1024) as p:
        for i in range(40):
            p.send(b"%04d" % i + b"x" * 196)
        p.flush(timeout=WAIT_S)
        files_by_size = len(shard_files(root, "roll"))
        assert files_by_size >= 3
        stats = p.stats()
        assert stats["messages"] == 40 and stats["files"] == files_by_size and stats["bytes"] > 8000
        assert p.current_files()[0] in ("", *shard_files(root, "roll"))
    with Producer(root, "age", roll_seconds=0.05) as p:
        p.send(b"a")
        p.flush(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while len(shard_files(root, "age")) < 1 or not _sealed(root, "age", shard_files(root, "age")[0]):
            assert time.monotonic() < deadline, "age rollover never sealed the file"
            time.sleep(0.01)
        p.send(b"b")
        p.flush(timeout=WAIT_S)
        assert len(shard_files(root, "age")) == 2
    with Consumer(root, ["roll", "age"]) as c:
        rows = consume(c, 42)
    assert [r["value"][:4] for r in rows if r["stream"] == "roll"] == [b"%04d" % i for i in range(40)]
    assert [r["value"] for r in rows if r["stream"] == "age"] == [b"a", b"b"]
    assert [r["position"] for r in rows if r["stream"] == "age"] == [0, 0]


def _sealed(root, stream, name, shard=0):
    data = open(file_path(root, stream, name, shard), "rb").read()
    blocks = list(scan_blocks(data))
    return bool(blocks) and blocks[-1][1].sealed


def test_keys_route_by_hash_and_none_round_robin(root):
    with Producer(root, "keys", shards=4) as p:
        assert [p.send(b"v") for _ in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
        assert p.send(b"v", key="abc") == shard_for_key(b"abc", 4) == p.send(b"v", key=b"abc")
        assert p.send(b"v", key="abc", shard=2) == 2
        with pytest.raises(InvalidNameError, match="invalid shard 4"):
            p.send(b"v", shard=4)
        with pytest.raises(TypeError, match="value must be bytes, str or None"):
            p.send(12)
        with pytest.raises(TypeError, match="key"):
            p.send(b"v", key=3.5)
        p.send("text value", key=bytearray(b"k"), timestamp=dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc))
        p.send(None)
    with pytest.raises(ClosedError, match="closed"):
        p.send(b"late")
    p.close()  # idempotent
    with Consumer(root, "keys") as c:
        rows = consume(c, 13)
    text = [r for r in rows if r["value"] == b"text value"][0]
    assert text["key"] == b"k" and text["timestamp"] == dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
    assert any(r["value"] is None for r in rows)


# -- live tailing and restarts -----------------------------------------------------------------


def _produce_in_thread(root, stream, n, pause=0.001, **kwargs):
    """Send ``n`` numbered messages with small pauses from a thread; return (thread, errors)."""
    errors = []
    started = threading.Event()

    def run():
        try:
            with Producer(root, stream, **kwargs) as p:
                started.set()
                for i in range(n):
                    p.send(b"msg-%05d" % i + b"." * (i % 50), key=None)
                    if i % 7 == 0:
                        time.sleep(pause)
                    if i % 50 == 0:
                        p.flush(timeout=WAIT_S)
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(WAIT_S)
    return t, errors


def _numbers(rows):
    return [int(r["value"][4:9]) for r in rows]


def test_consumer_tails_a_live_producer(root):
    n = 600
    # the stream must exist before the consumer starts
    DurableStore(root).create_stream("live", 1)
    with Consumer(root, "live", start="earliest", poll_interval=0.001) as c:
        t, errors = _produce_in_thread(root, "live", n, roll_bytes=4000)
        got = []
        deadline = time.monotonic() + WAIT_S
        polls_with_data = 0
        while len(got) < n:
            assert time.monotonic() < deadline, f"got {len(got)} of {n}"
            batch = rows_of(c.poll())
            polls_with_data += bool(batch)
            got.extend(batch)
            time.sleep(0.001)
        t.join(WAIT_S)
        assert not errors
        assert_quiet(c, 0.05)
    assert _numbers(got) == list(range(n))
    assert polls_with_data > 1  # it really tailed: data arrived over several polls
    assert len({r["file"] for r in got}) > 3  # and followed the rollovers


def test_restart_from_saved_offsets_has_no_gap_and_no_duplicate(root):
    n = 900
    DurableStore(root).create_stream("rs", 1)
    t, errors = _produce_in_thread(root, "rs", n, roll_bytes=6000, max_block_bytes=1024)
    got = []
    restarts = 0
    offsets = "earliest"
    deadline = time.monotonic() + WAIT_S
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {len(got)} of {n}"
        # each consumer instance takes a few batches, saves its offsets and goes away
        c = Consumer(root, "rs", start=offsets, poll_interval=0.001)
        taken = 0
        for batch in c.batches(timeout=0.2):
            got.extend(rows_of([batch]))
            taken += 1
            if taken == 2:
                break
        offsets = c.offsets()
        c.close()
        restarts += 1
    t.join(WAIT_S)
    assert not errors
    with Consumer(root, "rs", start=offsets) as c:
        assert_quiet(c, 0.05)
    assert _numbers(got) == list(range(n))
    assert restarts > 3


def test_offsets_after_each_batch_of_a_poll(root):
    # many blocks are read in one poll; offsets() after a yielded batch covers that batch only
    with Producer(root, "ob", max_block_bytes=1024) as p:
        for i in range(200):
            p.send(b"msg-%05d" % i + b"x" * 100)
    c = Consumer(root, "ob")
    it = c.batches(timeout=0.5)
    first = next(it)
    offsets = c.offsets()
    it.close()
    c.close()
    rest = Consumer(root, "ob", start=offsets)
    rows = rows_of([first]) + consume(rest, 200 - first.num_rows)
    assert _numbers(rows) == list(range(200))
    # a generator left mid-poll does not lose the batches it did not hand out
    c = Consumer(root, "ob")
    it = c.batches(timeout=0.5)
    rows = rows_of([next(it)])
    it.close()
    rows += consume(c, 200 - len(rows))
    assert _numbers(rows) == list(range(200))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 400), min_size=1, max_size=6))
def test_offsets_in_the_middle_of_a_batch_resume_at_its_next_row(root, cuts):
    """``offsets(consumed=n)`` names row ``n`` of the last batch (an offset with a ``position``
    inside a block): a chain of consumers, each taking ``n`` rows of one batch and stopping,
    reads every message exactly once, across blocks, coalesced backlogs and a file's seal."""
    stream = "mid"
    if DurableStore(root).stream_shards(stream) is None:
        with Producer(root, stream, roll_bytes=20000, max_block_bytes=2048) as p:
            for i in range(1500):
                p.send(b"msg-%05d" % i + b"m" * (i % 40))
    got = []
    offsets = "earliest"
    for n in cuts * 40:
        with Consumer(root, stream, start=offsets) as c:
            batch = next(iter(c.batches(timeout=0.3)), None)
            if batch is None:
                break
            n = min(n, batch.num_rows)
            got.extend(rows_of([batch.slice(0, n)]))
            offsets = c.offsets(consumed=n)
            if n < batch.num_rows:  # a position unless row n starts its block
                assert offsets[stream]["0"].get("position", 0) in (0, batch.column("position")[n].as_py())
    with Consumer(root, stream, start=offsets) as c:
        got.extend(rows_of(list(c.batches(timeout=0.3))))
    assert _numbers(got) == list(range(1500))


def test_offsets_consumed_is_checked(root):
    with Producer(root, "oc") as p:
        p.send(b"msg-00000")
    with Consumer(root, "oc") as c:
        with pytest.raises(AcsOptionError, match="consumed: no batch was handed out"):
            c.offsets(consumed=0)
        batch = next(iter(c.batches(timeout=0.3)))
        with pytest.raises(AcsOptionError, match=r"consumed: 2 is not a row count of the last batch \(0 \.\. 1\)"):
            c.offsets(consumed=2)
        assert c.offsets(consumed=0)["oc"]["0"] == {"file": batch.column("file")[0].as_py(), "length": 0}
        assert c.offsets(consumed=1) == c.offsets()


@pytest.mark.parametrize("bad", [{"position": -1}, {"position": "3"}, {"file": "", "length": 0, "position": 2}])
def test_a_bad_position_in_an_offset_is_named(root, bad):
    from pyspark_acs.format.offsets import Offset

    value = dict({"file": "20261122T091242032052Z-5f2c.acs", "length": 0}, **bad)
    with pytest.raises(AcsOptionError, match="position must be a non-negative integer"):
        Offset.from_json(value)


def test_a_backlog_is_handed_out_in_a_few_large_batches_with_exact_offsets(root):
    """Blocks read together are coalesced (read/batches.py): a consumer that is behind gets its
    backlog in batches of up to CONSUMER_BATCH_BYTES, not one per block, in order, each of one
    file's messages; the offsets after each batch resume exactly after it."""
    from pyspark_acs.read.batches import CONSUMER_BATCH_BYTES, batch_bytes

    with Producer(root, "backlog", max_block_bytes=64 * 1024) as p:
        for i in range(2000):
            p.send(b"msg-%05d" % i + b"x" * 4000)
    with Producer(root, "backlog") as p:  # a second file, after the first one's seal
        for i in range(2000, 2010):
            p.send(b"msg-%05d" % i)
    blocks = sum(1 for _ in scan_blocks(open(DurableStore(root).path(
        f"{shard_dir('backlog', 0)}/{DurableStore(root).list_files('backlog', 0)[0]}"), "rb").read()))
    c = Consumer(root, "backlog", max_read_bytes=64 * 1024 * 1024)
    it = c.batches(timeout=0.5)
    first = next(it)
    offsets = c.offsets()
    it.close()
    c.close()
    assert 1 < first.num_rows < 2000 and batch_bytes(first) <= CONSUMER_BATCH_BYTES + 64 * 1024
    rest = Consumer(root, "backlog", start=offsets)
    batches = list(rest.batches(timeout=0.5))
    rest.close()
    # blocks of ~16 messages came in batches of about CONSUMER_BATCH_BYTES (~128 messages)
    assert len(batches) + 1 < blocks / 4
    assert all(batch_bytes(b) <= CONSUMER_BATCH_BYTES + 64 * 1024 for b in batches)
    assert _numbers(rows_of([first] + batches)) == list(range(2010))
    # A batch holds one file's messages: the seal between the files is never inside one.
    assert all(len(set(b.column("file").to_pylist())) == 1 for b in [first] + batches)
    assert batches[-1].num_rows == 10


def test_start_latest_sees_only_new_messages(root, monkeypatch):
    p = Producer(root, "lt", roll_bytes=500)
    for i in range(30):
        p.send(b"old-%d" % i)
    p.flush(timeout=WAIT_S)
    with Consumer(root, "lt", start="latest") as c:
        assert_quiet(c, 0.05)
        for i in range(20):
            p.send(b"new-%d" % i)
        p.flush(timeout=WAIT_S)
        assert [r["value"] for r in consume(c, 20)] == [b"new-%d" % i for i in range(20)]
        p.close()
        assert_quiet(c, 0.05)
    # latest after a closed (sealed) file: the next producer's file is followed
    with Consumer(root, "lt", start="latest") as c:
        with Producer(root, "lt") as p2:
            p2.send(b"after")
        assert [r["value"] for r in consume(c, 1)] == [b"after"]
        assert_quiet(c, 0.05)
    # latest on an empty stream
    DurableStore(root).create_stream("empty", 1)
    with Consumer(root, "empty", start="latest") as c:
        assert c.offsets() == {"empty": {"0": {"file": "", "length": 0}}}
        with Producer(root, "empty") as p3:
            p3.send(b"first")
        assert [r["value"] for r in consume(c, 1)] == [b"first"]


def test_consumer_follows_chosen_shards_and_several_streams(root):
    with Producer(root, "a", shards=3) as p:
        for i in range(9):
            p.send(b"a%d" % i, shard=i % 3)
    with Producer(root, "b") as p:
        p.send(b"b0")
    with Consumer(root, "a", shards=[1]) as c:
        assert [r["value"] for r in consume(c, 3)] == [b"a1", b"a4", b"a7"]
        assert list(c.offsets()["a"]) == ["1"]
    with Consumer(root, ["a", "b"]) as c:
        rows = consume(c, 10)
        assert sorted(c.offsets()) == ["a", "b"]
    assert [r["value"] for r in rows if r["stream"] == "b"] == [b"b0"]


# -- bad bytes ---------------------------------------------------------------------------------


def _three_sealed_files(root, stream="bad"):
    with Producer(root, stream, roll_bytes=600, max_block_bytes=1024) as p:
        for i in range(30):
            p.send(b"msg-%05d" % i + b"v" * 90)
            p.flush(timeout=WAIT_S)  # one message per block, about four blocks per file
    files = shard_files(root, stream)
    assert len(files) >= 3
    return files


def _block_starts(path):
    data = open(path, "rb").read()
    return [at for at, _ in scan_blocks(data, final=True)]


def _patch(path, at, new):
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(new)


def _consume_until_error(consumer, exc_type):
    deadline = time.monotonic() + WAIT_S
    rows = []
    with pytest.raises(exc_type) as err:
        while True:
            assert time.monotonic() < deadline, "the corruption was never reported"
            rows.extend(rows_of(consumer.poll()))
            time.sleep(0.005)
    return rows, err.value


def _truncate_first(root, stream, damage):
    """Cut the first of three sealed files: ``(file, uri, cut-off byte, rows before it, rows of
    the later files)``."""
    files = _three_sealed_files(root, stream)
    path = file_path(root, stream, files[0])
    uri = DurableStore(root).uri(f"{shard_dir(stream, 0)}/{files[0]}")
    data = open(path, "rb").read()
    starts = _block_starts(path)
    counts = {at: h.count for at, h in scan_blocks(data, final=True)}
    if damage == "truncated_header":  # the file ends 10 bytes into the seal
        bad_at = starts[-1]
        os.truncate(path, bad_at + 10)
    elif damage == "block_longer_than_file":  # the file ends inside its last message block
        bad_at = starts[-2]
        os.truncate(path, len(data) - HEADER_SIZE - 7)
    else:  # cut at a block boundary: the seal and the last block gone, no torn bytes left
        bad_at = starts[-2]
        os.truncate(path, bad_at)
    before = sum(n for at, n in counts.items() if at < bad_at)
    return files[0], uri, bad_at, before, sum(counts.values())


@pytest.mark.parametrize("damage", ["truncated_header", "block_longer_than_file", "at_a_block_boundary"])
def test_a_truncated_file_in_the_source_cluster_is_data_loss_named_by_file_and_bytes(root, damage, caplog):
    """The finality rule (read/positions.py unfinished_file): in the stream's source cluster an
    unsealed file that a later file with messages follows was cut after the fact (writers seal
    before they roll), so the reader raises DataLossError naming the file and the byte it was
    cut at -- it used to stop there in silence -- and with fail_on_data_loss=False goes on
    with the later file after a warning."""
    first, uri, bad_at, before, in_first = _truncate_first(root, "bad", damage)
    with Consumer(root, "bad") as c:
        rows, err = _consume_until_error(c, DataLossError)
    assert _numbers(rows) == list(range(before))
    assert (err.stream, err.shard, err.file, err.start) == ("bad", 0, first, bad_at)
    assert f"file {first} has no seal: its last complete block ends at byte {bad_at}" in str(err)
    assert "truncated or damaged" in str(err) and "failOnDataLoss=false" in str(err)
    with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.consumer"):
        with Consumer(root, "bad", fail_on_data_loss=False) as c:
            rows = consume(c, 30 - (in_first - before))
            assert_quiet(c, 0.1)
    assert _numbers(rows) == list(range(before)) + list(range(in_first, 30))
    assert any(f"file {first} has no seal" in r.getMessage() and "continuing from file" in r.getMessage()
               for r in caplog.records)


def test_the_look_for_a_later_file_backs_off_on_the_tailers_clock(root):
    """A tailer stuck at an unsealed file's end looks for a later file after
    TailTiming.unfinished_check_s[0] at the position, then with the wait doubling to the cap
    (a caught-up reader of an idle stream lists its shard a few times a minute); a bounded
    read whose end lies in a later file looks at once. Timed by the tailer's clock: no sleep."""
    from pyspark_acs.read.consumer import ShardTailer
    from pyspark_acs.read.readpath import DurableReadPath

    store = DurableStore(root)
    store.create_stream("ck", 1)
    names = [file_name(dt.datetime(2026, 1, 1, 0, 0, i, tzinfo=dt.timezone.utc), "w") for i in range(2)]
    first = encode_block([b"msg-00000"], first_index=0)
    with open(file_path(root, "ck", names[0]), "wb") as f:
        f.write(first)  # a live writer's file: no seal yet
    listings = []

    class Counting(DurableStore):
        def list_files(self, *a, **k):
            listings.append(now[0])
            return super().list_files(*a, **k)

    now = [0.0]
    path = DurableReadPath(Counting(root))
    t = ShardTailer(path, "ck", 0, Offset(names[0], 0), timing=TailTiming(unfinished_check_s=(1.0, 8.0)),
                    clock=lambda: now[0])
    assert len(t.step()) == 1
    for now[0] in [x / 2 for x in range(0, 80)]:  # 40 s of steps, every half second
        assert t.step() == []
    # first look 1 s after it stopped there, then waits of 1, 2, 4 and 8 (the cap) s
    assert listings == [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0], listings
    with open(file_path(root, "ck", names[1]), "wb") as f:
        f.write(encode_block([b"msg-00001"], first_index=0) + encode_seal(1))
    now[0] = 39.5
    assert t.step() == []  # not due yet
    now[0] = 40.0
    with pytest.raises(DataLossError, match=f"file {names[0]} has no seal"):
        t.step()
    listings.clear()
    bounded = ShardTailer(path, "ck", 0, Offset(names[0], len(first)), clock=lambda: now[0])
    with pytest.raises(DataLossError):
        bounded.step(end=Offset(names[1], 10))
    assert listings == [40.0]  # at once: the end lies in the later file


def test_a_truncated_file_in_a_destination_is_waited_at_until_its_copy_arrives(root, tmp_path, caplog):
    """In a destination (``copied_from``) files are copied side by side: an unsealed file with
    a later file after it is a copy still coming. The reader waits (saying so once after
    TailTiming.stuck_warn_after_s, after its first look for a later file), raises nothing, and reads every
    message once the rest arrives."""
    timing = TailTiming(stuck_warn_after_s=1.5)  # past its first look for a later file (1 s)
    source = str(tmp_path / "source")
    files = _three_sealed_files(source, "cp")
    DurableStore(root).create_stream("cp", 1, copied_from="A")
    whole = {}
    for name in files:
        whole[name] = open(file_path(source, "cp", name), "rb").read()
    cut = _block_starts(file_path(source, "cp", files[0]))[2] + 5  # inside the third block
    for name in files:
        with open(file_path(root, "cp", name), "wb") as f:
            f.write(whole[name][:cut] if name == files[0] else whole[name])
    with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.consumer"):
        with Consumer(root, "cp", timing=timing) as c:
            rows = consume(c, 2)
            deadline = time.monotonic() + WAIT_S
            while not any("still being copied" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the wait was never reported"
                assert rows_of(c.poll()) == []
                time.sleep(0.05)
            with open(file_path(root, "cp", files[0]), "ab") as f:
                f.write(whole[files[0]][cut:])
            rows += consume(c, 28)
            assert_quiet(c, 0.1)
    assert _numbers(rows) == list(range(30))
    warning = [r.getMessage() for r in caplog.records if "still being copied" in r.getMessage()]
    assert len(warning) == 1 and files[0] in warning[0] and files[1] in warning[0]


@pytest.mark.parametrize("damage", ["body_byte", "header_byte", "magic", "garbage_tail"])
def test_corrupt_finished_file_names_file_and_position(root, damage, monkeypatch):
    files = _three_sealed_files(root)
    path = file_path(root, "bad", files[0])
    uri = DurableStore(root).uri(f"{shard_dir('bad', 0)}/{files[0]}")
    data = open(path, "rb").read()
    starts = _block_starts(path)
    counts = {at: h.count for at, h in scan_blocks(data, final=True)}
    bad_at = starts[1]
    if damage == "body_byte":
        _patch(path, bad_at + HEADER_SIZE + 5, b"\xff")
        expected = ChecksumMismatchError
    elif damage == "header_byte":
        _patch(path, bad_at + 9, b"\x7f")
        expected = CorruptFileError
    elif damage == "magic":
        _patch(path, bad_at, b"NOPE")
        expected = CorruptFileError
    else:  # the seal replaced by garbage
        bad_at = starts[-1]
        _patch(path, bad_at, os.urandom(HEADER_SIZE))
        expected = CorruptFileError
    with Consumer(root, "bad") as c:
        rows, err = _consume_until_error(c, expected)
    assert isinstance(err, CorruptFileError)
    assert err.path == uri and err.position == bad_at
    assert uri in str(err) and f"byte {bad_at}" in str(err)
    # the messages before the bad block are delivered, none after it
    assert _numbers(rows) == list(range(sum(n for at, n in counts.items() if at < bad_at)))
    assert rows
    assert all(r["file"] == files[0] for r in rows)


def test_partial_last_block_is_waited_for_not_reported(root, monkeypatch):
    DurableStore(root).create_stream("part", 1)
    path = new_file(root, "part", "w1")
    b1 = encode_block([b"one", b"two"], None, [1, 2])
    b2 = encode_block([b"three" * 1000, b"four"], [b"k3", None], [3, 4], first_index=2)
    with open(path, "ab") as f:
        f.write(b1 + b2[:HEADER_SIZE // 2])
    with Consumer(root, "part") as c:
        assert [r["value"] for r in consume(c, 2)] == [b"one", b"two"]
        assert_quiet(c, 0.2)  # half a header: wait
        with open(path, "ab") as f:
            f.write(b2[HEADER_SIZE // 2 : HEADER_SIZE + 100])
        assert_quiet(c, 0.2)  # header and part of the body: wait
        with open(path, "ab") as f:
            f.write(b2[HEADER_SIZE + 100 :])
        rows = consume(c, 2)
        assert [r["value"] for r in rows] == [b"three" * 1000, b"four"]
        assert [r["position"] for r in rows] == [2, 3]
        assert c.offsets()["part"]["0"] == {"file": os.path.basename(path), "length": len(b1) + len(b2)}


def test_crashed_producer_torn_tail_is_skipped_with_a_warning(root, monkeypatch, caplog):
    DurableStore(root).create_stream("crash", 1)
    old = new_file(root, "crash", "deadwriter", offset_s=-1)
    good = encode_block([b"before-crash"], None, [1])
    torn = encode_block([b"never-acked" * 100], None, [2], first_index=1)[:300]
    with open(old, "ab") as f:
        f.write(good + torn)
    with Consumer(root, "crash") as c:
        assert [r["value"] for r in consume(c, 1)] == [b"before-crash"]
        assert_quiet(c, 0.15)  # no newer file: the torn block might still be completed
        with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.consumer"):
            with Producer(root, "crash", lease_seconds=0.5) as p:
                p.send(b"after-restart")
            rows = consume(c, 1)
        assert [r["value"] for r in rows] == [b"after-restart"]
        assert rows[0]["file"] != os.path.basename(old)
    warning = [r.getMessage() for r in caplog.records if "never finished" in r.getMessage()]
    assert len(warning) == 1
    assert os.path.basename(old) in warning[0]
    assert f"bytes [{len(good)}, {len(good) + len(torn)})" in warning[0]


_CHILD = r"""
import sys, time
from pyspark_acs.write.producer import Producer
p = Producer(sys.argv[1], "kill", lease_seconds=float(sys.argv[2]))
for i in range(10):
    p.send(b"child-%d" % i)
p.flush(timeout=20)
print(p.current_files()[0], flush=True)
time.sleep(60)
"""


def test_one_writer_per_shard_and_takeover_after_a_killed_writer(root, python_exe, subprocess_env, monkeypatch):
    child = subprocess.Popen(
        [python_exe, "-c", _CHILD, root, "3.0"], stdout=subprocess.PIPE, env=subprocess_env, text=True
    )
    try:
        line = child.stdout.readline().strip()  # the child flushed its messages
        assert line.endswith(".acs"), line
        with pytest.raises(WriterConflictError) as err:
            Producer(root, "kill")
        msg = str(err.value)
        assert "shard 0 of stream 'kill'" in msg and f"pid {child.pid}" in msg and "held by writer" in msg
        # the writer dies mid-block: SIGKILL, then the half-written block it left behind
        child.send_signal(signal.SIGKILL)
        child.wait(WAIT_S)
        torn = encode_block([b"x" * 500], None, [1], first_index=10)[:200]
        with open(file_path(root, "kill", line), "ab") as f:
            f.write(torn)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                p = Producer(root, "kill", lease_seconds=1.0)
                break
            except WriterConflictError:
                assert time.monotonic() < deadline, "the dead writer's lease never expired"
                time.sleep(0.05)
        with p:
            p.send(b"successor")
        with Consumer(root, "kill") as c:
            rows = consume(c, 11)
            assert_quiet(c, 0.1)
        assert [r["value"] for r in rows] == [b"child-%d" % i for i in range(10)] + [b"successor"]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT_S)


def test_second_producer_refused_until_the_first_closes(root):
    first = Producer(root, "one", shards=2)
    with pytest.raises(WriterConflictError, match="stream 'one'.*held by writer " + first.writer_id):
        Producer(root, "one", shards=2)
    first.send(b"from first")
    first.close()
    with Producer(root, "one", shards=2) as second:
        second.send(b"from second")
    with Consumer(root, "one") as c:
        assert sorted(r["value"] for r in consume(c, 2)) == [b"from first", b"from second"]


# -- bad options -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["..", "a/b", "", "x" * 129, "bad\x01name", ".hidden", "a\nb"])
def test_unsafe_stream_names_refused_everywhere(root, name):
    with pytest.raises(InvalidNameError, match="invalid stream name"):
        Producer(root, name)
    with pytest.raises(InvalidNameError, match="invalid stream name"):
        Consumer(root, name)
    assert os.listdir(root) == []


@pytest.mark.parametrize(
    "kwargs, option",
    [({"shards": 0}, "shards"), ({"shards": -2}, "shards"), ({"shards": True}, "shards"),
     ({"max_block_bytes": 10}, "max_block_bytes"), ({"roll_bytes": 0}, "roll_bytes"),
     ({"roll_seconds": 0}, "roll_seconds"), ({"max_batch_delay": -1}, "max_batch_delay"),
     ({"lease_seconds": 0}, "lease_seconds"), ({"max_pending_bytes": "big"}, "max_pending_bytes"),
     ({"shards": 200_000}, "shards"), ({"shards": 1.5}, "shards"), ({"acknowledge": "fast"}, "acknowledge"),
     ({"acknowledge": None}, "acknowledge")],
)
def test_bad_producer_options_name_the_option(root, kwargs, option):
    with pytest.raises(AcsOptionError) as err:
        Producer(root, "opts", **kwargs)
    assert err.value.option == option and str(err.value).startswith(option)
    if option == "acknowledge":  # the allowed values are named
        assert "'published'" in str(err.value) and "'durable'" in str(err.value)
    assert os.listdir(root) == []


def test_bad_consumer_options_name_the_option(root):
    Producer(root, "copts", shards=2).close()
    cases = [
        ({"poll_interval": -0.1}, "poll_interval"),
        ({"poll_interval": "fast"}, "poll_interval"),
        ({"start": "middle"}, "start"),
        ({"start": "{not json"}, "start"),
        ({"start": {"copts": {"0": {"file": "../x", "length": 0}}}}, "start"),
        ({"max_bytes_per_second": 0}, "max_bytes_per_second"),
        ({"max_read_bytes": 0}, "max_read_bytes"),
        ({"fail_on_data_loss": "maybe"}, "fail_on_data_loss"),
        ({"tier_read_policy": "disk"}, "tier_read_policy"),
    ]
    for kwargs, option in cases:
        with pytest.raises(AcsOptionError) as err:
            Consumer(root, "copts", **kwargs)
        assert err.value.option == option and option in str(err.value), kwargs
    with pytest.raises(AcsOptionError, match="no stream 'missing'"):
        Consumer(root, "missing")
    with pytest.raises(InvalidNameError, match="invalid shard 2"):
        Consumer(root, "copts", shards=[2])


def test_consumer_settings_take_units_and_say_what_was_meant(root):
    """The Consumer's settings are parsed once by ConsumerOptions: sizes and durations take
    units, None is the default, and a misspelt start word gets the nearest one."""
    Producer(root, "units").close()
    with Consumer(root, "units", start=" Latest", poll_interval="5ms", max_bytes_per_second="8MiB",
                  max_read_bytes="64KiB", fail_on_data_loss=None) as c:
        assert c.options == ConsumerOptions(start="latest", poll_interval=0.005, max_bytes_per_second=8 * MiB,
                                            max_read_bytes=64 * 1024)
        assert c.poll_interval == 0.005
    with pytest.raises(AcsOptionError, match=r"start: 'earlist' is not allowed \(did you mean 'earliest'\?\)"):
        Consumer(root, "units", start="earlist")


def test_mismatched_shard_count_refused(root):
    Producer(root, "sc", shards=2).close()
    with pytest.raises(AcsOptionError, match="has 2 shards, not 3") as err:
        Producer(root, "sc", shards=3)
    assert err.value.option == "shards"
    Producer(root, "sc", shards=2).close()


def test_closed_consumer(root):
    Producer(root, "cc").close()
    c = Consumer(root, "cc")
    c.close()
    c.close()
    with pytest.raises(ClosedError):
        c.poll()


# -- data loss ---------------------------------------------------------------------------------


def _offsets_inside(root, stream, files, n_files_before):
    """Offsets in the middle of file ``files[n_files_before]`` (after its first block)."""
    path = file_path(root, stream, files[n_files_before])
    starts = _block_starts(path)
    return {stream: {"0": {"file": files[n_files_before], "length": starts[1]}}}


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_data_loss_raises_or_skips_to_the_next_file(root, how, caplog):
    files = _three_sealed_files(root, "dl")
    offsets = _offsets_inside(root, "dl", files, 1)
    with Consumer(root, "dl") as c:
        everything = consume(c, 30)
    expected_after = [r for r in everything if r["file"] > files[1]]
    path = file_path(root, "dl", files[1])
    position = offsets["dl"]["0"]["length"]
    if how == "deleted":
        os.remove(path)
    else:
        os.truncate(path, position - 10)
    with Consumer(root, "dl", start=offsets) as c:
        with pytest.raises(DataLossError) as err:
            consume(c, 1)
    e = err.value
    assert (e.stream, e.shard, e.file) == ("dl", 0, files[1])
    msg = str(e)
    assert "stream 'dl' shard 0" in msg and files[1] in msg and f"byte {position}" in msg
    if how == "truncated":
        assert (e.start, e.end) == (position - 10, position) and f"only {position - 10} bytes" in msg
    else:
        assert "gone" in msg
    with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.consumer"):
        with Consumer(root, "dl", start=offsets, fail_on_data_loss=False) as c:
            rows = consume(c, len(expected_after))
            assert_quiet(c, 0.1)
    assert [r["value"] for r in rows] == [r["value"] for r in expected_after]
    assert any("data loss" in r.getMessage() and files[1] in r.getMessage() for r in caplog.records)


def test_data_loss_of_the_newest_file_waits_without_replaying_older_files(root, caplog):
    files = _three_sealed_files(root, "dn")
    offsets = _offsets_inside(root, "dn", files, len(files) - 1)
    os.remove(file_path(root, "dn", files[-1]))
    with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.consumer"):
        with Consumer(root, "dn", start=offsets, fail_on_data_loss=False) as c:
            assert_quiet(c, 0.1)  # older files are not read again
            with Producer(root, "dn") as p:
                p.send(b"later")
            assert [r["value"] for r in consume(c, 1)] == [b"later"]
    assert any("data loss" in r.getMessage() for r in caplog.records)


def test_send_many_keeps_order_and_shards_like_send(root):
    values = [b"v%d" % i for i in range(500)]
    keys = [None if i % 3 == 0 else b"k%d" % (i % 7) for i in range(500)]
    with Producer(root, "many", shards=3) as p:
        p.send_many(values[:250], keys[:250])
        p.send_many(values[250:], keys[250:])
        p.send_many([b"pinned"], shard=2)
        with pytest.raises(ValueError):
            p.send_many([b"a", b"b"], [b"k"])
    c = Consumer(root, "many")
    rows = [r for b in c.batches(timeout=0.5) for r in b.to_pylist()]
    c.close()
    assert sorted(r["value"] for r in rows) == sorted(values + [b"pinned"])
    for r in rows:
        if r["key"] is not None:
            assert r["shard"] == shard_for_key(r["key"], 3)
    for shard in range(3):
        got = [r["value"] for r in rows if r["shard"] == shard and r["value"] != b"pinned"]
        assert got == sorted(got, key=lambda v: int(v[1:]))
    assert [r["shard"] for r in rows if r["value"] == b"pinned"] == [2]


def test_a_consumer_waiting_for_a_first_file_sleeps_between_listings(root):
    """Before a stream's first file, batches() waits for the listing back-off rather than
    looking every poll interval (a look then lists nothing); the first message is still found
    within the back-off's longest wait."""
    longest = TailTiming().listing_backoff_s[1]
    DurableStore(root).create_stream("late", 1)
    c = Consumer(root, "late", poll_interval=0.01)
    rounds = []
    fill = c._fill
    c._fill = lambda: (rounds.append(time.monotonic()), fill())[1]
    try:
        assert list(c.batches(timeout=1.0)) == []
        # 1 s of 10 ms polls would be ~100 rounds; with waits doubling to 0.1 s, about 14.
        assert len(rounds) <= 1.0 / longest + 8, len(rounds)
        with Producer(root, "late") as p:
            p.send(b"first")
            sent = time.monotonic()
        batch = next(iter(c.batches(timeout=1.0)))
        assert time.monotonic() - sent < longest + 0.2
        assert batch.column("value").to_pylist() == [b"first"]
    finally:
        c.close()


def test_send_many_queues_like_send_one_at_a_time(root):
    """send_many's list-at-a-time paths (round-robin slices, one shard for all, any iterable,
    values that need converting) queue exactly what one send() per message queues: the same
    shards, order and byte accounting (the writer cuts blocks by it)."""
    values = [b"r%d" % i for i in range(101)]
    with Producer(root, "rr_many", shards=4) as many, Producer(root, "rr_one", shards=4) as one:
        many.send(b"first")  # the round-robin does not start at shard 0 for the batch
        one.send(b"first")
        many.send_many(values)
        many.send_many(iter([b"g1", "g2", None, bytearray(b"g4")]))  # an iterator, and conversions
        many.send_many([b"p1", b"p2"], keys=[b"kk", None], shard=3)
        for v in values + [b"g1", b"g2", None, b"g4"]:
            one.send(v)
        one.send(b"p1", key=b"kk", shard=3)
        one.send(b"p2", shard=3)
        many.flush()
        one.flush()

    def rows(stream):
        with Consumer(root, stream) as c:
            return [(r["shard"], r["key"], r["value"]) for b in c.batches(timeout=0.5) for r in b.to_pylist()]

    assert sorted(rows("rr_many"), key=repr) == sorted(rows("rr_one"), key=repr)
    got = rows("rr_many")
    for shard in range(4):
        assert [r for r in got if r[0] == shard] == [r for r in rows("rr_one") if r[0] == shard]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=60), most=st.integers(16, 3000),
       data=st.data())
def test_block_cut_without_keys_matches_the_per_message_rule(sizes, most, data):
    """The writer's block cut for messages with values alone (running sizes and a binary
    search) takes exactly the messages the per-message rule takes: at least one, then while
    the block stays within max_block_bytes."""
    import types

    limit = data.draw(st.integers(1, len(sizes)))
    sh = types.SimpleNamespace(values=[b"x" * n for n in sizes], keys=[None] * len(sizes),
                               headers=[None] * len(sizes), pending_bytes=sum(sizes) + 16 * len(sizes))
    producer = types.SimpleNamespace(options=types.SimpleNamespace(max_block_bytes=most))
    total, expected = 0, (limit, None)
    for i in range(limit):
        if i and total + sizes[i] + 16 > most:
            expected = (i, total)
            break
        total += sizes[i] + 16
    if expected[1] is None:
        expected = (limit, total)
    window = data.draw(st.sampled_from([1, 3, 8, 1024]))  # windows that double
    assert Producer._take_block(producer, sh, limit, window) == expected


class _ShortOnce:
    """A read path that returns a short read the first time a large range is asked (as the
    cached read path does while Algorithm 1 postpones a durable read)."""

    def __init__(self, inner):
        self.inner = inner
        self.store = inner.store
        self.shorted = 0

    def lengths(self, rels):
        return self.inner.lengths(rels)

    def durable_length(self, rel):
        return self.inner.durable_length(rel)

    def read(self, rel, start, end, **kw):
        data = self.inner.read(rel, start, end, **kw)
        if end - start > 100_000 and not self.shorted:
            self.shorted += 1
            return data[: len(data) // 2]
        return data

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


def test_short_read_of_a_block_larger_than_max_read_is_retried_not_corrupt(root):
    from pyspark_acs.read.readpath import DurableReadPath
    from pyspark_acs.storage.store import open_store

    big = os.urandom(300_000)
    with Producer(root, "big", shards=1) as p:
        p.send(big)
    path = _ShortOnce(DurableReadPath(open_store(root)))
    c = Consumer(root, "big", max_read_bytes=64 * 1024, read_path=path)
    values = [v for b in c.batches(timeout=0.5) for v in b.column("value").to_pylist()]
    c.close()
    assert values == [big] and path.shorted == 1


def test_a_hot_shard_does_not_starve_the_others(root):
    # A 1 MiB backlog bound keeps the hot shard busy without leaving tens of MB of 1 KiB blocks
    # for close() to write (that took ~30 s and tested nothing more).
    with Producer(root, "hot", shards=2, max_block_bytes=1024, max_pending_bytes=1024 * 1024) as p:
        stop = threading.Event()

        def hammer():
            while not stop.is_set():
                p.send_many([b"h" * 200] * 50, shard=0)

        t = threading.Thread(target=hammer)
        t.start()
        try:
            time.sleep(0.2)
            p.send(b"cold", shard=1)
            c = Consumer(root, "hot", shards=[1])
            got = []
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                got = [v for b in c.poll() for v in b.column("value").to_pylist()]
                time.sleep(0.01)
            c.close()
            assert got == [b"cold"]  # written while shard 0 never stopped being busy
        finally:
            stop.set()
            t.join()


def test_waits_at_the_start_of_two_files_are_not_added_up(root, caplog):
    """A tailer waits at byte 0 of each new file while its first block is still arriving (a
    copy at a destination). The 'no complete block' warning timed the wait by position alone,
    so the wait at byte 0 of file X and, much later, the one at byte 0 of file Y added up to a
    false warning about Y (seen in the soak run). It is timed per file and position now."""
    from pyspark_acs.format.block import encode_seal

    store = DurableStore(root)
    store.create_stream("slow", 1)
    block = encode_block([b"first"] * 3, first_index=0)
    names = [file_name(dt.datetime(2026, 1, 1, 0, 0, i, tzinfo=dt.timezone.utc), "w") for i in range(2)]
    rels = [f"{shard_dir('slow', 0)}/{n}" for n in names]
    with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.consumer"):
        with Consumer(root, "slow", timing=TailTiming(stuck_warn_after_s=0.5)) as c:
            x = store.open_appender(rels[0])
            x.write(block[:10])  # X's first block is arriving
            assert rows_of(c.poll()) == []
            time.sleep(0.7)  # longer than the warning's wait, at X:0 ... then X completes
            x.write(block[10:] + encode_seal(3))
            x.close()
            y = store.open_appender(rels[1])
            y.write(encode_block([b"second"], first_index=3)[:10])  # ... and Y's first block arrives
            got = consume(c, 3)
            assert_quiet(c, 0.2)
            y.close()
    assert len(got) == 3
    assert not [r for r in caplog.records if "no complete block" in r.getMessage()], caplog.text


def test_bytes_appended_after_a_seal_are_never_read(root):
    """A tailer that read a file's seal and waits for the next file read a block appended after
    the seal (a deposed writer's late bytes, never acknowledged). It stops at the seal now."""
    from pyspark_acs.format.block import encode_seal

    store = DurableStore(root)
    store.create_stream("late", 1)
    name = file_name(dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), "w")
    rel = f"{shard_dir('late', 0)}/{name}"
    app = store.open_appender(rel)
    app.write(encode_block([b"a0"], first_index=0) + encode_seal(1))
    sealed_at = app.position
    with Consumer(root, "late") as c:
        assert [r["value"] for r in consume(c, 1)] == [b"a0"]
        app.write(encode_block([b"late"], first_index=1))  # after the seal
        app.close()
        assert_quiet(c, 0.5)
        assert c.offsets()["late"]["0"] == {"file": name, "length": sealed_at}


def test_a_header_key_that_is_not_utf8_is_refused_by_send_and_loses_nothing(root):
    """Review finding: a surrogate in a header key passed send() and then killed the writer
    thread, losing the messages already accepted."""
    with Producer(root, "hk", shards=1) as p:
        p.send(b"before")
        with pytest.raises(TypeError, match="headers must be"):
            p.send(b"bad", headers=[("\ud800", b"v")])
        p.send(b"after")
    c = Consumer(root, "hk")
    assert [r["value"] for b in c.batches(timeout=0.3) for r in b.to_pylist()] == [b"before", b"after"]
    c.close()


def test_produce_and_consume_do_not_import_pandas(tmp_path):
    """pyarrow's object conversion imports pandas on first use (0.5-3 s of CPU per process);
    the producer and consumer paths build their arrays from buffers instead (format/arrays.py),
    so N consumer processes do not all pay it at their first message."""
    import subprocess
    import sys

    code = f"""
import sys
from pyspark_acs import Consumer, Producer
with Producer({str(tmp_path)!r}, "s", data_cache="none", metadata_cache="none") as p:
    p.send(b"a"); p.send("b"); p.send(None); p.send_many([b"x", b"y"], keys=[b"k", None]); p.flush()
c = Consumer({str(tmp_path)!r}, "s", data_cache="none", metadata_cache="none", start="earliest")
n = 0
for batch in c.batches(timeout=5):
    n += batch.num_rows
    if n >= 5:
        break
c.close()
print(n, "pandas" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5", "False"]


def test_a_shard_waiting_for_a_file_is_listed_with_back_off_and_the_file_still_found(root, monkeypatch):
    """A consumer of a shard with no file yet (and one past a seal waiting for the next file)
    lists the shard folder at once, then less and less often (TailTiming.listing_backoff_s), not once per
    poll interval: 32 waiting consumers listed the store 3,200 times a second (on HDFS, NameNode
    calls). The file is still found, and a roll-over's next file too, in order."""
    first, most = TailTiming().listing_backoff_s
    store = DurableStore(root)
    store.create_stream("idle", 1)
    listings = []
    real = DurableStore.list_files
    monkeypatch.setattr(DurableStore, "list_files",
                        lambda self, *a, **k: (listings.append(time.monotonic()), real(self, *a, **k))[1])
    c = Consumer(root, "idle", poll_interval=0.001)
    waited = 1.5
    assert list(c.batches(timeout=waited)) == []
    # At the 1 ms poll interval: ~1,500 listings. Backed off: the doubling steps up to the
    # longest wait, then one per longest wait.
    steps = math.ceil(math.log2(most / first)) + 1
    assert len(listings) <= steps + waited / most + 2, len(listings)
    gaps = [b - a for a, b in zip(listings, listings[1:])]
    assert max(gaps) <= most + 0.5, gaps  # listed again and again (slack: a loaded machine)
    with Producer(root, "idle", shards=1, roll_bytes=2000) as p:
        for i in range(6):  # a few files: each roll-over's next file is found too
            p.send(b"m-%d" % i + b"." * 900)
            p.flush()
    got = consume(c, 6)
    assert [r["value"][:3] for r in got] == [b"m-%d" % i for i in range(6)]
    assert len({r["file"] for r in got}) >= 2
    c.close()
