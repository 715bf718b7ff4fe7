"""ChunkWriter's cutting of a file's bytes into chunk puts (the write path's mirror), and its
patience with a cache whose puts time out.

Its chunks are views of the appended bytes (each byte copied once, into the put's body): any
sequence of appends from any start must put, per chunk, the file's bytes from the chunk's
start up to the writer's position -- a partial last chunk again, longer, on the next append.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_acs.cache import wire
from pyspark_acs.cache.chunks import CHUNK_SIZE, PUT_PATIENCE_S, ChunkWriter, chunk_keys
from pyspark_acs.cache.proto import acs_pb2
from pyspark_acs.errors import CacheTimeoutError

from tests.helpers import FakeClock

URI = "file:///root/stream/00000/20260101T000000000000Z-w.acs"


class _Recorder:
    """A data cache client that keeps the newest version of each chunk it is given, encoding
    every put as the real client does (wire.encode joins the values into one body)."""

    def __init__(self) -> None:
        self.chunks: Dict[bytes, Tuple[int, bytes]] = {}

    def put(self, items, *, ttl=None, grace=True) -> None:
        items = list(items)
        values = [v for _, v, _ in items]
        head = acs_pb2.PutRequest(keys=[k for k, _, _ in items], sizes=[len(v) for v in values],
                                  versions=[ver for _, _, ver in items])
        body = wire.encode(head, values, sum(len(v) for v in values), data_first=True)
        request, data = wire.split(body, acs_pb2.PutRequest)
        at = 0
        for key, size, version in zip(request.keys, request.sizes, request.versions):
            assert version == size  # a chunk's version is its length
            old = self.chunks.get(key)
            if old is None or version >= old[0]:
                self.chunks[key] = (version, bytes(data[at:at + size]))
            at += size


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 3 * CHUNK_SIZE),
       sizes=st.lists(st.integers(0, 3 * CHUNK_SIZE + 17), max_size=8),
       kind=st.sampled_from([bytes, bytearray, memoryview]))
def test_any_appends_put_the_files_bytes_chunk_by_chunk(start, sizes, kind):
    content = bytes(range(256)) * ((start + sum(sizes)) // 256 + 1)
    content = content[:start + sum(sizes)]
    client = _Recorder()
    writer = ChunkWriter(client, URI, start, prefix=content[start - start % CHUNK_SIZE:start])
    at = start
    for size in sizes:
        assert writer.append(kind(content[at:at + size])) == at + size
        at += size
    assert writer.position == len(content)
    # Every chunk from the one holding ``start`` to the last one the bytes reach (the held
    # partial chunk again even for an empty append); nothing without an append.
    numbers: List[int] = list(range(start // CHUNK_SIZE, -(-len(content) // CHUNK_SIZE))) if sizes else []
    for n, key in zip(numbers, chunk_keys(URI, numbers)):
        _, value = client.chunks[key]
        assert value == content[n * CHUNK_SIZE:(n + 1) * CHUNK_SIZE], n
    assert len(client.chunks) == len(numbers)


class _Loaded(_Recorder):
    """A recorder whose first ``timeouts`` puts time out on every replica (a loaded cache)."""

    def __init__(self, timeouts: int, clock) -> None:
        super().__init__()
        self.timeouts, self.clock, self.calls = timeouts, clock, 0

    def put(self, items, *, ttl=None, grace=True) -> None:
        self.calls += 1
        if self.timeouts > 0:
            self.timeouts -= 1
            self.clock.advance(0.5)  # the call's deadline passed
            raise CacheTimeoutError("data cache: put failed: no answer within 0.500 s")
        super().put(items, ttl=ttl, grace=grace)


def test_a_put_that_times_out_is_sent_again_within_the_patience_then_given_up():
    clock = FakeClock()
    waits: List[float] = []
    client = _Loaded(2, clock)
    w = ChunkWriter(client, URI, clock=clock, sleep=waits.append)
    assert w.append(b"a" * 5000) == 5000  # two timeouts, then taken: nothing given up
    assert (client.calls, w.retries, waits) == (3, 2, [0.05, 0.1])
    assert len(client.chunks) == 2
    # A cache that keeps timing out: sent again until the run outlasts the patience...
    client.timeouts = 10 ** 6
    with pytest.raises(CacheTimeoutError):
        w.append(b"b" * 100)
    assert clock() >= PUT_PATIENCE_S
    # ... and the next put of the same run is given up at its first timeout.
    calls = client.calls
    with pytest.raises(CacheTimeoutError):
        w.append(b"c" * 100)
    assert client.calls == calls + 1
    # A put that is taken ends the run: the next timeout is waited out again.
    client.timeouts = 0
    w.append(b"d" * 100)
    client.timeouts = 1
    retries = w.retries
    w.append(b"e" * 100)
    assert w.retries == retries + 1
