"""Keep Spark's reused Python workers from re-scanning every long-lived object after each task.

A reused Spark Python worker runs :func:`gc.collect` after *every* task (``pyspark/daemon.py``,
``spark.python.worker.reuse``, Spark's default). A full collection walks every object the
cyclic garbage collector tracks, and a worker that runs the acs source or sink has imported
pyspark, pyarrow, numpy, grpc, protobuf and this package: tens of thousands of tracked objects,
tens of milliseconds per collection, more in a worker that has run for a while -- after tasks
that read or wrote a few hundred messages, and a worker in it cannot start the next
micro-batch's task.

Most of those objects live as long as the worker (modules, classes, functions).
:func:`freeze_long_lived` moves what is alive to the collector's permanent generation
(:func:`gc.freeze`, made for exactly this: long-lived processes that collect often), once per
worker process, when this package's ``datasource`` module is first imported there (while Spark
unpickles the first task's reader or writer): pyspark, pyarrow, numpy and this package's first
modules. What is imported or built after it -- the source and sink modules, grpc and protobuf
(imported by the first cache call), the per-process read paths and cache clients -- stays in
the walk, about a fifth of them. Reference counting still frees frozen
objects; only cyclic garbage among what was alive at the freeze is never reclaimed, a bounded
one-off amount. Frozen objects are left out of :func:`gc.get_objects` and
:func:`gc.get_referrers` (a leak hunt in a worker has to :func:`gc.unfreeze` first).

Only processes started with ``SPARK_REUSE_WORKER`` are touched. Spark sets it for its reused
workers: the tasks' and the planner's (schema, partitions, the sink's commit), which pyspark's
daemon forks; the streaming source's planner process is started directly and has none (it
collects no garbage per call). A driver, a Consumer, a copy daemon or a Spark Connect client
keeps its collector as it was.
"""

from __future__ import annotations

import gc
import os

__all__ = [
    "freeze_long_lived",
]

#: Set by Spark in the environment of Python workers that run task after task.
REUSED_WORKER_ENV = "SPARK_REUSE_WORKER"

# Whether this process froze. A child forked after the freeze inherits the frozen generation
# with this flag: it has nothing of its own to freeze from before the fork.
_frozen = False


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
    global _frozen
    if _frozen or not in_reused_worker():
        return False
    _frozen = True  # called at module import, under the import lock; a second freeze is harmless
    gc.freeze()
    return True
