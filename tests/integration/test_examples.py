"""The runnable examples: examples/demo.py, examples/producer_job.py + consumer_job.py, and the
jars-free launcher jars-free/cache_server.py, each run as its own process (as a user would).

Spark-heavy runs are marked ``spark``; every wait is bounded, and a process that overruns
gets SIGTERM (the scripts clean up on it), then SIGKILL.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import List

import pytest

from tests.helpers import ROOT, free_port

EXAMPLES = Path(ROOT) / "examples"
JARS_FREE = Path(ROOT) / "jars-free"


def run(cmd: List[str], env, timeout: float, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """Run ``cmd``; on timeout SIGTERM it (scripts clean up), then SIGKILL, and fail with its output."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout:.0f} s; output tail:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}; output tail:\n{result.stdout[-6000:]}"


@pytest.fixture
def env(subprocess_env):
    e = dict(subprocess_env)
    e["PYSPARK_PYTHON"] = sys.executable
    e["PYSPARK_DRIVER_PYTHON"] = sys.executable
    return e


# -- jars-free/cache_server.py ------------------------------------------------------------------


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    got: List[str] = []
    t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return got[0].strip() if got else ""


def test_cache_server_launcher_serves_and_stops_on_sigterm(env, tmp_path):
    cmd = [sys.executable, str(JARS_FREE / "cache_server.py"), "--role", "data", "--port", "0", "--capacity", "16MiB",
           "--metrics-port", "-1"]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        line = _first_line(proc, 30.0)
        assert re.match(r"acs-cache-server role=data listening on 127\.0\.0\.1:\d+ metrics=off$", line), (
            line, proc.poll())
        endpoint = line.split(" listening on ", 1)[1].split()[0]

        from pyspark_acs.cache.client import CacheClient

        with CacheClient(endpoint, name="data cache") as client:  # it really serves
            client.put([(b"k", b"v" * 10, 10)])
            assert client.get([b"k"])[0].value == b"v" * 10

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_cache_server_launcher_help_and_bad_flag(env):
    ok = run([sys.executable, str(JARS_FREE / "cache_server.py"), "--help"], env, 60)
    assert ok.returncode == 0 and "--role" in ok.stdout and "--capacity" in ok.stdout, explain(ok)
    bad = run([sys.executable, str(JARS_FREE / "cache_server.py"), "--role", "data", "--capacity", "lots"], env, 60)
    assert bad.returncode == 2 and "--capacity" in bad.stdout, explain(bad)


def _topology(tmp_path, port: int) -> str:
    import json

    path = tmp_path / "topology.json"
    path.write_text(json.dumps({"clusters": {"A": {
        "root": str(tmp_path / "A"), "data_cache": "127.0.0.1:9", "metadata_cache": "127.0.0.1:9",
        "copy_daemon": f"127.0.0.1:{port}"}}}))
    return str(path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("launcher", ["cache_server.py", "copy_daemon.py"])
def test_a_launcher_under_spark_submit_exits_with_the_jvm(env, tmp_path, launcher):
    """Killing ``spark-submit`` (here: the launcher's parent, with spark-submit's environment)
    stops the server too: no orphan holding its port."""
    import os
    import time


    args = (["--role", "data", "--port", "0", "--metrics-port", "-1"] if launcher == "cache_server.py"
            else ["--topology", _topology(tmp_path, free_port()), "--cluster", "A", "--metrics-port", "-1"])
    parent_code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, {str(JARS_FREE / launcher)!r}, *{args!r}])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=dict(env, PYSPARK_GATEWAY_PORT="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=str(tmp_path))
    try:
        child = int(_first_line(parent, 30.0))
        # Serving (it shares the parent's stdout): it has read its parent's pid by then. A fixed
        # sleep here lost that race on a loaded machine, where importing grpc alone takes 2 s.
        listening = _first_line(parent, 60.0)
        assert "listening on" in listening, listening
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), f"{launcher} (pid {child}) outlived its spark-submit parent"
    finally:
        parent.kill()


