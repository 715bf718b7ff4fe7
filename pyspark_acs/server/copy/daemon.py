"""The copy daemon: tail-copies streams from cluster to cluster along the copy tree.

Run one per cluster::

    acs-copy-daemon --topology topology.json --cluster B [--workers 64] [--replica 0/1] [--set poll_interval=20ms]
    spark-submit jars-free/copy_daemon.py --topology topology.json --cluster B

It serves the gRPC ``Copy`` service (``proto/copy.proto``) on its cluster's ``copy_daemon``
address (the writer side: bytes from the parent cluster land in this cluster's durable
store and caches), and runs readers for the hops where its cluster is the parent (the
scheduler, :mod:`~pyspark_acs.server.copy.scheduler`). Health probes of the other clusters
rebuild the trees when a cluster fails (:mod:`~pyspark_acs.server.copy.health`); the
topology file is reread when it changes. ``/metrics`` serves Prometheus metrics.

Once listening it prints one line on stdout (parents parse it)::

    acs-copy-daemon cluster=B listening on 127.0.0.1:PORT metrics=http://127.0.0.1:MPORT/metrics

Security (docs/security.md): the token and TLS files come from the topology file's ``security``
table, else ``$ACS_TOKEN_FILE``/``$ACS_CACHE_TOKEN`` and ``$ACS_TLS_*``. With a token every RPC
(``Copy`` included) must carry it and every call to another daemon sends it; with a certificate
the service listens with TLS; a non-loopback ``--host`` needs both, or ``--insecure``.

Bad flags, a bad topology file or a ``--cluster`` not in it exit with status 2 and a message.
SIGTERM and SIGINT stop it gracefully (operations release their leases).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from pyspark_acs._fork import open_grpc
from pyspark_acs._grpc import grpc

from pyspark_acs.errors import AcsError, AcsOptionError, TopologyError
from pyspark_acs.options import add_option_flags, options_from_flags, parse_options
from pyspark_acs.server.copy.cluster import ClusterIO
from pyspark_acs.server.copy.confirm import Confirmer
from pyspark_acs.server.copy.health import HealthMonitor
from pyspark_acs.server.copy.metrics import CopyMetrics
from pyspark_acs.server.copy.options import CopyDaemonOptions
from pyspark_acs.server.strict import add_servicer
from pyspark_acs.server.lifetime import watch_parent
from pyspark_acs.server.settings import configure_logging, insecure_option, log_level_option, parent_pid_option
from pyspark_acs.server.copy.scheduler import CopyScheduler
from pyspark_acs.server.copy.writer import CopyServicer
from pyspark_acs.server.metrics import MetricsEndpoint
from pyspark_acs.server.copy.proto import copy_pb2_grpc
from pyspark_acs.server.copy.topology import load_topology
from pyspark_acs.security import SecuritySettings, TokenInterceptor, check_bind, resolve_security
from pyspark_acs.server.copy.writer import COPY_STREAMS_RESERVE
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.storage.tier import tiered_store

__all__ = [
    "main",
]

log = logging.getLogger("pyspark_acs.copy")

#: Largest gRPC message of the copy protocol: a delta (max_delta_bytes, or one large block)
#: plus headers; larger than the cache protocol's (a block is sent whole).
COPY_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: In-flight RPCs get this long to finish at shutdown.
COPY_STOP_GRACE_S = 2.0
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", COPY_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", COPY_MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
#: The daemon's server: never share its port with another daemon (a second one for the same
#: cluster must fail to start, not run beside the first).
_SERVER_OPTIONS = _CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)]


class CopyDaemon:
    """One cluster's copy daemon (writer service + scheduler + health + metrics).

    Parameters
    ----------
    topology_path : str
        The topology file (JSON or TOML).
    cluster : str
        This daemon's cluster; must be in the file.
    options : CopyDaemonOptions, optional
    security : SecuritySettings, optional
        Token and TLS of this daemon's server, of its calls to other daemons and of its cache
        clients; default: the topology file's ``security`` entry, else the environment
        (:func:`~pyspark_acs.security.resolve_security`).
    insecure : bool
        Allow binding a non-loopback host without TLS and a token.

    Raises
    ------
    TopologyError
        For a bad file or an unknown cluster.
    """

    def __init__(self, topology_path: str, cluster: str, options: Optional[CopyDaemonOptions] = None,
                 security: Optional[SecuritySettings] = None, insecure: bool = False) -> None:
        self.options = options or CopyDaemonOptions()
        self.topology_path = str(topology_path)
        topology = load_topology(self.topology_path)
        self.cluster = topology.cluster(cluster).name
        if security is None:  # the topology file's security table, else the environment
            sec = topology.security
            security = resolve_security(token_file=sec.get("token_file"), tls_cert=sec.get("tls_cert"),
                                        tls_key=sec.get("tls_key"), tls_ca=sec.get("tls_ca"), mtls=sec.get("mtls"))
        # Passed to everything the daemon builds: its cluster's clients (and through them the
        # shared poller and feed of its read path), the health probes, the channels to other daemons.
        self.security = security
        self.insecure = insecure
        self.io = ClusterIO(topology.cluster(cluster), security=self.security)
        self.metrics = CopyMetrics(self.cluster)
        i, n = self.options.replica
        self.operation_prefix = f"{self.cluster}_r{i}of{n}_{secrets.token_hex(3)}"
        # _lock guards _channels (gRPC channels to other daemons, by address).
        self._lock = threading.Lock()
        self._channels: Dict[str, grpc.Channel] = {}
        #: Durable stores of other clusters by root (they vouch for what their copies send).
        self._stores: Dict[str, DurableStore] = {}
        self.confirmer = Confirmer(self.cluster, lambda: self.scheduler.topology, self.store_of, self.security,
                                   resend=self.options.confirm_resend)
        self.scheduler = CopyScheduler(
            self.cluster, self.topology_path, topology, self.io, self.options, self.metrics,
            self.stub_for, self.operation_prefix, confirmer=self.confirmer,
        )
        # Lengths this daemon's writers publish wake its own readers of the next hop at once.
        self.servicer = CopyServicer(self.io, self.options, self.metrics, reading=self.scheduler.running,
                                     on_published=self.scheduler.poller.notify, source_store=self.store_of,
                                     max_streams=self._threads() - COPY_STREAMS_RESERVE)
        self.health = HealthMonitor(
            self.cluster, self.options.health_interval, self.options.unhealthy_after, self.stub_for,
            self.scheduler.set_unhealthy, security=self.security,
        )
        self.health.set_topology(topology)
        self.scheduler.topology_listeners.append(self.health.set_topology)
        self.servicer.topology_sha256 = topology.sha256
        for stream in topology.streams:  # what this cluster holds quarantined, from the first scrape on
            self.servicer.note_quarantine(stream)
        self.scheduler.topology_listeners.append(lambda t: setattr(self.servicer, "topology_sha256", t.sha256))
        self._server: Optional[grpc.Server] = None
        self._http: Optional[MetricsEndpoint] = None
        self.port = 0

    def _threads(self) -> int:
        """Threads of the gRPC server (Copy streams may take all but COPY_STREAMS_RESERVE)."""
        return max(32, 4 * self.options.workers) + COPY_STREAMS_RESERVE

    def store_of(self, cluster: str) -> DurableStore:
        """``cluster``'s files in either tier (the source of a copy vouches for its files; a
        sealed file its tier mover moved out of the hot store is still its file).

        Raises
        ------
        TopologyError
            When ``cluster`` is not in the topology.
        """
        root = self.scheduler.topology.cluster(cluster).root
        with self._lock:
            store = self._stores.get(root)
            if store is None:
                store = self._stores[root] = tiered_store(DurableStore(root, create=False))
        return store

    def stub_for(self, cluster: str) -> copy_pb2_grpc.CopyStub:
        """A stub of ``cluster``'s copy daemon (channels are shared per address; every call
        carries the token, over TLS when configured)."""
        address = self.scheduler.topology.cluster(cluster).copy_daemon
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self.security.channel(address, _CHANNEL_OPTIONS, with_token=True)
                self._channels[address] = channel
        return copy_pb2_grpc.CopyStub(channel)

    @property
    def endpoint(self) -> str:
        """``host:port`` of the copy service (port 0 before :meth:`start`)."""
        return f"{self.options.host}:{self.port}"

    def start(self) -> "CopyDaemon":
        """Listen, then start health checks and the scheduler.

        Raises
        ------
        OSError
            When the copy-daemon or metrics port cannot be bound.
        """
        address = self.io.cluster.copy_daemon
        port = self.options.port if self.options.port >= 0 else int(address.rsplit(":", 1)[1])
        check_bind(self.options.host, self.security, self.insecure, what=f"acs-copy-daemon (cluster {self.cluster})")
        interceptors = [TokenInterceptor(self.security.token, stream_methods={"Copy"})] if self.security.token else []
        server = open_grpc(f"acs-copy-daemon (cluster {self.cluster})", lambda: grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._threads(), thread_name_prefix="acs-copy-rpc"),
            options=_SERVER_OPTIONS, interceptors=interceptors,
        ))
        add_servicer(copy_pb2_grpc.add_CopyServicer_to_server, self.servicer, server, aio=False)
        try:
            bound = self.security.add_port(server, f"{self.options.host}:{port}")
        except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind ..."): in use, or not ours
            raise OSError(f"cannot bind the copy daemon port {self.options.host}:{port} (cluster {self.cluster}): "
                          f"in use (another daemon?) or not a local address") from exc
        if not bound:
            raise OSError(f"cannot bind the copy daemon port {self.options.host}:{port} (cluster {self.cluster})")
        server.start()
        self._server = server
        self.port = bound
        if self.options.metrics_port >= 0:
            try:
                self._http = MetricsEndpoint(self.metrics.registry, self.healthz, self.options.host,
                                             self.options.metrics_port, name="acs-copy-metrics",
                                             security=self.security)
            except OSError:  # the message names the metrics port
                server.stop(None)
                raise
            self._http.start()
        self.health.start()
        self.confirmer.start()
        self.scheduler.start()
        return self

    def healthz(self):
        """``/healthz``: healthy while the copy service serves; names the clusters judged unhealthy."""
        return self.servicer.serving, {"cluster": self.cluster, "unhealthy_clusters": sorted(self.health.unhealthy)}

    def banner(self) -> str:
        """The start-up line printed on stdout, which parent processes parse; call after :meth:`start`."""
        metrics = self._http.url if self._http else "off"
        return f"acs-copy-daemon cluster={self.cluster} listening on {self.endpoint} metrics={metrics}"

    def stop(self) -> None:
        """Stop operations (releasing leases), then the servers. Idempotent."""
        self.servicer.serving = False
        self.health.stop()
        self.scheduler.stop()
        self.confirmer.stop()
        if self._server is not None:
            self._server.stop(COPY_STOP_GRACE_S).wait(COPY_STOP_GRACE_S + 1)
            self._server = None
        if self._http is not None:
            self._http.stop()
            self._http = None
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            stores, self._stores = list(self._stores.values()), {}
        for channel in channels:
            channel.close()
        for store in stores:
            store.close()
        self.io.close()


# -- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``acs-copy-daemon`` argument parser."""
    p = argparse.ArgumentParser(
        prog="acs-copy-daemon",
        description="Copy streams from cluster to cluster along their copy trees (Fast ACS).",
    )
    p.add_argument("--topology", required=True, metavar="FILE", help="topology file (.json or .toml)")
    p.add_argument("--cluster", required=True, metavar="NAME", help="this daemon's cluster (a name in the file)")
    # The common settings as flags of their own, generated from their declarations; any setting
    # (these too) as --set NAME=VALUE.
    add_option_flags(p, CopyDaemonOptions, only=_FLAGGED)
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                   help="any daemon setting, e.g. poll_interval=20ms, max_bytes_per_second=10MiB (repeatable)")
    add_option_flags(p, _DaemonFlags)
    return p


