"""Security finding 6 and fuzzing (docs/security.md): hypothesis strategies for forged blocks (valid
checksums, hostile fields), wrong-shape lease records, and raw RPC bodies of every method of
the cache and copy services against real server processes -- each for a bounded number of
examples (scripts/fuzz.py runs the same strategies for longer).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspark_acs.errors import CorruptFileError, WriterConflictError
from pyspark_acs.format.block import HEADER_SIZE, decode_block, encode_block
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.leases import LeaseRecord

from tests import helpers as fuzz
from tests.helpers import ROOT, free_port

TOKEN = "fuzz-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
#: Deadline of a fuzzed push-stream call (seconds): past the server's answer to a bad body.
PUSH_STREAM_DEADLINE_S = 0.25
RPC_FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


# -- forged blocks ----------------------------------------------------------------------------------


@FUZZ
@given(fuzz.forged_blocks())
def test_forged_blocks_raise_only_corrupt_file_error(data):
    fuzz.check_decoder(data)


def _resign(raw: bytearray) -> bytes:
    body = bytes(raw[HEADER_SIZE:])
    struct.pack_into("<I", raw, 16, zlib.crc32(body))
    struct.pack_into("<I", raw, 20, 0)
    struct.pack_into("<I", raw, 20, zlib.crc32(bytes(raw[:HEADER_SIZE])))
    return bytes(raw)


@pytest.mark.parametrize("what", ["negative offset", "first_index 2**63", "first_index 2**63-1"])
def test_the_reported_forged_blocks(what):
    """ArrowIndexError, OverflowError and silently negative positions before (finding 6)."""
    raw = bytearray(encode_block([b"aa", b"bb"], keys=[b"k", b"l"], first_index=0))
    if what == "negative offset":
        # The key offsets follow timestamps (16 bytes) and two 8-byte-padded bitmaps.
        struct.pack_into("<i", raw, HEADER_SIZE + 16 + 8 + 8 + 4, -5)
    else:
        struct.pack_into("<Q", raw, 24, 2**63 if what == "first_index 2**63" else 2**63 - 1)
    data = _resign(raw)
    with pytest.raises(CorruptFileError) as info:
        decode_block(data, path="store://x/f.acs", position=123)
    assert info.value.path == "store://x/f.acs" and info.value.position == 123
    assert "store://x/f.acs" in str(info.value) and "123" in str(info.value)


# -- lease records ----------------------------------------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=8)
_lease_like = st.fixed_dictionaries({}, optional={
    "writer": _json | st.text(max_size=5), "nonce": _json | st.text(max_size=5),
    "expires": _json | st.floats(allow_nan=False), "poisoned": _json, "host": _json, "pid": _json})


@FUZZ
@given(st.one_of(_json, _lease_like))
def test_lease_records_of_any_shape_are_a_record_or_a_writer_conflict(doc):
    raw = json.dumps(doc).encode()
    try:
        record = LeaseRecord.decode(raw, "store://x/_lease")
    except WriterConflictError as exc:
        assert "store://x/_lease" in str(exc)
        return
    if record is not None:
        record.live()
        record.describe()
        record.same_holder(record)


# -- raw RPC bodies of every method ------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A token-protected cache server pair and a copy daemon of one cluster, real processes."""
    base = tmp_path_factory.mktemp("fuzz")
    from pyspark_acs.security import SecuritySettings

    dep = LocalDeployment(base / "caches", data_replicas=1, metadata_replicas=1, capacity="64MiB",
                          security=SecuritySettings(token=TOKEN)).start()
    port = free_port()
    topology = base / "topology.json"
    topology.write_text(json.dumps({
        "clusters": {"A": {"root": str(base / "root-A"), "data_cache": dep.data_endpoints,
                           "metadata_cache": dep.metadata_endpoints, "copy_daemon": f"127.0.0.1:{port}"}},
        "links": [], "streams": {}}))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), ACS_CACHE_TOKEN=TOKEN,
               PYTHONUNBUFFERED="1")
    log = open(base / "daemon.log", "ab")
    daemon = subprocess.Popen([sys.executable, "-m", "pyspark_acs.server.copy.daemon", "--topology", str(topology),
                               "--cluster", "A", "--parent-pid", str(os.getpid()), "--metrics-port", "-1"],
                              stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT)
    log.close()
    line = daemon.stdout.readline().decode()
    assert "listening on" in line, (base / "daemon.log").read_text()
    try:
        yield {"pyspark_acs.cache.Cache": [dep.server("data", 0).endpoint, dep.server("metadata", 0).endpoint],
               "pyspark_acs.copy.Copy": [f"127.0.0.1:{port}"]}, dep, daemon
    finally:
        daemon.terminate()
        daemon.wait(timeout=20)
        dep.stop()


_CASES = [("pyspark_acs.cache.Cache", m, k) for m, k in fuzz.CACHE_METHODS] + \
         [("pyspark_acs.copy.Copy", m, k) for m, k in fuzz.COPY_METHODS]


@pytest.mark.parametrize("service,method,kind", _CASES, ids=[f"{s.rsplit('.', 1)[1]}.{m}" for s, m, _ in _CASES])
def test_raw_rpc_bodies_are_refused_or_answered_and_the_server_stays_up(servers, service, method, kind):
    endpoints, dep, daemon = servers
    request_class = fuzz.request_classes()[service][method]
    channels = [grpc.insecure_channel(ep) for ep in endpoints[service]]
    try:
        # Without the token: refused, whatever the body.
        for channel in channels:
            with pytest.raises(grpc.RpcError) as info:
                name = f"/{service}/{method}"
                if kind == "uu":
                    channel.unary_unary(name)(b"\x08\x01", timeout=5)
                else:
                    list(channel.stream_stream(name)(iter([b"\x08\x01"]), timeout=5))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # A push stream (Follow) that accepts its request waits for news until the deadline: a
        # short one keeps its 25 examples x 2 servers from waiting 26 s; a refusal comes at once.
        timeout = PUSH_STREAM_DEADLINE_S if kind == "us" else 1.0

        @RPC_FUZZ
        @given(st.lists(fuzz.raw_bodies(request_class), min_size=1, max_size=3))
        def check(bodies):
            for channel in channels:
                fuzz.check_rpc(channel, service, method, kind, bodies, metadata=AUTH, timeout=timeout)

        check()
        # Still serving.
        for channel in channels:
            health = "/pyspark_acs.cache.Cache/Health" if service.endswith("Cache") else "/pyspark_acs.copy.Copy/Health"
            channel.unary_unary(health)(b"", metadata=AUTH, timeout=5)
        assert daemon.poll() is None and all(s.popen.poll() is None for r in ("data", "metadata")
                                             for s in dep.servers[r])
    finally:
        for channel in channels:
            channel.close()
