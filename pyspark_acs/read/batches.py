"""The Arrow batches readers hand out: consecutive blocks coalesced (DESIGN.md section 5).

A block becomes one Arrow batch when it is decoded (no copy). Blocks are often small (a
producer's linger flush of a few dozen messages), and whoever takes the batches pays per
batch: the JVM for a Spark read task, the user's code for a Consumer. So consecutive blocks
read together are concatenated into batches of up to :data:`READ_BATCH_BYTES` (one copy, in
Arrow: no per-row Python). A caught-up Consumer reads one block at a time and hands it out as
it is; one that is behind hands out its backlog in a few large batches.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Tuple, TypeVar

import pyarrow as pa

__all__ = ["READ_BATCH_BYTES", "coalesce_batches", "coalesce_tagged"]

#: Bytes of one Arrow batch handed out, at most (a single larger block is a batch of its own).
#: Measured with Spark's ceiling probe (benchmarks/spark_source.py): batches of ~90 rows ran at
#: about half the rate of batches of 1000 rows.
READ_BATCH_BYTES = 4 * 1024 * 1024

T = TypeVar("T")


def coalesce_tagged(items: Iterable[Tuple[pa.RecordBatch, T]],
                    max_bytes: int = READ_BATCH_BYTES) -> Iterator[Tuple[pa.RecordBatch, T]]:
    """Concatenate consecutive ``(batch, tag)`` items into batches of up to ``max_bytes``; each
    result carries the tag of the last batch in it (a reader's position after it).

    Empty batches are dropped (their tags with them, unless a later batch joins theirs); a
    batch larger than ``max_bytes`` passes alone.
    """
    pending: List[pa.RecordBatch] = []
    tag = None
    size = 0
    for batch, item_tag in items:
        if not batch.num_rows:
            continue
        nbytes = batch.nbytes
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
