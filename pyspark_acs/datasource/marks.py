"""The sink's marks: where each batch begins and ends in a shard, kept in the shard's own bytes.

Before the first piece a batch appends to a shard, and after the last, the driver appends a
mark (:func:`~pyspark_acs.format.block.encode_mark`) naming the sink, the batch id and which
end it is. Marks are bytes of the message files, so every copy of a file holds them exactly
where the batch began and ended, and a promotion's cut (``acs promote``) keeps or drops a
mark with the bytes before it. A promoted cluster therefore holds its sinks' progress without
their state files, which live beside the streams in the old source. The sink reads its state
from the marks when its state file is missing or of another epoch than the stream's
(docs/format.md section 7):

- a shard whose last mark is the replayed batch's end holds all of that batch's rows: nothing
  is appended to it again;
- a shard whose last mark is the replayed batch's beginning holds its first rows (the old
  source was lost while it appended, or the cut fell inside the batch): the replay's first
  rows must be those (compared by key, value and headers) and only the rest is appended,
  then the end. A replay whose rows differ is refused: neither appending nor skipping them
  would be exactly once;
- rows after an earlier batch's beginning are that batch's, whose rest did not reach this
  cluster: they stand, and the replay is appended after them; rows after no mark at all
  (files of a version before marks) are no batch's to complete.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import pyarrow as pa

from pyspark_acs.datasource.commit_log import Piece, ShardState, SinkState
from pyspark_acs.errors import AcsError, CorruptFileError, InvalidNameError
from pyspark_acs.format.block import (
    HEADER_SIZE,
    MARK_MAGIC,
    BlockHeader,
    body_intact,
    decode_block,
    encode_block,
    mark_body,
    parse_header,
    scan_blocks,
)
from pyspark_acs.format.names import parse_file_name, shard_dir
from pyspark_acs.storage.store import DurableStore

__all__ = [
    "SinkMarks",
    "mark_payload",
    "read_marks",
    "trim_replay",
]

log = logging.getLogger(__name__)

#: The columns a replay's rows are compared on (timestamps are the attempt's own).
COMPARED = ("key", "value", "headers")


#: A mark's ``at``: where in its batch it stands.
BEGIN, END = "begin", "end"


def mark_payload(sink_id: str, batch: int, at: str = END) -> bytes:
    """A sink mark's payload: ``{"at": "begin"|"end", "batch": b, "sink": id}`` as compact JSON
    (the same bytes for the same batch, so a resumed append writes the same mark)."""
    return json.dumps({"at": at, "batch": batch, "sink": sink_id}, sort_keys=True, separators=(",", ":")).encode()


def _parse_payload(payload: bytes) -> Optional[Tuple[str, int, str]]:
    try:
        raw = json.loads(payload)
        at = str(raw["at"])
        return (str(raw["sink"]), int(raw["batch"]), at) if at in (BEGIN, END) else None
    except (ValueError, KeyError, TypeError):
        return None  # a mark of another writer's form: not this sink's


@dataclass
class ShardMarks:
    """What one shard holds of a sink: its last mark (batch, begin or end) and where it ends,
    and the sink's messages after it when it is a beginning (the first rows of a batch that
    did not finish there)."""

    last_batch: Optional[int] = None
    #: Whether the last mark is a batch's beginning (its rows follow), not its end.
    begun: bool = False
    end: Optional[ShardState] = None
    #: The sink's message blocks after its last mark, in order: (file uri, byte, decoded rows).
    tail: List[Tuple[str, int, pa.RecordBatch]] = field(default_factory=list)
    #: More than the scan's limit of rows lie after the last mark found, or no mark was found
    #: that far back: the rows there are no batch's to complete.
    over: bool = False

    @property
    def tail_rows(self) -> int:
        return sum(b.num_rows for _, _, b in self.tail)

    #: Where the last mark ends: (file uri, byte), when it was found by its headers alone.
    after: Optional[Tuple[str, int]] = None

    def tail_range(self) -> str:
        """Where the tail lies (first and last block), for messages."""
        if self.after is not None:
            return f"{self.after[0]} from byte {self.after[1]} on"
        first, last = self.tail[0], self.tail[-1]
        if first[0] == last[0]:
            return f"{first[0]} from byte {first[1]}"
        return f"{first[0]} from byte {first[1]} to {last[0]}"


@dataclass
class SinkMarks:
    """A sink's marks in every shard of a stream (:func:`read_marks`)."""

    shards: Dict[int, ShardMarks]

    def state(self, epoch: int) -> SinkState:
        """The sink state the marks give: the largest batch marked (begun or ended; Spark
        replays no batch before one that began), each shard's end."""
        batches = [m.last_batch for m in self.shards.values() if m.last_batch is not None]
        ends = {s: m.end for s, m in self.shards.items() if m.end is not None}
        return SinkState(max(batches) if batches else None, ends, None, epoch)


