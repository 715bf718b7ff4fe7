"""How the sink's driver commit appends: all tasks' pieces of a shard in one append, shards at
once, cache clients kept between micro-batches -- with the exactly-once protocol unchanged
(failure and replay cases: test_sink_commit.py)."""

from __future__ import annotations

import os
import threading

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

from pyspark_acs.datasource import commit as commit_module
from pyspark_acs.datasource.commit import COMMIT_APPEND_BYTES
from pyspark_acs.datasource.options import parse_sink_options
from pyspark_acs.datasource.sink import AcsStreamWriter
from pyspark_acs.datasource.staging import AcsCommitMessage
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.write.shard import ShardWriter

SCHEMA = StructType([StructField("shard", IntegerType()), StructField("value", BinaryType())])


def writer(root, commit_append_bytes=COMMIT_APPEND_BYTES, **extra):
    opts = parse_sink_options({"root": root, "stream": "out", "shards": "2", "checkpointLocation": "/ck/batching",
                               **extra})
    return AcsStreamWriter(opts, SCHEMA, commit_append_bytes=commit_append_bytes)


def rows(values, shards):
    return pa.RecordBatch.from_arrays([pa.array(shards, pa.int32()), pa.array(values, pa.binary())],
                                      names=["shard", "value"])


def stream_values(root, **caches):
    with Consumer(root, "out", **caches) as c:
        got = [r for b in c.batches(timeout=0.5) for r in b.to_pylist()]
    return {s: [r["value"] for r in got if r["shard"] == s] for s in (0, 1)}


def task_messages(w, batch_id, tasks=3):
    return [w.write(iter([rows([b"b%d-t%d-%d" % (batch_id, t, i) for i in range(4)], [0, 1, 0, 1])]))
            for t in range(tasks)]


@pytest.fixture
def appends(monkeypatch):
    """(shard, messages) of every ShardWriter.append, and the threads they ran in."""
    calls, threads = [], set()
    real = ShardWriter.append

    def counting(self, data, messages):
        calls.append((self.shard, messages))
        threads.add(threading.current_thread().name)
        return real(self, data, messages)

    monkeypatch.setattr(ShardWriter, "append", counting)
    return calls, threads


def expected(batches, tasks=3):
    return {s: [b"b%d-t%d-%d" % (b, t, i) for b in batches for t in range(tasks) for i in (s, s + 2)] for s in (0, 1)}


def test_one_append_per_shard_in_task_order(root, appends):
    calls, threads = appends
    w = writer(root)
    for batch_id in range(2):
        w.commit(task_messages(w, batch_id), batch_id)
    assert sorted(calls) == [(0, 6), (0, 6), (1, 6), (1, 6)]  # 3 tasks' pieces, one append per shard
    assert all(name.startswith("acs-sink-commit") for name in threads)  # the two shards at once
    assert stream_values(root) == expected(range(2))
    w.commit(task_messages(w, 1), 1)  # a replay writes nothing
    assert stream_values(root) == expected(range(2))


def test_pieces_beyond_the_append_size_go_in_several_appends(root, appends):
    calls, _ = appends
    w = writer(root, commit_append_bytes=1)  # every piece its own append
    w.commit(task_messages(w, 0), 0)
    assert sorted(calls) == [(0, 2)] * 3 + [(1, 2)] * 3
    assert stream_values(root) == expected([0])


def test_a_batch_without_rows_commits(root):
    w = writer(root)
    w.commit([AcsCommitMessage({}), None], 0)
    w.commit(task_messages(w, 1), 1)
    assert stream_values(root) == expected([1])


def test_cache_clients_are_kept_between_micro_batches(root, tmp_path):
    dep = LocalDeployment(tmp_path / "caches", data_replicas=1, metadata_replicas=1, capacity="32MiB").start()
    try:
        caches = {"dataCache": dep.data_endpoints, "metadataCache": dep.metadata_endpoints}
        w = writer(root, **caches)
        w.commit(task_messages(w, 0), 0)
        kept = dict(commit_module._commit_clients)
        w.commit(task_messages(w, 1), 1)
        assert commit_module._commit_clients == kept and len(kept) >= 1  # the same clients, not new ones
        assert stream_values(root, data_cache=dep.data_endpoints, metadata_cache=dep.metadata_endpoints) \
            == expected(range(2))
    finally:
        dep.stop()


