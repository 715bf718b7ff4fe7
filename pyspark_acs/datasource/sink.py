"""The ``acs`` Spark sink: exactly-once per batch id, in batch order per shard.

How a micro-batch lands
-----------------------
1. Each Spark task (``write``) encodes its rows into blocks per shard and *stages* them as
   files under ``<root>/<stream>/_sinks/<sink id>/staging/``; its commit message lists them
   (plain data: shard, path, bytes, rows).
2. The driver (``commit``) appends the staged blocks of all tasks, in task order, to each
   shard's current file, behind a shard lease: durable store first, then chunks to the data
   cache and lengths to the metadata cache, as the Producer does. Before the first byte it
   writes an *intent* (target file, start length and message index per shard, the staged
   files in order); after the last, the sink *state* records the batch id as committed.
3. A batch id at or below the committed one is a replay (the query restarted from its
   checkpoint after the sink committed): nothing is written again. A batch whose intent
   exists but which is not committed (the driver died while appending) is completed from its
   intent: the bytes already appended are exactly a prefix of the planned bytes (headers are
   renumbered deterministically), so the rest is appended and nothing is duplicated.

The guarantee is therefore **exactly-once per batch id** for one sink identity. The sink
identity is the query's ``checkpointLocation`` (hashed) or the ``sinkId`` option: two
queries that write the same stream need different checkpoints, and a query started afresh
(new checkpoint) is a new sink. Rows of one batch appear after all rows of earlier batches
in every shard; within a batch, a shard holds task 0's rows, then task 1's, and so on.

This module is what Spark calls (the writers, their schema and option checks); the task side
is :mod:`pyspark_acs.datasource.staging`, the driver side :mod:`pyspark_acs.datasource.commit`,
and the intent and state files :mod:`pyspark_acs.datasource.commit_log` (docs/format.md
section 7).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, Dict, Iterator, List, Optional

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from pyspark_acs.datasource.commit import COMMIT_APPEND_BYTES, abort_batch, commit_batch
from pyspark_acs.datasource.options import SinkOptions
from pyspark_acs.datasource.staging import AcsCommitMessage, Stager
from pyspark_acs.errors import AcsOptionError
from pyspark_acs.storage.store import open_store

__all__ = [
    "AcsBatchWriter",
    "AcsStreamWriter",
]


#: Columns the sink writes, with the types it takes.
SINK_COLUMNS = {
    "value": ((BinaryType, StringType), "binary or string"),
    "key": ((BinaryType, StringType), "binary or string"),
    "shard": ((IntegerType, LongType, ShortType, ByteType), "an integer type"),
    "timestamp": ((TimestampType, TimestampNTZType), "timestamp"),
    "stream": ((StringType,), "string"),
    "headers": ((ArrayType,), "array<struct<key: string, value: binary>> (Kafka's headers)"),
}
#: Columns of the acs source that the sink drops: a message gets a new file and position where
#: it lands, so ``readStream.format("acs")`` can feed ``writeStream.format("acs")`` unchanged.
SOURCE_POSITION_COLUMNS = ("file", "position")
#: Kafka sink columns and what to use instead (refused: silently dropping them loses data).
KAFKA_COLUMNS = {
    "topic": "name the target stream in a 'stream' column (or option stream)",
    "partition": "name the target shard in a 'shard' column",
}


def _headers_type(dt: Any) -> bool:
    """Kafka's headers type: ``array<struct<key: string, value: binary>>``."""
    item = getattr(dt, "elementType", None)
    if not isinstance(item, StructType) or [f.name.lower() for f in item.fields] != ["key", "value"]:
        return False
    return isinstance(item.fields[0].dataType, StringType) and isinstance(item.fields[1].dataType, BinaryType)


