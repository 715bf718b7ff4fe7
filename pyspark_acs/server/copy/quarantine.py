"""Quarantine: a cluster that comes back after a promotion holding bytes past its cut.

A promotion (:mod:`pyspark_acs.server.copy.promote`) makes a destination B the source of a
stream; a cluster unreachable then (the old source A, which may have gone on writing, or a
destination that was down) still holds its old history. Past the promotion's cut those bytes
are a history that did not happen: copied on or served, they would reach readers as a second
history. The store is append-only, so nothing is cut out of a file; instead, when the
cluster's copy daemon takes the new epoch from its parent's hello
(:meth:`~pyspark_acs.storage.store.DurableStore.create_stream`'s ``on_adopt``):

1. :func:`past_cut` finds, per shard, every file holding bytes the new history does not: from
   the byte where its messages end in the new history (the cut record's ``sealed`` map), or
   all of it for a file the new history lacks;
2. :func:`move_past_cut` writes the shard's record (``_quarantine/epoch-<E>/record.json``)
   and then moves those files into that folder, where no listing of the shard sees them;
3. the stream's ``_stream.json`` gets the records (``quarantined``) together with the new
   epoch, so readers name the range (:func:`~pyspark_acs.read.positions.quarantined_at`);
4. the copy brings the new history's version of each moved file it holds from byte 0.

Run again after a stop between the steps, it ends in the same state: the record is written
before any file moves and is read back, so a file moved before the stop keeps its range.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from pyspark_acs.errors import StaleEpochError
from pyspark_acs.format.names import shard_dir

__all__ = [
    "describe",
    "move_past_cut",
    "past_cut",
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
                    found.append(PastCut(shard, name, int(at["length"]), have, True))
                elif at.get("file") and name > at["file"] and have:
                    found.append(PastCut(shard, name, 0, have, False))
                continue
            if name not in theirs:
                if have:
                    found.append(PastCut(shard, name, 0, have, False))
                continue
            prefix, length = (int(v) for v in theirs[name])
            if have <= prefix:
                continue  # a prefix of the new history's file: the copy goes on from there
            tail = scan_file(local, rel, length=have)
            if tail.sealed and tail.end == prefix and tail.length == length:
                continue  # sealed where the promotion sealed it: the same messages, the same end
            found.append(PastCut(shard, name, prefix, have, True))
    return found


def _read_record(store: Any, rel: str) -> List[Dict[str, Any]]:
    raw = store.read_small(rel)
    if raw is None:
        return []
    try:
        return list(json.loads(raw)["files"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StaleEpochError(f"{store.uri(rel)}: malformed quarantine record ({exc}); move it aside and let the copy "
                              f"daemon quarantine the shard again") from exc


def move_past_cut(store: Any, stream: str, found: List[PastCut], record: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Move the files of ``found`` into their shard's quarantine folder of the promotion
    ``record``'s epoch, each shard's record written first; returns every entry of the
    shards' records (those of an earlier, stopped run included), as ``_stream.json``'s
    ``quarantined`` keeps them: ``shard``, ``file``, ``start``, ``end``, ``kept``, ``epoch``,
    ``source`` (the promotion's new source), ``moved_to`` (relative to the root), ``at``.

    Raises
    ------
    StaleEpochError
        A file past the cut is tiered (sealed and moved to the object store): it cannot be
        moved aside here (naming it).
    """
    epoch = int(record.get("epoch") or 0)
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    by_shard: Dict[int, List[PastCut]] = {}
    for p in found:
        by_shard.setdefault(p.shard, []).append(p)
    shards = sorted(set(by_shard) | _shards_with_records(store, stream, epoch))
    out: List[Dict[str, Any]] = []
    for shard in shards:
        folder = quarantine_dir(stream, shard, epoch)
        rel = f"{folder}/{RECORD_FILE}"
        entries = {e["file"]: e for e in _read_record(store, rel)}
        for p in by_shard.get(shard, []):
            if p.file in entries:
                continue  # moved by a run that stopped; its range stands
            src = f"{shard_dir(stream, shard)}/{p.file}"
            if store.lengths([src]).get(src) is None:
                raise StaleEpochError(
                    f"stream {stream!r}: {store.uri(src)} holds bytes [{p.start}, {p.end}) past the cut of its "
                    f"promotion (epoch {epoch}, source {record.get('source')!r}), but it is tiered to the object "
                    f"store and cannot be moved aside; remove it from the stream's tier and folder by hand")
            entries[p.file] = dict(asdict(p), epoch=epoch, source=record.get("source"), moved_to=f"{folder}/{p.file}",
                                   at=when)
        if not entries:
            continue
        store.make_dirs(folder)
        store.write_small(rel, json.dumps({"files": sorted(entries.values(), key=lambda e: e["file"])}).encode())
        for entry in sorted(entries.values(), key=lambda e: e["file"]):
            src = f"{shard_dir(stream, shard)}/{entry['file']}"
            if store.exists(src) and not store.exists(entry["moved_to"]):
                store.move(src, entry["moved_to"])
            out.append(entry)
    return out


def _shards_with_records(store: Any, stream: str, epoch: int) -> set:
    """Shards of ``stream`` whose quarantine folder of ``epoch`` holds a record already."""
    out = set()
    for name in store.list_dir(stream):
        if name.isdigit() and store.exists(f"{quarantine_dir(stream, int(name), epoch)}/{RECORD_FILE}"):
            out.add(int(name))
    return out


def describe(entries: List[Dict[str, Any]], uri: Any) -> str:
    """The quarantined ranges for a log line or report: ``file bytes [a, b)`` each, naming the
    folder they moved to (``uri``: the store's ``uri``)."""
    return ", ".join(f"shard {e['shard']} {e['file']} bytes [{e['start']}, {e['end']}) (in {uri(e['moved_to'])})"
                     for e in entries)
