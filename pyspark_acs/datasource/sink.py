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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.compute as pc
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

from pyspark_acs.datasource.options import SinkOptions
from pyspark_acs.errors import AcsError, AcsOptionError, CacheError
from pyspark_acs.format.block import HEADER_SIZE, encode_block, encode_seal, rebase_blocks, scan_blocks
from pyspark_acs.format.names import next_file_name, shard_dir, validate_stream
from pyspark_acs.storage.store import DurableStore, open_store
from pyspark_acs.errors import LaterFileError
from pyspark_acs.write.shard import OpenFile, ShardWriter, shard_for_key

__all__ = [
    "AcsBatchWriter",
    "AcsStreamWriter",
    "SinkCommitter",
]

log = logging.getLogger(__name__)

#: Folder (under the root, beside the streams) of the sink identities' batch manifests.
SINKS_DIR = "_sinks"
#: Staged files of failed task attempts older than this are swept at commit time.
STAGING_SWEEP_AFTER_S = 3600.0
#: Staged pieces of one segment are appended together up to this many bytes (one durable
#: append, one chunk write, one length publication for all the tasks' pieces of a shard,
#: instead of one each); a single larger piece is appended alone.
COMMIT_APPEND_BYTES = 8 * 1024 * 1024
#: Shards of a batch appended at once by the driver: each shard is its own writer, lease and
#: file, so their appends (durable write, chunks, lengths: mostly waiting on I/O) overlap.
COMMIT_THREADS = 8

# Cache clients of the commits of this process, one per (process, endpoints, token, TLS files), kept
# open between micro-batches: Spark reuses the Python process that commits a query's batches,
# so each commit finds its channels connected. _commit_clients_lock guards _commit_clients.
_commit_clients_lock = threading.Lock()
_commit_clients: Dict[Tuple[Any, ...], Tuple[Any, Any]] = {}


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


class StagedStream(NamedTuple):
    """What one task staged for one stream: ``[(shard, staged file path relative to the root,
    bytes, rows)]`` in its staging folder."""

    staged: List[Tuple[int, str, int, int]]
    staging_dir: str


class AcsCommitMessage(WriterCommitMessage):
    """What one task staged, per stream (plain data): ``{stream: StagedStream}``."""

    def __init__(self, streams: Dict[str, StagedStream]) -> None:
        self.streams = streams


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


def _column(batch: pa.RecordBatch, name: str) -> Optional[pa.Array]:
    for i, field in enumerate(batch.schema):
        if field.name.lower() == name:
            return batch.column(i)
    return None


