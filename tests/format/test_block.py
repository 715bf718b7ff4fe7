"""The block format: encode/decode round trips and clear errors on bad bytes."""

from __future__ import annotations

import struct
import time
import zlib

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_acs.format.block import (
    BLOCK_SCHEMA,
    FLAG_END_OF_FILE,
    HEADER_SIZE,
    MAGIC,
    decode_block,
    encode_block,
    encode_seal,
    parse_header,
    scan_blocks,
)
from pyspark_acs.errors import ChecksumMismatchError, CorruptFileError, TruncatedBlockError
from pyspark_acs.format.arrays import CONSTANT_ROWS, POSITION_WINDOW_ROWS, ConstantColumns, position_array

PATH = "file:///data/s/00000/x.acs"


def _rehash_header(block: bytearray, at: int = 0) -> None:
    """Recompute the header checksum after a deliberate header edit (simulates a 'valid' lie)."""
    block[at + 20 : at + 24] = b"\0\0\0\0"
    block[at + 20 : at + 24] = struct.pack("<I", zlib.crc32(bytes(block[at : at + HEADER_SIZE])))


key_st = st.one_of(st.none(), st.binary(max_size=20), st.text(max_size=10))
value_st = st.one_of(st.none(), st.binary(max_size=300), st.text(max_size=30))


@settings(max_examples=60, deadline=None)
@given(
    msgs=st.lists(st.tuples(key_st, value_st, st.integers(-(2**62), 2**62)), max_size=40),
    first_index=st.integers(0, 2**40),
)
def test_round_trip(msgs, first_index):
    keys = [k for k, _, _ in msgs]
    values = [v for _, v, _ in msgs]
    stamps = [t for _, _, t in msgs]
    block = encode_block(values, keys, stamps, first_index=first_index)
    header, batch = decode_block(block, path=PATH)
    assert header.size == len(block)
    assert header.count == len(msgs)
    assert not header.sealed
    assert batch.schema == BLOCK_SCHEMA
    enc = lambda x: x.encode() if isinstance(x, str) else x  # noqa: E731
    assert batch.column("key").to_pylist() == [enc(k) for k in keys]
    assert batch.column("value").to_pylist() == [enc(v) for v in values]
    assert batch.column("timestamp").cast(pa.int64()).to_pylist() == stamps
    assert batch.column("position").to_pylist() == list(range(first_index, first_index + len(msgs)))
    if msgs:
        assert (header.first_ts, header.last_ts) == (stamps[0], stamps[-1])
    assert [at for at, _ in scan_blocks(block, final=True)] == [0]


def test_arrow_inputs_sliced_and_string_arrays():
    values = pa.array(["a", "bb", None, "dddd", "eeeee"]).slice(1, 3)  # offset != 0, with a null
    keys = pa.chunked_array([pa.array([b"k1"]), pa.array([None, b"k3"], pa.binary())])
    stamps = pa.array([10, 20, 30], pa.timestamp("us", tz="UTC"))
    _, batch = decode_block(encode_block(values, keys, stamps, first_index=7))
    assert batch.column("value").to_pylist() == [b"bb", None, b"dddd"]
    assert batch.column("key").to_pylist() == [b"k1", None, b"k3"]
    assert batch.column("timestamp").cast(pa.int64()).to_pylist() == [10, 20, 30]
    assert batch.column("position").to_pylist() == [7, 8, 9]


def test_default_timestamps_are_now_and_arguments_are_checked():
    import time

    before = time.time_ns() // 1000
    header, batch = decode_block(encode_block([b"x", b"y"]))
    after = time.time_ns() // 1000
    assert before <= header.first_ts <= header.last_ts <= after
    assert batch.column("key").null_count == 2
    with pytest.raises(ValueError, match="keys"):
        encode_block([b"a", b"b"], [b"k"])
    with pytest.raises(ValueError, match="timestamps"):
        encode_block([b"a"], None, [1, 2])
    with pytest.raises(TypeError, match="values"):
        encode_block([1, 2])


def test_empty_block_and_seal_decode():
    header, batch = decode_block(encode_block([], first_index=3))
    assert header.count == 0 and batch.num_rows == 0 and not header.sealed
    seal = encode_seal(12)
    assert len(seal) == HEADER_SIZE
    header, batch = decode_block(seal)
    assert header.sealed and header.flags == FLAG_END_OF_FILE
    assert header.count == 0 and header.body_len == 0 and header.first_index == 12
    assert batch.num_rows == 0 and batch.schema == BLOCK_SCHEMA


