"""Copy daemon end to end: real cache server processes per cluster (LocalDeployment), real
``acs-copy-daemon`` processes, a Producer in the source cluster, consumers downstream.

Clusters are tmp folders plus loopback ports. The cache deployments are shared by the whole
module (each test uses its own stream); daemons are started per test. Every wait is bounded.
The harness (Env, produce, consume_all...) is tests/helpers.py, shared with the
cross-cluster fault tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyspark_acs import Producer
from pyspark_acs.cache.poller import LengthPoller
from pyspark_acs.errors import AcsOptionError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.storage.store import DurableStore

from tests.helpers import (
    ARRIVE_S, CHAIN, CLUSTERS, LOCK_HOLDER, ROOT, STAR, Background, Collector, Env, check_order, consume_all,
    metric, produce, stop_process,
)

pytestmark = pytest.mark.slow


# -- fixtures ------------------------------------------------------------------------------------


_counter = [0]


@pytest.fixture
def make_env(tmp_path, caches):
    envs = []

    def make(links=CHAIN, dests=("B", "C"), tree=None) -> Env:
        _counter[0] += 1
        env = Env(tmp_path / f"env{_counter[0]}", caches, links, f"s{os.getpid()}x{_counter[0]}", dests, tree)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.stop()


# -- tests ---------------------------------------------------------------------------------------


def test_chain_copy_durable_and_cache(make_env):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    # Small blocks: the files roll over at 20 kB even when a loaded machine lets the
    # producer batch all pending messages of a shard into one block.
    with env.producer(max_block_bytes=4096) as p:
        produce(p, 0, 300, pause=0.001)
    env.wait_same("B")
    env.wait_same("C")
    values = consume_all(env, "C", 300)
    check_order(values, 300)
    assert len(env.files("C")) > 2  # files rolled over on the way

    from pyspark_acs.server.copy.status import copy_status, format_status
    from pyspark_acs.server.copy.topology import load_topology

    # The cache copy publishes its length independently of the durable copy: wait for both.
    deadline = time.monotonic() + 30
    while True:
        rows = copy_status(load_topology(env.topology), env.stream)
        settled = all(r["bytes_behind"] == 0 and r["cache_length"] == r["durable_length"] for r in rows)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r["shard"], r["cluster"], r["parent"]) for r in rows] == [
        (s, c, p) for s in (0, 1) for c, p in (("A", None), ("B", "A"), ("C", "B"))
    ]
    for r in rows:
        assert r["bytes_behind"] == 0 and r["cache_length"] == r["durable_length"], r
    # Delay records are best effort (a metric): at least one per downstream cluster.
    for c in ("B", "C"):
        assert any(r["cache_delay_s"] is not None for r in rows if r["cluster"] == c), format_status(rows)
    assert any(r["hop_delay_s"] is not None for r in rows if r["cluster"] == "C"), format_status(rows)
    assert "hop" in format_status(rows)
    acs = os.path.join(os.path.dirname(sys.executable), "acs")
    out = subprocess.run([acs, "copy-status", "--topology", str(env.topology), "--stream", env.stream],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.count("\n") == 7, out.stderr
    out = subprocess.run([acs, "tree", "--topology", str(env.topology)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "└── C" in out.stdout, out.stderr
    # The copies say where they come from, and a Producer is refused them (only the source
    # cluster's stream takes messages). copied_from names the cluster that created the copy:
    # on a loaded machine A may have found B slow and fed C directly at first (the tree above
    # is the one after), so C's may name A.
    for cluster, senders in (("B", ("A",)), ("C", ("B", "A"))):
        with open(os.path.join(env.roots[cluster], env.stream, "_stream.json")) as f:
            parent = json.load(f)["copied_from"]
        assert parent in senders, (cluster, parent)
        with pytest.raises(AcsOptionError, match=f"copied from cluster '{parent}'"):
            Producer(env.roots[cluster], env.stream, 2)


def test_cache_copy_after_complete_durable_copy_publishes_cache_length(make_env):
    """Regression: the durable copy of a file was complete in the destination before its
    cache operation said hello (a loaded machine delays one of the two operations). The cache
    copy started at the durable length and the reader ended at once, with no delta to
    publish the cache length: the destination's metadata cache never had one. The writer now
    publishes the start position (and writes the partial chunk there) at the hello."""
    import datetime as dt

    from pyspark_acs.format.block import encode_block, encode_seal
    from pyspark_acs.cache.chunks import CHUNK_SIZE, ChunkReader
    from pyspark_acs.format.names import file_name
    from pyspark_acs.server.copy.cluster import ClusterIO
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.writer import CopyServicer
    from pyspark_acs.server.copy.proto import copy_pb2
    from pyspark_acs.server.copy.topology import load_topology

    env = make_env(CHAIN, dests=("B",))
    io = ClusterIO(load_topology(env.topology).cluster("B"), cache_deadline=5.0)
    try:
        name = file_name(dt.datetime.now(dt.timezone.utc), "t1")
        rel = f"{shard_dir(env.stream, 0)}/{name}"
        data = encode_block([b"x" * 100] * 50, first_index=0) + encode_seal(50)
        assert len(data) % CHUNK_SIZE  # ends inside a chunk
        io.store.create_stream(env.stream, 1, copied_from="A")  # a copy, as the daemon makes it
        appender = io.store.open_appender(rel)
        appender.write(data)  # the durable copy is complete
        appender.close()
        servicer = CopyServicer(io, CopyDaemonOptions(lease_seconds=1.5), CopyMetrics("B"))
        hello = copy_pb2.CopyRequest(hello=True, stream=env.stream, shard=0, file=name, storage=copy_pb2.CACHE,
                                     shards=1, operation="t1", source_cluster="A")
        acks = list(servicer.Copy(iter([hello]), None))
        assert [(a.status, a.length) for a in acks] == [(copy_pb2.OK, len(data))]
        uri = io.uri(rel)
        assert io.meta.lengths([uri])[uri][0] == len(data)
        start = len(data) - len(data) % CHUNK_SIZE
        assert ChunkReader(io.data).read(uri, start, len(data)) == [(start, len(data), data[start:])]
        # A second hello (a reconnecting reader) continues from the published length.
        acks = list(servicer.Copy(iter([hello]), None))
        assert [(a.status, a.length) for a in acks] == [(copy_pb2.OK, len(data))]
    finally:
        io.close()


def test_poller_notify_wakes_followers_of_the_file_only(make_env):
    """A length this daemon's writer published wakes the next hop's readers of that file at
    once (no poll wait per intermediate hop) and hands them the bytes; lengths only grow;
    other files stay asleep. The daemon's source files read through the process's one length
    poller and the one read path (no second poller in the copy reader)."""
    from pyspark_acs.server.copy.cluster import ClusterIO
    from pyspark_acs.server.copy.reader import SourceFiles
    from pyspark_acs.server.copy.topology import load_topology

    env = make_env(CHAIN, dests=("B",))
    io = ClusterIO(load_topology(env.topology).cluster("B"), cache_deadline=5.0)
    files = SourceFiles(io, interval=0.05)
    try:
        assert files.path.poller is LengthPoller.shared(io.meta_client.endpoints)
        a, b = files.follow("s/00000/a"), files.follow("s/00000/b")
        a.clear(), b.clear()
        files.notify("s/00000/a", durable_length=100)
        assert a.is_set() and not b.is_set()
        assert files.lengths("s/00000/a") == (None, 100)
        a.clear()
        files.notify("s/00000/a", cache_length=100, durable_length=50)
        assert a.is_set() and files.lengths("s/00000/a") == (100, 100)
        files.notify("s/00000/a", cache_length=300, data=(100, b"y" * 200))  # bytes the writer wrote
        assert files.path.read("s/00000/a", 150, 300) == b"y" * 150  # from memory: no such chunks
        files.notify("s/00000/zzz", cache_length=1)  # not followed: ignored
        assert files.lengths("s/00000/zzz") == (None, None)
        files.unfollow("s/00000/a", a)
        files.notify("s/00000/a", cache_length=400)
        assert files.path.published("s/00000/a") == (None, None)
    finally:
        files.stop()
        io.close()


def test_tree_copy_with_live_consumer_in_c(make_env):
    env = make_env(STAR)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer() as p:
        produce(p, 0, 50)
        env.wait_same("C")  # the stream exists in C before the consumer starts
        bg = Background(p, 50, 250, pause=0.002)
        values = consume_all(env, "C", 300)
        bg.join()
    check_order(values, 300)
    env.wait_same("B")
    env.wait_same("C")
    assert metric(env.daemons["C"][0], "bytes_total", source="A", target="C", storage="cache") > 0


def test_kill_b_daemon_mid_stream_then_restart(make_env):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer() as p:
        bg = Background(p, 0, 400)
        time.sleep(0.6)
        env.kill_daemon("B")  # kill -9
        time.sleep(1.0)
        env.start_daemon("B")
        bg.join()
    env.wait_same("B")
    env.wait_same("C")
    check_order(consume_all(env, "C", 400), 400)


def test_kill_b_data_caches_durable_keeps_c_complete(make_env, caches):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer() as p:
        produce(p, 0, 100)
        env.wait_same("C")
        caches["B"].kill("data", 0)
        try:
            produce(p, 100, 150, pause=0.002)
            env.wait_same("B")
            env.wait_same("C")
        finally:
            caches["B"].restart("data", 0)
        produce(p, 250, 150, pause=0.002)
        env.wait_same("C")
    check_order(consume_all(env, "C", 400), 400)
    # The cache path resumed: C's metadata cache publishes the cache length of its newest file.
    store = DurableStore(env.roots["C"])
    from pyspark_acs.cache.client import CacheClient
    from pyspark_acs.cache.metadata import MetadataCache

    meta = MetadataCache(CacheClient(caches["C"].metadata_endpoints))
    try:
        deadline = time.monotonic() + ARRIVE_S
        while True:
            ok = True
            for shard in range(2):
                rel = f"{shard_dir(env.stream, shard)}/{store.list_files(env.stream, shard)[-1]}"
                c_len, _ = meta.lengths([store.uri(rel)])[store.uri(rel)]
                ok = ok and c_len == store.length(rel)
            if ok:
                break
            assert time.monotonic() < deadline, "cache copies did not resume in C"
            time.sleep(0.1)
    finally:
        meta.client.close()


def test_kill_a_metadata_cache_copy_continues_from_durable(make_env, caches):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer() as p:
        produce(p, 0, 100)
        env.wait_same("C")
        caches["A"].kill("metadata", 0)
        try:
            produce(p, 100, 200, pause=0.002)
            env.wait_same("B")
            env.wait_same("C")
            # A's daemon could not read lengths from its metadata cache: it held to its store
            # (counted once its operations account their reads, every few seconds).
            deadline = time.monotonic() + 30
            while metric(env.daemons["A"][0], "store_holds_total") < 1:
                assert time.monotonic() < deadline, f"no store hold counted\n{env.logs()}"
                time.sleep(0.2)
        finally:
            caches["A"].restart("metadata", 0)
    env.wait_same("C")
    check_order(consume_all(env, "C", 300), 300)


def test_stale_replica_dueling_writers_stay_byte_exact(make_env):
    env = make_env(CHAIN, dests=("B",))
    env.start_daemon("A")
    env.start_daemon("A", "--port", "0")  # a stale replica owning the same operations (ports are never shared)
    env.start_daemon("B")
    a1, a2 = env.daemons["A"]

    def poisoned() -> float:
        return metric(a1, "errors_total", kind="poisoned") + metric(a2, "errors_total", kind="poisoned")

    # Produce until the two readers have met at the lease: on a loaded machine the second
    # may find the file only after the first has copied what there was, and a fixed count
    # would then end before they duel.
    n = 0
    deadline = time.monotonic() + 60
    with env.producer(roll_bytes=1_000_000) as p:  # long-lived files: both readers meet on them
        while n < 300 or (poisoned() == 0 and time.monotonic() < deadline):
            produce(p, n, 100, pause=0.005)
            n += 100
    env.wait_same("B")
    assert poisoned() > 0, f"one of the two readers should have been stopped by the lease\n{env.logs()}"
    check_order(consume_all(env, "B", n), n)


def test_unhealthy_b_rebuilds_tree_and_c_continues(make_env):
    env = make_env(CHAIN)
    for c in CLUSTERS:
        env.start_daemon(c)
    with env.producer(roll_bytes=200_000) as p:
        produce(p, 0, 100)
        env.wait_same("C")
        env.healthy["B"] = False
        env.write_topology()
        time.sleep(1.0)  # the daemons reread the file within listing_interval
        produce(p, 100, 200, pause=0.002)
        env.wait_same("C")
        env.wait_same("B")
    # C is now fed by A: C's writer saw bytes from A.
    assert metric(env.daemons["C"][0], "bytes_total", source="A", target="C") > 0
    check_order(consume_all(env, "C", 300), 300)


def test_bad_topology_and_unknown_cluster_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bad = tmp_path / "bad.json"
    bad.write_text('{"clusters": {"A": {"root": "/tmp/x"}}}')
    base = [sys.executable, "-m", "pyspark_acs.server.copy.daemon", "--topology"]
    r = subprocess.run(base + [str(bad), "--cluster", "A"], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2 and "missing required field" in r.stderr, r.stderr
    good = Path(ROOT) / "examples" / "topology.json"
    r = subprocess.run(base + [str(good), "--cluster", "Z"], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2 and "unknown cluster 'Z'" in r.stderr, r.stderr
    r = subprocess.run(base + [str(good), "--cluster", "A", "--set", "nope=1"], capture_output=True, text=True,
                       env=env, timeout=30)
    assert r.returncode == 2 and "unknown option 'nope'" in r.stderr, r.stderr
    r = subprocess.run(base + [str(tmp_path / "missing.json"), "--cluster", "A"], capture_output=True, text=True,
                       env=env, timeout=30)
    assert r.returncode == 2 and "cannot read topology file" in r.stderr, r.stderr


def _deposed_file_with_late_block(env, caches, data_cache=False):
    """A source shard of two sealed files: the first (the deposed writer's) holds messages
    0-9, its successor's recovery seal, then a late block the deposed writer appended after
    that seal once it resumed; the second holds messages 10-19. With ``data_cache`` both
    writers mirror their verified bytes to the source's data cache too (the late block, never
    verified, is only in the store): the first file's cache length is its seal's end.

    Returns
    -------
    (rel, values, seal_end) : the first file, the 20 messages readers of the source read, and
    where the recovery seal ends (the file's end by the seal rule; the late block follows it).
    """
    from pyspark_acs.cache.client import client_for
    from pyspark_acs.cache.metadata import MetadataCache
    from pyspark_acs.format.block import encode_block
    from pyspark_acs.write.shard import ShardWriter

    src = env.clusters[0]
    store = DurableStore(env.roots[src])
    store.create_stream(env.stream, 1)
    meta = MetadataCache(client_for(caches[src].metadata_endpoints, "metadata cache", []))
    data = client_for(caches[src].data_endpoints, "data cache", []) if data_cache else None
    values = [f"m{i:06d}-".encode() + b"x" * 100 for i in range(20)]
    try:
        first = ShardWriter(store, env.stream, 0, "first", data=data, meta=meta, lease_seconds=0.6)
        first.acquire()
        first.recover()
        for i in range(10):
            first.append(encode_block([values[i]], first_index=i), 1)
        deposed_file = f"{shard_dir(env.stream, 0)}/{first.file}"
        first.close_file()  # it stops here (stopped inside its next append, the lock held)
        second = ShardWriter(store, env.stream, 0, "second", data=data, meta=meta, lease_seconds=0.6)
        second.acquire()
        second.recover()  # the recovery seal of the first writer's file
        assert second.recovered == [deposed_file.rsplit("/", 1)[1]]
        seal_end = store.length(deposed_file)
        # The first writer resumes: its append lands after the seal (its check refuses it).
        late = store.open_appender(deposed_file)
        late.write(encode_block([b"late, never acknowledged"], first_index=10))
        late.close()
        assert store.length(deposed_file) > seal_end
        for i in range(10, 20):
            second.append(encode_block([values[i]], first_index=i - 10), 1)
        second.close()
    finally:
        meta.client.close()
        if data is not None:
            data.close()
        store.close()
    assert _fresh(env.roots[src], env.stream, len(values)) == values
    return deposed_file, values, seal_end


def test_a_late_block_after_a_recovery_seal_does_not_stop_the_copy_of_the_file(make_env, caches):
    """Review of 01be342: a writer stopped holding its append lock is now passed by its
    successor's recovery seal, and its append lands after that seal once it resumes (refused
    by its own check, but the bytes are in the file; readers never read past a seal). The copy
    reader sent every complete block of the range, the late block too, and the destination
    refused the whole delta ('bytes after the seal'), every time: the messages before the seal
    -- acknowledged, readable in the source -- never reached the destination."""
    env = make_env(CHAIN, dests=("B",))
    _, values, _ = _deposed_file_with_late_block(env, caches)
    for c in ("A", "B"):
        env.start_daemon(c)
    deadline = time.monotonic() + ARRIVE_S
    while not DurableStore(env.roots["B"]).stream_shards(env.stream):
        assert time.monotonic() < deadline, f"the stream never reached B\n{env.logs()}"
        time.sleep(0.05)
    got = consume_all(env, "B", 20)
    assert got == values, f"{len(got)} of 20 messages reached B\n{env.logs()}"


def test_an_operation_on_a_file_complete_at_the_destination_ends_at_its_first_seal(make_env, caches):
    """Review of CopyOperation._complete: a source file holding messages, a recovery seal,
    then a late block. Its copy ends at the seal (the read path's rule: a file ends at its
    first seal). A second operation on that file -- the destination already holds it whole,
    e.g. a reader reconnecting after the seal's acknowledgement was lost, or a restarted
    daemon whose Files survey could not ask the child -- must finish at once and write
    nothing: it used to look for a seal at the source's store length (past the late block),
    found none, then sent the late block (the durable writer refused it every session until
    the operation gave up, again and again; the cache writer wrote it past the seal and the
    operation never finished)."""
    import grpc

    from pyspark_acs.cache.chunks import ChunkReader
    from pyspark_acs.server.copy.cluster import CACHE, DURABLE, ClusterIO
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.reader import SourceFiles
    from pyspark_acs.server.copy.topology import load_topology

    env = make_env(CHAIN, dests=("B",))
    rel, values, seal_end = _deposed_file_with_late_block(env, caches)
    source = env.files("A")[rel]
    daemon_a = env.start_daemon("A")
    daemon_b = env.start_daemon("B")
    topology = load_topology(env.topology)
    b_io = ClusterIO(topology.cluster("B"), cache_deadline=5.0)
    a_io = ClusterIO(topology.cluster("A"), cache_deadline=5.0)
    uri = b_io.uri(rel)

    def cache_length():
        return b_io.meta.lengths([uri])[uri][0]

    files = SourceFiles(a_io, interval=0.02)
    channel = grpc.insecure_channel(f"127.0.0.1:{env.ports['B']}")
    try:
        # The daemons copy the file: exactly the bytes through the seal, in both storages.
        deadline = time.monotonic() + ARRIVE_S
        while env.files("B").get(rel) != source[:seal_end] or cache_length() != seal_end:
            assert time.monotonic() < deadline, (
                f"B holds {len(env.files('B').get(rel, b''))} bytes, cache length {cache_length()}; "
                f"the file ends at its seal at {seal_end}\n{env.logs()}")
            time.sleep(0.05)
        assert consume_all(env, "B", 20) == values
        env.kill_daemon("A")

        # A second operation per storage on the file complete at B (no survey in front of it).
        _operations_to_b(env, a_io, files, channel, rel, (DURABLE, CACHE), seal_end,
                         CopyDaemonOptions(lease_seconds=1.5, retry=0.05), "again")
        assert env.files("B")[rel] == source[:seal_end]
        assert cache_length() == seal_end
        late_chunks = ChunkReader(b_io.data).read(uri, seal_end, len(source))
        assert all(part is None for _, _, part in late_chunks), late_chunks  # no late bytes in B's cache

        # A restarted daemon finds the file complete at B (its survey) and copies nothing.
        daemon_a = env.start_daemon("A")
        deadline = time.monotonic() + ARRIVE_S
        while metric(daemon_a, "files_surveyed_total", state="complete") < 2:
            assert time.monotonic() < deadline, f"A never surveyed B\n{env.logs()}"
            time.sleep(0.05)
        assert env.files("B")[rel] == source[:seal_end]
        assert metric(daemon_b, "errors_total", kind="delta_refused") == 0, env.logs()
        assert consume_all(env, "B", 20) == values
    finally:
        channel.close()
        files.stop()
        a_io.close()
        b_io.close()


@pytest.mark.parametrize("storages", [("cache",), ("durable", "cache")], ids=["cache-only", "durable+cache"])
def test_nothing_after_a_seal_reaches_the_destination_cache(make_env, caches, storages):
    """A source file with messages, a recovery seal, then a deposed writer's late block (in
    the store only; the source's cache ends at the seal). Copied to B -- by its cache
    operation alone, or by both operations; the cache one in catch-up mode, a jump to the
    chunk holding the source's cache length, the seal's end --, B's data cache and lengths
    end at the seal and no reader sends the late block. A reader that sends it all the same
    (before c1e84cc, a reader resuming at the seal did): B's durable writer refused it
    ('nothing may follow the seal'), but B's cache writer did not check deltas after a
    resume or a jump, wrote it into B's data cache and published the cache length past the
    seal. Both writers now refuse it alike, and B's consumers read the messages before the
    seal, then the next file's."""
    from pyspark_acs.cache.chunks import ChunkReader
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.proto import copy_pb2, copy_pb2_grpc

    env = make_env(CHAIN, dests=("B",))
    rel, values, seal_end = _deposed_file_with_late_block(env, caches, data_cache=True)
    source = env.files("A")[rel]
    name = rel.rsplit("/", 1)[1]
    daemon_b = env.start_daemon("B")
    b_io, a_io, uri, files, channel = _a_to_b(env, rel)

    def published():
        return b_io.meta.lengths([uri])[uri]

    def check_b(when):
        cache_length, durable_length = published()
        assert cache_length == seal_end, f"{when}: B's cache length {cache_length}; the file ends at {seal_end}"
        assert durable_length is None or durable_length <= seal_end, f"{when}: B's durable length {durable_length}"
        chunks = ChunkReader(b_io.data)
        assert b"".join(part for _, _, part in chunks.read(uri, 0, seal_end)) == source[:seal_end], when
        late = chunks.read(uri, seal_end, len(source))
        assert all(part is None for _, _, part in late), f"{when}: late bytes in B's data cache: {late}"
        held = env.files("B").get(rel)
        assert held is None or held == source[:len(held)] and len(held) <= seal_end, when

    try:
        # The source's read path knows the store's real size (the late block) before the copy starts.
        files.follow(rel)
        deadline = time.monotonic() + ARRIVE_S
        while files.lengths(rel) != (seal_end, len(source)):
            assert time.monotonic() < deadline, f"A's lengths {files.lengths(rel)}; expected ({seal_end}, {len(source)})"
            time.sleep(0.02)

        # Real readers copy the file; the cache copy in catch-up mode (a jump to the seal's chunk).
        _operations_to_b(env, a_io, files, channel, rel, storages, seal_end,
                         CopyDaemonOptions(lease_seconds=1.5, retry=0.05, catchup_bytes=1), "first")
        check_b("copied")
        assert metric(daemon_b, "errors_total", kind="delta_refused") == 0, f"a reader sent bytes after the seal\n{env.logs()}"

        # A reader that sends the late block all the same: each of B's writers refuses it alike.
        stub = copy_pb2_grpc.CopyStub(channel)
        for n, storage in enumerate(storages, 1):
            fields = dict(stream=env.stream, shard=0, file=name, shards=1, operation=f"late_{storage}",
                          source_cluster="A", storage=copy_pb2.DURABLE if storage == "durable" else copy_pb2.CACHE)
            acks = list(stub.Copy(iter([copy_pb2.CopyRequest(hello=True, **fields),
                                        copy_pb2.CopyRequest(start=seal_end, data=source[seal_end:], **fields)]),
                                  timeout=ARRIVE_S))
            assert [(a.status, a.length) for a in acks] == [(copy_pb2.OK, seal_end), (copy_pb2.FAILED, seal_end)], acks
            assert "nothing may follow the seal" in acks[1].message, acks[1].message
            assert metric(daemon_b, "errors_total", kind="delta_refused") == n, env.logs()
            check_b(f"late block sent to B's {storage} writer")

        # The daemons copy the shard (a cache-only copy gets its durable copy now, so that a
        # consumer of B finds the file): B's consumers read the messages before the seal, then
        # the next file's.
        env.start_daemon("A")
        assert consume_all(env, "B", 20) == values, env.logs()
        deadline = time.monotonic() + ARRIVE_S
        while env.files("B").get(rel) != source[:seal_end]:
            assert time.monotonic() < deadline, f"B holds {len(env.files('B').get(rel, b''))} bytes\n{env.logs()}"
            time.sleep(0.05)
        check_b("after the daemons' copy")
        assert metric(daemon_b, "errors_total", kind="delta_refused") == len(storages), env.logs()
    finally:
        channel.close()
        files.unfollow(rel)
        files.stop()
        a_io.close()
        b_io.close()


