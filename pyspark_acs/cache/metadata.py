"""The metadata cache: published lengths, shard heads and writer leases (paper sections 2.2, 3).

Keys (all in the metadata cache of one cluster):

- ``b"lc:" + file URI`` -> cache length, ``b"ld:" + file URI`` -> durable length. The value
  is the length as 8 big-endian bytes and the version is the length itself, so a replica
  never lets a length go backwards. Lengths are published only after every byte below them
  is written to that storage, and are always block boundaries.
- ``b"h:" + shard URI`` -> the shard's current (head) file name; version = its creation
  time in µs, so the head only moves forward.
- ``b"w:" + file or shard URI`` -> a writer lease (JSON :class:`~pyspark_acs.storage.leases.LeaseRecord`).
  Every compare-and-set of a lease carries a higher version than the record it replaces
  (:func:`lease_version`): consistent reads keep the highest version, so a replica that
  missed a swap can never make an old record win a read.

- ``b"lk:" + cluster + b"|" + file URI`` -> how far ``cluster`` (a destination) holds the
  source cluster's file durably, as a length (version = the length): the copy daemons confirm
  there, in the stream's source cluster, what each destination acknowledged
  (``acknowledge="clusters:K"``, :mod:`pyspark_acs.write.confirm`).
- ``b"lx:" + stream URI`` -> the stream's destinations (JSON list of cluster names), put by the
  source cluster's copy daemon from its topology; version = the put's time in µs.

A new writer *poisons* the lease of the old one; the old writer sees the poison at its next
check and stops; a writer that died without releasing is superseded after a short delay.
"""

from __future__ import annotations

import json
import random
import time
from typing import Dict, List, Optional, Sequence, Tuple

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.fanout import Entry
from pyspark_acs.errors import CacheError, LeasePoisonedError, WriterConflictError
from pyspark_acs.storage.leases import WRITER_LEASE_S, LeaseRecord
from pyspark_acs.format.names import parse_file_name

__all__ = [
    "LENGTH_TTL_S",
    "MetadataCache",
    "MetadataLease",
    "confirm_key",
    "head_key",
    "length_keys",
    "parse_length_key",
]

#: Metadata lives much longer than a file takes to roll over (paper: 24 h).
LENGTH_TTL_S = 24 * 3600.0


def _len_value(n: int) -> bytes:
    return n.to_bytes(8, "big")


#: Key prefixes of a file's published cache and durable lengths.
CACHE_LENGTH_PREFIX = b"lc:"
DURABLE_LENGTH_PREFIX = b"ld:"


def length_keys(uri: str) -> Tuple[bytes, bytes]:
    """The metadata keys of ``uri``'s published (cache length, durable length)."""
    b = uri.encode()
    return CACHE_LENGTH_PREFIX + b, DURABLE_LENGTH_PREFIX + b


def parse_length_key(key: bytes) -> Optional[Tuple[str, int]]:
    """``(uri, 0 for the cache length or 1 for the durable one)`` of a length key, else ``None``."""
    if key.startswith(CACHE_LENGTH_PREFIX):
        return key[len(CACHE_LENGTH_PREFIX):].decode(), 0
    if key.startswith(DURABLE_LENGTH_PREFIX):
        return key[len(DURABLE_LENGTH_PREFIX):].decode(), 1
    return None


