"""``acknowledge="clusters:K"`` against real copy daemons: a flush returns once the bytes are
durable in K clusters (the source and K-1 destinations, as the daemons confirm in the source's
metadata cache), times out naming the destinations that did not confirm, and is refused
without a metadata cache."""

from __future__ import annotations

import signal
import time

import pytest

from pyspark_acs.errors import AcsOptionError, AcsTimeoutError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.producer import Producer

from tests.helpers import msg, wait_until
from tests.integration.test_cross_cluster import make_env  # noqa: F401 (the fixture: clusters of one test)

pytestmark = pytest.mark.slow


def _durable(env, cluster: str, rels) -> dict:
    store = DurableStore(env.roots[cluster])
    try:
        return store.lengths(list(rels))
    finally:
        store.close()


def test_clusters_k_flush_returns_once_k_clusters_hold_the_bytes(make_env, caches):
    """Chain A -> B -> C. clusters:2 and clusters:3 flushes return with the bytes durable in
    that many clusters (C's confirmation comes from B's daemon, straight to A's cache). With
    C's daemon stopped, clusters:2 still returns (B holds them) and clusters:3 times out,
    naming C and how far it confirmed; resumed, C confirms and the flush returns."""
    env = make_env(caches)
    for c in "ABC":
        env.start_daemon(c)
    kw = dict(data_cache=caches["A"].data_endpoints, metadata_cache=caches["A"].metadata_endpoints, shards=1)
    with Producer(env.roots["A"], env.stream, acknowledge="clusters:3", **kw) as p3:
        for i in range(20):
            p3.send(msg(i))
            p3.flush(timeout=60)
            rel = f"{shard_dir(env.stream, 0)}/{p3.current_files()[0]}"
            end = _durable(env, "A", [rel])[rel]  # the flush returned: all of it is acknowledged
            held = _durable(env, "B", [rel]), _durable(env, "C", [rel])
            assert all((h.get(rel) or 0) >= end for h in held), (i, end, held)
    with Producer(env.roots["A"], env.stream, acknowledge="clusters:2", **kw) as p2:
        p2.send(msg(100))
        p2.flush(timeout=60)
        for proc in env.daemons["C"]:
            proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(5):
                p2.send(msg(101 + i))
                p2.flush(timeout=60)  # B alone confirms
        finally:
            for proc in env.daemons["C"]:
                proc.send_signal(signal.SIGCONT)
    with Producer(env.roots["A"], env.stream, acknowledge="clusters:3", **kw) as p3:
        for proc in env.daemons["C"]:
            proc.send_signal(signal.SIGSTOP)
        try:
            p3.send(msg(200))
            started = time.monotonic()
            with pytest.raises(AcsTimeoutError, match=r"clusters:3.*not confirmed in time: B confirmed everything. C confirmed .*not at all"):
                p3.flush(timeout=2)
            assert time.monotonic() - started < 10
        finally:
            for proc in env.daemons["C"]:
                proc.send_signal(signal.SIGCONT)
        p3.flush(timeout=60)  # C caught up


def test_clusters_k_needs_a_metadata_cache_and_a_valid_k(tmp_path):
    with pytest.raises(AcsOptionError, match=r"acknowledge: 'clusters:2' needs the metadata cache"):
        Producer(str(tmp_path / "root"), "s", acknowledge="clusters:2")
    with pytest.raises(AcsOptionError, match=r"K in 'clusters:K' is a whole number from 1 to 64"):
        Producer(str(tmp_path / "root"), "s", acknowledge="clusters:two")
    with pytest.raises(AcsOptionError, match=r"'clusters:K'"):
        Producer(str(tmp_path / "root"), "s", acknowledge="all")


def test_clusters_k_without_a_source_daemon_says_so(tmp_path, caches):
    """No copy daemon in the source cluster put the stream's destinations: the flush's
    timeout says what to run."""
    p = Producer(str(tmp_path / "root"), "lonely", shards=1, acknowledge="clusters:2",
                 data_cache=caches["A"].data_endpoints, metadata_cache=caches["A"].metadata_endpoints)
    p.send(b"x")
    with pytest.raises(AcsTimeoutError, match="no copy daemon of this cluster has put the stream's destinations"):
        p.flush(timeout=0.5)
    with pytest.raises(AcsTimeoutError, match="close of stream 'lonely'.*no copy daemon"):
        p.close(timeout=0.5)


