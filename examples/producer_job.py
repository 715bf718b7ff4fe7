"""Producer job: a Spark Structured Streaming query that writes a stream with ``format("acs")``.

The input is Spark's built-in ``rate-micro-batch`` source: batch ``b`` holds the row numbers
``[b * rows_per_batch, (b + 1) * rows_per_batch)``, one batch per ``--trigger-interval``.
Each row becomes a message with key ``key-<n % keys>`` and value ``<n, 12 digits>:<padding>``
(``--value-bytes`` long), so a consumer can check what it reads. The sink creates the stream
with ``--shards`` shards when it does not exist; keys pick the shard (crc32).

Run it with plain Python (a local[2] Spark) or with spark-submit (no jars needed)::

    python examples/producer_job.py --root /tmp/acs --stream events --messages 10000
    PYSPARK_PYTHON=$PWD/.venv/bin/python spark-submit examples/producer_job.py \\
        --root /tmp/acs --stream events --data-cache HOST:PORT,... --metadata-cache HOST:PORT,...

With ``--messages N`` it stops once N messages are committed (exit 0); otherwise it runs for
``--duration`` seconds, or until Ctrl-C / SIGTERM. Restarting with the same ``--checkpoint``
continues where it stopped, exactly once per micro-batch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:  # run from a source checkout without installing
    sys.path.append(os.path.dirname(HERE))

VALUE_HEAD = 13  # 12 digits and ':'


def log(msg: str) -> None:
    print(f"producer_job: {msg}", flush=True)


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


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="producer_job.py",
        description="Write a pyspark_acs stream from Spark's rate-micro-batch source with writeStream.format('acs').",
    )
    p.add_argument("--root", required=True, help="durable store root (local path, file:///, hdfs://...)")
    p.add_argument("--stream", default="events", help="stream name (default events)")
    p.add_argument("--shards", type=int, default=4, help="shard count when the stream is created (default 4)")
    p.add_argument("--data-cache", help="data-cache endpoints host:port,... (default: durable store only)")
    p.add_argument("--metadata-cache", help="metadata-cache endpoints host:port,...")
    p.add_argument("--rows-per-batch", type=int, default=1000, help="messages per micro-batch (default 1000)")
    p.add_argument("--trigger-interval", default="1 second",
                   help="processing-time trigger, e.g. '1 second' or '0 seconds' (default '1 second')")
    p.add_argument("--messages", type=int, default=0,
                   help="stop after this many messages are committed (default 0: no limit)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (default 0: no limit)")
    p.add_argument("--keys", type=int, default=16, help="distinct keys (default 16)")
    p.add_argument("--value-bytes", type=int, default=100, help=f"value size, >= {VALUE_HEAD} (default 100)")
    p.add_argument("--checkpoint", help="checkpoint folder (default: a temp folder, removed at exit; i.e. a new sink every run)")
    p.add_argument("--master", help="Spark master (default: spark-submit's, or local[2] with plain python)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="with --messages: fail if they are not committed within this many seconds (default 600)")
    args = p.parse_args(argv)
    if args.value_bytes < VALUE_HEAD:
        p.error(f"--value-bytes must be >= {VALUE_HEAD}")
    for name in ("shards", "rows_per_batch", "keys"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.messages < 0 or args.duration < 0:
        p.error("--messages and --duration must be >= 0")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="acs-producer-ckpt-")
    spark = build_spark("acs-producer-job", args.master)
    query = None
    done = False  # every message asked for is committed (or --duration ran out)
    try:
        from pyspark.sql import functions as F

        rows = spark.readStream.format("rate-micro-batch").option("rowsPerBatch", args.rows_per_batch).load()
        if args.messages:
            rows = rows.where(F.col("value") < args.messages)
        v = F.col("value")
        messages = rows.select(
            F.concat(F.lit("key-"), (v % args.keys).cast("string")).cast("binary").alias("key"),
            F.concat(F.lpad(v.cast("string"), 12, "0"), F.lit(":"),
                     F.repeat(F.lit("x"), args.value_bytes - VALUE_HEAD)).cast("binary").alias("value"),
        )
        writer = (
            messages.writeStream.format("acs")
            .option("root", args.root)
            .option("stream", args.stream)
            .option("shards", args.shards)
            .option("checkpointLocation", checkpoint)
            .trigger(processingTime=args.trigger_interval)
        )
        if args.data_cache:
            writer = writer.option("dataCache", args.data_cache)
        if args.metadata_cache:
            writer = writer.option("metadataCache", args.metadata_cache)
        query = writer.start()
        log(f"writing stream {args.stream!r} in {args.root} ({args.shards} shards, {args.rows_per_batch} "
            f"messages per batch, trigger {args.trigger_interval!r}), checkpoint {checkpoint}")
        # Batch b covers rows [b * rows_per_batch, (b + 1) * rows_per_batch): after batch
        # last_needed is committed (lastProgress reports it), every message < --messages is written.
        last_needed = (args.messages - 1) // args.rows_per_batch if args.messages else None
        started = time.monotonic()
        last_seen = -1
        while True:
            if query.exception() is not None:
                raise RuntimeError(f"the sink query failed: {query.exception()}")
            progress = query.lastProgress
            batch = progress["batchId"] if progress else -1
            if batch != last_seen:
                last_seen = batch
                committed = (batch + 1) * args.rows_per_batch
                if args.messages:
                    committed = min(committed, args.messages)
                log(f"batch {batch} committed; {committed} messages written")
            if last_needed is not None and batch >= last_needed:
                log(f"done: {args.messages} messages written to {args.stream!r}")
                done = True
                return 0
            elapsed = time.monotonic() - started
            if args.duration and elapsed >= args.duration:
                log(f"done: ran {args.duration:.0f} s")
                done = True
                return 0
            if last_needed is not None and elapsed > args.timeout:
                log(f"error: only batch {batch} of {last_needed} committed after {args.timeout:.0f} s")
                return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        log("interrupted; stopping")
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line, then clean up
        log(f"error: {exc}")
        return 1
    finally:
        if query is not None:
            if done:
                # The rate source never ends, so stop() interrupts a micro-batch past the last
                # message (its rows are filtered out); Spark logs that write's abort with stack
                # traces at ERROR. Nothing of ours is in it: keep them off a successful run.
                spark.sparkContext.setLogLevel("OFF")
            query.stop()
        spark.stop()
        if not args.checkpoint:  # a throw-away checkpoint: nothing can resume from it
            shutil.rmtree(checkpoint, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
