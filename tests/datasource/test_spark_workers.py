"""Spark's reused Python workers: the data source freezes what lives as long as the worker.

A reused worker runs ``gc.collect()`` after every task (pyspark/daemon.py); importing the acs
data source there moves the objects alive at import (pyspark, pyarrow, grpc, this package) to
the collector's permanent generation, so those per-task collections walk only what tasks make
(pyspark_acs/datasource/workergc.py). Elsewhere the collector is left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pyspark_acs.datasource.workergc import REUSED_WORKER_ENV

PROBE = (
    "import gc, pyspark_acs.datasource as d, pyspark_acs.datasource.workergc as w;"
    "print(gc.get_freeze_count(), w.freeze_long_lived())"
)


def _probe(env_value):
    env = {k: v for k, v in os.environ.items() if k != REUSED_WORKER_ENV}
    if env_value is not None:
        env[REUSED_WORKER_ENV] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    frozen, again = out.stdout.split()
    return int(frozen), again


def test_in_a_reused_worker_importing_the_source_freezes_once():
    frozen, again = _probe("1")
    # pyspark, pyarrow and this package alone are tens of thousands of tracked objects
    assert frozen > 10_000
    assert again == "False"  # once per process


def test_outside_spark_workers_the_collector_is_left_alone():
    frozen, again = _probe(None)
    assert frozen == 0 and again == "False"


@pytest.mark.spark
def test_spark_s_own_reused_workers_freeze_on_import(spark):
    """In the session's real Spark: its Python workers are started with the reuse flag, and a
    task that imports the data source finds the long-lived objects frozen."""
    import pyarrow as pa

    def probe(batches):
        import gc

        import pyspark_acs.datasource  # noqa: F401  (as unpickling a reader or writer does)

        for batch in batches:
            yield pa.RecordBatch.from_arrays(
                [pa.array([gc.get_freeze_count()] * batch.num_rows, pa.int64()),
                 pa.array([os.environ.get(REUSED_WORKER_ENV, "")] * batch.num_rows)],
                names=["frozen", "reuse"])

    rows = spark.range(4, numPartitions=2).mapInArrow(probe, "frozen long, reuse string").collect()
    assert len(rows) == 4
    for row in rows:
        assert row["reuse"], "Spark started its Python worker without SPARK_REUSE_WORKER"
        assert row["frozen"] > 10_000
