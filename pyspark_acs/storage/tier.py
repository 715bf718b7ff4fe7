"""Tiered storage: sealed message files in a secondary (object) store, readable by the same offsets.

The hot store (a :class:`~pyspark_acs.storage.store.DurableStore`, appendable) holds the files
being written and recent history; the *secondary store* (any ``pyarrow.fs`` filesystem: S3,
GCS, a local folder) holds sealed files the tier mover (:mod:`pyspark_acs.server.tier`) moved
there. This module holds the rules both sides share, once:

- **Stream settings** (:class:`TierSettings`): the secondary store's URI and the retention of
  both tiers, kept in the stream's metadata file (``<stream>/_stream.json``, key ``"tier"``).
- **Tier records** (:class:`TierRecord`): which files are tiered, kept per shard in
  ``<stream>/<shard>/_tiered.json`` of the hot store. A record is written only after its
  object was uploaded and verified (data before index); the hot copy may be deleted only once
  the record exists. An object no record names is never read (a partial or abandoned upload).
- **Which tier holds file X and how to open it** (:class:`TieredStore`): the one place every
  reader asks. :func:`pyspark_acs.read.readpath.open_read_path` wraps the hot store in it, so
  the Consumer, the Spark source planner and tasks and the copy reader all read a file by its
  ``(file, length)`` offset wherever it lives, under one read policy (the RocketMQ
  tiered-storage article's, docs/overview.md section 9):

  ``NOT_IN_DISK`` (default)
      caches, then the hot store; the secondary store only for files no longer in the hot store.
  ``NOT_IN_MEM``
      caches, then the secondary store for every tiered file (its hot copy is not read: the
      hot store's disks are kept for the files being written); the hot store for the rest.
  ``FORCE``
      no caches; every tiered file from the secondary store (for tests and checks).

- **Pre-reading** (:class:`PrereadWindow`): reads from the secondary store fetch a window
  ahead; the window grows additively by the reader's request size while read-ahead is used,
  and halves when read-ahead bytes are dropped unread (the RocketMQ article's AIMD, after TCP
  Tahoe).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.fs as pafs

from pyspark_acs.errors import AcsOptionError, StoreError, StoreFileNotFoundError, TierUploadError
from pyspark_acs.format.block import HEADER_SIZE
from pyspark_acs.format.names import shard_dir
from pyspark_acs.storage.store import _translate as _store_translate, open_filesystem
from pyspark_acs.storage.store import STREAM_META_FILE, DurableStore

__all__ = [
    "DEFAULT_READ_POLICY",
    "MANIFEST_SETTLE_S",
    "TierRecord",
    "TierSettings",
    "TierStore",
    "configure_tier",
    "encode_header_index",
    "parse_read_policy",
    "raise_retention_floor",
    "read_manifest",
    "retention_floor",
    "retention_gap",
    "stream_tier_settings",
    "tier_summary",
    "tiered_store",
    "write_manifest",
]

log = logging.getLogger(__name__)

#: Per-shard file of tier records, in the shard's folder of the hot store.
TIER_MANIFEST_FILE = "_tiered.json"
#: Per-shard file naming the newest file secondary retention deleted (``{"deleted_through":
#: name}``), in the shard's folder of the hot store: readers tell a gap from the next file.
RETENTION_FLOOR_FILE = "_retained.json"
#: The read policies of the RocketMQ tiered-storage article (``DISABLE``: a stream without a
#: tier).
READ_POLICIES = ("NOT_IN_DISK", "NOT_IN_MEM", "FORCE")
#: Hot store first; the secondary store for files gone from it.
DEFAULT_READ_POLICY = "NOT_IN_DISK"
#: Smallest pre-reading window (bytes): where a reader starts, and the floor of halving.
PREREAD_MIN_BYTES = 256 * 1024
#: Largest pre-reading window (bytes): bounds the memory one reader holds per shard.
PREREAD_MAX_BYTES = 32 * 1024 * 1024
#: Read-ahead bytes not read within this many seconds are dropped (and the window halves).
PREREAD_TTL_S = 30.0
#: Read-ahead buffers a reader keeps (one per file it reads; least recently used dropped first).
PREREAD_MAX_BUFFERS = 16
#: Open input files a reader keeps on the secondary store.
MAX_OPEN_OBJECTS = 64
#: How long a reader reuses a shard's tier records before reading them again (seconds);
#: a file it cannot find in either tier makes it read them at once.
MANIFEST_TTL_S = 1.0
#: A manifest changed less than this long ago (seconds, by its modification time) is read
#: again on every fresh look; an older one only when its (mtime, size) changed.
MANIFEST_SETTLE_S = 2.0
#: Header indexes a reader keeps in memory (one per object; 56 bytes per block).
MAX_HEADER_INDEXES = 256
#: Files a reader remembers as gone from the hot store (forgotten all at once past it).
MAX_GONE_FILES = 100_000
#: How long a reader reuses a stream's tier settings (seconds).
SETTINGS_TTL_S = 5.0


def parse_read_policy(value: Any, name: str = "tierReadPolicy") -> str:
    """``value`` as one of :data:`READ_POLICIES` (case-insensitive); AcsOptionError naming ``name``."""
    text = str(value).strip().upper()
    if text not in READ_POLICIES:
        raise AcsOptionError(f"{name}: {value!r} is not allowed; use one of: {', '.join(READ_POLICIES)}",
                             option=name)
    return text


# -- stream settings ---------------------------------------------------------------------


@dataclass(frozen=True)
class TierSettings:
    """Tiering and retention settings of one stream (in its metadata file, key ``"tier"``).

    Parameters
    ----------
    uri : str, optional
        The secondary store (``s3://bucket/prefix?endpoint_override=...``, ``gs://bucket/prefix``,
        a local folder). ``None``: the stream is not tiered and nothing is deleted.
    hot_retention_s : float, optional
        Hot copies of tiered files older than this (seconds since their last write) are deleted.
    hot_retention_bytes : int, optional
        The stream's hot files are kept below this many bytes by deleting the oldest tiered hot
        copies. A hot file not yet verified in the secondary store is never deleted, so the
        hot store may exceed it while uploads lag.
    secondary_retention_s : float, optional
        Files older than this are deleted from both tiers. ``None``: kept forever.
    owner : str, optional
        A random id of this stream in this hot store, part of every object name the mover
        writes: the mover sweeps only its own objects, so two clusters (or streams) pointed at
        the same bucket prefix never delete each other's objects.
    """

    uri: Optional[str] = None
    hot_retention_s: Optional[float] = None
    hot_retention_bytes: Optional[int] = None
    secondary_retention_s: Optional[float] = None
    owner: Optional[str] = None

    @property
    def enabled(self) -> bool:
        """Whether the stream has a secondary store."""
        return bool(self.uri)

    def to_json(self) -> Dict[str, Any]:
        """The settings as the plain dict kept in the stream metadata."""
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any, where: str = "stream metadata") -> "TierSettings":
        """Settings from the stream metadata's ``"tier"`` value (``None``: not tiered)."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise StoreError(f"{where}: malformed tier settings {raw!r}")
        known = {k: raw.get(k) for k in ("uri", "hot_retention_s", "hot_retention_bytes", "secondary_retention_s",
                                          "owner")}
        return cls(**known)

    def describe(self) -> str:
        """A one-line summary for ``acs ls`` / ``acs status``."""
        if not self.enabled:
            return "tier: none"
        uri = _public_uri(self.uri)

        def age(v: Optional[float]) -> str:
            return "forever" if v is None else f"{v:g}s"

        hot_bytes = "unbounded" if self.hot_retention_bytes is None else f"{self.hot_retention_bytes}B"
        return (f"tier: {uri} hot: {age(self.hot_retention_s)}/{hot_bytes} "
                f"secondary: {age(self.secondary_retention_s)}")


