"""The acs source and sink with the calls of the delay path traced (benchmarks/delay_timeline.py).

A module of its own, imported by name in Spark's Python processes, apart from ``_acs_traced``
(whose planner tracing of available_now_timeline.py must add no imports: this one imports the
sink and the cached read path).
"""

from __future__ import annotations

import inspect
import time

from pyspark_acs.datasource.sink import AcsStreamWriter
from pyspark_acs.datasource.source import AcsStreamReader

from _acs_traced import TracedReader, TracedSource, _trace


def _traced_method(cls, name, base_cls, extra=None):
    base = getattr(base_cls, name)

    def call(self, *args, **kwargs):
        t0 = time.time()
        out = None
        try:
            out = base(self, *args, **kwargs)
            return out
        finally:
            fields = extra(self, args, out) if extra else {}
            _trace(name, begin=t0, dur=time.time() - t0, **fields)

    call.__name__ = name
    call.__signature__ = inspect.signature(base)
    setattr(cls, name, call)


def _install_sink_tracing() -> None:
    from pyspark_acs.datasource import commit, sink

    if getattr(commit._HeldLengths.flush, "traced", False):
        return
    flush = commit._HeldLengths.flush

    def traced_flush(self, on_error):
        t0 = time.time()
        try:
            return flush(self, on_error)
        finally:
            _trace("sink lengths published", begin=t0, dur=time.time() - t0)

    traced_flush.traced = True
    commit._HeldLengths.flush = traced_flush
    # the commit's steps, one event each ("step"), to split the commit's time
    from pyspark_acs.write.shard import ShardWriter
    from pyspark_acs.storage.store import DurableStore
    from pyspark_acs.write.file import FileWriter

    steps = [(commit.SinkCommitter, n) for n in ("_finish_older_intents", "_load", "_plan", "_append_shard",
                                                 "_append_segment", "_landed", "_delete_dir", "_sweep",
                                                 "_cache_clients")]
    steps += [(ShardWriter, n) for n in ("acquire", "recover", "append", "check_leases", "close", "files")]
    steps += [(DurableStore, n) for n in ("write_small", "read_small", "delete", "list_dir", "list_files",
                                          "lengths", "exists", "read")]
    steps += [(sink, "open_store"), (commit, "open_store")]
    from pyspark_acs.cache.metadata import MetadataCache, MetadataLease
    from pyspark_acs.storage.leases import StoreLease
    from pyspark_acs.write.file import CacheMirror, DurableFile

    steps += [(MetadataLease, n) for n in ("acquire", "release", "check")]
    steps += [(StoreLease, n) for n in ("acquire", "release", "renew")]
    steps += [(DurableFile, "append"), (CacheMirror, "append"), (MetadataCache, "set_head"),
              (MetadataCache, "publish_many")]
    for owner, n in steps:
        _step(owner, n)


def _step(owner, name):
    base = getattr(owner, name)

    def call(*args, **kwargs):
        t0 = time.time()
        try:
            return base(*args, **kwargs)
        finally:
            _trace("step", name=f"{getattr(owner, '__name__', owner)}.{name}", begin=t0, dur=time.time() - t0)

    setattr(owner, name, call)


class TracedWriter(AcsStreamWriter):
    """The acs stream writer with its task writes and driver commits traced."""


_traced_method(TracedWriter, "write", AcsStreamWriter,
               lambda self, a, out: {"rows": sum(s[3] for st in getattr(out, "streams", {}).values() for s in st.staged)})
_traced_method(TracedWriter, "commit", AcsStreamWriter, lambda self, a, out: {"batch": a[1] if len(a) > 1 else None})


def _install_planner_tracing() -> None:
    from pyspark_acs.read import positions
    from pyspark_acs.read.cachepath import CachedReadPath
    from pyspark_acs.datasource import source

    if getattr(CachedReadPath.wait, "traced", False):
        return
    wait = CachedReadPath.wait

    def traced_wait(self, timeout, since=None):
        t0 = time.time()
        try:
            return wait(self, timeout, since)
        finally:
            _trace("planner wait", begin=t0, dur=time.time() - t0)

    traced_wait.traced = True
    CachedReadPath.wait = traced_wait
    for owner, n in ((source, "shard_extent"), (source, "carries_messages"), (source, "advance"),
                     (positions.ShardExtent, "latest"), (source._Planner, "shards"), (source, "earliest_offset")):
        _step(owner, n)


class DelayTracedReader(TracedReader):
    """The traced reader with the planner's wait and header walks traced too, its read tasks,
    and what each latestOffset answered (moved or not)."""

    def __init__(self, opts) -> None:
        _install_planner_tracing()
        super().__init__(opts)

    def read(self, partition):
        t0 = time.time()
        rows = 0
        for b in AcsStreamReader.read(self, partition):
            rows += b.num_rows
            yield b
        _trace("read", begin=t0, dur=time.time() - t0, rows=rows)

    def latestOffset(self, start, limit):
        t0 = time.time()
        out = AcsStreamReader.latestOffset(self, start, limit)
        _trace("latestOffset answer", begin=t0, dur=time.time() - t0, moved=out != start)
        return out


class TracedSinkSource(TracedSource):
    """``acs_traced`` (the name is TracedSource's) with the delay path's reader and the traced sink."""

    def streamReader(self, schema):
        from pyspark_acs.datasource.options import parse_source_options

        return DelayTracedReader(parse_source_options(self.options))

    def streamWriter(self, schema, overwrite):
        from pyspark_acs.datasource.options import parse_sink_options

        _install_sink_tracing()
        return TracedWriter(parse_sink_options(self.options), schema)
