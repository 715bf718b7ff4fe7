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

Why ``cachetools``: :class:`cachetools.FIFOCache` is exactly a least-recently-*modified* cache.
Its ``__setitem__`` appends a new key to its order and moves a rewritten key to the end
(``OrderedDict.move_to_end``), its ``__getitem__`` does not touch the order, and ``popitem`` takes
the front, so ``popitem`` evicts the entry whose last write is oldest and reads never refresh an
entry. FIFOCache has behaved so since it appeared in cachetools 4.2.0 (same ``__setitem__`` in the
4.2.0, 5.0.0 and 8.0.1 sources; the store passes its tests on all three), so ``cachetools>=5`` in
``setup.py`` is enough. The cachetools documentation only says FIFO evicts "in the order they
were added", so the move on rewrite is an implementation detail:
``test_store_evicts_least_recently_modified_and_reads_do_not_refresh`` pins it. A ``getsizeof``
returning an entry's charged bytes (key, value and :data:`ENTRY_OVERHEAD_BYTES`) with ``maxsize`` set to
the capacity makes ``currsize`` the byte accounting and the capacity a hard bound: if one batch
grows past it, cachetools itself evicts least-recently-modified entries before inserting (after
the store has swept expired entries). cachetools caches are not thread-safe; the store's lock
covers them.

Layout. ``_entries`` is that FIFOCache subclass (:class:`_Entries`), key -> entry (a plain tuple, see
:data:`_VALUE`).
Expiry needs a second order, because one cache holds entries with different TTLs (the role
default, and the TTL the lease code asks for): ``_Entries.by_ttl`` keeps, per distinct TTL, the
keys in modification order, which within one TTL is also expiry order. Sweeping is therefore
popping expired keys from the front of each group (cost proportional to what expires, plus one
look per group), and an expired entry also reads as absent at once. There are normally one or
two groups; a put with a new TTL creates a group, an empty group is dropped.

