"""Produce and consume throughput of 1 KiB messages on local files, and live-tail delay.

Prints messages/s and MB/s for the Producer and the Consumer, the same bytes written and
read with plain buffered Python file I/O as a peer (one message per line), their ratio, and
the delivery delay p50/p99 of a live tail at a fixed rate.

    python benchmarks/produce_consume.py [--messages 200000] [--rate 2000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time

from _common import delays_ms, progress, report, summary_ms

from pyspark_acs import Consumer, Producer


def bench_produce_consume(root: str, n: int, size: int, shards: int) -> dict:
    value = os.urandom(size // 2).hex().encode()[:size]
    progress(f"producing {n} messages of {size} B")
    t0 = time.perf_counter()
    with Producer(root, "bench", shards=shards) as p:
        for i in range(n):
            p.send(value)
        p.flush()
    t_prod = time.perf_counter() - t0
    progress(f"producing {n} messages with send_many (batches of 1000)")
    t0 = time.perf_counter()
    with Producer(root, "bench_many", shards=shards) as p:
        batch = [value] * 1000
        for _ in range(n // 1000):
            p.send_many(batch)
        p.flush()
    t_many = time.perf_counter() - t0
    progress("consuming")
    t0 = time.perf_counter()
    got = 0
    with Consumer(root, "bench") as c:
        while got < n:
            for b in c.poll():
                got += b.num_rows
    t_cons = time.perf_counter() - t0
    return {"produce_s": t_prod, "produce_many_s": t_many, "consume_s": t_cons, "n": n, "bytes": n * size}


def bench_plain_files(root: str, n: int, size: int) -> dict:
    """Peer: the same messages as lines in one file with Python's buffered I/O."""
    value = b"x" * (size - 1) + b"\n"
    path = os.path.join(root, "plain.txt")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(value)
        f.flush()
    t_prod = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = 0
    with open(path, "rb") as f:
        for _line in f:
            got += 1
    t_cons = time.perf_counter() - t0
    assert got == n
    return {"produce_s": t_prod, "consume_s": t_cons}


def bench_live_tail(root: str, rate: float, seconds: float, size: int) -> list:
    """Delivery delay of a live tail: producer at a fixed rate, consumer polling every 10 ms."""
    value = b"y" * size
    total = int(rate * seconds)
    samples: list = []
    with Producer(root, "live", shards=1) as p:
        c = Consumer(root, "live", start="latest")
        stop = threading.Event()

        def produce() -> None:
            start = time.perf_counter()
            for i in range(total):
                due = start + i / rate
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                p.send(value)
            stop.set()

        t = threading.Thread(target=produce)
        t.start()
        progress(f"live tail: {total} messages at {rate:.0f}/s")
        while len(samples) < total:
            for b in c.poll():
                samples.extend(delays_ms(b, time.time_ns() // 1000))
            if stop.is_set() and len(samples) >= total:
                break
            time.sleep(0.001)
        t.join()
        c.close()
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--rate", type=float, default=2000.0, help="live-tail messages/s")
    ap.add_argument("--seconds", type=float, default=5.0, help="live-tail duration")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="acs-bench-")
    try:
        r = bench_produce_consume(root, args.messages, args.size, args.shards)
        peer = bench_plain_files(root, args.messages, args.size)
        mb = r["bytes"] / 1e6
        report(
            f"throughput, {args.messages} x {args.size} B messages, {args.shards} shards, local files",
            {
                "produce": f"{args.messages / r['produce_s']:,.0f} msg/s  {mb / r['produce_s']:,.1f} MB/s",
                "produce (send_many)": f"{args.messages / r['produce_many_s']:,.0f} msg/s  {mb / r['produce_many_s']:,.1f} MB/s",
                "consume": f"{args.messages / r['consume_s']:,.0f} msg/s  {mb / r['consume_s']:,.1f} MB/s",
                "peer produce (plain lines)": f"{args.messages / peer['produce_s']:,.0f} msg/s",
                "peer consume (plain lines)": f"{args.messages / peer['consume_s']:,.0f} msg/s",
                "ratio produce acs/peer": f"{peer['produce_s'] / r['produce_s']:.2f}",
                "ratio produce send_many/peer": f"{peer['produce_s'] / r['produce_many_s']:.2f}",
                "ratio consume acs/peer": f"{peer['consume_s'] / r['consume_s']:.2f}",
            },
        )
        samples = bench_live_tail(root, args.rate, args.seconds, args.size)
        report(f"live tail delay at {args.rate:.0f} msg/s (consumer polled every 1 ms)", {"delivery delay": summary_ms(samples)})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
