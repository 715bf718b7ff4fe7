"""TLS round trips through ``acs up --secure`` (docs/security.md): two clusters, each ``acs up`` as a user
runs it (cluster B reusing A's CA, certificate and token file through the explicit flags), copy
daemons that take their token and TLS files from the topology file's ``security`` table alone,
a Producer in A, a Consumer in B and a Spark batch query in B given the files as options.
Plaintext and token-less clients are refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.proto import acs_pb2, acs_pb2_grpc
from pyspark_acs.errors import CacheError
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.security import SecuritySettings, resolve_security
from pyspark_acs.server.copy.proto import copy_pb2, copy_pb2_grpc
from pyspark_acs.write.producer import Producer

from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.slow
SECURITY_ENV = ("ACS_CACHE_TOKEN", "ACS_TOKEN_FILE", "ACS_TLS_CA", "ACS_TLS_CERT", "ACS_TLS_KEY", "ACS_TLS_MTLS")
N = 120


def _acs(env, *args):
    return subprocess.run([sys.executable, "-m", "pyspark_acs.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)


def _exports(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("export ")][-1]
    return dict(item.split("=", 1) for item in line[len("export "):].split())


@pytest.fixture(scope="module")
def secure(tmp_path_factory, spark):  # Spark first: its JVM starts before this module opens channels
    base = tmp_path_factory.mktemp("tls")
    env = {k: v for k, v in os.environ.items() if k not in SECURITY_ENV and not k.startswith("ACS_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    topology = str(base / "topology.json")
    roots = {c: str(base / f"root-{c}") for c in "AB"}
    copy_ports = {c: free_port() for c in "AB"}
    dirs = {c: str(base / f"dep-{c}") for c in "AB"}
    out = _acs(env, "up", "--secure", "--dir", dirs["A"], "--data-replicas", "1", "--metadata-replicas", "1",
               "--cluster", "A", "--topology", topology, "--root", roots["A"], "--copy-port", str(copy_ports["A"]))
    assert out.returncode == 0, out.stderr
    a = _exports(out.stdout)
    tls = {"token_file": a["ACS_TOKEN_FILE"], "tls_ca": a["ACS_TLS_CA"], "tls_cert": a["ACS_TLS_CERT"],
           "tls_key": a["ACS_TLS_KEY"]}
    out = _acs(env, "up", "--dir", dirs["B"], "--data-replicas", "1", "--metadata-replicas", "1",
               "--token-file", tls["token_file"], "--tls-ca", tls["tls_ca"], "--tls-cert", tls["tls_cert"],
               "--tls-key", tls["tls_key"], "--cluster", "B", "--topology", topology, "--root", roots["B"],
               "--copy-port", str(copy_ports["B"]), "--link", "A")
    assert out.returncode == 0, out.stderr
    b = _exports(out.stdout)
    # The topology file carries the security settings and the stream for the copy daemons.
    data = json.loads(open(topology).read())
    data["security"] = tls
    data["streams"] = {"tls": {"source": "A", "destinations": ["B"]}}
    with open(topology, "w") as f:
        json.dump(data, f)
    daemons = []
    try:
        for c in "AB":
            proc = subprocess.Popen([sys.executable, "-m", "pyspark_acs.server.copy.daemon", "--topology", topology,
                                     "--cluster", c, "--parent-pid", str(os.getpid()), "--set", "poll_interval=20ms",
                                     "--set", "listing_interval=300ms"],
                                    stdout=subprocess.PIPE, stderr=open(base / f"daemon-{c}.log", "ab"), env=env,
                                    cwd=ROOT)
            daemons.append(proc)
            line = proc.stdout.readline().decode()
            assert "listening on" in line, (base / f"daemon-{c}.log").read_text()
        yield {"A": a, "B": b, "tls": tls, "roots": roots, "copy_ports": copy_ports, "base": base}
    finally:
        for proc in daemons:
            proc.terminate()
            proc.wait(timeout=20)
        for c in "AB":
            _acs(env, "down", "--dir", dirs[c])


def test_producer_consumer_copy_daemon_and_spark_over_tls(secure, spark, monkeypatch):
    tls, a, b = secure["tls"], secure["A"], secure["B"]
    for name in SECURITY_ENV:
        monkeypatch.delenv(name, raising=False)
    # A plaintext client, and a TLS client without the token, are refused.
    channel = grpc.insecure_channel(a["ACS_DATA_CACHE"])
    with pytest.raises(grpc.RpcError) as info:
        acs_pb2_grpc.CacheStub(channel).Health(acs_pb2.HealthRequest(), timeout=3)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()
    with CacheClient(a["ACS_DATA_CACHE"], security=SecuritySettings(tls_ca=tls["tls_ca"])) as no_token:
        with pytest.raises(CacheError, match="token"):
            no_token.put([(b"k", b"v", 1)])
    copy_channel = SecuritySettings(tls_ca=tls["tls_ca"]).channel(f"127.0.0.1:{secure['copy_ports']['B']}")
    with pytest.raises(grpc.RpcError) as info:
        copy_pb2_grpc.CopyStub(copy_channel).Health(copy_pb2.HealthRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    copy_channel.close()

    # The shell after `acs up --secure`: the exported files, nothing else.
    for name in ("ACS_TOKEN_FILE", "ACS_TLS_CA"):
        monkeypatch.setenv(name, a[name])
    with Producer(secure["roots"]["A"], "tls", shards=2, data_cache=a["ACS_DATA_CACHE"],
                  metadata_cache=a["ACS_METADATA_CACHE"], max_batch_delay=0.001) as p:
        for i in range(N):
            p.send(f"m{i:05d}".encode(), key=str(i % 5).encode())
        p.flush(timeout=30)
    from pyspark_acs.storage.store import DurableStore

    store_b = DurableStore(secure["roots"]["B"])
    deadline = time.monotonic() + 60
    while store_b.stream_shards("tls") is None and time.monotonic() < deadline:  # the copy creates it
        time.sleep(0.1)
    store_b.close()
    c = Consumer(secure["roots"]["B"], "tls", data_cache=b["ACS_DATA_CACHE"], metadata_cache=b["ACS_METADATA_CACHE"])
    got = []
    deadline = time.monotonic() + 60
    try:
        while len(got) < N and time.monotonic() < deadline:
            for batch in c.poll():
                got.extend(batch.column("value").to_pylist())
            time.sleep(0.02)
    finally:
        c.close()
    assert sorted(got) == sorted(f"m{i:05d}".encode() for i in range(N)), (len(got), secure["base"])
    # The cache lengths in B were published by B's copy daemon through TLS.
    with CacheClient(b["ACS_METADATA_CACHE"], security=resolve_security()) as meta:
        assert meta.stats()

    # Spark: the token file and CA as options (the Python workers' environment has neither).
    monkeypatch.delenv("ACS_TOKEN_FILE")
    monkeypatch.delenv("ACS_TLS_CA")
    df = (spark.read.format("acs").option("root", secure["roots"]["B"]).option("stream", "tls")
          .option("dataCache", b["ACS_DATA_CACHE"]).option("metadataCache", b["ACS_METADATA_CACHE"])
          .option("tokenFile", tls["token_file"]).option("tlsCa", tls["tls_ca"]).load())
    assert df.count() == N

    # Producer and Consumer arguments: the settings given explicitly, nothing in the environment.
    explicit = resolve_security(token_file=tls["token_file"], tls_ca=tls["tls_ca"])
    with Producer(secure["roots"]["A"], "tls-arg", shards=1, data_cache=a["ACS_DATA_CACHE"],
                  metadata_cache=a["ACS_METADATA_CACHE"], security=explicit) as p:
        p.send(b"by-argument")
        p.flush(timeout=30)
        assert p.stats()["cache_errors"] == 0
    c = Consumer(secure["roots"]["A"], "tls-arg", data_cache=a["ACS_DATA_CACHE"],
                 metadata_cache=a["ACS_METADATA_CACHE"], security=explicit)
    try:
        got = [r["value"] for batch in c.batches(timeout=5) for r in batch.to_pylist()]
        stats = c.stats()
    finally:
        c.close()
    assert got == [b"by-argument"]
    assert stats["durable_bytes"] == 0, stats  # read through the TLS caches, not around them
