"""A writer deposed while it stalls between its lease check and creating its next file must
not start an unfenced file (a hostile review's finding F1).

The take-over's recovery can only seal files that exist; a file the deposed writer creates
afterwards would be outside every seal. Variant A: it stalls before naming the file (its file
sorts after the new writer's first file: readers would stall there and later acknowledged
messages would be hidden). Variant B: it named the file before the stall (its file sorts before
the new writer's: live readers would skip its acknowledged messages). Both failed on a7d4837.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time

import pytest

from pyspark_acs import Consumer, Producer, WriterConflictError
from pyspark_acs.errors import StoreError
from pyspark_acs.format.block import encode_seal
from pyspark_acs.format.names import file_name, next_file_name, parse_file_name
from pyspark_acs.read.consumer import TailTiming
from pyspark_acs.storage.store import DurableStore, open_store
from pyspark_acs.write.file import scan_file
from pyspark_acs.write.shard import STRAY_RETRY_S

from tests.helpers import FakeClock, later_files_at_first_open, stall_at_next_lease_check


def _lease_clock() -> FakeClock:
    """The store leases' wall clock of a test's producers: moved past a 1 s lease where a
    writer's lease runs out, instead of sleeping (every holder and taker is in this process)."""
    return FakeClock(time.time())


#: How long a drain waits for the messages it expects (only a failing test waits it out).
WAIT_S = 30.0
#: How long a reader must then stay without new messages: time to meet a message that should
#: not be there (at most a listing back-off and a look for a later file, _TIMING, away).
SETTLE_S = 0.5
#: The readers' timing: a reader stuck at the end of an unsealed file looks for a later file
#: after 0.1 s, not 1 s, so a settle meets what lies behind such a file.
_TIMING = TailTiming(unfinished_check_s=(0.1, 0.4))


def _reader(root: str) -> Consumer:
    return Consumer(root, "s", start="earliest", timing=_TIMING)


def _drain(consumer: Consumer, count: int = 0, settle: float = 0.0) -> list:
    """The values ``consumer`` delivers next: until ``count`` of them came (AssertionError after
    WAIT_S without a message), then until none came for ``settle`` seconds."""
    got: list = []
    if count > 0:
        for b in consumer.batches(timeout=WAIT_S):
            got += [v.decode() for v in b.column("value").to_pylist()]
            if len(got) >= count:
                break
        assert len(got) >= count, f"expected {count} more messages, got {got} in {WAIT_S} s"
    if settle > 0:
        got += [v.decode() for b in consumer.batches(timeout=settle) for v in b.column("value").to_pylist()]
    return got


@pytest.mark.parametrize("variant", ["stall_before_naming", "stall_after_naming"])
def test_deposed_writer_never_starts_an_unfenced_file(root, variant):
    clock = _lease_clock()
    deposed = Producer(root, "s", 1, lease_seconds=1.0, writer_id="d", lease_clock=clock)
    writer = deposed._shards[0].writer
    # The stall ends once the successor holds the shard (not after a fixed 1.6 s, which a loaded
    # machine could reach before the successor's take-over: then nobody would depose the writer).
    stalled, taken_over = threading.Event(), threading.Event()
    if variant == "stall_before_naming":
        original = writer.open_new

        def slow_open_new(name=None):
            stalled.set()
            taken_over.wait(30)  # past the 1 s lease: another writer takes the shard over meanwhile
            return original(name)

        writer.open_new = slow_open_new
    else:
        original = writer._open

        def slow_open(name, length, index):
            stalled.set()
            taken_over.wait(30)
            return original(name, length, index)

        writer._open = slow_open
    live = _reader(root)
    deposed.send(b"d1")
    outcome = {}

    def flush():
        try:
            deposed.flush()
            outcome["acked"] = True
        except WriterConflictError as exc:
            outcome["error"] = exc

    flusher = threading.Thread(target=flush)
    flusher.start()
    assert stalled.wait(30)  # after its lease check
    clock.advance(1.2)  # the deposed writer's lease runs out
    successor = Producer(root, "s", 1, lease_seconds=1.0, writer_id="r", roll_bytes=1,  # every block rolls
                         lease_clock=clock)
    taken_over.set()
    successor.send(b"r1")
    successor.flush()
    # A look, not a wait for r1: the live reader may wait at an empty stray of the deposed
    # writer (variant B) until the successor's next claim seals it.
    seen = _drain(live, settle=0.3)
    flusher.join(10)
    successor.send(b"r2")
    successor.flush()
    seen += _drain(live, 2 - len(seen), SETTLE_S)
    fresh = _drain(_reader(root), 2, SETTLE_S)
    successor.close()
    with pytest.raises(WriterConflictError):
        deposed.close()
    assert "error" in outcome and "deposed" in str(outcome["error"])  # d1 never acknowledged
    assert seen == fresh == ["r1", "r2"]  # one history, every acknowledged message in it
    live.close()


