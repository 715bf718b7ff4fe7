"""Positions in a shard: latest readable offset, offset for a timestamp, backlog, how far
a bounded read may go under a byte or row budget -- and the seal rule.

All of it walks block *headers* only (a 48-byte read per block, or one window read for many
small blocks), through a read path, so it costs little even on large files. Readers that need
the blocks' bytes (the Consumer's tailer, the copy reader) take them with :func:`read_blocks`:
with :func:`~pyspark_acs.format.block.scan_blocks` the one block walk of the read side.

The seal rule lives here, once: a file is finished only at its seal (docs/format.md,
section 6). A walk crosses from one file to the next only after passing the first file's
seal; a newer file, a listing, an age or a timeout never finishes a file. A reader stuck at a
block its crashed writer never finished (a torn block) passes it only through the recovery
seal that the next writer appended (:func:`skip_void`). What an unsealed file followed by a
later file means depends on the cluster (:func:`unfinished_file`): damage in the stream's
source cluster, a copy still coming in a destination.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from pyspark_acs.errors import CorruptFileError, DataLossError
from pyspark_acs.format.block import (HEADER_SIZE, RECOVERY_SEAL_SIZE, BlockHeader, find_recovery_seal,
                                      parse_header, scan_blocks)
from pyspark_acs.format.names import shard_dir
from pyspark_acs.format.offsets import Offset
from pyspark_acs.read.readpath import ReadPath
from pyspark_acs.storage.tier import retention_floor

__all__ = [
    "BoundaryCache",
    "ShardExtent",
    "advance",
    "block_end",
    "carries_messages",
    "ends_with_seal",
    "latest_offset",
    "offset_for_timestamp",
    "read_blocks",
    "seal_behind",
    "shard_extent",
    "skip_void",
    "unfinished_file",
    "walk_blocks",
]

log = logging.getLogger(__name__)

#: Bytes read at once while walking headers of small blocks.
WALK_WINDOW_BYTES = 256 * 1024
#: Files whose last block boundary the driver remembers.
MAX_KNOWN_FILES = 4096


def _read_now(path: ReadPath, rel: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` without waiting: asked with ``postpone=False``, a cached read path
    neither postpones durable reads for a lagging cache (Algorithm 1) nor waits for a live feed
    to push bytes the cache holds (those it reads from the cache, not the store); a path that
    stops short all the same gets the rest straight from the durable store (which may itself
    be shorter)."""
    data = path.read(rel, start, end, postpone=False)
    if len(data) < end - start:
        data += path.store.read(rel, start + len(data), end)
    return data


class BlockRead(NamedTuple):
    """What :func:`read_blocks` found."""

    #: The bytes read from the start.
    data: bytes
    #: ``(offset in data, header)`` of each complete block in them, a seal included.
    blocks: List[Tuple[int, BlockHeader]]
    #: When there is no complete block because the bytes at the start are no valid header,
    #: that error (the caller decides: a torn block passed through its recovery seal with
    #: :func:`skip_void`, or real corruption).
    error: Optional[CorruptFileError]
    #: The read path returned fewer bytes than asked: it postponed them (Algorithm 1) or waits
    #: for a push. No sign of a torn block -- the bytes come once the path reads them --, so
    #: a reader must not search them for a recovery seal (that would read them from the store
    #: early, every round).
    short: bool


def read_blocks(
    path: ReadPath, rel: str, start: int, limit: int, max_bytes: int, *, postpone: bool = True
) -> BlockRead:
    """The complete blocks of ``rel`` from ``start`` (a block boundary) below ``limit``, up
    to and including the first seal: nothing after a seal is read (a deposed writer's late
    append lands there, e.g. one stopped holding its append lock and passed by its
    successor's recovery seal).

    Reads at most ``max_bytes`` -- or, when the first block is larger, that block whole once
    it is all readable. ``postpone`` is passed to the read path (Algorithm 1).
    """
    kw = {} if postpone else {"postpone": False}
    asked = min(limit, start + max_bytes) - start
    data = path.read(rel, start, start + asked, **kw)
    uri = path.store.uri(rel)
    blocks: List[Tuple[int, BlockHeader]] = []
    try:
        for item in scan_blocks(data, path=uri, base=start):
            blocks.append(item)
            if item[1].sealed:
                break
    except CorruptFileError as exc:
        if not blocks:
            return BlockRead(data, [], exc, len(data) < asked)
    if not blocks and len(data) >= HEADER_SIZE:
        header = parse_header(data, 0, path=uri, position=start)  # valid: scan_blocks parsed it
        if start + header.size <= limit and len(data) < header.size:
            asked = header.size
            data = path.read(rel, start, start + header.size, **kw)  # one block larger than max_bytes
            if len(data) >= header.size:
                blocks = [(0, header)]
    return BlockRead(data, blocks, None, len(data) < asked)


