"""The one write path: the seal fence against a deposed producer, a retried sink batch that
lands where live readers are, torn-tail recovery, and the suspected races (concurrent copy
appends, lease versions, store lease acquisition, batch-write reruns).

Every test runs real parts: real files, real producer threads and child processes, real cache
servers where a cache is involved, and consumers that follow the stream from the start while
the fault happens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

import pyspark_acs.write.producer as producer_mod
from pyspark_acs.datasource.options import parse_sink_options
from pyspark_acs.datasource.commit import COMMIT_APPEND_BYTES, SinkCommitter
from pyspark_acs.datasource.sink import AcsBatchWriter, AcsStreamWriter
from pyspark_acs.errors import AcsError, WriterConflictError
from pyspark_acs.format.block import encode_block, encode_seal, parse_header, scan_blocks, seal_void_from
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.storage.leases import StoreLease
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.file import DurableFile, scan_file
from pyspark_acs.write.producer import Producer
from pyspark_acs.write.shard import ShardWriter

from tests.helpers import LOCK_HOLDER, FakeClock, stop_process

WAIT_S = 20.0
#: The lock wait of the stores whose take-over passes a stopped writer's lock (DurableStore's
#: lock_wait_s): shorter than LOCK_WAIT_SECONDS, so those tests do not wait out 2 s each; the
#: stopped holder keeps its lock however long the wait is.
LOCK_WAIT_S = 0.5


class Follower:
    """A Consumer following a stream from the start in a background thread (live reader)."""

    def __init__(self, root: str, stream: str, **options) -> None:
        self.consumer = Consumer(root, stream, **options)
        self.rows: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                got = [r for b in self.consumer.poll() for r in b.to_pylist()]
                with self._lock:
                    self.rows.extend(got)
                if not got:
                    time.sleep(0.005)
        except BaseException as exc:  # reported by values()
            self.error = exc

    def values(self) -> list:
        assert self.error is None, f"the live consumer failed: {self.error!r}"
        with self._lock:
            return [r["value"] for r in self.rows]

    def wait_for(self, value: bytes, timeout: float = WAIT_S) -> list:
        deadline = time.monotonic() + timeout
        while value not in self.values():
            assert time.monotonic() < deadline, f"{value!r} never arrived; got {self.values()[-5:]}"
            time.sleep(0.01)
        return self.values()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        self.consumer.close()


def fresh_values(root: str, stream: str, **options) -> list:
    with Consumer(root, stream, **options) as c:
        return [r["value"] for b in c.batches(timeout=0.5) for r in b.to_pylist()]


# -- bug 2: a deposed producer is fenced ---------------------------------------------------------


def test_deposed_producer_stalled_after_its_lease_check_is_fenced(root, monkeypatch):
    """A producer stalls between its lease check and its append (GC pause, slow I/O); another
    producer takes the shard over. The stalled one's flush must fail naming the file and the
    messages, and no reader may ever see those messages."""
    clock = FakeClock(time.time())  # the store leases' wall clock, moved past a lease's expiry
    first = Producer(root, "fence", lease_seconds=0.6, lease_clock=clock)
    follower = Follower(root, "fence")
    try:
        for i in range(10):
            first.send(b"first-%d" % i)
        first.flush(timeout=WAIT_S)
        follower.wait_for(b"first-9")

        stalled, resume = threading.Event(), threading.Event()
        real_encode = producer_mod.encode_block

        def stalling_encode(values, *args, **kwargs):
            # Runs in the first producer's writer thread after its lease check, before the append.
            if values and values[0].startswith(b"deposed"):
                stalled.set()
                resume.wait(WAIT_S)
            return real_encode(values, *args, **kwargs)

        monkeypatch.setattr(producer_mod, "encode_block", stalling_encode)
        for i in range(5):
            first.send(b"deposed-%d" % i)
        assert stalled.wait(WAIT_S)
        clock.advance(1.0)  # the stalled writer does not renew: its lease expires and we take over
        second = Producer(root, "fence", lease_seconds=0.6, lease_clock=clock)
        with second:
            for i in range(10):
                second.send(b"second-%d" % i)
            second.flush(timeout=WAIT_S)
            resume.set()  # the deposed producer wakes up and appends
            with pytest.raises(WriterConflictError) as err:
                first.flush(timeout=WAIT_S)
            msg = str(err.value)
            old_file = [f for f in DurableStore(root).list_files("fence", 0) if first.writer_id in f][0]
            assert old_file in msg and "messages 10..14" in msg and "not acknowledged" in msg, msg
            with pytest.raises(WriterConflictError):
                first.close(timeout=WAIT_S)
            for i in range(10, 20):
                second.send(b"second-%d" % i)
        live = follower.wait_for(b"second-19")
        time.sleep(0.2)
        live = follower.values()
    finally:
        resume.set()
        follower.close()
    expected = [b"first-%d" % i for i in range(10)] + [b"second-%d" % i for i in range(20)]
    assert live == expected
    assert fresh_values(root, "fence") == expected


@pytest.mark.parametrize("stall", ["before_naming", "after_naming"])
def test_deposed_producer_stalled_before_it_creates_its_next_file_is_fenced(root, monkeypatch, stall):
    """The stall falls between the lease check and the creation of the next file (a roll):
    the deposed producer's new file may sort before or after the new writer's file. Either
    way its flush fails, its file is sealed empty (no reader waits at it) and no reader sees
    its messages."""
    clock = FakeClock(time.time())  # the store leases' wall clock, moved past a lease's expiry
    first = Producer(root, "rollfence", lease_seconds=0.6, roll_bytes=1,  # every block ends its file
                     lease_clock=clock)
    follower = Follower(root, "rollfence")
    try:
        for i in range(3):
            first.send(b"first-%d" % i)
            first.flush(timeout=WAIT_S)
        follower.wait_for(b"first-2")
        stalled, resume = threading.Event(), threading.Event()
        real_name = ShardWriter.new_file_name

        def stalling_name(self):
            if self.writer_id != first.writer_id:
                return real_name(self)
            if stall == "before_naming":
                stalled.set()
                resume.wait(WAIT_S)
                return real_name(self)
            name = real_name(self)  # listed and named: the name sorts before the new writer's file
            stalled.set()
            resume.wait(WAIT_S)
            return name

        monkeypatch.setattr(ShardWriter, "new_file_name", stalling_name)
        first.send(b"deposed-0")
        assert stalled.wait(WAIT_S)
        clock.advance(1.0)  # the stalled writer's lease expires
        second = Producer(root, "rollfence", lease_seconds=0.6, lease_clock=clock)
        with second:
            for i in range(5):
                second.send(b"second-%d" % i)
            second.flush(timeout=WAIT_S)
            follower.wait_for(b"second-4")
            resume.set()
            with pytest.raises(WriterConflictError) as err:
                first.flush(timeout=WAIT_S)
            assert "was deposed" in str(err.value), str(err.value)
            with pytest.raises(WriterConflictError):
                first.close(timeout=WAIT_S)
            for i in range(5, 10):
                second.send(b"second-%d" % i)
        # The new writer sealed its file on close: every reader moves on past it.
        live = follower.wait_for(b"second-9")
        time.sleep(0.2)
        live = follower.values()
    finally:
        resume.set()
        follower.close()
    expected = [b"first-%d" % i for i in range(3)] + [b"second-%d" % i for i in range(10)]
    assert live == expected
    assert fresh_values(root, "rollfence") == expected
    store = DurableStore(root)
    for name in store.list_files("rollfence", 0):  # no file is left unsealed (none holds readers)
        assert scan_file(store, f"{shard_dir('rollfence', 0)}/{name}").sealed, name


def test_deposed_producer_found_out_at_its_lease_check_raises_writer_conflict_naming_the_messages(root):
    """However a deposed producer finds out (here: its lease check, before it wrote the
    pending messages), flush raises a WriterConflictError that says how many messages are
    not acknowledged and names the shard's last file."""
    from pyspark_acs.errors import LeasePoisonedError
    from pyspark_acs.storage.leases import LeaseRecord

    p = Producer(root, "checked", lease_seconds=30)
    p.send(b"kept")
    p.flush(timeout=WAIT_S)
    store = DurableStore(root)
    lease_rel = f"{shard_dir('checked', 0)}/_writer.lease"
    store.write_small(lease_rel, LeaseRecord.new("usurper", 30).encode())  # another writer took it
    p._shards[0].writer.leases[0]._renewed -= 100  # the next round checks the lease first
    p.send_many([b"lost-%d" % i for i in range(3)])
    with pytest.raises(WriterConflictError) as err:
        p.flush(timeout=WAIT_S)
    assert isinstance(err.value, LeasePoisonedError)  # what a lease check raises, as before
    msg = str(err.value)
    assert "3 message(s)" in msg and "not acknowledged" in msg and p.current_files()[0] in msg, msg
    with pytest.raises(WriterConflictError):
        p.close(timeout=WAIT_S)
    assert fresh_values(root, "checked") == [b"kept"]


