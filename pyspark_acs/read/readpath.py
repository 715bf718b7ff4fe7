"""Where a reader gets lengths and bytes: the paper's "File interface" on the read side.

A read path answers two questions for files of one cluster: how many bytes of a file are
readable now (its *published* length, always a block boundary once caches are in play, or
the raw durable length without them) and what those bytes are. :class:`DurableReadPath`
reads the durable store alone; the cache layer provides a read path with the same methods
that reads chunks from the data cache first and falls back to the store.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional, Protocol, Sequence

from pyspark_acs.storage.store import DurableStore

__all__ = [
    "DurableReadPath",
    "RateLimiter",
    "ReadPath",
    "open_read_path",
]


class ReadPath(Protocol):
    """What tail readers need from the storage of one cluster."""

    store: DurableStore

    def lengths(self, rels: Sequence[str]) -> Dict[str, Optional[int]]:
        """Readable lengths of files (``None``: the file does not exist), in one batched call."""

    def durable_length(self, rel: str) -> Optional[int]:
        """The durable store's own length of a file (``None`` if missing), bypassing caches."""

    def read(self, rel: str, start: int, end: int, *, postpone: bool = True) -> bytes:
        """Bytes ``[start, end)`` of a file; ``end`` must not exceed a length from ``lengths``.
        May stop short (a prefix) while the bytes are not readable yet; ``postpone=False``
        makes a cached path read past the cache length at once (and not wait for pushed
        bytes)."""

    def stats(self) -> Dict[str, int]:
        """Counters of where bytes came from."""

    def close(self) -> None:
        """Release connections and files."""


class DurableReadPath:
    """A read path over the durable store alone."""

    def __init__(self, store: DurableStore) -> None:
        self.store = store
        # _lock guards _stats (readers may run in several threads).
        self._lock = threading.Lock()
        self._stats = {"durable_bytes": 0, "durable_reads": 0}

    def lengths(self, rels: Sequence[str]) -> Dict[str, Optional[int]]:
        """Durable lengths of files in one batched call (``None``: the file does not exist)."""
        return self.store.lengths(list(rels))

    def durable_length(self, rel: str) -> Optional[int]:
        """The durable store's length of ``rel`` in bytes (``None`` if missing)."""
        return self.store.lengths([rel])[rel]

    def read(self, rel: str, start: int, end: int, *, postpone: bool = True) -> bytes:
        """Bytes ``[start, end)`` from the store (fewer only if the file is shorter); the store
        is read at once whatever ``postpone`` says. Thread-safe."""
        data = self.store.read(rel, start, end)
        with self._lock:
            self._stats["durable_bytes"] += len(data)
            self._stats["durable_reads"] += 1
        return data

    def stats(self) -> Dict[str, int]:
        """Counters since creation: ``durable_bytes`` and ``durable_reads``."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Close the store's open files."""
        self.store.close()


def open_read_path(
    root: "str | DurableStore",
    *,
    data_cache: Any = None,
    metadata_cache: Any = None,
    token: Optional[str] = None,
    poller: Any = None,
    push: bool = False,
    security: Any = None,
    tier_read_policy: Optional[str] = None,
    tier_preread: bool = True,
) -> "ReadPath":
    """The one read-path factory: through the caches when any is given, else the durable store.

    Parameters
    ----------
    root : str or DurableStore
        Durable store root (URI or path) of the cluster, or an open store. A reader never
        creates a root: a missing one raises :class:`~pyspark_acs.errors.RootNotFoundError`
        naming it (an open store is taken as it is).
    data_cache, metadata_cache : str or CacheClient, optional
        Cache endpoints (``host:port,...``) or clients of the same cluster.
    token : str, optional
        Shared token of token-protected cache servers (default ``$ACS_CACHE_TOKEN``).
    poller : LengthPoller, optional
        The process's shared length poller to take published lengths from when
        ``metadata_cache`` is a ready client (the copy daemon); endpoint strings find it alone.
    security : SecuritySettings, optional
        Token and TLS settings of the cache clients (default: the environment's,
        :func:`~pyspark_acs.security.resolve_security`).
    push : bool
        Tailing reader: have the data cache push the bytes of the files it reads
        (:class:`~pyspark_acs.cache.feed.ChunkFeed`). Lengths are pushed to every reader.
    tier_read_policy : str, optional
        Which tier a tiered file is read from: ``NOT_IN_DISK`` (default), ``NOT_IN_MEM`` or
        ``FORCE`` (no caches at all), see :mod:`pyspark_acs.storage.tier`.
    tier_preread : bool
        Pre-read from the secondary store with an AIMD window (default on).
    """
    from pyspark_acs.storage.store import open_store
    from pyspark_acs.storage.tier import DEFAULT_READ_POLICY, parse_read_policy, tiered_store

    policy = parse_read_policy(tier_read_policy or DEFAULT_READ_POLICY)
    # Every reader sees files in either tier by the same names (storage/tier.py TieredStore).
    store = tiered_store(open_store(root, create=False), policy, preread=tier_preread)
    if policy == "FORCE":
        return DurableReadPath(store)  # FORCE: tiered files from the secondary store, nothing from memory
    if data_cache or metadata_cache:
        from pyspark_acs.read.cachepath import CachedReadPath  # imports grpc: only when caches are used

        return CachedReadPath(store, data_cache=data_cache, metadata_cache=metadata_cache, token=token, poller=poller,
                              push=push, security=security)
    return DurableReadPath(store)


class RateLimiter:
    """A passive token bucket on bytes: ``acquire(n)`` sleeps so reads average ``rate`` bytes/s.

    Bursts up to one second's worth are allowed. ``rate=None`` disables the cap.
    """

    def __init__(self, rate: Optional[float]) -> None:
        self.rate = rate
        self._tokens = float(rate or 0)
        self._last = time.monotonic()
        self._lock = threading.Lock()  # guards _tokens and _last

    def acquire(self, n: int) -> None:
        """Take ``n`` bytes from the bucket, sleeping while it is in debt; a no-op without a rate.

        Thread-safe: the sleep happens outside the lock, in the calling thread.
        """
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
