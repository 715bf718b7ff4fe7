"""The Arrow batches readers hand out: consecutive blocks coalesced (DESIGN.md section 5).

A block becomes one Arrow batch when it is decoded (no copy). Blocks are often small (a
producer's linger flush of a few dozen messages), and whoever takes the batches pays per
batch: the JVM for a Spark read task, the user's code for a Consumer. So consecutive blocks
read together are concatenated into batches of up to :data:`READ_BATCH_BYTES` (one copy, in
Arrow: no per-row Python). A caught-up Consumer reads one block at a time and hands it out as
it is; one that is behind hands out its backlog in a few large batches.
"""

from __future__ import annotations

import struct
from typing import Iterable, Iterator, List, Tuple, TypeVar

import pyarrow as pa

from pyspark_acs.format.block import BLOCK_SCHEMA_WITH_HEADERS

__all__ = ["READ_BATCH_BYTES", "ROW_BYTES", "batch_bytes", "coalesce_batches", "coalesce_tagged"]

#: Bytes of one Arrow batch handed out, at most (a single larger block is a batch of its own).
#: Measured with Spark's ceiling probe (benchmarks/spark_source.py): batches of ~90 rows ran at
#: about half the rate of batches of 1000 rows.
READ_BATCH_BYTES = 4 * 1024 * 1024

#: What :func:`batch_bytes` counts per row for the columns besides ``key`` and ``value`` (the
#: reader's ``stream``, ``shard`` and ``file``, ``position``, ``timestamp``): a bound on a
#: batch of many small messages, not an exact figure.
ROW_BYTES = 64

T = TypeVar("T")


def batch_bytes(batch: pa.RecordBatch) -> int:
    """The size :func:`coalesce_tagged` caps (bytes): the ``key`` and ``value`` columns' bytes
    and offsets, read from their offsets, the ``headers`` column's buffers when there is one,
    plus :data:`ROW_BYTES` per row for the others; a batch without binary ``key`` and ``value``
    columns counts its ``nbytes``.

    Not ``RecordBatch.nbytes``: that walks every column's buffers to count shared ones once,
    ~20 us a block here (the reader's constant columns are slices of one array): 2.5-2.8 ms
    for a backlog of 200 blocks, whose concat took 0.6-1.3 ms. This costs ~2.5 us a block
    and is exact for slices too.
    """
    schema = batch.schema
    value = schema.get_field_index("value")
    key = schema.get_field_index("key")
    if value < 0 or key < 0:
        return batch.nbytes
    values, keys = batch.column(value), batch.column(key)
    if values.type.id != _BINARY_ID or keys.type.id != _BINARY_ID:
        return batch.nbytes
    size = _binary_bytes(values) + _binary_bytes(keys) + ROW_BYTES * batch.num_rows
    headers = schema.get_field_index(_HEADERS)
    if headers >= 0:
        # Their buffers whole: exact for a decoded block, more for a slice (a smaller batch).
        size += batch.column(headers).get_total_buffer_size()
    return size


_BINARY_ID = pa.binary().id
_HEADERS = BLOCK_SCHEMA_WITH_HEADERS.names[-1]  # the messages' headers (include_headers)
_OFFSET = struct.Struct("<i")


def _binary_bytes(array: pa.Array) -> int:
    """Data and offset bytes of a ``binary`` array's rows (slices count only their own rows)."""
    first, n = array.offset, len(array)
    offsets = array.buffers()[1]
    if offsets is None:  # an empty array may have none
        return 0
    return _OFFSET.unpack_from(offsets, 4 * (first + n))[0] - _OFFSET.unpack_from(offsets, 4 * first)[0] + 4 * (n + 1)


def coalesce_tagged(items: Iterable[Tuple[pa.RecordBatch, T]],
                    max_bytes: int = READ_BATCH_BYTES) -> Iterator[Tuple[pa.RecordBatch, T]]:
    """Concatenate consecutive ``(batch, tag)`` items into batches of up to ``max_bytes`` (as
    :func:`batch_bytes` counts them); each result carries the tag of the last batch in it (a
    reader's position after it).

    Empty batches are dropped (their tags with them, unless a later batch joins theirs); a
    batch larger than ``max_bytes`` passes alone.
    """
    pending: List[pa.RecordBatch] = []
    tag = None
    size = 0
    for batch, item_tag in items:
        if not batch.num_rows:
            continue
        nbytes = batch_bytes(batch)
        if pending and size + nbytes > max_bytes:
            yield (pending[0] if len(pending) == 1 else pa.concat_batches(pending)), tag
            pending, size = [], 0
        pending.append(batch)
        tag = item_tag
        size += nbytes
    if pending:
        yield (pending[0] if len(pending) == 1 else pa.concat_batches(pending)), tag


def coalesce_batches(batches: Iterable[pa.RecordBatch], max_bytes: int = READ_BATCH_BYTES) -> Iterator[pa.RecordBatch]:
    """:func:`coalesce_tagged` without tags: the batches alone."""
    return (batch for batch, _ in coalesce_tagged(((b, None) for b in batches), max_bytes))
