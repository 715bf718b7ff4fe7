"""Consumer job: a Spark Structured Streaming query that reads a stream with ``format("acs")``.

Every micro-batch goes to ``foreachBatch``, which prints its message count, bytes, messages
per shard and (with ``--show N``) its first rows, and adds them to a running total. With
``--available-now`` it reads what exists when it starts (``Trigger.AvailableNow``, in bounded
batches under ``--max-rows-per-trigger``/``--max-bytes-per-trigger``) and exits; otherwise it
follows the stream at ``processingTime="0 seconds"`` for ``--duration`` seconds, or until
Ctrl-C / SIGTERM. It ends with one summary line::

    consumer_job: consumed 10000 messages (1000000 value bytes) in 3 batches; per shard {0: 2500, ...}

Run it with plain Python (a local[2] Spark) or with spark-submit (no jars needed)::

    python examples/consumer_job.py --root /tmp/acs --stream events --available-now
    PYSPARK_PYTHON=$PWD/.venv/bin/python spark-submit examples/consumer_job.py \\
        --root /tmp/acs --stream events --data-cache HOST:PORT,... --metadata-cache HOST:PORT,...

A fixed ``--checkpoint`` makes a restarted job continue after the last batch it finished.
``--expect N`` exits 1 unless exactly N messages were consumed (handy in scripts and tests).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:  # run from a source checkout without installing
    sys.path.append(os.path.dirname(HERE))


def log(msg: str) -> None:
    print(f"consumer_job: {msg}", flush=True)


def build_spark(app: str, master: Optional[str]):
    """A SparkSession; under spark-submit its settings win, with plain python a local[2] one."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app)
    if master or "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        builder = (
            builder.master(master or "local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.python.worker.reuse", "true")
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


class Counter:
    """The foreachBatch function: prints each batch and keeps totals."""

    def __init__(self, show: int) -> None:
        self.show = show
        self.lock = threading.Lock()
        self.messages = 0
        self.bytes = 0
        self.batches = 0
        self.per_shard: Dict[int, int] = collections.Counter()

    def __call__(self, df, batch_id: int) -> None:
        from pyspark.sql import functions as F

        stats = df.groupBy("shard").agg(F.count("*").alias("n"), F.sum(F.length("value")).alias("bytes")).collect()
        n = sum(r["n"] for r in stats)
        nbytes = sum(r["bytes"] or 0 for r in stats)
        with self.lock:
            self.batches += 1
            self.messages += n
            self.bytes += nbytes
            for r in stats:
                self.per_shard[r["shard"]] += r["n"]
            total = self.messages
        shards = {r["shard"]: r["n"] for r in sorted(stats, key=lambda r: r["shard"])}
        log(f"batch {batch_id}: {n} messages, {nbytes} value bytes, per shard {shards}; total {total}")
        if self.show and n:
            for r in df.orderBy("shard", "file", "position").limit(self.show).collect():
                log(f"  shard {r['shard']} {r['file']}#{r['position']} {r['timestamp']} "
                    f"key={bytes(r['key'] or b'')[:40]!r} value={bytes(r['value'])[:60]!r}")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="consumer_job.py",
        description="Read a pyspark_acs stream with spark.readStream.format('acs'), printing and counting messages.",
    )
    p.add_argument("--root", required=True, help="durable store root (local path, file:///, hdfs://...)")
    p.add_argument("--stream", default="events", help="stream name or comma-separated list (default events)")
    p.add_argument("--data-cache", help="data-cache endpoints host:port,... (default: durable store only)")
    p.add_argument("--metadata-cache", help="metadata-cache endpoints host:port,...")
    p.add_argument("--starting-offsets", default="earliest",
                   help="earliest (default), latest, or offsets JSON for a new checkpoint")
    p.add_argument("--available-now", action="store_true",
                   help="read what exists now (Trigger.AvailableNow), then exit")
    p.add_argument("--max-rows-per-trigger", type=int, help="messages per micro-batch (admission control)")
    p.add_argument("--max-bytes-per-trigger", help="bytes per micro-batch, e.g. 8MiB")
    p.add_argument("--duration", type=float, default=0.0,
                   help="without --available-now: stop after this many seconds (default 0: until Ctrl-C)")
    p.add_argument("--show", type=int, default=0, metavar="N", help="print the first N messages of each batch")
    p.add_argument("--expect", type=int, help="exit 1 unless exactly this many messages were consumed")
    p.add_argument("--checkpoint", help="checkpoint folder (default: a temp folder, removed at exit)")
    p.add_argument("--master", help="Spark master (default: spark-submit's, or local[2] with plain python)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="with --available-now: fail if not done within this many seconds (default 600)")
    args = p.parse_args(argv)
    if args.duration < 0 or args.show < 0:
        p.error("--duration and --show must be >= 0")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="acs-consumer-ckpt-")
    spark = build_spark("acs-consumer-job", args.master)
    counter = Counter(args.show)
    query = None
    status = 0
    started = time.monotonic()
    try:
        reader = (
            spark.readStream.format("acs")
            .option("root", args.root)
            .option("stream", args.stream)
            .option("startingOffsets", args.starting_offsets)
        )
        for option, value in (("dataCache", args.data_cache), ("metadataCache", args.metadata_cache),
                              ("maxRowsPerTrigger", args.max_rows_per_trigger),
                              ("maxBytesPerTrigger", args.max_bytes_per_trigger)):
            if value is not None:
                reader = reader.option(option, value)
        writer = reader.load().writeStream.foreachBatch(counter).option("checkpointLocation", checkpoint)
        if args.available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime="0 seconds")
        query = writer.start()
        mode = "available now" if args.available_now else "following"
        log(f"reading {args.stream!r} in {args.root} ({mode}), checkpoint {checkpoint}")
        if args.available_now:
            if not query.awaitTermination(args.timeout):
                log(f"error: not done after {args.timeout:.0f} s")
                status = 1
        else:
            while query.isActive and not (args.duration and time.monotonic() - started >= args.duration):
                query.awaitTermination(0.5)
        if query.exception() is not None:
            raise RuntimeError(f"the source query failed: {query.exception()}")
    except KeyboardInterrupt:
        log("interrupted; stopping")
        status = 130
    except Exception as exc:  # noqa: BLE001 - one clear line, then clean up
        log(f"error: {exc}")
        status = 1
    finally:
        if query is not None:
            query.stop()
        spark.stop()
        if not args.checkpoint:  # a throw-away checkpoint: nothing can resume from it
            shutil.rmtree(checkpoint, ignore_errors=True)
    shards = dict(sorted(counter.per_shard.items()))
    log(f"consumed {counter.messages} messages ({counter.bytes} value bytes) in {counter.batches} batches; "
        f"per shard {shards}")
    if status == 0 and args.expect is not None and counter.messages != args.expect:
        log(f"error: expected {args.expect} messages, consumed {counter.messages}")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