class _Stager:
    """Task side: route rows to streams, encode them into blocks per shard and stage them in the
    durable store."""

    def __init__(self, opts: SinkOptions, sink_id: str, shards: Dict[str, int]) -> None:
        self.opts = opts
        self.sink_id = sink_id
        self.shards = dict(shards)  # stream -> shard count; streams met in rows are added

    def write(self, batches: Iterator[pa.RecordBatch]) -> AcsCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        pid = ctx.partitionId() if ctx else 0
        store = open_store(self.opts.root)
        attempt = f"{uuid.uuid4().hex}-{pid}"
        appenders: Dict[Tuple[str, int], Any] = {}
        counts: Dict[Tuple[str, int], List[int]] = {}
        rows: Dict[str, int] = {}
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                for stream, sub in self._route(batch, store):
                    shard_ids = self._shards_of(sub, stream, pid, rows.get(stream, 0))
                    rows[stream] = rows.get(stream, 0) + sub.num_rows
                    for shard, part in self._split(sub, shard_ids, self.shards[stream]):
                        app = appenders.get((stream, shard))
                        if app is None:
                            rel = f"{self._staging(stream, attempt)}/{shard:05d}.blk"
                            app = appenders[(stream, shard)] = store.open_appender(rel)
                            counts[(stream, shard)] = [0, 0]
                        for block, n in self._blocks(part):
                            app.write(block)
                            counts[(stream, shard)][0] += len(block)
                            counts[(stream, shard)][1] += n
        finally:
            for app in appenders.values():
                app.close()
            store.close()
        out: Dict[str, StagedStream] = {}
        for stream, shard in sorted(appenders):
            staging = self._staging(stream, attempt)
            entry = out.setdefault(stream, StagedStream([], staging))
            entry.staged.append((shard, f"{staging}/{shard:05d}.blk", *counts[(stream, shard)]))
        return AcsCommitMessage(out)

    def _staging(self, stream: str, attempt: str) -> str:
        return f"{stream}/_sinks/{self.sink_id}/staging/{attempt}"

    def _route(self, batch: pa.RecordBatch, store: DurableStore) -> Iterator[Tuple[str, pa.RecordBatch]]:
        """``(stream, rows)`` pairs of a batch, row order kept within each stream: option
        ``stream`` takes every row (it overrides a ``stream`` column, as Kafka's ``topic``
        option does), else the ``stream`` column routes each row."""
        if self.opts.stream is not None:
            self._check_stream(self.opts.stream, store)
            yield self.opts.stream, batch
            return
        column = _column(batch, "stream")
        if column.null_count:
            row = pc.index(pc.is_null(column), True).as_py()
            raise AcsOptionError(
                f"acs sink: column 'stream' is null in a row (number {row} of a batch of this task); every row "
                f"needs a target stream, or give option 'stream' to write all rows to one",
                option="stream",
            )
        names = sorted(pc.unique(column).to_pylist())
        for name in names:
            self._check_stream(name, store)
        if len(names) == 1:
            yield names[0], batch
            return
        for name in names:
            yield name, batch.filter(pc.equal(column, name))

    def _check_stream(self, stream: str, store: DurableStore) -> None:
        """A stream met in a ``stream`` column: a safe name, and known (or created with option
        ``shards``)."""
        if stream in self.shards:
            return
        try:
            validate_stream(stream)
        except ValueError as exc:
            raise AcsOptionError(f"acs sink: column 'stream': {exc}", option="stream") from None
        existing = store.writer_shards(stream)
        if existing is None:
            if self.opts.shards is None:
                raise AcsOptionError(
                    f"acs sink: stream {stream!r} (column 'stream') does not exist in {self.opts.root}; give "
                    f"option 'shards' to create streams the column names",
                    option="shards",
                )
            existing = store.create_stream(stream, self.opts.shards)
        elif self.opts.shards is not None and self.opts.shards != existing:
            raise AcsOptionError(
                f"shards: stream {stream!r} (column 'stream') has {existing} shards, but option shards="
                f"{self.opts.shards}", option="shards",
            )
        self.shards[stream] = existing

    def _shards_of(self, batch: pa.RecordBatch, stream: str, pid: int, row: int) -> pa.Array:
        n = batch.num_rows
        count = self.shards[stream]
        shard = _column(batch, "shard")
        if shard is not None:
            shard = pc.cast(shard, pa.int64())
            bad = pc.fill_null(pc.or_(pc.less(shard, 0), pc.greater_equal(shard, count)), False)
            if pc.any(bad).as_py():
                value = pc.filter(shard, bad)[0].as_py()
                raise AcsOptionError(
                    f"acs sink: shard {value} is out of range for stream {stream!r} with "
                    f"{count} shards (allowed 0..{count - 1})",
                    option="shard",
                )
            if shard.null_count == 0:
                return shard
        key = _column(batch, "key")
        if key is not None and key.null_count < n:
            if pa.types.is_string(key.type) or pa.types.is_large_string(key.type):
                key = key.cast(pa.binary())
            rr = (row + pid) % count
            ids = [
                shard_for_key(k, count) if k is not None else (rr + i) % count
                for i, k in enumerate(key.to_pylist())
            ]
            base = pa.array(ids, pa.int64())
        else:
            # No key: spread rows round-robin, starting where this task left off.
            seq = pc.add(pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), n)), row + pid - 1)
            base = pc.subtract(seq, pc.multiply(pc.divide(seq, count), count))  # seq mod shards
        if shard is not None:  # explicit shard where given, hash/round-robin for nulls
            return pc.if_else(pc.is_null(shard), base, shard)
        return base

    def _split(self, batch: pa.RecordBatch, shard_ids: pa.Array, count: int) -> Iterator[Tuple[int, pa.RecordBatch]]:
        if count == 1:
            yield 0, batch
            return
        order = pc.sort_indices(shard_ids)  # stable: keeps the row order within a shard
        sorted_ids = pc.take(shard_ids, order)
        table = batch.take(order)
        counts = pc.value_counts(sorted_ids)
        at = 0
        for item in sorted(counts.to_pylist(), key=lambda d: d["values"]):
            yield int(item["values"]), table.slice(at, item["counts"])
            at += item["counts"]

    def _blocks(self, part: pa.RecordBatch) -> Iterator[Tuple[bytes, int]]:
        values = _column(part, "value")
        keys = _column(part, "key")
        stamps = _column(part, "timestamp")
        headers = _column(part, "headers")
        sizes = pc.binary_length(values.cast(pa.binary()) if not pa.types.is_binary(values.type) else values)
        if keys is not None:
            ksizes = pc.binary_length(keys.cast(pa.binary()) if not pa.types.is_binary(keys.type) else keys)
            sizes = pc.add(pc.fill_null(sizes, 0), pc.fill_null(ksizes, 0))
        if headers is not None:  # header keys and values count towards the block size too
            pairs = headers.flatten()
            pair_sizes = pc.add(pc.fill_null(pc.binary_length(pairs.field("key")), 0),
                                pc.fill_null(pc.binary_length(pairs.field("value")), 0))
            per_row = pc.fill_null(pc.list_value_length(headers), 0).cast(pa.int64())
            offsets = pc.cumulative_sum(per_row).to_pylist()
            csum = pc.cumulative_sum(pair_sizes).to_pylist() if len(pair_sizes) else []
            row_bytes, prev = [], 0
            for end_pair in offsets:  # bytes of each row's headers, from the running pair sums
                total = csum[end_pair - 1] if end_pair else 0
                row_bytes.append(total - prev)
                prev = total
            sizes = pc.add(pc.fill_null(sizes, 0), pa.array(row_bytes, pa.int64()))
        cum = pc.cumulative_sum(pc.add(pc.fill_null(sizes, 0), 16)).to_pylist()
        start, n, base = 0, part.num_rows, 0
        limit = self.opts.max_block_bytes
        import bisect

        while start < n:
            end = bisect.bisect_right(cum, base + limit, lo=start)
            end = max(end, start + 1)
            ts = None
            if stamps is not None:
                ts = stamps.slice(start, end - start)
                if pa.types.is_timestamp(ts.type) and ts.type.tz is None:
                    ts = ts.cast(pa.timestamp("us"))
            yield (
                encode_block(
                    values.slice(start, end - start),
                    None if keys is None else keys.slice(start, end - start),
                    ts,
                    headers=None if headers is None else headers.slice(start, end - start),
                ),
                end - start,
            )
            base = cum[end - 1]
            start = end


