"""What a Spark user who knows the Kafka connector expects of ``format("acs")``:
empty ranges read as empty DataFrames, no empty micro-batch after each sealed file, stream-only
options refused on streams, per-shard starting timestamps and an ending timestamp, a ``stream``
column that routes rows, and Kafka's columns refused instead of silently dropped.

Every test runs real Spark (the session's local SparkSession) on real files.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from chispa import assert_df_equality

from pyspark_acs import Producer
from pyspark_acs.read.consumer import Consumer
from tests.helpers import ROOT, read_acs, start_query

pytestmark = pytest.mark.spark


def values_of(df):
    return [r.value for r in df.orderBy("shard", "file", "position").select("value").collect()]


def test_empty_ranges_read_as_empty_dataframes(spark, root):
    Producer(root, "empty", shards=2).close()
    assert read_acs(spark, root, "empty").count() == 0
    with Producer(root, "some", shards=2) as p:
        for i in range(10):
            p.send(b"m%d" % i, shard=i % 2)
    assert read_acs(spark, root, "some", startingOffsets="latest").count() == 0
    assert read_acs(spark, root, "some").count() == 10


def test_no_empty_micro_batch_after_sealed_files(spark, root, tmp_path):
    """Each file's seal moves the reader to the next file, but carries no message: no batch."""
    sizes = []

    def record(df, batch_id):
        # Spark runs a new query's batch 0 whatever the source answers (no committed offsets to
        # compare with: MicroBatchExecution.isNewDataAvailable), empty when it starts before the
        # first message; every later batch is one the source asked for.
        if batch_id > 0 or df.count():
            sizes.append(df.count())

    def wait_rows(n):
        deadline = time.monotonic() + 120
        while sum(sizes) < n and time.monotonic() < deadline:
            time.sleep(0.1)

    Producer(root, "rolls", shards=1).close()
    q = start_query(spark.readStream.format("acs").option("root", root).option("stream", "rolls")
         .option("startingOffsets", "earliest").load()
         .writeStream.foreachBatch(record).option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="100 milliseconds"))
    try:
        for i in range(4):
            with Producer(root, "rolls", shards=1) as p:  # a new file each time; close seals it
                p.send(b"m%d" % i)
                p.flush()
                wait_rows(i + 1)
            time.sleep(1.0)  # several triggers see the seal (and nothing else)
    finally:
        q.stop()
    assert sum(sizes) == 4, sizes
    assert 0 not in sizes, f"empty micro-batches ran: {sizes}"


def _file_with_a_voided_tail_then_a_second_file(root):
    """Shard 0: file 1 = message ``a`` + a torn 300 KB block voided by its recovery seal; file 2 =
    message ``b``. Returns (file 1, bytes of the first block)."""
    from pyspark_acs.format.block import encode_block, encode_seal
    from pyspark_acs.format.names import next_file_name, shard_dir
    from pyspark_acs.storage.store import open_store

    store = open_store(root)
    store.create_stream("voided", 1)
    first = encode_block([b"a"], timestamps=[1])
    big = encode_block([b"x" * 600000], timestamps=[2], first_index=1)
    f1 = next_file_name([], "w1")
    store.write_small(f"{shard_dir('voided', 0)}/{f1}", first + big[:300000] + encode_seal(1, void_from=len(first)))
    f2 = next_file_name([f1], "w2")
    store.write_small(f"{shard_dir('voided', 0)}/{f2}", encode_block([b"b"], timestamps=[3]))
    return f1, len(first)


def test_a_byte_budget_ending_in_voided_bytes_still_moves_on(spark, root, tmp_path):
    """Review finding (HIGH): with maxBytesPerTrigger cutting a range right after a seal or voided
    bytes, the no-empty-batch rule held the shard at its offset for ever (an AvailableNow query
    ended without 'b'). The range now takes the next message block too."""
    _file_with_a_voided_tail_then_a_second_file(root)
    q = start_query(spark.readStream.format("acs").option("root", root).option("stream", "voided")
         .option("startingOffsets", "earliest").option("maxBytesPerTrigger", "100000").load()
         .selectExpr("CAST(value AS STRING) v")
         .writeStream.format("memory").queryName("voided_budget")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True))
    q.awaitTermination(120)
    assert q.exception() is None
    assert [r.v for r in spark.sql("select v from voided_budget").collect()] == ["a", "b"]


