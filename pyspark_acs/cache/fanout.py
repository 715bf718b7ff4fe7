"""Fan-out of one cache call to its keys' replicas: the one-call read, quorum reads and writes.

A :class:`~pyspark_acs.cache.client.CacheClient` call hands its keys to one of these and gets
back the answer or a :class:`~pyspark_acs.errors.CacheError`. They drive the client through
its ``_replicas`` (by endpoint), ``_ring``, ``_send`` (one request to one replica, its outcome
put on a queue) and ``_error`` (the error naming what each replica said).
"""

from __future__ import annotations

import queue
import random
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from pyspark_acs.cache.replicas import Replica, deadline_error
from pyspark_acs.errors import CacheError

if TYPE_CHECKING:
    from pyspark_acs.cache.client import CacheClient

__all__ = [
    "MAX_BATCH_BYTES",
    "MAX_BATCH_KEYS",
    "Entry",
    "QuorumRead",
    "QuorumWrite",
    "majority",
    "read_anywhere",
]

#: Batches to one replica are split above this many value bytes (puts) ...
MAX_BATCH_BYTES = 4 * 1024**2
#: ... or this many keys (gets and puts; 1024 chunks of 4 KiB = 4 MiB per reply), so a large
#: call becomes several RPCs the server works on in parallel.
MAX_BATCH_KEYS = 1024


class Entry(NamedTuple):
    """A cache value and its version."""

    value: bytes
    version: int


def majority(n: int) -> int:
    """Answers needed out of ``n`` replicas."""
    return n // 2 + 1


def read_anywhere(client: "CacheClient", keys: List[bytes], pb: Any, start: float, end: float,
                  failed: Dict[str, BaseException]) -> Any:
    """A relaxed get where every replica holds every key (``CacheClient.holds_every_key``): one
    call to one usable replica picked at random -- hedged to a second one after
    ``hedge_after``, the first answer wins -- answered without the per-key bookkeeping of
    :class:`QuorumRead` (which cost about as much client CPU as the call itself on a 256-key
    read). ``None`` when every call sent failed, each replica's error then in ``failed``
    (unanswered ones as timed out): the caller runs a :class:`QuorumRead`, which fails over to
    the replicas not asked or raises naming what each said.

    A replica whose back-off ended is asked first: :meth:`Replica.usable` gave this call its
    probe (and holds other calls off it for a deadline), so the probe must go out; a still dead
    one fails at once, a stalled one is hedged like any other.

    A function, not an object: this is the read path's hot call. Returns the answering
    replica's ``GetResponse``, split from its data (:class:`~pyspark_acs.cache.wire.WithData`).
    """
    usable: List[Replica] = []
    probes: List[Replica] = []
    for rep in client._replicas.values():
        was_down = rep.down_until != 0.0  # read without the lock: it only orders the picks
        if rep.usable(start):
            (probes if was_down else usable).append(rep)
    if not usable and not probes:
        return None
    random.shuffle(usable)
    usable = probes + usable
    request = pb.GetRequest(keys=keys)
    out: "queue.SimpleQueue" = queue.SimpleQueue()
    hedge_at = start + client.hedge_after if client.hedge_after > 0 and len(usable) > 1 else None
    # With no hedge to send the answer is waited for anyway: on this thread.
    client._send(usable[0], "Get", request, end, out, None, inline=hedge_at is None)
    sent = [usable[0]]
    answered = 0
    good = None
    while answered < len(sent):
        wait_until = hedge_at if hedge_at is not None else end + 0.25
        try:
            _, rep, response, exc = out.get(timeout=max(0.0, wait_until - time.monotonic()))
        except queue.Empty:
            if hedge_at is None:
                break  # past the deadline (gRPC's fire at `end`: only a safety bound)
            hedge_at = None
            client._send(usable[1], "Get", request, end, out, None)
            sent.append(usable[1])
            continue
        answered += 1
        if exc is None and len(response.message.found) == len(keys):
            good = response
            break
        if exc is not None:
            failed[rep.endpoint] = exc
    if good is None:
        for rep in sent:
            if rep.endpoint not in failed and answered < len(sent):
                failed[rep.endpoint] = deadline_error(rep.endpoint, client.deadline)
    return good


