"""Regression tests of the one read path: a file is finished only at its seal.

Each test names the bug it guards and fails on the read path before the change
(commit 0c51954): there a reader left an unsealed file once a newer file existed, planned
Spark ranges across it, fed Algorithm 1 only published lengths, walked ``latest`` headers in
the durable file up to the cache length, and let the length poller thread die on a closed client.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pyspark_acs import Consumer, Producer
from pyspark_acs.cache.chunks import ChunkWriter
from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.metadata import MetadataCache
from pyspark_acs.cache.poller import LengthPoller
from pyspark_acs.datasource.options import parse_source_options
from pyspark_acs.datasource.source import _Planner
from pyspark_acs.format.block import encode_block, encode_seal
from pyspark_acs.format.names import file_name, shard_dir
from pyspark_acs.format.offsets import Offset
from pyspark_acs.read.cachepath import (OVERLOAD_PATIENCE_S, SLOW_RETRY_MIN_S, STORE_HOLD_JITTER, STORE_HOLD_MIN_S,
                                        CachedReadPath)
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.store import DurableStore

from tests.helpers import FakeClock, free_port, stop_process

WAIT_S = 20.0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """One data and one metadata cache server (real processes) for the module."""
    with LocalDeployment(str(tmp_path_factory.mktemp("caches")), data_replicas=1, metadata_replicas=1) as dep:
        yield dep


@pytest.fixture(scope="module")
def caches(deployment):
    return {"data_cache": deployment.data_endpoints, "metadata_cache": deployment.metadata_endpoints}


def _name(offset_s: float, writer: str = "w") -> str:
    created = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=offset_s)
    return file_name(created, writer)


def _append(root: str, stream: str, name: str, data: bytes) -> str:
    path = os.path.join(root, shard_dir(stream, 0), name)
    with open(path, "ab") as f:
        f.write(data)
    return path


def _block(first: int, n: int, tag: str = "m") -> bytes:
    values = [f"{tag}{i}".encode() for i in range(first, first + n)]
    return encode_block(values, None, list(range(first, first + n)), first_index=first)


def _values(consumer: Consumer, n: int, timeout: float = WAIT_S) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} messages arrived: {got[-5:]}"
        for batch in consumer.poll():
            got.extend(batch.column("value").to_pylist())
        time.sleep(0.01)
    return got


def _quiet(consumer: Consumer, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert [v for b in consumer.poll() for v in b.column("value").to_pylist()] == []
        time.sleep(0.02)


# -- bug 1: a newer file never finishes an older one --------------------------------------------
# In a destination (a stream the copy daemon keeps) files are copied side by side: an older file
# may still grow while a newer one exists. (In the source cluster that is damage:
# test_producer_consumer.py's truncated-file tests.)


def test_unsealed_file_is_not_left_for_a_newer_file(root):
    DurableStore(root).create_stream("s", 1, copied_from="A")
    f1, f2 = _name(0), _name(1)
    _append(root, "s", f1, _block(0, 3, "a"))
    _append(root, "s", f2, _block(0, 2, "b"))  # a newer file exists while f1 still grows
    with Consumer(root, "s") as c:
        assert _values(c, 3) == [b"a0", b"a1", b"a2"]
        _quiet(c, 1.5)  # past TailTiming.unfinished_check_s (1 s): it looked at the newer file and stayed
        assert c.offsets()["s"]["0"]["file"] == f1
        b = _block(3, 2, "a")
        _append(root, "s", f1, b + encode_seal(5))
        assert _values(c, 4) == [b"a3", b"a4", b"b0", b"b1"]


def test_spark_planner_stops_at_the_first_unsealed_file(root):
    DurableStore(root).create_stream("p", 1, copied_from="A")
    f1, f2 = _name(0), _name(1)
    b1 = _block(0, 3)
    _append(root, "p", f1, b1)
    _append(root, "p", f2, _block(0, 2, "b") + encode_seal(2))
    planner = _Planner(parse_source_options({"root": root, "stream": "p"}))
    shard = ("p", 0)
    assert planner.latest([shard], {shard: Offset(f1, 0)})[shard] == Offset(f1, len(b1))
    _append(root, "p", f1, encode_seal(3))
    # sealed now: the walk crosses into f2 and up to the end of f2 (its seal included)
    end = planner.latest([shard], {shard: Offset(f1, 0)})[shard]
    assert end.file == f2 and end.length == os.path.getsize(os.path.join(root, shard_dir("p", 0), f2))


# -- torn block + recovery seal --------------------------------------------------------------------


def test_torn_block_is_skipped_only_through_its_recovery_seal(root, caplog):
    DurableStore(root).create_stream("t", 1)
    f1, f2 = _name(0), _name(1)
    good = _block(0, 2, "a")
    torn = _block(2, 50, "x")[: 300]  # a writer died in the middle of this block
    path = _append(root, "t", f1, good + torn)
    _append(root, "t", f2, _block(0, 1, "b"))
    with caplog.at_level(logging.WARNING, logger="pyspark_acs.read.consumer"):
        with Consumer(root, "t") as c:
            assert _values(c, 2) == [b"a0", b"a1"]
            _quiet(c, 0.5)  # no seal yet: the torn bytes may still complete; never skipped
            seal_at = os.path.getsize(path)
            _append(root, "t", f1, encode_seal(2, void_from=len(good)))  # the next writer's recovery seal
            assert _values(c, 1) == [b"b0"]
    uri = DurableStore(root).uri(f"{shard_dir('t', 0)}/{f1}")
    assert any(uri in r.getMessage() and f"[{len(good)}, {seal_at})" in r.getMessage() for r in caplog.records)
    planner = _Planner(parse_source_options({"root": root, "stream": "t"}))
    end = planner.latest([("t", 0)], {("t", 0): Offset(f1, 0)})[("t", 0)]
    assert end.file == f2


@pytest.mark.parametrize("short", [1, 8, 30, 55, 60])
def test_a_torn_block_whose_size_reaches_into_its_recovery_seal_is_voided_too(root, short):
    """The torn block lacks only ``short`` bytes: by its header it ends inside the recovery seal
    after it (1-56 bytes short) or past it. Every walk (the planner's, the seal rule's) and the
    Consumer pass it through the seal; none takes seal bytes for a block (found by the review of
    the sink's marks: 1-8 bytes short raised CorruptFileError in every reader)."""
    from pyspark_acs.read.positions import walk_blocks
    from pyspark_acs.read.readpath import DurableReadPath

    DurableStore(root).create_stream("t", 1)
    f1, f2 = _name(0), _name(1)
    good = _block(0, 2, "a")
    whole = _block(2, 3, "x")
    path = _append(root, "t", f1, good + whole[: len(whole) - short])
    _append(root, "t", f1, encode_seal(2, void_from=len(good)))
    _append(root, "t", f2, _block(0, 1, "b"))
    with Consumer(root, "t") as c:
        assert _values(c, 3) == [b"a0", b"a1", b"b0"]
    store = DurableStore(root)
    rp = DurableReadPath(store)
    rel = f"{shard_dir('t', 0)}/{f1}"
    assert walk_blocks(rp, rel, 0, os.path.getsize(path)) == (os.path.getsize(path), 2, 2, True)
    planner = _Planner(parse_source_options({"root": root, "stream": "t"}))
    assert planner.latest([("t", 0)], {("t", 0): Offset(f1, 0)})[("t", 0)].file == f2


def _one_file(tmp_path, data):
    root = str(tmp_path / "r")
    DurableStore(root).create_stream("t", 1)
    name = file_name(dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), "w")
    rel = f"{shard_dir('t', 0)}/{name}"
    with open(os.path.join(root, rel), "wb") as f:
        f.write(data)
    return root, rel