def test_a_tiny_budget_share_does_not_starve_a_shard_behind_a_seal(root):
    """A shard whose share of maxBytesPerTrigger is smaller than a seal still passes the seal and
    reads its next message in the same trigger, while another shard has a large backlog."""
    from pyspark.sql.streaming.datasource import ReadMaxBytes

    from pyspark_acs.datasource.options import parse_source_options
    from pyspark_acs.datasource.source import AcsStreamReader
    from pyspark_acs.format.offsets import parse_offsets

    with Producer(root, "skew", shards=2) as p:
        p.send(b"x", shard=1)
    with Producer(root, "skew", shards=2) as p:  # shard 1: a sealed file, then a new one
        p.send(b"y", shard=1)
        for _ in range(2000):
            p.send(b"z" * 1000, shard=0)
    reader = AcsStreamReader(parse_source_options({"root": root, "stream": "skew", "maxBytesPerTrigger": "100000"}))
    start = reader.initialOffset()  # latest by default: take the first message of each shard instead
    first = parse_offsets(start)
    from pyspark_acs.read.consumer import Consumer as _C

    c = _C(root, "skew", shards=[1])
    next(c.batches(timeout=1))  # past 'x' (its file is sealed behind it)
    after_x = c.offsets()
    c.close()
    begin = {"skew": {"0": {"file": "", "length": 0}, "1": after_x["skew"]["1"]}}
    end = parse_offsets(reader.latestOffset(begin, ReadMaxBytes(100000)))
    shard1 = end[("skew", 1)]
    assert shard1.file != after_x["skew"]["1"]["file"], "shard 1 stayed behind its seal"
    assert shard1.length > 0 and first is not None


@pytest.mark.parametrize("name, value", [
    ("endingOffsets", "latest"),
    ("endingTimestamp", "1700000000000"),
])
def test_ending_options_are_refused_on_streams_with_the_reason(spark, root, name, value):
    Producer(root, "ends", shards=1).close()
    df = (spark.readStream.format("acs").option("root", root).option("stream", "ends")
          .option(name, value).load())
    # Started through start_query: a start whose Python planner did not connect back (a
    # loaded machine) is started again instead of being taken for the refusal.
    query = start_query(df.writeStream.format("memory").queryName(f"ends_{name}"))
    with pytest.raises(Exception) as err:
        query.awaitTermination(60)
    text = str(err.value)
    assert name in text and "batch reads only" in text and "availableNow" in text


def test_starting_offsets_by_timestamp_per_shard_and_ending_timestamp(spark, root):
    def send(tag, n):
        with Producer(root, "times", shards=2) as p:
            for i in range(n):
                p.send(b"%s-%d" % (tag, i), shard=i % 2)

    send(b"a", 20)
    time.sleep(0.05)
    t1 = int(time.time() * 1000)
    time.sleep(0.05)
    send(b"b", 20)
    time.sleep(0.05)
    t2 = int(time.time() * 1000)
    time.sleep(0.05)
    send(b"c", 20)

    # Shard 0 from t1, shard 1 by startingOffsets (earliest).
    df = read_acs(spark, root, "times", startingOffsetsByTimestamp=json.dumps({"times": {"0": t1}}))
    got = {(r.shard, r.value) for r in df.collect()}
    want = {(0, b"%s-%d" % (t, i)) for t in (b"b", b"c") for i in range(0, 20, 2)}
    want |= {(1, b"%s-%d" % (t, i)) for t in (b"a", b"b", b"c") for i in range(1, 20, 2)}
    assert got == want
    # endingTimestamp: everything stamped before t2, nothing after.
    df = read_acs(spark, root, "times", endingTimestamp=str(t2))
    assert sorted(values_of(df)) == sorted(b"%s-%d" % (t, i) for t in (b"a", b"b") for i in range(20))
    # Both ends by time.
    df = read_acs(spark, root, "times", startingTimestamp=str(t1), endingTimestamp=str(t2))
    assert sorted(values_of(df)) == sorted(b"b-%d" % i for i in range(20))


@pytest.mark.parametrize("opts, needle", [
    ({"startingOffsetsByTimestamp": '{"times": {"0": "soon"}}'}, "is not a timestamp"),
    ({"startingOffsetsByTimestamp": '{"other": {"0": 5}}'}, "not in option stream"),
    ({"startingOffsetsByTimestamp": '{"times": {"7": 5}}'}, "times/7 is not a shard"),
    ({"startingOffsetsByTimestamp": '{"times": {"0": 5}}', "startingTimestamp": "5"}, "not both"),
    ({"endingTimestamp": "5", "endingOffsets": "latest"}, "not both"),
])
def test_bad_timestamp_options_are_named(spark, root, opts, needle):
    Producer(root, "times", shards=2).close()
    with pytest.raises(Exception) as err:
        read_acs(spark, root, "times", **opts).count()
    assert needle in str(err.value)


