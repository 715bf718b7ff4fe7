"""How far a Spark query's checkpoint is behind its streams (Kafka's consumer-group lag).

A Structured Streaming checkpoint keeps, per micro-batch ``N``, the planned end offsets of
every source in ``offsets/N`` and a marker ``commits/N`` once the batch's output is done::

    offsets/N:  v1
                {"batchWatermarkMs": ..., "batchTimestampMs": ..., "conf": {...}}
                <offsets of source 0, one JSON line>      ("-" when the source has none yet)
                <offsets of source 1> ...
    commits/N:  v1
                {"nextBatchWatermarkMs": 0}

The ``acs`` source's offsets are the consumer offsets of :mod:`pyspark_acs.format.offsets`.
The committed position of a query is ``offsets/N`` of the newest ``N`` with a ``commits/N``;
an ``offsets/N+1`` without its commit is a batch running (or cut short by a crash, then run
again from the committed offsets on restart).

The end of a shard and the bytes and messages in between are found by the read side's
header walks (:mod:`pyspark_acs.read.positions`), under its seal rule: a reader never goes
past an unsealed file, so neither does the end counted here.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from pyspark_acs.errors import AcsOptionError
from pyspark_acs.format.offsets import Offset, OffsetMap, parse_offsets
from pyspark_acs.read.positions import BoundaryCache, shard_extent, walk_blocks
from pyspark_acs.read.readpath import ReadPath

__all__ = [
    "checkpoint_lag",
    "read_checkpoint",
]

#: Version line Spark writes first in every offset and commit log entry.
_LOG_VERSION_PREFIX = "v"


class CheckpointOffsets(NamedTuple):
    """The ``acs`` offsets a checkpoint holds.

    Attributes
    ----------
    committed_batch : int or None
        Newest micro-batch whose output is committed (None: no batch committed yet).
    committed : dict
        ``{source index: OffsetMap}`` of that batch: where the query goes on from.
    running_batch : int or None
        A planned batch newer than the committed one (running, or to be run again).
    running : dict
        ``{source index: OffsetMap}`` of the running batch (the offsets it reads up to).
    """

    committed_batch: Optional[int]
    committed: Dict[int, OffsetMap]
    running_batch: Optional[int]
    running: Dict[int, OffsetMap]


class ShardLag(NamedTuple):
    """One shard's distance from a committed offset to the readable end of the shard, and in a
    cluster whose copy has not reached the offset yet (a checkpoint moved here), how far that
    copy is behind it."""

    stream: str
    shard: int
    committed: Offset
    end: Offset
    bytes_behind: int
    messages_behind: int
    #: Bytes of the committed offset's file this cluster's copy still lacks (the whole offset
    #: when the file is not here yet); 0 when the copy holds it.
    copy_behind_bytes: int = 0
    #: Why a reader here waits at the offset (:func:`~pyspark_acs.read.positions.missing_at`).
    waiting: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        """A JSON-able dict (offsets in their JSON form)."""
        return {
            "stream": self.stream, "shard": self.shard, "committed": self.committed.to_json(),
            "end": self.end.to_json(), "bytes_behind": self.bytes_behind, "messages_behind": self.messages_behind,
            "copy_behind_bytes": self.copy_behind_bytes, "waiting": self.waiting,
        }


def _batch_ids(store: Any, folder: str) -> List[int]:
    """Batch ids of a log folder (numbered files; Spark's ``.N.crc`` and temporary files skipped)."""
    return sorted(int(n) for n in store.list_dir(folder) if n.isdigit())


def _source_offsets(text: str, where: str) -> Dict[int, OffsetMap]:
    """``{source index: OffsetMap}`` of the sources of one ``offsets/N`` entry that are ``acs``
    sources (other sources' lines -- Kafka's, files' -- and ``-`` are skipped)."""
    lines = text.splitlines()
    if len(lines) < 2 or not lines[0].startswith(_LOG_VERSION_PREFIX):
        raise AcsOptionError(f"--checkpoint: {where} is not a Spark offset log entry (expected a 'v1' line, then "
                             f"the batch metadata, then one line per source)", option="--checkpoint")
    found: Dict[int, OffsetMap] = {}
    for index, line in enumerate(lines[2:]):
        line = line.strip()
        if not line or line == "-":
            continue
        try:
            found[index] = parse_offsets(json.loads(line), option=f"{where} source {index}")
        except (ValueError, AcsOptionError):
            continue  # not an acs source
    return found


def read_checkpoint(checkpoint: str) -> CheckpointOffsets:
    """Read the committed (and running) ``acs`` offsets of a Structured Streaming checkpoint.

    Parameters
    ----------
    checkpoint : str
        The query's ``checkpointLocation``: a local folder or a URI pyarrow opens.

    Raises
    ------
    AcsOptionError
        Naming the folder when it does not exist or holds no offset log, or the entry when
        no source of it is an ``acs`` source.
    """
    from pyspark_acs.storage.store import DurableStore

    try:
        store = DurableStore(checkpoint, create=False)
    except AcsOptionError:
        raise AcsOptionError(f"--checkpoint: no checkpoint at {checkpoint!r}: no such folder",
                             option="--checkpoint") from None
    try:
        planned = _batch_ids(store, "offsets")
        if not planned:
            raise AcsOptionError(f"--checkpoint: {store.path('offsets')} holds no offset log entry: is "
                                 f"{checkpoint!r} a Structured Streaming checkpointLocation whose query ran a "
                                 f"batch?", option="--checkpoint")
        done = set(_batch_ids(store, "commits"))
        committed_batch = max((b for b in planned if b in done), default=None)
        running_batch = planned[-1] if planned[-1] != committed_batch else None

        def load(batch: Optional[int]) -> Dict[int, OffsetMap]:
            if batch is None:
                return {}
            data = store.read_small(f"offsets/{batch}")
            if data is None:  # cleaned up by Spark between the listing and the read
                return {}
            return _source_offsets(data.decode("utf-8", "replace"), store.path(f"offsets/{batch}"))

        committed, running = load(committed_batch), load(running_batch)
        if not committed and not running:
            raise AcsOptionError(f"--checkpoint: no source of {store.path(f'offsets/{planned[-1]}')} has acs offsets "
                                 f"({{stream: {{shard: {{file, length}}}}}})", option="--checkpoint")
    finally:
        store.close()
    return CheckpointOffsets(committed_batch, committed, running_batch, running)


def shard_lag(path: ReadPath, stream: str, shard: int, committed: Offset,
              boundaries: Optional[BoundaryCache] = None) -> ShardLag:
    """Bytes and messages from ``committed`` to the readable end of one shard.

    The end is where a reader at ``committed`` can read to now (:meth:`ShardExtent.latest`:
    through sealed files, up to the last complete block of the first unsealed one); bytes
    count seals and block headers too, messages are the block headers' counts. A range with
    no message (only seals an idle query waits before) is no lag: 0 and 0, ending at
    ``committed``.
    """
    boundaries = boundaries or BoundaryCache()
    extent = shard_extent(path, stream, shard, committed)
    found = extent.missing_start(boundaries, path, committed)
    if found is not None and found[0].wait:  # a loss is raised by latest() below
        return ShardLag(stream, shard, committed, committed, 0, 0, committed.length - (found[0].durable or 0),
                        found[0].wait)
    end = extent.latest(boundaries, path, committed,
                        hint=" (a query reading the shard fails there too, unless it reads with failOnDataLoss=false)")
    behind_bytes = behind_rows = 0
    for _, rel, begin, stop in extent.ranges(committed, end):
        if stop <= begin:
            continue
        reached, rows, _, _ = walk_blocks(path, rel, begin, stop)
        behind_bytes += reached - begin
        behind_rows += rows
    if not behind_rows:
        # Nothing but seals and empty files ahead: the source moves past them only with the next
        # message (no empty micro-batch), so a query sitting here is caught up, not 48 bytes behind.
        return ShardLag(stream, shard, committed, committed, 0, 0)
    return ShardLag(stream, shard, committed, end, behind_bytes, behind_rows)


def checkpoint_lag(path: ReadPath, offsets: OffsetMap, streams: Optional[List[str]] = None) -> List[ShardLag]:
    """:func:`shard_lag` of every shard of the streams in ``offsets`` (sorted by stream, shard).

    Shards the store has that ``offsets`` lacks (added since the query's last batch) count from
    the start of the shard, as the source reads them.
    """
    wanted = sorted({s for s, _ in offsets} if streams is None else set(streams))
    rows: List[ShardLag] = []
    boundaries = BoundaryCache()
    for stream in wanted:
        count = path.store.stream_shards(stream)
        shards: List[Tuple[str, int]] = sorted({k for k in offsets if k[0] == stream}
                                               | {(stream, i) for i in range(count or 0)})
        if count is None and not shards:
            raise AcsOptionError(f"stream: no stream {stream!r} in {path.store.root}", option="stream")
        for key in shards:
            rows.append(shard_lag(path, key[0], key[1], offsets.get(key, Offset()), boundaries))
    return rows
