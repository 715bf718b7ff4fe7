"""The Spark connector with a real local SparkSession: format("acs") source, batch reader, sink."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import pytest
from chispa import assert_df_equality

from pyspark_acs import Producer
from pyspark_acs.errors import AcsOptionError
from pyspark_acs.read.consumer import Consumer
from tests.helpers import read_acs, start_query, wait_until

pytestmark = pytest.mark.spark

COLS = ["shard", "key", "value"]




def produce(root, stream, messages, shards=2, flush_each=False, **kw):
    """Send (shard, key, value) triples (one block each with flush_each); return them."""
    with Producer(root, stream, shards=shards, **kw) as p:
        for shard, key, value in messages:
            p.send(value, key=key, shard=shard)
            if flush_each:
                p.flush()
    return messages


def random_messages(n, shards, seed=0, max_size=300):
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        size = rnd.choice([0, 1, 10, max_size, rnd.randrange(max_size)])
        out.append((i % shards, f"k{i}".encode(), rnd.randbytes(size)))
    return out


def ordered(df):
    """Rows per shard in stream order, as (shard, key, value)."""
    return df.orderBy("shard", "file", "position").select(*COLS)


def test_batch_read_is_byte_exact_and_ordered(spark, root):
    msgs = produce(root, "orders", random_messages(500, 3, seed=1), shards=3, max_block_bytes=4096, roll_bytes=20_000)
    got = ordered(read_acs(spark, root, "orders"))
    expected = spark.createDataFrame(sorted(msgs, key=lambda m: m[0]), got.schema)  # stable: per-shard order kept
    assert_df_equality(got, expected)
    assert read_acs(spark, root, "orders").schema.simpleString() == (
        "struct<stream:string,shard:int,file:string,position:bigint,timestamp:timestamp,key:binary,value:binary>"
    )


def test_batch_sink_then_source_round_trip(spark, root):
    rows = [(i % 2, f"k{i}".encode(), os.urandom(i % 50)) for i in range(300)]
    df = spark.createDataFrame(rows, "shard int, key binary, value binary").repartition(1)
    df.write.format("acs").option("root", root).option("stream", "copy").option("shards", 2).mode("append").save()
    got = ordered(read_acs(spark, root, "copy"))
    assert_df_equality(got, spark.createDataFrame(sorted(rows, key=lambda r: r[0]), got.schema))


def test_streaming_sink_to_source_restart_exactly_once(spark, root, tmp_path):
    """acs -> Spark -> acs with a stop and restart mid-stream and a replayed batch."""
    first = produce(root, "src", random_messages(400, 2, seed=2), max_block_bytes=2048)
    ckpt = str(tmp_path / "ckpt")

    def start(trigger):
        q = (
            spark.readStream.format("acs").option("root", root).option("stream", "src")
            .option("startingOffsets", "earliest").option("maxRowsPerTrigger", 150).load()
            .select("shard", "key", "value", "timestamp")
            .writeStream.queryName("relay").format("acs").option("root", root).option("stream", "dst")
            .option("shards", 2).option("checkpointLocation", ckpt)
        )
        return start_query(q.trigger(**trigger))

    q = start({"processingTime": "0 seconds"})
    wait_until(lambda: sum(p["numInputRows"] for p in q.recentProgress) >= 150, 120, "the first batches", interval=0.2)
    q.stop()
    second = produce(root, "src", random_messages(300, 2, seed=3), max_block_bytes=2048)
    q = start({"availableNow": True})
    q.awaitTermination(180)
    assert q.exception() is None
    # Replay: forget the sink's last commit in the checkpoint; Spark runs that batch again.
    last = max(int(n) for n in os.listdir(os.path.join(ckpt, "commits")) if n.isdigit())
    for name in (str(last), f".{last}.crc"):
        path = os.path.join(ckpt, "commits", name)
        if os.path.exists(path):
            os.remove(path)
    q = start({"availableNow": True})
    q.awaitTermination(180)
    assert q.exception() is None
    expected = sorted(first + second, key=lambda m: m[0])
    got = ordered(read_acs(spark, root, "dst"))
    assert_df_equality(got, spark.createDataFrame(expected, got.schema))


def test_admission_control_bounds_batches_and_available_now_drains(spark, root, tmp_path):
    produce(root, "adm", [(i % 2, None, b"x" * 100) for i in range(600)], max_block_bytes=1024)
    q = start_query(
        spark.readStream.format("acs").option("root", root).option("stream", "adm")
        .option("startingOffsets", "earliest").option("maxRowsPerTrigger", 100).load()
        .writeStream.format("memory").queryName("adm_rows").trigger(availableNow=True)
    )
    q.awaitTermination(180)
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sum(sizes) == 600 and spark.table("adm_rows").count() == 600
    assert len(sizes) >= 6 and max(sizes) <= 100, sizes
    q = start_query(
        spark.readStream.format("acs").option("root", root).option("stream", "adm")
        .option("startingOffsets", "earliest").option("maxBytesPerTrigger", "20KiB").load()
        .writeStream.format("memory").queryName("adm_bytes").trigger(availableNow=True)
    )
    q.awaitTermination(180)
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    # 20 KiB of ~1 KiB blocks of 9 messages of 100 B: at most ~20 blocks a batch.
    assert sum(sizes) == 600 and len(sizes) >= 3 and max(sizes) <= 200, sizes
    q = start_query(
        spark.readStream.format("acs").option("root", root).option("stream", "adm")
        .option("startingOffsets", "earliest").option("maxRowsPerTrigger", 100).load()
        .writeStream.format("memory").queryName("adm_once").trigger(once=True)
    )
    q.awaitTermination(180)
    assert [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]] == [600]


def test_offsets_latest_timestamp_and_ending(spark, root):
    produce(root, "pos", [(0, None, b"old-%d" % i) for i in range(20)], shards=1)
    time.sleep(0.05)
    cut_ms = int(time.time() * 1000)
    time.sleep(0.05)
    produce(root, "pos", [(0, None, b"new-%d" % i) for i in range(10)], shards=1)
    values = [r.value for r in ordered(read_acs(spark, root, "pos", startingTimestamp=cut_ms)).collect()]
    assert values == [b"new-%d" % i for i in range(10)]
    c = Consumer(root, "pos")
    first = next(c.batches(timeout=1))
    mid = c.offsets()
    c.close()
    assert first.num_rows == 20
    values = [r.value for r in ordered(read_acs(spark, root, "pos", endingOffsets=json.dumps(mid))).collect()]
    assert values == [b"old-%d" % i for i in range(20)]
    values = [r.value for r in ordered(read_acs(spark, root, "pos", startingOffsets=json.dumps(mid))).collect()]
    assert values == [b"new-%d" % i for i in range(10)]


def test_offsets_taken_in_the_middle_of_a_batch_start_and_end_spark_reads_exactly(spark, root, tmp_path):
    """An offset a Consumer took after 7 rows of a batch (``offsets(consumed=7)``: a position
    inside a block) starts a batch read and a streaming query at the 8th message, and ends a
    batch read after the 7th: each offset a reader hands out follows one rule."""
    def value(i):
        return b"m-%03d" % i + b"." * 100  # about nine messages a block

    produce(root, "mid", [(0, None, value(i)) for i in range(60)], shards=1, max_block_bytes=1024)
    c = Consumer(root, "mid", max_read_bytes=1 << 20)
    first = next(c.batches(timeout=1))
    assert first.num_rows > 7
    mid = c.offsets(consumed=7)
    c.close()
    assert mid["mid"]["0"]["position"] == 7
    rest = [value(i) for i in range(7, 60)]
    got = [r.value for r in ordered(read_acs(spark, root, "mid", startingOffsets=json.dumps(mid))).collect()]
    assert got == rest
    got = [r.value for r in ordered(read_acs(spark, root, "mid", endingOffsets=json.dumps(mid))).collect()]
    assert got == [value(i) for i in range(7)]
    q = start_query(
        spark.readStream.format("acs").option("root", root).option("stream", "mid")
        .option("startingOffsets", json.dumps(mid)).option("maxRowsPerTrigger", 5).load()
        .writeStream.format("memory").queryName("mid_rows").trigger(availableNow=True)
    )
    q.awaitTermination(180)
    assert q.exception() is None
    assert [r.value for r in spark.table("mid_rows").orderBy("position").collect()] == rest


def test_fail_on_data_loss_both_ways(spark, root):
    produce(root, "lossy", [(0, None, b"a%d" % i) for i in range(50)], shards=1, flush_each=True, roll_bytes=1500)
    c = Consumer(root, "lossy")
    files = sorted(os.listdir(os.path.join(root, "lossy", "00000")))
    files = [f for f in files if f.endswith(".acs")]
    assert len(files) >= 3
    os.remove(os.path.join(root, "lossy", "00000", files[0]))
    start = json.dumps({"lossy": {"0": {"file": files[0], "length": 0}}})
    with pytest.raises(Exception) as err:
        read_acs(spark, root, "lossy", startingOffsets=start).count()
    text = str(err.value)
    assert "data loss" in text and files[0] in text and "shard 0" in text
    rest = read_acs(spark, root, "lossy", startingOffsets=start, failOnDataLoss="false").count()
    c.close()
    assert 0 < rest < 50


def test_a_truncated_file_fails_batch_and_available_now_reads_or_is_skipped(spark, root):
    """The first of several files cut to 10,000 bytes in the source cluster: a batch read and
    an availableNow query fail naming the file (they used to return the messages before the
    cut and succeed); with failOnDataLoss=false both read every message of the later files."""
    values = [b"%05d" % i for i in range(3000)]
    with Producer(root, "cut", roll_bytes=20000) as p:
        for i, v in enumerate(values):
            p.send(v)
            if i % 50 == 49:
                p.flush()  # blocks of 50 messages, as a trickle makes them
    assert len(os.listdir(os.path.join(root, "cut", "00000"))) > 3
    first = sorted(f for f in os.listdir(os.path.join(root, "cut", "00000")) if f.endswith(".acs"))[0]
    os.truncate(os.path.join(root, "cut", "00000", first), 10000)
    with pytest.raises(Exception) as err:
        read_acs(spark, root, "cut").count()
    assert f"file {first} has no seal" in str(err.value) and "failOnDataLoss=false" in str(err.value)

    def stream(name, **opts):
        reader = spark.readStream.format("acs").option("root", root).option("stream", "cut") \
            .option("startingOffsets", "earliest")
        for k, v in opts.items():
            reader = reader.option(k, v)
        q = start_query(reader.load().writeStream.format("memory").queryName(name).trigger(availableNow=True))
        try:
            q.awaitTermination(180)
        except Exception:  # a failed query raises here too; q.exception() holds it
            pass
        return q

    q = stream("cut_fail")
    assert q.exception() is not None and f"file {first} has no seal" in str(q.exception())
    kept = [r.value for r in ordered(read_acs(spark, root, "cut", failOnDataLoss="false")).collect()]
    q = stream("cut_skip", failOnDataLoss="false")
    assert q.exception() is None
    streamed = [r.value for r in spark.table("cut_skip").orderBy("file", "position").collect()]
    assert streamed == kept
    gap = next(i for i, v in enumerate(kept) if int(v) != i)  # the messages cut off the first file
    assert gap > 0 and kept == values[:gap] + values[int(kept[gap]):], "the messages before the cut, then the rest"


@pytest.mark.parametrize(
    "opts, needle",
    [
        ({"stream": "x", "bogus": "1"}, "valid options are"),
        ({"stream": "x", "startingOffsets": "beginning"}, "startingOffsets"),
        ({"stream": "x", "maxBytesPerTrigger": "lots"}, "maxBytesPerTrigger"),
        ({"stream": "x", "failOnDataLoss": "maybe"}, "failOnDataLoss"),
        ({"stream": "x", "dataCache": "localhost"}, "dataCache"),
        ({"stream": "../x"}, "invalid stream name"),
        ({}, "'stream' is required"),
        ({"stream": "nope"}, "no stream 'nope'"),
    ],
)
def test_bad_source_options_are_named(spark, root, opts, needle):
    with pytest.raises(Exception) as err:
        read_acs_raw = spark.read.format("acs").option("root", root)
        for k, v in opts.items():
            read_acs_raw = read_acs_raw.option(k, v)
        read_acs_raw.load().count()
    assert needle in str(err.value)


def test_cache_options_come_from_the_drivers_environment_unless_given(monkeypatch):
    """Like the Producer and the Consumer, the source and the sink take ``acs up``'s exports when
    their cache options are not given; resolved once on the driver (the parsed options are what
    tasks receive); ``none`` turns a cache off; an explicit option wins."""
    from pyspark_acs.datasource.options import parse_sink_options, parse_source_options

    monkeypatch.setenv("ACS_DATA_CACHE", "127.0.0.1:7101,127.0.0.1:7102")
    monkeypatch.setenv("ACS_METADATA_CACHE", " 127.0.0.1:7111 ")
    src = parse_source_options({"root": "/r", "stream": "s"})
    assert (src.data_cache, src.metadata_cache) == ("127.0.0.1:7101,127.0.0.1:7102", "127.0.0.1:7111")
    sink = parse_sink_options({"root": "/r", "stream": "s", "dataCache": "none", "metadataCache": "127.0.0.1:9"})
    assert (sink.data_cache, sink.metadata_cache) == (None, "127.0.0.1:9")
    monkeypatch.setenv("ACS_DATA_CACHE", "nohost")
    with pytest.raises(AcsOptionError, match=r"\$ACS_DATA_CACHE"):
        parse_source_options({"root": "/r", "stream": "s"})


@pytest.mark.parametrize(
    "ddl, opts, needle",
    [
        ("key binary", {"shards": "1"}, "needs a 'value' column"),
        ("value int", {"shards": "1"}, "column 'value' must be binary or string"),
        ("value binary, shard string", {"shards": "1"}, "column 'shard' must be an integer type"),
        ("value binary", {}, "give option 'shards'"),
        ("value binary", {"shards": "1", "colour": "red"}, "unknown option 'colour'"),
    ],
)
def test_bad_sink_input_is_refused(spark, root, ddl, opts, needle):
    df = spark.createDataFrame([], ddl)
    writer = df.write.format("acs").option("root", root).option("stream", "sinkbad").mode("append")
    for k, v in opts.items():
        writer = writer.option(k, v)
    with pytest.raises(Exception) as err:
        writer.save()
    assert needle in str(err.value)


def test_cache_replica_killed_during_streaming_query(spark, tmp_path):
    from pyspark_acs.server.local.deploy import LocalDeployment

    root = str(tmp_path / "store")
    with LocalDeployment(str(tmp_path / "caches")) as dep:
        caches = {"dataCache": dep.data_endpoints, "metadataCache": dep.metadata_endpoints}
        total = 3000
        stop = threading.Event()

        def feed():
            with Producer(root, "live", shards=2, data_cache=dep.data_endpoints,
                          metadata_cache=dep.metadata_endpoints) as p:
                for i in range(total):
                    p.send(b"m%05d" % i, shard=i % 2)
                    if i % 100 == 99:
                        p.flush()
                        time.sleep(0.02)
            stop.set()

        Producer(root, "live", shards=2).close()  # create the stream before the query starts
        reader = spark.readStream.format("acs").option("root", root).option("stream", "live")
        for k, v in caches.items():
            reader = reader.option(k, v)
        q = start_query(reader.option("startingOffsets", "earliest").load()
                        .writeStream.format("memory").queryName("live_rows").trigger(processingTime="0 seconds"))
        try:
            feeder = threading.Thread(target=feed)
            feeder.start()
            wait_until(lambda: spark.table("live_rows").count() > 300, 120, "rows before the kill", interval=0.2)
            dep.kill("data", 0)
            feeder.join(120)
            assert stop.is_set()
            wait_until(lambda: spark.table("live_rows").count() >= total, 120, "every row after the kill", interval=0.2)
            assert q.exception() is None
        finally:
            q.stop()
        rows = spark.table("live_rows").orderBy("shard", "file", "position").select("shard", "value").collect()
        for shard in (0, 1):
            got = [r.value for r in rows if r.shard == shard]
            assert got == [b"m%05d" % i for i in range(shard, total, 2)]


def test_batch_read_with_caches_plans_everything_when_data_cache_lacks_chunks(spark, tmp_path):
    """Published lengths without chunks (the data cache lost them): planning reads headers
    from the durable store instead of waiting for the cache (Algorithm 1 is for tail reads)."""
    from pyspark_acs.server.local.deploy import LocalDeployment

    root = str(tmp_path / "store")
    with LocalDeployment(str(tmp_path / "caches"), data_replicas=1, metadata_replicas=1) as dep:
        produce(root, "nochunks", [(i % 2, None, b"v%d" % i) for i in range(200)],
                metadata_cache=dep.metadata_endpoints)
        df = read_acs(spark, root, "nochunks", dataCache=dep.data_endpoints, metadataCache=dep.metadata_endpoints)
        assert df.count() == 200


def test_the_streaming_planner_imports_no_more_than_it_plans_with():
    """Spark starts a Python process of its own for every streaming query's planning and imports
    the source there (benchmarks/available_now_timeline.py): what that import pulls in is paid by
    every query's start. pyarrow.compute (~20 ms) and grpc are imported only by what uses them
    (row filters, cache clients)."""
    import subprocess
    import sys

    probe = ("import sys, pyspark.sql.datasource, pyarrow; import pyspark_acs.datasource.source; "
             "print(sorted(m for m in ('pyarrow.compute', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- option errors arrive where the query is described ------------------------

_MISSPELT_SOURCE = "did you mean 'startingOffsets'?"


def test_a_misspelt_source_option_fails_at_load_naming_the_nearest(spark, root):
    """``.load()`` raises (stream and batch), and its message holds the one-line acs error
    rather than pyspark's UnboundLocalError from a query that already runs."""
    produce(root, "typo", [(0, None, b"m")], shards=1)
    for reader in (spark.readStream, spark.read):
        described = (reader.format("acs").option("root", root).option("stream", "typo")
                     .option("strartingOffsets", "earliest"))
        with pytest.raises(Exception) as err:
            described.load()
        text = str(err.value)
        assert "acs source: unknown option 'strartingoffsets' (" + _MISSPELT_SOURCE + ")" in text, text
        assert "UnboundLocalError" not in text


