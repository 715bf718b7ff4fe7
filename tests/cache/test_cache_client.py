"""CacheClient against real replicated cache servers: quorums, hedging, failover, recovery."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import threading
import time
from concurrent import futures

import pytest

from tests.helpers import free_port, stop_process, wait_until
from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.endpoints import parse_endpoints
from pyspark_acs.cache.fanout import Entry
from pyspark_acs.cache.replicas import DOWN_BACKOFF_INITIAL_S
from pyspark_acs.errors import (
    AcsOptionError,
    CacheError,
    CacheTimeoutError,
    CacheUnavailableError,
    ClosedError,
)
from pyspark_acs.server.local.deploy import LocalDeployment

CHUNK = 4096


def chunk(i: int) -> bytes:
    return (b"%08d" % i) * (CHUNK // 8)





@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three data servers that stay healthy (tests here may pause one, and resume it)."""
    with LocalDeployment(tmp_path_factory.mktemp("cluster"), data_replicas=3, metadata_replicas=0,
                         capacity="64MiB") as dep:
        yield dep


@pytest.fixture(scope="module")
def fragile(tmp_path_factory):
    """Three data servers the failure test kills and restarts."""
    with LocalDeployment(tmp_path_factory.mktemp("fragile"), data_replicas=3, metadata_replicas=0,
                         capacity="64MiB") as dep:
        yield dep


@pytest.fixture(scope="module")
def client(cluster):
    with CacheClient(cluster.data_endpoints, name="data cache") as c:
        yield c


def in_threads(work, count: int, timeout: float) -> None:
    """Run ``work(t)`` for t in range(count) on as many threads; re-raise the first error."""
    errors = []

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors[0]


def single(endpoint: str) -> CacheClient:
    """A client of one replica, to look at (or skew) what one replica holds."""
    return CacheClient(endpoint, replication=1)


# -- endpoints and construction -------------------------------------------------------------


@pytest.mark.parametrize("bad, item", [
    ("localhost", "localhost"),
    ("127.0.0.1:", "127.0.0.1:"),
    (":7001", ":7001"),
    ("127.0.0.1:0", "127.0.0.1:0"),
    ("127.0.0.1:99999", "127.0.0.1:99999"),
    ("127.0.0.1:7001,,127.0.0.1:7002", ""),
    ("http://127.0.0.1:7001", "http://127.0.0.1:7001"),
    ("127.0.0.1:7001,a b:1", "a b:1"),
])
def test_malformed_endpoints_are_refused_naming_the_item(bad, item):
    with pytest.raises(AcsOptionError) as info:
        CacheClient(bad)
    assert repr(item) in str(info.value)
    assert "expected 'host:port'" in str(info.value)


def test_empty_and_duplicate_endpoints_are_refused():
    with pytest.raises(AcsOptionError, match="host:port"):
        CacheClient([])
    with pytest.raises(AcsOptionError, match="'127.0.0.1:7001' is listed twice"):
        CacheClient("127.0.0.1:7001,127.0.0.1:7001")


def test_endpoint_forms():
    assert parse_endpoints(" 127.0.0.1:7001 ,localhost:7002,[::1]:7003") == (
        "127.0.0.1:7001", "localhost:7002", "[::1]:7003")
    assert CacheClient(["127.0.0.1:1", "127.0.0.1:2"]).endpoints == ("127.0.0.1:1", "127.0.0.1:2")
    with pytest.raises(AcsOptionError, match="replication"):
        CacheClient("127.0.0.1:1", replication=0)
    with pytest.raises(AcsOptionError, match="deadline"):
        CacheClient("127.0.0.1:1", deadline=0)


def test_client_is_never_pickled_and_closes(cluster):
    c = CacheClient(cluster.data_endpoints)
    with pytest.raises(TypeError, match="endpoint string"):
        pickle.dumps(c)
    c.put([(b"x", b"y", 1)])
    c.close()
    with pytest.raises(ClosedError):
        c.get([b"x"])


# -- replication ----------------------------------------------------------------------------


def test_put_reaches_all_replicas_and_chunks_spread(client, cluster):
    items = [(b"/root/s/00000/f.acs#%d" % i, chunk(i), CHUNK) for i in range(300)]
    client.put(items)
    for endpoint in cluster.endpoints("data"):
        with single(endpoint) as one:
            got = one.get([k for k, _, _ in items])
        # r = 3 over 3 servers: every replica holds every chunk of the file
        assert [e.value for e in got] == [v for _, v, _ in items]
    assert client.get([k for k, _, _ in items]) == [Entry(v, CHUNK) for _, v, _ in items]
    assert client.get([b"/root/s/00000/f.acs#999"]) == [None]


def test_chunks_of_a_file_spread_over_all_primaries(tmp_path):
    eps = ",".join(f"127.0.0.1:{p}" for p in range(7001, 7006))
    c = CacheClient(eps)
    primaries = {c.replicas_for(b"/root/s/00000/f.acs#%d" % i)[0] for i in range(200)}
    assert primaries == set(c.endpoints)
    assert all(len(set(c.replicas_for(b"k%d" % i))) == 3 for i in range(50))


