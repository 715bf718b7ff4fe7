"""``acs lag`` against a real Spark checkpoint, ``--watch`` of ``acs status`` / ``copy-status`` /
``lag`` (in place on a terminal, a history on a pipe) and the progress bar of ``acs produce``.

Every command runs as a subprocess, as a user runs it; the caches are real servers."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from pyspark_acs.write.producer import Producer
from tests.helpers import deployments, start_query

pytestmark = pytest.mark.timeout(300)

TIMEOUT = 60
ACS = [sys.executable, "-m", "pyspark_acs.cli.main"]


def run(env, *args, stdin: bytes = b"", timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([*ACS, *args], input=stdin, capture_output=True, env=env, timeout=timeout)


@pytest.fixture
def env(subprocess_env):
    e = dict(subprocess_env)
    for name in ("ACS_DATA_CACHE", "ACS_METADATA_CACHE", "ACS_DEPLOYMENT"):
        e.pop(name, None)
    return e


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """One data and one metadata cache server per cluster A and B, for the whole module."""
    with deployments(tmp_path_factory.mktemp("caches"), clusters=("A", "B"), capacity="32MiB") as deps:
        yield deps


def send(root, stream, per_shard, shards=2, size=100, tag=b"m", **kw):
    with Producer(root, stream, shards=shards, **kw) as p:
        for shard in range(shards):
            for i in range(per_shard[shard] if isinstance(per_shard, (list, tuple)) else per_shard):
                p.send(tag + b"%d-%d-" % (shard, i) + b"x" * size, shard=shard)


def lag_json(env, ckpt, root, *extra):
    out = run(env, "lag", "--checkpoint", ckpt, "--root", root, "--json", *extra)
    assert out.returncode == 0, out.stderr.decode()
    return json.loads(out.stdout)


# -- acs lag ---------------------------------------------------------------------------------


def test_lag_reads_a_spark_checkpoint_and_counts_what_is_behind(spark, root, tmp_path, env):
    send(root, "orders", [5, 3])
    ckpt = str(tmp_path / "ckpt")

    def run_query():
        q = start_query(spark.readStream.format("acs").option("root", root).option("stream", "orders")
             .option("startingOffsets", "earliest").load()
             .writeStream.format("noop").option("checkpointLocation", ckpt).trigger(availableNow=True))
        q.awaitTermination(120)
        assert q.exception() is None

    run_query()
    rep = lag_json(env, ckpt, root)
    assert rep["committed_batch"] is not None and rep["basis"] == "committed"
    assert [(r["stream"], r["shard"], r["messages_behind"], r["bytes_behind"]) for r in rep["shards"]] == [
        ("orders", 0, 0, 0), ("orders", 1, 0, 0)]

    # A new writer (new files after the sealed ones): 4 and 7 messages behind, bytes counted by block walks.
    send(root, "orders", [4, 7], tag=b"n")
    rep = lag_json(env, ckpt, root)
    behind = {r["shard"]: r for r in rep["shards"]}
    assert behind[0]["messages_behind"] == 4 and behind[1]["messages_behind"] == 7, rep
    assert rep["messages_behind"] == 11
    assert all(r["bytes_behind"] > r["messages_behind"] * 100 for r in rep["shards"]), rep
    assert behind[0]["end"]["file"] > behind[0]["committed"]["file"]  # past the first file's seal

    # The table form says the same, and --stream filters.
    out = run(env, "lag", "--checkpoint", ckpt, "--root", root, "--stream", "orders")
    assert out.returncode == 0, out.stderr.decode()
    text = out.stdout.decode()
    assert "behind:" in text and "11 messages" in text and "messages_behind" in text, text

    # A batch planned but not committed (Spark died in it): the committed one still counts.
    last = rep["committed_batch"]
    for name in (str(last), f".{last}.crc"):
        if os.path.exists(os.path.join(ckpt, "commits", name)):
            os.remove(os.path.join(ckpt, "commits", name))
    rep2 = lag_json(env, ckpt, root)
    assert rep2["running_batch"] == last and rep2["committed_batch"] in (None, last - 1)

    # The query catches up: nothing behind.
    run_query()
    rep = lag_json(env, ckpt, root)
    assert rep["messages_behind"] == 0 and rep["bytes_behind"] == 0, rep


def test_lag_names_what_is_wrong(tmp_path, root, env):
    out = run(env, "lag", "--checkpoint", str(tmp_path / "typo"), "--root", root)
    assert out.returncode == 1 and b"no checkpoint at" in out.stderr and b"typo" in out.stderr
    (tmp_path / "empty").mkdir()
    out = run(env, "lag", "--checkpoint", str(tmp_path / "empty"), "--root", root)
    assert out.returncode == 1 and b"holds no offset log entry" in out.stderr, out.stderr
    kafka = tmp_path / "kafka-ckpt" / "offsets"
    kafka.mkdir(parents=True)
    (kafka / "0").write_text('v1\n{"batchWatermarkMs":0}\n{"topic":{"0":42}}\n')
    out = run(env, "lag", "--checkpoint", str(kafka.parent), "--root", root)
    assert out.returncode == 1 and b"has acs offsets" in out.stderr, out.stderr
    out = run(env, "lag", "--checkpoint", str(kafka.parent), "--root", str(tmp_path / "nostore"))
    assert out.returncode == 1


def _hand_checkpoint(path, offsets: dict, committed: bool = True) -> None:
    (path / "offsets").mkdir(parents=True)
    (path / "commits").mkdir()
    (path / "offsets" / "0").write_text('v1\n{"batchWatermarkMs":0}\n' + json.dumps(offsets) + "\n")
    if committed:
        (path / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}\n')


def test_lag_watch_on_a_pipe_prints_each_refresh(root, tmp_path, env, caches):
    send(root, "clicks", [2, 2])
    ckpt = tmp_path / "ckpt"
    _hand_checkpoint(ckpt, {"clicks": {"0": {"file": "", "length": 0}, "1": {"file": "", "length": 0}}})
    A = caches["A"]
    proc = subprocess.Popen([*ACS, "lag", "--checkpoint", str(ckpt), "--root", root, "--watch", "--interval",
                             "300ms", "--iterations", "40", "--data-cache", A.data_endpoints, "--metadata-cache",
                             A.metadata_endpoints], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        first = b""
        deadline = time.monotonic() + 30
        while b"4 messages" not in first:
            assert time.monotonic() < deadline, first.decode()[-3000:]
            first += os.read(proc.stdout.fileno(), 65536)
        # More messages while it watches, published through the caches: a later refresh shows them.
        send(root, "clicks", [3, 0], data_cache=A.data_endpoints, metadata_cache=A.metadata_endpoints)
        out = first
        while b"7 messages" not in out:
            assert time.monotonic() < deadline, out
            out += os.read(proc.stdout.fileno(), 65536)
    finally:
        proc.kill()
        proc.wait()
    text = out.decode()
    assert text.count("-- ") >= 2 and "every 300ms" in text, text
    assert "messages_behind" in text


# -- status / copy-status --watch --------------------------------------------------------------


def _run_in_pty(cmd, env, timeout: float = 40.0) -> bytes:
    """Run ``cmd`` with a terminal as stdout (as a user's shell), return all it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.PIPE, env=dict(env, COLUMNS="200", TERM="xterm"))
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=10) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return out


