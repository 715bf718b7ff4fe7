"""pyspark_acs: low-latency, ordered, large-fan-out message delivery through plain files.

An implementation of Fast ACS on open parts: producers append blocks of messages to
chronological message files in a durable store (``pyarrow.fs``), a replicated in-memory
cache absorbs the tail reads, a copy daemon moves files between clusters, and Spark
Structured Streaming reads and writes streams as ``format("acs")``.

Importing this package is cheap: it does not import pyspark, start threads or touch the
network. Public names are loaded on first use. Its one side effect: in a virtualenv, with
neither ``PYSPARK_PYTHON`` nor ``spark.pyspark.python`` set, it sets ``PYSPARK_PYTHON`` to this
interpreter, so that the Python workers of a SparkSession built afterwards can run
``format("acs")`` (``ACS_WORKER_PYTHON=off`` turns it off; see :mod:`pyspark_acs.worker_python`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pyspark_acs.errors import (
    AcsError,
    AcsOptionError,
    AcsTimeoutError,
    AppendConflictError,
    AppendLockBusyError,
    CacheError,
    CacheTimeoutError,
    CacheUnavailableError,
    ChecksumMismatchError,
    ClosedError,
    CorruptFileError,
    DataLossError,
    DeploymentError,
    ForkError,
    InvalidNameError,
    LaterFileError,
    LeaseError,
    LeasePoisonedError,
    RootNotFoundError,
    StaleEpochError,
    StoreError,
    StoreFileNotFoundError,
    TierUploadError,
    TopologyError,
    TruncatedBlockError,
    WriterConflictError,
)

from pyspark_acs import worker_python as _worker_python

__version__ = "0.1.0"

# Before any SparkSession of this process starts: Spark reads PYSPARK_PYTHON when it does.
_worker_python.point_workers_at_driver()

__all__ = [
    "AcsError",
    "AcsOptionError",
    "AcsTimeoutError",
    "AppendConflictError",
    "AppendLockBusyError",
    "CacheError",
    "CacheTimeoutError",
    "CacheUnavailableError",
    "ChecksumMismatchError",
    "ClosedError",
    "Consumer",
    "CorruptFileError",
    "DataLossError",
    "DefaultSource",
    "DeploymentError",
    "ForkError",
    "InvalidNameError",
    "LaterFileError",
    "LeaseError",
    "LeasePoisonedError",
    "Producer",
    "RootNotFoundError",
    "StaleEpochError",
    "StoreError",
    "StoreFileNotFoundError",
    "TierUploadError",
    "TopologyError",
    "TruncatedBlockError",
    "WriterConflictError",
    "__version__",
    "register",
]

# name -> module that defines it; imported on first attribute access (PEP 562).
_LAZY = {
    "Consumer": ".read.consumer",
    "DefaultSource": ".datasource",
    "Producer": ".write.producer",
    "register": ".datasource.interpreter",
}

if TYPE_CHECKING:  # pragma: no cover
    from pyspark_acs.read.consumer import Consumer
    from pyspark_acs.datasource import DefaultSource
    from pyspark_acs.write.producer import Producer
    from pyspark_acs.datasource.interpreter import register


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pyspark_acs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