class _FanOut:
    """One call's requests in flight: each replica's outcome lands on ``out`` as ``(tag,
    replica, response, error)``; ``pending`` counts those still to come, ``errors`` holds each
    replica's latest failure (by endpoint)."""

    __slots__ = ("client", "end", "out", "pending", "errors")

    def __init__(self, client: "CacheClient", end: float, errors: Dict[str, BaseException]) -> None:
        self.client = client
        self.end = end
        self.out: "queue.SimpleQueue" = queue.SimpleQueue()
        self.pending = 0
        self.errors = errors

    def send(self, rep: Replica, method: str, request: Any, tag: Any) -> None:
        self.client._send(rep, method, request, self.end, self.out, tag)
        self.pending += 1

    def failure(self, op: str, summary: str, involved: Sequence[str]) -> CacheError:
        """The error for a call that failed on ``involved``: the replicas among them that
        failed (all of them if none did), those that gave no answer reported as timed out."""
        errors = self.errors
        failed = [ep for ep in involved if ep in errors] or list(involved)
        for ep in failed:
            if ep not in errors:
                errors[ep] = deadline_error(ep, self.client.deadline)
        return self.client._error(op, summary, failed, errors)


class QuorumRead(_FanOut):
    """A get by the ring: each key from one replica (relaxed) or a majority (consistent), the
    highest version winning; hedged after ``hedge_after``, failing over to a key's next replica
    when one fails. The general path of ``CacheClient.get``, where :func:`read_anywhere` does
    not apply or did not answer.

    Candidate order per distinct replica tuple: usable replicas, rotated by a random offset per
    call so hot keys spread their reads over all replicas (the paper reads "a random replica");
    replicas marked down are left out and reported if nothing else answers. ``tried_first``:
    replicas a :func:`read_anywhere` of the same call asked and that failed, with their errors;
    they are not asked again (the same request would fail the same way) and are reported as
    they failed (not as the down mark their failure left, which would lose the cause and call a
    timeout "unavailable").
    """

    __slots__ = ("keys", "pb", "consistent", "hedge_at", "ring_reps", "orders", "need", "answers",
                 "inflight", "tried", "best", "done")

    def __init__(self, client: "CacheClient", keys: List[bytes], pb: Any, consistent: bool,
                 start: float, end: float, tried_first: Dict[str, BaseException]) -> None:
        ring_reps = client._ring.replicas_for_many(keys, client.replication)
        replicas = client._replicas
        rotation = random.randrange(client.replication)
        distinct = set(ring_reps)
        alive: Dict[str, bool] = {}
        errors: Dict[str, BaseException] = {}
        for ep in {ep for reps in distinct for ep in reps}:
            rep = replicas[ep]
            if ep in tried_first:
                alive[ep] = False
                errors[ep] = tried_first[ep]
                continue
            alive[ep] = rep.usable(start)
            if not alive[ep]:
                errors[ep] = rep.down(start)
        super().__init__(client, end, errors)
        orders: Dict[Tuple[str, ...], List[Replica]] = {}
        for reps in distinct:
            usable = [replicas[ep] for ep in reps if alive[ep]]
            k = rotation % len(usable) if usable else 0
            orders[reps] = usable[k:] + usable[:k]
        n = len(keys)
        self.keys = keys
        self.pb = pb
        self.consistent = consistent
        self.hedge_at = start + client.hedge_after if client.hedge_after > 0 else None
        self.ring_reps = ring_reps
        self.orders = orders
        self.need = [(majority(len(reps)) if consistent else 1) for reps in ring_reps]
        self.answers = [0] * n
        self.inflight = [0] * n
        self.tried = [0] * n  # how many of the key's candidates were sent to
        self.best: List[Optional[Entry]] = [None] * n
        self.done = [False] * n

    def dispatch(self, groups: Dict[Replica, List[int]]) -> None:
        """Send each replica its keys, in batches of at most :data:`MAX_BATCH_KEYS`."""
        keys, inflight, GetRequest = self.keys, self.inflight, self.pb.GetRequest
        for rep, idxs in groups.items():
            for lo in range(0, len(idxs), MAX_BATCH_KEYS):
                batch = idxs[lo : lo + MAX_BATCH_KEYS]
                self.send(rep, "Get", GetRequest(keys=[keys[i] for i in batch]), batch)
                for i in batch:
                    inflight[i] += 1

    def advance(self, idxs: Sequence[int], extra: bool) -> Dict[Replica, List[int]]:
        """Pick the next candidate for keys that need one more attempt."""
        done, orders, ring_reps, need = self.done, self.orders, self.ring_reps, self.need
        answers, inflight, tried = self.answers, self.inflight, self.tried
        groups: Dict[Replica, List[int]] = defaultdict(list)
        for i in idxs:
            if done[i]:
                continue
            order = orders[ring_reps[i]]
            wanted = need[i] - answers[i] - inflight[i] + (1 if extra else 0)
            while wanted > 0 and tried[i] < len(order):
                groups[order[tried[i]]].append(i)
                tried[i] += 1
                wanted -= 1
        return groups

    def give_up(self, i: int) -> bool:
        """Whether key ``i`` can no longer get the answers it needs."""
        return (self.answers[i] + self.inflight[i] < self.need[i]
                and self.tried[i] >= len(self.orders[self.ring_reps[i]]))

    def run(self) -> List[Optional[Entry]]:
        """The entries, one per key (``None`` for a miss); raises if some key got fewer answers
        than it needs."""
        keys, out = self.keys, self.out
        orders, ring_reps, need = self.orders, self.ring_reps, self.need
        answers, inflight, tried, best, done = self.answers, self.inflight, self.tried, self.best, self.done
        n = len(keys)
        remaining = n
        failed: List[int] = []
        first: Dict[Replica, List[int]] = defaultdict(list)
        for i in range(n):
            order = orders[ring_reps[i]]
            take = min(need[i], len(order))
            for j in range(take):
                first[order[j]].append(i)
            tried[i] = take
        self.dispatch(first)
        # Keys with fewer usable replicas than answers needed fail now, not after the deadline.
        for i in range(n):
            if self.give_up(i):
                done[i] = True
                failed.append(i)
                remaining -= 1

        end, hedge_at = self.end, self.hedge_at
        # Stragglers (hedges answered elsewhere) are left to finish on their own.
        while remaining > 0 and self.pending > 0:
            now = time.monotonic()
            wait_until = hedge_at if hedge_at is not None else end + 0.25
            try:
                batch, rep, response, exc = out.get(timeout=max(0.0, wait_until - now))
            except queue.Empty:
                if hedge_at is not None:
                    hedge_at = None
                    self.dispatch(self.advance([i for i in range(n) if not done[i]], extra=True))
                    continue
                break  # gRPC deadlines fire at `end`; this is only a safety bound
            self.pending -= 1
            if exc is not None:
                self.errors[rep.endpoint] = exc
                for i in batch:
                    inflight[i] -= 1
                self.dispatch(self.advance(batch, extra=False))
                for i in batch:
                    if not done[i] and self.give_up(i):
                        done[i] = True
                        failed.append(i)
                        remaining -= 1
                continue
            data, got = response.data, response.message
            offset = 0
            for i, found, size, version in zip(batch, got.found, got.sizes, got.versions):
                start_at = offset
                offset += size
                inflight[i] -= 1
                if done[i]:
                    continue
                answers[i] += 1
                if found:
                    current = best[i]
                    if current is None or version > current.version:
                        best[i] = Entry(bytes(data[start_at:offset]), version)
                if answers[i] >= need[i]:
                    done[i] = True
                    remaining -= 1
        if remaining > 0:
            failed.extend(i for i in range(n) if not done[i])
        if failed:
            consistent = self.consistent
            raise self.failure(
                f"{'consistent' if consistent else 'relaxed'} get",
                f"{len(failed)} of {n} keys got fewer answers than needed "
                f"({'a majority' if consistent else 'one'} of their replicas)",
                sorted({ep for i in failed for ep in ring_reps[i]}),
            )
        return best


