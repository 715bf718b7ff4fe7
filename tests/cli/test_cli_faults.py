"""Faults a user meets at the command line, run as a user runs them.

- A root that does not exist is an error naming it for every reader (``acs tail``, the
  Consumer, a Spark read), and none of them creates the folder.
- ``acs copy-status`` of clusters it cannot reach says so and exits 1, creating nothing.
- Ctrl-C of ``acs produce`` (a real SIGINT to a real subprocess reading a pipe): the messages
  sent are flushed, ``sent N (M acknowledged)`` is printed and the exit code is 130; a second
  Ctrl-C while that flush waits on a store that does not answer exits at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator, List

import pytest

from pyspark_acs.errors import RootNotFoundError
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.write.producer import Producer

from tests.helpers import free_port, start_caches, wait_until

ACS = [sys.executable, "-m", "pyspark_acs.cli.main"]
#: Bound of every wait on a subprocess (a failing test fails, it never hangs).
TIMEOUT = 60.0


def run(env, *args, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([*ACS, *args], input=stdin, capture_output=True, env=env, timeout=TIMEOUT)


# -- item 4: readers never create a root -------------------------------------------------------


def test_tail_of_a_missing_root_names_it_and_creates_nothing(tmp_path, subprocess_env):
    typo = tmp_path / "typo2"
    out = run(subprocess_env, "tail", "--root", str(typo), "--stream", "x", "--timeout", "1")
    err = out.stderr.decode()
    assert out.returncode == 1, err
    assert f"no durable store at '{typo}'" in err and "does not exist" in err, err
    assert "a Producer" in err and "--wait" in err, err  # the fixes: write it first, or wait for it
    assert "no stream" not in err and "Traceback" not in err, err
    assert not typo.exists()
    # A relative root is named as given and by its full path.
    out = subprocess.run([*ACS, "tail", "--root", "./typo2", "--stream", "x"], capture_output=True,
                         env=subprocess_env, cwd=tmp_path, timeout=TIMEOUT)
    assert out.returncode == 1 and f"'./typo2': {typo} does not exist" in out.stderr.decode(), out.stderr
    assert not typo.exists()


def test_tail_wait_waits_for_a_missing_root_naming_it(tmp_path, subprocess_env):
    """Like a Kafka consumer started before its topic exists, ``--wait`` waits for the root
    too, but says that the root itself is missing (by its full path, so a typo shows), and with
    ``--timeout`` fails naming it."""
    later = tmp_path / "later"
    out = run(subprocess_env, "tail", "--root", str(later), "--stream", "s", "--wait", "--timeout", "0.3")
    err = out.stderr.decode()
    assert out.returncode == 1, err
    assert f"waiting for stream s in {later} (the root {later} does not exist yet" in err, err
    assert f"--wait: root {later} does not exist and stream s did not appear" in err, err
    assert not later.exists()
    tail = subprocess.Popen([*ACS, "tail", "--root", str(later), "--stream", "s", "--wait", "--max-messages", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env)
    try:
        assert f"(the root {later} does not exist yet" in _readline(tail.stderr)
        with Producer(str(later), "s") as p:
            p.send(b"first")
        out, err = tail.communicate(timeout=TIMEOUT)
    finally:
        tail.kill()
        tail.wait()
    assert tail.returncode == 0 and out == b"first\n", err


def test_consumer_of_a_missing_root_names_it_and_creates_nothing(tmp_path):
    typo = tmp_path / "typo"
    with pytest.raises(RootNotFoundError) as err:
        Consumer(str(typo), "x")
    assert err.value.option == "root" and err.value.path == str(typo)
    assert f"no durable store at '{typo}'" in str(err.value)
    assert not typo.exists()
    Producer(str(typo), "x").close()  # a writer still creates its root
    Consumer(str(typo), "x").close()


def test_a_readers_store_stays_a_readers_when_pickled(tmp_path):
    """Spark ships stores to its workers by pickling: a reader's store must not create the
    root there either."""
    import pickle

    from pyspark_acs.read.readpath import open_read_path

    root = tmp_path / "r"
    Producer(str(root), "x").close()
    path = open_read_path(str(root))
    shutil.rmtree(root)
    with pytest.raises(RootNotFoundError):
        pickle.loads(pickle.dumps(path.store))
    assert not root.exists()


@pytest.mark.spark
def test_spark_read_of_a_missing_root_names_it_and_creates_nothing(spark, tmp_path):
    typo = tmp_path / "typo"
    with pytest.raises(Exception) as err:
        spark.read.format("acs").option("root", str(typo)).option("stream", "x").load().count()
    assert f"no durable store at '{typo}'" in str(err.value) and "no stream" not in str(err.value)
    assert not typo.exists()


# -- item 5: copy-status says what it cannot reach ---------------------------------------------


def _topology(path: Path, roots, metadata) -> Path:
    path.write_text(json.dumps({
        "clusters": {c: {"root": roots[c], "data_cache": metadata[c], "metadata_cache": metadata[c],
                         "copy_daemon": f"127.0.0.1:{free_port()}"} for c in roots},
        "links": [{"from": "A", "to": "B", "cost": 1}],
        "streams": {"orders": {"source": "A", "destinations": ["B"], "shards": 2}},
    }))
    return path


def test_copy_status_with_nothing_running_says_so_and_creates_no_root(tmp_path, subprocess_env):
    roots = {c: str(tmp_path / f"root-{c}") for c in ("A", "B")}
    silent = {c: f"127.0.0.1:{free_port()}" for c in ("A", "B")}  # nothing listens there
    topology = _topology(tmp_path / "topology.json", roots, silent)
    out = run(subprocess_env, "copy-status", "--topology", str(topology), "--stream", "orders")
    err = out.stderr.decode()
    assert out.returncode == 1, err
    for c in ("A", "B"):
        assert f"cluster {c}: root {roots[c]} does not exist" in err, err
        assert f"cluster {c}: metadata cache of {c}: no answer from {silent[c]}" in err, err
        assert not os.path.exists(roots[c])
    # Nothing known is shown as nothing: no "behind 0", no "0.0ms" delay of a source it never read.
    assert "0.0ms" not in out.stdout.decode(), out.stdout
    out = run(subprocess_env, "copy-status", "--topology", str(topology), "--stream", "orders", "--json")
    rows = json.loads(out.stdout)
    assert out.returncode == 1 and len(rows) == 4
    assert all(r["bytes_behind"] is None and r["cache_delay_s"] is None and r["problems"] for r in rows), rows


def test_copy_status_names_only_what_is_missing(tmp_path, subprocess_env):
    caches = start_caches(tmp_path / "caches", ("A",))
    try:
        caches["B"] = LocalDeployment(tmp_path / "caches" / "B", data_replicas=1, metadata_replicas=3,
                                      capacity="64MiB").start()
        metadata = {c: caches[c].metadata_endpoints for c in ("A", "B")}
        roots = {c: str(tmp_path / f"root-{c}") for c in ("A", "B")}
        topology = _topology(tmp_path / "topology.json", roots, metadata)
        with Producer(roots["A"], "orders", shards=2) as p:
            for i in range(10):
                p.send(b"m%d" % i, shard=i % 2)
        # B's copy daemon has not run: its root does not exist. A is fine.
        out = run(subprocess_env, "copy-status", "--topology", str(topology), "--stream", "orders")
        err = out.stderr.decode()
        assert out.returncode == 1, err
        assert f"cluster B: root {roots['B']} does not exist: its copy daemon" in err, err
        assert "cluster A" not in err and "no answer" not in err, err
        assert not os.path.exists(roots["B"])
        rows = {(r["shard"], r["cluster"]): r for r in json.loads(
            run(subprocess_env, "copy-status", "--topology", str(topology), "--stream", "orders", "--json").stdout)}
        assert rows[0, "A"]["problems"] == [] and rows[0, "A"]["cache_delay_s"] == 0.0
        assert rows[0, "B"]["bytes_behind"] == rows[0, "A"]["durable_length"] > 0  # B holds none of it
        # Every root there and every cache answering: exit 0, nothing on stderr.
        os.mkdir(roots["B"])
        out = run(subprocess_env, "copy-status", "--topology", str(topology), "--stream", "orders")
        assert out.returncode == 0 and out.stderr == b"", out.stderr
        # One replica of three down: a warning naming it (the majority still answers for it).
        silent = caches["B"].server("metadata", 0).endpoint
        caches["B"].kill("metadata", 0)
        out = run(subprocess_env, "copy-status", "--topology", str(topology), "--stream", "orders")
        err = out.stderr.decode()
        assert out.returncode == 0, err
        assert f"warning: cluster B: metadata cache of B: no answer from {silent} (1 of 3 replicas" in err, err
        # A metadata cache that stops answering is named, and the status fails.
        caches["B"].stop()
        out = run(subprocess_env, "copy-status", "--topology", str(topology), "--stream", "orders")
        err = out.stderr.decode()
        assert out.returncode == 1, err
        assert "error: cluster B: metadata cache of B: no answer from " in err and "(3 of 3 replicas" in err, err
    finally:
        for dep in caches.values():
            dep.stop()


# -- item 9: Ctrl-C of acs produce -------------------------------------------------------------


def _default_sigint() -> None:
    # The child gets Python's own Ctrl-C handling even if this test runs where SIGINT is
    # ignored (a background job): Python installs it only when SIGINT is not ignored at start.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _produce(env, root: str, stream: str) -> subprocess.Popen:
    return subprocess.Popen([*ACS, "produce", "--root", root, "--stream", stream], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=_default_sigint)


def _readline(stream) -> str:
    """The next line of a child's pipe, waited for at most TIMEOUT (a thread reads it)."""
    got: List[bytes] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(TIMEOUT)
    assert got, f"no line within {TIMEOUT} s"
    return got[0].decode()