def test_lease_holder_moves_past_a_deposed_writers_later_file(root, monkeypatch):
    """The race CI found in the test above: the deposed writer names its file after the
    successor's take-over (so it sorts after the successor's new file) and creates it while
    the successor claims its own. The deposed writer's check fails and it stops; the
    successor holds the lease, so it must go on (seal that file and its own empty one, and
    write to a file named after both), not stop too. Made deterministic here: the later file
    appears right after the successor creates its first file."""
    clock = _lease_clock()
    deposed = Producer(root, "s", 1, lease_seconds=1.0, writer_id="d", lease_clock=clock)
    deposed.send(b"d0")
    deposed.flush()
    taken_over = stall_at_next_lease_check(deposed._shards[0].writer)  # past its lease
    live = _reader(root)
    seen = _drain(live, 1)
    clock.advance(1.2)  # the deposed writer's lease runs out
    successor = Producer(root, "s", 1, lease_seconds=1.0, writer_id="r", lease_clock=clock)
    taken_over.set()
    writer = successor._shards[0].writer
    late = later_files_at_first_open(monkeypatch, writer, ["d"])  # before our claim
    successor.send(b"r1")
    successor.flush()  # failed before: the successor took the later file for a successor's
    seen += _drain(live, 2 - len(seen))
    files = writer.files()
    assert late and late[0] in files and files[-1] > late[0]
    for name in files:
        assert scan_file(writer.store, f"{writer.dir}/{name}").sealed or name == files[-1], name
    successor.send(b"r2")
    successor.flush()
    seen += _drain(live, 3 - len(seen), SETTLE_S)
    fresh = _drain(_reader(root), 3, SETTLE_S)
    successor.close()
    with pytest.raises(WriterConflictError):  # the deposed writer stops at its lease check
        deposed.close()
    assert seen == fresh == ["d0", "r1", "r2"]
    live.close()


@pytest.mark.parametrize("later", [["x"], ["x", "y"]], ids=["one", "two"])
def test_a_later_file_that_cannot_be_sealed_strands_no_file(root, monkeypatch, later):
    """Deposed writers' files appear after the lease holder's new file, and the first cannot be
    sealed (HDFS refuses a second appender while its writer's stream is open; any store error
    alike): the holder stops. Its own empty file must already be sealed: it sorts before the
    later files, so a take-over's newest-file seal would miss it (hostile review of bbd2ce1,
    finding 1). With two, the first stays unsealed and is not the newest: the next take-over
    seals every empty file, and with the newest empty, the last file holding bytes too
    (hostile review of 350838f, finding 3). Readers then get every message."""
    clock = _lease_clock()
    first = Producer(root, "s", 1, lease_seconds=1.0, writer_id="d", lease_clock=clock)
    first.send(b"d0")
    first.flush()
    first.close()
    successor = Producer(root, "s", 1, lease_seconds=1.0, writer_id="r", lease_clock=clock)
    writer = successor._shards[0].writer
    store = writer.store
    late = later_files_at_first_open(monkeypatch, writer, later, refuse_first=True)
    successor.send(b"r1")
    with pytest.raises(StoreError, match="AlreadyBeingCreated"):
        successor.flush()
    with pytest.raises(StoreError):
        successor.close()
    monkeypatch.undo()  # the refusal ends (the dead writer's HDFS lease on the file expired)
    unsealed = [f for f in writer.files() if not scan_file(store, f"{writer.dir}/{f}").sealed]
    assert unsealed == late  # ours is sealed; the refused one and any after it are not
    clock.advance(1.2)  # the successor's lease runs out
    third = Producer(root, "s", 1, lease_seconds=1.0, writer_id="t", lease_clock=clock)
    third.send(b"t1")
    third.flush()
    third.close()
    assert [f for f in writer.files() if not scan_file(store, f"{writer.dir}/{f}").sealed] == []
    assert _drain(_reader(root), 2, SETTLE_S) == ["d0", "t1"]


