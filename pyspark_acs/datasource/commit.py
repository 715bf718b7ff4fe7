"""The sink's driver side: a batch's staged blocks appended to its shards, exactly once per batch id."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import pyarrow as pa
from pyspark.sql.datasource import WriterCommitMessage

from pyspark_acs.datasource.commit_log import (
    STATE_FILE,
    BatchManifest,
    Intent,
    Piece,
    Segment,
    ShardState,
    SinkState,
    batch_manifest_rel,
    intent_batch,
    intent_file,
    sink_dir,
)
from pyspark_acs.datasource.marks import BEGIN, END, ShardMarks, SinkMarks, mark_payload, read_marks, trim_replay
from pyspark_acs.datasource.options import SinkOptions
from pyspark_acs.datasource.staging import AcsCommitMessage, StagedStream, staging_root
from pyspark_acs.errors import AcsError, CacheError, LaterFileError
from pyspark_acs.format.block import HEADER_SIZE, encode_mark, encode_seal, rebase_blocks, scan_blocks
from pyspark_acs.format.names import next_file_name, shard_dir
from pyspark_acs.storage.store import DurableStore, open_store, record_timestamp, stream_epoch
from pyspark_acs.write.confirm import clusters_needed, wait_confirmed
from pyspark_acs.write.shard import OpenFile, ShardWriter

__all__ = [
    "COMMIT_APPEND_BYTES",
    "SinkCommitter",
    "abort_batch",
    "commit_batch",
]

log = logging.getLogger(__name__)

#: Staged files of failed task attempts older than this are swept at commit time.
STAGING_SWEEP_AFTER_S = 3600.0
#: Staged pieces of one segment are appended together up to this many bytes (one durable
#: append, one chunk write, one length publication for all the tasks' pieces of a shard,
#: instead of one each); a single larger piece is appended alone. The default of the commit's
#: ``append_bytes``.
COMMIT_APPEND_BYTES = 8 * 1024 * 1024
#: Shards of a batch appended at once by the driver: each shard is its own writer, lease and
#: file, so their appends (durable write, chunks, lengths: mostly waiting on I/O) overlap.
COMMIT_THREADS = 8

# Cache clients of the commits of this process, one per (process, endpoints, token, TLS files), kept
# open between micro-batches: Spark reuses the Python process that commits a query's batches,
# so each commit finds its channels connected. _commit_clients_lock guards _commit_clients.
_commit_clients_lock = threading.Lock()
_commit_clients: Dict[Tuple[Any, ...], Tuple[Any, Any]] = {}


class SinkCommitter:
    """Driver side: appends staged blocks to the shards, exactly once per batch id.

    Every byte goes through a :class:`~pyspark_acs.write.shard.ShardWriter` (lease, recovery
    seal of a predecessor's unsealed file, appends verified against seals, chunks, lengths).
    """

    def __init__(self, opts: SinkOptions, sink_id: str, *, append_bytes: int = COMMIT_APPEND_BYTES) -> None:
        self.opts = opts
        #: Staged pieces of a segment are appended together up to this many bytes.
        self.append_bytes = append_bytes
        self.sink_id = sink_id
        self.writer_id = f"sink{sink_id}"
        self.dir = sink_dir(opts.stream, sink_id)
        self._held: Optional[_HeldLengths] = None  # length publications of the commit under way
        self._writers: List[ShardWriter] = []  # shard writers of the commit under way (see _append_shard)
        self._batch_id: Optional[int] = None  # the batch under way (its marks name it)

    def _load(self, store: DurableStore, name: str) -> Optional[Any]:
        """The JSON of record ``name`` in the sink folder (``None``: no such file)."""
        return _read_json(store, f"{self.dir}/{name}")

    def _load_state(self, store: DurableStore) -> SinkState:
        raw = self._load(store, STATE_FILE)
        return SinkState() if raw is None else SinkState.from_json(raw, store.uri(f"{self.dir}/{STATE_FILE}"))

    def _state_here(self, store: DurableStore, epoch: int, since: Optional[float], staged: Dict[int, List[Piece]]
                    ) -> Tuple[SinkState, Optional[SinkMarks]]:
        """The sink's state in this stream, and the marks it was read from when the state file
        is missing or of another epoch (a promotion since: the file is the old history's, or
        lives in the lost source alone). ``since``: when the stream took its epoch (None: no
        promotion). ``staged``: the batch's pieces per shard, bounding the marks' scan."""
        raw = self._load(store, STATE_FILE)
        state = SinkState() if raw is None else SinkState.from_json(raw, store.uri(f"{self.dir}/{STATE_FILE}"))
        if raw is not None and _of_epoch(state.epoch, state.updated, epoch, since):
            return state, None
        # After a promotion every shard is looked at (the batch's beginning may be in a shard its
        # replay routes no rows to); a fresh sink of a stream never promoted looks at its own.
        shards = range(store.stream_shards(self.opts.stream) or 0) if epoch else sorted(staged)
        marks = read_marks(store, self.opts.stream, shards, self.writer_id, self.sink_id,
                           {s: sum(p.rows for p in ps) for s, ps in staged.items()})
        found = marks.state(epoch)
        if raw is not None or found.last_batch is not None or any(m.tail for m in marks.shards.values()):
            log.warning("acs sink %s (stream %r): %s; the state read from the batches' marks in the shards: last "
                        "batch %s", self.sink_id, self.opts.stream,
                        "no state file here" if raw is None else
                        f"the state file is of epoch {state.epoch or 0}, the stream is at epoch {epoch}",
                        found.last_batch)
        return found, marks

    def _drop_other_epochs(self, store: DurableStore, epoch: int, since: Optional[float],
                           names: List[str]) -> List[str]:
        """Delete the intents (and their staging) written at another epoch of the stream: the
        history they were appending to was cut by a promotion; the marks say what of it stands.
        ``names``: the sink folder's; returns those left."""
        left = []
        for name in names:
            if intent_batch(name) is None and name != intent_file(None):
                left.append(name)
                continue
            intent = self._load_intent(store, name)
            if intent is not None and not _of_epoch(intent.epoch, store.modified(f"{self.dir}/{name}"), epoch, since):
                log.warning("acs sink %s (stream %r): %s was written at epoch %d, the stream is at epoch %d (a "
                            "promotion since); it is dropped: the batches' marks say what of it stands",
                            self.sink_id, self.opts.stream, name, intent.epoch or 0, epoch)
                store.delete(f"{self.dir}/{name}")
                for rel in intent.staging_dirs:
                    self._delete_dir(store, rel)
            else:
                left.append(name)
        return left

    def _load_intent(self, store: DurableStore, name: str) -> Optional[Intent]:
        raw = self._load(store, name)
        return None if raw is None else Intent.from_json(raw, store.uri(f"{self.dir}/{name}"))

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
        security = o.security()
        key = (os.getpid(), o.data_cache, o.metadata_cache, security)
        with _commit_clients_lock:
            clients = _commit_clients.get(key)
            if clients is None:
                from pyspark_acs.cache.client import client_for
                from pyspark_acs.cache.metadata import MetadataCache

                owned: List[Any] = []  # never closed: they live as long as the process
                data = client_for(o.data_cache, "data cache", owned, security=security)
                meta = client_for(o.metadata_cache, "metadata cache", owned, security=security)
                clients = _commit_clients[key] = (data, MetadataCache(meta) if meta is not None else None)
            return clients

    def _commit(self, store: DurableStore, messages: Sequence[Optional[StagedStream]], batch_id: Optional[int]) -> None:
        meta = store.stream_meta(self.opts.stream) or {}
        epoch = stream_epoch(meta)
        since = _epoch_since(meta, epoch)
        if batch_id is not None:
            names = self._drop_other_epochs(store, epoch, since, store.list_dir(self.dir))
            self._finish_older_intents(store, batch_id, names)
        self._batch_id = batch_id
        staged, staging_dirs = _staged_pieces(messages)
        marks: Optional[SinkMarks] = None
        if batch_id is None:
            state = self._load_state(store)
        else:
            state, marks = self._state_here(store, epoch, since, staged)
        last = state.last_batch
        if batch_id is not None and last is not None and batch_id < last:
            # Spark only ever replays the last batch: a smaller id is another query (e.g. a
            # checkpoint folder deleted and reused) whose batches would otherwise be dropped.
            raise AcsError(
                f"acs sink {self.sink_id} (stream {self.opts.stream!r}): batch {batch_id} is older than the last "
                f"committed batch {last}; this looks like a new query reusing a sink identity. Give it its own "
                f"checkpointLocation or sinkId"
            )
        if batch_id is not None and batch_id == last and marks is None:
            log.info("acs sink %s: batch %d was committed before; the replay writes nothing", self.sink_id, batch_id)
            self._discard(store, messages)
            return
        intent_name = intent_file(batch_id)
        self._intent_rel = f"{self.dir}/{intent_name}"
        intent = self._load_intent(store, intent_name) if batch_id is not None else None
        if intent is None:
            continued: Set[int] = set()
            if marks is not None:
                # Every shard the replay routes rows to, and every shard holding this batch's
                # beginning (a replay routing no rows there ends it, or did not replay its rows).
                what = f"acs sink {self.sink_id} (stream {self.opts.stream!r})"
                begun = {s for s, m in marks.shards.items() if m.begun and m.last_batch == batch_id}
                trimmed = {}
                for s in sorted(set(staged) | begun):
                    pieces, cont = trim_replay(store, what, s, staged.get(s, []), marks.shards.get(s, ShardMarks()),
                                               batch_id, _staging_of(messages, s) if s in staged else "")
                    if pieces or cont:
                        trimmed[s] = pieces
                    if cont:
                        continued.add(s)
                staged = trimmed
            intent = self._plan(store, state, staged, staging_dirs, batch_id, epoch, continued)
            store.write_small(self._intent_rel, json.dumps(intent.to_json()).encode())
        else:
            log.warning("acs sink %s: completing batch %s from its intent (the driver stopped while appending)",
                        self.sink_id, batch_id)
            self._discard(store, messages)  # this attempt's staging is not used: the intent's is
        self._intent = intent
        shards_state: Dict[int, ShardState] = dict(state.shards)
        order = sorted(intent.shards)
        _, meta = self._cache_clients()  # before the threads: they share the clients
        self._held = _HeldLengths(meta) if meta is not None else None
        writers = self._writers = []  # the shards' writers, closed once the batch's lengths are out
        pool = ThreadPoolExecutor(min(COMMIT_THREADS, len(order)), thread_name_prefix="acs-sink-commit") \
            if len(order) > 1 else None
        try:
            if pool is None:
                for shard in order:
                    shards_state[shard] = self._append_shard(store, shard, intent.shards[shard])
            else:
                # Shards are independent (own writer, lease, file): append them at once. Every shard
                # is tried even when one fails; the intent makes a retry complete the ones that did
                # not land.
                futures = {s: pool.submit(self._append_shard, store, s, intent.shards[s]) for s in order}
                wait(futures.values())
                for shard in order:
                    shards_state[shard] = futures[shard].result()
        finally:
            try:
                if self._held is not None:
                    self._held.flush(self._cache_failed)  # what landed, even when a shard failed
            finally:
                # The leases are given up after the lengths are out, not before: their release
                # (a metadata-cache write and a store file per shard) is not on the path of a
                # reader waiting for the batch.
                self._close_writers(writers, pool)
        self._wait_clusters(store, intent)
        new_state = SinkState(batch_id if batch_id is not None else last, shards_state, time.time(), epoch)
        store.write_small(f"{self.dir}/{STATE_FILE}", json.dumps(new_state.to_json()).encode())
        store.delete(self._intent_rel)
        for rel in intent.staging_dirs:
            self._delete_dir(store, rel)
        self._sweep(store)

    def _wait_clusters(self, store: DurableStore, intent: Intent) -> None:
        """``acknowledge="clusters:K"``: before the batch counts as committed, wait until K-1
        destinations hold every file it appended to, as long as it is now (the copy daemons'
        confirmations, :func:`~pyspark_acs.write.confirm.wait_confirmed`). A timeout fails the
        commit with the intent in place: the retry appends nothing and waits again."""
        k = clusters_needed(self.opts.acknowledge)
        if k <= 1:
            return
        _, meta = self._cache_clients()
        rels = sorted({f"{shard_dir(self.opts.stream, s)}/{seg.file}" for s, segs in intent.shards.items()
                       for seg in segs})
        lengths = store.lengths(rels) if rels else {}
        needed = {store.uri(r): n for r, n in lengths.items() if n}
        wait_confirmed(meta, store.uri(self.opts.stream), needed, k,
                       deadline=time.monotonic() + self.opts.ack_timeout,
                       what=f"acs sink {self.sink_id}: batch {intent.batch} of stream {self.opts.stream!r}")

    def _finish_older_intents(self, store: DurableStore, batch_id: int, names: List[str]) -> None:
        """Complete any batch before ``batch_id`` that began appending to this stream and never
        finished (its replay routed no rows here): its bytes already there are a prefix of its
        plan, so the rest lands before this batch's, never left half-written."""
        last = self._load_state(store).last_batch  # of another epoch: its intents were dropped
        older = []
        for name in names:
            j = intent_batch(name)
            if j is not None and j < batch_id and (last is None or j > last):
                older.append(j)
        for j in sorted(older):
            log.warning("acs sink %s (stream %r): batch %d began appending here and never finished; completing "
                        "it from its intent before batch %d", self.sink_id, self.opts.stream, j, batch_id)
            self._commit(store, [], j)

    def _plan(self, store: DurableStore, state: SinkState, per_shard: Dict[int, List[Piece]],
              staging_dirs: Sequence[str], batch_id: Optional[int], epoch: int,
              continued: Set[int] = frozenset()) -> Intent:
        """The intent: per shard, the file segments the staged pieces go to, in task order.

        A shard continues its current file when this sink wrote it last and nobody appended
        since; a piece that would take a file past ``rollBytes`` starts a new file (the old
        one is sealed), so a large batch rolls over like a Producer does.
        """
        plans: Dict[int, Tuple[Segment, ...]] = {}
        for shard, staged in per_shard.items():
            prev = state.shards.get(shard)
            files = store.list_files(self.opts.stream, shard)
            prev_rel = f"{shard_dir(self.opts.stream, shard)}/{prev.file}" if prev else ""
            reuse = (
                prev is not None
                and not prev.sealed
                and files
                and files[-1] == prev.file
                and store.lengths([prev_rel]).get(prev_rel) == prev.length
            )
            begin = shard not in continued  # else the shard holds the batch's beginning already
            if reuse:
                plans[shard] = self._segments(prev.file, prev.length, prev.next_index, staged, begin)
            else:
                plans[shard] = self._segments(next_file_name(files, self.writer_id), 0, 0, staged, begin)
        return Intent(batch_id, plans, tuple(staging_dirs), epoch)

    def _segments(self, file: str, start_length: int, start_index: int,
                  staged: Sequence[Piece], begin: bool = True) -> Tuple[Segment, ...]:
        """Spread staged pieces over ``file`` from ``start_length`` on and new files after it,
        rolling at ``rollBytes``; a batch with an id begins (unless not ``begin``: the shard
        holds its beginning already) and ends with its marks."""
        marked = self._batch_id is not None
        segments: List[Segment] = []
        pieces: List[Piece] = []
        size = start_length
        for piece in staged:
            if pieces and size + piece.size > self.opts.roll_bytes:
                segments.append(Segment(file, start_length, start_index, tuple(pieces), seal=True,
                                        begin=marked and begin and not segments))
                file, start_length, start_index = next_file_name([file], self.writer_id), 0, 0
                pieces, size = [], 0
            pieces.append(piece)
            size += piece.size
        segments.append(Segment(file, start_length, start_index, tuple(pieces), seal=size >= self.opts.roll_bytes,
                                mark=marked, begin=marked and begin and not segments))
        return tuple(segments)

    def _mark(self, index: int, at: str = END) -> bytes:
        """The batch's mark at message ``index``: its beginning (before its first piece in a
        shard) or its end (after the last)."""
        assert self._batch_id is not None, "only a batch with an id is marked"
        return encode_mark(index, mark_payload(self.sink_id, self._batch_id, at))

    def _append_shard(self, store: DurableStore, shard: int, segments: Sequence[Segment]) -> ShardState:
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
        result: Optional[ShardState] = None
        while i < len(segments):
            outcome = self._append_segment(store, shard, segments[i], writer)
            if isinstance(outcome, _Redirect):
                segments = tuple(segments[:i]) + self._redirect(store, shard, writer, outcome, segments[i + 1:])
                with self._intent_lock:
                    self._intent = self._intent.with_shard(shard, segments)
                    # Recorded before the first byte goes to the new file: a retry finds it.
                    store.write_small(self._intent_rel, json.dumps(self._intent.to_json()).encode())
                continue
            result = outcome
            i += 1
        assert result is not None, "a planned shard has at least one segment"
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
                  later: Sequence[Segment]) -> Tuple[Segment, ...]:
        """New segments for the pieces that did not land (and every later segment's), starting
        with a new file after every existing one; the newest file is sealed first if its
        writer left it unsealed."""
        writer.check_leases(every=True)  # a deposed sink must not seal the new holder's file
        writer.recover()
        staged = list(redirect.remaining) + [p for seg in later for p in seg.pieces]
        new = self._segments(writer.new_file_name(), 0, 0, staged, begin=redirect.begin)
        log.warning("acs sink %s: %s; the rest of the batch for shard %d goes to the new file %s",
                    self.sink_id, redirect.why, shard, new[0].file)
        return new

    def _pieces(self, store: DurableStore, seg: Segment, uri: str) -> Iterator[Tuple[bytes, int]]:
        """The planned bytes of a segment, one piece at a time (driver memory stays at one
        piece): staged blocks renumbered from the segment's start index, then the batch's mark
        and the seal if planned. Deterministic, so after a crash the bytes in the file are a
        prefix of them."""
        index = seg.start_index
        if seg.begin:
            yield self._mark(index, BEGIN), 0
        for piece in seg.pieces:
            raw = store.read(piece.path, piece.skip, piece.length)
            if len(raw) != piece.size:
                raise AcsError(f"{store.uri(piece.path)}: staged file has {piece.skip + len(raw)} of {piece.length} bytes")
            data, count = rebase_blocks(raw, index, path=uri)
            index += count
            yield data, count
        if seg.mark:
            yield self._mark(index), 0
        if seg.seal:
            yield encode_seal(index), 0

    def _landed(self, store: DurableStore, rel: str, uri: str, seg: Segment,
                done: int) -> Tuple[Optional[int], int]:
        """Compare the file's ``done`` bytes after the segment's start with the planned bytes.

        Returns ``(landed, cut)``: ``landed`` is where foreign bytes (another writer's seal)
        begin, relative to the segment's start (None when the file holds only a prefix of the
        planned bytes); ``cut`` is the last block boundary of the planned bytes within the
        equal prefix (where valid bytes end: a torn block after it is void).
        """
        start = seg.start_length
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

    def _append_segment(self, store: DurableStore, shard: int, seg: Segment,
                        writer: ShardWriter) -> "ShardState | _Redirect":
        """Append what of one segment is not in its file yet, one staged piece at a time.

        The rest is appended to the segment's file only when the file holds nothing but a
        prefix of the planned bytes and is still the shard's newest file (or is absent and
        named after every file), so readers following the shard find the bytes. When another
        writer sealed the file (it took the shard over meanwhile), the pieces that did not
        land are returned as a :class:`_Redirect`: they go to a new file.
        """
        rel = f"{shard_dir(self.opts.stream, shard)}/{seg.file}"
        uri = store.uri(rel)
        start = seg.start_length
        length = store.lengths([rel]).get(rel)
        if length is not None and length < start:
            raise AcsError(f"{uri}: the file is {length} bytes long, but this sink's batch starts at byte {start}")
        done = length - start if length is not None else 0
        sizes = ([len(self._mark(0, BEGIN))] if seg.begin else []) + [p.size for p in seg.pieces] \
            + ([len(self._mark(0))] if seg.mark else []) + ([HEADER_SIZE] if seg.seal else [])
        rows = ([0] if seg.begin else []) + [p.rows for p in seg.pieces] + ([0] if seg.mark else []) \
            + ([0] if seg.seal else [])
        planned = sum(sizes)
        end_state = ShardState(seg.file, start + planned, seg.start_index + sum(rows), seg.seal)
        landed, cut = self._landed(store, rel, uri, seg, done) if done else (None, 0)
        if (landed is None and done == planned) or (landed is not None and landed >= planned):
            return end_state  # all landed (a retry after the crash came later than the append)
        files = writer.files()
        newest = files[-1] if files else None
        in_order = seg.file == newest if length is not None else (newest is None or seg.file > newest)
        if landed is not None or not in_order:
            if landed is None and length is not None:
                writer.check_leases(every=True)  # a deposed sink must not seal the new holder's file
                writer.seal_file(seg.file)  # only our prefix is in it: finish it where it ends
            why = (f"another writer sealed {uri} at byte {start + landed} (it took the shard over)"
                   if landed is not None else f"{uri} is no longer where the shard ends")
            return self._remaining(store, seg, cut, why)
        at = _piece_at(sizes, done)
        try:
            writer.recover(resume=OpenFile(seg.file, start + done, seg.start_index + sum(rows[:at])))
        except LaterFileError as exc:
            # The planned file, created now, was sealed unused: a file sorts after it (a deposed
            # writer named one after our take-over). Ours while the lease holds (this check
            # raises if not): the batch goes on in a new file after it, as after a seal. Nothing
            # of the segment landed (the file was new), so every piece is redirected.
            writer.check_leases(every=True)
            return self._remaining(store, seg, cut, str(exc))
        if writer.current() is None or writer.file != seg.file:
            return self._remaining(store, seg, cut, f"{uri} changed while this sink took the shard")
        offset = 0
        pending: List[bytes] = []  # pieces not appended yet, appended together (append_bytes)
        pending_bytes = pending_rows = 0
        for data, count in self._pieces(store, seg, uri):
            if offset + len(data) > done:
                # A mark or seal joins the append before it, a beginning mark the one after it.
                if pending_rows and count and pending_bytes + len(data) > self.append_bytes:
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
        if seg.seal:
            writer.close_file()  # the planned seal was the last piece
        return end_state

    def _remaining(self, store: DurableStore, seg: Segment, cut: int, why: str) -> "_Redirect":
        """The staged pieces of ``seg`` from planned byte ``cut`` (a block boundary) on, with
        the bytes to skip in the first one (block boundaries are the same in the staged file),
        and whether the batch's beginning mark is still to go."""
        out: List[Piece] = []
        offset = len(self._mark(0, BEGIN)) if seg.begin else 0
        for piece in seg.pieces:
            if offset + piece.size > cut:
                inner = max(0, cut - offset)
                rows = piece.rows
                if inner:
                    skipped = store.read(piece.path, piece.skip, piece.skip + inner)
                    rows -= sum(h.count for _, h in scan_blocks(skipped, path=store.uri(piece.path), final=True))
                out.append(replace(piece, rows=rows, skip=piece.skip + inner))
            offset += piece.size
        return _Redirect(out, why, seg.begin and cut == 0)

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

        base = staging_root(self.opts.stream, self.sink_id)
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

    remaining: List[Piece]
    why: str
    begin: bool = False  # the batch's beginning mark did not land either


