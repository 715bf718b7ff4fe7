"""The cache server and its storage engine.

Store semantics are checked in-process (fast, with a fake clock); everything about the server
(gRPC, capacity, TTL, auth, metrics, signals, flags) runs against real server processes on free
loopback ports, started once per module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from unittest.mock import ANY

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.fanout import Entry
from pyspark_acs.errors import CacheError, CacheUnavailableError
from pyspark_acs.server.local.deploy import LocalDeployment, load_deployment
from pyspark_acs.cache.proto import acs_pb2, acs_pb2_grpc
from pyspark_acs.server.cache.store import (
    ENTRY_OVERHEAD_BYTES,
    GC_LOW_WATERMARK_FRACTION,
    GC_START_FRACTION,
    PutResult,
    Store,
    StoredEntry,
)

CHUNK = 4096


def chunk(i: int) -> bytes:
    return (b"%08d" % i) * (CHUNK // 8)



def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


# -- the store, in-process ------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_store_versions_never_go_backwards():
    s = Store(1 << 20, 60)
    assert s.put(b"k", b"abc", 3) is PutResult.STORED
    assert s.put(b"k", b"ab", 2) is PutResult.STALE
    assert s.get(b"k") == StoredEntry(b"abc", 3)
    assert s.put(b"k", b"abc", 3) is PutResult.STORED  # equal version rewrites (refreshes)
    assert s.put(b"k", b"abcd", 4) is PutResult.STORED
    assert s.get(b"k") == StoredEntry(b"abcd", 4)
    assert s.stats()["stale_total"] == 1


def test_store_read_many_answers_a_get_in_its_shape_and_drops_what_expired():
    """read_many (the Get handler's lookup) gives found, value and version per key in order
    -- b"" and 0 for an absent or expired key -- drops and counts what expired, and counts the
    read; with every key live it takes its no-test path and agrees with get_many."""
    clock = FakeClock()
    s = Store(1 << 20, 60, clock=clock)
    s.put(b"live", b"abc", 3)
    s.put(b"short", b"xy", 5, ttl_s=1)
    s.put(b"other", b"q", 1)
    assert s.read_many([b"live", b"other"]) == ([True, True], [b"abc", b"q"], [3, 1])
    clock.now += 1.5
    before = s.stats()
    assert s.read_many([b"short", b"live", b"absent"]) == ([False, True, False], [b"", b"abc", b""], [0, 3, 0])
    after = s.stats()
    assert after["expired_total"] - before["expired_total"] == 1 and len(s) == 2  # dropped
    assert after["gets_total"] - before["gets_total"] == 3
    assert after["hits_total"] - before["hits_total"] == 1
    assert after["misses_total"] - before["misses_total"] == 2
    assert after["read_bytes_total"] - before["read_bytes_total"] == 3
    assert s.get_many([b"live", b"absent"]) == [StoredEntry(b"abc", 3), None]
    # count=False: a push stream's uncounted reads, by the same liveness rule.
    s.put(b"brief", b"z", 1, ttl_s=1)
    counted = s.stats()["gets_total"]
    assert s.get_many([b"live", b"absent"], count=False) == [StoredEntry(b"abc", 3), None]
    clock.now += 1.5
    assert s.get_many([b"brief"], count=False) == [None]
    assert s.stats()["expired_total"] == after["expired_total"] + 1
    assert s.stats()["gets_total"] == counted
    # A put meeting an expired entry counts it as expired too (one rule for all three).
    s.put(b"gone", b"v", 9, ttl_s=1)
    clock.now += 1.5
    expired = s.stats()["expired_total"]
    assert s.put(b"gone", b"w", 1) is PutResult.STORED
    assert s.stats()["expired_total"] == expired + 1


def test_store_compare_and_set_on_exact_bytes_or_absence():
    s = Store(1 << 20, 60)
    assert s.compare_and_set(b"lease", None, b"w1", version=1) == (True, StoredEntry(b"w1", 1))
    assert s.compare_and_set(b"lease", None, b"w2", version=1) == (False, StoredEntry(b"w1", 1))
    assert s.compare_and_set(b"lease", b"w", b"w2", version=2) == (False, StoredEntry(b"w1", 1))
    assert s.compare_and_set(b"lease", b"w1", b"w2", version=2) == (True, StoredEntry(b"w2", 2))
    assert s.delete_many([b"lease", b"missing"]) == 1
    assert s.compare_and_set(b"lease", b"w2", b"w3") == (False, None)


def test_store_ttl_per_entry_and_default():
    clock = FakeClock()
    s = Store(1 << 20, 10, clock=clock)
    s.put(b"default", b"v", 1)
    s.put(b"short", b"v", 1, ttl_s=1)
    clock.now += 1.5
    assert s.get(b"short") is None
    assert s.get(b"default") == StoredEntry(b"v", 1)
    clock.now += 9
    assert s.expire() == 1
    assert len(s) == 0 and s.used_bytes == 0
    # An expired entry does not block a lower version.
    s.put(b"k", b"new", 9)
    clock.now += 11
    assert s.put(b"k", b"old", 1) is PutResult.STORED


def test_stored_entries_are_not_walked_by_the_garbage_collector():
    """Entries are plain tuples of atomic values: once a collection has looked at them the
    collector no longer tracks them, so a full collection of a server holding a large cache does
    not walk every entry (the event loop stalls for the collection)."""
    import gc

    s = Store(1 << 24, 60)
    s.put_many((b"gc/%d" % i, b"v" * 100, 1) for i in range(2000))
    gc.collect()
    entries = [s._entries.lookup(b"gc/%d" % i) for i in range(2000)]
    assert not any(gc.is_tracked(e) for e in entries)
    assert s.get(b"gc/7") == StoredEntry(b"v" * 100, 1)


def test_store_evicts_least_recently_modified_and_reads_do_not_refresh():
    clock = FakeClock()
    per_entry = 8 + CHUNK + ENTRY_OVERHEAD_BYTES
    s = Store(100 * per_entry, 3600, clock=clock)
    order = []
    for i in range(70):  # below the 80 % start
        clock.now += 0.001
        s.put(b"k%06d" % i, chunk(i), 1)
        order.append(b"k%06d" % i)
    for _ in range(5):  # read the oldest ones a lot: must not save them
        s.get_many(order[:20])
    clock.now += 0.001
    s.put(order[10], chunk(10), 2)  # ... but a write does
    order.remove(order[10])
    order.append(b"k%06d" % 10)
    for i in range(70, 85):
        clock.now += 0.001
        s.put(b"k%06d" % i, chunk(i), 1)
        order.append(b"k%06d" % i)
    stats = s.stats()
    assert stats["evicted_total"] > 0
    assert stats["used_bytes"] <= 100 * per_entry * GC_START_FRACTION
    present = [k for k in order if s.get(k) is not None]
    assert present == order[len(order) - len(present):], "survivors must be the most recently modified"
    assert b"k%06d" % 10 in present and b"k%06d" % 0 not in present


def test_store_eviction_order_spans_ttl_groups():
    clock = FakeClock()
    per_entry = 2 + 1000 + ENTRY_OVERHEAD_BYTES
    s = Store(20 * per_entry, 60, clock=clock)
    for i in range(16):
        clock.now += 1
        s.put(b"%02d" % i, b"x" * 1000, 1, ttl_s=(3600 if i % 2 else None))
    clock.now += 1
    s.put(b"zz", b"x" * 1000, 1)  # crosses 80 %: evict oldest written, whatever their TTL
    assert s.get(b"00") is None and s.get(b"01") is None
    assert s.get(b"02") is None and s.get(b"03") is not None  # down to 70 %: 14 of 20 entries
    assert s.get(b"15") is not None and s.get(b"zz") is not None
    assert s.stats()["ttl_groups"] == 2


def test_store_refuses_entries_that_can_never_fit():
    s = Store(64 * 1024, 60)
    assert s.put(b"big", b"x" * 60000, 1) is PutResult.TOO_LARGE
    assert s.get(b"big") is None
    with pytest.raises(ValueError, match="exceeds"):
        s.compare_and_set(b"big", None, b"x" * 60000)
    assert s.put(b"ok", b"x" * 1000, 1) is PutResult.STORED


# -- real server processes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    """Several single-server deployments, started in parallel, once for the module."""
    specs = {
        "plain": dict(capacity="64MiB"),
        "small": dict(capacity="1MiB"),
        "flood": dict(capacity="16MiB"),
        "ttl": dict(capacity="4MiB", data_ttl="300ms"),
        "token": dict(capacity="4MiB", token="s3cret"),
    }
    deps = {}
    try:
        for name, kw in specs.items():
            deps[name] = LocalDeployment(tmp_path_factory.mktemp(name), data_replicas=1, metadata_replicas=0, **kw)
        meta = LocalDeployment(tmp_path_factory.mktemp("meta"), data_replicas=0, metadata_replicas=1,
                               metadata_capacity="1MiB")
        deps["meta"] = meta
        for dep in deps.values():
            dep.start()
        yield deps
    finally:
        for dep in deps.values():
            dep.stop()


@pytest.fixture(scope="module")
def plain(deployments):
    with CacheClient(deployments["plain"].data_endpoints, name="data cache") as client:
        yield client


def stub_for(endpoint: str):
    channel = grpc.insecure_channel(endpoint, options=[("grpc.max_receive_message_length", 64 * 1024**2)])
    return channel, acs_pb2_grpc.CacheStub(channel)


def test_deployment_files_and_banner(deployments):
    dep = deployments["plain"]
    state = load_deployment(dep.base_dir)
    assert state["data_endpoints"] == dep.data_endpoints
    (server,) = state["servers"]
    assert server["pid"] and os.path.exists(server["pid_path"]) and server["metrics_port"]
    log = open(server["log_path"]).read()
    assert re.search(r"^acs-cache-server role=data listening on 127\.0\.0\.1:\d+ "
                     r"metrics=http://127\.0\.0\.1:\d+/metrics$", log, re.M)


def test_put_get_versions_over_grpc(deployments):
    channel, stub = stub_for(deployments["plain"].data_endpoints)
    with channel:
        resp = stub.Put(acs_pb2.PutRequest(keys=[b"a", b"b"], data=b"122", sizes=[1, 2], versions=[5, 1]),
                        timeout=2)
        assert list(resp.status) == [acs_pb2.STORED, acs_pb2.STORED]
        resp = stub.Put(acs_pb2.PutRequest(keys=[b"a"], data=b"0", sizes=[1], versions=[4]), timeout=2)
        assert list(resp.status) == [acs_pb2.STALE]
        got = stub.Get(acs_pb2.GetRequest(keys=[b"a", b"nope", b"b"]), timeout=2)
        assert list(got.found) == [True, False, True]
        assert got.data == b"122" and list(got.sizes) == [1, 0, 2]
        assert list(got.versions) == [5, 0, 1]
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(acs_pb2.PutRequest(keys=[b"a"], data=b"xy", sizes=[1], versions=[1]), timeout=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_put_stream_answers_in_order_and_ends_at_a_refused_put(deployments):
    """PutStream: one PutResponse per PutRequest, in order; a refused request ends the stream
    with its status (INVALID_ARGUMENT naming the disagreement) after the answers before it, and
    stores nothing after it."""
    channel, stub = stub_for(deployments["plain"].data_endpoints)
    with channel:
        requests = [
            acs_pb2.PutRequest(keys=[b"ps#1"], data=b"1", sizes=[1], versions=[1]),
            acs_pb2.PutRequest(keys=[b"ps#2", b"ps#3"], data=b"223", sizes=[2, 1], versions=[1, 1]),
            acs_pb2.PutRequest(keys=[b"ps#1"], data=b"0", sizes=[1], versions=[0]),  # stale
            acs_pb2.PutRequest(keys=[b"ps#4"], data=b"xy", sizes=[1], versions=[1]),  # refused
            acs_pb2.PutRequest(keys=[b"ps#5"], data=b"5", sizes=[1], versions=[1]),
        ]
        answers = []
        with pytest.raises(grpc.RpcError) as info:
            for answer in stub.PutStream(iter(requests), timeout=5):
                answers.append(list(answer.status))
        assert answers == [[acs_pb2.STORED], [acs_pb2.STORED, acs_pb2.STORED], [acs_pb2.STALE]]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sizes summing to 1 for 2 data bytes" in info.value.details()
        got = stub.Get(acs_pb2.GetRequest(keys=[b"ps#1", b"ps#2", b"ps#3", b"ps#4", b"ps#5"]), timeout=2)
        assert list(got.found) == [True, True, True, False, False]
        assert got.data == b"1223"


def test_client_roundtrip_cas_delete_stats_health(plain):
    plain.put([(b"file#0", chunk(0), CHUNK), (b"file#1", b"part", 4)])
    assert plain.get([b"file#0", b"file#1", b"file#2"]) == [Entry(chunk(0), CHUNK), Entry(b"part", 4), None]
    plain.put([(b"file#1", b"pa", 2)])  # an older, shorter write never wins
    assert plain.get([b"file#1"], consistent=True) == [Entry(b"part", 4)]
    assert plain.compare_and_set(b"lease", None, b"w1", version=1) == (True, Entry(b"w1", 1))
    assert plain.compare_and_set(b"lease", None, b"w2") == (False, Entry(b"w1", 1))
    assert plain.compare_and_set(b"lease", b"w1", b"w2", version=2) == (True, Entry(b"w2", 2))
    plain.delete([b"lease", b"file#0"])
    assert plain.get([b"lease", b"file#0"]) == [None, None]
    (stats,) = plain.stats().values()
    assert stats["role"] == "data" and stats["capacity_bytes"] == 64 * 1024**2
    assert stats["stale_total"] >= 1 and stats["cas_swapped_total"] >= 2 and stats["entries"] >= 1
    assert stats["rss_bytes"] > 0
    assert plain.health() == {plain.endpoints[0]: True}


def test_batched_multi_mib_put_and_get(plain):
    items = [(b"big/%d" % i, chunk(i), CHUNK) for i in range(3000)]  # ~12 MiB: split into batches
    plain.put(items)
    got = plain.get([k for k, _, _ in items])
    assert all(e is not None and e.value == v for e, (_, v, _) in zip(got, items))
    channel, stub = stub_for(plain.endpoints[0])
    with channel:  # one unsplit 8 MiB message is accepted by the server too
        resp = stub.Get(acs_pb2.GetRequest(keys=[k for k, _, _ in items[:2048]]), timeout=5)
        assert len(resp.data) == 2048 * CHUNK and all(resp.found)


def test_capacity_evicts_least_recently_modified_reads_do_not_save(deployments):
    dep = deployments["small"]
    with CacheClient(dep.data_endpoints) as client:
        (before,) = client.stats().values()
        capacity = before["capacity_bytes"]
        order = []

        def write(keys):
            client.put([(k, chunk(int(k.split(b"#")[1])), CHUNK) for k in keys])
            for k in keys:
                if k in order:
                    order.remove(k)
                order.append(k)

        a = [b"a#%d" % i for i in range(100)]
        b = [b"b#%d" % i for i in range(40)]
        for i in range(0, 100, 10):
            write(a[i:i + 10])
        write(b)
        for _ in range(10):
            assert all(e is not None for e in client.get(a[:50]))  # hot reads ...
        write(a[50:60])  # ... but only writes refresh
        write([b"c#%d" % i for i in range(60)])
        (after,) = client.stats().values()
        assert after["evicted_total"] > 0
        assert after["used_bytes"] <= capacity * GC_START_FRACTION
        present = [k for k, e in zip(order, client.get(order)) if e is not None]
        assert present == order[len(order) - len(present):], "evicted must be the least recently modified"
        assert a[0] not in present  # read ten times, still evicted first
        assert set(a[50:60]) <= set(present)
        per_entry = CHUNK + 5 + ENTRY_OVERHEAD_BYTES
        assert len(present) * per_entry <= capacity * GC_START_FRACTION
        assert len(present) * (per_entry + 8) >= capacity * GC_LOW_WATERMARK_FRACTION - 10 * per_entry


def test_memory_stays_within_capacity_under_a_flood(deployments):
    dep = deployments["flood"]
    with CacheClient(dep.data_endpoints) as client:
        (before,) = client.stats().values()
        capacity = before["capacity_bytes"]
        batch = [chunk(i) for i in range(256)]  # 1 MiB per put
        for n in range(64):  # 64 MiB through a 16 MiB cache
            client.put([(b"flood/%d/%d" % (n, i), v, CHUNK) for i, v in enumerate(batch)])
            (stats,) = client.stats().values()
            assert stats["used_bytes"] <= capacity * GC_START_FRACTION
        (after,) = client.stats().values()
        assert after["evicted_total"] > 0 and after["entries"] * CHUNK < capacity
        # RSS loosely: the charged bytes bound the heap; allow allocator slack and gRPC buffers.
        assert after["rss_bytes"] - before["rss_bytes"] < 2 * capacity + 32 * 1024**2, (before, after)


def test_metadata_of_live_files_survives_a_flood(deployments):
    """A metadata server of adequate capacity: entries that keep being written (live files'
    lengths, heads, leases) outlive a flood of entries that are written once."""
    dep = deployments["meta"]
    with CacheClient(dep.metadata_endpoints, name="metadata cache") as client:
        live = [b"len/stream/%05d/live.acs" % i for i in range(50)]
        version = 0
        for n in range(60):
            version += 1
            client.put([(k, b"%d,%d" % (version * 100, version * 100), version) for k in live])
            client.put([(b"len/stream/old/%d/%d.acs" % (n, i), b"x" * 200, 1) for i in range(100)])
        (stats,) = client.stats().values()
        assert stats["role"] == "metadata" and stats["evicted_total"] > 0
        assert stats["default_ttl_ms"] == 24 * 3600 * 1000
        got = client.get(live, consistent=True)
        assert all(e is not None and e.version == version for e in got)


def test_ttl_expiry_on_a_short_ttl_server(deployments, plain):
    with CacheClient(deployments["ttl"].data_endpoints) as client:
        client.put([(b"t", b"v", 1)])
        assert client.get([b"t"]) == [Entry(b"v", 1)]
        time.sleep(0.5)
        assert client.get([b"t"]) == [None]
        client.put([(b"long", b"v", 1)], ttl=30)  # a put may carry its own TTL
        time.sleep(0.5)
        assert client.get([b"long"]) == [Entry(b"v", 1)]
    plain.put([(b"short-lived", b"v", 1)], ttl=0.2)  # shorter than the role default
    time.sleep(0.4)
    assert plain.get([b"short-lived"]) == [None]


def test_token_auth_rejects_a_wrong_or_missing_token(deployments):
    endpoints = deployments["token"].data_endpoints
    with CacheClient(endpoints, token="s3cret") as good:
        good.put([(b"k", b"v", 1)])
        assert good.get([b"k"]) == [Entry(b"v", 1)]
    for token in ("wrong", None):
        with CacheClient(endpoints, token=token) as bad:
            with pytest.raises(CacheError) as info:
                bad.get([b"k"])
            assert not isinstance(info.value, CacheUnavailableError)
            assert endpoints in str(info.value) and "UNAUTHENTICATED" in str(info.value)
            assert isinstance(info.value.__cause__, grpc.RpcError)
            # Puts go on a PutStream: refused the same way, naming the status, as a CacheError
            with pytest.raises(CacheError) as info:
                bad.put([(b"k", b"w", 2)])
            assert not isinstance(info.value, CacheUnavailableError)
            assert endpoints in str(info.value) and "UNAUTHENTICATED" in str(info.value)
            assert isinstance(info.value.__cause__, grpc.RpcError)
            assert bad.health() == {endpoints: False}
            assert bad.down_endpoints() == ()  # a live replica refusing us is not "down"


def test_metrics_endpoint_serves_prometheus_text(deployments, plain):
    plain.get([b"metrics-probe"])
    port = deployments["plain"].server("data", 0).metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    assert "# TYPE acs_cache_gets_total counter" in text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["acs_cache_used_bytes"].labels == {"role": "data"}
    assert samples["acs_cache_used_bytes"].value >= 0
    assert samples["acs_cache_misses_total"].value >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
        assert resp.headers["Content-Type"] == "application/json"
        assert json.loads(resp.read()) == {"healthy": True, "role": "data", "uptime_s": ANY}


def test_sigterm_stops_gracefully(tmp_path):
    with LocalDeployment(tmp_path, data_replicas=1, metadata_replicas=0, capacity="1MiB") as dep:
        server = dep.server("data", 0)
        popen = server.popen
        dep.kill("data", 0, sig=signal.SIGTERM)
        assert popen.returncode == 0
        assert "stopped" in open(server.log_path).read()
        dep.restart("data", 0)  # comes back on the same port
        assert dep.server("data", 0).port == server.port
        with CacheClient(dep.data_endpoints) as client:
            assert client.health() == {dep.data_endpoints: True}
    assert not os.path.exists(server.pid_path)


def run_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pyspark_acs.server.cache", *args],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_bad_flags_exit_2_naming_the_flag():
    cases = {
        "--capacity": ["--role", "data", "--capacity", "12XB"],
        "--ttl": ["--role", "data", "--ttl", "soon"],
        "--role": ["--role", "chunks"],
        "--port": ["--role", "data", "--port", "70000"],
        "--capacity ": ["--role", "data", "--capacity", "1KiB"],  # below the minimum
        "--ttl ": ["--role", "metadata", "--ttl", "0s"],
    }
    procs = {flag: run_cli(*args) for flag, args in cases.items()}
    errs = {}
    for flag, proc in procs.items():
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 2, (flag, out, err)
        assert f"argument {flag.strip()}:" in err, err
        assert out == ""
        errs[flag] = err
    assert "'12XB' is not a byte size" in errs["--capacity"]
    assert "too small" in errs["--capacity "] and "too small" in errs["--ttl "]
    assert "invalid choice: 'chunks'" in errs["--role"]
    assert "not a port number" in errs["--port"]


def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("--role", "data", "--port", str(port), "--parent-pid", str(os.getpid()))
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"127.0.0.1:{port}" in err and "cannot bind" in err


def test_start_failure_reports_the_log_tail(tmp_path):
    from pyspark_acs.server.local.deploy import DeploymentError

    dep = LocalDeployment(tmp_path, data_replicas=1, metadata_replicas=0, capacity=1024)  # below the minimum
    t0 = time.monotonic()
    with pytest.raises(DeploymentError) as info:
        dep.start()
    assert time.monotonic() - t0 < 15
    message = str(info.value)
    assert "data-0 cache server exited with status 2" in message
    assert "argument --capacity" in message and "too small" in message
    assert not (tmp_path / "deployment.json").exists()


def test_acs_up_then_acs_down_from_another_process(tmp_path):
    from pyspark_acs.server.local.deploy import DeploymentError, acs_down, acs_up

    dep = acs_up(tmp_path, data_replicas=2, metadata_replicas=1, capacity="4MiB")
    try:
        state = load_deployment(tmp_path)
        assert state["data_endpoints"] == dep.data_endpoints and len(state["servers"]) == 3
        assert oct((tmp_path / "deployment.json").stat().st_mode & 0o777) == "0o600"
        with pytest.raises(DeploymentError, match="already has a running deployment"):
            acs_up(tmp_path)
        pids = [s["pid"] for s in state["servers"]]
        with CacheClient(dep.metadata_endpoints) as client:
            client.put([(b"k", b"v", 1)])
        code = (
            "import sys, json; from pyspark_acs.server.local.deploy import acs_down; "
            f"print(json.dumps(acs_down({str(tmp_path)!r})))"
        )
        out = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert sorted(__import__("json").loads(out.stdout)) == ["data-0", "data-1", "metadata-0"]
        for popen in (s.popen for role in ("data", "metadata") for s in dep.servers[role]):
            assert popen.wait(timeout=10) == 0  # SIGTERM: graceful exit
        assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)
        assert load_deployment(tmp_path) is None
        assert acs_down(tmp_path) == []
    finally:
        dep.stop()


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and glibc's mallopt")
def test_a_large_get_is_answered_from_reused_memory_not_fresh_pages(deployments, plain):
    """acs-cache-server tunes glibc's mmap and trim thresholds at start (server/malloc.py): a
    1 MiB answer's buffers come from the heap, reused, instead of a fresh mmap faulted in page by
    page and unmapped after (hundreds of minor page faults per 1 MiB Get without, about one
    with)."""
    keys = [b"malloc/%04d" % i for i in range(256)]
    plain.put([(k, bytes([i % 251]) * 4096, 1) for i, k in enumerate(keys)])
    pid = deployments["plain"].server("data", 0).pid
    for _ in range(20):  # the heap grows to its working size
        plain.get(keys)
    before = _minor_faults(pid)
    for _ in range(50):
        assert len(plain.get(keys)) == 256
    per_get = (_minor_faults(pid) - before) / 50
    assert per_get < 64, f"{per_get:.0f} page faults per 1 MiB Get (256 pages): buffers are mapped afresh"


def test_store_lookup_agrees_with_indexing_through_writes_and_evictions():
    """The entries' lookup (the Get handler's per-key read of cachetools' own dict) gives what
    ``entries[key]`` gives: the item, or None for a key never written, deleted or evicted."""
    s = Store(64 * 1024, 60)
    for i in range(40):  # more than fit: the first ones are evicted
        s.put(b"k%d" % i, b"v" * 4000, 1)
    s.delete_many([b"k39"])
    entries = s._entries
    for key in [b"k%d" % i for i in range(40)] + [b"never"]:
        assert entries.lookup(key) is entries[key]
    assert entries.lookup(b"k0") is None and entries.lookup(b"k38") is not None


# -- what a Follow stream sends (server/cache/watch.py) -----------------------------------------


def _take_one_chunk_at_a_time(chunks, start, budget):
    """The rule of FileFollow.take, a chunk at a time: the bytes from ``start`` the store holds
    contiguously (a chunk's valid prefix is its version), at most ``budget``."""
    out, pos, left = [], start, budget
    while left > 0:
        n, skip = divmod(pos, 4096)
        entry = chunks.get(n)
        if entry is None or entry[1] <= skip:
            break
        piece = entry[0][skip:entry[1]][:left]
        out.append(piece)
        pos += len(piece)
        left -= len(piece)
        if skip + len(piece) < 4096:
            break
    return b"".join(out)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.helpers import ROOT


@settings(max_examples=150, deadline=None)
@given(present=st.lists(st.integers(0, 4096), min_size=0, max_size=60), start=st.integers(0, 70 * 4096),
       budget=st.one_of(st.integers(1, 300_000), st.integers(1, 70).map(lambda k: k * 4096)))
def test_a_follow_push_takes_what_the_store_holds_contiguously(present, start, budget):
    """Chunks are looked up a window at a time (doubling): the push is the same bytes as a
    lookup per chunk gives -- up to a missing chunk, a chunk shorter than the cursor, the end of
    a partial chunk or the budget -- and the file stays marked when the budget ran out, also
    exactly at a chunk's end (its next bytes go in the next message, not after its next put)."""
    from pyspark_acs.cache.chunks import chunk_key, file_id
    from pyspark_acs.server.cache.watch import FileFollow

    store = Store(1 << 30, 600.0)
    fid = file_id("file:///s/00000/f.acs")
    chunks = {}
    for n, valid in enumerate(present):  # valid 0: the chunk is absent
        if valid:
            value = bytes([n % 251]) * valid
            chunks[n] = (value, valid)
            store.put(chunk_key("", n, file_id=fid), value, valid)
    follow = FileFollow()
    follow.cursors[fid] = start
    follow.mark(fid)
    runs = follow.take(store, budget)
    want = _take_one_chunk_at_a_time(chunks, start, budget)
    got = b"".join(b"".join(r[2]) for r in runs)
    assert got == want
    if want:
        assert runs == [(fid, start, runs[0][2], len(want))]
        assert follow.cursors[fid] == start + len(want)
    else:
        assert runs == [] and follow.cursors[fid] == start
    assert (fid in follow.marked) == (len(want) == budget)


def test_a_file_with_a_backlog_does_not_hold_a_follow_streams_other_files_off():
    """Files whose runs use up a message's budget go to the back of the marked files: with
    three files behind by many chunks and a budget of a few, the messages take turns."""
    from pyspark_acs.cache.chunks import chunk_key, file_id
    from pyspark_acs.server.cache.watch import FileFollow

    store = Store(1 << 30, 600.0)
    follow = FileFollow()
    fids = [file_id(f"file:///s/00000/f{i}.acs") for i in range(3)]
    for fid in fids:
        for n in range(40):
            store.put(chunk_key("", n, file_id=fid), b"v" * 4096, 4096)
        follow.cursors[fid] = 0
        follow.mark(fid)
    order = [follow.take(store, 8 * 4096)[0][0] for _ in range(9)]
    assert order == fids * 3
    assert all(follow.cursors[fid] == 3 * 8 * 4096 for fid in fids)


def test_followers_at_one_cursor_share_one_message_until_the_file_grows():
    """``Watchers.next_message``: the first stream at a cursor takes its run from the store and
    encodes it; the others at that cursor are sent the same message, with no store read and no
    encode, and move to the same cursor. A stored chunk of the file drops what was kept: the
    next message holds the new bytes. A stream elsewhere in the file gets its own bytes, and a
    run cut by the budget (more bytes follow) is not kept."""
    from pyspark_acs.cache.chunks import chunk_key, file_id
    from pyspark_acs.server.cache.watch import SENT_KEPT_PER_FILE, FileFollow, Watchers

    store = Store(1 << 30, 600.0)
    watchers = Watchers(store)
    fid = file_id("file:///s/00000/shared.acs")
    data = bytes(range(251)) * 100  # 25,100 bytes: six chunks and a partial one

    def put(upto: int) -> None:
        keys = []
        for n in range(0, (upto + 4095) // 4096):
            value = data[n * 4096:min(upto, (n + 1) * 4096)]
            store.put(chunk_key("", n, file_id=fid), value, len(value))
            keys.append(chunk_key("", n, file_id=fid))
        watchers.stored(keys)

    encoded = []

    def encode(runs):
        encoded.append([(r[1], r[3]) for r in runs])
        return b"|".join(b"".join(r[2]) for r in runs)

    reads = [0]
    read_many = store.read_many

    def counting(*a, **kw):
        reads[0] += 1
        return read_many(*a, **kw)

    store.read_many = counting
    streams = [FileFollow() for _ in range(5)]
    for f in streams[:4]:
        watchers.follow(f, [fid], [0], ())
    watchers.follow(streams[4], [fid], [10_000], ())
    put(12_000)
    sent = [watchers.next_message(f, encode) for f in streams]
    assert [m for m, _ in sent[:4]] == [data[:12_000]] * 4
    assert all(m is sent[0][0] for m, _ in sent[:4])  # the one message object, sent again
    assert sent[4] == (data[10_000:12_000], 2_000)
    assert encoded == [[(0, 12_000)], [(10_000, 2_000)]]
    assert watchers.counts["pushed_shared_total"] == 3
    assert all(f.cursors[fid] == 12_000 and not f.marked for f in streams)
    # The file grows: nothing kept is sent again; every stream gets the new bytes.
    put(20_000)
    reads_before = reads[0]
    again = [watchers.next_message(f, encode) for f in streams]
    assert all(m == data[12_000:20_000] for m, _ in again)
    assert reads[0] > reads_before and encoded[-1] == [(12_000, 8_000)]
    assert watchers.counts["pushed_shared_total"] == 3 + 4
    # Nothing marked: nothing to send.
    assert watchers.next_message(streams[0], encode) == (None, 0)
    # A run that used a message's budget up is not kept (the file stays marked for the rest).
    from pyspark_acs.server.cache.watch import MAX_PUSH_BYTES

    big = file_id("file:///s/00000/big.acs")
    for n in range(MAX_PUSH_BYTES // 4096 + 8):
        store.put(chunk_key("", n, file_id=big), b"b" * 4096, 4096)
    a, b = FileFollow(), FileFollow()
    watchers.follow(a, [big], [0], ())
    watchers.follow(b, [big], [0], ())
    shared = watchers.counts["pushed_shared_total"]
    assert [watchers.next_message(f, encode)[1] for f in (a, b)] == [MAX_PUSH_BYTES] * 2
    assert a.marked and b.marked and watchers.counts["pushed_shared_total"] == shared
    assert big not in watchers._sent
    # Kept messages are bounded per file, and the last follower's leaving drops them.
    for i in range(SENT_KEPT_PER_FILE + 2):
        f = FileFollow()
        watchers.follow(f, [fid], [i * 100], ())
        watchers.next_message(f, encode)
    assert len(watchers._sent[fid]) == SENT_KEPT_PER_FILE
    for f in list(watchers._by_file[fid]):
        watchers.drop_follow(f)
    assert fid not in watchers._sent


def test_kept_follow_messages_are_bounded_per_replica_and_a_delete_drops_them():
    """Kept messages are not charged to the store, so a replica holds at most SENT_KEPT_BYTES of
    them (review reproduction: 32 files of ~1 MB with readers at four cursors each kept 133 MB
    beside an 8 MB store); past it a message is sent and not kept, and /metrics shows the
    bytes kept. A ``Delete`` of a chunk drops its file's kept messages: the push then stops at
    the missing chunk, as a Get misses it."""
    from pyspark_acs.cache.chunks import CHUNK_SIZE, chunk_key, file_id
    from pyspark_acs.server.cache.server import _encode_runs
    from pyspark_acs.server.cache.watch import MAX_PUSH_BYTES, SENT_KEPT_BYTES, SENT_KEPT_PER_FILE, FileFollow, Watchers

    store = Store(64 << 20, 600.0)  # holds every file: the Delete below is the only gap
    watchers = Watchers(store)
    nchunks = MAX_PUSH_BYTES // CHUNK_SIZE - 1  # a file just under one message
    fids = []
    for i in range(32):
        fid = file_id(f"file:///k/{i}.acs")
        fids.append(fid)
        store.put_many([(chunk_key("", n, file_id=fid), bytes([i]) * CHUNK_SIZE, CHUNK_SIZE)
                        for n in range(nchunks)])
        for j in range(SENT_KEPT_PER_FILE):
            f = FileFollow()
            watchers.follow(f, [fid], [j * CHUNK_SIZE], ())
            message, size = watchers.next_message(f, _encode_runs)
            assert size == (nchunks - j) * CHUNK_SIZE and message is not None
    kept = sum(len(m) for per in watchers._sent.values() for _, m in per.values())
    assert kept == watchers.kept_bytes <= SENT_KEPT_BYTES
    assert kept > SENT_KEPT_BYTES - MAX_PUSH_BYTES - 1024  # it filled up to the bound
    # A Delete of one chunk of a file drops what was kept for it (and the count follows).
    kept_file = next(fid for fid in fids if fid in watchers._sent)
    dropped = sum(len(m) for _, m in watchers._sent[kept_file].values())
    store.delete_many([chunk_key("", 5, file_id=kept_file)])
    watchers.deleted([chunk_key("", 5, file_id=kept_file), b"not a chunk key"])
    assert kept_file not in watchers._sent and watchers.kept_bytes == kept - dropped
    f = FileFollow()
    watchers.follow(f, [kept_file], [0], ())
    assert watchers.next_message(f, _encode_runs)[1] == 5 * CHUNK_SIZE  # stops at the deleted chunk
    # The last follower of each file leaving drops everything.
    for fid in fids:
        for s in list(watchers._by_file.get(fid, ())):
            watchers.drop_follow(s)
    assert watchers._sent == {} and watchers.kept_bytes == 0