def test_a_deposed_writers_file_named_before_ours_is_sealed_at_our_next_file(root):
    """Hostile review of bbd2ce1 (seen in passing): a deposed writer that named its file before
    the successor's and created it after the successor's claim, then died before its own claim
    could seal it, left an empty unsealed file that sorts before the successor's files. No
    take-over's recovery seals it (that seals the newest file), and the successor's next claim
    only looked at names after its own last file: readers from the earliest offset stopped
    there for good. The next claim now seals every unsealed file that appeared since the
    writer last listed the shard."""
    successor = Producer(root, "s", 1, lease_seconds=1.0, writer_id="r", roll_bytes=1)  # every block rolls
    successor.send(b"r1")
    successor.flush()
    writer = successor._shards[0].writer
    first = writer.files()[-1]
    created = parse_file_name(first).created - datetime.timedelta(microseconds=1)
    stray = file_name(created, "d")  # named before our file, created after our claim
    writer.store.write_small(f"{writer.dir}/{stray}", b"")
    assert not scan_file(writer.store, f"{writer.dir}/{stray}").sealed
    successor.send(b"r2")
    successor.flush()
    assert scan_file(writer.store, f"{writer.dir}/{stray}").sealed
    assert _drain(_reader(root), 2, SETTLE_S) == ["r1", "r2"]
    successor.close()


def test_a_stray_before_our_file_is_sealed_by_the_next_writers_recovery(root):
    """The stray of the test above, when the writer that could have sealed it at its next claim
    stops first (closed before its next file; a restart): the next writer's recovery seals
    it. A deposed writer's stray is always empty (nothing is appended before a claim passes)
    and a sealed file never is, so recovery seals every empty file (hostile review of ea781a5,
    finding 1)."""
    first = Producer(root, "s", 1, lease_seconds=1.0, writer_id="r")
    first.send(b"r1")
    first.flush()
    live = _reader(root)  # follows through the stray and the restart
    seen = _drain(live, 1)
    writer = first._shards[0].writer
    created = parse_file_name(writer.files()[-1]).created - datetime.timedelta(microseconds=1)
    stray = file_name(created, "d")
    writer.store.write_small(f"{writer.dir}/{stray}", b"")
    first.close()  # no next file: the stray is still unsealed
    assert not scan_file(writer.store, f"{writer.dir}/{stray}").sealed
    restarted = Producer(root, "s", 1, lease_seconds=1.0, writer_id="r")
    restarted.send(b"r2")
    restarted.flush()
    restarted.close()
    assert scan_file(writer.store, f"{writer.dir}/{stray}").sealed
    seen += _drain(live, 2 - len(seen), SETTLE_S)
    fresh = _drain(_reader(root), 2, SETTLE_S)
    assert seen == fresh == ["r1", "r2"]
    live.close()


def test_recovery_never_recreates_a_file_the_tier_mover_deleted(root, monkeypatch):
    """With an empty newest file, recovery also seals the last file holding bytes; that file is
    usually sealed and tiered, and the tier mover may delete its hot copy right after
    recovery listed the shard. Sealing it then must not create an empty sealed file in its
    place (readers would take it for the whole file and skip its messages; hostile review of
    c0ac7de, finding 1)."""
    first = Producer(root, "s", 1, lease_seconds=1.0, writer_id="a")
    first.send(b"m0")
    first.flush()
    first.close()
    store = open_store(root)
    full = store.list_files("s", 0)[-1]
    store.write_small(f"s/00000/{next_file_name([full], 'b')}", b"")  # a writer died right after creating it
    listed = DurableStore.list_file_lengths

    def listed_then_tiered(self, stream, shard):
        out = listed(self, stream, shard)
        if self.exists(f"s/00000/{full}"):
            self.delete(f"s/00000/{full}")  # the mover deletes the hot copy of the tiered file
        return out

    monkeypatch.setattr(DurableStore, "list_file_lengths", listed_then_tiered)
    successor = Producer(root, "s", 1, lease_seconds=1.0, writer_id="c")
    monkeypatch.setattr(DurableStore, "list_file_lengths", listed)
    assert full not in store.list_files("s", 0)
    successor.close()


