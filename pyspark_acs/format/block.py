"""The block: the unit a producer appends to a message file.

A block is a fixed 48-byte little-endian header followed by a columnar body, so that a
block decodes to a :class:`pyarrow.RecordBatch` by slicing one buffer, with no Python loop
over messages. The exact byte layout is documented in ``docs/format.md``:

======  ====  ===========  ==================================================================
offset  size  field        meaning
======  ====  ===========  ==================================================================
0       4     magic        ``b"ACSB"``
4       1     version      format version, currently 1
5       1     flags        bit 0: END_OF_FILE (a seal: the writer will append nothing more);
                           bit 1: HEADERS (the body ends with a headers section)
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
    value bytes       offsets[count] bytes (last section unless HEADERS: not padded)

With the HEADERS flag (Kafka-style message headers: a list of (string key, binary value)
pairs per message, ``m`` pairs in the block), the value bytes are padded and followed by::

    headers validity  ceil(count / 8) bytes (bit i clear = message i has no headers list)
    headers offsets   (count + 1) x int32, message i's pairs are [o[i], o[i+1])
    hkey offsets      (m + 1) x int32
    hvalue validity   ceil(m / 8) bytes
    hvalue offsets    (m + 1) x int32
    hkey bytes        UTF-8
    hvalue bytes      (last section: not padded)

Blocks without headers are byte for byte what they were before headers existed, so files
written before stay readable and files without headers stay readable by older readers.
"""

from __future__ import annotations

import struct
import sys
import time
from typing import Any, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from pyspark_acs.errors import ChecksumMismatchError, CorruptFileError, TruncatedBlockError
from pyspark_acs.format.arrays import binary_array, int64_array, position_array
from pyspark_acs.format.checksum import crc32

__all__ = [
    "BLOCK_SCHEMA",
    "BLOCK_SCHEMA_WITH_HEADERS",
    "BlockHeader",
    "DEFAULT_MAX_BLOCK_BYTES",
    "HEADER_SIZE",
    "MARK_MAGIC",
    "RECOVERY_SEAL_SIZE",
    "check_block_bodies",
    "body_intact",
    "check_body",
    "decode_block",
    "encode_block",
    "encode_mark",
    "encode_seal",
    "find_recovery_seal",
    "mark_body",
    "parse_header",
    "rebase_blocks",
    "scan_blocks",
    "timestamp_bounds",
    "timestamps_section",
]

MAGIC = b"ACSB"
FORMAT_VERSION = 1
HEADER_SIZE = 48
#: Largest message index (positions are int64): a block whose indexes would pass it is corrupt.
MAX_MESSAGE_INDEX = 2**63 - 1
#: Default upper bound on a block's body: Pravega's data frame size. A single larger
#: message still gets a block of its own.
DEFAULT_MAX_BLOCK_BYTES = 1024 * 1024
FLAG_END_OF_FILE = 0x01
#: The body ends with a headers section (see the module docstring).
FLAG_HEADERS = 0x02
_KNOWN_FLAGS = FLAG_END_OF_FILE | FLAG_HEADERS
_HEADER = struct.Struct("<4sBBHIIIIQqq")
_SEAL_BODY = struct.Struct("<Q")  # a recovery seal's body: void_from
assert _HEADER.size == HEADER_SIZE
#: Bytes of a recovery seal (:func:`encode_seal` with ``void_from``); a plain seal is a header.
RECOVERY_SEAL_SIZE = HEADER_SIZE + _SEAL_BODY.size
#: A mark's body starts with these bytes (a block of no messages whose body readers skip).
MARK_MAGIC = b"ACSMARK1"
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


_TIMESTAMP_TYPE = BLOCK_SCHEMA.field("timestamp").type  # built once: a new type object per block cost