def skip_void(path: ReadPath, rel: str, at: int, length: int) -> Optional[int]:
    """Past a torn block: the position after the recovery seal that voids ``[at, seal)``.

    ``at`` is where the last complete block of ``rel`` ends and a block its crashed writer
    never finished begins; a writer that took the shard over sealed the file after it with
    ``void_from = at``. Returns ``None`` while no such seal is within ``[at, length)``.
    """
    if length - at < HEADER_SIZE:
        return None
    data = _read_now(path, rel, at, length)
    found = find_recovery_seal(data, at, base=at, path=path.store.uri(rel))
    return None if found is None else at + found[0] + found[1].size


def block_end(path: ReadPath, rel: str, at: int) -> int:
    """Where the block at ``at`` (a block boundary of ``rel``) ends, by its header.

    Raises
    ------
    CorruptFileError
        No valid block header is at ``at`` (naming the file and byte).
    """
    data = _read_now(path, rel, at, at + HEADER_SIZE)
    return at + parse_header(data, 0, path=path.store.uri(rel), position=at).size


def seal_behind(path: ReadPath, rel: str, at: int, *, start: int = 0) -> Optional[int]:
    """The size of the seal that ends at ``at`` (a plain one, or a recovery seal with its
    8-byte body), ``None`` if the file is not sealed there.

    Proven by walking block headers from ``start`` (a block boundary: 0, or one the caller
    knows) up to ``at``, never by parsing the bytes just before ``at`` alone: a message may end
    in bytes shaped exactly like a seal (a user may send them), and a reader that took those for
    the seal would leave an unsealed file and skip the rest of it.
    """
    if at < HEADER_SIZE or start > at:
        return None
    end, _, _, sealed = walk_blocks(path, rel, start, at)
    if not (sealed and end == at):
        return None
    return _seal_size(path, rel, at)


def _seal_size(path: ReadPath, rel: str, at: int) -> Optional[int]:
    """The size of the seal a walk proved to end at ``at``: its last 48 or 56 bytes."""
    begin = max(0, at - RECOVERY_SEAL_SIZE)
    return _seal_size_in(_read_now(path, rel, begin, at), begin, at)


def _seal_size_in(tail: bytes, begin: int, at: int) -> Optional[int]:
    """The size of a seal (48 or 56 bytes) that ``tail`` (the file's bytes ``[begin, at)``)
    ends with, if it ends with one; None otherwise."""
    for size in (HEADER_SIZE, RECOVERY_SEAL_SIZE):
        if at - begin < size or len(tail) < at - begin:
            continue
        try:
            header = parse_header(tail, len(tail) - size, position=at - size)
        except CorruptFileError:
            continue
        if header is not None and header.sealed and header.size == size:
            return size
    return None


def ends_with_seal(path: ReadPath, rel: str, at: int, *, start: int = 0) -> bool:
    """Whether ``rel`` is sealed exactly at ``at`` (a position saved right after a seal is at
    the end of a finished file); proven by a header walk from ``start``, see :func:`seal_behind`."""
    return seal_behind(path, rel, at, start=start) is not None


def walk_blocks(
    path: ReadPath,
    rel: str,
    start: int,
    stop: int,
    *,
    max_bytes: Optional[int] = None,
    max_rows: Optional[int] = None,
    stop_before: Optional[Callable[[BlockHeader], bool]] = None,
    first_read: int = WALK_WINDOW_BYTES,
) -> Tuple[int, int, int, bool]:
    """Walk whole blocks of ``rel`` from ``start`` (a block boundary) towards ``stop``.

    Stops before a block that would end past ``stop`` or exceed the budgets, before a block
    for which ``stop_before(header)`` is true, and after a seal; the first block is always
    taken when it fits ``stop`` (and ``stop_before`` lets it), so a read always makes
    progress. A torn block followed by its recovery seal is passed as one (void) block.

    Returns
    -------
    (end, rows, blocks, sealed) : the block boundary reached, messages and blocks passed, and
    whether the walk ended by passing the file's seal.
    """
    at, rows, blocks = start, 0, 0
    uri = path.store.uri(rel)
    window = max(HEADER_SIZE, first_read)
    # The last block passed by its header alone: (start, end, rows and blocks before it). A
    # torn block whose claimed size ends inside its recovery seal looks whole by its header;
    # the bytes after it are then no block, and the seal starts before that claimed end and
    # ends after it (a seal inside the block's own bytes is a message's, not a seal).
    last: Optional[Tuple[int, int, int, int]] = None

    def torn_last() -> Optional[Tuple[int, int, int, bool]]:
        """The walk's end when the last block passed is torn and its recovery seal straddles
        the block's claimed end (at most 2 x 56 bytes read)."""
        if last is None:
            return None
        begin, claimed, before_rows, before_blocks = last
        lo = max(begin, claimed - RECOVERY_SEAL_SIZE)  # find_recovery_seal looks from lo + 1
        near = _read_now(path, rel, lo, min(stop, claimed + RECOVERY_SEAL_SIZE))
        found = find_recovery_seal(near, begin, base=lo, path=uri)
        if found is None or lo + found[0] >= claimed or lo + found[0] + found[1].size <= claimed:
            return None
        return lo + found[0] + found[1].size, before_rows, before_blocks + 1, True

    while at + HEADER_SIZE <= stop:
        data = _read_now(path, rel, at, min(stop, at + window))
        if len(data) < HEADER_SIZE:
            break
        off = 0
        while off + HEADER_SIZE <= len(data):
            try:
                header = parse_header(data, off, path=uri, position=at + off)
            except CorruptFileError:
                header = None
                passed = torn_last()
                if passed is not None:
                    return passed
            if header is None or (header.size > stop - (at + off) and not header.sealed):
                # Not a complete block: a torn block is passed only with its recovery seal.
                void_end = skip_void(path, rel, at + off, stop)
                if void_end is not None and (max_bytes is None or not blocks or void_end - start <= max_bytes):
                    return void_end, rows, blocks + 1, True
                if header is None and void_end is None:
                    parse_header(data, off, path=uri, position=at + off)  # raise: real corruption
                return at + off, rows, blocks, False
            # Large blocks: read just the next header instead of a window of body bytes.
            window = HEADER_SIZE if header.size > WALK_WINDOW_BYTES // 4 else WALK_WINDOW_BYTES
            end = at + off + header.size
            over_bytes = max_bytes is not None and end - start > max_bytes
            over_rows = max_rows is not None and rows + header.count > max_rows
            if end > stop or (blocks and (over_bytes or over_rows)):
                return at + off, rows, blocks, False
            if stop_before is not None and stop_before(header):
                return at + off, rows, blocks, False
            last = (at + off, at + off + header.size, rows, blocks)
            rows += header.count
            blocks += 1
            off += header.size
            if header.sealed:
                return at + off, rows, blocks, True
        at += off
    if 0 < stop - at < HEADER_SIZE:  # bytes after the last block too few for a header
        passed = torn_last()  # a small read: a walk to a writer's durable length mid-append ends so too
        if passed is not None:
            return passed
    return at, rows, blocks, False


