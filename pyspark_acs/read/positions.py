"""Positions in a shard: latest readable offset, offset for a timestamp, backlog, and how far
a bounded read may go under a byte or row budget.

All of it walks block *headers* only (a 48-byte read per block, or one window read for many
small blocks), through a read path, so it costs little even on large files.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import List, Optional, Tuple

from pyspark_acs.format.block import HEADER_SIZE, parse_header
from pyspark_acs.format.names import shard_dir
from pyspark_acs.format.offsets import Offset
from pyspark_acs.read.readpath import ReadPath

__all__ = ["BoundaryCache", "ShardExtent", "advance", "offset_for_timestamp", "shard_extent", "walk_blocks"]

#: Bytes read at once while walking headers of small blocks.
WALK_WINDOW_BYTES = 256 * 1024
#: Files whose last block boundary the driver remembers.
MAX_KNOWN_FILES = 4096


def _read_now(path: ReadPath, rel: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` without waiting: the read path may stop short while it
    postpones durable reads for a lagging cache (Algorithm 1); planning cannot wait, so the
    rest comes straight from the durable store (which may itself be shorter)."""
    data = path.read(rel, start, end)
    if len(data) < end - start:
        data += path.store.read(rel, start + len(data), end)
    return data


def walk_blocks(
    path: ReadPath,
    rel: str,
    start: int,
    stop: int,
    *,
    max_bytes: Optional[int] = None,
    max_rows: Optional[int] = None,
) -> Tuple[int, int, int]:
    """Walk whole blocks of ``rel`` from ``start`` (a block boundary) towards ``stop``.

    Stops before a block that would end past ``stop`` or exceed the budgets; the first block
    is always taken when it fits ``stop``, so a read always makes progress.

    Returns
    -------
    (end, rows, blocks) : the block boundary reached, messages and blocks passed.
    """
    at, rows, blocks = start, 0, 0
    uri = path.store.uri(rel)
    window = WALK_WINDOW_BYTES
    while at + HEADER_SIZE <= stop:
        data = _read_now(path, rel, at, min(stop, at + window))
        if len(data) < HEADER_SIZE:
            break
        off = 0
        while off + HEADER_SIZE <= len(data):
            header = parse_header(data, off, path=uri, position=at + off)
            # Large blocks: read just the next header instead of a window of body bytes.
            window = HEADER_SIZE if header.size > WALK_WINDOW_BYTES // 4 else WALK_WINDOW_BYTES
            end = at + off + header.size
            over_bytes = max_bytes is not None and end - start > max_bytes
            over_rows = max_rows is not None and rows + header.count > max_rows
            if end > stop or (blocks and (over_bytes or over_rows)):
                return at + off, rows, blocks
            rows += header.count
            blocks += 1
            off += header.size
        at += off
    return at, rows, blocks


class BoundaryCache:
    """Remembers the last block boundary found per file so walks resume there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _known
        self._known: "OrderedDict[str, int]" = OrderedDict()

    def boundary(self, path: ReadPath, rel: str, length: int) -> int:
        """The last block boundary at or below ``length`` in ``rel``."""
        with self._lock:
            at = self._known.get(rel, 0)
        if at > length:
            at = 0
        end, _, _ = walk_blocks(path, rel, at, length)
        with self._lock:
            self._known[rel] = end
            self._known.move_to_end(rel)  # least recently used files go first
            if len(self._known) > MAX_KNOWN_FILES:
                self._known.popitem(last=False)
        return end


class ShardExtent:
    """Files of a shard from a start offset on, with their readable lengths."""

    def __init__(self, stream: str, shard: int, files: List[Tuple[str, int]]):
        self.stream = stream
        self.shard = shard
        self.files = files  # [(name, readable length)], oldest first

    def latest(self, boundaries: BoundaryCache, path: ReadPath) -> Offset:
        """The last readable block boundary of the newest file (``Offset()`` when there are none).

        Walks block headers from the boundary ``boundaries`` remembers for that file.
        """
        if not self.files:
            return Offset()
        name, length = self.files[-1]
        rel = f"{shard_dir(self.stream, self.shard)}/{name}"
        return Offset(name, boundaries.boundary(path, rel, length))

    def backlog(self, start: Offset) -> int:
        """Bytes readable after ``start``."""
        total = 0
        for name, length in self.files:
            if name < start.file:
                continue
            total += max(0, length - (start.length if name == start.file else 0))
        return total


def shard_extent(path: ReadPath, stream: str, shard: int, start: Offset) -> ShardExtent:
    """The files at or after ``start.file`` and their readable lengths (one batched call)."""
    files = [f for f in path.store.list_files(stream, shard) if f >= start.file]
    rels = [f"{shard_dir(stream, shard)}/{f}" for f in files]
    lengths = path.lengths(rels) if rels else {}
    return ShardExtent(stream, shard, [(f, lengths.get(r) or 0) for f, r in zip(files, rels)])


def advance(
    path: ReadPath,
    extent: ShardExtent,
    start: Offset,
    latest: Offset,
    *,
    max_bytes: Optional[int] = None,
    max_rows: Optional[int] = None,
) -> Offset:
    """The furthest offset from ``start`` towards ``latest`` within the budgets (at least one
    block when there is one)."""
    if max_bytes is None and max_rows is None:
        return latest
    at = start
    used_bytes = used_rows = 0
    for name, length in extent.files:
        if name < start.file or name > latest.file:
            continue
        rel = f"{shard_dir(extent.stream, extent.shard)}/{name}"
        begin = start.length if name == start.file else 0
        stop = latest.length if name == latest.file else length
        end, rows, blocks = walk_blocks(
            path, rel, begin, stop,
            max_bytes=None if max_bytes is None else max(max_bytes - used_bytes, 0),
            max_rows=None if max_rows is None else max(max_rows - used_rows, 0),
        )
        if blocks == 0 and (used_bytes or used_rows):
            return at  # the budget is spent
        used_bytes += end - begin
        used_rows += rows
        at = Offset(name, end)
        if end < stop:
            return at
        if (max_bytes is not None and used_bytes >= max_bytes) or (max_rows is not None and used_rows >= max_rows):
            return at
    return at


def offset_for_timestamp(path: ReadPath, stream: str, shard: int, ts_us: int) -> Offset:
    """The offset of the first block whose last message is at or after ``ts_us`` (µs).

    Messages of that block before ``ts_us`` are returned too (offsets are block
    boundaries); with no such block, the end of the shard.
    """
    files = path.store.list_files(stream, shard)
    rels = [f"{shard_dir(stream, shard)}/{f}" for f in files]
    lengths = path.lengths(rels) if rels else {}
    last = Offset()
    for name, rel in zip(files, rels):
        length = lengths.get(rel) or 0
        at = 0
        uri = path.store.uri(rel)
        while at + HEADER_SIZE <= length:
            data = _read_now(path, rel, at, min(length, at + WALK_WINDOW_BYTES))
            off = 0
            while off + HEADER_SIZE <= len(data):
                header = parse_header(data, off, path=uri, position=at + off)
                if at + off + header.size > length:
                    break
                if header.count and header.last_ts >= ts_us:
                    return Offset(name, at + off)
                off += header.size
            if off == 0:
                break
            at += off
        last = Offset(name, at)
    return last