#: Type of the ``headers`` column, as Spark's Kafka source has it (and as Spark names Arrow's
#: list items, so batches match a DataSource's declared ``array<struct<...>>`` exactly).
HEADERS_TYPE = pa.list_(pa.field("element", pa.struct([("key", pa.string()), ("value", pa.binary())])))
#: :data:`BLOCK_SCHEMA` with the message headers (``decode_block(..., headers=True)``).
BLOCK_SCHEMA_WITH_HEADERS = BLOCK_SCHEMA.append(pa.field("headers", HEADERS_TYPE))


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
        values = binary_array(values, what)  # raises TypeError naming the bad value
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
            timestamps = timestamps.fill_null(_now_us())
    else:
        try:
            timestamps = int64_array(timestamps)
        except TypeError:
            if not any(t is None for t in timestamps):
                raise
            now = _now_us()  # documented: nulls become now (looked for only when the fast path fails)
            timestamps = int64_array([now if t is None else t for t in timestamps])
    if len(timestamps) != count:
        raise ValueError(f"got {len(timestamps)} timestamps for {count} messages")
    if timestamps.offset:
        timestamps = pa.concat_arrays([timestamps])
    if timestamps.null_count:
        timestamps = timestamps.fill_null(_now_us())
    raw = timestamps.buffers()[1].slice(0, 8 * count).to_pybytes()
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        import array

        a = array.array("q", raw)
        a.byteswap()
        raw = a.tobytes()
    return raw


def _headers(headers: Any, count: int) -> Optional[pa.ListArray]:
    """Normalise per-message headers to an offset-0 :data:`HEADERS_TYPE` array, or None when no
    message has any (the block then has no headers section)."""
    if headers is None:
        return None
    if isinstance(headers, pa.ChunkedArray):
        headers = headers.combine_chunks()
    if not isinstance(headers, pa.Array):
        rows = []
        for h in headers:
            if h is None:
                rows.append(None)
                continue
            pairs = h.items() if isinstance(h, Mapping) else h
            rows.append([{"key": k, "value": v.encode() if isinstance(v, str) else v} for k, v in pairs])
        try:
            headers = pa.array(rows, type=HEADERS_TYPE)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise TypeError(f"headers must be (str key, bytes value) pairs per message: {exc}") from exc
    if len(headers) != count:
        raise ValueError(f"got {len(headers)} header lists for {count} messages")
    if headers.null_count == count:
        return None
    if not headers.type.equals(HEADERS_TYPE):
        try:
            headers = headers.cast(HEADERS_TYPE)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise TypeError(f"headers must be {HEADERS_TYPE}, got {headers.type}: {exc}") from exc
    headers = pa.concat_arrays([headers])  # offset 0, offsets from 0, children sliced to fit
    pairs = headers.flatten()  # the pairs the lists hold (not what a slice left out)
    if pairs.null_count or pairs.field("key").null_count:
        raise ValueError("every header needs a key (a null header or header key was given)")
    return headers


def _headers_section(headers: pa.ListArray, count: int) -> List[Union[bytes, pa.Buffer]]:
    list_offsets = headers.buffers()[1].slice(0, 4 * (count + 1)).to_pybytes()
    first, last = struct.unpack_from("<i", list_offsets, 0)[0], struct.unpack_from("<i", list_offsets, 4 * count)[0]
    if first:  # rebase (concat_arrays keeps the first offset at 0, but do not rely on it)
        offs = np.frombuffer(list_offsets, dtype="<i4") - first
        list_offsets = offs.astype("<i4").tobytes()
    pairs = headers.values.slice(first, last - first)
    hkeys = _binary(pairs.field("key"), "header keys")
    hvals = _binary(pairs.field("value"), "header values")
    m = len(hkeys)
    hkey_offsets, hkey_data = _offsets_and_data(hkeys, m)
    hval_offsets, hval_data = _offsets_and_data(hvals, m)
    if hkey_data.size > _MAX_SECTION_BYTES or hval_data.size > _MAX_SECTION_BYTES:
        raise ValueError("one block's header keys or values must stay below 2 GiB")
    return [_bitmap(headers, count), list_offsets, hkey_offsets, _bitmap(hvals, m), hval_offsets, hkey_data,
            hval_data]


