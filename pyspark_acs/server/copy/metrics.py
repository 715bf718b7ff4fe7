"""Copy-daemon metrics: labelled counters and gauges, served as Prometheus text on /metrics.

Names (all prefixed ``acs_copy_``):

- ``bytes_total{stream,source,target,storage}`` bytes written into the target per hop
- ``operations{role,storage}`` operations running now (role ``reader`` or ``writer``)
- ``operations_finished_total{storage}`` operations that copied a whole sealed file
- ``lag_bytes{stream,shard,target,storage}`` source length minus target length (reader side)
- ``delay_seconds{stream,shard,cluster,storage}`` producer-to-this-cluster delivery delay of
  the newest bytes written here (writer side)
- ``errors_total{kind}`` errors by kind (restart, poisoned, failed, connect, ...)
- ``tree_rebuilds_total`` copy-tree rebuilds after health or topology changes
"""

from __future__ import annotations

import http.server
import threading
from typing import Dict, List, Optional, Tuple

__all__ = ["CopyMetrics", "MetricsHTTPServer"]

_Key = Tuple[str, Tuple[Tuple[str, str], ...]]

_HELP = {
    "bytes_total": ("counter", "bytes written into the target cluster, per hop and storage"),
    "operations": ("gauge", "operations running now"),
    "operations_finished_total": ("counter", "operations that copied a whole sealed file"),
    "lag_bytes": ("gauge", "bytes the target is behind the source file"),
    "delay_seconds": ("gauge", "producer-to-cluster delivery delay of the newest bytes written"),
    "errors_total": ("counter", "errors by kind"),
    "tree_rebuilds_total": ("counter", "copy-tree rebuilds"),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class CopyMetrics:
    """Thread-safe metric values; ``_lock`` guards ``_values``."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster
        self._lock = threading.Lock()
        self._values: Dict[_Key, float] = {}

    @staticmethod
    def _key(name: str, labels: Dict[str, object]) -> _Key:
        return name, tuple(sorted((k, str(v)) for k, v in labels.items()))

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        """Add ``amount`` (negative to decrease a gauge) to the series ``name{labels}``, which starts at 0.

        Label values are compared as strings; their order does not matter.
        """
        key = self._key(name, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def set(self, name: str, value: float, **labels: object) -> None:
        """Set the series ``name{labels}`` to ``value``."""
        with self._lock:
            self._values[self._key(name, labels)] = value

    def get(self, name: str, **labels: object) -> float:
        """The value of the series ``name{labels}`` (0 if it does not exist)."""
        with self._lock:
            return self._values.get(self._key(name, labels), 0)

    def remove(self, name: str, **labels: object) -> None:
        """Drop the series ``name{labels}``, so it is no longer exported (missing is fine)."""
        with self._lock:
            self._values.pop(self._key(name, labels), None)

    def snapshot(self) -> Dict[_Key, float]:
        """A copy of every series: ``{(name, sorted (label, value) pairs): value}``."""
        with self._lock:
            return dict(self._values)

    def render(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        values = self.snapshot()
        by_name: Dict[str, List[Tuple[Tuple[Tuple[str, str], ...], float]]] = {}
        for (name, labels), v in values.items():
            by_name.setdefault(name, []).append((labels, v))
        lines: List[str] = []
        for name in sorted(by_name):
            kind, text = _HELP.get(name, ("gauge", ""))
            metric = f"acs_copy_{name}"
            lines.append(f"# HELP {metric} {text}")
            lines.append(f"# TYPE {metric} {kind}")
            for labels, v in sorted(by_name[name]):
                all_labels = (("cluster", self.cluster),) + labels
                inner = ",".join(f'{k}="{_escape(val)}"' for k, val in all_labels)
                lines.append(f"{metric}{{{inner}}} {v:g}")
        return "\n".join(lines) + "\n"


class MetricsHTTPServer:
    """``/metrics`` (Prometheus text) and ``/healthz`` over HTTP, on a background thread."""

    def __init__(self, metrics: CopyMetrics, host: str, port: int) -> None:
        owner = metrics

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = owner.render().encode(), "text/plain; version=0.0.4; charset=utf-8", 200
                elif path == "/healthz":
                    body, ctype, code = b"ok\n", "text/plain", 200
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # scrapes are not worth a log line
                pass

        self._http = http.server.ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Serve on a daemon thread (the socket is bound at construction: see ``port``)."""
        self._thread = threading.Thread(target=self._http.serve_forever, name="acs-copy-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._http.shutdown()
        self._http.server_close()
