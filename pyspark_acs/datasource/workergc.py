"""Keep Spark's reused Python workers from re-scanning every long-lived object after each task.

A reused Spark Python worker runs :func:`gc.collect` after *every* task (``pyspark/daemon.py``,
``spark.python.worker.reuse``, Spark's default). A full collection walks every object the
cyclic garbage collector tracks, and a worker that runs the acs source or sink has imported
pyspark, pyarrow, numpy, grpc, protobuf and this package: ~56,000 tracked objects, 35 ms per
collection in a fresh worker on this 2-core machine, more in a worker that has run for a while.
Measured in ``make demo`` with py-spy: the two executor workers spent most of their samples in
that ``gc.collect()``, after tasks that read or wrote a few hundred messages, and a worker in
it cannot start the next micro-batch's task.

Those objects live as long as the worker (modules, classes, functions, the per-process read
paths and cache clients). :func:`freeze_long_lived` moves them to the collector's permanent
generation (:func:`gc.freeze`, made for exactly this: long-lived processes that collect
often), once per worker process, when the data source module is first imported there: later
collections walk only what tasks create. Reference counting still frees frozen objects; only
cyclic garbage among what was alive at the freeze is never reclaimed, a bounded one-off amount.

Only Spark's reused workers are touched (``SPARK_REUSE_WORKER`` set by Spark): a driver, a
Consumer or a copy daemon that imports this package keeps its collector as it was.
"""

from __future__ import annotations

import gc
import os
import threading

__all__ = ["REUSED_WORKER_ENV", "freeze_long_lived", "in_reused_worker"]

#: Set by Spark in the environment of Python workers that run task after task.
REUSED_WORKER_ENV = "SPARK_REUSE_WORKER"

_frozen_in_pid = 0  # the process that froze; a worker forked after it freezes on its own
_lock = threading.Lock()  # guards _frozen_in_pid


def in_reused_worker() -> bool:
    """Whether this process is a Spark Python worker that Spark reuses across tasks."""
    return bool(os.environ.get(REUSED_WORKER_ENV))


def freeze_long_lived() -> bool:
    """In a reused Spark worker, freeze the objects alive now (once per process).

    Returns
    -------
    bool
        Whether this call froze them.
    """
    global _frozen_in_pid
    if not in_reused_worker():
        return False
    with _lock:
        if _frozen_in_pid == os.getpid():
            return False
        _frozen_in_pid = os.getpid()
    gc.freeze()
    return True
