"""Per-hop copy status of a stream: what ``acs copy-status`` prints.

For every shard and every cluster of the stream's copy tree: the newest file, its durable
length (from the cluster's store) and cache length (from its metadata cache), how many
bytes the cluster is behind the source over all files of the shard, and the delivery delay
the copy writers recorded in the cluster's metadata cache (producer timestamp of the newest
bytes written to the time they were written). The per-hop delay is a cluster's delay minus
its parent's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.errors import CacheError
from pyspark_acs.cache.metadata import MetadataCache
from pyspark_acs.format.names import shard_dir
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.server.copy.cluster import CACHE, DURABLE, read_delay
from pyspark_acs.server.copy.tree import build_copy_tree
from pyspark_acs.server.copy.topology import Topology

__all__ = ["STATUS_CACHE_DEADLINE_S", "copy_status", "format_delay", "format_status"]

#: Cache calls of a status query give up after this long (a dead cache shows as unknown).
STATUS_CACHE_DEADLINE_S = 0.5


def copy_status(topology: Topology, stream: str) -> List[Dict[str, Any]]:
    """Rows of per-(shard, cluster) copy state of ``stream``, parents before children.

    Parameters
    ----------
    topology : Topology
    stream : str

    Returns
    -------
    list of dict
        Keys: ``shard``, ``cluster``, ``parent``, ``depth``, ``file`` (newest file or None),
        ``durable_length``, ``cache_length`` (None when unknown), ``bytes_behind`` (bytes of
        the shard's files the cluster's durable store lacks compared with the source),
        ``durable_delay_s``, ``cache_delay_s`` (producer-to-cluster delay of the newest copied
        bytes, None when unknown; 0 for the source), ``hop_delay_s`` (cache delay minus the
        parent's, None when unknown).

    Raises
    ------
    TopologyError
        For an unknown stream.
    """
    spec = topology.stream(stream)
    tree = build_copy_tree(topology, spec)
    stores = {c: DurableStore(topology.cluster(c).root) for c in tree.clusters}
    metas: Dict[str, MetadataCache] = {}
    rows: List[Dict[str, Any]] = []
    try:
        for c in tree.clusters:
            client = CacheClient(topology.cluster(c).metadata_cache, deadline=STATUS_CACHE_DEADLINE_S,
                                 name=f"metadata cache of {c}")
            metas[c] = MetadataCache(client)
        source_store = stores[tree.source]
        shards = source_store.stream_shards(stream) or spec.shards or 0
        for shard in range(shards):
            sdir = shard_dir(stream, shard)
            src_files = source_store.list_files(stream, shard)
            src_len = source_store.lengths([f"{sdir}/{f}" for f in src_files])
            delays: Dict[str, Optional[float]] = {}
            for c in tree.clusters:
                store = stores[c]
                files = store.list_files(stream, shard)
                lens = store.lengths([f"{sdir}/{f}" for f in src_files])
                behind = sum((src_len[r] or 0) - (lens.get(r) or 0) for r in src_len)
                newest = files[-1] if files else None
                durable = cache = None
                if newest:
                    rel = f"{sdir}/{newest}"
                    durable = store.lengths([rel])[rel]
                    try:
                        cache = metas[c].lengths([store.uri(rel)])[store.uri(rel)][0]
                    except CacheError:
                        cache = None
                shard_uri = store.uri(sdir)
                if c == tree.source:
                    d_delay = c_delay = 0.0
                else:
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
                    "durable_length": durable, "cache_length": cache, "bytes_behind": max(0, behind),
                    "durable_delay_s": d_delay, "cache_delay_s": c_delay, "hop_delay_s": hop,
                })
    finally:
        for m in metas.values():
            m.client.close()
        for s in stores.values():
            s.close()
    return rows


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
            _fmt(r["durable_length"]), _fmt(r["cache_length"]), str(r["bytes_behind"]),
            _fmt(r["durable_delay_s"], True), _fmt(r["cache_delay_s"], True), _fmt(r["hop_delay_s"], True),
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table) + "\n"
