"""A stateful model test (hypothesis) of moves, promotions and returns, with live readers in
every cluster.

Three clusters' real stores and the real promotion, epoch rule, quarantine and readers; what
is modelled in-process: the copy (each destination's copy daemon taking the source's epoch,
``CopyServicer.ensure_stream`` as its hello does, then the missing bytes appended file by file
in order, as whole files of a star tree), and the loss of a cluster (its root renamed away).
A message counts as held by every cluster a copy brought it to; a promotion keeps what any
reachable cluster holds.

The invariant, checked once everything is back and copied: the one history is what a fresh
reader of the source reads; every message held by a cluster the promotions reached is in it;
each reader's sequence is a prefix of it, except that a reader which read bytes of another
history (a returning cluster's tail past a cut) then gets a DataLossError; a reader that read
nothing outside the history never gets one, and one without an error ends with all of it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from pyspark_acs.errors import AcsError, DataLossError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.copy.promote import promote
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.producer import Producer

from tests.helpers import free_port, read_history

STREAM = "model"
CLUSTERS = ("A", "B", "C")


def _servicer(topology: Path, cluster: str, roots: Dict[str, Path]):
    from pyspark_acs.server.copy.cluster import ClusterIO
    from pyspark_acs.server.copy.metrics import CopyMetrics
    from pyspark_acs.server.copy.options import CopyDaemonOptions
    from pyspark_acs.server.copy.topology import load_topology
    from pyspark_acs.server.copy.writer import CopyServicer

    io = ClusterIO(load_topology(str(topology)).cluster(cluster), cache_deadline=0.05)
    servicer = CopyServicer(io, CopyDaemonOptions(), CopyMetrics(cluster),
                            source_store=lambda c: DurableStore(str(roots[c])))
    servicer.quarantine_settle = 0.0  # the readers are polled between the steps, not during them
    return servicer


class _Reader:
    def __init__(self, root: Path, start) -> None:
        self.consumer: Optional[Consumer] = Consumer(str(root), STREAM, start=start, poll_interval=0.0)
        self.values: List[bytes] = []
        self.error: Optional[DataLossError] = None

    def poll(self) -> None:
        if self.consumer is None or self.error is not None:
            return
        try:
            for _ in range(20):
                got = [v for b in self.consumer.poll() for v in b.column("value").to_pylist()]
                if not got:
                    return
                self.values += got
        except DataLossError as exc:
            self.error = exc
        except AcsError:
            pass  # a root gone for the moment (a lost cluster): looked at again later

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None


class Failover(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="acs-failover-model-"))
        self.roots = {c: self.tmp / f"root-{c}" for c in CLUSTERS}
        self.topology = self.tmp / "topology.json"
        self.topology.write_text(json.dumps({
            "clusters": {c: {"root": str(self.roots[c]), "data_cache": f"127.0.0.1:{free_port()}",
                             "metadata_cache": f"127.0.0.1:{free_port()}",
                             "copy_daemon": f"127.0.0.1:{free_port()}"} for c in CLUSTERS},
            "links": [{"from": "A", "to": "B", "cost": 1}, {"from": "A", "to": "C", "cost": 1},
                      {"from": "B", "to": "C", "cost": 1}],
            "streams": {STREAM: {"source": "A", "destinations": ["B", "C"]}},
        }))
        Producer(str(self.roots["A"]), STREAM, shards=1).close()
        self.source = "A"
        self.lost: Set[str] = set()
        self.counter = 0
        self.held: Dict[bytes, Set[str]] = {}  # message -> clusters whose store holds it
        self.kept: Set[bytes] = set()  # messages a promotion (or the source) kept
        self.readers: Dict[str, List[_Reader]] = {c: [] for c in CLUSTERS}
        for c in CLUSTERS:
            self._copy(c)
            self.readers[c].append(_Reader(self.roots[c], "earliest"))

    # -- the model's copy and loss ---------------------------------------------------------

    def _copy(self, child: str) -> None:
        """The source's copy daemon feeding ``child`` (a star tree): the child takes the
        source's epoch, then the missing bytes of every file, in order."""
        if child == self.source or child in self.lost or self.source in self.lost:
            return
        src = DurableStore(str(self.roots[self.source]))
        try:
            meta = src.stream_meta(STREAM) or {}
            servicer = _servicer(self.topology, child, self.roots)
            try:
                servicer.ensure_stream(STREAM, 1, self.source, int(meta.get("epoch") or 0), meta.get("promotions") or [])
            except AcsError:
                return  # refused (its own history, not the deposed source): nothing is copied
            finally:
                servicer.io.close()
            folder = shard_dir(STREAM, 0)
            dst = self.roots[child] / folder
            dst.mkdir(parents=True, exist_ok=True)
            for name in src.list_files(STREAM, 0):
                data = (self.roots[self.source] / folder / name).read_bytes()
                have = (dst / name).read_bytes() if (dst / name).exists() else b""
                assert data.startswith(have), f"{child}'s {name} is no prefix of {self.source}'s"
                with open(dst / name, "ab") as out:
                    out.write(data[len(have):])
        finally:
            src.close()
        for where in self.held.values():  # what the child holds now (a quarantine moved some aside)
            where.discard(child)
        for value in read_history(self.roots[child], STREAM).get(0, []):
            self.held.setdefault(value, set()).add(child)

    def _epoch(self, cluster: str) -> int:
        store = DurableStore(str(self.roots[cluster]))
        try:
            return int((store.stream_meta(STREAM) or {}).get("epoch") or 0)
        finally:
            store.close()

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: self.source not in self.lost)
    @rule(n=st.integers(1, 4))
    def produce(self, n: int) -> None:
        with Producer(str(self.roots[self.source]), STREAM, shards=1, roll_bytes=600) as p:
            for _ in range(n):
                value = b"m%04d" % self.counter
                self.counter += 1
                p.send(value)
                self.held[value] = {self.source}
            p.flush(timeout=10)

    @rule(child=st.sampled_from(CLUSTERS))
    def copy(self, child: str) -> None:
        self._copy(child)

    @precondition(lambda self: len(self.lost) < 1)
    @rule(to=st.sampled_from(CLUSTERS), lose_source=st.booleans())
    def promote_(self, to: str, lose_source: bool) -> None:
        if to == self.source or to in self.lost:
            return
        old = self.source
        if lose_source:
            self.roots[old].rename(self.roots[old].with_name(self.roots[old].name + ".lost"))
            self.lost.add(old)
        # The clusters of the current history take part; one that missed a promotion does not.
        epochs = {c: self._epoch(c) for c in CLUSTERS if c not in self.lost}
        if epochs[to] < max(epochs.values()):
            with pytest.raises(AcsError, match="missed a promotion"):
                promote(str(self.topology), STREAM, to, settle=0, timeout=1)
            return
        promote(str(self.topology), STREAM, to, settle=0, timeout=1)
        self.source = to
        taking_part = {c for c, e in epochs.items() if e >= epochs[to]}
        self.kept |= {v for v, where in self.held.items() if where & taking_part}

    @precondition(lambda self: bool(self.lost))
    @rule()
    def return_(self) -> None:
        for c in list(self.lost):
            self.roots[c].with_name(self.roots[c].name + ".lost").rename(self.roots[c])
            self.lost.discard(c)

    @rule(cluster=st.sampled_from(CLUSTERS))
    def read(self, cluster: str) -> None:
        if cluster not in self.lost:
            for r in self.readers[cluster]:
                r.poll()

    @rule(frm=st.sampled_from(CLUSTERS), to=st.sampled_from(CLUSTERS))
    def move_reader(self, frm: str, to: str) -> None:
        """A reader of ``frm`` goes on in ``to`` at its offsets (a Consumer moved between clusters)."""
        if frm == to or frm in self.lost or to in self.lost:
            return
        live = [r for r in self.readers[frm] if r.consumer is not None and r.error is None]
        if not live:
            return
        r = live[0]
        offsets = r.consumer.offsets()
        r.close()
        moved = _Reader(self.roots[to], offsets)
        moved.values = r.values
        self.readers[frm].remove(r)
        self.readers[to].append(moved)

    # -- the invariant, after quiescence ---------------------------------------------------

    def teardown(self) -> None:
        try:
            for c in list(self.lost):
                self.roots[c].with_name(self.roots[c].name + ".lost").rename(self.roots[c])
            self.lost.clear()
            for _ in range(2):
                for c in CLUSTERS:
                    self._copy(c)
            history = read_history(self.roots[self.source], STREAM).get(0, [])
            self.kept |= {v for v, where in self.held.items() if self.source in where}
            missing = self.kept - set(history)
            assert not missing, f"kept messages not in the history: {sorted(missing)[:5]}"
            every = set(history)
            for c in CLUSTERS:
                for r in self.readers[c]:
                    # Readers look for new files with a back-off: give each the time to get there.
                    deadline = time.monotonic() + 5.0
                    while r.error is None and r.values != history and time.monotonic() < deadline:
                        r.poll()
                        time.sleep(0.01)
                    inside = [v for v in r.values if v in every]
                    outside = [v for v in r.values if v not in every]
                    assert inside == history[:len(inside)], (c, r.values, history)
                    if outside:
                        first = r.values.index(outside[0])
                        assert r.values[:first] == history[:first], (c, r.values, history)
                        assert r.error is not None, f"reader in {c} read another history without an error: {outside}"
                    elif r.error is not None:
                        raise AssertionError(f"false DataLossError for a reader in {c} that read only the history: "
                                             f"{r.error}")
                    else:
                        assert r.values == history, (c, r.values, history)
        finally:
            for rs in self.readers.values():
                for r in rs:
                    r.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


def test_moves_promotions_and_returns_keep_one_history_per_shard():
    run_state_machine_as_test(Failover, settings=settings(
        max_examples=int(os.environ.get("ACS_MODEL_EXAMPLES", "25")), stateful_step_count=12, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], report_multiple_bugs=False))
