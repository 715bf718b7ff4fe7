"""The sink's marks: where each batch ends in a shard, kept in the shard's own bytes.

After the last piece a batch appends to a shard, the driver appends a mark
(:func:`~pyspark_acs.format.block.encode_mark`) naming the sink and the batch id. Marks are
bytes of the message files, so every copy of a file holds them exactly where the batch
ended, and a promotion's cut (``acs promote``) keeps or drops a mark with the bytes before
it. A promoted cluster therefore holds its sinks' progress without their state files, which
live beside the streams in the old source. The sink reads its state from the marks when its
state file is missing or of another epoch than the stream's (docs/format.md section 7):

- a shard whose last mark is the replayed batch holds all of that batch's rows: nothing is
  appended to it again;
- a shard holding messages of this sink after its last mark holds the first rows of the
  batch that was appending when the old source was lost: the replay's first rows must be
  those (compared by key, value and headers) and only the rest is appended. A replay whose
  rows differ is refused: neither appending nor skipping them would be exactly once.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import pyarrow as pa

from pyspark_acs.datasource.commit_log import Piece, ShardState, SinkState
from pyspark_acs.errors import AcsError, CorruptFileError, InvalidNameError
from pyspark_acs.format.block import (
    BlockHeader,
    body_intact,
    decode_block,
    encode_block,
    mark_body,
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


def mark_payload(sink_id: str, batch: int) -> bytes:
    """A sink mark's payload: ``{"batch": b, "sink": id}`` as compact JSON (the same bytes for the
    same batch, so a resumed append writes the same mark)."""
    return json.dumps({"batch": batch, "sink": sink_id}, sort_keys=True, separators=(",", ":")).encode()


def _parse_payload(payload: bytes) -> Optional[Tuple[str, int]]:
    try:
        raw = json.loads(payload)
        return str(raw["sink"]), int(raw["batch"])
    except (ValueError, KeyError, TypeError):
        return None  # a mark of another writer's form: not this sink's


@dataclass
class ShardMarks:
    """What one shard holds of a sink: its last mark's batch and where the mark ends, and the
    sink's messages after that mark (the first rows of a batch that did not finish there)."""

    last_batch: Optional[int] = None
    end: Optional[ShardState] = None
    #: The sink's message blocks after its last mark, in order: (file uri, byte, decoded rows).
    tail: List[Tuple[str, int, pa.RecordBatch]] = field(default_factory=list)
    #: More than the scan's limit of rows lie after the last mark (not all read).
    over: bool = False

    @property
    def tail_rows(self) -> int:
        return sum(b.num_rows for _, _, b in self.tail)

    def tail_range(self) -> str:
        """Where the tail lies (first and last block), for messages."""
        first, last = self.tail[0], self.tail[-1]
        if first[0] == last[0]:
            return f"{first[0]} from byte {first[1]}"
        return f"{first[0]} from byte {first[1]} to {last[0]}"


@dataclass
class SinkMarks:
    """A sink's marks in every shard of a stream (:func:`read_marks`)."""

    shards: Dict[int, ShardMarks]

    def state(self, epoch: int) -> SinkState:
        """The sink state the marks give: the largest batch marked, each shard's end."""
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


def read_marks(store: DurableStore, stream: str, shards: int, writer_id: str, sink_id: str,
               limits: Mapping[int, int]) -> SinkMarks:
    """Read back, per shard, the sink's last mark and its messages after it, from the files
    its writer id names (newest first, until a file holds one of its marks). A shard's scan
    stops once more than ``limits[shard]`` rows (default 0) lie after the last mark: more than
    the replay could hold."""
    out: Dict[int, ShardMarks] = {}
    for shard in range(shards):
        marks = ShardMarks()
        limit = limits.get(shard, 0)
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
            data = store.read(rel, 0, length)
            blocks = _walk(data, uri)
            last_mark = None
            for i, (at, header) in enumerate(blocks):
                body = mark_body(data, at, header)
                parsed = _parse_payload(body) if body is not None else None
                if parsed is not None and parsed[0] == sink_id:
                    last_mark = i
            after = blocks[last_mark + 1:] if last_mark is not None else blocks
            mine = [(uri, at, decode_block(data, at, path=uri, position=at, headers=True, header=h)[1])
                    for at, h in after if h.count]
            newer = mine + newer
            if last_mark is not None:
                at, header = blocks[last_mark]
                marks.last_batch = _parse_payload(mark_body(data, at, header) or b"")[1]  # type: ignore[index]
                end = at + header.size
                marks.end = ShardState(name, end, header.first_index, sealed=end != length)
                break
            if sum(b.num_rows for _, _, b in newer) > limit:
                marks.over = True
                break
        marks.tail = newer
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
                batch_id: int, staging_dir: str) -> List[Piece]:
    """The pieces of a replayed batch still to append to ``shard``, given what the shard holds
    of the sink (``marks``): none when its last mark is this batch; after the rows the shard
    holds of it already (compared with the replay's first rows; a block split there is encoded
    again into ``staging_dir``); all of them otherwise.

    Raises
    ------
    AcsError
        The shard holds rows of this sink after its last mark that are not the replay's first
        rows (naming the file and byte), or rows after this batch's own mark.
    """
    if marks.last_batch is not None and marks.last_batch == batch_id:
        if marks.tail:
            raise AcsError(
                f"{what}: shard {shard} holds batch {batch_id}'s mark and then {marks.tail_rows} more messages of this "
                f"sink ({marks.tail_range()}): the batch after it was appending, so batch {batch_id} is not the one "
                f"to replay; the query's checkpoint is older than the stream (restore the checkpoint that went with "
                f"it, or give the query a new checkpointLocation or sinkId)")
        return []
    if not marks.tail:
        return list(pieces)
    k = marks.tail_rows
    staged = _staged_rows(store, pieces)
    planned = _rows([b for *_, b in staged])
    held = _rows([b for _, _, b in marks.tail])
    differs = marks.over or planned.num_rows < k or not planned.slice(0, k).equals(held)
    if differs:
        first = next((i for i in range(min(k, planned.num_rows))
                      if not planned.slice(i, 1).equals(held.slice(i, 1))), min(k, planned.num_rows))
        how = ("holds more messages of this sink after its last mark than the replay has rows" if marks.over
               else f"differs from them from message {first} on (the replay has {planned.num_rows} rows for the shard)")
        raise AcsError(
            f"{what}: shard {shard} holds {k} message{'s' if k != 1 else ''} of this sink after its last mark "
            f"({marks.tail_range()}): "
            f"the first rows of batch {batch_id}, appended before the old source was lost; but the replay {how}. "
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
    return out
