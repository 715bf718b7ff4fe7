"""Bug 7: a file of A stayed absent in C after B's copy daemon was SIGKILLed and restarted
(chain A -> B -> C, two data and two metadata cache servers per cluster).

The cause: the replicas of a metadata-cache lease key can disagree. A compare-and-set reaches
each replica independently; when two copy writers race for a fresh key (after B's restart A
judges B unhealthy and feeds C itself while the restarted B feeds C too, so A's and B's
operations say hello for the same new file of C at once), each can win one of the two
replicas: a 1-1 split with no majority value. A CAS that reached one replica only (the other
past its deadline) leaves a 1-0 split. The lease then refused every later writer: each acquire
poisoned or replaced the value of ONE replica (refreshing its TTL), never a majority, and gave
up with WriterConflictError. The copy writer takes the lease before it creates the file, so
the file's hello failed for as long as the reader retried: the file never appeared in C.
``MetadataLease.acquire`` now walks every value the replicas hold in each round (each refused
CAS names one) and converges them on the new record.

Both tests use real cache-server processes (two metadata replicas); the second runs real copy
daemons with consumers following in every cluster. Both fail on the code before the fix: the
first with WriterConflictError, the second with the file absent in C.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Dict, List

import pytest

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.metadata import MetadataCache, MetadataLease
from pyspark_acs.errors import CacheError, LeasePoisonedError, WriterConflictError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.storage.store import DurableStore

from tests.helpers import (
    CHAIN, Env, LiveConsumer, check_histories, deployments, produce, source_history,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def caches2(tmp_path_factory):
    """Two data and two metadata cache servers per cluster (the setting of bug 7)."""
    with deployments(tmp_path_factory.mktemp("caches2"), replicas=2) as deps:
        yield deps


def _meta(endpoints: str) -> MetadataCache:
    return MetadataCache(CacheClient(endpoints, deadline=2.0))


def split(endpoints: str, uri: str, holders: Dict[int, str], seconds: float = 30.0) -> None:
    """Leave the lease of ``uri`` as a CAS race leaves it: replica ``i`` holds a live record of
    writer ``holders[i]`` (each written through a client that knows that replica only)."""
    replicas = endpoints.split(",")
    for index, writer in holders.items():
        meta = _meta(replicas[index])
        try:
            MetadataLease(meta, uri, writer, f"{writer} (test)", seconds=seconds).acquire(timeout=5)
        finally:
            meta.client.close()


@pytest.mark.parametrize("holders", [{0: "new-writer"}, {0: "old-writer"}, {0: "writer-a", 1: "writer-b"}],
                         ids=["one-replica-has-our-own", "one-replica-has-a-live-holder", "one-one-split"])
def test_a_split_lease_key_is_taken_over(caches2, holders):
    meta = _meta(caches2["A"].metadata_endpoints)
    uri = f"file:///split/{'-'.join(holders.values())}/{time.monotonic_ns()}#durable"
    try:
        split(caches2["A"].metadata_endpoints, uri, holders)
        lease = MetadataLease(meta, uri, "new-writer", "the new writer", seconds=1.5)
        started = time.monotonic()
        lease.acquire(timeout=4.5)  # WriterConflictError before the fix, however long one waits
        assert time.monotonic() - started < 4.5
        lease.check()  # a majority holds our record: renewals work
        assert meta.client.get([lease.key], consistent=True)[0].value == lease._raw
    finally:
        meta.client.close()


def test_two_writers_racing_for_fresh_keys_never_wedge_them(caches2):
    """Two writers acquire the same fresh key at once, 20 times: one of them always gets the
    lease (before the fix, a few keys in 30 ended with both refused, for good), and when
    both got it in turn the first one is poisoned. Short leases: a loser waits one out."""
    metas = [_meta(caches2["A"].metadata_endpoints) for _ in range(2)]
    wedged: List[str] = []
    try:
        for i in range(20):
            uri = f"file:///race/{os.getpid()}/{time.monotonic_ns()}/{i}#durable"
            got: Dict[str, object] = {}

            def take(w: int) -> None:
                lease = MetadataLease(metas[w], uri, f"writer-{w}", f"writer {w}", seconds=0.6)
                try:
                    lease.acquire(timeout=3.0)
                    got[f"writer-{w}"] = (time.monotonic(), lease)
                except (WriterConflictError, CacheError) as exc:
                    got[f"writer-{w}"] = exc

            threads = [threading.Thread(target=take, args=(w,)) for w in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            leases = sorted(v for v in got.values() if isinstance(v, tuple))
            if not leases:
                wedged.append(f"key {i}: {got}")
            elif len(leases) == 2:
                with pytest.raises(LeasePoisonedError):
                    leases[0][1].check()
    finally:
        for m in metas:
            m.client.close()
    assert not wedged, wedged


@pytest.mark.parametrize("started", ["later", "long-before"])
def test_a_writer_poisons_a_holder_but_not_a_racer_that_started_after_it(caches2, started):
    """The newest writer wins. A live record of a writer that began to acquire after this one
    (within one lease duration: a race) is left alone, and this writer gives up; a holder that
    began long before is poisoned and taken over, as any takeover."""
    from pyspark_acs.storage.leases import LeaseRecord

    meta = _meta(caches2["A"].metadata_endpoints)
    uri = f"file:///since/{started}/{time.monotonic_ns()}#durable"
    key = b"w:" + uri.encode()
    try:
        since = time.time() + (0.5 if started == "later" else -60.0)
        other = LeaseRecord.new("other-writer", 30.0, since=since).encode()
        assert meta.client.compare_and_set(key, None, other, version=1, ttl=120)[0]
        lease = MetadataLease(meta, uri, "this-writer", "this writer", seconds=1.5)
        if started == "later":
            with pytest.raises(WriterConflictError, match="other-writer"):
                lease.acquire(timeout=1.0)
            assert meta.client.get([key], consistent=True)[0].value == other  # not poisoned
        else:
            lease.acquire(timeout=4.0)
            held = LeaseRecord.decode(meta.client.get([key], consistent=True)[0].value)
            assert held["writer"] == "this-writer" and not held["poisoned"]
    finally:
        meta.client.close()


def test_relay_restart_with_a_split_lease_still_creates_every_file_downstream(tmp_path, caches2):
    """Bug 7 end to end: chain A -> B -> C, 2+2 caches per cluster, consumers following in A, B
    and C from the start. The lease of one file's durable copy in C is split 1-1 between A's
    and B's copy writers (what their racing hellos leave after B's restart); B's daemon is
    SIGKILLed mid-stream and restarted. Every file of A must reach C and every consumer must
    get the whole history. Before the fix that file never appeared in C."""
    env = Env(tmp_path / "env", caches2, CHAIN, f"b7x{os.getpid()}", ("B", "C"))
    live: List[LiveConsumer] = []
    try:
        with env.producer(roll_bytes=20_000, max_block_bytes=4096) as p:
            produce(p, 0, 300)  # files roll over (small blocks), sealed as they do
            store = DurableStore(env.roots["A"])
            shard, files = max(((s, store.list_files(env.stream, s)) for s in range(2)), key=lambda x: len(x[1]))
            store.close()
            assert len(files) >= 2, files
            victim = f"{shard_dir(env.stream, shard)}/{files[1]}"  # a middle file: later ones wait for it
            uri_in_c = DurableStore(env.roots["C"]).uri(victim)
            split(caches2["C"].metadata_endpoints, f"{uri_in_c}#durable",
                  {0: "A_r0of1_racing_op", 1: "B_r0of1_racing_op"})
            for c in ("A", "B", "C"):
                env.start_daemon(c)
            live = [LiveConsumer(env, c) for c in ("A", "B", "C")]
            produce(p, 300, 100, pause=0.002)
            env.kill_daemon("B")  # SIGKILL mid-stream
            produce(p, 400, 100, pause=0.002)
            env.start_daemon("B")
            produce(p, 500, 100, pause=0.002)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not any(env.differences("C")) and all(c.count() >= 600 for c in live):
                break
            time.sleep(0.2)
        diffs = env.differences("C")
        assert not any(diffs), f"C differs from A (bug 7): {diffs}\n{env.logs()}"
        check_histories(source_history(env), live)
    finally:
        for c in live:
            c.stop()
        env.stop()
