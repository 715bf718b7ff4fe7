"""The one metrics module (pyspark_acs/server/metrics.py): per-server registries, declared
metrics, and the /metrics + /healthz endpoint, scraped over HTTP from a real cache-server
process and real copy-daemon processes and parsed with ``prometheus_client.parser``.
"""

from __future__ import annotations

import gzip
import json
import os
import time
import urllib.error
import urllib.request
from typing import Dict, List, Tuple

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ROOT, Env, consume_all, deployments, produce
from pyspark_acs.cache.client import CacheClient
from pyspark_acs.server.local.deploy import LocalDeployment


def scrape(url: str, headers: Dict[str, str] = None) -> Tuple[str, Dict[str, object]]:
    """``(content type, {family name: family})`` of one scrape, parsed as Prometheus text."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
        ctype = resp.headers["Content-Type"]
        text = resp.read().decode()
    return ctype, {f.name: f for f in text_string_to_metric_families(text)}


def get_json(url: str) -> Tuple[int, str, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], json.loads(err.read())


def samples(families, name: str) -> List:
    """Samples of the family ``name`` (the name without ``_total`` for counters)."""
    return list(families[name].samples) if name in families else []


# -- in process: registries and declarations -------------------------------------------------


def test_each_server_has_a_registry_of_its_own():
    from pyspark_acs.server.copy.metrics import CopyMetrics

    b, c = CopyMetrics("B"), CopyMetrics("C")
    b.inc("bytes_total", 10, stream="s", source="A", target="B", storage="cache")
    assert b.get("bytes_total", stream="s", source="A", target="B", storage="cache") == 10
    assert c.get("bytes_total", stream="s", source="A", target="B", storage="cache") == 0
    assert 'cluster="B"' in b.render() and 'cluster="B"' not in c.render()
    assert not [m for m in REGISTRY.collect() if m.name.startswith("acs_")]  # never the global registry


def test_declared_names_and_labels_only():
    from pyspark_acs.server.copy.metrics import CopyMetrics

    m = CopyMetrics("B")
    with pytest.raises(KeyError, match="not declared"):
        m.inc("no_such_total")
    with pytest.raises(ValueError, match="takes the labels kind"):
        m.inc("errors_total", reason="x")
    with pytest.raises(ValueError):
        m.inc("errors_total", -1, kind="x")  # a counter never goes down
    with pytest.raises(ValueError, match="contradicts"):
        m.set("delay_seconds", 1.0, stream="s", shard=0, storage="cache", cluster="C")
    # The writer names the daemon's own cluster: one label, not two.
    m.set("delay_seconds", 1.5, stream="s", shard=0, storage="cache", cluster="B")
    assert m.get("delay_seconds", stream="s", shard=0, storage="cache") == 1.5
    m.inc("operations", 1, role="reader", storage="cache")
    m.inc("operations", -1, role="reader", storage="cache")
    assert m.get("operations", role="reader", storage="cache") == 0
    m.set("lag_bytes", 7, stream="s", shard=1, target="C", storage="durable")
    m.remove("lag_bytes", stream="s", shard=1, target="C", storage="durable")
    m.remove("lag_bytes", stream="s", shard=1, target="C", storage="durable")  # missing is fine
    assert ("lag_bytes", (("shard", "1"), ("storage", "durable"), ("stream", "s"), ("target", "C"))) \
        not in m.snapshot()
    families = {f.name: f for f in text_string_to_metric_families(m.render())}
    assert [s.labels for s in families["acs_copy_delay_seconds"].samples] == [
        {"cluster": "B", "shard": "0", "storage": "cache", "stream": "s"}]


def test_endpoint_health_callable_gzip_openmetrics_and_404():
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.metrics import MetricsEndpoint

    m = CopyMetrics("B")
    m.inc("tree_rebuilds_total")
    state = {"healthy": True, "fail": False}

    def health():
        if state["fail"]:
            raise RuntimeError("probe broke")
        return state["healthy"], {"cluster": "B"}

    endpoint = MetricsEndpoint(m.registry, health, "127.0.0.1", 0, name="test-metrics").start()
    try:
        base = endpoint.url.rsplit("/", 1)[0]
        assert get_json(base + "/healthz") == (200, "application/json", {"healthy": True, "cluster": "B"})
        state["healthy"] = False
        assert get_json(base + "/healthz")[:2] == (503, "application/json")
        state["fail"] = True
        code, _, body = get_json(base + "/healthz")
        assert code == 503 and body["healthy"] is False and "probe broke" in body["error"]

        req = urllib.request.Request(endpoint.url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert b'acs_copy_tree_rebuilds_total{cluster="B"} 1.0' in gzip.decompress(resp.read())
        ctype, _ = scrape(endpoint.url)
        assert ctype.startswith("text/plain; version=0.0.4")
        req = urllib.request.Request(endpoint.url, headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            assert resp.read().endswith(b"# EOF\n")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + "/nope", timeout=10)
        assert info.value.code == 404
    finally:
        endpoint.stop()
        endpoint.stop()  # idempotent


def test_a_taken_metrics_port_is_named():
    from pyspark_acs.server.metrics import MetricsEndpoint
    from prometheus_client import CollectorRegistry

    first = MetricsEndpoint(CollectorRegistry(), lambda: (True, {}), "127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=f"metrics port 127.0.0.1:{first.port}"):
            MetricsEndpoint(CollectorRegistry(), lambda: (True, {}), "127.0.0.1", first.port)
    finally:
        first.stop()


# -- real processes ------------------------------------------------------------------------


def test_scrape_a_cache_server_process(tmp_path):
    from pyspark_acs.server.metrics import CACHE_METRICS

    with LocalDeployment(tmp_path, data_replicas=1, metadata_replicas=0, capacity="1MiB") as dep:
        with CacheClient(dep.data_endpoints) as client:
            client.put([(b"k%d" % i, b"v" * 100, 1) for i in range(5)])
            client.get([b"k0", b"k1", b"absent"])
            stats = client.stats()[dep.data_endpoints]
        server = dep.server("data", 0)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        ctype, families = scrape(url)
        assert ctype.startswith("text/plain; version=0.0.4")
        for short, spec in CACHE_METRICS.items():
            name = "acs_cache_" + (short[: -len("_total")] if spec.kind == "counter" else short)
            assert families[name].type == spec.kind, name
            assert families[name].documentation == spec.help, name
            (sample,) = families[name].samples
            assert sample.labels == {"role": "data"}, name
        value = {s.name: s.value for f in families.values() for s in f.samples}
        assert value["acs_cache_gets_total"] == 3 and value["acs_cache_hits_total"] == 2
        assert value["acs_cache_misses_total"] == 1 and value["acs_cache_stored_total"] == 5
        assert value["acs_cache_entries"] == 5 == stats["entries"]
        assert value["acs_cache_capacity_bytes"] == 1024 * 1024
        assert value["acs_cache_rss_bytes"] > 0 and value["acs_cache_uptime_seconds"] > 0
        assert value["process_resident_memory_bytes"] > 0  # the standard process metrics come along
        assert value["acs_cache_default_ttl_seconds"] == 60.0  # durations in seconds, not milliseconds
        # Per-call latency histograms: reads (Get) and writes (Put) each observed once per call.
        from pyspark_acs.server.metrics import CACHE_CALL_METRICS

        hist = families["acs_cache_request_seconds"]
        assert hist.type == "histogram" and hist.documentation == CACHE_CALL_METRICS["request_seconds"].help
        counts = {s.labels["method"]: s.value for s in hist.samples if s.name == "acs_cache_request_seconds_count"}
        assert counts["Get"] >= 1 and counts["Put"] >= 1, counts
        assert all(s.labels["role"] == "data" for s in hist.samples)

        code, ctype, body = get_json(f"http://127.0.0.1:{server.metrics_port}/healthz")
        assert (code, ctype, body["healthy"], body["role"]) == (200, "application/json", True, "data")


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    with deployments(tmp_path_factory.mktemp("caches"), clusters=("A", "B")) as deps:
        yield deps


@pytest.mark.slow
def test_scrape_copy_daemon_processes(tmp_path, caches):
    """Regression: the hand-written renderer gave ``acs_copy_delay_seconds`` two ``cluster``
    labels (the daemon's and the writer's), which Prometheus' parser refuses, and /healthz
    answered plain ``ok`` whatever the daemon's state."""
    from pyspark_acs.server.metrics import COPY_METRICS

    env = Env(tmp_path / "env", caches, [("A", "B", 1)], f"m{os.getpid()}", ["B"], clusters=("A", "B"))
    try:
        daemons = {c: env.start_daemon(c) for c in ("A", "B")}
        with env.producer(max_block_bytes=4096) as p:
            produce(p, 0, 200, pause=0.001)
        env.wait_same("B")
        assert len(consume_all(env, "B", 200)) == 200
        deadline = time.monotonic() + 30
        while True:  # the cache copy and the finished-operation count settle after the durable copy
            _, fam_b = scrape(daemons["B"].banner.split(" metrics=", 1)[1])
            _, fam_a = scrape(daemons["A"].banner.split(" metrics=", 1)[1])
            storages = {s.labels["storage"] for s in samples(fam_b, "acs_copy_bytes")}
            if storages == {"cache", "durable"} and samples(fam_a, "acs_copy_operations_finished") \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)

        for cluster, families in (("A", fam_a), ("B", fam_b)):
            for short, spec in COPY_METRICS.items():
                name = "acs_copy_" + (short[: -len("_total")] if spec.kind == "counter" else short)
                assert families[name].type == spec.kind and families[name].documentation == spec.help, name
                for s in families[name].samples:
                    assert s.labels["cluster"] == cluster, s
                    assert set(s.labels) - {"cluster", "le"} == set(spec.labels), s
        # B's writer: bytes per hop and storage, and the delivery delay of the newest bytes.
        written = {s.labels["storage"]: s.value for s in samples(fam_b, "acs_copy_bytes")
                   if s.labels["source"] == "A" and s.labels["target"] == "B"}
        assert written.get("durable", 0) > 0 and written.get("cache", 0) > 0, written
        assert samples(fam_b, "acs_copy_delay_seconds")
        deltas = {s.labels["storage"]: s.value for s in samples(fam_b, "acs_copy_delivery_delay_seconds")
                  if s.name == "acs_copy_delivery_delay_seconds_count"}
        assert deltas.get("durable", 0) > 0, deltas
        # A's readers finished the sealed files they copied... or are still following the open ones.
        assert sum(s.value for s in samples(fam_a, "acs_copy_operations") if s.labels["role"] == "reader") > 0 \
            or samples(fam_a, "acs_copy_operations_finished")
        assert "process_resident_memory_bytes" in fam_b  # the standard process metrics come along
        # A's operations read their source through the one read path, and tailing a growing
        # file the data cache pushes its bytes to them (docs/cache.md): produce slowly and see it.
        read = {s.labels["way"]: s.value for s in samples(fam_a, "acs_copy_source_read_bytes")}
        assert set(read) <= {"pushed", "asked", "durable"} and sum(read.values()) > 0, read
        with env.producer(max_block_bytes=4096) as p:
            deadline = time.monotonic() + 30
            i = 200
            while time.monotonic() < deadline:
                produce(p, i, 20, pause=0.005)
                i += 20
                _, fam_a = scrape(daemons["A"].banner.split(" metrics=", 1)[1])
                read = {s.labels["way"]: s.value for s in samples(fam_a, "acs_copy_source_read_bytes")}
                if read.get("pushed", 0) > 0:
                    break
        assert read.get("pushed", 0) > 0, read

        code, ctype, body = get_json(daemons["B"].banner.split(" metrics=", 1)[1].replace("/metrics", "/healthz"))
        assert (code, ctype, body) == (200, "application/json",
                                       {"healthy": True, "cluster": "B", "unhealthy_clusters": []})
    finally:
        env.stop()