class BoundaryCache:
    """Remembers the last block boundary found per file, and whether it is the file's seal,
    so walks resume there (a sealed file is never walked again); and per file the span of the
    last walk that passed a block holding messages, so :func:`carries_messages` need not read
    those headers again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _known and _with_messages
        self._known: "OrderedDict[str, Tuple[int, bool]]" = OrderedDict()
        self._with_messages: Dict[str, Tuple[int, int]] = {}  # rel -> [start, end) walked past a message
        #: :func:`missing_at`'s answers for starts past what this cluster holds of their file: the
        #: planner asks at every trigger, and a loss proven by a walk from byte 0 is not walked
        #: again, nor logged again.
        self.missing = MissingRules()

    def boundary(self, path: ReadPath, rel: str, length: int, start: int = 0) -> Tuple[int, bool]:
        """The last block boundary at or below ``length`` in ``rel`` walking from ``start`` (a
        block boundary), and whether the file is sealed there."""
        with self._lock:
            known = self._known.get(rel)
        at, sealed = known or (0, False)
        if sealed and at >= start:
            return at, True
        # A boundary remembered here is settled: a walk reached it past a block that is no seal,
        # or the seal check below said no. Only a start taken from elsewhere (a saved offset)
        # is checked, once: the check walks headers from 0 (seal_behind), not at every trigger.
        settled = known is not None and at == start
        if at > length or at < start:
            at = start
        end, rows, _, sealed = walk_blocks(path, rel, at, length, first_read=HEADER_SIZE)
        if not sealed and end == at and at > 0 and at == start and not settled:
            sealed = ends_with_seal(path, rel, at)  # a position saved right after a seal
        with self._lock:
            self._known[rel] = (end, sealed)
            self._known.move_to_end(rel)  # least recently used files go first
            if rows:
                self._with_messages[rel] = (at, end)
            if len(self._known) > MAX_KNOWN_FILES:
                gone, _ = self._known.popitem(last=False)
                self._with_messages.pop(gone, None)
        return end, sealed

    def passed_messages(self, rel: str, start: int, stop: int) -> bool:
        """Whether a walk of ``rel`` within ``[start, stop]`` passed a block holding messages
        (bytes below a readable length never change: what a walk saw there stays true)."""
        with self._lock:
            span = self._with_messages.get(rel)
        return span is not None and start <= span[0] and span[1] <= stop


class ShardExtent:
    """Files of a shard from a start offset on, with their readable lengths."""

    def __init__(self, stream: str, shard: int, files: List[Tuple[str, int]]):
        self.stream = stream
        self.shard = shard
        self.files = files  # [(name, readable length)], oldest first

    def latest(self, boundaries: BoundaryCache, path: ReadPath, start: Offset = Offset(), *,
               fail_on_data_loss: bool = True, hint: str = "") -> Offset:
        """How far a reader at ``start`` can read now: through every sealed file, up to the last
        complete block of the first file that is not sealed (the seal rule), unless
        :func:`unfinished_file` finds that file damaged (the source cluster, a later file
        holding messages): then :class:`~pyspark_acs.errors.DataLossError` (with ``hint``
        added), or with ``fail_on_data_loss=False`` a warning and on through the later file.

        Raises
        ------
        DataLossError
            An unsealed file is damaged and ``fail_on_data_loss`` is set.
        """
        at = start
        names = [name for name, _ in self.files]
        skip_to = ""  # after a damaged file: the later file readers go on with
        found = self.missing_start(boundaries, path, start)
        if found is not None:
            missing, new = found
            if missing.wait:
                return start
            if fail_on_data_loss:
                raise missing.error(hint)
            later = [name for name in names if name > start.file]
            if new:
                log.warning("%s; continuing from file %s", missing.error().args[0],
                            later[0] if later else "(none yet)")
            if not later:
                return start
            skip_to = later[0]
            start = Offset(later[0], 0)
        for name, length in self.files:
            if name < start.file or name < skip_to:
                continue
            rel = f"{shard_dir(self.stream, self.shard)}/{name}"
            begin = start.length if name == start.file else 0
            end, sealed = boundaries.boundary(path, rel, length, begin)
            at = Offset(name, end)
            if sealed:
                continue
            found = unfinished_file(path, self.stream, self.shard, name, end, names)
            if found is None or found.wait:
                return at
            if fail_on_data_loss:
                raise found.error(hint)
            log.warning("%s; continuing from file %s", found.error().args[0], found.later)
            skip_to = found.later
        return at

    def missing_start(self, boundaries: BoundaryCache, path: ReadPath,
                      start: Offset) -> Optional[Tuple["Missing", bool]]:
        """:func:`missing_at` for a ``start`` past what this cluster reads of its file (through
        ``boundaries.missing``: with whether it was worked out just now), or None when the
        bytes before it are here (a cache that lags while the store holds them included)."""
        if not start.file or dict(self.files).get(start.file, -1) >= start.length:
            return None
        durable = path.durable_length(f"{shard_dir(self.stream, self.shard)}/{start.file}")
        if durable is not None and durable >= start.length:
            return None
        return boundaries.missing.get(path, self.stream, self.shard, start.file, start.length, durable)

    def ranges(self, start: Offset, end: Offset) -> Iterator[Tuple[str, str, int, int]]:
        """``(file, rel, begin, stop)`` of each file's bytes between two offsets, oldest first:
        from ``start.length`` in the first file, up to ``end.length`` in the last, whole readable
        lengths in between."""
        for name, length in self.files:
            if name < start.file or name > end.file:
                continue
            rel = f"{shard_dir(self.stream, self.shard)}/{name}"
            begin = start.length if name == start.file else 0
            stop = end.length if name == end.file else length
            yield name, rel, begin, stop

    def backlog(self, start: Offset) -> int:
        """Bytes readable after ``start``."""
        total = 0
        for name, length in self.files:
            if name < start.file:
                continue
            total += max(0, length - (start.length if name == start.file else 0))
        return total


def shard_extent(path: ReadPath, stream: str, shard: int, start: Offset) -> ShardExtent:
    """The files at or after ``start.file`` and their readable lengths (one batched call)."""
    files = [f for f in path.store.list_files(stream, shard) if f >= start.file]
    rels = [f"{shard_dir(stream, shard)}/{f}" for f in files]
    lengths = path.lengths(rels) if rels else {}
    return ShardExtent(stream, shard, [(f, lengths.get(r) or 0) for f, r in zip(files, rels)])


def advance(
    path: ReadPath,
    extent: ShardExtent,
    start: Offset,
    latest: Offset,
    *,
    max_bytes: Optional[int] = None,
    max_rows: Optional[int] = None,
) -> Offset:
    """The furthest offset from ``start`` towards ``latest`` within the budgets (at least one
    block when there is one)."""
    if max_bytes is None and max_rows is None:
        return latest
    at = start
    used_bytes = used_rows = 0
    for name, rel, begin, stop in extent.ranges(start, latest):
        end, rows, blocks, _ = walk_blocks(
            path, rel, begin, stop,
            max_bytes=None if max_bytes is None else max(max_bytes - used_bytes, 0),
            max_rows=None if max_rows is None else max(max_rows - used_rows, 0),
        )
        if blocks == 0 and (used_bytes or used_rows):
            return at  # the budget is spent
        used_bytes += end - begin
        used_rows += rows
        at = Offset(name, end)
        if end < stop:
            if name < latest.file and not walk_blocks(path, rel, end, stop)[2]:
                continue  # no block follows in a file `latest` went past: a damaged file skipped
            return at
        if (max_bytes is not None and used_bytes >= max_bytes) or (max_rows is not None and used_rows >= max_rows):
            return at
    return at


class Unfinished(NamedTuple):
    """An unsealed file of a shard at whose last complete block a reader stops, while a later
    file of the shard holds messages (:func:`unfinished_file`)."""

    stream: str
    shard: int
    #: The unsealed file (base name) and where its last complete block ends.
    file: str
    at: int
    #: The file's length in the durable store (None: it is gone).
    durable: Optional[int]
    #: The first later file of the shard (holding messages, in a source cluster).
    later: str
    #: Why a reader waits there instead (None: the file is damaged): the file's copy is still
    #: coming (a destination), or the file is empty (a deposed writer's stray, sealed by its
    #: successor's next claim).
    wait: Optional[str]

    def describe(self) -> str:
        """What the reader found, naming the file and the byte range."""
        size = "is gone from the store" if self.durable is None else f"is {self.durable} bytes long"
        torn = "" if self.durable is None or self.durable <= self.at else \
            f" (bytes [{self.at}, {self.durable}) are no complete block)"
        return (f"stream {self.stream!r} shard {self.shard}: file {self.file} has no seal: its last complete "
                f"block ends at byte {self.at} and it {size}{torn}, while the later file {self.later} "
                f"holds messages")

    def error(self, hint: str = "") -> DataLossError:
        """The data loss this is in a source cluster: the file's bytes from ``at`` on are lost."""
        return DataLossError(
            f"data loss in {self.describe()}; in the stream's source cluster a writer seals a file "
            f"before it starts the next one, and a writer that takes a shard over seals its "
            f"predecessor's file first, so {self.file} was truncated or damaged after it was written: "
            f"its messages from byte {self.at} on are lost{hint}",
            stream=self.stream, shard=self.shard, file=self.file, start=self.at, end=-1,
        )