def _durable_bytes(root: str, stream: str) -> int:
    folder = os.path.join(root, stream, "00000")
    if not os.path.isdir(folder):
        return 0
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".acs"))


def _unread(pipe) -> int:
    """Bytes written to a child's stdin pipe that it has not read yet."""
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(pipe.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def _read_all(root: str, stream: str) -> List[bytes]:
    values: List[bytes] = []
    with contextlib.closing(Consumer(root, stream)) as c:
        for batch in c.batches(timeout=1.0):  # the producer is gone: 1 s of nothing is the end
            values.extend(batch.column("value").to_pylist())
    return values


def test_ctrl_c_of_produce_flushes_prints_the_summary_and_exits_130(tmp_path, subprocess_env):
    root = str(tmp_path / "store")
    lines = [b"line %d" % i for i in range(5000)]
    proc = _produce(subprocess_env, root, "s")
    try:
        proc.stdin.write(b"\n".join(lines) + b"\n")
        proc.stdin.flush()  # stdin stays open: acs produce is waiting for more when Ctrl-C comes
        wait_until(lambda: _durable_bytes(root, "s") > 0, TIMEOUT, "the first messages in the store")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
        proc.wait()
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert "Ctrl-C again to exit at once" in text, text
    summary = re.findall(r"^acs produce: interrupted: sent (\d+) \((\d+) acknowledged\) to stream 's'$", text, re.M)
    assert len(summary) == 1, text
    sent, acked = map(int, summary[0])
    assert sent == acked > 0, text  # everything sent was flushed
    assert _read_all(root, "s") == lines[:sent]  # in the store, in order, nothing else


class FreezableDisk:
    """A small ext4 filesystem on a loop device that ``fsfreeze`` can freeze: a store that
    stops answering (writes block until it is thawed), as a hung disk or NFS server does."""

    def __init__(self, base: Path) -> None:
        self.image = base / "disk.img"
        self.mount = base / "disk"
        self.frozen = False

    def __enter__(self) -> "FreezableDisk":
        tools = ("mkfs.ext4", "mount", "umount", "fsfreeze")
        if os.geteuid() != 0 or not all(shutil.which(t) for t in tools):
            pytest.skip("a freezable filesystem needs root and " + ", ".join(tools))
        with open(self.image, "wb") as f:
            f.truncate(32 << 20)
        self.mount.mkdir()
        subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], check=True, capture_output=True, timeout=TIMEOUT)
        made = subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mount)], capture_output=True,
                              timeout=TIMEOUT)
        if made.returncode != 0:
            pytest.skip(f"cannot loop-mount a filesystem here: {made.stderr.decode().strip()}")
        return self

    def freeze(self) -> None:
        subprocess.run(["fsfreeze", "-f", str(self.mount)], check=True, timeout=TIMEOUT)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            subprocess.run(["fsfreeze", "-u", str(self.mount)], check=True, timeout=TIMEOUT)
            self.frozen = False

    def __exit__(self, *exc) -> None:
        self.thaw()
        subprocess.run(["umount", str(self.mount)], timeout=TIMEOUT)  # frees the loop device too