def encode_block(
    values: Any,
    keys: Any = None,
    timestamps: Any = None,
    *,
    first_index: int = 0,
    headers: Any = None,
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
    headers : sequence or pyarrow list array, optional
        Per message, ``None`` or a list of ``(str key, bytes value)`` pairs (or a mapping), or an
        array of :data:`HEADERS_TYPE`. Without any, the block has no headers section.

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
    hs = _headers(headers, count)
    key_offsets, key_data = _offsets_and_data(ks, count)
    val_offsets, val_data = _offsets_and_data(vals, count)
    if key_data.size > _MAX_SECTION_BYTES or val_data.size > _MAX_SECTION_BYTES:
        raise ValueError("one block's keys or values must stay below 2 GiB")
    sections: List[Union[bytes, pa.Buffer]] = [ts, _bitmap(ks, count), _bitmap(vals, count), key_offsets,
                                               val_offsets, key_data, val_data]
    if hs is not None:
        sections += _headers_section(hs, count)
    parts: List[Union[bytes, pa.Buffer]] = []
    for part in sections[:-1]:
        parts.append(part)
        size = part.size if isinstance(part, pa.Buffer) else len(part)
        if size % 8:
            parts.append(b"\x00" * (8 - size % 8))
    parts.append(sections[-1])  # the last section is not padded
    body = b"".join(parts)
    first_ts = struct.unpack_from("<q", ts, 0)[0] if count else 0
    last_ts = struct.unpack_from("<q", ts, 8 * (count - 1))[0] if count else 0
    flags = FLAG_HEADERS if hs is not None else 0
    return _header(flags, count, body, first_index, first_ts, last_ts) + body


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


def encode_mark(first_index: int, payload: bytes) -> bytes:
    """A mark: a block of no messages (flags 0, ``count`` 0) whose body is :data:`MARK_MAGIC`
    and ``payload``. Readers of messages skip it as any block of no messages (they do not look
    at such a body); a writer records in it where something it did ends, in the bytes every
    copy of the file holds (the Spark sink: where each batch ends in a shard). The timestamps
    are 0, so the bytes depend only on ``first_index`` and ``payload``."""
    body = MARK_MAGIC + payload
    return _header(0, 0, body, first_index, 0, 0) + body


def mark_body(data: Union[bytes, memoryview], offset: int, header: BlockHeader) -> Optional[bytes]:
    """The payload of the mark at ``data[offset:]`` (its header parsed as ``header``, its body
    checked), or None when the block is not a mark."""
    if header.count or header.flags or header.body_len < len(MARK_MAGIC):
        return None
    start = offset + header.header_len
    body = bytes(data[start:start + header.body_len])
    return body[len(MARK_MAGIC):] if body.startswith(MARK_MAGIC) else None


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
            and body_intact(view, at, header)  # whole, and its checksum matches
            and seal_void_from(view, at, header, base + at) == void_from
        ):
            return at, header
        at = raw.find(MAGIC, at + 1)
    return None


def _header(flags: int, count: int, body: bytes, first_index: int, first_ts: int, last_ts: int) -> bytes:
    body_crc = crc32(body)
    raw = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, HEADER_SIZE, count, len(body), body_crc, 0,
                       first_index, first_ts, last_ts)
    header_crc = crc32(raw)
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
    if crc32(raw) != header_crc:
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


def body_intact(view: Union[bytes, memoryview], at: int, header: BlockHeader) -> bool:
    """Whether the body of the block at ``view[at:]`` (its header parsed as ``header``) is
    whole and matches the header's checksum: the one test of a block's body."""
    end = at + header.size
    return end <= len(view) and crc32(view[at + header.header_len : end]) == header.body_crc


def check_body(view: Union[bytes, memoryview], at: int, header: BlockHeader, *, path: str = "",
               position: int = 0) -> None:
    """:func:`body_intact`, raising :class:`ChecksumMismatchError` (naming ``path`` and the
    body's byte range, ``position`` being the block's) when the body does not match.
    The caller has checked that the body is within ``view``."""
    if not body_intact(view, at, header):
        raise ChecksumMismatchError(
            f"{path or '<buffer>'} at byte {position}: block body checksum mismatch "
            f"(bytes {position + header.header_len}..{position + header.size})",
            path=path,
            position=position,
        )


