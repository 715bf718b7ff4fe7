"""Many consumers joining a running stream at once, through real cache servers.

Sixteen consumer processes, started and imported beforehand, create their ``Consumer(...,
start="latest")`` at the same moment while a producer writes. Each reports what it read from
the durable store before and after it delivered its first message sent after the join, and the
sequence numbers it received. The checks are counts, not timings, so they hold on a busy
machine: a joining reader reads a few bytes, not the shard's newest file (which sixteen, or
sixty-four, readers reading at once turned into a storm of store reads), and every message
from where it joined on arrives once and in order.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from pyspark_acs import Consumer, Producer
from pyspark_acs.storage.store import DurableStore

from tests.helpers import deployments, wait_until

CONSUMERS = 16
#: Store bytes a consumer may read while it joins (the issue's bound: 1 MiB each).
JOIN_STORE_BYTES = 1024 * 1024
#: The stream's newest file holds this much before the join: reading it whole, as a join did,
#: would be far above the bound below.
BEFORE_JOIN_BYTES = 3 * 1024 * 1024
#: Bytes a consumer may read in all (cache and store) beyond the messages it delivers.
JOIN_OVERHEAD_BYTES = 256 * 1024
VALUE = b"x" * 1000

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from pyspark_acs import Consumer
    root, data, meta = sys.argv[1:4]
    print("ready", flush=True)
    sys.stdin.readline()  # the join: every consumer at once
    joined_us = time.time_ns() // 1000
    seqs, delivered, at_first_new = [], 0, None
    with Consumer(root, "j", start="latest", data_cache=data, metadata_cache=meta) as c:
        print("joined", flush=True)
        done = False
        while not done:
            for b in c.batches(timeout=30):
                values = b.column("value").to_pylist()
                for v in values:
                    if v == b"end":
                        done = True
                        break
                    seqs.append(int(v.split(b" ", 1)[0]))
                    delivered += len(v)
                if at_first_new is None and max(b.column("timestamp").cast("int64").to_pylist()) > joined_us:
                    at_first_new = c.stats()
                if done:
                    break
            else:
                break  # 30 s without a message: report what came
        end = c.stats()
    print(json.dumps({"seqs": seqs, "delivered": delivered, "first_new": at_first_new, "end": end,
                      "done": done}), flush=True)
    """
)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    with deployments(tmp_path_factory.mktemp("caches"), clusters=("A",), replicas=3, capacity="256MiB") as deps:
        dep = deps["A"]
        _SERVERS[:] = [dep]
        yield {"data_cache": dep.data_endpoints, "metadata_cache": dep.metadata_endpoints}


#: The deployment of the module's caches (for their /metrics).
_SERVERS: list = []
_CALLS = re.compile(r'^acs_cache_request_seconds_count\{[^}]*method="(\w+)"[^}]*\} (\S+)$', re.M)


def _calls(role: str) -> dict:
    """Requests the ``role`` servers handled so far, by method (from their /metrics)."""
    counts: dict = {}
    for server in _SERVERS[0].servers[role]:
        text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        for method, value in _CALLS.findall(text):
            counts[method] = counts.get(method, 0.0) + float(value)
    return counts


def test_a_join_at_latest_asks_the_data_cache_nothing_and_watches_nothing(root, caches):
    """A reader joining a running stream at latest, through a feed, takes its look for a seal
    from the feed's first push (no Get), covers the file before its first poll round (no Watch
    calls that go idle at once) and opens no data-cache channel beyond the one the feed follows
    on: each of these was a round trip or a connection per reader that sixty-four readers
    joining at once paid on a starved machine."""
    DurableStore(root).create_stream("g", 1)
    with Producer(root, "g", shards=1, **caches) as p:
        for i in range(50):
            p.send_many([b"%d " % (i * 20 + k) + VALUE for k in range(20)])
            p.flush(timeout=30)
        data0, meta0 = _calls("data"), _calls("metadata")
        with Consumer(root, "g", start="latest", **caches) as c:
            p.send(b"after")
            p.flush(timeout=30)
            got = [v for b in c.batches(timeout=10) for v in b.column("value").to_pylist()]
            wait_until(lambda: got.extend(v for b in c.poll() for v in b.column("value").to_pylist())
                       or b"after" in got, timeout=30, what="the message sent after the join")
            assert got == [b"after"]  # latest: nothing from before the join
            assert c.stats()["durable_bytes"] == 0
            feed = c.path.feed
            assert sum(rep.channel is not None for rep in feed.client._replicas.values()) == 1
            assert not c.path.poller._streams  # no Watch stream: the feed covers the file
        data1, meta1 = _calls("data"), _calls("metadata")
    assert data1.get("Get", 0) == data0.get("Get", 0), (data0, data1)
    assert data1.get("Health", 0) == data0.get("Health", 0), (data0, data1)
    assert meta1.get("Watch", 0) == meta0.get("Watch", 0), (meta0, meta1)


def test_sixteen_consumers_join_a_running_stream_at_once(root, caches, subprocess_env):
    DurableStore(root).create_stream("j", 1)
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, root, caches["data_cache"], caches["metadata_cache"]],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=subprocess_env)
                for _ in range(CONSUMERS)]
    try:
        for child in children:
            assert child.stdout.readline().strip() == b"ready"
        sent = [0]
        stop = threading.Event()
        errors = []

        def produce() -> None:
            try:
                while not stop.is_set():
                    p.send_many([b"%d " % (sent[0] + i) + VALUE for i in range(20)])
                    sent[0] += 20
                    p.flush(timeout=30)
                    time.sleep(0.005)
            except BaseException as exc:  # raised in the test below
                errors.append(exc)

        with Producer(root, "j", shards=1, roll_bytes=64 * 1024 * 1024, **caches) as p:
            writer = threading.Thread(target=produce, daemon=True)
            writer.start()
            wait_until(lambda: sent[0] * len(VALUE) >= BEFORE_JOIN_BYTES or errors, timeout=60,
                       what="the producer's first megabytes")
            for child in children:  # the join
                child.stdin.write(b"go\n")
            for child in children:
                child.stdin.flush()
            for child in children:  # the producer goes on until every one has joined, and after
                assert child.stdout.readline().strip() == b"joined"
            time.sleep(0.5)
            stop.set()
            writer.join(30)
            assert not errors, errors
            p.send(b"end")
            p.flush(timeout=30)
        reports = [json.loads(child.communicate(timeout=120)[0]) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    last = sent[0] - 1
    for i, r in enumerate(reports):
        assert r["done"], f"consumer {i} did not reach the end: {len(r['seqs'])} messages"
        seqs = r["seqs"]
        # From where it joined on, every message, once and in order, up to the last one sent.
        assert seqs and seqs == list(range(seqs[0], last + 1)), f"consumer {i}: not the history's suffix"
        assert r["first_new"] is not None, f"consumer {i} delivered no message sent after the join"
        joined_store = r["first_new"]["durable_bytes"]
        assert joined_store <= JOIN_STORE_BYTES, f"consumer {i} read {joined_store} store bytes joining"
        assert r["end"]["durable_bytes"] == joined_store, (
            f"consumer {i} read {r['end']['durable_bytes'] - joined_store} store bytes after it caught up")
        read = r["end"]["cache_bytes"] + r["end"]["durable_bytes"]
        assert read <= r["delivered"] + JOIN_OVERHEAD_BYTES + 64 * len(seqs), (
            f"consumer {i} read {read} bytes to deliver {r['delivered']}")