@contextlib.contextmanager
def _interrupted_on_a_frozen_store(tmp_path, env) -> "Iterator[tuple[subprocess.Popen, FreezableDisk]]":
    """``acs produce`` with messages its writer cannot write (the disk froze under it), after
    one Ctrl-C: yields the process and the disk once it says it waits for them; thaws the disk and ends the
    process afterwards (a thread blocked on a frozen disk leaves the kernel only once thawed)."""
    with FreezableDisk(tmp_path) as disk:
        root = str(disk.mount / "store")
        proc = _produce(env, root, "s")
        try:
            proc.stdin.write(b"before\n")
            proc.stdin.flush()
            wait_until(lambda: _durable_bytes(root, "s") > 0, TIMEOUT, "the first message in the store")
            disk.freeze()
            # These reach the writer thread, whose next append blocks on the frozen disk. Sent
            # for sure once acs produce has read the next line too: it reads only when it has
            # sent every line it read before.
            proc.stdin.write(b"".join(b"after %d\n" % i for i in range(100)))
            proc.stdin.flush()
            wait_until(lambda: _unread(proc.stdin) == 0, TIMEOUT, "acs produce to read the lines")
            proc.stdin.write(b"last\n")
            proc.stdin.flush()
            wait_until(lambda: _unread(proc.stdin) == 0, TIMEOUT, "acs produce to read the last line")
            proc.send_signal(signal.SIGINT)
            waiting = _readline(proc.stderr)
            assert "interrupted: waiting up to" in waiting and "Ctrl-C again to exit at once" in waiting, waiting
            yield proc, disk
        finally:
            disk.thaw()
            proc.kill()
            proc.wait()