def _walk(data: bytes, uri: str) -> List[Tuple[int, BlockHeader]]:
    """The whole blocks of a file's bytes up to its seal; a torn tail (voided by a recovery
    seal, or still landing) ends the walk."""
    out: List[Tuple[int, BlockHeader]] = []
    try:
        for at, header in scan_blocks(data, path=uri):
            if header.sealed or not body_intact(data, at, header):
                break  # the end, or a torn block whose claimed size runs into the recovery seal
            out.append((at, header))
    except CorruptFileError:
        pass  # bytes that are not a block: the torn tail a recovery seal voids
    return out


#: How far back (bytes of the sink's files per shard) the marks are looked for by their
#: headers alone, past the rows the replay could complete: a batch that rolled over files
#: has its beginning in an older file than its last rows.
MARK_SEARCH_BYTES = 1 << 30
#: Bytes of block headers read at a time when marks are looked for by headers.
_HEADER_WINDOW = 64 * 1024


def _last_mark_by_headers(store: DurableStore, rel: str, length: int, sink_id: str
                          ) -> Optional[Tuple[int, BlockHeader, Tuple[str, int, str]]]:
    """The sink's last mark in ``rel``, found by walking block headers (bodies read only for
    blocks without messages): (byte, header, payload)."""
    uri = store.uri(rel)
    found = None
    at, buf_start, buf = 0, 0, b""
    while length - at >= HEADER_SIZE:
        if at + HEADER_SIZE > buf_start + len(buf):
            buf_start, buf = at, store.read(rel, at, min(length, at + _HEADER_WINDOW))
        try:
            header = parse_header(buf, at - buf_start, path=uri, position=at)
        except CorruptFileError:
            break  # a torn tail
        if header.sealed or at + header.size > length:
            break
        if not header.count and not header.flags and header.body_len >= len(MARK_MAGIC):
            block = store.read(rel, at, at + header.size)
            body = mark_body(block, 0, header) if body_intact(block, 0, header) else None
            parsed = _parse_payload(body) if body is not None else None
            if parsed is not None and parsed[0] == sink_id:
                found = (at, header, parsed)
        at += header.size
    return found


def read_marks(store: DurableStore, stream: str, shards: Iterable[int], writer_id: str, sink_id: str,
               limits: Mapping[int, int]) -> SinkMarks:
    """Read back, per shard of ``shards``, the sink's last mark and its messages after it, from
    the files its writer id names (newest first, until a file holds one of its marks). Once
    more than ``limits[shard]`` rows (default 0) lie after where it has looked (more than the
    replay could complete), the rows are no longer decoded and the mark is looked for by block
    headers, up to :data:`MARK_SEARCH_BYTES` further back."""
    out: Dict[int, ShardMarks] = {}
    for shard in shards:
        marks = ShardMarks()
        limit = limits.get(shard, 0)
        searched = 0
        newer: List[Tuple[str, int, pa.RecordBatch]] = []  # tail blocks of files newer than this one
        folder = shard_dir(stream, shard)
        for name in reversed(store.list_files(stream, shard)):
            try:
                if parse_file_name(name).writer_id != writer_id:
                    continue
            except InvalidNameError:
                continue
            rel = f"{folder}/{name}"
            uri = store.uri(rel)
            length = store.lengths([rel]).get(rel) or 0
            if marks.over:  # past what the replay could complete: the mark by headers alone
                searched += length
                found = _last_mark_by_headers(store, rel, length, sink_id)
                if found is not None:
                    at, header, (_, batch, where) = found
                    marks.last_batch, marks.begun = batch, where == BEGIN
                    end = at + header.size
                    marks.end = ShardState(name, end, header.first_index, sealed=True)
                    marks.tail = newer  # the rows decoded before the search: a part of them
                    marks.after = (uri, end)
                    break
                if searched > MARK_SEARCH_BYTES:
                    log.warning("%s: no mark of sink %s in the last %d bytes of its files in shard %d; the rows "
                                "there are no batch's to complete", uri, sink_id, searched, shard)
                    break
                continue
            data = store.read(rel, 0, length)
            blocks = _walk(data, uri)
            last = None  # (block number, parsed payload) of the sink's last mark in the file
            for i, (at, header) in enumerate(blocks):
                body = mark_body(data, at, header)
                parsed = _parse_payload(body) if body is not None else None
                if parsed is not None and parsed[0] == sink_id:
                    last = (i, parsed)
            after = blocks[last[0] + 1:] if last is not None else blocks
            if last is None and sum(h.count for _, h in after) + sum(b.num_rows for *_, b in newer) > limit:
                marks.over = True  # no mark that far back: nothing decoded past it
                searched = 0
                continue
            newer = [(uri, at, decode_block(data, at, path=uri, position=at, headers=True, header=h)[1])
                     for at, h in after if h.count] + newer
            if last is not None:
                i, (_, batch, where) = last
                at, header = blocks[i]
                marks.last_batch, marks.begun = batch, where == BEGIN
                end = at + header.size
                marks.end = ShardState(name, end, header.first_index, sealed=end != length)
                if marks.begun:
                    marks.tail = newer
                    marks.over = marks.tail_rows > limit
                elif newer:
                    log.warning("%s: %d messages of sink %s follow its mark of batch %d's end without a "
                                "beginning; they are no batch's to complete", uri, sum(b.num_rows for *_, b in newer),
                                sink_id, batch)
                break
        out[shard] = marks
    return SinkMarks(out)


