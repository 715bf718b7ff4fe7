"""Shared fixtures: temporary store roots, free ports, and one SparkSession per test session."""

from __future__ import annotations

import os
import sys
from typing import Optional

import pytest

# Before any test module imports grpc: this package's fork-handler setting (pyspark_acs._grpc),
# without which the Spark fixture's Java gateway could die at launch after earlier tests' channels.
import pyspark_acs._grpc  # noqa: F401,E402

from tests.helpers import ROOT

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


#: Work units of a parallel run that take longest, in the order they start (a group's name, a
#: module's file name, or ``module::test`` for a test that is a unit of its own): before every
#: other unit, so none of them starts last and holds the run up alone at its end. Units that
#: start JVMs (Spark sessions, spark-submit jobs, the standalone cluster) alternate with units
#: that mostly wait on servers: started side by side, the JVMs' start-ups took the 2 cores for
#: minutes and Spark's 10 s Python connect-back timed out.
LONG_UNITS = (
    "test_spark_cluster.py", "test_push.py", "spark-a", "test_cross_cluster.py",
    "test_examples.py::test_producer_job_then_consumer_job_available_now", "test_copy_daemon.py", "spark-b",
    "test_tiered.py", "test_examples.py::test_demo_runs_end_to_end", "test_cache_delivery.py", "test_lease_split.py",
    "test_spark_user.py", "test_model.py", "test_write_path.py", "test_fencing.py", "test_push_sharing.py",
)


#: The modules whose Spark tests form the group "spark-a"; every other module's form "spark-b".
#: Each group runs on its own worker with its own Spark session: the Spark tests as one group
#: were the run's longest unit (about 260 s of a 9-minute run on 3 workers).
SPARK_A_MODULES = frozenset({
    "test_spark_connector.py", "test_cli_faults.py", "test_cli_watch.py", "test_spark_workers.py", "test_tiered.py",
})


def _group(item) -> Optional[str]:
    """The group of ``item`` in a parallel run, None for a test that is a unit of its own."""
    if item.get_closest_marker("serial"):
        return "serial"
    if "spark" in item.fixturenames:
        return "spark-a" if item.path.name in SPARK_A_MODULES else "spark-b"
    defs = item._fixtureinfo.name2fixturedefs
    if any(d.scope in ("module", "package", "class") for name in item.fixturenames for d in defs.get(name, ())):
        return item.path.name
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Work units of a parallel run (``pytest -n N --dist loadgroup``, as ``make test`` runs).

    The tests of a module that has module-scoped fixtures (its servers, mostly) stay together
    on one worker, so those start once; any other test is a unit of its own. Two groups cut
    across modules: the tests that use the ``spark`` fixture are two groups ("spark-a" and
    "spark-b", by module: :data:`SPARK_A_MODULES`), so two workers start a Spark session each (a
    JVM with a 2 GiB heap and seconds of CPU to start), not every worker; and a test marked ``serial`` joins the group "serial", whose tests run one after
    another. In a parallel run the long units come first (:data:`LONG_UNITS`). Runs before
    xdist's own hook, which reads the ``xdist_group`` marks this adds (tryfirst)."""
    for item in items:
        group = _group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONG_UNITS)}
        def start(item) -> int:
            unit = _group(item)
            if unit is None:
                test = f"{item.path.name}::{item.originalname}"
                unit = test if test in rank else item.path.name
            return rank.get(unit, len(rank))

        items.sort(key=start)


def pytest_collection_finish(session):
    """In a parallel run, refuse to go on when pytest-xdist did not group: its loadgroup marks a
    grouped test by appending ``@group`` to the node id, which pytest 9.2 ignores (reported as
    github.com/pytest-dev/pytest-xdist/issues/1386); ungrouped, every worker starts the module servers and a Spark session itself
    and the suite takes minutes longer, silently."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or session.config.getoption("dist", None) != "loadgroup":
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(lost)} tests (first: {lost[0]}): this pytest "
            f"({pytest.__version__}) drops its group marks; install the test extra's pytest "
            f"(pip install -e '.[test]', pytest<9.2)")


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """One data and one metadata cache server per cluster A, B and C, for the whole module (its
    tests then share a worker). A module that needs other deployments defines its own."""
    from tests.helpers import deployments

    with deployments(tmp_path_factory.mktemp("caches")) as deps:
        yield deps


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