def unfinished_file(path: ReadPath, stream: str, shard: int, name: str, at: int,
                    files: Sequence[str]) -> Optional[Unfinished]:
    """The finality rule for an unsealed file ``name`` whose readable bytes end at ``at`` (its
    last complete block), given the shard's ``files`` (a listing taken before this call).

    Returns None while the file may still go on: no later file (after strays: empty files a
    deposed writer created and sealed unused hold no message), or the durable copy holds
    complete blocks or the seal past ``at``. Otherwise an :class:`Unfinished`:

    - in the stream's **source cluster** (``_stream.json`` without ``copied_from``) the file
      is damaged (:meth:`Unfinished.error`): writers seal before they roll, a take-over seals
      its predecessor first, and a deposed writer's stray never holds a message;
    - in a **destination** (``copied_from``) files are copied side by side, so the later file
      proves nothing: the reader waits for the copy (``wait`` says so);
    - an **empty** file is a deposed writer's stray (it named its file before its successor's
      and died before sealing it), sealed at the successor's next claim: the reader waits
      (``wait`` says so). A file truncated to nothing looks the same and waits too.

    The listing must come first: a seal is durable before the next file is created, so a
    length read after the listing that showed the later file shows the seal, if there is one.
    """
    d = shard_dir(stream, shard)
    later = [f for f in files if f > name]
    if not later:
        return None
    rel = f"{d}/{name}"
    meta = path.store.stream_meta(stream) or {}
    copy = bool(meta.get("copied_from"))
    if copy:
        return Unfinished(stream, shard, name, at, None, later[0],
                          f"the later file {later[0]} exists and this cluster keeps a copy of the stream: the "
                          f"rest of {name} is still being copied")
    after = next((f for f in later if _holds_message(path, f"{d}/{f}", 0, path.durable_length(f"{d}/{f}") or 0)),
                 None)
    if after is None:
        return None
    durable = path.durable_length(rel)
    if durable == 0:
        return Unfinished(stream, shard, name, at, durable, after,
                          f"{name} is empty while the later file {after} holds messages: a deposed writer's "
                          f"stray that its successor seals at its next claim (or a file truncated to nothing)")
    if durable is not None and durable > at:
        _, _, blocks, sealed = walk_blocks(path, rel, at, durable)
        if blocks or sealed:
            return None  # readable blocks (or the seal) are there: the reader goes on
    return Unfinished(stream, shard, name, at, durable, after, None)