def test_a_cache_copy_resumed_past_the_seal_finishes(make_env, caches):
    """Review of c1e84cc: B's metadata cache holds a cache length inside a chunk its data cache
    lost (a data cache replica restarted), so B's cache writer answers a hello with the next
    chunk boundary (paper section 3: readers fetch the gap from the durable store) -- here past
    the end of A's sealed file (files smaller than a chunk, or sealed within one). The operation
    has nothing more to copy and must finish: _complete asked the seal rule only at positions the
    source's store reaches, so it waited forever (a worker slot held, the file never done)."""
    from pyspark_acs.cache.chunks import CHUNK_SIZE
    from pyspark_acs.cache.client import client_for
    from pyspark_acs.cache.metadata import MetadataCache
    from pyspark_acs.format.block import encode_block
    from pyspark_acs.server.copy.cluster import CACHE
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.write.shard import ShardWriter

    env = make_env(CHAIN, dests=("B",))
    store = DurableStore(env.roots["A"])
    store.create_stream(env.stream, 1)
    meta = MetadataCache(client_for(caches["A"].metadata_endpoints, "metadata cache", []))
    try:
        writer = ShardWriter(store, env.stream, 0, "w", meta=meta, lease_seconds=0.6)
        writer.acquire()
        writer.recover()
        for i in range(10):
            writer.append(encode_block([f"m{i}".encode() * 10], first_index=i), 1)
        rel = f"{shard_dir(env.stream, 0)}/{writer.file}"
        half = store.length(rel) // 2
        writer.close()  # sealed
    finally:
        meta.client.close()
        store.close()
    seal_end = len(env.files("A")[rel])
    assert seal_end < CHUNK_SIZE
    env.start_daemon("B")
    b_io, a_io, uri, files, channel = _a_to_b(env, rel)
    try:
        # B's lengths say a cache copy reached the middle of the file's first chunk; B's data
        # cache does not hold that chunk (lost with a restarted replica).
        b_io.meta.publish(uri, cache_length=half)
        _operations_to_b(env, a_io, files, channel, rel, (CACHE,), seal_end,
                         CopyDaemonOptions(lease_seconds=1.5, retry=0.05), "resumed")
        assert b_io.meta.lengths([uri])[uri][0] <= seal_end
    finally:
        channel.close()
        files.stop()
        a_io.close()
        b_io.close()


