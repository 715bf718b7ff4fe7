"""The copy-daemon topology file: clusters, the links between them, and streams.

A topology file (JSON or TOML) tells every copy daemon where each cluster keeps its
durable root and caches, what it costs to send bytes between clusters, and which clusters
every stream is copied to. It is read once at start (and again on reload), validated as a
whole, and turned into frozen dataclasses that the copy tree builder
(:mod:`pyspark_acs.server.copy.tree`) and the daemon use. The format is documented in
``docs/topology.md``; a minimal JSON file::

    {
      "clusters": {
        "A": {"root": "/tmp/acs-demo/A", "data_cache": "127.0.0.1:7101",
              "metadata_cache": "127.0.0.1:7201", "copy_daemon": "127.0.0.1:7301"},
        "B": {"root": "/tmp/acs-demo/B", "data_cache": "127.0.0.1:7102",
              "metadata_cache": "127.0.0.1:7202", "copy_daemon": "127.0.0.1:7302"}
      },
      "links": [{"from": "A", "to": "B", "cost": 1}],
      "streams": {"orders": {"source": "A", "destinations": ["B"]}}
    }

Every mistake is reported as a :class:`~pyspark_acs.errors.TopologyError` whose message
starts with the file name and the place in the file (``links[2].to``,
``streams.orders.tree.C``), so an operator can fix it without reading code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import math
import re
import tomllib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from pyspark_acs.errors import TopologyError

__all__ = [
    "Cluster",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_FANOUT",
    "StreamSpec",
    "Topology",
    "check_writable",
    "load_topology",
    "set_cluster",
    "write_topology",
]

#: Most hops from the source cluster to any destination (the paper's "maximum of 4 hops").
DEFAULT_MAX_DEPTH = 4
#: Most children a cluster may feed; bounds the egress a single copy daemon must carry.
DEFAULT_MAX_FANOUT = 8

#: Stream names (docs/overview.md section 1); they become folder names in the durable store.
STREAM_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Cluster names follow the same rule: they appear in folder names and log lines too.
CLUSTER_NAME_RE = STREAM_NAME_RE

_TOP_KEYS = ("clusters", "links", "security", "settings", "streams")
#: Keys of the optional ``security`` table: files the copy daemons (and ``acs`` commands given
#: the topology) use for the token and TLS (docs/security.md). Never the token itself.
_SECURITY_KEYS = ("token_file", "tls_cert", "tls_key", "tls_ca", "mtls")
_CLUSTER_KEYS = ("copy_daemon", "data_cache", "healthy", "metadata_cache", "root")
_CLUSTER_REQUIRED = ("root", "data_cache", "metadata_cache", "copy_daemon")
_LINK_KEYS = ("cost", "directed", "from", "to")
_STREAM_KEYS = ("destinations", "shards", "source", "tree")
_SETTINGS_KEYS = ("max_depth", "max_fanout")


@dataclass(frozen=True)
class Cluster:
    """One cluster: a durable root plus its caches and its copy daemon.

    Attributes
    ----------
    name : str
        The cluster's name, unique in the topology.
    root : str
        Durable store root: a URI (``file:///...``, ``hdfs://...``, ``s3://...``) or a local path.
    data_cache : tuple of str
        ``host:port`` endpoints of the data cache replicas.
    metadata_cache : tuple of str
        ``host:port`` endpoints of the metadata cache replicas.
    copy_daemon : str
        ``host:port`` gRPC listen address of the cluster's copy daemon.
    healthy : bool
        ``False`` marks the cluster unhealthy in the file itself (an operator's drain); the copy
        tree then treats it as it treats clusters reported unhealthy at run time.
    """

    name: str
    root: str
    data_cache: Tuple[str, ...]
    metadata_cache: Tuple[str, ...]
    copy_daemon: str
    healthy: bool = True


@dataclass(frozen=True)
class Link:
    """A network link bytes may be copied over.

    Attributes
    ----------
    source, target : str
        The clusters it joins (``from`` and ``to`` in the file).
    cost : float
        Non-negative cost of sending bytes over the link (bandwidth price, distance...).
    directed : bool
        ``True`` when bytes may only go from ``source`` to ``target``; links are undirected
        by default.
    """

    source: str
    target: str
    cost: float
    directed: bool = False

    def arcs(self) -> Iterator[Tuple[str, str]]:
        """Yield the ``(from, to)`` directions bytes may flow over this link."""
        yield (self.source, self.target)
        if not self.directed:
            yield (self.target, self.source)


@dataclass(frozen=True)
class StreamSpec:
    """A stream and where it is copied.

    Attributes
    ----------
    name : str
        Stream name, matching :data:`STREAM_NAME_RE`.
    source : str
        The cluster producers write to; the root of the copy tree.
    destinations : tuple of str
        Clusters the stream is copied to, in file order (the source is not one of them).
    shards : int or None
        Number of shards when the file fixes it; ``None`` leaves it to the producers.
    tree : tuple of (str, str)
        Explicit ``(child, parent)`` hops, sorted by child, overriding Prim's tree; empty
        when the tree is computed.
    """

    name: str
    source: str
    destinations: Tuple[str, ...]
    shards: Optional[int] = None
    tree: Tuple[Tuple[str, str], ...] = ()

    @property
    def explicit_parents(self) -> Dict[str, str]:
        """The explicit tree as a ``{child: parent}`` dict (empty when none is given)."""
        return dict(self.tree)


@dataclass(frozen=True)
class Topology:
    """A whole, validated topology file.

    Built by :func:`load_topology` or :func:`parse_topology`, which check every cross
    reference; the mappings are read-only.

    Attributes
    ----------
    clusters : Mapping[str, Cluster]
        Clusters by name.
    links : tuple of Link
        Links in file order.
    streams : Mapping[str, StreamSpec]
        Streams by name.
    max_depth : int
        Most hops from a stream's source to any of its clusters.
    max_fanout : int
        Most children any cluster may feed in a copy tree.
    origin : str
        Where the topology came from (a file path or ``"<name>"``); error messages name it.
    security : Mapping[str, Any]
        The ``security`` table: ``token_file``, ``tls_cert``, ``tls_key``, ``tls_ca`` (paths,
        relative ones resolved against the file's folder) and ``mtls`` (bool); empty when absent.
    """

    clusters: Mapping[str, Cluster]
    links: Tuple[Link, ...]
    streams: Mapping[str, StreamSpec]
    max_depth: int = DEFAULT_MAX_DEPTH
    max_fanout: int = DEFAULT_MAX_FANOUT
    origin: str = "<topology>"
    security: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: SHA-256 (hex) of the file's bytes (:func:`load_topology`; empty for parsed data): what
    #: a copy daemon's Health reports, so ``acs promote`` can tell it runs the file it wrote.
    sha256: str = ""

    def cluster(self, name: str) -> Cluster:
        """Return cluster ``name``; raise :class:`TopologyError` naming the known ones."""
        try:
            return self.clusters[name]
        except KeyError:
            raise TopologyError(
                f"{self.origin}: unknown cluster {name!r} (known: {', '.join(sorted(self.clusters))})"
            ) from None

    def stream(self, name: str) -> StreamSpec:
        """Return stream ``name``; raise :class:`TopologyError` naming the known ones."""
        try:
            return self.streams[name]
        except KeyError:
            raise TopologyError(
                f"{self.origin}: unknown stream {name!r} (known: {', '.join(sorted(self.streams)) or 'none'})"
            ) from None

    def arcs(self) -> Dict[str, Dict[str, float]]:
        """Return the directed adjacency ``{from: {to: cost}}`` of every link.

        Every cluster has an entry, possibly empty; undirected links appear both ways.
        """
        adjacency: Dict[str, Dict[str, float]] = {name: {} for name in self.clusters}
        for link in self.links:
            for a, b in link.arcs():
                adjacency[a][b] = link.cost
        return adjacency

    def link_cost(self, a: str, b: str) -> Optional[float]:
        """Return the cost of sending from ``a`` to ``b`` over a link, or ``None`` when not linked."""
        for link in self.links:
            if (a, b) in link.arcs():
                return link.cost
        return None

    def reachable_from(self, start: str) -> frozenset:
        """Return the clusters reachable from ``start`` over links (``start`` included)."""
        adjacency = self.arcs()
        seen = {start}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            for nxt in adjacency.get(node, {}):
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        return frozenset(seen)


# --------------------------------------------------------------------------- loading


def load_topology(path: Union[str, Path]) -> Topology:
    """Read and validate a topology file.

    Parameters
    ----------
    path : str or pathlib.Path
        A ``.json`` or ``.toml`` file.

    Returns
    -------
    Topology

    Raises
    ------
    TopologyError
        When the file cannot be read, does not parse, or is inconsistent; the message names
        the file and the place in it.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise TopologyError(f"{path}: unknown topology file type {path.suffix!r}; use a .json or .toml file")
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"{path}: cannot read topology file: {exc}") from exc
    if suffix == ".json":
        try:
            # The hook refuses duplicate keys, which json.loads would silently collapse.
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except _DuplicateKey as exc:
            raise TopologyError(f"{path}: duplicate key {exc.args[0]!r} in one JSON object") from None
        except json.JSONDecodeError as exc:
            raise TopologyError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise TopologyError(f"{path}: not valid TOML: {exc}") from exc
    return dataclasses.replace(parse_topology(data, source=str(path)), sha256=hashlib.sha256(raw).hexdigest())


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    result: Dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def parse_topology(data: Mapping[str, Any], source: str = "<topology>") -> Topology:
    """Validate an already decoded topology (a dict as read from JSON or TOML).

    Parameters
    ----------
    data : Mapping
        The decoded file: ``clusters``, ``links``, ``streams`` and optional ``settings``.
        Keys starting with ``_`` are ignored at every level, so JSON files can carry comments.
    source : str
        Named at the start of every error message (the file path, or ``"<name>"``).

    Returns
    -------
    Topology

    Raises
    ------
    TopologyError
        On the first problem found, naming ``source`` and the place (``clusters.B.root``,
        ``links[0].cost``, ``streams.orders.destinations[1]``...).
    """
    p = _Parser(source)
    top = p.mapping(data, "", "the top level")
    p.known_keys(top, _TOP_KEYS, "the top level")

    settings = p.mapping(top.get("settings", {}), "settings", "a table")
    p.known_keys(settings, _SETTINGS_KEYS, "settings")
    max_depth = p.positive_int(settings.get("max_depth", DEFAULT_MAX_DEPTH), "settings.max_depth")
    max_fanout = p.positive_int(settings.get("max_fanout", DEFAULT_MAX_FANOUT), "settings.max_fanout")

    if "clusters" not in top:
        raise p.error("", "missing required field 'clusters'")
    raw_clusters = p.mapping(top["clusters"], "clusters", "a table of cluster name -> settings")
    if not raw_clusters:
        raise p.error("clusters", "no clusters defined")
    clusters: Dict[str, Cluster] = {}
    for name, raw in raw_clusters.items():
        clusters[name] = p.cluster(name, raw)

    links = p.links(top.get("links", []), clusters)
    topology_wo_streams = Topology(
        clusters=MappingProxyType(clusters),
        links=links,
        streams=MappingProxyType({}),
        max_depth=max_depth,
        max_fanout=max_fanout,
        origin=source,
    )

    raw_streams = p.mapping(top.get("streams", {}), "streams", "a table of stream name -> settings")
    streams: Dict[str, StreamSpec] = {}
    for name, raw in raw_streams.items():
        streams[name] = p.stream(name, raw, topology_wo_streams)

    raw_security = p.mapping(top.get("security", {}), "security", "a table")
    p.known_keys(raw_security, _SECURITY_KEYS, "security")
    security: Dict[str, Any] = {}
    base = os.path.dirname(os.path.abspath(source)) if not source.startswith("<") else os.getcwd()
    for key, value in raw_security.items():
        if key.startswith("_"):
            continue
        if key == "mtls":
            security[key] = p.boolean(value, "security.mtls")
        else:
            security[key] = os.path.join(base, p.string(value, f"security.{key}"))

    return Topology(
        clusters=MappingProxyType(clusters),
        links=links,
        streams=MappingProxyType(streams),
        max_depth=max_depth,
        max_fanout=max_fanout,
        origin=source,
        security=MappingProxyType(security),
    )


def _kind(value: Any) -> str:
    """Name a decoded value's type the way a JSON/TOML author thinks of it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "a table"
    return type(value).__name__


class _Parser:
    """Field-level checks that all report ``<source>: <place>: <problem>``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, where: str, problem: str) -> TopologyError:
        return TopologyError(f"{self.source}: {where}: {problem}" if where else f"{self.source}: {problem}")

    # -- shapes

    def mapping(self, value: Any, where: str, what: str) -> Dict[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(where, f"expected {what}, got {_kind(value)}")
        # Underscore keys are comments (JSON has no other way to carry them).
        return {k: v for k, v in value.items() if not (isinstance(k, str) and k.startswith("_"))}

    def known_keys(self, table: Mapping[str, Any], allowed: Tuple[str, ...], where: str) -> None:
        for key in table:
            if key not in allowed:
                raise self.error(
                    where, f"unknown field {key!r} (allowed: {', '.join(allowed)})"
                )

    def required(self, table: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in table:
            raise self.error(where, f"missing required field {key!r}")
        return table[key]

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise self.error(where, f"expected a string, got {_kind(value)} {value!r}")
        if not value.strip():
            raise self.error(where, "must not be empty")
        return value

    def boolean(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(where, f"expected true or false, got {_kind(value)} {value!r}")
        return value

    def positive_int(self, value: Any, where: str) -> int:
        # bool is an int subclass; "true" as a depth is a typo, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(where, f"expected a whole number, got {_kind(value)} {value!r}")
        if value < 1:
            raise self.error(where, f"must be at least 1, got {value}")
        return value

    def name(self, value: Any, where: str, what: str) -> str:
        if not isinstance(value, str):
            raise self.error(where, f"{what} name must be a string, got {_kind(value)} {value!r}")
        if not STREAM_NAME_RE.fullmatch(value):
            raise self.error(
                where,
                f"bad {what} name {value!r}: use 1-128 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit",
            )
        return value

    def cluster_ref(self, value: Any, where: str, clusters: Mapping[str, Cluster]) -> str:
        if not isinstance(value, str):
            raise self.error(where, f"expected a cluster name, got {_kind(value)} {value!r}")
        if value not in clusters:
            raise self.error(
                where, f"unknown cluster {value!r} (known: {', '.join(sorted(clusters))})"
            )
        return value

    def endpoint(self, value: Any, where: str) -> str:
        text = self.string(value, where).strip()
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise self.error(where, f"bad endpoint {text!r}: expected host:port with a port from 1 to 65535")
        return text

    def endpoints(self, value: Any, where: str) -> Tuple[str, ...]:
        # A comma-separated string (the documented form) or, for TOML comfort, a list.
        if isinstance(value, str):
            parts = [part for part in value.split(",")]
        elif isinstance(value, (list, tuple)):
            parts = list(value)
        else:
            raise self.error(where, f"expected a string 'host:port,...', got {_kind(value)} {value!r}")
        if not parts or all(isinstance(x, str) and not x.strip() for x in parts):
            raise self.error(where, "expected at least one host:port endpoint")
        result = tuple(self.endpoint(part, where) for part in parts)
        seen = set()
        for endpoint in result:
            if endpoint in seen:
                raise self.error(where, f"endpoint {endpoint!r} listed twice")
            seen.add(endpoint)
        return result

    # -- sections

    def cluster(self, name: Any, raw: Any) -> Cluster:
        where = f"clusters.{name}"
        self.name(name, where, "cluster")
        table = self.mapping(raw, where, "a table with root, data_cache, metadata_cache and copy_daemon")
        self.known_keys(table, _CLUSTER_KEYS, where)
        for key in _CLUSTER_REQUIRED:
            self.required(table, key, where)
        return Cluster(
            name=name,
            root=self.string(table["root"], f"{where}.root"),
            data_cache=self.endpoints(table["data_cache"], f"{where}.data_cache"),
            metadata_cache=self.endpoints(table["metadata_cache"], f"{where}.metadata_cache"),
            copy_daemon=self.endpoint(table["copy_daemon"], f"{where}.copy_daemon"),
            healthy=self.boolean(table.get("healthy", True), f"{where}.healthy"),
        )

    def links(self, raw: Any, clusters: Mapping[str, Cluster]) -> Tuple[Link, ...]:
        if not isinstance(raw, (list, tuple)):
            raise self.error("links", f"expected a list of {{from, to, cost}} tables, got {_kind(raw)}")
        links: List[Link] = []
        # Arc -> index of the link that first declared it, to name both in a duplicate error.
        declared: Dict[Tuple[str, str], int] = {}
        for i, item in enumerate(raw):
            where = f"links[{i}]"
            table = self.mapping(item, where, "a table with from, to and cost")
            self.known_keys(table, _LINK_KEYS, where)
            a = self.cluster_ref(self.required(table, "from", where), f"{where}.from", clusters)
            b = self.cluster_ref(self.required(table, "to", where), f"{where}.to", clusters)
            if a == b:
                raise self.error(where, f"self-link from {a!r} to itself")
            cost = self.required(table, "cost", where)
            if isinstance(cost, bool) or not isinstance(cost, (int, float)):
                raise self.error(f"{where}.cost", f"expected a number, got {_kind(cost)} {cost!r}")
            if not math.isfinite(cost):
                raise self.error(f"{where}.cost", f"cost must be finite, got {cost!r}")
            if cost < 0:
                raise self.error(f"{where}.cost", f"negative cost {cost!r}: costs must be >= 0")
            directed = self.boolean(table.get("directed", False), f"{where}.directed")
            link = Link(source=a, target=b, cost=cost, directed=directed)
            for arc in link.arcs():
                if arc in declared:
                    raise self.error(
                        where,
                        f"duplicate link {arc[0]} -> {arc[1]} (already declared by links[{declared[arc]}])",
                    )
            for arc in link.arcs():
                declared[arc] = i
            links.append(link)
        return tuple(links)

    def stream(self, name: Any, raw: Any, topology: Topology) -> StreamSpec:
        where = f"streams.{name}"
        self.name(name, where, "stream")
        table = self.mapping(raw, where, "a table with source and destinations")
        self.known_keys(table, _STREAM_KEYS, where)
        clusters = topology.clusters
        source = self.cluster_ref(self.required(table, "source", where), f"{where}.source", clusters)

        raw_dest = self.required(table, "destinations", where)
        if not isinstance(raw_dest, (list, tuple)):
            raise self.error(f"{where}.destinations", f"expected a list of cluster names, got {_kind(raw_dest)}")
        destinations: List[str] = []
        for i, item in enumerate(raw_dest):
            dest = self.cluster_ref(item, f"{where}.destinations[{i}]", clusters)
            if dest == source:
                raise self.error(f"{where}.destinations[{i}]", f"{dest!r} is the stream's source, not a destination")
            if dest in destinations:
                raise self.error(f"{where}.destinations[{i}]", f"{dest!r} listed twice")
            destinations.append(dest)

        reachable = topology.reachable_from(source)
        for i, dest in enumerate(destinations):
            if dest not in reachable:
                raise self.error(
                    f"{where}.destinations[{i}]",
                    f"destination {dest!r} is unreachable: no path over links from source {source!r}",
                )

        shards = None
        if "shards" in table:
            shards = self.positive_int(table["shards"], f"{where}.shards")

        tree: Tuple[Tuple[str, str], ...] = ()
        if "tree" in table:
            tree = self.tree(table["tree"], f"{where}.tree", source, destinations, topology)
        return StreamSpec(name=name, source=source, destinations=tuple(destinations), shards=shards, tree=tree)

    def tree(
        self, raw: Any, where: str, source: str, destinations: List[str], topology: Topology
    ) -> Tuple[Tuple[str, str], ...]:
        table = self.mapping(raw, where, "a table of child -> parent cluster names")
        clusters = topology.clusters
        parents: Dict[str, str] = {}
        for child, parent in table.items():
            self.cluster_ref(child, where, clusters)
            parent = self.cluster_ref(parent, f"{where}.{child}", clusters)
            if child == source:
                raise self.error(f"{where}.{child}", f"the source {source!r} cannot have a parent")
            if child == parent:
                raise self.error(f"{where}.{child}", f"{child!r} is its own parent")
            if topology.link_cost(parent, child) is None:
                raise self.error(f"{where}.{child}", f"no link from {parent!r} to {child!r} for this hop")
            parents[child] = parent

        for dest in destinations:
            if dest not in parents:
                raise self.error(where, f"destination {dest!r} has no parent in the explicit tree")

        # Walk every chain up to the source: a repeat is a cycle, a dead end is a detached part.
        depth: Dict[str, int] = {source: 0}
        for start in sorted(parents):
            chain = [start]
            node = start
            while node not in depth:
                parent = parents.get(node)
                if parent is None:
                    raise self.error(
                        f"{where}.{chain[-2] if len(chain) > 1 else start}",
                        f"parent {node!r} is neither the source {source!r} nor a child in the tree",
                    )
                if parent in chain:
                    cycle = chain[chain.index(parent):] + [parent]
                    raise self.error(where, f"cycle in explicit tree: {' -> '.join(cycle)} (child -> parent)")
                chain.append(parent)
                node = parent
            base = depth[node]
            for offset, member in enumerate(reversed(chain[:-1]), start=1):
                depth[member] = base + offset

        deepest = max(depth, key=lambda c: (depth[c], c))
        if depth[deepest] > topology.max_depth:
            raise self.error(
                where,
                f"{deepest!r} is {depth[deepest]} hops from the source, more than max_depth={topology.max_depth}",
            )
        fanout: Dict[str, int] = {}
        for parent in parents.values():
            fanout[parent] = fanout.get(parent, 0) + 1
        for parent in sorted(fanout):
            if fanout[parent] > topology.max_fanout:
                raise self.error(
                    where,
                    f"{parent!r} feeds {fanout[parent]} clusters, more than max_fanout={topology.max_fanout}",
                )
        return tuple(sorted(parents.items()))


def check_writable(path: Union[str, Path]) -> None:
    """Refuse a topology file :func:`set_cluster` cannot edit: not JSON, or already broken.

    Raises
    ------
    TopologyError
        Naming the file and its problem.
    """
    path = Path(path)
    if path.suffix.lower() != ".json":
        raise TopologyError(f"{path}: acs up writes JSON topology files; give a .json file")
    if path.exists():
        load_topology(path)


def set_cluster(path: Union[str, Path], name: str, cluster: Mapping[str, Any],
                links: Sequence[Tuple[str, int]] = ()) -> Topology:
    """Add or update one cluster's entry (and links from it) in a JSON topology file.

    What ``acs up --cluster NAME --topology FILE`` does, so two clusters take two commands:
    a missing file is created; other clusters, links and streams are kept; a link given again
    gets its new cost. The result is validated before it replaces the file (atomically).

    Parameters
    ----------
    path : str or pathlib.Path
        A ``.json`` topology file (TOML is read, not written: its comments would be lost).
    name : str
        The cluster.
    cluster : mapping
        Its fields (``root``, ``data_cache``, ``metadata_cache``, ``copy_daemon``, ...).
    links : sequence of (cluster, cost)
        Links from ``name`` to other clusters.

    Raises
    ------
    TopologyError
        For a non-JSON file, a file that does not parse, or a result that is not valid.
    """
    path = Path(path)
    check_writable(path)
    data: Dict[str, Any] = {}
    if path.exists():
        data = json.loads(path.read_text(encoding="utf-8"))
    clusters = data.setdefault("clusters", {})
    clusters[name] = {**clusters.get(name, {}), **cluster}
    entries = data.setdefault("links", []) if links else data.get("links", [])
    for other, cost in links:
        for entry in entries:
            if {entry.get("from"), entry.get("to")} == {name, other}:
                entry["cost"] = cost
                break
        else:
            entries.append({"from": name, "to": other, "cost": cost})
    return write_topology(path, data)


def write_topology(path: Union[str, Path], data: Mapping[str, Any]) -> Topology:
    """Validate ``data`` and replace the JSON topology file ``path`` with it atomically
    (``acs up``'s :func:`set_cluster`, ``acs promote``); returns what the daemons will load.

    Raises
    ------
    TopologyError
        When ``data`` is not a valid topology (the file is left as it was).
    """
    path = Path(path)
    parse_topology(data, source=str(path))
    raw = (json.dumps(data, indent=2) + "\n").encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return load_topology(path)
