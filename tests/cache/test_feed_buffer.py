"""A followed file's buffer (cache/feed.py ``_File``): pushed runs kept as they came, read
back exactly as a plain buffer of the same bytes would give them, with no copy for the
caught-up reader's read of the last run."""

from __future__ import annotations

import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_acs.cache import feed
from pyspark_acs.cache.feed import FEED_STALL_S, PUSH_GRACE_S, _File

from tests.helpers import FakeClock

FILE = bytes(range(256)) * 64  # the file's bytes: any pushed run is a slice of them
#: A small buffer size for the property test (runs of up to 900 bytes overflow it often).
CAP = 2048


class _Plain:
    """The reference: one bytearray from ``base``, as the feed kept it before."""

    def __init__(self) -> None:
        self.base, self.buf = 0, bytearray()

    @property
    def end(self) -> int:
        return self.base + len(self.buf)

    def append(self, start: int, data: bytes) -> bool:
        if start > self.end or start + len(data) <= self.end:
            return False
        self.buf += data[self.end - start:]
        if len(self.buf) > CAP:
            drop = len(self.buf) - CAP
            del self.buf[:drop]
            self.base += drop
        return True

    def drop_to(self, position: int) -> None:
        if position > self.base:
            del self.buf[:position - self.base]
            self.base = position

    def restart(self, position: int) -> None:
        self.base, self.buf = position, bytearray()

    def take(self, start: int, end: int) -> bytes:
        return bytes(self.buf[start - self.base:min(end, self.end) - self.base])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(-600, 200), st.integers(0, 900)),
        st.tuples(st.just("read"), st.integers(0, 3000), st.integers(1, 3000)),
        st.tuples(st.just("drop"), st.integers(0, 3000)),
        st.tuples(st.just("restart"), st.integers(0, 3000)),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(ops=ops)
def test_runs_read_back_as_one_buffer(ops):
    """Any sequence of pushes (overlapping, past a gap, exact), reads, drops and restarts
    gives the same bytes, base and end as one plain buffer, under a small buffer size."""
    f, ref = _File("file:///x", ("a",)), _Plain()
    for op in ops:
        if op[0] == "push":
            start = max(0, f.end + op[1])
            data = FILE[start:start + op[2]]
            assert f.append(start, data) == ref.append(start, data)
            if f.end - f.base > CAP:  # the feed's drop (ChunkFeed._overflow)
                f.trim(CAP)
        elif op[0] == "read":
            start = f.base + op[1] % max(1, f.end - f.base) if f.end > f.base else None
            if start is not None:
                assert f.take(start, start + op[2]) == ref.take(start, start + op[2])
        elif op[0] == "drop":
            to = f.base + op[1] % (f.end - f.base + 1)
            f.drop_to(to)
            ref.drop_to(to)
        else:
            f.restart(op[1])
            ref.restart(op[1])
        assert (f.base, f.end) == (ref.base, ref.end)
        assert f.end - f.base <= CAP
        # no run below what is held stays referenced (memory is bounded by what is held)
        assert not f.pieces or f.starts[0] + len(f.pieces[0]) > f.base
        if f.end > f.base:
            assert f.take(f.base, f.end) == bytes(ref.buf) == FILE[f.base:f.end]


def test_caught_up_read_is_the_pushed_run_itself():
    """A reader at the end of what it read takes the next pushed run without a copy; a read
    across runs or inside one copies once into ``bytes``."""
    f = _File("file:///x", ("a",))
    first, second = FILE[:1000], FILE[1000:1700]
    f.append(0, first)
    assert f.take(0, 1000) is first
    f.drop_to(1000)
    f.append(1000, second)
    assert f.take(1000, 5000) is second
    f.append(1700, FILE[1700:2000])
    got = f.take(1500, 1800)
    assert type(got) is bytes and got == FILE[1500:1800]


class _FakeStream:
    """Stands in for a FollowStream: records the cursor the feed asks for, and since when a
    subscription is unanswered (``asked_at``, set by the test)."""

    def __init__(self) -> None:
        self.cursors: dict = {}
        self.asked_at = None
        self.live = threading.Event()  # up and answered: set by the test

    def follow(self, fid: bytes, offset: int) -> None:
        self.cursors[fid] = offset

    def unfollow(self, fid: bytes) -> None:
        self.cursors.pop(fid, None)

    def push(self, f: "feed.ChunkFeed", fid: bytes, size: int) -> None:
        """The replica pushes ``size`` bytes of ``fid`` at its cursor, as a real stream would."""
        at = self.cursors[fid]
        self.cursors[fid] = at + size
        f._on_bytes(fid, at, b"x" * size)


