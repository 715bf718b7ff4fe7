"""Fuzzing strategies and checks shared by tests/test_security_fuzz.py (a bounded number of
examples in ``make test``) and scripts/fuzz.py (a longer run that reports inputs and failures).

* :func:`forged_blocks`: blocks with valid header and body checksums but hostile fields (count,
  lengths, offsets, ``first_index``, flags), the attacker's best shot at the decoder.
* :func:`check_decoder`: the decoder, the block walk and the copy writer's delta check either
  accept a forged block or raise :class:`~pyspark_acs.errors.CorruptFileError` naming the file
  and byte position -- never another exception, never a hang.
* :func:`raw_bodies` / :func:`check_rpc`: raw request bodies (random bytes, and random fields
  of the real messages) for every method of the cache and copy services; the server answers
  with a status from :data:`ALLOWED_CODES` and stays healthy.
"""

from __future__ import annotations

import struct
import zlib
from typing import Dict, List, Tuple

import grpc
from hypothesis import strategies as st

from pyspark_acs.errors import CorruptFileError
from pyspark_acs.format.block import (FLAG_END_OF_FILE, FLAG_HEADERS, HEADER_SIZE, MAGIC, decode_block,
                                      encode_block, scan_blocks)
from pyspark_acs.server.copy.writer import validate_delta

__all__ = ["ALLOWED_CODES", "CACHE_METHODS", "COPY_METHODS", "check_decoder", "check_rpc", "forged_blocks",
           "raw_bodies"]

_HEADER = struct.Struct("<4sBBHIIIIQqq")
_U32 = st.integers(0, 2**32 - 1)
_I32 = st.integers(-(2**31), 2**31 - 1)
_U64_EDGE = st.sampled_from([0, 1, 2**31, 2**32, 2**62, 2**63 - 2, 2**63 - 1, 2**63, 2**64 - 1])


def _sign(header: bytearray, body: bytes) -> bytes:
    """Recompute both checksums of ``header + body`` (the forger knows the algorithm)."""
    struct.pack_into("<I", header, 16, zlib.crc32(body))
    struct.pack_into("<I", header, 20, 0)
    struct.pack_into("<I", header, 20, zlib.crc32(bytes(header[:HEADER_SIZE])))
    return bytes(header) + body