def lease_version(current: Optional[Entry]) -> int:
    """The version of a lease record replacing ``current``: above it, and at least the wall
    clock in µs (so a record written after the entry expired still outranks stale copies)."""
    return max((current.version + 1) if current is not None else 1, time.time_ns() // 1000)


def confirm_key(uri: str, cluster: str) -> bytes:
    """The metadata key of how far ``cluster`` holds the (source cluster's) file ``uri`` durably."""
    return b"lk:" + cluster.encode() + b"|" + uri.encode()


def destinations_key(stream_uri: str) -> bytes:
    """The metadata key of the stream's destination clusters (the source's daemon puts it)."""
    return b"lx:" + stream_uri.encode()


def head_key(shard_uri: str) -> bytes:
    """The metadata key of the shard's head (its newest file's name)."""
    return b"h:" + shard_uri.encode()


def _head_item(shard_uri: str, file_name: str) -> Tuple[bytes, bytes, int]:
    """The put item recording ``file_name`` as the shard's head: versioned by the file's
    creation time (µs), so the head never moves backwards."""
    created = parse_file_name(file_name).created
    return (head_key(shard_uri), file_name.encode(), int(created.timestamp() * 1_000_000))


class MetadataCache:
    """Typed access to a cluster's metadata cache.

    Parameters
    ----------
    client : CacheClient
        Client of the metadata-cache replicas.
    """

    def __init__(self, client: CacheClient) -> None:
        self.client = client

    # -- lengths -------------------------------------------------------------------------

    def publish(self, uri: str, *, cache_length: Optional[int] = None, durable_length: Optional[int] = None) -> None:
        """Publish a file's cache and/or durable length (majority write)."""
        self.publish_many([(uri, cache_length, durable_length)])

    def publish_many(self, lengths: Sequence[Tuple[str, Optional[int], Optional[int]]],
                     heads: Sequence[Tuple[str, str]] = ()) -> None:
        """Publish ``(uri, cache length, durable length)`` of several files in one majority
        write (``None``: that length is not published), so readers see them move together;
        with ``heads``, ``(shard uri, file name)`` pairs recorded as by :meth:`set_head` in
        the same write."""
        items = [_head_item(shard_uri, file_name) for shard_uri, file_name in heads]
        for uri, cache_length, durable_length in lengths:
            lc, ld = length_keys(uri)
            if cache_length is not None:
                items.append((lc, _len_value(cache_length), cache_length))
            if durable_length is not None:
                items.append((ld, _len_value(durable_length), durable_length))
        if items:
            # Lengths are read from a majority or pushed: no grace for the third replica, the
            # writer's flush waits on this put (CacheClient.put's ``grace``).
            self.client.put(items, ttl=LENGTH_TTL_S, grace=False)

    def lengths(self, uris: Sequence[str]) -> Dict[str, Tuple[Optional[int], Optional[int]]]:
        """``{uri: (cache length, durable length)}`` in one batched consistent read (None = unknown)."""
        keys = []
        for u in uris:
            keys += length_keys(u)
        entries = self.client.get(keys, consistent=True) if keys else []
        out = {}
        for i, u in enumerate(uris):
            c, d = entries[2 * i], entries[2 * i + 1]
            out[u] = (c.version if c else None, d.version if d else None)
        return out

    # -- confirmations from other clusters -------------------------------------------------

    def confirm_many(self, items: Sequence[Tuple[str, str, int]]) -> None:
        """Record ``(file uri, cluster, durable length)`` confirmations (majority write; a
        length never goes backwards)."""
        if items:
            self.client.put([(confirm_key(u, c), _len_value(n), n) for u, c, n in items], ttl=LENGTH_TTL_S,
                            grace=False)

    def confirmations(self, uris: Sequence[str], clusters: Sequence[str]) -> Dict[str, Dict[str, int]]:
        """``{uri: {cluster: durable length}}`` of the clusters that confirmed any of ``uris``
        (one consistent read)."""
        pairs = [(u, c) for u in uris for c in clusters]
        entries = self.client.get([confirm_key(u, c) for u, c in pairs], consistent=True) if pairs else []
        out: Dict[str, Dict[str, int]] = {u: {} for u in uris}
        for (u, c), e in zip(pairs, entries):
            if e is not None:
                out[u][c] = e.version
        return out

    def set_destinations(self, stream_uri: str, clusters: Sequence[str]) -> None:
        """Record the stream's destination clusters (newest put wins)."""
        self.client.put([(destinations_key(stream_uri), json.dumps(sorted(clusters)).encode(),
                          time.time_ns() // 1000)], ttl=LENGTH_TTL_S)

    def destinations(self, stream_uri: str) -> Optional[List[str]]:
        """The stream's destination clusters as the source's copy daemon put them (None: never)."""
        entry = self.client.get([destinations_key(stream_uri)], consistent=True)[0]
        if entry is None:
            return None
        try:
            return [str(c) for c in json.loads(entry.value)]
        except (ValueError, TypeError):
            return None

    # -- shard heads -----------------------------------------------------------------------

    def set_head(self, shard_uri: str, file_name: str) -> None:
        """Record ``file_name`` as the shard's current file (never moves backwards)."""
        self.client.put([_head_item(shard_uri, file_name)], ttl=LENGTH_TTL_S)

    def heads(self, shard_uris: Sequence[str]) -> Dict[str, Optional[str]]:
        """``{shard uri: head file name or None}`` in one consistent read."""
        entries = self.client.get([head_key(u) for u in shard_uris], consistent=True) if shard_uris else []
        return {u: (e.value.decode() if e else None) for u, e in zip(shard_uris, entries)}

    def lease(self, uri: str, writer: str, what: str, seconds: float = WRITER_LEASE_S) -> "MetadataLease":
        """A :class:`MetadataLease` on ``uri`` for ``writer``."""
        return MetadataLease(self, uri, writer, what, seconds)


class MetadataLease:
    """A writer lease in the metadata cache, taken over by poisoning.

    Parameters
    ----------
    meta : MetadataCache
    uri : str
        What the lease protects (a file URI for copy writers, a shard URI for producers).
    writer : str
        Our writer id.
    what : str
        For messages.
    seconds : float
        Lease duration. The holder checks (and renews) it every ``check_interval`` =
        min(1 s, seconds / 3), so a poisoned holder stops within one check.
    """

    def __init__(self, meta: MetadataCache, uri: str, writer: str, what: str, seconds: float = WRITER_LEASE_S):
        self.meta = meta
        self.key = b"w:" + uri.encode()
        #: Names the lease in errors: the metadata-cache key of ``uri``'s lease.
        self._where = f"key w:{uri} of the metadata cache"
        self.writer = writer
        self.what = what
        self.seconds = seconds
        self.check_interval = min(1.0, seconds / 3)
        self.record: Optional[LeaseRecord] = None
        self._raw: Optional[bytes] = None
        self._entry: Optional[Entry] = None  # our record as last swapped in (value, version)
        self._checked = 0.0

    def _current(self) -> Optional[Entry]:
        return self.meta.client.get([self.key], consistent=True)[0]

    def _cas(self, current: Optional[Entry], record: LeaseRecord) -> bool:
        raw = record.encode()
        version = lease_version(current)
        swapped, _ = self.meta.client.compare_and_set(
            self.key, current.value if current is not None else None, raw, version=version, ttl=self.seconds * 4,
        )
        if swapped:
            self._raw = raw
            self._entry = Entry(raw, version)
        return swapped

    def acquire(self, timeout: Optional[float] = None) -> None:
        """Take the lease, poisoning a live holder and waiting for it to stop.

        The old holder releases at its next check (at most ``check_interval`` later); a
        holder that died is superseded once its poisoned lease has waited
        ``2 * check_interval`` (or its lease expired).

        The replicas of the key may disagree: a compare-and-set that reached only some of
        them (a replica past the deadline, two writers racing for a fresh key, one replica
        restarted) leaves a minority holding another value, and with two replicas a 1-1
        split has no majority value at all. Every round therefore walks the distinct values
        the replicas hold (each refused compare-and-set names one) and treats each like the
        consistent read's value, so the replicas converge on our record instead of every
        later writer being refused for as long as writers keep retrying.

        Raises
        ------
        WriterConflictError
            If the lease could not be taken within ``timeout`` (default 5 x check interval + 1 s).
        CacheError
            If the metadata cache is unavailable.
        """
        limit = time.monotonic() + (timeout if timeout is not None else 5 * self.check_interval + 1.0)
        #: poisoned record (raw) -> monotonic time it was first seen poisoned (or poisoned by us)
        poisoned_at: Dict[bytes, float] = {}
        # The first round takes the key as absent without reading it: a free lease (released,
        # expired, never taken: what every batch of a sink and every start of a producer meets)
        # is then one compare-and-set, not a consistent read and one. A key that is not free
        # refuses it and names its value, which the round goes on with as after a read; a
        # round that does not converge is followed at once by one that reads.
        optimistic = True
        since = time.time()  # in every round's record: a writer that starts later wins a race (_yields_to)
        while True:
            cur = None if optimistic else self._current()
            now = time.monotonic()
            mine = LeaseRecord.new(self.writer, self.seconds, since=since)
            if self._converge(cur, mine, poisoned_at, now):
                self.record = mine
                self._checked = time.monotonic()
                return
            if optimistic:
                optimistic = False
                continue
            if now >= limit:
                old = LeaseRecord.decode(cur.value, self._where) if cur else None
                holder = old.describe() if old else "another writer"
                raise WriterConflictError(f"{self.what}: could not take the lease from {holder}")
            # Jitter: two writers racing for a split key must not keep mirroring each other.
            time.sleep(min(0.05, self.check_interval / 4) * random.uniform(0.5, 1.5))

    def _takeable(self, raw: Optional[bytes], poisoned_at: Dict[bytes, float], now: float) -> bool:
        """Whether a value a replica holds may be replaced by our record now."""
        old = LeaseRecord.decode(raw, self._where)
        if old is None or not old.live():
            return True  # absent, released or expired
        if old.get("poisoned"):  # ours too: someone wants the lease, we do not snatch it back
            seen = poisoned_at.setdefault(raw, now)
            return now - seen >= 2 * self.check_interval
        return old.get("writer") == self.writer  # an earlier attempt of this same writer

    def _yields_to(self, old: LeaseRecord, mine: LeaseRecord) -> bool:
        """Whether this writer leaves ``old`` (a live, unpoisoned record of another writer)
        alone instead of poisoning it: ``old``'s writer began to acquire after this one did,
        within one lease duration (a race, not a holder that has held the lease for a while),
        ties broken by writer id. The newest writer wins, as in a takeover: otherwise two
        writers racing for one key over two replicas each take one replica and poison the
        other's record round after round
        (test_two_writers_racing_for_fresh_keys_never_wedge_them)."""
        theirs = (float(old.get("since", 0.0)), str(old.get("writer")))
        ours = (float(mine["since"]), str(mine["writer"]))
        return theirs > ours and theirs[0] - ours[0] < self.seconds

    def _converge(self, cur: Optional[Entry], mine: LeaseRecord, poisoned_at: Dict[bytes, float], now: float) -> bool:
        """One round: replace (or poison) every value the replicas hold, starting with ``cur``;
        True once a majority holds ``mine``."""
        raw = mine.encode()
        version = lease_version(cur)
        expected: Optional[bytes] = cur.value if cur is not None else None
        tried = set()
        wrote_mine = False
        while expected not in tried and expected != raw:
            tried.add(expected)
            if self._takeable(expected, poisoned_at, now):
                write = raw
                wrote_mine = True
            else:
                old = LeaseRecord.decode(expected, self._where)
                if old.get("poisoned"):
                    break  # its holder still has time to stop
                if self._yields_to(old, mine):
                    break  # a writer racing us that started later: it takes the lease
                write = LeaseRecord(old, poisoned=True).encode()
                poisoned_at.setdefault(write, now)
            swapped, best = self.meta.client.compare_and_set(
                self.key, expected, write, version=version, ttl=self.seconds * 4
            )
            if swapped and write is raw:
                self._raw = raw
                self._entry = Entry(raw, version)
                return True
            # A refusing replica holds best (the client reports what it wrote itself when the
            # refusers hold nothing): go on with that value.
            held = best.value if best is not None else None
            expected = None if held == write else held
        if not wrote_mine:
            return False
        # Replicas earlier steps of this round swapped hold our record: a majority of them?
        swapped, _ = self.meta.client.compare_and_set(self.key, raw, raw, version=version, ttl=self.seconds * 4)
        if swapped:
            self._raw = raw
            self._entry = Entry(raw, version)
        return swapped

    def due(self) -> bool:
        """True when the lease should be checked again."""
        return time.monotonic() - self._checked >= self.check_interval

    def check(self) -> None:
        """Verify the lease is still ours and unpoisoned, and extend it.

        Raises
        ------
        LeasePoisonedError
            A newer writer poisoned or took the lease: stop writing now.
        """
        try:
            cur = self._current()
        except CacheError:
            # Metadata cache unreachable: writes go on (availability first); try again after
            # one check interval rather than on every write.
            self._checked = time.monotonic()
            raise
        if cur is None and self.record is not None:
            # The entry is gone, not released (a released lease holds b""): the replicas were
            # wiped (restarted) or evicted it. Nobody poisoned us: put our lease back.
            renewed = LeaseRecord(self.record, expires=time.time() + self.seconds)
            if self._cas(None, renewed):
                self.record = renewed
                self._checked = time.monotonic()
                return
            cur = self._current()  # someone else took it meanwhile
        rec = LeaseRecord.decode(cur.value, self._where) if cur else None
        if self.record is None or not self.record.same_holder(rec) or (rec and rec.get("poisoned")):
            if rec is not None and self.record is not None and self.record.same_holder(rec):
                # Poisoned: hand the lease over at once by deleting our poisoned record.
                self.meta.client.compare_and_set(self.key, cur.value, b"", version=lease_version(cur), ttl=0.001)
            self.record = None
            raise LeasePoisonedError(f"{self.what}: a newer writer took over; this writer stops")
        renewed = LeaseRecord(self.record, expires=time.time() + self.seconds)
        if self._cas(cur, renewed):
            self.record = renewed
        self._checked = time.monotonic()

    def release(self) -> None:
        """Give the lease up if it is still ours (best effort)."""
        if self.record is None or self._raw is None:
            return
        try:
            self.meta.client.compare_and_set(self.key, self._raw, b"", version=lease_version(self._entry), ttl=0.001)
        except CacheError:
            pass  # the lease expires by itself
        self.record = None
