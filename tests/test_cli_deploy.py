"""`acs up`, `acs down` and `acs status` as subprocesses, with real cache servers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.local.deploy import acs_down, load_deployment

#: A safety net only: every wait in these tests has its own, shorter deadline.
pytestmark = pytest.mark.timeout(120)

TIMEOUT = 60


def run(python_exe, env, *args, stdin: bytes = b"", timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([python_exe, "-m", "pyspark_acs.cli.main", *args], input=stdin, capture_output=True,
                          env=env, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


@pytest.fixture
def env(subprocess_env):
    e = dict(subprocess_env)
    e.pop("ACS_DATA_CACHE", None)
    e.pop("ACS_METADATA_CACHE", None)
    return e


def test_up_produce_tail_status_down(tmp_path, root, env, python_exe):
    dep_dir = str(tmp_path / "acs-local")
    up = run(python_exe, env, "up", "--dir", dep_dir, "--data-replicas", "3", "--metadata-replicas", "3",
             "--capacity", "32MiB", "--data-ttl", "30s")
    try:
        assert up.returncode == 0, up.stderr.decode()
        out = up.stdout.decode()
        m = re.search(r"^export ACS_DATA_CACHE=(\S+) ACS_METADATA_CACHE=(\S+)$", out, re.M)
        assert m, out
        data, meta = m.groups()
        assert len(data.split(",")) == 3 and len(meta.split(",")) == 3
        assert f"data cache:     {data}" in out and f"metadata cache: {meta}" in out
        state = load_deployment(dep_dir)
        pids = [s["pid"] for s in state["servers"]]
        assert len(pids) == 6 and all(alive(p) for p in pids)  # `up` returned, the servers run on

        # Produce and tail through the printed endpoints.
        lines = [b"line-%05d" % i for i in range(2000)]
        prod = run(python_exe, env, "produce", "--root", root, "--stream", "s", "--data-cache", data,
                   "--metadata-cache", meta, stdin=b"\n".join(lines) + b"\n")
        assert prod.returncode == 0, prod.stderr.decode()
        tail = run(python_exe, env, "tail", "--root", root, "--stream", "s", "--data-cache", data,
                   "--metadata-cache", meta, "--timeout", "2", "--max-messages", "2000")
        assert tail.returncode == 0, tail.stderr.decode()
        assert tail.stdout.splitlines() == lines
        with Consumer(root, "s", data_cache=data, metadata_cache=meta) as c:
            got = []
            deadline = time.monotonic() + 20
            while len(got) < len(lines):
                assert time.monotonic() < deadline, c.stats()
                for b in c.poll():
                    got.extend(b.column("value").to_pylist())
            stats = c.stats()
        assert got == lines
        assert stats["durable_bytes"] == 0 and stats["cache_bytes"] > 0, stats  # the bytes came from the cache

        # Status: endpoints from the environment `up` printed.
        env_up = dict(env, ACS_DATA_CACHE=data, ACS_METADATA_CACHE=meta)
        st = run(python_exe, env_up, "status", "--root", root, "--json")
        assert st.returncode == 0, st.stderr.decode()
        report = json.loads(st.stdout)
        (stream,) = report["streams"]
        (shard,) = stream["shards"]
        (row,) = shard["files"]
        assert shard["head"] == row["file"]
        assert row["durable"] == row["published_cache"] == row["published_durable"] > 0
        assert row["behind"] == 0
        assert [s["role"] for s in report["servers"]] == ["data"] * 3 + ["metadata"] * 3
        assert all(s["healthy"] for s in report["servers"])

        # A dead server shows as down (endpoints found through --dir this time).
        victim = state["servers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_gone([victim["pid"]])
        st = run(python_exe, env, "status", "--root", root, "--dir", dep_dir)
        assert st.returncode == 0, st.stderr.decode()
        text = st.stdout.decode()
        assert re.search(rf"data\s+{re.escape(victim['endpoint'])}\s+DOWN", text), text
        assert text.count("healthy") == 5, text
        assert f"durable={row['durable']}  published_cache={row['durable']}" in text

        # A second `up` in the same folder is refused while servers run.
        again = run(python_exe, env, "up", "--dir", dep_dir)
        assert again.returncode == 1 and "already has a running deployment" in again.stderr.decode()

        down = run(python_exe, env, "down", "--dir", dep_dir)
        assert down.returncode == 0, down.stderr.decode()
        assert "stopped 5 servers" in down.stdout.decode()
        wait_gone(pids)
        assert load_deployment(dep_dir) is None
        down = run(python_exe, env, "down", "--dir", dep_dir)
        assert down.returncode == 0 and "no deployment" in down.stderr.decode()
    finally:
        acs_down(dep_dir)  # never leave servers behind, whatever failed above


def test_status_without_caches_shows_durable_lengths_only(root, env, python_exe, tmp_path):
    prod = run(python_exe, env, "produce", "--root", root, "--stream", "plain", "--shards", "2",
               stdin=b"a\nb\nc\n")
    assert prod.returncode == 0, prod.stderr.decode()
    st = run(python_exe, env, "status", "--root", root, "--dir", str(tmp_path / "none"), "--json")
    assert st.returncode == 0, st.stderr.decode()
    report = json.loads(st.stdout)
    assert report["servers"] == []
    rows = [r for sh in report["streams"][0]["shards"] for r in sh["files"]]
    assert len(rows) == 2 and all(r["durable"] > 0 and r["published_cache"] is None and r["behind"] is None
                                  for r in rows)


@pytest.mark.parametrize("args, code, needle", [
    (["up", "--data-replicas", "x"], 2, "--data-replicas"),
    (["up", "--capacity", "12XB"], 1, "capacity"),
    (["up", "--data-ttl", "soon"], 1, "data_ttl"),
    (["status", "--root", "R", "--metadata-cache", "nohost"], 1, "nohost"),
    (["status", "--root", "R", "--stream", "missing"], 1, "missing"),
])
def test_bad_arguments_are_refused(tmp_path, env, python_exe, args, code, needle):
    args = [str(tmp_path / "x") if a == "R" else a for a in args]
    if args[0] == "up":
        args += ["--dir", str(tmp_path / "dep")]
    res = run(python_exe, env, *args)
    assert res.returncode == code, (res.stdout, res.stderr)
    assert needle in res.stderr.decode()
    assert load_deployment(tmp_path / "dep") is None


def test_help_lists_the_deployment_commands(env, python_exe):
    res = run(python_exe, env, "--help")
    assert res.returncode == 0
    for name in ("up", "down", "status"):
        assert name in res.stdout.decode()