#: The runs the stand-in replica pushes (bytes).
RUN = 256 * 1024


def _feed_following(uri: str, *readers: str, replicas=("r1",), clock=time.monotonic):
    """A ChunkFeed over stand-in streams (one per replica), ``readers`` following ``uri`` from
    byte 0: ``(feed, stream of the file's replica, file id)``."""
    from pyspark_acs.cache.chunks import file_id

    f = object.__new__(feed.ChunkFeed)
    f._whole_files, f._lock = True, threading.Lock()
    f._grew = threading.Condition(f._lock)
    f._files, f._by_fid, f.received, f.served, f.moves, f._warned = {}, {}, 0, 0, 0, {}
    f.max_bytes, f.clock = feed.FEED_MAX_BYTES, clock

    class _Client:
        def replicas_for(self, key):
            return replicas

    f.client = _Client()
    f._streams = {r: _FakeStream() for r in replicas}
    for reader in readers:
        f.follow(uri, reader, 0)
    return f, f._streams[f._files[uri].endpoint], file_id(uri)


def test_wait_read_returns_the_bytes_once_their_push_comes_and_nothing_it_does_not_bring():
    """A joining reader's look at a few bytes waits for the feed's push (ChunkFeed.wait_read)
    instead of asking the cache; it gives up at once on bytes the feed will not bring (below
    its base) and after its timeout on bytes that do not come."""
    uri = "file:///joining"
    f, stream, fid = _feed_following(uri, "A")
    pusher = threading.Timer(0.05, lambda: stream.push(f, fid, RUN))
    pusher.start()
    t0 = time.monotonic()
    assert f.wait_read(uri, RUN - 56, RUN, timeout=5.0) == b"x" * 56  # came with the push
    assert time.monotonic() - t0 < 5.0
    pusher.join()
    f._files[uri].drop_to(1024)
    t0 = time.monotonic()
    assert f.wait_read(uri, 0, 56, timeout=5.0) == b""  # below the base: never pushed again
    assert time.monotonic() - t0 < 1.0
    assert f.wait_read(uri, RUN, RUN + 56, timeout=0.05) == b""  # not pushed within the timeout
    assert f.wait_read("file:///not-followed", 0, 56, timeout=5.0) == b""
    # The replica answered the subscription and pushed nothing (it does not hold the bytes: a
    # file idle past the data cache's time to live): given up after the grace, not the timeout.
    stream.live.set()
    t0 = time.monotonic()
    assert f.wait_read(uri, RUN, RUN + 56, timeout=5.0) == b""
    assert time.monotonic() - t0 < 1.0


def test_a_paused_push_resumes_when_one_of_its_readers_reaches_the_head():
    """Review finding (hostile read of 14ff6f7): two readers of one file both far behind stop
    its push; one of them then catches up by reading from the cache while the other stays put.
    The push must resume (the oldest bytes dropped for the one behind, as when it never
    stopped), not stay off for as long as the slow one lags."""
    run, cap, uri = RUN, feed.FEED_MAX_BYTES, "file:///two-readers"
    f, stream, fid = _feed_following(uri, "A", "B")
    while fid in stream.cursors:  # the replica pushes until the feed stops it
        stream.push(f, fid, run)
    held = f._files[uri]
    assert held.paused and cap < held.end <= cap + run
    at = 0
    while at < held.end + cap:  # B reads the buffer, then on from the cache past the feed's end
        got = f.read(uri, at, at + run)
        f.consumed(uri, "B", at, at + (len(got) or run))
        at += len(got) or run
    assert not held.paused and stream.cursors.get(fid) == held.end  # pushed again from the end
    assert held.end - held.base <= cap  # A, behind, asks for what was dropped


