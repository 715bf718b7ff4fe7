"""Quarantine: a cluster that comes back after a promotion holding bytes past its cut.

A promotion (:mod:`pyspark_acs.server.copy.promote`) makes a destination B the source of a
stream; a cluster unreachable then (the old source A, which may have gone on writing, or a
destination that was down) still holds its old history. Past the promotion's cut those bytes
are a history that did not happen: copied on or served, they would reach readers as a second
history. The store is append-only, so nothing is cut out of a file; instead, before the
cluster's copy daemon takes the new epoch from its parent (``CopyServicer._quarantine``, the
order is the rule):

1. **Fence**: ``_stream.json`` gets ``quarantine`` (the epoch, when): from then on no writer
   starts a file there, and the cluster's own open files are sealed where they end (a writer
   still appending fails its next append, as at a take-over);
2. :func:`past_cuts` finds, per shard and for every promotion this cluster missed, each file
   holding bytes the new history does not: from the byte where its messages end in the new
   history (each record's ``sealed`` map), or all of it for a file the new history lacks;
3. the ranges go into ``quarantine`` (``files``), and the daemon waits ``QUARANTINE_SETTLE_S``:
   readers in the cluster look at the record at least that often
   (:data:`~pyspark_acs.read.positions.QUARANTINE_CHECK_S`), stop at each range's start and
   report a position inside one (:func:`~pyspark_acs.read.positions.quarantined_at`);
4. :func:`move_past_cut` writes each shard's ``_quarantine/epoch-<E>/record.json`` and moves the
   files into that folder, where no listing of the shard sees them; their cache entries go;
5. the epoch is taken, the records kept as ``quarantined``; the copy brings the new history's
   version of each kept file from byte 0.

Run again after a stop between the steps, it ends in the same state: the ranges are in
``_stream.json`` before any file moves, and a moved file keeps its range.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from pyspark_acs.errors import StaleEpochError
from pyspark_acs.format.names import shard_dir

__all__ = [
    "describe",
    "entries",
    "move_past_cut",
    "past_cuts",
]

log = logging.getLogger(__name__)

#: The folder of a shard that quarantined files move into (one folder per epoch in it).
QUARANTINE_DIR = "_quarantine"
#: The record of a shard's quarantine, in its epoch's folder.
RECORD_FILE = "record.json"


@dataclass(frozen=True)
class PastCut:
    """Bytes ``[start, end)`` of a shard's file that are no part of the new history."""

    shard: int
    file: str
    start: int
    end: int
    #: The new history holds the file too (up to ``start`` it is the same): the copy brings
    #: it again from byte 0. False: the new history has no such file.
    kept: bool
    #: The new history's length of the file (its seal's end; 0 when not kept or unknown): a
    #: position there is the new file's end, no part of the range.
    new_end: int = 0


def quarantine_dir(stream: str, shard: int, epoch: int) -> str:
    """The folder (relative to the root) that a shard's files past the cut of ``epoch`` move into."""
    return f"{shard_dir(stream, shard)}/{QUARANTINE_DIR}/epoch-{epoch}"


def past_cut(local: Any, stream: str, shards: int, record: Dict[str, Any]) -> List[PastCut]:
    """Every range of this cluster's files (``local``: a store view with ``list_files``,
    ``lengths``, ``read``, ``uri``; tiered files included) past the cut of the promotion
    ``record``.

    Files up to the record's ``sealed_through`` were sealed everywhere alike before the
    promotion and are not looked at. After it, the record's ``sealed`` map gives, per file the
    new source held, where its messages end and its length: a file holding more is past the
    cut from where its messages end, unless it ends in the same seal (the same messages and
    length: a writer here sealed it where the promotion did). A file the map lacks is not in
    the new history at all. A record without the map (written before it existed) gives only
    the cut file's length: bytes beyond it, and files after the cut file, are past the cut.
    """
    from pyspark_acs.write.file import scan_file

    found: List[PastCut] = []
    cut = record.get("cut") or {}
    through = record.get("sealed_through") or {}
    sealed = record.get("sealed")
    for shard in range(shards):
        folder = shard_dir(stream, shard)
        after = through.get(str(shard), "")
        names = [n for n in local.list_files(stream, shard) if n > after]
        lengths = local.lengths([f"{folder}/{n}" for n in names]) if names else {}
        at = cut.get(str(shard)) or {}
        theirs: Optional[Dict[str, List[int]]] = None if sealed is None else sealed.get(str(shard)) or {}
        for name in names:
            rel = f"{folder}/{name}"
            have = lengths.get(rel) or 0
            if theirs is None:  # an older record: the cut's length alone
                if name == at.get("file") and have > int(at["length"]):
                    found.append(PastCut(shard, name, int(at["length"]), have, True, int(at["length"])))
                elif at.get("file") and name > at["file"]:
                    found.append(PastCut(shard, name, 0, have, False))
                continue
            if name not in theirs:
                # Empty too: a deposed writer's new file, which it would go on appending to.
                found.append(PastCut(shard, name, 0, have, False))
                continue
            prefix, length = (int(v) for v in theirs[name])
            if have <= prefix:
                continue  # a prefix of the new history's file: the copy goes on from there
            tail = scan_file(local, rel, length=have)
            if tail.sealed and tail.end == prefix and tail.length == length:
                continue  # sealed where the promotion sealed it: the same messages, the same end
            found.append(PastCut(shard, name, prefix, have, True, length))
    return found


