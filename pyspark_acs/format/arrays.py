"""Arrow arrays built from Python values without ``pyarrow``'s object conversion.

``pa.array(...)`` and ``pa.scalar(...)`` on Python objects import pandas the first time they
run (pyarrow checks every value against pandas' missing-value types). That import costs
0.5-3 s of CPU per process -- paid by every producer at its first flush and by every consumer
at its first message, so many consumers starting together fall seconds behind and fail over to
the durable store. The hot paths build their arrays here instead,
straight from buffers: no pandas, and no per-value conversion in pyarrow either.
"""

from __future__ import annotations

import struct
import sys
from array import array
from itertools import accumulate
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

__all__ = [
    "ConstantColumns",
    "binary_array",
    "int64_array",
    "position_array",
]

#: Largest total bytes of a ``pa.binary()`` array (its offsets are int32).
MAX_BINARY_BYTES = 2**31 - 1

_LITTLE = sys.byteorder == "little"


def _le(a: "array[int]") -> bytes:
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


def binary_array(values: Sequence[Any], what: str = "values") -> pa.BinaryArray:
    """A ``pa.binary()`` array of ``values`` (``bytes``-like, ``str`` as UTF-8, or ``None``).

    Raises
    ------
    TypeError
        A value of another type (names its position), or more than 2 GiB in all.
    """
    n = len(values)
    items = values
    validity: Optional[bytearray] = None
    if not all(type(v) is bytes for v in values):  # the common case needs no second list
        items = []
        for i, v in enumerate(values):
            if v is None:
                if validity is None:
                    validity = bytearray(b"\xff" * ((n + 7) // 8))
                validity[i >> 3] &= ~(1 << (i & 7)) & 0xFF
                items.append(b"")
            elif isinstance(v, str):
                items.append(v.encode("utf-8"))
            elif isinstance(v, (bytes, bytearray, memoryview)):
                items.append(bytes(v))
            else:
                raise TypeError(f"{what}[{i}] must be bytes, str or None, got {type(v).__name__}")
    if validity is not None and n & 7:
        validity[-1] &= (1 << (n & 7)) - 1  # padding bits zero, as Arrow writes them (the block CRC covers them)
    lengths = list(map(len, items))
    total = sum(lengths)
    if total > MAX_BINARY_BYTES:
        raise TypeError(f"{what}: {total} bytes in one batch, more than {MAX_BINARY_BYTES} (split it)")
    offsets = array("i", accumulate(lengths, initial=0))
    buffers = [None if validity is None else pa.py_buffer(bytes(validity)),
               pa.py_buffer(_le(offsets)), pa.py_buffer(b"".join(items))]
    return pa.Array.from_buffers(pa.binary(), n, buffers, null_count=-1 if validity is not None else 0)


def int64_array(values: Sequence[int], what: str = "timestamps") -> pa.Int64Array:
    """A ``pa.int64()`` array of Python ints (no nulls).

    Raises
    ------
    TypeError
        A value that is not an int in the int64 range.
    """
    try:
        raw = array("q", values)
    except (TypeError, OverflowError) as exc:
        raise TypeError(f"{what} must be ints (int64): {exc}") from exc
    return pa.Array.from_buffers(pa.int64(), len(raw), [None, pa.py_buffer(_le(raw))], null_count=0)


def constant_array(value: Any, type_: pa.DataType, n: int) -> pa.Array:
    """``n`` copies of one ``str`` (``pa.string()``) or ``int`` (``pa.int32()``/``pa.int64()``)."""
    if pa.types.is_string(type_):
        data = value.encode("utf-8")
        if len(data) * n < 2**31:  # int32 offsets
            # From buffers, not pa.repeat: the first compute call of a process was ~130 ms of a
            # joining consumer's first batch on a loaded machine (64 joining at once).
            offsets = np.arange(n + 1, dtype="<i4") * len(data)
            return pa.Array.from_buffers(type_, n, [None, pa.py_buffer(offsets), pa.py_buffer(data * n)],
                                         null_count=0)
        one = pa.Array.from_buffers(type_, 1, [None, pa.py_buffer(struct.pack("<ii", 0, len(data))),
                                                 pa.py_buffer(data)], null_count=0)
        return pa.repeat(one[0], n)
    if pa.types.is_int32(type_):
        return pa.Array.from_buffers(type_, n, [None, pa.py_buffer(struct.pack("<i", value) * n)], null_count=0)
    if pa.types.is_int64(type_):
        return pa.Array.from_buffers(type_, n, [None, pa.py_buffer(struct.pack("<q", value) * n)], null_count=0)
    raise TypeError(f"constant_array: unsupported type {type_}")


#: Rows a :class:`ConstantColumns` builds at first; it doubles when a batch needs more.
CONSTANT_ROWS = 4096


class ConstantColumns:
    """Columns that hold one value each (a reader's ``stream``, ``shard``, ``file``), handed
    out as zero-copy slices of arrays built once: a tailing reader hands out a batch per
    pushed block, and building the columns anew per batch (``pa.repeat`` three times) was a
    fifth of its decode work.

    Parameters
    ----------
    values : sequence of (value, pyarrow type)
        The columns' values and types (see :func:`constant_array`).
    """

    __slots__ = ("values", "_arrays", "_rows", "_last")

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = tuple(values)
        self._arrays: list = []
        self._rows = 0
        # The slices last handed out: a producer's blocks mostly hold the same number of
        # messages, and Arrow arrays are immutable, so the same slices serve the next block.
        self._last: Tuple[int, Tuple[pa.Array, ...]] = (-1, ())

    def take(self, n: int) -> Tuple[pa.Array, ...]:
        """The columns for ``n`` rows."""
        last = self._last
        if last[0] == n:
            return last[1]
        if n > self._rows or not self._arrays:
            rows = max(n, CONSTANT_ROWS, 2 * self._rows)
            self._arrays = [constant_array(v, t, rows) for v, t in self.values]
            self._rows = rows
        columns = tuple(a.slice(0, n) for a in self._arrays)
        self._last = (n, columns)
        return columns


#: Rows of one cached window of positions (:func:`position_array`): 32 KiB of int64 each.
POSITION_WINDOW_ROWS = 4096
#: Windows kept per process (1 MiB in all); past that the cache starts over.
POSITION_WINDOWS = 32
# Window number -> int64 array of that window's positions. Plain dict operations, each atomic
# under the GIL: two threads building the same window at once store equal arrays.
_position_windows: Dict[int, pa.Array] = {}


def position_array(first: int, n: int) -> pa.Array:
    """The int64 array ``first, first + 1, ..., first + n - 1`` (a block's message positions).

    A zero-copy slice of a cached window of consecutive positions when the run fits in one:
    building it per block (numpy's ``arange`` wrapped as a buffer) is the dearest single step of
    decoding a tailing reader's block on a cold CPU.
    """
    window, at = divmod(first, POSITION_WINDOW_ROWS)
    if at + n <= POSITION_WINDOW_ROWS and first >= 0:
        arr = _position_windows.get(window)
        if arr is None:
            if len(_position_windows) >= POSITION_WINDOWS:
                _position_windows.clear()
            arr = _position_windows[window] = _int64_run(window * POSITION_WINDOW_ROWS, POSITION_WINDOW_ROWS)
        return arr.slice(at, n)
    return _int64_run(first, n)


def _int64_run(first: int, n: int) -> pa.Array:
    # numpy's arange wrapped as a buffer without a copy: pyarrow.compute's cumulative_sum cost
    # more, and both it and pa.array(ndarray) import pandas on first use (see the module doc).
    # Read-only: a cached window is shared by every block sliced from it.
    run = np.arange(first, first + n, dtype=np.int64)
    run.flags.writeable = False
    return pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(run)], null_count=0)