#: The rest of a stalling child's script, once ``p`` (its Producer) exists: ten messages
#: acknowledged, then five that the test stalls (the deposed writer's), and the verdict.
_DEPOSED_RUN = r"""
for i in range(10):
    p.send(b"first-%d" % i)
p.flush(timeout=20)
print("FLUSHED " + p.current_files()[0], flush=True)
for i in range(5):
    p.send(b"deposed-%d" % i)
try:
    p.flush(timeout=30)
    print("ACKNOWLEDGED", flush=True)
except WriterConflictError as exc:
    print("CONFLICT " + " ".join(str(exc).split()), flush=True)
try:
    p.close(timeout=20)
except WriterConflictError:
    pass
"""


_STALLING_CHILD = r"""
import sys
import pyspark_acs.write.producer as producer_mod
from pyspark_acs.errors import WriterConflictError

root, data, meta = sys.argv[1:4]
real_encode = producer_mod.encode_block


def stalling_encode(values, *args, **kwargs):
    # The writer thread, after its lease check and before its append, tells the test, which
    # stops the whole process (a GC pause, a slow disk) with SIGSTOP, takes the shard over,
    # sends SIGCONT and then lets this thread go on. (A SIGSTOP the thread sends itself is
    # not enough: the kernel may let it run on for a moment before the group stop.)
    if values and values[0].startswith(b"deposed"):
        print("STALLED", flush=True)
        sys.stdin.readline()
    return real_encode(values, *args, **kwargs)


producer_mod.encode_block = stalling_encode
p = producer_mod.Producer(root, "stall", lease_seconds=0.6, data_cache=data, metadata_cache=meta)
""" + _DEPOSED_RUN


def _end(follower: "Follower", child: subprocess.Popen) -> None:
    """Close the live consumer and make sure the child process is gone (resumed, killed)."""
    if follower is not None:
        follower.close()
    if child.poll() is None:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait(WAIT_S)


