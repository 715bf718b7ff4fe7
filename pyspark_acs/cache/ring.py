"""Consistent hashing of cache keys onto cache server endpoints.

Each endpoint owns :data:`DEFAULT_VNODES` points on a 64-bit ring (virtual nodes), placed by a
stable hash (:func:`hashlib.blake2b`, 8-byte digest) of ``"<endpoint>#<i>"``. A key hashes to a
point; its replicas are the first ``r`` *distinct* endpoints met walking clockwise from there.
Because keys are hashed whole, the chunk keys of one file land all over the ring, so the chunks
of one file spread over every replica (as in the paper, section 2.2).

The hash does not depend on the process (unlike :func:`hash`), so every producer, consumer and
copy daemon that is given the same endpoint list agrees on where a key lives. Adding one endpoint
to ``n`` moves about ``1/(n+1)`` of the keys' primary replicas.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Dict, Iterable, List, Sequence, Tuple

__all__ = [
    "DEFAULT_VNODES",
    "HashRing",
]

#: Virtual nodes per endpoint: with 128, each endpoint's share of the keys stays within about
#: +-15 % of the mean for small clusters, and the ring table stays tiny (384 points for 3 servers).
DEFAULT_VNODES = 128

#: Keys whose replicas :meth:`HashRing.replicas_for_many` remembers (per replication factor),
#: about 100 bytes each.
MEMO_KEYS = 32768

_DIGEST_BYTES = 8


def key_hash(data: bytes) -> int:
    """The ring position (unsigned 64-bit) of ``data``; stable across processes and machines."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest(), "big")


class HashRing:
    """An immutable consistent-hash ring over ``endpoints``.

    Parameters
    ----------
    endpoints : sequence of str
        Distinct ``host:port`` strings. Order does not matter: two rings over the same set are
        identical.
    vnodes : int, default DEFAULT_VNODES
        Virtual nodes per endpoint.

    Raises
    ------
    ValueError
        If ``endpoints`` is empty, holds duplicates, or ``vnodes < 1``.
    """

    __slots__ = ("_endpoints", "_vnodes", "_points", "_owners", "_tables", "_memo")

    def __init__(self, endpoints: Iterable[str], *, vnodes: int = DEFAULT_VNODES) -> None:
        eps = tuple(endpoints)
        if not eps:
            raise ValueError("HashRing needs at least one endpoint")
        if len(set(eps)) != len(eps):
            raise ValueError(f"HashRing endpoints must be distinct, got {list(eps)}")
        if vnodes < 1:
            raise ValueError(f"HashRing vnodes must be >= 1, got {vnodes}")
        self._endpoints = eps
        self._vnodes = vnodes
        ring = sorted(
            (key_hash(f"{ep}#{i}".encode()), ep) for ep in sorted(eps) for i in range(vnodes)
        )
        self._points: List[int] = [p for p, _ in ring]
        self._owners: List[str] = [ep for _, ep in ring]
        # Per replica count r: for every ring position, the r distinct endpoints met clockwise
        # from it. Built lazily; the ring is immutable, so a plain dict write is race-free enough
        # (two threads may build the same table; both results are equal).
        self._tables: Dict[int, List[Tuple[str, ...]]] = {}
        # Per r: key -> replicas. Plain dicts: single operations are atomic under the GIL.
        self._memo: Dict[int, Dict[bytes, Tuple[str, ...]]] = {}

    @property
    def endpoints(self) -> Tuple[str, ...]:
        """The endpoints, in the order given."""
        return self._endpoints

    @property
    def vnodes(self) -> int:
        """Virtual nodes per endpoint."""
        return self._vnodes

    def __len__(self) -> int:
        return len(self._endpoints)

    def __repr__(self) -> str:
        return f"HashRing({list(self._endpoints)!r}, vnodes={self._vnodes})"

    def _table(self, r: int) -> List[Tuple[str, ...]]:
        table = self._tables.get(r)
        if table is None:
            owners = self._owners
            size = len(owners)
            table = []
            for start in range(size):
                picked: List[str] = []
                i = start
                while len(picked) < r:
                    ep = owners[i % size]
                    if ep not in picked:
                        picked.append(ep)
                    i += 1
                table.append(tuple(picked))
            self._tables[r] = table
        return table

    def replicas_for(self, key: bytes, r: int) -> Tuple[str, ...]:
        """The ``r`` distinct endpoints holding ``key``, primary first.

        Fewer than ``r`` when the ring has fewer endpoints.

        Parameters
        ----------
        key : bytes
            The cache key.
        r : int
            Replication factor (>= 1).
        """
        if r < 1:
            raise ValueError(f"replication must be >= 1, got {r}")
        r = min(r, len(self._endpoints))
        table = self._table(r)
        index = bisect.bisect_left(self._points, key_hash(key))
        return table[index if index < len(table) else 0]

    def replicas_for_many(self, keys: Sequence[bytes], r: int) -> List[Tuple[str, ...]]:
        """:meth:`replicas_for` for each of ``keys``.

        Results are memoized (up to :data:`MEMO_KEYS` keys per ``r``, then the memo starts
        over): the metadata poller asks for the same few keys every few milliseconds, and a
        blake2b per key is most of the cost here.
        """
        if r < 1:
            raise ValueError(f"replication must be >= 1, got {r}")
        r = min(r, len(self._endpoints))
        memo = self._memo.get(r)
        if memo is None:
            memo = self._memo.setdefault(r, {})
        if len(memo) > MEMO_KEYS:
            memo.clear()  # racing threads may each clear or refill it: both are harmless
        table = self._table(r)
        points = self._points
        size = len(table)
        blake = hashlib.blake2b
        find = bisect.bisect_left
        out = []
        append = out.append
        for key in keys:
            reps = memo.get(key)
            if reps is None:
                index = find(points, int.from_bytes(blake(key, digest_size=_DIGEST_BYTES).digest(), "big"))
                reps = memo[key] = table[index if index < size else 0]
            append(reps)
        return out

    def primary(self, key: bytes) -> str:
        """The first replica of ``key``."""
        return self.replicas_for(key, 1)[0]
