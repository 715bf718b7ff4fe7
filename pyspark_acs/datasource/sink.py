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

import datetime as _dt
import hashlib
import json
import logging
import time
import uuid
import zlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
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

from pyspark_acs.format.block import HEADER_SIZE, encode_block, encode_seal, rebase_blocks
from pyspark_acs.errors import AcsError, AcsOptionError, CacheError
from pyspark_acs.storage.leases import StoreLease
from pyspark_acs.format.names import file_name, parse_file_name, shard_dir
from pyspark_acs.storage.store import DurableStore, open_store
from pyspark_acs.datasource.options import SinkOptions

__all__ = ["AcsBatchWriter", "AcsCommitMessage", "AcsStreamWriter", "SinkCommitter", "check_sink_schema"]

log = logging.getLogger(__name__)

#: Staged files of failed task attempts older than this are swept at commit time.
STAGING_SWEEP_AFTER_S = 3600.0
_LEASE_FILE = "_writer.lease"


def check_sink_schema(schema: StructType) -> None:
    """Refuse a DataFrame the sink cannot write, naming the column and the allowed types.

    Raises
    ------
    AcsOptionError
        No ``value`` column, or a column of a wrong type.
    """
    fields = {f.name.lower(): f for f in schema.fields}
    allowed = {
        "value": ((BinaryType, StringType), "binary or string"),
        "key": ((BinaryType, StringType), "binary or string"),
        "shard": ((IntegerType, LongType, ShortType, ByteType), "an integer type"),
        "timestamp": ((TimestampType, TimestampNTZType), "timestamp"),
    }
    if "value" not in fields:
        raise AcsOptionError(
            f"acs sink: the DataFrame needs a 'value' column (binary or string); it has: "
            f"{', '.join(schema.fieldNames()) or 'no columns'}",
            option="value",
        )
    for name, (types, text) in allowed.items():
        f = fields.get(name)
        if f is not None and not isinstance(f.dataType, types):
            raise AcsOptionError(
                f"acs sink: column {f.name!r} must be {text}, not {f.dataType.simpleString()}", option=name
            )


class AcsCommitMessage(WriterCommitMessage):
    """What one task staged: ``[(shard, staged file path relative to the root, bytes, rows)]``."""

    def __init__(self, staged: List[Tuple[int, str, int, int]], staging_dir: str) -> None:
        self.staged = staged
        self.staging_dir = staging_dir


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
    """Task side: encode rows into blocks per shard and stage them in the durable store."""

    def __init__(self, opts: SinkOptions, sink_id: str, shards: int) -> None:
        self.opts = opts
        self.sink_id = sink_id
        self.shards = shards

    def write(self, batches: Iterator[pa.RecordBatch]) -> AcsCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        pid = ctx.partitionId() if ctx else 0
        store = open_store(self.opts.root)
        staging = f"{self.opts.stream}/_sinks/{self.sink_id}/staging/{uuid.uuid4().hex}-{pid}"
        appenders: Dict[int, Any] = {}
        counts: Dict[int, List[int]] = {}
        row = 0
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                shard_ids = self._shards_of(batch, pid, row)
                row += batch.num_rows
                for shard, part in self._split(batch, shard_ids):
                    app = appenders.get(shard)
                    if app is None:
                        app = appenders[shard] = store.open_appender(f"{staging}/{shard:05d}.blk")
                        counts[shard] = [0, 0]
                    for block, n in self._blocks(part):
                        app.write(block)
                        counts[shard][0] += len(block)
                        counts[shard][1] += n
        finally:
            for app in appenders.values():
                app.close()
            store.close()
        staged = [(s, f"{staging}/{s:05d}.blk", counts[s][0], counts[s][1]) for s in sorted(appenders)]
        return AcsCommitMessage(staged, staging)

    def _shards_of(self, batch: pa.RecordBatch, pid: int, row: int) -> pa.Array:
        n = batch.num_rows
        shard = _column(batch, "shard")
        if shard is not None:
            shard = pc.cast(shard, pa.int64())
            bad = pc.fill_null(pc.or_(pc.less(shard, 0), pc.greater_equal(shard, self.shards)), False)
            if pc.any(bad).as_py():
                value = pc.filter(shard, bad)[0].as_py()
                raise AcsOptionError(
                    f"acs sink: shard {value} is out of range for stream {self.opts.stream!r} with "
                    f"{self.shards} shards (allowed 0..{self.shards - 1})",
                    option="shard",
                )
            if shard.null_count == 0:
                return shard
        key = _column(batch, "key")
        if key is not None and key.null_count < n:
            if pa.types.is_string(key.type) or pa.types.is_large_string(key.type):
                key = key.cast(pa.binary())
            rr = (row + pid) % self.shards
            ids = [
                (zlib.crc32(k) % self.shards) if k is not None else (rr + i) % self.shards
                for i, k in enumerate(key.to_pylist())
            ]
            base = pa.array(ids, pa.int64())
        else:
            # No key: spread rows round-robin, starting where this task left off.
            seq = pc.add(pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), n)), row + pid - 1)
            base = pc.subtract(seq, pc.multiply(pc.divide(seq, self.shards), self.shards))  # seq mod shards
        if shard is not None:  # explicit shard where given, hash/round-robin for nulls
            return pc.if_else(pc.is_null(shard), base, shard)
        return base

    def _split(self, batch: pa.RecordBatch, shard_ids: pa.Array) -> Iterator[Tuple[int, pa.RecordBatch]]:
        if self.shards == 1:
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
        sizes = pc.binary_length(values.cast(pa.binary()) if not pa.types.is_binary(values.type) else values)
        if keys is not None:
            ksizes = pc.binary_length(keys.cast(pa.binary()) if not pa.types.is_binary(keys.type) else keys)
            sizes = pc.add(pc.fill_null(sizes, 0), pc.fill_null(ksizes, 0))
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
                ),
                end - start,
            )
            base = cum[end - 1]
            start = end