def test_consistent_read_returns_the_majority_write(client, cluster):
    key = b"/root/s/00000/g.acs#0"
    client.put([(key, b"ab", 2)])
    lagging, *ahead = client.replicas_for(key)
    for endpoint in ahead:  # chunk 0 grew on 2 of 3 replicas only (paper figure 5)
        with single(endpoint) as one:
            one.put([(key, b"abcd", 4)])
    for _ in range(20):  # whichever majority is asked, it overlaps the one written
        assert client.get([key], consistent=True) == [Entry(b"abcd", 4)]
    relaxed = {client.get([key])[0] for _ in range(40)}
    assert relaxed <= {Entry(b"ab", 2), Entry(b"abcd", 4)}
    client.put([(key, b"a", 1)])  # an older writer never shortens the chunk anywhere
    with single(lagging) as one:
        assert one.get([key]) == [Entry(b"ab", 2)]


def test_compare_and_set_majorities(client, cluster):
    key = b"lease/f.acs"
    assert client.compare_and_set(key, None, b"A", version=1) == (True, Entry(b"A", 1))
    assert client.compare_and_set(key, None, b"B") == (False, Entry(b"A", 1))
    assert client.compare_and_set(key, b"A", b"A-poisoned", version=2) == (True, Entry(b"A-poisoned", 2))
    # Replicas disagree: one already holds a lease, two are empty -> the majority swaps.
    key2 = b"lease/g.acs"
    first, second, third = client.replicas_for(key2)
    with single(first) as one:
        one.put([(key2, b"old", 1)])
    assert client.compare_and_set(key2, None, b"new", version=2) == (True, Entry(b"new", 2))
    # Two hold a lease, one is empty -> only a minority can swap.
    key3 = b"lease/h.acs"
    for endpoint in (first, second):
        with single(endpoint) as one:
            one.put([(key3, b"held", 5)])
    swapped, current = client.compare_and_set(key3, None, b"mine", version=1)
    assert not swapped and current == Entry(b"held", 5)


def test_delete_and_version_refusal_counts_as_ack(client):
    client.put([(b"d1", b"v", 9), (b"d2", b"v", 1)])
    client.put([(b"d1", b"older", 3)])  # every replica refuses (STALE): still a success
    assert client.get([b"d1"], consistent=True) == [Entry(b"v", 9)]
    client.delete([b"d1", b"d2", b"never-there"])
    assert client.get([b"d1", b"d2"], consistent=True) == [None, None]


def test_too_large_is_a_cache_error_not_unavailable(tmp_path):
    with LocalDeployment(tmp_path, data_replicas=1, metadata_replicas=0, capacity="64KiB") as dep:
        with CacheClient(dep.data_endpoints) as c:
            with pytest.raises(CacheError, match="too large") as info:
                c.put([(b"big", b"x" * 60000, 1)])
            assert not isinstance(info.value, CacheUnavailableError)
            assert dep.data_endpoints in info.value.endpoints


def test_write_counts_each_key_on_its_own_replicas(tmp_path):
    """A put over a ring wider than the replication (5 replicas, 3 copies per key: keys land on
    different replica sets) succeeds exactly for the keys that got a majority of their own
    replicas, counts a replica's partial refusal (too large) against those keys only, and
    fails, naming the dead replicas, when replicas die (while the keys with a live majority are
    still stored)."""
    with LocalDeployment(tmp_path, data_replicas=5, metadata_replicas=0, capacity="256KiB") as dep:
        eps = dep.endpoints("data")
        with CacheClient(dep.data_endpoints, replication=3, deadline=2.0) as c:
            items = [(b"spread/%d" % i, b"v%d" % i, 1) for i in range(200)]
            c.put(items)
            for key, value, version in items:
                holders = c.replicas_for(key)
                assert len(holders) == 3
                seen = [single(ep).get([key])[0] for ep in holders]
                assert sum(e == Entry(value, version) for e in seen) >= 2, key
            # One key too large for every replica, in batches with keys that fit: only it fails.
            mixed = [(b"mixed/%d" % i, b"y", 1) for i in range(40)] + [(b"mixed/big", b"x" * 200_000, 1)]
            with pytest.raises(CacheError, match="too large") as info:
                c.put(mixed)
            # It gives up at the refusals; keys still in flight then are said to be so.
            short, unanswered = re.search(r"(\d+) of 41 keys got fewer than a majority of acknowledgements"
                                          r"(?: \((\d+) of them still unanswered)?", str(info.value)).groups()
            assert int(short) - int(unanswered or 0) == 1, str(info.value)
            deadline = time.monotonic() + 10
            while c.get([k for k, _, _ in mixed[:40]], consistent=True) != [Entry(b"y", 1)] * 40:
                assert time.monotonic() < deadline, "the keys that fit were not stored"
                time.sleep(0.05)
            # Two replicas dead: the keys with two of them among their three fall short, the
            # others still get their majority.
            dep.kill("data", 0)
            dep.kill("data", 1)
            dead = set(eps[:2])
            keys = [b"after/%d" % i for i in range(120)]
            lost = [k for k in keys if len(dead & set(c.replicas_for(k))) >= 2]
            assert lost and len(lost) < len(keys)  # the ring puts both kinds in 120 keys
            with pytest.raises(CacheUnavailableError) as info:
                c.put([(k, b"z", 1) for k in keys])
            short, unanswered = re.search(r"(\d+) of 120 keys got fewer than a majority of acknowledgements"
                                          r"(?: \((\d+) of them still unanswered)?", str(info.value)).groups()
            # It gives up at the first key that cannot get a majority; what was still in flight
            # is said to be unanswered, never failed.
            assert 1 <= int(short) - int(unanswered or 0) <= len(lost)
            assert set(info.value.endpoints) <= dead
            kept = [k for k in keys if k not in lost]
            deadline = time.monotonic() + 10
            while c.get(kept, consistent=True) != [Entry(b"z", 1)] * len(kept):
                assert time.monotonic() < deadline, "keys with a live majority were not stored"
                time.sleep(0.05)