def test_a_second_copy_daemon_for_the_same_address_does_not_start(env, tmp_path):

    topology = _topology(tmp_path, free_port())
    cmd = [sys.executable, str(JARS_FREE / "copy_daemon.py"), "--topology", topology, "--cluster", "A",
           "--metrics-port", "-1"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "listening on" in _first_line(first, 30.0)
        second = run(cmd, env, 60)
        assert second.returncode == 1 and "cannot bind the copy daemon port" in second.stdout, explain(second)
    finally:
        first.kill()
        first.wait(10)


# -- examples/producer_job.py + consumer_job.py -------------------------------------------------


def test_job_help(env):
    for script in ("producer_job.py", "consumer_job.py", "demo.py"):
        result = run([sys.executable, str(EXAMPLES / script), "--help"], env, 60)
        assert result.returncode == 0 and "usage:" in result.stdout, (script, explain(result))
    missing = run([sys.executable, str(EXAMPLES / "consumer_job.py")], env, 60)
    assert missing.returncode == 2 and "--root" in missing.stdout, explain(missing)


@pytest.mark.spark
def test_producer_job_then_consumer_job_available_now(env, tmp_path):
    root = str(tmp_path / "store")
    produced = run(
        [sys.executable, str(EXAMPLES / "producer_job.py"), "--root", root, "--stream", "events", "--shards", "3",
         "--messages", "2500", "--rows-per-batch", "1000", "--trigger-interval", "0 seconds", "--value-bytes", "64",
         "--checkpoint", str(tmp_path / "ckpt-producer")],
        env, 240,
    )
    assert produced.returncode == 0, explain(produced)
    assert "done: 2500 messages written to 'events'" in produced.stdout, explain(produced)
    # Stopping the never-ending rate query once done logs no aborted write at ERROR.
    assert " ERROR " not in produced.stdout, explain(produced)

    consumed = run(
        [sys.executable, str(EXAMPLES / "consumer_job.py"), "--root", root, "--stream", "events", "--available-now",
         "--max-rows-per-trigger", "1000", "--show", "1", "--expect", "2500",
         "--checkpoint", str(tmp_path / "ckpt-consumer")],
        env, 240,
    )
    assert consumed.returncode == 0, explain(consumed)
    summary = re.search(r"consumed (\d+) messages \((\d+) value bytes\) in (\d+) batches", consumed.stdout)
    assert summary, explain(consumed)
    assert int(summary.group(1)) == 2500 and int(summary.group(2)) == 2500 * 64, explain(consumed)
    assert int(summary.group(3)) >= 3, explain(consumed)  # maxRowsPerTrigger=1000 under AvailableNow
    assert "value=b'000000000000:xxx" in consumed.stdout, explain(consumed)


# -- examples/demo.py ---------------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
def test_demo_runs_end_to_end(env):
    result = run([sys.executable, str(EXAMPLES / "demo.py"), "--messages", "6000", "--rate", "1500",
                  "--timeout", "200"], env, 270)
    assert result.returncode == 0, explain(result)
    out = result.stdout
    assert "byte-exact: 6000/6000 messages match" in out, explain(result)
    assert "byte-exact: a batch read of the durable store equals the 6000 streamed rows" in out, explain(result)
    assert re.search(r"delivery delay \(source row arrival - message timestamp\).*p50 \d+ ms\s+p99 \d+ ms", out), (
        explain(result))
    # gRPC's C core may log a channel's GOAWAY from a server stopped last ("I1201 ... .cc:...]"):
    # its own log line, not the demo's.
    lines = [line for line in out.splitlines() if not re.match(r"[IWE]\d{4} [\d:.]+\s+\d+ \w+\.cc:\d+\]", line)]
    assert "demo OK" in out and "stopped" in lines[-1], explain(result)
    # Stopping the never-ending rate query once done logs no aborted write at ERROR.
    assert " ERROR " not in out, explain(result)
    if "cluster B: skipped" not in out:
        assert "byte-exact: cluster B holds the same 6000 messages" in out, explain(result)


def _load_demo():
    spec = importlib.util.spec_from_file_location("acs_demo", EXAMPLES / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_verification_catches_mismatches(tmp_path):
    """The demo's checks (no Spark): a right stream passes; a flipped byte, a lost, a duplicated or
    a reordered message each fail with a message saying what differs."""
    import pyarrow as pa

    demo_mod = _load_demo()
    n, vb, shards = 40, 100, 2

    def table(numbers, corrupt=None):
        rows = {"shard": [], "position": [], "file": [], "timestamp": [], "key": [], "value": []}
        positions = {}
        for v in numbers:
            key = demo_mod.expected_key(v)
            shard = demo_mod.zlib.crc32(key) % shards
            value = demo_mod.expected_value(v, vb)
            if v == corrupt:
                value = value[:-1] + b"!"
            rows["shard"].append(shard)
            rows["position"].append(positions.setdefault(shard, 0))
            positions[shard] += 1
            rows["file"].append("f.acs")
            rows["timestamp"].append(1_700_000_000_000_000 + v)
            rows["key"].append(key)
            rows["value"].append(value)
        return pa.table({**rows, "timestamp": pa.array(rows["timestamp"], pa.timestamp("us", tz="UTC"))})

    def check(numbers, **kw):
        d = demo_mod.Demo(demo_mod.parse_args(["--messages", str(n), "--value-bytes", str(vb), "--shards",
                                               str(shards), "--workdir", str(tmp_path / "w")]))
        d.collector.tables.append((0.0, table(numbers, **kw)))
        return d.verify_stream()

    assert len(check(list(range(n)))) == n
    with pytest.raises(demo_mod.Mismatch, match="message 7 .*value differs"):
        check(list(range(n)), corrupt=7)
    with pytest.raises(demo_mod.Mismatch, match=r"1 messages missing \(first: \[5\]\)"):
        check([v for v in range(n) if v != 5])
    with pytest.raises(demo_mod.Mismatch, match="message 3 arrived twice"):
        check(list(range(n)) + [3])
    same = [v for v in range(n) if demo_mod.zlib.crc32(demo_mod.expected_key(v)) % shards == 0][:2]
    swapped = list(range(n))
    swapped[same[0]], swapped[same[1]] = same[1], same[0]
    with pytest.raises(demo_mod.Mismatch, match="shard 0: messages out of order"):
        check(swapped)


def test_demo_goes_on_without_cluster_b_when_the_copy_daemon_does_not_start(tmp_path, monkeypatch):
    """--copy auto: a copy daemon that fails to start is reported and cluster B is skipped
    (cluster A's servers keep running); --copy on makes it an error."""
    demo_mod = _load_demo()

    def broken(self, dep):
        raise demo_mod.DemoError("copy daemon of cluster A did not start (exit 1): boom")

    monkeypatch.setattr(demo_mod.Demo, "start_cluster_b", broken)
    for mode in ("auto", "on"):
        d = demo_mod.Demo(demo_mod.parse_args(["--copy", mode, "--workdir", str(tmp_path / mode)]))
        try:
            if mode == "on":
                with pytest.raises(demo_mod.DemoError, match="boom"):
                    d.start_clusters()
            else:
                d.start_clusters()
                assert set(d.deps) == {"A"} and d.deps["A"].is_running("data", 0)
        finally:
            d.close()
        assert not (tmp_path / mode).exists()  # close() removed the work folder
