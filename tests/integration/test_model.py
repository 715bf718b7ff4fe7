"""A stateful model test across clusters (hypothesis): random interleavings of faults against
real processes, with consumers live in every cluster from the start.

Each example builds three clusters (A the source, B and C destinations; a chain A -> B -> C or
a star), starts one copy daemon per cluster as a user does, starts a consumer in every
cluster at once (each follows the stream from the moment it exists there), and a producer in
its own process. Then hypothesis interleaves:

* producers: sends of random sizes and counts (files roll over), take-over by a new producer
  (the old one is deposed), SIGKILL at any point (e.g. after the durable append, before the
  length is published), and stalls (SIGSTOP while a flush is in flight, a take-over, SIGCONT);
* copy daemons: SIGKILL and restart, restart with a rate cap (files copied side by side,
  slowly), bursts of many small files;
* cache replicas: SIGKILL and restart of a data or metadata cache server of any cluster.

The invariant, checked after every step (prefix) and at the end after quiescence (complete):
every consumer's sequence per shard is a prefix of the one true history (what a fresh reader
of the source cluster reads after quiescence), every acknowledged message (flush returned) is
in that history, and after quiescence every consumer has all of it.

Bounded: few examples, few steps, small data, ``deadline=None``; about a minute in all.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from tests.helpers import (  # noqa: E402
    CHAIN, CLUSTERS, STAR, Env, LiveConsumer, ProducerProcess, check_histories, source_history, start_caches,
)

pytestmark = pytest.mark.slow

#: Bound of the wait for quiescence at the end of an example.
QUIET_S = 60.0
#: Lease of the model's producers: a killed producer's shards are free after it.
PRODUCER_LEASE_S = 1.5

_state: Dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def model_caches(tmp_path_factory):
    """One data and one metadata cache server per cluster for every example of the module."""
    base = tmp_path_factory.mktemp("model")
    deps = start_caches(base / "caches")
    _state.update(caches=deps, base=base, n=0)
    try:
        yield deps
    finally:
        for dep in deps.values():
            dep.stop()
        _state.clear()


def prefix_ok(history: Dict[int, List[bytes]], consumers: List[LiveConsumer]) -> None:
    """The part of the invariant that holds at every moment: consumers read prefixes of the
    history so far (the source's history only grows, so a prefix now is a prefix later)."""
    check_histories(history, consumers, complete=False)


class CrossClusterModel(RuleBasedStateMachine):
    """Faults against real clusters; consumers in A, B and C follow throughout."""

    @initialize(links=st.sampled_from(["chain", "star"]))
    def setup(self, links: str) -> None:
        _state["n"] = int(_state["n"]) + 1
        n = _state["n"]
        caches = _state["caches"]
        self.env = Env(_state["base"] / f"ex{n}", caches, CHAIN if links == "chain" else STAR,
                       f"model{os.getpid()}e{n}", ("B", "C"))
        self.capped = set()
        for c in CLUSTERS:
            self.env.start_daemon(c)
        self.consumers = [LiveConsumer(self.env, c) for c in CLUSTERS]
        self.producers: List[ProducerProcess] = []
        self.current: Optional[ProducerProcess] = None
        self.stalled: Optional[ProducerProcess] = None
        self._new_producer()

    # -- producers -------------------------------------------------------------------------

    def _new_producer(self, roll_bytes: int = 20_000) -> ProducerProcess:
        p = ProducerProcess(self.env, f"p{len(self.producers)}", roll_bytes=roll_bytes, lease_seconds=PRODUCER_LEASE_S)
        self.producers.append(p)
        self.current = p
        return p

    @rule(n=st.integers(1, 200), size=st.sampled_from([10, 300, 3000, 20_000]))
    def send(self, n: int, size: int) -> None:
        if self.current is None or not self.current.alive:
            self._new_producer()
        self.current.send(n, size)

    @rule(n=st.integers(20, 200))
    def many_files(self, n: int) -> None:
        """A burst that rolls over many small files (copied side by side)."""
        p = self._new_producer(roll_bytes=2_000)
        p.send(n, 300)

    @rule()
    def take_over(self) -> None:
        """A new producer takes the shards over; the old one stays alive, deposed."""
        old = self.current
        self._new_producer()
        self.current.send(20, 100)
        if old is not None and old.alive:
            old.send(5, 100)  # a deposed writer: must fail or land before the seal

    @rule(n=st.integers(1, 100))
    def crash_producer(self, n: int) -> None:
        """SIGKILL while a flush is in flight (e.g. between the durable append and the publish)."""
        if self.current is None or not self.current.alive:
            return
        self.current.start_send(n, 3000)
        time.sleep(0.01 * (n % 7))
        self.current.kill()
        self.current = None

    @precondition(lambda self: self.stalled is None)
    @rule()
    def stall_producer(self) -> None:
        """A producer stalls (SIGSTOP) with a flush in flight while another takes over."""
        if self.current is None or not self.current.alive:
            self._new_producer()
        self.stalled = self.current
        self.stalled.start_send(30, 500)
        time.sleep(0.005)
        self.stalled.pause()
        self._new_producer()
        self.current.send(10, 100)

    @precondition(lambda self: self.stalled is not None)
    @rule()
    def resume_stalled(self) -> None:
        p, self.stalled = self.stalled, None
        p.resume()
        p.result(timeout=60)  # acknowledged only if its bytes lie before the take-over's seal

    # -- copy daemons and caches -----------------------------------------------------------

    @rule(cluster=st.sampled_from(CLUSTERS), down=st.floats(0.0, 2.0))
    def kill_daemon(self, cluster: str, down: float) -> None:
        self.env.kill_daemon(cluster)
        time.sleep(down)
        self.env.start_daemon(cluster)
        self.capped.discard(cluster)

    @rule(cluster=st.sampled_from(("A", "B")))
    def rate_cap(self, cluster: str) -> None:
        """Restart a daemon with a rate cap: files of a shard are copied side by side, slowly."""
        self.env.kill_daemon(cluster)
        self.env.start_daemon(cluster, "--set", "max_bytes_per_second=256KiB")
        self.capped.add(cluster)

    @rule(cluster=st.sampled_from(CLUSTERS), role=st.sampled_from(["data", "metadata"]))
    def restart_cache(self, cluster: str, role: str) -> None:
        dep = self.env.caches[cluster]
        dep.kill(role, 0)
        time.sleep(0.2)
        dep.restart(role, 0)

    # -- the invariant ---------------------------------------------------------------------

    @invariant()
    def consumers_read_prefixes(self) -> None:
        if getattr(self, "env", None) is not None:
            prefix_ok(source_history(self.env), self.consumers)

    def teardown(self) -> None:
        env = getattr(self, "env", None)
        if env is None:
            return
        try:
            self._quiesce()
        finally:
            for c in self.consumers:
                c.stop()
            for p in self.producers:
                if p.alive:
                    p.resume()
                    p.kill()
            env.stop()

    def _quiesce(self) -> None:
        env = self.env
        if self.stalled is not None:
            self.resume_stalled()
        # Every daemon runs without a cap; a last producer takes every shard over (sealing
        # whatever a killed producer left open) and closes (sealing its own files).
        for cluster in list(self.capped):
            env.kill_daemon(cluster)
            env.start_daemon(cluster)
        for c in CLUSTERS:
            if not any(p.poll() is None for p in env.daemons.get(c, [])):
                env.start_daemon(c)
        last = self._new_producer()
        last.send(10, 100)
        assert last.close(), f"the last producer did not close cleanly: {last.errors}"
        for p in self.producers[:-1]:
            if p.alive and p is not self.stalled:
                p.close()
        acknowledged = [v for p in self.producers for v in p.acknowledged]
        deadline = time.monotonic() + QUIET_S
        history: Dict[int, List[bytes]] = {}
        while time.monotonic() < deadline:
            history = source_history(env)
            total = sum(len(v) for v in history.values())
            if all(c.count() >= total for c in self.consumers):
                break
            time.sleep(0.25)
        try:
            check_histories(history, self.consumers, acknowledged)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{env.logs(15)}") from None


CrossClusterModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("ACS_MODEL_EXAMPLES", "2")),
    stateful_step_count=int(os.environ.get("ACS_MODEL_STEPS", "6")),
    deadline=None,
    derandomize=os.environ.get("ACS_MODEL_SEED") is None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
test_cross_cluster_model = CrossClusterModel.TestCase