#: How long an answer of :func:`missing_at` stands while the file's local length does (seconds):
#: the stream may stop being a copy meanwhile (its ``copied_from`` removed at a failover).
MISSING_RECHECK_S = 1.0


#: How often a tailer looks at its stream's quarantine record (seconds): the copy daemon waits
#: four times this long between recording the ranges and moving the files.
QUARANTINE_CHECK_S = 0.5


def quarantine_entries(meta: Optional[Dict[str, Any]], shard: Optional[int] = None, name: Optional[str] = None,
                       moved_only: bool = False) -> List[Dict[str, Any]]:
    """The quarantine entries of the stream's metadata: those moved (``quarantined``) and,
    unless ``moved_only``, those of a quarantine under way (``quarantine``'s ``files``;
    :mod:`pyspark_acs.server.copy.quarantine`); only of ``shard`` and file ``name`` when given."""
    meta = meta or {}
    found = list(meta.get("quarantined") or ())
    if not moved_only:
        found += list((meta.get("quarantine") or {}).get("files") or ())
    return [e for e in found if (shard is None or int(e.get("shard", -1)) == shard)
            and (name is None or e.get("file") == name)]


def quarantined_at(meta: Optional[Dict[str, Any]], shard: int, name: str, at: int,
                   holds: Optional[Callable[[Dict[str, Any]], bool]] = None) -> Optional[Tuple[Dict[str, Any], bool]]:
    """Whether the position (``name``, byte ``at``) lies in a quarantined range: ``(entry,
    True)`` when it does (past the byte where the new history leaves the file, ``start``, or
    inside a file the new history lacks, ``kept`` false), naming the range that makes it a loss;
    ``(entry, False)`` when it is at byte 0 of a file the new history lacks and the reader
    passed no quarantined message before it (it read the new history alone: it goes on with the
    new history's next file; ``holds(entry)`` says whether a range holds a message, default: any
    byte); None when it is not (a position at or before ``start`` of a kept file reads on there
    once the copy brings the file again)."""
    mine = quarantine_entries(meta, shard)
    for entry in mine:
        if entry.get("file") != name:
            continue
        if entry.get("kept", True):
            # The new history's end of the file (after its seal) is a position of the new file.
            lost = at > int(entry["start"]) and at != int(entry.get("new_end") or -1)
            return (entry, True) if lost else None
        if at > 0:
            return entry, True
        # At byte 0: a range passed before it (files are read in order) is what was read past the cut.
        passed = [e for e in mine if e.get("file", "") < name and int(e["end"]) > int(e["start"])
                  and (holds is None or holds(e))]
        return (max(passed, key=lambda e: e["file"]), True) if passed else (entry, False)
    return None


