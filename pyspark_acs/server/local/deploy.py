"""Local deployments of cache servers: one subprocess per replica, on loopback ports.

:class:`LocalDeployment` starts ``data_replicas`` data-cache servers and ``metadata_replicas``
metadata-cache servers as background processes (``python -m pyspark_acs.server.cache ...
--port 0``), parses the port each prints, and keeps a pid file and a log per server under
``base_dir``; with ``tier_mover_root`` also a tier mover (``acs-tier-mover``, role ``tier``)
for that hot store, started and stopped with the servers. Tests use it for real server processes (kill, restart); :func:`acs_up` and
:func:`acs_down` back the ``acs up`` / ``acs down`` commands, persisting the deployment to
``base_dir/deployment.json`` so a later process can stop it.

Layout of ``base_dir``::

    deployment.json          endpoints, pids, ports and log paths (mode 0600: may hold the token)
    data-0.log, data-0.pid   one pair per server
    metadata-0.log, ...
    tier-0.log, tier-0.pid   the tier mover, when asked for
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from pyspark_acs.security import (ENV_MTLS, ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TOKEN, ENV_TOKEN_FILE,
                                  SecuritySettings, resolve_security)
from pyspark_acs.errors import DeploymentError
from pyspark_acs.options import choice_parser
from pyspark_acs.server.cache.options import DEFAULT_CAPACITY_BYTES, ROLE_DEFAULT_TTL_S
from pyspark_acs.server.settings import DEFAULT_HOST, LOG_LEVELS
from pyspark_acs.units import parse_bytes, parse_duration

__all__ = [
    "LocalDeployment",
    "acs_down",
    "acs_up",
    "load_deployment",
]

#: Data-cache capacity of a local deployment (per replica): the cache server's own default.
DEFAULT_DATA_CAPACITY = DEFAULT_CAPACITY_BYTES["data"]
#: Metadata-cache capacity of a local deployment (per replica): the cache server's own default.
DEFAULT_METADATA_CAPACITY = DEFAULT_CAPACITY_BYTES["metadata"]
#: How long :meth:`LocalDeployment.start` waits for every server's start-up line.
DEFAULT_START_TIMEOUT_S = 20.0
#: How long a stop waits after SIGTERM before SIGKILL.
DEFAULT_STOP_TIMEOUT_S = 5.0
DEPLOYMENT_FILE = "deployment.json"
_LOG_TAIL_LINES = 20
_POLL_S = 0.02
_SERVER_MODULE = "pyspark_acs.server.cache"
_TIER_MODULE = "pyspark_acs.server.tier.daemon"
#: Per role: the module its process runs, the start of the line it prints once serving, and
#: what it is called in messages.
_ROLES: Dict[str, Tuple[str, str, str]] = {
    "data": (_SERVER_MODULE, "acs-cache-server role=", "cache server"),
    "metadata": (_SERVER_MODULE, "acs-cache-server role=", "cache server"),
    "tier": (_TIER_MODULE, "acs-tier-mover root=", "tier mover"),
}
# The directory holding the pyspark_acs package, put on the servers' PYTHONPATH so they import
# this very copy whether it is pip-installed or a source checkout.
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


@dataclass
class ServerProcess:
    """One server of a deployment (what ``deployment.json`` records per server)."""

    role: str
    index: int
    host: str
    port: int = 0
    metrics_port: Optional[int] = None
    pid: Optional[int] = None
    log_path: str = ""
    pid_path: str = ""
    popen: Optional[subprocess.Popen] = field(default=None, repr=False, compare=False)

    @property
    def endpoint(self) -> str:
        """``host:port`` of the server's gRPC service."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """``role-index``, also the stem of its log and pid files."""
        return f"{self.role}-{self.index}"

    @property
    def metrics_url(self) -> Optional[str]:
        """``http://host:port/metrics`` of the server's Prometheus endpoint (None when off)."""
        if not self.metrics_port:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.metrics_port}/metrics"

    def to_json(self) -> Dict[str, Any]:
        """The JSON-able fields (everything but the Popen handle)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "popen"}
        data["endpoint"] = self.endpoint
        return data


def _log_tail(path: str, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    tail = text.splitlines()[-lines:]
    return "\n".join(f"    {line}" for line in tail) if tail else "    (log is empty)"


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (reaping it first if it is our exited child; zombies count as dead)."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass  # not our child: ask the kernel below
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _is_ours(pid: int, role: str = "data") -> bool:
    """Whether ``pid`` runs the module of ``role`` (a cache server, the tier mover): guards
    against pids reused by other programs."""
    module = _ROLES.get(role, _ROLES["data"])[0]
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return module.encode() in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc (not Linux): trust the pid file


def _terminate(pid: int, popen: Optional[subprocess.Popen], timeout: float, *, signalled: bool = False) -> None:
    """SIGTERM ``pid`` (unless ``signalled`` says the caller already did), then SIGKILL after
    ``timeout``; returns once it is gone (bounded).

    SIGTERM is sent once only: a second one may land after the server restored the default
    handler on its way out and turn a clean exit into death by signal.
    """

    def gone() -> bool:
        if popen is not None:
            return popen.poll() is not None
        return not _pid_alive(pid)

    if gone():
        return
    if not signalled:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
    def wait_gone() -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if gone():
                return True
            time.sleep(_POLL_S)
        return False

    if wait_gone():
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if wait_gone():
        return
    raise DeploymentError(f"server pid {pid} did not exit after SIGKILL within {timeout:.1f} s")


class LocalDeployment:
    """Cache servers for one cluster, as local background processes.

    Parameters
    ----------
    base_dir : str or Path
        Where logs, pid files and ``deployment.json`` go (created if missing).
    data_replicas, metadata_replicas : int
        Number of servers per role (0 allowed).
    capacity : str or int
        Data-cache capacity per replica (``"256MiB"`` or bytes).
    metadata_capacity : str or int, optional
        Metadata-cache capacity per replica; default :data:`DEFAULT_METADATA_CAPACITY`.
    data_ttl, metadata_ttl : str or float
        Default TTLs (``"60s"`` or seconds).
    host : str
        Interface the servers bind; loopback by default.
    token : str, optional
        Shared token the servers require (passed through the environment, not argv); default
        ``security``'s.
    security : SecuritySettings, optional
        Token and TLS of the servers; default: this process's environment
        (:func:`~pyspark_acs.security.resolve_security`: ``$ACS_CACHE_TOKEN``,
        ``$ACS_TOKEN_FILE``, ``$ACS_TLS_*``), so a token set in the shell reaches the servers.
    insecure : bool, default False
        Let the servers bind a non-loopback ``host`` without TLS and a token (``--insecure``).
    die_with_parent : bool, default True
        Servers exit when this process does (tests); :func:`acs_up` turns it off.
    start_timeout : float
        Seconds :meth:`start` and :meth:`restart` wait for readiness.
    python : str, optional
        Interpreter for the servers; default ``sys.executable``.
    base_port : int, optional
        Fixed ports instead of free ones: the gRPC ports ``base_port``, ``base_port + 1``, ...
        (data servers first, then metadata servers), then the metrics ports in the same order.
    tier_mover_root : str, optional
        Also run a tier mover (``acs-tier-mover``) over this hot store root, with its
        ``/metrics`` on a free port; stopped with the servers.
    tier_interval : str or float
        Time between the tier mover's passes.
    log_level : str, optional
        ``--log-level`` of every server (default: theirs, ``INFO``).
    """

    def __init__(
        self,
        base_dir: Union[str, os.PathLike],
        data_replicas: int = 3,
        metadata_replicas: int = 3,
        capacity: Union[str, int] = DEFAULT_DATA_CAPACITY,
        data_ttl: Union[str, float] = ROLE_DEFAULT_TTL_S["data"],
        metadata_ttl: Union[str, float] = ROLE_DEFAULT_TTL_S["metadata"],
        *,
        metadata_capacity: Union[str, int, None] = None,
        host: str = DEFAULT_HOST,
        token: Optional[str] = None,
        security: Optional[SecuritySettings] = None,
        insecure: bool = False,
        die_with_parent: bool = True,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        python: Optional[str] = None,
        base_port: Optional[int] = None,
        tier_mover_root: Optional[str] = None,
        tier_interval: Union[str, float] = 10.0,
        log_level: Optional[str] = None,
    ) -> None:
        if data_replicas < 0 or metadata_replicas < 0:
            raise ValueError("replica counts must be >= 0")
        total = data_replicas + metadata_replicas
        if base_port is not None and not 1 <= base_port <= 65535 - 2 * total:
            raise DeploymentError(
                f"base port {base_port}: the {2 * total} ports from it (gRPC, then metrics) must lie in 1-65535"
            )
        self.base_dir = Path(base_dir)
        self.capacity = {
            "data": parse_bytes(capacity, option="capacity"),
            "metadata": parse_bytes(
                metadata_capacity if metadata_capacity is not None else DEFAULT_METADATA_CAPACITY,
                option="metadata_capacity",
            ),
        }
        self.ttl = {
            "data": parse_duration(data_ttl, option="data_ttl", unit_required=True),
            "metadata": parse_duration(metadata_ttl, option="metadata_ttl", unit_required=True),
        }
        self.host = host
        self.security = (security if security is not None else resolve_security()).with_token(token)
        self.token = self.security.token
        self.insecure = insecure
        self.die_with_parent = die_with_parent
        self.start_timeout = start_timeout
        self.python = python or sys.executable
        self.servers: Dict[str, List[ServerProcess]] = {
            role: [
                ServerProcess(
                    role,
                    i,
                    host,
                    log_path=str(self.base_dir / f"{role}-{i}.log"),
                    pid_path=str(self.base_dir / f"{role}-{i}.pid"),
                )
                for i in range(count)
            ]
            for role, count in (("data", data_replicas), ("metadata", metadata_replicas),
                                ("tier", 1 if tier_mover_root else 0))
        }
        self.tier_mover_root = tier_mover_root
        self.tier_interval = parse_duration(tier_interval, option="tier_interval", minimum=0.01)
        self.log_level = choice_parser(*LOG_LEVELS, upper=True)(log_level, "log_level") if log_level else None
        # Fixed ports: gRPC from base_port, metrics after them (0 = a free port chosen at start).
        self._metrics_ports: Dict[str, int] = {}
        if base_port is not None:  # the cache servers' (the tier mover has no gRPC port)
            everyone = [s for role in ("data", "metadata") for s in self.servers[role]]
            for i, server in enumerate(everyone):
                server.port = base_port + i
                self._metrics_ports[server.name] = base_port + total + i
        # _lock serializes start/kill/restart/stop so the server table and deployment.json agree.
        self._lock = threading.RLock()

    # -- endpoints ---------------------------------------------------------------------------

    def endpoints(self, role: str) -> List[str]:
        """``host:port`` of each server of ``role``, by index."""
        return [s.endpoint for s in self._role(role)]

    @property
    def data_endpoints(self) -> str:
        """Data-cache endpoints as ``"host:port,host:port"`` (what CacheClient takes)."""
        return ",".join(self.endpoints("data"))

    @property
    def metadata_endpoints(self) -> str:
        """Metadata-cache endpoints as ``"host:port,host:port"``."""
        return ",".join(self.endpoints("metadata"))

    def server(self, role: str, index: int) -> ServerProcess:
        """The server ``index`` of ``role``."""
        servers = self._role(role)
        if not 0 <= index < len(servers):
            raise IndexError(f"no {role} server {index}; there are {len(servers)}")
        return servers[index]

    def _role(self, role: str) -> List[ServerProcess]:
        if role not in self.servers:
            raise ValueError(f"role must be 'data', 'metadata' or 'tier', got {role!r}")
        return self.servers[role]

    def _everyone(self) -> List[ServerProcess]:
        """Every process of the deployment: data servers, metadata servers, the tier mover."""
        return [s for role in _ROLES for s in self.servers.get(role, [])]

    @property
    def tier_mover(self) -> Optional[ServerProcess]:
        """The tier mover's process entry (``None`` when the deployment runs none)."""
        return self.servers["tier"][0] if self.servers["tier"] else None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "LocalDeployment":
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def _command(self, server: ServerProcess, port: int) -> List[str]:
        if server.role == "tier":
            cmd = [self.python, "-m", _TIER_MODULE, "--root", str(self.tier_mover_root), "--host", self.host,
                   "--interval", f"{self.tier_interval!r}s",
                   "--metrics-port", str(self._metrics_ports.get(server.name, 0))]
            return cmd + self._daemon_flags()
        cmd = [
            self.python, "-m", _SERVER_MODULE,
            "--role", server.role,
            "--host", self.host,
            "--port", str(port),
            "--capacity", str(self.capacity[server.role]),
            "--ttl", f"{self.ttl[server.role]!r}s",
            "--metrics-port", str(self._metrics_ports.get(server.name, 0)),
        ]
        return cmd + self._daemon_flags()

    def _daemon_flags(self) -> List[str]:
        """The flags every daemon of this deployment shares (server/settings.py declares them)."""
        flags = []
        if self.die_with_parent:
            flags += ["--parent-pid", str(os.getpid())]
        if self.insecure:
            flags += ["--insecure"]
        if self.log_level:
            flags += ["--log-level", self.log_level]
        return flags

    def _env(self) -> Dict[str, str]:
        env = dict(os.environ)
        path = env.get("PYTHONPATH", "")
        parts = [p for p in path.split(os.pathsep) if p]
        if _PACKAGE_PARENT not in parts:
            env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_PARENT] + parts)
        env["PYTHONUNBUFFERED"] = "1"
        for name in (ENV_TOKEN, ENV_TOKEN_FILE, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA, ENV_MTLS):
            env.pop(name, None)
        env.update(self.security.to_env())  # the environment, never argv (ps shows argv to everyone)
        return env

    def _spawn(self, server: ServerProcess, port: int) -> int:
        """Launch ``server``; returns the log offset its start-up line will follow."""
        log_path = Path(server.log_path)
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            server.popen = subprocess.Popen(
                self._command(server, port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,  # a Ctrl-C meant for the parent must not reach the servers
                close_fds=True,
            )
        server.pid = server.popen.pid
        Path(server.pid_path).write_text(f"{server.pid}\n")
        return offset

    def _await_ready(self, server: ServerProcess, offset: int, deadline: float) -> None:
        popen = server.popen
        assert popen is not None
        while True:
            with open(server.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
            _, banner, what = _ROLES[server.role]
            for line in text.splitlines():
                if line.startswith(banner) and (" listening on " in line or server.role == "tier"):
                    if " listening on " in line:
                        address = line.split(" listening on ", 1)[1].split()[0]
                        server.port = int(address.rsplit(":", 1)[1])
                    metrics = line.split(" metrics=", 1)[1].strip() if " metrics=" in line else "off"
                    server.metrics_port = (
                        int(metrics.rsplit(":", 1)[1].split("/", 1)[0]) if metrics.startswith("http") else None
                    )
                    return
            code = popen.poll()
            if code is not None:
                raise DeploymentError(
                    f"{server.name} {what} exited with status {code} before it was ready; "
                    f"last lines of {server.log_path}:\n{_log_tail(server.log_path)}",
                    endpoints=(server.endpoint,) if server.port else (),
                )
            if time.monotonic() > deadline:
                popen.kill()
                popen.wait(timeout=5)
                raise DeploymentError(
                    f"{server.name} {what} was not ready within {self.start_timeout:.1f} s "
                    f"(killed); last lines of {server.log_path}:\n{_log_tail(server.log_path)}"
                )
            time.sleep(_POLL_S)

    def start(self) -> "LocalDeployment":
        """Start every server and wait until each listens; writes ``deployment.json``.

        Raises
        ------
        DeploymentError
            If a server exits or is not ready within ``start_timeout``; the message has the
            tail of its log. Servers already started are stopped again.
        """
        with self._lock:
            self.base_dir.mkdir(parents=True, exist_ok=True)
            everyone = self._everyone()
            try:
                offsets = [(s, self._spawn(s, s.port)) for s in everyone]
                deadline = time.monotonic() + self.start_timeout
                for server, offset in offsets:
                    self._await_ready(server, offset, deadline)
            except BaseException:
                self.stop()
                raise
            self.save()
            return self

    def kill(self, role: str, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) to one server and wait (bounded) until it has exited."""
        with self._lock:
            server = self.server(role, index)
            if server.pid is None:
                return
            try:
                os.kill(server.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + DEFAULT_STOP_TIMEOUT_S
            while time.monotonic() < deadline:
                if (server.popen.poll() is not None) if server.popen else not _pid_alive(server.pid):
                    break
                time.sleep(_POLL_S)
            else:
                raise DeploymentError(f"{server.name} (pid {server.pid}) still runs {DEFAULT_STOP_TIMEOUT_S} s after signal {sig}")

    def restart(self, role: str, index: int) -> ServerProcess:
        """Stop one server if it runs and start it again on the same port (its data is gone)."""
        with self._lock:
            server = self.server(role, index)
            if server.pid is not None:
                _terminate(server.pid, server.popen, DEFAULT_STOP_TIMEOUT_S)
            offset = self._spawn(server, server.port)
            self._await_ready(server, offset, time.monotonic() + self.start_timeout)
            self.save()
            return server

    def is_running(self, role: str, index: int) -> bool:
        """Whether the server's process is alive."""
        server = self.server(role, index)
        if server.popen is not None:
            return server.popen.poll() is None
        return server.pid is not None and _pid_alive(server.pid)

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """SIGTERM every server, SIGKILL those still running after ``timeout``. Idempotent."""
        with self._lock:
            everyone = [s for s in self._everyone() if s.pid is not None]
            for server in everyone:
                try:
                    os.kill(server.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for server in everyone:
                _terminate(server.pid, server.popen, timeout, signalled=True)
                server.pid = None
                server.popen = None
                try:
                    os.unlink(server.pid_path)
                except FileNotFoundError:
                    pass
            state = self.base_dir / DEPLOYMENT_FILE
            if state.exists():
                state.unlink()

    # -- persistence -------------------------------------------------------------------------

    def to_json(self) -> Dict[str, Any]:
        """What ``deployment.json`` holds."""
        data: Dict[str, Any] = {
            "version": 1,
            "base_dir": str(self.base_dir),
            "host": self.host,
            "data_endpoints": self.data_endpoints,
            "metadata_endpoints": self.metadata_endpoints,
            "servers": [s.to_json() for s in self._everyone()],
        }
        if self.token:
            data["token"] = self.token
        return data

    def save(self) -> Path:
        """Write ``base_dir/deployment.json`` (mode 0600) atomically; returns its path."""
        path = self.base_dir / DEPLOYMENT_FILE
        tmp = path.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
        return path


def load_deployment(base_dir: Union[str, os.PathLike]) -> Optional[Dict[str, Any]]:
    """The contents of ``base_dir/deployment.json``, or ``None`` when there is none."""
    path = Path(base_dir) / DEPLOYMENT_FILE
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise DeploymentError(f"{path} is not valid JSON ({exc}); remove it after stopping its servers by hand") from exc


def acs_up(base_dir: Union[str, os.PathLike], **kwargs: Any) -> LocalDeployment:
    """Start a detached local deployment under ``base_dir`` (``acs up``).

    Keyword arguments are those of :class:`LocalDeployment`; the servers outlive this process
    and are stopped by :func:`acs_down` from any later process.

    Raises
    ------
    DeploymentError
        If ``base_dir`` already holds a running deployment, or a server fails to start.
    """
    existing = load_deployment(base_dir)
    if existing is not None:
        alive = [s for s in existing.get("servers", [])
                 if s.get("pid") and _pid_alive(s["pid"]) and _is_ours(s["pid"], s.get("role", "data"))]
        if alive:
            raise DeploymentError(
                f"{base_dir} already has a running deployment ({len(alive)} servers, data "
                f"{existing.get('data_endpoints')}, metadata {existing.get('metadata_endpoints')}); "
                f"run 'acs down' first"
            )
    kwargs.setdefault("die_with_parent", False)
    return LocalDeployment(base_dir, **kwargs).start()


def acs_down(base_dir: Union[str, os.PathLike], timeout: float = DEFAULT_STOP_TIMEOUT_S) -> List[str]:
    """Stop the deployment recorded in ``base_dir/deployment.json`` (``acs down``).

    Sends SIGTERM to each recorded server that is still one of ours, SIGKILL after ``timeout``,
    then removes the pid files and ``deployment.json``.

    Returns
    -------
    list of str
        The ``role-index`` names of the servers that were running and were stopped.
    """
    state = load_deployment(base_dir)
    if state is None:
        return []
    stopped: List[str] = []
    servers = state.get("servers", [])
    for server in servers:
        pid = server.get("pid")
        if pid and _pid_alive(pid) and _is_ours(pid, server.get("role", "data")):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            stopped.append(f"{server['role']}-{server['index']}")
    for server in servers:
        pid = server.get("pid")
        if pid and f"{server['role']}-{server['index']}" in stopped:
            _terminate(pid, None, timeout, signalled=True)
        pid_path = server.get("pid_path")
        if pid_path:
            try:
                os.unlink(pid_path)
            except FileNotFoundError:
                pass
    (Path(base_dir) / DEPLOYMENT_FILE).unlink(missing_ok=True)
    return stopped