class _ShortAnswers:
    """A replica that does not keep the protocol: it answers every PutStream request with a
    PutResponse holding fewer statuses than the request has keys (a real server of ours answers
    one per key, so this misbehaviour needs a stand-in)."""

    def __init__(self) -> None:
        from pyspark_acs._grpc import grpc
        from pyspark_acs.cache.proto import acs_pb2

        def put_stream(requests, context):
            for request in requests:
                keys = acs_pb2.PutRequest.FromString(request).keys
                yield acs_pb2.PutResponse(status=[acs_pb2.STORED] * (len(keys) // 2)).SerializeToString()

        service = acs_pb2.DESCRIPTOR.services_by_name["Cache"].full_name
        handler = grpc.method_handlers_generic_handler(service, {
            "PutStream": grpc.stream_stream_rpc_method_handler(put_stream)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None)


def test_an_answer_with_fewer_statuses_than_keys_acknowledges_only_those(tmp_path):
    """Keys a replica's answer has no status for are not acknowledged by it: with one real
    replica and two that answer half the statuses, a put of 6 keys gets a majority (2 of 3) for
    the 3 keys the short answers cover and fails, naming 3 keys and why, for the others (a
    CacheError, not "unavailable": asking again would not help)."""
    short = [_ShortAnswers(), _ShortAnswers()]
    try:
        with LocalDeployment(tmp_path, data_replicas=1, metadata_replicas=0, capacity="16MiB") as dep:
            endpoints = ",".join([dep.data_endpoints] + [s.endpoint for s in short])
            with CacheClient(endpoints, replication=3, deadline=2.0) as c:
                with pytest.raises(CacheError, match=r"^cache: put failed: 3 of 6 keys got fewer") as info:
                    c.put([(b"short/%d" % i, b"v", 1) for i in range(6)])
                assert str(info.value).count("answered 3 statuses for 6 keys") == 2
    finally:
        for s in short:
            s.stop()


def test_many_threads_share_one_client(cluster):
    # A deadline a loaded machine meets: this is about sharing, not timing (at the default
    # 0.5 s, eight threads' puts timed out on a saturated 2-core machine).
    client = CacheClient(cluster.data_endpoints, name="data cache", deadline=10.0)

    def work(t: int) -> None:
        for n in range(30):
            items = [(b"t%d/%d/%d" % (t, n, i), chunk(i), CHUNK) for i in range(16)]
            client.put(items)
            want = [Entry(v, CHUNK) for _, v, _ in items]
            assert client.get([k for k, _, _ in items], consistent=True) == want
            # relaxed: a replica that has not stored it yet may miss (never a wrong value)
            got = client.get([k for k, _, _ in items])
            assert all(g is None or g == w for g, w in zip(got, want))

    with client:
        in_threads(work, 8, timeout=60)


# -- slow and dead replicas -----------------------------------------------------------------


def test_hedged_reads_hide_a_stalled_replica(cluster):
    keys = [b"hedge#%d" % i for i in range(60)]
    # A deadline far above the hedge: a read that hedged takes a fraction of it even on a loaded
    # machine, one that waited for the stalled replica takes all of it.
    with CacheClient(cluster.data_endpoints, deadline=3.0, hedge_after=0.03) as c:
        c.put([(k, b"v", 1) for k in keys])
        stalled = cluster.server("data", 0)
        stop_process(stalled.pid)  # alive but silent: the case hedging is for
        try:
            for _ in range(5):
                t0 = time.monotonic()
                assert c.get(keys) == [Entry(b"v", 1)] * len(keys)
                assert time.monotonic() - t0 < c.deadline / 2  # hedged after 30 ms, not the deadline
                t0 = time.monotonic()
                assert c.get(keys, consistent=True) == [Entry(b"v", 1)] * len(keys)
                assert time.monotonic() - t0 < c.deadline / 2
            c.put([(k, b"w", 2) for k in keys])  # returns on 2 acks
            # With 2 of 3 silent, consistent reads time out, naming them, within the deadline.
            other = cluster.server("data", 1)
            stop_process(other.pid)
            try:
                with CacheClient(cluster.data_endpoints, deadline=0.5) as fresh:
                    fresh.connect()  # waits up to CONNECT_TIMEOUT_S for the silent two: not timed here
                    t0 = time.monotonic()
                    with pytest.raises(CacheTimeoutError) as info:
                        fresh.get(keys, consistent=True)
                    assert time.monotonic() - t0 < fresh.deadline + 1.5
                    assert set(info.value.endpoints) == {stalled.endpoint, other.endpoint}
                    assert stalled.endpoint in str(info.value) and "DEADLINE_EXCEEDED" in str(info.value)
            finally:
                os.kill(other.pid, signal.SIGCONT)
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
    with CacheClient(cluster.data_endpoints) as c:
        assert c.get(keys, consistent=True) == [Entry(b"w", 2)] * len(keys)


def test_a_put_without_grace_returns_at_its_majority_and_the_straggler_still_gets_it(cluster):
    """put(grace=False) (a producer's chunks and lengths) returns once a majority acknowledged,
    without waiting hedge_after for the third; put() waits that grace. The third replica is
    never cancelled: it stores the write once it answers again."""
    keys = [b"grace#%d" % i for i in range(20)]
    # A grace far above anything a majority of healthy replicas needs, below the deadline: a
    # put that waited for the stalled replica takes the whole grace.
    with CacheClient(cluster.data_endpoints, deadline=60.0, hedge_after=20.0) as c:
        c.put([(k, b"v", 1) for k in keys])
        stalled = cluster.server("data", 2)
        stop_process(stalled.pid)
        try:
            done = threading.Event()
            worker = threading.Thread(target=lambda: (c.put([(k, b"w", 2) for k in keys], grace=False),
                                                      done.set()), daemon=True)
            worker.start()
            assert done.wait(10.0), "a put without grace waited for the stalled replica"
            graced = threading.Event()
            worker = threading.Thread(target=lambda: (c.put([(k, b"x", 3) for k in keys]), graced.set()),
                                      daemon=True)
            worker.start()
            # Once its majority has the write, a put that does not wait its grace returns at
            # their answers: it gets a second on top to do so.
            for i in (0, 1):
                with CacheClient(cluster.server("data", i).endpoint, replication=1, deadline=30.0) as one:
                    wait_until(lambda: one.get(keys) == [Entry(b"x", 3)] * len(keys), 20.0,
                               f"replica {i} to store the graced put")
            assert not graced.wait(1.0), "a put with grace returned before its grace for the stalled replica"
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        worker.join(30.0)
    with CacheClient(stalled.endpoint, replication=1, deadline=30.0) as only:
        wait_until(lambda: only.get(keys) == [Entry(b"x", 3)] * len(keys), 20.0)


def test_a_relaxed_read_where_every_replica_holds_every_key_is_one_call_to_one_replica(cluster):
    """No more replicas than copies: any replica answers for every key, so a relaxed read is one
    call to one replica picked at random (no per-key bookkeeping); the picks spread over all
    replicas. A stalled or dead pick falls back to the hedging path (the tests above)."""
    keys = [b"anywhere#%d" % i for i in range(100)]
    # No hedge: a pick slower than the hedge delay on a loaded machine would add a second call.
    with CacheClient(cluster.data_endpoints, deadline=5.0, hedge_after=0) as c:
        assert len(c.endpoints) <= c.replication
        c.put([(k, b"v%d" % i, 1) for i, k in enumerate(keys)])
        picked = set()
        for _ in range(12):
            before = {ep: s.get("gets_total", 0) for ep, s in c.stats().items()}
            assert c.get(keys + [b"anywhere-missing"]) == [Entry(b"v%d" % i, 1) for i in range(100)] + [None]
            grew = {ep: s.get("gets_total", 0) - before[ep] for ep, s in c.stats().items()}
            assert sorted(grew.values()) == [0, 0, 101], grew
            picked.update(ep for ep, n in grew.items() if n)
        assert len(picked) >= 2  # random picks, not always the same replica


def test_a_relaxed_read_that_fails_reports_what_each_replica_said(cluster):
    """Review of 400ec98/1de8f62, finding 1: when the one-call read (every replica holds every
    key) failed, the general path ran after it and found the replicas it had just tried marked
    down, so the error named the mark ("marked down after a failure; next probe in 1.5 s")
    instead of the call's own failure: no gRPC cause (raise ... from), and a read every replica
    of which timed out raised CacheUnavailableError, not the CacheTimeoutError get() promises
    (and the general path gave)."""
    dead = f"127.0.0.1:{free_port()}"
    with CacheClient(dead, deadline=0.5) as c:
        with pytest.raises(CacheUnavailableError) as info:
            c.get([b"k"])
        assert "marked down" not in str(info.value), info.value
        assert info.value.__cause__ is not None
    with CacheClient(cluster.data_endpoints, deadline=10.0) as c:
        c.put([(b"timed-out", b"v", 1)])  # connected while they answer, at a deadline load meets
        c.deadline = 0.5  # calls read it when they start (probes keep 10 s; none runs here)
        stopped = [cluster.server("data", i) for i in range(3)]
        for server in stopped:
            stop_process(server.pid)
        try:
            with pytest.raises(CacheTimeoutError) as info:
                c.get([b"timed-out"])
        finally:
            for server in stopped:
                os.kill(server.pid, signal.SIGCONT)
        assert "DEADLINE_EXCEEDED" in str(info.value) and "marked down" not in str(info.value), info.value
        assert info.value.__cause__ is not None


def test_replicas_marked_down_by_timeouts_still_fail_a_call_as_a_timeout(cluster):
    """A call skipping replicas that an earlier call's timeouts marked down is a timeout too
    (CacheTimeoutError: the cache is slow), not CacheUnavailableError (it refuses calls):
    readers wait for a loaded cache but fail over from a dead one."""
    with CacheClient(cluster.data_endpoints, deadline=0.3) as c:
        # Connected while they answer (a put with this deadline could miss it on a loaded machine).
        c.connect()
        stopped = [cluster.server("data", i) for i in range(3)]
        for server in stopped:
            stop_process(server.pid)
        try:
            with pytest.raises(CacheTimeoutError):
                c.get([b"slow"])
            with pytest.raises(CacheTimeoutError) as info:  # every replica marked down now
                c.get([b"slow"])
            assert "marked down after DEADLINE_EXCEEDED" in str(info.value), info.value
        finally:
            for server in stopped:
                os.kill(server.pid, signal.SIGCONT)


def test_a_relaxed_read_probes_a_replica_whose_back_off_ended(cluster):
    """Review of 400ec98/1de8f62, finding 2: the one-call read claimed the probe of every replica
    whose back-off had ended (``Replica.usable`` lets one request through and holds the others
    off for a deadline) but sent to one or two of the three, so 2 times in 3 no probe went out and
    the recovered replica stayed out of reads for another deadline. The probe goes out first."""
    eps = list(cluster.endpoints("data"))
    # A deadline a loaded machine's probe answers within (at 0.5 s one timed out in a full run
    # and marked the replica down again). A claimed probe that is not sent holds the replica
    # out for the whole deadline, so the wait below, shorter than it, still tells the two apart;
    # it covers a probe that answers after a hedge to another replica ended the read.
    deadline = 5.0
    with CacheClient(cluster.data_endpoints, deadline=deadline) as c:
        c.put([(b"probe#%d" % i, b"v", 1) for i in range(10)])
        for _ in range(6):
            rep = c._replicas[eps[0]]
            with c._lock:  # as Replica.mark leaves it after a failure, its back-off just ended
                rep.down_until = time.monotonic() - 0.001
            assert c.get([b"probe#%d" % i for i in range(10)]) == [Entry(b"v", 1)] * 10
            wait_until(lambda: eps[0] not in c.down_endpoints(), deadline - 1.0,
                       "the probed replica up again")


def test_a_fail_over_sent_past_the_deadline_marks_no_healthy_replica_down(cluster):
    """Review of 400ec98/1de8f62, finding 3 (the general path's; the one-call read's fallback
    reaches it too, when both replicas it asked stalled): keys whose first two replicas stalled
    failed over, once those timed out at the deadline, to the third with no time left -- a
    call with gRPC's 1 ms minimum, whose DEADLINE_EXCEEDED marked the one healthy replica
    down, so for the next back-off every read found all three down (6 of 6 runs with 5 MB to
    fail over; about 1 in 10 with small answers, which sometimes come within the 1 ms). A call
    sent after its deadline says nothing of its replica and marks nothing.
    (More than MAX_BATCH_KEYS keys take the general path; its random rotation gives the keys of
    some replica orders the healthy replica last, whatever the rotation.)"""
    import itertools

    from pyspark_acs.cache.fanout import MAX_BATCH_KEYS

    healthy = cluster.server("data", 2)
    stopped = [cluster.server("data", i) for i in range(2)]
    timed_out = 0
    # A late call can still be answered: gRPC now and then delivers a reply that lands a few
    # milliseconds past its 1 ms deadline (1 run in ~6 here), and then the read succeeds. Each
    # attempt must leave the healthy replica up; at least one must take the timeout path.
    for attempt in range(4):
        with CacheClient(cluster.data_endpoints, deadline=0.5) as c:  # no down marks from before
            by_order = {}  # one key per replica order: all six orders, whatever the rotation
            for i in itertools.count():
                by_order.setdefault(c.replicas_for(b"late#%d" % i), b"late#%d" % i)
                if len(by_order) == 6:
                    break
            c.put([(k, bytes(16384), 1) for k in by_order.values()])  # connected while they answer
            keys = (list(by_order.values()) * MAX_BATCH_KEYS)[:MAX_BATCH_KEYS + 1]
            for server in stopped:
                stop_process(server.pid)
            try:
                got = c.get(keys)
            except CacheTimeoutError:
                timed_out += 1
            else:
                assert [e.value for e in got] == [bytes(16384)] * len(keys)
            finally:
                for server in stopped:
                    os.kill(server.pid, signal.SIGCONT)
            assert healthy.endpoint not in c.down_endpoints(), f"attempt {attempt}"
        if timed_out:
            break
    assert timed_out, "every read was answered past its deadline; the timeout path went untested"


def test_nothing_listening_fails_fast_naming_the_endpoint():
    dead = f"127.0.0.1:{free_port()}"
    with CacheClient(dead, deadline=0.5) as c:
        for call in (lambda: c.get([b"k"]), lambda: c.get([b"k"], consistent=True),
                     lambda: c.put([(b"k", b"v", 1)]), lambda: c.delete([b"k"]),
                     lambda: c.compare_and_set(b"k", None, b"v")):
            t0 = time.monotonic()
            with pytest.raises(CacheUnavailableError) as info:
                call()
            assert time.monotonic() - t0 < 2.0
            assert info.value.endpoints == (dead,) and dead in str(info.value)
        assert c.health() == {dead: False}
        assert "error" in c.stats()[dead]


def test_replica_failures_and_recovery(fragile):
    eps = fragile.endpoints("data")
    keys = [b"/root/s/00001/f.acs#%d" % i for i in range(200)]
    with CacheClient(fragile.data_endpoints, deadline=0.5) as c:
        c.put([(k, chunk(i), CHUNK) for i, k in enumerate(keys)])

        # kill -9 one of three: reads and writes go on
        fragile.kill("data", 0)
        assert c.get(keys) == [Entry(chunk(i), CHUNK) for i in range(len(keys))]
        assert c.get(keys, consistent=True) == [Entry(chunk(i), CHUNK) for i in range(len(keys))]
        c.put([(k, chunk(i + 1), CHUNK + 1) for i, k in enumerate(keys)])
        assert eps[0] in c.down_endpoints()
        t0 = time.monotonic()  # a known-dead replica is skipped, not waited for
        for _ in range(10):
            c.get(keys[:20], consistent=True)
        assert time.monotonic() - t0 < 0.5

        # kill two: quorum calls fail naming them; relaxed reads still work off the survivor
        fragile.kill("data", 1)
        with pytest.raises(CacheUnavailableError) as info:
            c.get(keys, consistent=True)
        assert set(info.value.endpoints) == {eps[0], eps[1]}
        assert eps[0] in str(info.value) and eps[1] in str(info.value)
        with pytest.raises(CacheUnavailableError) as info:
            c.put([(b"new", b"v", 1)])
        assert set(info.value.endpoints) == {eps[0], eps[1]}
        with pytest.raises(CacheUnavailableError):
            c.compare_and_set(b"lease", None, b"me")
        assert c.get(keys) == [Entry(chunk(i + 1), CHUNK + 1) for i in range(len(keys))]
        health = c.health()
        assert health == {eps[0]: False, eps[1]: False, eps[2]: True}

        # restart both (same ports, empty): after the back-off the client uses them again
        fragile.restart("data", 0)
        fragile.restart("data", 1)
        time.sleep(DOWN_BACKOFF_INITIAL_S)

        def recovered():
            try:
                c.put([(b"after", b"v", 1)])
                c.get([b"after"], consistent=True)
            except CacheUnavailableError:
                return False
            return not c.down_endpoints()

        wait_until(recovered, timeout=15)
        c.put([(k, chunk(i), CHUNK + 2) for i, k in enumerate(keys)])
        stats = c.stats()
        for endpoint in eps[:2]:
            assert stats[endpoint]["stored_total"] >= len(keys) * 2 // 3 - 20
        assert c.get(keys, consistent=True) == [Entry(chunk(i), CHUNK + 2) for i in range(len(keys))]


# -- pipelined puts (PutStream) -------------------------------------------------------------


def test_puts_are_pipelined_on_one_stream_per_replica(cluster):
    """Every put of a client to a replica goes on the replica's one PutStream, answers matched
    to requests by order: threads putting batches of different sizes at once each get their own
    acknowledgements (a mismatched answer would leave keys unacknowledged and fail the put)."""
    eps = cluster.endpoints("data")
    with CacheClient(cluster.data_endpoints, name="data cache") as probe:
        before = {ep: s["put_streams"] for ep, s in probe.stats().items()}
        with CacheClient(cluster.data_endpoints, name="data cache") as c:

            def work(t: int) -> None:
                for n in range(25):
                    c.put([(b"pipe/%d/%d/%d" % (t, n, i), b"%d.%d.%d" % (t, n, i), n + 1)
                           for i in range(t + 1)])

            in_threads(work, 6, timeout=60)
            keys = [b"pipe/%d/%d/%d" % (t, n, i) for t in range(6) for n in range(25) for i in range(t + 1)]
            want = [Entry(b"%d.%d.%d" % (t, n, i), n + 1) for t in range(6) for n in range(25) for i in range(t + 1)]
            assert c.get(keys, consistent=True) == want
            opened = probe.stats()
            assert {ep: opened[ep]["put_streams"] - before[ep] for ep in eps} == {ep: 1 for ep in eps}
        # closing the client ends its streams
        wait_until(lambda: {ep: s["put_streams"] for ep, s in probe.stats().items()} == before)


def test_a_stalled_replica_ends_its_put_stream_at_the_deadline_and_rejoins(cluster):
    """A replica that stops answering (SIGSTOP) while a writer puts every 10 ms: puts go on at a
    majority; the stalled replica's stream is ended once a request on it is past its deadline
    (the replica is marked down, as a unary call's deadline would mark it), so requests do not
    pile up behind it; once it answers again, a new stream takes the writer's puts to it."""
    stalled = cluster.server("data", 2)
    with CacheClient(cluster.data_endpoints, deadline=0.3, name="data cache") as c:
        c.put([(b"stall#0", b"v", 1)])
        puts = c._put_stream(c._replicas[stalled.endpoint])
        most_waiting = 0
        stop_process(stalled.pid)
        try:
            until = time.monotonic() + 1.5
            n = 0
            while time.monotonic() < until:
                n += 1
                c.put([(b"stall#%d" % n, b"v", 1)])  # two of three answer
                most_waiting = max(most_waiting, puts.waiting)
                time.sleep(0.01)
            assert stalled.endpoint in c.down_endpoints()
            # 10 ms apart, 0.3 s deadline: about 30 requests wait before the stream is ended;
            # without the deadline all of them (~100+) would
            assert most_waiting <= 60, most_waiting
            # Puts went on at the majority: waiting for the stalled replica's 0.3 s deadline,
            # 1.5 s would hold about 5 of them (a bound with room for a loaded machine).
            assert n > 20, n
            # Those ~30 failed together: one failure, not 30 failed probes. The back-off grows
            # only when a probe fails (at most once or twice in 1.5 s), not to its 10 s maximum,
            # which left the replica out of every call for 10 s after it recovered.
            assert c._replicas[stalled.endpoint].backoff <= 2 * DOWN_BACKOFF_INITIAL_S
        finally:
            os.kill(stalled.pid, signal.SIGCONT)

        def rejoined():
            c.put([(b"stall#after", b"w", 2)])
            with single(stalled.endpoint) as look:
                return look.get([b"stall#after"]) == [Entry(b"w", 2)]

        wait_until(rejoined, timeout=20, interval=0.1)


def test_a_straggler_of_an_old_failure_does_not_mark_a_recovered_replica_down(cluster):
    """The marking rule alone, on a real client: a call sent before a replica was marked down
    that fails after it recovered is the old failure's straggler (it says nothing new) and
    leaves the replica up; a call sent after the recovery that fails marks it down."""
    from pyspark_acs.cache.pipeline import _StreamEnded

    ep = cluster.data_endpoints.split(",")[0]
    with CacheClient(ep, name="data cache") as c:
        rep = c._replicas[ep]
        sent_before = time.monotonic()
        rep.mark(_StreamEnded("stalled", "DEADLINE_EXCEEDED"), sent=time.monotonic())
        assert ep in c.down_endpoints()
        rep.mark(None)  # a probe answered: up again
        assert ep not in c.down_endpoints()
        rep.mark(_StreamEnded("stalled", "DEADLINE_EXCEEDED"), sent=sent_before)
        assert ep not in c.down_endpoints()
        rep.mark(_StreamEnded("died", "UNAVAILABLE"), sent=time.monotonic())
        assert ep in c.down_endpoints()
        assert rep.backoff == DOWN_BACKOFF_INITIAL_S  # a fresh failure, not a failed probe


def test_a_replica_without_put_stream_gets_unary_puts(tmp_path):
    """A replica from before PutStream (a rolling upgrade) answers it UNIMPLEMENTED: the client
    sends that put again as a unary Put, and every later put to it unary. The old server is
    stood in for by a gRPC server with the Put method alone (the real one has both)."""
    import grpc
    from concurrent import futures

    from pyspark_acs.cache.proto import acs_pb2

    stored = {}
    calls = []

    def put(request, context):
        calls.append(len(request.keys))
        offset = 0
        for key, size in zip(request.keys, request.sizes):
            stored[key] = request.data[offset:offset + size]
            offset += size
        return acs_pb2.PutResponse(status=[acs_pb2.STORED] * len(request.keys))

    def health(request, context):
        return acs_pb2.HealthResponse(serving=True, role="data")

    handlers = {
        "Put": grpc.unary_unary_rpc_method_handler(
            put, request_deserializer=acs_pb2.PutRequest.FromString,
            response_serializer=acs_pb2.PutResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            health, request_deserializer=acs_pb2.HealthRequest.FromString,
            response_serializer=acs_pb2.HealthResponse.SerializeToString),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pyspark_acs.cache.Cache", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with CacheClient(f"127.0.0.1:{port}", replication=1, name="old cache") as c:
            c.put([(b"a", b"1", 1), (b"b", b"22", 1)])
            c.put([(b"c", b"333", 1)])
            assert stored == {b"a": b"1", b"b": b"22", b"c": b"333"}
            assert calls == [2, 1]
            assert c._replicas[f"127.0.0.1:{port}"].unary_puts
            assert c.down_endpoints() == ()
    finally:
        server.stop(0)


#: A process whose cache client is busy forks this many children through a preexec_fn (as
#: pyspark launches its Java gateway). With grpcio's fork handlers on, 28 of 1000 died here.
FORKED_CHILDREN = 300

FORKING_CLIENT = r"""
import signal, subprocess, sys, threading
from pyspark_acs.cache.client import CacheClient

client = CacheClient(sys.argv[1])
client.put([(b"k", b"v", 1)])
stop = threading.Event()

def busy():
    while not stop.is_set():
        client.get([b"k"])

threads = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
for t in threads:
    t.start()
died = []
for i in range(int(sys.argv[2])):
    child = subprocess.Popen(["true"], stderr=subprocess.PIPE,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    _, err = child.communicate()
    if child.returncode != 0:
        died.append((i, child.returncode, err.decode(errors="replace")[:200]))
stop.set()
for t in threads:
    t.join()
client.close()
print(len(died), died[:3])
sys.exit(1 if died else 0)
"""


def test_children_forked_beside_live_channels_survive_to_exec(cluster, subprocess_env, python_exe):
    """A process with busy cache channels forks children with a preexec_fn (pyspark's launch
    of its Java gateway does): every child execs. grpcio >= 1.81 aborts some such children
    (grpc/grpc#43055: its fork handlers restart a poller on a closed epoll fd); pyspark_acs
    turns those handlers off unless the environment chose (pyspark_acs._grpc). The child
    process starts without the variable, so this checks the package's own default."""
    from pyspark_acs._grpc import FORK_SUPPORT_ENV

    env = {k: v for k, v in subprocess_env.items() if k != FORK_SUPPORT_ENV}
    run = subprocess.run([python_exe, "-c", FORKING_CLIENT, cluster.data_endpoints, str(FORKED_CHILDREN)],
                         env=env, capture_output=True, timeout=60)
    assert run.returncode == 0, (run.stdout.decode(), run.stderr.decode()[-2000:])


def test_a_read_with_no_hedge_to_send_is_made_on_the_calling_thread(cluster):
    """A relaxed read that cannot hedge (hedging off here; one usable replica alike) makes its
    call on the caller's thread: no hand-off to the pool and back. One that can hedge still goes
    through the pool, which lets it send the hedge while the first call is out."""
    keys = [b"inline#%d" % i for i in range(40)]
    values = [chunk(i) for i in range(40)]
    # Written with the default grace, so every replica has the keys before the relaxed reads
    # below (with hedge_after=0 the third replica got no time to finish, and a relaxed read of
    # it missed under load).
    with CacheClient(cluster.data_endpoints) as writer:
        writer.put([(k, v, 1) for k, v in zip(keys, values)])
    for hedge_after, pooled in ((0.0, 0), (0.03, 1)):
        with CacheClient(cluster.data_endpoints, hedge_after=hedge_after) as c:
            c.put([(k, v, 1) for k, v in zip(keys, values)])  # connects (the pool is in use after)
            pool = c._pool()
            submitted = []
            submit = pool.submit
            pool.submit = lambda *a, **kw: (submitted.append(a), submit(*a, **kw))[1]
            data, sizes = c.get_joined(keys)
            assert data == b"".join(values) and sizes == [CHUNK] * len(keys)
            assert c.get(keys[:3]) == [Entry(v, 1) for v in values[:3]]
            assert len(submitted) == 2 * pooled, hedge_after


@pytest.mark.parametrize("metadata_file", [True, False], ids=["metadata-file", "fallback"])
def test_the_grpcio_version_read_without_importing_grpc_is_the_installed_one(subprocess_env, python_exe,
                                                                              tmp_path, metadata_file):
    """pyspark_acs reads grpcio's version from its metadata file before grpc is imported (and
    without importlib.metadata): the same (major, minor) as the installed distribution's. A
    grpc package without that file (here a shadowing one) falls back to importlib.metadata."""
    from importlib.metadata import version

    env = dict(subprocess_env)
    if not metadata_file:
        (tmp_path / "grpc").mkdir()
        (tmp_path / "grpc" / "__init__.py").write_text("")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    code = ("import sys; from pyspark_acs._grpc import _grpcio_version; "
            "print(repr((_grpcio_version(), 'importlib.metadata' in sys.modules)))")
    run = subprocess.run([python_exe, "-c", code], env=env, capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    want = tuple(int(x) for x in version("grpcio").split(".")[:2])
    assert run.stdout.decode().strip() == repr((want, not metadata_file))


EXPERIMENTS_CLIENT = """
import os, sys
from pyspark_acs._grpc import EXPERIMENTS_APPLIED, EXPERIMENTS_ENV
from pyspark_acs.cache.client import CacheClient
with CacheClient(sys.argv[1]) as c:
    c.put([(b"experiments#1", b"v", 1)])
    assert c.get([b"experiments#1"])[0].value == b"v"
print(repr((EXPERIMENTS_APPLIED, os.environ.get(EXPERIMENTS_ENV))))
"""


def test_grpc_polls_on_the_waiting_thread_unless_the_environment_chose(cluster, subprocess_env, python_exe):
    """pyspark_acs turns grpcio's client and listener EventEngine experiments off for its import
    of grpc (the thread that waits for a message polls for it: a thread wake less per message)
    on the grpcio versions measured with it, and restores the environment right after, so that
    child processes (maybe with another grpcio) do not inherit it. A value the environment set
    is kept and nothing is applied. Calls to the servers work either way, and grpc logs no
    unknown experiment."""
    from pyspark_acs._grpc import EXPERIMENTS_DEFAULT, EXPERIMENTS_ENV, LEGACY_POLLING_GRPCIO, _grpcio_version

    base = {k: v for k, v in subprocess_env.items() if k != EXPERIMENTS_ENV}
    measured = LEGACY_POLLING_GRPCIO[0] <= _grpcio_version() < LEGACY_POLLING_GRPCIO[1]
    cases = ((base, (EXPERIMENTS_DEFAULT if measured else None, None)),
             (dict(base, **{EXPERIMENTS_ENV: ""}), (None, "")))
    for env, want in cases:
        run = subprocess.run([python_exe, "-c", EXPERIMENTS_CLIENT, cluster.data_endpoints],
                             env=env, capture_output=True, timeout=60)
        assert run.returncode == 0, run.stderr.decode()[-2000:]
        assert run.stdout.decode().strip() == repr(want)
        assert b"Unknown experiment" not in run.stderr
