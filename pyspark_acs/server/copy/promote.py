"""Promotion: make a destination cluster the source of a stream (``acs promote``; docs/copy.md).

Copies flow from parent to child only, so when the source cluster A is lost (or for a planned
move) nothing else makes B the place where producers write. :func:`promote` does, in steps
that are each safe to run again (a promotion interrupted at any step, run again, ends in the
same state):

1. **Fence.** Every reachable destination's ``_stream.json`` gets the next *epoch* and a
   promotion record ``{"epoch", "source": B, "previous": A, "state": "fenced", "at"}``. From
   then on a copy from A (whose epoch stays behind) is refused at its hello, and an operation
   A began before is poisoned within ``EPOCH_RECHECK_S`` (the epoch rule:
   :meth:`~pyspark_acs.storage.store.DurableStore.create_stream`; the poison:
   ``server/copy/writer.py``). A reachable A is marked a copy of B, so no new Producer or
   sink starts there. Promotion then waits :data:`FENCE_SETTLE_S`.
2. **Longest prefix.** Per shard, every file any reachable cluster holds, at the longest
   length one of them holds: a sealed copy is the whole file, else a copy ends where its last
   complete block ends (files are byte-identical prefixes in every cluster).
3. **Bring B there.** Bytes B lacks are read from the cluster that has them and appended to
   B's file (store to store), each range checked first as whole blocks with valid checksums
   (``validate_delta``, the copy writer's check), and shadowed into B's caches.
4. **Seal** every unsealed file of B's shards where its valid bytes end, as a take-over does
   (:meth:`~pyspark_acs.write.shard.ShardWriter.seal_file`). The seal is the fence for a
   writer still running in A: no copy of its later bytes can land in B.
5. **Record the cut**: per shard, B's newest file and its sealed length, where the new
   history leaves A's. B's ``_stream.json`` drops ``copied_from`` (Producers and sinks may
   write there now); every other reachable destination's record gets the cut too, and the
   clusters fenced later learn it from their parent's hello.
6. **Re-root** the topology file (JSON): the stream's source is B, A becomes a destination,
   a pinned ``tree`` is dropped.
7. **Wait** until every copy daemon that answers reports the new file (``Health``'s
   ``topology_sha256``; daemons reread the file every ``listing_interval``).

A cluster that is unreachable throughout (A, or a destination that was down) keeps its epoch:
its daemon's copies are refused everywhere fenced, and when it comes back as a destination it
adopts the new epoch from its parent, moving its bytes past the cut aside first
(:mod:`~pyspark_acs.server.copy.quarantine`); the record names, per shard, where the old
history's bytes end in each of B's files after ``sealed_through`` (``sealed``).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from pyspark_acs.errors import AcsError, AcsTimeoutError, RootNotFoundError, StoreError, TopologyError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.server.copy.cluster import ClusterIO
from pyspark_acs.server.copy.topology import Topology, load_topology, write_topology
from pyspark_acs.storage.store import DurableStore, record_time, stream_epoch
from pyspark_acs.storage.tier import tiered_store

__all__ = [
    "promote",
    "seal_open_files",
]

log = logging.getLogger(__name__)

#: How long promotion waits after its fence before it measures the prefixes (seconds): four
#: times ``EPOCH_RECHECK_S``, the longest a copy operation begun before the fence goes on.
FENCE_SETTLE_S = 1.0
#: Deadline of one ``Health`` call to a copy daemon (seconds).
HEALTH_TIMEOUT_S = 2.0
#: Between two rounds of ``Health`` calls while waiting for the daemons (seconds).
HEALTH_POLL_S = 0.2


@dataclass
class PromotionReport:
    """What :func:`promote` did (JSON-able through :meth:`to_dict`)."""

    stream: str
    source: str
    previous: str
    epoch: int
    #: Per shard: (file, length) where the new history leaves the old one.
    cut: Dict[int, Tuple[str, int]] = field(default_factory=dict)
    #: (shard, file, cluster the bytes came from, start, end) of every range copied into B.
    copied: List[Tuple[int, str, str, int, int]] = field(default_factory=list)
    #: (shard, file, length after the seal) of every file promotion sealed.
    sealed: List[Tuple[int, str, int]] = field(default_factory=list)
    #: Per shard: {file: [where its messages end, its length]} of B's files after the record's
    #: ``sealed_through`` (recorded with the cut as ``sealed``: a returning cluster's bytes
    #: past them are quarantined, :mod:`~pyspark_acs.server.copy.quarantine`).
    prefixes: Dict[int, Dict[str, List[int]]] = field(default_factory=dict)
    #: Clusters whose store could not be read, and why.
    unreachable: Dict[str, str] = field(default_factory=dict)
    #: Per cluster with a copy daemon: "runs the new topology" or why it was not waited for.
    daemons: Dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "stream": self.stream, "source": self.source, "previous": self.previous, "epoch": self.epoch,
            "cut": {str(s): {"file": f, "length": n} for s, (f, n) in sorted(self.cut.items())},
            "copied": [{"shard": s, "file": f, "from": c, "start": a, "end": b} for s, f, c, a, b in self.copied],
            "sealed": [{"shard": s, "file": f, "length": n} for s, f, n in self.sealed],
            "unreachable": dict(self.unreachable), "daemons": dict(self.daemons),
        }


def promote(topology_path: str, stream: str, to: str, *, timeout: float = 60.0,
            progress: Optional[Callable[[str], None]] = None, settle: float = FENCE_SETTLE_S,
            security: Any = None, sleep: Callable[[float], None] = time.sleep,
            clock: Callable[[], float] = time.monotonic) -> PromotionReport:
    """Make cluster ``to`` the source of ``stream`` (the module's steps), and return what was done.

    Parameters
    ----------
    topology_path : str
        The JSON topology file every copy daemon reads; rewritten with ``to`` as the source.
    stream : str
        The stream.
    to : str
        A destination of the stream (or, run again, its source since an earlier promotion).
    timeout : float
        How long to wait for the copy daemons to run the new topology (seconds).
    progress : callable, optional
        Called with one line per step (``acs promote`` prints them).
    settle : float
        The wait after the fence (:data:`FENCE_SETTLE_S`).
    security : SecuritySettings, optional
        For the daemons' and caches' clients (default: the topology's ``security`` table,
        else the environment).

    Raises
    ------
    TopologyError
        Unknown stream or cluster, ``to`` is not a destination, or the file is not JSON.
    AcsError
        ``to``'s store cannot be read or holds no copy of the stream; a copy in ``to`` that
        does not continue the bytes promotion would append (naming the file and range).
    AcsTimeoutError
        A copy daemon that answers did not run the new topology within ``timeout`` (naming it);
        the stores are promoted by then, and running the command again only waits.

    Examples
    --------
    >>> report = promote("topology.json", "orders", "B")        # doctest: +SKIP
    >>> report.cut                                              # doctest: +SKIP
    {0: ('20261203T101500.000000Z-0a1b2c3d.acs', 48211)}
    """
    say = progress or (lambda line: log.info("%s", line))
    if Path(topology_path).suffix.lower() != ".json":
        raise TopologyError(f"{topology_path}: acs promote rewrites the topology file and writes JSON only (a "
                            f"TOML file's comments would be lost); convert it to a .json file with the same keys")
    topology = load_topology(topology_path)
    spec = topology.streams.get(stream)
    if spec is None:
        raise TopologyError(f"{topology_path}: no stream {stream!r} (streams: {', '.join(sorted(topology.streams))})")
    topology.cluster(to)
    if security is None:
        from pyspark_acs.security import resolve_security

        sec = topology.security
        security = resolve_security(token_file=sec.get("token_file"), tls_cert=sec.get("tls_cert"),
                                    tls_key=sec.get("tls_key"), tls_ca=sec.get("tls_ca"), mtls=sec.get("mtls"))
    names = [spec.source] + [d for d in spec.destinations if d != spec.source]
    stores, unreachable = _open_stores(topology, names, stream)
    if to not in stores:
        raise AcsError(f"cannot promote {to}: its store {topology.cluster(to).root} cannot be read "
                       f"({unreachable.get(to)}); promote a cluster whose store is reachable")
    b_meta = stores[to].stream_meta(stream)
    if b_meta is None:
        raise AcsError(f"cannot promote {to}: {topology.cluster(to).root} holds no copy of stream {stream!r}")
    record = _last_record(b_meta, to)
    if spec.source == to:
        if record is None:
            raise TopologyError(f"{topology_path}: {to} is already the source of {stream!r} and no promotion "
                                f"to it is recorded; nothing to promote")
        previous = record["previous"]
    elif to not in spec.destinations:
        raise TopologyError(f"{topology_path}: {to} is not a destination of {stream!r} (destinations: "
                            f"{', '.join(spec.destinations) or 'none'}); only a copy can be promoted")
    else:
        previous = spec.source
    for name in [previous] + list(spec.destinations):
        if name not in stores and name not in unreachable:
            found, why = _open_stores(topology, [name], stream)
            stores.update(found)
            unreachable.update(why)
    for name, why in sorted(unreachable.items()):
        say(f"{name}: store not reachable ({why}); left as it is")
    # A cluster that missed a promotion (it was unreachable then) holds another history past
    # that cut: it takes no part in this one (neither fenced nor read for the prefix) and
    # quarantines what it holds past the cuts when it next takes copies.
    base = stream_epoch(b_meta) if record is None else int(record["epoch"]) - 1
    epochs = {c: stream_epoch(st.stream_meta(stream)) for c, st in stores.items()}
    ahead = sorted(c for c, e in epochs.items() if e > base and (record is None or e > int(record["epoch"])))
    if ahead:  # also when ``to`` records an older promotion to itself: not this one run again
        raise AcsError(f"cannot promote {to}: it holds the stream at epoch {int(b_meta.get('epoch') or 0)}, while "
                       f"{', '.join(ahead)} hold(s) "
                       f"epoch {max(epochs[c] for c in ahead)}: {to} missed a promotion and holds another history; "
                       f"promote a cluster of the current history")
    for name in sorted(c for c, e in epochs.items() if e < base and c != to):
        say(f"{name}: at epoch {epochs[name]}, behind epoch {base} (it missed a promotion); left as it is: it "
            f"quarantines what it holds past the cuts when it next takes copies")
        unreachable[name] = f"behind: epoch {epochs[name]} < {base}"
        stores.pop(name).close()
    # B first: on a run again after a stop, B's record is the promotion to go on with.
    fenced = [to] + sorted(c for c, st in stores.items()
                           if c not in (previous, to) and st.stream_meta(stream) is not None)

    # 1. Fence.
    if record is None:
        epoch = 1 + max(stream_epoch(st.stream_meta(stream)) for st in stores.values())
        record = {"epoch": epoch, "id": secrets.token_hex(8), "source": to, "previous": previous,
                  "state": "fenced", "at": record_time(),
                  "sealed_through": _sealed_through(stores[to], stream, int(b_meta["shards"]))}
    epoch = int(record["epoch"])
    report = PromotionReport(stream, to, previous, epoch, unreachable=unreachable)
    if record["state"] == "fenced":
        newly = [c for c in fenced if _fence(stores[c], c, stream, record)]
        if previous in stores:
            # A reachable old source is marked a copy, then takes the epoch too: it holds the
            # history up to the cut (its open files are sealed below), no other one.
            _mark_copy(stores[previous], stream, to)
            if _fence(stores[previous], previous, stream, record):
                newly.append(previous)
        say(f"fenced epoch {epoch} in {', '.join(fenced)}"
            + (f"; {previous} marked a copy of {to}" if previous in stores else ""))
        if newly:
            sleep(settle)  # operations begun before the fence are poisoned meanwhile
        _still_ours(stores[to], to, stream, record)

        # 2-4. Longest prefix (caches included: readers may have delivered what a cache
        # holds beyond its durable copy), bring B there, seal.
        shards = int(b_meta["shards"])
        paths = {c: _path(st, topology.cluster(c), security) for c, st in stores.items()}
        # B's cache clients: what promotion appends and seals is shadowed there, so B's readers
        # following by push get it as they get a producer's bytes.
        io = ClusterIO(topology.cluster(to), security=security)
        try:
            if previous in stores:
                for shard in range(shards):  # a planned move: A's writers are fenced first
                    seal_open_files(stores[previous], stream, shard, None, report, say, who=previous)
            for shard in range(shards):
                _bring(stream, shard, to, stores[to], paths, io, report, say)
                report.prefixes[shard] = _prefixes(stores[to], stream, shard,
                                                   record["sealed_through"].get(str(shard), ""))
        finally:
            io.close()
            for path in paths.values():
                path.close()
        record = dict(record, state="cut",
                      cut={str(s): ({"file": f, "length": n} if f else {"file": None, "length": 0})
                           for s, (f, n) in report.cut.items()},
                      sealed={str(s): files for s, files in sorted(report.prefixes.items())})
    else:
        report.cut = {int(s): (c["file"] or "", int(c["length"])) for s, c in (record.get("cut") or {}).items()}
        say(f"epoch {epoch}: the cut is recorded already; stores left as they are")

    # 5. Record the cut.
    _still_ours(stores[to], to, stream, record)
    for c in fenced + ([previous] if previous in stores else []):
        _record_cut(stores[c], stream, record, is_source=c == to)
    say(f"cut recorded in {', '.join(fenced)}: "
        + (", ".join(f"shard {s} at {f} byte {n}" for s, (f, n) in sorted(report.cut.items()) if f) or "no files"))
    for store in stores.values():
        store.close()

    # 6. Re-root.
    digest = _reroot(topology_path, stream, to, previous)
    say(f"topology {topology_path}: {to} is the source of {stream!r}, {previous} a destination")

    # 7. Wait for the daemons.
    _wait_daemons(load_topology(topology_path), digest, report, timeout, security, say, sleep, clock)
    return report


def _sealed_through(store: DurableStore, stream: str, shards: int) -> Dict[str, str]:
    """Per shard, the newest file of ``store`` before which (and with which) every file was
    sealed before the promotion ("" when its first file is not): histories can only part
    after it, so a returning cluster's files are compared from the next one on
    (:func:`~pyspark_acs.server.copy.quarantine.past_cut`). Taken at the fence, before promotion seals anything."""
    from pyspark_acs.write.file import scan_file

    view = tiered_store(store)
    out: Dict[str, str] = {}
    for shard in range(shards):
        folder = shard_dir(stream, shard)
        names = view.list_files(stream, shard)
        lengths = view.lengths([f"{folder}/{n}" for n in names]) if names else {}
        through = ""
        for name in names:
            rel = f"{folder}/{name}"
            if not scan_file(view, rel, length=lengths.get(rel) or 0).sealed:
                break
            through = name
        out[str(shard)] = through
    return out


def _open_stores(topology: Topology, names: List[str], stream: str) -> Tuple[Dict[str, DurableStore], Dict[str, str]]:
    stores: Dict[str, DurableStore] = {}
    why: Dict[str, str] = {}
    for name in names:
        root = topology.cluster(name).root
        try:
            store = DurableStore(root, create=False)
            store.stream_meta(stream)  # readable, not just present
            stores[name] = store
        except (RootNotFoundError, StoreError, OSError) as exc:
            why[name] = str(exc)
    return stores, why


def _last_record(meta: Dict[str, Any], to: str) -> Optional[Dict[str, Any]]:
    """The promotion to ``to`` this store records as its newest, if that is its epoch."""
    records = meta.get("promotions") or []
    if records and records[-1].get("source") == to and int(records[-1].get("epoch", -1)) == stream_epoch(meta):
        return dict(records[-1])
    return None


def _fence(store: DurableStore, cluster: str, stream: str, record: Dict[str, Any]) -> bool:
    """Write the fence record into ``store`` unless it is there; True when written now.

    Raises
    ------
    AcsError
        The store records another promotion at this epoch or a later one (two ran at once).
    """
    written = [False]

    def change(meta: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if meta is None:
            return None  # no copy here yet: it takes the epoch from its parent's first hello
        here = stream_epoch(meta)
        if here >= record["epoch"]:
            last = (meta.get("promotions") or [{}])[-1]
            if last.get("id") != record["id"]:
                raise AcsError(f"cannot promote {record['source']}: {cluster} records another promotion (epoch "
                               f"{here}, to {last.get('source')!r} at {last.get('at', '?')}): promotions of one "
                               f"stream ran at once; run acs promote again for the cluster that is to be the source")
            return None
        written[0] = True
        return dict(meta, epoch=record["epoch"], promotions=list(meta.get("promotions") or []) + [record])

    if store.stream_meta(stream) is None:
        return False
    store.update_stream_meta(stream, change)
    return written[0]


def _still_ours(store: DurableStore, cluster: str, stream: str, record: Dict[str, Any]) -> None:
    """Stop when ``cluster`` now records another, later promotion (one that ran meanwhile wins:
    this one changes no more stores and does not re-root the topology)."""
    last = ((store.stream_meta(stream) or {}).get("promotions") or [{}])[-1]
    if last.get("id") != record["id"]:
        raise AcsError(f"cannot promote {record['source']}: {cluster} records another promotion since this one "
                       f"began (epoch {last.get('epoch')}, to {last.get('source')!r} at {last.get('at', '?')}); "
                       f"that one stands. Run acs promote one at a time per stream")


def _mark_copy(store: DurableStore, stream: str, to: str) -> None:
    """Mark the old source a copy of ``to`` (new Producers and sinks there are refused)."""
    def change(meta: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if meta is None or meta.get("copied_from") == to:
            return None
        return dict(meta, copied_from=to)

    if store.stream_meta(stream) is not None:
        store.update_stream_meta(stream, change)


def _record_cut(store: DurableStore, stream: str, record: Dict[str, Any], *, is_source: bool) -> None:
    def change(meta: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        records = list((meta or {}).get("promotions") or [])
        if meta is None or not records or records[-1].get("id") != record["id"]:
            return None  # not fenced here by this promotion: its parent's hello brings the record
        new = dict(meta, promotions=records[:-1] + [record])
        if is_source:
            new.pop("copied_from", None)
        return None if new == meta else new

    if store.stream_meta(stream) is not None:
        store.update_stream_meta(stream, change)


class _View:
    """One cluster's files as its readers see them: the durable store (tiered files included)
    and, beyond its durable copy, what its caches hold (a reader may have delivered it)."""

    def __init__(self, store: DurableStore, path: Any) -> None:
        self.files = tiered_store(store)
        self.path = path
        self.uri = store.uri

    def list_files(self, stream: str, shard: int) -> List[str]:
        return self.files.list_files(stream, shard)

    def lengths(self, rels: List[str]) -> Dict[str, Optional[int]]:
        durable = self.files.lengths(rels)
        if self.path is None:
            return durable
        try:
            readable = self.path.lengths(rels)
        except AcsError as exc:
            log.debug("promote: cache lengths not read: %s", exc)
            return durable
        return {r: max((n for n in (durable.get(r), readable.get(r)) if n is not None), default=None) for r in rels}

    def read(self, rel: str, start: int, end: int) -> bytes:
        got = self.files.read(rel, start, end) if start < end else b""
        if len(got) < end - start and self.path is not None:
            more = self.path.read(rel, start + len(got), end, postpone=False)
            got += more
        return got

    def close(self) -> None:
        if self.path is not None:
            self.path.close()


def _path(store: DurableStore, cluster: Any, security: Any) -> _View:
    from pyspark_acs.read.readpath import open_read_path

    try:
        path = open_read_path(store, data_cache=cluster.data_cache, metadata_cache=cluster.metadata_cache,
                              security=security)
    except AcsError as exc:
        log.debug("promote: %s's caches not opened: %s", cluster.name, exc)
        path = None
    return _View(store, path)


def _prefixes(store: DurableStore, stream: str, shard: int, through: str) -> Dict[str, List[int]]:
    """``{file: [where its messages end, its length]}`` of B's files after ``through`` (each
    sealed by now): where the old history's bytes end in the new one, for a returning
    cluster's check (:func:`~pyspark_acs.server.copy.quarantine.past_cut`). Read from the
    files, not from what this run sealed, so a promotion run again records the same."""
    from pyspark_acs.write.file import scan_file

    view = tiered_store(store)
    folder = shard_dir(stream, shard)
    names = [n for n in view.list_files(stream, shard) if n > through]
    lengths = view.lengths([f"{folder}/{n}" for n in names]) if names else {}
    out: Dict[str, List[int]] = {}
    for name in names:
        tail = scan_file(view, f"{folder}/{name}", length=lengths.get(f"{folder}/{name}") or 0)
        out[name] = [tail.end, tail.length]
    return out


def seal_open_files(store: DurableStore, stream: str, shard: int, io: Optional[ClusterIO], report: Optional[PromotionReport],
              say: Callable[[str], None], who: str) -> List[Tuple[str, int, int]]:
    """Seal every unsealed file of the shard in ``store`` where its valid bytes end, as a
    take-over does; returns (file, length after, where its valid bytes end) of those sealed."""
    from pyspark_acs.write.file import scan_file
    from pyspark_acs.write.shard import ShardWriter

    folder = shard_dir(stream, shard)
    names = store.list_files(stream, shard)  # unsealed files are never tiered
    done: List[Tuple[str, int, int]] = []
    if not names:
        return done
    sealer = ShardWriter(store, stream, shard, f"promote-{who}", data=io.data if io else None,
                         meta=io.meta if io else None,
                         on_cache_error=lambda what, exc: log.debug("promote: %s not shadowed: %s", what, exc))
    lengths = store.lengths([f"{folder}/{n}" for n in names])
    for name in names:
        rel = f"{folder}/{name}"
        tail = scan_file(store, rel, length=lengths.get(rel) or 0)
        if tail.sealed:
            continue
        sealer.seal_file(name)
        after = store.lengths([rel]).get(rel) or 0
        done.append((name, after, tail.end))
        say(f"{who}: shard {shard}: {name}: sealed at byte {after}")
    return done


def _bring(stream: str, shard: int, to: str, store: DurableStore, views: Dict[str, _View], io: ClusterIO,
           report: PromotionReport, say: Callable[[str], None]) -> None:
    """Steps 2-4 for one shard: B's files to the longest prefix any reachable cluster holds
    (every file of it, empty ones too), then sealed; the cut into ``report``."""
    from pyspark_acs.server.copy.writer import validate_delta
    from pyspark_acs.write.file import FileWriter, scan_file

    folder = shard_dir(stream, shard)
    listed: Dict[str, Dict[str, int]] = {}
    for cluster, view in views.items():
        try:
            names = view.list_files(stream, shard)
            lengths = view.lengths([f"{folder}/{n}" for n in names]) if names else {}
        except (StoreError, OSError) as exc:
            say(f"{cluster}: shard {shard} not listed ({exc}); its copy is left out")
            continue
        listed[cluster] = {n: lengths[f"{folder}/{n}"] for n in names if lengths.get(f"{folder}/{n}") is not None}
    mine_view = views[to]
    quiet = lambda what, exc: log.debug("promote: %s not shadowed: %s", what, exc)  # noqa: E731
    for name in sorted(set().union(*listed.values())):
        rel = f"{folder}/{name}"
        best: Optional[Tuple[int, bool, str]] = None  # (length, sealed, cluster)
        for cluster, files in listed.items():
            if name not in files:
                continue
            tail = scan_file(views[cluster], rel, length=files[name])
            here = (tail.length if tail.sealed else tail.end, tail.sealed, cluster)
            if best is None or here[:2] > best[:2]:
                best = here
        assert best is not None
        have = store.lengths([rel]).get(rel)
        if have is None and mine_view.files.lengths([rel]).get(rel) is not None:
            continue  # tiered here: sealed and whole
        if have is None:
            store.open_appender(rel).close()  # a file another cluster holds, even empty: B's readers need it
            have = 0
        mine = scan_file(store, rel, length=have) if have else None
        if mine is not None and mine.sealed:
            continue
        length, _, cluster = best
        if length <= have:
            continue
        start = mine.end if mine is not None else 0
        prefix = store.read(rel, start, have) if have > start else b""
        theirs = views[cluster].read(rel, start, length)
        if len(theirs) < length - start:
            raise AcsError(f"cannot promote {to}: {cluster}'s copy of {store.uri(rel)} reads short: bytes "
                           f"[{start + len(theirs)}, {length}) did not come; run acs promote again")
        if theirs[:len(prefix)] != prefix:
            raise AcsError(f"cannot promote {to}: its {store.uri(rel)} ends in a torn block, bytes [{start}, {have}), "
                           f"that is not the start of {cluster}'s block there (a crashed copy left other bytes), "
                           f"so {cluster}'s bytes up to {length} cannot follow it; promote {cluster} instead")
        validate_delta(b"", theirs, base=start, path=store.uri(rel))
        writer = FileWriter(store, rel, data=io.data, meta=io.meta, position=have, on_cache_error=quiet)
        try:
            writer.append(theirs[len(prefix):])
        finally:
            writer.close()
        report.copied.append((shard, name, cluster, have, length))
        say(f"shard {shard}: {name}: bytes [{have}, {length}) copied from {cluster}")
    for name, after, _ in seal_open_files(store, stream, shard, io, None, say, who=to):
        report.sealed.append((shard, name, after))
    names = mine_view.list_files(stream, shard)
    if not names:
        report.cut[shard] = ("", 0)
        return
    last = f"{folder}/{names[-1]}"
    report.cut[shard] = (names[-1], int(mine_view.files.lengths([last]).get(last) or 0))


def _reroot(topology_path: str, stream: str, to: str, previous: str) -> str:
    """Rewrite the JSON topology file with ``to`` as the stream's source (atomically, validated
    first); returns the SHA-256 of the file's bytes as the daemons will read them."""
    import hashlib

    path = Path(topology_path)
    raw = path.read_bytes()
    data = json.loads(raw)
    entry = data["streams"][stream]
    if entry.get("source") != to:
        entry["source"] = to
        entry["destinations"] = [d for d in entry.get("destinations", []) if d != to]
        if previous not in entry["destinations"]:
            entry["destinations"].append(previous)
        entry.pop("tree", None)  # pinned from the old source: no longer a tree of this stream
        return write_topology(path, data).sha256
    return hashlib.sha256(raw).hexdigest()


