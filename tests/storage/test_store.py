"""The durable store (real local files through pyarrow.fs) and store leases."""

from __future__ import annotations

import json
import os
import pickle
import time

import pytest

from pyspark_acs.errors import (
    AcsOptionError,
    InvalidNameError,
    LeasePoisonedError,
    StoreError,
    StoreFileNotFoundError,
    WriterConflictError,
)
from pyspark_acs.storage.leases import LeaseRecord, StoreLease
from pyspark_acs.storage.store import STREAM_LOCK_FILE, STREAM_META_FILE, DurableStore, open_store

from tests.helpers import LOCK_HOLDER, FakeClock

REL = "s/00000/20260102T030405000006Z-w.acs"


def test_append_read_length_list(root):
    store = DurableStore(root)
    a = store.open_appender(REL)
    assert a.position == 0
    assert a.write(b"hello ") == 6
    assert store.length(REL) == 6
    assert store.read(REL, 0, 6) == b"hello "
    # the store caches input files: bytes appended after the first read are still seen
    assert a.write(b"world") == 11
    assert store.read(REL, 6, 11) == b"world"
    assert store.read(REL, 3, 100) == b"lo world"  # short only at the end of the file
    assert store.read(REL, 5, 5) == b""
    a.close()
    a.close()  # idempotent
    # reopening appends after the existing bytes
    b = store.open_appender(REL)
    assert b.position == 11
    b.write(b"!")
    b.close()
    with open(os.path.join(root, REL), "rb") as f:
        assert f.read() == b"hello world!"
    assert store.lengths([REL, "s/00000/missing.acs"]) == {REL: 12, "s/00000/missing.acs": None}
    assert store.lengths([]) == {}
    assert store.list_dir("s/00000") == ["20260102T030405000006Z-w.acs"]
    assert store.list_dir("nope") == []
    assert store.exists(REL) and not store.exists("s/00000/x")
    store.close()


def test_missing_files_raise_store_file_not_found_naming_the_uri(root):
    store = DurableStore(root)
    with pytest.raises(StoreFileNotFoundError) as err:
        store.length("s/00000/missing.acs")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, StoreError)
    assert store.uri("s/00000/missing.acs") in str(err.value)
    with pytest.raises(StoreFileNotFoundError, match="missing.acs"):
        store.read("s/00000/missing.acs", 0, 10)
    assert store.read_small("nothing.json") is None
    store.delete("s/00000/missing.acs")  # missing is fine


def test_uri_paths_and_roots(root, tmp_path):
    store = DurableStore(root)
    assert store.uri(REL) == f"file://{os.path.abspath(root)}/{REL}"
    same = DurableStore("file://" + os.path.abspath(root))
    assert same.uri(REL) == store.uri(REL)
    assert open_store(store) is store
    assert pickle.loads(pickle.dumps(store)).uri(REL) == store.uri(REL)
    fresh = tmp_path / "new" / "root"
    DurableStore(str(fresh))
    assert fresh.is_dir()
    for bad in ("", "   ", None):
        with pytest.raises(AcsOptionError, match="root"):
            DurableStore(bad)
    with pytest.raises(AcsOptionError, match="cannot open durable store"):
        DurableStore("nosuchscheme://x/y")


def test_streams_and_shard_counts(root):
    store = DurableStore(root)
    assert store.list_streams() == []
    assert store.stream_shards("orders") is None
    assert store.create_stream("orders", 3) == 3
    assert store.create_stream("orders", 3) == 3
    assert sorted(os.listdir(os.path.join(root, "orders"))) == ["00000", "00001", "00002", STREAM_META_FILE,
                                                                 STREAM_LOCK_FILE]
    with pytest.raises(AcsOptionError, match="has 3 shards, not 2") as err:
        store.create_stream("orders", 2)
    assert err.value.option == "shards"
    assert store.list_streams() == ["orders"]
    os.makedirs(os.path.join(root, "not-a-stream"))
    assert store.list_streams() == ["orders"]
    with pytest.raises(InvalidNameError):
        store.stream_shards("../orders")
    with open(os.path.join(root, "orders", STREAM_META_FILE), "w") as f:
        f.write("{broken")
    with pytest.raises(StoreError, match="malformed stream metadata"):
        store.stream_shards("orders")