class QuorumWrite(_FanOut):
    """A write to every replica of every key, done once each key has a majority of acks.

    ``build(idxs)`` makes the requests for the keys of one cohort (split into batches);
    ``acked(response, batch)`` returns the batch indexes acknowledged (``None``: all of them)
    and, when some were not, why (the replica's error for the message). Once every key has its
    majority, stragglers get ``hedge_after`` more to finish (``grace`` False: none); after that
    they are left running (not cancelled), so a slow third replica still gets the write.

    Acknowledgements are counted per batch (one request's keys, all of one cohort, sent alike
    to each of its replicas), not per key and replica: that Python step was a third of a
    producer's CPU for its chunk puts (256 chunks a MiB, three replicas). A replica that
    acknowledges some keys of a batch only (too large, a short answer) counts for those keys
    alone (``extra``, per batch). Every key is in exactly one batch.
    """

    __slots__ = ("op", "n", "acked", "batches", "b_reps", "b_need", "b_acks", "b_inflight", "extra")

    def __init__(
        self,
        client: "CacheClient",
        op: str,
        keys: Sequence[bytes],
        method: str,
        build: Callable[[List[int]], List[Tuple[Any, List[int]]]],
        acked: Callable[[Any, List[int]], Tuple[Optional[List[int]], Optional[BaseException]]],
        start: float,
        end: float,
    ) -> None:
        n = len(keys)
        replicas = client._replicas
        # Keys by the replicas that hold them (cohorts). Every replica holds every key when the
        # replication covers them all (the data cache's three of three): one cohort, no key to
        # hash.
        if client.holds_every_key():
            cohorts: Dict[Tuple[str, ...], List[int]] = {tuple(client.endpoints): list(range(n))}
        else:
            cohorts = defaultdict(list)
            for i, reps in enumerate(client._ring.replicas_for_many(keys, client.replication)):
                cohorts[reps].append(i)
        # Whom to send to, asked once per replica per write (letting a down replica's probe
        # through marks it probed).
        usable: Dict[str, bool] = {}
        for reps in cohorts:
            for ep in reps:
                if ep not in usable:
                    usable[ep] = replicas[ep].usable(start)
        super().__init__(client, end, {
            ep: replicas[ep].down(start) for ep, ok in usable.items() if not ok})
        self.op = op
        self.n = n
        self.acked = acked
        self.batches: List[List[int]] = []
        self.b_reps: List[Tuple[str, ...]] = []
        self.b_need: List[int] = []
        self.b_acks: List[int] = []  # replicas that acknowledged every key of the batch
        self.b_inflight: List[int] = []
        self.extra: Dict[int, Dict[int, int]] = {}  # batch -> key index -> acknowledgements of it alone
        for reps_key, idxs in cohorts.items():
            targets = [replicas[ep] for ep in reps_key if usable[ep]]
            need = majority(len(reps_key))
            for request, batch in build(idxs):
                slot = len(self.batches)
                self.batches.append(batch)
                self.b_reps.append(reps_key)
                self.b_need.append(need)
                self.b_acks.append(0)
                self.b_inflight.append(len(targets))
                # The replicas of a cohort get the same request, serialized once.
                payload = request if isinstance(request, bytes) or len(targets) <= 1 else request.SerializeToString()
                for rep in targets:
                    self.send(rep, method, payload, slot)

    def acks_of(self, slot: int) -> int:
        """The fewest acknowledgements a key of batch ``slot`` has."""
        alone = self.extra.get(slot)
        if alone is None:
            return self.b_acks[slot]
        return self.b_acks[slot] + min(alone.get(i, 0) for i in self.batches[slot])

    def run(self, grace: bool) -> None:
        """Wait for the acknowledgements; raises once some key cannot get its majority."""
        client, out, errors, acked, acks_of = self.client, self.out, self.errors, self.acked, self.acks_of
        batches, b_need, b_acks, b_inflight, extra = self.batches, self.b_need, self.b_acks, self.b_inflight, self.extra
        end = self.end
        remaining = sum(1 for slot in range(len(batches)) if acks_of(slot) < b_need[slot])
        hopeless = any(acks_of(slot) + b_inflight[slot] < b_need[slot] for slot in range(len(batches)))
        grace_until: Optional[float] = None
        while self.pending > 0 and not hopeless:
            if remaining == 0:
                # Quorum reached. Give the other replicas a short grace (hedge_after) to finish
                # too, so a relaxed read right after this put rarely meets a replica that has
                # not stored it yet; a slow replica still costs at most that grace.
                if grace_until is None:
                    grace_until = min(end, time.monotonic() + (client.hedge_after if grace else 0.0))
                wait = grace_until - time.monotonic()
                if wait <= 0:
                    break
            else:
                wait = end + 0.25 - time.monotonic()  # safety bound only: gRPC deadlines fire at `end`
            try:
                slot, rep, response, exc = out.get(timeout=max(0.0, wait))
            except queue.Empty:
                break
            self.pending -= 1
            b_inflight[slot] -= 1
            was_done = acks_of(slot) >= b_need[slot]
            if exc is not None:
                errors[rep.endpoint] = exc
            else:
                ok, refusal = acked(response, batches[slot])
                if refusal is not None:
                    errors[rep.endpoint] = refusal
                if ok is None:
                    b_acks[slot] += 1
                else:
                    alone = extra.setdefault(slot, {})
                    for i in ok:
                        alone[i] = alone.get(i, 0) + 1
            now_acks = acks_of(slot)
            if not was_done and now_acks >= b_need[slot]:
                remaining -= 1
            hopeless = now_acks + b_inflight[slot] < b_need[slot]
        if remaining == 0:
            return
        # A write gives up as soon as one key cannot get its majority any more: keys still in
        # flight then are not failed (their replicas may store them), only not acknowledged.
        short = unanswered = 0
        involved: set = set()
        for slot, batch in enumerate(batches):
            if acks_of(slot) >= b_need[slot]:
                continue
            involved.update(self.b_reps[slot])
            alone = extra.get(slot, {})
            for i in batch:
                got = b_acks[slot] + alone.get(i, 0)
                if got < b_need[slot]:
                    short += 1
                    unanswered += got + b_inflight[slot] >= b_need[slot]
        raise self.failure(
            self.op,
            f"{short} of {self.n} keys got fewer than a majority of acknowledgements"
            + (f" ({unanswered} of them still unanswered when it gave up)" if unanswered else ""),
            sorted(involved),
        )