def test_a_sink_commit_with_clusters_k_returns_once_k_clusters_hold_the_batch(make_env, caches):
    """The Spark sink's driver commit (AcsStreamWriter, without Spark's engine) with
    acknowledge=clusters:2: the commit returns with the batch durable in B; with B's and C's
    daemons stopped it fails after ackTimeout naming them, the batch is not committed, and
    its retry appends nothing twice and returns once they confirm."""
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

    from pyspark_acs.datasource.options import parse_sink_options
    from pyspark_acs.datasource.sink import AcsStreamWriter

    env = make_env(caches)
    for c in "ABC":
        env.start_daemon(c)
    schema = StructType([StructField("shard", IntegerType()), StructField("value", BinaryType())])
    opts = {"root": env.roots["A"], "stream": env.stream, "shards": "1", "checkpointLocation": "/ck/clusters",
            "metadataCache": caches["A"].metadata_endpoints, "dataCache": caches["A"].data_endpoints,
            "acknowledge": "clusters:2", "ackTimeout": "2s"}
    w = AcsStreamWriter(parse_sink_options(opts), schema)

    def rows(*values):
        return iter([pa.RecordBatch.from_arrays([pa.array([0] * len(values), pa.int32()),
                                                 pa.array(list(values), pa.binary())], names=["shard", "value"])])

    w.commit([w.write(rows(b"b0-0", b"b0-1"))], 0)
    rel = f"{shard_dir(env.stream, 0)}/" + DurableStore(env.roots["A"]).list_files(env.stream, 0)[-1]
    assert _durable(env, "B", [rel])[rel] == _durable(env, "A", [rel])[rel]
    for c in "BC":
        for proc in env.daemons[c]:
            proc.send_signal(signal.SIGSTOP)
    try:
        staged = [w.write(rows(b"b1-0"))]
        with pytest.raises(AcsTimeoutError, match=r"batch 1 .*clusters:2.*not confirmed in time"):
            w.commit(staged, 1)
    finally:
        for c in "BC":
            for proc in env.daemons[c]:
                proc.send_signal(signal.SIGCONT)
    w.commit([w.write(rows(b"b1-again"))], 1)  # Spark's retry of batch 1: completes its intent
    from tests.helpers import read_history

    assert read_history(env.roots["A"], env.stream)[0] == [b"b0-0", b"b0-1", b"b1-0"]
    with pytest.raises(AcsOptionError, match="acknowledge: 'clusters:2' needs the metadata cache"):
        AcsStreamWriter(parse_sink_options({k: v for k, v in opts.items() if k != "metadataCache"}), schema)


def test_close_of_a_clusters_k_producer_is_bounded_and_an_exception_does_not_wait(tmp_path, caches):
    """Review finding: a destination gone (the case clusters:K exists for), close() waited for
    its confirmation for ever. It waits at most its timeout (CLOSE_CONFIRM_S without one) after
    sealing, naming what is unconfirmed; a with block left by an exception does not wait."""
    from pyspark_acs.cache.client import CacheClient
    from pyspark_acs.cache.metadata import MetadataCache

    kw = dict(shards=1, acknowledge="clusters:2", data_cache=caches["A"].data_endpoints,
              metadata_cache=caches["A"].metadata_endpoints)
    p = Producer(str(tmp_path / "root"), "s", **kw)
    meta = MetadataCache(CacheClient(caches["A"].metadata_endpoints))
    try:
        meta.set_destinations(p.store.uri("s"), ["B"])  # as the source's daemon does; B never confirms
        p.send(b"x")
        with pytest.raises(AcsTimeoutError):
            p.flush(timeout=0.5)
        started = time.monotonic()
        with pytest.raises(AcsTimeoutError, match=r"close of stream 's'.*B confirmed"):
            p.close(timeout=1)
        assert time.monotonic() - started < 5
        assert DurableStore(str(tmp_path / "root")).list_files("s", 0)  # sealed and released meanwhile
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="the caller's own error"):
            with Producer(str(tmp_path / "root"), "s", **kw) as p2:
                p2.send(b"y")
                raise RuntimeError("the caller's own error")
        assert time.monotonic() - started < 5
    finally:
        meta.client.close()


def test_a_lost_confirmation_of_a_sealed_file_is_sent_again(make_env, caches):
    """Review finding: A's metadata cache lost B's confirmation of a file already copied whole
    and sealed (a restarted cache comes back empty); no operation runs for that file again.
    The daemons send their recent confirmations again (confirm_resend), so the flush returns."""
    from pyspark_acs.cache.client import CacheClient
    from pyspark_acs.cache.metadata import MetadataCache, confirm_key
    from tests.helpers import DAEMON_SETTINGS

    env = make_env(caches, dests=("B",), settings=DAEMON_SETTINGS + ["confirm_resend=1s"])
    env.start_daemon("A")
    env.start_daemon("B")
    kw = dict(data_cache=caches["A"].data_endpoints, metadata_cache=caches["A"].metadata_endpoints, shards=1)
    meta = MetadataCache(CacheClient(caches["A"].metadata_endpoints))
    try:
        with Producer(env.roots["A"], env.stream, acknowledge="clusters:2", roll_bytes=1, **kw) as p:
            p.send(msg(1))  # one block, then the file rolls (sealed)
            p.flush(timeout=30)
            rel = f"{shard_dir(env.stream, 0)}/" + DurableStore(env.roots["A"]).list_files(env.stream, 0)[0]
            uri = p.store.uri(rel)
            wait_until(lambda: meta.confirmations([uri], ["B"])[uri].get("B") == _durable(env, "A", [rel])[rel],
                       30, "B's confirmation of the sealed file")
            meta.client.delete([confirm_key(uri, "B")])  # the cache lost it
            # What the flush of that file waits for again (B holds every byte durably).
            p._confirm(({uri: _durable(env, "A", [rel])[rel]}, []), time.monotonic() + 10)
    finally:
        meta.client.close()
