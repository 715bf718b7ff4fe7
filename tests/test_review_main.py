"""Hostile review of main's 83c3483 (Arrow arrays from buffers) and 9d04c43 (chunk reads in
pieces, push sender wait)."""

from __future__ import annotations

import time

import pyarrow as pa

from pyspark_acs.format.block import decode_block, encode_block


def test_encode_block_still_turns_null_timestamps_into_now():
    """encode_block documents ``timestamps`` as a sequence of ints in which "Nulls become
    now"; before 83c3483 a Python list holding None was accepted (pa.array made it a null,
    filled with now). The buffer-built int64 array must keep that, not raise TypeError."""
    before = time.time_ns() // 1000
    block = encode_block([b"a", b"b", b"c"], timestamps=[5, None, 7])
    after = time.time_ns() // 1000
    _, batch = decode_block(block)
    stamps = batch.column("timestamp").cast(pa.int64()).to_pylist()
    assert stamps[0] == 5 and stamps[2] == 7 and before <= stamps[1] <= after
