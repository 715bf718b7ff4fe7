"""Soak run: three clusters, live consumers in each from the start, random SIGKILLs.

A is the source; B and C are destinations, fed along a chain A -> B -> C (``--links chain``,
default) or a star A -> B, A -> C. Every cluster has its own cache servers and copy daemon,
started as a user starts them; a consumer follows the stream in every cluster from the moment
it exists there. For ``--minutes`` the script keeps producers sending (random message sizes,
files rolling over) and at random moments SIGKILLs a producer (its successor takes the
shards over), a cache replica (restarted at once) or a copy daemon (restarted after a
moment). Then it stops the faults, lets a last producer take over and close, waits for
quiescence and prints, per cluster, messages sent / acknowledged / delivered, and lost,
duplicated and reordered (all must be 0; the exit status is 1 otherwise).

Run::

    .venv/bin/python benchmarks/soak.py --minutes 10
    .venv/bin/python benchmarks/soak.py --minutes 0.5        # smoke run

The one true history is what a fresh reader of the source cluster reads after quiescence;
"lost" counts acknowledged messages missing from it plus messages of it a consumer never
got, "duplicated" messages a consumer got more than once, "reordered" consumers' per-shard
sequences that are not a prefix of the history (counted at the first differing position).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List

# The checkout, for tests.helpers (the cross-cluster harness the fault tests use).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers import (  # noqa: E402
    CHAIN,
    CLUSTERS,
    STAR,
    Env,
    LiveConsumer,
    ProducerProcess,
    source_history,
    start_caches,
)

#: Seconds between progress lines.
PROGRESS_S = 5.0
#: Bound of the wait for quiescence at the end.
QUIET_S = 180.0
#: The wait for quiescence also ends when no consumer has moved for this long.
STALLED_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults go on (default 10)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    p.add_argument("--links", choices=("chain", "star"), default="chain")
    p.add_argument("--replicas", type=int, default=1, help="data and metadata cache replicas per cluster")
    p.add_argument("--fault-every", type=float, default=3.0, help="mean seconds between faults (default 3)")
    p.add_argument("--dir", default=None, help="working folder (default: a new temporary one, kept)")
    return p


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rnd = random.Random(args.seed)
        self.base = Path(args.dir or tempfile.mkdtemp(prefix="acs-soak-"))
        self.caches = start_caches(self.base / "caches", replicas=args.replicas)
        self.env = Env(self.base / "env", self.caches, CHAIN if args.links == "chain" else STAR,
                       f"soak{os.getpid()}", ("B", "C"))
        self.producers: List[ProducerProcess] = []
        self.faults: Counter = Counter()
        self.sent = 0

    def producer(self) -> ProducerProcess:
        p = ProducerProcess(self.env, f"p{len(self.producers)}", roll_bytes=self.rnd.choice([5_000, 20_000, 100_000]))
        self.producers.append(p)
        return p

    def acknowledged(self) -> List[bytes]:
        return [v for p in self.producers for v in p.acknowledged]

    def fault(self) -> None:
        kind = self.rnd.choice(["producer", "cache", "daemon", "daemon"])
        if kind == "producer":
            self.producers[-1].kill()
            self.producer()
        elif kind == "cache":
            cluster = self.rnd.choice(CLUSTERS)
            role = self.rnd.choice(["data", "metadata"])
            index = self.rnd.randrange(self.args.replicas)
            self.caches[cluster].kill(role, index)
            time.sleep(self.rnd.uniform(0.0, 1.0))
            self.caches[cluster].restart(role, index)
            kind = f"cache {cluster} {role}-{index}"
        else:
            cluster = self.rnd.choice(CLUSTERS)
            self.env.kill_daemon(cluster)
            time.sleep(self.rnd.uniform(0.0, 3.0))
            self.env.start_daemon(cluster)
            kind = f"daemon {cluster}"
        self.faults[kind.split()[0]] += 1
        print(f"  fault: SIGKILL {kind}", flush=True)

    def progress(self, consumers: List[LiveConsumer], started: float) -> None:
        delivered = " ".join(f"{c.cluster}={c.count()}" for c in consumers)
        print(f"[{time.monotonic() - started:7.1f} s] sent={self.sent} acknowledged={len(self.acknowledged())} "
              f"delivered: {delivered} faults={dict(self.faults)}", flush=True)

    def run(self) -> int:
        env = self.env
        print(f"soak: {self.args.minutes} min, seed {self.args.seed}, links {self.args.links}, folder {self.base}",
              flush=True)
        for c in CLUSTERS:
            env.start_daemon(c)
        consumers = [LiveConsumer(env, c) for c in CLUSTERS]
        started = time.monotonic()
        try:
            self.producer()
            end = started + self.args.minutes * 60
            next_fault = started + self.rnd.expovariate(1 / self.args.fault_every)
            last_progress = started
            while time.monotonic() < end:
                p = self.producers[-1]
                n = self.rnd.randint(1, 100)
                self.sent += n
                if not p.send(n, self.rnd.choice([10, 200, 2000, 30_000])):
                    if not p.alive or p.errors:
                        self.producer()  # deposed or dead: a successor takes over
                now = time.monotonic()
                if now >= next_fault:
                    self.fault()
                    next_fault = time.monotonic() + self.rnd.expovariate(1 / self.args.fault_every)
                if now - last_progress >= PROGRESS_S:
                    last_progress = now
                    self.progress(consumers, started)
            return self.finish(consumers, started)
        finally:
            for c in consumers:
                c.stop()
            for p in self.producers:
                if p.alive:
                    p.kill()
            env.stop()
            for dep in self.caches.values():
                dep.stop()

    def finish(self, consumers: List[LiveConsumer], started: float) -> int:
        env = self.env
        print("faults stop; a last producer takes over and closes; waiting for quiescence", flush=True)
        for c in CLUSTERS:
            if not any(p.poll() is None for p in env.daemons.get(c, [])):
                env.start_daemon(c)
        last = self.producer()
        self.sent += 10
        last.send(10, 100)
        last.close()
        for p in self.producers[:-1]:
            if p.alive:
                p.close()
        deadline = time.monotonic() + QUIET_S
        history: Dict[int, List[bytes]] = {}
        counts, moved, shown = None, time.monotonic(), time.monotonic()
        while time.monotonic() < deadline:
            history = source_history(env)
            total = sum(len(v) for v in history.values())
            now_counts = [c.count() for c in consumers]
            if all(n >= total for n in now_counts):
                break
            if now_counts != counts:
                counts, moved = now_counts, time.monotonic()
            elif time.monotonic() - moved > STALLED_S:
                print(f"no consumer moved for {STALLED_S:.0f} s: stop waiting", flush=True)
                break
            if time.monotonic() - shown >= PROGRESS_S:
                shown = time.monotonic()
                self.progress(consumers, started)
            time.sleep(0.5)
        return self.report(history, consumers)

    def report(self, history: Dict[int, List[bytes]], consumers: List[LiveConsumer]) -> int:
        acknowledged = self.acknowledged()
        in_history = {v for seq in history.values() for v in seq}
        total = sum(len(v) for v in history.values())
        lost_acked = sum(1 for v in acknowledged if v not in in_history)
        history_dups = total - len(in_history)
        print(f"\nsent {self.sent}, acknowledged {len(acknowledged)}, in the source's history {total} "
              f"(acknowledged but not in it: {lost_acked}; duplicated in it: {history_dups})")
        print(f"faults: {dict(self.faults)}")
        print(f"{'cluster':8} {'delivered':>10} {'lost':>6} {'duplicated':>11} {'reordered':>10}")
        bad = lost_acked + history_dups
        for c in consumers:
            got = c.snapshot()
            delivered = sum(len(v) for v in got.values())
            seen = Counter(v for seq in got.values() for v in seq)
            duplicated = sum(n - 1 for n in seen.values() if n > 1)
            lost = sum(1 for v in in_history if v not in seen)
            reordered = 0
            for shard, true in history.items():
                seq = [v for v in got.get(shard, [])]
                if seq != true[: len(seq)]:
                    reordered += 1
            bad += lost + duplicated + reordered + len(c.errors)
            print(f"{c.cluster:8} {delivered:>10} {lost:>6} {duplicated:>11} {reordered:>10}")
            for err in c.errors:
                print(f"  consumer error: {err}")
        print("OK: nothing lost, duplicated or reordered" if bad == 0 else "FAILED", flush=True)
        return 0 if bad == 0 else 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
