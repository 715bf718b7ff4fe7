"""Copy-daemon metrics: the ``acs_copy_*`` series of one daemon.

Names, kinds, help texts and labels are declared once, in
:data:`pyspark_acs.server.metrics.COPY_METRICS`; every series also carries ``cluster`` (the
daemon's own). The daemon serves them with :class:`pyspark_acs.server.metrics.MetricsEndpoint`.

- ``bytes_total{stream,source,target,storage}`` bytes written into the target per hop
- ``operations{role,storage}`` operations running now (role ``reader`` or ``writer``)
- ``operations_finished_total{storage}`` operations that copied a whole sealed file
- ``lag_bytes{stream,shard,target,storage}`` source length minus target length (reader side)
- ``delay_seconds{stream,shard,storage}`` producer-to-this-cluster delivery delay of the
  newest bytes written here (writer side; its ``cluster`` is the daemon's own)
- ``delivery_delay_seconds{storage}`` histogram of those delays, one observation per delta
- ``errors_total{kind}`` errors by kind (restart, poisoned, failed, connect, ...)
- ``tree_rebuilds_total`` copy-tree rebuilds after health or topology changes
- ``quarantined_bytes{stream,shard}`` bytes past a promotion's cut moved into the shard's
  quarantine when this cluster took the new history
- ``files_surveyed_total{state}`` files a child reported holding when this daemon started
  feeding it: ``complete`` (sealed there: no operation runs) or ``present``
"""

from __future__ import annotations

from pyspark_acs.server.metrics import COPY_METRICS, Metrics

__all__ = [
    "CopyMetrics",
]

#: Prefix of every copy-daemon metric.
COPY_PREFIX = "acs_copy_"


class CopyMetrics(Metrics):
    """One copy daemon's metrics, in a registry of its own (thread-safe).

    The reader, writer and scheduler call ``inc(name, amount, **labels)``,
    ``set(name, value, **labels)``, ``remove(name, **labels)`` and ``get(name, **labels)``
    with names without the ``acs_copy_`` prefix (e.g. ``inc("errors_total", kind="restart")``);
    see :class:`~pyspark_acs.server.metrics.Metrics`.

    Parameters
    ----------
    cluster : str
        The daemon's cluster: the ``cluster`` label of every series.
    """

    def __init__(self, cluster: str) -> None:
        super().__init__(COPY_PREFIX, COPY_METRICS, const_labels={"cluster": cluster})
        self.cluster = cluster

    def set(self, name: str, value: float, **labels: object) -> None:
        """Set a gauge; a ``delay_seconds`` value is also one observation of ``delivery_delay_seconds``.

        The writer records one delay per delta it writes: the gauge keeps the newest per shard,
        the histogram their distribution per storage (what a delay SLO is read from).
        """
        super().set(name, value, **labels)
        if name == "delay_seconds":
            self.observe("delivery_delay_seconds", value, storage=labels["storage"])