def test_a_stream_column_routes_rows_and_the_stream_option_overrides_it(spark, root):
    rows = [(f"s{i % 3}", b"v%d" % i) for i in range(60)]
    df = spark.createDataFrame(rows, "stream string, value binary").repartition(2)
    df.write.format("acs").option("root", root).option("shards", 2).mode("append").save()
    for s in range(3):
        got = [r.value for r in read_acs(spark, root, f"s{s}").collect()]
        assert sorted(got) == sorted(v for name, v in rows if name == f"s{s}")
    # The option wins over the column (Kafka's topic option does the same): an acs source's
    # rows, with their stream, file and position columns, land in another stream.
    src = read_acs(spark, root, "s0")
    src.write.format("acs").option("root", root).option("stream", "copy").option("shards", 2).mode("append").save()
    assert sorted(values_of(read_acs(spark, root, "copy"))) == sorted(values_of(src))


def test_a_streaming_query_routes_by_the_stream_column_exactly_once(spark, root, tmp_path):
    with Producer(root, "mixed", shards=2) as p:
        for i in range(200):
            p.send(b"%d" % i, shard=i % 2)
    q = start_query(spark.readStream.format("acs").option("root", root).option("stream", "mixed")
         .option("startingOffsets", "earliest").option("maxRowsPerTrigger", 60).load()
         .selectExpr("concat('out', CAST(shard AS STRING)) AS stream", "value")
         .writeStream.format("acs").option("root", root).option("shards", 1)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True))
    q.awaitTermination(180)
    assert q.exception() is None
    for shard in (0, 1):
        c = Consumer(root, f"out{shard}")
        got = [r["value"] for b in c.batches(timeout=0.3) for r in b.to_pylist()]
        c.close()
        assert got == [b"%d" % i for i in range(shard, 200, 2)]


@pytest.mark.parametrize("ddl, opts, needle", [
    ("topic string, value binary", {"stream": "x"}, "column 'topic' is not written (name the target stream"),
    ("partition int, value binary", {"stream": "x"}, "column 'partition' is not written (name the target shard"),
    ("headers array<string>, value binary", {"stream": "x"}, "column 'headers' must be array<struct<key: string"),
    ("colour string, value binary", {"stream": "x"}, "column 'colour' is not written"),
    ("value binary", {}, "give option 'stream'"),
    ("stream int, value binary", {}, "column 'stream' must be string"),
    ("stream string, file string, position bigint, value binary", {}, "would go back to the stream they were read"),
])
def test_columns_the_sink_would_drop_are_refused_by_name(spark, root, ddl, opts, needle):
    df = spark.createDataFrame([], ddl)
    writer = df.write.format("acs").option("root", root).option("shards", 1).mode("append")
    for k, v in opts.items():
        writer = writer.option(k, v)
    with pytest.raises(Exception) as err:
        writer.save()
    assert needle in str(err.value)


def test_rows_without_a_stream_or_naming_a_bad_one_are_refused(spark, root):
    df = spark.createDataFrame([("a", b"1"), (None, b"2")], "stream string, value binary").repartition(1)
    with pytest.raises(Exception) as err:
        df.write.format("acs").option("root", root).option("shards", 1).mode("append").save()
    assert "column 'stream' is null" in str(err.value)
    df = spark.createDataFrame([("../etc", b"1")], "stream string, value binary")
    with pytest.raises(Exception) as err:
        df.write.format("acs").option("root", root).option("shards", 1).mode("append").save()
    assert "column 'stream'" in str(err.value) and "../etc" in str(err.value)
    df = spark.createDataFrame([("nosuch", b"1")], "stream string, value binary")
    with pytest.raises(Exception) as err:
        df.write.format("acs").option("root", root).mode("append").save()
    assert "stream 'nosuch' (column 'stream') does not exist" in str(err.value)


# -- the interpreter Spark's Python workers run ------------------------------------------------

JOB = '''
import os, sys
{setup}
from pyspark.sql import SparkSession
import pyspark_acs

spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
try:
    pyspark_acs.register(spark)
    n = spark.read.format("acs").option("root", sys.argv[1]).option("stream", "interp").load().count()
    print("ROWS", n)
finally:
    spark.stop()
'''