class SinkCommitter:
    """Driver side: appends staged blocks to the shards, exactly once per batch id."""

    def __init__(self, opts: SinkOptions, sink_id: str) -> None:
        self.opts = opts
        self.sink_id = sink_id
        self.writer_id = f"sink{sink_id}"
        self.dir = f"{opts.stream}/_sinks/{sink_id}"

    def _load(self, store: DurableStore, name: str) -> Optional[Dict[str, Any]]:
        raw = store.read_small(f"{self.dir}/{name}")
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise AcsError(f"{store.uri(self.dir + '/' + name)}: corrupt sink record: {exc}") from exc

    def commit(self, messages: Sequence[Optional[AcsCommitMessage]], batch_id: Optional[int]) -> None:
        """Append a batch's staged blocks to its shards, exactly once per ``batch_id``."""
        store = open_store(self.opts.root)
        self._clients: List[Any] = []  # cache clients of this commit, one per cache
        try:
            self._commit(store, messages, batch_id)
        finally:
            for client in self._clients:
                client.close()
            store.close()

    def _cache_clients(self) -> Tuple[Any, Any]:
        """(data client, metadata cache) of this commit, created on first use."""
        if not hasattr(self, "_data"):
            from pyspark_acs.cache.client import client_for
            from pyspark_acs.cache.metadata import MetadataCache

            self._data = client_for(self.opts.data_cache, "data cache", self._clients, self.opts.cache_token)
            meta = client_for(self.opts.metadata_cache, "metadata cache", self._clients, self.opts.cache_token)
            self._meta = MetadataCache(meta) if meta is not None else None
        return self._data, self._meta

    def _commit(self, store: DurableStore, messages: Sequence[Optional[AcsCommitMessage]], batch_id: Optional[int]) -> None:
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
        intent = self._load(store, intent_name) if batch_id is not None else None
        if intent is None:
            intent = self._plan(store, state, messages, batch_id)
            store.write_small(f"{self.dir}/{intent_name}", json.dumps(intent).encode())
        else:
            log.warning("acs sink %s: completing batch %s from its intent (the driver stopped while appending)",
                        self.sink_id, batch_id)
            self._discard(store, messages)  # this attempt's staging is not used: the intent's is
        shards_state = dict(state.get("shards", {}))
        for shard_s, segments in sorted(intent["shards"].items(), key=lambda kv: int(kv[0])):
            shards_state[shard_s] = self._append_shard(store, int(shard_s), segments)
        new_state = {"last_batch": batch_id if batch_id is not None else last, "shards": shards_state,
                     "updated": time.time()}
        store.write_small(f"{self.dir}/state.json", json.dumps(new_state).encode())
        store.delete(f"{self.dir}/{intent_name}")
        for rel in intent["staging_dirs"]:
            self._delete_dir(store, rel)
        self._sweep(store)

    def _plan(self, store: DurableStore, state: Dict[str, Any], messages: Sequence[Optional[AcsCommitMessage]],
              batch_id: Optional[int]) -> Dict[str, Any]:
        """The intent: per shard, the file segments the staged pieces go to, in task order.

        A shard continues its current file when this sink wrote it last and nobody appended
        since; a piece that would take a file past ``rollBytes`` starts a new file (the old
        one is sealed), so a large batch rolls over like a Producer does.
        """
        per_shard: Dict[int, List[Tuple[str, int, int]]] = {}
        staging_dirs = []
        for m in messages:
            if m is None:
                continue
            staging_dirs.append(m.staging_dir)
            for shard, rel, nbytes, nrows in m.staged:
                per_shard.setdefault(shard, []).append((rel, nbytes, nrows))
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
                seg = self._segment(prev["file"], prev["length"], prev["next_index"])
            else:
                seg = self._segment(self._new_file_name(files), 0, 0)
            segments = [seg]
            size = seg["start_length"]
            for rel, nbytes, nrows in staged:
                if seg["staged"] and size + nbytes > self.opts.roll_bytes:
                    seg["seal"] = True
                    seg = self._segment(self._new_file_name([seg["file"]]), 0, 0)
                    segments.append(seg)
                    size = 0
                seg["staged"].append([rel, nbytes, nrows])
                size += nbytes
            seg["seal"] = size >= self.opts.roll_bytes
            plans[str(shard)] = segments
        return {"batch": batch_id, "shards": plans, "staging_dirs": staging_dirs}

    @staticmethod
    def _segment(file: str, start_length: int, start_index: int) -> Dict[str, Any]:
        return {"file": file, "start_length": start_length, "start_index": start_index, "staged": [], "seal": False}

    def _new_file_name(self, existing: List[str]) -> str:
        created = _dt.datetime.now(_dt.timezone.utc)
        if existing:
            last = parse_file_name(existing[-1]).created
            if created <= last:
                created = last + _dt.timedelta(microseconds=1)
        return file_name(created, self.writer_id)

    def _append_shard(self, store: DurableStore, shard: int, segments: List[Dict[str, Any]]) -> Dict[str, Any]:
        """Append a shard's segments behind its lease; return the shard's new sink state."""
        lease = StoreLease(store, f"{shard_dir(self.opts.stream, shard)}/{_LEASE_FILE}", self.writer_id,
                           f"shard {shard} of stream {self.opts.stream!r} (acs sink)")
        lease.acquire()
        try:
            for seg in segments:
                result = self._append_segment(store, shard, seg, lease)
        finally:
            lease.release()
        return result

    def _append_segment(self, store: DurableStore, shard: int, seg: Dict[str, Any], lease: StoreLease) -> Dict[str, Any]:
        """Append one segment, one staged piece at a time (memory stays at one piece).

        The planned bytes are the staged pieces with their headers renumbered from the
        segment's start index, then a seal if planned: deterministic, so after a crash the
        bytes already in the file are a prefix of them and only the rest is appended.
        """
        rel = f"{shard_dir(self.opts.stream, shard)}/{seg['file']}"
        uri = store.uri(rel)
        start = seg["start_length"]
        planned = sum(b for _, b, _ in seg["staged"]) + (HEADER_SIZE if seg["seal"] else 0)
        current = store.lengths([rel])[rel] or 0
        done = current - start
        if not 0 <= done <= planned:
            raise AcsError(
                f"{uri}: the file is {current} bytes long, but this sink's batch expected it between "
                f"{start} and {start + planned}: another writer appended to it"
            )
        shadow = _Shadow(self, store, shard, rel, seg["file"], start)
        app = store.open_appender(rel) if done < planned else None
        offset, index = 0, seg["start_index"]
        try:
            pieces = [(r, b) for r, b, _ in seg["staged"]] + ([(None, HEADER_SIZE)] if seg["seal"] else [])
            for staged_rel, nbytes in pieces:
                if staged_rel is None:
                    data, count = encode_seal(index), 0
                else:
                    raw = store.read(staged_rel, 0, nbytes)
                    if len(raw) != nbytes:
                        raise AcsError(f"{store.uri(staged_rel)}: staged file has {len(raw)} of {nbytes} bytes")
                    data, count = rebase_blocks(raw, index, path=uri)
                if offset + nbytes > done:
                    app.write(data[max(0, done - offset):])
                offset += nbytes
                index += count
                shadow.append(data, start + offset)
                if lease.due():
                    lease.renew()  # a long append keeps its shard
        finally:
            if app is not None:
                app.close()
        return {"file": seg["file"], "length": start + planned, "next_index": index, "sealed": bool(seg["seal"])}

    def _discard(self, store: DurableStore, messages: Sequence[Optional[AcsCommitMessage]]) -> None:
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