def _a_to_b(env, rel):
    """B's and A's cluster IO (this process), ``rel``'s URI at B, A's source files (its read
    path) and a channel to B's daemon: what a test needs to run copy operations of ``rel`` from
    A to B itself (:func:`_operations_to_b`) or to talk to B's writers."""
    import grpc

    from pyspark_acs.server.copy.cluster import ClusterIO
    from pyspark_acs.server.copy.reader import SourceFiles
    from pyspark_acs.server.copy.topology import load_topology

    topology = load_topology(env.topology)
    b_io = ClusterIO(topology.cluster("B"), cache_deadline=5.0)
    a_io = ClusterIO(topology.cluster("A"), cache_deadline=5.0)
    files = SourceFiles(a_io, interval=0.02)
    return b_io, a_io, b_io.uri(rel), files, grpc.insecure_channel(f"127.0.0.1:{env.ports['B']}")


def _operations_to_b(env, a_io, files, channel, rel, storages, seal_end, options, prefix) -> None:
    """Run one :class:`CopyOperation` per storage of ``rel`` from A to B (in this process, through
    ``files``, A's read path, and ``channel``, B's daemon) and check that each finishes."""
    import threading

    from pyspark_acs.server.copy.cluster import OpKey
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.proto import copy_pb2_grpc
    from pyspark_acs.server.copy.reader import CopyOperation

    name = rel.rsplit("/", 1)[1]
    ops = []
    for storage in storages:
        op = CopyOperation(OpKey(env.stream, 0, name, storage, "B"), 1, a_io, files,
                           lambda _child: copy_pb2_grpc.CopyStub(channel), options, CopyMetrics("A"),
                           prefix, is_source=True)
        thread = threading.Thread(target=op.run, daemon=True)
        thread.start()
        ops.append((op, thread))
    for op, thread in ops:
        thread.join(ARRIVE_S)
        running = thread.is_alive()
        op.stop()
        thread.join(10)
        assert not running and op.finished and not op.gave_up, (
            f"{op.key}: running={running} finished={op.finished} gave_up={op.gave_up} acked={op.acked}; "
            f"the file ends at {seal_end}\n{env.logs()}")


