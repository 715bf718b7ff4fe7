"""Tiered storage against a real S3 endpoint: moto's server on loopback, reached through
pyarrow.fs.S3FileSystem with an endpoint override (the client code a user runs against S3).

Covers: files tier and leave the hot store only after a verified upload; a Consumer and Spark
(batch and stream) read from earliest across caches -> hot -> S3 byte-exact and in order; the
mover SIGKILLed mid-upload leaves no visible partial object and loses no file; an ambiguous
upload failure follows the non-stop-write rule; retention never deletes an unverified hot file.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List

import pytest

from pyspark_acs import Consumer, Producer
from pyspark_acs.errors import AcsOptionError, TierUploadError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.positions import ends_with_seal
from pyspark_acs.read.readpath import DurableReadPath, open_read_path
from pyspark_acs.server.tier import TierMover
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.storage.tier import parse_read_policy
from pyspark_acs.storage.tier_manifest import read_manifest
from pyspark_acs.storage.tier_preread import PREREAD_MIN_BYTES, PrereadWindow
from pyspark_acs.storage.tier_settings import configure_tier, stream_tier_settings
from pyspark_acs.storage.tier_store import TierStore
from tests.helpers import ROOT, Env, FakeClock, deployments, free_port, start_caches, start_query, wait_until

BUCKET = "acs-tier"
KEY, SECRET = "testing", "testing"
WAIT_S = 30.0
#: How long a Consumer watches that nothing arrives while the copy daemons are down (seconds):
#: no process can copy then, so dozens of its polls show it waits where it is.
NOTHING_ARRIVES_S = 0.5


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free loopback port (one per module); yields its endpoint."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not start on 127.0.0.1:{port}")
            time.sleep(0.05)
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id=KEY,
                          aws_secret_access_key=SECRET, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield {"port": port, "client": client}
    finally:
        proc.kill()
        proc.wait()


def tier_uri(s3, prefix: str) -> str:
    return (f"s3://{KEY}:{SECRET}@{BUCKET}/{prefix}?endpoint_override=127.0.0.1:{s3['port']}"
            f"&scheme=http&region=us-east-1")


def objects(s3, prefix: str) -> List[str]:
    got = s3["client"].list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"] for o in got.get("Contents", []) if not o["Key"].endswith("/"))  # not folder markers


def named(records) -> set:
    """Object keys the tier records name (packs and their header indexes)."""
    return {k for r in records.values() for k in (r.object, r.index) if k}


def msg(i: int, size: int = 200) -> bytes:
    return f"m{i:06d}-".encode() + bytes([i % 251]) * size


def hot_files(root: str, stream: str, shard: int = 0) -> List[str]:
    return DurableStore(root).list_files(stream, shard)


def file_bytes(root: str, stream: str, shard: int = 0) -> Dict[str, bytes]:
    store = DurableStore(root)
    out = {}
    for name in store.list_files(stream, shard):
        rel = f"{shard_dir(stream, shard)}/{name}"
        out[name] = store.read(rel, 0, store.length(rel))
    return out


def read_all(root: str, stream: str, n: int, timeout: float = WAIT_S, **kw) -> List[bytes]:
    values: List[bytes] = []
    with Consumer(root, stream, start="earliest", **kw) as c:
        deadline = time.monotonic() + timeout
        while len(values) < n and time.monotonic() < deadline:
            for batch in c.poll():
                values.extend(batch.column("value").to_pylist())
            time.sleep(0.01)
    return values


def make_stream(root: str, stream: str, n: int, *, roll_bytes: int = 4000, keep_open: bool = False, **kw):
    """``n`` messages in several sealed files of one shard (the last file stays unsealed while
    the returned producer is open)."""
    p = Producer(root, stream, roll_bytes=roll_bytes, max_block_bytes=1024, **kw)
    for i in range(n):
        p.send(msg(i))
    p.flush(timeout=WAIT_S)
    if not keep_open:
        p.close()
        return None
    store = DurableStore(root)
    rel = f"{shard_dir(stream, 0)}/{store.list_files(stream, 0)[-1]}"
    assert not ends_with_seal(DurableReadPath(store), rel, store.length(rel)), \
        "the newest file must stay unsealed: choose n so that the last file is not full"
    return p


def run_pass(root: str, **kw):
    """One mover pass (its tier leases given up after)."""
    mover = TierMover(root, **kw)
    try:
        return mover.run_once()
    finally:
        mover.close()


# -- the tier mover -----------------------------------------------------------------------------


def test_sealed_files_tier_and_leave_hot_store_only_after_verified_upload(root, s3):
    p = make_stream(root, "orders", 110, keep_open=True)
    try:
        before = file_bytes(root, "orders")
        names = sorted(before)
        assert len(names) >= 4
        configure_tier(root, "orders", tier_uri(s3, "t1"), hot_retention_s=0)
        assert stream_tier_settings(DurableStore(root), "orders").hot_retention_s == 0
        report = run_pass(root, batch_bytes=10_000)
        # Every sealed file went up, the open one (unsealed) waits: the read side's seal rule.
        assert report.uploaded_files == len(names) - 1 and report.waiting_unsealed == 1
        assert report.objects >= 2  # batched: several files per object, several objects
        records = read_manifest(DurableStore(root), "orders", 0)
        assert sorted(records) == names[:-1]
        assert named(records) == {k[len("t1/"):] for k in objects(s3, "t1")}  # packs + header indexes
        assert all(r.index for r in records.values())
        assert all(r.blocks > 0 for r in records.values())
        # Verified -> hot copies deleted (hot retention 0 s); the unsealed file stays.
        assert hot_files(root, "orders") == names[-1:]
        assert report.hot_deleted == len(names) - 1
        # The same offsets read the same bytes, from S3 now.
        path = open_read_path(root)
        for name, data in before.items():
            rel = f"{shard_dir('orders', 0)}/{name}"
            assert path.lengths([rel])[rel] == len(data)
            assert path.read(rel, 0, len(data)) == data
        assert path.store.tier_stats()["tier_requests"] > 0
        path.close()
        # A second pass has nothing to do.
        again = run_pass(root)
        assert again.uploaded_files == 0 and again.abandoned_objects == 0
    finally:
        p.close()


class FlakyTier(TierStore):
    """A real S3 tier whose uploads fail as told (a fault injection: S3 cannot be told to)."""

    mode = "ok"  # "ambiguous": first put lands its bytes, then fails; "fail": every put fails
    calls: List[str] = []

    def put(self, key, parts):
        FlakyTier.calls.append(key)
        if FlakyTier.mode == "fail":
            list(parts)
            raise TierUploadError(f"upload {key}: injected connection reset")
        n = super().put(key, parts)
        if FlakyTier.mode == "ambiguous" and len(FlakyTier.calls) == 1:
            raise TierUploadError(f"upload {key}: injected timeout after the bytes landed")
        return n


class CorruptingTier(TierStore):
    """A tier that lands one flipped byte (what verification must catch)."""

    def put(self, key, parts):
        data = bytearray(b"".join(parts))
        data[len(data) // 2] ^= 0xFF
        return super().put(key, [bytes(data)])


def test_ambiguous_upload_failure_uploads_a_new_object_never_over_the_old(root, s3):
    make_stream(root, "amb", 60)
    before = file_bytes(root, "amb")
    configure_tier(root, "amb", tier_uri(s3, "t2"), hot_retention_s=0)
    FlakyTier.mode, FlakyTier.calls = "ambiguous", []
    report = run_pass(root, tier_factory=FlakyTier)
    first, second = FlakyTier.calls[:2]
    assert first != second  # non-stop-write: a new object name, no retry over the first
    assert report.abandoned_objects == 1 and report.uploaded_files == len(before)
    records = read_manifest(DurableStore(root), "amb", 0)
    assert {r.object for r in records.values()} == {second}
    assert named(records) == {second, second[: -len(".pack")] + ".idx"}
    # The first object landed whole but no record names it: readers never see it, and the
    # sweep deletes it once past the grace period.
    assert f"t2/{first}" in objects(s3, "t2")
    assert read_all(root, "amb", 60) == [msg(i) for i in range(60)]
    swept = run_pass(root, orphan_grace_s=0)
    assert swept.swept_objects == 1 and set(objects(s3, "t2")) == {f"t2/{k}" for k in named(records)}
    assert read_all(root, "amb", 60) == [msg(i) for i in range(60)]


def test_retention_never_deletes_a_hot_file_not_verified_in_the_secondary_store(root, s3):
    make_stream(root, "keep", 60)
    before = file_bytes(root, "keep")
    configure_tier(root, "keep", tier_uri(s3, "t3"), hot_retention_s=0, hot_retention_bytes=0)
    FlakyTier.mode, FlakyTier.calls = "fail", []
    report = run_pass(root, tier_factory=FlakyTier, upload_attempts=2)
    assert report.uploaded_files == 0 and report.abandoned_objects == 2 and report.hot_deleted == 0
    assert sorted(hot_files(root, "keep")) == sorted(before)
    # A corrupted upload fails verification: abandoned too, nothing recorded, nothing deleted.
    report = run_pass(root, tier_factory=CorruptingTier, upload_attempts=1)
    assert report.uploaded_files == 0 and report.abandoned_objects == 1 and report.hot_deleted == 0
    assert read_manifest(DurableStore(root), "keep", 0) == {}
    assert file_bytes(root, "keep") == before
    # A good pass then tiers and deletes them (over the byte budget of 0).
    report = run_pass(root)
    # (a shard's newest file always stays hot: writers name their next file after it)
    assert report.uploaded_files == len(before) and hot_files(root, "keep") == sorted(before)[-1:]
    assert read_all(root, "keep", 60) == [msg(i) for i in range(60)]


def test_secondary_retention_deletes_old_files_from_both_tiers(root, s3):
    make_stream(root, "old", 60)
    configure_tier(root, "old", tier_uri(s3, "t4"))
    run_pass(root)
    names = hot_files(root, "old")
    assert objects(s3, "t4") and len(names) > 1
    configure_tier(root, "old", tier_uri(s3, "t4"), secondary_retention_s=0)
    report = run_pass(root, orphan_grace_s=0)
    assert report.secondary_deleted > 0 and report.swept_objects >= 0
    newest = names[-1]
    assert hot_files(root, "old") == [newest]  # the newest file stays (writers name files after it)
    assert list(read_manifest(DurableStore(root), "old", 0)) == [newest]
    remaining = named(read_manifest(DurableStore(root), "old", 0))
    assert {k[len("t4/"):] for k in objects(s3, "t4")} == remaining
    # A reader from earliest starts at the first file left: the newest file's messages.
    left = read_all(root, "old", 60, timeout=2.0)
    assert 0 < len(left) < 60 and left == [msg(i) for i in range(60 - len(left), 60)]


def test_mover_sigkilled_mid_upload_leaves_no_partial_object_and_loses_no_file(root, s3, subprocess_env, tmp_path):
    # One large sealed file (24 MiB): a multipart upload, throttled so the kill lands mid-way.
    with Producer(root, "big", roll_bytes=1 << 30) as p:
        for i in range(24 * 64):
            p.send(bytes([i % 251]) * 16384)
        p.flush(timeout=WAIT_S)
    before = file_bytes(root, "big")
    configure_tier(root, "big", tier_uri(s3, "t5"), hot_retention_s=0)
    cmd = [sys.executable, "-m", "pyspark_acs.server.tier.daemon", "--root", root, "--interval", "60s",
           "--upload-rate", "6MiB", "--lease", "1s", "--parent-pid", str(os.getpid())]
    proc = subprocess.Popen(cmd, env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + WAIT_S
        while not s3["client"].list_multipart_uploads(Bucket=BUCKET, Prefix="t5/").get("Uploads"):
            assert time.monotonic() < deadline, "the mover never started its multipart upload"
            assert proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    # No object is visible, nothing is recorded, the hot file is whole.
    assert objects(s3, "t5") == []
    assert read_manifest(DurableStore(root), "big", 0) == {}
    assert file_bytes(root, "big") == before
    time.sleep(1.2)  # the dead mover's 1 s lease runs out
    done = subprocess.run(cmd[:5] + ["--once", "--orphan-grace", "0"], env=subprocess_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    records = read_manifest(DurableStore(root), "big", 0)
    assert sorted(records) == sorted(before) and hot_files(root, "big") == sorted(before)[-1:]
    path = open_read_path(root)
    for name, data in before.items():
        rel = f"{shard_dir('big', 0)}/{name}"
        assert path.read(rel, 0, len(data)) == data
    path.close()


# -- reads across tiers -------------------------------------------------------------------------


def test_consumer_reads_across_caches_hot_and_s3_in_order(root, s3, tmp_path):

    deps = start_caches(tmp_path / "caches", clusters=("A",))
    try:
        dep = deps["A"]
        caches = dict(data_cache=dep.data_endpoints, metadata_cache=dep.metadata_endpoints)
        p = make_stream(root, "mix", 150, keep_open=True, **caches)
        try:
            names = hot_files(root, "mix")
            configure_tier(root, "mix", tier_uri(s3, "t6"), hot_retention_bytes=3 * 4000)
            report = run_pass(root)
            assert report.uploaded_files == len(names) - 1
            left = hot_files(root, "mix")
            # Oldest files only in S3, the next ones tiered and hot, the newest hot only.
            assert 1 < len(left) < len(names)
            for i in range(150, 200):
                p.send(msg(i))
            p.flush(timeout=WAIT_S)
            want = [msg(i) for i in range(200)]
            assert read_all(root, "mix", 200, **caches) == want
            for policy in ("NOT_IN_MEM", "FORCE"):
                assert read_all(root, "mix", 200, tier_read_policy=policy, **caches) == want
        finally:
            p.close()
    finally:
        for d in deps.values():
            d.stop()


def test_spark_batch_and_stream_read_history_from_s3(root, s3, spark, tmp_path):
    """Spark reads a stream whose oldest files are only in S3, the next ones in S3 and hot, the
    newest hot with its chunks in the data cache: batch (whole and pruned by timestamp) and a
    stream from earliest, byte-exact and in order, the same rows as before tiering."""

    deps = start_caches(tmp_path / "caches", clusters=("A",))
    try:
        caches = {"dataCache": deps["A"].data_endpoints, "metadataCache": deps["A"].metadata_endpoints}
        with Producer(root, "hist", roll_bytes=4000, max_block_bytes=1024, data_cache=caches["dataCache"],
                      metadata_cache=caches["metadataCache"]) as p:
            for i in range(150):
                if i == 100:
                    p.flush(timeout=WAIT_S)
                    time.sleep(0.02)  # messages from 100 on are stamped later: a timestamp to prune by
                p.send(msg(i))
        want = [msg(i) for i in range(150)]
        with Consumer(root, "hist", start="earliest") as c:
            stamps: List = []
            while len(stamps) < 150:
                for batch in c.poll():
                    stamps.extend(batch.column("timestamp").to_pylist())
        from_ms = int(stamps[100].timestamp() * 1000)

        def backfill():  # a batch read pruned by timestamp
            df = (spark.read.format("acs").option("root", root).option("stream", "hist")
                  .option("startingTimestamp", str(from_ms)).load())
            return [bytes(r.value) for r in df.orderBy("file", "position").select("value").collect()]

        pruned = backfill()
        assert pruned == want[100:]
        names = hot_files(root, "hist")
        configure_tier(root, "hist", tier_uri(s3, "t7"), hot_retention_bytes=3 * 4000)
        run_pass(root, batch_bytes=3000)
        left = hot_files(root, "hist")
        assert 1 < len(left) < len(names) - 1  # S3 only, S3 and hot, and the newest (hot, cached)
        assert backfill() == pruned  # same offsets, same rows
        df = spark.read.format("acs").option("root", root).option("stream", "hist").load()
        rows = df.orderBy("file", "position").select("value").collect()
        assert [bytes(r.value) for r in rows] == want
        for policy in ("not_in_disk", "not_in_mem"):
            query = start_query(spark.readStream.format("acs").option("root", root).option("stream", "hist")
                     .options(**caches).option("startingOffsets", "earliest").option("tierReadPolicy", policy)
                     .load().writeStream.format("memory").queryName(f"tiered_hist_{policy}")
                     .option("checkpointLocation", str(tmp_path / f"ckpt-{policy}")).trigger(availableNow=True))
            query.awaitTermination(120)
            got = spark.sql(f"select value from tiered_hist_{policy} order by file, position").collect()
            assert [bytes(r.value) for r in got] == want
        with pytest.raises(Exception, match="tierReadPolicy"):
            spark.read.format("acs").option("root", root).option("stream", "hist") \
                .option("tierReadPolicy", "sometimes").load().collect()
    finally:
        for d in deps.values():
            d.stop()


# -- read policy and pre-reading ----------------------------------------------------------------


def test_read_policy_is_checked_and_named():
    assert parse_read_policy("force") == "FORCE"
    with pytest.raises(AcsOptionError, match="tierReadPolicy.*NOT_IN_DISK, NOT_IN_MEM, FORCE"):
        parse_read_policy("DISK_FIRST")


def test_preread_window_grows_additively_and_halves():
    w = PrereadWindow(minimum=100, maximum=1000)
    assert w.size == 100
    w.grow(64)
    w.grow(64)
    assert w.size == 228
    w.shrink()
    assert w.size == 114
    for _ in range(100):
        w.grow(64)
    assert w.size == 1000
    for _ in range(10):
        w.shrink()
    assert w.size == 100


def test_preread_cuts_requests_to_the_secondary_store(root, s3):
    from pyspark_acs.storage.tier import tiered_store
    from pyspark_acs.storage.tier_preread import PREREAD_TTL_S

    make_stream(root, "pre", 2000, roll_bytes=100_000)
    configure_tier(root, "pre", tier_uri(s3, "t8"), hot_retention_s=0)
    run_pass(root)
    name = read_manifest(DurableStore(root), "pre", 0)
    rel, rec = next((f"{shard_dir('pre', 0)}/{n}", r) for n, r in sorted(name.items()))
    requests = {}
    for preread in (False, True):
        clock = FakeClock()
        path = open_read_path(tiered_store(DurableStore(root, create=False), preread=preread, clock=clock))
        data = b"".join(path.read(rel, at, min(rec.length, at + 4096)) for at in range(0, rec.length, 4096))
        assert len(data) == rec.length
        requests[preread] = path.store.tier_stats()["tier_requests"]
        if preread:
            grown = path.store.window("pre", 0)
            assert grown > PREREAD_MIN_BYTES  # additive increase while read-ahead is used
            # Read-ahead not read within its expiry time is dropped and the window halves
            # (the RocketMQ tiered-storage article's AIMD: the client stopped pulling).
            rel2 = f"{shard_dir('pre', 0)}/{sorted(name)[1]}"
            path.store.read(rel2, 0, 4096)
            clock.advance(PREREAD_TTL_S + 1)
            path.store.read(rel, 100, 200)  # not a header: through the pre-read path
            assert path.store.tier_stats()["preread_dropped_bytes"] > 0
            assert path.store.window("pre", 0) == max(PREREAD_MIN_BYTES, grown // 2)
        path.close()
    assert requests[True] * 5 < requests[False]


def test_acs_ls_and_status_show_tier_settings(root, s3, tmp_path, capsys):
    import json

    from pyspark_acs.cli.main import main

    make_stream(root, "shown", 60)
    configure_tier(root, "shown", tier_uri(s3, "t9"), hot_retention_s=3600, hot_retention_bytes=0,
                   secondary_retention_s=86400 * 30)
    run_pass(root)
    assert len(hot_files(root, "shown")) == 1  # over the 0-byte hot budget: all tiered, the newest stays hot
    assert main(["ls", "--root", root, "--stream", "shown"]) == 0
    out = capsys.readouterr().out
    assert f"tier: s3://{BUCKET}/t9 hot: 3600s/0B secondary: 2.592e+06s" in out
    assert SECRET + "@" not in out and "tiered_files=" in out and "secondary_only=" in out
    assert len([line for line in out.splitlines() if line.strip().endswith(".acs") or ".acs " in line]) >= 1
    assert main(["status", "--root", root, "--stream", "shown", "--json", "--dir", str(tmp_path / "none")]) == 0
    report = json.loads(capsys.readouterr().out)
    tier = report["streams"][0]["tier"]
    assert tier["uri"] == f"s3://{BUCKET}/t9" and tier["hot_retention_bytes"] == 0
    assert tier["tiered_files"] == tier["secondary_only"] + 1 and tier["hot_files"] == 1


def test_configure_tier_names_bad_settings(root, s3):
    make_stream(root, "cfg", 10)
    with pytest.raises(AcsOptionError, match="hot_retention_s"):
        configure_tier(root, "cfg", "/tmp/x", hot_retention_s=-1)
    # Strings are read by the declarations' parsers, as acs tier's flags are: with their unit.
    with pytest.raises(AcsOptionError, match="secondary_retention_s: '90' has no unit"):
        configure_tier(root, "cfg", "/tmp/x", secondary_retention_s="90")
    with pytest.raises(AcsOptionError, match="hot_retention_bytes: 'lots' is not a byte size"):
        configure_tier(root, "cfg", "/tmp/x", hot_retention_bytes="lots")
    with pytest.raises(AcsOptionError, match="no stream 'nope'"):
        configure_tier(root, "nope", "/tmp/x")
    with pytest.raises(AcsOptionError, match="bucket 'no-such-bucket' of s3://no-such-bucket/x does not exist"):
        configure_tier(root, "cfg", tier_uri(s3, "x").replace(BUCKET, "no-such-bucket"))
    with pytest.raises(AcsOptionError, match="tier_read_policy|tierReadPolicy"):
        Consumer(root, "cfg", tier_read_policy="sometimes")


def test_local_folder_tier(root, tmp_path):
    """Any pyarrow filesystem serves as the secondary store: here a local folder."""
    make_stream(root, "local", 80)
    before = file_bytes(root, "local")
    settings = configure_tier(root, "local", str(tmp_path / "cold"), hot_retention_s="0s",
                              secondary_retention_s="forever")
    assert (settings.hot_retention_s, settings.secondary_retention_s) == (0, None)
    report = run_pass(root)
    assert report.uploaded_files == len(before) and len(hot_files(root, "local")) == 1
    assert list((tmp_path / "cold" / "local" / "00000").iterdir())
    assert read_all(root, "local", 80, tier_read_policy="FORCE") == [msg(i) for i in range(80)]


def test_offsets_stay_valid_when_files_move_under_a_reader(root, s3):
    """A Consumer part-way through hot files goes on by the same offsets after they moved to
    S3 and left the hot store; a Consumer resumed from saved offsets does too."""
    make_stream(root, "moving", 120)
    configure_tier(root, "moving", tier_uri(s3, "t10"), hot_retention_s=0)
    want = [msg(i) for i in range(120)]
    got: List[bytes] = []
    with Consumer(root, "moving", start="earliest", max_read_bytes=2048) as c:
        while len(got) < 30:
            for batch in c.poll():
                got.extend(batch.column("value").to_pylist())
        saved, at_save = c.offsets(), len(got)
        report = run_pass(root)  # every file but the newest leaves the hot store meanwhile
        assert report.hot_deleted >= 3
        deadline = time.monotonic() + WAIT_S
        while len(got) < 120 and time.monotonic() < deadline:
            for batch in c.poll():
                got.extend(batch.column("value").to_pylist())
            time.sleep(0.01)
    assert got == want
    rest: List[bytes] = []
    with Consumer(root, "moving", start=saved) as c:  # offsets saved before the files moved
        deadline = time.monotonic() + WAIT_S
        while len(rest) < 120 - at_save and time.monotonic() < deadline:
            for batch in c.poll():
                rest.extend(batch.column("value").to_pylist())
            time.sleep(0.01)
    assert rest == want[at_save:]


def test_header_walks_over_tiered_files_use_the_header_index(root, s3):
    """A planner's header walk (a timestamp search over the history) gives the same offsets
    from S3 as from the hot store, with one request per object (its header index), not one
    per block."""
    from pyspark_acs.read.positions import latest_offset, offset_for_timestamp

    with Producer(root, "walk", roll_bytes=2 << 20, max_block_bytes=256 * 1024) as p:
        for i in range(64):
            p.send(bytes([i]) * 100_000)
            if i % 2:
                p.flush(timeout=WAIT_S)  # two messages a block: ~200 KB blocks
    hot = open_read_path(root)
    mid_ts = None
    with Consumer(root, "walk", start="earliest") as c:
        rows = []
        while len(rows) < 64:
            for batch in c.poll():
                rows.extend(batch.column("timestamp").to_pylist())
    mid_ts = int(rows[40].timestamp() * 1_000_000) if hasattr(rows[40], "timestamp") else int(rows[40])
    want_mid = offset_for_timestamp(hot, "walk", 0, mid_ts)
    want_end = offset_for_timestamp(hot, "walk", 0, 2 ** 62)
    hot.close()
    configure_tier(root, "walk", tier_uri(s3, "t11"), hot_retention_s=0)
    run_pass(root)
    assert len(hot_files(root, "walk")) == 1
    path = open_read_path(root)
    assert offset_for_timestamp(path, "walk", 0, mid_ts) == want_mid
    assert offset_for_timestamp(path, "walk", 0, 2 ** 62) == want_end
    assert latest_offset(path, "walk", 0).file == want_end.file
    stats = path.store.tier_stats()
    objects_named = len({r.object for r in read_manifest(DurableStore(root), "walk", 0).values()})
    assert stats["index_hits"] >= 20
    assert stats["tier_requests"] <= 3 * objects_named, stats  # index + seal checks, not one per block
    path.close()


def test_live_tail_while_the_mover_tiers_and_deletes_underneath(root, s3, subprocess_env):
    """A Consumer tails a stream being written while the mover daemon keeps tiering sealed
    files and deleting their hot copies: every message arrives once, in order."""
    configure_stream = Producer(root, "live", roll_bytes=3000, max_block_bytes=1024)
    configure_tier(root, "live", tier_uri(s3, "t12"), hot_retention_s=0)
    mover = subprocess.Popen(
        [sys.executable, "-m", "pyspark_acs.server.tier.daemon", "--root", root, "--interval", "50ms",
         "--lease", "2s", "--parent-pid", str(os.getpid())],
        env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    got: List[bytes] = []
    n = 400
    try:
        with configure_stream as p, Consumer(root, "live", start="earliest", poll_interval=0.005) as c:
            for i in range(n):
                p.send(msg(i))
                if i % 10 == 9:
                    p.flush(timeout=WAIT_S)
                    time.sleep(0.01)
                if i == 99:  # the reader has read nothing yet: its first file leaves the hot store
                    first = DurableStore(root).list_files("live", 0)[0]
                    deadline = time.monotonic() + WAIT_S
                    while first in hot_files(root, "live"):
                        assert time.monotonic() < deadline, "the mover did not tier the first file"
                        time.sleep(0.02)
                if i % 100 == 99:  # the reader lags: files it has not read yet move meanwhile
                    time.sleep(0.1)
                    for batch in c.poll():
                        got.extend(batch.column("value").to_pylist())
            p.flush(timeout=WAIT_S)
            deadline = time.monotonic() + WAIT_S
            while len(got) < n and time.monotonic() < deadline:
                for batch in c.poll():
                    got.extend(batch.column("value").to_pylist())
                time.sleep(0.01)
            from_s3 = c.path.store.tier_stats()["tier_bytes"]
        tiered = read_manifest(DurableStore(root), "live", 0)
    finally:
        mover.terminate()
        err = mover.communicate(timeout=WAIT_S)[1].decode()
    assert mover.returncode == 0, err
    assert got == [msg(i) for i in range(n)]
    assert len(tiered) >= 5  # files moved while the consumer read
    assert from_s3 > 0  # and some it read only from S3


def test_jars_free_launcher_and_bad_flags(root, s3, subprocess_env):

    make_stream(root, "launch", 60)
    configure_tier(root, "launch", tier_uri(s3, "t13"))
    script = os.path.join(ROOT, "jars-free", "tier_mover.py")
    done = subprocess.run([sys.executable, script, "--root", root, "--once"], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "'uploaded_files': " in done.stdout and read_manifest(DurableStore(root), "launch", 0)
    bad = subprocess.run([sys.executable, script, "--root", root, "--interval", "soon"], env=subprocess_env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--interval" in bad.stderr
    missing = subprocess.run([sys.executable, script, "--root", root + "-missing", "--once"], env=subprocess_env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no durable store" in missing.stderr


def test_a_file_with_a_torn_block_voided_by_its_recovery_seal_tiers_and_reads_the_same(root, s3):
    """A crashed writer's torn block, voided by the next writer's recovery seal: the file is
    sealed (the read side's rule), its copy verifies (crc32 of the whole file; the torn
    block's own checksum fails in the hot copy too) and readers pass it the same way."""
    import datetime as dt

    from pyspark_acs.format.block import encode_block, encode_seal
    from pyspark_acs.format.names import file_name

    store = DurableStore(root)
    store.create_stream("torn", 1)
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    f1, f2 = file_name(t0, "w1"), file_name(t0 + dt.timedelta(seconds=1), "w2")
    good = encode_block([b"a0", b"a1"], None, [1, 2], first_index=0)
    torn = encode_block([b"x%d" % i for i in range(50)], None, list(range(50)), first_index=2)[:300]
    with open(os.path.join(root, shard_dir("torn", 0), f1), "wb") as f:
        f.write(good + torn + encode_seal(2, void_from=len(good)))
    with open(os.path.join(root, shard_dir("torn", 0), f2), "wb") as f:
        f.write(encode_block([b"b0"], None, [3], first_index=0))
    configure_tier(root, "torn", tier_uri(s3, "t14"), hot_retention_s=0)
    report = run_pass(root)
    assert report.uploaded_files == 1 and report.abandoned_objects == 0 and report.waiting_unsealed == 1
    assert hot_files(root, "torn") == [f2]
    assert read_all(root, "torn", 3, tier_read_policy="FORCE") == [b"a0", b"a1", b"b0"]


def test_two_clusters_on_one_bucket_prefix_never_sweep_each_others_objects(tmp_path, s3):
    roots = []
    for name in ("a", "b"):
        root = str(tmp_path / name)
        make_stream(root, "shared", 60)
        configure_tier(root, "shared", tier_uri(s3, "t15"), hot_retention_s=0)
        roots.append(root)
    for root in roots:
        run_pass(root)
    for root in roots:  # each sweep, with no grace at all, takes only its own unnamed objects
        assert run_pass(root, orphan_grace_s=0).swept_objects == 0
    owners = {stream_tier_settings(DurableStore(r), "shared").owner for r in roots}
    assert len(owners) == 2
    for root in roots:
        assert read_all(root, "shared", 60, tier_read_policy="FORCE") == [msg(i) for i in range(60)]


# -- copies across clusters -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def caches_ab(tmp_path_factory):
    """Cache servers of clusters A and B, shared by the module's copy tests: each test's clusters
    have roots of their own, so the keys of their files are their own."""
    with deployments(tmp_path_factory.mktemp("caches-ab"), clusters=("A", "B")) as deps:
        yield deps


@pytest.fixture
def clusters_ab(tmp_path, caches_ab):
    """Clusters A (the source) and B (the destination) of stream ``copied``, each with cache
    servers of its own and a running copy daemon; yields the harness Env."""
    env = Env(tmp_path / "env", caches_ab, [("A", "B", 1)], "copied", ("B",), clusters=("A", "B"))
    try:
        env.start_daemon("A")
        env.start_daemon("B")
        yield env
    finally:
        env.stop()


def send_copied(env, start: int, stop: int) -> None:
    """Messages ``start`` .. ``stop`` to cluster A's shard 0 (small files), producer closed."""
    with env.producer(shards=1, roll_bytes=4000, max_block_bytes=1024) as p:
        for i in range(start, stop):
            p.send(msg(i))


def send_newer_file(env, start: int, stop: int) -> Dict[str, bytes]:
    """Messages ``start`` .. ``stop`` in files newer than every file A holds, once each is in B
    byte-exact; returns them. A file reaches B only once every older file of its shard exists
    there or is known to (the scheduler's file order rule), so by then A's daemon has copied
    each older file it was ever going to copy."""
    before = set(file_bytes(env.roots["A"], env.stream))
    send_copied(env, start, stop)
    newer = {n: b for n, b in file_bytes(env.roots["A"], env.stream).items() if n not in before}
    assert newer and min(newer) > max(before)
    wait_until(lambda: all(file_bytes(env.roots["B"], env.stream).get(n) == b for n, b in newer.items()),
               WAIT_S, f"the newer files in B\n{env.logs()}", interval=0.05)
    return newer


def test_copy_daemon_delivers_files_the_source_tiered_before_the_destination_copied_them(clusters_ab, s3):
    """The destination's daemon is down (and the source's restarts) while the source tiers
    sealed files and deletes their hot copies: once the daemons run again, every file reaches
    the destination byte-exact, and a Consumer already following there gets the whole
    history in order (the scheduler lists both tiers, the destination's writer vouches for a
    tiered file with the source's tiered view, the reader reads it from S3)."""
    env = clusters_ab
    got: List[bytes] = []

    def read_until(c, n: int, wait: float = WAIT_S) -> None:
        deadline = time.monotonic() + wait
        while len(got) < n and time.monotonic() < deadline:
            for batch in c.poll():
                got.extend(batch.column("value").to_pylist())
            time.sleep(0.01)

    with env.producer(shards=1, roll_bytes=4000, max_block_bytes=1024) as p:
        for i in range(40):
            p.send(msg(i))
        p.flush(timeout=WAIT_S)
        env.wait_same("B")
        with env.consumer("B", start="earliest") as c:
            read_until(c, 40)
            assert got == [msg(i) for i in range(40)]
            env.kill_daemon("B")  # the destination is down ...
            env.kill_daemon("A")  # ... and the source's daemon restarts (forgets what it listed)
            for i in range(40, 200):
                p.send(msg(i))
            p.close()  # seals the last file
            source = file_bytes(env.roots["A"], env.stream)
            configure_tier(env.roots["A"], env.stream, tier_uri(s3, "t16"), hot_retention_s=0)
            report = run_pass(env.roots["A"])
            assert report.uploaded_files == len(source) and report.hot_deleted == len(source) - 1
            assert hot_files(env.roots["A"], env.stream) == sorted(source)[-1:]
            read_until(c, 41, NOTHING_ARRIVES_S)  # nothing more arrives while the daemons are down
            assert len(got) == 40
            env.start_daemon("B")
            env.start_daemon("A")
            read_until(c, 200)
    assert got == [msg(i) for i in range(200)], env.logs()
    # Every file of the source is in the destination's hot store, byte-exact.
    assert file_bytes(env.roots["B"], env.stream) == source


# -- the mover's metrics and health ---------------------------------------------------------------


def test_mover_counts_failures_retention_and_tier_lag_in_its_metrics(root, s3):
    p = make_stream(root, "counted", 110, keep_open=True)
    try:
        sizes = {n: len(b) for n, b in file_bytes(root, "counted").items()}
        sealed = sorted(sizes)[:-1]
        configure_tier(root, "counted", tier_uri(s3, "t17"), hot_retention_s=0)
        FlakyTier.mode, FlakyTier.calls = "fail", []
        mover = TierMover(root, tier_factory=FlakyTier, upload_attempts=2, batch_bytes=10_000)
        try:
            report = mover.run_once()
            m = mover.metrics
            assert report.upload_failures == 2 and m.get("upload_failures_total", stream="counted") == 2
            # Nothing tiered: every sealed file is tier lag; the open file waits (unsealed).
            assert m.get("lag_files", stream="counted") == len(sealed)
            assert m.get("lag_bytes", stream="counted") == sum(sizes[n] for n in sealed)
            assert m.get("waiting_unsealed", stream="counted") == 1
            assert mover.lag() == {"counted": (len(sealed), sum(sizes[n] for n in sealed))}
            assert m.get("pass_seconds") == 1 and m.get("last_pass_timestamp_seconds") > 0
            mover._tier_factory, mover._tiers = CorruptingTier, {}
            mover.upload_attempts = 1
            report = mover.run_once()
            assert report.verify_failures == 1 and m.get("verify_failures_total", stream="counted") == 1
            mover._tier_factory, mover._tiers = TierStore, {}
            report = mover.run_once()
            assert m.get("files_tiered_total", stream="counted") == len(sealed) == report.uploaded_files
            assert m.get("bytes_tiered_total", stream="counted") == sum(sizes[n] for n in sealed)
            assert m.get("objects_total", stream="counted") == report.objects >= 2
            assert m.get("lag_files", stream="counted") == 0 and m.get("lag_bytes", stream="counted") == 0
            assert m.get("retention_deleted_total", stream="counted", tier="hot") == len(sealed)
            configure_tier(root, "counted", tier_uri(s3, "t17"), secondary_retention_s=0)
            report = mover.run_once()
            assert m.get("retention_deleted_total", stream="counted", tier="secondary") == len(sealed)
            configure_tier(root, "counted", None)  # not tiered any more: no lag series for it
            mover.run_once()
            assert ("lag_files", (("stream", "counted"),)) not in m.snapshot()
        finally:
            mover.close()
    finally:
        p.close()


def test_mover_daemon_serves_metrics_and_health_with_a_token(root, s3, subprocess_env, tmp_path):
    import json
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from pyspark_acs.server.metrics import TIER_METRICS

    make_stream(root, "scraped", 60)
    names = hot_files(root, "scraped")
    configure_tier(root, "scraped", tier_uri(s3, "t18"), hot_retention_s=0)
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyspark_acs.server.tier.daemon", "--root", root, "--interval", "100ms",
         "--metrics-port", "0", "--token-file", str(token), "--parent-pid", str(os.getpid())],
        env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline().strip()
        assert banner.startswith(f"acs-tier-mover root={root} interval=0.1s metrics=http://127.0.0.1:"), banner
        url = banner.split(" metrics=", 1)[1]
        auth = {"Authorization": "Bearer s3cret-token"}
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(url, timeout=5)
        deadline = time.monotonic() + WAIT_S
        while True:
            text = urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=5).read().decode()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            tiered = [s.value for s in families["acs_tier_files_tiered"].samples
                      if s.name == "acs_tier_files_tiered_total" and s.labels == {"stream": "scraped"}]
            # The files are counted during the first pass, its duration only at its end.
            passes = [s.value for s in families["acs_tier_pass_seconds"].samples
                      if s.name == "acs_tier_pass_seconds_count"]
            if (tiered == [len(names)] and passes and passes[0] >= 1) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert tiered == [len(names)]
        for short, spec in TIER_METRICS.items():  # every declared metric, with its type and help
            name = "acs_tier_" + (short[: -len("_total")] if spec.kind == "counter" else short)
            assert families[name].type == spec.kind and families[name].documentation == spec.help, name

        def value(name, **labels):
            return sum(s.value for f in families.values() for s in f.samples if s.name == name and s.labels == labels)

        assert value("acs_tier_retention_deleted_total", stream="scraped", tier="hot") == len(names) - 1
        assert value("acs_tier_lag_files", stream="scraped") == 0
        assert value("acs_tier_pass_seconds_count") >= 1
        health = urllib.request.urlopen(urllib.request.Request(url.replace("/metrics", "/healthz"), headers=auth),
                                        timeout=5)
        body = json.loads(health.read())
        assert health.status == 200 and body["healthy"] is True and body["passes"] >= 1
        assert body["failed_streams"] == {} and body["lag"]["scraped"] == {"files": 0, "bytes": 0}
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err