def test_a_reader_inside_a_block_larger_than_the_buffer_keeps_the_push_going():
    """Review finding 2 (of 14ff6f7): a reader inside a block larger than FEED_MAX_BYTES stands
    at the block's start (no complete block yet) while reading up to the buffer's end. It counts
    as at the head: the push goes on and the oldest bytes are dropped (it asks for its block
    once whole), rather than the push stopping with the block incomplete for good."""
    run, cap, uri = RUN, feed.FEED_MAX_BYTES, "file:///one-large-block"
    f, stream, fid = _feed_following(uri, "R")
    held = f._files[uri]
    while stream.cursors.get(fid, 0) < cap + 8 * run:
        stream.push(f, fid, run)
        f.consumed(uri, "R", 0, held.end)  # no complete block: it stands at 0, read to the end
        assert fid in stream.cursors, "the push stopped inside the block"
    assert not held.paused and held.base > 0 and held.end - held.base <= cap


def test_a_replica_silent_for_the_stall_time_loses_the_file_to_the_next_one():
    """The stall rule on a hand-moved clock: a reader past the feed (it read by asking) while
    the file's stream leaves its subscription unanswered moves the file to its next replica only
    once FEED_STALL_S has passed since the subscription (and since the file came there)."""
    clock = FakeClock()
    uri = "file:///stalled"
    f, stream, fid = _feed_following(uri, "R", replicas=("r1", "r2", "r3"), clock=clock)
    first = f._files[uri].endpoint
    stream.asked_at = clock()  # subscribed, never answered
    clock.advance(FEED_STALL_S / 2)
    f.consumed(uri, "R", 4096)  # past the feed: read from the cache
    assert f._files[uri].endpoint == first and f.moves == 0  # not silent for long enough yet
    assert stream.cursors[fid] == 4096  # followed on from where the reader is, on the same replica
    clock.advance(FEED_STALL_S)
    f.consumed(uri, "R", 8192)
    moved = f._files[uri].endpoint
    assert moved != first and f.moves == 1
    assert fid not in stream.cursors and f._streams[moved].cursors[fid] == 8192
    f._streams[moved].asked_at = clock()  # the next replica is asked now: its own time to answer
    f.consumed(uri, "R", 12288)
    assert f._files[uri].endpoint == moved and f.moves == 1


def test_a_reader_waits_for_the_push_for_the_grace_time_only():
    """Push grace on a hand-moved clock: a reader at the end of the feed's bytes waits for the
    push (no request) until PUSH_GRACE_S has passed without the feed growing; pushed bytes
    start the grace afresh."""
    clock = FakeClock()
    uri = "file:///grace"
    f, stream, fid = _feed_following(uri, "R", clock=clock)
    stream.live = threading.Event()
    stream.live.set()
    stream.push(f, fid, 1000)
    assert f.waiting(uri, 1000)  # the first look starts the grace
    clock.advance(PUSH_GRACE_S / 2)
    assert f.waiting(uri, 1000)
    clock.advance(PUSH_GRACE_S)
    assert not f.waiting(uri, 1000)  # then it asks
    stream.push(f, fid, 500)  # the feed grew: a reader at its new end waits again
    assert f.waiting(uri, 1500)
    clock.advance(PUSH_GRACE_S * 1.5)
    assert not f.waiting(uri, 1500)
    stream.live.clear()
    assert not f.waiting(uri, 1500)


def test_a_reader_joining_behind_a_lead_that_read_past_the_feed_does_not_pull_it_back():
    """A lead reader that read past the feed by asking (its replica was slow to push, as on a
    loaded machine) has the file followed on from the end of its read, while its position is
    the start of that read, below the feed's new base. A reader joining at byte 0 then found
    no other reader "inside" the buffer and moved the cursor back to 0: the replica pushed the
    whole file again for the next append (tests/cache/test_push.py's late destination, which
    failed so under load). The lead's read reaches the buffer: the newcomer reads from the
    cache until it gets there, and nothing already pushed is pushed again."""
    uri, length = "file:///late-destination", 1536 * 1024
    f, stream, fid = _feed_following(uri, "lead")
    f.consumed(uri, "lead", 0, length)  # one read of the whole file, from the cache
    assert stream.cursors[fid] == length  # followed on from where the read ended
    f.follow(uri, "late", 0)
    assert stream.cursors[fid] == length, "a reader joining behind moved the push back"
    stream.push(f, fid, 278)  # the next append comes by push, for the lead
    assert f.read(uri, length, length + 278) == b"x" * 278