def _fresh(root: str, stream: str, count: int) -> list:
    """The values a fresh Consumer of the store reads once it has ``count``, and what one more
    poll finds."""
    from pyspark_acs.read.consumer import Consumer

    with Consumer(root, stream) as c:
        got = Collector(c)
        got.until(lambda: len(got.values) >= count, ARRIVE_S, f"{count} messages in {root}")
        return got.values + [v for b in c.poll() for v in b.column("value").to_pylist()]


def test_a_destination_file_locked_by_a_stopped_process_fails_the_copy_then_resumes(
        make_env, python_exe, subprocess_env):
    """A process stopped inside its append keeps the destination file's append lock (flock):
    B's copy writer must not append past it (the holder may still land the same bytes), so it
    answers FAILED after LOCK_WAIT_SECONDS (``errors_total{kind="durable_lock_busy"}``) and B's
    file stays a prefix of A's. Once the holder is gone, the copy resumes and B ends byte-exact."""

    env = make_env(CHAIN, dests=("B",))
    env.start_daemon("A")
    daemon_b = env.start_daemon("B")
    with env.producer(shards=1, roll_bytes=10_000_000) as p:
        produce(p, 0, 50)
        p.flush()
        env.wait_same("B")
        (rel,) = env.files("B")
        store_b = DurableStore(env.roots["B"])
        holder = subprocess.Popen([python_exe, "-c", LOCK_HOLDER, store_b.path(rel)], stdout=subprocess.PIPE,
                                  env=subprocess_env, text=True)
        try:
            assert holder.stdout.readline().strip() == "LOCKED"
            stop_process(holder)
            produce(p, 50, 100)
            p.flush()
            deadline = time.monotonic() + 30
            while metric(daemon_b, "errors_total", kind="durable_lock_busy") < 1:
                assert time.monotonic() < deadline, f"no FAILED append on the locked file\n{env.logs()}"
                time.sleep(0.2)
            env.check_prefixes("B")
            assert store_b.length(rel) < DurableStore(env.roots["A"]).length(rel)  # nothing went past the lock
        finally:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
            holder.wait(10)
            store_b.close()
    env.wait_same("B")
    check_order(consume_all(env, "B", 150), 150)
