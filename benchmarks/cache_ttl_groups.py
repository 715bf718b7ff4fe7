#!/usr/bin/env python
"""Put latency of the cache store with many distinct TTLs (sweeps off the request path,
docs/security.md), and the
amplification Get against a real cache server.

Part 1 (in process, the Store alone): put p50/p99 with 1 TTL group and with 8001 groups, in the
same run; the ratio should be ~1, since puts never sweep.
Also the longest hold of the store lock by one sweep slice with 8001 expired groups.

Part 2 (a real acs-cache-server process): a ~240-byte Get naming one 8 MiB key 80 times:
status, time to answer, and the server's peak RSS before and after.

    python benchmarks/cache_ttl_groups.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from pyspark_acs.server.cache.store import SWEEP_SLICE_STEPS, Store  # noqa: E402

PUTS = 20_000
GROUPS = 8001


def put_latencies(groups: int) -> list:
    store = Store(512 * 1024**2, 60.0)
    for g in range(groups):
        store.put(b"g%d" % g, b"v", 1, ttl_s=60.0 + g / 1000.0)
    out = []
    value = b"x" * 64
    for i in range(PUTS):
        t = time.perf_counter()
        store.put(b"k%d" % i, value, 1)
        out.append(time.perf_counter() - t)
    return out


def sweep_slice_ms() -> float:
    now = [0.0]
    store = Store(512 * 1024**2, 60.0, clock=lambda: now[0])
    for g in range(GROUPS):
        store.put(b"g%d" % g, b"v", 1, ttl_s=1.0 + g / 1000.0)
    now[0] = 1000.0
    with store._lock:  # one slice, timed under the lock as the sweeper takes it
        store._sweep_todo = list(store._entries.by_ttl)
        t = time.perf_counter()
        store._expire_slice(now[0], SWEEP_SLICE_STEPS)
        return (time.perf_counter() - t) * 1000


def amplification() -> str:
    import grpc

    from pyspark_acs.cache.proto import acs_pb2, acs_pb2_grpc

    p = subprocess.Popen([sys.executable, "-m", "pyspark_acs.server.cache", "--role", "data", "--port", "0",
                          "--capacity", "256MiB", "--metrics-port", "-1"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=HERE))
    try:
        endpoint = p.stdout.readline().decode().split("listening on ")[1].split()[0]
        opts = [("grpc.max_send_message_length", 64 * 1024**2), ("grpc.max_receive_message_length", 64 * 1024**2)]
        stub = acs_pb2_grpc.CacheStub(grpc.insecure_channel(endpoint, options=opts))
        value = b"v" * (8 * 1024**2)
        stub.Put(acs_pb2.PutRequest(keys=[b"big"], data=value, sizes=[len(value)], versions=[1]), timeout=30)

        def hwm() -> int:
            with open(f"/proc/{p.pid}/status") as f:
                return next(int(ln.split()[1]) // 1024 for ln in f if ln.startswith("VmHWM"))

        before = hwm()
        t = time.perf_counter()
        try:
            stub.Get(acs_pb2.GetRequest(keys=[b"big"] * 80), timeout=60)
            status = "OK"
        except grpc.RpcError as exc:
            status = exc.code().name
        took = time.perf_counter() - t
        return f"status={status} time={took * 1000:.1f} ms peak_rss_mib before={before} after={hwm()}"
    finally:
        p.terminate()
        p.wait(timeout=10)


def main() -> None:
    one = put_latencies(1)
    many = put_latencies(GROUPS)
    p50_1, p50_n = statistics.median(one) * 1000, statistics.median(many) * 1000
    p99 = lambda xs: sorted(xs)[int(len(xs) * 0.99)] * 1000  # noqa: E731
    print(f"put p50 ms: 1 TTL group {p50_1:.4f}, {GROUPS} groups {p50_n:.4f}, ratio {p50_n / p50_1:.2f}")
    print(f"put p99 ms: 1 TTL group {p99(one):.4f}, {GROUPS} groups {p99(many):.4f}")
    print(f"one sweep slice ({SWEEP_SLICE_STEPS} steps) over {GROUPS} expired groups holds the lock {sweep_slice_ms():.3f} ms")
    print(f"amplification Get (80 x one 8 MiB key): {amplification()}")


if __name__ == "__main__":
    main()