@st.composite
def forged_blocks(draw) -> bytes:
    """A block with valid checksums whose fields and body an attacker chose."""
    n = draw(st.integers(1, 6))
    values = draw(st.lists(st.binary(max_size=20), min_size=n, max_size=n))
    keys = draw(st.one_of(st.none(), st.lists(st.binary(max_size=8), min_size=n, max_size=n)))
    headers = draw(st.one_of(st.none(), st.lists(
        st.lists(st.tuples(st.text(max_size=4), st.binary(max_size=4)), max_size=2), min_size=n, max_size=n)))
    raw = bytearray(encode_block(values, keys=keys, headers=headers, first_index=draw(st.integers(0, 1000))))
    header, body = raw[:HEADER_SIZE], bytearray(raw[HEADER_SIZE:])
    # Hostile body words: overwrite int32s anywhere in the body (offsets, counts, lengths).
    for _ in range(draw(st.integers(0, 4))):
        if len(body) >= 4:
            at = draw(st.integers(0, (len(body) - 4) // 4)) * 4
            struct.pack_into("<i", body, at, draw(st.one_of(_I32, st.sampled_from([-1, -8, 2**31 - 1]))))
    # Hostile header fields.
    field = draw(st.sampled_from(["none", "count", "first_index", "flags", "body_len", "ts"]))
    if field == "count":
        struct.pack_into("<I", header, 8, draw(st.one_of(_U32, st.integers(0, 64))))
    elif field == "first_index":
        struct.pack_into("<Q", header, 24, draw(st.one_of(_U64_EDGE, st.integers(0, 2**64 - 1))))
    elif field == "flags":
        struct.pack_into("<B", header, 5, draw(st.sampled_from([0, FLAG_HEADERS, FLAG_END_OF_FILE,
                                                                 FLAG_HEADERS | FLAG_END_OF_FILE])))
    elif field == "body_len":
        cut = draw(st.integers(0, len(body)))
        body = body[:cut]
    elif field == "ts":
        struct.pack_into("<qq", header, 32, draw(st.integers(-(2**63), 2**63 - 1)), draw(st.integers(-(2**63), 2**63 - 1)))
    struct.pack_into("<I", header, 12, len(body))
    return _sign(header, bytes(body))


def check_decoder(data: bytes, path: str = "mem://fuzz/file.acs", position: int = 4096) -> str:
    """Run the decoders over ``data``; return ``"ok"`` or ``"corrupt"``; raise AssertionError
    on any other exception or an error that does not name the file and position."""
    outcome = "ok"
    for call in (
        lambda: decode_block(data, path=path, position=position, headers=True),
        lambda: decode_block(data, path=path, position=position, headers=False),
        lambda: list(scan_blocks(data, path=path, base=position, final=True)),
        lambda: validate_delta(b"", data, base=position, path=path, next_index=None),
    ):
        try:
            result = call()
            if isinstance(result, tuple) and len(result) == 2:  # decode_block: touch every column
                header, batch = result
                batch.validate(full=True)
                batch.column(0).to_pylist()
        except CorruptFileError as exc:
            outcome = "corrupt"
            assert path in str(exc) and exc.path == path, f"the error does not name the file: {exc!r}"
            assert exc.position >= position, f"the error names no byte position: {exc!r}"
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            raise AssertionError(f"foreign exception {type(exc).__name__}: {exc}") from exc
    return outcome


# -- raw RPC bodies -------------------------------------------------------------------------------------

#: (method, kind): kind "uu" unary-unary, "us" unary-stream, "ss" stream-stream.
CACHE_METHODS: List[Tuple[str, str]] = [("Get", "uu"), ("Put", "uu"), ("CompareAndSet", "uu"), ("Delete", "uu"),
                                        ("Stats", "uu"), ("Health", "uu"), ("Watch", "ss"), ("Follow", "us")]
COPY_METHODS: List[Tuple[str, str]] = [("Copy", "ss"), ("Files", "uu"), ("Health", "uu")]
#: What a server may answer a hostile body with. UNKNOWN (an exception escaped a handler) is not here.
ALLOWED_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED,  # a push stream waiting for news
                 grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION}


def _message_bodies(message_class) -> st.SearchStrategy:
    """Serialized messages of ``message_class`` with random scalar and repeated fields."""
    fields = message_class.DESCRIPTOR.fields

    @st.composite
    def build(draw):
        msg = message_class()
        for f in fields:
            if not draw(st.booleans()):
                continue
            repeated = getattr(f, "is_repeated", None)
            if repeated is None:  # older protobuf
                repeated = f.label == f.LABEL_REPEATED
            if f.type in (f.TYPE_BYTES,):
                value = st.binary(max_size=64)
            elif f.type == f.TYPE_STRING:
                value = st.one_of(st.text(max_size=40), st.sampled_from(["../../etc/hostname", "a/../b", "x" * 300]))
            elif f.type == f.TYPE_BOOL:
                value = st.booleans()
            elif f.type in (f.TYPE_INT32, f.TYPE_SINT32, f.TYPE_ENUM):
                value = st.integers(-(2**31), 2**31 - 1)
            elif f.type in (f.TYPE_UINT32, f.TYPE_FIXED32):
                value = st.integers(0, 2**32 - 1)
            elif f.type in (f.TYPE_INT64, f.TYPE_SINT64, f.TYPE_SFIXED64):
                value = st.integers(-(2**63), 2**63 - 1)
            elif f.type in (f.TYPE_UINT64, f.TYPE_FIXED64):
                value = st.integers(0, 2**64 - 1)
            else:
                continue  # nested messages stay empty
            try:
                if repeated:
                    getattr(msg, f.name).extend(draw(st.lists(value, max_size=5)))
                else:
                    setattr(msg, f.name, draw(value))
            except (TypeError, ValueError, AttributeError):
                pass  # a value the field cannot hold (or a map): leave it unset
        return msg.SerializeToString()

    return build()


def raw_bodies(request_class) -> st.SearchStrategy:
    """Random bytes or a random instance of ``request_class``, serialized."""
    return st.one_of(st.binary(max_size=200), _message_bodies(request_class))


def check_rpc(channel: grpc.Channel, service: str, method: str, kind: str, bodies: List[bytes],
              metadata=None, timeout: float = 2.0) -> grpc.StatusCode:
    """Send raw ``bodies`` to ``/service/method``; return the status; raise AssertionError for
    a status outside :data:`ALLOWED_CODES`."""
    name = f"/{service}/{method}"
    try:
        if kind == "uu":
            channel.unary_unary(name)(bodies[0], metadata=metadata, timeout=timeout)
        elif kind == "us":
            for _ in channel.unary_stream(name)(bodies[0], metadata=metadata, timeout=timeout):
                pass
        else:
            call = channel.stream_stream(name)(iter(bodies), metadata=metadata, timeout=timeout)
            for _ in call:
                pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in ALLOWED_CODES, f"{name}: {code} {exc.details()}"
    return code


def request_classes() -> Dict[str, Dict[str, type]]:
    """Request message class per service and method."""
    from pyspark_acs.cache.proto import acs_pb2
    from pyspark_acs.server.copy.proto import copy_pb2

    return {
        "pyspark_acs.cache.Cache": {"Get": acs_pb2.GetRequest, "Put": acs_pb2.PutRequest,
                      "CompareAndSet": acs_pb2.CompareAndSetRequest, "Delete": acs_pb2.DeleteRequest,
                      "Stats": acs_pb2.StatsRequest, "Health": acs_pb2.HealthRequest,
                      "Watch": acs_pb2.WatchRequest, "Follow": acs_pb2.FollowRequest},
        "pyspark_acs.copy.Copy": {"Copy": copy_pb2.CopyRequest, "Files": copy_pb2.FilesRequest,
                          "Health": copy_pb2.HealthRequest},
    }
