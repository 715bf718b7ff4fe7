"""Producer -> Consumer through real cache server processes: byte-exactness, replica failures,
metadata outages, TTL and capacity fallbacks, dueling writers, lease poisoning, bad endpoints.

Every wait has a deadline; no assertion is about speed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from contextlib import suppress
from typing import List

import pytest

from tests.helpers import Collector, Sender, assert_exact, free_port, msg, stop_process, wait_until
from pyspark_acs.cache.client import CacheClient
from pyspark_acs.read.cachepath import CachedReadPath
from pyspark_acs.cache.chunks import CHUNK_SIZE, ChunkWriter, chunk_key
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.errors import AcsOptionError, CacheError, LeasePoisonedError
from pyspark_acs.cache.metadata import MetadataCache, length_keys
from pyspark_acs.format.names import shard_dir
from pyspark_acs.write.producer import Producer
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.store import open_store

#: A safety net only: every wait in these tests has its own, shorter deadline.
pytestmark = pytest.mark.timeout(240)
#: Cache-call deadline of the clients tests build: generous, so a loaded test machine does not
#: turn a healthy replica into a "failed" one (the library default is 0.5 s).
DEADLINE = 3.0


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    """Three data and three metadata cache servers; tests that kill servers restart them."""
    with LocalDeployment(tmp_path_factory.mktemp("dep"), data_replicas=3, metadata_replicas=3,
                         capacity="64MiB") as d:
        yield d


def _heal(dep: LocalDeployment) -> None:
    for role in ("data", "metadata"):
        for i in range(3):
            if not dep.is_running(role, i):
                dep.restart(role, i)


_CLIENTS: List[CacheClient] = []


def caches(dep: LocalDeployment) -> dict:
    """Fresh clients of both caches (closed after the test), with the tests' generous deadline."""
    data = CacheClient(dep.data_endpoints, name="data cache", deadline=DEADLINE)
    meta = CacheClient(dep.metadata_endpoints, name="metadata cache", deadline=DEADLINE)
    _CLIENTS.extend((data, meta))
    return {"data_cache": data, "metadata_cache": meta}


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


# -- steady state ---------------------------------------------------------------------------


def test_delivery_through_caches_is_byte_exact_and_reads_no_durable_bytes(dep, root):
    values = [os.urandom(n) for n in (0, 1, 4095, 4096, 4097, 70000, 300)] + [msg(i) for i in range(3000)]
    with Producer(root, "exact", shards=2, **caches(dep)) as p:
        for i, v in enumerate(values):
            p.send(v, key=b"k%d" % i, shard=i % 2)
        p.flush(timeout=20)
        assert p.stats()["cache_errors"] == 0
        with Consumer(root, "exact", **caches(dep)) as c:
            col = Collector(c)
            col.until(lambda: len(col.values) >= len(values), 20, "all messages")
            stats = c.stats()
    # Per-shard order: shard s holds values[s::2].
    with Consumer(root, "exact", shards=[0], **caches(dep)) as c0:
        col0 = Collector(c0)
        col0.until(lambda: len(col0.values) >= len(values[0::2]), 20, "shard 0")
    assert col0.values == values[0::2]
    assert sorted(col.values) == sorted(values)
    assert stats["durable_bytes"] == 0, stats
    assert stats["cache_bytes"] > sum(len(v) for v in values), stats
    assert stats["metadata_fallbacks"] == 0


def test_live_tail_reads_no_durable_bytes_in_steady_state(dep, root):
    with Producer(root, "live", **caches(dep)) as p:
        sender = Sender(p)
        with Consumer(root, "live", **caches(dep)) as c:
            col = Collector(c)
            sender.start()
            col.until(lambda: len(col.values) >= 2000, 20, "2000 live messages")
            count = sender.stop()
            col.until(lambda: len(col.values) >= count, 20, "every message")
            stats = c.stats()
    assert_exact(col.values, count)
    assert stats["durable_bytes"] == 0, stats
    assert stats["cache_bytes"] > 0


# -- data-cache replica failures -------------------------------------------------------------


def test_data_replica_failures_one_then_two_then_all_then_restart(dep, root):
    try:
        with Producer(root, "kill", **caches(dep)) as p:
            sender = Sender(p)
            with Consumer(root, "kill", **caches(dep)) as c:
                col = Collector(c)
                sender.start()
                col.until(lambda: len(col.values) >= 500, 20, "first messages")

                # One replica down: writes still get a majority; nothing lost, nothing duplicated.
                dep.kill("data", 0, signal.SIGKILL)
                seen = len(col.values)
                col.until(lambda: len(col.values) >= seen + 1500, 20, "messages with one replica dead")
                assert p.stats()["cache_errors"] == 0, p.stats()

                # Two down: no majority for chunks. The survivor still takes them (each written
                # after its durable append was verified), so a reader whose feed follows it, or
                # hedged to it, may keep reading pushed bytes; the others fall back to the store.
                dep.kill("data", 1, signal.SIGKILL)
                seen = len(col.values)
                col.until(lambda: len(col.values) >= seen + 1000, 20, "messages with two replicas dead")
                assert p.stats()["cache_errors"] > 0

                # All three down: nothing in the cache; the consumer falls back to the store.
                durable0 = col.stat("durable_bytes")
                dep.kill("data", 2, signal.SIGKILL)
                col.until(lambda: col.stat("durable_bytes") > durable0, 20, "durable fallback")
                seen = len(col.values)
                col.until(lambda: len(col.values) >= seen + 1000, 20, "messages with every data replica dead")

                # All back (empty): the producer's chunks and lengths reach the cache again and
                # consumers return to it: cache bytes grow and durable bytes stop growing.
                dep.restart("data", 0)
                dep.restart("data", 1)
                dep.restart("data", 2)
                cache0 = col.stat("cache_bytes")
                col.until(lambda: col.stat("cache_bytes") > cache0, 30, "reads from the cache after restart")
                deadline = time.monotonic() + 30
                while True:
                    d0, c0, n0 = col.stat("durable_bytes"), col.stat("cache_bytes"), len(col.values)
                    col.pump(1.5)
                    if col.stat("durable_bytes") == d0 and col.stat("cache_bytes") > c0 and len(col.values) > n0:
                        break
                    assert time.monotonic() < deadline, f"durable reads did not stop: {c.stats()}"

                count = sender.stop()
                col.until(lambda: len(col.values) >= count, 30, "every message")
                assert_exact(col.values, count)
    finally:
        _heal(dep)