def test_deposed_producer_process_stopped_after_its_lease_check_is_fenced_with_caches(
        tmp_path, root, python_exe, subprocess_env):
    """The same fault with real processes and the caches: a producer process is SIGSTOPped
    (its writer thread held between its lease check and its append) while another producer
    (poisoning its metadata lease) takes the shard over; SIGCONT. Its flush fails naming the file and messages, and
    neither a live consumer through the caches nor a fresh one (caches or store) ever sees
    its messages: they were never mirrored to the data cache."""
    from pyspark_acs.server.local.deploy import LocalDeployment

    with LocalDeployment(tmp_path / "dep", data_replicas=2, metadata_replicas=3, capacity="16MiB") as dep:
        caches = {"data_cache": dep.data_endpoints, "metadata_cache": dep.metadata_endpoints}
        child_log = tmp_path / "child.log"
        with open(child_log, "wb") as err_file:
            child = subprocess.Popen([python_exe, "-c", _STALLING_CHILD, root, dep.data_endpoints,
                                      dep.metadata_endpoints], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=err_file, env=subprocess_env, text=True)
        follower = None
        try:
            line = child.stdout.readline().strip()
            assert line.startswith("FLUSHED "), line
            old_file = line.split()[1]
            follower = Follower(root, "stall", **caches)
            follower.wait_for(b"first-9")
            assert child.stdout.readline().strip() == "STALLED"
            stop_process(child)
            deadline = time.monotonic() + WAIT_S
            while True:
                try:
                    second = Producer(root, "stall", lease_seconds=0.6, **caches)
                    break
                except WriterConflictError:
                    assert time.monotonic() < deadline, "the stalled producer's lease was never taken over"
                    time.sleep(0.05)
            with second:
                for i in range(10):
                    second.send(b"second-%d" % i)
                second.flush(timeout=WAIT_S)
                follower.wait_for(b"second-9")
                child.send_signal(signal.SIGCONT)  # the deposed producer wakes up and appends
                child.stdin.write("go\n")
                child.stdin.flush()
                verdict = child.stdout.readline().strip()
                for i in range(10, 20):
                    second.send(b"second-%d" % i)
            if not verdict.startswith("CONFLICT "):
                st = DurableStore(root)
                files = [(f, scan_file(st, f"{shard_dir('stall', 0)}/{f}")) for f in st.list_files("stall", 0)]
                raise AssertionError(f"{verdict!r}; files {files}; the child's log:\n{child_log.read_text()}")
            assert old_file in verdict and "messages 10..14" in verdict and "not acknowledged" in verdict, verdict
            assert child.wait(WAIT_S) == 0
            follower.wait_for(b"second-19")
            time.sleep(0.3)
            live = follower.values()
        finally:
            _end(follower, child)
        expected = [b"first-%d" % i for i in range(10)] + [b"second-%d" % i for i in range(20)]
        assert live == expected
        assert fresh_values(root, "stall", **caches) == expected
        assert fresh_values(root, "stall") == expected


_LOCK_STALLING_CHILD = r"""
import sys
import pyspark_acs.storage.store as store_mod
from pyspark_acs.errors import WriterConflictError
from pyspark_acs.write.producer import Producer

real_write = store_mod.Appender.write


def stalling_write(self, data):
    # Inside DurableFile.append, the file's append lock (flock) held: the test stops the
    # process here, so the successor finds the lock of the file it must seal taken.
    if b"deposed" in data:
        print("STALLED", flush=True)
        sys.stdin.readline()
    return real_write(self, data)


store_mod.Appender.write = stalling_write
p = Producer(sys.argv[1], "lockstall", lease_seconds=0.6)
""" + _DEPOSED_RUN


def test_takeover_of_a_producer_stopped_holding_its_append_lock(tmp_path, root, python_exe, subprocess_env):
    """A producer process stopped (SIGSTOP) in the middle of its append, holding the flock of
    its file, must not block the producer taking the shard over: the successor's recovery
    seal waits its store's lock wait (LOCK_WAIT_SECONDS by default, LOCK_WAIT_S here) for the
    lock, then lands unlocked. On SIGCONT the stopped append lands after the seal and is
    refused; readers never see it."""
    child_log = tmp_path / "child.log"
    with open(child_log, "wb") as err_file:
        child = subprocess.Popen([python_exe, "-c", _LOCK_STALLING_CHILD, root], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err_file, env=subprocess_env, text=True)
    follower = None
    try:
        line = child.stdout.readline().strip()
        assert line.startswith("FLUSHED "), (line, child_log.read_text())
        old_file = line.split()[1]
        follower = Follower(root, "lockstall")
        follower.wait_for(b"first-9")
        assert child.stdout.readline().strip() == "STALLED"
        stop_process(child)
        made: list = []

        def take_over() -> None:
            while True:
                try:
                    made.append(Producer(DurableStore(root, lock_wait_s=LOCK_WAIT_S), "lockstall",
                                         lease_seconds=0.6))
                    return
                except WriterConflictError:  # its lease has not expired yet
                    time.sleep(0.05)

        taker = threading.Thread(target=take_over, daemon=True)
        taker.start()
        taker.join(LOCK_WAIT_S + WAIT_S)
        assert made, "the take-over is blocked by the stopped producer's append lock"
        with made[0] as second:
            for i in range(10):
                second.send(b"second-%d" % i)
            second.flush(timeout=WAIT_S)
            follower.wait_for(b"second-9")
            child.send_signal(signal.SIGCONT)
            child.stdin.write("go\n")
            child.stdin.flush()
            verdict = child.stdout.readline().strip()
        assert verdict.startswith("CONFLICT "), (verdict, child_log.read_text())
        assert old_file in verdict and "messages 10..14" in verdict and "not acknowledged" in verdict, verdict
        assert child.wait(WAIT_S) == 0
        time.sleep(0.3)
        live = follower.values()
    finally:
        _end(follower, child)
    expected = [b"first-%d" % i for i in range(10)] + [b"second-%d" % i for i in range(10)]
    assert live == expected
    assert fresh_values(root, "lockstall") == expected


# -- bug 4: a retried sink batch lands where live readers are -------------------------------------

SCHEMA = StructType([StructField("shard", IntegerType()), StructField("value", BinaryType())])


def sink(root, name, **settings):
    opts = parse_sink_options({"root": root, "stream": "both", "shards": "1", "checkpointLocation": f"/ck/{name}"})
    return AcsStreamWriter(opts, SCHEMA, **settings)


def staged(w, values):
    return w.write(iter([pa.RecordBatch.from_arrays(
        [pa.array([0] * len(values), pa.int32()), pa.array(values, pa.binary())], names=["shard", "value"])]))


