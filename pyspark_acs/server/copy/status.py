"""Per-hop copy status of a stream: what ``acs copy-status`` prints.

For every shard and every cluster of the stream's copy tree: the newest file, its durable
length (from the cluster's store) and cache length (from its metadata cache), how many
bytes the cluster is behind the source over all files of the shard, and the delivery delay
the copy writers recorded in the cluster's metadata cache (producer timestamp of the newest
bytes written to the time they were written). The per-hop delay is a cluster's delay minus
its parent's.

A status only reads: a cluster whose root does not exist or whose metadata cache does not
answer is reported as such (each row's ``problems``), never shown as an empty cluster with
nothing behind.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.errors import AcsOptionError, CacheError, RootNotFoundError
from pyspark_acs.cache.metadata import MetadataCache
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.positions import quarantine_entries
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.server.copy.cluster import CACHE, DURABLE, read_delay
from pyspark_acs.server.copy.tree import build_copy_tree
from pyspark_acs.server.copy.topology import Topology

__all__ = [
    "copy_status",
    "format_delay",
    "format_status",
    "problems",
]

#: Cache calls of a status query give up after this long (a dead cache shows as unknown).
STATUS_CACHE_DEADLINE_S = 0.5


def copy_status(topology: Topology, stream: str) -> List[Dict[str, Any]]:
    """Rows of per-(shard, cluster) copy state of ``stream``, parents before children.

    It only reads: a cluster's missing root is not created (it is reported), and a metadata
    cache that does not answer is reported rather than shown as an empty one.

    Parameters
    ----------
    topology : Topology
    stream : str

    Returns
    -------
    list of dict
        Keys: ``shard``, ``cluster``, ``parent``, ``depth``, ``file`` (newest file or None),
        ``durable_length``, ``cache_length`` (None when unknown), ``bytes_behind`` (bytes of
        the shard's files the cluster's durable store lacks compared with the source; None
        when the source cannot be read), ``durable_delay_s``, ``cache_delay_s``
        (producer-to-cluster delay of the newest copied bytes, None when unknown; 0 for a
        source that holds the stream), ``hop_delay_s`` (cache delay minus the parent's, None
        when unknown), ``problems`` (what of the cluster could not be reached or read, one
        sentence each naming it and the fix; empty when all is well: see :func:`problems`),
        ``warnings`` (what is down without hiding anything shown: a minority of the metadata
        cache's replicas; ranges the cluster quarantined when it took a promotion's new history).

    Raises
    ------
    TopologyError
        For an unknown stream.
    """
    spec = topology.stream(stream)
    tree = build_copy_tree(topology, spec)
    found: Dict[str, List[str]] = {c: [] for c in tree.clusters}
    warned: Dict[str, List[str]] = {c: [] for c in tree.clusters}
    stores: Dict[str, Optional[DurableStore]] = {}
    metas: Dict[str, MetadataCache] = {}
    answering: Dict[str, bool] = {}
    rows: List[Dict[str, Any]] = []
    try:
        for c in tree.clusters:
            stores[c] = _open_root(topology, c, c == tree.source, stream, found[c])
            client = CacheClient(topology.cluster(c).metadata_cache, deadline=STATUS_CACHE_DEADLINE_S,
                                 name=f"metadata cache of {c}")
            metas[c] = MetadataCache(client)
            answering[c] = _probe(client, found[c], warned[c])
        source_store = stores[tree.source]
        source_shards = source_store.stream_shards(stream) if source_store is not None else None
        if source_store is not None and source_shards is None:
            found[tree.source].append(
                f"stream {stream!r} does not exist in {source_store.root}: nothing has written it there yet "
                f"(a Producer, `acs produce` or the sink creates it), or the topology's source for it is wrong")
        known_source = source_shards is not None
        shards = source_shards or spec.shards or 0
        for c in tree.clusters:
            store = stores[c]
            moved = quarantine_entries(store.stream_meta(stream), moved_only=True) if store is not None else []
            for e in moved:
                warned[c].append(f"shard {e['shard']}: {e['file']} bytes [{e['start']}, {e['end']}) are past the "
                                 f"cut of promotion epoch {e.get('epoch')} (new source {e.get('source')}): "
                                 f"quarantined in {store.uri(e['moved_to'])}, never copied on or served")
        for shard in range(shards):
            sdir = shard_dir(stream, shard)
            src_files = source_store.list_files(stream, shard) if known_source else []
            src_len = source_store.lengths([f"{sdir}/{f}" for f in src_files]) if known_source else {}
            delays: Dict[str, Optional[float]] = {}
            for c in tree.clusters:
                store = stores[c]
                files = store.list_files(stream, shard) if store is not None else []
                # A missing destination root holds none of the source's bytes: all are behind.
                lens = store.lengths([f"{sdir}/{f}" for f in src_files]) if store is not None else {}
                behind = sum((src_len[r] or 0) - (lens.get(r) or 0) for r in src_len) if known_source else None
                newest = files[-1] if files else None
                durable = cache = None
                if newest:
                    rel = f"{sdir}/{newest}"
                    durable = store.lengths([rel])[rel]
                    if answering[c]:
                        try:
                            cache = metas[c].lengths([store.uri(rel)])[store.uri(rel)][0]
                        except CacheError:
                            cache = None
                if c == tree.source:
                    d_delay = c_delay = 0.0 if known_source else None
                elif store is None or not answering[c]:
                    d_delay = c_delay = None
                else:
                    shard_uri = store.uri(sdir)
                    d_rec = read_delay(metas[c], shard_uri, DURABLE)
                    c_rec = read_delay(metas[c], shard_uri, CACHE)
                    d_delay = d_rec["delay_s"] if d_rec else None
                    c_delay = c_rec["delay_s"] if c_rec else None
                delays[c] = c_delay
                parent = tree.parent(c)
                hop = None
                if parent is not None and c_delay is not None and delays.get(parent) is not None:
                    hop = c_delay - delays[parent]
                rows.append({
                    "shard": shard, "cluster": c, "parent": parent, "depth": tree.depth(c), "file": newest,
                    "durable_length": durable, "cache_length": cache,
                    "bytes_behind": None if behind is None else max(0, behind),
                    "durable_delay_s": d_delay, "cache_delay_s": c_delay, "hop_delay_s": hop,
                    "problems": found[c], "warnings": warned[c],
                })
    finally:
        for m in metas.values():
            m.client.close()
        for st in stores.values():
            if st is not None:
                st.close()
    return rows


def _open_root(topology: Topology, cluster: str, source: bool, stream: str, found: List[str]) -> Optional[DurableStore]:
    """The cluster's store, never created here; None (and a line in ``found``) when its root
    cannot be opened."""
    root = topology.cluster(cluster).root
    try:
        return DurableStore(root, create=False)
    except RootNotFoundError as exc:
        if source:
            why = (f"nothing has written stream {stream!r} there yet (a Producer, `acs produce` or the sink "
                   f"creates it)")
        else:
            why = f"its copy daemon (`acs-copy-daemon --cluster {cluster}`) has copied nothing there yet"
        found.append(f"root {exc.path} does not exist: {why}, or the topology's root for {cluster} is wrong")
    except AcsOptionError as exc:  # not a folder, or a URI pyarrow cannot open
        found.append(str(exc))
    return None


def _probe(client: CacheClient, found: List[str], warned: List[str]) -> bool:
    """Whether a majority of a metadata cache's replicas answer (one Health call to each, in
    parallel): what its consistent reads need. Fewer go in ``found``, and the cache is asked
    nothing else (each call would only wait out its deadline); a silent minority goes in
    ``warned`` (what is shown is still read from the majority)."""
    health = client.health()
    silent = [ep for ep in client.endpoints if not health.get(ep)]
    if not silent:
        return True
    line = (f"{client.name}: no answer from {', '.join(silent)} ({len(silent)} of {len(client.endpoints)} replicas; "
            f"is it running? `acs up` or acs-cache-server starts one)")
    majority = len(client.endpoints) - len(silent) > len(client.endpoints) // 2
    (warned if majority else found).append(line)
    return majority


def problems(rows: List[Dict[str, Any]], key: str = "problems") -> List[str]:
    """Each cluster's problems (or ``key="warnings"``: warnings) in ``rows`` once, as
    ``cluster C: ...`` lines (empty: all was reached and read)."""
    out: List[str] = []
    for r in rows:
        for p in r.get(key, ()):
            line = f"cluster {r['cluster']}: {p}"
            if line not in out:
                out.append(line)
    return out


def _fmt(value: Any, seconds: bool = False) -> str:
    if value is None:
        return "-"
    if seconds:
        return f"{value * 1000:.1f}ms"
    return str(value)


def format_delay(seconds: Optional[float]) -> str:
    """A delay of :func:`copy_status` for people (``-`` when unknown)."""
    return _fmt(seconds, True)


def format_status(rows: List[Dict[str, Any]]) -> str:
    """A text table of :func:`copy_status` rows."""
    head = ["shard", "cluster", "parent", "file", "durable", "cache", "behind", "delay(durable)", "delay(cache)", "hop"]
    table = [head]
    for r in rows:
        table.append([
            str(r["shard"]), ("  " * r["depth"]) + r["cluster"], r["parent"] or "-", r["file"] or "-",
            _fmt(r["durable_length"]), _fmt(r["cache_length"]), _fmt(r["bytes_behind"]),
            _fmt(r["durable_delay_s"], True), _fmt(r["cache_delay_s"], True), _fmt(r["hop_delay_s"], True),
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table) + "\n"