def _no_stream(store: DurableStore, stream: str) -> AcsOptionError:
    return AcsOptionError(f"stream: no stream {stream!r} in {store.root}", option="stream")


def _stream_meta(store: DurableStore, stream: str) -> Dict[str, Any]:
    meta = store.stream_meta(stream)
    if meta is None:
        raise _no_stream(store, stream)
    return meta


def stream_tier_settings(store: DurableStore, stream: str) -> TierSettings:
    """The tier settings of ``stream`` (not tiered when its metadata has none)."""
    meta = _stream_meta(store, stream)
    return TierSettings.from_json(meta.get("tier"), store.uri(f"{stream}/{STREAM_META_FILE}"))


def configure_tier(
    root: "str | DurableStore",
    stream: str,
    uri: Optional[str],
    *,
    hot_retention_s: Optional[float] = None,
    hot_retention_bytes: Optional[int] = None,
    secondary_retention_s: Optional[float] = None,
) -> TierSettings:
    """Set (or with ``uri=None`` clear) the secondary store and retention of an existing stream.

    The secondary store is opened once to check the URI. Returns the settings written.
    ``acs tier`` (:mod:`pyspark_acs.cli.tier`) calls it.

    Raises
    ------
    AcsOptionError
        No such stream, a URI pyarrow cannot open, or a negative retention (names the option);
        turning tiering off, or pointing the stream at another location, while files of the
        stream are recorded in its secondary store (their only copy may be there: they would
        become unreadable).
    """
    from pyspark_acs.storage.store import open_store

    store = open_store(root)
    for name, value in (("hot_retention_s", hot_retention_s), ("hot_retention_bytes", hot_retention_bytes),
                        ("secondary_retention_s", secondary_retention_s)):
        if value is not None and value < 0:
            raise AcsOptionError(f"{name}: must be >= 0 or None (keep forever), got {value!r}", option=name)
    if uri is not None:
        TierStore(uri).check()  # raises naming the URI when it cannot be reached
    _stream_meta(store, stream)  # no such stream: say so before taking its lock
    written: List[TierSettings] = []

    def change(meta: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        if meta is None:  # deleted since the check above
            raise _no_stream(store, stream)
        current = TierSettings.from_json(meta.get("tier"))
        if current.enabled and (uri is None or _public_uri(uri) != _public_uri(current.uri)):
            # Tier records name objects of the current location: readers find them nowhere else.
            recorded = sum(len(read_manifest(store, stream, shard)) for shard in range(meta["shards"]))
            if recorded:
                what = "turning tiering off" if uri is None else f"moving it to {_public_uri(uri)}"
                raise AcsOptionError(
                    f"uri: {recorded} files of stream {stream!r} are recorded in its secondary store "
                    f"{_public_uri(current.uri)} (their only copy may be there); {what} would leave them "
                    f"unreadable. Keep the secondary store (a retention of None stops deletions), or let "
                    f"secondary_retention_s delete them first", option="uri")
        # The owner id outlives reconfiguration: objects written under it stay this stream's.
        owner = current.owner or secrets.token_hex(4)
        settings = TierSettings(uri, hot_retention_s, hot_retention_bytes, secondary_retention_s, owner)
        written.append(settings)
        meta["tier"] = settings.to_json() if settings.enabled else None
        return meta

    # Under the stream's lock: a copy daemon marking the stream a copy at the same moment keeps
    # its field, and this keeps ours.
    store.update_stream_meta(stream, change)
    return written[-1]


# -- tier records --------------------------------------------------------------------------


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


def _floor_rel(stream: str, shard: int) -> str:
    return f"{shard_dir(stream, shard)}/{RETENTION_FLOOR_FILE}"


def raise_retention_floor(store: DurableStore, stream: str, shard: int, name: str) -> None:
    """Record that files up to ``name`` left the shard by retention (the floor only rises).
    The mover calls it before it deletes them, so a reader that finds a file gone also finds
    the floor; a copy writer carries a source's floor to its cluster (server/copy/writer.py)."""
    floor = retention_floor(store, stream, shard)
    if floor is None or name > floor:
        store.write_small(_floor_rel(stream, shard), json.dumps({"deleted_through": name}).encode())


def retention_floor(store: DurableStore, stream: str, shard: int) -> Optional[str]:
    """The newest file of the shard that retention deleted (None: none)."""
    rel = _floor_rel(stream, shard)
    raw = store.read_small(rel)
    if raw is None:
        return None
    try:
        floor = json.loads(raw)["deleted_through"]
        if not isinstance(floor, str):
            raise TypeError(f"deleted_through is {type(floor).__name__}, not a file name")
        return floor
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{store.uri(rel)}: malformed retention floor: {exc}") from exc


def retention_gap(store: DurableStore, stream: str, shard: int, after: str) -> Optional[str]:
    """The newest file retention deleted after file ``after``, or None.

    The one test of a gap in a shard's history: a reader that finished ``after`` and steps to
    the next file it lists has lost every file retention deleted after ``after`` (it read
    none of them), so a floor past ``after`` means data loss up to and including the floor.
    File names carry no sequence number; without the floor the step would look seamless.
    """
    if not after:
        return None
    floor = retention_floor(store, stream, shard)
    return floor if floor is not None and floor > after else None


# -- the secondary store -------------------------------------------------------------------


def _translate(what: str, error: type = StoreError) -> "contextlib.AbstractContextManager[None]":
    """The store's one translation of filesystem errors, for objects of the secondary tier."""
    return _store_translate(what, error, missing="no such object")


def _public_uri(uri: str) -> str:
    """``uri`` without its query and ``user:secret@`` part (credentials may sit in either)."""
    uri = uri.split("?", 1)[0]
    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


class TierStore:
    """Objects in a secondary store (write once, read by range), through ``pyarrow.fs``.

    Parameters
    ----------
    uri : str
        Anything :func:`pyarrow.fs.FileSystem.from_uri` accepts: ``s3://bucket/prefix`` (add
        ``?endpoint_override=host:port&scheme=http`` for an S3-compatible server),
        ``gs://bucket/prefix``, ``file:///path``, or a plain local path.
    """

    def __init__(self, uri: str) -> None:
        if not isinstance(uri, str) or not uri.strip():
            raise AcsOptionError("tier uri: the secondary store must be a non-empty URI or path", option="uri")
        self.uri_root = uri
        self.fs, base = open_filesystem(uri, option="uri", what="secondary store")
        self.base = base.rstrip("/")
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self._lock = threading.Lock()  # guards _files and _stats
        self._files: "OrderedDict[str, pa.NativeFile]" = OrderedDict()
        self._stats = {"tier_requests": 0, "tier_bytes": 0}

    def __repr__(self) -> str:
        return f"TierStore({self.where()!r})"

    def where(self) -> str:
        """The URI without credentials and query, for messages."""
        return _public_uri(self.uri_root)

    def check(self) -> None:
        """Reach the store once: a local folder is created; an object store's bucket must exist.

        Raises
        ------
        AcsOptionError
            The endpoint cannot be reached or the bucket does not exist (names the URI).
        """
        if self.local:
            os.makedirs(self.base, exist_ok=True)
            return
        bucket = self.base.split("/", 1)[0]
        try:
            kind = self.fs.get_file_info(bucket).type
        except (OSError, pa.ArrowException) as exc:
            raise AcsOptionError(f"tier uri: cannot reach secondary store {self.where()}: {exc}", option="uri") from exc
        if kind != pafs.FileType.Directory:
            raise AcsOptionError(f"tier uri: bucket {bucket!r} of {self.where()} does not exist; create it first",
                                 option="uri")

    def path(self, key: str) -> str:
        """Filesystem path of object ``key``."""
        return f"{self.base}/{key}"

    def put(self, key: str, parts: Iterable[bytes]) -> int:
        """Write object ``key`` from ``parts`` (large objects go up as a multipart upload: an
        S3 object appears only when the upload completes). Returns the bytes written.

        Raises
        ------
        TierUploadError
            Any failure: the object may be absent, partial or complete (ambiguous).
        """
        n = 0
        with _translate(f"upload {self.where()}/{key}", TierUploadError):
            if self.local:
                self.fs.create_dir(self.path(key).rsplit("/", 1)[0], recursive=True)
            with self.fs.open_output_stream(self.path(key)) as out:
                for part in parts:
                    out.write(part)
                    n += len(part)
        return n

    def read(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of object ``key`` (one ranged request)."""
        if end <= start:
            return b""
        path = self.path(key)
        with self._lock:
            f = self._files.get(path)
            if f is not None:
                self._files.move_to_end(path)
        with _translate(f"read {self.where()}/{key} bytes [{start}, {end})"):
            if f is None:
                f = self.fs.open_input_file(path)
                with self._lock:
                    self._files[path] = f
                    while len(self._files) > MAX_OPEN_OBJECTS:
                        self._files.popitem(last=False)
            data = f.read_at(end - start, start)
        with self._lock:
            self._stats["tier_requests"] += 1
            self._stats["tier_bytes"] += len(data)
        return data

    def size(self, key: str) -> Optional[int]:
        """The object's size in bytes, ``None`` if absent."""
        with _translate(f"stat {self.where()}/{key}"):
            info = self.fs.get_file_info(self.path(key))
        return int(info.size) if info.type == pafs.FileType.File else None

    def delete(self, key: str) -> None:
        """Delete object ``key`` (absent is fine)."""
        with self._lock:
            self._files.pop(self.path(key), None)
        try:
            with _translate(f"delete {self.where()}/{key}"):
                self.fs.delete_file(self.path(key))
        except StoreFileNotFoundError:
            pass

    def list(self, prefix: str) -> List[Tuple[str, int, Optional[float]]]:
        """``(key, size, mtime seconds or None)`` of every object under ``prefix``."""
        with _translate(f"list {self.where()}/{prefix}"):
            sel = pafs.FileSelector(self.path(prefix), allow_not_found=True, recursive=True)
            infos = self.fs.get_file_info(sel)
        out = []
        for i in infos:
            if i.type != pafs.FileType.File:
                continue
            mtime = i.mtime.timestamp() if i.mtime is not None else None
            out.append((i.path[len(self.base) + 1:], int(i.size), mtime))
        return sorted(out)

    def stats(self) -> Dict[str, int]:
        """``tier_requests`` (ranged reads) and ``tier_bytes`` read since creation."""
        with self._lock:
            return dict(self._stats)


# -- pre-reading -----------------------------------------------------------------------------


class PrereadWindow:
    """How far ahead a reader fetches from the secondary store: additive increase,
    multiplicative decrease (the RocketMQ article, section 3.5.2). Not thread-safe (its owner's
    lock)."""

    def __init__(self, minimum: int = PREREAD_MIN_BYTES, maximum: int = PREREAD_MAX_BYTES) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.size = minimum

    def grow(self, step: int) -> None:
        """Read-ahead was used: widen by ``step`` (the reader's request size), up to the maximum."""
        self.size = min(self.maximum, self.size + max(step, 1))

    def shrink(self) -> None:
        """Read-ahead was dropped unread: halve, down to the minimum."""
        self.size = max(self.minimum, self.size // 2)


@dataclass
class _Buffer:
    start: int  # file position of data[0]
    data: bytes
    used: int  # file position up to which it was read
    at: float = field(default_factory=time.monotonic)

    @property
    def end(self) -> int:
        return self.start + len(self.data)


# -- the one tier choice of the read side ---------------------------------------------------


class TieredStore(DurableStore):
    """The hot store as readers see it with tiering: files in either tier, by the same names.

    A view of ``hot`` (it shares its filesystem and open files) whose :meth:`list_files`,
    :meth:`lengths`, :meth:`length`, :meth:`read` and :meth:`exists` find tiered files too, by
    the read policy. Built by :func:`tiered_store`; readers get it from
    :func:`~pyspark_acs.read.readpath.open_read_path`.

    Parameters
    ----------
    hot : DurableStore
        The hot (appendable) store.
    policy : str
        One of :data:`READ_POLICIES`.
    preread : bool
        Fetch ahead from the secondary store (:class:`PrereadWindow`); off: one request per read.
    """

    def __init__(self, hot: DurableStore, policy: str = DEFAULT_READ_POLICY, *, preread: bool = True) -> None:
        self.__dict__.update(hot.__dict__)  # same root, filesystem and open-file LRU
        self.hot = hot
        self.policy = parse_read_policy(policy)
        self.preread = preread
        # _tier_lock guards _manifests, _settings, _tiers, _buffers, _windows, _indexes, _gone
        # and _tier_stats.
        self._tier_lock = threading.Lock()
        #: (stream, shard) -> (monotonic time read or checked, records, manifest version).
        self._manifests: Dict[Tuple[str, int], Tuple[float, Dict[str, TierRecord], Optional[Tuple[int, int]]]] = {}
        self._settings: Dict[str, Tuple[float, TierSettings]] = {}
        self._tiers: Dict[str, TierStore] = {}
        self._buffers: "OrderedDict[str, _Buffer]" = OrderedDict()
        self._windows: Dict[str, PrereadWindow] = {}
        self._indexes: "OrderedDict[str, Dict[int, bytes]]" = OrderedDict()
        self._gone: set = set()  # files whose hot copy is known deleted
        self._tier_stats = {"tier_reads": 0, "preread_hits": 0, "preread_dropped_bytes": 0, "index_hits": 0,
                            "manifest_reads": 0, "manifest_checks": 0}

    def __repr__(self) -> str:
        return f"TieredStore({self.root!r}, {self.policy})"

    def __reduce__(self):  # only plain data crosses process boundaries
        return (_reopen, (self.root, self.policy, self.preread, getattr(self.hot, "create", True)))

    # -- which tier --------------------------------------------------------------------------

    @staticmethod
    def _split(rel: str) -> Optional[Tuple[str, int, str]]:
        parts = rel.split("/")
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        return parts[0], int(parts[1]), parts[2]

    def _records(self, stream: str, shard: int, fresh: bool) -> Dict[str, TierRecord]:
        """A shard's tier records: from memory when read less than MANIFEST_TTL_S ago, unless
        ``fresh``; ``fresh`` wants the records as they are now, and costs one stat of the
        manifest when it has not changed since it was read (:meth:`_manifest_version`), one
        read when it has: a reader waiting for a shard's next file lists it every poll, and a
        manifest of a long history is a large JSON document."""
        now = time.monotonic()
        with self._tier_lock:
            hit = self._manifests.get((stream, shard))
        if hit is not None and not fresh and now - hit[0] < MANIFEST_TTL_S:
            return hit[1]
        # The version is taken BEFORE the read: a change between the two gives the records a
        # stale version, so the next check reads them again (never the reverse).
        version = self._manifest_version(stream, shard)
        if hit is not None and version is not None and version == hit[2]:
            with self._tier_lock:
                self._manifests[(stream, shard)] = (now, hit[1], version)
            return hit[1]
        records = read_manifest(self.hot, stream, shard)
        with self._tier_lock:
            self._tier_stats["manifest_reads"] += 1
            self._manifests[(stream, shard)] = (now, records, version)
        return records

    def _manifest_version(self, stream: str, shard: int) -> Optional[Tuple[int, int]]:
        """``(mtime in ns, size)`` of a shard's manifest (``(0, 0)``: none), or ``None`` when it
        changed less than MANIFEST_SETTLE_S ago: two versions written within a filesystem's
        timestamp resolution (ms to 1 s) may look the same, so only an older one is trusted."""
        path = self.hot.path(manifest_rel(stream, shard))
        with _store_translate(f"stat {self.hot.uri(manifest_rel(stream, shard))}"):
            info = self.hot.fs.get_file_info(path)
        with self._tier_lock:
            self._tier_stats["manifest_checks"] += 1
        if info.type == pafs.FileType.NotFound:
            return (0, 0)
        mtime_ns = info.mtime_ns
        if mtime_ns is None or time.time() - mtime_ns / 1e9 < MANIFEST_SETTLE_S:
            return None
        return (mtime_ns, int(info.size or 0))

    def record(self, rel: str, *, fresh: bool = False) -> Optional[TierRecord]:
        """The tier record of ``rel`` (``None``: not tiered), from records read at most
        :data:`MANIFEST_TTL_S` ago; ``fresh`` reads them again."""
        split = self._split(rel)
        if split is None:
            return None
        stream, shard, name = split
        return self._records(stream, shard, fresh).get(name)

    def _gone_from_hot(self, rel: str) -> bool:
        with self._tier_lock:
            return rel in self._gone

    def _mark_gone(self, rel: str) -> None:
        """``rel`` is tiered and its hot copy deleted (a hot copy never comes back: file names
        are never reused), so its reads and lengths skip the hot store from now on."""
        with self._tier_lock:
            if len(self._gone) >= MAX_GONE_FILES:
                self._gone.clear()
            self._gone.add(rel)

    def tier(self, stream: str) -> Optional[TierStore]:
        """The secondary store of ``stream`` (``None`` when it is not tiered)."""
        now = time.monotonic()
        with self._tier_lock:
            hit = self._settings.get(stream)
        if hit is None or now - hit[0] >= SETTINGS_TTL_S:
            try:
                settings = stream_tier_settings(self.hot, stream)
            except AcsOptionError:
                settings = TierSettings()
            with self._tier_lock:
                self._settings[stream] = hit = (now, settings)
        if not hit[1].enabled:
            return None
        with self._tier_lock:
            t = self._tiers.get(hit[1].uri)
        if t is None:
            t = TierStore(hit[1].uri)
            with self._tier_lock:
                t = self._tiers.setdefault(hit[1].uri, t)
        return t

    def _tier_first(self, rel: str) -> Optional[TierRecord]:
        """The record when the policy reads ``rel`` from the secondary store even while hot."""
        if self.policy == "NOT_IN_DISK":
            return None
        return self.record(rel)

    # -- the read side of DurableStore -------------------------------------------------------

    def list_files(self, stream: str, shard: int) -> List[str]:
        """Message files of a shard in either tier, oldest first.

        The hot store is listed before the records are read: a file deleted from the hot store
        was recorded before it, so it is in one list or the other.
        """
        hot = super().list_files(stream, shard)
        records = self._records(stream, shard, True)
        return sorted(set(hot) | set(records))

    def lengths(self, rels: Sequence[str]) -> Dict[str, Optional[int]]:
        """Lengths in either tier; ``None`` for a file in neither. The records of a shard are
        read again at most once per call, and only when a file is missing from the hot store."""
        rels = list(rels)
        gone = {r for r in rels if self._gone_from_hot(r)}
        ask = [r for r in rels if r not in gone]
        out: Dict[str, Optional[int]] = self.hot.lengths(ask) if ask else {}
        refreshed = set()
        for r in rels:
            missing = r not in out or out[r] is None
            if not missing and self.policy == "NOT_IN_DISK":
                continue
            split = self._split(r)
            if split is None:
                continue
            key = split[:2]
            fresh = missing and r not in gone and key not in refreshed
            if fresh:
                refreshed.add(key)
            rec = self._records(split[0], split[1], fresh).get(split[2])
            if rec is None and missing and not fresh and key not in refreshed:
                refreshed.add(key)
                rec = self._records(split[0], split[1], True).get(split[2])
            if rec is not None:
                out[r] = rec.length
                if missing:
                    self._mark_gone(r)
            elif missing:
                out[r] = None
        return out

    def length(self, rel: str) -> int:
        """Length of a file in either tier; StoreFileNotFoundError if in neither."""
        n = self.lengths([rel])[rel]
        if n is None:
            raise StoreFileNotFoundError(f"length of {self.uri(rel)}: no such file in the hot or secondary store")
        return n

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists in the hot store or is a tiered file."""
        return self.hot.exists(rel) or self.record(rel, fresh=True) is not None

    def read(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file from the tier the policy picks (fewer only if the
        file is shorter). Thread-safe."""
        if end <= start:
            return b""
        rec = self._tier_first(rel)
        if rec is None and self._gone_from_hot(rel):
            rec = self.record(rel) or self.record(rel, fresh=True)
        if rec is None:
            try:
                return self.hot.read(rel, start, end)
            except StoreFileNotFoundError:
                rec = self.record(rel, fresh=True)
                if rec is None:
                    raise
                self._mark_gone(rel)
        return self._read_tier(rel, rec, start, min(end, rec.length))

    def _read_tier(self, rel: str, rec: TierRecord, start: int, end: int) -> bytes:
        stream = rel.split("/", 1)[0]
        tier = self.tier(stream)
        if tier is None:
            raise StoreFileNotFoundError(
                f"read {self.uri(rel)}: tiered to {rec.object} but stream {stream!r} has no secondary store configured")
        header = self._indexed_header(tier, rec, start, end)
        if header is not None:
            return header
        with self._tier_lock:
            self._tier_stats["tier_reads"] += 1
        if not self.preread:
            return tier.read(rec.object, rec.offset + start, rec.offset + end)
        parts: List[bytes] = []
        at = start
        window_key = rel.rsplit("/", 1)[0]  # one window per shard: it carries across files
        while at < end:
            with self._tier_lock:
                self._expire()
                buf = self._buffers.get(rel)
                window = self._windows.setdefault(window_key, PrereadWindow())
                if buf is not None and buf.start <= at < buf.end:
                    take = min(end, buf.end) - at
                    parts.append(buf.data[at - buf.start: at - buf.start + take])
                    at += take
                    buf.used = max(buf.used, at)
                    self._buffers.move_to_end(rel)
                    self._tier_stats["preread_hits"] += 1
                    window.grow(take)  # read-ahead was used
                    continue
                size = max(end - at, window.size)
            fetch_end = min(rec.length, at + size)
            data = tier.read(rec.object, rec.offset + at, rec.offset + fetch_end)
            if not data:
                break
            take = min(end - at, len(data))
            parts.append(data[:take])  # served from the fetch itself, whatever happens to the buffer
            with self._tier_lock:
                old = self._buffers.pop(rel, None)
                if old is not None:
                    self._drop(old, window_key)
                self._buffers[rel] = _Buffer(at, data, at + take)
                while len(self._buffers) > PREREAD_MAX_BUFFERS:
                    k, b = self._buffers.popitem(last=False)
                    self._drop(b, k.rsplit("/", 1)[0])
            at += take
        return b"".join(parts)

    def _indexed_header(self, tier: TierStore, rec: TierRecord, start: int, end: int) -> Optional[bytes]:
        """A read within one block header, answered from the object's header index (loaded
        with one request per object); ``None`` when the index does not hold it."""
        if rec.index is None or end - start > HEADER_SIZE:
            return None
        with self._tier_lock:
            index = self._indexes.get(rec.index)
            if index is not None:
                self._indexes.move_to_end(rec.index)
        if index is None:
            try:
                raw = tier.read(rec.index, 0, tier.size(rec.index) or 0)
                index = decode_header_index(raw, f"{tier.where()}/{rec.index}")
            except StoreError as exc:
                log.warning("header index %s unreadable, reading headers from the object: %s", rec.index, exc)
                index = {}
            with self._tier_lock:
                self._indexes[rec.index] = index
                while len(self._indexes) > MAX_HEADER_INDEXES:
                    self._indexes.popitem(last=False)
        # The header that holds [start, end): the block starting at or before start.
        at = rec.offset + start
        header = index.get(at)
        if header is None:
            return None
        with self._tier_lock:
            self._tier_stats["index_hits"] += 1
        return header[: end - start]

    def _drop(self, buf: _Buffer, window_key: str) -> None:
        """A buffer leaves (under _tier_lock): unread read-ahead halves the window."""
        unread = buf.end - buf.used
        if unread > 0:
            self._tier_stats["preread_dropped_bytes"] += unread
            w = self._windows.get(window_key)
            if w is not None:
                w.shrink()

    def _expire(self) -> None:
        """Drop buffers idle for PREREAD_TTL_S (under _tier_lock)."""
        now = time.monotonic()
        for k in [k for k, b in self._buffers.items() if now - b.at > PREREAD_TTL_S]:
            self._drop(self._buffers.pop(k), k.rsplit("/", 1)[0])

    def window(self, stream: str, shard: int) -> int:
        """The current pre-reading window of a shard in bytes."""
        with self._tier_lock:
            w = self._windows.get(shard_dir(stream, shard))
            return w.size if w is not None else PREREAD_MIN_BYTES

    def tier_stats(self) -> Dict[str, int]:
        """``tier_reads`` (reads that went to the secondary store), ``tier_requests`` and
        ``tier_bytes`` (ranged requests and bytes fetched), ``preread_hits``,
        ``preread_dropped_bytes``, ``index_hits`` (header reads answered by a header index),
        ``manifest_reads`` (tier records read from the hot store) and ``manifest_checks``
        (stats of a manifest to learn whether it changed)."""
        with self._tier_lock:
            out = dict(self._tier_stats)
            tiers = list(self._tiers.values())
        out["tier_requests"] = sum(t.stats()["tier_requests"] for t in tiers)
        out["tier_bytes"] = sum(t.stats()["tier_bytes"] for t in tiers)
        return out

    def close(self) -> None:
        """Close the hot store's open files and drop read-ahead."""
        with self._tier_lock:
            self._buffers.clear()
        self.hot.close()


def _reopen(root: str, policy: str, preread: bool, create: bool = True) -> TieredStore:
    return TieredStore(DurableStore(root, create=create), policy, preread=preread)


def tiered_store(store: DurableStore, policy: str = DEFAULT_READ_POLICY, *, preread: bool = True) -> TieredStore:
    """``store`` as readers see it with tiering (returned as is when it already is a view)."""
    if isinstance(store, TieredStore):
        return store
    return TieredStore(store, policy, preread=preread)


def tier_summary(store: DurableStore, stream: str) -> Dict[str, Any]:
    """A stream's tier settings and state, for ``acs ls`` / ``acs status``: the settings
    (``uri`` without credentials), ``tiered_files`` (recorded in the secondary store),
    ``secondary_only`` (of those, no longer in the hot store), ``hot_files``, ``hot_bytes``
    and ``line`` (a one-line text form)."""
    settings = stream_tier_settings(store, stream)
    out: Dict[str, Any] = settings.to_json()
    out["uri"] = _public_uri(settings.uri) if settings.uri else None
    tiered = secondary_only = hot_files = hot_bytes = 0
    for shard in range(store.stream_shards(stream) or 0):
        records = read_manifest(store, stream, shard)
        hot = DurableStore.list_files(store, stream, shard)  # the hot store's own listing
        lengths = store.lengths([f"{shard_dir(stream, shard)}/{f}" for f in hot]) if hot else {}
        tiered += len(records)
        secondary_only += len(set(records) - set(hot))
        hot_files += len(hot)
        hot_bytes += sum(n or 0 for n in lengths.values())
    out.update(tiered_files=tiered, secondary_only=secondary_only, hot_files=hot_files, hot_bytes=hot_bytes)
    out["line"] = (f"{settings.describe()}  tiered_files={tiered} secondary_only={secondary_only} "
                   f"hot_files={hot_files} hot_bytes={hot_bytes}")
    return out