def test_status_watch_redraws_in_place_on_a_terminal(root, env, caches):
    A = caches["A"]
    send(root, "orders", [3, 1], data_cache=A.data_endpoints, metadata_cache=A.metadata_endpoints)
    out = _run_in_pty([*ACS, "status", "--root", root, "--watch", "--interval", "200ms", "--iterations", "3",
                       "--data-cache", A.data_endpoints, "--metadata-cache", A.metadata_endpoints], env)
    text = out.decode(errors="replace")
    # rich's Live moves the cursor up over the previous table (ESC [ n A) and clears its lines.
    assert re.search(r"\x1b\[\d*A", text) and "\x1b[2K" in text, text[:2000]
    assert text.count("published_cache") >= 3, text[:2000]  # three frames
    assert "healthy" in text and "orders" in text
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert re.search(r"orders\s*│\s*0\s*│\s*1\s*│", plain), plain[:2000]


def test_status_watch_on_a_pipe_and_bad_interval(root, env, caches):
    A = caches["A"]
    send(root, "orders", 1)
    out = run(env, "status", "--root", root, "--watch", "--interval", "100ms", "--iterations", "2",
              "--metadata-cache", A.metadata_endpoints)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().count("every 100ms") == 2
    out = run(env, "status", "--root", root, "--watch", "--interval", "soon")
    assert out.returncode == 1 and b"--interval" in out.stderr and b"not a duration" in out.stderr, out.stderr
    out = run(env, "status", "--root", root + "-typo", "--watch", "--iterations", "1")
    assert out.returncode == 1 and b"typo" in out.stderr  # the first refresh fails the command


