"""Shared fixtures: temporary store roots, free ports, and one SparkSession per test session."""

from __future__ import annotations

import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