def test_layout_matches_the_documented_header():
    block = encode_block([b"hello", b"w"], [b"k", None], [5, 6], first_index=9)
    magic, version, flags, header_len, count, body_len, body_crc, header_crc, first, t0, t1 = struct.unpack_from(
        "<4sBBHIIIIQqq", block
    )
    assert (magic, version, flags, header_len, count) == (MAGIC, 1, 0, 48, 2)
    assert body_len == len(block) - 48 and body_crc == zlib.crc32(block[48:])
    raw = bytearray(block[:48])
    raw[20:24] = b"\0\0\0\0"
    assert header_crc == zlib.crc32(bytes(raw))
    assert (first, t0, t1) == (9, 5, 6)
    body = block[48:]
    # timestamps (16), key validity (1 -> pad 8), value validity (1 -> 8), key offsets (12 -> 16),
    # value offsets (12 -> 16), key bytes (1 -> 8), value bytes (6, unpadded)
    assert struct.unpack_from("<2q", body, 0) == (5, 6)
    assert body[16] & 0b11 == 0b01 and body[24] & 0b11 == 0b11  # bits past count are unspecified
    assert struct.unpack_from("<3i", body, 32) == (0, 1, 1)
    assert struct.unpack_from("<3i", body, 48) == (0, 5, 6)
    assert body[64:65] == b"k" and body[72:] == b"hellow"
    assert len(body) == 78


def test_longer_header_of_a_later_version_is_skipped():
    block = bytearray(encode_block([b"abc"], [b"k"], [1]))
    extended = bytearray(block[:48]) + b"\xee" * 8 + block[48:]
    struct.pack_into("<H", extended, 6, 56)
    _rehash_header(extended)
    header, batch = decode_block(bytes(extended))
    assert header.size == len(extended)
    assert batch.column("value").to_pylist() == [b"abc"]


# -- bad bytes ---------------------------------------------------------------------------------


def _file_of_blocks(n: int = 3) -> tuple:
    """Three blocks back to back, as in a message file, and their start positions."""
    blocks = [encode_block([b"m%d-%d" % (i, j) for j in range(4)], None, [1, 2, 3, 4], first_index=4 * i) for i in range(n)]
    starts, at = [], 0
    for b in blocks:
        starts.append(at)
        at += len(b)
    return b"".join(blocks), starts


def test_flipped_body_byte_is_a_checksum_mismatch_naming_file_and_position():
    data, starts = _file_of_blocks()
    bad = bytearray(data)
    bad[starts[1] + HEADER_SIZE + 3] ^= 0x40
    with pytest.raises(ChecksumMismatchError) as err:
        decode_block(bytes(bad), starts[1], path=PATH)
    assert err.value.path == PATH and err.value.position == starts[1]
    assert PATH in str(err.value) and f"byte {starts[1]}" in str(err.value)
    # scan_blocks only reads headers: the body flip is caught when decoding
    assert [at for at, _ in scan_blocks(bytes(bad), path=PATH, final=True)] == starts
    # with verify=False the caller takes responsibility (e.g. bytes already verified)
    decode_block(bytes(bad), starts[1], verify=False)


@pytest.mark.parametrize("byte", range(HEADER_SIZE))
def test_every_flipped_header_byte_is_detected(byte):
    data, starts = _file_of_blocks()
    bad = bytearray(data)
    bad[starts[2] + byte] ^= 0x01
    with pytest.raises(CorruptFileError) as err:
        list(scan_blocks(bytes(bad), path=PATH, base=1000, final=True))
    assert err.value.position == 1000 + starts[2]
    assert f"{PATH}" in str(err.value) and f"byte {1000 + starts[2]}" in str(err.value)
    with pytest.raises(CorruptFileError) as err:
        decode_block(bytes(bad), starts[2], path=PATH)
    assert err.value.position == starts[2]


def test_wrong_magic():
    data, starts = _file_of_blocks()
    bad = bytearray(data)
    bad[starts[1] : starts[1] + 4] = b"XXXX"
    with pytest.raises(CorruptFileError, match="not a block") as err:
        list(scan_blocks(bytes(bad), path=PATH))
    assert type(err.value) is CorruptFileError
    assert err.value.position == starts[1] and f"byte {starts[1]}" in str(err.value)
    with pytest.raises(CorruptFileError, match="magic"):
        parse_header(bytes(bad), starts[1], path=PATH, position=starts[1])


def test_unknown_version_and_flags_are_refused():
    for offset, value, pattern in ((4, 2, "version 2"), (5, 0x80, "flags")):
        bad = bytearray(encode_block([b"x"]))
        bad[offset] = value
        _rehash_header(bad)
        with pytest.raises(CorruptFileError, match=pattern):
            decode_block(bytes(bad), path=PATH)