def test_a_message_shaped_like_a_recovery_seal_is_not_taken_for_one_mid_append(tmp_path):
    from pyspark_acs.read.positions import walk_blocks
    from pyspark_acs.read.readpath import DurableReadPath

    value = b"hello" + encode_seal(0, void_from=0) + b"world"   # a user's message bytes
    block = encode_block([value], None, [1], first_index=0)
    nxt = encode_block([b"next"], None, [2], first_index=1)
    root, rel = _one_file(tmp_path, block + nxt[:20])  # the writer is mid-append: 20 bytes of a header
    store = DurableStore(root)
    got = walk_blocks(DurableReadPath(store), rel, 0, len(block) + 20)
    assert got == (len(block), 1, 1, False)


def test_a_walk_stopping_inside_the_next_header_reads_no_block_body(tmp_path):
    from pyspark_acs.read.positions import walk_blocks
    from pyspark_acs.read.readpath import DurableReadPath

    big = encode_block([b"v" * (4 << 20)], None, [1], first_index=0)
    nxt = encode_block([b"next"], None, [2], first_index=1)
    root, rel = _one_file(tmp_path, big + nxt[:20])
    store = DurableStore(root)
    rp = DurableReadPath(store)
    read = []
    real = store.read
    store.read = lambda r, s, e: (read.append(e - s), real(r, s, e))[1]
    assert walk_blocks(rp, rel, 0, len(big) + 20)[:2] == (len(big), 1)
    assert sum(read) < 512 * 1024, f"{sum(read)} bytes read for a header walk"


# -- bug 3: a producer that dies between its durable append and publishing ----------------------

_DYING_PRODUCER = textwrap.dedent(
    """
    import os, signal, sys
    from pyspark_acs import Producer
    root, data, meta = sys.argv[1:4]
    p = Producer(root, "d", shards=1, data_cache=data, metadata_cache=meta, writer_id="dying")
    for i in range(5):
        p.send(f"a{i}".encode())
    p.flush()
    print(p.current_files()[0], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no seal, no release
    """
)