@pytest.mark.parametrize("crash", ["after_intent", "after_first_piece"])
def test_retried_sink_batch_after_another_writer_moved_on_is_seen_once_by_live_readers(root, monkeypatch, crash):
    a, b = sink(root, "a"), sink(root, "b")
    a.commit([staged(a, [b"a0-%d" % i for i in range(3)])], 0)
    follower = Follower(root, "both")
    try:
        follower.wait_for(b"a0-2")
        batch1 = [staged(a, [b"a1-%d" % i for i in range(3)]), staged(a, [b"a1-%d" % i for i in range(3, 6)])]
        crashing = a  # the attempt that dies (sink "a" again, its own settings)
        if crash == "after_intent":
            def die(self, store, shard, plan):
                raise AcsError("injected: the driver died right after writing its intent")

            monkeypatch.setattr(SinkCommitter, "_append_shard", die)
        else:
            real_append = ShardWriter.append
            calls = []

            def die_after_first(self, data, messages):
                calls.append(len(data))
                if len(calls) == 2:
                    raise AcsError("injected: the driver died after appending the first task's rows")
                return real_append(self, data, messages)

            monkeypatch.setattr(ShardWriter, "append", die_after_first)
            # One append per task's piece (the commit joins a shard's pieces into one append up
            # to commit_append_bytes): the failure must land between two tasks' rows.
            crashing = sink(root, "a", commit_append_bytes=1)
        with pytest.raises(AcsError, match="injected"):
            crashing.commit(batch1, 1)
        a.abort(batch1, 1)
        monkeypatch.undo()
        # The other sink moves on: it takes the shard, writes its batch and leaves.
        b.commit([staged(b, [b"b0-%d" % i for i in range(3)])], 0)
        follower.wait_for(b"b0-2")
        # The restarted query retries batch 1 (its own attempt's staging is not used).
        a.commit([staged(a, [b"ignored"])], 1)
        follower.wait_for(b"a1-5")
        b.commit([staged(b, [b"b1-0"])], 1)
        live = follower.wait_for(b"b1-0")
    finally:
        follower.close()
    a1 = [b"a1-%d" % i for i in range(6)]
    for got in (live, fresh_values(root, "both")):
        assert sorted(v for v in got if v.startswith(b"a1")) == a1, got  # the batch exactly once
        assert [v for v in got if v.startswith(b"a1")] == a1  # in order
        assert [v for v in got if v.startswith(b"a0")] == [b"a0-%d" % i for i in range(3)]
        assert [v for v in got if v.startswith(b"b")] == [b"b0-0", b"b0-1", b"b0-2", b"b1-0"]
    assert live == fresh_values(root, "both")  # one history


def test_sink_stalled_before_it_creates_its_planned_file_does_not_hide_the_batch(root, monkeypatch):
    """The sink's commit plans a new file (its name fixed in the intent), then stalls past its
    lease before creating it; a producer takes the shard over and writes a newer file. The
    planned file would sort before the producer's: live readers already past it would never
    see the batch. The commit must fail instead (the planned file sealed empty), and the
    retry must land the batch after the producer's file, exactly once."""
    import functools

    import pyspark_acs.datasource.commit as commit_mod

    clock = FakeClock(time.time())  # the store leases' wall clock, moved past a lease's expiry
    monkeypatch.setattr(commit_mod, "ShardWriter", functools.partial(ShardWriter, lease_seconds=0.6,
                                                                     lease_clock=clock))
    a = sink(root, "a")
    a.commit([staged(a, [b"a0-%d" % i for i in range(3)])], 0)
    # The sink's next batch starts a new file: the producer below seals the sink's file.
    with Producer(root, "both", lease_seconds=0.6, lease_clock=clock) as p:
        p.send(b"p-0")
    follower = Follower(root, "both")
    stalled, resume = threading.Event(), threading.Event()
    real_open = ShardWriter._open

    def stalling_open(self, name, length, index):
        if self.writer_id == a_writer and length == 0 and not stalled.is_set():
            stalled.set()
            resume.wait(WAIT_S)
        return real_open(self, name, length, index)

    a_writer = SinkCommitter(a.opts, a.sink_id).writer_id
    monkeypatch.setattr(ShardWriter, "_open", stalling_open)
    outcome = {}

    def commit():
        try:
            a.commit([staged(a, [b"a1-%d" % i for i in range(3)])], 1)
            outcome["done"] = True
        except AcsError as exc:
            outcome["error"] = exc

    try:
        follower.wait_for(b"p-0")
        committer = threading.Thread(target=commit)
        committer.start()
        assert stalled.wait(WAIT_S)
        clock.advance(1.0)  # the stalled commit's lease expires
        p = Producer(root, "both", lease_seconds=0.6, lease_clock=clock)
        with p:
            p.send(b"p-1")
            p.flush(timeout=WAIT_S)
            follower.wait_for(b"p-1")
            resume.set()
            committer.join(WAIT_S)
            assert isinstance(outcome.get("error"), WriterConflictError), outcome
            p.send(b"p-2")
        a.commit([staged(a, [b"ignored"])], 1)  # the retry
        live = follower.wait_for(b"a1-2")
        time.sleep(0.2)
        live = follower.values()
    finally:
        resume.set()
        follower.close()
    expected = [b"a0-0", b"a0-1", b"a0-2", b"p-0", b"p-1", b"p-2", b"a1-0", b"a1-1", b"a1-2"]
    assert live == expected
    assert fresh_values(root, "both") == expected


# -- torn tail: a producer killed mid-block --------------------------------------------------------

_CHILD = r"""
import sys, time
from pyspark_acs.write.producer import Producer
p = Producer(sys.argv[1], "torn", lease_seconds=0.6)
for i in range(20):
    p.send(b"child-%d" % i)
p.flush(timeout=20)
print(p.current_files()[0], flush=True)
time.sleep(60)
"""