# -- metadata-cache outage ---------------------------------------------------------------------


def _holding(dep: LocalDeployment, key: bytes) -> int:
    """How many metadata replicas hold ``key`` (each asked on its own)."""
    held = 0
    for endpoint in dep.endpoints("metadata"):
        with CacheClient(endpoint, deadline=DEADLINE) as one:  # a loaded machine's deadline
            try:
                held += one.get([key])[0] is not None
            except CacheError:
                pass
    return held


def test_metadata_outage_delivers_from_durable_lengths_then_returns(dep, root):
    try:
        with Producer(root, "meta", **caches(dep)) as p:
            sender = Sender(p)
            with Consumer(root, "meta", **caches(dep)) as c:
                col = Collector(c)
                sender.start()
                col.until(lambda: len(col.values) >= 500, 20, "first messages")
                for i in range(3):
                    dep.kill("metadata", i, signal.SIGKILL)
                fallbacks0 = col.stat("metadata_fallbacks")
                seen = len(col.values)
                col.until(lambda: len(col.values) >= seen + 1000, 30, "messages with the metadata cache dead")
                assert col.stat("metadata_fallbacks") > fallbacks0
                assert p.stats()["cache_errors"] > 0

                for i in range(3):
                    dep.restart("metadata", i)
                # Back to published lengths: no more metadata fallbacks, bytes from the cache.
                deadline = time.monotonic() + 30
                while True:
                    f0, c0, n0 = col.stat("metadata_fallbacks"), col.stat("cache_bytes"), len(col.values)
                    col.pump(1.5)
                    if col.stat("metadata_fallbacks") == f0 and col.stat("cache_bytes") > c0 and len(col.values) > n0:
                        break
                    assert time.monotonic() < deadline, f"did not return to the metadata cache: {c.stats()}"
                uri = p.store.uri(f"{shard_dir('meta', 0)}/{p.current_files()[0]}")
                # The restarted replicas came back empty: the Producer publishes lengths again, to
                # a majority once its client probes them again (each after its own back-off, so
                # meanwhile a write may reach one replica, which a consistent read may miss).
                wait_until(lambda: _holding(dep, length_keys(uri)[1]) >= 2, 30,
                           "the Producer's durable length published again to a majority after the restart")
                count = sender.stop()
                col.until(lambda: len(col.values) >= count, 30, "every message")
                assert_exact(col.values, count)
        with CacheClient(dep.metadata_endpoints, deadline=DEADLINE) as mc:
            lc, ld = MetadataCache(mc).lengths([uri])[uri]
        # Never past the store; the close's own publish may be lost on a loaded machine (a
        # failed cache write is counted, not retried), so the length may trail the last one.
        assert ld is not None and ld <= open_store(root).length(uri.split(root, 1)[1].lstrip("/"))
    finally:
        _heal(dep)


# -- chunk TTL and capacity ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Data replicas of 1 MiB whose chunks live 1.5 s; a separate (roomy) metadata cache."""
    with LocalDeployment(tmp_path_factory.mktemp("small"), data_replicas=3, metadata_replicas=3,
                         capacity="1MiB", data_ttl=1.5) as d:
        yield d


def test_consumer_behind_the_chunk_ttl_catches_up_from_durable_then_returns_to_cache(small, root):
    with Producer(root, "late", **caches(small)) as p:
        for i in range(1500):
            p.send(msg(i))
        p.flush(timeout=20)
        time.sleep(2.5)  # every chunk written so far has expired (TTL 1.5 s)
        with Consumer(root, "late", **caches(small)) as c:
            col = Collector(c)
            col.until(lambda: len(col.values) >= 1500, 20, "the old messages")
            durable_old = col.stat("durable_bytes")
            assert durable_old >= 1500 * len(msg(0)), c.stats()
            assert col.stat("missing_chunks") > 0
            cache_old = col.stat("cache_bytes")

            # New data while the consumer follows the head: from the cache alone.
            sender = Sender(p)
            sender.sent = 1500
            sender.start()
            col.until(lambda: len(col.values) >= 3000, 20, "new messages")
            count = sender.stop()
            col.until(lambda: len(col.values) >= count, 20, "every message")
            stats = c.stats()
    assert_exact(col.values, count)
    assert stats["durable_bytes"] == durable_old, stats
    assert stats["cache_bytes"] > cache_old + 1000 * len(msg(0))


