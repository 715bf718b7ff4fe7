"""The block: the unit a producer appends to a message file.

A block is a fixed 48-byte little-endian header followed by a columnar body, so that a
block decodes to a :class:`pyarrow.RecordBatch` by slicing one buffer, with no Python loop
over messages. The exact byte layout is documented in ``docs/format.md``:

======  ====  ===========  ==================================================================
offset  size  field        meaning
======  ====  ===========  ==================================================================
0       4     magic        ``b"ACSB"``
4       1     version      format version, currently 1
5       1     flags        bit 0: END_OF_FILE (a seal: the writer will append nothing more)
6       2     header_len   48; readers skip unknown trailing header bytes of later versions
8       4     count        number of messages
12      4     body_len     bytes of body following the header
16      4     body_crc     zlib.crc32 of the body
20      4     header_crc   zlib.crc32 of the header with this field set to zero
24      8     first_index  index in the file of the block's first message (message position)
32      8     first_ts     producer timestamp of the first message, µs since the epoch (UTC)
40      8     last_ts      producer timestamp of the last message, µs since the epoch (UTC)
======  ====  ===========  ==================================================================

Body, each section zero-padded to a multiple of 8 bytes::

    timestamps        count x int64 (µs since the epoch, UTC)
    key validity      ceil(count / 8) bytes, Arrow bitmap (bit i set = key i is not null)
    value validity    ceil(count / 8) bytes
    key offsets       (count + 1) x int32, Arrow binary offsets, starting at 0
    value offsets     (count + 1) x int32
    key bytes         offsets[count] bytes
    value bytes       offsets[count] bytes (last section: not padded)
"""

from __future__ import annotations

import struct
import sys
import time
import zlib
from typing import Any, Iterator, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pyspark_acs.errors import ChecksumMismatchError, CorruptFileError, TruncatedBlockError

__all__ = [
    "BLOCK_SCHEMA",
    "DEFAULT_MAX_BLOCK_BYTES",
    "FLAG_END_OF_FILE",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "BlockHeader",
    "decode_block",
    "encode_block",
    "encode_seal",
    "find_recovery_seal",
    "parse_header",
    "rebase_blocks",
    "scan_blocks",
    "seal_void_from",
]

MAGIC = b"ACSB"
FORMAT_VERSION = 1
HEADER_SIZE = 48
#: Default upper bound on a block's body: Pravega's data frame size. A single larger
#: message still gets a block of its own.
DEFAULT_MAX_BLOCK_BYTES = 1024 * 1024
FLAG_END_OF_FILE = 0x01
_KNOWN_FLAGS = FLAG_END_OF_FILE
_HEADER = struct.Struct("<4sBBHIIIIQqq")
_SEAL_BODY = struct.Struct("<Q")  # a recovery seal's body: void_from
assert _HEADER.size == HEADER_SIZE
# Offsets are int32 as in Arrow's binary type: one block's keys or values stay below 2 GiB.
_MAX_SECTION_BYTES = 2**31 - 1
_LITTLE = sys.byteorder == "little"

