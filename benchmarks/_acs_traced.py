"""The acs source with every streaming-planner call traced (benchmarks/available_now_timeline.py).

A module of its own, imported by name in the planner process (Spark pickles the data source
class by reference when it lives in an importable module): tracing adds no imports there
beyond the source's own.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from typing import List

from pyspark_acs.datasource import AcsDataSource
from pyspark_acs.datasource.source import AcsStreamReader

HEAVY = ("grpc", "google.protobuf", "pandas", "pyarrow", "pyarrow.compute", "numpy", "pyspark_acs.cache.client")

TRACE_ENV = "ACS_TIMELINE_TRACE"


def _trace(event: str, **fields) -> None:
    """Append one event (wall time, pid) to the trace file named by $ACS_TIMELINE_TRACE."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    fields.update(t=time.time(), pid=os.getpid(), event=event)
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def _loaded() -> List[str]:
    return [m for m in HEAVY if m in sys.modules]


class TracedReader(AcsStreamReader):
    """The acs stream reader with every planner call traced."""

    def __init__(self, opts) -> None:
        _trace("reader init begin", loaded=_loaded(),
               modules=len(sys.modules))
        t0 = time.time()
        super().__init__(opts)
        _trace("reader init end", dur=time.time() - t0, loaded=_loaded())


def _wrap(name):
    base = getattr(AcsStreamReader, name)

    def call(self, *args, **kwargs):
        t0 = time.time()
        try:
            return base(self, *args, **kwargs)
        finally:
            _trace(name, begin=t0, dur=time.time() - t0, loaded=_loaded())

    call.__name__ = name
    call.__signature__ = inspect.signature(base)
    return call


for _name in ("initialOffset", "getDefaultReadLimit", "prepareForTriggerAvailableNow", "latestOffset",
              "reportLatestOffset", "partitions", "commit", "stop"):
    setattr(TracedReader, _name, _wrap(_name))


class TracedSource(AcsDataSource):
    @classmethod
    def name(cls) -> str:
        return "acs_traced"

    def streamReader(self, schema):
        from pyspark_acs.datasource.options import parse_source_options

        return TracedReader(parse_source_options(self.options))