Sweeps are off the request path (were every put to sweep every group, a client putting many
distinct TTLs would slow every put): the server's sweeper thread calls :meth:`Store.expire`,
which works in slices of at most :data:`SWEEP_SLICE_STEPS` steps (groups looked at plus entries
dropped) per hold of the lock. A put sweeps only when the store is over its capacity or GC start.
"""

from __future__ import annotations

import enum
import operator
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import cachetools

__all__ = [
    "DATA_TTL_S",
    "METADATA_TTL_S",
    "PutResult",
    "SWEEP_SLICE_STEPS",
    "Store",
]

#: Default time to live of data-cache entries (chunks): one minute of recent bytes.
DATA_TTL_S = 60.0
#: Default time to live of metadata-cache entries: much longer than a file's roll-over age.
METADATA_TTL_S = 24 * 3600.0
#: Steps (a TTL group looked at, or an entry dropped) of one slice of an expiry sweep: how long
#: the sweeper holds the lock at a time (about a millisecond).
SWEEP_SLICE_STEPS = 2048
#: GC starts when the charged bytes cross this fraction of the capacity.
GC_START_FRACTION = 0.8
#: GC evicts least-recently-modified entries until the charged bytes are at most this fraction.
GC_LOW_WATERMARK_FRACTION = 0.7
#: Bytes charged per entry on top of its key and value bytes: the CPython headers of the key and
#: value ``bytes`` objects (2 x 33), the version int (~32) and what the store itself allocates per
#: entry (entry record; the cache's data, size and order slots; the TTL group node). tracemalloc
#: measures ~420 bytes of the latter for 50k 4 KiB chunks (cachetools 8.0, CPython 3.11), so
#: ~520 in all; 512 is charged. Capacity is
#: therefore a bound on the Python heap the entries take (within ~1 %), not just on their payload.
ENTRY_OVERHEAD_BYTES = 512
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


#: A stored entry is a plain tuple ``(value, version, expires_at, ttl_ms, charged)``, replaced
#: (never mutated) on every write; ``charged`` is ``len(key) + len(value) +
#: ENTRY_OVERHEAD_BYTES``, what the cache charges for it. These name its places. A plain tuple
#: of atomic values (bytes, ints, a float) is no longer tracked by the garbage collector once a
#: collection has looked at it, so a full collection does not walk every entry of a large
#: cache (a tracked entry per chunk makes each full collection an event-loop stall for every
#: stream of the server).
_VALUE, _VERSION, _EXPIRES_AT, _TTL_MS, _CHARGED = range(5)
_Item = Tuple[bytes, int, float, int, int]


class _Entries(cachetools.FIFOCache):
    """key -> entry (a tuple, see :data:`_VALUE`); ``currsize`` is the charged bytes,
    ``popitem`` evicts the least recently modified entry.

    ``entries[key]`` is the item or ``None`` (:meth:`__missing__`), so a lookup needs no
    exception. ``by_ttl`` maps each TTL (ms) to its keys in modification order (the value is the
    item, so a sweep needs no second lookup); the store keeps it in step on every write and
    delete, and :meth:`popitem` on the evictions cachetools makes by itself. Not thread-safe:
    the store's lock guards it.
    """

    def __init__(self, capacity_bytes: int, counts: Dict[str, int]) -> None:
        # getsizeof: an entry's charged bytes, read by a C-level itemgetter (no Python frame per write).
        super().__init__(capacity_bytes, getsizeof=operator.itemgetter(_CHARGED))
        self.by_ttl: Dict[int, "OrderedDict[bytes, _Item]"] = {}
        self._counts = counts
        # key -> item or None, without a Python frame per key: the bound ``get`` of the dict
        # cachetools keeps the entries in (a FIFOCache's reads do not reorder it, so this is the
        # lookup ``entries[key]`` makes). A 256-chunk Get's lookups through ``__getitem__`` were
        # about a sixth of its handler's time. Falls back to ``__getitem__`` should a later
        # cachetools keep its entries elsewhere.
        data = getattr(self, "_Cache__data", None)
        self.lookup: Callable[[bytes], Optional[_Item]] = (
            data.get if type(data) is dict else self.__getitem__)  # type: ignore[assignment]

    def __missing__(self, key: bytes) -> None:
        return None

    def popitem(self) -> Tuple[bytes, _Item]:
        """Evict the least recently modified entry (GC, or cachetools when a batch overflows)."""
        key, item = super().popitem()
        self.unindex(key, item[_TTL_MS])
        self._counts["evicted_total"] += 1
        return key, item

    def unindex(self, key: bytes, ttl_ms: int) -> None:
        """Take ``key`` out of its TTL group, if it is there."""
        group = self.by_ttl.get(ttl_ms)
        if group is not None:
            group.pop(key, None)
            if not group:
                del self.by_ttl[ttl_ms]


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
        # _lock guards everything below: _entries (the cache, its TTL groups and its byte
        # accounting) and _counts. It is held for whole batches so a batched put or get is atomic
        # with respect to GC.
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._entries = _Entries(self.capacity_bytes, self._counts)
        #: TTL groups the current sweep has still to visit (guarded by _lock).
        self._sweep_todo: List[int] = []

    # -- reads -----------------------------------------------------------------------------

    def get_many(self, keys: Sequence[bytes], *, count: bool = True) -> List[Optional[StoredEntry]]:
        """Look up ``keys``; absent or expired keys give ``None``. Never refreshes an entry.

        ``count=False`` leaves the get/hit/miss counters alone (the push streams' reads: they
        are counted as pushed messages and bytes instead; expired entries are dropped and
        counted alike).
        """
        found, values, versions = self.read_many(keys, count=count)
        return [StoredEntry(v, ver) if f else None for f, v, ver in zip(found, values, versions)]

    def read_many(self, keys: Sequence[bytes], *,
                  count: bool = True) -> Tuple[List[bool], List[bytes], List[int]]:
        """:meth:`get_many` as three lists, one item per key: found, value (``b""`` when not)
        and version (``0`` when not) -- the shape of a ``GetResponse``, built with no object
        per key.
        """
        now = self._clock()
        with self._lock:
            entries = self._entries
            items = list(map(entries.lookup, keys))  # None when absent; the eviction order stays
            if [it for it in items if it is None or it[_EXPIRES_AT] <= now]:
                items = [self._live(key, item, now) for key, item in zip(keys, items)]
                found = [it is not None for it in items]
                values = [it[_VALUE] if it is not None else b"" for it in items]
                versions = [it[_VERSION] if it is not None else 0 for it in items]
            else:  # all found and live: no test per key
                found = [True] * len(items)
                values = [it[_VALUE] for it in items]
                versions = [it[_VERSION] for it in items]
            if count:
                counts = self._counts
                hits = sum(found)
                counts["gets_total"] += len(keys)
                counts["hits_total"] += hits
                counts["misses_total"] += len(keys) - hits
                counts["read_bytes_total"] += sum(map(len, values))
        return found, values, versions

    def get(self, key: bytes) -> Optional[StoredEntry]:
        """Look up one key (see :meth:`get_many`)."""
        return self.get_many((key,))[0]

    def _live(self, key: bytes, item: Optional[_Item], now: float) -> Optional[_Item]:
        """``item`` (``key``'s) if it is live at ``now``; an expired one is dropped and
        counted, and gives None. The caller holds ``_lock``."""
        if item is not None and item[_EXPIRES_AT] <= now:
            self._drop(key, item)
            self._counts["expired_total"] += 1
            return None
        return item

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
        expires_at = now + ttl_ms / 1000.0
        max_entry_bytes = self.max_entry_bytes
        with self._lock:
            counts = self._counts
            entries = self._entries
            by_ttl = entries.by_ttl
            group = by_ttl.get(ttl_ms)
            lookup = entries.lookup
            # Bytes left before cachetools would evict by itself (only a batch bigger than the
            # room above the GC start gets there): then drop expired entries first.
            room = self.capacity_bytes - entries.currsize
            n = stored = nbytes = 0
            for key, value, version in items:
                n += 1
                charged = len(key) + len(value) + ENTRY_OVERHEAD_BYTES
                if charged > max_entry_bytes:
                    counts["too_large_total"] += 1
                    append(PutResult.TOO_LARGE)
                    continue
                # Expired: as if absent, any version replaces it. (The dict's own get: the
                # cache's ``in`` and ``[]`` are a Python frame each, and most chunks are new.)
                old = lookup(key)
                if old is not None and old[_EXPIRES_AT] <= now:
                    old = self._live(key, old, now)
                if old is not None:
                    if version < old[_VERSION]:
                        counts["stale_total"] += 1
                        append(PutResult.STALE)
                        continue
                item = (value, version, expires_at, ttl_ms, charged)
                room -= charged if old is None else charged - old[_CHARGED]
                if room < 0:
                    self._expire_locked(now)
                    room = self.capacity_bytes - entries.currsize - charged
                # What _write does, inlined (this loop is the hot path). FIFOCache appends a new
                # key and moves a rewritten one to the end: the most recently modified. It may
                # evict least-recently-modified entries itself (popitem) when over capacity.
                entries[key] = item
                if old is not None and old[_TTL_MS] != ttl_ms:
                    entries.unindex(key, old[_TTL_MS])
                if group is None or by_ttl.get(ttl_ms) is not group:  # new, or emptied meanwhile
                    group = by_ttl.setdefault(ttl_ms, OrderedDict())
                group[key] = item
                if old is not None:
                    group.move_to_end(key)
                stored += 1
                nbytes += len(value)
                append(PutResult.STORED)
            counts["puts_total"] += n
            counts["stored_total"] += stored
            counts["written_bytes_total"] += nbytes
            # No sweep here: the sweeper thread expires in slices (expired entries read as absent).
            if entries.currsize > self.gc_start_bytes:
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
            old = self._live(key, self._entries[key], now)
            matches = old is None if expected is None else (old is not None and old[_VALUE] == expected)
            if not matches:
                return False, (None if old is None else StoredEntry(old[_VALUE], old[_VERSION]))
            item = (value, version, now + ttl_ms / 1000.0, ttl_ms, charged)
            self._write(key, old, item, now)
            self._counts["cas_swapped_total"] += 1
            self._counts["written_bytes_total"] += len(value)
            if self._entries.currsize > self.gc_start_bytes:
                self._gc_locked(now)
            return True, StoredEntry(value, version)

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove ``keys``; returns how many were present (expired ones included)."""
        deleted = 0
        with self._lock:
            n = 0
            entries = self._entries
            for key in keys:
                n += 1
                item = entries[key]
                if item is not None:
                    self._drop(key, item)
                    deleted += 1
            self._counts["deletes_total"] += n
            self._counts["deleted_total"] += deleted
        return deleted

    def expire(self, slice_steps: Optional[int] = None) -> int:
        """Drop every expired entry now; returns how many. The server's sweeper calls this
        periodically.

        The lock is held for at most ``slice_steps`` (default :data:`SWEEP_SLICE_STEPS`) steps
        at a time -- a TTL group looked at or an entry dropped -- and released between slices,
        so requests wait for one slice at most, however many groups or entries there are.
        """
        steps = SWEEP_SLICE_STEPS if slice_steps is None else max(1, int(slice_steps))
        total = 0
        with self._lock:
            self._sweep_todo = list(self._entries.by_ttl)
        while True:
            with self._lock:
                dropped, done = self._expire_slice(self._clock(), steps)
                self._counts["expired_total"] += dropped
            total += dropped
            if done:
                return total
            time.sleep(0)  # let waiting requests take the lock

    def _expire_slice(self, now: float, steps: int) -> Tuple[int, bool]:
        """One slice of a sweep (caller holds _lock): (entries dropped, sweep finished)."""
        by_ttl = self._entries.by_ttl
        todo = self._sweep_todo
        dropped = 0
        while todo and steps > 0:
            group = by_ttl.get(todo[-1])
            steps -= 1
            while group and steps > 0:
                key, item = next(iter(group.items()))
                if item[_EXPIRES_AT] > now:
                    group = None
                    break
                self._drop(key, item)
                dropped += 1
                steps -= 1
            if not group:  # this group is done (live front entry, or emptied)
                todo.pop()
        return dropped, not todo

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._entries = _Entries(self.capacity_bytes, self._counts)

    # -- introspection ---------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def used_bytes(self) -> int:
        """Charged bytes of the entries held (expired ones not yet swept included)."""
        with self._lock:
            return self._entries.currsize

    def stats(self) -> Dict[str, int]:
        """Gauges and counters: entries, used/capacity/watermark bytes, and the ``*_total`` counters."""
        with self._lock:
            out = dict(self._counts)
            out["entries"] = len(self._entries)
            out["used_bytes"] = self._entries.currsize
            out["ttl_groups"] = len(self._entries.by_ttl)
        out["capacity_bytes"] = self.capacity_bytes
        out["gc_start_bytes"] = self.gc_start_bytes
        out["gc_low_bytes"] = self.gc_low_bytes
        out["max_entry_bytes"] = self.max_entry_bytes
        out["entry_overhead_bytes"] = ENTRY_OVERHEAD_BYTES
        out["default_ttl_ms"] = self.default_ttl_ms
        return out

    # -- internals (caller holds _lock) -----------------------------------------------------

    def _write(self, key: bytes, old: Optional[_Item], item: _Item, now: float) -> None:
        """Store ``item`` under ``key`` (``old``: the live entry it replaces, or ``None``)."""
        entries = self._entries
        if entries.currsize + item[_CHARGED] > self.capacity_bytes:
            # Only a batch bigger than the room left above the GC start gets here. cachetools
            # evicts least-recently-modified entries to make room; drop expired ones first.
            self._expire_locked(now)
        # FIFOCache appends a new key and moves a rewritten one to the end: most recently modified.
        entries[key] = item
        ttl_ms = item[_TTL_MS]
        if old is not None and old[_TTL_MS] != ttl_ms:
            entries.unindex(key, old[_TTL_MS])
        group = entries.by_ttl.get(ttl_ms)
        if group is None:
            group = entries.by_ttl[ttl_ms] = OrderedDict()
        group[key] = item
        group.move_to_end(key)

    def _drop(self, key: bytes, item: _Item) -> None:
        del self._entries[key]
        self._entries.unindex(key, item[_TTL_MS])

    def _expire_locked(self, now: float) -> int:
        expired = 0
        by_ttl = self._entries.by_ttl
        for group in list(by_ttl.values()):
            # Within a group modification order is expiry order: stop at the first live entry.
            while group:
                key, item = next(iter(group.items()))
                if item[_EXPIRES_AT] > now:
                    break
                self._drop(key, item)
                expired += 1
        self._counts["expired_total"] += expired
        return expired

    def _gc_locked(self, now: float) -> None:
        self._counts["gc_runs_total"] += 1
        self._expire_locked(now)
        entries = self._entries
        while entries.currsize > self.gc_low_bytes:
            entries.popitem()  # the least recently modified entry, whatever its TTL (counts it)