def test_a_copy_is_refused_to_producers_and_sinks_naming_where_to_write(root):
    """A stream the copy daemon keeps (created with ``copied_from``) is refused to a writer of
    messages: its take-over would seal the files being copied (recovery seals every empty
    file, and a copy starts its files empty), and its files would mix with the source's."""
    store = DurableStore(root)
    assert store.create_stream("copied", 2, copied_from="A") == 2
    assert store.create_stream("copied", 2, copied_from="A") == 2  # the copy daemon again
    with pytest.raises(AcsOptionError, match="copy kept by the copy daemon \\(copied from cluster 'A'\\)") as err:
        store.create_stream("copied", 2)
    assert err.value.option == "stream"
    from pyspark_acs import Producer

    with pytest.raises(AcsOptionError, match="source cluster"):
        Producer(root, "copied", 2)
    with pytest.raises(AcsOptionError, match="copied from cluster 'A'"):
        store.writer_shards("copied")  # the sink's check of an existing stream
    assert store.create_stream("own", 1) == 1 and store.writer_shards("own") == 1  # this cluster's own
    # A stream a writer created here and wrote nothing to is marked at the copy daemon's next
    # check, and a rebuilt tree's new parent replaces the old one.
    assert store.create_stream("own", 1, copied_from="A") == 1
    with pytest.raises(AcsOptionError, match="copied from cluster 'A'"):
        store.create_stream("own", 1)
    store.create_stream("own", 1, copied_from="B")
    assert store.stream_meta("own")["copied_from"] == "B"
    # A stream with this cluster's own files is never made a copy: two histories would mix
    # (a Producer that wrote before the copy daemon created the stream, or a promoted source
    # under a stale daemon).
    with Producer(root, "mine", 1) as p:
        p.send(b"written here")
    with pytest.raises(AcsOptionError, match="holds files written in this cluster.*from cluster 'A' is refused") as err:
        store.create_stream("mine", 1, copied_from="A")
    assert err.value.option == "stream" and "copied_from" not in store.stream_meta("mine")


