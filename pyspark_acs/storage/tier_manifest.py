"""Tier records: which files of a shard are in the secondary store, and their objects' header indexes."""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

from pyspark_acs.errors import StoreError
from pyspark_acs.format.block import HEADER_SIZE
from pyspark_acs.format.names import shard_dir
from pyspark_acs.storage.store import DurableStore

__all__ = [
    "TierRecord",
    "decode_header_index",
    "encode_header_index",
    "manifest_rel",
    "read_manifest",
    "write_manifest",
]

#: Per-shard file of tier records, in the shard's folder of the hot store.
TIER_MANIFEST_FILE = "_tiered.json"


@dataclass(frozen=True)
class TierRecord:
    """Where a tiered file lives: bytes ``[offset, offset + length)`` of ``object``.

    ``crc32`` is zlib.crc32 of the whole file and ``blocks`` the number of blocks whose body
    checksums were verified in the object; ``mtime`` the hot file's last write (seconds since
    the epoch: retention ages), ``tiered_at`` when the record was written. ``index``: the
    object holding the block headers of the object's files (:func:`encode_header_index`), so
    header walks (planning, timestamp searches) need one request per object, not per block.
    """

    object: str
    offset: int
    length: int
    crc32: int
    blocks: int
    mtime: float
    tiered_at: float
    index: Optional[str] = None

    @classmethod
    def from_json(cls, raw: Dict[str, Any]) -> "TierRecord":
        """A record from its manifest entry."""
        index = raw.get("index")
        return cls(str(raw["object"]), int(raw["offset"]), int(raw["length"]), int(raw["crc32"]),
                   int(raw["blocks"]), float(raw["mtime"]), float(raw["tiered_at"]),
                   None if index is None else str(index))


#: One entry of a header index: the header's offset in the object, then its bytes.
_INDEX_ENTRY = struct.Struct("<Q%ds" % HEADER_SIZE)


def encode_header_index(headers: Iterable[Tuple[int, bytes]]) -> bytes:
    """The header index of an object: ``(offset in the object, HEADER_SIZE header bytes)`` each."""
    return b"".join(_INDEX_ENTRY.pack(at, h) for at, h in headers)


def decode_header_index(data: bytes, where: str = "") -> Dict[int, bytes]:
    """Offset in the object -> header bytes, from :func:`encode_header_index`'s bytes."""
    if len(data) % _INDEX_ENTRY.size:
        raise StoreError(f"{where}: malformed header index ({len(data)} bytes)")
    return {at: h for at, h in _INDEX_ENTRY.iter_unpack(data)}


def manifest_rel(stream: str, shard: int) -> str:
    """The hot-store path of a shard's tier records."""
    return f"{shard_dir(stream, shard)}/{TIER_MANIFEST_FILE}"


def read_manifest(store: DurableStore, stream: str, shard: int) -> Dict[str, TierRecord]:
    """The tier records of a shard: file name -> :class:`TierRecord` (empty when none)."""
    rel = manifest_rel(stream, shard)
    raw = store.read_small(rel)
    if raw is None:
        return {}
    try:
        files = json.loads(raw)["files"]
        return {name: TierRecord.from_json(rec) for name, rec in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreError(f"{store.uri(rel)}: malformed tier records: {exc}") from exc


def write_manifest(store: DurableStore, stream: str, shard: int, records: Dict[str, TierRecord]) -> None:
    """Replace a shard's tier records (atomically: written aside, then moved over). Only the
    tier mover holding the stream's tier lease calls it."""
    body = {"format": 1, "files": {name: asdict(rec) for name, rec in sorted(records.items())}}
    store.write_small(manifest_rel(stream, shard), json.dumps(body).encode())