def test_takeover_seals_a_torn_tail_and_readers_continue(root, python_exe, subprocess_env):
    child = subprocess.Popen([python_exe, "-c", _CHILD, root], stdout=subprocess.PIPE, env=subprocess_env, text=True)
    follower = None
    try:
        name = child.stdout.readline().strip()
        assert name.endswith(".acs"), name
        follower = Follower(root, "torn")
        follower.wait_for(b"child-19")
        child.send_signal(signal.SIGKILL)  # killed in the middle of its next block:
        child.wait(WAIT_S)
        path = os.path.join(root, shard_dir("torn", 0), name)
        complete = os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(encode_block([b"never-acked" * 50], None, [1], first_index=20)[:300])
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                successor = Producer(root, "torn", lease_seconds=0.6)
                break
            except WriterConflictError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with successor:
            for i in range(5):
                successor.send(b"successor-%d" % i)
        live = follower.wait_for(b"successor-4")
    finally:
        if follower is not None:
            follower.close()
        if child.poll() is None:
            child.kill()
            child.wait(WAIT_S)
    # The dead writer's file ends with a recovery seal that voids the torn block.
    data = open(path, "rb").read()
    assert len(data) == complete + 300 + 56
    seal = parse_header(data, complete + 300)
    assert seal.sealed and seal.first_index == 20
    assert seal_void_from(data, complete + 300, seal, complete + 300) == complete
    # The writers' walk finds that seal too (the read side's rule), so the next take-over does
    # not seal the file again (hostile review of a1a24e8, finding 5).
    tail = scan_file(DurableStore(root), f"{shard_dir('torn', 0)}/{name}")
    assert (tail.sealed_at, tail.end, tail.next_index) == (complete + 300, complete, 20)
    expected = [b"child-%d" % i for i in range(20)] + [b"successor-%d" % i for i in range(5)]
    assert live == expected
    assert fresh_values(root, "torn") == expected


# -- suspected: the durable copy writer's check-length-then-append -------------------------------


