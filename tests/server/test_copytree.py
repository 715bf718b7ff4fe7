"""Tests of the copy tree builder (pyspark_acs.server.copy.tree)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspark_acs.errors import TopologyError
from pyspark_acs.server.copy.tree import CopyTree, Reparent, build_copy_tree, diff
from pyspark_acs.server.copy.topology import load_topology, parse_topology

from tests.helpers import ROOT

EXAMPLES = Path(ROOT) / "examples"


def make(links, destinations, *, source="A", clusters=None, tree=None, unhealthy=(), **settings_):
    """Build a topology with one stream 'orders' from ``links`` = [(a, b, cost[, directed])]."""
    names = set(clusters or ()) | {source} | set(destinations)
    for link in links:
        names.update(link[:2])
    data = {
        "clusters": {
            n: {
                "root": f"/tmp/acs-test/{n}",
                "data_cache": "127.0.0.1:1",
                "metadata_cache": "127.0.0.1:2",
                "copy_daemon": "127.0.0.1:3",
                "healthy": n not in unhealthy,
            }
            for n in sorted(names)
        },
        "links": [
            {"from": a, "to": b, "cost": c, "directed": bool(rest and rest[0])} for a, b, c, *rest in links
        ],
        "streams": {"orders": {"source": source, "destinations": list(destinations)}},
    }
    if tree is not None:
        data["streams"]["orders"]["tree"] = tree
    if settings_:
        data["settings"] = settings_
    return parse_topology(data, source="<test>")


def parents(tree: CopyTree) -> dict:
    return dict(tree.parents)


# ------------------------------------------------------------------ shapes


def test_chain_when_costs_favour_it():
    topo = make([("A", "B", 1), ("B", "C", 1), ("A", "C", 5)], ["B", "C"])
    assert parents(build_copy_tree(topo, "orders")) == {"B": "A", "C": "B"}


def test_star_when_costs_favour_it():
    topo = make([("A", "B", 1), ("B", "C", 5), ("A", "C", 1)], ["B", "C"])
    assert parents(build_copy_tree(topo, "orders")) == {"B": "A", "C": "A"}


def test_example_file_tree():
    topo = load_topology(EXAMPLES / "topology.toml")
    tree = build_copy_tree(topo, "orders")
    assert tree.hops() == [("A", "B"), ("B", "C")]
    assert tree.render() == "stream orders (source A)\nA\n└── B  cost 1\n    └── C  cost 1\n"


def test_accessors_and_render():
    topo = make([("A", "B", 1), ("B", "C", 1), ("A", "D", 5), ("C", "D", 10)], ["B", "C", "D"])
    tree = build_copy_tree(topo, "orders")
    assert tree.render() == (
        "stream orders (source A)\n"
        "A\n"
        "├── B  cost 1\n"
        "│   └── C  cost 1\n"
        "└── D  cost 5\n"
    )
    assert tree.parent("A") is None and tree.parent("C") == "B"
    assert tree.children("A") == ("B", "D") and tree.children("C") == ()
    assert tree.depth("A") == 0 and tree.depth("C") == 2
    assert tree.path("C") == ("A", "B", "C")
    assert tree.hops() == [("A", "B"), ("B", "C"), ("A", "D")]
    assert tree.clusters == ("A", "B", "C", "D")
    assert tree.cost("D") == 5 and tree.total_cost() == 7
    d = tree.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["parents"] == {"B": "A", "C": "B", "D": "A"}
    assert d["hops"][1] == {"from": "B", "to": "C", "cost": 1, "depth": 2}
    with pytest.raises(KeyError, match="'Z' is not in the copy tree of stream 'orders'"):
        tree.parent("Z")
    assert hash(tree) == hash(build_copy_tree(topo, "orders"))
    assert tree == build_copy_tree(topo, "orders")


def test_render_is_deterministic_whatever_the_link_order():
    links = [("A", "B", 1), ("A", "C", 1), ("B", "C", 1), ("C", "D", 1), ("B", "D", 1)]
    renders = {
        build_copy_tree(make(list(perm), ["D", "C", "B"]), "orders").render()
        for perm in itertools.permutations(links)
    }
    assert len(renders) == 1
    # Ties: shallower parent first, then names (A feeds B and C, B < C feeds D).
    assert renders.pop() == "stream orders (source A)\nA\n├── B  cost 1\n│   └── D  cost 1\n└── C  cost 1\n"


# ------------------------------------------------------------------ limits


def test_depth_limit_turns_chain_into_star():
    links = [("A", "B", 1), ("B", "C", 1), ("C", "D", 1), ("A", "C", 10), ("A", "D", 10)]
    topo = make(links, ["B", "C", "D"])
    assert parents(build_copy_tree(topo, "orders")) == {"B": "A", "C": "B", "D": "C"}
    assert parents(build_copy_tree(topo, "orders", max_depth=2)) == {"B": "A", "C": "B", "D": "A"}
    assert parents(build_copy_tree(topo, "orders", max_depth=1)) == {"B": "A", "C": "A", "D": "A"}


def test_settings_in_file_are_the_defaults():
    links = [("A", "B", 1), ("B", "C", 1), ("A", "C", 10)]
    topo = make(links, ["B", "C"], max_depth=1)
    tree = build_copy_tree(topo, "orders")
    assert parents(tree) == {"B": "A", "C": "A"} and tree.max_depth == 1


def test_fanout_limit():
    links = [("A", "B", 1), ("A", "C", 1), ("A", "D", 1), ("B", "C", 5), ("B", "D", 6), ("C", "D", 5)]
    topo = make(links, ["B", "C", "D"])
    assert parents(build_copy_tree(topo, "orders")) == {"B": "A", "C": "A", "D": "A"}
    tree = build_copy_tree(topo, "orders", max_fanout=1)
    assert parents(tree) == {"B": "A", "C": "B", "D": "C"}
    assert all(len(tree.children(c)) <= 1 for c in tree.clusters)


def test_depth_limit_unplaceable_says_so():
    topo = make([("A", "B", 1), ("B", "C", 1)], ["B", "C"])
    with pytest.raises(TopologyError, match=r"destination 'C' is 2 hops from source 'A' at best, more than max_depth=1"):
        build_copy_tree(topo, "orders", max_depth=1)


def test_fanout_limit_unplaceable_says_so():
    topo = make([("A", "B", 1), ("A", "C", 1)], ["B", "C"])
    with pytest.raises(TopologyError, match=r"cannot place destination 'C'.*A already feed max_fanout=1"):
        build_copy_tree(topo, "orders", max_fanout=1)


def test_bad_limits_refused():
    topo = make([("A", "B", 1)], ["B"])
    with pytest.raises(TopologyError, match="max_depth must be a whole number >= 1"):
        build_copy_tree(topo, "orders", max_depth=0)


# ------------------------------------------------------------------ relays


def test_relay_used_only_when_needed_and_noted():
    topo = make([("A", "R", 1), ("R", "B", 1), ("A", "C", 1)], ["B", "C"])
    tree = build_copy_tree(topo, "orders")
    assert parents(tree) == {"R": "A", "B": "R", "C": "A"}
    assert tree.relays == frozenset({"R"})
    assert any("relay R carries the stream to B: no cluster in the tree has a link to B" in n for n in tree.notes)
    assert "B  cost 1" in tree.render() and "R  cost 1  [relay]" in tree.render()


def test_relay_not_used_when_direct_link_exists():
    topo = make([("A", "R", 1), ("R", "B", 1), ("A", "B", 10)], ["B"])
    tree = build_copy_tree(topo, "orders")
    assert parents(tree) == {"B": "A"} and tree.relays == frozenset()


def test_relay_when_limits_block_direct_hops():
    # A may feed one cluster; B only via A or via relay R... R itself must hang off B.
    topo = make([("A", "B", 1), ("A", "C", 1), ("B", "R", 1), ("R", "C", 1)], ["B", "C"])
    tree = build_copy_tree(topo, "orders", max_fanout=1)
    assert parents(tree) == {"B": "A", "R": "B", "C": "R"}
    assert any("at the depth or fan-out limit" in n for n in tree.notes)


# ------------------------------------------------------------------ health


def test_unhealthy_b_becomes_leaf_and_c_fed_from_a():
    topo = load_topology(EXAMPLES / "topology.json")
    healthy = build_copy_tree(topo, "orders")
    tree = build_copy_tree(topo, "orders", unhealthy_clusters={"B"})
    assert parents(tree) == {"B": "A", "C": "A"}
    assert tree.unhealthy == frozenset({"B"}) and tree.children("B") == ()
    assert "B  cost 1  [unhealthy]" in tree.render()
    assert diff(healthy, tree) == [Reparent("C", "B", "A")]
    assert diff(tree, healthy) == [Reparent("C", "A", "B")]
    assert diff(tree, tree) == []


def test_unhealthy_in_file():
    topo = make([("A", "B", 1), ("B", "C", 1), ("A", "C", 5)], ["B", "C"], unhealthy={"B"})
    assert parents(build_copy_tree(topo, "orders")) == {"B": "A", "C": "A"}


def test_unhealthy_link():
    topo = make([("A", "B", 1), ("B", "C", 1), ("A", "C", 5)], ["B", "C"])
    tree = build_copy_tree(topo, "orders", unhealthy_links={("C", "B")})
    assert parents(tree) == {"B": "A", "C": "A"}


def test_new_destination_starts_as_leaf():
    topo = make([("A", "B", 1), ("B", "C", 1), ("A", "C", 5)], ["B", "C"])
    tree = build_copy_tree(topo, "orders", leaves_first={"B"})
    assert parents(tree) == {"B": "A", "C": "A"}
    assert tree.new == frozenset({"B"}) and "[new]" in tree.render()


def test_unhealthy_cluster_still_relays_when_it_is_the_only_way():
    topo = make([("A", "B", 1), ("B", "C", 1)], ["B", "C"])
    tree = build_copy_tree(topo, "orders", unhealthy_clusters={"B"})
    assert parents(tree) == {"B": "A", "C": "B"}
    assert any("C is fed by penalised B" in n for n in tree.notes)


def test_child_moved_to_healthy_parent_that_joined_later():
    # Prim must place C and D under unhealthy B (nothing healthy reaches them), C first
    # (cheaper). D can then feed C (directed link), so the last pass moves C under D.
    topo = make([("A", "B", 1), ("B", "C", 1), ("B", "D", 2), ("D", "C", 1, True)], ["B", "C", "D"])
    tree = build_copy_tree(topo, "orders", unhealthy_clusters={"B"})
    assert parents(tree) == {"B": "A", "D": "B", "C": "D"}


def test_unhealthy_takes_parent_slot_last():
    # A can feed two; healthy C and D get A's slots, unhealthy B hangs below C.
    links = [("A", "B", 1), ("A", "C", 2), ("A", "D", 2), ("C", "B", 3)]
    topo = make(links, ["B", "C", "D"])
    tree = build_copy_tree(topo, "orders", unhealthy_clusters={"B"}, max_fanout=2)
    assert parents(tree) == {"C": "A", "D": "A", "B": "C"}


def test_bad_arguments():
    topo = make([("A", "B", 1), ("B", "C", 1)], ["B", "C"])
    with pytest.raises(TopologyError, match=r"unknown stream 'nope'"):
        build_copy_tree(topo, "nope")
    with pytest.raises(TopologyError, match=r"unknown cluster 'Z'"):
        build_copy_tree(topo, "orders", unhealthy_clusters={"Z"})
    with pytest.raises(TopologyError, match=r"unhealthy link A-C: no such link"):
        build_copy_tree(topo, "orders", unhealthy_links=[("A", "C")])


# ------------------------------------------------------------------ explicit trees


def test_explicit_tree_overrides_prim_and_health():
    links = [("A", "B", 1), ("B", "C", 1), ("A", "C", 5)]
    topo = make(links, ["B", "C"], tree={"B": "A", "C": "A"})
    tree = build_copy_tree(topo, "orders", unhealthy_clusters={"C"})
    assert parents(tree) == {"B": "A", "C": "A"} and tree.explicit
    assert tree.render().startswith("stream orders (source A, explicit tree)\nA\n├── B  cost 1\n└── C  cost 5  [unhealthy]\n")
    with pytest.raises(TopologyError, match=r"streams.orders.tree: 'A' feeds 2 clusters, more than max_fanout=1"):
        build_copy_tree(topo, "orders", max_fanout=1)


def test_diff_added_and_removed_clusters():
    small = build_copy_tree(make([("A", "B", 1), ("B", "C", 1)], ["B"]), "orders")
    big = build_copy_tree(make([("A", "B", 1), ("B", "C", 1)], ["B", "C"]), "orders")
    assert diff(small, big) == [Reparent("C", None, "B")]
    assert diff(big, small) == [Reparent("C", "B", None)]


# ------------------------------------------------------------------ properties


@st.composite
def graphs(draw, max_nodes=6):
    """A random connected undirected graph: (names, {frozenset(pair): cost})."""
    n = draw(st.integers(2, max_nodes))
    names = [chr(ord("A") + i) for i in range(n)]
    edges = {}
    for i in range(1, n):  # a random spanning tree keeps the graph connected
        j = draw(st.integers(0, i - 1))
        edges[frozenset((names[i], names[j]))] = draw(st.integers(0, 9))
    for a, b in itertools.combinations(names, 2):
        if frozenset((a, b)) not in edges and draw(st.booleans()):
            edges[frozenset((a, b))] = draw(st.integers(0, 9))
    return names, edges


def topo_of(names, edges, destinations, source="A"):
    links = [(*sorted(pair), cost) for pair, cost in sorted(edges.items(), key=lambda kv: sorted(kv[0]))]
    return make(links, destinations, source=source, clusters=names)


def check_tree(tree, topo, destinations, max_depth, max_fanout):
    spec_dest = set(destinations)
    assert tree.source == "A" and tree.parent("A") is None
    assert spec_dest <= set(tree.parents)
    assert set(tree.parents) - spec_dest == set(tree.relays)
    arcs = topo.arcs()
    for parent, child in tree.hops():
        assert child in arcs[parent]
        assert tree.cost(child) == arcs[parent][child]
    for cluster in tree.clusters:
        assert tree.path(cluster)[0] == "A"  # rooted, no cycles (path terminates)
        assert tree.depth(cluster) <= max_depth
        assert len(tree.children(cluster)) <= max_fanout
        # A relay is only kept when it leads to a destination.
        if cluster in tree.relays:
            assert tree.children(cluster)


def brute_force_min_cost(names, edges):
    """Cheapest spanning tree by trying every parent choice for every non-source node."""
    others = names[1:]
    options = [[p for p in names if p != c and frozenset((p, c)) in edges] for c in others]
    best = None
    for choice in itertools.product(*options):
        parent = dict(zip(others, choice))
        ok = True
        for start in others:
            seen, node = set(), start
            while node != "A" and ok:
                if node in seen:
                    ok = False
                seen.add(node)
                node = parent[node]
            if not ok:
                break
        if ok:
            cost = sum(edges[frozenset((c, p))] for c, p in parent.items())
            best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_prim_is_minimal_when_no_limit_binds(graph):
    names, edges = graph
    topo = topo_of(names, edges, names[1:])
    tree = build_copy_tree(topo, "orders", max_depth=len(names), max_fanout=len(names))
    check_tree(tree, topo, names[1:], len(names), len(names))
    assert tree.total_cost() == brute_force_min_cost(names, edges)


@settings(max_examples=400, deadline=None)
@given(graphs(max_nodes=8), st.data())
def test_random_graphs_give_valid_trees_or_name_the_limit(graph, data):
    names, edges = graph
    destinations = data.draw(st.lists(st.sampled_from(names[1:]), unique=True), label="destinations")
    max_depth = data.draw(st.integers(1, 5), label="max_depth")
    max_fanout = data.draw(st.integers(1, 4), label="max_fanout")
    unhealthy = data.draw(st.sets(st.sampled_from(names)), label="unhealthy")
    topo = topo_of(names, edges, destinations)
    try:
        tree = build_copy_tree(
            topo, "orders", max_depth=max_depth, max_fanout=max_fanout, unhealthy_clusters=unhealthy
        )
    except TopologyError as exc:
        assert "max_depth" in str(exc) or "max_fanout" in str(exc)
        return
    check_tree(tree, topo, destinations, max_depth, max_fanout)
    assert build_copy_tree(
        topo, "orders", max_depth=max_depth, max_fanout=max_fanout, unhealthy_clusters=unhealthy
    ).render() == tree.render()
    # No unhealthy cluster feeds a child that a healthy cluster of the tree could feed instead.
    arcs = topo.arcs()
    for parent, child in tree.hops():
        if parent not in unhealthy:
            continue
        below = {c for c in tree.clusters if child in tree.path(c)}
        height = max(tree.depth(c) for c in below) - tree.depth(child)
        for cand in tree.clusters:
            if cand in unhealthy or cand in below or child not in arcs[cand]:
                continue
            assert (
                len(tree.children(cand)) >= max_fanout or tree.depth(cand) + 1 + height > max_depth
            ), f"{child} fed by unhealthy {parent} though {cand} could feed it"