def check_sink_schema(schema: StructType, opts: Optional[SinkOptions] = None) -> None:
    """Refuse a DataFrame the sink cannot write, naming the column and what is allowed.

    Raises
    ------
    AcsOptionError
        No ``value`` column, a column of a wrong type, a column the sink would not write (Kafka's
        ``topic``/``partition``/``headers`` or any other), or neither a ``stream`` column nor a
        ``stream`` option.
    """
    fields = {f.name.lower(): f for f in schema.fields}
    if "value" not in fields:
        raise AcsOptionError(
            f"acs sink: the DataFrame needs a 'value' column (binary or string); it has: "
            f"{', '.join(schema.fieldNames()) or 'no columns'}",
            option="value",
        )
    for name, (types, text) in SINK_COLUMNS.items():
        f = fields.get(name)
        if f is not None and (not isinstance(f.dataType, types) or (name == "headers" and not _headers_type(f.dataType))):
            raise AcsOptionError(
                f"acs sink: column {f.name!r} must be {text}, not {f.dataType.simpleString()}", option=name
            )
    for name, f in fields.items():
        if name in SINK_COLUMNS or name in SOURCE_POSITION_COLUMNS:
            continue
        why = KAFKA_COLUMNS.get(name, "the sink would drop it")
        raise AcsOptionError(
            f"acs sink: column {f.name!r} is not written ({why}); the sink writes columns "
            f"{', '.join(SINK_COLUMNS)} (and ignores the acs source's {', '.join(SOURCE_POSITION_COLUMNS)}): "
            f"select only those",
            option=f.name,
        )
    if opts is not None and opts.stream is None and "stream" not in fields:
        raise AcsOptionError(
            "acs sink: give option 'stream' (the target stream), or a 'stream' column routing each row",
            option="stream",
        )
    if opts is not None and opts.stream is None and all(c in fields for c in SOURCE_POSITION_COLUMNS):
        # Rows of an acs source still carry the stream they were read from: routed by it, a
        # query would write every row back into its own input and read it again, for ever.
        raise AcsOptionError(
            "acs sink: these rows come from an acs source (columns stream, file, position): routed by their "
            "'stream' column they would go back to the stream they were read from. Give option 'stream', or "
            "select a new 'stream' column",
            option="stream",
        )


def _sink_id(opts: SinkOptions) -> str:
    """The sink identity: ``sinkId``, else the query's ``checkpointLocation``.

    Raises
    ------
    AcsOptionError
        When neither is given (e.g. the checkpoint comes from the session configuration):
        without an identity, queries would share one commit log and drop each other's batches.
    """
    ident = opts.sink_id or opts.checkpoint_location
    if not ident:
        raise AcsOptionError(
            "acs sink: give the query a checkpointLocation option, or a sinkId option, so the sink can "
            "recognise replayed batches (exactly-once per batch id)",
            option="sinkId",
        )
    return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()


def _prepare(opts: SinkOptions) -> Dict[str, int]:
    """Create the stream of option ``stream`` or check its shard count: ``{stream: shards}``
    (empty without the option: every row names its stream)."""
    if opts.acknowledge != "published" and not opts.metadata_cache:
        raise AcsOptionError(f"acknowledge: {opts.acknowledge!r} needs the metadata cache (option metadataCache): the "
                             f"copy daemons confirm there what other clusters hold", option="acknowledge")
    if opts.stream is None:
        return {}
    store = open_store(opts.root)
    try:
        existing = store.writer_shards(opts.stream)
        if existing is None:
            if opts.shards is None:
                raise AcsOptionError(
                    f"acs sink: stream {opts.stream!r} does not exist in {opts.root}; give option 'shards' to create it",
                    option="shards",
                )
            return {opts.stream: store.create_stream(opts.stream, opts.shards)}
        if opts.shards is not None and opts.shards != existing:
            raise AcsOptionError(
                f"shards: stream {opts.stream!r} has {existing} shards, but option shards={opts.shards}", option="shards"
            )
        return {opts.stream: existing}
    finally:
        store.close()


