"""Tests of the topology file loader (pyspark_acs.server.copy.topology)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from pyspark_acs.errors import AcsError, TopologyError
from pyspark_acs.server.copy.topology import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_FANOUT,
    Cluster,
    Link,
    StreamSpec,
    Topology,
    load_topology,
    parse_topology,
)

from tests.helpers import ROOT

EXAMPLES = Path(ROOT) / "examples"


def cluster(i: int) -> dict:
    return {
        "root": f"/tmp/acs-test/{i}",
        "data_cache": f"127.0.0.1:{7000 + i}",
        "metadata_cache": f"127.0.0.1:{7100 + i}",
        "copy_daemon": f"127.0.0.1:{7200 + i}",
    }


def base() -> dict:
    """A valid three-cluster topology that each bad case below breaks in one place."""
    return {
        "clusters": {"A": cluster(1), "B": cluster(2), "C": cluster(3)},
        "links": [
            {"from": "A", "to": "B", "cost": 1},
            {"from": "B", "to": "C", "cost": 1},
        ],
        "streams": {"orders": {"source": "A", "destinations": ["B", "C"]}},
    }


# ------------------------------------------------------------------ good files


def test_example_files_load_and_agree():
    from_json = load_topology(EXAMPLES / "topology.json")
    from_toml = load_topology(EXAMPLES / "topology.toml")
    assert sorted(from_json.clusters) == ["A", "B", "C"]
    assert from_json.clusters == from_toml.clusters
    assert from_json.links == from_toml.links
    assert from_json.streams == from_toml.streams
    a = from_json.clusters["A"]
    assert a.root == "/tmp/acs-demo/A"
    assert a.data_cache == ("127.0.0.1:7101", "127.0.0.1:7102", "127.0.0.1:7103")
    assert a.copy_daemon == "127.0.0.1:7121"
    assert a.healthy is True
    orders = from_json.streams["orders"]
    assert orders == StreamSpec(name="orders", source="A", destinations=("B", "C"), shards=4)
    assert from_json.origin.endswith("topology.json")


def test_defaults_and_types():
    topo = parse_topology(base(), source="<t>")
    assert isinstance(topo, Topology)
    assert topo.max_depth == DEFAULT_MAX_DEPTH == 4
    assert topo.max_fanout == DEFAULT_MAX_FANOUT == 8
    assert topo.origin == "<t>"
    assert topo.clusters["B"] == Cluster("B", "/tmp/acs-test/2", ("127.0.0.1:7002",), ("127.0.0.1:7102",), "127.0.0.1:7202")
    assert topo.links[0] == Link("A", "B", 1)
    assert topo.streams["orders"].shards is None
    assert topo.streams["orders"].tree == ()


def test_frozen():
    topo = parse_topology(base())
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.max_depth = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.clusters["A"].root = "/x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        topo.clusters["Z"] = topo.clusters["A"]  # type: ignore[index]


def test_endpoint_list_settings_comments_and_health():
    data = base()
    data["_comment"] = "ignored"
    data["clusters"]["A"]["data_cache"] = ["127.0.0.1:1", " [::1]:2"]
    data["clusters"]["C"]["healthy"] = False
    data["settings"] = {"max_depth": 2, "max_fanout": 3}
    topo = parse_topology(data)
    assert topo.clusters["A"].data_cache == ("127.0.0.1:1", "[::1]:2")
    assert topo.clusters["C"].healthy is False
    assert (topo.max_depth, topo.max_fanout) == (2, 3)


def test_arcs_and_directed_links():
    data = base()
    data["links"].append({"from": "C", "to": "A", "cost": 2.5, "directed": True})
    topo = parse_topology(data)
    assert topo.arcs() == {"A": {"B": 1}, "B": {"A": 1, "C": 1}, "C": {"B": 1, "A": 2.5}}
    assert topo.link_cost("C", "A") == 2.5
    assert topo.link_cost("A", "C") is None
    assert topo.reachable_from("A") == frozenset("ABC")


def test_explicit_tree_parsed():
    data = base()
    data["streams"]["orders"]["tree"] = {"C": "B", "B": "A"}
    spec = parse_topology(data).streams["orders"]
    assert spec.tree == (("B", "A"), ("C", "B"))
    assert spec.explicit_parents == {"B": "A", "C": "B"}


def test_stream_with_relay_in_explicit_tree_and_no_destinations():
    data = base()
    data["streams"]["orders"] = {"source": "A", "destinations": ["C"], "tree": {"B": "A", "C": "B"}}
    data["streams"]["local"] = {"source": "B", "destinations": []}
    topo = parse_topology(data)
    assert topo.streams["local"].destinations == ()


# ------------------------------------------------------------------ bad files


def _set(path, value):
    """Return a mutation that sets data[path...] = value (or deletes it when value is DELETE)."""

    def mutate(data):
        target = data
        for key in path[:-1]:
            target = target[key]
        if value is DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value

    return mutate


DELETE = object()

BAD_CASES = {
    "unknown cluster in link": (_set(("links", 0, "to"), "Z"), ["links[0].to", "unknown cluster 'Z'", "known: A, B, C"]),
    "unknown cluster in stream source": (_set(("streams", "orders", "source"), "Z"), ["streams.orders.source", "unknown cluster 'Z'"]),
    "unknown cluster in destinations": (
        _set(("streams", "orders", "destinations"), ["B", "Q"]),
        ["streams.orders.destinations[1]", "unknown cluster 'Q'"],
    ),
    "unknown cluster in tree child": (
        _set(("streams", "orders", "tree"), {"B": "A", "C": "B", "Z": "A"}),
        ["streams.orders.tree", "unknown cluster 'Z'"],
    ),
    "unknown cluster in tree parent": (
        _set(("streams", "orders", "tree"), {"B": "A", "C": "Z"}),
        ["streams.orders.tree.C", "unknown cluster 'Z'"],
    ),
    "missing root": (_set(("clusters", "A", "root"), DELETE), ["clusters.A", "missing required field 'root'"]),
    "missing copy_daemon": (_set(("clusters", "B", "copy_daemon"), DELETE), ["clusters.B", "missing required field 'copy_daemon'"]),
    "missing link cost": (_set(("links", 1, "cost"), DELETE), ["links[1]", "missing required field 'cost'"]),
    "missing source": (_set(("streams", "orders", "source"), DELETE), ["streams.orders", "missing required field 'source'"]),
    "missing destinations": (
        _set(("streams", "orders", "destinations"), DELETE),
        ["streams.orders", "missing required field 'destinations'"],
    ),
    "missing clusters": (_set(("clusters",), DELETE), ["missing required field 'clusters'"]),
    "empty clusters": (_set(("clusters",), {}), ["clusters", "no clusters defined"]),
    "cost is a string": (_set(("links", 0, "cost"), "1"), ["links[0].cost", "expected a number", "a string"]),
    "cost is a bool": (_set(("links", 0, "cost"), True), ["links[0].cost", "expected a number", "a boolean"]),
    "cost is nan": (_set(("links", 0, "cost"), float("nan")), ["links[0].cost", "finite"]),
    "negative cost": (_set(("links", 0, "cost"), -1), ["links[0].cost", "negative cost -1"]),
    "self link": (_set(("links", 0, "to"), "A"), ["links[0]", "self-link from 'A' to itself"]),
    "healthy not bool": (_set(("clusters", "A", "healthy"), "yes"), ["clusters.A.healthy", "expected true or false"]),
    "directed not bool": (_set(("links", 0, "directed"), 1), ["links[0].directed", "expected true or false"]),
    "data_cache wrong type": (_set(("clusters", "A", "data_cache"), 7), ["clusters.A.data_cache", "expected a string 'host:port,...'"]),
    "data_cache empty": (_set(("clusters", "A", "data_cache"), ""), ["clusters.A.data_cache", "at least one host:port"]),
    "endpoint without port": (_set(("clusters", "A", "metadata_cache"), "localhost"), ["clusters.A.metadata_cache", "bad endpoint 'localhost'"]),
    "endpoint port too big": (_set(("clusters", "A", "copy_daemon"), "h:70000"), ["clusters.A.copy_daemon", "port from 1 to 65535"]),
    "endpoint twice": (
        _set(("clusters", "A", "data_cache"), "h:1,h:1"),
        ["clusters.A.data_cache", "endpoint 'h:1' listed twice"],
    ),
    "root empty": (_set(("clusters", "A", "root"), " "), ["clusters.A.root", "must not be empty"]),
    "root wrong type": (_set(("clusters", "A", "root"), 3), ["clusters.A.root", "expected a string"]),
    "cluster not a table": (_set(("clusters", "A"), "x"), ["clusters.A", "expected a table"]),
    "links not a list": (_set(("links",), {"from": "A"}), ["links", "expected a list"]),
    "destinations not a list": (_set(("streams", "orders", "destinations"), "B"), ["streams.orders.destinations", "expected a list"]),
    "shards not an int": (_set(("streams", "orders", "shards"), "4"), ["streams.orders.shards", "expected a whole number"]),
    "shards zero": (_set(("streams", "orders", "shards"), 0), ["streams.orders.shards", "must be at least 1"]),
    "max_depth zero": (_set(("settings",), {"max_depth": 0}), ["settings.max_depth", "must be at least 1"]),
    "max_fanout float": (_set(("settings",), {"max_fanout": 2.5}), ["settings.max_fanout", "expected a whole number"]),
    "unknown setting": (_set(("settings",), {"max_dept": 3}), ["settings", "unknown field 'max_dept'", "max_depth"]),
    "unknown cluster field": (_set(("clusters", "A", "rooot"), "/x"), ["clusters.A", "unknown field 'rooot'"]),
    "unknown top field": (_set(("stream",), {}), ["the top level", "unknown field 'stream'"]),
    "bad stream name": (_set(("streams", "bad name!"), {"source": "A", "destinations": []}), ["streams.bad name!", "bad stream name 'bad name!'"]),
    "stream name leading dot": (_set(("streams", ".hidden"), {"source": "A", "destinations": []}), ["bad stream name '.hidden'"]),
    "stream name too long": (_set(("streams", "s" * 129), {"source": "A", "destinations": []}), ["bad stream name", "1-128"]),
    "bad cluster name": (_set(("clusters", "a/b"), cluster(9)), ["clusters.a/b", "bad cluster name 'a/b'"]),
    "duplicate destination": (
        _set(("streams", "orders", "destinations"), ["B", "C", "B"]),
        ["streams.orders.destinations[2]", "'B' listed twice"],
    ),
    "source as destination": (
        _set(("streams", "orders", "destinations"), ["A", "B"]),
        ["streams.orders.destinations[0]", "'A' is the stream's source"],
    ),
    "duplicate link": (
        _set(("links", 1), {"from": "B", "to": "A", "cost": 3}),
        ["links[1]", "duplicate link B -> A", "links[0]"],
    ),
    "unreachable destination": (
        _set(("links",), [{"from": "A", "to": "B", "cost": 1}]),
        ["streams.orders.destinations[1]", "destination 'C' is unreachable", "no path over links from source 'A'"],
    ),
    "unreachable against a directed link": (
        _set(("links",), [{"from": "B", "to": "A", "cost": 1, "directed": True}, {"from": "B", "to": "C", "cost": 1}]),
        ["destination 'B' is unreachable"],
    ),
    "tree cycle": (
        _set(("streams", "orders", "tree"), {"B": "C", "C": "B"}),
        ["streams.orders.tree", "cycle in explicit tree", "B -> C -> B"],
    ),
    "tree missing destination": (
        _set(("streams", "orders", "tree"), {"B": "A"}),
        ["streams.orders.tree", "destination 'C' has no parent"],
    ),
    "tree hop without link": (
        _set(("streams", "orders", "tree"), {"B": "A", "C": "A"}),
        ["streams.orders.tree.C", "no link from 'A' to 'C'"],
    ),
    "tree source has parent": (
        _set(("streams", "orders", "tree"), {"A": "B", "B": "A", "C": "B"}),
        ["streams.orders.tree.A", "the source 'A' cannot have a parent"],
    ),
    "tree parent detached": (
        lambda d: (
            d["streams"]["orders"].__setitem__("destinations", ["C"]),
            d["streams"]["orders"].__setitem__("tree", {"C": "B"}),
        ),
        ["streams.orders.tree.C", "parent 'B' is neither the source 'A' nor a child in the tree"],
    ),
    "tree own parent": (
        _set(("streams", "orders", "tree"), {"B": "B", "C": "B"}),
        ["streams.orders.tree.B", "its own parent"],
    ),
    "tree too deep": (
        lambda d: (d.__setitem__("settings", {"max_depth": 1}), d["streams"]["orders"].__setitem__("tree", {"B": "A", "C": "B"})),
        ["streams.orders.tree", "'C' is 2 hops", "max_depth=1"],
    ),
    "tree too wide": (
        lambda d: (
            d.__setitem__("settings", {"max_fanout": 1}),
            d["links"].append({"from": "A", "to": "C", "cost": 1}),
            d["streams"]["orders"].__setitem__("tree", {"B": "A", "C": "A"}),
        ),
        ["streams.orders.tree", "'A' feeds 2 clusters", "max_fanout=1"],
    ),
    "stream not a table": (_set(("streams", "orders"), ["A"]), ["streams.orders", "expected a table"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_topology_is_refused_with_a_precise_message(case):
    mutate, expected = BAD_CASES[case]
    data = copy.deepcopy(base())
    mutate(data)
    with pytest.raises(TopologyError) as info:
        parse_topology(data, source="site.json")
    message = str(info.value)
    assert message.startswith("site.json: "), message
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert isinstance(info.value, (AcsError, ValueError))


def test_top_level_not_a_table():
    with pytest.raises(TopologyError, match=r"<x>: expected the top level, got a list"):
        parse_topology([], source="<x>")  # type: ignore[arg-type]


# ------------------------------------------------------------------ files


def test_load_json_and_toml_files(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(base()))
    assert load_topology(path).origin == str(path)
    assert sorted(load_topology(str(path)).clusters) == ["A", "B", "C"]


def test_json_duplicate_cluster_key(tmp_path):
    path = tmp_path / "dup.json"
    text = json.dumps(base()).replace('"clusters": {', '"clusters": {"A": {"root": "x"}, ', 1)
    path.write_text(text)
    with pytest.raises(TopologyError, match=r"dup\.json: duplicate key 'A'"):
        load_topology(path)


def test_toml_duplicate_table(tmp_path):
    path = tmp_path / "dup.toml"
    path.write_text('[clusters.A]\nroot = "/a"\n[clusters.A]\nroot = "/b"\n')
    with pytest.raises(TopologyError, match=r"dup\.toml: not valid TOML"):
        load_topology(path)


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "clusters": {,}\n}')
    with pytest.raises(TopologyError, match=r"bad\.json: not valid JSON: .* at line 2 column"):
        load_topology(path)


def test_errors_in_toml_name_the_file(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text((EXAMPLES / "topology.toml").read_text().replace("cost = 5", "cost = -5"))
    with pytest.raises(TopologyError, match=r"t\.toml: links\[2\]\.cost: negative cost -5"):
        load_topology(path)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(TopologyError, match=r"nope\.json: cannot read topology file"):
        load_topology(tmp_path / "nope.json")
    other = tmp_path / "t.yaml"
    other.write_text("{}")
    with pytest.raises(TopologyError, match=r"t\.yaml: unknown topology file type '\.yaml'"):
        load_topology(other)


def test_lookup_helpers():
    topo = parse_topology(base(), source="<t>")
    assert topo.cluster("A").name == "A"
    assert topo.stream("orders").source == "A"
    with pytest.raises(TopologyError, match=r"<t>: unknown cluster 'Z' \(known: A, B, C\)"):
        topo.cluster("Z")
    with pytest.raises(TopologyError, match=r"<t>: unknown stream 'x' \(known: orders\)"):
        topo.stream("x")