def test_small_data_cache_evicts_old_chunks_and_keeps_metadata(small, root):
    count = 12000  # about 2.3 MB: more than twice one replica's capacity
    with Producer(root, "flood", **caches(small)) as p:
        for i in range(count):
            p.send(msg(i))
        p.flush(timeout=30)
        assert p.stats()["cache_errors"] == 0, p.stats()
        rel = f"{shard_dir('flood', 0)}/{p.current_files()[0]}"
        uri = p.store.uri(rel)
        with CacheClient(small.data_endpoints) as dc:
            stats = dc.stats()
        assert all(s["evicted_total"] > 0 for s in stats.values()), stats
        assert all(s["used_bytes"] <= s["capacity_bytes"] for s in stats.values()), stats
        # The live file's lengths are still published (the metadata cache is separate).
        with CacheClient(small.metadata_endpoints) as mc:
            lc, ld = MetadataCache(mc).lengths([uri])[uri]
        durable = open_store(root).length(rel)
        assert lc == ld == durable
        with Consumer(root, "flood", **caches(small)) as c:
            col = Collector(c)
            col.until(lambda: len(col.values) >= count, 30, "every message")
            cstats = c.stats()
    assert_exact(col.values, count)
    assert cstats["durable_bytes"] > 0 and cstats["missing_chunks"] > 0, cstats


# -- lease poisoning ---------------------------------------------------------------------------


def test_second_producer_poisons_the_first_and_takes_over(dep, root):
    a = Producer(root, "duo", lease_seconds=1.5, **caches(dep))
    for i in range(500):
        a.send(msg(i, b"a"))
    a.flush(timeout=20)
    flushed_a = 500
    for i in range(500, 600):
        a.send(msg(i, b"a"))
    with Producer(root, "duo", lease_seconds=1.5, **caches(dep)) as b:
        # The first writer stopped within one lease check; its next send raises.
        deadline = time.monotonic() + 5
        while True:
            try:
                a.send(b"late")
            except LeasePoisonedError:
                break
            assert time.monotonic() < deadline, "the first producer was not stopped"
            time.sleep(0.01)
        with pytest.raises(LeasePoisonedError):
            a.flush(timeout=5)
        with pytest.raises(LeasePoisonedError):
            a.close(timeout=5)
        for i in range(300):
            b.send(msg(i, b"b"))
        b.flush(timeout=20)
        assert sorted(b.current_files().values()) > sorted(a.current_files().values())
    with Consumer(root, "duo", **caches(dep)) as c:
        col = Collector(c)
        col.until(lambda: col.values[-1:] == [msg(299, b"b")], 20, "the second producer's messages")
    first = [v for v in col.values if v.startswith(b"a")]
    assert len(first) >= flushed_a
    assert_exact(first, len(first), b"a")
    assert col.values[len(first):] == [msg(i, b"b") for i in range(300)]


DEAD_PRODUCER = r"""
import sys, time
from pyspark_acs.write.producer import Producer
root, data, meta = sys.argv[1:4]
p = Producer(root, "dead", data_cache=data, metadata_cache=meta)
for i in range(200):
    p.send(b"d%08d|" % i + b"." * 180)
p.flush(timeout=20)
print("flushed", flush=True)
time.sleep(120)
"""


def test_producer_killed_without_release_is_superseded(dep, root, subprocess_env, python_exe):
    proc = subprocess.Popen([python_exe, "-c", DEAD_PRODUCER, root, dep.data_endpoints, dep.metadata_endpoints],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env)
    try:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=30), "the child producer did not report"
        assert proc.stdout.readline().strip() == b"flushed", proc.stderr.read1(4000)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    started = time.monotonic()
    with Producer(root, "dead", **caches(dep)) as p:  # poisons, then seizes the dead lease
        took = time.monotonic() - started
        for i in range(100):
            p.send(msg(i, b"e"))
    assert took < 10  # the acquire has its own bound; this only documents it
    with Consumer(root, "dead", **caches(dep)) as c:
        col = Collector(c)
        col.until(lambda: len(col.values) >= 300, 20, "both producers' messages")
    assert col.values == [msg(i, b"d") for i in range(200)] + [msg(i, b"e") for i in range(100)]


# -- bad input ---------------------------------------------------------------------------------


def test_unanswering_endpoint_producer_and_consumer_use_the_durable_store(root, caplog):
    ep = f"127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="pyspark_acs"):
        with Producer(root, "lonely", data_cache=ep, metadata_cache=ep) as p:
            for i in range(300):
                p.send(msg(i))
            p.flush(timeout=20)
            assert p.stats()["cache_errors"] > 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(ep in w for w in warnings), warnings
    with Consumer(root, "lonely", data_cache=ep, metadata_cache=ep) as c:
        col = Collector(c)
        col.until(lambda: len(col.values) >= 300, 20, "every message")
        stats = c.stats()
    assert_exact(col.values, 300)
    assert stats["durable_bytes"] > 0 and stats["cache_bytes"] == 0


