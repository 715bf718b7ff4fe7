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


def read(consumer, n):
    """The values ``consumer`` reads once it has ``n`` (at most 30 s), and what one more poll finds."""
    values, deadline = [], time.monotonic() + 30
    while len(values) < n and time.monotonic() < deadline:
        values += [v.decode() for b in consumer.poll() for v in b.column("value").to_pylist()]
        time.sleep(0.01)
    return values + [v.decode() for b in consumer.poll() for v in b.column("value").to_pylist()]


def round_trip(kw, stream):
    with Producer(root, stream, **kw) as p:
        p.send(b"hello")
        p.flush()
    with Consumer(root, stream, **kw) as c:
        return read(c, 1)


results["parent pid"] = os.getpid()
if sys.argv[2] == "opening":
    # Forked while another thread makes the process's first channel (holding the client's
    # lock): the child is told so, and neither a call nor close() waits on that lock.
    import threading
    from pyspark_acs._grpc import grpc

    real, started = grpc.insecure_channel, threading.Event()

    def slow(*args, **kwargs):
        started.set()
        time.sleep(1.0)
        return real(*args, **kwargs)

    grpc.insecure_channel = slow
    client = CacheClient("127.0.0.1:9", deadline=1)
    maker = threading.Thread(target=lambda: client._stub(client._replicas["127.0.0.1:9"]))
    maker.start()
    started.wait(5)
    in_child("get", lambda: client.get([b"k"]))
    in_child("close", lambda: [client.close(), "closed"][1])
    maker.join()
    print(json.dumps(results))
    sys.exit(0)
if sys.argv[2] == "server":
    # A process that runs a cache server in it, with no client channel, has gRPC open too.
    from pyspark_acs.server.cache.server import CacheServer

    server = CacheServer("data", host="127.0.0.1", port=0, metrics_port=None)
    server.start()
    in_child("beside a server", lambda: CacheClient(f"127.0.0.1:{server.port}", deadline=3).get([b"k"]))
    server.stop()
    print(json.dumps(results))
    sys.exit(0)

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
    results["parent"] = read(consumer, 1)
    results["parent pid"] = os.getpid()

    in_child("new consumer", lambda: round_trip(kw, "t"))
    in_child("new client", lambda: CacheClient(dep.data_endpoints).get([b"k"]))
    in_child("parent's producer send", lambda: producer.send(b"two"))
    in_child("parent's producer flush", lambda: producer.flush(timeout=5))
    in_child("parent's consumer", lambda: [b.num_rows for b in consumer.batches(timeout=3)])
    in_child("parent's producer stats", lambda: producer.stats())
    in_child("closing a parent's client", lambda: [consumer.path.data.close(), "closed"][1])

    producer.send(b"two")  # the parent goes on as before
    producer.flush()
    results["parent after"] = read(consumer, 1)
    producer.close()
    consumer.close()
print(json.dumps(results))
'''


def _run(tmp_path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _refused(result, parent: int) -> str:
    kind, *rest = result
    assert kind == "ForkError", result
    message, parent_pid, child_pid = rest[0]
    assert parent_pid == parent, rest
    assert f"process {child_pid} was forked from process {parent}" in message
    assert "'spawn' or 'forkserver'" in message
    return message


def test_a_child_forked_with_channels_open_is_told_so_and_a_clean_child_works(tmp_path):
    results = _run(tmp_path, "main")
    assert results["clean child"] == ["ok", ["hello"]]
    assert results["parent"] == ["one"]
    assert results["parent after"] == ["two"]
    parent = results["parent pid"]
    assert results["closing a parent's client"] == ["ok", "closed"]  # dropped, not closed: that hangs
    for name in ("new consumer", "new client", "parent's producer send", "parent's producer flush",
                 "parent's consumer", "parent's producer stats"):
        _refused(results[name], parent)
    assert "which made it at the fork" in results["parent's producer send"][1][0]
    assert "had gRPC open at the fork" in results["new consumer"][1][0]


def test_a_child_forked_beside_an_in_process_cache_server_is_told_so(tmp_path):
    """A server is gRPC open as a channel is: the child's first call hung (3 of 3, the review)."""
    results = _run(tmp_path, "server")
    assert "had gRPC open at the fork" in _refused(results["beside a server"], results["parent pid"])


def test_a_child_forked_while_a_channel_is_being_made_is_told_so_without_waiting_on_its_lock(tmp_path):
    """The thread making the channel holds the client's lock at the fork: a check after the
    lock hung the child (the second review)."""
    results = _run(tmp_path, "opening")
    assert "had gRPC open at the fork" in _refused(results["get"], results["parent pid"])
    assert results["close"] == ["ok", "closed"]
