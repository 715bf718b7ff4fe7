"""ChunkWriter's cutting of a file's bytes into chunk puts (the write path's mirror).

Its chunks are views of the appended bytes (each byte copied once, into the put's body): any
sequence of appends from any start must put, per chunk, the file's bytes from the chunk's
start up to the writer's position -- a partial last chunk again, longer, on the next append.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_acs.cache import wire
from pyspark_acs.cache.chunks import CHUNK_SIZE, ChunkWriter, chunk_keys
from pyspark_acs.cache.proto import acs_pb2

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
