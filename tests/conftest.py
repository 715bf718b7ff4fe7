"""Shared fixtures: temporary store roots, free ports, and one SparkSession per test session."""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
from typing import Optional

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
# The same for the JVMs that tests launch through spark-submit and spark-class (the examples,
# the README job, the standalone cluster's master, workers and drivers): each is short-lived.
os.environ.setdefault("SPARK_SUBMIT_OPTS", TEST_SPARK_JAVA_OPTIONS)
os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", TEST_SPARK_JAVA_OPTIONS)


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


def _worker_slice() -> tuple:
    """``(index, count)`` of this process among the suite's parallel workers (``(0, 1)`` alone).

    pytest-xdist names its workers gw0, gw1, ... and tells each the count."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        index = int(name[2:]) if name.startswith("gw") else 0
    except ValueError:
        return 0, 1
    return (index, count) if 0 <= index < count else (0, 1)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a server a test starts later.

    Picked below the kernel's ephemeral range: binds to port 0 (every cache server's) and
    outgoing connections take their ports from that range, so a port picked there could be
    taken between picking it and the server binding it (a copy daemon of a full run once failed
    to start that way). Each parallel worker picks from its own slice of the range (two workers
    could otherwise both pick a port before either binds it). Ports are handed out in turn from
    a random start, each checked free and never twice in this process.
    """
    index, count = _worker_slice()
    span = PICKED_PORTS // count
    low = max(1024, _ephemeral_low() - PICKED_PORTS) + index * span
    with _picked_lock:
        if _next_pick[0] == 0:
            _next_pick[0] = low + random.randrange(span)
        for _ in range(span):
            port = _next_pick[0]
            _next_pick[0] = low + (port + 1 - low) % span
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no free port in 127.0.0.1:{low}-{low + span - 1}")


#: Work units of a parallel run that take longest, longest first (a module's file name, a
#: group's name): they start before every other unit, so none of them starts last and holds
#: the run up alone at its end.
LONG_UNITS = (
    "test_spark_cluster.py", "test_examples.py", "spark", "test_push.py", "test_cross_cluster.py",
    "test_tiered.py", "test_copy_daemon.py", "test_cache_delivery.py", "test_write_path.py",
    "test_lease_split.py", "test_fencing.py", "test_push_sharing.py", "test_model.py",
)


def _group(item) -> Optional[str]:
    """The group of ``item`` in a parallel run, None for a test that is a unit of its own."""
    if item.get_closest_marker("serial"):
        return "serial"
    if "spark" in item.fixturenames:
        return "spark"
    defs = item._fixtureinfo.name2fixturedefs
    if any(d.scope in ("module", "package", "class") for name in item.fixturenames for d in defs.get(name, ())):
        return item.path.name
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Work units of a parallel run (``pytest -n N --dist loadgroup``, as ``make test`` runs).

    The tests of a module that has module-scoped fixtures (its servers, mostly) stay together
    on one worker, so those start once; any other test is a unit of its own. Two groups cut
    across modules: the tests that use the ``spark`` fixture are the group "spark", so one
    worker starts a Spark session (a JVM with a 2 GiB heap and seconds of CPU to start), not
    each; and a test marked ``serial`` joins the group "serial", whose tests run one after
    another. In a parallel run the long units come first (:data:`LONG_UNITS`). Runs before
    xdist's own hook, which reads the ``xdist_group`` marks this adds (tryfirst)."""
    for item in items:
        group = _group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONG_UNITS)}
        items.sort(key=lambda item: rank.get(_group(item) or item.path.name, len(rank)))


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
