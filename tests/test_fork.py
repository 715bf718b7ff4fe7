"""A process forked while it had gRPC channels open (``multiprocessing``'s default start method
on Linux): a Consumer, cache client or Producer used in the child raises ForkError naming both
processes and the remedy, instead of hanging in gRPC's core (8 of 8 children hung before) or
queueing messages no writer thread writes. A child forked from a process with no channel open
uses the caches as any process does.

The scenario runs in a fresh interpreter (the pytest process holds channels of other tests)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r'''
import json, multiprocessing, os, sys, time
from pyspark_acs import Consumer, Producer
from pyspark_acs.cache.client import CacheClient
from pyspark_acs.errors import ForkError
from pyspark_acs.server.local.deploy import LocalDeployment

base = sys.argv[1]
root = os.path.join(base, "store")
ctx = multiprocessing.get_context("fork")
results = {}


def in_child(name, job):
    """Run job in a forked child; record what it returned or raised (or that it hung)."""
    q = ctx.Queue()

    def run():
        try:
            q.put(("ok", job()))
        except ForkError as exc:
            q.put(("ForkError", [str(exc), exc.parent_pid, os.getpid()]))
        except BaseException as exc:
            q.put((type(exc).__name__, str(exc)))

    p = ctx.Process(target=run)
    p.start()
    p.join(20)
    if p.is_alive():
        p.kill()
        results[name] = ["hung"]
    else:
        results[name] = list(q.get(timeout=5)) if not q.empty() else ["exit", p.exitcode]


def round_trip(kw, stream):
    with Producer(root, stream, **kw) as p:
        p.send(b"hello")
        p.flush()
    with Consumer(root, stream, **kw) as c:
        return [v.decode() for b in c.batches(timeout=3) for v in b.column("value").to_pylist()]


# A child forked before any channel is open: the caches work there (its own channels).
endpoints = ctx.Queue()
clean = ctx.Process(target=lambda: endpoints.put(round_trip(endpoints.get(), "clean")))
clean.start()
with LocalDeployment(os.path.join(base, "caches"), data_replicas=1, metadata_replicas=1) as dep:
    kw = dict(data_cache=dep.data_endpoints, metadata_cache=dep.metadata_endpoints)
    endpoints.put(kw)
    clean.join(60)
    results["clean child"] = ["ok", endpoints.get(timeout=5)] if clean.exitcode == 0 else ["exit", clean.exitcode]

    producer = Producer(root, "s", **kw)
    producer.send(b"one")
    producer.flush()
    consumer = Consumer(root, "s", **kw)
    results["parent"] = [v.decode() for b in consumer.batches(timeout=1) for v in b.column("value").to_pylist()]
    results["parent pid"] = os.getpid()

    in_child("new consumer", lambda: round_trip(kw, "t"))
    in_child("new client", lambda: CacheClient(dep.data_endpoints).get([b"k"]))
    in_child("parent's producer send", lambda: producer.send(b"two"))
    in_child("parent's producer flush", lambda: producer.flush(timeout=5))
    in_child("parent's consumer", lambda: [b.num_rows for b in consumer.batches(timeout=3)])

    producer.send(b"two")  # the parent goes on as before
    producer.flush()
    results["parent after"] = [v.decode() for b in consumer.batches(timeout=1) for v in b.column("value").to_pylist()]
    producer.close()
    consumer.close()
print(json.dumps(results))
'''


def test_a_child_forked_with_channels_open_is_told_so_and_a_clean_child_works(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["clean child"] == ["ok", ["hello"]]
    assert results["parent"] == ["one"]
    assert results["parent after"] == ["two"]
    parent = results["parent pid"]
    for name in ("new consumer", "new client", "parent's producer send", "parent's producer flush",
                 "parent's consumer"):
        kind, *rest = results[name]
        assert kind == "ForkError", (name, results[name])
        message, parent_pid, child_pid = rest[0]
        assert parent_pid == parent, (name, rest)
        assert f"process {child_pid} was forked from process {parent}" in message
        assert "'spawn' or 'forkserver'" in message
    assert "which made it at the fork" in results["parent's producer send"][1][0]
    assert "gRPC channels open" in results["new consumer"][1][0]