class AcsStreamWriter(DataSourceStreamArrowWriter):
    """Stream writer of ``df.writeStream.format("acs")`` (see the module docstring for the guarantee).

    ``commit_append_bytes``: a shard's staged pieces are appended together up to this many
    bytes at commit (default :data:`~pyspark_acs.datasource.commit.COMMIT_APPEND_BYTES`).
    """

    def __init__(self, opts: SinkOptions, schema: StructType, *,
                 commit_append_bytes: int = COMMIT_APPEND_BYTES) -> None:
        check_sink_schema(schema, opts)
        self.opts = opts
        self.commit_append_bytes = commit_append_bytes
        self.sink_id = _sink_id(opts)
        self.shards = _prepare(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AcsCommitMessage:
        """Task side: stage this partition's rows as blocks per stream and shard; return what was staged."""
        return Stager(self.opts, self.sink_id, self.shards).write(iterator)

    def commit(self, messages: List[Optional[WriterCommitMessage]], batchId: int) -> None:
        """Driver side: append the batch's staged blocks to its shards, exactly once per ``batchId``."""
        commit_batch(self.opts, self.sink_id, messages, batchId, append_bytes=self.commit_append_bytes)

    def abort(self, messages: List[Optional[WriterCommitMessage]], batchId: int) -> None:
        """Delete the staged files of a batch that will not be committed.

        If a commit of this batch already wrote a stream's intent (it failed part way), that
        stream's staged files belong to the intent: they are kept so the next attempt can finish.
        """
        abort_batch(self.opts, self.sink_id, messages, batchId, f"batch {batchId} failed while committing")


class AcsBatchWriter(DataSourceArrowWriter):
    """Batch writer of ``df.write.format("acs")``: appends the DataFrame once, in task order.

    Without a ``sinkId`` option every ``df.write`` is a new write: if its commit fails part
    way (the driver dies while appending), the bytes appended so far stay in the stream and
    a rerun writes the whole DataFrame again (the first part twice).

    With ``sinkId``, the id names one logical write (an idempotency key): the commit is batch
    0 of the sink identity ``sinkId``, so a rerun after a failed commit completes the first
    attempt's intent (exactly the planned bytes, nothing twice) and writes nothing of its
    own, and a rerun after a successful commit writes nothing. Use a new ``sinkId`` for new
    data.

    ``commit_append_bytes`` is as for :class:`AcsStreamWriter`.
    """

    def __init__(self, opts: SinkOptions, schema: StructType, overwrite: bool, *,
                 commit_append_bytes: int = COMMIT_APPEND_BYTES) -> None:
        if overwrite:
            raise AcsOptionError("acs sink: streams are append-only; use mode('append')", option="mode")
        check_sink_schema(schema, opts)
        self.opts = opts
        self.commit_append_bytes = commit_append_bytes
        if opts.sink_id:
            self.sink_id = "batch" + hashlib.blake2b(opts.sink_id.encode(), digest_size=8).hexdigest()
            self.batch_id: Optional[int] = 0
        else:
            self.sink_id = "batch" + uuid.uuid4().hex[:12]
            self.batch_id = None
        self.shards = _prepare(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AcsCommitMessage:
        """Task side: stage this partition's rows as blocks per stream and shard; return what was staged."""
        return Stager(self.opts, self.sink_id, self.shards).write(iterator)

    def commit(self, messages: List[Optional[WriterCommitMessage]]) -> None:
        """Driver side: append every task's staged blocks, in task order."""
        commit_batch(self.opts, self.sink_id, messages, self.batch_id, append_bytes=self.commit_append_bytes)

    def abort(self, messages: List[Optional[WriterCommitMessage]]) -> None:
        """Delete the staged files of a write that will not be committed (those an intent
        needs stay: a rerun with the same ``sinkId`` completes it)."""
        abort_batch(self.opts, self.sink_id, messages, self.batch_id,
               "the write failed while committing (rerun with the same sinkId to complete it)")