def test_ctrl_c_of_produce_on_a_store_that_does_not_answer_waits_a_bounded_time(tmp_path, subprocess_env):
    with _interrupted_on_a_frozen_store(tmp_path, subprocess_env) as (proc, disk):
        said = _readline(proc.stderr) + _readline(proc.stderr)
        # Said while the disk is still frozen: the wait ended on its own bound, not the store.
        assert disk.frozen
        disk.thaw()
        rest = proc.communicate(timeout=TIMEOUT)[1].decode()
    assert proc.returncode == 130, said + rest
    assert "not acknowledged within 5 s" in said and "they may or may not be in the stream" in said, said
    sent, acked = map(int, re.search(r"interrupted: sent (\d+) \((\d+) acknowledged\)", said).groups())
    assert acked < sent and sent >= 101, said
    assert "Traceback" not in said + rest, said + rest


def test_a_second_ctrl_c_exits_at_once_while_the_flush_waits(tmp_path, subprocess_env):
    with _interrupted_on_a_frozen_store(tmp_path, subprocess_env) as (proc, disk):
        proc.send_signal(signal.SIGINT)
        again = _readline(proc.stderr)
        # Said and exiting while the disk is still frozen: it did not wait for the flush.
        assert re.match(r"acs produce: interrupted again: exiting at once: sent \d+ \(\d+ acknowledged\)",
                        again), again
        assert disk.frozen
        disk.thaw()
        rest = proc.communicate(timeout=TIMEOUT)[1].decode()
    assert proc.returncode == 130, rest
    assert "Traceback" not in rest and "acs produce: interrupted: sent" not in rest, rest
