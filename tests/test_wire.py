"""The byte-carrying cache messages encoded and split by hand (pyspark_acs/cache/wire.py): the
encoding is the message's own wire format both ways, and a bad body is a clear error."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_acs.cache import wire
from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.proto import acs_pb2, acs_pb2_grpc
from pyspark_acs.server.local.deploy import LocalDeployment

values = st.lists(st.binary(max_size=300), max_size=20)


def _get_response(vals, found_bits):
    found = [bool(found_bits >> i & 1) for i in range(len(vals))]
    vals = [v if f else b"" for v, f in zip(vals, found)]
    return vals, dict(found=found, sizes=[len(v) for v in vals], versions=[i * 977 for i in range(len(vals))])


@settings(max_examples=200, deadline=None)
@given(values, st.integers(min_value=0, max_value=2**20))
def test_encoded_get_response_parses_with_the_generated_code_and_splits_back(vals, found_bits):
    vals, fields = _get_response(vals, found_bits)
    body = wire.encode(acs_pb2.GetResponse(**fields), vals, sum(map(len, vals)))
    # An older client parses it with the generated code: the same message.
    assert acs_pb2.GetResponse.FromString(body) == acs_pb2.GetResponse(data=b"".join(vals), **fields)
    got = wire.split(body, acs_pb2.GetResponse)
    assert got.data == b"".join(vals)
    assert got.message == acs_pb2.GetResponse(**fields)


@settings(max_examples=200, deadline=None)
@given(values, st.integers(min_value=0, max_value=2**20))
def test_split_reads_the_generated_encoding_too(vals, found_bits):
    """An older server serializes with protobuf (data between found and sizes): split reads it."""
    vals, fields = _get_response(vals, found_bits)
    body = acs_pb2.GetResponse(data=b"".join(vals), **fields).SerializeToString()
    got = wire.split(body, acs_pb2.GetResponse)
    assert got.data == b"".join(vals)
    assert got.message == acs_pb2.GetResponse(**fields)


def test_file_bytes_round_trip_and_the_last_data_field_wins():
    msg = acs_pb2.FileBytes(files=[b"f" * 16, b"g" * 16], starts=[0, 4096], sizes=[3, 2])
    body = wire.encode(msg, [b"abc", b"de"], 5)
    assert wire.split(body, acs_pb2.FileBytes) == (msg, b"abcde")
    # Protobuf's rule for a singular field seen twice: the last one counts.
    twice = body + wire.encode(acs_pb2.FileBytes(), [b"xyz"], 3)
    assert acs_pb2.FileBytes.FromString(twice).data == b"xyz"
    assert wire.split(twice, acs_pb2.FileBytes).data == b"xyz"
    assert wire.split(b"", acs_pb2.FileBytes) == (acs_pb2.FileBytes(), b"")


def test_encode_refuses_a_wrong_size():
    with pytest.raises(ValueError, match="not the 4 announced"):
        wire.encode(acs_pb2.GetResponse(), [b"abc"], 4)


def test_bad_bodies_name_the_byte_where_they_break():
    good = wire.encode(acs_pb2.GetResponse(found=[True], sizes=[5], versions=[1]), [b"hello"], 5)
    with pytest.raises(wire.WireError, match="runs past the end"):
        wire.split(good[:-2], acs_pb2.GetResponse)
    with pytest.raises(wire.WireError, match="varint runs past the end of the body at byte 1 of 1"):
        wire.split(b"\x80", acs_pb2.GetResponse)
    with pytest.raises(wire.WireError, match="wire type 7"):
        wire.split(b"\x0f", acs_pb2.GetResponse)


def test_server_answers_encoded_and_the_client_reads_both_shapes(tmp_path):
    """A real server's Get answer parses with the generated stub (an older client), and the
    client reads values through both of its paths (the one-call read and the per-key one)."""
    with LocalDeployment(tmp_path, data_replicas=1, metadata_replicas=0) as dep:
        ep = dep.endpoints("data")[0]
        items = [(b"k%d" % i, bytes([i]) * (i * 100), 1) for i in range(20)]
        with CacheClient(ep, replication=1) as client:
            client.put(items)
            data, sizes = client.get_joined([k for k, _, _ in items] + [b"absent"])
            assert data == b"".join(v for _, v, _ in items)
            assert sizes == [len(v) for _, v, _ in items] + [-1]
            entries = client.get([b"absent", b"k3", b"k19"], consistent=True)
            assert entries[0] is None and entries[1].value == b"\x03" * 300 and entries[2].value == b"\x13" * 1900
        with grpc.insecure_channel(ep) as ch:
            answer = acs_pb2_grpc.CacheStub(ch).Get(acs_pb2.GetRequest(keys=[b"k5", b"absent"]), timeout=10)
        assert list(answer.found) == [True, False] and answer.data == b"\x05" * 500