class SinkCommitter:
    """Driver side: appends staged blocks to the shards, exactly once per batch id.

    Every byte goes through a :class:`~pyspark_acs.write.shard.ShardWriter` (lease, recovery
    seal of a predecessor's unsealed file, appends verified against seals, chunks, lengths).
    """

    def __init__(self, opts: SinkOptions, sink_id: str) -> None:
        self.opts = opts
        self.sink_id = sink_id
        self.writer_id = f"sink{sink_id}"
        self.dir = f"{opts.stream}/_sinks/{sink_id}"
        self._held: Optional[_HeldLengths] = None  # length publications of the commit under way
        self._writers: List[ShardWriter] = []  # shard writers of the commit under way (see _append_shard)

    def _load(self, store: DurableStore, name: str) -> Optional[Dict[str, Any]]:
        raw = store.read_small(f"{self.dir}/{name}")
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise AcsError(f"{store.uri(self.dir + '/' + name)}: corrupt sink record: {exc}") from exc

    def commit(self, messages: Sequence[Optional[StagedStream]], batch_id: Optional[int]) -> None:
        """Append a batch's staged blocks to its shards, exactly once per ``batch_id``."""
        store = open_store(self.opts.root)
        self._intent_lock = threading.Lock()  # guards self._intent and its file while shards append
        try:
            self._commit(store, messages, batch_id)
        finally:
            store.close()

    def _cache_clients(self) -> Tuple[Any, Any]:
        """(data client, metadata cache) of this process's commits to these caches (created on
        first use, kept open for the next micro-batch)."""
        if not (self.opts.data_cache or self.opts.metadata_cache):
            return None, None
        o = self.opts
        key = (os.getpid(), o.data_cache, o.metadata_cache, o.cache_token, o.tls_ca, o.tls_cert, o.tls_key, o.mtls)
        with _commit_clients_lock:
            clients = _commit_clients.get(key)
            if clients is None:
                from pyspark_acs.cache.client import client_for
                from pyspark_acs.cache.metadata import MetadataCache

                owned: List[Any] = []  # never closed: they live as long as the process
                data = client_for(self.opts.data_cache, "data cache", owned, self.opts.cache_token)
                meta = client_for(self.opts.metadata_cache, "metadata cache", owned, self.opts.cache_token)
                clients = _commit_clients[key] = (data, MetadataCache(meta) if meta is not None else None)
            return clients

    def _commit(self, store: DurableStore, messages: Sequence[Optional[StagedStream]], batch_id: Optional[int]) -> None:
        if batch_id is not None:
            self._finish_older_intents(store, batch_id)
        state = self._load(store, "state.json") or {"last_batch": None, "shards": {}}
        last = state.get("last_batch")
        if batch_id is not None and last is not None and batch_id < last:
            # Spark only ever replays the last batch: a smaller id is another query (e.g. a
            # checkpoint folder deleted and reused) whose batches would otherwise be dropped.
            raise AcsError(
                f"acs sink {self.sink_id} (stream {self.opts.stream!r}): batch {batch_id} is older than the last "
                f"committed batch {last}; this looks like a new query reusing a sink identity. Give it its own "
                f"checkpointLocation or sinkId"
            )
        if batch_id is not None and batch_id == last:
            log.info("acs sink %s: batch %d was committed before; the replay writes nothing", self.sink_id, batch_id)
            self._discard(store, messages)
            return
        intent_name = f"intent-{batch_id if batch_id is not None else 'batch'}.json"
        self._intent_rel = f"{self.dir}/{intent_name}"
        intent = self._load(store, intent_name) if batch_id is not None else None
        if intent is None:
            intent = self._plan(store, state, messages, batch_id)
            store.write_small(self._intent_rel, json.dumps(intent).encode())
        else:
            log.warning("acs sink %s: completing batch %s from its intent (the driver stopped while appending)",
                        self.sink_id, batch_id)
            self._discard(store, messages)  # this attempt's staging is not used: the intent's is
        self._intent = intent
        shards_state = dict(state.get("shards", {}))
        order = sorted(intent["shards"], key=int)
        plans = {shard_s: intent["shards"][shard_s] for shard_s in order}
        _, meta = self._cache_clients()  # before the threads: they share the clients
        self._held = _HeldLengths(meta) if meta is not None else None
        writers = self._writers = []  # the shards' writers, closed once the batch's lengths are out
        pool = ThreadPoolExecutor(min(COMMIT_THREADS, len(order)), thread_name_prefix="acs-sink-commit") \
            if len(order) > 1 else None
        try:
            if pool is None:
                for shard_s in order:
                    shards_state[shard_s] = self._append_shard(store, int(shard_s), plans[shard_s])
            else:
                # Shards are independent (own writer, lease, file): append them at once. Every shard
                # is tried even when one fails; the intent makes a retry complete the ones that did
                # not land.
                futures = {s_: pool.submit(self._append_shard, store, int(s_), plans[s_]) for s_ in order}
                wait(futures.values())
                for shard_s in order:
                    shards_state[shard_s] = futures[shard_s].result()
        finally:
            try:
                if self._held is not None:
                    self._held.flush(self._cache_failed)  # what landed, even when a shard failed
            finally:
                # The leases are given up after the lengths are out, not before: their release
                # (a metadata-cache write and a store file per shard) is not on the path of a
                # reader waiting for the batch.
                self._close_writers(writers, pool)
        new_state = {"last_batch": batch_id if batch_id is not None else last, "shards": shards_state,
                     "updated": time.time()}
        store.write_small(f"{self.dir}/state.json", json.dumps(new_state).encode())
        store.delete(self._intent_rel)
        for rel in intent["staging_dirs"]:
            self._delete_dir(store, rel)
        self._sweep(store)

    def _finish_older_intents(self, store: DurableStore, batch_id: int) -> None:
        """Complete any batch before ``batch_id`` that began appending to this stream and never
        finished (its replay routed no rows here): its bytes already there are a prefix of its
        plan, so the rest lands before this batch's, never left half-written."""
        state = self._load(store, "state.json") or {}
        last = state.get("last_batch")
        older = []
        for name in store.list_dir(self.dir):
            if name.startswith("intent-") and name.endswith(".json") and name[7:-5].isdigit():
                j = int(name[7:-5])
                if j < batch_id and (last is None or j > last):
                    older.append(j)
        for j in sorted(older):
            log.warning("acs sink %s (stream %r): batch %d began appending here and never finished; completing "
                        "it from its intent before batch %d", self.sink_id, self.opts.stream, j, batch_id)
            self._commit(store, [], j)

    def _plan(self, store: DurableStore, state: Dict[str, Any], messages: Sequence[Optional[StagedStream]],
              batch_id: Optional[int]) -> Dict[str, Any]:
        """The intent: per shard, the file segments the staged pieces go to, in task order.

        A shard continues its current file when this sink wrote it last and nobody appended
        since; a piece that would take a file past ``rollBytes`` starts a new file (the old
        one is sealed), so a large batch rolls over like a Producer does.
        """
        per_shard: Dict[int, List[List[Any]]] = {}
        staging_dirs = []
        for m in messages:
            if m is None:
                continue
            staging_dirs.append(m.staging_dir)
            for shard, rel, nbytes, nrows in m.staged:
                per_shard.setdefault(shard, []).append([rel, nbytes, nrows])
        plans: Dict[str, List[Dict[str, Any]]] = {}
        for shard, staged in per_shard.items():
            prev = state.get("shards", {}).get(str(shard))
            files = store.list_files(self.opts.stream, shard)
            prev_rel = f"{shard_dir(self.opts.stream, shard)}/{prev['file']}" if prev else ""
            reuse = (
                prev is not None
                and not prev.get("sealed")
                and files
                and files[-1] == prev["file"]
                and store.lengths([prev_rel]).get(prev_rel) == prev["length"]
            )
            if reuse:
                first = self._segment(prev["file"], prev["length"], prev["next_index"])
            else:
                first = self._segment(next_file_name(files, self.writer_id), 0, 0)
            plans[str(shard)] = self._segments(first, staged)
        return {"batch": batch_id, "shards": plans, "staging_dirs": staging_dirs}

    def _segments(self, seg: Dict[str, Any], staged: List[List[Any]]) -> List[Dict[str, Any]]:
        """Spread staged pieces over ``seg`` and new files after it, rolling at ``rollBytes``."""
        segments = [seg]
        size = seg["start_length"]
        for piece in staged:
            nbytes = _piece_bytes(piece)
            if seg["staged"] and size + nbytes > self.opts.roll_bytes:
                seg["seal"] = True
                seg = self._segment(next_file_name([seg["file"]], self.writer_id), 0, 0)
                segments.append(seg)
                size = 0
            seg["staged"].append(piece)
            size += nbytes
        seg["seal"] = size >= self.opts.roll_bytes
        return segments

    @staticmethod
    def _segment(file: str, start_length: int, start_index: int) -> Dict[str, Any]:
        return {"file": file, "start_length": start_length, "start_index": start_index, "staged": [], "seal": False}

    def _append_shard(self, store: DurableStore, shard: int, segments: List[Dict[str, Any]]) -> Dict[str, Any]:
        """Append a shard's segments through its shard writer; return the shard's new sink state.

        The writer, once it holds the shard's lease, is added to ``self._writers``: the commit closes
        it (without sealing: an unsealed last file is continued by the next batch) after
        publishing the batch's lengths, whether or not the append succeeded."""
        data, meta = self._cache_clients()
        writer = ShardWriter(
            store, self.opts.stream, shard, self.writer_id, data=data, meta=self._held or meta, roll_bytes=2**62,
            roll_seconds=float("inf"), what=f"shard {shard} of stream {self.opts.stream!r} (acs sink)",
            on_cache_error=self._cache_failed,
        )
        writer.acquire()
        self._writers.append(writer)  # list.append is atomic: shard threads add theirs at once
        i = 0
        result: Dict[str, Any] = {}
        while i < len(segments):
            outcome = self._append_segment(store, shard, segments[i], writer)
            if isinstance(outcome, _Redirect):
                segments = segments[:i] + self._redirect(store, shard, writer, outcome, segments[i + 1:])
                with self._intent_lock:
                    self._intent["shards"][str(shard)] = segments
                    # Recorded before the first byte goes to the new file: a retry finds it.
                    store.write_small(self._intent_rel, json.dumps(self._intent).encode())
                continue
            result = outcome
            i += 1
        return result

    @staticmethod
    def _close_writers(writers: List[ShardWriter], pool: Optional[ThreadPoolExecutor]) -> None:
        """Close the shards' writers without sealing and release their leases (on ``pool``'s
        threads when given, then shut it down); the first failure is raised after all closed."""
        try:
            if pool is None:  # one shard at most
                for w in writers:
                    w.close(seal=False)
            else:
                futures = [pool.submit(w.close, seal=False) for w in writers]
                wait(futures)
                for f in futures:
                    f.result()
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    def _redirect(self, store: DurableStore, shard: int, writer: ShardWriter, redirect: "_Redirect",
                  later: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """New segments for the pieces that did not land (and every later segment's), starting
        with a new file after every existing one; the newest file is sealed first if its
        writer left it unsealed."""
        writer.check_leases(every=True)  # a deposed sink must not seal the new holder's file
        writer.recover()
        staged = redirect.remaining + [p for seg in later for p in seg["staged"]]
        new = self._segments(self._segment(writer.new_file_name(), 0, 0), staged)
        log.warning("acs sink %s: %s; the rest of the batch for shard %d goes to the new file %s",
                    self.sink_id, redirect.why, shard, new[0]["file"])
        return new

    def _pieces(self, store: DurableStore, seg: Dict[str, Any], uri: str) -> Iterator[Tuple[bytes, int]]:
        """The planned bytes of a segment, one piece at a time (driver memory stays at one
        piece): staged blocks renumbered from the segment's start index, then the seal if
        planned. Deterministic, so after a crash the bytes in the file are a prefix of them."""
        index = seg["start_index"]
        for piece in seg["staged"]:
            rel, nbytes, skip = piece[0], piece[1], _piece_skip(piece)
            raw = store.read(rel, skip, nbytes)
            if len(raw) != nbytes - skip:
                raise AcsError(f"{store.uri(rel)}: staged file has {skip + len(raw)} of {nbytes} bytes")
            data, count = rebase_blocks(raw, index, path=uri)
            index += count
            yield data, count
        if seg["seal"]:
            yield encode_seal(index), 0

    def _landed(self, store: DurableStore, rel: str, uri: str, seg: Dict[str, Any],
                done: int) -> Tuple[Optional[int], int]:
        """Compare the file's ``done`` bytes after the segment's start with the planned bytes.

        Returns ``(landed, cut)``: ``landed`` is where foreign bytes (another writer's seal)
        begin, relative to the segment's start (None when the file holds only a prefix of the
        planned bytes); ``cut`` is the last block boundary of the planned bytes within the
        equal prefix (where valid bytes end: a torn block after it is void).
        """
        start = seg["start_length"]
        offset = cut = 0
        for data, _ in self._pieces(store, seg, uri):
            if offset >= done:
                break
            theirs = store.read(rel, start + offset, start + min(done, offset + len(data)))
            same = _common_prefix(theirs, data)
            cut = offset
            for at, header in scan_blocks(data[:same], path=uri):
                cut = offset + at + header.size
            if same < len(theirs):
                return offset + same, cut
            offset += len(data)
        if done > offset:
            return offset, offset  # foreign bytes after everything planned (a seal): all landed
        return None, cut

    def _append_segment(self, store: DurableStore, shard: int, seg: Dict[str, Any],
                        writer: ShardWriter) -> "Dict[str, Any] | _Redirect":
        """Append what of one segment is not in its file yet, one staged piece at a time.

        The rest is appended to the segment's file only when the file holds nothing but a
        prefix of the planned bytes and is still the shard's newest file (or is absent and
        named after every file), so readers following the shard find the bytes. When another
        writer sealed the file (it took the shard over meanwhile), the pieces that did not
        land are returned as a :class:`_Redirect`: they go to a new file.
        """
        rel = f"{shard_dir(self.opts.stream, shard)}/{seg['file']}"
        uri = store.uri(rel)
        start = seg["start_length"]
        length = store.lengths([rel]).get(rel)
        if length is not None and length < start:
            raise AcsError(f"{uri}: the file is {length} bytes long, but this sink's batch starts at byte {start}")
        done = length - start if length is not None else 0
        sizes = [_piece_bytes(p) for p in seg["staged"]] + ([HEADER_SIZE] if seg["seal"] else [])
        rows = [p[2] for p in seg["staged"]] + ([0] if seg["seal"] else [])
        planned = sum(sizes)
        end_state = self._state(seg, start + planned, seg["start_index"] + sum(rows))
        landed, cut = self._landed(store, rel, uri, seg, done) if done else (None, 0)
        if (landed is None and done == planned) or (landed is not None and landed >= planned):
            return end_state  # all landed (a retry after the crash came later than the append)
        files = writer.files()
        newest = files[-1] if files else None
        in_order = seg["file"] == newest if length is not None else (newest is None or seg["file"] > newest)
        if landed is not None or not in_order:
            if landed is None and length is not None:
                writer.check_leases(every=True)  # a deposed sink must not seal the new holder's file
                writer.seal_file(seg["file"])  # only our prefix is in it: finish it where it ends
            why = (f"another writer sealed {uri} at byte {start + landed} (it took the shard over)"
                   if landed is not None else f"{uri} is no longer where the shard ends")
            return _Redirect(self._remaining(store, seg, cut), why)
        at = _piece_at(sizes, done)
        try:
            writer.recover(resume=OpenFile(seg["file"], start + done, seg["start_index"] + sum(rows[:at])))
        except LaterFileError as exc:
            # The planned file, created now, was sealed unused: a file sorts after it (a deposed
            # writer named one after our take-over). Ours while the lease holds (this check
            # raises if not): the batch goes on in a new file after it, as after a seal. Nothing
            # of the segment landed (the file was new), so every piece is redirected.
            writer.check_leases(every=True)
            return _Redirect(self._remaining(store, seg, cut), str(exc))
        if writer.current() is None or writer.file != seg["file"]:
            return _Redirect(self._remaining(store, seg, cut), f"{uri} changed while this sink took the shard")
        offset = 0
        pending: List[bytes] = []  # pieces not appended yet, appended together (COMMIT_APPEND_BYTES)
        pending_bytes = pending_rows = 0
        for data, count in self._pieces(store, seg, uri):
            if offset + len(data) > done:
                if pending and pending_bytes + len(data) > COMMIT_APPEND_BYTES:
                    writer.append(b"".join(pending), pending_rows)
                    writer.check_leases()  # a long append keeps its shard
                    pending, pending_bytes, pending_rows = [], 0, 0
                piece = data[max(0, done - offset):]
                pending.append(piece)
                pending_bytes += len(piece)
                pending_rows += count
            offset += len(data)
        if pending:
            writer.append(b"".join(pending), pending_rows)
            writer.check_leases()
        if seg["seal"]:
            writer.close_file()  # the planned seal was the last piece
        return end_state

    @staticmethod
    def _state(seg: Dict[str, Any], length: int, next_index: int) -> Dict[str, Any]:
        return {"file": seg["file"], "length": length, "next_index": next_index, "sealed": bool(seg["seal"])}

    @staticmethod
    def _remaining(store: DurableStore, seg: Dict[str, Any], cut: int) -> List[List[Any]]:
        """The staged pieces of ``seg`` from planned byte ``cut`` (a block boundary) on, with
        the bytes to skip in the first one (block boundaries are the same in the staged file)."""
        out: List[List[Any]] = []
        offset = 0
        for piece in seg["staged"]:
            size = _piece_bytes(piece)
            if offset + size > cut:
                inner = max(0, cut - offset)
                skip, rows = _piece_skip(piece), piece[2]
                if inner:
                    skipped = store.read(piece[0], skip, skip + inner)
                    rows -= sum(h.count for _, h in scan_blocks(skipped, path=store.uri(piece[0]), final=True))
                out.append([piece[0], piece[1], rows, skip + inner])
            offset += size
        return out

    def _cache_failed(self, what: str, exc: Exception) -> None:
        log.warning("acs sink %s: cache write of %s failed, readers use the durable store: %s", self.sink_id, what, exc)

    def _discard(self, store: DurableStore, messages: Sequence[Optional[StagedStream]]) -> None:
        for m in messages:
            if m is not None:
                self._delete_dir(store, m.staging_dir)

    def _delete_dir(self, store: DurableStore, rel: str) -> None:
        if store.exists(rel):  # an earlier attempt may have deleted it already
            try:
                store.fs.delete_dir(store.path(rel))
            except FileNotFoundError:
                pass  # deleted concurrently by another attempt

    def _sweep(self, store: DurableStore) -> None:
        """Delete staging folders of failed task attempts (older than an hour)."""
        import pyarrow.fs as pafs

        base = f"{self.dir}/staging"
        try:
            infos = store.fs.get_file_info(pafs.FileSelector(store.path(base), allow_not_found=True))
        except (OSError, pa.ArrowException):
            return
        cutoff = time.time() - STAGING_SWEEP_AFTER_S
        for info in infos:
            if info.mtime is not None and info.mtime.timestamp() < cutoff:
                self._delete_dir(store, f"{base}/{info.base_name}")


class _HeldLengths:
    """A metadata cache whose length publications and shard heads are held until
    :meth:`flush`, then sent in one write; everything else (leases) goes through at once.

    The commit appends a batch's shards in parallel; published one by one, their lengths
    reached a streaming reader tens of milliseconds apart, and it read the batch in one
    micro-batch per shard (the last shard's rows a whole micro-batch later). Held and sent
    together, they move together. Publishing later is always safe: a length only promises
    that the bytes below it are written, and a head (the file a shard's writer writes, for
    the copy daemons) only names a file that exists. Each shard's writer records its head
    when it opens its file, every batch; sent on their own, the heads cost a metadata-cache
    write per shard before the batch's first append. ``_lock`` guards ``_lengths`` and
    ``_heads`` (shard threads publish).
    """

    def __init__(self, meta: Any) -> None:
        self._meta = meta
        self._lock = threading.Lock()
        self._lengths: Dict[str, List[Optional[int]]] = {}  # uri -> [cache length, durable length]
        self._heads: Dict[str, str] = {}  # shard uri -> newest file name recorded as its head

    def set_head(self, shard_uri: str, file_name: str) -> None:
        with self._lock:
            # file names sort by creation time: the newest is the head (it never moves back)
            self._heads[shard_uri] = max(file_name, self._heads.get(shard_uri, file_name))

    def publish(self, uri: str, *, cache_length: Optional[int] = None, durable_length: Optional[int] = None) -> None:
        with self._lock:
            held = self._lengths.setdefault(uri, [None, None])
            for i, n in enumerate((cache_length, durable_length)):
                if n is not None:
                    held[i] = n if held[i] is None else max(held[i], n)

    def flush(self, on_error: Any) -> None:
        """Publish the held lengths and heads in one write; a cache failure goes to
        ``on_error("lengths", exc)``."""
        with self._lock:
            lengths, self._lengths = self._lengths, {}
            heads, self._heads = self._heads, {}
        if not lengths and not heads:
            return
        try:
            self._meta.publish_many([(uri, c, d) for uri, (c, d) in lengths.items()], heads=sorted(heads.items()))
        except CacheError as exc:
            on_error("lengths", exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meta, name)


class _Redirect(NamedTuple):
    """The pieces of a segment that did not land in its file, and why."""

    remaining: List[List[Any]]
    why: str


def _piece_skip(piece: List[Any]) -> int:
    """Bytes at the start of a staged file that a piece ``[rel, nbytes, rows(, skip)]`` skips
    (they landed in an earlier file before another writer sealed it)."""
    return piece[3] if len(piece) > 3 else 0


def _piece_bytes(piece: List[Any]) -> int:
    """Bytes a staged piece contributes."""
    return piece[1] - _piece_skip(piece)


def _piece_at(sizes: List[int], position: int) -> int:
    """Number of the planned piece holding byte ``position`` (``len(sizes)`` at the end)."""
    offset = 0
    for number, size in enumerate(sizes):
        if position < offset + size:
            return number
        offset += size
    return len(sizes)


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _prepare(opts: SinkOptions) -> Dict[str, int]:
    """Create the stream of option ``stream`` or check its shard count: ``{stream: shards}``
    (empty without the option: every row names its stream)."""
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


def _by_stream(opts: SinkOptions, messages: Sequence[Optional[WriterCommitMessage]], also: Sequence[str] = ()
               ) -> List[Tuple[SinkOptions, List[Optional[StagedStream]]]]:
    """Per stream of a batch (every stream a task staged rows for, option ``stream``'s even
    without rows, and ``also``), its options and its tasks' staged files in task order."""
    names = {name for m in messages if isinstance(m, AcsCommitMessage) for name in m.streams}
    names.update(also)
    if opts.stream is not None:
        names.add(opts.stream)
    return [
        (replace(opts, stream=name),
         [m.streams.get(name) if isinstance(m, AcsCommitMessage) else None for m in messages])
        for name in sorted(names)
    ]


def _manifest_rel(sink_id: str, batch_id: int) -> str:
    """Where a batch's list of streams is kept while it commits (beside the streams: a sink
    identity spans every stream it routes rows to)."""
    return f"{SINKS_DIR}/{sink_id}/batch-{batch_id}.json"


def _commit(opts: SinkOptions, sink_id: str, messages: Sequence[Optional[WriterCommitMessage]],
            batch_id: Optional[int]) -> None:
    """Commit a batch stream by stream, each exactly once per batch id (its own intent and
    state): after a failure part way, the retry replays the streams done and completes the rest.

    Before the first stream, the batch's streams are recorded (a manifest); a retry commits the
    recorded ones too, so a stream its replay routes no rows to is still completed from its
    intent, never left half-written."""
    if batch_id is None:  # a batch write without sinkId: no retry identity, nothing to record
        for stream_opts, staged in _by_stream(opts, messages):
            SinkCommitter(stream_opts, sink_id).commit(staged, batch_id)
        return
    store = open_store(opts.root)
    try:
        rel = _manifest_rel(sink_id, batch_id)
        raw = store.read_small(rel)
        recorded: List[str] = json.loads(raw)["streams"] if raw is not None else []
        plan = _by_stream(opts, messages, recorded)
        names = [stream_opts.stream for stream_opts, _ in plan]
        if names != recorded:
            store.write_small(rel, json.dumps({"streams": names}).encode())
        for stream_opts, staged in plan:
            SinkCommitter(stream_opts, sink_id).commit(staged, batch_id)
        store.delete(rel)
    finally:
        store.close()


def _abort(opts: SinkOptions, sink_id: str, messages: Sequence[Optional[WriterCommitMessage]],
           batch_id: Optional[int], why: str) -> None:
    """Delete the staged files of a batch that will not be committed, except those of a stream
    whose commit already wrote its intent (they are kept so the next attempt can finish it)."""
    store = open_store(opts.root)
    try:
        for stream_opts, staged in _by_stream(opts, messages):
            committer = SinkCommitter(stream_opts, sink_id)
            if batch_id is not None and store.exists(f"{committer.dir}/intent-{batch_id}.json"):
                log.warning("acs sink %s (stream %r): %s; its staged data is kept for the retry",
                            sink_id, stream_opts.stream, why)
                continue
            committer._discard(store, staged)
    finally:
        store.close()


class AcsStreamWriter(DataSourceStreamArrowWriter):
    """Stream writer of ``df.writeStream.format("acs")`` (see the module docstring for the guarantee)."""

    def __init__(self, opts: SinkOptions, schema: StructType) -> None:
        check_sink_schema(schema, opts)
        self.opts = opts
        self.sink_id = _sink_id(opts)
        self.shards = _prepare(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AcsCommitMessage:
        """Task side: stage this partition's rows as blocks per stream and shard; return what was staged."""
        return _Stager(self.opts, self.sink_id, self.shards).write(iterator)

    def commit(self, messages: List[Optional[WriterCommitMessage]], batchId: int) -> None:
        """Driver side: append the batch's staged blocks to its shards, exactly once per ``batchId``."""
        _commit(self.opts, self.sink_id, messages, batchId)

    def abort(self, messages: List[Optional[WriterCommitMessage]], batchId: int) -> None:
        """Delete the staged files of a batch that will not be committed.

        If a commit of this batch already wrote a stream's intent (it failed part way), that
        stream's staged files belong to the intent: they are kept so the next attempt can finish.
        """
        _abort(self.opts, self.sink_id, messages, batchId, f"batch {batchId} failed while committing")


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
    """

    def __init__(self, opts: SinkOptions, schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise AcsOptionError("acs sink: streams are append-only; use mode('append')", option="mode")
        check_sink_schema(schema, opts)
        self.opts = opts
        if opts.sink_id:
            self.sink_id = "batch" + hashlib.blake2b(opts.sink_id.encode(), digest_size=8).hexdigest()
            self.batch_id: Optional[int] = 0
        else:
            self.sink_id = "batch" + uuid.uuid4().hex[:12]
            self.batch_id = None
        self.shards = _prepare(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AcsCommitMessage:
        """Task side: stage this partition's rows as blocks per stream and shard; return what was staged."""
        return _Stager(self.opts, self.sink_id, self.shards).write(iterator)

    def commit(self, messages: List[Optional[WriterCommitMessage]]) -> None:
        """Driver side: append every task's staged blocks, in task order."""
        _commit(self.opts, self.sink_id, messages, self.batch_id)

    def abort(self, messages: List[Optional[WriterCommitMessage]]) -> None:
        """Delete the staged files of a write that will not be committed (those an intent
        needs stay: a rerun with the same ``sinkId`` completes it)."""
        _abort(self.opts, self.sink_id, messages, self.batch_id,
               "the write failed while committing (rerun with the same sinkId to complete it)")
