"""The storage engine of one cache replica: a byte-accounted, versioned in-memory map.

Policy (paper section 3, "Tuning the caches"):

- **TTL per entry.** Each put carries a time to live (the role default when it does not:
  :data:`DATA_TTL_S` for chunks, :data:`METADATA_TTL_S` for lengths, heads and leases). An expired
  entry reads as absent at once and its memory is reclaimed by the next sweep.
- **Capacity in bytes.** Every entry is charged ``len(key) + len(value) + ENTRY_OVERHEAD_BYTES``.
  Garbage collection starts when usage crosses :data:`GC_START_FRACTION` (80 %) of the capacity
  and then drops expired entries, then evicts the *least-recently-modified* entries until usage is
  at most :data:`GC_LOW_WATERMARK_FRACTION` (70 %). Reads never refresh an entry: a chunk that is
  read a lot but no longer written is as old as its last write. An entry larger than the low
  watermark could never stay (GC would evict it at once), so such a put is refused
  (:attr:`PutResult.TOO_LARGE`).
- **Versions.** Every entry has an unsigned 64-bit version. A put is stored only when its version
  is ``>=`` the stored one, so chunk prefixes and published lengths never go backwards on a
  replica (dueling writers, section 3). A refused put reports :attr:`PutResult.STALE`: the replica
  already has something newer, which the client counts as an acknowledgement.
- **Compare-and-set** on the exact value bytes, or on absence, for leases.

Why not ``cachetools``: its caches order entries by insertion (FIFO), by use (LRU, LFU) or by
expiry (TTL/TLRU). Least-recently-*modified* is none of these: FIFO keeps a rewritten key at its
first insertion slot and LRU moves it on reads. So the engine keeps its own ordered maps.

Layout. Entries live in one ordered map per distinct TTL (``_groups``), in modification order.
Within a group, modification order is also expiry order, so expiring is popping from the front
of each group, and least-recently-modified eviction is popping the group whose front entry was
written first. There are normally one or two groups (the role default, and the TTL the lease
code asks for); a put with a new TTL creates a group, an empty group is dropped.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

__all__ = [
    "DATA_TTL_S",
    "ENTRY_OVERHEAD_BYTES",
    "GC_LOW_WATERMARK_FRACTION",
    "GC_START_FRACTION",
    "MAX_VERSION",
    "METADATA_TTL_S",
    "PutResult",
    "Store",
    "StoredEntry",
]

#: Default time to live of data-cache entries (chunks): one minute of recent bytes.
DATA_TTL_S = 60.0
#: Default time to live of metadata-cache entries: much longer than a file's roll-over age.
METADATA_TTL_S = 24 * 3600.0
#: GC starts when the charged bytes cross this fraction of the capacity.
GC_START_FRACTION = 0.8
#: GC evicts least-recently-modified entries until the charged bytes are at most this fraction.
GC_LOW_WATERMARK_FRACTION = 0.7
#: Bytes charged per entry on top of its key and value bytes: the CPython headers of the key and
#: value ``bytes`` objects (2 x 33), the version int (~32) and what the store itself allocates per
#: entry (entry record, expiry float, key index slot, ordered group node): tracemalloc measured
#: 286 bytes of the latter for 50k 4 KiB chunks, so ~384 in all. Capacity is therefore a bound
#: on the Python heap the entries take, not just on their payload.
ENTRY_OVERHEAD_BYTES = 384
#: Versions are unsigned 64-bit on the wire.
MAX_VERSION = 2**64 - 1


class PutResult(enum.IntEnum):
    """Outcome of one key of a put (same numbers as the wire enum ``PutStatus``)."""

    STORED = 0
    STALE = 1
    TOO_LARGE = 2


class StoredEntry(NamedTuple):
    """A live entry as returned by :meth:`Store.get`."""

    value: bytes
    version: int


class _Item:
    """One stored entry; replaced (never mutated) on every write."""

    __slots__ = ("value", "version", "expires_at", "ttl_ms", "charged")

    def __init__(self, value: bytes, version: int, expires_at: float, ttl_ms: int, charged: int):
        self.value = value
        self.version = version
        self.expires_at = expires_at
        self.ttl_ms = ttl_ms
        self.charged = charged


_COUNTERS = (
    "gets_total",
    "hits_total",
    "misses_total",
    "read_bytes_total",
    "puts_total",
    "stored_total",
    "stale_total",
    "too_large_total",
    "written_bytes_total",
    "cas_total",
    "cas_swapped_total",
    "deletes_total",
    "deleted_total",
    "expired_total",
    "evicted_total",
    "gc_runs_total",
)


class Store:
    """A thread-safe, byte-accounted, versioned in-memory map with TTL and LRM eviction.

    Parameters
    ----------
    capacity_bytes : int
        Charged bytes the store may hold (see :data:`ENTRY_OVERHEAD_BYTES`); must be positive.
    default_ttl_s : float
        TTL of puts that do not carry one; must be positive.
    clock : callable, default time.monotonic
        Seconds as a float; injectable for tests.
    """

    def __init__(
        self,
        capacity_bytes: int,
        default_ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be positive, got {default_ttl_s}")
        self.capacity_bytes = int(capacity_bytes)
        self.default_ttl_ms = max(1, int(round(default_ttl_s * 1000)))
        self.gc_start_bytes = int(self.capacity_bytes * GC_START_FRACTION)
        self.gc_low_bytes = int(self.capacity_bytes * GC_LOW_WATERMARK_FRACTION)
        #: Largest charged size one entry may have; bigger ones would be evicted at once.
        self.max_entry_bytes = self.gc_low_bytes
        self._clock = clock
        # _lock guards everything below: _index, _groups, _used and _counts. It is held for
        # whole batches so a batched put or get is atomic with respect to GC.
        self._lock = threading.Lock()
        self._index: Dict[bytes, _Item] = {}
        self._groups: Dict[int, "OrderedDict[bytes, _Item]"] = {}
        self._used = 0
        self._counts: Dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    # -- reads -----------------------------------------------------------------------------

    def get_many(self, keys: Sequence[bytes]) -> List[Optional[StoredEntry]]:
        """Look up ``keys``; absent or expired keys give ``None``. Never refreshes an entry."""
        now = self._clock()
        out: List[Optional[StoredEntry]] = []
        append = out.append
        hits = 0
        nbytes = 0
        with self._lock:
            index = self._index
            for key in keys:
                item = index.get(key)
                if item is None:
                    append(None)
                elif item.expires_at <= now:
                    self._drop(key, item)
                    self._counts["expired_total"] += 1
                    append(None)
                else:
                    hits += 1
                    nbytes += len(item.value)
                    append(StoredEntry(item.value, item.version))
            counts = self._counts
            counts["gets_total"] += len(keys)
            counts["hits_total"] += hits
            counts["misses_total"] += len(keys) - hits
            counts["read_bytes_total"] += nbytes
        return out

    def get(self, key: bytes) -> Optional[StoredEntry]:
        """Look up one key (see :meth:`get_many`)."""
        return self.get_many((key,))[0]

    # -- writes ----------------------------------------------------------------------------

    def _ttl_ms(self, ttl_s: Optional[float]) -> int:
        if ttl_s is None or ttl_s <= 0:
            return self.default_ttl_ms
        return max(1, int(round(ttl_s * 1000)))

    def put_many(
        self,
        items: Iterable[Tuple[bytes, bytes, int]],
        *,
        ttl_s: Optional[float] = None,
    ) -> List[PutResult]:
        """Store ``(key, value, version)`` triples, each only if its version is ``>=`` the stored one.

        Parameters
        ----------
        items : iterable of (bytes, bytes, int)
            The entries.
        ttl_s : float, optional
            Time to live of these entries; ``None`` or ``<= 0`` means the store's default.

        Returns
        -------
        list of PutResult
            One per item, in order.
        """
        ttl_ms = self._ttl_ms(ttl_s)
        results: List[PutResult] = []
        append = results.append
        now = self._clock()
        with self._lock:
            counts = self._counts
            index = self._index
            n = 0
            for key, value, version in items:
                n += 1
                charged = len(key) + len(value) + ENTRY_OVERHEAD_BYTES
                if charged > self.max_entry_bytes:
                    counts["too_large_total"] += 1
                    append(PutResult.TOO_LARGE)
                    continue
                old = index.get(key)
                if old is not None:
                    if old.expires_at > now and version < old.version:
                        counts["stale_total"] += 1
                        append(PutResult.STALE)
                        continue
                    self._drop(key, old)
                self._insert(key, _Item(value, version, now + ttl_ms / 1000.0, ttl_ms, charged))
                counts["stored_total"] += 1
                counts["written_bytes_total"] += len(value)
                append(PutResult.STORED)
            counts["puts_total"] += n
            self._expire_locked(now)
            if self._used > self.gc_start_bytes:
                self._gc_locked(now)
        return results

    def put(self, key: bytes, value: bytes, version: int, *, ttl_s: Optional[float] = None) -> PutResult:
        """Store one entry (see :meth:`put_many`)."""
        return self.put_many(((key, value, version),), ttl_s=ttl_s)[0]

    def compare_and_set(
        self,
        key: bytes,
        expected: Optional[bytes],
        value: bytes,
        *,
        version: int = 0,
        ttl_s: Optional[float] = None,
    ) -> Tuple[bool, Optional[StoredEntry]]:
        """Replace ``key`` by ``value`` if its value is exactly ``expected`` (``None``: if absent).

        The version of the new entry is ``version``; unlike :meth:`put_many` it is not compared
        with the stored one (leases change hands by value, not by version).

        Returns
        -------
        (bool, StoredEntry or None)
            Whether it swapped, and the entry stored after the call.

        Raises
        ------
        ValueError
            If the entry could never fit in this store.
        """
        ttl_ms = self._ttl_ms(ttl_s)
        charged = len(key) + len(value) + ENTRY_OVERHEAD_BYTES
        if charged > self.max_entry_bytes:
            raise ValueError(
                f"entry of {charged} charged bytes exceeds the largest this store keeps "
                f"({self.max_entry_bytes})"
            )
        now = self._clock()
        with self._lock:
            self._counts["cas_total"] += 1
            old = self._index.get(key)
            if old is not None and old.expires_at <= now:
                self._drop(key, old)
                self._counts["expired_total"] += 1
                old = None
            matches = old is None if expected is None else (old is not None and old.value == expected)
            if not matches:
                return False, (None if old is None else StoredEntry(old.value, old.version))
            if old is not None:
                self._drop(key, old)
            self._insert(key, _Item(value, version, now + ttl_ms / 1000.0, ttl_ms, charged))
            self._counts["cas_swapped_total"] += 1
            self._counts["written_bytes_total"] += len(value)
            if self._used > self.gc_start_bytes:
                self._gc_locked(now)
            return True, StoredEntry(value, version)

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove ``keys``; returns how many were present (expired ones included)."""
        deleted = 0
        with self._lock:
            n = 0
            for key in keys:
                n += 1
                item = self._index.get(key)
                if item is not None:
                    self._drop(key, item)
                    deleted += 1
            self._counts["deletes_total"] += n
            self._counts["deleted_total"] += deleted
        return deleted

    def expire(self) -> int:
        """Drop every expired entry now; returns how many. The server calls this periodically."""
        with self._lock:
            return self._expire_locked(self._clock())

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._index.clear()
            self._groups.clear()
            self._used = 0

    # -- introspection ---------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def used_bytes(self) -> int:
        """Charged bytes of the entries held (expired ones not yet swept included)."""
        with self._lock:
            return self._used

    def stats(self) -> Dict[str, int]:
        """Gauges and counters: entries, used/capacity/watermark bytes, and the ``*_total`` counters."""
        with self._lock:
            out = dict(self._counts)
            out["entries"] = len(self._index)
            out["used_bytes"] = self._used
            out["ttl_groups"] = len(self._groups)
        out["capacity_bytes"] = self.capacity_bytes
        out["gc_start_bytes"] = self.gc_start_bytes
        out["gc_low_bytes"] = self.gc_low_bytes
        out["max_entry_bytes"] = self.max_entry_bytes
        out["entry_overhead_bytes"] = ENTRY_OVERHEAD_BYTES
        out["default_ttl_ms"] = self.default_ttl_ms
        return out

    # -- internals (caller holds _lock) -----------------------------------------------------

    def _insert(self, key: bytes, item: _Item) -> None:
        group = self._groups.get(item.ttl_ms)
        if group is None:
            group = self._groups[item.ttl_ms] = OrderedDict()
        group[key] = item  # a fresh key goes to the end: the most recently modified
        self._index[key] = item
        self._used += item.charged

    def _drop(self, key: bytes, item: _Item) -> None:
        del self._index[key]
        group = self._groups[item.ttl_ms]
        del group[key]
        if not group:
            del self._groups[item.ttl_ms]
        self._used -= item.charged

    def _expire_locked(self, now: float) -> int:
        expired = 0
        for ttl_ms in list(self._groups):
            group = self._groups[ttl_ms]
            # Within a group modification order is expiry order: stop at the first live entry.
            while group:
                key, item = next(iter(group.items()))
                if item.expires_at > now:
                    break
                self._drop(key, item)
                expired += 1
                if ttl_ms not in self._groups:
                    break
        self._counts["expired_total"] += expired
        return expired

    def _gc_locked(self, now: float) -> None:
        self._counts["gc_runs_total"] += 1
        self._expire_locked(now)
        evicted = 0
        groups = self._groups
        while self._used > self.gc_low_bytes and groups:
            # The least recently modified entry overall is the oldest-written front of a group;
            # written_at = expires_at - ttl.
            oldest_key = None
            oldest_item = None
            oldest_written = 0.0
            for group in groups.values():
                key, item = next(iter(group.items()))
                written = item.expires_at - item.ttl_ms / 1000.0
                if oldest_item is None or written < oldest_written:
                    oldest_key, oldest_item, oldest_written = key, item, written
            self._drop(oldest_key, oldest_item)  # type: ignore[arg-type]
            evicted += 1
        self._counts["evicted_total"] += evicted