def test_copy_status_watch_shows_each_cluster_and_how_much_is_copied(tmp_path, env, caches):
    roots = {c: str(tmp_path / f"root-{c}") for c in ("A", "B")}
    topology = tmp_path / "topology.json"
    topology.write_text(json.dumps({
        "clusters": {c: {"root": roots[c], "data_cache": caches[c].data_endpoints,
                         "metadata_cache": caches[c].metadata_endpoints, "copy_daemon": f"127.0.0.1:{7000 + i}"}
                     for i, c in enumerate(("A", "B"))},
        "links": [{"from": "A", "to": "B", "cost": 1}],
        "streams": {"orders": {"source": "A", "destinations": ["B"]}},
    }))
    send(roots["A"], "orders", [5, 5])
    out = run(env, "copy-status", "--topology", str(topology), "--stream", "orders", "--watch", "--interval",
              "100ms", "--iterations", "2")
    assert out.returncode == 0, out.stderr.decode()
    text = out.stdout.decode()
    assert text.count("copy status of stream orders") == 2 and "newest file copied" in text, text
    # B has nothing yet: a row per shard with A as its parent and every byte behind.
    rows = [line for line in text.splitlines() if re.search(r"│\s*B\s*│\s*A\s*│", line)]
    assert len(rows) == 4, text  # two shards, two frames
    assert all(re.search(r"│\s*[1-9][0-9]*\s*│", r) for r in rows)


# -- produce progress -------------------------------------------------------------------------


def test_produce_progress_bar(root, tmp_path, env):
    lines = b"".join(b"line %d\n" % i for i in range(500))
    out = run(env, "produce", "--root", root, "--stream", "bulk", "--progress", stdin=lines)
    assert out.returncode == 0, out.stderr.decode()
    err = out.stderr.decode()
    assert "produce bulk" in err and "500 messages" in err and "messages/s" in err, err
    files = []
    for i in range(3):
        f = tmp_path / f"f{i}"
        f.write_bytes(b"y" * 1000)
        files += ["--file", str(f)]
    out = run(env, "produce", "--root", root, "--stream", "bulk", "--progress", *files)
    assert out.returncode == 0 and "3/3" in out.stderr.decode(), out.stderr.decode()
    # A pipe gets no bar unless asked for.
    out = run(env, "produce", "--root", root, "--stream", "bulk", stdin=b"a\nb\n")
    assert out.returncode == 0 and "messages/s" not in out.stderr.decode()


def test_lag_of_a_checkpoint_against_a_copy_that_is_behind_it(tmp_path, root, env):
    """A checkpoint taken against the source, asked of a destination whose copy holds half of
    the committed offset's file (docs/copy.md, "Moving a reader"): `acs lag` says how many bytes
    the copy lacks and that a query there waits; nothing is behind the checkpoint there yet."""
    import shutil

    from pyspark_acs.format.names import shard_dir
    from pyspark_acs.storage.store import DurableStore

    with Producer(root, "cp", shards=1, roll_bytes=1000) as p:
        for i in range(20):
            p.send(b"m%d-" % i + b"x" * 100)
            p.flush()  # a block per message, files of a few blocks
    store = DurableStore(root)
    files = store.list_files("cp", 0)
    last = files[-2]  # the committed offset: inside a sealed file that is not the newest
    from pyspark_acs.format.block import scan_blocks

    data = open(os.path.join(root, shard_dir("cp", 0), last), "rb").read()
    at = [start for start, _ in scan_blocks(data, final=True)][-2]  # the last message block
    assert at > 200
    _hand_checkpoint(tmp_path / "ck", {"cp": {"0": {"file": last, "length": at}}})
    dest = str(tmp_path / "C")
    DurableStore(dest).create_stream("cp", 1, copied_from="A")
    src, dst = os.path.join(root, shard_dir("cp", 0)), os.path.join(dest, shard_dir("cp", 0))
    for name in files[:-2]:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, last), "rb") as f_in, open(os.path.join(dst, last), "wb") as f_out:
        f_out.write(f_in.read()[:200])
    rep = lag_json(env, str(tmp_path / "ck"), dest)
    (row,) = rep["shards"]
    assert row["copy_behind_bytes"] == at - 200 and "holds 200 bytes so far" in row["waiting"], row
    assert (row["bytes_behind"], row["messages_behind"]) == (0, 0)
    out = run(env, "lag", "--checkpoint", str(tmp_path / "ck"), "--root", dest)
    assert out.returncode == 0 and b"copy is %d bytes short" % (at - 200) in out.stdout, out
    for name in files[-2:]:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    (row,) = lag_json(env, str(tmp_path / "ck"), dest)["shards"]
    assert row["copy_behind_bytes"] == 0 and row["messages_behind"] > 0, row