def _epoch_since(meta: Dict[str, Any], epoch: int) -> Optional[float]:
    """When the stream took ``epoch`` (its promotion record's ``at``, Unix seconds; None for
    epoch 0 or a record without one)."""
    for record in reversed(meta.get("promotions") or []):
        if int(record.get("epoch") or 0) == epoch and record.get("at"):
            return record_timestamp(str(record["at"]))
    return None


def _of_epoch(recorded: Optional[int], written: Optional[float], epoch: int, since: Optional[float]) -> bool:
    """Whether a sink record (state or intent) belongs to the stream's current epoch: by the
    epoch it records; a record without one (written before records carried it) by when it
    was written, at or after the promotion to the current epoch."""
    if recorded is not None:
        return recorded == epoch
    if epoch == 0:
        return True
    return written is not None and since is not None and written >= since


def _staged_pieces(messages: Sequence[Optional[StagedStream]]) -> Tuple[Dict[int, List[Piece]], List[str]]:
    """The tasks' staged files per shard in task order, and their staging folders."""
    per_shard: Dict[int, List[Piece]] = {}
    staging_dirs = []
    for m in messages:
        if m is None:
            continue
        staging_dirs.append(m.staging_dir)
        for shard, rel, nbytes, nrows in m.staged:
            per_shard.setdefault(shard, []).append(Piece(rel, nbytes, nrows))
    return per_shard, staging_dirs