#: A plain job that imports pyspark_acs and never calls register().
PLAIN_JOB = '''
import sys
import pyspark_acs
from pyspark.sql import SparkSession

spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
try:
    print("ROWS", spark.read.format("acs").option("root", sys.argv[1]).option("stream", "interp").load().count())
finally:
    spark.stop()
'''


@pytest.fixture(scope="module")
def bare_python_path(tmp_path_factory):
    """A PATH whose ``python3`` cannot run the source, as a machine's system Python: a bare venv
    (no pyarrow, no grpc, no pyspark_acs installed) first, and the test interpreter's bin left out
    (as when a user runs ``.venv/bin/python job.py`` without activating the venv)."""
    import subprocess
    import sys

    from pyspark_acs.datasource.interpreter import _PROBE

    bare = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare / "venv")], check=True)
    venv_bin = os.path.dirname(os.path.abspath(sys.executable))
    rest = [d for d in os.environ["PATH"].split(os.pathsep) if d and os.path.abspath(d) != venv_bin]
    path = os.pathsep.join([str(bare / "venv" / "bin")] + rest)
    # The premise: the job's own environment (PYTHONPATH points at this checkout, so the package
    # itself imports) gives PATH's python3 nothing the source needs.
    probe = subprocess.run(["python3", "-c", _PROBE], env=_job_env(path), capture_output=True, text=True,
                           cwd=str(bare), timeout=120)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, (path, probe.stderr)
    return path