def test_unpublished_bytes_of_a_dead_producer_reach_cached_readers(root, caches, subprocess_env):
    DurableStore(root).create_stream("d", 1)
    with Consumer(root, "d", **caches) as c:
        out = subprocess.run(
            [sys.executable, "-c", _DYING_PRODUCER, root, caches["data_cache"], caches["metadata_cache"]],
            capture_output=True, text=True, env=subprocess_env, timeout=60,
        )
        name = out.stdout.strip().splitlines()[-1]
        assert _values(c, 5) == [f"a{i}".encode() for i in range(5)]
        # The producer's last append reached the store, but it died before publishing the length.
        _append(root, "d", name, _block(5, 2, "a"))
        # Old read path: stuck at the published length until the metadata entry expires (24 h).
        assert _values(c, 2, timeout=10) == [b"a5", b"a6"]
        with Producer(root, "d", shards=1, lease_seconds=1, **caches) as p2:  # takes over, seals
            p2.send(b"next")
        assert _values(c, 1, timeout=10) == [b"next"]
        assert c.stats()["durable_bytes"] > 0


# -- bug 6: start="latest" where the cache copy is ahead of the durable copy -------------------------


def test_latest_where_the_cache_copy_leads_the_durable_copy(root, caches):
    store = DurableStore(root)
    store.create_stream("l", 1)
    name = _name(0)
    b1, b2 = _block(0, 3), _block(3, 4)
    _append(root, "l", name, b1)  # the durable copy has b1 only
    uri = store.uri(f"{shard_dir('l', 0)}/{name}")
    with CacheClient(caches["data_cache"]) as data, CacheClient(caches["metadata_cache"]) as meta:
        cache_len = ChunkWriter(data, uri).append(b1 + b2)
        MetadataCache(meta).publish(uri, cache_length=cache_len, durable_length=len(b1))
    with Consumer(root, "l", start="latest", **caches) as c:  # old: TruncatedBlockError
        assert c.offsets()["l"]["0"] == {"file": name, "length": len(b1) + len(b2)}


def test_latest_through_the_caches_reads_a_few_bytes_not_the_newest_file(root, caches):
    # A joining reader took "latest" by reading the whole newest file (and read it again to
    # look for a seal behind its position): with many joining at once, a storm of reads.
    with Producer(root, "j", shards=1, **caches) as p:
        for i in range(100):  # 100 blocks, 1 MB in one file
            p.send_many([b"old-%d-" % i + b"x" * 1000] * 10)
            p.flush(timeout=WAIT_S)
        with Consumer(root, "j", start="latest", **caches) as c:
            p.send(b"new")
            p.flush(timeout=WAIT_S)
            assert _values(c, 1) == [b"new"]
            stats = c.stats()
    assert stats["cache_bytes"] + stats["durable_bytes"] < 16 * 1024, stats


def test_latest_after_a_message_shaped_like_a_seal_reads_on_in_the_file(root, caches):
    # The newest block ends in a seal's 48 bytes (a message value may): the bytes before the
    # published length prove nothing, so the file's headers are walked and it is not sealed.
    with Producer(root, "k", shards=1, **caches) as p:
        p.send(b"a")
        p.send(b"tail" + encode_seal(first_index=2))
        p.flush(timeout=WAIT_S)
        with Consumer(root, "k", start="latest", **caches) as c:
            p.send(b"after")
            p.flush(timeout=WAIT_S)
            assert _values(c, 1) == [b"after"]


def test_latest_in_a_copy_walks_to_a_boundary_not_a_published_length_inside_a_block(root, caches):
    # A copy daemon may publish a destination's length at the end of a torn append (inside a
    # block): in a copy, latest walks the headers instead of trusting the length.
    store = DurableStore(root)
    store.create_stream("cp", 1, copied_from="A")
    name = _name(0)
    b1, b2 = _block(0, 3), _block(3, 4)
    _append(root, "cp", name, b1 + b2[:20])  # b2 torn so far
    uri = store.uri(f"{shard_dir('cp', 0)}/{name}")
    with CacheClient(caches["metadata_cache"]) as meta:
        MetadataCache(meta).publish(uri, durable_length=len(b1) + 20)
    with Consumer(root, "cp", start="latest", **caches) as c:
        assert c.offsets()["cp"]["0"] == {"file": name, "length": len(b1)}
        _append(root, "cp", name, b2[20:])
        with CacheClient(caches["metadata_cache"]) as meta:
            MetadataCache(meta).publish(uri, durable_length=len(b1) + len(b2))
        assert _values(c, 4) == [b"m3", b"m4", b"m5", b"m6"]


