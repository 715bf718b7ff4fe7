"""The Consumer: tail-reads the message files of a stream's shards, in order.

Each shard is followed by a :class:`ShardTailer` that holds the shard's position
``(file, length)``. A poll round asks the read path for the lengths of every followed file
in one batched call, reads the new bytes of each shard, decodes the complete blocks into
Arrow record batches, and moves to the next file only when it has read the current one's
seal (the seal rule, :mod:`pyspark_acs.read.positions`): a writer seals its file when it rolls
over or closes, and a writer that takes a shard over seals its predecessor's file first.

A block whose bytes are only partly written is waited for, never reported as corrupt: the
store is append-only, so bytes present are final, and a block is only decoded once all of
it is there.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import time
from typing import Any, Callable, Deque, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union

import pyarrow as pa

from pyspark_acs.cache.endpoints import DATA_CACHE_ENV, METADATA_CACHE_ENV, cache_endpoints
from pyspark_acs.cache.poller import DEFAULT_POLL_INTERVAL_S, PUSH_SAFETY_POLL_S, safety_period
from pyspark_acs.errors import AcsOptionError, ClosedError, CorruptFileError, DataLossError
from pyspark_acs.format.arrays import ConstantColumns
from pyspark_acs.format.block import BLOCK_SCHEMA, BLOCK_SCHEMA_WITH_HEADERS, decode_block
from pyspark_acs.format.names import shard_dir, validate_shard, validate_stream
from pyspark_acs.format.offsets import Offset, OffsetMap, format_offsets, parse_offsets
from pyspark_acs.options import bytes_parser, duration_parser, nearest_name, option, parse_bool, parse_options
from pyspark_acs.read.batches import CONSUMER_BATCH_BYTES, coalesce_runs
from pyspark_acs.read.positions import (QUARANTINE_CHECK_S, Missing, MissingRules, ends_with_seal, latest_offset,
                                        quarantine_entries, quarantined_at, read_blocks, seal_behind, skip_void,
                                        unfinished_file)
from pyspark_acs.read.readpath import RateLimiter, ReadPath, open_read_path
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.storage.tier import DEFAULT_READ_POLICY, parse_read_policy, retention_gap

__all__ = [
    "Consumer",
    "ConsumerOptions",
    "DEFAULT_MAX_READ_BYTES",
    "START_WORDS",
    "ShardTailer",
    "earliest_offset",
    "parse_start",
]

log = logging.getLogger(__name__)

#: What a DataLossError adds: how to read on past the loss instead.
_SKIP_HINT = " (set failOnDataLoss=false / fail_on_data_loss=False to skip to the next available data)"

#: How long a consumer whose followed files all have their lengths pushed waits at most, on
#: average (seconds): pushes wake it at once; this bound is the same safety net as the poller's
#: (Algorithm 1's maxDelay, 1 s), drawn afresh for each wait like the poller's
#: (:func:`~pyspark_acs.cache.poller.safety_period`): idle consumers woken by the same last push
#: would otherwise look at the store in step each second.
PUSHED_WAIT_S = PUSH_SAFETY_POLL_S


@dataclasses.dataclass(frozen=True)
class TailTiming:
    """When a :class:`ShardTailer` looks again and when it says it is stuck, in seconds.

    Passed down from the :class:`Consumer` (tests pass shorter ones); with the tailer's
    ``clock`` these rules are tested without sleeping.
    """

    #: A tailer stuck this long before bytes that are no complete block and no seal says so
    #: once: a writer or copy still at work, or a crashed writer whose shard nobody took over
    #: yet. It waits for a seal; it never skips the bytes.
    stuck_warn_after_s: float = 30.0
    #: Waits between listings of a shard folder that found no file to go on with (before the
    #: shard's first file, or after a seal before the next file): the first look is at once,
    #: then the wait doubles from the first value to the second while nothing appears, and a
    #: listing that finds a file starts over. A roll-over's next file is created by the
    #: writer's next append, so it is found within a look or two; an idle shard is listed ten
    #: times a second instead of once per poll interval (a listing costs a few hundred
    #: microseconds of CPU, and on HDFS it is a NameNode call).
    listing_backoff_s: Tuple[float, float] = (0.01, 0.1)
    #: A tailer stuck at the end of an unsealed file looks for a later file (the finality
    #: rule, :func:`~pyspark_acs.read.positions.unfinished_file`) after the first value, then
    #: with the wait doubling up to the second while the position stays: a caught-up reader of
    #: an idle stream lists its shard a few times a minute, not every poll.
    unfinished_check_s: Tuple[float, float] = (1.0, 30.0)


#: Bytes read from one shard in one step: bounds memory when a consumer is far behind.
DEFAULT_MAX_READ_BYTES = 16 * 1024 * 1024

OUTPUT_SCHEMA = pa.schema(
    [("stream", pa.string()), ("shard", pa.int32()), ("file", pa.string())] + list(BLOCK_SCHEMA)
)
#: :data:`OUTPUT_SCHEMA` with the messages' ``headers`` (``include_headers=True``).
OUTPUT_SCHEMA_WITH_HEADERS = OUTPUT_SCHEMA.append(BLOCK_SCHEMA_WITH_HEADERS.field("headers"))


class ShardTailer:
    """Follows one shard from a position, reading complete blocks in order.

    Parameters
    ----------
    path : ReadPath
        Lengths and bytes of this cluster's files.
    stream, shard : str, int
    offset : Offset
        Where to start (``Offset()`` = before the first file).
    max_read_bytes : int
        Bytes read per step at most (a single larger block is still read whole).
    fail_on_data_loss : bool
        Raise :class:`DataLossError` when the file of the position is gone or shorter than
        the position; otherwise log it and continue from the next available position.
    include_headers : bool
        Batches carry the messages' ``headers`` column (:data:`OUTPUT_SCHEMA_WITH_HEADERS`).
    timing : TailTiming
        When it looks again and when it says it is stuck.
    clock : callable
        Monotonic seconds (``time.monotonic``): the clock ``timing`` is measured on.
    """

    def __init__(
        self,
        path: ReadPath,
        stream: str,
        shard: int,
        offset: Offset = Offset(),
        *,
        max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
        fail_on_data_loss: bool = True,
        limiter: Optional[RateLimiter] = None,
        include_headers: bool = False,
        timing: TailTiming = TailTiming(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timing = timing
        self.clock = clock
        self.include_headers = include_headers
        self.schema = OUTPUT_SCHEMA_WITH_HEADERS if include_headers else OUTPUT_SCHEMA
        self.path = path
        self.store = path.store
        self.stream = stream
        self.shard = shard
        self.dir = shard_dir(stream, shard)
        # _position: messages of the file before it are not handed out (an offset taken in the
        # middle of a block); 0 once the block holding it is read.
        self.file, self.length, self._position = offset
        self.sealed = False
        self.max_read_bytes = max_read_bytes
        self.fail_on_data_loss = fail_on_data_loss
        self.limiter = limiter or RateLimiter(None)
        self._check_behind = True  # first stall after a seek: is the position right after a seal?
        # The listing back-off (timing.listing_backoff_s): no listing before _list_after (clock);
        # _list_wait is the wait after the next listing that finds nothing (0: none yet).
        self._list_after = 0.0
        self._list_wait = 0.0
        self._void_checked: Optional[Tuple[int, int]] = None  # (position, length) searched for a recovery seal
        # (file, position, since) while no complete block follows; the file is part of the key:
        # a tailer waits at byte 0 of every new file at a destination, and those waits must
        # not add up to one warning.
        self._stuck: Optional[Tuple[Optional[str], int, float]] = None
        # ((file, length) stuck at, next look for a later file (monotonic), the wait after it)
        self._unfinished: Optional[Tuple[Tuple[str, int], float, float]] = None
        self._wait_why: Optional[str] = None  # why the finality rule said to wait there
        self._loss_logged: Optional[Offset] = None  # the lost position already logged
        # ((file, position, local length), its rule, since when, warned) while the position is
        # past the local end of its file (_data_loss); the rule comes from _rules.
        self._missing: Optional[Tuple[Tuple[str, int, Optional[int]], Missing, float, bool]] = None
        self._rules = MissingRules(clock)
        #: Quarantine records (epoch, file) whose moved file this tailer read anew, when it looks
        #: at the record next, and how far it reads its file meanwhile (_look_at_quarantine).
        self._reread: Set[Tuple[object, object]] = set()
        self._quarantine_due = 0.0
        self._stop_at: Optional[int] = None
        #: Position after each batch of the last step's result (same length as that result).
        self.batch_ends: List[Offset] = []
        #: Position before each batch of the last step's result: where its block starts, with
        #: the position of its first message when that is not the block's first.
        self.batch_starts: List[Offset] = []
        #: Whether the last step left bytes below the readable length unread: it stopped at
        #: ``max_read_bytes``, or the read path returned fewer bytes than asked (a live feed
        #: about to push them, Algorithm 1 postponing a durable read). Such a round is not
        #: settled: the rest may become readable with no length moving (Consumer.batches).
        self.short = False
        #: Whether the read path returned fewer bytes than the last read asked for (Algorithm 1
        #: postponing, a live feed's push awaited): those bytes are not known to be a torn block.
        self._cut_short = False
        self._consts: Optional[ConstantColumns] = None  # stream, shard, file columns of self.file

    @property
    def offset(self) -> Offset:
        """The position: the file followed and the bytes of it consumed."""
        return Offset(self.file, self.length, self._position)

    @property
    def copy_wait(self) -> Optional[str]:
        """Why this tailer waits at its position (the copy has not brought its bytes yet:
        :func:`~pyspark_acs.read.positions.missing_at`), or None when it does not."""
        if self._missing is None or self._missing[0][:2] != (self.file, self.length):
            return None
        return self._missing[1].wait

    @property
    def next_listing(self) -> Optional[float]:
        """When this tailer lists its shard folder next (monotonic) while it waits for a file to
        appear (before its first file, or sealed before the next); None while it follows one."""
        if self.file and not self.sealed:
            return None
        return self._list_after

    @property
    def rel(self) -> Optional[str]:
        """The followed file relative to the store root (None before the first file)."""
        return f"{self.dir}/{self.file}" if self.file else None

    def seek(self, offset: Offset, *, after_seal: bool = True) -> None:
        """Move to ``offset`` (a block boundary, and the message of its block to start at),
        forgetting per-file read state of the old file. ``after_seal=False``: the offset is
        known not to be right after a seal (:func:`latest_offset`'s), so the tailer does not
        prove it by walking the file's headers from its start."""
        if self.file and offset.file != self.file and hasattr(self.path, "forget"):
            self.path.forget(self.rel)  # drop per-file read state of the file we leave
        self.file, self.length, self._position = offset
        self._stop_at, self._quarantine_due = None, 0.0  # the new file's quarantine state: looked at next
        self.sealed = False
        self._check_behind = after_seal  # a position saved right after a seal is at a finished file's end
        self._void_checked = None
        expect = getattr(self.path, "expect", None)
        if expect is not None and self.file:
            expect(self.rel, self.length)  # a pushing path follows the file from here at once

    def step(self, length: Optional[int] = None, *, known: bool = False, end: Optional[Offset] = None) -> List[pa.RecordBatch]:
        """Read what is new; return decoded batches (possibly none).

        Parameters
        ----------
        length : int, optional
            The followed file's readable length if the caller already polled it.
        known : bool
            True when ``length`` comes from a poll (``None`` then means the file is missing).
        end : Offset, optional
            Stop at this position (bounded reads); the tailer never reads past it. A bounded
            step returns after each read that found messages: call it until ``offset >= end``.
        """
        out: List[pa.RecordBatch] = []
        self.batch_ends = []
        self.batch_starts = []
        self.short = False
        while True:
            if end is not None and self.offset >= end:
                return out
            if not self.file:
                files = self._list_files()
                if not files:
                    return out
                self.seek(Offset(files[0], 0))
                known = False
            if self._look_at_quarantine():
                continue
            if not known:
                length = self.path.lengths([self.rel])[self.rel]
            known = False
            if length is None or length < self.length:
                # A cache's published length can trail a position taken elsewhere (evicted or
                # lagging metadata): only the durable store's own length proves a loss.
                durable = self.path.durable_length(self.rel)
                if durable is not None and durable >= self.length:
                    self._missing = None
                    return out
                if not self._data_loss(durable):
                    return out
                continue
            self._missing = None  # the bytes at the position are here (copy_wait says so)
            limit = length if self._stop_at is None else min(length, max(self.length, self._stop_at))
            if end is not None and self.file == end.file:
                limit = min(limit, end.length)
            # Nothing is read past a seal: bytes after it are a deposed writer's, never
            # acknowledged (docs/format.md); the tailer only waits for the next file.
            progressed = self._read(limit, out) if limit > self.length and not self.sealed else False
            if not progressed and not self.sealed:
                self._check_finished(limit)
                if not self.sealed and self._check_unfinished(limit, end):
                    continue  # a damaged file skipped (fail_on_data_loss=False): read the next one
            if self.sealed:
                if not self._next_file():
                    return out
                continue
            if progressed:
                self._check_behind = False
                # A bounded read hands out what one read found (at most max_read_bytes) before
                # reading on, so a task reading a large range holds one read's batches at a time.
                if end is None or out:
                    return out
                continue
            return out

    # -- internals -------------------------------------------------------------------------

    def _read(self, limit: int, out: List[pa.RecordBatch]) -> bool:
        """Read complete blocks of the current file in ``[self.length, limit)``."""
        try:
            return self._read_blocks(limit, out)
        finally:
            self.short = not self.sealed and self.length < limit

    def _read_blocks(self, limit: int, out: List[pa.RecordBatch]) -> bool:
        start = self.length
        self.limiter.acquire(min(limit, start + self.max_read_bytes) - start)
        # Blocks before a bad one are handed out first; the next step starts at the bad block
        # and raises then (unless a recovery seal voids it).
        data, blocks, error, self._cut_short = read_blocks(self.path, self.rel, start, limit, self.max_read_bytes)
        if error is not None:
            if self._pass_void(limit):
                return True
            raise error
        if not blocks:
            return False  # no complete block yet (or the read path postponed the bytes)
        buf = pa.py_buffer(data)
        consts = self._consts
        if consts is None or consts.values[2][0] != self.file:
            consts = self._consts = ConstantColumns(
                ((self.stream, pa.string()), (self.shard, pa.int32()), (self.file, pa.string())))
        for at, header in blocks:
            # Messages before an offset's position (a resume in the middle of a block) are
            # decoded with their block and dropped from it.
            skip = min(header.count, max(0, self._position - header.first_index)) if self._position else 0
            handed = header.count > skip
            if handed:
                try:
                    _, batch = decode_block(buf, at, path=self.store.uri(self.rel), position=start + at,
                                            headers=self.include_headers, header=header,
                                            prefix=consts.take(header.count), schema=self.schema)
                except CorruptFileError:
                    if self.length == start + at and self._pass_void(limit):
                        return True
                    if self.length == start:
                        raise
                    break
                out.append(batch.slice(skip) if skip else batch)
                self.batch_starts.append(Offset(self.file, start + at, self._position if skip else 0))
            self.length = start + at + header.size
            if self._position and header.count and header.first_index + header.count >= self._position:
                self._position = 0  # the block holding it is read: later blocks hand out every message
            if handed:
                self.batch_ends.append(self.offset)
            if header.sealed:
                self.sealed = True
                break
        return True

    def _next_file(self) -> bool:
        """After the seal: follow the first file after this one in name order (wait for it).

        Files that retention deleted after this one before it was read are data loss
        (:func:`~pyspark_acs.storage.tier.retention_gap`), not a seamless step.
        """
        later = [f for f in self._list_files() if f > self.file]
        if not later:
            return False
        lost = retention_gap(self.store, self.stream, self.shard, self.file)
        if lost is not None:
            msg = (f"data loss in stream {self.stream!r} shard {self.shard}: retention deleted the files after "
                   f"{self.file} up to {lost} before this reader read them")
            if self.fail_on_data_loss:
                raise DataLossError(
                    msg + _SKIP_HINT,
                    stream=self.stream, shard=self.shard, file=lost, start=0, end=-1,
                )
            log.warning("%s; continuing from file %s", msg, later[0])
        self.seek(Offset(later[0], 0))
        return True

    def _list_files(self) -> List[str]:
        """The shard's files, or none while the listing backs off after looks that found no
        file to go on with (:attr:`TailTiming.listing_backoff_s`)."""
        now = self.clock()
        if now < self._list_after:
            return []
        files = self.store.list_files(self.stream, self.shard)
        if files and (not self.file or files[-1] > self.file):
            self._list_after, self._list_wait = 0.0, 0.0  # something to go on with: look freely
        else:
            first, most = self.timing.listing_backoff_s
            self._list_wait = min(most, max(first, 2 * self._list_wait))
            self._list_after = now + self._list_wait
        return files

    def _check_finished(self, limit: int) -> None:
        """No complete block at the position: the file may be finished all the same.

        Two cases, both through the seal rule (:mod:`pyspark_acs.read.positions`): the position
        is right after a seal (a restart from saved offsets), or bytes follow that do not make
        a complete block and a recovery seal voids them (a crashed writer's torn block).
        """
        if self._check_behind:
            self._check_behind = False
            if self.length > 0 and ends_with_seal(self.path, self.rel, self.length):
                self.sealed = True
                return
        # A read the path cut short is no sign of a torn block: the bytes come once the path
        # reads them (the push arrives, or Algorithm 1's maxDelay passes); searching them for a
        # recovery seal now would read them from the store early, every round.
        if limit > self.length and (self._cut_short or not self._pass_void(limit)) and not self.sealed:
            self._warn_stuck(limit)

    def _check_unfinished(self, limit: int, end: Optional[Offset]) -> bool:
        """Stuck at the end of an unsealed file: is a later file there, and what does it mean
        (the rule: :func:`~pyspark_acs.read.positions.unfinished_file`)? Looked at with a
        back-off (:attr:`TailTiming.unfinished_check_s`) while the position stays, at once for
        a bounded read whose end lies in a later file. Returns True when it moved to the later
        file."""
        now = self.clock()
        first, most = self.timing.unfinished_check_s
        if self._unfinished is None or self._unfinished[0] != (self.file, self.length):
            self._unfinished = ((self.file, self.length), now + (0.0 if end is not None and end.file > self.file
                                                                 else first), first)
            self._wait_why = None
        key, due, wait = self._unfinished
        if now < due:
            return False
        self._unfinished = (key, now + wait, min(most, 2 * wait))
        # The listing before the lengths (unfinished_file reads them): see its docstring.
        found = unfinished_file(self.path, self.stream, self.shard, self.file, self.length,
                                self.store.list_files(self.stream, self.shard))
        if found is None:
            return False
        if found.wait:
            self._wait_why = found.wait
            self._warn_stuck(limit)
            return False
        if self.fail_on_data_loss:
            raise found.error(_SKIP_HINT)
        log.warning("%s; continuing from file %s", found.error().args[0], found.later)
        self.seek(Offset(found.later, 0))
        return True

    def _look_at_quarantine(self) -> bool:
        """Every :data:`~pyspark_acs.read.positions.QUARANTINE_CHECK_S`, look at the stream's
        quarantine record (a cluster that took a promotion's new history moves its bytes past
        the cut aside, :mod:`pyspark_acs.server.copy.quarantine`). A position inside a range is
        the loss (:meth:`_data_loss` names it; returns True if the tailer moved on); before a
        range's start the tailer reads no further than it (``_stop_at``) until the file has
        moved, and then reads it anew (its open handle and read state are the old file's)."""
        now = self.clock()
        if now < self._quarantine_due or not self.file:
            return False
        self._quarantine_due = now + QUARANTINE_CHECK_S
        meta = self.store.stream_meta(self.stream)
        found = quarantined_at(meta, self.shard, self.file, self.length)
        if found is not None:
            return self._data_loss(self.path.durable_length(self.rel))
        self._stop_at = None
        moved = {(e.get("epoch"), e.get("file")) for e in quarantine_entries(meta, self.shard, moved_only=True)}
        for entry in quarantine_entries(meta, self.shard, self.file):
            key = (entry.get("epoch"), entry.get("file"))
            if key not in moved:
                self._stop_at = int(entry["start"])  # not moved yet: the old file's bytes follow
            elif key not in self._reread:
                self._reread.add(key)
                self.store.forget(self.rel)
                if hasattr(self.path, "forget"):
                    self.path.forget(self.rel)
        return False

    def _warn_stuck(self, limit: int) -> None:
        now = self.clock()
        after = self.timing.stuck_warn_after_s
        if self._stuck is None or self._stuck[:2] != (self.rel, self.length):
            self._stuck = (self.rel, self.length, now)
        elif now - self._stuck[2] >= after:
            self._stuck = (self.rel, self.length, math.inf)  # once per position
            why = self._wait_why if self._unfinished and self._unfinished[0] == (self.file, self.length) else None
            why = why or "a writer still at work, or a crashed writer whose shard nobody took over yet"
            log.warning("%s: bytes [%d, %d) have been no complete block and no seal for %.0f s; waiting for "
                        "them (%s)", self.store.uri(self.rel), self.length, limit, after, why)

    def _pass_void(self, limit: int) -> bool:
        """Skip a torn block up to and including the recovery seal that voids it (logged with
        the byte range); False while there is none. Searched once per readable length."""
        if self._void_checked == (self.length, limit):
            return False
        self._void_checked = (self.length, limit)
        after = skip_void(self.path, self.rel, self.length, limit)
        if after is None:
            return False
        log.warning(
            "%s: bytes [%d, %d) are a block its writer never finished; the writer that took the shard over "
            "sealed the file after them (they were never acknowledged and are skipped)",
            self.store.uri(self.rel), self.length, after - (seal_behind(self.path, self.rel, after) or 0),
        )
        self.length = after
        self.sealed = True
        return True

    def _data_loss(self, length: Optional[int]) -> bool:
        """Handle a file that this cluster holds shorter than the position, or not at all
        (the rule: :func:`~pyspark_acs.read.positions.missing_at`): wait for a copy still
        coming, else the loss. Returns True if the tailer moved on."""
        key = (self.file, self.length, length)
        now = self.clock()
        missing, _ = self._rules.get(self.path, self.stream, self.shard, self.file, self.length, length)
        if self._missing is None or self._missing[0] != key:
            self._missing = (key, missing, now, False)
        else:
            self._missing = (key, missing) + self._missing[2:]
        _, _, since, warned = self._missing
        if missing.skip_to is not None:
            log.info("stream %r shard %d: file %s is no part of this cluster's history since a promotion (moved "
                     "aside) and nothing of it was read; going on with %s", self.stream, self.shard, self.file,
                     missing.skip_to)
            self.seek(Offset(missing.skip_to, 0))
            return True
        if missing.wait:
            if not warned and now - since >= self.timing.stuck_warn_after_s:
                self._missing = (key, missing, since, True)  # once per position and length
                log.warning("stream %r shard %d: the position is at byte %d of file %s, but %s; waiting for "
                            "the copy (%.0f s so far)", self.stream, self.shard, self.length, self.file,
                            missing.wait, self.timing.stuck_warn_after_s)
            return False
        if self.fail_on_data_loss:
            raise missing.error(_SKIP_HINT)
        msg = missing.error().args[0]
        files = self.store.list_files(self.stream, self.shard)
        later = [f for f in files if f > self.file]
        # failOnDataLoss=false: the file lost its end (its seal with it), so nothing more will be
        # read from it; go on with the next file, else wait at its new end for more.
        if later:
            log.warning("%s; continuing from file %s", msg, later[0])
            self.seek(Offset(later[0], 0))
            return True
        if length is not None:
            log.warning("%s; continuing from the end of that file (byte %d)", msg, length)
            self.length, self._position = length, 0
            return True
        # Wait at this position for a newer file. (Seeking to Offset() would restart the shard
        # from its oldest file and replay messages already consumed.)
        if self._loss_logged != self.offset:
            log.warning("%s; waiting for new data", msg)
            self._loss_logged = self.offset
        return False


#: A batch read and not handed out yet, or the last one handed out: (batch, tailer index,
#: position after it, ``(row, position before it)`` of each block in it).
_Pending = Tuple[pa.RecordBatch, int, Offset, Tuple[Tuple[int, Offset], ...]]


def _inside(batch: pa.RecordBatch, starts: Sequence[Tuple[int, Offset]], row: int) -> Offset:
    """The offset of row ``row`` of ``batch`` (the next message to hand out): the start of the
    block holding it, with the row's ``position`` unless the row starts that block."""
    block_row, start = max((part for part in starts if part[0] <= row), key=lambda part: part[0])
    if row == block_row:
        return start
    return Offset(start.file, start.length, batch.column("position")[row].as_py())


def earliest_offset(store: DurableStore, stream: str, shard: int) -> Offset:
    """The position before the first message of a shard."""
    files = store.list_files(stream, shard)
    return Offset(files[0], 0) if files else Offset()


StartSpec = Union[str, Mapping[str, Any]]

#: The words ``start`` takes besides an offsets dict or its JSON.
START_WORDS = ("earliest", "latest")


def parse_start(value: Any, name: str) -> StartSpec:
    """``start``: ``"earliest"``/``"latest"`` (any case, returned lower-cased) or an offsets dict
    or its JSON (checked, returned as given); AcsOptionError naming ``name`` otherwise."""
    if isinstance(value, str) and value.strip().lower() in START_WORDS:
        return value.strip().lower()
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        nearest = nearest_name(value.strip(), START_WORDS)
        hint = f" (did you mean {nearest!r}?)" if nearest else ""
        raise AcsOptionError(
            f"{name}: {value!r} is not allowed{hint}; use 'earliest', 'latest' or an offsets dict", option=name)
    parse_offsets(value, option=name)
    return value


def _rate(value: Any, name: str) -> int:
    """A read-rate cap in bytes per second: a size (``"8MiB"``) or a number (a float is rounded down)."""
    if isinstance(value, float) and math.isfinite(value):
        value = int(value)
    return bytes_parser(1)(value, name)


_rate.acs_kind = "bytes"  # type: ignore[attr-defined] # describe_options shows a size


@dataclasses.dataclass(frozen=True)
class ConsumerOptions:
    """Validated Consumer settings (see :class:`Consumer` for their meaning), declared with
    :func:`~pyspark_acs.options.option` and built by :meth:`from_values`; ``acs tail``'s flags are
    generated from the same declarations."""

    start: StartSpec = option("start", "earliest", parse=parse_start,
                              doc="where to begin: earliest, latest, or offsets (a dict or its JSON) as "
                                  "offsets() returns; shards missing from them start at the earliest position")
    poll_interval: float = option("poll_interval", DEFAULT_POLL_INTERVAL_S, parse=duration_parser(0.0),
                                  doc="time between polls while there is no new data")
    max_bytes_per_second: Optional[int] = option("max_bytes_per_second", None, parse=_rate, shown="no cap",
                                                 doc="read-rate cap in bytes per second, across every shard")
    max_read_bytes: int = option("max_read_bytes", DEFAULT_MAX_READ_BYTES, parse=bytes_parser(1),
                                 doc="bytes read from one shard in one step at most; a larger block is still "
                                     "read whole")
    fail_on_data_loss: bool = option("fail_on_data_loss", True, parse=parse_bool,
                                     doc="fail when data at the position is gone; otherwise log it and go on at "
                                         "the next available data")
    include_headers: bool = option("include_headers", False, parse=parse_bool,
                                   doc="batches carry the messages' headers (a headers column; acs tail "
                                       "--format json prints them)")
    tier_read_policy: str = option("tier_read_policy", DEFAULT_READ_POLICY, parse=parse_read_policy,
                                   metavar="POLICY", doc="which tier a tiered file is read from: NOT_IN_DISK, NOT_IN_MEM or FORCE")

    @classmethod
    def from_values(cls, **values: Any) -> "ConsumerOptions":
        """Parse the Consumer's keyword arguments (numbers or strings such as ``"10ms"``,
        ``"8MiB"``); ``None`` means the default.

        Raises
        ------
        AcsOptionError
            Naming the option and what it allows.
        """
        return parse_options(cls, values, component="Consumer")


class Consumer:
    """Tail-read one or more streams, in order per shard.

    Parameters
    ----------
    root : str or DurableStore
        Durable store root of this cluster.
    stream : str or sequence of str
        Stream(s) to follow.
    shards : sequence of int, optional
        Shards to follow (default: all shards of each stream).
    start : "earliest", "latest" or offsets
        Where to begin: the first message, the end of what exists now, or an offsets dict
        (or its JSON) as returned by :meth:`offsets`. Shards missing from the dict start at
        the earliest position.
    poll_interval : float or str
        Seconds (or a duration such as ``"10ms"``) between polls while there is no new data
        (default 10 ms).
    max_bytes_per_second : int or str, optional
        Passive cap on the read rate (bytes/s, or a size such as ``"8MiB"``) so a backlog
        cannot melt the store or cache.
    max_read_bytes : int or str
        Bytes read from one shard in one step at most (default 16 MiB): bounds memory when far
        behind; a single larger block is still read whole.
    fail_on_data_loss : bool
        Raise :class:`~pyspark_acs.errors.DataLossError` when data at the position is gone
        (default); otherwise log and skip to the next available data.
    data_cache, metadata_cache : str, optional
        Cache endpoints (``host:port,...``) of this cluster: lengths are polled from the
        metadata cache and bytes read from the data cache, with the durable store as the
        fallback (see :class:`~pyspark_acs.read.cachepath.CachedReadPath`). When not given,
        ``$ACS_DATA_CACHE`` / ``$ACS_METADATA_CACHE`` are used; ``"none"`` turns a cache off.
        The Consumer connects to them when created (at most ``CONNECT_TIMEOUT_S`` per cache
        for replicas that do not answer; they are read around, not an error).
    cache_token : str, optional
        Shared token of token-protected cache servers (default ``$ACS_CACHE_TOKEN``).
    read_path : ReadPath, optional
        Where lengths and bytes come from (default: the caches if given, else the durable
        store alone).
    security : SecuritySettings, optional
        Token and TLS settings of token- or TLS-protected caches
        (:class:`~pyspark_acs.security.SecuritySettings`; default from the environment:
        ``$ACS_CACHE_TOKEN``/``$ACS_TOKEN_FILE``, ``$ACS_TLS_CA`` ...; see docs/security.md).
    include_headers : bool
        Batches carry a ``headers`` column (list of ``{key, value}``; null for messages sent
        without headers), as Spark's Kafka source with ``includeHeaders``.
    tier_read_policy : str, optional
        Which tier a tiered file is read from (``NOT_IN_DISK`` default, ``NOT_IN_MEM``,
        ``FORCE``; see :mod:`pyspark_acs.storage.tier`).
    timing : TailTiming, optional
        When the shards' tailers look again and say they are stuck (default
        :class:`TailTiming`'s values).

    The settings (``start`` to ``tier_read_policy``) are checked once, by
    :class:`ConsumerOptions` (``self.options``); ``None`` for any of them means its default.

    Raises
    ------
    AcsOptionError
        A setting that is not allowed, naming it and what it allows; a stream that does not
        exist.

    Examples
    --------
    >>> c = Consumer("/tmp/acs", "orders", start="earliest")   # doctest: +SKIP
    >>> for batch in c.batches(timeout=1.0):                  # doctest: +SKIP
    ...     print(batch.num_rows, c.offsets())
    """

    def __init__(
        self,
        root: Union[str, DurableStore],
        stream: Union[str, Sequence[str]],
        shards: Optional[Sequence[int]] = None,
        *,
        start: StartSpec = "earliest",
        poll_interval: Union[float, str] = DEFAULT_POLL_INTERVAL_S,
        max_bytes_per_second: Union[int, float, str, None] = None,
        max_read_bytes: Union[int, str] = DEFAULT_MAX_READ_BYTES,
        fail_on_data_loss: bool = True,
        data_cache: Any = None,
        metadata_cache: Any = None,
        cache_token: Optional[str] = None,
        read_path: Optional[ReadPath] = None,
        include_headers: bool = False,
        security: Any = None,
        tier_read_policy: Optional[str] = None,
        timing: TailTiming = TailTiming(),
    ) -> None:
        self.options = opts = ConsumerOptions.from_values(
            start=start, poll_interval=poll_interval, max_bytes_per_second=max_bytes_per_second,
            max_read_bytes=max_read_bytes, fail_on_data_loss=fail_on_data_loss, include_headers=include_headers,
            tier_read_policy=tier_read_policy,
        )
        if read_path is None:
            read_path = open_read_path(root, data_cache=cache_endpoints(data_cache, DATA_CACHE_ENV),
                                       metadata_cache=cache_endpoints(metadata_cache, METADATA_CACHE_ENV),
                                       token=cache_token, push=True, security=security,
                                       tier_read_policy=opts.tier_read_policy)
        self.path: ReadPath = read_path
        self.store = read_path.store
        self.streams = [validate_stream(s) for s in ([stream] if isinstance(stream, str) else stream)]
        connect = getattr(read_path, "connect", None)
        if connect is not None:
            # Connected when created, like a Kafka consumer: the set-up (gRPC's import, a
            # channel per replica) is not charged to the first messages, and many consumer
            # processes started together do not all do it when the first file appears.
            connect(at_latest=opts.start == "latest")
        self.poll_interval = opts.poll_interval
        limiter = RateLimiter(opts.max_bytes_per_second)
        self._tailers: List[ShardTailer] = []
        for name in self.streams:
            count = self.store.stream_shards(name)
            if count is None:
                raise AcsOptionError(f"stream: no stream {name!r} in {self.store.root}", option="stream")
            for shard in shards if shards is not None else range(count):
                validate_shard(shard, count)
                self._tailers.append(
                    ShardTailer(
                        self.path,
                        name,
                        shard,
                        max_read_bytes=opts.max_read_bytes,
                        fail_on_data_loss=opts.fail_on_data_loss,
                        limiter=limiter,
                        include_headers=opts.include_headers,
                        timing=timing,
                    )
                )
        self._closed = False
        self._stats = {"messages": 0, "batches": 0}
        # Batches read from the tailers but not handed out yet: (batch, tailer index, position
        # after it, (row, position) where each of its blocks starts). offsets() reports
        # _reported, the position after what was handed out.
        self._pending: Deque[_Pending] = collections.deque()
        self._reported: List[Offset] = []
        self._last: Optional[_Pending] = None  # the batch handed out last, for offsets(consumed=)
        # The change token taken before a round of batches() that read everything readable (no
        # tailer left bytes unread: ShardTailer.short): if nothing moved since, the next round
        # would find nothing, so the loop waits at once instead (once; after the wait it always
        # looks, so the safety-net timeout still reads). A seek moves no length: it clears it.
        self._settled: Optional[int] = None
        self.seek(opts.start)

    def seek(self, start: StartSpec) -> None:
        """Move every followed shard to ``start`` ("earliest", "latest" or an offsets dict).

        Raises
        ------
        ClosedError
            After :meth:`close` (a seek has a pushing read path follow the files it moves to).
        """
        if self._closed:
            raise ClosedError("consumer is closed")
        start = parse_start(start, "start")
        if start in START_WORDS:
            mode = start
            for t in self._tailers:
                if mode == "earliest":
                    t.seek(earliest_offset(self.store, t.stream, t.shard))
                else:
                    t.seek(latest_offset(self.path, t.stream, t.shard), after_seal=False)
            self._forget_pending()
            return
        offsets: OffsetMap = parse_offsets(start, option="start")
        for t in self._tailers:
            t.seek(offsets.get((t.stream, t.shard)) or earliest_offset(self.store, t.stream, t.shard))
        self._forget_pending()

    def _forget_pending(self) -> None:
        self._pending.clear()
        self._last = None
        self._settled = None
        self._reported = [t.offset for t in self._tailers]

    def offsets(self, consumed: Optional[int] = None) -> Dict[str, Dict[str, Dict[str, Any]]]:
        """The JSON-able position of every followed shard: where a consumer started from it
        goes on, with no message skipped or repeated.

        Parameters
        ----------
        consumed : int, optional
            How many rows of the last batch handed out were processed (default: all of it).
            With fewer, that batch's shard is positioned at its next row: a consumer that
            stops in the middle of a batch resumes at the exact message (the offset then has
            a ``position``, see :mod:`pyspark_acs.format.offsets`).

        Raises
        ------
        AcsOptionError
            ``consumed`` is given while no batch was handed out since the last seek or look
            for more, or is not within ``0 .. rows of that batch``.

        Examples
        --------
        >>> for batch in consumer.batches(timeout=1.0):          # doctest: +SKIP
        ...     done = process_until_full(batch)                  # rows processed
        ...     if done < batch.num_rows:
        ...         save(consumer.offsets(consumed=done))         # resume at row `done`
        ...         break
        """
        reported = list(self._reported)
        if consumed is not None:
            last = self._last
            if last is None:
                raise AcsOptionError(
                    "consumed: no batch was handed out since the consumer last moved or looked for more; "
                    "call offsets(consumed=...) right after the batch it counts", option="consumed")
            batch, i, _, starts = last
            if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= batch.num_rows:
                raise AcsOptionError(
                    f"consumed: {consumed!r} is not a row count of the last batch (0 .. {batch.num_rows})",
                    option="consumed")
            if consumed < batch.num_rows:
                reported[i] = _inside(batch, starts, consumed)
        return format_offsets({(t.stream, t.shard): off for t, off in zip(self._tailers, reported)})

    def _fill(self) -> None:
        """One round over every shard: queue what is new. Call only when nothing is pending."""
        if self._closed:
            raise ClosedError("consumer is closed")
        self._last = None  # looking for more: the batch handed out last counts as processed
        rels = [t.rel for t in self._tailers if t.rel]
        lengths = self.path.lengths(rels) if rels else {}
        for i, t in enumerate(self._tailers):
            got = t.step(lengths.get(t.rel), known=True) if t.rel else t.step()
            starts = t.batch_starts
            if len(got) == 1:  # a caught-up reader's round: one block, nothing to coalesce
                self._pending.append((got[0], i, t.offset, ((0, starts[0]),)))
                continue
            ends = t.batch_ends
            # the last batch of a round ends where the tailer is (it may have passed a seal)
            tagged = [(batch, (ends[j] if j < len(got) - 1 else t.offset, starts[j], batch.num_rows))
                      for j, batch in enumerate(got)]
            # A backlog (several blocks in one read) is handed out in batches of up to
            # CONSUMER_BATCH_BYTES, each of one file's messages (a batch's ``file`` column
            # holds one value).
            for _, run in itertools.groupby(tagged, key=lambda item: item[1][1].file):
                for batch, tags in coalesce_runs(run, CONSUMER_BATCH_BYTES):
                    row, parts = 0, []
                    for _, start, rows in tags:
                        parts.append((row, start))
                        row += rows
                    self._pending.append((batch, i, tags[-1][0], tuple(parts)))
            if not got:
                self._reported[i] = t.offset

    def _hand_out(self) -> pa.RecordBatch:
        item = self._pending.popleft()
        batch, i, end, _ = self._last = item
        self._reported[i] = end
        self._stats["batches"] += 1
        self._stats["messages"] += batch.num_rows
        return batch

    def poll(self) -> List[pa.RecordBatch]:
        """One round over every shard: return what is new now (possibly nothing)."""
        if self._closed:
            raise ClosedError("consumer is closed")
        self._settled = None  # a look of its own: batches() must not skip its next one
        if not self._pending:
            self._fill()
        return [self._hand_out() for _ in range(len(self._pending))]

    def batches(self, timeout: Optional[float] = None) -> Iterator[pa.RecordBatch]:
        """Yield record batches as data arrives.

        Parameters
        ----------
        timeout : float, optional
            Return after this many seconds without new data; follow forever if None.

        Yields
        ------
        pyarrow.RecordBatch
            Columns ``stream, shard, file, position, timestamp, key, value``; the messages of
            one shard in order. :meth:`offsets` reflects each batch once it is yielded.
        """
        idle_since = time.monotonic()
        token = getattr(self.path, "change_token", lambda: None)
        self._settled = None
        while True:
            if self._closed:
                raise ClosedError("consumer is closed")
            # Taken before looking: a length pushed while this round reads ends the wait below.
            since = token()
            pushed: Optional[bool] = None
            if not self._pending:
                if self._settled is not None and since == self._settled:
                    pushed = self._all_pushed()
                if not pushed:
                    self._fill()
                self._settled = None
            if self._pending:
                if since is not None and not any(t.short for t in self._tailers):
                    self._settled = since
                while self._pending:
                    yield self._hand_out()
                idle_since = time.monotonic()
                continue
            idle = time.monotonic() - idle_since
            if timeout is not None and idle >= timeout:
                return
            wait = getattr(self.path, "wait", None)  # the cached path wakes on new lengths
            if wait is not None:
                if pushed is None:
                    pushed = self._all_pushed()
                seconds = safety_period() if pushed else self._poll_wait()
                seconds = seconds if timeout is None else min(seconds, timeout - idle)
                if since is None:
                    wait(seconds)
                else:
                    wait(seconds, since=since)
            else:
                time.sleep(self._poll_wait())

    def _poll_wait(self) -> float:
        """How long :meth:`batches` waits before its next look when nothing is pushed: the poll
        interval, or, while every shard waits for a file to appear, until the first of them
        lists its folder again (:attr:`TailTiming.listing_backoff_s`): a round in between would look at
        nothing, and many idle consumers waking every poll interval take the CPU their
        producer needs."""
        looks = [t.next_listing for t in self._tailers]
        if not looks or None in looks:
            return self.poll_interval
        return max(self.poll_interval, min(looks) - self._tailers[0].clock())

    def _all_pushed(self) -> bool:
        """Whether every shard follows a file whose length changes are pushed to this process:
        then the loop waits for a wake (at most a drawn :func:`~pyspark_acs.cache.poller.safety_period`,
        :data:`PUSHED_WAIT_S` on average) instead of polling every
        ``poll_interval``. A shard before its first file, or after a seal waiting for the next
        file, needs a listing: it keeps the loop polling."""
        pushed = getattr(self.path, "pushed", None)
        if pushed is None:
            return False
        rels = []
        for t in self._tailers:
            if t.rel is None or t.sealed:
                return False
            rels.append(t.rel)
        return pushed(rels)

    def stats(self) -> Dict[str, int]:
        """Counters: messages and batches returned, and the read path's byte counters."""
        return dict(self._stats, **self.path.stats())

    def close(self) -> None:
        """Close the read path (cache clients, open files); idempotent."""
        if not self._closed:
            self._closed = True
            self.path.close()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