@pytest.mark.parametrize("bad, item", [
    ("localhost", "localhost"),
    ("127.0.0.1:0", "127.0.0.1:0"),
    ("127.0.0.1:70000", "127.0.0.1:70000"),
    ("127.0.0.1:7001,nohost", "nohost"),
    ("127.0.0.1:7001,,", "''"),
    ("http://127.0.0.1:7001", "http://127.0.0.1:7001"),
])
def test_malformed_endpoints_are_refused_naming_the_item(root, bad, item):
    for kwargs in ({"data_cache": bad}, {"metadata_cache": bad}):
        with pytest.raises(AcsOptionError) as e:
            Producer(root, "badopt", **kwargs)
        assert item in str(e.value)
    Producer(root, "badopt").close()
    for kwargs in ({"data_cache": bad}, {"metadata_cache": bad}):
        with pytest.raises(AcsOptionError) as e:
            Consumer(root, "badopt", **kwargs)
        assert item in str(e.value)


def test_cache_endpoints_from_the_environment_reach_producer_and_consumer(dep, root, monkeypatch):
    """``acs up`` prints ``export ACS_DATA_CACHE=... ACS_METADATA_CACHE=...``: a Producer and a
    Consumer given no endpoints use them; ``"none"`` turns a cache off; explicit values win."""
    monkeypatch.setenv("ACS_DATA_CACHE", dep.data_endpoints)
    monkeypatch.setenv("ACS_METADATA_CACHE", dep.metadata_endpoints)
    with Producer(root, "envcarry", shards=1) as p:
        for i in range(200):
            p.send(msg(i))
        p.flush(timeout=20)
        assert p.stats()["cache_errors"] == 0
    with Consumer(root, "envcarry") as c:
        col = Collector(c)
        col.until(lambda: len(col.values) >= 200, 20, "every message")
        stats = c.stats()
    assert_exact(col.values, 200)
    assert stats["cache_bytes"] > 0 and stats["durable_bytes"] == 0, stats
    # "none" wins over the environment: the store alone.
    with Consumer(root, "envcarry", data_cache="none", metadata_cache="none") as c:
        col = Collector(c)
        col.until(lambda: len(col.values) >= 200, 20, "every message")
        stats = c.stats()
    assert_exact(col.values, 200)
    assert stats.get("cache_bytes", 0) == 0 and stats["durable_bytes"] > 0, stats


def test_a_bad_cache_environment_variable_is_named(root, monkeypatch):
    monkeypatch.setenv("ACS_METADATA_CACHE", "localhost")
    with pytest.raises(AcsOptionError, match=r"\$ACS_METADATA_CACHE: 'localhost' is not an endpoint"):
        Producer(root, "badenv")
    with pytest.raises(AcsOptionError, match=r"\$ACS_METADATA_CACHE"):
        Consumer(root, "badenv")
    Producer(root, "badenv", metadata_cache="none").close()  # an explicit choice wins


# -- dueling writers (paper section 3, appendix A) ---------------------------------------------

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