def quarantine_error(stream: str, entry: Dict[str, Any], name: str, at: int, uri: str,
                     hint: str = "") -> DataLossError:
    """The data loss of a reader positioned at byte ``at`` of file ``name``, inside (or past)
    the quarantined range ``entry``."""
    where = "of it" if entry["file"] == name else f"of file {entry['file']}, which the reader passed to get there,"
    return DataLossError(
        f"data loss in stream {stream!r} shard {entry['shard']}: the position is at byte {at} of file {name}, but "
        f"bytes [{entry['start']}, {entry['end']}) {where} are a history that did not happen: this cluster wrote "
        f"or copied them after the cut of promotion epoch {entry.get('epoch')} (new source {entry.get('source')!r}) "
        f"and moved them aside to {uri} when it took the new history; the messages read from them were never part "
        f"of the stream's history{hint}",
        stream=stream, shard=int(entry["shard"]), file=entry["file"], start=int(entry["start"]), end=int(entry["end"]),
    )


class Missing(NamedTuple):
    """A position past the end of its file as this cluster holds it (:func:`missing_at`)."""

    stream: str
    shard: int
    #: The position's file (base name) and byte.
    file: str
    at: int
    #: The file's length in this cluster's durable store (None: no such file here).
    durable: Optional[int]
    #: Why the reader waits instead (None: the bytes are lost): this cluster keeps a copy of
    #: the stream and the copy has not brought them yet.
    wait: Optional[str]
    #: What makes it a loss (None while waiting).
    why: Optional[str] = None
    #: The quarantine record the position lies in (:func:`quarantined_at`) and the URI of the
    #: file it was moved to: the loss is then that record's range.
    quarantine: Optional[Tuple[Dict[str, Any], str]] = None
    #: The file to go on with (the position is at byte 0 of a file the new history lacks, and
    #: the reader read nothing past the cut: the new history's next file).
    skip_to: Optional[str] = None

    def error(self, hint: str = "") -> DataLossError:
        """The data loss: bytes ``[durable, at)`` of the file (all of it when it is gone), or the
        quarantined range the position lies in."""
        if self.quarantine is not None:
            return quarantine_error(self.stream, self.quarantine[0], self.file, self.at, self.quarantine[1], hint)
        what = "is gone from the store" if self.durable is None else f"is only {self.durable} bytes long"
        return DataLossError(
            f"data loss in stream {self.stream!r} shard {self.shard}: file {self.file} {what}, but the position "
            f"is at byte {self.at}{': ' + self.why if self.why else ''}{hint}",
            stream=self.stream, shard=self.shard, file=self.file,
            start=0 if self.durable is None else self.durable, end=self.at if self.durable is not None else -1,
        )