def _race(root: str, jobs, rounds: int):
    """Run ``jobs`` (functions of (store, round)) in forked processes that start each round at
    one barrier; returns per round what each returned ("ok", value) or raised ("err", message)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results = []
    for r in range(rounds):
        barrier, queue = ctx.Barrier(len(jobs)), ctx.Queue()

        def run(i, job, r=r):
            store = DurableStore(root)
            barrier.wait()
            try:
                queue.put((i, "ok", job(store, r)))
            except AcsOptionError as exc:
                queue.put((i, "err", f"{exc.option}: {exc}"))

        procs = [ctx.Process(target=run, args=(i, job)) for i, job in enumerate(jobs)]
        for p in procs:
            p.start()
        got = dict((i, (kind, value)) for i, kind, value in (queue.get(timeout=30) for _ in procs))
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
        results.append(got)
    return results


def test_creators_racing_for_a_stream_are_never_told_a_count_it_does_not_have(root):
    """Producers of different shard counts that start at once: before the stream's metadata was
    changed under a lock, two of them could both "create" it and each be told its own count,
    so one wrote shards no reader reads (reproduced in 15 of 30 rounds of four creators). Now
    the one whose count stands is told it and every other is refused, naming ``shards``."""
    rounds = 12
    results = _race(root, [lambda store, r, k=k: store.create_stream(f"race{r}", k) for k in (1, 2, 3, 4)],
                    rounds)
    for r, got in enumerate(results):
        shards = DurableStore(root).stream_shards(f"race{r}")
        ok = [value for kind, value in got.values() if kind == "ok"]
        assert ok == [shards], (r, got)
        assert all(kind == "ok" or value.startswith("shards: ") for kind, value in got.values()), got
        assert sorted(os.listdir(os.path.join(root, f"race{r}"))) == [
            f"{s:05d}" for s in range(shards)] + [STREAM_META_FILE, STREAM_LOCK_FILE]


def test_a_change_of_stream_metadata_fails_naming_the_lock_rather_than_go_on_unlocked(root, monkeypatch):
    """A creator that keeps the lock past STREAM_LOCK_WAIT_S (a stopped process; one making
    50,000 shard folders took 4 s) makes the next change fail: going on unlocked, as appends do
    after their wait, let a 1-shard and a 50,000-shard creator both be told their own count."""
    import fcntl

    store = DurableStore(root, stream_lock_wait_s=0.3)
    os.makedirs(os.path.join(root, "held"))
    fd = os.open(os.path.join(root, "held", STREAM_LOCK_FILE), os.O_RDONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: flock conflicts within a process too
    try:
        with pytest.raises(StoreError, match=r"held/_stream.lock: held by another process for more than"):
            store.create_stream("held", 2)
        assert store.stream_meta("held") is None
    finally:
        os.close(fd)
    assert store.create_stream("held", 2) == 2
    # A change that writes nothing to a stream that does not exist says so, naming the file.
    with pytest.raises(StoreError, match=r"ghost/_stream.json: no stream 'ghost' to change"):
        store.update_stream_meta("ghost", lambda meta: None)


def test_a_child_forked_while_a_stream_change_holds_the_lock_does_not_keep_it(root, monkeypatch):
    """A flock belongs to the open file, which a forked child shares: the child's copy kept
    the lock a parent's thread held at the fork until the child exited (the review: every
    change of the stream failed meanwhile). The child now closes its copies at once."""
    import multiprocessing
    import threading

    store = DurableStore(root, stream_lock_wait_s=2.0)
    store.create_stream("fk", 1)
    inside, release = threading.Event(), threading.Event()

    def change(meta):
        inside.set()
        release.wait(10)
        return None

    holder = threading.Thread(target=store.update_stream_meta, args=("fk", change))
    holder.start()
    assert inside.wait(10)
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    child = ctx.Process(target=stop.wait, args=(30,))
    child.start()  # forked while the holder is inside its change
    release.set()
    holder.join(10)
    try:
        assert child.is_alive()
        started = time.monotonic()
        assert store.create_stream("fk", 1, copied_from="A") == 1  # a write: it takes the lock
        assert time.monotonic() - started < 1.0
    finally:
        stop.set()
        child.join(10)


def test_tier_settings_and_a_copy_mark_written_at_once_both_stand(root, tmp_path):
    """``acs tier`` and the copy daemon marking a stream a copy change the one metadata file:
    each reads, changes a field and writes it back, so unlocked, the later write dropped the
    other's field."""
    from pyspark_acs.storage.tier_settings import configure_tier, stream_tier_settings

    rounds = 8
    for r in range(rounds):
        DurableStore(root).create_stream(f"both{r}", 1)
    tier = str(tmp_path / "tier")
    _race(root, [lambda store, r: configure_tier(store, f"both{r}", tier, hot_retention_s=5).uri,
                 lambda store, r: store.create_stream(f"both{r}", 1, copied_from="A")], rounds)
    store = DurableStore(root)
    for r in range(rounds):
        assert store.stream_meta(f"both{r}")["copied_from"] == "A"
        assert stream_tier_settings(store, f"both{r}").hot_retention_s == 5


def test_list_files_sorted_and_only_message_files(root):
    store = DurableStore(root)
    store.create_stream("s", 1)
    for name in ("20260102T030405000007Z-b.acs", "20260102T030405000006Z-a.acs", "_writer.lease", "x.tmp"):
        store.open_appender(f"s/00000/{name}").close()
    assert store.list_files("s", 0) == ["20260102T030405000006Z-a.acs", "20260102T030405000007Z-b.acs"]


def test_write_small_replaces_atomically_and_delete_drops_cached_handles(root):
    store = DurableStore(root)
    store.write_small("a/meta.json", b"one")
    store.write_small("a/meta.json", b"two")
    assert store.read_small("a/meta.json") == b"two"
    assert os.listdir(os.path.join(root, "a")) == ["meta.json"]  # no temporary left behind
    a = store.open_appender(REL)
    a.write(b"abc")
    a.close()
    assert store.read(REL, 0, 3) == b"abc"
    store.delete(REL)
    assert not store.exists(REL)
    with pytest.raises(StoreFileNotFoundError):
        store.read(REL, 0, 3)


def test_read_reopens_stale_handles(root):
    store = DurableStore(root)
    a = store.open_appender(REL)
    a.write(b"x" * 10)
    assert store.read(REL, 0, 10) == b"x" * 10
    for i in range(20):
        a.write(b"%03d" % i)
        assert store.read(REL, 10 + 3 * i, 13 + 3 * i) == b"%03d" % i
    a.close()