class _Shadow:
    """Shadows one segment's appended bytes to the caches as a Producer does: chunks to the
    data cache, then lengths (and the shard head) to the metadata cache. Best effort: a
    cache failure is logged once and readers fall back to the durable store."""

    def __init__(self, committer: SinkCommitter, store: DurableStore, shard: int, rel: str, file: str,
                 start: int) -> None:
        self.uri = store.uri(rel)
        self.chunks: Any = None
        self.meta: Any = None
        if not (committer.opts.data_cache or committer.opts.metadata_cache):
            return
        from pyspark_acs.cache.chunks import CHUNK_SIZE, ChunkWriter

        data_client, self.meta = committer._cache_clients()
        try:
            if data_client is not None:
                prefix = store.read(rel, start - start % CHUNK_SIZE, start) if start % CHUNK_SIZE else b""
                self.chunks = ChunkWriter(data_client, self.uri, start, prefix)
            if self.meta is not None:
                self.meta.set_head(store.uri(shard_dir(committer.opts.stream, shard)), file)
        except CacheError as exc:
            self._failed(exc)

    def append(self, data: bytes, durable_length: int) -> None:
        cache_length = None
        try:
            if self.chunks is not None:
                cache_length = self.chunks.append(data)
            if self.meta is not None:
                self.meta.publish(self.uri, cache_length=cache_length, durable_length=durable_length)
        except CacheError as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        log.warning("acs sink: cache update for %s failed, readers use the durable store: %s", self.uri, exc)
        self.chunks = self.meta = None