def test_latest_through_the_caches_after_a_sealed_file_follows_the_next(root, caches):
    with Producer(root, "z", shards=1, **caches) as p:
        p.send(b"before")
    with Consumer(root, "z", start="latest", **caches) as c:
        with Producer(root, "z", shards=1, **caches) as p2:
            p2.send(b"after")
        assert _values(c, 1) == [b"after"]
        _quiet(c, 0.05)


# -- bug 8: the length poller's thread on a closed client -----------------------------------------


def test_poller_thread_stops_quietly_when_its_client_closes(caches):
    errors = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        poller = LengthPoller(tuple(caches["metadata_cache"].split(",")))
        poller.lengths(["file:///nowhere/a.acs"])
        assert poller._thread is not None
        poller._client.close()
        deadline = time.monotonic() + 5
        while poller._thread is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert poller._thread is None
    finally:
        threading.excepthook = old_hook
    assert errors == []


_CLOSING_CONSUMER = textwrap.dedent(
    """
    import concurrent.futures.thread, sys, threading, time
    from pyspark_acs import Consumer
    errors = []
    threading.excepthook = lambda args: errors.append(f"{args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")
    root, data, meta = sys.argv[1:4]
    c = Consumer(root, "c8", data_cache=data, metadata_cache=meta)
    n = 0
    while n < 20:
        n += sum(b.num_rows for b in c.poll())
    c.close()
    time.sleep(0.1)  # the shared poller still follows the files it was asked about
    # What the interpreter does at exit before daemon threads stop: shut every executor down.
    concurrent.futures.thread._python_exit()
    time.sleep(0.3)
    print(repr(errors), flush=True)
    """
)


def test_closing_a_consumer_and_exiting_leaves_no_poller_exception(root, caches, subprocess_env):
    """Bug 8 as users saw it: a script closes its Consumer and exits while the process's
    length poller still polls; the poller's next batched read submitted to a shut-down pool and
    its thread died with ``RuntimeError: cannot schedule new futures after ... shutdown``
    (3 runs in 10 printed it on 0c51954; this test makes the exit deterministic)."""
    with Producer(root, "c8", shards=2, **caches) as p:
        p.send_many([b"x"] * 20)
    out = subprocess.run(
        [sys.executable, "-c", _CLOSING_CONSUMER, root, caches["data_cache"], caches["metadata_cache"]],
        capture_output=True, text=True, env=subprocess_env, timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]


# -- a start at a timestamp follows the seal rule too ----------------------------------------------


def test_timestamp_start_does_not_skip_an_unsealed_file(root):
    from pyspark_acs.format.offsets import format_offsets
    from pyspark_acs.read.positions import offset_for_timestamp
    from pyspark_acs.read.readpath import DurableReadPath

    DurableStore(root).create_stream("ts", 1, copied_from="A")  # files copied side by side
    f1, f2 = _name(0), _name(1)
    b1 = encode_block([b"a0", b"a1", b"a2"], None, [1, 2, 3], first_index=0)
    _append(root, "ts", f1, b1)  # unsealed: its writer may still append
    _append(root, "ts", f2, encode_block([b"b0", b"b1"], None, [100, 101], first_index=0) + encode_seal(2))
    path = DurableReadPath(DurableStore(root))
    try:
        # Old rule: Offset(f2, 0) -- a reader starting there never sees f1's later messages.
        start = offset_for_timestamp(path, "ts", 0, 50)
        assert start == Offset(f1, len(b1))
        with Consumer(root, "ts", start=format_offsets({("ts", 0): start})) as c:
            _quiet(c, 0.3)
            _append(root, "ts", f1, encode_block([b"a3"], None, [60], first_index=3) + encode_seal(4))
            assert _values(c, 3) == [b"a3", b"b0", b"b1"]
        assert offset_for_timestamp(path, "ts", 0, 50) == Offset(f1, len(b1))  # a3 (60 >= 50)
        assert offset_for_timestamp(path, "ts", 0, 80) == Offset(f2, 0)  # f1 sealed: on to f2
    finally:
        path.close()


# -- the copy daemon reads through the process's one poller and the one read path -----------------


def test_copy_reader_uses_the_one_length_poller_and_read_path(root, caches):
    from pyspark_acs.read.cachepath import CachedReadPath
    from pyspark_acs.server.copy import reader

    assert not hasattr(reader, "LengthPoller") or reader.LengthPoller is LengthPoller
    assert not hasattr(reader, "ABANDONED_AFTER_S")

    class _IO:  # the parts of ClusterIO SourceFiles uses
        def __init__(self) -> None:
            self.store = DurableStore(root)
            self.data = CacheClient(caches["data_cache"])
            self.meta_client = CacheClient(caches["metadata_cache"])

        def uri(self, rel: str) -> str:
            return self.store.uri(rel)

    io = _IO()
    files = reader.SourceFiles(io, interval=0.05)
    try:
        assert isinstance(files.path, CachedReadPath)
        assert files.path.poller is LengthPoller.shared(io.meta_client.endpoints)
        consumer_path = CachedReadPath(DurableStore(root), metadata_cache=caches["metadata_cache"])
        assert files.path.poller is consumer_path.poller  # one poller per process and metadata cache
        consumer_path.close()
        assert not [t for t in threading.enumerate() if t.name == "acs-copy-poller"]
    finally:
        files.stop()
        io.data.close()
        io.meta_client.close()


