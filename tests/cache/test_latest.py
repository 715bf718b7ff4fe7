"""Joining at latest by the boundary a writer marks in the data cache (docs/cache.md, "Bytes"),
against real cache-server processes: a Producer's appends mark their ends and a copy's do not;
a Follow stream asked for a file at latest is answered with that boundary and pushed from just
before it; a replica without one, a stalled one and a reader that follows the file from a
position meanwhile each leave the reader to join by the published lengths, at the right place."""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import threading
import time
import urllib.request
from typing import List, Optional, Tuple

import pytest

from pyspark_acs.cache.chunks import ChunkWriter, boundary_key, chunk_key, file_id
from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.feed import ChunkFeed, pick_replica
from pyspark_acs.cache.metadata import MetadataCache
from pyspark_acs.cache.push import FollowStream
from pyspark_acs.format.block import RECOVERY_SEAL_SIZE, encode_block
from pyspark_acs.format.names import file_name, shard_dir
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.file import CacheMirror
from pyspark_acs.write.producer import Producer

from tests.helpers import stop_process, wait_until

WAIT_S = 30


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    with LocalDeployment(tmp_path_factory.mktemp("latest"), data_replicas=3, metadata_replicas=3,
                         capacity="64MiB") as d:
        yield d


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "store")


def caches(dep: LocalDeployment) -> dict:
    return {"data_cache": dep.data_endpoints, "metadata_cache": dep.metadata_endpoints}


def boundary(dep: LocalDeployment, uri: str) -> Optional[int]:
    """The boundary the data cache holds for ``uri`` (its key's version), None without one."""
    with CacheClient(dep.data_endpoints) as data:
        entry = data.get([boundary_key(file_id(uri))], consistent=True)[0]
    return None if entry is None else entry.version


_CALLS = re.compile(r'^acs_cache_request_seconds_count\{[^}]*method="(\w+)"[^}]*\} (\S+)$', re.M)


def counts(dep: LocalDeployment, role: str = "data") -> dict:
    """The ``role`` servers' latest-follow counters and the calls they served, by method."""
    with CacheClient(",".join(dep.endpoints(role))) as c:
        stats = c.stats()
    out = {k: sum(v.get(k, 0) for v in stats.values() if "error" not in v)
           for k in ("follow_latest_total", "follow_latest_unknown_total")}
    for server in dep.servers[role]:
        text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        for method, value in _CALLS.findall(text):
            out[method] = out.get(method, 0.0) + float(value)
    return out


def newest(root: str, stream: str) -> Tuple[str, str]:
    store = DurableStore(root)
    rel = f"{shard_dir(stream, 0)}/{store.list_files(stream, 0)[-1]}"
    return rel, store.uri(rel)


