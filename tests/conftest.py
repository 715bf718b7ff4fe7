"""Shared fixtures: temporary store roots, free ports, and one SparkSession per test session."""

from __future__ import annotations

import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Heap of the test session's one Spark driver JVM (local mode: driver and executors share it).
TEST_SPARK_DRIVER_MEMORY = "2g"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (may race with other processes; good enough for tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