def test_truncated_header():
    data, starts = _file_of_blocks()
    cut = data[: starts[2] + 20]
    # not final: a block still being written, so the scan stops before it silently
    assert [at for at, _ in scan_blocks(cut, path=PATH)] == starts[:2]
    with pytest.raises(TruncatedBlockError) as err:
        list(scan_blocks(cut, path=PATH, base=64, final=True))
    assert err.value.position == 64 + starts[2]
    assert "truncated block header" in str(err.value) and f"byte {64 + starts[2]}" in str(err.value)
    assert PATH in str(err.value)
    with pytest.raises(TruncatedBlockError, match="20 of 48 bytes"):
        decode_block(cut, starts[2], path=PATH)


def test_block_longer_than_the_data():
    data, starts = _file_of_blocks()
    cut = data[:-5]
    assert [at for at, _ in scan_blocks(cut)] == starts[:2]
    with pytest.raises(TruncatedBlockError) as err:
        list(scan_blocks(cut, path=PATH, final=True))
    assert err.value.position == starts[2] and "claims" in str(err.value)
    with pytest.raises(TruncatedBlockError) as err:
        decode_block(cut, starts[2], path=PATH)
    assert f"byte {starts[2]}" in str(err.value) and PATH in str(err.value)
    # a header that lies about its body length (valid header checksum), in the middle of data
    lie = bytearray(data)
    struct.pack_into("<I", lie, starts[0] + 12, 1 << 30)
    _rehash_header(lie, starts[0])
    assert list(scan_blocks(bytes(lie))) == []
    with pytest.raises(TruncatedBlockError):
        list(scan_blocks(bytes(lie), path=PATH, final=True))


def test_inconsistent_sections_with_a_valid_checksum():
    block = bytearray(encode_block([b"abc", b"de"], None, [1, 2]))
    # value offsets start at body byte 8*2 + 8 + 8 + 16 (key offsets: 3 x int32 -> 16)
    struct.pack_into("<i", block, HEADER_SIZE + 48 + 8, 1000)  # last value offset far too big
    body = bytes(block[HEADER_SIZE:])
    struct.pack_into("<I", block, 16, zlib.crc32(body))
    _rehash_header(block)
    with pytest.raises(CorruptFileError, match="byte 0"):
        decode_block(bytes(block), path=PATH)


def test_decode_shares_memory_and_handles_offsets_into_a_buffer():
    data, starts = _file_of_blocks()
    buf = pa.py_buffer(b"\0" * 5 + data)
    header, batch = decode_block(buf, 5 + starts[1], position=starts[1])
    assert batch.column("value").to_pylist() == [b"m1-%d" % j for j in range(4)]
    assert batch.column("position").to_pylist() == [4, 5, 6, 7]


# -- headers (Kafka-style, optional section) ---------------------------------------------------

#: A block written before headers existed (the encoder of format version 1, three messages).
OLD_BLOCK = bytes.fromhex(
    "414353420100300003000000540000004cc64a586e35a63f0500000000000000e803000000000000b80b000000000000"
    "e803000000000000d007000000000000b80b0000000000000100000000000000050000000000000000000000010000000100"
    "000001000000000000000300000003000000040000006b000000000000006f6c6476"
)


def test_blocks_without_headers_are_unchanged_and_old_blocks_decode():
    from pyspark_acs.format.block import FLAG_HEADERS

    again = encode_block([b"old", None, b"v"], [b"k", None, None], [1000, 2000, 3000], first_index=5)
    assert again == OLD_BLOCK  # no headers: byte for byte the old format
    header, batch = decode_block(OLD_BLOCK, headers=True)
    assert not header.flags & FLAG_HEADERS
    assert batch.column("value").to_pylist() == [b"old", None, b"v"]
    assert batch.column("headers").to_pylist() == [None, None, None]


def test_headers_round_trip_with_nulls_empties_and_sliced_arrays():
    import pyarrow as pa
    from pyspark_acs.format.block import HEADERS_TYPE

    given = [[("a", b"1"), ("b", None)], None, [], {"c": "3"}]
    block = encode_block([b"w", b"x", b"y", b"z"], headers=given)
    _, batch = decode_block(block, headers=True)
    assert batch.column("headers").to_pylist() == [
        [{"key": "a", "value": b"1"}, {"key": "b", "value": None}], None, [], [{"key": "c", "value": b"3"}]
    ]
    assert decode_block(block)[1].schema.names == ["position", "timestamp", "key", "value"]
    arr = pa.array([[{"key": "skip", "value": b"0"}], [{"key": "k", "value": b"v"}], None], HEADERS_TYPE).slice(1)
    _, batch = decode_block(encode_block([b"1", b"2"], headers=arr), headers=True)
    assert batch.column("headers").to_pylist() == [[{"key": "k", "value": b"v"}], None]


