"""Cache read throughput: CacheClient + our gRPC cache server vs redis-server MGET.

Both hold the same 4 KiB chunks under the same keys; both are read in batches of ``--batch``
keys (one batched Get RPC per replica / one MGET), from 1 and from ``--threads`` client
threads. Prints MB/s and chunk gets per second for each, and the ratio ours / redis.

Our figures come in two set-ups: one server with ``replication=1`` (the like-for-like
comparison with one redis-server) and three replicas with ``replication=3`` relaxed reads
(the production path: each batch is split over the three replicas, in parallel). A third set-up
is the grpcio floor (``_grpc_floor.py``): the same grpcio answering each batch with pre-built
bytes and doing nothing else, so the ratios show which part of a gap to Redis is the fixed
transport's and which is ours.

redis-server is started here on a free loopback port (``--save '' --appendonly no``) and
stopped at the end. Without it (or without the ``redis`` Python client) only our figures are
printed, with how to install the missing piece.

Then a Producer alone with ``send_many`` (through the caches, through the store alone, and
redis-py XADD pipelined as the peer), and the delivery delay p50/p99 of Producer -> Consumer
through the caches at a fixed rate
(default 2000 msg/s of 1 KiB for 5 s), and of the same Producer -> Consumer through the
durable store alone, in the same run.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/cache_throughput.py [--seconds 3] [--delay-only]
Takes well under two minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _grpc_floor  # noqa: E402
from _common import RedisServer  # noqa: E402
from pyspark_acs.cache.client import CacheClient  # noqa: E402
from pyspark_acs.server.local.deploy import LocalDeployment  # noqa: E402

CHUNK_BYTES = 4096
DEFAULT_CHUNKS = 8192  # 32 MiB of chunks
DEFAULT_BATCH_KEYS = 256  # 1 MiB per batched read
DEFAULT_SECONDS = 3.0
DEFAULT_THREADS = 4


def chunk_keys(n: int) -> List[bytes]:
    return [b"/bench/stream/00000/20260101T000000000000Z-w.acs#%d" % i for i in range(n)]


def chunk_values(n: int) -> List[bytes]:
    seed = os.urandom(CHUNK_BYTES * 2)
    return [seed[i % CHUNK_BYTES : i % CHUNK_BYTES + CHUNK_BYTES] for i in range(n)]


def measure(read_batch: Callable[[Sequence[bytes]], int], keys: List[bytes], batch: int,
            seconds: float, threads: int) -> Dict[str, float]:
    """Read ``keys`` in batches from ``threads`` threads for ``seconds``; returns MB/s and ops/s."""
    batches = [keys[i : i + batch] for i in range(0, len(keys), batch)]
    stop = time.monotonic() + seconds
    totals = [(0, 0)] * threads
    errors: List[BaseException] = []

    def work(t: int) -> None:
        nbytes = nkeys = 0
        i = t
        try:
            while time.monotonic() < stop:
                b = batches[i % len(batches)]
                nbytes += read_batch(b)
                nkeys += len(b)
                i += 1
        except BaseException as exc:  # re-raised below in the main thread
            errors.append(exc)
        totals[t] = (nbytes, nkeys)

    start = time.monotonic()
    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    elapsed = time.monotonic() - start
    if errors:
        raise errors[0]
    nbytes = sum(t[0] for t in totals)
    nkeys = sum(t[1] for t in totals)
    return {"MB/s": nbytes / elapsed / 1e6, "ops/s": nkeys / elapsed}


def ours(endpoints: str, replication: int, keys: List[bytes], values: List[bytes],
         batch: int, seconds: float, threads: int) -> Dict[str, float]:
    # Load with a generous deadline so every replica holds every chunk even on a busy machine
    # (a replica that misses a put's deadline would turn later relaxed reads into misses).
    with CacheClient(endpoints, replication=replication, deadline=30.0, name="bench-load") as loader:
        for i in range(0, len(keys), 1024):
            loader.put([(k, v, CHUNK_BYTES) for k, v in zip(keys[i : i + 1024], values[i : i + 1024])])
    with CacheClient(endpoints, replication=replication, name="bench") as client:

        def read(b: Sequence[bytes]) -> int:
            # The read path's chunk read (ChunkReader): the values joined, one size per key.
            data, sizes = client.get_joined(b)
            if -1 in sizes:
                raise AssertionError("a relaxed read missed a chunk every replica was given")
            return len(data)

        read(keys[:batch])  # warm the channels
        return measure(read, keys, batch, seconds, threads)


def floor(keys: List[bytes], batch: int, seconds: float, threads: int) -> List[Dict[str, float]]:
    """The grpcio floor (``_grpc_floor.py``): the same grpcio answering each batch's keys with
    a pre-built run of ``batch`` chunks, raw bytes, nothing else -- what any Python gRPC cache
    server could reach here, in the same run."""
    server = _grpc_floor.FloorServer(get_bytes=batch * CHUNK_BYTES)
    try:
        with _grpc_floor.channel(server.endpoint) as ch:
            call = _grpc_floor.get_call(ch)

            def read(b: Sequence[bytes]) -> int:
                return len(call(b"".join(b), timeout=30.0))

            read(keys[:batch])
            return [measure(read, keys, batch, seconds, 1), measure(read, keys, batch, seconds, threads)]
    finally:
        server.stop()


def theirs(keys: List[bytes], values: List[bytes], batch: int, seconds: float,
           threads: int) -> Optional[List[Dict[str, float]]]:
    binary = shutil.which("redis-server")
    try:
        import redis  # type: ignore
    except ImportError:
        redis = None
    if binary is None or redis is None:
        missing = []
        if binary is None:
            missing.append("redis-server (as root: apt-get install -y redis-server)")
        if redis is None:
            missing.append("the redis Python client (pip install redis)")
        print(f"redis comparison skipped: install {' and '.join(missing)}")
        return None
    server = RedisServer(binary)
    try:
        client = server.wait(redis)
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys, values):
            pipe.set(k, v)
        pipe.execute()
        pool = redis.ConnectionPool(host="127.0.0.1", port=server.port, max_connections=threads + 2)
        shared = redis.Redis(connection_pool=pool)

        def read(b: Sequence[bytes]) -> int:
            return sum(len(v) for v in shared.mget(b) if v is not None)

        read(keys[:batch])
        return [measure(read, keys, batch, seconds, 1), measure(read, keys, batch, seconds, threads)]
    finally:
        server.stop()


def _percentile(samples: Sequence[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, int(round(q / 100.0 * (len(ordered) - 1)))))]


def _live_delay(root: str, stream: str, rate: float, seconds: float, size: int, warmup: float,
                caches: Dict[str, str]) -> Dict[str, float]:
    """Producer -> Consumer delivery delay at a fixed rate; ``caches`` empty = durable store alone.

    The producer thread sends ``size``-byte messages at ``rate``/s for ``warmup + seconds``
    (paced on absolute due times, so it does not drift); the consumer polls in this thread at
    its default 10 ms interval. A message's delay is the time it is returned by ``poll()``
    minus its producer timestamp (taken at ``send``); the warm-up's messages are dropped.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from pyspark_acs.read.consumer import Consumer
    from pyspark_acs.write.producer import Producer

    value = b"v" * size
    total = int(rate * (warmup + seconds))
    samples: List[float] = []
    errors: List[BaseException] = []
    with Producer(root, stream, shards=1, **caches) as producer, \
            Consumer(root, stream, start="earliest", **caches) as consumer:
        done = threading.Event()

        def produce() -> None:
            try:
                start = time.perf_counter()
                for i in range(total):
                    wait = start + i / rate - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                    producer.send(value)
                producer.flush(timeout=30)
            except BaseException as exc:  # re-raised below
                errors.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=produce, name="bench-producer")
        measure_from_us = (time.time_ns() // 1000) + int(warmup * 1e6)
        thread.start()
        seen = 0
        deadline = time.monotonic() + warmup + seconds + 30
        while seen < total and time.monotonic() < deadline:
            got = consumer.poll()
            now_us = time.time_ns() // 1000
            for b in got:
                seen += b.num_rows
                ts = b.column("timestamp").cast(pa.int64())
                keep = pc.greater_equal(ts, pa.scalar(measure_from_us, pa.int64()))
                late = pc.filter(ts, keep)
                samples.extend(pc.divide(pc.subtract(pa.scalar(now_us, pa.int64()), late), 1000.0).to_pylist())
            if not got:
                # What Consumer.batches() does between polls: through the caches it wakes as
                # soon as the process's length poller sees a length move.
                wait = getattr(consumer.path, "wait", None)
                wait(consumer.poll_interval) if wait else time.sleep(consumer.poll_interval)
        thread.join(30)
        if errors:
            raise errors[0]
        if seen < total:
            raise AssertionError(f"{stream}: consumer got {seen} of {total} messages")
        stats = consumer.stats()
        perr = producer.stats()["cache_errors"]
    return {
        "p50": _percentile(samples, 50),
        "p99": _percentile(samples, 99),
        "max": max(samples) if samples else float("nan"),
        "n": float(len(samples)),
        "cache_mb": stats.get("cache_bytes", 0) / 1e6,
        "durable_mb": stats.get("durable_bytes", 0) / 1e6,
        "producer_cache_errors": float(perr),
    }


def run_delivery_delay(args: argparse.Namespace) -> Optional[Dict[str, float]]:
    """Delivery delay p50/p99 of Producer -> Consumer through the caches (3 data + 3 metadata
    replicas) at a fixed rate, and of the same Producer -> Consumer through the durable store
    alone, in the same run. Returns ``{"caches p50 ms": ..., ...}``."""
    if args.delay_seconds <= 0:
        return None
    print(f"\ndelivery delay: {args.rate:.0f} msg/s of {args.message_bytes} B for {args.delay_seconds:.0f} s "
          f"(after {args.warmup:.1f} s warm-up), 1 shard, consumer polls every 10 ms")
    results: Dict[str, Dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="acs-bench-delay-") as tmp:
        root = os.path.join(tmp, "store")
        with LocalDeployment(os.path.join(tmp, "dep"), data_replicas=3, metadata_replicas=3,
                             capacity="256MiB") as dep:
            results["caches"] = _live_delay(
                root, "via-caches", args.rate, args.delay_seconds, args.message_bytes, args.warmup,
                {"data_cache": dep.data_endpoints, "metadata_cache": dep.metadata_endpoints},
            )
        results["durable"] = _live_delay(
            root, "durable-only", args.rate, args.delay_seconds, args.message_bytes, args.warmup, {}
        )
    for name, r in results.items():
        print(f"  {name:8s} p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms  max {r['max']:7.2f} ms  "
              f"n={r['n']:.0f}  read {r['cache_mb']:.1f} MB from the data cache, {r['durable_mb']:.1f} MB "
              f"from the store  (producer cache errors {r['producer_cache_errors']:.0f})")
    c, d = results["caches"], results["durable"]
    print(f"  ratio caches / durable: p50 {c['p50'] / d['p50']:.2f}  p99 {c['p99'] / d['p99']:.2f}")
    return {
        "caches p50 ms": c["p50"], "caches p99 ms": c["p99"],
        "durable p50 ms": d["p50"], "durable p99 ms": d["p99"],
    }


def _produce_alone(root: str, mb: float, message_bytes: int, caches: Dict[str, str]) -> float:
    """MB/s of one Producer writing ``mb`` MB with ``send_many`` (batches of 1000) and a final
    flush, one shard: through the caches when given (durable store, chunks, lengths)."""
    from pyspark_acs.write.producer import Producer

    value = b"v" * message_bytes
    count = int(mb * 1e6 / message_bytes)
    with Producer(root, "alone", shards=1, **caches) as producer:
        producer.send_many([value] * 1000)  # warm-up: files, leases, channels
        producer.flush()
        started = time.perf_counter()
        for _ in range(count // 1000):
            producer.send_many([value] * 1000)
        producer.flush()
        elapsed = time.perf_counter() - started
        errors = producer.stats()["cache_errors"]
    if errors:
        print(f"  (producer cache errors: {errors})")
    return (count // 1000) * 1000 * message_bytes / 1e6 / elapsed


def _xadd_alone(mb: float, message_bytes: int) -> Optional[float]:
    """MB/s of redis-py XADD of the same bytes, pipelined 1000 at a time (the peer)."""
    binary = shutil.which("redis-server")
    try:
        import redis  # type: ignore
    except ImportError:
        redis = None
    if binary is None or redis is None:
        print("  redis: skipped (needs redis-server: apt-get install -y redis-server, and pip install redis)")
        return None
    server = RedisServer(binary)
    try:
        client = server.wait(redis)
        value = b"v" * message_bytes
        count = int(mb * 1e6 / message_bytes)
        started = time.perf_counter()
        for _ in range(count // 1000):
            pipe = client.pipeline(transaction=False)
            for _ in range(1000):
                pipe.xadd("alone", {"v": value})
            pipe.execute()
        return (count // 1000) * 1000 * message_bytes / 1e6 / (time.perf_counter() - started)
    finally:
        server.stop()


def run_producer_alone(args: argparse.Namespace) -> None:
    """Producer throughput alone with send_many: through 3 data + 3
    metadata replicas, through the durable store alone, and redis-py XADD pipelined, one run."""
    if args.produce_mb <= 0:
        return
    print(f"\nproducer alone: {args.produce_mb:.0f} MB of {args.message_bytes} B messages, send_many of 1000, "
          f"one shard")
    results: Dict[str, Optional[float]] = {}
    with tempfile.TemporaryDirectory(prefix="acs-bench-produce-") as tmp:
        with LocalDeployment(os.path.join(tmp, "dep"), data_replicas=3, metadata_replicas=3,
                             capacity="1GiB") as dep:
            results["through the caches"] = _produce_alone(
                os.path.join(tmp, "a"), args.produce_mb, args.message_bytes,
                {"data_cache": dep.data_endpoints, "metadata_cache": dep.metadata_endpoints})
        results["durable store alone"] = _produce_alone(os.path.join(tmp, "b"), args.produce_mb,
                                                        args.message_bytes, {})
    results["redis XADD (pipelined)"] = _xadd_alone(args.produce_mb, args.message_bytes)
    for name, value in results.items():
        if value is not None:
            print(f"  {name:24s} {value:8.1f} MB/s")
    if results["redis XADD (pipelined)"]:
        print(f"  ratio caches / redis: {results['through the caches'] / results['redis XADD (pipelined)']:.2f}")


def fmt(r: Dict[str, float]) -> str:
    return f"{r['MB/s']:8.1f} MB/s {r['ops/s']:10.0f} chunk gets/s"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS, help="distinct 4 KiB chunks")
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH_KEYS, help="keys per batched read")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="per measurement")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="client threads (second run)")
    parser.add_argument("--rate", type=float, default=2000.0, help="delivery delay: messages/s (default 2000)")
    parser.add_argument("--message-bytes", type=int, default=1024, help="delivery delay: message size (default 1 KiB)")
    parser.add_argument("--delay-seconds", type=float, default=5.0,
                        help="delivery delay: measured seconds per set-up (0 skips it; default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="delivery delay: seconds not measured first")
    parser.add_argument("--delay-only", action="store_true", help="skip the throughput part")
    parser.add_argument("--produce-mb", type=float, default=100.0,
                        help="producer alone: MB written (0 skips it; default 100)")
    parser.add_argument("--produce-only", action="store_true", help="only the producer-alone part")
    args = parser.parse_args(argv)
    if args.produce_only:
        run_producer_alone(args)
        return 0
    if args.delay_only:
        delay = run_delivery_delay(args)
        return 0 if delay is not None else 2
    keys = chunk_keys(args.chunks)
    values = chunk_values(args.chunks)
    print(f"{args.chunks} chunks of {CHUNK_BYTES} B, batches of {args.batch} keys "
          f"({args.batch * CHUNK_BYTES / 2**20:.2f} MiB), {args.seconds:.0f} s per run, {os.cpu_count()} CPUs")
    results: Dict[str, List[Dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="acs-bench-") as tmp:
        with LocalDeployment(tmp, data_replicas=3, metadata_replicas=0, capacity="1GiB") as dep:
            first = dep.endpoints("data")[0]
            results["ours r=1 (1 server)"] = [
                ours(first, 1, keys, values, args.batch, args.seconds, 1),
                ours(first, 1, keys, values, args.batch, args.seconds, args.threads),
            ]
            results["ours r=3 relaxed"] = [
                ours(dep.data_endpoints, 3, keys, values, args.batch, args.seconds, 1),
                ours(dep.data_endpoints, 3, keys, values, args.batch, args.seconds, args.threads),
            ]
    results["grpc floor (1 server)"] = floor(keys, args.batch, args.seconds, args.threads)
    redis_results = theirs(keys, values, args.batch, args.seconds, args.threads)
    if redis_results is not None:
        results["redis MGET (1 server)"] = redis_results
    print()
    for name, (one, many) in results.items():
        print(f"{name:24s} 1 thread : {fmt(one)}")
        print(f"{'':24s} {args.threads} threads: {fmt(many)}")
    print()
    for name in ("ours r=1 (1 server)", "ours r=3 relaxed"):
        for label, idx in (("1 thread", 0), (f"{args.threads} threads", 1)):
            ratio = results[name][idx]["MB/s"] / results["grpc floor (1 server)"][idx]["MB/s"]
            print(f"ratio {name} / grpc floor, {label}: {ratio:.2f}")
    if redis_results is not None:
        print()
        for name in ("ours r=1 (1 server)", "ours r=3 relaxed", "grpc floor (1 server)"):
            for label, idx in (("1 thread", 0), (f"{args.threads} threads", 1)):
                ratio = results[name][idx]["MB/s"] / redis_results[idx]["MB/s"]
                print(f"ratio {name} / redis, {label}: {ratio:.2f}")
    run_producer_alone(args)
    delay = run_delivery_delay(args)
    if delay is not None:
        print()
        for key, value in delay.items():
            print(f"delivery delay {key}: {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