def test_copy_reader_waits_for_a_read_the_path_cut_short_without_searching_the_store(root, caches):
    """Left alone last session, fixed now: when the read path postponed the bytes of a delta
    (Algorithm 1: the cache lags and the bytes are younger than maxDelay) the copy reader saw
    no complete block and searched the range for a recovery seal, a read "without waiting"
    that took them from the durable store early, every round. A short read is no torn block
    (the rule is :class:`~pyspark_acs.read.positions.BlockRead`'s ``short``, for the Consumer
    too): the reader sends nothing and waits; once the bytes are readable it sends them."""
    from collections import deque

    from pyspark_acs.server.copy import reader
    from pyspark_acs.server.copy.cluster import CACHE, OpKey
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions

    class _IO:  # the parts of ClusterIO SourceFiles and CopyOperation use
        def __init__(self) -> None:
            self.name = "A"
            self.store = DurableStore(root)
            self.data = CacheClient(caches["data_cache"])
            self.meta_client = CacheClient(caches["metadata_cache"])

        def uri(self, rel: str) -> str:
            return self.store.uri(rel)

    class _Session:
        def __init__(self) -> None:
            self.sent: list = []

        def send(self, request) -> None:
            self.sent.append((request.start, bytes(request.data), request.sealed))

    DurableStore(root).create_stream("cutshort", 1)
    name = _name(0)
    data = _block(0, 5) + encode_seal(5)
    _append(root, "cutshort", name, data)
    io = _IO()
    files = reader.SourceFiles(io, interval=0.05)
    op = reader.CopyOperation(OpKey("cutshort", 0, name, CACHE, "B"), 1, io, files, lambda child: None,
                              CopyDaemonOptions(), CopyMetrics("A"), "test")
    real_read = files.path.read
    asked: list = []

    def read(rel, start, end, postpone=True, **kw):
        got = real_read(rel, start, end, postpone=postpone, **kw)
        asked.append((postpone, len(got)))
        return got

    files.path.read = read  # the bytes are durable only, the cache has none: Algorithm 1 postpones
    session = _Session()
    began, rounds = time.monotonic(), 0
    try:
        while not session.sent:  # the operation's rounds, until maxDelay lets the bytes through
            assert time.monotonic() - began < WAIT_S, "the bytes were never sent"
            rounds += 1
            result = op._send_delta(session, 0, len(data), 0, len(data), deque())
            time.sleep(0.05)
        assert result == (len(data), True) and session.sent == [(0, data, True)]
        assert rounds > 3 and time.monotonic() - began >= files.path.max_delay * 0.9
        assert all(postpone for postpone, _ in asked), asked  # nothing read "without waiting"
        assert [n for _, n in asked][:-1] == [0] * (len(asked) - 1), asked  # postponed, then read once
    finally:
        files.stop()
        io.data.close()
        io.meta_client.close()


# -- review finding F3: a seal is proven by a header walk, never by the last bytes alone ----------


def test_message_ending_in_seal_bytes_does_not_finish_its_file(root):
    """A message may end in bytes shaped exactly like a seal (a user sent them). A reader
    restarted right after that message's block, and the Spark planner, took the file for
    sealed there and moved on to the next file (here one that already exists, as at a
    destination where a newer file's copy arrived while this one's is still in flight),
    skipping the rest of this one. Now a seal is proven by walking block headers."""
    DurableStore(root).create_stream("f3", 1, copied_from="A")  # files copied side by side
    x, y = _name(0), _name(1)
    forged = b"payload-" + encode_seal(7)  # its last 48 bytes are a valid seal
    head = _block(0, 1, "a") + encode_block([forged], None, [1], first_index=1)
    _append(root, "f3", x, head)
    _append(root, "f3", y, _block(0, 1, "b") + encode_seal(1))
    at = Offset(x, len(head))
    assert head.endswith(encode_seal(7))
    planner = _Planner(parse_source_options({"root": root, "stream": "f3"}))
    assert planner.latest([("f3", 0)], {("f3", 0): at})[("f3", 0)] == at  # x is not sealed: stop there
    with Consumer(root, "f3", start={"f3": {"0": {"file": x, "length": len(head)}}}) as c:
        _quiet(c, 0.3)  # x may still grow: never left
        _append(root, "f3", x, _block(2, 1, "a") + encode_seal(3))  # the rest of x, then its real seal
        assert _values(c, 2) == [b"a2", b"b0"]