@pytest.mark.parametrize("headers, error", [
    ([[("k", b"v")]], "got 1 header lists for 2 messages"),
    ([[(None, b"v")], None], "every header needs a key"),
    ([[("k", 5)], None], "headers must be"),
])
def test_bad_headers_are_refused(headers, error):
    with pytest.raises((TypeError, ValueError), match=error):
        encode_block([b"a", b"b"], headers=headers)


def test_a_corrupt_headers_section_names_file_and_position():
    block = bytearray(encode_block([b"a"], headers=[[("k", b"v")]]))
    body = block[48:]
    # The header count (the headers offsets' last entry) claims 1000 pairs: the sections overrun
    # the body. Checksums are fixed up so only the decoder's bounds can catch it.
    idx = bytes(body).find(struct.pack("<ii", 0, 1))
    assert idx > 0
    body[idx + 4: idx + 8] = struct.pack("<i", 1000)
    block[48:] = body
    block[16:20] = struct.pack("<I", zlib.crc32(bytes(body)))
    raw = bytearray(block[:48])
    raw[20:24] = b"\x00\x00\x00\x00"
    block[20:24] = struct.pack("<I", zlib.crc32(bytes(raw)))
    with pytest.raises(CorruptFileError, match=r"f\.acs at byte 96: .*block"):
        decode_block(bytes(block), path="f.acs", position=96, headers=True)


def _forge_headers_section(mutate):
    """A one-message block with a header whose headers section ``mutate(body, section_at)``
    changes; checksums fixed up so only the decoder's own checks can catch it."""
    block = bytearray(encode_block([b"v"], headers=[[("k", b"x")]]))
    body = bytearray(block[48:])
    # One message: timestamps, two validities, two offset arrays and the padded value take 48
    # body bytes, the headers validity 8 more: the headers offsets (0, 1) start at byte 56, the
    # header key offsets (0, 1) at 64.
    at = 56
    assert bytes(body[at:at + 16]) == struct.pack("<iiii", 0, 1, 0, 1)
    mutate(body, at)
    block[48:] = body
    block[16:20] = struct.pack("<I", zlib.crc32(bytes(body)))
    raw = bytearray(block[:48])
    raw[20:24] = b"\x00\x00\x00\x00"
    block[20:24] = struct.pack("<I", zlib.crc32(bytes(raw)))
    return bytes(block)


@pytest.mark.parametrize("what, mutate", [
    ("negative header key length", lambda b, at: b.__setitem__(slice(at + 8 + 4, at + 8 + 8), struct.pack("<i", -5))),
    ("list offsets not from 0", lambda b, at: b.__setitem__(slice(at, at + 4), struct.pack("<i", 1))),
    ("huge header count", lambda b, at: b.__setitem__(slice(at + 4, at + 8), struct.pack("<i", 2**30))),
])
def test_forged_headers_sections_are_corrupt_files_naming_the_position(what, mutate):
    """Review finding: negative section sizes raised pyarrow's ArrowIndexError; every forged
    headers section is a CorruptFileError naming the file and the block's position."""
    block = _forge_headers_section(mutate)
    with pytest.raises(CorruptFileError, match=r"f\.acs at byte 4096") as err:
        decode_block(block, path="f.acs", position=4096, headers=True)
    assert err.value.position == 4096, what


def test_a_slice_that_leaves_out_a_null_header_key_is_accepted():
    from pyspark_acs.format.block import HEADERS_TYPE

    arr = pa.array([[{"key": None, "value": b"0"}], [{"key": "k", "value": b"v"}]], HEADERS_TYPE).slice(1)
    _, batch = decode_block(encode_block([b"x"], headers=arr), headers=True)
    assert batch.column("headers").to_pylist() == [[{"key": "k", "value": b"v"}]]


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


def test_constant_columns_are_slices_of_one_value_each_and_grow():
    """The stream/shard/file columns a reader adds to every batch: n copies of one value,
    as zero-copy slices, also past the rows first built."""
    from pyspark_acs.format.arrays import CONSTANT_ROWS, ConstantColumns

    cols = ConstantColumns((("orders", pa.string()), (7, pa.int32()), ("f-001", pa.string())))
    for n in (0, 1, 33, CONSTANT_ROWS + 5, 3):
        stream, shard, file = cols.take(n)
        assert stream.type == pa.string() and shard.type == pa.int32() and len(file) == n
        assert stream.to_pylist() == ["orders"] * n and shard.to_pylist() == [7] * n
        assert file.to_pylist() == ["f-001"] * n and stream.null_count == 0
        stream.validate(full=True)