def _staging_of(messages: Sequence[Optional[StagedStream]], shard: int) -> str:
    """The staging folder of the first task that staged rows for ``shard`` (where a split
    block of a replay is staged again; deleted with the batch's)."""
    return next(m.staging_dir for m in messages if m is not None and any(s == shard for s, *_ in m.staged))


def _read_json(store: DurableStore, rel: str) -> Optional[Any]:
    """The JSON of a sink record (``None``: no such file); AcsError naming a corrupt one."""
    raw = store.read_small(rel)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise AcsError(f"{store.uri(rel)}: corrupt sink record: {exc}") from exc


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


def commit_batch(opts: SinkOptions, sink_id: str, messages: Sequence[Optional[WriterCommitMessage]],
                 batch_id: Optional[int], *, append_bytes: int = COMMIT_APPEND_BYTES) -> None:
    """Commit a batch stream by stream, each exactly once per batch id (its own intent and
    state): after a failure part way, the retry replays the streams done and completes the rest.

    Before the first stream, the batch's streams are recorded (a manifest); a retry commits the
    recorded ones too, so a stream its replay routes no rows to is still completed from its
    intent, never left half-written. A shard's staged pieces are appended together up to
    ``append_bytes`` (default :data:`COMMIT_APPEND_BYTES`)."""
    if batch_id is None:  # a batch write without sinkId: no retry identity, nothing to record
        for stream_opts, staged in _by_stream(opts, messages):
            SinkCommitter(stream_opts, sink_id, append_bytes=append_bytes).commit(staged, batch_id)
        return
    store = open_store(opts.root)
    try:
        rel = batch_manifest_rel(sink_id, batch_id)
        raw = _read_json(store, rel)
        recorded = list(BatchManifest.from_json(raw, store.uri(rel)).streams) if raw is not None else []
        plan = _by_stream(opts, messages, recorded)
        names = [stream_opts.stream for stream_opts, _ in plan]
        if names != recorded:
            store.write_small(rel, json.dumps(BatchManifest(tuple(names)).to_json()).encode())
        for stream_opts, staged in plan:
            SinkCommitter(stream_opts, sink_id, append_bytes=append_bytes).commit(staged, batch_id)
        store.delete(rel)
    finally:
        store.close()


def abort_batch(opts: SinkOptions, sink_id: str, messages: Sequence[Optional[WriterCommitMessage]],
                batch_id: Optional[int], why: str) -> None:
    """Delete the staged files of a batch that will not be committed, except those of a stream
    whose commit already wrote its intent (they are kept so the next attempt can finish it)."""
    store = open_store(opts.root)
    try:
        for stream_opts, staged in _by_stream(opts, messages):
            committer = SinkCommitter(stream_opts, sink_id)
            if batch_id is not None and store.exists(f"{committer.dir}/{intent_file(batch_id)}"):
                log.warning("acs sink %s (stream %r): %s; its staged data is kept for the retry",
                            sink_id, stream_opts.stream, why)
                continue
            committer._discard(store, staged)
    finally:
        store.close()
