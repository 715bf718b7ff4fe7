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
        m = re.search(r"^export ACS_DATA_CACHE=(\S+) ACS_METADATA_CACHE=(\S+) ACS_DEPLOYMENT=\S+$", out, re.M)
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
    (["up", "--capacity", "12XB"], 2, "argument --capacity: '12XB' is not a byte size"),
    (["up", "--data-ttl", "soon"], 2, "argument --data-ttl: 'soon' is not a duration"),
    (["status", "--root", "R", "--metadata-cache", "nohost"], 1, "nohost"),
    (["status", "--root", "R", "--stream", "missing"], 1, "no durable store at"),
    (["up", "--cluster", "A"], 1, "--cluster and --topology go together"),
    (["up", "--cluster", "A", "--topology", "t.json"], 1, "--root: give the cluster's durable store root"),
    (["up", "--cluster", "A", "--topology", "t.toml", "--root", "R"], 1, "acs up writes JSON topology files"),
    (["up", "--link", "B:x"], 1, "--link: 'B:x' is not CLUSTER or CLUSTER:COST"),
    (["up", "--base-port", "65530"], 1, "must lie in 1-65535"),
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


def _free_base(count: int) -> int:
    """A base port with ``count`` free loopback ports after it."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 60000 - count)
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range")


def _exports(out: str) -> dict:
    line = next(l for l in out.splitlines() if l.startswith("export "))
    return dict(item.split("=", 1) for item in line[len("export "):].split())


def test_a_fresh_shell_with_only_the_printed_exports_uses_the_caches(tmp_path, env, python_exe):
    """`acs up --base-port ... --cluster A --topology t.json` then, in a shell holding only what it
    printed to export, produce and tail through the caches and see published lengths in `acs status`
    from another folder; a second `acs up --cluster B --link A` completes the topology file."""
    from prometheus_client.parser import text_string_to_metric_families

    from pyspark_acs.server.copy.topology import load_topology

    topo = tmp_path / "topology.json"
    root_a, root_b = str(tmp_path / "A"), str(tmp_path / "B")
    base = _free_base(4)
    dir_a, dir_b = str(tmp_path / "dep-a"), str(tmp_path / "dep-b")
    up = run(python_exe, env, "up", "--dir", dir_a, "--data-replicas", "1", "--metadata-replicas", "1",
             "--capacity", "16MiB", "--base-port", str(base), "--cluster", "A", "--topology", str(topo),
             "--root", root_a)
    try:
        assert up.returncode == 0, up.stderr.decode()
        out = up.stdout.decode()
        exports = _exports(out)
        assert exports["ACS_DATA_CACHE"] == f"127.0.0.1:{base}"
        assert exports["ACS_METADATA_CACHE"] == f"127.0.0.1:{base + 1}"
        for port in (base + 2, base + 3):  # metrics after the gRPC ports, printed as URLs
            url = f"http://127.0.0.1:{port}/metrics"
            assert url in out
            import urllib.request

            with urllib.request.urlopen(url, timeout=10) as resp:
                assert list(text_string_to_metric_families(resp.read().decode()))
        shell = dict(env, **exports)
        other = tmp_path / "elsewhere"
        other.mkdir()
        prod = subprocess.run([python_exe, "-m", "pyspark_acs.cli.main", "produce", "--root", root_a, "--stream",
                               "s"], input=b"one\ntwo\n", capture_output=True, env=shell, cwd=str(other),
                              timeout=TIMEOUT)
        assert prod.returncode == 0, prod.stderr.decode()
        tail = subprocess.run([python_exe, "-m", "pyspark_acs.cli.main", "tail", "--root", root_a, "--stream", "s",
                               "--timeout", "1", "--max-messages", "2"], capture_output=True, env=shell,
                              cwd=str(other), timeout=TIMEOUT)
        assert tail.stdout.splitlines() == [b"one", b"two"], tail.stderr.decode()
        st = subprocess.run([python_exe, "-m", "pyspark_acs.cli.main", "status", "--root", root_a, "--json"],
                            capture_output=True, env=shell, cwd=str(other), timeout=TIMEOUT)
        assert st.returncode == 0, st.stderr.decode()
        (row,) = json.loads(st.stdout)["streams"][0]["shards"][0]["files"]
        assert row["published_cache"] == row["durable"] > 0  # the producer published through the caches
        # The deployment is found from anywhere through $ACS_DEPLOYMENT; without it, status says why.
        only_dep = dict(env, ACS_DEPLOYMENT=exports["ACS_DEPLOYMENT"])
        st = run(python_exe, only_dep, "status", "--root", root_a, "--json")
        assert all(s["healthy"] for s in json.loads(st.stdout)["servers"])
        st = subprocess.run([python_exe, "-m", "pyspark_acs.cli.main", "status", "--root", root_a],
                            capture_output=True, env=env, cwd=str(other), timeout=TIMEOUT)
        assert b"no cache endpoints" in st.stderr and b"showing the durable store only" in st.stderr

        up_b = run(python_exe, env, "up", "--dir", dir_b, "--data-replicas", "1", "--metadata-replicas", "1",
                   "--capacity", "16MiB", "--cluster", "B", "--topology", str(topo), "--root", root_b,
                   "--link", "A:2")
        assert up_b.returncode == 0, up_b.stderr.decode()
        topology = load_topology(topo)
        assert sorted(topology.clusters) == ["A", "B"]
        assert topology.clusters["A"].data_cache == (f"127.0.0.1:{base}",)
        assert [(l.source, l.target, l.cost) for l in topology.links] == [("B", "A", 2)]
    finally:
        acs_down(dir_a)
        acs_down(dir_b)


def test_acs_down_finds_a_deployment_started_with_dir_from_the_same_folder(tmp_path, env, python_exe):
    """``acs up --dir X`` then ``acs down`` (no --dir, no $ACS_DEPLOYMENT) in the same folder stops
    it; elsewhere, ``acs down`` says which --dir to pass."""
    env = {k: v for k, v in env.items() if k != "ACS_DEPLOYMENT"}
    here = tmp_path / "here"
    here.mkdir()

    def acs(*args, cwd=here):
        return subprocess.run([python_exe, "-m", "pyspark_acs.cli.main", *args], capture_output=True, text=True,
                              env=env, cwd=str(cwd), timeout=TIMEOUT)

    up = acs("up", "--dir", "deps/one", "--data-replicas", "1", "--metadata-replicas", "1", "--log-level", "WARNING")
    assert up.returncode == 0, up.stderr
    state = load_deployment(here / "deps" / "one")
    try:
        pids = [s["pid"] for s in state["servers"]]
        assert all(alive(p) for p in pids)
        with open(f"/proc/{pids[0]}/cmdline", "rb") as f:
            assert b"--log-level\0WARNING" in f.read()  # acs up's --log-level reaches its servers
        elsewhere = acs("down", cwd=tmp_path)
        assert elsewhere.returncode == 0 and "no deployment in" in elsewhere.stderr
        assert "run 'acs down --dir DIR'" in elsewhere.stderr
        down = acs("down")
        assert down.returncode == 0, down.stderr
        assert "stopped 2 servers" in down.stdout
        assert load_deployment(here / "deps" / "one") is None and not (here / ".acs-deployment").exists()
    finally:
        subprocess.run([python_exe, "-m", "pyspark_acs.cli.main", "down", "--dir", str(here / "deps" / "one")],
                       env=env, capture_output=True, timeout=TIMEOUT)