def test_a_bad_source_value_fails_at_load(spark, root):
    with pytest.raises(Exception) as err:
        spark.readStream.format("acs").option("root", root).option("stream", "x").option(
            "maxRowsPerTrigger", "many").load()
    assert "maxRowsPerTrigger: 'many' is not a whole number" in str(err.value)


def test_a_misspelt_sink_option_fails_at_save_naming_the_nearest(spark, root):
    df = spark.createDataFrame([("a",)], "value string")
    writer = (df.write.format("acs").mode("append").option("root", root).option("stream", "typo")
              .option("shards", "1").option("rolBytes", "1MiB"))
    with pytest.raises(Exception) as err:
        writer.save()
    assert "acs sink: unknown option 'rolbytes' (did you mean 'rollBytes'?)" in str(err.value)


def test_a_misspelt_sink_option_fails_at_start_naming_the_nearest(spark, root, tmp_path):
    """``writeStream...start()`` raises before the query exists (no query is left running)."""
    import pyspark_acs

    pyspark_acs.register(spark)  # as the README's example does; it installs the start() check
    rows = spark.readStream.format("rate").load().selectExpr("cast(value as string) as value")
    active = len(spark.streams.active)
    writer = (rows.writeStream.format("acs").option("root", root).option("stream", "typo")
              .option("shards", "1").option("checkpointLocation", str(tmp_path / "ck")))
    with pytest.raises(AcsOptionError) as err:
        writer.option("rolBytes", "1MiB").start()
    assert str(err.value).startswith("acs sink: unknown option 'rolBytes' (did you mean 'rollBytes'?)")
    with pytest.raises(AcsOptionError, match="did you mean 'maxBlockBytes'"):  # given to start() itself
        rows.writeStream.format("acs").start(root, maxBlokBytes="1MiB", stream="typo")
    with pytest.raises(AcsOptionError, match="shards: 'two' is not a whole number"):
        rows.writeStream.start(root, format="acs", stream="typo", shards="two")
    assert len(spark.streams.active) == active
    # Other formats are not looked at.
    query = rows.writeStream.format("memory").queryName("typo_other").option("rolBytes", "1").start()
    query.stop()
