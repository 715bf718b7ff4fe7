"""``import pyspark_acs`` points Spark's Python workers at a driver in a virtualenv
(pyspark_acs/worker_python.py), and leaves every choice a user made alone.

Each case imports the package in a fresh interpreter, as a job does; no Spark runs here (the
jobs that read through it are in test_spark_user.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

#: What a fresh process reports after ``import pyspark_acs``.
REPORT = ("import json, os, sys, pyspark_acs; from pyspark_acs import worker_python as w; "
          "print(json.dumps({'PYSPARK_PYTHON': os.environ.get('PYSPARK_PYTHON'), 'reason': w.choice.reason, "
          "'pyspark': 'pyspark' in sys.modules}))")


def _import_in(python, **env_vars):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYSPARK_SUBMIT_ARGS", "ACS_WORKER_PYTHON")}
    env["PYTHONPATH"] = ROOT
    env.update(env_vars)
    run = subprocess.run([python, "-c", REPORT], env=env, capture_output=True, text=True, timeout=60, cwd="/")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout), run.stderr


in_venv = pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the test interpreter is not a virtualenv's")


@in_venv
def test_a_driver_in_a_virtualenv_points_the_workers_at_itself():
    got, _ = _import_in(sys.executable)
    assert got["PYSPARK_PYTHON"] == sys.executable
    assert got["pyspark"] is False  # the import stays cheap


@in_venv
@pytest.mark.parametrize("env_vars, reason", [
    ({"ACS_WORKER_PYTHON": "off"}, "$ACS_WORKER_PYTHON is off"),
    ({"ACS_WORKER_PYTHON": "OFF"}, "$ACS_WORKER_PYTHON is off"),
    ({"PYSPARK_PYTHON": "/opt/other/python"}, "$PYSPARK_PYTHON is set"),
    ({"PYSPARK_SUBMIT_ARGS": "--conf spark.pyspark.python=/opt/other/python pyspark-shell"},
     "$PYSPARK_SUBMIT_ARGS sets spark.pyspark.python"),
])
def test_a_choice_the_user_made_is_left_alone(env_vars, reason):
    got, _ = _import_in(sys.executable, **env_vars)
    assert got["PYSPARK_PYTHON"] == env_vars.get("PYSPARK_PYTHON")
    assert got["reason"] == reason


@in_venv
def test_auto_is_the_default_spelled_out():
    got, _ = _import_in(sys.executable, ACS_WORKER_PYTHON="auto")
    assert got["PYSPARK_PYTHON"] == sys.executable


@in_venv
def test_a_misspelt_switch_warns_naming_it_and_changes_nothing():
    got, err = _import_in(sys.executable, ACS_WORKER_PYTHON="of")
    assert got["PYSPARK_PYTHON"] is None
    assert "RuntimeWarning: pyspark_acs: $ACS_WORKER_PYTHON='of' is neither 'auto' nor 'off'" in err, err
    assert "set ACS_WORKER_PYTHON=auto or off" in err


def test_a_driver_outside_a_virtualenv_is_left_alone():
    """The base interpreter (the venv's python3 links to it): nothing to point at; the README's
    first Spark example sets PYSPARK_PYTHON itself for this case."""
    base = os.path.join(sys.base_prefix, "bin", "python3")
    if not os.path.exists(base):
        pytest.skip(f"no base interpreter at {base}")
    got, _ = _import_in(base)
    assert got["PYSPARK_PYTHON"] is None
    assert got["reason"] == "the driver does not run in a virtualenv"