def test_store_errors_name_the_path(root):
    store = DurableStore(root)
    os.makedirs(os.path.join(root, "s", "00000", "dir.acs"))
    with pytest.raises(StoreError) as err:
        store.open_appender("s/00000/dir.acs").write(b"x")
    assert "dir.acs" in str(err.value)


# -- leases ------------------------------------------------------------------------------------


def _lease(store, writer, seconds=10.0, clock=time.time):
    return StoreLease(store, "s/00000/_writer.lease", writer, "shard 0 of stream 's'", seconds, clock=clock)


def test_lease_conflict_release_and_expiry(root):
    store = DurableStore(root)
    first = _lease(store, "w1", seconds=30)
    first.acquire()
    record = json.loads(store.read_small("s/00000/_writer.lease"))
    assert record["writer"] == "w1" and record["pid"] == os.getpid() and not record["poisoned"]
    with pytest.raises(WriterConflictError) as err:
        _lease(store, "w2").acquire()
    msg = str(err.value)
    assert "shard 0 of stream 's'" in msg and "writer w1" in msg and f"pid {os.getpid()}" in msg
    assert "lease expires in" in msg
    # a held lease renews and stays ours
    assert not first.due()
    first.renew()
    first.release()
    assert store.read_small("s/00000/_writer.lease") is None
    clock = FakeClock(time.time())  # the leases' wall clock, moved past an expiry
    second = _lease(store, "w2", seconds=0.3, clock=clock)
    second.acquire()
    # second "dies" (never renews): until its expiry nobody else takes it, then a third writer does
    clock.advance(0.2)
    with pytest.raises(WriterConflictError, match="lease expires in 0.1 s"):
        _lease(store, "w3", clock=clock).acquire()
    clock.advance(0.2)
    _lease(store, "w3", clock=clock).acquire()
    with pytest.raises(LeasePoisonedError, match="taken over"):
        second.renew()
    second.release()  # not ours any more: must not delete w3's lease
    assert json.loads(store.read_small("s/00000/_writer.lease"))["writer"] == "w3"


def test_lease_due_and_poisoned_flag(root):
    store = DurableStore(root)
    lease = _lease(store, "w1", seconds=30)
    lease.acquire()
    assert not lease.due()
    lease._renewed -= 10.5  # as if a third of the lease had passed
    assert lease.due()
    lease.renew()
    assert not lease.due()
    rec = LeaseRecord.decode(store.read_small("s/00000/_writer.lease"))
    rec["poisoned"] = True
    store.write_small("s/00000/_writer.lease", rec.encode())
    with pytest.raises(LeasePoisonedError):
        lease.renew()