def decode_block(
    data: Union[bytes, memoryview, pa.Buffer],
    offset: int = 0,
    *,
    path: str = "",
    position: Optional[int] = None,
    verify: bool = True,
    headers: bool = False,
    header: Optional[BlockHeader] = None,
    prefix: Sequence[pa.Array] = (),
    schema: Optional[pa.Schema] = None,
) -> Tuple[BlockHeader, pa.RecordBatch]:
    """Decode the block at ``data[offset:]`` into a RecordBatch of :data:`BLOCK_SCHEMA`
    (:data:`BLOCK_SCHEMA_WITH_HEADERS` with ``headers``: null lists for a block without any).

    The arrays share memory with ``data``: no copy and no per-message Python work.
    ``header``: the block's header as :func:`parse_header` (or :func:`scan_blocks`) already
    parsed and verified it at this offset; it is not parsed again. ``prefix``: columns of
    ``header.count`` rows put before the block's own, ``schema`` then being the result's (a
    reader's stream, shard and file columns: one RecordBatch per block, not two).

    Raises
    ------
    CorruptFileError
        Bad header, body checksum mismatch (:class:`ChecksumMismatchError`), a body that runs
        past the end of ``data`` (:class:`TruncatedBlockError`) or inconsistent sections.
    """
    pos = offset if position is None else position
    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    view = memoryview(buf)
    if header is None:
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
    if verify:
        check_body(view, offset, header, path=path, position=pos)
    return header, _decode_body(buf, start, header, path, pos, headers, prefix, schema)