def _prepare(opts: SinkOptions) -> int:
    """Create the stream or check its shard count; return the shard count."""
    store = open_store(opts.root)
    try:
        existing = store.stream_shards(opts.stream)
        if existing is None:
            if opts.shards is None:
                raise AcsOptionError(
                    f"acs sink: stream {opts.stream!r} does not exist in {opts.root}; give option 'shards' to create it",
                    option="shards",
                )
            return store.create_stream(opts.stream, opts.shards)
        if opts.shards is not None and opts.shards != existing:
            raise AcsOptionError(
                f"shards: stream {opts.stream!r} has {existing} shards, but option shards={opts.shards}", option="shards"
            )
        return existing
    finally:
        store.close()


class AcsStreamWriter(DataSourceStreamArrowWriter):
    """Stream writer of ``df.writeStream.format("acs")`` (see the module docstring for the guarantee)."""

    def __init__(self, opts: SinkOptions, schema: StructType) -> None:
        check_sink_schema(schema)
        self.opts = opts
        self.sink_id = _sink_id(opts)
        self.shards = _prepare(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AcsCommitMessage:
        """Task side: stage this partition's rows as blocks per shard; return what was staged."""
        return _Stager(self.opts, self.sink_id, self.shards).write(iterator)

    def commit(self, messages: List[Optional[WriterCommitMessage]], batchId: int) -> None:
        """Driver side: append the batch's staged blocks to its shards, exactly once per ``batchId``."""
        SinkCommitter(self.opts, self.sink_id).commit(messages, batchId)

    def abort(self, messages: List[Optional[WriterCommitMessage]], batchId: int) -> None:
        """Delete the staged files of a batch that will not be committed.

        If a commit of this batch already wrote its intent (it failed part way), the staged
        files belong to that intent: they are kept so the next attempt can finish the batch.
        """
        committer = SinkCommitter(self.opts, self.sink_id)
        store = open_store(self.opts.root)
        try:
            if store.exists(f"{committer.dir}/intent-{batchId}.json"):
                log.warning("acs sink %s: batch %d failed while committing; its staged data is kept for the retry",
                            self.sink_id, batchId)
                return
            committer._discard(store, messages)
        finally:
            store.close()


class AcsBatchWriter(DataSourceArrowWriter):
    """Batch writer of ``df.write.format("acs")``: appends the DataFrame once, in task order."""

    def __init__(self, opts: SinkOptions, schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise AcsOptionError("acs sink: streams are append-only; use mode('append')", option="mode")
        check_sink_schema(schema)
        self.opts = opts
        self.sink_id = "batch" + uuid.uuid4().hex[:12]
        self.shards = _prepare(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AcsCommitMessage:
        """Task side: stage this partition's rows as blocks per shard; return what was staged."""
        return _Stager(self.opts, self.sink_id, self.shards).write(iterator)

    def commit(self, messages: List[Optional[WriterCommitMessage]]) -> None:
        """Driver side: append every task's staged blocks, in task order."""
        SinkCommitter(self.opts, self.sink_id).commit(messages, None)

    def abort(self, messages: List[Optional[WriterCommitMessage]]) -> None:
        """Delete the staged files of a write that will not be committed."""
        store = open_store(self.opts.root)
        try:
            SinkCommitter(self.opts, self.sink_id)._discard(store, messages)
        finally:
            store.close()
