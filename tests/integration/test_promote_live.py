"""Losing the source cluster and promoting a destination (``acs promote``), against real
processes: cache servers per cluster, copy daemons started as users start them, a producer in
its own process, consumers already following in B and C before the fault.

The invariant (tests/helpers.py ``check_histories``): each consumer's sequence per shard is a
prefix of the one history (what a fresh reader of the new source reads after quiescence),
every acknowledged message is in it, and after quiescence every consumer has all of it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import List

import pytest

from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.producer import Producer

from tests.helpers import (
    ROOT, LiveConsumer, ProducerProcess, check_histories, metric, msg, read_history, wait_until,
)
from tests.integration.test_cross_cluster import make_env  # noqa: F401 (the fixture: clusters of one test)

pytestmark = pytest.mark.slow

QUIET_S = 60.0


def _lengths(root: str, stream: str) -> list:
    """(file, length) of every file of the stream's shards in ``root``."""
    store = DurableStore(root)
    try:
        return [f for shard in range(store.stream_shards(stream) or 0) for f in store.list_file_lengths(stream, shard)]
    finally:
        store.close()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP takes effect asynchronously)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _quiet(root: str, stream: str, live: List[LiveConsumer], acknowledged, timeout: float = QUIET_S):
    deadline = time.monotonic() + timeout
    while True:
        history = read_history(root, stream)
        try:
            check_histories(history, live, acknowledged)
            return history
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_source_lost_promote_b_the_producer_resumes_there_and_readers_keep_following(make_env, caches):
    """Chain A -> B -> C; consumers follow in B and C; a producer process in A acknowledges
    messages with clusters:2. Right after, every process of A is SIGKILLed (its producer, its
    copy daemon) and its store is gone. ``acs promote`` (the command, as a user runs it) makes B the
    source; a Producer in B writes on. Every acknowledged message reaches both consumers once,
    in order per shard. Then A comes back: a producer writing there reaches nobody but a
    consumer in A, and A's daemon, back with the topology from before, reaches nobody; A
    quarantines what it wrote past the cut (``acs status`` and a metric name it), that consumer
    gets the DataLossError naming it, and A holds the new history."""
    env = make_env(caches)
    old_topology = env.tmp / "topology-before.json"
    shutil.copy(env.topology, old_topology)
    for c in "ABC":
        env.start_daemon(c)
    live = [LiveConsumer(env, c) for c in "BC"]
    acknowledged: List[bytes] = []
    pa = ProducerProcess(env, "a", acknowledge="clusters:2")
    try:
        for _ in range(6):
            assert pa.send(50, size=600), pa.errors
        acknowledged += pa.acknowledged
        # C holds the stream before the fault, so the promotion fences it (a loaded machine can
        # take seconds for C's first copy; clusters:2 waits for B only).
        wait_until(lambda: _lengths(env.roots["C"], env.stream), timeout=60, what="C to hold the stream")
        # A is lost right after (no wait for the copies: clusters:2 is the wait): every process
        # of it killed mid-file (its newest files stay unsealed), then its store.
        pa.kill()
        env.kill_daemon("A")
        lost = env.roots["A"] + ".lost"
        os.rename(env.roots["A"], lost)

        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pyspark_acs.cli", "promote", env.stream, "--to", "B",
                               "--topology", str(env.topology), "--timeout", "30", "--json"],
                              capture_output=True, text=True, cwd=ROOT, timeout=90)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        promoted = time.monotonic()
        assert report["source"] == "B" and report["epoch"] == 1
        assert report["daemons"]["B"] == report["daemons"]["C"] == "runs the new topology"
        assert "not reachable" in report["daemons"]["A"] and "A" in report["unreachable"]
        assert "acs promote: fenced epoch 1 in B, C" in done.stderr

        with Producer(env.roots["B"], env.stream, data_cache=caches["B"].data_endpoints,
                      metadata_cache=caches["B"].metadata_endpoints, shards=2, roll_bytes=20_000) as pb:
            for i in range(300):
                pb.send(msg(i, b"b"), key=str(i % 5).encode())
                if i % 50 == 49:
                    pb.flush(timeout=30)
                    acknowledged += [msg(j, b"b") for j in range(i - 49, i + 1)]
            first_b = msg(0, b"b")
            first_new = wait_until(lambda: any(first_b in vs for vs in live[1].snapshot().values())
                                   and time.monotonic(), 60, "a message written in B after the promotion, in C")
        history = _quiet(env.roots["B"], env.stream, live, acknowledged)
        assert sum(map(len, history.values())) == len(acknowledged)
        print(f"promote took {promoted - started:.2f} s; first new message in C {first_new - promoted:.2f} s after it")
        meta_c = DurableStore(env.roots["C"]).stream_meta(env.stream)
        assert meta_c["epoch"] == 1 and meta_c["promotions"][-1]["state"] == "cut"

        # A comes back and writes on before its daemon runs (a consumer there reads it). Then its
        # daemon comes back with the old topology: its copies are refused (the fence), and B's
        # daemon, feeding A by the new topology, has A quarantine what it wrote past the cut.
        os.rename(lost, env.roots["A"])
        live_a = LiveConsumer(env, "A")
        live.append(live_a)
        pa2 = ProducerProcess(env, "stale")
        try:
            assert pa2.send(50, size=600), pa2.errors
        finally:
            pa2.kill()
        wait_until(lambda: any(v.startswith(b"stale-") for vs in live_a.snapshot().values() for v in vs), 60,
                   "A's consumer reading what A wrote after the cut")
        env.start_daemon("A", "--topology", str(old_topology))
        meta_a = wait_until(lambda: (DurableStore(env.roots["A"]).stream_meta(env.stream) or {}).get("quarantined")
                            and DurableStore(env.roots["A"]).stream_meta(env.stream), 90, "A's quarantine")
        final = _quiet(env.roots["B"], env.stream, live[:2], acknowledged)
        assert final == history, "a copy from the old source reached the new history"
        for c in "BC":
            assert not any(v.startswith(b"stale-") for vs in read_history(env.roots[c], env.stream).values() for v in vs)

        # A's daemon runs the new topology: the quarantine is reported (the metric from its
        # _stream.json at start), its consumer that read A's tail is told which bytes, and A
        # holds the new history.
        env.kill_daemon("A")
        env.start_daemon("A")
        assert meta_a["epoch"] == 1 and meta_a["copied_from"] == "B"
        moved = sum(e["end"] - e["start"] for e in meta_a["quarantined"])
        wait_until(lambda: metric(env.daemons["A"][0], "quarantined_bytes") == moved, 30, "A's quarantined_bytes")
        status = subprocess.run([sys.executable, "-m", "pyspark_acs.cli", "status", "--root", env.roots["A"],
                                 "--json", "--data-cache", "none", "--metadata-cache", "none"],
                                capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert status.returncode == 0, status.stderr
        shown = [q for st in json.loads(status.stdout)["streams"] for sh in st["shards"] for q in sh["quarantined"]]
        assert sorted(q["file"] for q in shown) == sorted(e["file"] for e in meta_a["quarantined"])
        wait_until(lambda: live_a.errors, 60, "A's consumer's DataLossError")
        assert "DataLossError" in live_a.errors[0], live_a.errors
        assert "a history that did not happen" in live_a.errors[0], live_a.errors
        assert any(f"file {e['file']}" in live_a.errors[0] for e in meta_a["quarantined"]), live_a.errors
        wait_until(lambda: read_history(env.roots["A"], env.stream) == final, 60, "A holding the new history")
        assert not any(v.startswith(b"stale-") for vs in read_history(env.roots["A"], env.stream).values() for v in vs)
    finally:
        pa.kill()
        for c in live:
            c.stop()


def test_a_partitioned_source_writer_acknowledges_nothing_after_the_promotion(make_env, caches):
    """Chain A -> B -> C; a producer process in A acknowledges with clusters:2. Every process of
    A is SIGSTOPped while its producer is mid-flush (its bytes in A's store, not copied), and A's store is out of the promoter's
    reach (a partition); B is promoted and written. Then A resumes (SIGCONT, its store back):
    no clusters:2 flush of A's writer is acknowledged after the promotion, what it wrote lands
    in A's quarantined range (reported in A's _stream.json and by its daemon's metric), and
    every clusters:2-acknowledged message is in the new history, which B and C deliver once in
    order and A holds in the end."""
    env = make_env(caches)
    for c in "ABC":
        env.start_daemon(c)
    live = [LiveConsumer(env, c) for c in "BC"]
    pa = ProducerProcess(env, "a", acknowledge="clusters:2", flush_timeout=5)
    acknowledged: List[bytes] = []
    try:
        for _ in range(4):
            assert pa.send(50, size=600), pa.errors
        # The partition: A's daemon first (its copies stop), then its producer mid-flush, once
        # the flush's bytes are in A's store (appended, waiting for clusters:2).
        for proc in env.daemons["A"]:
            proc.send_signal(signal.SIGSTOP)
        for proc in env.daemons["A"]:  # stopped, not just signalled
            wait_until(lambda pid=proc.pid: _stopped(pid), 10, f"A's daemon {proc.pid} stopped")
        before = sum(n for _, n in _lengths(env.roots["A"], env.stream))
        pa.start_send(50, size=600)
        wait_until(lambda: sum(n for _, n in _lengths(env.roots["A"], env.stream)) > before, 30,
                   "the pending flush's bytes in A's store")
        pa.pause()
        wait_until(lambda: _stopped(pa.proc.pid), 10, "A's producer stopped")
        lost = env.roots["A"] + ".lost"
        os.rename(env.roots["A"], lost)
        done = subprocess.run([sys.executable, "-m", "pyspark_acs.cli", "promote", env.stream, "--to", "B",
                               "--topology", str(env.topology), "--timeout", "30", "--json"],
                              capture_output=True, text=True, cwd=ROOT, timeout=90)
        assert done.returncode == 0, done.stderr
        with Producer(env.roots["B"], env.stream, data_cache=caches["B"].data_endpoints,
                      metadata_cache=caches["B"].metadata_endpoints, shards=2, roll_bytes=20_000) as pb:
            for i in range(100):
                pb.send(msg(i, b"b"), key=str(i % 5).encode())
            pb.flush(timeout=30)
        os.rename(lost, env.roots["A"])
        for proc in env.daemons["A"]:
            proc.send_signal(signal.SIGCONT)
        pa.resume()
        assert not pa.result(timeout=30), "the pending flush was acknowledged: nothing could confirm it"
        before = len(pa.acknowledged)
        assert not pa.send(50, size=600), "a clusters:2 flush in A was acknowledged after the promotion"
        assert len(pa.acknowledged) == before
        acknowledged = list(pa.acknowledged) + [msg(i, b"b") for i in range(100)]
        meta_a = wait_until(lambda: (DurableStore(env.roots["A"]).stream_meta(env.stream) or {}).get("quarantined")
                            and DurableStore(env.roots["A"]).stream_meta(env.stream), 90, "A's quarantine")
        assert meta_a["copied_from"] == "B" and meta_a["epoch"] == 1
        moved = sum(e["end"] - e["start"] for e in meta_a["quarantined"])
        wait_until(lambda: metric(env.daemons["A"][0], "quarantined_bytes") == moved, 30, "A's quarantined_bytes")
        history = _quiet(env.roots["B"], env.stream, live, acknowledged)
        wait_until(lambda: read_history(env.roots["A"], env.stream) == history, 60, "A holding the new history")
        print(f"quarantined in A: {moved} bytes")
    finally:
        pa.kill()
        for c in live:
            c.stop()