@settings(max_examples=200, deadline=None)
@given(first=st.integers(0, 2**40), n=st.integers(1, 3 * POSITION_WINDOW_ROWS))
def test_position_arrays_are_the_run_of_positions_across_windows(first, n):
    """position_array slices cached windows of positions: a run inside one window, across a
    window's end, or longer than a window is still exactly first .. first + n - 1."""
    for start in (first, first - first % POSITION_WINDOW_ROWS + POSITION_WINDOW_ROWS - 1):
        arr = position_array(start, n)
        assert arr.type == pa.int64() and arr.null_count == 0
        assert arr.to_pylist() == list(range(start, start + n))


def test_constant_columns_reuse_the_slices_of_a_repeated_row_count():
    cols = ConstantColumns((("s", pa.string()), (3, pa.int32()), ("f", pa.string())))
    a = cols.take(20)
    assert cols.take(20) is a  # same count: the same (immutable) slices
    b = cols.take(CONSTANT_ROWS + 5)  # grows its arrays
    assert [len(x) for x in b] == [CONSTANT_ROWS + 5] * 3
    assert [x.to_pylist() for x in cols.take(2)] == [["s", "s"], [3, 3], ["f", "f"]]
    assert [x.to_pylist()[:1] for x in cols.take(20)] == [["s"], [3], ["f"]]


# -- the checksum (format/checksum.py) ----------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=20_000), start=st.integers(0, 64), value=st.integers(0, 2**32 - 1))
def test_the_checksum_is_zlibs_crc32_on_every_input(data, start, value):
    """Files written with ISA-L's CRC-32 are read by zlib's and the other way round: the same
    values for bytes, bytearrays and memoryview slices, from any running value."""
    from pyspark_acs.format.checksum import crc32

    view = memoryview(data)[min(start, len(data)):]
    assert crc32(data) == zlib.crc32(data)
    assert crc32(bytearray(data)) == zlib.crc32(data)
    assert crc32(view) == zlib.crc32(view)
    assert crc32(view, value) == zlib.crc32(view, value)


def test_the_fast_checksum_is_the_one_in_use():
    """isal is a dependency: a broken import must not quietly fall back to zlib's 20x slower one."""
    from pyspark_acs.format import checksum

    pytest.importorskip("isal")
    assert checksum.FAST
    assert checksum.crc32 is not zlib.crc32


def test_a_corrupt_body_is_named_by_every_reader_of_it():
    """The one body test (check_body) names the file and the body's bytes, wherever it runs."""
    from pyspark_acs.format.block import check_block_bodies, check_body, parse_header

    blk = bytearray(encode_block([b"a" * 100, b"b" * 50], first_index=0))
    blk[HEADER_SIZE + 20] ^= 0xFF
    header = parse_header(memoryview(blk), 0)
    with pytest.raises(ChecksumMismatchError, match=rf"f\.acs at byte 1000: block body checksum mismatch "
                                                    rf"\(bytes {1000 + HEADER_SIZE}\.\.{1000 + len(blk)}\)"):
        check_body(memoryview(blk), 0, header, path="f.acs", position=1000)
    with pytest.raises(ChecksumMismatchError, match=r"f\.acs at byte 0: block body checksum mismatch"):
        decode_block(bytes(blk), path="f.acs")
    with pytest.raises(ChecksumMismatchError, match=r"f\.acs at byte 0: block body checksum mismatch"):
        check_block_bodies(bytes(blk), path="f.acs")


@pytest.mark.parametrize("value", ["orders", "", "é/ß 00017", "x" * 300])
@pytest.mark.parametrize("n", [0, 1, 7, 4096])
def test_constant_string_columns_are_built_from_buffers(value, n):
    # A reader's stream and file columns: n copies of one string, valid and equal to repeat's.
    from pyspark_acs.format.arrays import ConstantColumns, constant_array

    got = constant_array(value, pa.string(), n)
    got.validate(full=True)
    assert got.equals(pa.repeat(pa.scalar(value), n))
    columns = ConstantColumns([(value, pa.string()), (3, pa.int32())]).take(n)
    assert columns[0].to_pylist() == [value] * n and columns[1].to_pylist() == [3] * n