def _wait_daemons(topology: Topology, digest: str, report: PromotionReport, timeout: float, security: Any,
                  say: Callable[[str], None], sleep: Callable[[float], None], clock: Callable[[], float]) -> None:
    from pyspark_acs._grpc import grpc
    from pyspark_acs.server.copy.proto import copy_pb2, copy_pb2_grpc

    channels = {name: security.channel(c.copy_daemon, with_token=True) for name, c in topology.clusters.items()}
    waiting = set(channels)
    deadline = clock() + timeout
    try:
        while True:
            for name in sorted(waiting):
                try:
                    got = copy_pb2_grpc.CopyStub(channels[name]).Health(copy_pb2.HealthRequest(),
                                                                        timeout=HEALTH_TIMEOUT_S)
                except grpc.RpcError as exc:
                    # Not waited for: a daemon that comes back, or answers again, on the old
                    # topology has its copies refused wherever the fence reached.
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        report.daemons[name] = "not reachable (UNAVAILABLE); not waited for"
                        say(f"{name}: copy daemon not reachable at {topology.cluster(name).copy_daemon}; "
                            f"not waited for (it reads the new topology when it starts)")
                    else:
                        report.daemons[name] = f"did not answer ({exc.code().name}); not waited for"
                        say(f"{name}: copy daemon at {topology.cluster(name).copy_daemon} did not answer in "
                            f"{HEALTH_TIMEOUT_S:g} s ({exc.code().name}; stopped or overloaded); not waited for: "
                            f"if it runs the old topology, the fenced clusters refuse its copies")
                    waiting.discard(name)
                    continue
                if got.topology_sha256 == digest:
                    report.daemons[name] = "runs the new topology"
                    say(f"{name}: copy daemon runs the new topology")
                    waiting.discard(name)
                elif not got.topology_sha256:
                    report.daemons[name] = "answers without naming its topology (an older version); not waited for"
                    waiting.discard(name)
            if not waiting:
                return
            if clock() >= deadline:
                raise AcsTimeoutError(
                    f"the copy daemons of {', '.join(sorted(waiting))} did not run the new topology within "
                    f"{timeout:g} s (they reread it every listing_interval; is their --topology another copy of "
                    f"the file?). The stores are promoted; run acs promote again to wait again")
            sleep(HEALTH_POLL_S)
    finally:
        for channel in channels.values():
            channel.close()
