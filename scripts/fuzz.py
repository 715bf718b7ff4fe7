#!/usr/bin/env python
"""A longer fuzz run of the strategies in tests/helpers.py (docs/security.md): forged blocks with valid
checksums against the decoders, and raw request bodies against every method of a real cache
server pair and copy daemon (token-protected, on loopback). Prints the inputs tried and the
failures found per target; exits 1 when any failure was found.

    python scripts/fuzz.py --blocks 20000 --rpc 300        # ~5 minutes on 2 cores

Each failure is printed with the input hypothesis shrank it to.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

import grpc  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import helpers as fuzz  # noqa: E402
from pyspark_acs.security import SecuritySettings  # noqa: E402
from pyspark_acs.server.local.deploy import LocalDeployment  # noqa: E402

TOKEN = "fuzz-script-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def run(name: str, test, examples: int, results: dict) -> None:
    tried = [0]
    outcomes: dict = {}

    def counted(value):
        tried[0] += 1
        out = test(value)
        outcomes[out] = outcomes.get(out, 0) + 1

    started = time.monotonic()
    failure = None
    try:
        settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                 database=None)(given(test.strategy)(counted))()
    except Exception as exc:  # noqa: BLE001 - a failure is the result
        failure = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    results[name] = {"inputs": tried[0], "failures": 0 if failure is None else 1, "outcomes": outcomes,
                     "seconds": round(time.monotonic() - started, 1), "failure": failure}
    print(f"{name:32s} inputs={tried[0]:6d} failures={0 if failure is None else 1} "
          f"outcomes={outcomes} {results[name]['seconds']} s", flush=True)
    if failure:
        print(failure, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=20000, help="forged blocks to try")
    p.add_argument("--rpc", type=int, default=300, help="raw-body examples per RPC method")
    args = p.parse_args()
    results: dict = {}

    def blocks(data):
        return fuzz.check_decoder(data)

    blocks.strategy = fuzz.forged_blocks()
    run("decoder: forged blocks", blocks, args.blocks, results)

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        dep = LocalDeployment(base / "caches", data_replicas=1, metadata_replicas=1, capacity="64MiB",
                              security=SecuritySettings(token=TOKEN)).start()
        port = _free_port()
        topology = base / "topology.json"
        topology.write_text(json.dumps({"clusters": {"A": {
            "root": str(base / "root"), "data_cache": dep.data_endpoints, "metadata_cache": dep.metadata_endpoints,
            "copy_daemon": f"127.0.0.1:{port}"}}, "links": [], "streams": {}}))
        env = dict(os.environ, PYTHONPATH=str(HERE), ACS_CACHE_TOKEN=TOKEN)
        daemon = subprocess.Popen([sys.executable, "-m", "pyspark_acs.server.copy.daemon", "--topology",
                                   str(topology), "--cluster", "A", "--metrics-port", "-1",
                                   "--parent-pid", str(os.getpid())],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        daemon.stdout.readline()
        endpoints = {"pyspark_acs.cache.Cache": [dep.server("data", 0).endpoint, dep.server("metadata", 0).endpoint],
                     "pyspark_acs.copy.Copy": [f"127.0.0.1:{port}"]}
        methods = [("pyspark_acs.cache.Cache", m, k) for m, k in fuzz.CACHE_METHODS] + \
                  [("pyspark_acs.copy.Copy", m, k) for m, k in fuzz.COPY_METHODS]
        try:
            for service, method, kind in methods:
                channels = [grpc.insecure_channel(ep) for ep in endpoints[service]]
                request_class = fuzz.request_classes()[service][method]

                def rpc(bodies, channels=channels, service=service, method=method, kind=kind):
                    codes = [fuzz.check_rpc(ch, service, method, kind, bodies, metadata=AUTH, timeout=1.0).name
                             for ch in channels]
                    return codes[0]

                rpc.strategy = st.lists(fuzz.raw_bodies(request_class), min_size=1, max_size=3)
                run(f"rpc: {service.rsplit('.', 1)[1]}.{method}", rpc, args.rpc, results)
                for ch in channels:
                    ch.close()
            alive = daemon.poll() is None and all(s.popen.poll() is None for r in ("data", "metadata")
                                                  for s in dep.servers[r])
            print(f"servers alive after the run: {alive}")
            if not alive:
                results["servers"] = {"inputs": 0, "failures": 1}
        finally:
            daemon.terminate()
            daemon.wait(timeout=20)
            dep.stop()
    total = sum(r["inputs"] for r in results.values())
    failures = sum(r["failures"] for r in results.values())
    print(f"TOTAL inputs={total} failures={failures}")
    return 1 if failures else 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
