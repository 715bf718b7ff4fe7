"""Shared fixtures: temporary store roots, free ports, and one SparkSession per test session."""

from __future__ import annotations

import os
import random
import socket
import sys
import threading

import pytest

# Before any test module imports grpc: this package's fork-handler setting (pyspark_acs._grpc),
# without which the Spark fixture's Java gateway could die at launch after earlier tests' channels.
import pyspark_acs._grpc  # noqa: F401,E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Heap of the test session's one Spark driver JVM (local mode: driver and executors share it).
TEST_SPARK_DRIVER_MEMORY = "2g"
#: The JVM compiles with C1 only: the suite is hundreds of short queries, and on 2 cores the
#: JIT compiler threads took about half of the JVM's CPU in a one-minute streaming run
#: (make demo, per-thread /proc). The Spark test files ran in 123 s instead of 140 s (two
#: interleaved pairs); nothing a test checks depends on how hot code is compiled. C1 alone
#: shrinks the default code cache to 48 MB, which a run of three Spark test files filled to
#: 32 MB: the cache keeps the tiered default's size.
TEST_SPARK_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"


#: How many ports below the kernel's ephemeral range :func:`free_port` picks from.
PICKED_PORTS = 8000
_picked_lock = threading.Lock()
_next_pick = [0]  # the next candidate port (0: not started yet); guarded by _picked_lock


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a server a test starts later.

    Picked below the kernel's ephemeral range: binds to port 0 (every cache server's) and
    outgoing connections take their ports from that range, so a port picked there could be
    taken between picking it and the server binding it (a copy daemon of a full run once failed
    to start that way). Ports are handed out in turn from a random start, each checked free and
    never twice in this process.
    """
    low = max(1024, _ephemeral_low() - PICKED_PORTS)
    with _picked_lock:
        if _next_pick[0] == 0:
            _next_pick[0] = low + random.randrange(PICKED_PORTS)
        for _ in range(PICKED_PORTS):
            port = _next_pick[0]
            _next_pick[0] = low + (port + 1 - low) % PICKED_PORTS
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no free port in 127.0.0.1:{low}-{low + PICKED_PORTS - 1}")


@pytest.fixture(autouse=True)
def _process_security_default_restored():
    """Parsing source or sink options installs their token and TLS settings as the process's
    default (``security.install_default``: a Spark worker's environment is not the driver's).
    In the one test process that default outlived its test: after test_poller's token test,
    every later LocalDeployment started token-protected servers ("s3cret") whose copy daemons,
    started with the plain environment, got UNAUTHENTICATED (test_cross_cluster, run after it)."""
    from pyspark_acs import security

    before = security._installed
    yield
    security.install_default(before)


@pytest.fixture
def root(tmp_path):
    """A fresh durable store root (a local folder)."""
    path = tmp_path / "store"
    path.mkdir()
    return str(path)


@pytest.fixture(scope="session")
def subprocess_env():
    """Environment for child processes that must import this checkout's pyspark_acs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@pytest.fixture(scope="session")
def python_exe():
    return sys.executable


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession for the whole test session (Spark start-up is the slow part)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("pyspark_acs-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.streaming.stopTimeout", "30s")
        # The one session runs every Spark test of the suite: at local mode's default 1 GiB heap
        # a full run once ended a streaming query with "Java heap space" at 80 % of the suite.
        .config("spark.driver.memory", TEST_SPARK_DRIVER_MEMORY)
        .config("spark.driver.extraJavaOptions", TEST_SPARK_JAVA_OPTIONS)
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