class _Lagging:
    """The durable read path, with some files seen only up to a length (a cache or a copy
    destination that has a file's head while a newer file already arrived)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.store = inner.store
        self.held: dict = {}  # rel -> the length seen

    def lengths(self, rels):
        got = self.inner.lengths(rels)
        return {r: n if n is None or r not in self.held else min(n, self.held[r]) for r, n in got.items()}

    def durable_length(self, rel):
        return self.inner.durable_length(rel)

    def read(self, rel, start, end, **kw):
        return self.inner.read(rel, start, min(end, self.held.get(rel, end)))

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


def test_restart_after_a_producer_message_ending_in_seal_bytes_reads_the_rest_of_its_file(root):
    """F3 end to end with a real Producer and Consumer. A user's message ends in the bytes of a
    valid seal; it is the last message of its block, so a position saved after it is right
    after seal-shaped bytes. The old rule (parse the last 48 bytes) took the file for sealed
    there: a Consumer restarted from the saved offsets that saw the next file before the rest
    of this one (a lagging cache, a copy destination) went on to the next file and skipped
    the rest of this one, and the planner's boundary cache reported the file sealed."""
    from pyspark_acs.format.block import HEADER_SIZE, parse_header
    from pyspark_acs.read.positions import BoundaryCache, ends_with_seal, latest_offset, seal_behind
    from pyspark_acs.read.readpath import DurableReadPath

    seal = encode_seal(7)
    forged = b"user-bytes-" + seal
    with Producer(root, "f3p") as p1:
        for value in (b"a0", b"a1", forged):
            p1.send(value)
        p1.flush()
        with Consumer(root, "f3p") as c:
            assert _values(c, 3) == [b"a0", b"a1", forged]
            saved = c.offsets()
        x, at = saved["f3p"]["0"]["file"], saved["f3p"]["0"]["length"]
        rel = f"{shard_dir('f3p', 0)}/{x}"
        with open(os.path.join(root, rel), "rb") as f:
            head = f.read()
        assert len(head) == at  # the position is the end of the forged message's block ...
        assert head.endswith(seal) and parse_header(head[-HEADER_SIZE:]).sealed  # ... and a "seal" to the old rule

        path = DurableReadPath(DurableStore(root))
        try:
            assert seal_behind(path, rel, at) is None and not ends_with_seal(path, rel, at)
            boundaries = BoundaryCache()  # the Spark planner's
            assert boundaries.boundary(path, rel, at, at) == (at, False)
            reads = path.stats()["durable_reads"]
            assert boundaries.boundary(path, rel, at, at) == (at, False)
            assert path.stats()["durable_reads"] == reads  # settled once: no walk from 0 at every trigger
            assert latest_offset(path, "f3p", 0) == Offset(x, at)
        finally:
            path.close()

        p1.send(b"a3")
        p1.send(b"a4")
    # p1 closed: x sealed after a4; the next file, with more messages:
    with Producer(root, "f3p") as p2:
        p2.send(b"b0")
        p2.send(b"b1")
        p2.flush()
        y = p2.current_files()[0]
    assert y > x
    lagging = _Lagging(DurableReadPath(DurableStore(root)))
    lagging.held[rel] = at  # this reader has x only up to the saved position, y already whole
    with Consumer(root, "f3p", start=saved, read_path=lagging) as c:
        _quiet(c, 0.3)  # old rule: [b"b0", b"b1"] here -- a3, a4 skipped
        lagging.held.clear()  # the rest of x arrives
        assert _values(c, 4) == [b"a3", b"a4", b"b0", b"b1"]
        assert c.offsets()["f3p"]["0"]["file"] == y