def test_a_stopped_process_holding_the_lease_lock_delays_a_take_over_only_for_the_lock_wait(
        root, python_exe, subprocess_env):
    """A writer stopped (SIGSTOP, a frozen VM) inside its lease read-decide-write keeps the
    flock; the next writer must not wait forever: after LOCK_WAIT_SECONDS it goes on unlocked
    (as on HDFS) and takes the expired lease."""
    import signal
    import subprocess

    from pyspark_acs.storage.leases import LOCK_WAIT_SECONDS

    store = DurableStore(root)
    clock = FakeClock(time.time())  # the leases' wall clock, moved past w1's expiry
    _lease(store, "w1", seconds=0.2, clock=clock).acquire()  # w1 then stops renewing: its lease expires
    lock = store.path("s/00000/_writer.lease.lock")
    holder = subprocess.Popen([python_exe, "-c", LOCK_HOLDER, lock], stdout=subprocess.PIPE, env=subprocess_env,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        holder.send_signal(signal.SIGSTOP)
        clock.advance(0.3)
        began = time.monotonic()
        _lease(store, "w2", clock=clock).acquire()
        waited = time.monotonic() - began
        assert LOCK_WAIT_SECONDS * 0.9 <= waited < LOCK_WAIT_SECONDS + 10, waited
        assert json.loads(store.read_small("s/00000/_writer.lease"))["writer"] == "w2"
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait(10)


def test_renew_holding_the_cache_lease_takes_an_overwritten_store_lease_back(root):
    """A deposed writer stopped inside its renewal writes its record over ours when it
    resumes; the holder of the authoritative cache lease renews with ``force`` and keeps the
    shard, while a plain renew (no cache lease) stops, as before."""
    store = DurableStore(root)
    ours = _lease(store, "new", seconds=30)
    ours.acquire()
    stale = LeaseRecord.new("deposed", 30)
    store.write_small("s/00000/_writer.lease", stale.encode())
    with pytest.raises(LeasePoisonedError, match="deposed"):
        ours.renew()
    store.write_small("s/00000/_writer.lease", stale.encode())
    ours.renew(force=True)
    assert json.loads(store.read_small("s/00000/_writer.lease"))["writer"] == "new"
    ours.renew()  # ours again
    rec = LeaseRecord.decode(store.read_small("s/00000/_writer.lease"))
    rec["poisoned"] = True  # poisoned by a take-over: force does not keep a poisoned lease
    store.write_small("s/00000/_writer.lease", rec.encode())
    with pytest.raises(LeasePoisonedError):
        ours.renew(force=True)


def test_torn_lease_file_counts_as_free(root):
    store = DurableStore(root)
    store.write_small("s/00000/_writer.lease", b"{torn")
    _lease(store, "w1").acquire()
    assert LeaseRecord.decode(b"") is None and LeaseRecord.decode(b"[x") is None


_STOPPED_IN_RENEW = r"""
import sys
from pyspark_acs.errors import LeasePoisonedError
from pyspark_acs.storage.leases import StoreLease
from pyspark_acs.storage.store import DurableStore
store = DurableStore(sys.argv[1], lock_wait_s=float(sys.argv[4]))
lease = StoreLease(store, sys.argv[2], "mover-1", "tier mover of stream 's'", seconds=float(sys.argv[3]))
lease.acquire()
real_read_small = store.read_small
stalled = []


def stalling_read_small(rel):
    # Inside renew's read-decide-write, right after it read our record: the lock held.
    data = real_read_small(rel)
    if not stalled:
        stalled.append(True)
        print("STALLED", flush=True)
        sys.stdin.readline()
    return data


store.read_small = stalling_read_small
try:
    lease.renew()
    print("RENEWED", flush=True)
except LeasePoisonedError as exc:
    print("POISONED " + " ".join(str(exc).split()), flush=True)
"""


def test_a_holder_stopped_inside_its_renewal_does_not_take_back_a_lease_taken_past_its_lock(
        root, python_exe, subprocess_env):
    """Review of 01be342: a lease holder stopped (SIGSTOP) inside its renewal, after reading
    its own record and before writing the renewed one, keeps the lock; its lease expires; a
    second holder waits LOCK_WAIT_SECONDS (the stores' lock wait: shortened here, the same in
    both processes), goes on unlocked and takes the expired lease. On
    SIGCONT the first must not write its renewal over the second's record: the tier mover
    (its store lease is its only guard, no seal fences it) would then run two passes of one
    stream at once, each rewriting the shard's _tiered.json from what it read."""
    import signal
    import subprocess

    from pyspark_acs.server.tier.mover import TIER_LEASE_FILE

    lock_wait = 0.5  # every process of a store uses the same: the stopped one reads again after it
    store = DurableStore(root, lock_wait_s=lock_wait)
    rel = f"s/{TIER_LEASE_FILE}"
    seconds = 0.3  # the stopped holder's lease, waited out in real time (it is in another process)
    child = subprocess.Popen([python_exe, "-c", _STOPPED_IN_RENEW, root, rel, str(seconds), str(lock_wait)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=subprocess_env, text=True)
    try:
        assert child.stdout.readline().strip() == "STALLED"
        child.send_signal(signal.SIGSTOP)
        expires = json.loads(store.read_small(rel))["expires"]
        while time.time() <= expires:  # the stopped holder's lease runs out
            time.sleep(0.05)
        second = StoreLease(store, rel, "mover-2", "tier mover of stream 's'", seconds=30.0)
        second.acquire()  # past the stopped holder's lock (the lock wait), the lease expired
        child.send_signal(signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        verdict = child.stdout.readline().strip()
        assert child.wait(20) == 0
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait(20)
    assert verdict.startswith("POISONED"), verdict
    assert json.loads(store.read_small(rel))["writer"] == "mover-2"
    second.renew()  # still the second's
