"""One cluster's storage as the copy daemon sees it: durable store, data cache, metadata cache.

Also the operation identity (:class:`OpKey`) and the copy-delay record the writers publish in
the destination metadata cache (read by :mod:`pyspark_acs.server.copy.status`).
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple, Optional

from pyspark_acs.cache.client import CacheClient
from pyspark_acs.security import SecuritySettings
from pyspark_acs.errors import CacheError
from pyspark_acs.cache.metadata import LENGTH_TTL_S, MetadataCache
from pyspark_acs.format.names import shard_dir
from pyspark_acs.storage.store import DurableStore, stream_epoch
from pyspark_acs.server.copy.topology import Cluster

__all__ = [
    "CACHE",
    "ClusterIO",
    "DURABLE",
    "OpKey",
    "STORAGES",
    "publish_delay",
    "read_delay",
]

#: Storage names of an operation (``copy.proto``'s ``Storage``: DURABLE = 0, CACHE = 1).
DURABLE = "durable"
CACHE = "cache"
STORAGES = (DURABLE, CACHE)


class OpKey(NamedTuple):
    """An operation: one file copied to one storage of one child cluster."""

    stream: str
    shard: int
    file: str
    storage: str
    child: str

    @property
    def rel(self) -> str:
        """The file relative to a store root (the same path in every cluster)."""
        return f"{shard_dir(self.stream, self.shard)}/{self.file}"

    def __str__(self) -> str:
        return f"{self.rel} [{self.storage}] -> {self.child}"


class ClusterIO:
    """Clients of one cluster's durable store and caches (opened lazily, closed by :meth:`close`).

    Parameters
    ----------
    cluster : Cluster
        The topology entry.
    cache_deadline : float
        Deadline of every cache call (seconds).
    security : SecuritySettings, optional
        Token and TLS of the cache clients (default: the environment).
    """

    def __init__(self, cluster: Cluster, cache_deadline: float = 0.5, security: Optional[SecuritySettings] = None) -> None:
        self.cluster = cluster
        self.name = cluster.name
        self.store = DurableStore(cluster.root)
        self.data = CacheClient(cluster.data_cache, name=f"data cache of {cluster.name}", deadline=cache_deadline,
                                security=security)
        self.meta_client = CacheClient(
            cluster.metadata_cache, name=f"metadata cache of {cluster.name}", deadline=cache_deadline,
            security=security,
        )
        self.meta = MetadataCache(self.meta_client)

    def uri(self, rel: str) -> str:
        """The globally unique URI of ``rel`` in this cluster's store (the key of its chunks and lengths)."""
        return self.store.uri(rel)

    def shard_uri(self, stream: str, shard: int) -> str:
        """The URI of a shard's folder (the key of its head and copy-delay records)."""
        return self.store.uri(shard_dir(stream, shard))

    def epoch_fields(self, stream: str) -> dict:
        """The stream's promotion count here and its records (``_stream.json``), as the fields
        ``epoch`` and ``promotions_json`` of a copy hello or ``Files`` call, which the child
        checks and adopts (storage/store.py ``create_stream``); empty before any promotion."""
        meta = self.store.stream_meta(stream) or {}
        epoch = stream_epoch(meta)
        return {"epoch": epoch, "promotions_json": json.dumps(meta.get("promotions") or [])} if epoch else {}

    def close(self) -> None:
        """Close both cache clients and the store's open files."""
        self.data.close()
        self.meta_client.close()
        self.store.close()


def delay_key(shard_uri: str, storage: str) -> bytes:
    """Metadata-cache key of the delivery delay of a shard's newest bytes in one storage."""
    return b"cd:" + storage.encode() + b":" + shard_uri.encode()


def publish_delay(meta: MetadataCache, shard_uri: str, storage: str, delay_s: float, source: str) -> None:
    """Record the producer-to-this-cluster delay of the newest bytes written (version = time, ms)."""
    now = time.time()
    value = json.dumps({"delay_s": round(delay_s, 6), "at": now, "from": source}).encode()
    meta.client.put([(delay_key(shard_uri, storage), value, int(now * 1000))], ttl=LENGTH_TTL_S)


def read_delay(meta: MetadataCache, shard_uri: str, storage: str) -> Optional[dict]:
    """The last delay record of a shard and storage, or None (unknown or cache down)."""
    try:
        entry = meta.client.get([delay_key(shard_uri, storage)], consistent=True)[0]
    except CacheError:
        return None
    if entry is None:
        return None
    try:
        return json.loads(entry.value)
    except ValueError:
        return None
