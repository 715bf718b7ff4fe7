"""The byte-carrying cache messages encoded and split by hand (pyspark_acs/cache/wire.py): the
encoding is the message's own wire format both ways, and split reads (or refuses) every body
exactly as the generated parser does."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from google.protobuf.message import DecodeError

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
            # The one-call read hands out a view of the answer, not a copy of it; values read
            # per key, relaxed or consistent, are bytes of their own.
            assert isinstance(data, memoryview)
            relaxed = client.get([b"k3"])
            assert type(relaxed[0].value) is bytes and type(entries[1].value) is bytes
            assert relaxed[0].value == b"\x03" * 300
        with grpc.insecure_channel(ep) as ch:
            answer = acs_pb2_grpc.CacheStub(ch).Get(acs_pb2.GetRequest(keys=[b"k5", b"absent"]), timeout=10)
        assert list(answer.found) == [True, False] and answer.data == b"\x05" * 500


def _same_as_generated(raw, message_type):
    """split reads ``raw`` exactly as the generated parser does, or refuses it as it does."""
    try:
        expect = message_type.FromString(raw)
    except DecodeError:
        with pytest.raises(DecodeError):
            wire.split(raw, message_type)
        return
    got = wire.split(raw, message_type)
    assert bytes(got.data) == expect.data
    whole = message_type()
    whole.MergeFrom(got.message)
    whole.data = bytes(got.data)
    assert whole == expect
    assert whole.SerializeToString(deterministic=True) == expect.SerializeToString(deterministic=True)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=120))
def test_any_bytes_are_read_or_refused_as_the_generated_parser_does(raw):
    _same_as_generated(raw, acs_pb2.GetResponse)
    _same_as_generated(raw, acs_pb2.FileBytes)
    _same_as_generated(raw, acs_pb2.PutRequest)
    _same_as_generated(b"\x12" + raw, acs_pb2.PutRequest)  # as if data came first


@settings(max_examples=400, deadline=None)
@given(values, st.integers(min_value=0, max_value=2**20), st.data())
def test_damaged_answers_are_read_or_refused_as_the_generated_parser_does(vals, found_bits, data):
    vals, fields = _get_response(vals, found_bits)
    body = wire.encode(acs_pb2.GetResponse(**fields), vals, sum(map(len, vals)))
    at = data.draw(st.integers(min_value=0, max_value=len(body)))
    how = data.draw(st.sampled_from(["cut", "insert", "flip"]))
    if how == "cut":
        body = body[:at]
    elif how == "insert":
        body = body[:at] + data.draw(st.binary(min_size=1, max_size=12)) + body[at:]
    elif at < len(body):
        body = body[:at] + bytes([body[at] ^ data.draw(st.integers(min_value=1, max_value=255))]) + body[at + 1:]
    _same_as_generated(body, acs_pb2.GetResponse)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=300), st.integers(0, 2**64 - 1)), max_size=300),
       st.integers(0, 2**40), st.booleans())
def test_a_put_with_its_data_first_parses_with_the_generated_code_and_splits_back(items, ttl_ms, view):
    """The cache client's PutRequest (data first, so split finds it without walking a record per
    key): the generated parser reads the same message, and split gives it back, with the data as
    a view of the body when asked."""
    head = acs_pb2.PutRequest(keys=[k for k, _, _ in items], sizes=[len(v) for _, v, _ in items],
                              versions=[n for _, _, n in items], ttl_ms=ttl_ms)
    vals = [v for _, v, _ in items]
    body = wire.encode(head, vals, sum(map(len, vals)), data_first=True)
    whole = acs_pb2.PutRequest()
    whole.CopyFrom(head)
    whole.data = b"".join(vals)
    assert acs_pb2.PutRequest.FromString(body) == whole
    got = wire.split(body, acs_pb2.PutRequest, view=view)
    assert got.message == head and bytes(got.data) == b"".join(vals)
    assert isinstance(got.data, memoryview) == (view and bool(body))
    _same_as_generated(body, acs_pb2.PutRequest)


def test_a_data_first_body_with_another_data_record_is_read_as_the_generated_parser_reads_it():
    """Protobuf's last data record wins, also an empty one: split then leaves the body to the
    generated parser (the rest is not canonical, or has data of its own)."""
    head = acs_pb2.PutRequest(keys=[b"k"], sizes=[3], versions=[1])
    body = wire.encode(head, [b"abc"], 3, data_first=True)
    for tail in (wire.encode(acs_pb2.PutRequest(), [b"zz"], 2), b"\x12\x00", b"\x12\x01q"):
        _same_as_generated(body + tail, acs_pb2.PutRequest)
    for cut in range(len(body)):
        _same_as_generated(body[:cut], acs_pb2.PutRequest)


def test_odd_but_valid_bodies_are_read_as_the_generated_parser_reads_them():
    good = wire.encode(acs_pb2.GetResponse(found=[True], sizes=[5], versions=[1]), [b"hello"], 5)
    _same_as_generated(good + b"\x2b\x2c", acs_pb2.GetResponse)  # an unknown group
    _same_as_generated(b"\x92\x80\x80\x80\x80\x00\x02ab", acs_pb2.GetResponse)  # a padded data key
    _same_as_generated(b"\x12\x82\x00ab", acs_pb2.GetResponse)  # a padded data length
    many = b"\x78\x01" * (wire.MAX_SCANNED_RECORDS * 10) + good  # unknown records, then the answer
    _same_as_generated(many, acs_pb2.GetResponse)
    assert wire.split(many, acs_pb2.GetResponse).data == b"hello"


def test_a_corrupt_answer_fails_the_read_naming_the_replica_and_does_not_mark_it_down():
    """A replica whose Get answer is not a GetResponse (a bug, a proxy mangling bytes): the read
    fails with a CacheError naming the endpoint and why, the bytes are not taken for data, and
    the replica is not marked down (it answered; its answer was bad)."""
    import asyncio
    import threading

    from pyspark_acs.errors import CacheError

    ready = threading.Event()
    port = []

    async def serve(stop: "asyncio.Future") -> None:
        async def get(request, context):
            return b"\x12\x05abc"  # a data field announcing 5 bytes, holding 3

        handler = grpc.method_handlers_generic_handler(
            "pyspark_acs.cache.Cache", {"Get": grpc.unary_unary_rpc_method_handler(get)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        await stop
        await server.stop(0)

    loop = asyncio.new_event_loop()
    stop = loop.create_future()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(stop),), daemon=True)
    thread.start()
    assert ready.wait(30)
    endpoint = f"127.0.0.1:{port[0]}"
    try:
        with CacheClient(endpoint, replication=1, deadline=10.0) as client:
            for read in (lambda: client.get_joined([b"k"]), lambda: client.get([b"k"], consistent=True)):
                with pytest.raises(CacheError) as info:
                    read()
                assert endpoint in str(info.value) and "deserializing" in str(info.value)
            assert client.down_endpoints() == ()
    finally:
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(10)