def _decode_body(buf: pa.Buffer, start: int, h: BlockHeader, path: str, pos: int,
                 with_headers: bool = False, prefix: Sequence[pa.Array] = (),
                 schema: Optional[pa.Schema] = None) -> pa.RecordBatch:
    n = h.count
    if schema is None:
        schema = BLOCK_SCHEMA_WITH_HEADERS if with_headers else BLOCK_SCHEMA
    if not 0 <= h.first_index <= MAX_MESSAGE_INDEX - n:
        # Positions are int64: an index past 2**63 - 1 would overflow or wrap negative.
        raise CorruptFileError(
            f"{path or '<buffer>'} at byte {pos}: block first_index {h.first_index} with {n} messages is out of "
            f"range (0..{MAX_MESSAGE_INDEX})", path=path, position=pos)
    if n == 0:  # a seal or an empty block: nothing to slice (a seal's body is empty)
        return pa.RecordBatch.from_arrays([pa.nulls(0, f.type) for f in schema], schema=schema)
    if len(prefix) + len(BLOCK_SCHEMA) + with_headers != len(schema):
        raise ValueError(f"decode_block: {len(prefix)} prefix columns do not fit schema {schema}")
    at = start
    end = start + h.body_len

    def take(size: int, pad: bool = True) -> pa.Buffer:
        nonlocal at
        if size < 0 or at + size > end:
            raise CorruptFileError(
                f"{path or '<buffer>'} at byte {pos}: block sections exceed its body length"
                + (f" (a section of {size} bytes)" if size < 0 else ""), path=path, position=pos
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
    has_headers = bool(h.flags & FLAG_HEADERS)
    val_data = take(val_len, pad=has_headers)
    columns: List[pa.Array] = []
    try:
        keys = pa.Array.from_buffers(pa.binary(), n, [key_valid, key_offsets, key_data])
        values = pa.Array.from_buffers(pa.binary(), n, [val_valid, val_offsets, val_data])
        if n:
            keys.validate(full=True)
            values.validate(full=True)
        if with_headers and has_headers:
            list_valid = take((n + 7) // 8)
            list_offsets = take(4 * (n + 1))
            m = struct.unpack_from("<i", list_offsets, 4 * n)[0]
            if m < 0:
                raise ValueError(f"negative header count {m}")
            hkey_offsets = take(4 * (m + 1))
            hval_valid = take((m + 7) // 8)
            hval_offsets = take(4 * (m + 1))
            for name, offs in (("headers", list_offsets), ("header key", hkey_offsets), ("header value", hval_offsets)):
                if struct.unpack_from("<i", offs, 0)[0] != 0:
                    raise ValueError(f"{name} offsets do not start at 0")
            hkey_data = take(struct.unpack_from("<i", hkey_offsets, 4 * m)[0])
            hval_data = take(struct.unpack_from("<i", hval_offsets, 4 * m)[0], pad=False)
            pairs = pa.StructArray.from_arrays(
                [pa.Array.from_buffers(pa.string(), m, [None, hkey_offsets, hkey_data]),
                 pa.Array.from_buffers(pa.binary(), m, [hval_valid, hval_offsets, hval_data])],
                fields=list(HEADERS_TYPE.value_type),
            )
            headers = pa.Array.from_buffers(HEADERS_TYPE, n, [list_valid, list_offsets], children=[pairs])
            headers.validate(full=True)
            columns.append(headers)
        elif with_headers:
            columns.append(pa.nulls(n, HEADERS_TYPE))
    except (pa.ArrowException, ValueError, IndexError, OverflowError, struct.error) as exc:
        # Hostile offsets (negative, past the data) surface as Arrow errors: translate them here.
        raise CorruptFileError(
            f"{path or '<buffer>'} at byte {pos}: inconsistent block body: {exc}", path=path, position=pos
        ) from exc
    timestamps = pa.Array.from_buffers(_TIMESTAMP_TYPE, n, [None, ts])
    positions = position_array(h.first_index, n)
    return pa.RecordBatch.from_arrays([*prefix, positions, timestamps, keys, values, *columns], schema=schema)


def timestamps_section(header: BlockHeader) -> Tuple[int, int]:
    """Where a block's message timestamps lie: ``(start, length)`` in bytes from the block's
    first byte (the first body section: ``count`` x int64 µs). A reader that prunes blocks by
    time reads these bytes alone, not the block's keys and values."""
    return header.header_len, 8 * header.count


def timestamp_bounds(section: Union[bytes, memoryview, pa.Buffer], header: BlockHeader, *, path: str = "",
                     position: int = 0) -> Tuple[int, int]:
    """The smallest and largest message timestamp (µs) of a block, from its timestamps section
    (see :func:`timestamps_section`). The header's ``first_ts`` / ``last_ts`` are the first and
    last messages' stamps, not bounds: a writer may stamp messages out of order.

    Raises
    ------
    TruncatedBlockError
        When ``section`` is shorter than the block's ``count`` timestamps.
    """
    _, size = timestamps_section(header)
    if len(section) < size:
        raise TruncatedBlockError(
            f"{path or '<buffer>'} at byte {position}: timestamps section of {size} bytes, got {len(section)}",
            path=path,
            position=position,
        )
    if not header.count:
        return 0, 0
    stamps = np.frombuffer(section, dtype="<i8", count=header.count)
    return int(stamps.min()), int(stamps.max())


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


def check_block_bodies(data: Union[bytes, memoryview], *, path: str = "", base: int = 0) -> Tuple[int, int]:
    """Verify the body checksum of every complete block :func:`scan_blocks` finds in ``data``
    (a copy being checked against its header checksums, e.g. a tiered upload).

    Returns ``(blocks, end)``: blocks verified and the offset after the last one (a torn block
    and what follows it are not walked: the caller compares whole-file checksums too).

    Raises
    ------
    ChecksumMismatchError
        A block body does not match its header's checksum (names the byte position).
    """
    view = memoryview(data)
    blocks = end = 0
    try:
        for at, header in scan_blocks(view, path=path, base=base):
            check_body(view, at, header, path=path, position=base + at)
            blocks += 1
            end = at + header.size
    except ChecksumMismatchError:
        raise
    except CorruptFileError:
        pass  # a torn block voided by a recovery seal: not a block
    return blocks, end


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
        out[at + 20 : at + 24] = struct.pack("<I", crc32(raw))
        out[at + 24 : at + HEADER_SIZE] = raw[24:]
        index += header.count
    return bytes(out), index - first_index