def test_two_concurrent_appenders_of_one_file_never_duplicate_bytes(root):
    """Two copy operations of one file (a stale one and its successor) append the same deltas
    at the positions they expect, restarting from the file's length when told (as the copy
    writer does). The file must come out byte-identical to the source: no delta twice."""
    deltas = [encode_block([b"%04d" % i * 50], None, [i], first_index=i) for i in range(300)]
    source = b"".join(deltas)
    starts = [sum(len(d) for d in deltas[:i]) for i in range(len(deltas))]
    store = DurableStore(root)
    rel = "copy/00000/20260101T000000000000Z-w.acs"
    barrier = threading.Barrier(2)
    conflicts = [0, 0]

    def operation(n: int) -> None:
        f = DurableFile(store, rel, position=0)
        barrier.wait()
        i = 0
        while i < len(deltas):
            f.position = starts[i]
            try:
                f.append(deltas[i])
                i += 1
            except WriterConflictError as exc:  # RESTART: continue from the file's length
                conflicts[n] += 1
                i = starts.index(exc.actual_length) if exc.actual_length in starts else len(deltas)
        f.close()

    threads = [threading.Thread(target=operation, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert open(store.path(rel), "rb").read() == source
    assert sum(conflicts) > 0  # they did race


def test_without_an_append_lock_the_check_after_the_append_is_the_fence(root):
    """On a filesystem without flock (HDFS, anything pyarrow.fs reaches but a local disk) a
    deposed writer's append is not prevented, only found out: its bytes land after the
    successor's recovery seal, the append raises naming the seal, and readers stop at the
    seal (they never see those bytes). A writer whose bytes landed before a foreign seal is
    acknowledged (they are readable), and only its next append fails."""
    store = DurableStore(root)
    store.create_stream("nolock", 1)
    store.local = False  # no append lock, no check before the append: only the check after it
    rel_dir = shard_dir("nolock", 0)
    deposed = ShardWriter(store, "nolock", 0, "deposed", lease_seconds=5)
    deposed.acquire()
    deposed.recover()
    sealed_at = deposed.append(encode_block([b"a0", b"a1"], None, [1, 2]), 2)
    old = deposed.file
    deposed.release()  # its lease lapses (it stalled); the writer object goes on
    successor = ShardWriter(store, "nolock", 0, "successor", lease_seconds=5)
    successor.acquire()
    successor.recover()  # the recovery seal of the deposed writer's file
    assert successor.recovered == [old]
    lost = encode_block([b"lost0", b"lost1"], None, [1, 2], first_index=2)
    with pytest.raises(WriterConflictError) as err:
        deposed.append(lost, 2)
    assert (err.value.start, err.value.seal_at) == (sealed_at, sealed_at)
    assert err.value.actual_length == sealed_at + len(encode_seal(2)) + len(lost)
    msg = str(err.value)
    assert old in msg and "messages 2..3" in msg and "sealed the file at byte" in msg, msg
    assert b"lost0" in open(store.path(f"{rel_dir}/{old}"), "rb").read()  # it did land: after the seal
    successor.append(encode_block([b"b0"], None, [1]), 1)
    successor.close()
    assert fresh_values(root, "nolock") == [b"a0", b"a1", b"b0"]

    # Ours first, then a foreign seal: acknowledged; the next append is refused.
    first = DurableFile(store, f"{rel_dir}/x.acs", position=0)
    block = encode_block([b"x"], None, [1])
    real_write = first._appender.write

    def write_then_sealed(data):
        real_write(data)
        with open(store.path(f"{rel_dir}/x.acs"), "ab") as f:  # the successor's seal right after
            f.write(encode_seal(1))

    first._appender.write = write_then_sealed
    assert first.append(block) == len(block)
    first._appender.write = real_write
    with pytest.raises(WriterConflictError) as err:
        first.append(encode_block([b"y"], None, [1], first_index=1))
    assert err.value.seal_at == len(block)
    first.close()


def test_a_seal_that_meets_the_successors_recovery_seal_keeps_the_bytes_acknowledged(root):
    """A writer's last append is verified, then the shard is taken over and the successor's
    recovery seal lands right after those bytes, then the writer seals (roll or close). The
    bytes lie before the seal and are acknowledged: sealing must not report them as a conflict
    (a caller would send them again); the writer's next file is refused instead."""
    store = DurableStore(root)
    store.create_stream("meet", 1)
    clock = FakeClock(time.time())  # the store leases' wall clock
    writer = ShardWriter(store, "meet", 0, "old", lease_seconds=0.5, roll_bytes=10**9, lease_clock=clock)
    writer.acquire()
    writer.recover()
    writer.append(encode_block([b"o0", b"o1"], None, [1, 2]), 2)
    clock.advance(0.6)  # it stalls: its lease lapses
    successor = ShardWriter(store, "meet", 0, "new", lease_seconds=5, lease_clock=clock)
    successor.acquire()
    successor.recover()
    assert successor.recovered == [writer.file]
    writer.seal()  # the file is sealed where our bytes end: fine
    with pytest.raises(WriterConflictError, match="was deposed"):
        writer.append(encode_block([b"o2"], None, [1]), 1)
    successor.append(encode_block([b"n0"], None, [1]), 1)
    successor.close()
    assert fresh_values(root, "meet") == [b"o0", b"o1", b"n0"]


# -- suspected: lease records and store leases ---------------------------------------------------


def test_store_lease_is_taken_by_exactly_one_of_many_racing_writers(root):
    store = DurableStore(root)
    for attempt in range(20):
        rel = f"s/{attempt:05d}/_writer.lease"
        barrier = threading.Barrier(6)
        winners = []

        def race(n: int) -> None:
            lease = StoreLease(store, rel, f"w{n}", "shard", 30)
            barrier.wait()
            try:
                lease.acquire()
                winners.append(n)
            except WriterConflictError:
                pass

        threads = [threading.Thread(target=race, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(winners) == 1, f"attempt {attempt}: {len(winners)} writers hold the lease"


def test_metadata_lease_records_carry_increasing_versions(tmp_path):
    from pyspark_acs.cache.client import CacheClient
    from pyspark_acs.cache.metadata import MetadataCache
    from pyspark_acs.server.local.deploy import LocalDeployment

    with LocalDeployment(tmp_path / "dep", data_replicas=1, metadata_replicas=3, capacity="16MiB") as dep:
        client = CacheClient(dep.metadata_endpoints, name="metadata cache", deadline=10.0)
        try:
            meta = MetadataCache(client)
            key = b"w:file:///x/00000"
            first = meta.lease("file:///x/00000", "w1", "shard 0", seconds=0.6)
            first.acquire()
            versions = [client.get([key], consistent=True)[0].version]
            first._checked -= 10
            first.check()
            versions.append(client.get([key], consistent=True)[0].version)
            second = meta.lease("file:///x/00000", "w2", "shard 0", seconds=0.6)
            second.acquire()  # poisons w1, then takes over
            versions.append(client.get([key], consistent=True)[0].version)
            assert versions[0] > 0 and versions == sorted(set(versions)), versions
            # A stale copy of the old record on one replica can no longer win a consistent read.
            entry = client.get([key], consistent=True)[0]
            assert b"w2" in entry.value
            second.release()
        finally:
            client.close()


def test_a_free_metadata_lease_is_taken_with_one_compare_and_set(tmp_path):
    """A free lease key (never taken, released, expired: what each batch of a sink meets) is
    taken with one compare-and-set and no read before it; a key another writer holds refuses
    it and is still poisoned and taken over."""
    from pyspark_acs.cache.client import CacheClient
    from pyspark_acs.errors import LeasePoisonedError
    from pyspark_acs.cache.metadata import MetadataCache
    from pyspark_acs.server.local.deploy import LocalDeployment

    with LocalDeployment(tmp_path / "dep", data_replicas=1, metadata_replicas=3, capacity="16MiB") as dep:
        client = CacheClient(dep.metadata_endpoints, name="metadata cache", deadline=10.0)
        calls = []
        real_get, real_cas = client.get, client.compare_and_set
        client.get = lambda *a, **k: (calls.append("get"), real_get(*a, **k))[1]
        client.compare_and_set = lambda *a, **k: (calls.append("cas"), real_cas(*a, **k))[1]
        try:
            meta = MetadataCache(client)
            uri = "file:///free/00000"
            for attempt in range(2):  # never taken, then released
                lease = meta.lease(uri, "w1", "shard 0", seconds=0.6)
                calls.clear()
                lease.acquire()
                assert calls == ["cas"], (attempt, calls)
                lease.release()
                # A released lease is an empty value that lives 1 ms (MetadataLease.release); its third replica's
                # release may still be on its way: a sink's next batch meets the key tens of ms
                # later; taken within the millisecond, the key is not free yet (rounds converge).
                time.sleep(0.05)
            first = meta.lease(uri, "w1", "shard 0", seconds=0.6)
            first.acquire()
            second = meta.lease(uri, "w2", "shard 0", seconds=0.6)
            second.acquire()  # refused as free, then poisons w1 and takes over once w1 may be gone
            assert b"w2" in real_get([first.key], consistent=True)[0].value
            with pytest.raises(LeasePoisonedError):
                first._checked -= 10
                first.check()
            second.release()
        finally:
            client.close()


# -- suspected: df.write reruns -------------------------------------------------------------------


def batch_writer(root, commit_append_bytes=COMMIT_APPEND_BYTES, **extra):
    opts = parse_sink_options({"root": root, "stream": "bw", "shards": "1", **extra})
    return AcsBatchWriter(opts, SCHEMA, overwrite=False, commit_append_bytes=commit_append_bytes)


def test_batch_write_with_sink_id_rerun_after_a_partial_commit_completes_once(root, monkeypatch):
    w = batch_writer(root, sinkId="nightly-2026-01-01", commit_append_bytes=1)  # an append per piece
    msgs = [staged(w, [b"r%d" % i for i in range(3)]), staged(w, [b"r%d" % i for i in range(3, 6)])]
    real_append = ShardWriter.append
    calls = []

    def die_after_first(self, data, messages):
        calls.append(1)
        if len(calls) == 2:
            raise AcsError("injected: the driver died part way")
        return real_append(self, data, messages)

    monkeypatch.setattr(ShardWriter, "append", die_after_first)
    with pytest.raises(AcsError, match="injected"):
        w.commit(msgs)
    w.abort(msgs)
    monkeypatch.undo()
    assert fresh_values(root, "bw") == [b"r0", b"r1", b"r2"]  # the partial commit is visible
    rerun = batch_writer(root, sinkId="nightly-2026-01-01")
    rerun.commit([staged(rerun, [b"r%d" % i for i in range(6)])])
    assert fresh_values(root, "bw") == [b"r%d" % i for i in range(6)]
    again = batch_writer(root, sinkId="nightly-2026-01-01")
    again.commit([staged(again, [b"r%d" % i for i in range(6)])])  # committed before: nothing
    assert fresh_values(root, "bw") == [b"r%d" % i for i in range(6)]


def test_batch_write_without_sink_id_appends_every_time(root):
    """Documented: without sinkId each df.write is a new write (a rerun appends again)."""
    for _ in range(2):
        w = batch_writer(root)
        w.commit([staged(w, [b"x", b"y"])])
    assert fresh_values(root, "bw") == [b"x", b"y", b"x", b"y"]


# -- the shard writer's recovery on its own ---------------------------------------------------------


def test_recovery_seals_only_an_unsealed_newest_file(root):
    store = DurableStore(root)
    store.create_stream("rec", 1)
    w = ShardWriter(store, "rec", 0, "one", lease_seconds=5)
    w.acquire()
    w.recover()
    w.append(encode_block([b"a", b"b"], None, [1, 2]), 2)
    name = w.file
    w.close(seal=False)  # as if it crashed: unsealed
    other = ShardWriter(store, "rec", 0, "two", lease_seconds=5)
    other.acquire()
    tail = other.recover()
    assert other.recovered == [name] and tail.next_index == 2
    again = scan_file(store, f"{shard_dir('rec', 0)}/{name}")
    assert again.sealed and again.next_index == 2
    assert [h.sealed for _, h in scan_blocks(open(store.path(f"{shard_dir('rec', 0)}/{name}"), "rb").read())] == [
        False, True]
    other.release()
    third = ShardWriter(store, "rec", 0, "three", lease_seconds=5)
    third.acquire()
    third.recover()
    assert third.recovered == []  # already sealed: nothing appended
    third.release()


# -- review3: an append that passes a stopped writer's lock must not duplicate identical bytes --------

_RESUMING_CHILD = r"""
import sys
import pyspark_acs.storage.store as store_mod
from pyspark_acs.cache.client import client_for
from pyspark_acs.cache.metadata import MetadataCache
from pyspark_acs.errors import WriterConflictError
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.shard import OpenFile, ShardWriter

root, meta_eps, stream, name, blocks = sys.argv[1:6]
with open(blocks, "rb") as f:
    first, second = f.read().split(b"|SPLIT|")
real_write = store_mod.Appender.write


def stalling_write(self, data):
    # Inside DurableFile.append, the append lock held and the file's length checked: the
    # test stops the process here.
    if data == second:
        print("STALLED", flush=True)
        sys.stdin.readline()
    return real_write(self, data)


store_mod.Appender.write = stalling_write
meta = MetadataCache(client_for(meta_eps, "metadata cache", []))
w = ShardWriter(DurableStore(root), stream, 0, "driver-1", meta=meta, lease_seconds=0.6)
w.acquire()
w.recover(resume=OpenFile(name, 0, 0))
w.append(first, 1)
print("FIRST", flush=True)
try:
    w.append(second, 1)
    print("ACKNOWLEDGED", flush=True)
except WriterConflictError as exc:
    print("CONFLICT " + " ".join(str(exc).split()), flush=True)
w.close(seal=False)
"""


def test_a_retry_that_passes_a_stopped_writers_append_lock_never_duplicates_its_identical_bytes(
        tmp_path, root, python_exe, subprocess_env):
    """Review of 01be342 (the append lock waits LOCK_WAIT_SECONDS -- the store's lock wait,
    LOCK_WAIT_S here -- then the block runs unlocked). A writer (here the sink's commit: a
    batch continued from its intent, with deterministic bytes; a copy operation appending the
    same source bytes is the same case) is stopped inside its append after the file-length
    check, the lock held. Its successor
    continues the same file with the same bytes (recover(resume=...)) once the lease is its
    own. No seal separates the two: if the successor appends unlocked, the stopped writer's
    append lands right after it on SIGCONT, its post-append check reads the successor's
    identical bytes at its position and acknowledges, and readers get the messages twice.
    Whatever either writer is told, readers must see every message exactly once."""
    from pyspark_acs.cache.client import client_for
    from pyspark_acs.cache.metadata import MetadataCache
    from pyspark_acs.server.local.deploy import LocalDeployment
    from pyspark_acs.write.shard import OpenFile

    from pyspark_acs.format.names import next_file_name

    stream, name = "resumed", next_file_name([], "sink")
    store = DurableStore(root, lock_wait_s=LOCK_WAIT_S)
    store.create_stream(stream, 1)
    first = encode_block([b"m-0"], first_index=0, timestamps=[1])
    second = encode_block([b"m-1"], first_index=1, timestamps=[2])
    blocks = tmp_path / "blocks.bin"
    blocks.write_bytes(first + b"|SPLIT|" + second)
    with LocalDeployment(tmp_path / "dep", data_replicas=1, metadata_replicas=3, capacity="16MiB") as dep:
        child_log = tmp_path / "child.log"
        with open(child_log, "wb") as err_file:
            child = subprocess.Popen([python_exe, "-c", _RESUMING_CHILD, root, dep.metadata_endpoints, stream, name,
                                      str(blocks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_file,
                                     env=subprocess_env, text=True)
        try:
            assert child.stdout.readline().strip() == "FIRST", child_log.read_text()
            assert child.stdout.readline().strip() == "STALLED", child_log.read_text()
            stop_process(child)
            meta = MetadataCache(client_for(dep.metadata_endpoints, "metadata cache", []))
            successor = ShardWriter(store, stream, 0, "driver-2", meta=meta, lease_seconds=0.6)
            successor.acquire()  # poisons the stopped writer's cache lease, forces the store lease
            successor.recover(resume=OpenFile(name, len(first), 1))
            assert successor.current() is not None and successor.file == name
            try:
                successor.append(second, 1)
                successor_acked = True
            except WriterConflictError:
                successor_acked = False
            finally:
                successor.close(seal=False)
                meta.client.close()
            child.send_signal(signal.SIGCONT)
            child.stdin.write("go\n")
            child.stdin.flush()
            verdict = child.stdout.readline().strip()
            assert child.wait(WAIT_S) == 0, child_log.read_text()
        finally:
            _end(None, child)
    values = fresh_values(root, stream)
    assert values == [b"m-0", b"m-1"], (values, verdict, successor_acked, store.length(f"{shard_dir(stream, 0)}/{name}"))
    assert not (successor_acked and verdict == "ACKNOWLEDGED"), "both writers acknowledged the same messages"


def test_the_holder_of_the_cache_lease_keeps_its_shard_when_it_opens_a_file_after_a_stale_store_lease_write(
        tmp_path, root):
    """Review of 01be342: a deposed writer stopped inside its store-lease renewal writes its
    record over ours when it resumes; the holder of the authoritative metadata-cache lease
    takes it back at its next check_leases (renew with force) -- but the check a new file's
    claim makes (ShardWriter._claim, every roll-over) renewed the store lease without force:
    the legitimate writer sealed its new file unused and stopped as 'deposed', and the
    resumed writer stops at its own cache-lease check, so nobody wrote the shard."""
    from pyspark_acs.cache.client import client_for
    from pyspark_acs.cache.metadata import MetadataCache
    from pyspark_acs.server.local.deploy import LocalDeployment
    from pyspark_acs.storage.leases import LeaseRecord
    from pyspark_acs.write.shard import LEASE_FILE

    store = DurableStore(root)
    store.create_stream("kept", 1)
    with LocalDeployment(tmp_path / "dep", data_replicas=1, metadata_replicas=3, capacity="16MiB") as dep:
        meta = MetadataCache(client_for(dep.metadata_endpoints, "metadata cache", []))
        try:
            w = ShardWriter(store, "kept", 0, "writer_new", meta=meta, lease_seconds=30)
            w.acquire()
            w.recover()
            w.append(encode_block([b"a"], first_index=0), 1)
            # The deposed writer resumes inside its renewal and writes its record over ours.
            store.write_small(f"{shard_dir('kept', 0)}/{LEASE_FILE}", LeaseRecord.new("writer_old", 30).encode())
            w.open_new()  # a roll-over: the claim checks the leases
            w.append(encode_block([b"b"], first_index=0), 1)
            w.close()
        finally:
            meta.client.close()
    assert fresh_values(root, "kept") == [b"a", b"b"]
    assert not store.exists(f"{shard_dir('kept', 0)}/{LEASE_FILE}")  # released: it was ours again


def test_an_append_past_a_lock_held_by_a_stopped_process_is_refused_and_appends_nothing(
        root, python_exe, subprocess_env):
    """The refusal of an append whose lock a stopped process keeps (AppendLockBusyError, what
    the copy writer answers FAILED on and the sink's commit fails with): it names the file, the
    bytes and the lock, and nothing lands; a recovery seal (past_a_stopped_writer) lands."""

    from pyspark_acs.errors import AppendLockBusyError

    store = DurableStore(root, lock_wait_s=LOCK_WAIT_S)
    store.create_stream("busy", 1)
    rel = "busy/00000/20260101T000000000000Z-w.acs"
    block = encode_block([b"a", b"b"], None, [1, 2])
    f = DurableFile(store, rel, position=0)
    f.append(block, messages=(0, 2))
    holder = subprocess.Popen([python_exe, "-c", LOCK_HOLDER, store.path(rel)], stdout=subprocess.PIPE,
                              env=subprocess_env, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        stop_process(holder)
        began = time.monotonic()
        with pytest.raises(AppendLockBusyError) as err:
            f.append(encode_block([b"c"], None, [3], first_index=2), messages=(2, 1))
        assert time.monotonic() - began >= LOCK_WAIT_S * 0.9  # it waited the store's lock wait
        msg = str(err.value)
        assert rel in msg and "messages 2..2" in msg and "append lock" in msg, msg
        assert store.length(rel) == len(block)  # nothing appended
        f.append(encode_seal(2), past_a_stopped_writer=True)  # the fence goes through
        assert store.length(rel) == len(block) + len(encode_seal(2))
    finally:
        _end(None, holder)
        f.close()
    assert fresh_values(root, "busy") == [b"a", b"b"]


@pytest.mark.parametrize("window", [64, 100, 1000])
def test_the_walk_finds_a_recovery_seal_across_its_read_windows(root, monkeypatch, window):
    """scan_file searches a torn tail for its recovery seal window by window (a corrupt header
    early in a large file must not make it read the rest at once); a seal across a window's
    end is found in the next window, however the torn bytes fall."""
    store = DurableStore(root)
    good = encode_block([b"a" * 40], None, [1], first_index=0)
    for cut in range(150, 270, 7):
        torn = encode_block([b"b" * 300], None, [1], first_index=1)[:cut]
        rel = f"s/00000/20260101T000000{cut:06d}Z-w.acs"
        appender = store.open_appender(rel)
        appender.write(good + torn + encode_seal(1, void_from=len(good)))
        appender.close()
        tail = scan_file(store, rel, window=window)
        assert (tail.end, tail.next_index, tail.sealed_at) == (len(good), 1, len(good) + cut), cut