# -- the Grafana dashboard -------------------------------------------------------------------

#: Labels Prometheus itself adds to every scraped series.
TARGET_LABELS = {"instance", "job"}


def _declared():
    """``{exported series name: label names}`` of every declared metric (histograms with their
    ``_bucket``/``_count``/``_sum`` series), plus the standard process metrics."""
    from pyspark_acs.server.metrics import CACHE_CALL_METRICS, CACHE_METRICS, COPY_METRICS, TIER_METRICS

    names = {}
    for prefix, const, specs in (("acs_cache_", {"role"}, CACHE_METRICS), ("acs_cache_", {"role"}, CACHE_CALL_METRICS),
                                 ("acs_copy_", {"cluster"}, COPY_METRICS), ("acs_tier_", set(), TIER_METRICS)):
        for short, spec in specs.items():
            labels = const | set(spec.labels) | TARGET_LABELS
            if spec.kind == "histogram":
                names[prefix + short + "_bucket"] = labels | {"le"}
                names[prefix + short + "_count"] = labels
                names[prefix + short + "_sum"] = labels
            else:
                names[prefix + short] = labels
    names["process_resident_memory_bytes"] = set(TARGET_LABELS)
    return names


def test_grafana_dashboard_uses_declared_metrics_and_labels():
    """docs/grafana-dashboard.json: valid JSON, unique panel ids, and every query names only
    metrics declared in pyspark_acs/server/metrics.py, grouped and filtered by their labels."""
    import re

    path = os.path.join(ROOT, "docs", "grafana-dashboard.json")
    with open(path, encoding="utf-8") as f:
        dash = json.load(f)
    declared = _declared()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), ids
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = set()
    for expr in exprs:
        metrics = set(re.findall(r"\b((?:acs|process)_[a-z_]+)\b", expr))
        assert metrics, expr
        for name in metrics:
            assert name in declared, f"{name} (in {expr!r}) is not declared in pyspark_acs/server/metrics.py"
        used |= metrics
        allowed = set.union(*(declared[m] for m in metrics))
        labels = set()
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            labels |= {x.strip() for x in group.split(",") if x.strip()}
        for selector in re.findall(r"\{([^{}]*)\}", expr):
            labels |= set(re.findall(r"([a-z_]+)\s*(?:=~|!=|!~|=)", selector))
        labels |= set(re.findall(r"label_values\([a-z_]+,\s*([a-z_]+)\)", expr))
        assert labels <= allowed, f"{expr!r}: labels {labels - allowed} are not those of {sorted(metrics)}"
    # Delivery delay, copy throughput and the cache latency histograms are on it.
    for name in ("acs_copy_delay_seconds", "acs_copy_delivery_delay_seconds_bucket", "acs_copy_bytes_total",
                 "acs_cache_request_seconds_bucket", "acs_cache_hits_total", "acs_tier_lag_bytes",
                 "acs_tier_upload_failures_total", "acs_tier_retention_deleted_total"):
        assert name in used, name
    for p in panels:  # each panel has a unit and a query per target, on the dashboard's data source
        assert p["fieldConfig"]["defaults"]["unit"] and p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