def test_a_stray_that_cannot_be_sealed_yet_does_not_stop_the_next_writer(root, monkeypatch):
    """An empty stray whose seal the store refuses for now (HDFS: the dead writer's lease on the
    file has not expired) is no reason to refuse the shard to the next writer (nothing in it
    to fence); the writer tries again every STRAY_RETRY_S while idle, and readers then get
    every message (hostile review of c0ac7de, finding 3, and of a1a24e8, finding 4)."""
    first = Producer(root, "s", 1, lease_seconds=1.0, writer_id="r")
    first.send(b"r1")
    first.flush()
    first.close()
    live = _reader(root)  # follows through the refused stray
    seen = _drain(live, 1)
    store = open_store(root)
    created = parse_file_name(store.list_files("s", 0)[-1]).created - datetime.timedelta(microseconds=1)
    stray = file_name(created, "d")
    store.write_small(f"s/00000/{stray}", b"")
    refused = []
    original = DurableStore.open_appender

    def appender(self, rel):
        if rel.endswith(stray) and len(refused) < 2:  # at recovery, and at the first retry
            refused.append(rel)
            raise StoreError(f"open {rel} for append: AlreadyBeingCreatedException (simulated)")
        return original(self, rel)

    monkeypatch.setattr(DurableStore, "open_appender", appender)
    successor = Producer(root, "s", 1, lease_seconds=1.0, writer_id="t")
    successor.send(b"t1")
    successor.flush()  # acknowledged while the stray still waits for its seal
    deadline = time.monotonic() + 10 * STRAY_RETRY_S
    while not scan_file(store, f"s/00000/{stray}").sealed:  # the idle writer's housekeeping
        assert time.monotonic() < deadline, refused
        time.sleep(0.1)
    assert len(refused) == 2
    seen += _drain(live, 2 - len(seen), SETTLE_S)
    fresh = _drain(_reader(root), 2, SETTLE_S)
    assert seen == fresh == ["r1", "t1"]
    successor.close()
    live.close()


def test_a_refused_seal_of_the_last_file_with_bytes_stops_the_take_over(root, monkeypatch):
    """With an empty newest file, the last file holding bytes is fenced like the newest one: a
    deposed writer may still hold it with an append in flight (HDFS refuses the seal then),
    so a refused seal stops the take-over, it is not logged and passed (hostile review of
    a1a24e8, finding 1)."""
    clock = _lease_clock()
    first = Producer(root, "s", 1, lease_seconds=1.0, writer_id="d", lease_clock=clock)
    first.send(b"d0")
    first.flush()
    writer = first._shards[0].writer
    full = writer.file
    resumed = stall_at_next_lease_check(writer)  # d stalls holding its file, unsealed, past its lease
    store = open_store(root)
    store.write_small(f"s/00000/{next_file_name([full], 'x')}", b"")
    original = DurableStore.open_appender

    def appender(self, rel):
        if rel.endswith(full):
            raise StoreError(f"open {rel} for append: AlreadyBeingCreatedException (simulated)")
        return original(self, rel)

    monkeypatch.setattr(DurableStore, "open_appender", appender)
    clock.advance(1.2)  # d's lease runs out
    with pytest.raises(StoreError, match="AlreadyBeingCreated"):
        Producer(root, "s", 1, lease_seconds=1.0, writer_id="t", lease_clock=clock)
    monkeypatch.undo()
    resumed.set()
    with contextlib.suppress(WriterConflictError):  # its lease was taken over before the recovery stopped
        first.close()


def test_a_file_sealed_unused_after_a_crashed_writers_file_does_not_hide_it(root, monkeypatch):
    """A deposed writer's file that its claim sealed unused (a lone seal) sorts after the last
    writer's file, which that writer left unsealed when it crashed: the next take-over must
    fence that file too, as when the newest file is empty, or readers wait at its end for
    good and never see the new writer's messages (final review of this session, finding 1)."""
    clock = _lease_clock()
    first = Producer(root, "s", 1, lease_seconds=1.0, writer_id="w", lease_clock=clock)
    first.send(b"w0")
    first.flush()
    live = _reader(root)  # waits at the end of w's file through the crash
    seen = _drain(live, 1)
    writer = first._shards[0].writer
    full = writer.file
    resumed = stall_at_next_lease_check(writer)  # w crashed (stalls here) with its file unsealed
    store = open_store(root)
    store.write_small(f"s/00000/{next_file_name([full], 'z')}", encode_seal(0))  # sealed unused
    clock.advance(1.2)  # w's lease runs out
    successor = Producer(root, "s", 1, lease_seconds=1.0, writer_id="t", lease_clock=clock)
    assert scan_file(store, f"s/00000/{full}").sealed
    successor.send(b"t1")
    successor.flush()
    successor.close()
    resumed.set()
    with contextlib.suppress(WriterConflictError):
        first.close()
    seen += _drain(live, 2 - len(seen), SETTLE_S)
    fresh = _drain(_reader(root), 2, SETTLE_S)
    assert seen == fresh == ["w0", "t1"]
    live.close()
