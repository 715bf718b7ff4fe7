"""Security findings 3 to 7 (docs/security.md), against real cache-server processes (``acs up`` as a user runs it,
LocalDeployment) on loopback: the token from the environment or a file reaches the servers and
every Cache method refuses calls without it; bounded work per request (the amplification Get
answered RESOURCE_EXHAUSTED with the server's peak RSS bounded); expiry sweeps off the put
path; the security settings resolved in one place; TLS round trips through ``acs up --secure``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.proto import acs_pb2, acs_pb2_grpc
from pyspark_acs.errors import AcsOptionError
from pyspark_acs.security import SecuritySettings, check_bind, resolve_security
from pyspark_acs.server.cache.server import MAX_KEYS_PER_CALL, MAX_RESPONSE_BYTES
from pyspark_acs.server.cache.store import Store
from pyspark_acs.server.local.deploy import LocalDeployment, load_deployment
from tests.helpers import Collector

TIMEOUT = 120


def _acs(python_exe, env, *args, timeout=TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([python_exe, "-m", "pyspark_acs.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _exports(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("export ")][-1]
    return dict(item.split("=", 1) for item in line[len("export "):].split())


# -- the settings -----------------------------------------------------------------------------------


def test_settings_resolve_from_argument_then_environment_and_pickle(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    env = {"ACS_TOKEN_FILE": str(token_file), "ACS_TLS_CA": "/ca.pem"}
    assert resolve_security(env=env).token == "from-file"
    assert resolve_security(env=dict(env, ACS_CACHE_TOKEN="from-env")).token == "from-env"
    assert resolve_security(token="explicit", env=env).token == "explicit"
    s = resolve_security(env=env)
    assert s.tls_ca == "/ca.pem" and s.client_tls and not s.server_tls
    assert pickle.loads(pickle.dumps(s)) == s
    assert "from-file" not in repr(s)
    (tmp_path / "empty").write_text("\n")
    for bad, option in (({"ACS_TOKEN_FILE": str(tmp_path / "empty")}, "ACS_TOKEN_FILE"),
                        ({"ACS_TOKEN_FILE": str(tmp_path / "missing")}, "ACS_TOKEN_FILE"),
                        ({"ACS_TLS_CERT": "/c.pem"}, "tls_cert"),
                        ({"ACS_TLS_MTLS": "1"}, "mtls"),
                        ({"ACS_TLS_MTLS": "maybe"}, "ACS_TLS_MTLS")):
        with pytest.raises(AcsOptionError) as info:
            resolve_security(env=bad)
        assert info.value.option == option, info.value
    check_bind("127.0.0.1", SecuritySettings(), False, what="x")
    with pytest.raises(AcsOptionError, match="--insecure"):
        check_bind("0.0.0.0", SecuritySettings(token="t"), False, what="x")
    check_bind("0.0.0.0", SecuritySettings(), True, what="x")


# -- the settings travel in the objects, not in the process ------------------------------------------


def test_sources_with_different_tokens_in_one_process_keep_to_their_own(tmp_path, monkeypatch):
    """Two Spark sources with different tokens in one process each read through their own
    token-protected caches (the settings travel in the options, pickled as Spark ships a reader
    to a worker), and neither token reaches a later plain Consumer: there is no process default,
    and the shared length poller and byte feed are per endpoints and settings."""
    from pyspark_acs import Consumer, Producer
    from pyspark_acs.cache.feed import ChunkFeed
    from pyspark_acs.cache.poller import LengthPoller
    from pyspark_acs.datasource.options import parse_source_options
    from pyspark_acs.datasource.source import AcsBatchReader, _task_read_path

    for name in ("ACS_CACHE_TOKEN", "ACS_TOKEN_FILE", "ACS_TLS_CA", "ACS_DATA_CACHE", "ACS_METADATA_CACHE"):
        monkeypatch.delenv(name, raising=False)
    n = 40
    with LocalDeployment(str(tmp_path / "a"), data_replicas=1, metadata_replicas=1, token="token-a") as a, \
            LocalDeployment(str(tmp_path / "b"), data_replicas=1, metadata_replicas=1, token="token-b") as b:
        deployments = {"a": a, "b": b}
        options = {}
        for name, dep in deployments.items():
            root = str(tmp_path / f"root-{name}")
            with Producer(root, "s", shards=1, data_cache=dep.data_endpoints, metadata_cache=dep.metadata_endpoints,
                          cache_token=f"token-{name}") as p:
                for i in range(n):
                    p.send(f"{name}{i}".encode())
                p.flush(timeout=30)
                assert p.stats()["cache_errors"] == 0
            options[name] = parse_source_options({"root": root, "stream": "s", "dataCache": dep.data_endpoints,
                                                  "metadataCache": dep.metadata_endpoints,
                                                  "cacheToken": f"token-{name}"})
        paths = {}
        for name in ("a", "b", "a"):  # a's options are unpickled last: a process default would be a's token
            reader = AcsBatchReader(options[name])
            parts = reader.partitions()
            worker = pickle.loads(pickle.dumps(reader))  # as Spark ships read() to a Python worker
            got = [v for part in parts for batch in worker.read(pickle.loads(pickle.dumps(part)))
                   for v in batch.column("value").to_pylist()]
            assert got == [f"{name}{i}".encode() for i in range(n)]
            path = paths[name] = _task_read_path(worker.opts)
            stats = path.stats()
            assert stats["cache_bytes"] > 0 and stats["durable_bytes"] == 0, (name, stats)  # its caches took it
            assert path.data.security.token == path.meta.client.security.token == f"token-{name}"
        assert paths["a"].poller is not paths["b"].poller

        # A plain Consumer of a's caches: no token, so a's servers refuse it and it reads the store.
        plain = Consumer(str(tmp_path / "root-a"), "s", data_cache=a.data_endpoints,
                         metadata_cache=a.metadata_endpoints)
        try:
            assert plain.path.data.security.token is None and plain.path.meta.client.security.token is None
            assert plain.path.poller is not paths["a"].poller
            assert plain.path.poller.meta.client.security.token is None
            assert plain.path.feed is not None and plain.path.feed.client.security.token is None
            read = Collector(plain)
            read.until(lambda: len(read.values) >= n, 30, f"{n} messages")
            got = read.values + [v for batch in plain.poll() for v in batch.column("value").to_pylist()]
            stats = plain.stats()
        finally:
            plain.close()
        assert got == [f"a{i}".encode() for i in range(n)]
        assert stats["cache_bytes"] == 0 and stats["durable_bytes"] > 0, stats

        # The shared poller and feed are keyed by the settings, the token included.
        ends = a.metadata_endpoints.split(",")
        assert LengthPoller.shared(ends, token="token-a") is LengthPoller.shared(ends, token="token-a")
        assert LengthPoller.shared(ends, token="token-a") is not LengthPoller.shared(ends)
        assert (LengthPoller.shared(ends, security=SecuritySettings(token="token-a"))
                is not LengthPoller.shared(ends, security=SecuritySettings(token="token-b")))
        data = a.data_endpoints.split(",")
        with_token = ChunkFeed.shared(data, token="token-a")
        try:
            assert with_token is ChunkFeed.shared(data, token="token-a")
            assert with_token is not ChunkFeed.shared(data) and with_token.client.security.token == "token-a"
        finally:
            with_token.close()


# -- finding 3: acs up and the token --------------------------------------------------------------


def _calls(stub, metadata):
    """One call of every Cache method (the streams read their first answer)."""
    yield "Get", lambda: stub.Get(acs_pb2.GetRequest(keys=[b"k"]), metadata=metadata, timeout=5)
    yield "Put", lambda: stub.Put(acs_pb2.PutRequest(keys=[b"c:0"], data=b"forged", sizes=[6],
                                                     versions=[2**64 - 1]), metadata=metadata, timeout=5)
    yield "CompareAndSet", lambda: stub.CompareAndSet(acs_pb2.CompareAndSetRequest(key=b"w:x", value=b"[]",
                                                                                   expect_absent=True),
                                                      metadata=metadata, timeout=5)
    yield "Delete", lambda: stub.Delete(acs_pb2.DeleteRequest(keys=[b"k"]), metadata=metadata, timeout=5)
    yield "Stats", lambda: stub.Stats(acs_pb2.StatsRequest(), metadata=metadata, timeout=5)
    yield "Health", lambda: stub.Health(acs_pb2.HealthRequest(), metadata=metadata, timeout=5)
    yield "Watch", lambda: next(stub.Watch(iter([acs_pb2.WatchRequest()]), metadata=metadata, timeout=5))
    yield "Follow", lambda: next(stub.Follow(acs_pb2.FollowRequest(), metadata=metadata, timeout=5))


def test_acs_up_passes_the_token_from_the_environment_and_every_method_refuses_without_it(
        tmp_path, subprocess_env, python_exe):
    env = dict(subprocess_env, ACS_CACHE_TOKEN="up-token")
    env.pop("ACS_TOKEN_FILE", None)
    dep_dir = str(tmp_path / "dep")
    out = _acs(python_exe, env, "up", "--dir", dep_dir, "--data-replicas", "1", "--metadata-replicas", "1")
    assert out.returncode == 0, out.stderr
    try:
        exports = _exports(out.stdout)
        channel = grpc.insecure_channel(exports["ACS_DATA_CACHE"])
        stub = acs_pb2_grpc.CacheStub(channel)
        for metadata in (None, (("authorization", "Bearer wrong"),)):
            for method, call in _calls(stub, metadata):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        assert stub.Health(acs_pb2.HealthRequest(), metadata=(("authorization", "Bearer up-token"),), timeout=5)
        channel.close()
        # The token is in no server's command line (ps shows argv to every user).
        for server in load_deployment(dep_dir)["servers"]:
            with open(f"/proc/{server['pid']}/cmdline", "rb") as f:
                assert b"up-token" not in f.read()
        # /metrics and /healthz of the servers want it too.
        url = [ln for ln in out.stdout.splitlines() if ln.startswith("data-0")][0].split("metrics=")[1].split()[0]
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url, timeout=5)
        assert info.value.code == 401
        req = urllib.request.Request(url.replace("/metrics", "/healthz"), headers={"Authorization": "Bearer up-token"})
        assert json.loads(urllib.request.urlopen(req, timeout=5).read())["healthy"]
    finally:
        _acs(python_exe, env, "down", "--dir", dep_dir)


def test_acs_up_token_file_flag_and_non_loopback_refusal(tmp_path, subprocess_env, python_exe):
    env = dict(subprocess_env)
    env.pop("ACS_CACHE_TOKEN", None)
    env.pop("ACS_TOKEN_FILE", None)
    out = _acs(python_exe, env, "up", "--dir", str(tmp_path / "d0"), "--host", "0.0.0.0")
    assert out.returncode != 0 and "--insecure" in out.stderr, out.stderr
    token = tmp_path / "token"
    token.write_text("file-token\n")
    dep_dir = str(tmp_path / "d1")
    out = _acs(python_exe, env, "up", "--dir", dep_dir, "--data-replicas", "1", "--metadata-replicas", "0",
               "--token-file", str(token))
    assert out.returncode == 0, out.stderr
    try:
        exports = _exports(out.stdout)
        assert exports["ACS_TOKEN_FILE"] == str(token)
        with CacheClient(exports["ACS_DATA_CACHE"], token="wrong") as bad:
            with pytest.raises(Exception, match="token"):
                bad.put([(b"k", b"v", 1)])
        with CacheClient(exports["ACS_DATA_CACHE"], security=resolve_security(token_file=str(token))) as good:
            good.put([(b"k", b"v", 1)])
            assert good.get([b"k"])[0].value == b"v"
    finally:
        _acs(python_exe, env, "down", "--dir", dep_dir)


# -- findings 4 and 5: bounded work per request -------------------------------------------------------


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


#: What the amplification Get may add to the server's peak RSS (bytes): the answer it refuses
#: would have been 80 x 8 MiB = 640 MiB.
RSS_GROWTH_BOUND = 64 * 1024**2


def test_amplification_get_is_refused_before_it_is_assembled(tmp_path):
    with LocalDeployment(tmp_path / "dep", data_replicas=1, metadata_replicas=0, capacity="256MiB",
                         security=SecuritySettings()) as dep:
        server = dep.server("data", 0)
        channel = grpc.insecure_channel(server.endpoint, options=[("grpc.max_send_message_length", 64 * 1024**2),
                                                                 ("grpc.max_receive_message_length", 64 * 1024**2)])
        stub = acs_pb2_grpc.CacheStub(channel)
        value = b"v" * (8 * 1024**2)
        stub.Put(acs_pb2.PutRequest(keys=[b"big"], data=value, sizes=[len(value)], versions=[1]), timeout=30)
        before = _peak_rss(server.pid)
        with pytest.raises(grpc.RpcError) as info:
            stub.Get(acs_pb2.GetRequest(keys=[b"big"] * 80), timeout=30)  # a ~240-byte request
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(MAX_RESPONSE_BYTES) in info.value.details()
        growth = _peak_rss(server.pid) - before
        assert growth < RSS_GROWTH_BOUND, f"peak RSS grew by {growth / 2**20:.0f} MiB"
        # Repeated keys within the bound are answered, each position in order.
        reply = stub.Get(acs_pb2.GetRequest(keys=[b"big", b"none", b"big"]), timeout=30)
        assert list(reply.found) == [True, False, True] and list(reply.sizes) == [len(value), 0, len(value)]
        # Too many keys in one call.
        with pytest.raises(grpc.RpcError) as info:
            stub.Get(acs_pb2.GetRequest(keys=[b"k%d" % i for i in range(MAX_KEYS_PER_CALL + 1)]), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as info:
            keys = [b"k%d" % i for i in range(MAX_KEYS_PER_CALL + 1)]
            stub.Put(acs_pb2.PutRequest(keys=keys, data=b"", sizes=[0] * len(keys), versions=[1] * len(keys)),
                     timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Push streams are bounded too: too many keys (files) in one Watch (Follow) message.
        too_many = [b"k%d" % i for i in range(MAX_KEYS_PER_CALL + 1)]
        for call in (lambda: stub.Watch(iter([acs_pb2.WatchRequest(add=too_many)]), timeout=30),
                     lambda: stub.Follow(acs_pb2.FollowRequest(follow=too_many, offsets=[0] * len(too_many)),
                                         timeout=30),
                     # Files at latest count with the others: half each way is one too many.
                     lambda: stub.Follow(acs_pb2.FollowRequest(follow=too_many[:MAX_KEYS_PER_CALL // 2],
                                                               offsets=[0] * (MAX_KEYS_PER_CALL // 2),
                                                               latest=too_many[MAX_KEYS_PER_CALL // 2:]),
                                         timeout=30)):
            with pytest.raises(grpc.RpcError) as info:
                for _ in call():
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            assert "at most" in info.value.details()
        assert stub.Health(acs_pb2.HealthRequest(), timeout=5).serving
        channel.close()


def test_puts_do_not_sweep_and_the_sweeper_expires_in_slices():
    now = [0.0]
    store = Store(64 * 1024**2, 60.0, clock=lambda: now[0])
    for i in range(2000):  # 2000 distinct TTLs: 2000 groups
        store.put(b"k%d" % i, b"v", 1, ttl_s=1.0 + i / 1000)
    now[0] = 100.0
    store.put(b"fresh", b"v", 1)
    # The put swept nothing (expired entries read as absent, the sweeper drops them).
    assert store.stats()["expired_total"] == 0
    assert store.get(b"k1") is None  # a read drops the expired entry it meets
    assert store.expire(slice_steps=7) == 1999
    assert store.stats()["expired_total"] == 2000
    assert store.stats()["ttl_groups"] == 1 and len(store) == 1


# -- finding 7: the metrics endpoint's threads ----------------------------------------------------------


def test_metrics_endpoint_threads_are_bounded_and_idle_connections_time_out():
    import socket
    import threading

    from pyspark_acs.server.metrics import METRICS_THREADS, Metrics, MetricsEndpoint

    request_timeout = 1.0  # shorter than the default: the test waits for it once
    ep = MetricsEndpoint(Metrics("acs_test_", {}).registry, lambda: (True, {}), "127.0.0.1", 0,
                         security=SecuritySettings(token="m"), request_timeout=request_timeout).start()
    try:
        def request_threads() -> int:
            # This endpoint's request threads only: other tests' background threads (pollers,
            # push streams reconnecting) come and go in this process meanwhile.
            # (socketserver's thread per connection was named "Thread-N (process_request_thread)").
            return sum(1 for t in threading.enumerate()
                       if t.name.startswith("acs-metrics-req") or "process_request" in t.name)

        before = request_threads()
        idle = []
        for _ in range(40):
            idle.append(socket.create_connection(("127.0.0.1", ep.port)))
            # The server thread accepts meanwhile: a burst overflows the listen backlog (5) and
            # the kernel's SYN retries (1 s, 2 s, ...) took seconds.
            time.sleep(0.01)
        time.sleep(0.5)
        assert request_threads() - before <= METRICS_THREADS  # was one thread per connection
        # The server drops an idle connection after its timeout.
        idle[0].settimeout(request_timeout + 5)
        started = time.monotonic()
        assert idle[0].recv(1) == b""
        assert time.monotonic() - started <= request_timeout + 1
        for s in idle:
            s.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{ep.port}/healthz",
                                             headers={"Authorization": "Bearer m"})
                assert urllib.request.urlopen(req, timeout=2).status == 200
                break
            except (OSError, urllib.error.URLError):
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        ep.stop()


# -- TLS and mutual TLS on a cache server and its metrics endpoint ----------------------------------------


def test_mutual_tls_cache_server_and_https_metrics(tmp_path):
    import ssl

    from pyspark_acs.server.cache.server import CacheServer
    from pyspark_acs.server.local.tls import make_local_tls

    files = make_local_tls(tmp_path / "tls")
    token = open(files["token_file"]).read().strip()
    server_side = resolve_security(token_file=files["token_file"], tls_cert=files["cert"], tls_key=files["key"],
                                   tls_ca=files["ca"], mtls=True, env={})
    server = CacheServer("data", security=server_side, capacity_bytes=16 * 1024**2)
    server.start()
    try:
        # A client with the CA and the token but no certificate cannot connect.
        with CacheClient(server.endpoint, security=SecuritySettings(token=token, tls_ca=files["ca"]),
                         deadline=2.0) as anonymous:
            with pytest.raises(Exception):
                anonymous.put([(b"k", b"v", 1)])
        client_side = resolve_security(token_file=files["token_file"], tls_cert=files["client_cert"],
                                       tls_key=files["client_key"], tls_ca=files["ca"], mtls=True, env={})
        with CacheClient(server.endpoint, security=client_side, deadline=2.0) as client:
            client.put([(b"k", b"v", 1)])
            assert client.get([b"k"])[0].value == b"v"
        # /metrics over HTTPS with a client certificate and the token.
        assert server.metrics_url.startswith("https://")
        ctx = ssl.create_default_context(cafile=files["ca"])
        ctx.load_cert_chain(files["client_cert"], files["client_key"])
        req = urllib.request.Request(server.metrics_url, headers={"Authorization": f"Bearer {token}"})
        body = urllib.request.urlopen(req, timeout=5, context=ctx).read().decode()
        assert "acs_cache_puts_total" in body
    finally:
        server.stop()