#: Schema of a decoded block (the consumer adds stream, shard, file in front).
BLOCK_SCHEMA = pa.schema(
    [
        ("position", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("key", pa.binary()),
        ("value", pa.binary()),
    ]
)


class BlockHeader(NamedTuple):
    """A parsed block header."""

    flags: int
    header_len: int
    count: int
    body_len: int
    body_crc: int
    first_index: int
    first_ts: int
    last_ts: int

    @property
    def size(self) -> int:
        """Total bytes of the block, header included."""
        return self.header_len + self.body_len

    @property
    def sealed(self) -> bool:
        """True for an END_OF_FILE block: the file is finished."""
        return bool(self.flags & FLAG_END_OF_FILE)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _now_us() -> int:
    return time.time_ns() // 1000


def _binary(values: Any, what: str) -> pa.BinaryArray:
    """Normalise ``values`` (list of bytes/str/None, or an Arrow array) to an offset-0 binary array."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not isinstance(values, pa.Array):
        try:
            values = pa.array(values, type=pa.binary())
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise TypeError(f"{what} must be bytes, str or None: {exc}") from exc
    if not pa.types.is_binary(values.type):
        if not (
            pa.types.is_string(values.type)
            or pa.types.is_large_string(values.type)
            or pa.types.is_large_binary(values.type)
            or pa.types.is_null(values.type)
        ):
            raise TypeError(f"{what} must be a binary or string column, got {values.type}")
        values = values.cast(pa.binary())
    if values.offset:
        values = pa.concat_arrays([values])  # re-bases offsets and validity to offset 0
    return values


def _bitmap(arr: pa.Array, count: int) -> bytes:
    nbytes = (count + 7) // 8
    validity = arr.buffers()[0]
    if validity is None:
        return b"\xff" * nbytes
    return validity.to_pybytes()[:nbytes]


def _offsets_and_data(arr: pa.BinaryArray, count: int) -> Tuple[bytes, pa.Buffer]:
    bufs = arr.buffers()
    offsets = bufs[1].slice(0, 4 * (count + 1)) if count else None
    if offsets is None:
        return b"\x00\x00\x00\x00", pa.py_buffer(b"")
    end = struct.unpack_from("<i", offsets, 4 * count)[0]
    data = bufs[2].slice(0, end) if bufs[2] is not None else pa.py_buffer(b"")
    return offsets.to_pybytes(), data


def _timestamps(timestamps: Any, count: int) -> bytes:
    if timestamps is None:
        return struct.pack("<q", _now_us()) * count
    if isinstance(timestamps, pa.ChunkedArray):
        timestamps = timestamps.combine_chunks()
    if isinstance(timestamps, pa.Array):
        if pa.types.is_timestamp(timestamps.type):
            timestamps = timestamps.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
        elif not pa.types.is_int64(timestamps.type):
            timestamps = timestamps.cast(pa.int64())
        if timestamps.null_count:
            timestamps = pc.fill_null(timestamps, _now_us())
    else:
        timestamps = pa.array(timestamps, type=pa.int64())
    if len(timestamps) != count:
        raise ValueError(f"got {len(timestamps)} timestamps for {count} messages")
    if timestamps.offset:
        timestamps = pa.concat_arrays([timestamps])
    if timestamps.null_count:
        timestamps = pc.fill_null(timestamps, _now_us())
    raw = timestamps.buffers()[1].slice(0, 8 * count).to_pybytes()
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        import array

        a = array.array("q", raw)
        a.byteswap()
        raw = a.tobytes()
    return raw


def encode_block(
    values: Any,
    keys: Any = None,
    timestamps: Any = None,
    *,
    first_index: int = 0,
) -> bytes:
    """Encode messages into one block.

    Parameters
    ----------
    values : sequence of bytes/str/None, or a pyarrow binary/string array
        Message values.
    keys : same, optional
        Message keys; ``None`` means no key for every message.
    timestamps : sequence of int (µs since the epoch) or a pyarrow timestamp/int64 array, optional
        Producer timestamps; default now. Nulls become now.
    first_index : int
        The index in the file of the first message (its ``position``).

    Returns
    -------
    bytes
        Header and body.
    """
    vals = _binary(values, "values")
    count = len(vals)
    if keys is None:
        ks = pa.nulls(count, pa.binary())
    else:
        ks = _binary(keys, "keys")
        if len(ks) != count:
            raise ValueError(f"got {len(ks)} keys for {count} values")
    ts = _timestamps(timestamps, count)
    key_offsets, key_data = _offsets_and_data(ks, count)
    val_offsets, val_data = _offsets_and_data(vals, count)
    if key_data.size > _MAX_SECTION_BYTES or val_data.size > _MAX_SECTION_BYTES:
        raise ValueError("one block's keys or values must stay below 2 GiB")
    parts: List[Union[bytes, pa.Buffer]] = []
    for part in (ts, _bitmap(ks, count), _bitmap(vals, count), key_offsets, val_offsets, key_data):
        parts.append(part)
        size = part.size if isinstance(part, pa.Buffer) else len(part)
        if size % 8:
            parts.append(b"\x00" * (8 - size % 8))
    parts.append(val_data)
    body = b"".join(parts)
    first_ts = struct.unpack_from("<q", ts, 0)[0] if count else 0
    last_ts = struct.unpack_from("<q", ts, 8 * (count - 1))[0] if count else 0
    return _header(0, count, body, first_index, first_ts, last_ts) + body


def encode_seal(first_index: int = 0, void_from: Optional[int] = None) -> bytes:
    """An END_OF_FILE block: no messages; tells readers the file is finished.

    Parameters
    ----------
    first_index : int
        Message index after the file's last message.
    void_from : int, optional
        For a recovery seal (a writer taking a shard over seals its predecessor's file at
        that file's durable length): the byte where the predecessor's last complete block
        ends. Bytes ``[void_from, seal position)`` are a block the crashed writer never
        finished; readers skip them. The body is then 8 bytes: ``void_from`` as uint64.
    """
    body = b"" if void_from is None else _SEAL_BODY.pack(void_from)
    return _header(FLAG_END_OF_FILE, 0, body, first_index, 0, 0) + body


def seal_void_from(data: Union[bytes, memoryview], offset: int, header: BlockHeader, position: int) -> int:
    """Where the valid bytes before the seal at ``data[offset:]`` end (its own ``position``
    for a plain seal; ``void_from`` for a recovery seal after a torn block)."""
    if header.body_len >= _SEAL_BODY.size:
        return _SEAL_BODY.unpack_from(data, offset + header.header_len)[0]
    return position


def find_recovery_seal(
    data: Union[bytes, memoryview], void_from: int, *, base: int, path: str = ""
) -> Optional[Tuple[int, BlockHeader]]:
    """Find the recovery seal that voids ``[void_from, seal)``: ``(offset in data, header)``.

    ``data`` holds the file's bytes from ``base`` (= ``void_from``, where a block is torn).
    Every occurrence of the magic is tried; only a seal whose header and body checksums hold
    and whose ``void_from`` equals ``void_from`` counts, so bytes of the torn block cannot be
    taken for it. ``None`` when there is none (yet).
    """
    view = memoryview(data) if not isinstance(data, memoryview) else data
    raw = bytes(view)
    at = raw.find(MAGIC, 1)
    while at != -1:
        try:
            header = parse_header(view, at, path=path, position=base + at)
        except CorruptFileError:
            header = None
        if (
            header is not None
            and header.sealed
            and at + header.size <= len(view)
            and zlib.crc32(view[at + header.header_len : at + header.size]) == header.body_crc
            and seal_void_from(view, at, header, base + at) == void_from
        ):
            return at, header
        at = raw.find(MAGIC, at + 1)
    return None


def _header(flags: int, count: int, body: bytes, first_index: int, first_ts: int, last_ts: int) -> bytes:
    body_crc = zlib.crc32(body)
    raw = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, HEADER_SIZE, count, len(body), body_crc, 0,
                       first_index, first_ts, last_ts)
    header_crc = zlib.crc32(raw)
    return raw[:20] + struct.pack("<I", header_crc) + raw[24:]


def parse_header(data: Union[bytes, memoryview], offset: int = 0, *, path: str = "", position: int = 0) -> BlockHeader:
    """Parse and verify the header at ``data[offset:]``.

    ``path`` and ``position`` (the header's byte position in the file) only serve error messages.

    Raises
    ------
    CorruptFileError
        Wrong magic, unknown version or flags, or a header checksum mismatch.
    """
    if len(data) - offset < HEADER_SIZE:
        raise TruncatedBlockError(
            f"{path or '<buffer>'}: truncated block header at byte {position}: "
            f"{len(data) - offset} of {HEADER_SIZE} bytes",
            path=path,
            position=position,
        )
    magic, version, flags, header_len, count, body_len, body_crc, header_crc, first_index, first_ts, last_ts = (
        _HEADER.unpack_from(data, offset)
    )
    where = f"{path or '<buffer>'} at byte {position}"
    if magic != MAGIC:
        raise CorruptFileError(
            f"{where}: not a block (magic {bytes(magic)!r}, expected {MAGIC!r})", path=path, position=position
        )
    raw = bytearray(data[offset : offset + HEADER_SIZE])
    raw[20:24] = b"\x00\x00\x00\x00"
    if zlib.crc32(raw) != header_crc:
        raise ChecksumMismatchError(f"{where}: block header checksum mismatch", path=path, position=position)
    if version != FORMAT_VERSION or header_len < HEADER_SIZE:
        raise CorruptFileError(
            f"{where}: unsupported block format version {version} (header {header_len} bytes); "
            f"this pyspark_acs reads version {FORMAT_VERSION}",
            path=path,
            position=position,
        )
    if flags & ~_KNOWN_FLAGS:
        raise CorruptFileError(f"{where}: unknown block flags {flags:#x}", path=path, position=position)
    return BlockHeader(flags, header_len, count, body_len, body_crc, first_index, first_ts, last_ts)


def decode_block(
    data: Union[bytes, memoryview, pa.Buffer],
    offset: int = 0,
    *,
    path: str = "",
    position: Optional[int] = None,
    verify: bool = True,
) -> Tuple[BlockHeader, pa.RecordBatch]:
    """Decode the block at ``data[offset:]`` into a RecordBatch of :data:`BLOCK_SCHEMA`.

    The arrays share memory with ``data``: no copy and no per-message Python work.

    Raises
    ------
    CorruptFileError
        Bad header, body checksum mismatch (:class:`ChecksumMismatchError`), a body that runs
        past the end of ``data`` (:class:`TruncatedBlockError`) or inconsistent sections.
    """
    pos = offset if position is None else position
    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    view = memoryview(buf)
    header = parse_header(view, offset, path=path, position=pos)
    start = offset + header.header_len
    end = start + header.body_len
    if end > len(view):
        raise TruncatedBlockError(
            f"{path or '<buffer>'} at byte {pos}: block body of {header.body_len} bytes runs past the "
            f"end of the data ({len(view) - start} bytes follow the header)",
            path=path,
            position=pos,
        )
    if verify and zlib.crc32(view[start:end]) != header.body_crc:
        raise ChecksumMismatchError(
            f"{path or '<buffer>'} at byte {pos}: block body checksum mismatch "
            f"(bytes {start - offset + pos}..{end - offset + pos})",
            path=path,
            position=pos,
        )
    return header, _decode_body(buf, start, header, path, pos)


def _decode_body(buf: pa.Buffer, start: int, h: BlockHeader, path: str, pos: int) -> pa.RecordBatch:
    n = h.count
    if n == 0:  # a seal or an empty block: nothing to slice (a seal's body is empty)
        return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in BLOCK_SCHEMA], schema=BLOCK_SCHEMA)
    at = start
    end = start + h.body_len

    def take(size: int, pad: bool = True) -> pa.Buffer:
        nonlocal at
        if at + size > end:
            raise CorruptFileError(
                f"{path or '<buffer>'} at byte {pos}: block sections exceed its body length", path=path, position=pos
            )
        piece = buf.slice(at, size)
        at += _pad8(size) if pad else size
        return piece

    ts = take(8 * n)
    key_valid = take((n + 7) // 8)
    val_valid = take((n + 7) // 8)
    key_offsets = take(4 * (n + 1))
    val_offsets = take(4 * (n + 1))
    key_len = struct.unpack_from("<i", key_offsets, 4 * n)[0] if n else 0
    val_len = struct.unpack_from("<i", val_offsets, 4 * n)[0] if n else 0
    key_data = take(key_len)
    val_data = take(val_len, pad=False)
    try:
        keys = pa.Array.from_buffers(pa.binary(), n, [key_valid, key_offsets, key_data])
        values = pa.Array.from_buffers(pa.binary(), n, [val_valid, val_offsets, val_data])
        if n:
            keys.validate(full=True)
            values.validate(full=True)
    except (pa.ArrowInvalid, ValueError) as exc:
        raise CorruptFileError(
            f"{path or '<buffer>'} at byte {pos}: inconsistent block body: {exc}", path=path, position=pos
        ) from exc
    timestamps = pa.Array.from_buffers(pa.timestamp("us", tz="UTC"), n, [None, ts])
    positions = _positions(h.first_index, n)
    return pa.RecordBatch.from_arrays([positions, timestamps, keys, values], schema=BLOCK_SCHEMA)


def _positions(first: int, n: int) -> pa.Array:
    # numpy's arange, wrapped as a buffer without a copy: pyarrow.compute's cumulative_sum cost
    # more per block, and both it and pa.array(ndarray) import pandas on first use (half a
    # second of every consumer process's CPU).
    return pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(np.arange(first, first + n, dtype=np.int64))])


def scan_blocks(
    data: Union[bytes, memoryview, pa.Buffer], *, path: str = "", base: int = 0, final: bool = False
) -> Iterator[Tuple[int, BlockHeader]]:
    """Yield ``(offset, header)`` of each complete block in ``data`` (header and body present).

    Stops silently before an incomplete trailing block unless ``final`` is true, in which case
    a trailing partial block raises :class:`TruncatedBlockError`. ``base`` is the file
    position of ``data[0]`` (for error messages).
    """
    view = memoryview(data) if not isinstance(data, memoryview) else data
    at = 0
    while at < len(view):
        if len(view) - at < HEADER_SIZE:
            if final:
                raise TruncatedBlockError(
                    f"{path or '<buffer>'}: truncated block header at byte {base + at} "
                    f"({len(view) - at} of {HEADER_SIZE} bytes before the end of the file)",
                    path=path,
                    position=base + at,
                )
            return
        header = parse_header(view, at, path=path, position=base + at)
        if at + header.size > len(view):
            if final:
                raise TruncatedBlockError(
                    f"{path or '<buffer>'}: block at byte {base + at} claims {header.size} bytes but the file "
                    f"ends {len(view) - at} bytes after it",
                    path=path,
                    position=base + at,
                )
            return
        yield at, header
        at += header.size


def rebase_blocks(data: bytes, first_index: int, *, path: str = "") -> Tuple[bytes, int]:
    """Rewrite the ``first_index`` of every block in ``data`` so they continue a file at
    message index ``first_index``; return the new bytes and the number of messages.

    Used when blocks encoded elsewhere (staged by Spark tasks) are appended to a message
    file. Bodies are untouched; each header's checksum is recomputed. The result depends only
    on ``data`` and ``first_index``, so a resumed append writes the same bytes again.
    """
    out = bytearray(data)
    index = first_index
    for at, header in scan_blocks(memoryview(data), path=path, final=True):
        raw = _HEADER.pack(MAGIC, FORMAT_VERSION, header.flags, header.header_len, header.count, header.body_len,
                           header.body_crc, 0, index, header.first_ts, header.last_ts)
        out[at : at + 20] = raw[:20]
        out[at + 20 : at + 24] = struct.pack("<I", zlib.crc32(raw))
        out[at + 24 : at + HEADER_SIZE] = raw[24:]
        index += header.count
    return bytes(out), index - first_index
