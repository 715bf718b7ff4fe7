"""A followed file's buffer (cache/feed.py ``_File``): pushed runs kept as they came, read
back exactly as a plain buffer of the same bytes would give them, with no copy for the
caught-up reader's read of the last run."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_acs.cache import feed
from pyspark_acs.cache.feed import _File

FILE = bytes(range(256)) * 64  # the file's bytes: any pushed run is a slice of them


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
        if len(self.buf) > feed.FEED_MAX_BYTES:
            drop = len(self.buf) - feed.FEED_MAX_BYTES
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
    gives the same bytes, base and end as one plain buffer, under a small FEED_MAX_BYTES."""
    saved = feed.FEED_MAX_BYTES
    feed.FEED_MAX_BYTES = 2048
    try:
        f, ref = _File("file:///x", ("a",)), _Plain()
        for op in ops:
            if op[0] == "push":
                start = max(0, f.end + op[1])
                data = FILE[start:start + op[2]]
                assert f.append(start, data) == ref.append(start, data)
                if f.end - f.base > feed.FEED_MAX_BYTES:  # the feed's drop (ChunkFeed._overflow)
                    f.drop_to(f.end - feed.FEED_MAX_BYTES)
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
            assert f.end - f.base <= feed.FEED_MAX_BYTES
            # no run below what is held stays referenced (memory is bounded by what is held)
            assert not f.pieces or f.starts[0] + len(f.pieces[0]) > f.base
            if f.end > f.base:
                assert f.take(f.base, f.end) == bytes(ref.buf) == FILE[f.base:f.end]
    finally:
        feed.FEED_MAX_BYTES = saved


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
    """Stands in for a FollowStream: records the cursor the feed asks for."""

    def __init__(self) -> None:
        self.cursors: dict = {}

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


def _feed_following(uri: str, *readers: str):
    """A ChunkFeed over a stand-in stream, ``readers`` following ``uri`` from byte 0:
    ``(feed, stream, file id)``."""
    import threading

    from pyspark_acs.cache.chunks import file_id

    f = object.__new__(feed.ChunkFeed)
    f._whole_files, f._lock = True, threading.Lock()
    f._files, f._by_fid, f.received, f.served = {}, {}, 0, 0

    class _Client:
        def replicas_for(self, key):
            return ("r1",)

    f.client = _Client()
    stream = _FakeStream()
    f._streams = {"r1": stream}
    for reader in readers:
        f.follow(uri, reader, 0)
    return f, stream, file_id(uri)


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
