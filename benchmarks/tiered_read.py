"""Read throughput of a stream's history from the S3 tier, with and without pre-reading.

A stream of ``--mb`` MiB (1 KiB messages, files rolled at ``--roll``) is written to a local hot
store, moved by the tier mover to an S3 endpoint (moto's server on loopback, reached through
``pyarrow.fs.S3FileSystem`` with an endpoint override: the client code a user runs against S3)
and deleted from the hot store. A Consumer then reads the whole history from ``earliest``:

- from the hot store (before tiering: the peer every figure is compared with),
- from S3 without the pre-reading window (one ranged GET per read),
- from S3 with the pre-reading window (AIMD: grows by the reader's request size while
  read-ahead is used, halves when it is dropped unread).

A Consumer caught up at the end of the history (waiting for the shard's next file, which it
lists every poll) is also timed for ``--idle`` seconds: polls per second and reads of the
shard's tier records (``_tiered.json``), against a peer that reads the records on every
listing (what listings did before they stat the manifest and re-read it only on change).

Each S3 run is done for two reader request sizes (``--read-bytes``, the Consumer's
``max_read_bytes``): the default, and a small one (a reader that asks for little at a time,
as ``acs tail`` or a rate-capped task). Printed: MB/s, GET requests per MB, and ratios.

    .venv/bin/python benchmarks/tiered_read.py [--mb 64] [--roll 8MiB] [--small-read 64KiB]

moto keeps objects in memory and is a single Python process: absolute S3 figures are far
below real S3; the request counts per MB are what carries over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import free_port, progress, report  # noqa: E402

from pyspark_acs import Consumer, Producer  # noqa: E402
from pyspark_acs.read.consumer import DEFAULT_MAX_READ_BYTES  # noqa: E402
from pyspark_acs.read.positions import offset_for_timestamp  # noqa: E402
from pyspark_acs.read.readpath import open_read_path  # noqa: E402
from pyspark_acs.server.tier import TierMover  # noqa: E402
from pyspark_acs.storage.tier_settings import configure_tier  # noqa: E402
from pyspark_acs.units import format_bytes, parse_bytes  # noqa: E402

STREAM = "history"
BUCKET = "acs-bench"
MESSAGE_BYTES = 1024
MB = 1024 * 1024


def start_moto() -> Tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("moto server did not start")
            time.sleep(0.05)


def read_history(root: str, n: int, max_read_bytes: int, **path_kw) -> Dict[str, float]:
    path = open_read_path(root, **path_kw)
    got = 0
    t0 = time.perf_counter()
    with Consumer(root, STREAM, start="earliest", read_path=path, max_read_bytes=max_read_bytes) as c:
        while got < n:
            for batch in c.poll():
                got += batch.num_rows
    seconds = time.perf_counter() - t0
    stats = path.store.tier_stats() if hasattr(path.store, "tier_stats") else {"tier_requests": 0, "tier_bytes": 0}
    path.close()
    mb = n * MESSAGE_BYTES / MB
    return {"seconds": seconds, "mb_s": mb / seconds, "requests": stats["tier_requests"],
            "req_per_mb": stats["tier_requests"] / mb, "fetched_mb": stats["tier_bytes"] / MB}


def walk_history(root: str, **path_kw) -> Dict[str, float]:
    """The Spark planner's cost on history: a timestamp search that walks every block header
    of every file (``startingTimestamp`` past the end), through the one read path."""
    path = open_read_path(root, **path_kw)
    t0 = time.perf_counter()
    offset_for_timestamp(path, STREAM, 0, 2 ** 62)
    seconds = time.perf_counter() - t0
    stats = path.store.tier_stats()
    path.close()
    return {"seconds": seconds, "requests": stats["tier_requests"], "fetched_mb": stats["tier_bytes"] / MB}


def idle_polls(root: str, n: int, seconds: float, read_every_listing: bool) -> Dict[str, float]:
    """Polls of a Consumer caught up at the end of the history (it lists the shard each poll
    for the next file) for ``seconds``; ``read_every_listing`` makes every listing read the
    tier records again (the peer)."""
    from pyspark_acs.storage.store import DurableStore
    from pyspark_acs.storage.tier import tiered_store

    # A manifest never settled is read again at every listing; one settled at once, only when changed.
    settle = float("inf") if read_every_listing else 0.0
    path = open_read_path(tiered_store(DurableStore(root, create=False), manifest_settle_s=settle))
    got = polls = 0
    with Consumer(root, STREAM, start="earliest", read_path=path) as c:
        while got < n:
            for batch in c.poll():
                got += batch.num_rows
        before = path.store.tier_stats()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            c.poll()
            polls += 1
        elapsed = time.perf_counter() - t0
        after = path.store.tier_stats()
    path.close()
    return {"polls_s": polls / elapsed, "polls": polls,
            "reads": after["manifest_reads"] - before["manifest_reads"],
            "checks": after["manifest_checks"] - before["manifest_checks"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="history size in MiB (default 64)")
    ap.add_argument("--roll", default="8MiB", help="file roll size (default 8MiB)")
    ap.add_argument("--small-read", default="64KiB", help="the small reader request size (default 64KiB)")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of idle polling timed (default 3)")
    args = ap.parse_args()
    roll = parse_bytes(args.roll, option="--roll", minimum=4096)
    small = parse_bytes(args.small_read, option="--small-read", minimum=4096)
    base = tempfile.mkdtemp(prefix="acs-tier-bench-")
    root = os.path.join(base, "hot")
    proc, port = start_moto()
    try:
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="k",
                     aws_secret_access_key="s", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        n = args.mb * MB // MESSAGE_BYTES
        progress(f"writing {args.mb} MiB ({n} messages, files of {format_bytes(roll)})")
        with Producer(root, STREAM, roll_bytes=roll) as p:
            for i in range(n):
                p.send(i.to_bytes(8, "little") * (MESSAGE_BYTES // 8))
            p.flush(timeout=120)
        rows: Dict[str, str] = {}
        results = {}
        read_history(root, n, DEFAULT_MAX_READ_BYTES)  # warm-up: page cache, imports
        for size_name, size in (("default", DEFAULT_MAX_READ_BYTES), ("small", small)):
            results[("hot", size_name)] = read_history(root, n, size)
        t0 = time.perf_counter()
        hot_path = open_read_path(root)
        offset_for_timestamp(hot_path, STREAM, 0, 2 ** 62)
        hot_path.close()
        hot_walk = time.perf_counter() - t0
        configure_tier(root, STREAM, f"s3://k:s@{BUCKET}/bench?endpoint_override=127.0.0.1:{port}&scheme=http"
                                     f"&region=us-east-1", hot_retention_s=0)
        progress("tiering the history to S3")
        t0 = time.perf_counter()
        mover = TierMover(root)
        moved = mover.run_once()
        mover.close()
        upload_s = time.perf_counter() - t0
        rows["upload (mover)"] = (f"{moved.uploaded_files} files in {moved.objects} objects, "
                                  f"{moved.uploaded_bytes / MB / upload_s:.1f} MB/s incl. read-back verify; "
                                  f"hot copies deleted: {moved.hot_deleted}")
        for size_name, size in (("default", DEFAULT_MAX_READ_BYTES), ("small", small)):
            for preread in (False, True):
                progress(f"reading from S3, reads of {format_bytes(size)}, preread={preread}")
                results[("s3" + ("+preread" if preread else ""), size_name)] = read_history(
                    root, n, size, tier_preread=preread)
        for (where, size_name), r in results.items():  # noqa: B007
            size = DEFAULT_MAX_READ_BYTES if size_name == "default" else small
            peer = results[("hot", size_name)]
            line = f"{r['mb_s']:7.1f} MB/s  ({r['mb_s'] / peer['mb_s']:.2f}x hot)"
            if where != "hot":
                line += f"  {r['req_per_mb']:6.2f} GET/MB  fetched {r['fetched_mb']:.1f} MB"
                if where == "s3+preread":
                    plain = results[("s3", size_name)]
                    line += (f"  vs no preread: {r['mb_s'] / plain['mb_s']:.2f}x MB/s, "
                             f"{plain['requests'] / max(r['requests'], 1):.1f}x fewer GETs")
            rows[f"{where:<11} reads {format_bytes(size):>8}"] = line
        walks = {pre: walk_history(root, tier_preread=pre) for pre in (False, True)}
        for pre, w in walks.items():
            line = f"{w['seconds'] * 1000:8.1f} ms  {w['requests']:5d} GETs  fetched {w['fetched_mb']:.1f} MB"
            if pre:
                line += (f"  vs no preread: {walks[False]['seconds'] / w['seconds']:.2f}x faster, "
                         f"{walks[False]['requests'] / max(w['requests'], 1):.1f}x fewer GETs")
            rows[f"header walk (planner) s3{'+preread' if pre else ''}"] = line
        rows["header walk (planner) hot"] = f"{hot_walk * 1000:8.1f} ms"
        progress(f"idle polling at the end of the history, {args.idle:g} s each")
        idle = {peer: idle_polls(root, n, args.idle, peer) for peer in (True, False)}
        for peer, r in idle.items():
            line = (f"{r['polls_s']:9.0f} polls/s  tier record reads {r['reads']:6d}  manifest stats "
                    f"{r['checks']:6d}  over {r['polls']} polls")
            if not peer:
                line += f"  ({r['polls_s'] / idle[True]['polls_s']:.1f}x polls/s vs reading every listing)"
            rows["idle consumer, " + ("records read every listing (peer)" if peer else "records read on change")] = line
        report(f"tiered read of {args.mb} MiB history (Consumer from earliest)", rows)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