#: The settings that have a flag of their own besides ``--set``.
_FLAGGED = ("workers", "replica", "host", "metrics_port", "port")


@dataclass(frozen=True)
class _DaemonFlags:
    """The process's flags that are not copy settings (declared as every daemon's are)."""

    parent_pid: Optional[int] = parent_pid_option()
    insecure: bool = insecure_option()
    log_level: str = log_level_option()


def _options(args: argparse.Namespace) -> CopyDaemonOptions:
    raw: Dict[str, str] = {}
    for item in args.settings:
        name, sep, value = item.partition("=")
        if not sep:
            raise AcsOptionError(f"--set: {item!r} is not NAME=VALUE", option="--set")
        raw[name.strip()] = value.strip()
    for name in _FLAGGED:  # a flag wins over --set of the same setting
        value = getattr(args, name)
        if value is not None:
            raw[name] = value
    return parse_options(CopyDaemonOptions, raw, component="acs-copy-daemon")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``acs-copy-daemon``; returns the exit status (2 for bad usage or topology)."""
    args = build_parser().parse_args(argv)
    flags = options_from_flags(_DaemonFlags, args)
    configure_logging(flags.log_level)
    try:
        options = _options(args)
        daemon = CopyDaemon(args.topology, args.cluster, options, insecure=flags.insecure)
    except (TopologyError, AcsOptionError) as exc:
        print(f"acs-copy-daemon: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda s, f: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            daemon.start()
        except (OSError, AcsError) as exc:
            print(f"acs-copy-daemon: error: {exc}", file=sys.stderr)
            daemon.stop()
            return 1
        print(daemon.banner(), flush=True)
        if flags.parent_pid is not None:
            watch_parent(flags.parent_pid, stop)
        while not stop.wait(0.5):  # a timed wait keeps the main thread responsive to signals
            pass
        log.info("stopping")
        daemon.stop()
        log.info("stopped")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