def test_mover_daemon_health_names_a_stale_pass_and_bad_flags(root, subprocess_env):
    from pyspark_acs.server.tier.daemon import TierMoverDaemon

    make_stream(root, "stale", 10)
    daemon = TierMoverDaemon(TierMover(root), 0.01, metrics_port=-1)
    daemon._started -= 3600  # started an hour ago and no pass ended since
    healthy, details = daemon.healthz()
    assert not healthy and "no tier pass ended for" in details["error"]
    daemon.run_pass()
    assert daemon.healthz()[0] and daemon.metrics_url is None
    daemon.stop()
    bad = subprocess.run([sys.executable, "-m", "pyspark_acs.server.tier.daemon", "--root", root,
                          "--metrics-port", "http"], env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--metrics-port" in bad.stderr
    exposed = subprocess.run([sys.executable, "-m", "pyspark_acs.server.tier.daemon", "--root", root,
                              "--host", "0.0.0.0"], env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert exposed.returncode == 2 and "--insecure" in exposed.stderr


# -- acs tier --------------------------------------------------------------------------------------


def test_acs_tier_sets_changes_shows_and_turns_off_tier_settings(root, s3, capsys):
    import json

    from pyspark_acs.cli.main import main

    make_stream(root, "cli", 60)
    uri = tier_uri(s3, "t19")

    def acs(*argv):
        try:
            code = main(["tier", *argv, "--root", root])
        except SystemExit as exc:  # a usage error: argparse exits
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = acs("cli")
    assert code == 0 and out.startswith("stream cli: not tiered")
    code, out, _ = acs("cli", uri, "--hot-retention", "1d", "--hot-retention-bytes", "10GiB",
                       "--secondary-retention", "90d")
    assert code == 0, out
    settings = stream_tier_settings(DurableStore(root), "cli")
    assert (settings.uri, settings.hot_retention_s, settings.hot_retention_bytes, settings.secondary_retention_s) == \
        (uri, 86400, 10 * 2**30, 90 * 86400)
    assert f"tiered to s3://{BUCKET}/t19" in out and "hot retention:        1d" in out and "10.0 GiB" in out
    assert "90d" in out and SECRET + "@" not in out
    # One flag changes one setting; the URI and the others stay; forever removes a retention.
    assert acs("cli", "--hot-retention", "12h", "--secondary-retention", "forever")[0] == 0
    settings = stream_tier_settings(DurableStore(root), "cli")
    assert (settings.uri, settings.hot_retention_s, settings.hot_retention_bytes, settings.secondary_retention_s) == \
        (uri, 43200, 10 * 2**30, None)
    code, out, _ = acs("cli", "--json")
    shown = json.loads(out)
    assert code == 0 and shown["uri"] == f"s3://{BUCKET}/t19" and shown["hot_retention_s"] == 43200
    # Bad values are usage errors naming their flag (the flags are generated from TierSettings'
    # declarations); a bare number needs its unit; nothing is written.
    for flag, value in (("--hot-retention", "soon"), ("--hot-retention-bytes", "lots"),
                        ("--secondary-retention", "-1d"), ("--hot-retention", "1")):
        code, _, err = acs("cli", f"{flag}={value}")
        assert code == 2 and f"acs tier: error: argument {flag}: " in err, err
    code, _, err = acs("cli", uri, "--off")
    assert code == 1 and "--off: takes no URI" in err
    code, _, err = acs("cli", tier_uri(s3, "x").replace(BUCKET, "no-such-bucket"))
    assert code == 1 and "bucket 'no-such-bucket'" in err and SECRET not in err
    code, _, err = acs("nope")
    assert code == 1 and "no stream 'nope'" in err
    assert stream_tier_settings(DurableStore(root), "cli").hot_retention_s == 43200
    # Once files are recorded in the tier, turning it off or moving it would strand them: refused.
    assert acs("cli", "--hot-retention", "0s")[0] == 0
    run_pass(root)
    assert len(hot_files(root, "cli")) == 1
    code, _, err = acs("cli", "--off")
    assert code == 1 and "files of stream 'cli' are recorded in its secondary store" in err, err
    code, _, err = acs("cli", tier_uri(s3, "elsewhere"))
    assert code == 1 and f"moving it to s3://{BUCKET}/elsewhere" in err
    assert read_all(root, "cli", 60) == [msg(i) for i in range(60)]
    # A stream with nothing tiered turns off; flags alone cannot tier a stream without a URI.
    make_stream(root, "cli2", 10)
    assert acs("cli2", uri)[0] == 0
    code, out, _ = acs("cli2", "--off")
    assert code == 0 and out.startswith("stream cli2: not tiered")
    code, _, err = acs("cli2", "--hot-retention", "1d")
    assert code == 1 and "URI: stream 'cli2' is not tiered" in err


# -- listings and the tier records ----------------------------------------------------------------


def test_a_consumer_waiting_for_the_next_file_does_not_read_the_tier_records_per_poll(root, s3):
    """A Consumer at a sealed file's end lists the shard (to find the next file); the tier
    records are read again only when the manifest changed (one stat per listing). The listing
    back-off is turned off here so that it lists every poll, as many listings as polls."""
    from pyspark_acs.read.consumer import TailTiming
    from pyspark_acs.storage.tier import tiered_store

    make_stream(root, "idle", 60)
    configure_tier(root, "idle", tier_uri(s3, "t20"), hot_retention_s=0)
    run_pass(root)
    got: List[bytes] = []
    store = tiered_store(DurableStore(root, create=False), manifest_settle_s=0.0)  # trust (mtime, size) at once
    with Consumer(root, "idle", start="earliest", read_path=open_read_path(store),
                  timing=TailTiming(listing_backoff_s=(0.0, 0.0))) as c:
        while len(got) < 60:
            for batch in c.poll():
                got.extend(batch.column("value").to_pylist())
        before = c.path.store.tier_stats()
        for _ in range(200):
            assert c.poll() == []
        after = c.path.store.tier_stats()
        assert after["manifest_checks"] - before["manifest_checks"] >= 200  # it did list every poll
        assert after["manifest_reads"] - before["manifest_reads"] == 0
        # New files, tiered and deleted from the hot store while the Consumer waits: the
        # manifest changed, so the next listing reads it and no file is skipped.
        with Producer(root, "idle", roll_bytes=4000, max_block_bytes=1024) as p:
            for i in range(60, 120):
                p.send(msg(i))
            p.flush(timeout=WAIT_S)
        assert run_pass(root).hot_deleted >= 3
        deadline = time.monotonic() + WAIT_S
        while len(got) < 120 and time.monotonic() < deadline:
            for batch in c.poll():
                got.extend(batch.column("value").to_pylist())
        assert c.path.store.tier_stats()["manifest_reads"] > after["manifest_reads"]
    assert got == [msg(i) for i in range(120)]


def test_acs_up_runs_a_tier_mover_and_acs_down_stops_it(root, s3, subprocess_env, tmp_path):
    import re
    import urllib.request

    from pyspark_acs.server.local.deploy import load_deployment

    make_stream(root, "upt", 60)
    configure_tier(root, "upt", tier_uri(s3, "t21"), hot_retention_s=0)
    dep_dir = str(tmp_path / "dep")
    env = {k: v for k, v in subprocess_env.items() if k not in ("ACS_DATA_CACHE", "ACS_METADATA_CACHE")}

    def acs(*argv):
        return subprocess.run([sys.executable, "-m", "pyspark_acs.cli.main", *argv], env=env, capture_output=True,
                              text=True, timeout=120)

    bad = acs("up", "--dir", dep_dir, "--tier-mover")
    assert bad.returncode == 1 and "--tier-mover: give the hot store root" in bad.stderr
    bad = acs("up", "--dir", dep_dir, "--tier-mover", "--root", root, "--tier-interval", "often")
    assert bad.returncode == 2 and "argument --tier-interval: 'often' is not a duration" in bad.stderr
    up = acs("up", "--dir", dep_dir, "--data-replicas", "1", "--metadata-replicas", "1", "--capacity", "16MiB",
             "--tier-mover", "--root", root, "--tier-interval", "100ms")
    pids = []
    try:
        assert up.returncode == 0, up.stderr
        line = re.search(r"^tier-0  tier mover of (\S+)  pid=(\d+)  metrics=(\S+)  log=(\S+)$", up.stdout, re.M)
        assert line and line.group(1) == root, up.stdout
        state = load_deployment(dep_dir)
        pids = [s["pid"] for s in state["servers"]]
        assert [s["role"] for s in state["servers"]] == ["data", "metadata", "tier"]
        deadline = time.monotonic() + WAIT_S
        while len(hot_files(root, "upt")) > 1:
            assert time.monotonic() < deadline, open(line.group(4)).read()
            time.sleep(0.1)
        text = urllib.request.urlopen(line.group(3), timeout=5).read().decode()
        assert 'acs_tier_files_tiered_total{stream="upt"}' in text
        # A second `up` in the same folder is refused while the mover (or any server) runs.
        again = acs("up", "--dir", dep_dir, "--tier-mover", "--root", root)
        assert again.returncode == 1 and "already has a running deployment" in again.stderr
    finally:
        down = acs("down", "--dir", dep_dir)
    assert down.returncode == 0 and "stopped 3 servers: data-0 metadata-0 tier-0" in down.stdout, down.stdout
    deadline = time.monotonic() + WAIT_S
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(") ", 1)[1][0] != "Z"
              for p in pids):
        assert time.monotonic() < deadline, "a process of the deployment outlived acs down"
        time.sleep(0.05)
    assert read_all(root, "upt", 60, tier_read_policy="FORCE") == [msg(i) for i in range(60)]


def test_a_destination_that_tiered_its_copies_is_not_sent_them_again(clusters_ab, s3):
    """A destination's own mover tiered the copies and deleted their hot copies; when the
    source's daemon restarts it asks the destination which files it holds (Files), which
    counts tiered files: none is copied into the destination's hot store again (checked once
    a file written after the restart is in B: the file order rule copies older files first)."""
    env = clusters_ab
    send_copied(env, 0, 100)
    env.wait_same("B")
    source = file_bytes(env.roots["A"], env.stream)
    configure_tier(env.roots["B"], env.stream, tier_uri(s3, "t22"), hot_retention_s=0)
    assert run_pass(env.roots["B"]).hot_deleted == len(source) - 1
    env.kill_daemon("A")
    env.start_daemon("A")
    newer = send_newer_file(env, 100, 110)
    assert hot_files(env.roots["B"], env.stream) == sorted(source)[-1:] + sorted(newer), env.logs()
    assert read_all(env.roots["B"], env.stream, 110) == [msg(i) for i in range(110)]


def test_a_copy_writer_answers_a_hello_for_a_file_tiered_here_without_creating_it(root, s3, tmp_path):
    """A parent that could not ask which files a destination holds (its Files call failed)
    starts an operation for a file the destination's own mover tiered and deleted from its hot
    store: the hello is answered with the whole length, no hot file is created, and a delta for
    it is refused."""
    from pyspark_acs.server.copy.cluster import ClusterIO
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.proto import copy_pb2
    from pyspark_acs.server.copy.topology import Cluster
    from pyspark_acs.server.copy.writer import CopyServicer

    make_stream(root, "here", 60)
    before = file_bytes(root, "here")
    configure_tier(root, "here", tier_uri(s3, "t23"), hot_retention_s=0)
    run_pass(root)
    oldest = sorted(before)[0]
    assert oldest not in hot_files(root, "here")
    deps = start_caches(tmp_path / "caches", clusters=("B",))
    io = ClusterIO(Cluster("B", root, tuple(deps["B"].endpoints("data")), tuple(deps["B"].endpoints("metadata")),
                           "127.0.0.1:1"))
    try:
        servicer = CopyServicer(io, CopyDaemonOptions(), CopyMetrics("B"))
        common = dict(stream="here", shard=0, file=oldest, storage=copy_pb2.DURABLE, shards=1, operation="op-1",
                      source_cluster="A")
        acks = list(servicer.Copy(iter([copy_pb2.CopyRequest(hello=True, **common),
                                        copy_pb2.CopyRequest(start=len(before[oldest]), data=b"x", **common)]), None))
        assert [a.status for a in acks] == [copy_pb2.OK, copy_pb2.FAILED]
        assert acks[0].length == len(before[oldest]) and "tiered here" in acks[1].message
        assert oldest not in hot_files(root, "here")  # not created again
        assert servicer.metrics.get("errors_total", kind="tiered_here") == 1
    finally:
        io.close()
        for d in deps.values():
            d.stop()
    assert read_all(root, "here", 60) == [msg(i) for i in range(60)]


# -- found in review: a destination's own retention and mover against copies --------------

REVIEW_WAIT_S = 30.0


def test_a_destination_whose_retention_deleted_old_files_is_not_sent_them_again(tmp_path, s3, caches_ab):
    """The destination keeps its stream a shorter time than the source (its own tier
    settings: secondary retention): its mover deletes old files from both tiers. When the
    source's daemon restarts it asks the destination which files it holds; the old files are
    no longer there, but the source still holds them (in its hot store or its secondary
    store, which the scheduler now lists): they must not be copied into the destination
    again (a resurrected history, copied once per restart, read again by readers from
    earliest). Checked once a file written after the restart is in B: the file order rule
    copies older files first."""

    env = Env(tmp_path / "env", caches_ab, [("A", "B", 1)], "kept", ("B",), clusters=("A", "B"))
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
        newer = send_newer_file(env, 100, 110)
        assert hot_files(env.roots["B"], env.stream) == [newest] + sorted(newer), \
            f"files the destination's retention deleted were copied there again\n{env.logs()}"
    finally:
        env.stop()


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
    after the seal its successor wrote (tests/write/test_write_path.py shows it; readers never read
    past a seal). Such a file is sealed: it, and every later file of the shard, must still
    tier; the mover must not wait for it forever as if it were unsealed."""
    from pyspark_acs.format.block import encode_block
    from pyspark_acs.format.names import shard_dir

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


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_reader_stepping_over_files_retention_deleted_reports_the_loss(root, tmp_path, caplog, fail_on_data_loss):
    """Secondary retention deletes files by age: when the file a reader finished survives (it
    was written again later) and files after it are deleted, the reader's next file is not
    the one after its own. File names carry no sequence number, so only the floor the mover
    records before deleting (``_retained.json``) tells the gap from a seamless step: the
    reader raises DataLossError naming the last lost file (or, with fail_on_data_loss=False,
    logs it and goes on), instead of skipping the files silently."""
    import logging
    import os

    from pyspark_acs.errors import DataLossError
    from pyspark_acs.storage.tier import RETENTION_FLOOR_FILE

    make_stream(root, "gap", 80)
    names = hot_files(root, "gap")
    assert len(names) >= 4
    first, lost, newest = names[0], names[1:-1], names[-1]
    folder = os.path.join(root, shard_dir("gap", 0))
    day_ago = time.time() - 86400
    for name in lost:  # old files: past retention; the first file was touched since
        os.utime(os.path.join(folder, name), (day_ago, day_ago))
    configure_tier(root, "gap", str(tmp_path / "cold"))
    run_pass(root)
    configure_tier(root, "gap", str(tmp_path / "cold"), secondary_retention_s=3600)
    report = run_pass(root, orphan_grace_s=0)
    assert report.secondary_deleted == len(lost)
    assert hot_files(root, "gap") == [first, newest]
    floor = json.loads(open(os.path.join(folder, RETENTION_FLOOR_FILE)).read())
    assert floor == {"deleted_through": lost[-1]}

    end_of_first = DurableStore(root).length(f"{shard_dir('gap', 0)}/{first}")
    start = {"gap": {"0": {"file": first, "length": end_of_first}}}
    with Consumer(root, "gap", start=start, fail_on_data_loss=fail_on_data_loss) as c:
        if fail_on_data_loss:
            with pytest.raises(DataLossError, match=f"retention deleted the files after {first} up to {lost[-1]}") as err:
                for _ in range(50):
                    c.poll()
                    time.sleep(0.01)
            assert (err.value.stream, err.value.shard, err.value.file) == ("gap", 0, lost[-1])
        else:
            with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.consumer"):
                got: List[bytes] = []
                deadline = time.monotonic() + WAIT_S
                while not got and time.monotonic() < deadline:
                    for batch in c.poll():
                        got.extend(batch.column("value").to_pylist())
            assert got and got[-1] == msg(79)  # on with the newest file
            assert f"retention deleted the files after {first} up to {lost[-1]}" in caplog.text


def test_a_destination_gets_the_sources_retention_floor_with_the_next_file(clusters_ab, tmp_path):
    """The destination's daemon is down while the source's secondary retention deletes files
    the destination has not copied: when it comes back, the copy writer records the source's
    floor before it creates the next file, so a Consumer there that finished its last file
    reports the lost files (DataLossError naming the last) instead of stepping over them
    (review: those files were skipped with no error). The Consumer follows in B through the
    whole fault: it read everything copied before, waits at its last file's seal while the
    daemons are down, and meets the gap when the next file arrives."""
    import os

    from pyspark_acs.errors import DataLossError
    from pyspark_acs.storage.tier import retention_floor

    env = clusters_ab
    send_copied(env, 0, 40)
    env.wait_same("B")
    copied = hot_files(env.roots["B"], env.stream)
    c = env.consumer("B", start="earliest")
    got: List[bytes] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < 40 and time.monotonic() < deadline:
        for batch in c.poll():
            got.extend(batch.column("value").to_pylist())
        time.sleep(0.01)
    assert got == [msg(i) for i in range(40)]
    env.kill_daemon("B")  # the destination is down ...
    env.kill_daemon("A")  # ... and the source's daemon restarts
    send_copied(env, 40, 160)
    names = hot_files(env.roots["A"], env.stream)
    later = [n for n in names if n > copied[-1]]
    assert len(later) >= 3
    folder = os.path.join(env.roots["A"], shard_dir(env.stream, 0))
    day_ago = time.time() - 86400
    for name in later[:-1]:  # past retention at the source before B copied them
        os.utime(os.path.join(folder, name), (day_ago, day_ago))
    configure_tier(env.roots["A"], env.stream, str(tmp_path / "cold"))
    run_pass(env.roots["A"])
    configure_tier(env.roots["A"], env.stream, str(tmp_path / "cold"), secondary_retention_s=3600)
    assert run_pass(env.roots["A"], orphan_grace_s=0).secondary_deleted == len(later) - 1
    assert retention_floor(DurableStore(env.roots["A"]), env.stream, 0) == later[-2]

    assert c.poll() == []  # still waiting at the seal of the last file it read
    env.start_daemon("B")
    env.start_daemon("A")
    deadline = time.monotonic() + WAIT_S
    while later[-1] not in hot_files(env.roots["B"], env.stream) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert later[-1] in hot_files(env.roots["B"], env.stream), env.logs()
    assert retention_floor(DurableStore(env.roots["B"]), env.stream, 0) == later[-2]
    with c, pytest.raises(DataLossError, match=f"after {copied[-1]} up to {later[-2]}"):
        for _ in range(250):
            assert c.poll() == []  # nothing from after the gap comes before the error
            time.sleep(0.02)