def _job_env(path, **extra):
    """The environment of a user's shell: no PYSPARK_* or ACS_WORKER_PYTHON the test process set."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYSPARK_SUBMIT_ARGS", "ACS_WORKER_PYTHON")}
    env["PATH"] = path
    env.update(extra)
    return env


def _run_job(tmp_path, root, setup, path, job=JOB, **extra):
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(job.format(setup=setup))
    return subprocess.run([sys.executable, str(script), root], cwd=str(tmp_path), env=_job_env(path, **extra),
                          capture_output=True, text=True, timeout=300)


def _why(run) -> str:
    """A failed job's error lines (Spark's own, e.g. DATA_SOURCE_NOT_FOUND, sit above a Java
    stack trace that fills the tail), then the tail."""
    errors = [line for line in run.stderr.splitlines() if "Error" in line or "Exception:" in line]
    return "\n".join(errors[:8]) + "\n--- stderr tail\n" + run.stderr[-2000:]


def test_workers_without_the_package_fail_naming_both_interpreters_and_the_fix(root, tmp_path, bare_python_path):
    """With the import's switch off (ACS_WORKER_PYTHON=off) register() still names both
    interpreters, why they differ and the fix."""
    import sys

    Producer(root, "interp", shards=1).close()
    run = _run_job(tmp_path, root, "", bare_python_path, ACS_WORKER_PYTHON="off")
    assert run.returncode != 0
    err = run.stderr
    assert "Spark's Python workers run 'python3'" in err, err[-3000:]
    assert "cannot import pyspark_acs" in err and f"this driver runs {sys.executable!r}" in err
    assert "importing pyspark_acs left it alone, as $ACS_WORKER_PYTHON is off" in err, err[-3000:]
    assert f"PYSPARK_PYTHON={sys.executable}" in err


def test_the_readme_job_runs_from_a_plain_venv_python(root, tmp_path, bare_python_path):
    with Producer(root, "interp", shards=1) as p:
        for i in range(7):
            p.send(b"%d" % i)
    run = _run_job(tmp_path, root, 'os.environ.setdefault("PYSPARK_PYTHON", sys.executable)', bare_python_path)
    assert run.returncode == 0, _why(run)
    assert "ROWS 7" in run.stdout


def test_a_plain_venv_job_reads_acs_without_register(root, tmp_path, bare_python_path):
    """A plain ``.venv/bin/python job.py`` that imports pyspark_acs and reads
    ``format("acs")`` without register(), PATH's python3 lacking the package: importing
    pyspark_acs points the workers (and Spark's lookup of the name) at the driver's interpreter,
    where Spark said only DATA_SOURCE_NOT_FOUND."""
    with Producer(root, "interp", shards=1) as p:
        for i in range(7):
            p.send(b"%d" % i)
    run = _run_job(tmp_path, root, "", bare_python_path, job=PLAIN_JOB)
    assert run.returncode == 0, _why(run)
    assert "ROWS 7" in run.stdout


def test_a_session_started_before_the_import_is_left_alone(spark):
    """Too late to matter for a running SparkContext: the import changes nothing then, and
    register() says why (here the test session is running)."""
    from pyspark_acs import worker_python

    before = worker_python.choice
    env = {}
    try:
        chose = worker_python.point_workers_at_driver(env)
    finally:
        worker_python.choice = before  # what this process's import chose, for later register() messages
    assert chose.python is None and env == {}
    assert "a SparkContext was running before pyspark_acs was imported" in chose.reason


def test_headers_round_trip_through_sink_source_and_producer(spark, root):
    """Kafka's headers: written by the sink's headers column and by Producer.send(headers=...),
    read by includeHeaders (null for messages without); files without headers read as before."""
    from pyspark.sql import Row

    with Producer(root, "hdrs", shards=1) as p:
        p.send(b"plain")
        p.send(b"tagged", headers=[("trace", b"t1"), ("empty", None)])
    rows = [Row(value=b"s%d" % i, headers=[Row(key="n", value=b"%d" % i)] if i % 2 else None) for i in range(6)]
    df = spark.createDataFrame(rows, "value binary, headers array<struct<key: string, value: binary>>")
    df.repartition(1).write.format("acs").option("root", root).option("stream", "hdrs").mode("append").save()
    got = (spark.read.format("acs").option("root", root).option("stream", "hdrs").option("includeHeaders", "true")
           .load().orderBy("file", "position").select("value", "headers").collect())
    as_py = [(r.value, None if r.headers is None else [(h.key, h.value) for h in r.headers]) for r in got]
    assert as_py == [(b"plain", None), (b"tagged", [("trace", b"t1"), ("empty", None)])] + [
        (b"s%d" % i, [("n", b"%d" % i)] if i % 2 else None) for i in range(6)
    ]
    plain = spark.read.format("acs").option("root", root).option("stream", "hdrs").load()
    assert "headers" not in plain.columns and plain.count() == 8


def test_a_length_pushed_while_latest_offset_looks_is_in_its_answer(root, tmp_path, monkeypatch):
    """The lengths of a sink's batch are published in one write but reach the source's planner
    as separate pushes (their keys live on different replicas). latestOffset, woken by the
    first, answered with only that shard moved and left the other shard's rows for a whole
    micro-batch later (the worst burst of a delay run, 488 ms against a p50 of 266). When some
    shards moved and others did not and a length moved while it looked, it looks again."""
    import time

    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from pyspark_acs.datasource.options import parse_source_options
    from pyspark_acs.datasource.source import AcsStreamReader, _Planner
    from pyspark_acs.format.offsets import parse_offsets
    from pyspark_acs.server.local.deploy import LocalDeployment

    dep = LocalDeployment(tmp_path / "caches", data_replicas=1, metadata_replicas=1, capacity="32MiB").start()
    caches = {"data_cache": dep.data_endpoints, "metadata_cache": dep.metadata_endpoints}
    try:
        with Producer(root, "pushed", shards=2, **caches) as p:
            for shard in (0, 1):
                p.send(b"first", shard=shard)
            p.flush()
            reader = AcsStreamReader(parse_source_options({
                "root": root, "stream": "pushed", "dataCache": dep.data_endpoints,
                "metadataCache": dep.metadata_endpoints}))
            begin = reader.latestOffset({"pushed": {"0": {"file": "", "length": 0},
                                                    "1": {"file": "", "length": 0}}}, ReadAllAvailable())
            before = parse_offsets(begin)

            def lands(shard, path):  # a message of `shard`, once its length reached the reader
                token = path.change_token()
                p.send(b"second", shard=shard)
                p.flush()
                deadline = time.monotonic() + 30
                while path.change_token() == token and time.monotonic() < deadline:
                    time.sleep(0.01)

            lands(0, reader.planner.path)
            real = _Planner.limited
            looks = []

            def shard_1_lands_during_the_first_look(self, start, limit):
                out = real(self, start, limit)
                if not looks:  # shard 1's length arrives while the first look is under way
                    lands(1, self.path)
                looks.append(out)
                return out

            monkeypatch.setattr(_Planner, "limited", shard_1_lands_during_the_first_look)
            end = parse_offsets(reader.latestOffset(begin, ReadAllAvailable()))
            reader.stop()
        first_end = looks[0][0]
        assert first_end[("pushed", 0)] > before[("pushed", 0)]  # the first look saw shard 0 moved ...
        assert first_end[("pushed", 1)] == before[("pushed", 1)]  # ... and missed shard 1 ...
        assert end[("pushed", 0)] > before[("pushed", 0)]
        assert end[("pushed", 1)] > before[("pushed", 1)]  # ... the answer has it
    finally:
        dep.stop()


def _readme_python_blocks():
    from pathlib import Path

    text = (Path(ROOT) / "README.md").read_text(encoding="utf-8")
    return [m.group(1) for m in __import__("re").finditer(r"```python\n(.*?)```", text, flags=__import__("re").S)]


def test_the_readmes_batch_write_runs_as_written(tmp_path, subprocess_env):
    """Spark's default save mode (ErrorIfExists) fails before the sink runs: the README's batch
    write says ``.mode("append")``, and runs as written, as a job of its own in a fresh folder
    (its relative root resolves in the driver's and the workers' working folder)."""
    import subprocess
    import sys

    writes = [b for b in _readme_python_blocks() if '.write.format("acs")' in b]
    assert writes, "README.md shows no batch write"
    for code in writes:
        assert '.mode("append")' in code, code
        env = {k: v for k, v in subprocess_env.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
        run = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.split()[-1] == "2", run.stdout
        assert (tmp_path / "acs-data" / "greetings").is_dir()


def test_a_query_restarted_from_its_checkpoint_against_a_lagging_copy_waits_for_it(spark, tmp_path):
    """A query's checkpoint moves to another cluster (docs/copy.md, "Moving a reader"): run
    against A, then restarted from the same checkpoint against C, a destination whose copy
    holds less than the checkpoint's offsets. The query does not fail (no DataLossError for
    bytes still coming) and plans nothing until the copy comes; then it delivers exactly the
    messages after the checkpoint, in order."""
    import shutil

    from pyspark_acs.format.names import shard_dir
    from pyspark_acs.storage.store import DurableStore

    a, c = str(tmp_path / "A"), str(tmp_path / "C")
    with Producer(a, "mv", shards=1, roll_bytes=600, max_block_bytes=1024) as p:
        for i in range(20):
            p.send(b"m%03d" % i)
            p.flush()
    ck = str(tmp_path / "ck")

    got = {"moved_a": [], "moved_c": []}

    def run(root, trigger, name):
        def record(df, batch_id):  # the memory sink cannot restart from a checkpoint
            got[name].extend(r.v for r in df.orderBy("file", "position").collect())

        return start_query(spark.readStream.format("acs").option("root", root).option("stream", "mv")
                           .option("startingOffsets", "earliest").load()
                           .selectExpr("CAST(value AS STRING) v", "file", "position")
                           .writeStream.foreachBatch(record)
                           .option("checkpointLocation", ck).trigger(**trigger))

    q = run(a, {"availableNow": True}, "moved_a")
    q.awaitTermination(120)
    assert q.exception() is None
    assert got["moved_a"] == ["m%03d" % i for i in range(20)]
    at_checkpoint = DurableStore(a).list_files("mv", 0)  # the last one holds the checkpoint's offset
    with Producer(a, "mv", shards=1, roll_bytes=600, max_block_bytes=1024) as p:
        for i in range(20, 30):
            p.send(b"m%03d" % i)
            p.flush()
    files = DurableStore(a).list_files("mv", 0)
    DurableStore(c).create_stream("mv", 1, copied_from="A")
    src, dst = os.path.join(a, shard_dir("mv", 0)), os.path.join(c, shard_dir("mv", 0))
    for name in at_checkpoint[:-1]:  # C's copy is behind the checkpoint: half of its file
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    last = at_checkpoint[-1]
    with open(os.path.join(src, last), "rb") as f_in, open(os.path.join(dst, last), "wb") as f_out:
        f_out.write(f_in.read()[: os.path.getsize(os.path.join(src, last)) // 2])
    q = run(c, {"processingTime": "100 milliseconds"}, "moved_c")
    try:
        time.sleep(3.0)
        assert q.exception() is None and q.isActive
        assert got["moved_c"] == []
        for name in files[len(at_checkpoint) - 1:]:
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
        deadline = time.monotonic() + 120
        while len(got["moved_c"]) < 10 and time.monotonic() < deadline:
            assert q.exception() is None
            time.sleep(0.2)
        time.sleep(1.0)  # nothing more arrives
    finally:
        q.stop()
    assert got["moved_c"] == ["m%03d" % i for i in range(20, 30)]