def values(c: Consumer, n: int, timeout: float = WAIT_S) -> List[bytes]:
    got: List[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        for b in c.batches(timeout=0.2):
            got.extend(b.column("value").to_pylist())
            if len(got) >= n:
                break
    return got


def test_a_file_writer_marks_each_append_end_and_a_copy_marks_none(dep, root):
    with Producer(root, "w", shards=1, **caches(dep)) as p:
        for i in range(3):
            p.send_many([b"m%d" % i] * 5)
            p.flush(timeout=WAIT_S)
            rel, uri = newest(root, "w")
            assert boundary(dep, uri) == DurableStore(root).lengths([rel])[rel]
    uri = f"file:///copy/{time.time_ns()}.acs"
    with CacheClient(dep.data_endpoints) as data:
        CacheMirror(data, uri, 0, b"").append(b"x" * 5000)  # a copy's mirror: appends may end inside a block
    assert boundary(dep, uri) is None


def test_an_append_put_in_several_requests_carries_its_boundary_last(dep):
    uri = f"file:///big/{time.time_ns()}.acs"
    with CacheClient(dep.data_endpoints) as data:
        writer = ChunkWriter(data, uri, boundaries=True)
        end = writer.append(b"y" * (9 * 1024 * 1024 + 100))  # more than one put request per replica
    assert boundary(dep, uri) == end == 9 * 1024 * 1024 + 100


def test_follow_at_latest_is_answered_with_the_boundary_and_pushed_from_before_it(dep):
    marked, bare = f"file:///l/{time.time_ns()}-a.acs", f"file:///l/{time.time_ns()}-b.acs"
    data = bytes(range(256)) * 40  # 10,240 bytes
    with CacheClient(dep.data_endpoints) as writer_client:
        ChunkWriter(writer_client, marked, boundaries=True).append(data)
        ChunkWriter(writer_client, bare).append(data)
    before = counts(dep)
    answers: List[Tuple[bytes, Optional[int]]] = []
    runs: List[Tuple[bytes, int, bytes]] = []
    client = CacheClient(dep.data_endpoints, name="data cache")
    stream = FollowStream(client, client.endpoints[0], lambda fid, start, run: runs.append((fid, start, run)),
                          on_latest=lambda fid, end: answers.append((fid, end)))
    try:
        stream.follow_latest(file_id(marked), 100)
        stream.follow_latest(file_id(bare), 100)
        wait_until(lambda: len(answers) == 2 and runs, 10, "the answers and the first push")
        assert dict(answers) == {file_id(marked): len(data), file_id(bare): None}
        assert runs[0] == (file_id(marked), len(data) - 100, data[-100:])
        assert stream.following() == 1  # the file without a boundary is not followed
        ChunkWriter(writer_client := CacheClient(dep.data_endpoints), marked, len(data),
                    data[len(data) // 4096 * 4096:], boundaries=True).append(b"more")
        writer_client.close()
        wait_until(lambda: b"".join(r[2] for r in runs) == data[-100:] + b"more", 10, "the next append")
    finally:
        stream.close()
        client.close()
    after = counts(dep)
    assert after["follow_latest_total"] - before["follow_latest_total"] == 1
    assert after["follow_latest_unknown_total"] - before["follow_latest_unknown_total"] == 1


def test_the_feed_leaves_a_file_without_a_boundary_or_whose_replica_is_silent(dep):
    uri = f"file:///f/{time.time_ns()}.acs"
    with CacheClient(dep.data_endpoints) as data:
        ChunkWriter(data, uri).append(b"z" * 3000)  # no boundary
    feed = ChunkFeed(dep.endpoints("data"))
    try:
        assert feed.follow_latest(uri, 1, RECOVERY_SEAL_SIZE) is None
        assert not feed.follows(uri)
        marked = f"file:///f/{time.time_ns()}-m.acs"
        with CacheClient(dep.data_endpoints) as data:
            ChunkWriter(data, marked, boundaries=True).append(b"z" * 3000)
        endpoint = pick_replica(feed.client.replicas_for(chunk_key(marked, 0)), marked)
        pid = dep.server("data", dep.endpoints("data").index(endpoint)).pid
        stop_process(pid)
        try:
            started = time.monotonic()
            assert feed.follow_latest(marked, 1, RECOVERY_SEAL_SIZE, timeout=0.5) is None
            assert time.monotonic() - started < 5
            assert not feed.follows(marked)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert feed.follow_latest(marked, 1, RECOVERY_SEAL_SIZE) == 3000
        wait_until(lambda: feed.read(marked, 3000 - RECOVERY_SEAL_SIZE, 3000) == b"z" * RECOVERY_SEAL_SIZE, 10,
                   "the bytes before the boundary")
    finally:
        feed.close()


def test_a_reader_following_from_a_position_takes_over_a_file_asked_for_at_latest(dep):
    uri = f"file:///p/{time.time_ns()}.acs"
    data = b"q" * 5000
    with CacheClient(dep.data_endpoints) as client:
        ChunkWriter(client, uri, boundaries=True).append(data)
    feed = ChunkFeed(dep.endpoints("data"))
    endpoint = pick_replica(feed.client.replicas_for(chunk_key(uri, 0)), uri)
    pid = dep.server("data", dep.endpoints("data").index(endpoint)).pid
    got: List[Optional[int]] = []
    stop_process(pid)  # the answer waits
    try:
        waiter = threading.Thread(target=lambda: got.append(feed.follow_latest(uri, 1, RECOVERY_SEAL_SIZE, 20)))
        waiter.start()
        wait_until(lambda: feed.follows(uri), 5, "the file asked for at latest")
        feed.follow(uri, 2, 1000)  # another reader of this process, from a position
        waiter.join(5)
        assert got == [None]  # the first joins by lengths
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        wait_until(lambda: feed.read(uri, 1000, 5000) == data[1000:], 20, "the bytes from the position")
        assert feed.follows(uri)
    finally:
        feed.close()


def test_a_consumer_joins_at_the_boundary_asking_the_metadata_cache_nothing(dep, root):
    with Producer(root, "c", shards=1, **caches(dep)) as p:
        p.send_many([b"before"] * 50)
        p.flush(timeout=WAIT_S)
        rel, uri = newest(root, "c")
        data0 = counts(dep)
        with Consumer(root, "c", start="latest", **caches(dep)) as c:
            assert c.offsets()["c"]["0"]["length"] == DurableStore(root).lengths([rel])[rel]
            p.send(b"after")
            p.flush(timeout=WAIT_S)
            assert values(c, 1) == [b"after"]
            assert c.stats()["durable_bytes"] == 0
            # No consistent read, no Health call: its metadata client never connected (the
            # producer's, in this process too, is another client).
            assert not c.path.poller.meta.client._connected
    data1 = counts(dep)
    assert data1["follow_latest_total"] - data0["follow_latest_total"] == 1
    assert data1.get("Get", 0) == data0.get("Get", 0)


def test_without_a_boundary_a_consumer_joins_at_the_published_length(dep, root):
    with Producer(root, "n", shards=1, **caches(dep)) as p:
        p.send_many([b"before"] * 20)
        p.flush(timeout=WAIT_S)
        rel, uri = newest(root, "n")
        with CacheClient(dep.data_endpoints) as data:  # as a restarted replica, or one past its TTL
            data.delete([boundary_key(file_id(uri))])
        before = counts(dep)
        with Consumer(root, "n", start="latest", **caches(dep)) as c:
            assert c.offsets()["n"]["0"]["length"] == DurableStore(root).lengths([rel])[rel]
            p.send(b"after")
            p.flush(timeout=WAIT_S)
            assert values(c, 1) == [b"after"]
    assert counts(dep)["follow_latest_unknown_total"] - before["follow_latest_unknown_total"] >= 1


def test_a_boundary_behind_the_store_reads_on_from_it_in_order(dep, root):
    """A block durable but never mirrored (its chunk put was lost) lies past the boundary: the
    reader joins at the boundary, and reads that block from the store before the next ones."""
    store = DurableStore(root)
    store.create_stream("b", 1)
    name = file_name(dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), "w")
    rel = f"{shard_dir('b', 0)}/{name}"
    uri = store.uri(rel)
    first = encode_block([b"m0", b"m1"], first_index=0)
    lost = encode_block([b"lost-2", b"lost-3"], first_index=2)
    with open(os.path.join(root, rel), "ab") as f:
        f.write(first + lost)
    with CacheClient(dep.data_endpoints) as data, CacheClient(dep.metadata_endpoints) as meta:
        ChunkWriter(data, uri, boundaries=True).append(first)  # the put of `lost` never came
        MetadataCache(meta).publish(uri, cache_length=len(first), durable_length=len(first) + len(lost))
    with Consumer(root, "b", start="latest", **caches(dep)) as c:
        assert c.offsets()["b"]["0"] == {"file": name, "length": len(first)}
        assert values(c, 2) == [b"lost-2", b"lost-3"]
        assert c.stats()["durable_bytes"] >= len(lost)


# -- from the hostile review of the boundary join: joins under a running producer, a stopped
# replica, joins of one process at once ----------------------------------------------------------


@pytest.mark.parametrize("acknowledge", ["published"])
def test_joins_at_latest_under_a_running_producer_are_gapless(dep, tmp_path, acknowledge):
    root = str(tmp_path / "store")
    stop = threading.Event()
    errors: List[BaseException] = []
    with Producer(root, "s", shards=1, roll_bytes=6000, acknowledge=acknowledge, max_batch_delay=0.001,
                  **caches(dep)) as p:
        def run():
            i = 0
            try:
                while not stop.is_set():
                    p.send_many([b"%08d" % (i + k) for k in range(3)])
                    i += 3
                    if i % 9 == 0:
                        p.flush(timeout=WAIT_S)
                    time.sleep(0.002)
            except BaseException as exc:  # pragma: no cover
                errors.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        before = latest_joins(dep)
        try:
            time.sleep(0.5)
            for _ in range(12):
                with Consumer(root, "s", start="latest", **caches(dep)) as c:
                    got = read_n(c, 40)
                assert len(got) == 40, got
                assert got == list(range(got[0], got[0] + 40)), got
                time.sleep(0.05)
        finally:
            stop.set()
            t.join(10)
    assert not errors
    assert latest_joins(dep) - before >= 10  # the joins went by the boundary


def test_a_stopped_data_replica_does_not_slow_a_join_at_latest_more_than_before(dep, tmp_path):
    """A Consumer at latest with one of three data replicas SIGSTOPped: a shard whose feed
    replica is the stopped one asks the next replica after LATEST_ANSWER_S (1 s), and later
    shards pass the stopped one over (a join by lengths spent about 1 s per such shard; the
    first form of the boundary join waited 2 s for the answer, then 1 s more: review)."""
    import os
    import signal

    from pyspark_acs.cache.chunks import chunk_key
    from pyspark_acs.cache.feed import pick_replica
    from pyspark_acs.format.names import shard_dir
    from tests.helpers import stop_process

    root = str(tmp_path / "st")
    shards = 6
    with Producer(root, "st", shards=shards, **caches(dep)) as p:
        p.send_many([b"%08d" % i for i in range(60)])
        p.flush(timeout=WAIT_S)
        store = DurableStore(root)
        with CacheClient(dep.data_endpoints) as probe:
            uris = [store.uri(f"{shard_dir('st', s)}/{store.list_files('st', s)[-1]}")
                    for s in range(shards) if store.list_files("st", s)]
            picked = [pick_replica(probe.replicas_for(chunk_key(u, 0)), u) for u in uris]
        endpoints = dep.endpoints("data")
        victim = max(set(picked), key=picked.count)
        hit = picked.count(victim)
        pid = dep.server("data", endpoints.index(victim)).pid
        stop_process(pid)
        try:
            started = time.monotonic()
            with Consumer(root, "st", start="latest", **caches(dep)) as c:
                offsets = c.offsets()
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        lengths = store.lengths([f"{shard_dir('st', s)}/{store.list_files('st', s)[-1]}" for s in range(shards)])
    assert sorted(o["length"] for o in offsets["st"].values()) == sorted(lengths.values())
    assert took < 1.6 * hit + 1.0, (hit, took)


@pytest.mark.parametrize("stall", [0.0, 2.3])
def test_consumers_of_one_process_joining_one_file_at_once_are_gapless(dep, tmp_path, stall):
    """Four Consumers of this process (one shared feed) join the same file at latest at
    once, while a producer writes; with ``stall`` the feed's replica is SIGSTOPped for that
    long during the joins (the answer comes late, or after follow_latest gave up)."""
    import os
    import signal

    from pyspark_acs.cache.chunks import chunk_key
    from pyspark_acs.cache.feed import pick_replica
    from pyspark_acs.format.names import shard_dir
    from tests.helpers import stop_process

    root = str(tmp_path / "cc")
    stop = threading.Event()
    with Producer(root, "cc", shards=1, roll_bytes=20000, max_batch_delay=0.001, **caches(dep)) as p:
        def run():
            i = 0
            while not stop.is_set():
                p.send_many([b"%08d" % (i + k) for k in range(3)])
                i += 3
                p.flush(timeout=WAIT_S)
                time.sleep(0.003)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            time.sleep(0.4)
            for _round in range(3):
                store = DurableStore(root)
                uri = store.uri(f"{shard_dir('cc', 0)}/{store.list_files('cc', 0)[-1]}")
                with CacheClient(dep.data_endpoints) as probe:
                    victim = pick_replica(probe.replicas_for(chunk_key(uri, 0)), uri)
                pid = dep.server("data", dep.endpoints("data").index(victim)).pid
                results: List[object] = [None] * 4
                go = threading.Barrier(5)

                def join(k):
                    go.wait()
                    try:
                        with Consumer(root, "cc", start="latest", **caches(dep)) as c:
                            results[k] = read_n(c, 60)
                    except BaseException as exc:
                        results[k] = exc

                threads = [threading.Thread(target=join, args=(k,)) for k in range(4)]
                for th in threads:
                    th.start()
                if stall:
                    stop_process(pid)
                go.wait()
                if stall:
                    time.sleep(stall)
                    os.kill(pid, signal.SIGCONT)
                for th in threads:
                    th.join(60)
                for got in results:
                    assert isinstance(got, list) and len(got) == 60, got
                    assert got == list(range(got[0], got[0] + 60)), got
        finally:
            stop.set()
            t.join(10)


def latest_joins(dep) -> int:
    with CacheClient(dep.data_endpoints) as c:
        return sum(v.get("follow_latest_total", 0) for v in c.stats().values() if "error" not in v)


def read_n(c: Consumer, n: int, timeout: float = WAIT_S) -> List[int]:
    got: List[int] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        for b in c.batches(timeout=0.2):
            got.extend(int(v) for v in b.column("value").to_pylist())
            if len(got) >= n:
                break
    return got[:n]