class MissingRules:
    """:func:`missing_at`'s answers, each kept per (file, position, local length) for
    :data:`MISSING_RECHECK_S`: a reader that waits at such a position asks at every round, and
    the answer changes only with the length or the stream's metadata (its ``copied_from``
    removed at a failover), which the recheck catches. Thread-safe.

    Parameters
    ----------
    clock : callable
        Monotonic seconds (``time.monotonic``) the recheck is measured on.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()  # guards _known
        self._known: "OrderedDict[Tuple[str, str, int, int, Optional[int]], Tuple[Missing, float]]" = OrderedDict()

    def get(self, path: ReadPath, stream: str, shard: int, name: str, at: int,
            durable: Optional[int]) -> Tuple[Missing, bool]:
        """The answer, and whether it was worked out just now (not kept from before)."""
        key = (stream, name, shard, at, durable)
        now = self.clock()
        with self._lock:
            known = self._known.get(key)
        if known is not None and now - known[1] < MISSING_RECHECK_S:
            return known[0], False
        found = missing_at(path, stream, shard, name, at, durable)
        with self._lock:
            self._known[key] = (found, now)
            self._known.move_to_end(key)
            while len(self._known) > MAX_KNOWN_FILES:
                self._known.popitem(last=False)
        return found, True


def missing_at(path: ReadPath, stream: str, shard: int, name: str, at: int, durable: Optional[int]) -> Missing:
    """The rule for a position (``name``, byte ``at``) past what this cluster's durable store
    holds of its file (``durable`` < ``at``, or None: no such file), the same for every reader.

    An offset is ``(file, bytes)`` and files are byte-identical in every cluster, so a position
    taken in one cluster names the same message in every other; what differs is how far each
    cluster holds it:

    - in the stream's **source cluster** (``_stream.json`` without ``copied_from``) the file
      was written here: shorter than a position taken on it, or gone, it lost those bytes;
    - in a **destination** (``copied_from``) the copy may simply not have brought them yet (a
      reader moved here from a cluster whose copy is ahead): it waits, unless the bytes can no
      longer come: retention deleted the file (the shard's retention floor), or a later file
      of the shard is here (a destination creates a shard's files in order, so the copy of
      this one was removed), or the local copy ends in its seal before ``at`` (the position
      lies past the file's end in this history: a reader arriving from another one).
    """
    meta = path.store.stream_meta(stream) or {}
    source = meta.get("copied_from")
    base = Missing(stream, shard, name, at, durable, None)
    from pyspark_acs.read.readpath import DurableReadPath

    moved_files = DurableReadPath(path.store)
    found = quarantined_at(meta, shard, name, at, lambda e: _holds_message(moved_files, e["moved_to"],
                                                                           int(e["start"]), int(e["end"])))
    if found is not None and found[1]:
        entry = found[0]
        return base._replace(why="quarantined", quarantine=(entry, path.store.uri(entry["moved_to"])))
    if found is not None:
        listing = path.store.list_files(stream, shard)
        before = [f for f in listing if f < name]
        after = [f for f in listing if f > before[-1]] if before else listing
        after = [f for f in after if f != name]
        if after:
            return base._replace(skip_to=after[0])
        return base._replace(wait=f"this cluster moved its {name} aside (the new history of promotion epoch "
                                  f"{found[0].get('epoch')} has no such file) and the copy from {source} has not "
                                  f"brought the new history's next file yet")
    moved = next(iter(quarantine_entries(meta, shard, name)), None)
    if moved is not None and (durable or 0) < at:
        return base._replace(wait=f"this cluster moved its {name} aside (bytes past the cut of promotion epoch "
                                  f"{moved.get('epoch')}) and the copy from {source} brings the new history's "
                                  f"{name} from byte 0")
    if not source:
        return base._replace(why="in the stream's source cluster a file never shrinks, so those bytes were removed")
    rel = f"{shard_dir(stream, shard)}/{name}"
    if durable is None:
        floor = retention_floor(path.store, stream, shard)
        if floor is not None and floor >= name:
            return base._replace(why=f"retention deleted the files up to {floor}")
        later = [f for f in path.store.list_files(stream, shard) if f > name]
        # The length again after the listing: the copy may have created the file, then the
        # later one, since the caller read it (a later file proves the removal only of a file
        # still missing after the listing that shows it).
        if later and path.durable_length(rel) is None:
            return base._replace(why=f"this cluster holds the later file {later[0]}, and a copy creates a shard's "
                                     f"files in order, so {name} was removed here")
        if later:
            return base._replace(wait=f"this cluster keeps a copy of the stream from {source}, whose copy of "
                                      f"{name} has just begun")
        return base._replace(wait=f"this cluster keeps a copy of the stream from {source} and has no copy of "
                                  f"{name} yet")
    if _may_end_with_seal(path, rel, durable) and ends_with_seal(path, rel, durable):
        return base._replace(why=f"its copy here ends in its seal at byte {durable}: bytes [{durable}, {at}) are "
                                 f"no part of this cluster's history (a position taken in another one)")
    return base._replace(wait=f"this cluster keeps a copy of the stream from {source}, and its copy of {name} "
                              f"holds {durable} bytes so far")


def _holds_message(path: ReadPath, rel: str, begin: int, stop: int) -> bool:
    """Whether a block holding messages lies in ``[begin, stop)`` of ``rel``: a header walk that
    stops at the first one (usually the first header read)."""
    found: List[BlockHeader] = []

    def first_message(header: BlockHeader) -> bool:
        if header.count:
            found.append(header)
        return bool(header.count)

    walk_blocks(path, rel, begin, stop, stop_before=first_message, first_read=HEADER_SIZE)
    return bool(found)


def carries_messages(path: ReadPath, extent: ShardExtent, start: Offset, end: Offset,
                     boundaries: Optional[BoundaryCache] = None) -> bool:
    """Whether any message lies between two offsets of a shard.

    A header walk that stops at the first block holding a message (usually the first header
    read), so a range of nothing but seals, voided torn bytes and empty files -- what a reader
    passes going from one file to the next -- is told apart from one with data. With
    ``boundaries`` (whose walk found ``end``, as a streaming planner's did just before), a
    file its last walk saw messages in within the range is not read again.
    """
    if end <= start:
        return False
    for _, rel, begin, stop in extent.ranges(start, end):
        if boundaries is not None and boundaries.passed_messages(rel, begin, stop):
            return True
        # Usually the first header answers: read it alone, not a window of the bytes after it
        # (a streaming planner asks this at every trigger, right after the boundary walk).
        if _holds_message(path, rel, begin, stop):
            return True
    return False


def offset_for_timestamp(path: ReadPath, stream: str, shard: int, ts_us: int, *, ending: bool = False) -> Offset:
    """The offset of the first block whose last message is at or after ``ts_us`` (µs).

    Messages of that block before ``ts_us`` are returned too (offsets are block boundaries).
    With ``ending`` (an end of a range, ``endingTimestamp``), the first block whose *first*
    message is at or after ``ts_us``: every message stamped before it lies before the offset
    (the reader drops those of the last block stamped at or after it).
    The search follows the seal rule: it goes on to the next file only past a file's seal, so
    with no such block it stops after the last complete block of the first unsealed file (a
    reader starting there gets everything written later), or at the end of the shard.
    """
    files = path.store.list_files(stream, shard)
    rels = [f"{shard_dir(stream, shard)}/{f}" for f in files]
    lengths = path.lengths(rels) if rels else {}
    last = Offset()
    for name, rel in zip(files, rels):
        end, _, _, sealed = walk_blocks(
            path, rel, 0, lengths.get(rel) or 0,
            stop_before=lambda h: bool(h.count) and (h.first_ts if ending else h.last_ts) >= ts_us,
        )
        last = Offset(name, end)
        if not sealed:
            return last  # at the block found, or waiting at an unsealed file's end
    return last


def latest_offset(path: ReadPath, stream: str, shard: int) -> Offset:
    """The position after the last complete block of a shard's newest file (before its seal,
    so a reader starting there reads the seal and follows the next file at once). Never a
    position right after a seal: a reader starting there need not look for one behind it.

    Where the feed's replica holds the boundary a writer marked for the file
    (:meth:`CachedReadPath.join_latest`), or else the read path knows a length a writer
    published for it (:meth:`CachedReadPath.published_boundary`: every length a Producer or
    sink publishes is a block boundary, docs/format.md), that is the position, unless the
    bytes just before it have the shape of a seal; only then, on paths without published
    lengths and in copies
    (the copy daemon's lengths may end inside a block), are the file's headers walked from its
    start. A reader joining a running stream thus reads a few bytes, not the
    whole newest file (which, read by many readers joining at once, overloaded the caches).
    Headers are read through ``path`` up to the readable length it reports, so a cache copy
    that is ahead of the durable copy is walked in the cache.
    """
    files = path.store.list_files(stream, shard)
    if not files:
        return Offset()
    rel = f"{shard_dir(stream, shard)}/{files[-1]}"
    at = None
    joined = getattr(path, "join_latest", None)
    published = getattr(path, "published_boundary", None)
    # Only a source cluster's lengths: a copy daemon may publish a destination's length inside
    # a block (the end of a torn append it resumes after), so a copy's headers are walked.
    if (joined or published) is not None and not (path.store.stream_meta(stream) or {}).get("copied_from"):
        # First the boundary the feed's replica holds (no lengths asked: a reader of a spike
        # joins with one channel and one call), then the published lengths.
        at = joined(rel, RECOVERY_SEAL_SIZE) if joined is not None else None
        if at is None and published is not None:
            at = published(rel)
    if at is not None and not _may_end_with_seal(path, rel, at):
        return Offset(files[-1], at)
    length = path.lengths([rel])[rel] or 0
    at, _, _, sealed = walk_blocks(path, rel, 0, length)
    if sealed:
        at -= _seal_size(path, rel, at) or 0  # the walk proved the seal
    return Offset(files[-1], at)


def _may_end_with_seal(path: ReadPath, rel: str, at: int) -> bool:
    """Whether the bytes before ``at`` have the shape of a seal (a plain one or a recovery
    seal). A file sealed at ``at`` always has it; bytes without it prove no seal ends there,
    bytes with it prove nothing (a message may end in such bytes: :func:`seal_behind`)."""
    if at < HEADER_SIZE:
        return False
    begin = max(0, at - RECOVERY_SEAL_SIZE)
    # A reader that follows the file by push takes these bytes from the replica's first push
    # (the file is followed from here): under load, a request of their own cost a round trip.
    pushed = getattr(path, "read_pushed", None)
    tail = pushed(rel, begin, at) if pushed is not None else path.read(rel, begin, at, postpone=False)
    if len(tail) < at - begin:
        tail += path.store.read(rel, begin + len(tail), at)
    if len(tail) < at - begin:
        return True  # the bytes are not readable: let the walk decide
    return _seal_size_in(tail, begin, at) is not None