class _CountingReads:
    """The durable read path, counting the bytes asked of it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.store = inner.store
        self.asked = 0

    def lengths(self, rels):
        return self.inner.lengths(rels)

    def read(self, rel, start, end, **kw):
        self.asked += end - start
        return self.inner.read(rel, start, end)

    def close(self):
        self.inner.close()


def test_planner_walks_new_large_blocks_by_their_headers_alone(root):
    """A streaming planner finds each trigger's end (the boundary walk) and whether the range
    holds a message (carries_messages) from block headers; a new block larger than a walk
    window's quarter is passed by reading its header, not its body (the walk read a 256 KiB
    window from the start, twice per shard and trigger: ~55 % of a trigger's planning time
    against live caches)."""
    from pyspark_acs.format.block import HEADER_SIZE
    from pyspark_acs.read.positions import BoundaryCache, carries_messages, shard_extent
    from pyspark_acs.read.readpath import DurableReadPath

    DurableStore(root).create_stream("big", 1)
    name = _name(0)
    big = [bytes([65 + i % 26]) * 1000 for i in range(150)]  # ~150 KB blocks
    b1 = encode_block(big, None, list(range(150)), first_index=0)
    b2 = encode_block(big, None, list(range(150)), first_index=150)
    _append(root, "big", name, b1 + b2)
    path = _CountingReads(DurableReadPath(DurableStore(root)))
    try:
        extent = shard_extent(path, "big", 0, Offset(name, 0))
        end = extent.latest(BoundaryCache(), path, Offset(name, 0))
        assert end == Offset(name, len(b1) + len(b2))
        assert path.asked <= 3 * HEADER_SIZE  # two headers and the look past the last block
        path.asked = 0
        assert carries_messages(path, extent, Offset(name, len(b1)), end)
        assert path.asked == HEADER_SIZE
    finally:
        path.close()


def test_planner_does_not_read_again_the_headers_its_boundary_walk_just_read(root):
    """latestOffset walks to the readable end (BoundaryCache) and then asks whether the range
    holds a message (carries_messages): handed the same BoundaryCache, that answer comes from
    the walk (it passed a block of messages within the range), with no header read of its own
    -- one read less per shard and trigger, on the path of a new batch. A range the walk did
    not cover is still read."""
    from pyspark_acs.format.block import HEADER_SIZE
    from pyspark_acs.read.positions import BoundaryCache, carries_messages, shard_extent
    from pyspark_acs.read.readpath import DurableReadPath

    DurableStore(root).create_stream("walked", 1)
    name = _name(0)
    b1 = encode_block([b"a" * 100] * 3, None, [1, 2, 3], first_index=0)
    b2 = encode_block([b"b" * 100] * 3, None, [4, 5, 6], first_index=3)
    _append(root, "walked", name, b1)
    path = _CountingReads(DurableReadPath(DurableStore(root)))
    boundaries = BoundaryCache()
    try:
        extent = shard_extent(path, "walked", 0, Offset(name, 0))
        assert extent.latest(boundaries, path, Offset(name, 0)) == Offset(name, len(b1))
        path.asked = 0
        assert carries_messages(path, extent, Offset(name, 0), Offset(name, len(b1)), boundaries)
        assert path.asked == 0
        _append(root, "walked", name, b2)  # the next trigger: the walk resumes after b1
        extent = shard_extent(path, "walked", 0, Offset(name, len(b1)))
        end = extent.latest(boundaries, path, Offset(name, len(b1)))
        assert end == Offset(name, len(b1) + len(b2))
        path.asked = 0
        assert carries_messages(path, extent, Offset(name, len(b1)), end, boundaries)
        assert path.asked == 0
        # b1 lies before the last walk's span: the planner's cache says nothing, the header is read
        assert carries_messages(path, extent, Offset(name, 0), Offset(name, len(b1)), boundaries)
        assert path.asked == HEADER_SIZE
    finally:
        path.close()


def test_the_store_hold_and_the_metadata_retry_run_on_the_paths_clock(root):
    """A metadata cache that refuses connections trips the path's store hold; the hold, and the
    retry of the metadata cache after it, end when the path's clock passes them, not before."""
    clock = FakeClock()
    path = CachedReadPath(DurableStore(root), metadata_cache=f"127.0.0.1:{free_port()}", shared_poller=False,
                          clock=clock)
    try:
        assert path.lengths(["s/00000/x.acs"]) == {"s/00000/x.acs": None}
        assert (path.stats()["metadata_fallbacks"], path.stats()["store_holds"]) == (1, 1)
        shortest = STORE_HOLD_MIN_S * (1 - STORE_HOLD_JITTER)
        clock.advance(shortest * 0.9)
        assert path.holding()
        path.lengths(["s/00000/x.acs"])  # from the store alone: the cache is not asked
        assert path.stats()["metadata_fallbacks"] == 1
        clock.advance(STORE_HOLD_MIN_S * (1 + STORE_HOLD_JITTER) - shortest * 0.9 + 0.01)  # past the longest
        assert not path.holding()
        path.lengths(["s/00000/x.acs"])  # asked again: it fails again, a second hold
        assert (path.stats()["metadata_fallbacks"], path.stats()["store_holds"]) == (2, 2)
        assert path.holding()
    finally:
        path.close()


# -- overload: caches that time out are waited for, then failed over ------------------------------


@contextlib.contextmanager
def _stopped(root, caches, deployment, role: str):
    """A path on a fake clock over a file of one message, its length known, and the cache
    replica of ``role`` stopped (SIGSTOP: its calls only time out, as a loaded one's) until the
    block ends. Yields ``(path, clock, rel, length)``."""
    with Producer(root, f"slow{role}", shards=1, **caches) as p:
        p.send(b"a" * 100)
        p.flush(timeout=WAIT_S)
        rel = f"{shard_dir(f'slow{role}', 0)}/{p.current_files()[0]}"
    clock = FakeClock()
    path = CachedReadPath(DurableStore(root), shared_poller=False, clock=clock, **caches)
    server = deployment.server(role, 0)
    try:
        length = path.lengths([rel])[rel]
        assert length > 0
        stop_process(server.pid)
        try:
            yield path, clock, rel, length
        finally:
            os.kill(server.pid, signal.SIGCONT)
    finally:
        path.close()