def test_a_batch_publishes_the_lengths_of_its_shards_together(root, tmp_path, monkeypatch):
    """Shards are appended in parallel, but their lengths are published in one metadata write
    after the last append, so a streaming reader finds the whole batch in one micro-batch
    (published one by one, it took one micro-batch per shard)."""
    from pyspark_acs.cache.metadata import MetadataCache

    writes = []
    real = MetadataCache.publish_many

    def recording(self, lengths, heads=()):
        writes.append(list(lengths))
        return real(self, lengths, heads)

    monkeypatch.setattr(MetadataCache, "publish_many", recording)
    dep = LocalDeployment(tmp_path / "caches", data_replicas=1, metadata_replicas=1, capacity="32MiB").start()
    try:
        caches = {"dataCache": dep.data_endpoints, "metadataCache": dep.metadata_endpoints}
        w = writer(root, **caches)
        for batch_id in range(2):
            w.commit(task_messages(w, batch_id), batch_id)
        assert len(writes) == 2  # one write per batch ...
        for lengths in writes:  # ... holding both shards' files, at the lengths the files have
            assert sorted(uri.split("/")[-2] for uri, _, _ in lengths) == ["00000", "00001"]
            for uri, cache_length, durable_length in lengths:
                assert cache_length == durable_length
        for uri, _, durable_length in writes[-1]:
            assert durable_length == os.path.getsize(uri.replace("file://", "", 1))
        assert stream_values(root, data_cache=dep.data_endpoints, metadata_cache=dep.metadata_endpoints) \
            == expected(range(2))
    finally:
        dep.stop()


@pytest.fixture
def caches(tmp_path):
    dep = LocalDeployment(tmp_path / "caches", data_replicas=1, metadata_replicas=1, capacity="32MiB").start()
    try:
        yield dep
    finally:
        dep.stop()


def test_the_shard_heads_go_out_with_the_lengths_in_one_write(root, caches, monkeypatch):
    """Each shard's writer records its head (the file it writes) every batch; the commit sends
    the heads in the batch's one write of lengths instead of one metadata write per shard
    before its first append."""
    from pyspark_acs.cache.client import client_for
    from pyspark_acs.cache.metadata import MetadataCache
    from pyspark_acs.storage.store import open_store

    own_writes, published = [], []
    real_publish, real_head = MetadataCache.publish_many, MetadataCache.set_head

    def recording_publish(self, lengths, heads=()):
        published.append((list(lengths), list(heads)))
        return real_publish(self, lengths, heads)

    def recording_head(self, shard_uri, file_name):
        own_writes.append((shard_uri, file_name))
        return real_head(self, shard_uri, file_name)

    monkeypatch.setattr(MetadataCache, "publish_many", recording_publish)
    monkeypatch.setattr(MetadataCache, "set_head", recording_head)
    w = writer(root, dataCache=caches.data_endpoints, metadataCache=caches.metadata_endpoints)
    for batch_id in range(2):
        w.commit(task_messages(w, batch_id), batch_id)
    assert own_writes == []  # no head write of its own ...
    assert len(published) == 2
    store = open_store(root)
    shard_uris = [store.uri(f"out/{s:05d}") for s in (0, 1)]
    for lengths, heads in published:  # ... each batch's write holds both shards' heads: their files
        assert [u for u, _ in heads] == shard_uris
        assert sorted(f"{u}/{name}" for u, name in heads) == sorted(uri for uri, _, _ in lengths)
    meta = MetadataCache(client_for(caches.metadata_endpoints, "metadata cache", []))
    try:
        assert meta.heads(shard_uris) == {u: store.list_files("out", s)[-1] for s, u in enumerate(shard_uris)}
    finally:
        meta.client.close()
    assert stream_values(root, data_cache=caches.data_endpoints, metadata_cache=caches.metadata_endpoints) \
        == expected(range(2))


def test_the_lengths_go_out_before_the_leases_are_released(root, caches, monkeypatch):
    """A reader waits for the batch's lengths, not for the shards' lease releases (a metadata
    write and a store file each): the commit publishes first, then releases."""
    from pyspark_acs.cache.metadata import MetadataCache, MetadataLease

    events = []
    real_publish, real_release = MetadataCache.publish_many, MetadataLease.release

    def recording_publish(self, lengths, heads=()):
        events.append("publish")
        return real_publish(self, lengths, heads)

    def recording_release(self):
        events.append("release")
        return real_release(self)

    monkeypatch.setattr(MetadataCache, "publish_many", recording_publish)
    monkeypatch.setattr(MetadataLease, "release", recording_release)
    w = writer(root, dataCache=caches.data_endpoints, metadataCache=caches.metadata_endpoints)
    for batch_id in range(2):
        w.commit(task_messages(w, batch_id), batch_id)
    assert events == ["publish", "release", "release"] * 2
    assert stream_values(root, data_cache=caches.data_endpoints, metadata_cache=caches.metadata_endpoints) \
        == expected(range(2))