def _staged_rows(store: DurableStore, pieces: Sequence[Piece]) -> List[Tuple[int, int, int, pa.RecordBatch]]:
    """The staged blocks of ``pieces`` in order: (piece number, byte in the staged file, block
    size, decoded rows)."""
    out = []
    for number, piece in enumerate(pieces):
        uri = store.uri(piece.path)
        data = store.read(piece.path, 0, piece.length)
        for at, header in scan_blocks(data, path=uri, final=True):
            if at < piece.skip:
                continue
            out.append((number, at, header.size,
                        decode_block(data, at, path=uri, position=at, headers=True, header=header)[1]))
    return out


def _rows(batches: Sequence[pa.RecordBatch]) -> pa.Table:
    if not batches:
        return pa.table({})
    return pa.Table.from_batches(list(batches)).select(list(COMPARED)).combine_chunks()


def trim_replay(store: DurableStore, what: str, shard: int, pieces: Sequence[Piece], marks: ShardMarks,
                batch_id: int, staging_dir: str) -> Tuple[List[Piece], bool]:
    """What of a replayed batch still goes to ``shard``, given what the shard holds of the sink
    (``marks``): ``(pieces, continued)``. ``continued``: the shard holds the batch's beginning,
    so the pieces (perhaps none) continue it and end it, with no new beginning. Nothing when
    the shard holds the batch's end; after the rows it holds of it already (compared with the
    replay's first rows; a block split there is encoded again into ``staging_dir``); all of them,
    begun anew, otherwise.

    Raises
    ------
    AcsError
        The shard holds rows of this batch that are not the replay's first rows (naming the
        file and byte).
    """
    if marks.last_batch != batch_id:
        if marks.begun and marks.tail:  # an earlier batch's first rows: the rest never came here
            log.warning("%s: shard %d holds the first %d rows of batch %s (%s) and not the rest, which did not reach "
                        "this cluster before the promotion; batch %d follows them", what, shard, marks.tail_rows,
                        marks.last_batch, marks.tail_range(), batch_id)
        return list(pieces), False
    if not marks.begun:
        return [], False  # the shard holds the batch's end: all of it
    k = marks.tail_rows
    if k == 0 and not marks.over:
        return list(pieces), True
    staged = _staged_rows(store, pieces)
    planned = _rows([b for *_, b in staged])
    held = _rows([b for _, _, b in marks.tail])
    differs = marks.over or planned.num_rows < k or not planned.slice(0, k).equals(held)
    if differs:
        first = next((i for i in range(min(k, planned.num_rows))
                      if not planned.slice(i, 1).equals(held.slice(i, 1))), min(k, planned.num_rows))
        how = (f"has only {planned.num_rows} rows for the shard" if marks.over or planned.num_rows < k
               else f"differs from them from message {first} on (the replay has {planned.num_rows} rows for the shard)")
        held_n = (f"more than {planned.num_rows} messages" if marks.after is not None  # not all read
                  else f"{k} message{'s' if k != 1 else ''}")
        raise AcsError(
            f"{what}: shard {shard} holds {held_n} of batch {batch_id} after its beginning "
            f"({marks.tail_range()}), appended before the old source was lost; but the replay {how}. "
            f"The batch did not replay the rows it ran with (a source that is not replayable, or a query that is "
            f"not deterministic), so neither appending them again nor skipping them is exactly once, and nothing "
            f"of the batch is written. To go on from the next batch, give the query a new checkpointLocation or "
            f"sinkId")
    out: List[Piece] = []
    seen = 0
    for number, piece in enumerate(pieces):
        blocks = [(at, rows) for n, at, _, rows in staged if n == number]
        total = sum(rows.num_rows for _, rows in blocks)
        if seen >= k or seen + total <= k:
            if seen >= k:
                out.append(piece)
            seen += total
            continue
        for i, (at, rows) in enumerate(blocks):  # the held rows end in this piece
            if seen >= k:
                rest_rows = sum(r.num_rows for _, r in blocks[i:])
                out.append(Piece(piece.path, piece.length, rest_rows, at))
                seen += rest_rows
                break
            if seen + rows.num_rows > k:
                # ... inside this block (the replay blocked its rows otherwise): the block's
                # rest is encoded again, from its own rows.
                rest = rows.slice(k - seen)
                hs = rest.column("headers")
                data = encode_block(rest.column("value"), rest.column("key"), rest.column("timestamp"),
                                    headers=hs if hs.null_count < len(hs) else None)
                rel = f"{staging_dir}/{shard:05d}-{number}-{at}.rest.blk"
                store.write_small(rel, data)
                out.append(Piece(rel, len(data), rest.num_rows))
            seen += rows.num_rows
    log.warning("%s: shard %d held the first %d rows of batch %d (%s); the replay appends the %d after them",
                what, shard, k, batch_id, marks.tail_range(), planned.num_rows - k)
    return out, True