def past_cuts(local: Any, stream: str, shards: int, records: List[Dict[str, Any]]) -> List[PastCut]:
    """:func:`past_cut` of every promotion record in ``records`` (those a returning cluster
    missed, oldest first), merged per file: the range from the smallest start, kept only if
    every record that names the file keeps it."""
    merged: Dict[tuple, PastCut] = {}
    for record in records:
        for p in past_cut(local, stream, shards, record):
            key = (p.shard, p.file)
            old = merged.get(key)
            if old is None:
                merged[key] = p
            else:
                first = old if old.start <= p.start else p
                merged[key] = PastCut(p.shard, p.file, first.start, max(old.end, p.end), old.kept and p.kept,
                                      first.new_end if old.kept and p.kept else 0)
    return [merged[k] for k in sorted(merged)]


def entries(found: List[PastCut], stream: str, record: Dict[str, Any], when: str) -> List[Dict[str, Any]]:
    """The quarantine entries of ``found`` for the newest missed promotion ``record``, as
    ``_stream.json`` keeps them: ``shard``, ``file``, ``start``, ``end``, ``kept``, ``epoch``,
    ``source`` (the new source), ``moved_to`` (relative to the root), ``at``."""
    epoch = int(record.get("epoch") or 0)
    return [dict(asdict(p), epoch=epoch, source=record.get("source"),
                 moved_to=f"{quarantine_dir(stream, p.shard, epoch)}/{p.file}", at=when) for p in found]


def move_past_cut(store: Any, stream: str, moving: List[Dict[str, Any]]) -> None:
    """Move the files of the quarantine entries ``moving`` (:func:`entries`) into their
    ``moved_to``, each shard's ``record.json`` (beside them) written first. A file moved
    before (a run that stopped) is left; one the store no longer holds hot is refused.

    Raises
    ------
    StaleEpochError
        A file past the cut is tiered (sealed and moved to the object store): it cannot be
        moved aside here (naming it). Checked for every shard before anything moves.
    """
    todo = []
    for entry in moving:
        src = f"{shard_dir(stream, int(entry['shard']))}/{entry['file']}"
        if store.exists(entry["moved_to"]):
            continue  # moved by a run that stopped
        if store.lengths([src]).get(src) is None:
            raise StaleEpochError(
                f"stream {stream!r}: {store.uri(src)} holds bytes [{entry['start']}, {entry['end']}) past the cut of "
                f"promotion epoch {entry['epoch']} (source {entry['source']!r}), but it is not in the hot store "
                f"(tiered to the object store) and cannot be moved aside; remove it from the stream's tier and "
                f"folder by hand")
        todo.append((src, entry))
    for shard in sorted({int(e["shard"]) for e in moving}):
        mine = sorted((e for e in moving if int(e["shard"]) == shard), key=lambda e: e["file"])
        folder = mine[0]["moved_to"].rsplit("/", 1)[0]
        store.make_dirs(folder)
        store.write_small(f"{folder}/{RECORD_FILE}", json.dumps({"files": mine}).encode())
    for src, entry in todo:
        store.move(src, entry["moved_to"])


def describe(entries: List[Dict[str, Any]], uri: Any) -> str:
    """The quarantined ranges for a log line or report: ``file bytes [a, b)`` each, naming the
    folder they moved to (``uri``: the store's ``uri``)."""
    return ", ".join(f"shard {e['shard']} {e['file']} bytes [{e['start']}, {e['end']}) (in {uri(e['moved_to'])})"
                     for e in entries)
