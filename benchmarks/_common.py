"""Helpers shared by the benchmark scripts (not collected by pytest)."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Sequence

import pyarrow as pa
import pyarrow.compute as pc


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of samples (nearest rank)."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    k = max(0, min(len(ordered) - 1, int(round(q / 100.0 * (len(ordered) - 1)))))
    return ordered[k]


def delays_ms(batch: pa.RecordBatch, now_us: int) -> List[float]:
    """Delivery delay of every row of a batch: now minus its producer timestamp, in ms."""
    ts = batch.column("timestamp").cast(pa.int64())
    return pc.divide(pc.subtract(pa.scalar(now_us, pa.int64()), ts), 1000.0).to_pylist()


def report(title: str, rows: Dict[str, str]) -> None:
    print(f"\n== {title}")
    width = max(len(k) for k in rows)
    for k, v in rows.items():
        print(f"  {k:<{width}}  {v}")
    sys.stdout.flush()


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def summary_ms(samples: Sequence[float]) -> str:
    return (
        f"p50 {percentile(samples, 50):.2f} ms  p99 {percentile(samples, 99):.2f} ms  "
        f"mean {statistics.fmean(samples):.2f} ms  n={len(samples)}"
    )


#: How long redis-server may take to answer its first PING.
REDIS_START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throw-away redis-server on a free loopback port, no persistence."""

    def __init__(self, binary: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )

    def wait(self, redis_module) -> "object":
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        client = redis_module.Redis(host="127.0.0.1", port=self.port)
        while True:
            try:
                client.ping()
                return client
            except redis_module.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class Chain:
    """Clusters chained by link costs on this machine, for the copy benchmarks: each with its
    own data and metadata cache server (one replica each), a root under ``tmp`` and a copy
    daemon started as users start it (``extra`` flags, e.g. ``--set poll_interval=20ms``).
    A context manager: everything stops on exit. ``deps[c]`` are the cache deployments,
    ``roots[c]`` the roots."""

    def __init__(self, tmp, clusters: Sequence[str], stream: str, extra: Sequence[str] = ()) -> None:
        self.tmp, self.clusters, self.stream, self.extra = tmp, tuple(clusters), stream, list(extra)
        self.deps: Dict[str, object] = {}
        self.daemons: List[subprocess.Popen] = []
        self.roots = {c: str(tmp / f"root-{c}") for c in self.clusters}

    def __enter__(self) -> "Chain":
        import json
        import os
        from pathlib import Path

        from pyspark_acs.server.local.deploy import LocalDeployment

        try:
            progress("starting cache servers (1 data + 1 metadata replica per cluster)")
            for c in self.clusters:
                self.deps[c] = LocalDeployment(self.tmp / f"caches-{c}", data_replicas=1, metadata_replicas=1,
                                               capacity="128MiB").start()
            topo = {
                "clusters": {c: {"root": self.roots[c], "data_cache": self.deps[c].data_endpoints,
                                 "metadata_cache": self.deps[c].metadata_endpoints,
                                 "copy_daemon": f"127.0.0.1:{free_port()}"} for c in self.clusters},
                "links": [{"from": a, "to": b, "cost": 1} for a, b in zip(self.clusters, self.clusters[1:])],
                "streams": {self.stream: {"source": self.clusters[0], "destinations": list(self.clusters[1:])}},
            }
            path = self.tmp / "topology.json"
            path.write_text(json.dumps(topo, indent=1))
            here = Path(__file__).resolve().parent
            env = dict(os.environ, PYTHONPATH=str(here.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            progress("starting copy daemons")
            for c in self.clusters:
                p = subprocess.Popen(
                    [sys.executable, "-m", "pyspark_acs.server.copy.daemon", "--topology", str(path), "--cluster", c,
                     *self.extra, "--log-level", "WARNING", "--parent-pid", str(os.getpid())],
                    stdout=subprocess.PIPE, stderr=open(self.tmp / f"daemon-{c}.log", "wb"), env=env,
                )
                self.daemons.append(p)
                line = p.stdout.readline().decode().strip()
                if "listening on" not in line:
                    raise SystemExit(f"copy daemon {c} did not start; see {self.tmp}/daemon-{c}.log")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        for p in self.daemons:
            p.send_signal(signal.SIGTERM)
        for p in self.daemons:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for d in self.deps.values():
            d.stop()
