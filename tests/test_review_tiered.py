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