DUEL_LEN = 7 * CHUNK_SIZE + 1234
DUEL_CONTENT = b"".join(b"%07d\n" % i for i in range(DUEL_LEN // 8 + 1))[:DUEL_LEN]


class Duel(RuleBasedStateMachine):
    """Several copy writers of one file, with lost writes, stale publishers and cache wipes.

    The test appends the durable file itself; every writer writes the same true bytes, at its
    own pace, and may run ahead of the durable file (as a copy writer's cache stream does).
    Safety: whatever a reader gets through the published lengths is a prefix of the file's
    true content. Liveness: once the writers stop and the durable file is complete, the
    reader eventually gets all of it.
    """

    env: dict = {}
    counter = 0

    def __init__(self) -> None:
        super().__init__()
        env = self.env
        Duel.counter += 1
        self.rel = f"duel/f{Duel.counter:05d}.acs"
        self.store = open_store(env["root"])
        self.store.write_small(self.rel, b"")
        self.uri = self.store.uri(self.rel)
        self.data, self.mc, self.dead = env["data"], env["meta"], env["dead"]
        self.meta = MetadataCache(self.mc)
        self.path = CachedReadPath(self.store, data_cache=self.data, metadata_cache=self.mc,
                                   max_delay=0.05, durable_poll_interval=0.05)
        self.durable = 0
        self.writers = [ChunkWriter(self.data, self.uri) for _ in range(3)]
        self.produced = 0  # the furthest any writer (or the durable file) has got
        self.restarts = 0

    def teardown(self) -> None:
        try:
            # Writers stopped; the file is complete in the store and its length published.
            self._append_durable(DUEL_LEN - self.durable)
            deadline = time.monotonic() + 10
            while True:
                with suppress(CacheError):
                    self.meta.publish(self.uri, durable_length=DUEL_LEN)
                got = self._read_all()
                if got == DUEL_CONTENT:
                    break
                assert got == DUEL_CONTENT[:len(got)], f"read {len(got)} bytes that are not a prefix"
                assert time.monotonic() < deadline, f"reader stuck at {len(got)} of {DUEL_LEN} bytes"
                time.sleep(0.02)
        finally:
            self.path.close()

    # -- writers -----------------------------------------------------------------------------

    def _append_durable(self, k: int) -> None:
        k = min(k, DUEL_LEN - self.durable)
        if k > 0:
            with open(self.store.path(self.rel), "ab") as f:
                f.write(DUEL_CONTENT[self.durable:self.durable + k])
            self.durable += k
            self.produced = max(self.produced, self.durable)

    @rule(k=st.integers(1, CHUNK_SIZE + 100))
    def durable_append(self, k):
        self._append_durable(k)

    @rule(w=st.integers(0, 2), k=st.integers(1, 2 * CHUNK_SIZE), lost=st.booleans(), publish=st.booleans())
    def cache_write(self, w, k, lost, publish):
        """Writer ``w`` appends its next ``k`` bytes (maybe lost), then maybe publishes its length."""
        writer = self.writers[w]
        data = DUEL_CONTENT[writer.position:writer.position + k]
        if not data:
            return
        if lost:
            writer.client = self.dead  # a real failure: nothing listens there
        try:
            writer.append(data)
        except CacheError:
            pass  # lost: the writer's position still advances (as ChunkWriter documents)
        finally:
            writer.client = self.data
            self.produced = max(self.produced, writer.position)
        if publish:
            self.publish_cache_length(w)

    @rule(w=st.integers(0, 2))
    def publish_cache_length(self, w):
        # Published even after lost writes: the chunks may vanish anyway (TTL, eviction).
        with suppress(CacheError):
            self.meta.publish(self.uri, cache_length=self.writers[w].position)

    @rule(data=st.data())
    def publish_durable_length(self, data):
        # A slow publisher may send an old length; versions keep lengths from going back.
        length = data.draw(st.integers(0, self.durable))
        with suppress(CacheError):
            self.meta.publish(self.uri, durable_length=length)

    @rule(w=st.integers(0, 2), data=st.data())
    def writer_restarts_from_the_store(self, w, data):
        pos = data.draw(st.integers(0, self.durable))
        start = pos - pos % CHUNK_SIZE
        self.writers[w] = ChunkWriter(self.data, self.uri, pos, prefix=DUEL_CONTENT[start:pos])

    # -- cache wipes ---------------------------------------------------------------------------

    @rule(replica=st.integers(0, 2), numbers=st.lists(st.integers(0, DUEL_LEN // CHUNK_SIZE), max_size=4))
    def wipe_chunks_on_one_replica(self, replica, numbers):
        keys = [chunk_key(self.uri, n) for n in set(numbers)]
        with suppress(CacheError):
            self.env["single_data"][replica].delete(keys)

    @rule(numbers=st.lists(st.integers(0, DUEL_LEN // CHUNK_SIZE), min_size=1, max_size=3))
    def wipe_chunks_everywhere(self, numbers):
        with suppress(CacheError):
            self.data.delete([chunk_key(self.uri, n) for n in set(numbers)])

    @rule(replica=st.integers(0, 2))
    def wipe_lengths_on_one_replica(self, replica):
        u = self.uri.encode()
        with suppress(CacheError):
            self.env["single_meta"][replica].delete([b"lc:" + u, b"ld:" + u])

    @precondition(lambda self: self.restarts < 1)
    @rule(role=st.sampled_from(["data", "metadata"]), replica=st.integers(0, 2), dice=st.integers(0, 7))
    def restart_replica(self, role, replica, dice):
        # A restart costs half a second: only one in eight draws restarts (at most one per run).
        if dice == 0:
            self.restarts += 1
            self.env["dep"].restart(role, replica)

    # -- readers -------------------------------------------------------------------------------

    def _read_all(self) -> bytes:
        length = self.path.lengths([self.rel])[self.rel]
        return self.path.read(self.rel, 0, length) if length else b""

    @invariant()
    def reads_are_a_prefix(self):
        length = self.path.lengths([self.rel])[self.rel]
        assert length is not None and length <= self.produced
        got = self.path.read(self.rel, 0, length)
        assert got == DUEL_CONTENT[:len(got)], f"read {len(got)} bytes that are not a prefix"

    @rule(data=st.data())
    def read_from_the_middle(self, data):
        length = self.path.lengths([self.rel])[self.rel]
        # Drawn within fixed bounds, then clamped: the length depends on timing (a stalled
        # published length is checked against the store after 50 ms), and hypothesis refuses
        # draws whose bounds differ between replays of one example.
        start = min(data.draw(st.integers(0, DUEL_LEN)), length)
        got = self.path.read(self.rel, start, length)
        assert got == DUEL_CONTENT[start:start + len(got)]


def test_cache_ahead_of_the_store_with_a_lost_chunk_reads_only_a_prefix(dep, root):
    """A copy writer's cache stream leads the durable file; its first chunk was lost. The
    reader must stop at the gap, not join later chunks onto a short durable read."""
    store = open_store(root)
    rel = "ahead/f.acs"
    store.write_small(rel, b"")
    uri = store.uri(rel)
    data = caches(dep)["data_cache"]
    meta = MetadataCache(caches(dep)["metadata_cache"])
    writer = ChunkWriter(CacheClient(f"127.0.0.1:{free_port()}"), uri)
    with pytest.raises(CacheError):
        writer.append(DUEL_CONTENT[:5000])  # lost: nothing listens there
    writer.client = data
    writer.append(DUEL_CONTENT[5000:9000])
    meta.publish(uri, cache_length=writer.position)
    path = CachedReadPath(open_store(root), data_cache=data, metadata_cache=meta.client, max_delay=0.05)
    try:
        length = path.lengths([rel])[rel]
        assert length == 9000
        assert path.read(rel, 0, length) == b""  # the store has nothing yet
        with open(store.path(rel), "ab") as f:
            f.write(DUEL_CONTENT[:3000])
        assert path.read(rel, 0, length) == DUEL_CONTENT[:3000]
        with open(store.path(rel), "ab") as f:
            f.write(DUEL_CONTENT[3000:4096])
        assert path.read(rel, 0, length) == DUEL_CONTENT[:9000]  # the rest from the cache
        assert path.stats()["cache_bytes"] >= 9000 - 4096
    finally:
        path.close()


def test_dueling_writers_reads_stay_a_prefix_and_complete(dep, root):
    dead = CacheClient(f"127.0.0.1:{free_port()}", name="dead data cache")
    singles = {role: [CacheClient(ep, replication=1, deadline=DEADLINE) for ep in dep.endpoints(role)]
               for role in ("data", "metadata")}
    with CacheClient(dep.data_endpoints, name="data cache", deadline=DEADLINE) as data, \
            CacheClient(dep.metadata_endpoints, name="metadata cache", deadline=DEADLINE) as meta:
        Duel.env = {"root": root, "data": data, "meta": meta, "dead": dead, "dep": dep,
                    "single_data": singles["data"], "single_meta": singles["metadata"]}
        try:
            run_state_machine_as_test(Duel, settings=settings(
                max_examples=40, stateful_step_count=30, deadline=None, database=None,
                suppress_health_check=list(HealthCheck)))
        finally:
            Duel.env = {}
            dead.close()
            for c in singles["data"] + singles["metadata"]:
                c.close()
            _heal(dep)


# -- bursts: a block's cache writes overlap the next block's durable append ------------------


def test_a_burst_overlaps_its_cache_writes_and_every_length_is_out_when_flush_returns(dep, root):
    """A send_many backlog of many blocks, with a consumer already following: blocks but the
    last of each round hand their cache writes to the file's shadow thread; the consumer gets
    every message in order from the caches alone, and once flush() returns the published
    lengths are the file's durable length (a burst leaves no cached length behind)."""
    count = 8000
    values = [msg(i, b"b") for i in range(count)]
    clients = caches(dep)
    with Producer(root, "burst", max_block_bytes=32 * 1024, **clients) as p, \
            Consumer(root, "burst", **caches(dep)) as c:
        col = Collector(c)
        sent: List[BaseException] = []

        def send() -> None:
            try:
                p.send_many(values)
                p.flush(timeout=30)
            except BaseException as exc:  # surfaced below
                sent.append(exc)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        col.until(lambda: len(col.values) >= count, 30, "the burst")
        sender.join(30)
        assert not sender.is_alive() and not sent, sent
        stats = p.stats()
        rel = f"{shard_dir('burst', 0)}/{p.current_files()[0]}"
        store = open_store(root)
        lengths = MetadataCache(clients["metadata_cache"]).lengths([store.uri(rel)])[store.uri(rel)]
        assert lengths == (store.length(rel), store.length(rel))
        consumer_stats = c.stats()
    assert_exact(col.values, count, b"b")
    assert stats["overlapped_blocks"] > 0, stats
    assert stats["cache_errors"] == 0, stats
    assert consumer_stats["durable_bytes"] == 0, consumer_stats


def test_a_flush_waits_for_its_own_shards_blocks_not_for_a_count_of_anybodys(dep, root, monkeypatch):
    """Thread A queues four blocks' worth to shard 0 and flushes; then thread B queues two
    blocks' worth to shard 1. The writer's next round interleaves the shards (s0, s1, s0, s1,
    s0, s0), so B's messages are written before A's last block. Before the fix flush() counted
    messages of all shards and returned there, with A's last block not yet appended. Here that
    block is held: flush must still wait; released, flush returns with every one of A's
    messages durable and shard 0's published lengths equal to its durable length."""
    clients = caches(dep)
    value = b"v" * 1024  # 1040 accounted bytes: three messages per 4 KiB block
    calls: List[int] = []
    first_held, first_go = threading.Event(), threading.Event()
    last_held, last_go = threading.Event(), threading.Event()
    flushed = threading.Event()
    errors: List[BaseException] = []
    with Producer(root, "perflush", shards=2, max_block_bytes=4096, **clients) as p:
        append = p._shards[0].writer.append

        def gated(data, messages, **kw):
            calls.append(messages)
            if len(calls) == 1:  # the warm-up message's round: keep the writer here
                first_held.set()
                first_go.wait(30)
            elif len(calls) == 5:  # A's fourth block, the last of its round
                last_held.set()
                last_go.wait(30)
            return append(data, messages, **kw)

        def flush() -> None:
            try:
                p.flush(timeout=60)
            except BaseException as exc:  # surfaced below
                errors.append(exc)
            flushed.set()

        monkeypatch.setattr(p._shards[0].writer, "append", gated)
        try:
            p.send(b"warm", shard=0)
            assert first_held.wait(30)
            for i in range(12):
                p.send(b"A%02d" % i + value[3:], shard=0)
            threading.Thread(target=flush, daemon=True).start()
            time.sleep(0.2)  # the flush took its targets
            for i in range(4):
                p.send(b"B%02d" % i + value[3:], shard=1)
            first_go.set()
            assert last_held.wait(30), calls
            assert not flushed.wait(1.0), "flush returned while the last block of its messages was unwritten"
        finally:  # never leave the writer held (a failed check would else wait out close())
            first_go.set()
            last_go.set()
        assert flushed.wait(30) and not errors, errors
        assert calls == [1, 3, 3, 3, 3], calls
        store = open_store(root)
        rel = f"{shard_dir('perflush', 0)}/{p.current_files()[0]}"
        lengths = MetadataCache(clients["metadata_cache"]).lengths([store.uri(rel)])[store.uri(rel)]
        assert lengths == (store.length(rel), store.length(rel))
        with Consumer(root, "perflush", shards=[0], **caches(dep)) as c:
            col = Collector(c)
            col.until(lambda: len(col.values) >= 13, 20, "shard 0's messages")
    assert col.values == [b"warm"] + [b"A%02d" % i + value[3:] for i in range(12)]


def test_a_burst_whose_cache_writes_stall_waits_at_the_bound_and_then_publishes_everything(dep, root):
    """Two of three data replicas are stopped (SIGSTOP), so the shadow thread's chunk put waits
    for its majority: the writer goes on appending durably until SHADOW_MAX_BYTES wait for the
    thread, and then waits too. A consumer follows the file through the stall; resumed, it has
    every message exactly, the lengths are published at the file's end, and every chunk the
    data cache holds is the file's bytes at its offset."""
    import datetime as dt

    from pyspark_acs.cache.chunks import ChunkReader
    from pyspark_acs.format.block import encode_block
    from pyspark_acs.format.names import file_name
    from pyspark_acs.write.file import SHADOW_MAX_BYTES, FileWriter

    store = open_store(root)
    store.create_stream("stall", 1)
    rel = f"{shard_dir('stall', 0)}/{file_name(dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), 'w')}"
    store.write_small(rel, b"")
    per_block = 5000  # messages of ~190 bytes: blocks of ~1 MiB
    values = [msg(i, b"s") for i in range(8 * per_block)]
    pieces = [encode_block(values[i:i + per_block], first_index=i) for i in range(0, len(values), per_block)]
    block = max(map(len, pieces))
    clients = caches(dep)
    errors: List[str] = []
    writer = FileWriter(store, rel, data=clients["data_cache"], meta=MetadataCache(clients["metadata_cache"]),
                        on_cache_error=lambda what, exc: errors.append(f"{what}: {exc}"))
    stopped = [dep.server("data", i).pid for i in (0, 1)]
    done: List[BaseException] = []

    def write() -> None:
        try:
            for i, piece in enumerate(pieces):
                writer.append(piece, more_follows=i < len(pieces) - 1)
        except BaseException as exc:  # surfaced below
            done.append(exc)

    with Consumer(root, "stall", **caches(dep)) as c:
        col = Collector(c)
        following = threading.Thread(
            target=col.until, args=(lambda: len(col.values) >= len(values), 60, "every message"), daemon=True)
        following.start()  # the consumer follows the file from before the stall to its end
        for pid in stopped:
            stop_process(pid)
        try:
            thread = threading.Thread(target=write, daemon=True)
            thread.start()
            # Durable appends run ahead of the stalled thread by at most what may wait for it
            # (under the bound, plus the block that crossed it) and the block appended before
            # the writer waits: they stop there.
            wait_until(lambda: writer.position >= SHADOW_MAX_BYTES, 10, "the appends up to the bound")
            time.sleep(0.5)
            assert thread.is_alive()
            assert writer.position <= SHADOW_MAX_BYTES + 2 * block, writer.position
            assert writer.position < len(b"".join(pieces))
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        thread.join(30)
        assert not thread.is_alive() and not done, done
        writer.close()
        following.join(60)
        assert not following.is_alive()
    assert_exact(col.values, len(values), b"s")
    content = b"".join(pieces)
    assert writer.position == len(content) == store.length(rel)
    uri = store.uri(rel)
    cached, durable = MetadataCache(clients["metadata_cache"]).lengths([uri])[uri]
    assert durable == len(content)
    assert cached is not None and cached <= len(content)
    runs = ChunkReader(clients["data_cache"]).read(uri, 0, cached)
    for run_start, run_end, got in runs:  # never a byte that is not the file's
        assert got is None or got == content[run_start:run_end], (run_start, run_end)
    if not errors:  # the stall stayed within the put deadline: the cache has every byte
        assert cached == len(content)
        assert all(got is not None for _, _, got in runs)


def test_one_shadow_thread_serves_a_writer_s_bursts_and_ends_with_it(dep, root):
    """The shadow thread waits for the next burst (SHADOW_IDLE_S) instead of ending after each:
    a thread started per burst made each burst wait for a new thread's first time slice, and a
    new thread is scheduled last (seconds per flush with 64 consumer processes on 2 cores).
    Bursts after a pause are published by the same thread, every byte in order; close() ends
    it; a burst after its idle time starts a new one."""
    from pyspark_acs.cache.chunks import ChunkReader
    from pyspark_acs.write import file as file_module
    from pyspark_acs.write.file import FileWriter

    store = open_store(root)
    rel = "linger/f.acs"
    store.write_small(rel, b"")
    clients = caches(dep)
    meta = MetadataCache(clients["metadata_cache"])
    writer = FileWriter(store, rel, data=clients["data_cache"], meta=meta)
    uri = store.uri(rel)

    def shadows():
        return [t for t in threading.enumerate() if t.name == f"acs-shadow {uri}"]

    content = b""
    threads = set()
    for burst in range(3):
        for i in range(3):
            piece = bytes([burst * 3 + i]) * 3000
            writer.append(piece, more_follows=True)
            content += piece
        writer.settle()  # published: the thread now waits for the next burst
        threads.update(shadows())
        assert meta.lengths([uri])[uri] == (len(content), len(content))
        time.sleep(0.05)
        assert shadows(), "the shadow thread waits for the next burst"
    assert len(threads) == 1 and all(t.is_alive() for t in threads)
    (thread,) = threads
    writer.close()
    thread.join(10)
    assert not thread.is_alive()
    runs = ChunkReader(clients["data_cache"]).read(uri, 0, len(content))
    assert b"".join(got for _, _, got in runs) == content

    store.write_small("linger/g.acs", b"")
    writer = FileWriter(store, "linger/g.acs", data=clients["data_cache"], meta=meta)
    uri = store.uri("linger/g.acs")
    try:
        writer.append(b"a" * 100, more_follows=True)
        writer.settle()
        (first,) = shadows()
        first.join(file_module.SHADOW_IDLE_S + 10)  # it ends by itself when no burst comes
        assert not first.is_alive()
        writer.append(b"b" * 100, more_follows=True)
        writer.settle()
        assert meta.lengths([uri])[uri] == (200, 200)
    finally:
        writer.close()


def test_an_unexpected_error_of_the_shadow_thread_reaches_the_writer(dep, root, monkeypatch):
    """Cache errors are the caller's to count (on_cache_error); anything else the shadow thread
    meets fails the writer's next append before it appends (those bytes are not acknowledged),
    and every append and the close after it: not lost, never attributed to durable bytes."""
    from pyspark_acs.write.file import CacheMirror, FileWriter

    store = open_store(root)
    rel = "boom/f.acs"
    store.write_small(rel, b"")
    clients = caches(dep)
    writer = FileWriter(store, rel, data=clients["data_cache"], meta=MetadataCache(clients["metadata_cache"]))

    def broken(self, data):
        raise RuntimeError("a bug in the mirror")

    monkeypatch.setattr(CacheMirror, "append", broken)
    writer.append(b"x" * 5000, more_follows=True)
    with pytest.raises(RuntimeError, match="a bug in the mirror"):
        writer.append(b"y" * 10)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="a bug in the mirror"):
        writer.append(b"z" * 10, more_follows=True)
    with pytest.raises(RuntimeError, match="a bug in the mirror"):
        writer.close()
    assert store.length(rel) == 5000


def test_a_producer_whose_shadow_thread_fails_reports_it_and_closes_every_shard(dep, root, monkeypatch):
    """The producer stops with the shadow thread's error; its cleanup still closes every shard
    and releases the leases, so a new producer takes the stream over at once."""
    from pyspark_acs.write.file import CacheMirror

    real = CacheMirror.append
    calls = []

    def broken_once(self, data):
        calls.append(len(data))
        if len(calls) == 3:
            raise RuntimeError("a bug in the mirror")
        return real(self, data)

    monkeypatch.setattr(CacheMirror, "append", broken_once)
    p = Producer(root, "shadowfail", shards=2, max_block_bytes=4096, **caches(dep))
    p.send_many([msg(i) for i in range(2000)])
    with pytest.raises(RuntimeError, match="a bug in the mirror"):
        p.flush(timeout=30)
    with pytest.raises(RuntimeError):
        p.close(timeout=30)
    assert all(sh.writer.writer is None and sh.writer.leases == [] for sh in p._shards)
    monkeypatch.undo()
    with Producer(root, "shadowfail", shards=2, lease_seconds=30, **caches(dep)) as again:
        again.send(msg(0, b"n"), shard=0)
        again.send(msg(0, b"n"), shard=1)
        again.flush(timeout=30)


def test_a_producer_waits_out_data_replicas_that_stop_answering_for_a_moment(dep, root):
    """Every data replica stopped (SIGSTOP: puts only time out, as on a loaded cache) for less
    than the put patience: the Producer's chunk put is sent again until they answer, nothing is
    given up (no cache error), and readers get the bytes from the cache, not the store."""
    from pyspark_acs.cache.chunks import PUT_PATIENCE_S

    stopped_s = 1.0
    assert stopped_s < PUT_PATIENCE_S / 2
    pids = [dep.server("data", i).pid for i in range(3)]
    with Producer(root, "waits", shards=1, data_cache=dep.data_endpoints,
                  metadata_cache=dep.metadata_endpoints) as p:
        p.send(b"before")
        p.flush(timeout=30)
        for pid in pids:
            stop_process(pid)
        resumer = threading.Timer(stopped_s, lambda: [os.kill(pid, signal.SIGCONT) for pid in pids])
        resumer.start()
        try:
            p.send(b"during")
            p.flush(timeout=30)
        finally:
            resumer.join()
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert p.stats()["cache_errors"] == 0, p.stats()
    with Consumer(root, "waits", data_cache=dep.data_endpoints, metadata_cache=dep.metadata_endpoints) as c:
        got = [v for b in c.batches(timeout=2) for v in b.column("value").to_pylist()]
        assert got == [b"before", b"during"]
        assert c.stats()["durable_bytes"] == 0, c.stats()
