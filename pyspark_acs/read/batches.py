"""The Arrow batches readers hand out: consecutive blocks coalesced (docs/overview.md section 5).

A block becomes one Arrow batch when it is decoded (no copy). Blocks are often small (a
producer's linger flush of a few dozen messages), and whoever takes the batches pays per
batch: the JVM for a Spark read task, the user's code for a Consumer. So consecutive blocks
read together are concatenated into batches of up to :data:`READ_BATCH_BYTES` for Spark and
:data:`CONSUMER_BATCH_BYTES` for a Consumer (one copy, in Arrow: no per-row Python). A
caught-up Consumer reads one block at a time and hands it out as it is; one that is behind
hands out its backlog in large batches.
"""

from __future__ import annotations

import struct
from typing import Dict, Iterable, Iterator, List, Tuple, TypeVar

import pyarrow as pa

__all__ = [
    "CONSUMER_BATCH_BYTES",
    "READ_BATCH_BYTES",
    "coalesce_batches",
    "coalesce_runs",
]

#: Bytes of one Arrow batch handed out, at most (a single larger block is a batch of its own).
#: Spark's JVM pays per batch: batches of ~90 rows run at half the rate of 1000-row ones.
READ_BATCH_BYTES = 4 * 1024 * 1024
#: Bytes of one batch a :class:`~pyspark_acs.read.consumer.Consumer` hands out of a backlog, at
#: most: a batch this size already spreads the taker's cost per batch over hundreds of rows, and
#: the concat that makes it writes into memory a core's cache still holds (1 MiB of L2 a core
#: here), where a 4 MiB concat is bound by memory bandwidth when many consumers catch up.
CONSUMER_BATCH_BYTES = 512 * 1024

T = TypeVar("T")


def batch_bytes(batch: pa.RecordBatch) -> int:
    """The size :func:`coalesce_tagged` caps (bytes): what the rows take in a concatenated
    batch. Binary and string columns count their data and offsets, read from the offsets
    (exact for slices too); fixed-width columns count their width; other columns (the
    messages' ``headers`` lists) count their buffers whole, which can be more than their rows
    need (a slice) but not less. Validity bitmaps are left out (an eighth of a byte a row).

    Not ``RecordBatch.nbytes``: that walks every column's buffers to count shared ones once
    (the reader's constant columns are slices of one array), which costs more than the
    concat it sizes.
    """
    n = batch.num_rows
    size = 0
    for column in batch.columns:
        kind = _KINDS.get(column.type.id)
        if kind is None:
            kind = _KINDS[column.type.id] = _kind(column.type)
        if kind == _OFFSETS:
            size += _binary_bytes(column)
        elif kind >= 0:  # fixed width: bits a row
            size += (kind * n + 7) // 8
        else:  # nested: its buffers whole; a list has one offset a row at least
            size += max(column.get_total_buffer_size(), 4 * (n + 1))
    return size


_OFFSETS = -2
_NESTED = -1
# Arrow type id -> _OFFSETS (binary, string), _NESTED, or the bits of a fixed-width row (>= 0).
# Plain dict operations, each atomic under the GIL: two threads filling one id store the same value.
_KINDS: Dict[int, int] = {}
_OFFSET = struct.Struct("<i")


def _kind(type_: pa.DataType) -> int:
    if pa.types.is_binary(type_) or pa.types.is_string(type_):
        return _OFFSETS
    if pa.types.is_dictionary(type_):  # its width is the indices'; the values count too
        return _NESTED
    try:
        return type_.bit_width
    except ValueError:  # not fixed-width
        return _NESTED


def _binary_bytes(array: pa.Array) -> int:
    """Data and offset bytes of a ``binary`` or ``string`` array's rows (a slice counts only its
    own rows)."""
    first, n = array.offset, len(array)
    offsets = array.buffers()[1]
    if n == 0 or offsets is None or offsets.size < 4 * (first + n + 1):
        return 0  # no rows (an empty array may have no offsets, or none past the first)
    return _OFFSET.unpack_from(offsets, 4 * (first + n))[0] - _OFFSET.unpack_from(offsets, 4 * first)[0] + 4 * (n + 1)


def coalesce_runs(items: Iterable[Tuple[pa.RecordBatch, T]],
                  max_bytes: int = READ_BATCH_BYTES) -> Iterator[Tuple[pa.RecordBatch, List[T]]]:
    """Concatenate consecutive ``(batch, tag)`` items into batches of up to ``max_bytes`` (as
    :func:`batch_bytes` counts them); each result carries the tags of the batches in it, in
    order.

    Empty batches are dropped with their tags; a batch larger than ``max_bytes`` passes alone.
    """
    pending: List[pa.RecordBatch] = []
    tags: List[T] = []
    size = 0
    for batch, item_tag in items:
        if not batch.num_rows:
            continue
        nbytes = batch_bytes(batch)
        if pending and size + nbytes > max_bytes:
            yield (pending[0] if len(pending) == 1 else pa.concat_batches(pending)), tags
            pending, tags, size = [], [], 0
        pending.append(batch)
        tags.append(item_tag)
        size += nbytes
    if pending:
        yield (pending[0] if len(pending) == 1 else pa.concat_batches(pending)), tags


def coalesce_tagged(items: Iterable[Tuple[pa.RecordBatch, T]],
                    max_bytes: int = READ_BATCH_BYTES) -> Iterator[Tuple[pa.RecordBatch, T]]:
    """:func:`coalesce_runs` with the tag of the last batch in each result (a reader's position
    after it)."""
    return ((batch, tags[-1]) for batch, tags in coalesce_runs(items, max_bytes))


def coalesce_batches(batches: Iterable[pa.RecordBatch], max_bytes: int = READ_BATCH_BYTES) -> Iterator[pa.RecordBatch]:
    """:func:`coalesce_tagged` without tags: the batches alone."""
    return (batch for batch, _ in coalesce_tagged(((b, None) for b in batches), max_bytes))
