"""Hostile review of the tiered2 branch and of main's 83c3483/9d04c43: each test shows one
scenario a user can hit (real cache servers, real copy daemons, real files, moto's S3)."""

from __future__ import annotations

import time
from typing import List

import pytest

from pyspark_acs.storage.store import DurableStore
from pyspark_acs.storage.tier import configure_tier, read_manifest
from tests.test_tiered import file_bytes, hot_files, msg, read_all, run_pass, s3, tier_uri  # noqa: F401

WAIT_S = 30.0


def test_a_destination_whose_retention_deleted_old_files_is_not_sent_them_again(tmp_path, s3):
    """The destination keeps its stream a shorter time than the source (its own tier
    settings: secondary retention): its mover deletes old files from both tiers. When the
    source's daemon restarts it asks the destination which files it holds; the old files are
    no longer there, but the source still holds them (in its hot store or its secondary
    store, which the scheduler now lists): they must not be copied into the destination
    again (a resurrected history, copied once per restart, read again by readers from
    earliest)."""
    from tests._harness import Env, start_caches

    caches = start_caches(tmp_path / "caches", clusters=("A", "B"))
    env = Env(tmp_path / "env", caches, [("A", "B", 1)], "kept", ("B",), clusters=("A", "B"))
    try:
        env.start_daemon("A")
        env.start_daemon("B")
        with env.producer(shards=1, roll_bytes=4000, max_block_bytes=1024) as p:
            for i in range(100):
                p.send(msg(i))
        env.wait_same("B")
        source = file_bytes(env.roots["A"], env.stream)
        assert len(source) > 3
        # The source keeps everything (tiered, hot copies deleted); the destination keeps none
        # but the newest file.
        configure_tier(env.roots["A"], env.stream, tier_uri(s3, "r1a"), hot_retention_s=0)
        run_pass(env.roots["A"])
        configure_tier(env.roots["B"], env.stream, tier_uri(s3, "r1b"), secondary_retention_s=0)
        run_pass(env.roots["B"])  # uploads
        run_pass(env.roots["B"], orphan_grace_s=0)  # retention
        newest = sorted(source)[-1]
        assert hot_files(env.roots["B"], env.stream) == [newest]
        assert list(read_manifest(DurableStore(env.roots["B"]), env.stream, 0)) == [newest]
        env.kill_daemon("A")
        env.start_daemon("A")
        time.sleep(4.0)  # the restarted daemon surveys B and lists A's files many times
        assert hot_files(env.roots["B"], env.stream) == [newest], \
            f"files the destination's retention deleted were copied there again\n{env.logs()}"
    finally:
        env.stop()
        for d in caches.values():
            d.stop()


def test_a_hello_racing_the_destinations_mover_never_recreates_a_tiered_file(root, s3, tmp_path, monkeypatch):
    """The destination's mover deletes a tiered file's hot copy between the writer's check
    that the hot copy exists and its open for appending (the interleaving is forced here: the
    hot copy is deleted just before the open, as the mover's retention may at any moment). The writer must not create the file again, empty, in the hot store and
    ask the parent for all of it from byte 0: a tiered file is whole and sealed here whether
    or not its hot copy still exists."""
    from pyspark_acs.format.names import shard_dir
    from pyspark_acs.server.copy.cluster import ClusterIO
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.proto import copy_pb2
    from pyspark_acs.server.copy.topology import Cluster
    from pyspark_acs.server.copy.writer import CopyServicer
    from tests._harness import start_caches
    from tests.test_tiered import make_stream

    make_stream(root, "race", 60)
    before = file_bytes(root, "race")
    configure_tier(root, "race", tier_uri(s3, "r2"))  # tiered, hot copies kept (no hot retention)
    run_pass(root)
    oldest = sorted(before)[0]
    rel = f"{shard_dir('race', 0)}/{oldest}"
    assert oldest in read_manifest(DurableStore(root), "race", 0) and oldest in hot_files(root, "race")
    deps = start_caches(tmp_path / "caches", clusters=("B",))
    io = ClusterIO(Cluster("B", root, tuple(deps["B"].endpoints("data")), tuple(deps["B"].endpoints("metadata")),
                           "127.0.0.1:1"))
    open_appender = io.store.open_appender

    def mover_deletes_then_open(r: str):
        if r == rel:
            DurableStore(root).delete(r)  # the mover's hot retention, between the writer's look and its open
        return open_appender(r)

    monkeypatch.setattr(io.store, "open_appender", mover_deletes_then_open)
    try:
        servicer = CopyServicer(io, CopyDaemonOptions(), CopyMetrics("B"))
        common = dict(stream="race", shard=0, file=oldest, storage=copy_pb2.DURABLE, shards=1, operation="op-1",
                      source_cluster="A")
        acks = list(servicer.Copy(iter([copy_pb2.CopyRequest(hello=True, **common)]), None))
        assert acks[0].status == copy_pb2.OK
        hot = file_bytes(root, "race")
        assert hot.get(oldest, before[oldest]) == before[oldest], \
            f"the tiered file was created again in the hot store with {len(hot[oldest])} bytes"
        assert acks[0].length == len(before[oldest]), f"the parent is asked to copy from byte {acks[0].length}"
    finally:
        io.close()
        for d in deps.values():
            d.stop()


def test_a_file_with_a_deposed_writers_bytes_after_its_seal_still_tiers(root, s3):
    """On a store without the local append lock (HDFS) a deposed writer's append can land
    after the seal its successor wrote (tests/test_write_path.py shows it; readers never read
    past a seal). Such a file is sealed: it, and every later file of the shard, must still
    tier; the mover must not wait for it forever as if it were unsealed."""
    from pyspark_acs.format.block import encode_block
    from pyspark_acs.format.names import shard_dir
    from tests.test_tiered import make_stream

    make_stream(root, "late", 60)
    before = file_bytes(root, "late")
    oldest = sorted(before)[0]
    app = DurableStore(root).open_appender(f"{shard_dir('late', 0)}/{oldest}")
    app.write(encode_block([b"never acknowledged"], first_index=10_000))  # after the seal
    app.close()
    configure_tier(root, "late", tier_uri(s3, "r3"))
    report = run_pass(root)
    recorded = read_manifest(DurableStore(root), "late", 0)
    assert sorted(recorded) == sorted(before), \
        f"tiered {len(recorded)} of {len(before)} sealed files; waiting_unsealed={report.waiting_unsealed}"
    assert read_all(root, "late", 60) == [msg(i) for i in range(60)]
