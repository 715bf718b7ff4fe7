"""Consistent hashing: distinct replicas, stability, balance, minimal movement."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_acs.cache.ring import DEFAULT_VNODES, HashRing, key_hash


def endpoints(n: int, base: int = 7000) -> list:
    return [f"127.0.0.1:{base + i}" for i in range(n)]


keys_strategy = st.lists(st.binary(min_size=0, max_size=64), min_size=1, max_size=50)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), r=st.integers(1, 5), keys=keys_strategy)
def test_replicas_are_distinct_and_capped_by_ring_size(n, r, keys):
    ring = HashRing(endpoints(n))
    for key in keys:
        reps = ring.replicas_for(key, r)
        assert len(reps) == min(r, n)
        assert len(set(reps)) == len(reps)
        assert set(reps) <= set(ring.endpoints)
        assert reps[0] == ring.primary(key)
    assert ring.replicas_for_many(keys, r) == [ring.replicas_for(k, r) for k in keys]


@settings(max_examples=40, deadline=None)
@given(eps=st.lists(st.integers(1, 65535), min_size=1, max_size=8, unique=True), data=st.data())
def test_placement_ignores_endpoint_order_and_process(eps, data):
    names = [f"10.0.0.1:{p}" for p in eps]
    shuffled = data.draw(st.permutations(names))
    a, b = HashRing(names), HashRing(shuffled)
    keys = data.draw(keys_strategy)
    assert [a.replicas_for(k, 3) for k in keys] == [b.replicas_for(k, 3) for k in keys]


def test_hash_and_placement_are_fixed_values():
    # Every process and machine must agree (blake2b, not the per-process salted hash()):
    # these constants may only change together with a documented re-sharding.
    assert key_hash(b"/root/s/00000/f.acs#0") == 0xF2561A2B599D42DD
    ring = HashRing(endpoints(3))
    assert ring.replicas_for(b"/root/s/00000/f.acs#0", 3) == (
        "127.0.0.1:7000", "127.0.0.1:7002", "127.0.0.1:7001")


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 10), salt=st.binary(min_size=1, max_size=8))
def test_adding_a_node_moves_about_one_over_n_of_the_keys(n, salt):
    keys = [salt + b"#%d" % i for i in range(4000)]
    before = HashRing(endpoints(n))
    after = HashRing(endpoints(n + 1))
    new = endpoints(n + 1)[-1]
    moved = 0
    for key in keys:
        old_primary, new_primary = before.primary(key), after.primary(key)
        if old_primary != new_primary:
            moved += 1
            assert new_primary == new, "a key may only move to the new node"
    expected = len(keys) / (n + 1)
    assert 0.5 * expected <= moved <= 1.6 * expected, (moved, expected)
    # replica sets change minimally too: each key gains at most the new node
    for key in keys[:500]:
        diff = set(after.replicas_for(key, 3)) - set(before.replicas_for(key, 3))
        assert diff <= {new}


@pytest.mark.parametrize("n", [3, 5, 8])
def test_keys_of_one_file_spread_evenly(n):
    ring = HashRing(endpoints(n))
    counts = collections.Counter(ring.primary(b"/root/stream/00003/20260101T000000Z-w.acs#%d" % i)
                                 for i in range(20000))
    assert set(counts) == set(ring.endpoints)
    mean = 20000 / n
    assert all(0.7 * mean <= c <= 1.3 * mean for c in counts.values()), counts
    # with r = 3, each server holds ~3/n of the chunks
    held = collections.Counter(ep for i in range(3000) for ep in ring.replicas_for(b"c#%d" % i, 3))
    assert all(0.7 * 3000 * min(3, n) / n <= c <= 1.3 * 3000 * min(3, n) / n for c in held.values())


def test_bad_rings_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        HashRing([])
    with pytest.raises(ValueError, match="distinct"):
        HashRing(["a:1", "a:1"])
    with pytest.raises(ValueError, match="replication"):
        HashRing(["a:1"]).replicas_for(b"k", 0)
    assert len(HashRing(["a:1"])) == 1 and HashRing(["a:1"]).vnodes == DEFAULT_VNODES
