"""Tiered storage as readers see it: a shard's files in either tier by the same offsets.

The hot store (a :class:`~pyspark_acs.storage.store.DurableStore`, appendable) holds the files
being written and recent history; the *secondary store* (any ``pyarrow.fs`` filesystem: S3,
GCS, a local folder) holds sealed files the tier mover (:mod:`pyspark_acs.server.tier`) moved
there. The rules both sides share live once each:

- **Stream settings** (:mod:`pyspark_acs.storage.tier_settings`, ``TierSettings``): the
  secondary store's URI and the retention of both tiers, kept in the stream's metadata file
  (``<stream>/_stream.json``, key ``"tier"``).
- **Tier records** (:mod:`pyspark_acs.storage.tier_manifest`, ``TierRecord``): which files are
  tiered, kept per shard in ``<stream>/<shard>/_tiered.json`` of the hot store. A record is
  written only after its object was uploaded and verified (data before index); the hot copy
  may be deleted only once the record exists. An object no record names is never read (a
  partial or abandoned upload).
- **The secondary store** (:mod:`pyspark_acs.storage.tier_store`, ``TierStore``): objects
  written once and read by range.
- **The retention floor** (here: :func:`raise_retention_floor`, :func:`retention_gap`): the
  newest file retention deleted from a shard, so a reader tells a gap from the next file.
- **Which tier holds file X and how to open it** (here: :class:`TieredStore`): the one place
  every reader asks. :func:`pyspark_acs.read.readpath.open_read_path` wraps the hot store in
  it, so the Consumer, the Spark source planner and tasks and the copy reader all read a file
  by its ``(file, length)`` offset wherever it lives, under one read policy (the RocketMQ
  tiered-storage article's, docs/overview.md section 9):

  ``NOT_IN_DISK`` (default)
      caches, then the hot store; the secondary store only for files no longer in the hot store.
  ``NOT_IN_MEM``
      caches, then the secondary store for every tiered file (its hot copy is not read: the
      hot store's disks are kept for the files being written); the hot store for the rest.
  ``FORCE``
      no caches; every tiered file from the secondary store (for tests and checks).

- **Pre-reading** (:mod:`pyspark_acs.storage.tier_preread`, ``PrereadWindow``): reads from the
  secondary store fetch a window ahead; the window grows additively by the reader's request
  size while read-ahead is used, and halves when read-ahead bytes are dropped unread (the
  RocketMQ article's AIMD, after TCP Tahoe).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pyarrow.fs as pafs

from pyspark_acs.errors import AcsOptionError, StoreError, StoreFileNotFoundError
from pyspark_acs.format.block import HEADER_SIZE
from pyspark_acs.format.names import shard_dir
from pyspark_acs.storage.store import _translate as _store_translate
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.storage.tier_manifest import TierRecord, decode_header_index, manifest_rel, read_manifest
from pyspark_acs.storage.tier_preread import PREREAD_TTL_S, ReadAhead
from pyspark_acs.storage.tier_settings import TierSettings, stream_tier_settings
from pyspark_acs.storage.tier_store import TierStore

__all__ = [
    "DEFAULT_READ_POLICY",
    "parse_read_policy",
    "raise_retention_floor",
    "retention_floor",
    "retention_gap",
    "tiered_store",
]

log = logging.getLogger(__name__)

#: Per-shard file naming the newest file secondary retention deleted (``{"deleted_through":
#: name}``), in the shard's folder of the hot store: readers tell a gap from the next file.
RETENTION_FLOOR_FILE = "_retained.json"
#: The read policies of the RocketMQ tiered-storage article (``DISABLE``: a stream without a
#: tier).
READ_POLICIES = ("NOT_IN_DISK", "NOT_IN_MEM", "FORCE")
#: Hot store first; the secondary store for files gone from it.
DEFAULT_READ_POLICY = "NOT_IN_DISK"
#: How long a reader reuses a shard's tier records before reading them again (seconds);
#: a file it cannot find in either tier makes it read them at once.
MANIFEST_TTL_S = 1.0
#: A manifest changed less than this long ago (seconds, by its modification time) is read
#: again on every fresh look; an older one only when its (mtime, size) changed. The default
#: of ``TieredStore(manifest_settle_s=)``.
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


# -- the retention floor ---------------------------------------------------------------


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
        Fetch ahead from the secondary store (:mod:`~pyspark_acs.storage.tier_preread`); off: one
        request per read.
    manifest_settle_s : float
        A manifest changed less than this long ago is read again on every fresh look (default
        :data:`MANIFEST_SETTLE_S`; measured against its modification time, on the wall clock).
    preread_ttl_s : float
        Read-ahead not read within this long is dropped (default
        :data:`~pyspark_acs.storage.tier_preread.PREREAD_TTL_S`).
    clock : callable
        Monotonic seconds (``time.monotonic``): the clock of the reuse of tier records and
        settings and of the read-ahead's expiry. Not carried to other processes (a pickled
        store has the default).
    """

    def __init__(self, hot: DurableStore, policy: str = DEFAULT_READ_POLICY, *, preread: bool = True,
                 manifest_settle_s: float = MANIFEST_SETTLE_S, preread_ttl_s: float = PREREAD_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.__dict__.update(hot.__dict__)  # same root, filesystem and open-file LRU
        self.hot = hot
        self.policy = parse_read_policy(policy)
        self.preread = preread
        self.manifest_settle_s = manifest_settle_s
        self.preread_ttl_s = preread_ttl_s
        self.clock = clock
        # _tier_lock guards _manifests, _settings, _tiers, _indexes, _gone and _tier_stats.
        self._tier_lock = threading.Lock()
        #: (stream, shard) -> (monotonic time read or checked, records, manifest version).
        self._manifests: Dict[Tuple[str, int], Tuple[float, Dict[str, TierRecord], Optional[Tuple[int, int]]]] = {}
        self._settings: Dict[str, Tuple[float, TierSettings]] = {}
        self._tiers: Dict[str, TierStore] = {}
        self._read_ahead = ReadAhead(preread_ttl_s, clock)
        self._indexes: "OrderedDict[str, Dict[int, bytes]]" = OrderedDict()
        self._gone: set = set()  # files whose hot copy is known deleted
        self._tier_stats = {"tier_reads": 0, "index_hits": 0, "manifest_reads": 0, "manifest_checks": 0}

    def __repr__(self) -> str:
        return f"TieredStore({self.root!r}, {self.policy})"

    def __reduce__(self):  # only plain data crosses process boundaries
        return (_reopen, (self.root, self.policy, self.preread, getattr(self.hot, "create", True),
                          self.manifest_settle_s, self.preread_ttl_s))

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
        now = self.clock()
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
        changed less than ``manifest_settle_s`` ago: two versions written within a filesystem's
        timestamp resolution (ms to 1 s) may look the same, so only an older one is trusted."""
        path = self.hot.path(manifest_rel(stream, shard))
        with _store_translate(f"stat {self.hot.uri(manifest_rel(stream, shard))}"):
            info = self.hot.fs.get_file_info(path)
        with self._tier_lock:
            self._tier_stats["manifest_checks"] += 1
        if info.type == pafs.FileType.NotFound:
            return (0, 0)
        mtime_ns = info.mtime_ns
        if mtime_ns is None or time.time() - mtime_ns / 1e9 < self.manifest_settle_s:
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
        now = self.clock()
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
        while at < end:
            held, size = self._read_ahead.take(rel, at, end)
            if held is not None:
                parts.append(held)
                at += len(held)
                continue
            fetch_end = min(rec.length, at + size)
            data = tier.read(rec.object, rec.offset + at, rec.offset + fetch_end)
            if not data:
                break
            take = min(end - at, len(data))
            parts.append(data[:take])  # served from the fetch itself, whatever happens to the buffer
            self._read_ahead.keep(rel, at, data, at + take)
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

    def window(self, stream: str, shard: int) -> int:
        """The current pre-reading window of a shard in bytes."""
        return self._read_ahead.window(shard_dir(stream, shard))

    def tier_stats(self) -> Dict[str, int]:
        """``tier_reads`` (reads that went to the secondary store), ``tier_requests`` and
        ``tier_bytes`` (ranged requests and bytes fetched), ``preread_hits``,
        ``preread_dropped_bytes``, ``index_hits`` (header reads answered by a header index),
        ``manifest_reads`` (tier records read from the hot store) and ``manifest_checks``
        (stats of a manifest to learn whether it changed)."""
        with self._tier_lock:
            out = dict(self._tier_stats)
            tiers = list(self._tiers.values())
        out.update(self._read_ahead.stats())
        out["tier_requests"] = sum(t.stats()["tier_requests"] for t in tiers)
        out["tier_bytes"] = sum(t.stats()["tier_bytes"] for t in tiers)
        return out

    def close(self) -> None:
        """Close the hot store's open files and drop read-ahead."""
        self._read_ahead.clear()
        self.hot.close()


def _reopen(root: str, policy: str, preread: bool, create: bool = True, manifest_settle_s: float = MANIFEST_SETTLE_S,
            preread_ttl_s: float = PREREAD_TTL_S) -> TieredStore:
    return TieredStore(DurableStore(root, create=create), policy, preread=preread,
                       manifest_settle_s=manifest_settle_s, preread_ttl_s=preread_ttl_s)


def tiered_store(store: DurableStore, policy: str = DEFAULT_READ_POLICY, *, preread: bool = True,
                 **settings: Any) -> TieredStore:
    """``store`` as readers see it with tiering (returned as is when it already is a view);
    ``settings`` are :class:`TieredStore`'s ``manifest_settle_s``, ``preread_ttl_s`` and
    ``clock``."""
    if isinstance(store, TieredStore):
        return store
    return TieredStore(store, policy, preread=preread, **settings)