def test_a_reader_waits_for_a_data_cache_that_times_out_then_reads_the_store(root, caches, deployment):
    """A data replica that only times out does not send the reader to the store at once: its
    read stops short and is asked again; only after the patience does the reader hold to the
    store."""
    with _stopped(root, caches, deployment, "data") as (path, clock, rel, length):
        assert path.read(rel, 0, length) == b""  # waits for the cache
        assert path.lengths([rel]) == {rel: length}  # the metadata cache answers meanwhile
        assert path.read(rel, 0, length) == b""  # its replica marked down after a timeout: still a wait
        stats = path.stats()
        assert (stats["cache_waits"], stats["store_holds"], stats["durable_bytes"]) == (2, 0, 0), stats
        clock.advance(OVERLOAD_PATIENCE_S)
        # The metadata cache's answers do not restart the data cache's patience.
        assert path.lengths([rel]) == {rel: length}
        got = path.read(rel, 0, length)  # still timing out past the patience: the store
        assert len(got) == length and path.holding()
        assert path.stats()["store_holds"] == 1


def test_a_reader_waits_for_a_metadata_cache_that_times_out_with_the_lengths_it_knows(root, caches, deployment):
    with _stopped(root, caches, deployment, "metadata") as (path, clock, rel, known):
        assert path.lengths([rel]) == {rel: known}  # timed out: the known length stands
        assert (path.stats()["cache_waits"], path.stats()["store_holds"]) == (1, 0)
        clock.advance(SLOW_RETRY_MIN_S / 2)
        assert path.lengths([rel]) == {rel: known}  # not asked again so soon
        assert path.stats()["cache_waits"] == 1
        clock.advance(OVERLOAD_PATIENCE_S)
        path.lengths([rel])  # timing out past the patience: the store alone
        assert path.stats()["store_holds"] == 1 and path.holding()


@pytest.mark.parametrize("cache_moves", [True, False])
def test_a_cache_that_trails_but_grows_is_read_around_not_held(root, caches, cache_moves):
    """Algorithm 1: bytes the store holds past the cache length for more than maxDelay are read
    from the store. While the cache length still moves, the cache is loaded, not lost: only that
    tail comes from the store and the reader stays on the caches (a hold of every read, taken by
    each of many readers of a loaded cache at once, was most of a store-read storm). A cache
    length that stood still for maxDelay holds the reader to the store, as before."""
    with Producer(root, f"trail{cache_moves}", shards=1) as p:  # durable only: the "cache" is set below
        p.send(b"a" * 100)
        p.flush(timeout=WAIT_S)
        rel = f"{shard_dir(f'trail{cache_moves}', 0)}/{p.current_files()[0]}"
        first = DurableStore(root).lengths([rel])[rel]
        p.send(b"b" * 100)
        p.flush(timeout=WAIT_S)
        end = DurableStore(root).lengths([rel])[rel]
    clock = FakeClock()
    path = CachedReadPath(DurableStore(root), shared_poller=False, clock=clock, **caches)
    try:
        path._published[rel] = (first, end)  # the cache trails the store by the second block
        assert path.read(rel, first, end) == b""  # postponed: the cache may catch up
        clock.advance(path.max_delay + 0.01)
        start = first
        if cache_moves:
            start = first + 1  # the cache length moved meanwhile (a byte: what the read asks for)
            path._published[rel] = (start, end)
        got = path.read(rel, start, end)
        assert len(got) == end - start  # the late tail, from the store
        assert path.holding() is (not cache_moves)
        assert path.stats()["store_holds"] == (0 if cache_moves else 1)
    finally:
        path.close()


def test_a_read_that_may_not_wait_takes_its_bytes_from_the_store_without_a_hold(root, caches, deployment):
    """A joining reader's look for a seal (and a durable copy) reads with ``postpone=False``:
    when the data cache times out it gets just those bytes from the store -- it cannot wait --
    but the path stays on the caches within the patience (a hold of every read at the first
    expired deadline sent each of many readers joining a loaded cache to the store)."""
    with _stopped(root, caches, deployment, "data") as (path, clock, rel, length):
        got = path.read(rel, 0, length, postpone=False)
        assert len(got) == length and not path.holding()
        stats = path.stats()
        assert (stats["store_holds"], stats["durable_bytes"]) == (0, length), stats
        clock.advance(OVERLOAD_PATIENCE_S)
        assert len(path.read(rel, 0, length, postpone=False)) == length
        assert path.holding() and path.stats()["store_holds"] == 1  # past the patience: a hold
