"""Which Python runs Spark's Python workers, and whether it can run the ``acs`` source.

Spark runs a Python DataSource -- and the lookup of the name ``"acs"`` itself -- in Python
worker processes started with ``$PYSPARK_PYTHON`` (Spark's default: ``python3`` on PATH), not in
the driver's interpreter. A job started as ``.venv/bin/python job.py`` therefore has a driver
that can import pyspark_acs and workers that cannot, and Spark says only
``DATA_SOURCE_NOT_FOUND`` or ``ModuleNotFoundError``. ``import pyspark_acs`` points the workers
at a driver in a virtualenv when nobody chose their interpreter (:mod:`pyspark_acs.worker_python`);
:func:`register` checks the workers' interpreter before the first query and fails naming both
interpreters, why the import left them alone, and the fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any, Optional

from pyspark_acs import worker_python
from pyspark_acs.errors import AcsError

__all__ = [
    "register",
]

#: How long the check may take to start the workers' interpreter and import the package.
WORKER_CHECK_TIMEOUT_S = 60.0
#: What the workers' interpreter must import beyond pyspark (which Spark puts on their path):
#: the package and the libraries its source and sink read and write with.
_PROBE = "import pyspark_acs, pyarrow, grpc, google.protobuf"


def _resolve(python: str) -> str:
    """The interpreter's path as PATH finds it. Not ``realpath``: a venv's python is a symlink to
    the base interpreter, but only the venv's sees the venv's packages."""
    return os.path.abspath(shutil.which(python) or python)


def worker_python_problem(python: str, *, driver: str = sys.executable) -> Optional[str]:
    """Why Spark's Python workers, running ``python``, cannot run the ``acs`` source (None if they can).

    Parameters
    ----------
    python : str
        The workers' interpreter: ``SparkContext.pythonExec`` (``$PYSPARK_PYTHON`` or ``python3``).
    driver : str
        The driver's interpreter, named in the message with the fix.

    Returns
    -------
    str or None
        A message naming both interpreters, what failed and how to fix it.
    """
    if _resolve(python) == _resolve(driver):
        return None
    try:
        run = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=WORKER_CHECK_TIMEOUT_S)
    except FileNotFoundError:
        failure = "it does not exist"
    except subprocess.TimeoutExpired:
        failure = f"importing pyspark_acs did not finish within {WORKER_CHECK_TIMEOUT_S:.0f} s"
    else:
        if run.returncode == 0:
            return None
        lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
        failure = f"it cannot import pyspark_acs ({lines[-1] if lines else f'exit status {run.returncode}'})"
    origin = "$PYSPARK_PYTHON" if os.environ.get("PYSPARK_PYTHON") else "Spark's default, as PYSPARK_PYTHON is unset"
    chose = worker_python.choice
    left = (f"; importing pyspark_acs left it alone, as {chose.reason}" if chose is not None and chose.python is None
            else "")
    return (
        f"Spark's Python workers run {python!r} ({origin}; resolves to {_resolve(python)!r}{left}), and {failure}; "
        f"this driver runs {driver!r}, which can. Fix: start Spark with PYSPARK_PYTHON={driver} (export it, or "
        f"os.environ['PYSPARK_PYTHON'] = sys.executable before the SparkSession is built), or install pyspark_acs "
        f"into {python!r}"
    )


def register(spark: Any) -> None:
    """Check that Spark's Python workers can run the ``acs`` source, then register it.

    Registering makes ``format("acs")`` resolve without Spark's package scan (which, too, runs
    in a worker). Call it once after building the SparkSession.

    Parameters
    ----------
    spark : pyspark.sql.SparkSession

    Raises
    ------
    AcsError
        When the workers' interpreter cannot import pyspark_acs; the message names both
        interpreters and the fix.
    """
    from pyspark_acs.datasource import AcsDataSource

    from pyspark.sql.utils import is_remote

    # Under Spark Connect the server starts the workers: nothing here to check.
    python = None if is_remote() else spark.sparkContext.pythonExec
    if python:
        problem = worker_python_problem(python)
        if problem:
            raise AcsError(problem)
    spark.dataSource.register(AcsDataSource)
