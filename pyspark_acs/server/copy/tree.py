"""The copy tree of a stream: which cluster feeds which (Fast ACS paper, section 2.3).

Sending every byte straight from the source cluster to every destination would cost too
much, so each stream is copied along a tree over its clusters: a minimum spanning tree
grown with Prim's algorithm from the source, weighted by link cost, with every cluster at
most ``max_depth`` hops from the source (each hop adds delay) and feeding at most
``max_fanout`` children (each child costs the feeding daemon egress).

Rules, in the order they apply:

1. Prim picks, among the *admissible* hops (parent already in the tree, not at
   ``max_depth``, fewer than ``max_fanout`` children; child a destination not yet placed),
   the one with the lowest effective cost; ties go to the shallower parent, then by name.
2. A cluster that is not a destination is used as a *relay* only when no destination left
   can be fed directly; the cheapest path through relays is added, and the tree's
   :attr:`CopyTree.notes` say why.
3. Unhealthy clusters, unhealthy links and new destinations (``leaves_first``) are
   penalised: hops leaving an unhealthy or new cluster, or crossing an unhealthy link, cost
   two :data:`UNHEALTHY_PENALTY`; hops into one cost one penalty, so a healthy cluster
   takes a parent slot first. The penalty exceeds the sum of all link costs, so such hops
   are only taken when nothing healthy is admissible, and a last pass moves any child of a
   penalised cluster to a healthy parent in the tree when one is admissible. Unhealthy and
   new clusters therefore end as leaves whenever the links allow.
4. When the limits leave a destination with no admissible parent, :class:`TopologyError`
   says which limit (depth or fan-out) is in the way.

Prim under depth and fan-out limits is a greedy heuristic: with no limit binding and no
relay needed it gives a minimum spanning tree, otherwise a good tree, not always the best.

A stream with an explicit ``tree`` in the topology file uses that tree as it is; health
and ``leaves_first`` do not change it (the operator pinned it).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from types import MappingProxyType
from typing import (
    AbstractSet,
    Any,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Set,
    Tuple,
    Union,
)

from pyspark_acs.errors import TopologyError
from pyspark_acs.server.copy.topology import DEFAULT_MAX_DEPTH, DEFAULT_MAX_FANOUT, StreamSpec, Topology

__all__ = [
    "CopyTree",
    "build_copy_tree",
]

#: Added to the cost of a penalised hop (see the module docs). Large against any real link
#: cost; when a topology's costs add up to more, the sum plus one is used instead, so a
#: penalised hop always loses against a healthy one.
UNHEALTHY_PENALTY = 1_000_000_000.0

# Penalty tiers: how many penalties a hop carries.
_TIER_HEALTHY = 0
_TIER_INTO_PENALISED = 1
_TIER_FROM_PENALISED = 2


class Reparent(NamedTuple):
    """A cluster whose parent differs between two copy trees.

    ``old_parent`` is ``None`` when the cluster was not in the old tree (or was its
    source); ``new_parent`` likewise for the new tree.
    """

    cluster: str
    old_parent: Optional[str]
    new_parent: Optional[str]


@dataclasses.dataclass(frozen=True)
class CopyTree:
    """A stream's copy tree: the source cluster at the root, one parent per other cluster.

    Attributes
    ----------
    stream : str
        The stream's name.
    source : str
        The root cluster.
    parents : Mapping[str, str]
        ``{child: parent}`` for every cluster but the source (read-only).
    costs : Mapping[str, float]
        ``{child: cost of the link from its parent}`` (the real link cost, no penalty).
    relays : frozenset of str
        Clusters in the tree that are not destinations of the stream.
    unhealthy : frozenset of str
        Clusters of the tree that were unhealthy when it was built (penalised to leaves).
    new : frozenset of str
        Clusters of the tree placed as new destinations (``leaves_first``), also penalised.
    explicit : bool
        ``True`` when the tree came from the topology file rather than Prim.
    notes : tuple of str
        Why the tree looks as it does where that is not obvious (relays, penalised parents).
    max_depth, max_fanout : int
        The limits the tree was built under.
    """

    stream: str
    source: str
    parents: Mapping[str, str]
    costs: Mapping[str, float]
    relays: FrozenSet[str] = frozenset()
    unhealthy: FrozenSet[str] = frozenset()
    new: FrozenSet[str] = frozenset()
    explicit: bool = False
    notes: Tuple[str, ...] = ()
    max_depth: int = DEFAULT_MAX_DEPTH
    max_fanout: int = DEFAULT_MAX_FANOUT
    _children: Mapping[str, Tuple[str, ...]] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        children: Dict[str, List[str]] = {self.source: []}
        for child in self.parents:
            children.setdefault(child, [])
        for child, parent in self.parents.items():
            children.setdefault(parent, []).append(child)
        # Frozen: the cached child lists are set once, here.
        object.__setattr__(
            self, "_children", MappingProxyType({k: tuple(sorted(v)) for k, v in children.items()})
        )
        object.__setattr__(self, "parents", MappingProxyType(dict(self.parents)))
        object.__setattr__(self, "costs", MappingProxyType(dict(self.costs)))

    def __hash__(self) -> int:
        # The mappings are read-only proxies, which do not hash; hash their content instead.
        return hash((self.stream, self.source, tuple(sorted(self.parents.items()))))

    @property
    def penalised(self) -> FrozenSet[str]:
        """Clusters that were asked to be leaves: :attr:`unhealthy` plus :attr:`new`."""
        return self.unhealthy | self.new

    def _check(self, cluster: str) -> None:
        if cluster not in self._children:
            raise KeyError(f"cluster {cluster!r} is not in the copy tree of stream {self.stream!r}")

    @property
    def clusters(self) -> Tuple[str, ...]:
        """Every cluster in the tree, source first, then in :meth:`hops` order."""
        return (self.source,) + tuple(child for _, child in self.hops())

    def parent(self, cluster: str) -> Optional[str]:
        """Return the cluster feeding ``cluster`` (``None`` for the source).

        Raises
        ------
        KeyError
            When ``cluster`` is not in the tree.
        """
        self._check(cluster)
        return self.parents.get(cluster)

    def children(self, cluster: str) -> Tuple[str, ...]:
        """Return the clusters ``cluster`` feeds, sorted by name."""
        self._check(cluster)
        return self._children[cluster]

    def path(self, cluster: str) -> Tuple[str, ...]:
        """Return the clusters from the source down to ``cluster``, both included."""
        self._check(cluster)
        chain = [cluster]
        while chain[-1] != self.source:
            chain.append(self.parents[chain[-1]])
        return tuple(reversed(chain))

    def depth(self, cluster: str) -> int:
        """Return the number of hops from the source to ``cluster`` (0 for the source)."""
        return len(self.path(cluster)) - 1

    def cost(self, cluster: str) -> float:
        """Return the link cost of the hop into ``cluster`` (0 for the source)."""
        self._check(cluster)
        return self.costs.get(cluster, 0)

    def total_cost(self) -> float:
        """Return the sum of the link costs of all hops."""
        return sum(self.costs.values())

    def hops(self) -> List[Tuple[str, str]]:
        """Return every ``(parent, child)`` hop, parents before children.

        The order is a depth-first walk with children by name (the order of :meth:`render`),
        so a scheduler walking it starts each hop after the hop feeding its parent.
        """
        return [(self.parents[child], child) for child in self._preorder()[1:]]

    def _preorder(self) -> List[str]:
        out: List[str] = []
        stack = [self.source]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(self._children[node]))
        return out

    def to_dict(self) -> Dict[str, Any]:
        """Return a JSON-ready description (used by ``acs tree --json`` and status pages)."""
        return {
            "stream": self.stream,
            "source": self.source,
            "explicit": self.explicit,
            "max_depth": self.max_depth,
            "max_fanout": self.max_fanout,
            "hops": [
                {"from": p, "to": c, "cost": self.costs[c], "depth": self.depth(c)} for p, c in self.hops()
            ],
            "parents": {c: self.parents[c] for c in sorted(self.parents)},
            "relays": sorted(self.relays),
            "unhealthy": sorted(self.unhealthy),
            "new": sorted(self.new),
            "total_cost": self.total_cost(),
            "notes": list(self.notes),
        }

    def render(self) -> str:
        """Draw the tree as text, for ``acs tree``.

        Example::

            stream orders (source A)
            A
            ├── B  cost 1
            │   └── C  cost 1
            └── D  cost 5
        """
        header = f"stream {self.stream} (source {self.source}{', explicit tree' if self.explicit else ''})"
        lines = [header, self.source]

        def walk(node: str, prefix: str) -> None:
            kids = self._children[node]
            for i, kid in enumerate(kids):
                last = i == len(kids) - 1
                tags = []
                if kid in self.relays:
                    tags.append("relay")
                if kid in self.unhealthy:
                    tags.append("unhealthy")
                if kid in self.new:
                    tags.append("new")
                tag = f"  [{', '.join(tags)}]" if tags else ""
                lines.append(f"{prefix}{'└── ' if last else '├── '}{kid}  cost {_fmt_cost(self.costs[kid])}{tag}")
                walk(kid, prefix + ("    " if last else "│   "))

        walk(self.source, "")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines) + "\n"


def _fmt_cost(cost: float) -> str:
    # Integral costs print as "1", not "1.0": files mostly hold whole numbers.
    if isinstance(cost, float) and cost.is_integer():
        return str(int(cost))
    return str(cost)


def diff(old: CopyTree, new: CopyTree) -> List[Reparent]:
    """List the clusters whose parent differs between two trees of a stream.

    Parameters
    ----------
    old, new : CopyTree
        The tree before and after a change (health, topology reload...).

    Returns
    -------
    list of Reparent
        Sorted by cluster name; clusters only in one tree appear with ``None`` for the
        other side. An empty list means the daemon has nothing to reschedule.
    """
    names = set(old.parents) | set(new.parents) | {old.source, new.source}
    changes = []
    for name in sorted(names):
        before = old.parents.get(name)
        after = new.parents.get(name)
        if before != after:
            changes.append(Reparent(name, before, after))
    return changes


# --------------------------------------------------------------------------- building


def build_copy_tree(
    topology: Topology,
    stream: Union[str, StreamSpec],
    *,
    unhealthy_clusters: AbstractSet[str] = frozenset(),
    unhealthy_links: Iterable[Tuple[str, str]] = frozenset(),
    leaves_first: AbstractSet[str] = frozenset(),
    max_depth: Optional[int] = None,
    max_fanout: Optional[int] = None,
) -> CopyTree:
    """Build the copy tree of ``stream``.

    Parameters
    ----------
    topology : Topology
        The validated topology.
    stream : str or StreamSpec
        The stream, by name or spec.
    unhealthy_clusters : set of str
        Clusters reported unhealthy; clusters marked ``healthy = false`` in the file are
        added. They are fed last and feed nobody when a healthy parent is admissible.
    unhealthy_links : iterable of (str, str)
        Links reported unhealthy, as cluster pairs (order ignored).
    leaves_first : set of str
        New destinations still catching up; placed as leaves like unhealthy clusters.
    max_depth, max_fanout : int, optional
        Limits; default to the topology's settings (4 and 8 unless the file says otherwise).

    Returns
    -------
    CopyTree

    Raises
    ------
    TopologyError
        For an unknown stream or cluster, or when the limits leave a destination with no
        admissible parent (the message names the destination and the limit).
    """
    spec = stream if isinstance(stream, StreamSpec) else topology.stream(stream)
    depth_limit = topology.max_depth if max_depth is None else max_depth
    fanout_limit = topology.max_fanout if max_fanout is None else max_fanout
    for value, what in ((depth_limit, "max_depth"), (fanout_limit, "max_fanout")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TopologyError(f"{what} must be a whole number >= 1, got {value!r}")

    for name in sorted(set(unhealthy_clusters) | set(leaves_first)):
        topology.cluster(name)
    arcs = topology.arcs()
    bad_links: Set[FrozenSet[str]] = set()
    for pair in unhealthy_links:
        a, b = tuple(pair)
        topology.cluster(a)
        topology.cluster(b)
        if b not in arcs[a] and a not in arcs[b]:
            raise TopologyError(f"{topology.origin}: unhealthy link {a}-{b}: no such link")
        bad_links.add(frozenset((a, b)))

    unhealthy = set(unhealthy_clusters) | {c.name for c in topology.clusters.values() if not c.healthy}
    penalised = frozenset(unhealthy | set(leaves_first))

    if spec.tree:
        tree = _explicit_tree(topology, spec, depth_limit, fanout_limit)
    else:
        tree = _PrimBuilder(topology, spec, arcs, penalised, bad_links, depth_limit, fanout_limit).build()
    members = set(tree.parents) | {tree.source}
    return dataclasses.replace(
        tree, unhealthy=frozenset(unhealthy & members), new=frozenset(set(leaves_first) & members)
    )


def _explicit_tree(
    topology: Topology, spec: StreamSpec, max_depth: int, max_fanout: int
) -> CopyTree:
    parents = spec.explicit_parents
    costs = {child: topology.link_cost(parent, child) for child, parent in parents.items()}
    tree = CopyTree(
        stream=spec.name,
        source=spec.source,
        parents=parents,
        costs=costs,
        relays=frozenset(parents) - set(spec.destinations),
        explicit=True,
        notes=("explicit tree from the topology file; health does not change it",),
        max_depth=max_depth,
        max_fanout=max_fanout,
    )
    # The file was checked against its own settings; the caller may pass tighter limits.
    for child in parents:
        if tree.depth(child) > max_depth:
            raise TopologyError(
                f"{topology.origin}: streams.{spec.name}.tree: {child!r} is {tree.depth(child)} hops "
                f"from the source, more than max_depth={max_depth}"
            )
    for node in tree.clusters:
        if len(tree.children(node)) > max_fanout:
            raise TopologyError(
                f"{topology.origin}: streams.{spec.name}.tree: {node!r} feeds {len(tree.children(node))} "
                f"clusters, more than max_fanout={max_fanout}"
            )
    return tree


class _PrimBuilder:
    """Prim's algorithm with depth and fan-out limits, relays and health penalties."""

    def __init__(
        self,
        topology: Topology,
        spec: StreamSpec,
        arcs: Mapping[str, Mapping[str, float]],
        penalised: FrozenSet[str],
        bad_links: Set[FrozenSet[str]],
        max_depth: int,
        max_fanout: int,
    ) -> None:
        self.topology = topology
        self.spec = spec
        self.arcs = arcs
        self.penalised = penalised
        self.bad_links = bad_links
        self.max_depth = max_depth
        self.max_fanout = max_fanout
        total = sum(cost for targets in arcs.values() for cost in targets.values())
        self.penalty = max(UNHEALTHY_PENALTY, total + 1.0)
        self.parent: Dict[str, str] = {}
        self.depth: Dict[str, int] = {spec.source: 0}
        self.fanout: Dict[str, int] = {spec.source: 0}
        self.relays: Set[str] = set()
        self.notes: List[str] = []

    # -- costs and admissibility

    def tier(self, a: str, b: str) -> int:
        if a in self.penalised or frozenset((a, b)) in self.bad_links:
            return _TIER_FROM_PENALISED
        if b in self.penalised:
            return _TIER_INTO_PENALISED
        return _TIER_HEALTHY

    def weight(self, a: str, b: str) -> float:
        return self.arcs[a][b] + self.tier(a, b) * self.penalty

    def can_feed(self, node: str) -> bool:
        return self.depth[node] < self.max_depth and self.fanout[node] < self.max_fanout

    def attach(self, parent: str, child: str) -> None:
        self.parent[child] = parent
        self.depth[child] = self.depth[parent] + 1
        self.fanout[child] = 0
        self.fanout[parent] += 1

    # -- the algorithm

    def build(self) -> CopyTree:
        remaining = set(self.spec.destinations)
        while remaining:
            best: Optional[Tuple[float, int, str, str]] = None
            for parent in self.depth:
                if not self.can_feed(parent):
                    continue
                for child, _ in self.arcs[parent].items():
                    if child in remaining:
                        key = (self.weight(parent, child), self.depth[parent], child, parent)
                        if best is None or key < best:
                            best = key
            if best is not None:
                _, _, child, parent = best
                self.attach(parent, child)
                remaining.discard(child)
                continue
            placed = self.add_relay_path(remaining)
            remaining.discard(placed)
        self.move_children_off_penalised()
        self.drop_idle_relays()
        return CopyTree(
            stream=self.spec.name,
            source=self.spec.source,
            parents=self.parent,
            costs={child: self.arcs[parent][child] for child, parent in self.parent.items()},
            relays=frozenset(self.relays),
            notes=tuple(self.notes),
            max_depth=self.max_depth,
            max_fanout=self.max_fanout,
        )

    def add_relay_path(self, remaining: Set[str]) -> str:
        """Reach one remaining destination through non-destination clusters; return it.

        Dijkstra over (cluster, depth) states, so the depth limit is part of the search;
        ties go to fewer hops, then to names. Raises when no path fits the limits.
        """
        in_tree = set(self.depth)
        heap: List[Tuple[float, int, Tuple[str, ...]]] = []
        for start in sorted(in_tree):
            if self.can_feed(start):
                heap.append((0.0, self.depth[start], (start,)))
        heapq.heapify(heap)
        done: Set[Tuple[str, int]] = set()
        while heap:
            cost, depth, path = heapq.heappop(heap)
            node = path[-1]
            if (node, depth) in done:
                continue
            done.add((node, depth))
            if node in remaining:
                relays = path[1:-1]
                for parent, child in zip(path, path[1:]):
                    self.attach(parent, child)
                self.relays.update(relays)
                linked = [c for c in sorted(in_tree) if node in self.arcs[c]]
                why = (
                    f"{', '.join(linked)} (linked to {node}) at the depth or fan-out limit"
                    if linked
                    else f"no cluster in the tree has a link to {node}"
                )
                self.notes.append(f"relay {', '.join(relays)} carries the stream to {node}: {why}")
                return node
            # A relay (or the attachment point) must be able to feed the next cluster.
            if depth >= self.max_depth:
                continue
            for nxt in sorted(self.arcs[node]):
                if nxt in in_tree or nxt in path:
                    continue
                heapq.heappush(heap, (cost + self.weight(node, nxt), depth + 1, path + (nxt,)))
        raise self.unplaceable(remaining)

    def unplaceable(self, remaining: Set[str]) -> TopologyError:
        """Explain which limit leaves the first remaining destination without a parent."""
        where = f"{self.topology.origin}: stream {self.spec.name}"
        dest = sorted(remaining)[0]
        # Fewest hops from the source to dest over links, ignoring every limit.
        hops = {self.spec.source: 0}
        queue = deque([self.spec.source])
        while queue:
            node = queue.popleft()
            for nxt in sorted(self.arcs[node]):
                if nxt not in hops:
                    hops[nxt] = hops[node] + 1
                    queue.append(nxt)
        if dest not in hops:
            return TopologyError(f"{where}: destination {dest!r} is unreachable: no path over links from {self.spec.source!r}")
        if hops[dest] > self.max_depth:
            return TopologyError(
                f"{where}: destination {dest!r} is {hops[dest]} hops from source {self.spec.source!r} "
                f"at best, more than max_depth={self.max_depth}"
            )
        feeders = sorted(p for p in self.depth if dest in self.arcs[p])
        full = [p for p in feeders if self.fanout[p] >= self.max_fanout]
        deep = [p for p in feeders if self.depth[p] >= self.max_depth]
        detail = []
        if full:
            detail.append(f"{', '.join(full)} already feed max_fanout={self.max_fanout} clusters")
        if deep:
            detail.append(f"{', '.join(deep)} are at max_depth={self.max_depth}")
        if not detail:
            detail.append("every path to it runs through clusters already at the limits")
        return TopologyError(
            f"{where}: cannot place destination {dest!r} within max_depth={self.max_depth} and "
            f"max_fanout={self.max_fanout}: {'; '.join(detail)}"
        )

    def subtree(self, node: str) -> Set[str]:
        children: Dict[str, List[str]] = {}
        for child, parent in self.parent.items():
            children.setdefault(parent, []).append(child)
        out = {node}
        stack = [node]
        while stack:
            for kid in children.get(stack.pop(), ()):
                out.add(kid)
                stack.append(kid)
        return out

    def height(self, node: str) -> int:
        return max(self.depth[n] for n in self.subtree(node)) - self.depth[node]

    def drop_idle_relays(self) -> None:
        """Remove relays left feeding nobody (their child moved to a healthy parent)."""
        while True:
            feeding = set(self.parent.values())
            idle = sorted(r for r in self.relays if r not in feeding)
            if not idle:
                return
            for relay in idle:
                self.fanout[self.parent.pop(relay)] -= 1
                del self.depth[relay], self.fanout[relay]
                self.relays.discard(relay)
                self.notes.append(f"relay {relay} dropped: its destinations found healthy parents")

    def move_children_off_penalised(self) -> None:
        """Give children of penalised clusters a healthy parent where one is admissible.

        Prim takes a penalised hop only when nothing healthy is admissible *at that moment*;
        a healthy cluster that joined later may be a valid parent now.
        """
        changed = True
        while changed:
            changed = False
            for child in sorted(self.parent):
                old = self.parent[child]
                if self.tier(old, child) != _TIER_FROM_PENALISED:
                    continue
                below = self.subtree(child)
                height = self.height(child)
                best = None
                for cand in sorted(self.depth):
                    if cand in below or child not in self.arcs[cand]:
                        continue
                    if self.tier(cand, child) == _TIER_FROM_PENALISED:
                        continue
                    if self.fanout[cand] >= self.max_fanout or self.depth[cand] + 1 + height > self.max_depth:
                        continue
                    key = (self.arcs[cand][child], self.depth[cand], cand)
                    if best is None or key < best:
                        best = key
                if best is None:
                    continue
                new = best[2]
                self.fanout[old] -= 1
                self.fanout[new] += 1
                self.parent[child] = new
                shift = self.depth[new] + 1 - self.depth[child]
                for member in below:
                    self.depth[member] += shift
                changed = True
        for child, parent in sorted(self.parent.items()):
            if parent in self.penalised:
                self.notes.append(f"{child} is fed by penalised {parent}: no healthy parent fits the links and limits")
