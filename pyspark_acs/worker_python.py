"""Which Python Spark's Python workers run when nobody said: a driver in a virtualenv's own.

Spark runs the ``acs`` source -- and the lookup of the name ``"acs"`` itself -- in Python worker
processes started with ``$PYSPARK_PYTHON``, else ``python3`` from PATH. A job run as
``.venv/bin/python job.py`` without an activated virtualenv has a driver that can import
pyspark_acs and workers that cannot, and Spark says only ``DATA_SOURCE_NOT_FOUND``. So
``import pyspark_acs`` sets ``PYSPARK_PYTHON`` to the driver's interpreter when all of these hold:

- the driver runs in a virtualenv (``sys.prefix != sys.base_prefix``);
- ``PYSPARK_PYTHON`` is not set, and ``$PYSPARK_SUBMIT_ARGS`` names no ``spark.pyspark.python``
  (``spark-submit`` turns ``spark.pyspark.python`` into ``PYSPARK_PYTHON``; under a plain
  ``python job.py`` Spark reads only the variable);
- no SparkContext runs in this process yet (Spark reads the variable when it starts one: the
  JVM, which looks the name up, inherits the environment at its launch);
- ``$ACS_WORKER_PYTHON`` is unset or ``auto``. ``off`` turns this off.

Executors on other hosts then start the same path, which they must have too (a shared image or
folder); otherwise set ``PYSPARK_PYTHON`` / ``spark.pyspark.python`` or ``ACS_WORKER_PYTHON=off``.

This module imports the standard library only: it runs on every ``import pyspark_acs``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import MutableMapping, NamedTuple, Optional

__all__ = [
    "choice",
    "point_workers_at_driver",
]

#: The switch: ``auto`` (the default) or ``off``.
ENV_WORKER_PYTHON = "ACS_WORKER_PYTHON"
#: Its values (case does not matter; unset or empty is ``auto``).
WORKER_PYTHON_MODES = ("auto", "off")


class Choice(NamedTuple):
    """What importing pyspark_acs did about ``PYSPARK_PYTHON``."""

    #: The interpreter ``PYSPARK_PYTHON`` was set to, None when it was left alone.
    python: Optional[str]
    #: Why, in words that complete "pyspark_acs ... because ...".
    reason: str


def _in_virtualenv() -> bool:
    # venv sets base_prefix apart from prefix; the old virtualenv tool sets real_prefix instead.
    return sys.prefix != getattr(sys, "base_prefix", sys.prefix) or hasattr(sys, "real_prefix")


def _spark_context_running() -> bool:
    """Whether this process already runs a SparkContext; looked up without importing pyspark."""
    pyspark = sys.modules.get("pyspark")
    context = getattr(pyspark, "SparkContext", None)
    return getattr(context, "_active_spark_context", None) is not None


def _mode(environ) -> Optional[str]:
    """``auto`` or ``off`` as ``$ACS_WORKER_PYTHON`` says (unset or empty: ``auto``); None if neither."""
    mode = environ.get(ENV_WORKER_PYTHON, "").strip().lower() or "auto"
    return mode if mode in WORKER_PYTHON_MODES else None


def choose(environ, *, executable: str, in_virtualenv: bool, spark_running: bool) -> Choice:
    """The rule of this module, on given facts (no side effects).

    Parameters
    ----------
    environ : Mapping[str, str]
        The process environment.
    executable : str
        The driver's interpreter (``sys.executable``).
    in_virtualenv : bool
        Whether the driver runs in a virtualenv.
    spark_running : bool
        Whether a SparkContext already runs in this process.

    Returns
    -------
    Choice
    """
    mode = _mode(environ)
    if mode is None:
        return Choice(None, f"${ENV_WORKER_PYTHON}={environ[ENV_WORKER_PYTHON]!r} is neither 'auto' nor 'off'")
    if mode == "off":
        return Choice(None, f"${ENV_WORKER_PYTHON} is off")
    if "PYSPARK_PYTHON" in environ:
        return Choice(None, "$PYSPARK_PYTHON is set")
    if "spark.pyspark.python" in environ.get("PYSPARK_SUBMIT_ARGS", ""):
        return Choice(None, "$PYSPARK_SUBMIT_ARGS sets spark.pyspark.python")
    if not in_virtualenv:
        return Choice(None, "the driver does not run in a virtualenv")
    if not executable:
        return Choice(None, "the driver's interpreter is unknown (sys.executable is empty)")
    if spark_running:
        return Choice(None, "a SparkContext was running before pyspark_acs was imported")
    return Choice(executable, "the driver runs in a virtualenv and neither PYSPARK_PYTHON nor "
                              "spark.pyspark.python is set")


#: What the import of pyspark_acs chose (set by :func:`point_workers_at_driver`).
choice: Optional[Choice] = None


def point_workers_at_driver(environ: Optional[MutableMapping[str, str]] = None) -> Choice:
    """Apply :func:`choose` to this process: set ``PYSPARK_PYTHON`` when the rule says so.

    Called once by ``import pyspark_acs``; a value of ``$ACS_WORKER_PYTHON`` other than
    ``auto``/``off`` leaves ``PYSPARK_PYTHON`` alone and warns (an import must not fail: the
    ``acs`` commands import the package too).
    """
    global choice
    env = os.environ if environ is None else environ
    choice = choose(env, executable=sys.executable, in_virtualenv=_in_virtualenv(),
                    spark_running=_spark_context_running())
    if choice.python is not None:
        env["PYSPARK_PYTHON"] = choice.python
    elif _mode(env) is None:
        warnings.warn(f"pyspark_acs: {choice.reason}; PYSPARK_PYTHON is left as it is "
                      f"(set {ENV_WORKER_PYTHON}=auto or off)", RuntimeWarning, stacklevel=2)
    return choice
