"""Push streams (docs/cache.md) against real cache-server processes: readers are told instead of
polling, keep every message in order while replicas die and come back, resume by offset, and a
slow reader holds up nobody and grows no server's memory."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import List

import pytest

from pyspark_acs.cache.chunks import ChunkWriter, file_id
from pyspark_acs.cache.client import CacheClient
from pyspark_acs.cache.metadata import length_keys
from pyspark_acs.cache.poller import PUSH_SAFETY_JITTER, PUSH_SAFETY_POLL_S
from pyspark_acs.cache.push import FollowStream, WatchStream
from pyspark_acs.errors import ClosedError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.read.cachepath import (STORE_HOLD_JITTER, STORE_HOLD_MAX_S, STORE_HOLD_MIN_S,
                                        STORE_HOLD_RESET_S, StoreHold)
from pyspark_acs.read.consumer import Consumer
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.producer import Producer

from tests.helpers import Collector, FakeClock, Sender, assert_exact, msg, stop_process, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    with LocalDeployment(tmp_path_factory.mktemp("push"), data_replicas=3, metadata_replicas=3,
                         capacity="64MiB") as d:
        yield d


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "store")


def endpoints(dep: LocalDeployment) -> dict:
    """Endpoint strings: readers share the process's poller and feed, as users' readers do."""
    return {"data_cache": dep.data_endpoints, "metadata_cache": dep.metadata_endpoints}


def followed_replica(dep: LocalDeployment, consumer: Consumer) -> int:
    """Index (in ``dep``'s data endpoints) of the replica the consumer's feed follows its file on."""
    feed = consumer.path.feed
    with feed._lock:
        (f,) = feed._files.values()
        return dep.endpoints("data").index(f.endpoint)


@contextlib.contextmanager
def following_through_a_fault(root: str, stream: str, eps: dict):
    """A Producer sending numbered messages (a Sender) and a Consumer already following them
    when the test's fault begins: yields ``(consumer, collector)``. On a clean exit the sender
    stops, and every message sent must arrive at the collector exactly and in order, none of
    them read from the durable store (every store read is counted, whether the read path's
    stats count it or not)."""
    with Producer(root, stream, shards=1, **eps) as p, Consumer(root, stream, **eps) as c:
        col = Collector(c)
        store_bytes, real_read = [0], c.store.read

        def counting_read(rel, start, end):
            got = real_read(rel, start, end)
            store_bytes[0] += len(got)
            return got

        c.store.read = counting_read
        sender = Sender(p)
        sender.start()
        try:
            yield c, col
        finally:
            count = sender.stop()
        col.until(lambda: len(col.values) >= count, 30, "every message")
        col.pump(0.2)
        assert_exact(col.values, count)
        assert c.stats()["durable_bytes"] == 0
        assert store_bytes[0] == 0


def first_message_pushed(p: Producer, c: Consumer, timeout=None):
    """Send msg(0), read it through ``c.batches(timeout)`` and wait until every file the
    consumer follows is pushed (its streams confirmed): ``(the batches iterator, [msg(0)])``."""
    batches = c.batches(timeout=timeout)
    p.send(msg(0))
    p.flush()
    got = next(batches).column("value").to_pylist()
    deadline = time.monotonic() + 20
    while not c._all_pushed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c._all_pushed()
    return batches, got


def live_feed_after_msg0(p: Producer, c: Consumer):
    """Send msg(0), collect it, and wait until the consumer's feed is live at its position:
    ``(the Collector, the shard's tailer, the feed, the file's uri)``."""
    col = Collector(c)
    p.send(msg(0))
    p.flush()
    col.until(lambda: len(col.values) == 1, 20, "the first message")
    t = c._tailers[0]
    feed, uri = c.path.feed, c.store.uri(t.rel)
    wait_until(lambda: feed.live(uri, t.length), 20, "the feed is live")
    return col, t, feed, uri


@contextlib.contextmanager
def polls_of(poller, uri: str):
    """The times ``poller`` reads ``uri``'s lengths from the metadata cache while the block runs."""
    asked: List[float] = []
    real = poller.meta.lengths

    def lengths(uris):
        if uri in uris:
            asked.append(time.monotonic())
        return real(uris)

    poller.meta.lengths = lengths
    try:
        yield asked
    finally:
        poller.meta.lengths = real


def learn_from_the_safety_poll(c: Consumer, t, uri: str, published: int) -> None:
    """Wait until the consumer's poller read the published cache length ``published`` (its
    safety poll: nothing is pushed), then hand it to the read path. Waiting on the path's own
    lengths instead could end on the store's length (a published length that stands still is
    checked against the store) with the cache length still old, and Algorithm 1 then reads
    from the store."""
    wait_until(lambda: (c.path.poller.lengths([uri])[uri][0] or 0) >= published, 10, "the safety poll")
    c.path.lengths([t.rel])


def server_stats(eps: str) -> dict:
    with CacheClient(eps) as c:
        return c.stats()


def total(stats: dict, name: str) -> int:
    return sum(v.get(name, 0) for v in stats.values() if "error" not in v)


def test_following_reader_is_pushed_lengths_and_bytes_without_asking(dep, root):
    """Caught up, a reader makes almost no Get calls: the data replica pushes the bytes, and
    the pushed bytes are the file's cache length (a fed file is not watched; a reader without
    a feed has its lengths pushed by the metadata replicas: see the watched-reader test)."""
    with Producer(root, "steady", shards=1, **endpoints(dep)) as p, Consumer(root, "steady", **endpoints(dep)) as c:
        col = Collector(c)
        p.send(msg(0))
        p.flush()
        col.until(lambda: len(col.values) == 1, 20, "the first message")
        col.pump(1.2)  # past one safety poll
        data0, meta0 = server_stats(dep.data_endpoints), server_stats(dep.metadata_endpoints)
        started = time.monotonic()
        for i in range(1, 301):
            p.send(msg(i))
            p.flush()
            col.pump(0.002)
        col.until(lambda: len(col.values) == 301, 20, "every message")
        data1, meta1 = server_stats(dep.data_endpoints), server_stats(dep.metadata_endpoints)
        elapsed = time.monotonic() - started
        assert_exact(col.values, 301)
        # At most a few: a length pushed by a metadata replica may wake the reader before the
        # data replica's bytes arrive, and then it asks (without push: one Get per flush, 300).
        # A twentieth of the flushes: a loaded machine delays some pushes more than others.
        assert total(data1, "gets_total") - total(data0, "gets_total") <= 300 // 20
        # Only the safety polls of one file: two keys on a majority (two) of replicas per poll,
        # a poll at most every PUSH_SAFETY_POLL_S * (1 - PUSH_SAFETY_JITTER), plus two polls'
        # worth for the moments a pushed length runs ahead of the pushed bytes. The bound is in
        # the test's own elapsed time: a loaded CI machine stretches the 300 flushes (5 s here,
        # over 10 s in CI), and the safety net runs by the clock. Polling at poll_interval
        # instead would make thousands.
        polls = elapsed / (PUSH_SAFETY_POLL_S * (1 - PUSH_SAFETY_JITTER)) + 2
        meta_gets = total(meta1, "gets_total") - total(meta0, "gets_total")
        assert meta_gets <= 4 * polls, f"{meta_gets} metadata gets in {elapsed:.1f} s"
        assert total(data1, "pushed_bytes_total") > total(data0, "pushed_bytes_total")
        assert c.stats()["pushed_bytes"] > 0 and c.stats()["durable_bytes"] == 0


def test_a_file_whose_feed_flows_skips_the_safety_poll_and_one_that_stands_still_keeps_it(dep, root):
    """The safety polls of tailing consumers are a large share of the metadata replicas'
    calls. A feed that flows is a cache that holds the file up to where it
    got (a replica pushes in order and never past a chunk it lacks), so that file skips the
    poll; a file whose feed stands still (chunk writes failing, a stalled stream, or just no
    traffic) is polled as before, and so is a file a reader follows explicitly (review
    finding: the copy daemon's durable copies read the durable length, which only a poll
    brings; skipping froze it while the feed flowed)."""
    with Producer(root, "safety", shards=1, **endpoints(dep)) as p, Consumer(root, "safety", **endpoints(dep)) as c:
        col, t, feed, uri = live_feed_after_msg0(p, c)
        poller = c.path.poller
        longest = PUSH_SAFETY_POLL_S * (1 + PUSH_SAFETY_JITTER)
        sent = [1]

        def flow(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                p.send(msg(sent[0]))
                p.flush()
                sent[0] += 1
                col.pump(0.02)

        with polls_of(poller, uri) as asked:
            flow(2 * longest + 0.5)
            # A poll that began while the feed had not flowed yet may still ask; after it, none.
            assert len(asked) <= 1, f"the file was polled {len(asked)} times while its feed flowed"
            steady = len(asked)
            wake = poller.follow(uri)  # an explicit follower: polled while the feed flows
            try:
                flow(2 * longest + 0.5)
            finally:
                poller.unfollow(uri, wake)
            assert len(asked) > steady, "a followed file was not polled while its feed flowed"
            followed = len(asked)
            col.pump(2 * longest + 0.5)  # nothing is sent: the feed stands still
            assert len(asked) > followed, "the safety poll stopped for a file whose feed stands still"
            col.until(lambda: len(col.values) == sent[0], 20, "every message")
            assert_exact(col.values, sent[0])


def test_a_feed_behind_the_known_length_is_not_polled_every_round_while_it_moves(dep, root):
    """On a CPU-starved machine the feeds trail the lengths the safety polls bring by a push
    or more; were every consumer's poller to read the lengths every round (10 ms) then, the
    overload would feed itself. A stream thread slowed to 60 ms a push, beside a producer flushing every
    20 ms, keeps this feed behind: while it moves the file is polled at the safety period only,
    and every message arrives in order."""
    with Producer(root, "behind", shards=1, **endpoints(dep)) as p, Consumer(root, "behind", **endpoints(dep)) as c:
        col, t, feed, uri = live_feed_after_msg0(p, c)
        poller = c.path.poller
        streams = list(feed._streams.values())
        slowed = {}
        for stream in streams:
            handle = slowed[stream] = stream._handle

            def slow(message, handle=handle):
                time.sleep(0.06)
                handle(message)

            stream._handle = slow
        behind = [0, 0]  # rounds sampled: [not covered, all]
        sent = 1
        store = DurableStore(root)
        try:
            with polls_of(poller, uri) as asked:
                end = time.monotonic() + 3 * PUSH_SAFETY_POLL_S * (1 + PUSH_SAFETY_JITTER)
                while time.monotonic() < end:
                    p.send(msg(sent))
                    p.flush()
                    sent += 1
                    # What a poll would bring (the published durable length): the safety poll
                    # is skipped while the feed flows, so it is handed in as a poll would.
                    poller.notify(uri, durable_length=store.length(t.rel))
                    col.pump(0.02)
                    behind[0] += not poller._covered(uri)
                    behind[1] += 1
        finally:
            for stream, handle in slowed.items():
                stream._handle = handle
        assert behind[0] >= behind[1] // 4, f"the feed was not behind the known length: {behind}"
        # Safety polls at most (one per half period), not a poll every 10 ms round.
        most = int(4.5 / (PUSH_SAFETY_POLL_S * (1 - PUSH_SAFETY_JITTER))) + 2
        assert len(asked) <= most, f"{len(asked)} polls in 4.5 s while the feed moved behind ({behind})"
        col.until(lambda: len(col.values) == sent, 30, "every message")
        assert_exact(col.values, sent)


def test_a_feed_that_stands_still_behind_the_known_length_is_polled_every_round(dep):
    """The other side of the rule: a fed file whose feed is behind the longest length known and
    has not moved for PUSH_GRACE_S is polled every round (its bytes may never come by push: a
    replica lacking a chunk stops its run there), a feed that moves stops that at once, and one
    that stops again is polled every round again within PUSH_GRACE_S."""
    from pyspark_acs.cache.feed import PUSH_GRACE_S
    from pyspark_acs.cache.poller import LengthPoller

    poller = LengthPoller(tuple(dep.metadata_endpoints.split(",")), interval=0.01)
    uri = "file:///nowhere/still.acs"
    try:
        with polls_of(poller, uri) as asked:
            poller.lengths([uri])
            poller.cover(uri, lambda known: False)  # a feed that is up but behind every known length
            time.sleep(0.5)
            still = len(asked)
            assert still >= 10, f"a fed file standing still behind was polled {still} times in 0.5 s"
            moving_until = time.monotonic() + 0.6
            step = 0
            while time.monotonic() < moving_until:  # the feed moves: it raises the cache length
                step += 1
                poller.notify(uri, cache_length=step, fed=True)
                time.sleep(PUSH_GRACE_S / 4)
            moved = len(asked) - still
            assert moved <= 3, f"a fed file whose feed moved was polled {moved} times in 0.6 s"
            # The feed stops: polled every round again once PUSH_GRACE_S has passed, not from the
            # next safety poll (up to 1.5 s later: the review).
            time.sleep(0.6)
            resumed = len(asked) - still - moved
            assert resumed >= 10, f"a fed file whose feed stopped behind was polled {resumed} times in 0.6 s"
    finally:
        poller.uncover(uri)
        poller.release([uri])
        poller.meta.client.close()  # the thread ends at its next round (ClosedError)


def test_a_failed_safety_poll_does_not_send_the_reader_of_a_live_feed_to_the_store(dep, root):
    """Safety polls timing out on overloaded metadata replicas must not send readers whose
    files a live feed pushes to the store for a hold (that makes the overload worse). A failed
    poll fails only readers of files that are not pushed: this one keeps reading pushed bytes,
    with no hold and nothing from the store. (Its poller's long interval keeps the failed poll
    the last one while the messages are read.)"""
    from pyspark_acs.cache.poller import LengthPoller
    from pyspark_acs.errors import CacheError
    from pyspark_acs.read.cachepath import CachedReadPath
    from pyspark_acs.storage.store import DurableStore

    meta = CacheClient(dep.metadata_endpoints, name="metadata cache")
    poller = LengthPoller(tuple(meta.endpoints), interval=5.0)
    path = CachedReadPath(DurableStore(root), data_cache=dep.data_endpoints, metadata_cache=meta, poller=poller,
                          push=True)
    with Producer(root, "safefail", shards=1, **endpoints(dep)) as p, \
            Consumer(root, "safefail", read_path=path) as c:
        col, t, feed, uri = live_feed_after_msg0(p, c)
        real = poller.meta.lengths

        def failing(uris):
            raise CacheError("metadata cache: consistent get failed (test)")

        poller.meta.lengths = failing
        try:
            # The feed stands still, so the next safety poll asks for the file, and fails.
            col.until(lambda: poller._error is not None, 10, "a failed safety poll")
            for n in range(1, 51):
                p.send(msg(n))
                p.flush()
                col.pump(0.01)
            col.until(lambda: len(col.values) == 51, 20, "every message")
        finally:
            poller.meta.lengths = real
        assert_exact(col.values, 51)
        assert col.stat("store_holds") == 0 and col.stat("durable_bytes") == 0, c.stats()
        assert col.stat("pushed_bytes") > 0
    meta.close()


def test_a_caught_up_reader_waits_for_pushes_instead_of_polling(dep, root):
    """With every followed length pushed, an idle consumer loop sleeps until a push wakes it (at
    most PUSHED_WAIT_S) instead of polling every poll_interval; a new message still arrives at
    once. A Follow stream counts as up as soon as its replica accepts it (initial metadata), so
    this holds right after the first message too, with nothing pushed yet."""
    from pyspark_acs.read.consumer import PUSHED_WAIT_S

    with Producer(root, "idle", shards=1, **endpoints(dep)) as p, Consumer(root, "idle", **endpoints(dep)) as c:
        got = []
        batches = c.batches()
        p.send(msg(0))
        p.flush()
        got.extend(next(batches).column("value").to_pylist())
        calls = []
        real = c._fill
        c._fill = lambda: (calls.append(1), real())[1]
        deadline = time.monotonic() + 20
        while not c._all_pushed() and time.monotonic() < deadline:  # the streams confirm the keys
            time.sleep(0.05)
        assert c._all_pushed()
        sent_at = {}

        def later():
            time.sleep(2.0)
            p.send(msg(1))
            p.flush()
            sent_at["t"] = time.monotonic()  # published: from here a push wakes the reader

        sender = threading.Thread(target=later, daemon=True)
        sender.start()
        got.extend(next(batches).column("value").to_pylist())
        arrived = time.monotonic()
        sender.join(30)
        # 2 s idle at the 10 ms poll interval would be ~200 loop rounds; pushed, a handful.
        assert len(calls) <= 2.0 / PUSHED_WAIT_S + 8, len(calls)
        assert arrived - sent_at["t"] < PUSHED_WAIT_S  # woken by the push, not by the bound
        assert got == [msg(0), msg(1)]


def test_an_idle_pushed_reader_waits_a_drawn_period_not_in_step(dep, root):
    """The idle loop's bound is drawn afresh for each wait (PUSHED_WAIT_S on average, within
    +-PUSH_SAFETY_JITTER): consumers woken by the same last push must not look at the store in
    step every second (on HDFS, a burst of NameNode calls per second from every consumer)."""
    from pyspark_acs.cache.poller import PUSH_SAFETY_JITTER
    from pyspark_acs.read.consumer import PUSHED_WAIT_S

    with Producer(root, "drawn", shards=1, **endpoints(dep)) as p, Consumer(root, "drawn", **endpoints(dep)) as c:
        first_message_pushed(p, c, timeout=5)
        waits = []
        real = c.path.wait
        c.path.wait = lambda seconds, since=None: (waits.append(seconds), real(seconds, since=since))[1]
        assert list(c.batches(timeout=5 * PUSHED_WAIT_S)) == []  # idle: nothing is sent
        lo, hi = (1 - PUSH_SAFETY_JITTER) * PUSHED_WAIT_S, (1 + PUSH_SAFETY_JITTER) * PUSHED_WAIT_S
        drawn = waits[:-1]  # the last one is cut to what is left of the timeout
        assert len(drawn) >= 2, waits
        assert all(lo <= w <= hi for w in drawn), waits
        assert max(drawn) - min(drawn) > 0.01, waits  # drawn, not the fixed bound


def test_a_caught_up_reader_looks_once_per_push(dep, root):
    """After a round that read everything readable, the loop waits at once instead of looking
    again (the second look found nothing and cost a tailing consumer a third of its main
    thread): one round per pushed flush, not two. Every message still arrives in order."""
    with Producer(root, "oncelook", shards=1, **endpoints(dep)) as p, \
            Consumer(root, "oncelook", **endpoints(dep)) as c:
        batches, got = first_message_pushed(p, c, timeout=5)
        calls = []
        real = c._fill
        c._fill = lambda: (calls.append(1), real())[1]

        def send():
            for i in range(1, 61):
                p.send(msg(i))
                p.flush()
                time.sleep(0.02)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        rounds = 0
        while len(got) < 61:
            got.extend(next(batches).column("value").to_pylist())
            rounds += 1
        sender.join()
        assert got == [msg(i) for i in range(61)]
        # One look per batch handed out, plus the looks after the safety-net timeouts and
        # the pushes that woke the loop before their bytes arrived; two per batch before.
        assert len(calls) <= rounds + 0.5 * rounds + 5, (len(calls), rounds)


def test_a_reader_capped_by_max_read_bytes_reads_on_without_waiting_for_a_push(dep, root):
    """A round that stopped at max_read_bytes with more readable is not a settled round: the
    loop reads on at once instead of waiting for a push that will not come."""
    from pyspark_acs.read.consumer import PUSHED_WAIT_S

    with Producer(root, "capped", shards=1, **endpoints(dep)) as p, \
            Consumer(root, "capped", max_read_bytes=8 * 1024, **endpoints(dep)) as c:
        batches, got = first_message_pushed(p, c, timeout=5)
        for i in range(1, 201):
            p.send(msg(i) + b"-" * 1000)
            if i % 20 == 0:
                p.flush()  # 10 blocks of ~20 KiB: each read takes one block past the cap
        p.flush()
        rel = c._tailers[0].rel
        deadline = time.monotonic() + 20
        while c.path.lengths([rel])[rel] < 200 * 1000 and time.monotonic() < deadline:
            time.sleep(0.05)  # the whole backlog is published (nothing more will be pushed)
        time.sleep(0.2)
        waits = []
        real_wait = c.path.wait
        c.path.wait = lambda *a, **k: (waits.append(1), real_wait(*a, **k))[1]
        got.extend(v for b in c.batches(timeout=PUSHED_WAIT_S / 2) for v in b.column("value").to_pylist())
        # Ten capped reads in a row, then the one wait that ends the loop (or a stray push).
        assert len(waits) <= 3, len(waits)
        assert got == [msg(0)] + [msg(i) + b"-" * 1000 for i in range(1, 201)]


def test_a_push_landing_while_the_reader_reads_is_not_lost(dep, root):
    """Review finding: a length pushed between the reader's look at lengths and its wait used to
    be missed, and the message sat out the whole pushed wait (1 s). The wait now starts from a
    token taken before the look."""
    from pyspark_acs.read.consumer import PUSHED_WAIT_S

    with Producer(root, "lostwake", shards=1, **endpoints(dep)) as p, \
            Consumer(root, "lostwake", **endpoints(dep)) as c:
        batches = c.batches()
        p.send(msg(0))
        p.flush()
        next(batches)
        deadline = time.monotonic() + 20
        while not c._all_pushed() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c._all_pushed()
        poller, real, state = c.path.poller, c._all_pushed, {"armed": True}

        def between_look_and_wait():  # runs after _fill looked, before the wait
            result = real()
            if state["armed"]:
                state["armed"] = False
                seen = poller.change_token()
                state["sent"] = time.monotonic()
                p.send(msg(1))
                p.flush()
                end = time.monotonic() + 10
                while poller.change_token() == seen and time.monotonic() < end:
                    time.sleep(0.001)  # the push has reached this process
            return result

        c._all_pushed = between_look_and_wait
        got = next(batches).column("value").to_pylist()
        waited = time.monotonic() - state["sent"]
        assert got == [msg(1)]
        assert waited < PUSHED_WAIT_S * 0.5, f"the pushed message waited {waited:.2f} s"


@pytest.mark.parametrize("role, how", [("data", "kill"), ("metadata", "kill"), ("both", "kill"), ("both", "stop")])
def test_reader_keeps_every_message_while_replicas_die_and_return(dep, root, role, how):
    """One data and/or one metadata replica is SIGKILLed mid-stream and restarted, or stopped
    (SIGSTOP: alive but silent, the producer's pipelined puts to it unanswered) and resumed:
    the reader hedges (bytes from another replica, lengths polled while no majority of streams
    is live), gets every message in order, and is pushed to again afterwards."""
    roles = ["data", "metadata"] if role == "both" else [role]
    with following_through_a_fault(root, "faults", endpoints(dep)) as (c, col):
        col.until(lambda: len(col.values) >= 500, 30, "first messages")
        # The data replica killed is the one this process's feed follows the file on.
        index = {"data": followed_replica(dep, c), "metadata": 0}
        for r in roles:
            if how == "kill":
                dep.kill(r, index[r], signal.SIGKILL)
            else:
                stop_process(dep.server(r, index[r]).pid)
        seen = len(col.values)
        try:
            col.until(lambda: len(col.values) >= seen + 1000, 30, "messages with a replica dead")
        finally:
            for r in roles:
                if how == "kill":
                    dep.restart(r, index[r])
                else:
                    os.kill(dep.server(r, index[r]).pid, signal.SIGCONT)
        pushed = col.stat("pushed_bytes")
        seen = len(col.values)
        col.until(lambda: len(col.values) >= seen + 1000, 30, "messages after the restart")
        # Pushed to again: on a loaded machine a reader woken by a length may read a flush
        # by asking before its pushed bytes land, so give the stream time, not a count.
        col.until(lambda: col.stat("pushed_bytes") > pushed, 30, "bytes pushed after the restart")


def test_a_stalled_data_replica_loses_its_followers_to_the_next_replica(dep, root):
    """The data replica a consumer's feed follows its file on is stopped (SIGSTOP: alive but
    silent; gRPC's keepalive would notice only after 30 s). Its readers ask the others for the
    bytes, and once the stream has left its subscription unanswered for FEED_STALL_S while they
    do, the file moves to its next replica, which pushes it from where the readers are: bytes
    are pushed again while the first replica is still stopped, and every message arrives in
    order, none from the store."""
    with following_through_a_fault(root, "stalled", endpoints(dep)) as (c, col):
        col.until(lambda: len(col.values) >= 300, 30, "first messages")
        feed = c.path.feed
        index = followed_replica(dep, c)
        stopped = dep.endpoints("data")[index]
        moves = feed.moves
        stop_process(dep.server("data", index).pid)
        try:
            col.until(lambda: feed.moves > moves, 30, "the file moving off the stalled replica")
            with feed._lock:  # the feed is the process's: other tests' files may be in it
                assert feed._files[c.store.uri(c._tailers[0].rel)].endpoint != stopped
            pushed = col.stat("pushed_bytes")
            seen = len(col.values)
            col.until(lambda: len(col.values) >= seen + 500 and col.stat("pushed_bytes") > pushed, 30,
                      "bytes pushed by the next replica while the first is stopped")
        finally:
            os.kill(dep.server("data", index).pid, signal.SIGCONT)
        seen = len(col.values)
        col.until(lambda: len(col.values) >= seen + 500, 30, "messages after the replica resumed")


def test_a_file_followed_on_a_replica_that_never_answers_moves_to_the_next(dep, caplog):
    """A replica stopped before a file is followed on it (SIGSTOP): its stream never answers,
    so it never comes up and no break is announced (the moves of a broken stream never
    happen). Once its reader has gone past the feed by asking for FEED_STALL_S, the file moves
    to its next replica, which pushes it from there: exactly the file's bytes."""
    from pyspark_acs.cache.chunks import chunk_key
    from pyspark_acs.cache.feed import ChunkFeed, pick_replica

    feed = ChunkFeed(dep.data_endpoints.split(","))
    writer_client = CacheClient(dep.data_endpoints)
    stopped = dep.endpoints("data")[0]
    pid = dep.server("data", 0).pid
    # A file this process follows on the replica about to stop.
    uri = next(u for u in (f"file:///never/{time.time_ns()}-{i}.acs" for i in range(1000))
               if pick_replica(feed.client.replicas_for(chunk_key(u, 0)), u) == stopped)
    piece = bytes(range(256)) * 16  # 4 KiB
    data = b""
    stop_process(pid)
    try:
        writer = ChunkWriter(writer_client, uri)
        feed.follow(uri, 1, 0)
        deadline = time.monotonic() + 30
        while feed.moves == 0:  # the reader asks for what is written and reads on past the feed
            assert time.monotonic() < deadline, "the file never left the replica that does not answer"
            writer.append(piece)
            data += piece
            feed.consumed(uri, 1, len(data))
            time.sleep(0.05)
        with feed._lock:
            f = feed._files[uri]
            assert f.endpoint != stopped and f.base == f.end == len(data)
        said = [r.getMessage() for r in caplog.records if r.name == "pyspark_acs.cache.feed"]
        assert any(stopped in m and "unanswered" in m and f.endpoint in m for m in said), said
        at = len(data)
        for _ in range(8):
            writer.append(piece)
            data += piece
        wait_until(lambda: feed.read(uri, at, len(data)) == data[at:], 20, "the next replica's push")
    finally:
        os.kill(pid, signal.SIGCONT)
        feed.close()
        writer_client.close()


def test_a_reader_the_caches_fail_reads_the_store_alone_for_a_hold_then_returns(dep, root):
    """Every data replica stopped (SIGSTOP: calls to them only time out): the reader's first
    failed read starts a store hold -- lengths and bytes from the store alone, its file no
    longer pushed to the process -- and it keeps getting every message in order. Failing again
    after each hold doubles the next, so a long outage costs a few holds, not a timed-out call
    per read. Once the replicas answer, the reader is back on the caches within a hold."""
    with Producer(root, "held", shards=1, **endpoints(dep)) as p, Consumer(root, "held", **endpoints(dep)) as c:
        col = Collector(c)
        sender = Sender(p)
        sender.start()
        pids = [dep.server("data", i).pid for i in range(3)]
        try:
            col.until(lambda: len(col.values) >= 500 and col.stat("pushed_bytes") > 0, 30, "first pushed messages")
            uri = p.store.uri(f"{shard_dir('held', 0)}/{p.current_files()[0]}")
            for pid in pids:
                stop_process(pid)
            stopped = time.monotonic()
            try:
                col.until(lambda: col.stat("store_holds") >= 1, 30, "a store hold")
                # The hold drops the file from the process's feed: nothing is pushed to it.
                col.until(lambda: c.path.holding() and not c.path.feed.follows(uri), 30,
                          "the file dropped from the feed during a hold")
                seen = len(col.values)
                col.until(lambda: len(col.values) >= seen + 1000, 30, "messages from the store alone")
                holds, outage = col.stat("store_holds"), time.monotonic() - stopped
                # Holds of 1, 2, 4, 8, 8 ... s, each at least 75 % of that: four within the first
                # 5.25 s, then one per 6 s at most -- not one per read.
                assert holds <= 4 + outage / (STORE_HOLD_MAX_S * (1 - STORE_HOLD_JITTER)), (holds, outage)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            # Back on the caches: bytes pushed again and durable reads stop.
            pushed = col.stat("pushed_bytes")
            col.until(lambda: col.stat("pushed_bytes") > pushed, 30, "bytes pushed after the outage")
            deadline = time.monotonic() + 30
            while True:
                d0, n0 = col.stat("durable_bytes"), len(col.values)
                col.pump(1.5)
                if col.stat("durable_bytes") == d0 and len(col.values) > n0:
                    break
                assert time.monotonic() < deadline, f"store reads did not stop: {c.stats()}"
        finally:
            count = sender.stop()
        col.until(lambda: len(col.values) >= count, 30, "every message")
        col.pump(0.2)
        assert_exact(col.values, count)


def test_a_producer_acknowledging_at_the_durable_append_does_not_wait_on_stalled_caches(dep, root):
    """acknowledge="durable" (the paper's producer: durable first, the cache shadowed
    asynchronously): with every data replica stopped (SIGSTOP: calls only time out), its
    flushes return at the durable append, while a default producer's flush waits out the chunk
    put's deadline. A consumer following all along gets every message in order once the
    replicas resume, and close() publishes the file's full length."""
    from pyspark_acs.cache.client import DEFAULT_DEADLINE_S
    from pyspark_acs.cache.metadata import MetadataCache

    pids = [dep.server("data", i).pid for i in range(3)]
    with Producer(root, "dack", shards=1, acknowledge="durable", **endpoints(dep)) as p, \
            Producer(root, "pack", shards=1, **endpoints(dep)) as published, \
            Consumer(root, "dack", **endpoints(dep)) as c:
        col = Collector(c)
        p.send(msg(0))
        p.flush()
        published.send(msg(0))
        published.flush()
        col.until(lambda: len(col.values) == 1, 20, "the first message")
        for pid in pids:
            stop_process(pid)
        try:
            slowest = 0.0
            for n in range(1, 21):
                p.send(msg(n))
                started = time.monotonic()
                p.flush()
                slowest = max(slowest, time.monotonic() - started)
                col.pump(0.01)
            published.send(msg(1))
            started = time.monotonic()
            published.flush()
            waited = time.monotonic() - started
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert slowest < DEFAULT_DEADLINE_S * 0.8, f"a flush took {slowest:.3f} s"
        assert waited >= DEFAULT_DEADLINE_S * 0.8, f"the default producer's flush took {waited:.3f} s"
        col.until(lambda: len(col.values) == 21, 30, "every message")
        assert_exact(col.values, 21)
        rel = f"{shard_dir('dack', 0)}/{p.current_files()[0]}"
    meta = MetadataCache(CacheClient(dep.metadata_endpoints))
    try:
        uri = c.store.uri(rel)
        cache_len, durable_len = meta.lengths([uri])[uri]
        size = DurableStore(root).lengths([rel])[rel]
        assert durable_len == size, (durable_len, size)  # close() published it
    finally:
        meta.client.close()


def test_a_producer_acknowledging_at_the_durable_append_keeps_every_shards_order_across_rolls(dep, root):
    """Review finding: acknowledge="durable" was tested on one shard without a roll. Three
    shards rolling every few blocks (each roll seals a file whose blocks the shadow thread may
    still hold), flushed in bursts: a consumer following all along gets every shard's messages
    exactly once and in order, across each shard's files (it reads on only at a seal)."""
    tags = [b"a", b"b", b"c"]
    per_shard = 120
    with Producer(root, "dackroll", shards=3, acknowledge="durable", roll_bytes=16 * 1024,
                  max_batch_delay=0.001, **endpoints(dep)) as p, \
            Consumer(root, "dackroll", **endpoints(dep)) as c:
        got = {0: [], 1: [], 2: []}

        def pump(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for b in c.poll():
                    for shard, value in zip(b.column("shard").to_pylist(), b.column("value").to_pylist()):
                        got[shard].append(value)
                time.sleep(0.005)

        for i in range(per_shard):
            for shard, tag in enumerate(tags):
                p.send(msg(i, tag), shard=shard)
            if i % 10 == 9:
                p.flush()
                pump(0.01)
        p.flush()
        deadline = time.monotonic() + 30
        while sum(map(len, got.values())) < 3 * per_shard and time.monotonic() < deadline:
            pump(0.1)
        for shard, tag in enumerate(tags):
            assert_exact(got[shard], per_shard, tag)
    store = DurableStore(root)
    for shard in range(3):
        assert len(store.list_files("dackroll", shard)) >= 2  # every shard rolled


def test_store_hold_doubles_while_failures_recur_and_starts_over_after_a_quiet_spell():
    """The hold rule alone: the first failure holds STORE_HOLD_MIN_S, a failure soon after a
    hold ended doubles it up to STORE_HOLD_MAX_S, one after STORE_HOLD_RESET_S starts over;
    failures during a hold change nothing; each hold is drawn within the jitter."""
    lo, hi = 1 - STORE_HOLD_JITTER, 1 + STORE_HOLD_JITTER
    for _ in range(20):
        h = StoreHold()
        now = 100.0
        assert not h.holding(now)
        want = STORE_HOLD_MIN_S
        for _ in range(6):
            got = h.trip(now)
            assert want * lo <= got <= want * hi
            assert h.holding(now + got * 0.99) and h.trip(now + got * 0.5) is None
            now += got + 0.1  # fails again just after the hold
            want = min(want * 2, STORE_HOLD_MAX_S)
        assert want == STORE_HOLD_MAX_S
        got = h.trip(now)
        assert STORE_HOLD_MAX_S * lo <= got <= STORE_HOLD_MAX_S * hi
        got = h.trip(now + got + STORE_HOLD_RESET_S + 0.1)
        assert STORE_HOLD_MIN_S * lo <= got <= STORE_HOLD_MIN_S * hi


def test_reader_that_connects_late_resumes_by_offset(dep, root):
    """A reader closed mid-stream and a new one started from its offsets later gets exactly the
    rest: the backlog it asks for, then, caught up, what is pushed from where it is."""
    with Producer(root, "late", shards=2, **endpoints(dep)) as p:
        for i in range(500):
            p.send(msg(i), shard=0)
        p.flush()
        with Consumer(root, "late", **endpoints(dep)) as c:
            col = Collector(c)
            col.until(lambda: len(col.values) >= 500, 20, "the first 500")
            offsets = c.offsets()
        for i in range(500, 1500):
            p.send(msg(i), shard=0)
        p.flush()
        with Consumer(root, "late", start=offsets, **endpoints(dep)) as c2:
            col2 = Collector(c2)
            col2.until(lambda: len(col2.values) >= 1000, 20, "the backlog")
            for i in range(1500, 1700):
                p.send(msg(i), shard=0)
                p.flush()
            col2.until(lambda: len(col2.values) >= 1200, 20, "the new messages")
            col2.pump(0.2)
            assert col2.values == [msg(i) for i in range(500, 1700)]
            assert c2.stats()["pushed_bytes"] > 0


def test_follow_stream_starts_at_the_offset_and_resumes_after_a_restart(dep):
    """The stream protocol itself: bytes come from the asked offset, contiguous, and after the
    replica restarts the stream reconnects and resumes at the cursor the bytes reached."""
    uri = f"file:///push/{time.time_ns()}.acs"
    data = bytes(range(251)) * 200  # 50,200 bytes
    writer = ChunkWriter(CacheClient(dep.data_endpoints), uri)
    writer.append(data[:20_000])
    got = bytearray()
    starts: List[int] = []
    lock = threading.Lock()

    def on_bytes(fid, start, run):
        with lock:
            starts.append(start)
            assert start == 5000 + len(got), (start, len(got))
            got.extend(run)

    client = CacheClient(dep.data_endpoints, name="data cache")
    index = dep.endpoints("data").index(client.endpoints[0])
    stream = FollowStream(client, client.endpoints[0], on_bytes)
    try:
        stream.follow(file_id(uri), 5000)
        wait_until(lambda: len(got) == 15_000, 10, "the bytes from 5000")
        assert starts[0] == 5000
        dep.kill("data", index, signal.SIGKILL)
        writer.append(data[20_000:30_000])  # a majority of the other replicas take it
        dep.restart("data", index)
        # gRPC clients of this process back off from the dead address for up to a second.
        wait_until(lambda: "error" not in server_stats(client.endpoints[0])[client.endpoints[0]], 10, "the replica")
        # The restarted replica has none of the file: the stream reconnects and waits at its
        # cursor (20,000) until chunks from there are written to it again.
        writer2 = ChunkWriter(CacheClient(dep.data_endpoints), uri, 16_384)  # rewrites from chunk 4 on
        writer2.append(data[16_384:])
        wait_until(lambda: len(got) == len(data) - 5000, 20, "the bytes after the restart")
        assert bytes(got) == data[5000:]
        assert stream.reconnects >= 1
    finally:
        stream.close()
        client.close()


def test_many_followers_of_a_file_get_its_exact_bytes_from_one_message_per_put(dep):
    """Eight streams follow one file on one replica from its start and a ninth from inside it,
    each on a client of its own (a process's stream, as eight consumer processes have). Every
    stream gets exactly the file's bytes from its offset, in order, through puts of odd sizes
    that end inside chunks; and the replica built about one message per put and cursor, not
    one per stream (``pushed_shared_total``: sent again as built for another stream)."""
    uri = f"file:///shared/{time.time_ns()}.acs"
    fid = file_id(uri)
    data = bytes(range(251)) * 400  # 100,400 bytes
    endpoint = CacheClient(dep.data_endpoints).endpoints[0]
    offsets = [0] * 8 + [7_000]
    got = [bytearray() for _ in offsets]
    clients, streams = [], []

    def on_bytes_of(i):
        def on_bytes(f, start, run):
            assert start == offsets[i] + len(got[i]), (i, start, len(got[i]))
            got[i].extend(run)
        return on_bytes

    before = total(server_stats(endpoint), "pushed_shared_total")
    writer = ChunkWriter(CacheClient(dep.data_endpoints), uri)
    writer.append(data[:10_000])
    try:
        for i, offset in enumerate(offsets):
            client = CacheClient(dep.data_endpoints, name="data cache")
            clients.append(client)
            streams.append(FollowStream(client, endpoint, on_bytes_of(i)))
            streams[-1].follow(fid, offset)
        wait_until(lambda: all(len(g) == 10_000 - o for g, o in zip(got, offsets)), 20, "the first bytes")
        at, puts = 10_000, 0
        while at < len(data):
            step = min(len(data) - at, 3_001 + 977 * (puts % 5))
            writer.append(data[at:at + step])
            at += step
            puts += 1
            wait_until(lambda: all(len(g) == at - o for g, o in zip(got, offsets)), 20, f"the bytes to {at}")
        for g, o in zip(got, offsets):
            assert bytes(g) == data[o:]
        shared = total(server_stats(endpoint), "pushed_shared_total") - before
        # Eight streams at one cursor per put: seven of them are sent the first one's message.
        assert shared >= puts * 7 // 2, (shared, puts)
    finally:
        for stream in streams:
            stream.close()
        for client in clients:
            client.close()


def test_slow_reader_holds_up_nobody_and_grows_no_server_memory(dep):
    """One follower stops reading (its callback blocks); 48 MiB go through a data cache of
    64 MiB. The other follower gets every byte as it lands, and the server's memory grows by
    no more than what it stores: a stream owes marks and a cursor, never queued bytes.

    The writer stays within 8 MiB of the fast follower: 48 MiB of 4 KiB chunks are charged
    ~54 MiB, so GC evicts the file's head while it is written, and a bare FollowStream that
    fell behind that far (a starved test process) would wait at the evicted chunk for ever
    (a reader asks the cache for it; this stream does not)."""
    uri = f"file:///slow/{time.time_ns()}.acs"
    fid = file_id(uri)
    client = CacheClient(dep.data_endpoints, name="data cache")
    endpoint = client.endpoints[0]
    index = dep.endpoints("data").index(endpoint)
    blocked = threading.Event()
    fast = bytearray()
    slow = [0]

    def on_fast(f, start, run):
        assert start == len(fast)
        fast.extend(run)

    def on_slow(f, start, run):
        slow[0] += len(run)
        blocked.wait(60)  # a reader that stopped reading

    before = client.stats()[endpoint]["rss_bytes"]
    streams = [FollowStream(client, endpoint, on_fast), FollowStream(client, endpoint, on_slow)]
    try:
        for s in streams:
            s.follow(fid, 0)
        writer = ChunkWriter(CacheClient(dep.data_endpoints), uri)
        piece = bytes(range(256)) * 1024  # 256 KiB
        lead = 8 * 1024 * 1024
        for i in range(192):  # 48 MiB
            writer.append(piece)
            written = (i + 1) * len(piece)
            wait_until(lambda: len(fast) >= written - lead, 60,
                       lambda: f"the fast follower within {lead} B of {written} B (it has {len(fast)} B; "
                               f"{client.stats()[endpoint]['evicted_total']} entries evicted)")
        wait_until(lambda: len(fast) == 192 * len(piece), 60, "the fast follower's bytes")
        after = client.stats()[endpoint]["rss_bytes"]
        stored = client.stats()[endpoint]["used_bytes"]
        assert after - before < stored + 32 * 1024 * 1024, (before, after, stored)
        assert slow[0] < 16 * 1024 * 1024  # the slow one got a message or so, then flow control
        assert dep.is_running("data", index)
    finally:
        blocked.set()
        for s in streams:
            s.close()
        client.close()


def test_a_feed_whose_readers_all_lag_stops_its_push_then_resumes_without_asking(dep):
    """Every reader of a followed file far behind (here: one that reads nothing): the feed
    stops the file's push when it holds FEED_MAX_BYTES instead of dropping the oldest bytes
    (which the reader would then ask for, and the feed push again), and pushes on from the
    buffer's end once the reader has read half. Every byte is read from the feed, in order,
    and pushed about once. With a second reader that keeps up, the push goes on and the
    oldest bytes are dropped as before (the lagging one asks for them)."""
    from pyspark_acs.cache.feed import ChunkFeed

    cap = 2 * 1024 * 1024
    feed = ChunkFeed(dep.data_endpoints.split(","), max_bytes=cap)
    writer_client = CacheClient(dep.data_endpoints)
    piece = bytes(range(256)) * 1024  # 256 KiB
    total = 32 * len(piece)  # 8 MiB: four times the cap
    try:
        uri = f"file:///lagging/{time.time_ns()}.acs"
        feed.follow(uri, 1, 0)
        writer = ChunkWriter(writer_client, uri)
        for _ in range(32):
            writer.append(piece)
        wait_until(lambda: feed._files[uri].paused, 30, "the push stopped")
        f = feed._files[uri]
        time.sleep(0.3)  # nothing more arrives: the stream no longer follows the file
        assert f.base == 0 and cap < f.end <= 2 * cap, (f.base, f.end)
        assert feed._streams[f.endpoint].following() == 0
        data = piece * 32
        at, deadline = 0, time.monotonic() + 60
        while at < total:
            got = feed.read(uri, at, at + 300_000)
            if got:
                assert got == data[at:at + len(got)]
                at += len(got)
                feed.consumed(uri, 1, at)
            else:
                assert time.monotonic() < deadline, f"stuck at {at} of {total}: {feed._files[uri].paused}"
                time.sleep(0.01)
        assert feed.received < total + 2 * 1024 * 1024, feed.received  # each byte pushed about once

        # A reader that keeps up beside one that reads nothing: the push never stops.
        uri2 = f"file:///shared/{time.time_ns()}.acs"
        feed.follow(uri2, 1, 0)
        feed.follow(uri2, 2, 0)
        writer = ChunkWriter(writer_client, uri2)
        at = 0
        for i in range(32):
            writer.append(piece)
            want, deadline = (i + 1) * len(piece), time.monotonic() + 30
            while at < want:
                got = feed.read(uri2, at, want)
                if got:
                    at += len(got)
                    feed.consumed(uri2, 1, at)
                else:
                    assert time.monotonic() < deadline, "the push of a file read at its head stopped"
                    time.sleep(0.005)
            assert not feed._files[uri2].paused
        assert at == total
        f2 = feed._files[uri2]
        assert f2.base > 0 and f2.end - f2.base <= cap  # the oldest dropped for the reader behind
    finally:
        feed.close()
        writer_client.close()


def test_a_consumer_the_feed_dropped_bytes_for_asks_for_them_and_the_others_go_on(dep, root):
    """Two consumers of one process share its feed: one reads as the producer writes, the
    other reads nothing until the producer is done. The feed keeps pushing for the one at the
    head and drops the oldest bytes above FEED_MAX_BYTES (bounded memory), so the laggard's
    bytes are gone from it: it falls back to asking the data cache for them, and gets every
    message in order. The one at the head is not held up: it has every message while the
    laggard has read nothing."""
    from pyspark_acs.cache.feed import ChunkFeed
    from pyspark_acs.read.cachepath import CachedReadPath

    cap = 1024 * 1024
    feed = ChunkFeed(dep.data_endpoints.split(","), max_bytes=cap)  # the process's feed, with a small buffer

    def reader(store: DurableStore) -> Consumer:
        return Consumer(store, "laggard", read_path=CachedReadPath(store, push=True, feed=feed, **endpoints(dep)))

    count = 8000  # ~1.6 MB of messages: past the cap, so the feed must drop for the laggard
    with contextlib.closing(feed), Producer(root, "laggard", shards=1, **endpoints(dep)) as p, \
            reader(DurableStore(root)) as fast, reader(DurableStore(root)) as slow:
        assert slow.path.feed is fast.path.feed is feed  # one feed per process: the readers share it
        quick, behind = Collector(fast), Collector(slow)
        p.send(msg(0))
        p.flush()
        # Both follow the file in the feed, at the same place, before the rest is written.
        quick.until(lambda: len(quick.values) == 1, 20, "the first message to the reader at the head")
        behind.until(lambda: len(behind.values) == 1, 20, "the first message to the laggard")
        uri = fast.store.uri(fast._tailers[0].rel)
        wait_until(lambda: fast.path.feed.live(uri, fast._tailers[0].length), 20, "the feed is live")
        for i in range(1, count):
            p.send(msg(i))
            if i % 20 == 19:
                p.flush()
                quick.pump(0.001)
        p.flush()
        quick.until(lambda: len(quick.values) == count, 30, "every message to the reader at the head")
        assert_exact(quick.values, count)
        f = fast.path.feed._files[uri]
        assert f.end - f.base <= 2 * cap and f.base > 0, (f.base, f.end)  # bounded: the oldest dropped
        assert not f.paused  # a reader at the head keeps the push going
        behind.until(lambda: len(behind.values) == count, 30, "every message to the laggard")
        assert_exact(behind.values, count)
        fast_stats, slow_stats = fast.stats(), slow.stats()
        assert slow_stats["durable_bytes"] == 0 and fast_stats["durable_bytes"] == 0
        # The laggard asked the data cache for what the feed no longer held: its cache bytes
        # are the pushed ones and the asked ones, and together the whole file, as the head's.
        asked = slow_stats["cache_bytes"] - slow_stats["pushed_bytes"]
        assert asked >= f.base - slow_stats["pushed_bytes"], (asked, f.base, slow_stats)
        assert slow_stats["cache_bytes"] == fast_stats["cache_bytes"]


def test_blocks_larger_than_one_push_are_read_from_the_feed(dep, root):
    """A producer writing blocks of ~1.5 MiB (more than one push message carries): a tailing
    reader gets part of a block in one push, reads it, finds no complete block and reads again
    from the block's start. The feed keeps those bytes for it (they are below where its last
    read ended, not below where it stands): before, it dropped them and the reader asked the
    cache for every such block again."""
    from pyspark_acs.server.cache.watch import MAX_PUSH_BYTES

    value = bytes(range(256)) * 6  # 1.5 KiB
    per_block = 1024  # messages: ~1.5 MiB blocks
    assert per_block * len(value) > MAX_PUSH_BYTES
    with Producer(root, "large", shards=1, max_block_bytes=4 * 1024 * 1024, **endpoints(dep)) as p, \
            Consumer(root, "large", **endpoints(dep)) as c:
        got = []

        def read() -> None:
            for batch in c.batches(timeout=10):
                got.append(batch.num_rows)
                if sum(got) >= 12 * per_block:
                    return

        reader = threading.Thread(target=read)
        reader.start()
        for _ in range(12):
            p.send_many([value] * per_block)
            p.flush()
            time.sleep(0.2)
        reader.join(60)
        assert sum(got) == 12 * per_block
        stats = c.stats()
        total = 12 * per_block * len(value)
        # What was asked for rather than pushed: at most the first block's (read before the
        # feed's stream was up) and a few chunks at block ends (the grace), not every block.
        asked = stats["cache_bytes"] - stats["pushed_bytes"]
        assert asked < total // 4 and stats["durable_bytes"] == 0, stats


def test_watch_stream_pushes_lengths_and_resends_after_restart(dep):
    """The metadata side: an added key is answered at once (absent), every stored change is
    pushed, and after the replica restarts the stream comes back and pushes the key again."""
    from pyspark_acs.cache.metadata import MetadataCache, length_keys

    uri = f"file:///watch/{time.time_ns()}.acs"
    key = length_keys(uri)[1]
    seen: List[int] = []
    client = CacheClient(dep.metadata_endpoints, name="metadata cache")
    endpoint = client.endpoints[0]
    index = dep.endpoints("metadata").index(endpoint)

    def on_entries(ep, keys, found, versions):
        seen.extend(v if ok else -1 for k, ok, v in zip(keys, found, versions) if k == key)

    stream = WatchStream(client, endpoint, on_entries)
    meta = MetadataCache(CacheClient(dep.metadata_endpoints))
    try:
        stream.watch([key])
        wait_until(lambda: seen == [-1], 10, "the first (absent) answer")
        assert stream.confirmed(key)
        for n in (100, 200, 300):
            meta.publish(uri, durable_length=n)
        wait_until(lambda: seen and seen[-1] == 300, 10, "the pushed lengths")
        dep.kill("metadata", index, signal.SIGKILL)
        wait_until(lambda: not stream.confirmed(key), 10, "the stream to notice")
        dep.restart("metadata", index)
        wait_until(lambda: stream.confirmed(key), 20, "the stream to come back")
        assert seen[-1] == -1  # the restarted replica lost the entry and says so at once
        wait_until(lambda: "error" not in server_stats(endpoint)[endpoint], 10, "the replica")
        # A publish is done at a majority: the first after the restart may miss the restarted
        # replica (its channel in meta's client still reconnecting), so publish until it has it.
        wait_until(lambda: meta.publish(uri, durable_length=400) or seen[-1] == 400, 20,
                   "the pushed length after the restart")
    finally:
        stream.close()
        meta.client.close()
        client.close()


def test_a_push_stream_that_watches_or_follows_nothing_holds_no_call(dep):
    """The Watch streams of a consumer whose file a feed pushes watch nothing, and an open
    call costs grpc's waits on it all the same. A stream with an empty subscription holds no
    call (the replica's gauge drops), is not live, and the next subscription opens a call at
    once and is pushed as before."""
    from pyspark_acs.cache.metadata import MetadataCache, length_keys

    uri = f"file:///idle-watch/{time.time_ns()}.acs"
    key = length_keys(uri)[1]
    seen: List[int] = []
    client = CacheClient(dep.metadata_endpoints, name="metadata cache")
    endpoint = client.endpoints[0]
    data = CacheClient(dep.data_endpoints, name="data cache")
    data_ep = data.endpoints[0]

    def on_entries(ep, keys, found, versions):
        seen.extend(v if ok else -1 for k, ok, v in zip(keys, found, versions) if k == key)

    def gauge(ep: str, name: str) -> int:
        return server_stats(ep)[ep][name]

    watch_base, follow_base = gauge(endpoint, "watch_streams"), gauge(data_ep, "follow_streams")
    stream = WatchStream(client, endpoint, on_entries)
    states: List[bool] = []
    follow = FollowStream(data, data_ep, lambda fid, start, run: None, on_state=lambda ep, live: states.append(live))
    meta = MetadataCache(CacheClient(dep.metadata_endpoints))
    try:
        time.sleep(0.5)
        assert not stream.live.is_set() and not follow.live.is_set()
        assert gauge(endpoint, "watch_streams") == watch_base and gauge(data_ep, "follow_streams") == follow_base
        for round_ in range(2):
            stream.watch([key])
            fid = file_id(f"{uri}.{round_}")
            follow.follow(fid, 0)
            wait_until(lambda: stream.confirmed(key), 10, "the watch up")
            wait_until(follow.live.is_set, 10, "the follow up")
            assert gauge(endpoint, "watch_streams") == watch_base + 1
            meta.publish(uri, durable_length=100 * (round_ + 1))
            wait_until(lambda: seen and seen[-1] == 100 * (round_ + 1), 10, "the pushed length")
            stream.watch(remove=[key])
            follow.unfollow(fid)
            wait_until(lambda: gauge(endpoint, "watch_streams") == watch_base, 10, "the idle watch to hold no call")
            wait_until(lambda: gauge(data_ep, "follow_streams") == follow_base, 10, "the idle follow to hold no call")
            assert not stream.live.is_set() and not stream.confirmed(key)
        assert stream.reconnects == 0 and follow.reconnects == 0  # going idle is not a failure
        # ... nor announced as one (review finding: the feed moves the files of a stream that
        # says it is down to their next replica, a file followed meanwhile too)
        assert False not in states and states.count(True) == 2, states
    finally:
        stream.close()
        follow.close()
        meta.client.close()
        client.close()
        data.close()


def test_a_long_chunk_read_goes_in_pieces_and_keeps_what_answered(dep):
    """A reader catching up asks for at most READ_PIECE_CHUNKS chunks per Get (each piece is
    answered within the deadline by a loaded replica), READ_PIECES_IN_FLIGHT pieces at once
    (each on a replica of its own pick); when a later piece fails, the pieces before it stay and
    the rest reads as missing (the caller takes it from the store)."""
    from pyspark_acs.cache.chunks import CHUNK_SIZE, READ_PIECE_CHUNKS, READ_PIECES_IN_FLIGHT, ChunkReader, chunk_key
    from pyspark_acs.errors import CacheUnavailableError

    uri = "file:///pieces/s/0/000001.acs"
    n = 2 * READ_PIECE_CHUNKS + 10
    data = bytes(range(256)) * (n * CHUNK_SIZE // 256)
    first_keys = {chunk_key(uri, i * READ_PIECE_CHUNKS): i for i in range(3)}
    with CacheClient(dep.data_endpoints) as client:
        ChunkWriter(client, uri).append(data)
        asked = []  # (piece, keys), in the order the calls started
        lock = threading.Lock()
        state = {"fail": None, "in_flight": 0, "most": 0}
        real = client.get_joined

        def recording_get(keys, **kw):
            piece = first_keys[keys[0]]
            with lock:
                asked.append((piece, len(keys)))
                state["in_flight"] += 1
                state["most"] = max(state["most"], state["in_flight"])
            try:
                time.sleep(0.1)  # long enough for the others to start meanwhile
                if piece == state["fail"]:
                    raise CacheUnavailableError("injected: this piece timed out")
                return real(keys, **kw)
            finally:
                with lock:
                    state["in_flight"] -= 1

        client.get_joined = recording_get
        got = ChunkReader(client).read(uri, 0, len(data))
        assert b"".join(part for _, _, part in got) == data
        # every chunk there in full: one run per piece, no object per chunk
        assert [(s, e) for s, e, _ in got] == [(0, READ_PIECE_CHUNKS * CHUNK_SIZE),
                                               (READ_PIECE_CHUNKS * CHUNK_SIZE, 2 * READ_PIECE_CHUNKS * CHUNK_SIZE),
                                               (2 * READ_PIECE_CHUNKS * CHUNK_SIZE, len(data))]
        assert sorted(asked) == [(0, READ_PIECE_CHUNKS), (1, READ_PIECE_CHUNKS), (2, 10)]
        assert state["most"] == min(3, READ_PIECES_IN_FLIGHT)  # in flight together, not one by one

        asked.clear()
        state["fail"] = 1
        got = ChunkReader(client).read(uri, 0, len(data))
        head = READ_PIECE_CHUNKS * CHUNK_SIZE
        assert got[0] == (0, head, data[:head])
        # the piece after the failed one may have been answered: it is dropped with the rest,
        # chunk by chunk (the caller reads them from the store)
        assert all(part is None for _, _, part in got[1:]) and len(got) == 1 + READ_PIECE_CHUNKS + 10
        assert got[-1][1] == len(data)

        asked.clear()
        state["fail"] = 0  # the first piece failing fails the read: nothing was read
        with pytest.raises(CacheUnavailableError):
            ChunkReader(client).read(uri, 0, len(data))


def test_a_chunk_read_keeps_exact_bytes_around_a_lost_chunk_and_a_partial_last_chunk(dep):
    """The runs a ChunkReader returns are the file's bytes exactly: a piece with a chunk lost
    from every replica goes chunk by chunk (the lost one None, for the store), a piece whose
    chunks are all there is one run, a range may start and end inside chunks, and the file's
    last chunk may be partial."""
    from pyspark_acs.cache.chunks import CHUNK_SIZE, READ_PIECE_CHUNKS, ChunkReader, chunk_key

    uri = "file:///pieces/s/0/000002.acs"
    data = os.urandom((READ_PIECE_CHUNKS + 20) * CHUNK_SIZE - 100)
    lost = 7
    with CacheClient(dep.data_endpoints) as client:
        ChunkWriter(client, uri).append(data)
        client.delete([chunk_key(uri, lost)])
        for start, end in [(0, len(data)), (1000, len(data) - 5), (CHUNK_SIZE * (lost + 1) + 3, len(data)),
                           (5, CHUNK_SIZE * lost), (len(data) - 50, len(data))]:
            got = ChunkReader(client).read(uri, start, end)
            assert got[0][0] == start and got[-1][1] == end
            assert all(a[1] == b[0] for a, b in zip(got, got[1:])), "runs must be contiguous"
            for s, e, part in got:
                if part is None:
                    assert (s // CHUNK_SIZE, (e - 1) // CHUNK_SIZE) == (lost, lost), (s, e)
                else:
                    assert part == data[s:e], (s, e)
            if start > CHUNK_SIZE * (lost + 1) or end <= CHUNK_SIZE * lost:
                assert all(part is not None for _, _, part in got)
                assert len(got) <= 2  # whole pieces: one run each


def test_reader_processes_spread_their_follow_streams_over_the_replicas():
    """Each process follows a file on one of its replicas picked by process and file, so many
    reader processes do not all push from the file's primary (64 consumers did)."""
    from pyspark_acs.cache.feed import pick_replica

    replicas = ("a:1", "b:2", "c:3")
    picks = {pick_replica(replicas, f"/s/0/file-{i}.acs") for i in range(30)}
    assert picks == set(replicas)
    assert pick_replica(replicas, "/s/0/x.acs") == pick_replica(replicas, "/s/0/x.acs")
    assert pick_replica(("only:1",), "/s/0/x.acs") == "only:1"


def test_a_reader_waits_for_bytes_a_live_feed_is_about_to_push_not_asks(dep, root):
    """Bytes the cache holds that the live feed has not pushed yet are waited for (at most
    PUSH_GRACE_S while the feed does not grow), not asked for with Gets: a busy replica asked
    for what it is pushing falls further behind. After the grace the reader asks. The grace
    runs on the feed's clock, moved by hand here."""
    from pyspark_acs.cache.feed import PUSH_GRACE_S, ChunkFeed
    from pyspark_acs.read.cachepath import CachedReadPath

    clock = FakeClock()
    own = ChunkFeed(dep.data_endpoints.split(","), clock=clock)
    store = DurableStore(root)
    path = CachedReadPath(store, push=True, feed=own, **endpoints(dep))
    with contextlib.closing(own), Producer(root, "grace", shards=1, **endpoints(dep)) as p, \
            Consumer(store, "grace", read_path=path) as c:
        col, t, feed, uri = live_feed_after_msg0(p, c)
        assert feed is own
        now = clock()
        assert feed.waiting(uri, t.length, now=now)  # the first look starts the grace
        assert feed.waiting(uri, t.length, now=now + PUSH_GRACE_S / 2)
        assert not feed.waiting(uri, t.length, now=now + PUSH_GRACE_S * 1.5)  # then it asks
        assert not feed.waiting(uri, t.length + 1, now=now)  # not where the feed's bytes go on
        p.send(msg(1))
        p.flush()
        col.until(lambda: len(col.values) == 2, 20, "the second message")
        # The feed grew: a reader at its new end waits afresh.
        assert feed.waiting(uri, t.length)
        # A push held back (the stream is up but its messages are dropped here): bytes the cache
        # holds are not asked for within the grace, then they are, whole and exact.
        with feed._lock:
            stream = feed._streams[feed._files[uri].endpoint]
        stream._handle = lambda message: None
        p.send(msg(2))
        p.flush()
        start = t.length
        published = c.path.meta.lengths([uri])[uri][0]
        assert published > start
        learn_from_the_safety_poll(c, t, uri, published)  # nothing is pushed
        with feed._lock:
            feed._files[uri].short_since = None  # the looks above started a grace long ago
        before = c.path.stats()["cache_bytes"]
        assert c.path.read(t.rel, start, published) == b""
        assert c.path.stats()["cache_bytes"] == before  # nothing asked
        clock.advance(PUSH_GRACE_S * 1.5)
        got = c.path.read(t.rel, start, published)
        assert len(got) == published - start and c.path.stats()["cache_bytes"] > before
        assert msg(2) in got



def test_a_round_cut_short_by_the_feed_is_not_a_settled_round(dep, root):
    """Review finding: a round whose read stopped at the feed's end to wait for its push (the
    length is known, the bytes not pushed yet) read less than was readable, yet it counted as
    settled: when the rest arrived by push, the known length did not move (no wake), so the loop
    skipped its look and slept the pushed wait (1 s) with the bytes in the feed. The loop must
    not wait while bytes it could hand out are in the feed."""
    with Producer(root, "cutshort", shards=1, **endpoints(dep)) as p, \
            Consumer(root, "cutshort", **endpoints(dep)) as c:
        batches, got = first_message_pushed(p, c)
        assert got == [msg(0)]
        t = c._tailers[0]
        feed, uri = c.path.feed, c.store.uri(t.rel)
        with feed._lock:
            stream = feed._streams[feed._files[uri].endpoint]
        # The feed and its streams are the process's: another test may have patched this one.
        held = []

        def real_handle(message):
            FollowStream._handle(stream, message)

        stream._handle = held.append  # pushed messages are held here, handed in by the test

        def held_end() -> int:
            return max((s + n for m in list(held) for s, n in zip(m.message.starts, m.message.sizes)), default=0)

        ends = []
        for i in (1, 2):
            p.send(msg(i))
            p.flush()
            ends.append(c.path.meta.lengths([uri])[uri][0])
            wait_until(lambda: held_end() >= ends[-1], 20, f"the push of message {i}")
        # A reopened Follow call starts with an empty message (a full run of the suite met one
        # here: the process's stream reopened for a subscription change): it carries no bytes.
        runs = [m for m in list(held) if m.message.sizes]
        first = [m for m in runs if max(s + n for s, n in zip(m.message.starts, m.message.sizes)) <= ends[0]]
        rest = runs[len(first):]
        for m in first:
            real_handle(m)  # message 1 reaches the feed
        # The safety poll tells the reader the length after message 2; its bytes are held.
        wait_until(lambda: c.path.poller.lengths([uri])[uri][0] >= ends[1], 20, "the safety poll")
        waits = []
        real_wait = c.path.wait

        def recording_wait(*a, **k):
            with feed._lock:
                waits.append((t.length, feed._files[uri].end))
            return real_wait(*a, **k)

        c.path.wait = recording_wait
        # This round reads message 1 and stops at the feed's end, waiting for message 2's push.
        assert next(batches).column("value").to_pylist() == [msg(1)]
        assert t.length == ends[0]
        for m in rest:
            real_handle(m)  # message 2's bytes arrive; the known length does not move
        assert next(batches).column("value").to_pylist() == [msg(2)]
        del stream._handle  # the process's stream pushes to every reader again
        # No wait began while the feed held readable bytes past the reader's position.
        assert all(pos >= end for pos, end in waits), waits


def test_a_reader_waiting_for_a_push_reads_nothing_from_the_store(dep, root):
    """Review finding: while the read path waited for a live feed to push bytes the cache holds,
    the tailer saw no complete block and searched the range for a recovery seal (skip_void),
    whose read "without waiting" took every byte the feed did not hand it straight from the
    durable store -- store reads for bytes in the cache, on every such wait, and not counted in
    the read path's durable_bytes. Bytes the cache holds come from the cache."""
    with Producer(root, "waitstore", shards=1, **endpoints(dep)) as p, \
            Consumer(root, "waitstore", **endpoints(dep)) as c:
        col, t, feed, uri = live_feed_after_msg0(p, c)
        with feed._lock:
            stream = feed._streams[feed._files[uri].endpoint]
        stream._handle = lambda message: None  # the stream is up, its pushes do not arrive
        p.send(msg(1))
        p.flush()
        published = c.path.meta.lengths([uri])[uri][0]
        learn_from_the_safety_poll(c, t, uri, published)
        store_reads = []
        real_read = c.store.read
        c.store.read = lambda rel, start, end: (store_reads.append((start, end)), real_read(rel, start, end))[1]
        with feed._lock:
            feed._files[uri].short_since = None  # the reader is about to wait at the feed's end
        assert c.poll() == []  # within the grace: waited for, not asked for
        assert store_reads == []
        col.until(lambda: len(col.values) == 2, 20, "the second message, after the grace")
        del stream._handle  # the feed's streams are the process's: later tests use this one
        assert col.values == [msg(0), msg(1)]
        assert store_reads == [] and c.stats()["durable_bytes"] == 0


def test_a_stream_that_came_back_backs_off_from_the_start_when_it_breaks_again(dep, monkeypatch):
    """Review finding: the reconnect back-off doubles on each failure up to RECONNECT_MAX_S and
    was reset when a stream came up again; the Follow refactor lost the reset (for Watch
    streams too), so once a stream had failed a few times in its life, every later break waited
    the maximum before reconnecting (pushes lost for that long, readers polling and asking)."""
    import pyspark_acs.cache.push as push

    waits: List[float] = []

    class RecordingEvent(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(push, "threading", type("T", (), {
        "Event": RecordingEvent, "Lock": threading.Lock, "Thread": threading.Thread}))
    client = CacheClient(dep.data_endpoints, name="data cache")
    endpoint = client.endpoints[0]
    index = dep.endpoints("data").index(endpoint)
    stream = FollowStream(client, endpoint, lambda fid, start, run: None)
    try:
        stream.follow(file_id(f"file:///backoff/{time.time_ns()}.acs"), 0)
        wait_until(stream.live.is_set, 20, "the stream up")
        dep.kill("data", index, signal.SIGKILL)
        wait_until(lambda: waits and waits[-1] == push.RECONNECT_MAX_S, 30, "the back-off at its maximum")
        dep.restart("data", index)
        wait_until(stream.live.is_set, 30, "the stream up again")
        before = len(waits)
        dep.kill("data", index, signal.SIGKILL)
        wait_until(lambda: len(waits) > before, 30, "the first wait after the new break")
        assert waits[before] == push.RECONNECT_INITIAL_S, waits[before:]
    finally:
        stream.close()
        client.close()
        if not dep.is_running("data", index):
            dep.restart("data", index)


def test_a_broken_stream_that_follows_nothing_waits_for_a_subscription_not_reconnects(dep):
    """A process keeps its shared feeds and pollers after its readers of a cluster are gone
    (after test_model, three feeds of stopped deployments were still reconnecting every 2 s).
    A broken stream that follows nothing now waits for a subscription; the next follow()
    reconnects it at once, and close() ends it."""
    import pyspark_acs.cache.push as push

    client = CacheClient(dep.data_endpoints, name="data cache")
    endpoint = client.endpoints[0]
    index = dep.endpoints("data").index(endpoint)
    fid = file_id(f"file:///idle/{time.time_ns()}.acs")
    stream = FollowStream(client, endpoint, lambda fid, start, run: None)

    def up_then_idle_and_broken(what: str) -> None:
        stream.follow(fid, 0)
        wait_until(stream.live.is_set, 20, f"the stream up{what}")
        stream.unfollow(fid)
        dep.kill("data", index, signal.SIGKILL)
        wait_until(lambda: not stream.live.is_set(), 20, f"the break noticed{what}")
        time.sleep(0.5)

    try:
        up_then_idle_and_broken("")
        parked = stream.reconnects
        time.sleep(3 * push.RECONNECT_MAX_S)  # a stream with files would retry every 2 s
        assert stream.reconnects == parked
        dep.restart("data", index)
        up_then_idle_and_broken(" again, after follow()")  # follow() woke it: it reconnected
    finally:
        stream.close()
        client.close()
        if not dep.is_running("data", index):
            dep.restart("data", index)
    stream._thread.join(10)
    assert not stream._thread.is_alive()  # close() woke the waiting stream and it ended


def test_a_seek_between_batches_is_read_at_once(dep, root):
    """Review finding: the loop skipped its next look after a settled round while no length
    moved, and a seek() between two batches moves no length: the batch generator then slept the
    pushed wait (1 s) before reading the position it was moved to, all of it readable."""
    with Producer(root, "seekagain", shards=1, **endpoints(dep)) as p, \
            Consumer(root, "seekagain", **endpoints(dep)) as c:
        batches, got = first_message_pushed(p, c)
        assert got == [msg(0)]
        p.send(msg(1))
        p.flush()
        assert next(batches).column("value").to_pylist() == [msg(1)]  # a settled round
        waits = []
        real_wait = c.path.wait
        c.path.wait = lambda *a, **k: (waits.append(a), real_wait(*a, **k))[1]
        c.seek("earliest")
        got = []
        while len(got) < 2:
            got.extend(next(batches).column("value").to_pylist())
        assert got == [msg(0), msg(1)]
        assert waits == []  # read at once, not after a wait for a push that does not come


@contextlib.contextmanager
def feed_over_four_replicas(tmp_path):
    """A ChunkFeed of a deployment of 4 data replicas (3 per chunk) following one file, and
    ``move(placed)``: moves the (empty) feed to the first chunk its replica is (or is not)
    placed on and returns that position once the stream is up."""
    from pyspark_acs.cache.chunks import CHUNK_SIZE, chunk_key
    from pyspark_acs.cache.feed import ChunkFeed

    with LocalDeployment(tmp_path / "four", data_replicas=4, metadata_replicas=1, capacity="16MiB") as d:
        feed = ChunkFeed(d.data_endpoints.split(","))
        try:
            uri = f"file:///spread/{time.time_ns()}.acs"
            feed.follow(uri, 1, 0)
            with feed._lock:
                endpoint = feed._files[uri].endpoint
            placed = {n: endpoint in feed.client.replicas_for(chunk_key(uri, n)) for n in range(64)}
            assert any(placed.values()) and not all(placed.values())  # both kinds among 64 chunks

            def move(on: bool) -> int:
                at = min(n for n, p in placed.items() if p == on) * CHUNK_SIZE
                feed.follow(uri, 1, at)
                wait_until(lambda: feed._streams[endpoint].live.is_set(), 20, "the stream up")
                return at

            yield feed, uri, move
        finally:
            feed.close()


@pytest.mark.parametrize("check", ["waiting", "live"])
def test_a_feed_at_a_chunk_its_replica_never_holds_neither_waits_nor_covers(tmp_path, check):
    """Review findings: with more data replicas than the replication factor, a file's chunks
    are placed on different replicas (each 4 KiB chunk by its own key), so the replica a feed
    follows never holds some of them and never pushes past them.

    - ``waiting``: the feed's grace waited PUSH_GRACE_S at every such chunk before asking (a
      caught-up reader was ~0.2 s late once every few chunks). Such a chunk is asked for at
      once; the bytes of a chunk the replica holds are still waited for.
    - ``live``: a file whose bytes a live feed pushes is not
      watched; its lengths come from the pushed bytes (and a safety poll every second). A feed
      stuck before such a chunk never pushes again, so the file must not count as covered, or
      its caught-up readers wait for the safety poll (1 s) at each such chunk.
    """
    with feed_over_four_replicas(tmp_path) as (feed, uri, move):
        at = move(False)
        assert not getattr(feed, check)(uri, at)
        at = move(True)
        assert getattr(feed, check)(uri, at)


def test_a_follow_stream_closed_while_it_reopens_ends(dep):
    """Review finding: close() cancels the stream's current call; a Follow call being opened at
    that moment (a reconnect, or a reopen for a new subscription) was not there to cancel, and
    nothing else ends a server-streaming call (the bidirectional one ended when close() ended
    its requests). The closed stream's thread then read pushes forever and the replica kept
    the stream: a thread, a server stream and its pushes leaked per such close."""
    client = CacheClient(dep.data_endpoints, name="data cache")
    endpoint = client.endpoints[0]
    stream = FollowStream(client, endpoint, lambda fid, start, run: None)
    real_stub, opened = client._stub, []

    def stub_then_close(rep):
        opened.append(1)
        if len(opened) == 1:
            stream.close()  # the reader closes while the reopened call is being made
        return real_stub(rep)

    try:
        stream.follow(file_id(f"file:///closing/first-{time.time_ns()}.acs"), 0)  # no call while it follows nothing
        wait_until(stream.live.is_set, 20, "the stream up")
        before = server_stats(endpoint)[endpoint]["follow_streams"]
        client._stub = stub_then_close
        stream.follow(file_id(f"file:///closing/{time.time_ns()}.acs"), 0)  # reopens
        wait_until(lambda: opened, 20, "the reopen")
        stream._thread.join(10)
        assert not stream._thread.is_alive()
        wait_until(lambda: server_stats(endpoint)[endpoint]["follow_streams"] < before, 20,
                   "the replica to drop the stream")
    finally:
        stream.close()
        client.close()


def test_readers_of_a_deployment_with_more_data_replicas_than_copies_read_by_asking(tmp_path):
    """Review estimate: with 4 data replicas and 3 copies per chunk, a feed's replica lacks a
    quarter of a file's chunks and each reader passing one reopened its Follow call. Such
    readers do not follow files in a feed; they get every message, lengths pushed, bytes asked."""
    with LocalDeployment(tmp_path / "four", data_replicas=4, metadata_replicas=3, capacity="32MiB") as d:
        eps = {"data_cache": d.data_endpoints, "metadata_cache": d.metadata_endpoints}
        root = str(tmp_path / "store")
        with Producer(root, "four", shards=1, **eps) as p, Consumer(root, "four", **eps) as c:
            assert c.path.feed is None
            col = Collector(c)
            for i in range(200):
                p.send(msg(i) + b"-" * 3000)  # ~6 chunks per flush of 2: chunks on every replica
                if i % 2:
                    p.flush()
            col.until(lambda: len(col.values) == 200, 30, "every message")
            assert [v[:len(msg(i))] for i, v in enumerate(col.values)] == [msg(i) for i in range(200)]
            assert c.stats()["pushed_bytes"] == 0 and c.stats()["durable_bytes"] == 0


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_watched_reader_keeps_every_message_while_a_metadata_replica_dies_and_returns(tmp_path, how):
    """A reader whose lengths come by Watch alone (no feed: 4 data replicas for 3 copies): its
    poller covers the file with a majority of the metadata replicas' streams. One metadata
    replica is SIGKILLed and restarted, or stopped (SIGSTOP) and resumed, while the reader
    follows: the two live streams still make the majority, so the reader gets every message
    in order, reads nothing from the store, and is pushed lengths by the third replica again
    once it is back. (The three-replica readers elsewhere here get their lengths from the
    pushed bytes, so their metadata faults touch no stream of theirs.)"""
    with LocalDeployment(tmp_path / "watched", data_replicas=4, metadata_replicas=3, capacity="32MiB") as d:
        eps = {"data_cache": d.data_endpoints, "metadata_cache": d.metadata_endpoints}
        root = str(tmp_path / "store")
        with following_through_a_fault(root, "watched", eps) as (c, col):
            assert c.path.feed is None
            poller = c.path.poller
            col.until(lambda: len(col.values) >= 300, 30, "first messages")
            uri = c.store.uri(c._tailers[0].rel)
            col.until(lambda: poller._covered(uri), 20, "the file's lengths pushed by a majority")
            endpoint = d.endpoints("metadata")[0]
            col.until(lambda: endpoint in poller._streams, 20, "a stream to the replica")
            stream = poller._streams[endpoint]
            pid = d.server("metadata", 0).pid
            if how == "kill":
                d.kill("metadata", 0, signal.SIGKILL)
            else:
                stop_process(pid)
            seen = len(col.values)
            try:
                if how == "kill":
                    wait_until(lambda: not stream.live.is_set(), 20, "the stream to notice the death")
                col.until(lambda: len(col.values) >= seen + 800, 30, "messages with a replica down")
            finally:
                if how == "kill":
                    d.restart("metadata", 0)
                else:
                    os.kill(pid, signal.SIGCONT)
            # Back: the third replica's stream confirms the file's keys again and pushes. The
            # reader keeps reading meanwhile: a poller nobody asks for FORGET_AFTER_S (5 s; a
            # restart on a loaded machine takes about that) drops its files and closes its
            # streams, so the stream is looked up afresh.
            def back():
                now = poller._streams.get(endpoint)
                return now is not None and all(now.confirmed(k) for k in length_keys(c.store.uri(c._tailers[0].rel)))

            col.until(back, 60, "the replica's stream to come back")
            pushed = poller.pushed
            seen = len(col.values)
            col.until(lambda: len(col.values) >= seen + 800, 30, "messages after the return")
            col.until(lambda: poller.pushed > pushed, 20, "lengths pushed after the return")


def test_a_follow_request_with_files_and_offsets_that_disagree_is_refused_naming_both(dep):
    """Follow takes the whole subscription in its one request: files and offsets must pair up,
    or the replica ends the stream INVALID_ARGUMENT saying how many of each it got (the reader
    sees it as a broken stream and reconnects with back-off; nothing is pushed)."""
    import grpc

    from pyspark_acs.cache.proto import acs_pb2

    client = CacheClient(dep.data_endpoints, name="data cache")  # its channel and token, as a reader's
    try:
        stub = client._stub(client._replicas[client.endpoints[0]])
        fid = file_id(f"file:///mismatch/{time.time_ns()}.acs")
        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.Follow(acs_pb2.FollowRequest(follow=[fid, fid], offsets=[0]), metadata=client._metadata,
                                 timeout=10):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2 files but 1 offsets" in info.value.details()
    finally:
        client.close()


def _read_all(view, rel: str, start: int, end: int) -> bytes:
    """``view``'s bytes ``[start, end)`` of ``rel``: a read may stop short while the feed is about to push."""
    got = b""
    deadline = time.monotonic() + 20
    while len(got) < end - start:
        assert time.monotonic() < deadline, f"{view.reader} read {len(got)} of {end - start} bytes"
        got += view.read(rel, start + len(got), end)
    return got


@contextlib.contextmanager
def _shared_path_on(dep, root: str, stream: str, values=(msg(0),)):
    """A Producer that wrote ``values`` to one shard of ``stream``, and one pushed read path
    shared by several readers (as the copy daemon's operations share theirs): yields
    ``(producer, path, rel of the producer's file)``."""
    from pyspark_acs.format.names import shard_dir
    from pyspark_acs.read.readpath import open_read_path

    with Producer(root, stream, shards=1, **endpoints(dep)) as p:
        for v in values:
            p.send(v)
        p.flush()
        path = open_read_path(root, push=True, **endpoints(dep))
        try:
            yield p, path, f"{shard_dir(stream, 0)}/{p.current_files()[0]}"
        finally:
            path.close()


def test_readers_sharing_a_path_keep_their_own_feed_positions(dep, root):
    """Left alone last session, fixed now: the copy daemon's operations share one read path,
    and every read moved the one position the path held in the feed. Two destinations of one
    file read it at different positions; the leading one's reads made the feed drop the bytes
    the lagging one still needed, so the laggard asked the cache for every byte instead of
    being pushed them. With a position per reader (:meth:`CachedReadPath.for_reader`) the
    laggard reads them from the feed; once it leaves, the feed keeps nothing for it."""
    with _shared_path_on(dep, root, "twodest") as (p, path, rel):
        lead, lag = path.for_reader("to-B"), path.for_reader("to-C")
        first = path.lengths([rel])[rel]

        def read_all(view, start, end):
            return _read_all(view, rel, start, end)

        assert read_all(lead, 0, first) == read_all(lag, 0, first)
        uri = path.store.uri(rel)
        wait_until(lambda: path.feed.live(uri, first), 20, "the feed is live")
        at = first
        for i in range(1, 41):
            p.send(msg(i))
            p.flush()
            wait_until(lambda: path.lengths([rel])[rel] > at, 20, f"message {i}")
            now = path.lengths([rel])[rel]
            read_all(lead, at, now)  # the leading destination keeps up
            at = now
        before = path.stats()
        caught_up = lag.read(rel, first, at)  # the lagging destination's next delta
        after = path.stats()
        assert caught_up == path.store.read(rel, first, at)
        assert after["pushed_bytes"] - before["pushed_bytes"] == at - first  # from the feed
        assert after["cache_bytes"] - after["pushed_bytes"] == before["cache_bytes"] - before["pushed_bytes"]
        assert after["durable_bytes"] == before["durable_bytes"]
        lag.leave(rel)
        with path.feed._lock:
            assert set(path.feed._files[uri].readers) == {"to-B"}
        path.forget(rel)
        with path.feed._lock:
            assert uri not in path.feed._files


def test_a_consumer_connects_to_its_caches_when_created(dep, root):
    """Found profiling 64 consumer processes: a Consumer imported gRPC and connected its cache
    clients at the first length it asked for, i.e. when the first file appeared -- all 64 at
    that moment, which put them seconds behind the producer. It connects when created; a
    replica that does not answer (stopped) holds it up at most CONNECT_TIMEOUT_S once (the
    clients connect in parallel), and it reads around that replica."""
    from pyspark_acs.cache.client import CONNECT_TIMEOUT_S
    from pyspark_acs.storage.store import DurableStore

    DurableStore(root).create_stream("early", 1)
    with Consumer(root, "early", **endpoints(dep)) as c:
        path = c.path
        clients = [path.data, path.poller.meta.client, path.feed.client]
        assert all(client._connected for client in clients)
        assert c.poll() == []  # no file yet
    stopped = [dep.server("data", 2), dep.server("metadata", 2)]
    for server in stopped:
        stop_process(server.pid)
    try:
        began = time.monotonic()
        c = Consumer(root, "early", **endpoints(dep))
        took = time.monotonic() - began
        try:
            # Once, not once per client (four of them: 4 x CONNECT_TIMEOUT_S); the rest of the
            # bound is the Consumer's own set-up on a loaded machine.
            assert took < 3.5 * CONNECT_TIMEOUT_S, took
            with Producer(root, "early", shards=1, **endpoints(dep)) as p:
                col = Collector(c)
                for i in range(20):
                    p.send(msg(i))
                p.flush()
                col.until(lambda: len(col.values) == 20, 30, "every message")
                assert_exact(col.values, 20)
        finally:
            c.close()
    finally:
        for server in stopped:
            os.kill(server.pid, signal.SIGCONT)


def test_a_reader_joining_a_followed_file_far_behind_does_not_pull_the_feed_back(dep, root):
    """Review of 807cb7a: with a feed position per reader, a new reader of a file that others
    already follow (a destination added late, its copy starting at byte 0) moved the file's
    one feed cursor back to its own position: the replica pushed the whole file again, and
    until that re-push passed the tail the readers keeping up there were pushed nothing. The
    feed's rule is that a slow follower only costs itself (module docstring of
    cache/feed.py): the newcomer reads from the cache until it reaches the feed's bytes, and
    nothing already pushed is pushed again."""
    with _shared_path_on(dep, root, "latedest", [msg(i) * 200 for i in range(40)]) as (p, path, rel):
        uri = path.store.uri(rel)
        lead = path.for_reader("to-B")
        length = path.lengths([rel])[rel]

        _read_all(lead, rel, 0, length)
        wait_until(lambda: path.feed.live(uri, length), 20, "the feed is live at the tail")
        late = path.for_reader("to-C")
        before = path.feed.received
        assert _read_all(late, rel, 0, 4096) == path.store.read(rel, 0, 4096)  # a new destination's first read
        p.send(msg(40))
        p.flush()
        grown = path.store.length(rel)
        wait_until(lambda: path.feed.live(uri, grown), 20, "the new message was pushed")
        pushed = path.feed.received - before
        assert pushed < length, f"the feed received {pushed} bytes for a {grown - length}-byte append"


def test_a_reader_that_leaves_after_a_concurrent_forget_is_not_left_in_the_feed(dep, root):
    """Review of 807cb7a: the copy daemon forgets a file when its last operation unfollows
    it, while a new operation of the same file may be starting its first read on another
    thread. When the forget lands between that read recording the reader (under the path's
    lock) and following the file in the feed (outside it), the reader is in the feed but no
    longer in the path's record; its leave() then found nothing to do and the feed kept
    following the file for nobody: a push stream and a buffer of up to FEED_MAX_BYTES per
    file, for as long as the daemon runs."""
    with _shared_path_on(dep, root, "leaked") as (p, path, rel):
        uri = path.store.uri(rel)
        length = path.lengths([rel])[rel]
        real_follow = path.feed.follow

        def follow_after_a_forget(*args, **kwargs):
            path.forget(rel)  # the last other operation of the file unfollows it, on its thread
            return real_follow(*args, **kwargs)

        path.feed.follow = follow_after_a_forget
        op = path.for_reader("op-2")
        op.read(rel, 0, length)
        path.feed.follow = real_follow
        op.leave(rel)
        with path.feed._lock:
            assert uri not in path.feed._files, dict(path.feed._files[uri].readers)


def test_a_consumer_follows_a_new_file_in_the_feed_before_its_first_length(dep, root, monkeypatch):
    """A tailer that moves to a file (here the stream's first, made after the consumer
    started) has it followed in the feed at once, from its position (CachedReadPath.expect):
    the feed covers the file before its lengths are first asked for, so the poller never
    watches them (three Watch calls that went idle a moment later, about half of a consumer's
    CPU for its first message), and the first bytes and length arrive by push."""
    from pyspark_acs.cache.metadata import length_keys

    added: List[bytes] = []
    real_watch = WatchStream.watch

    def watch(self, add=(), remove=()):
        add = list(add)
        added.extend(add)
        return real_watch(self, add, remove)

    monkeypatch.setattr(WatchStream, "watch", watch)
    DurableStore(root).create_stream("first-sight", 1)
    with Consumer(root, "first-sight", **endpoints(dep)) as c, \
            Producer(root, "first-sight", shards=1, **endpoints(dep)) as p:
        col = Collector(c)
        col.pump(0.3)  # the consumer looks for a file: none yet
        p.send(msg(0))
        p.flush()
        col.until(lambda: len(col.values) == 1, 20, "the first message")
        t = c._tailers[0]
        uri = c.store.uri(t.rel)
        feed = c.path.feed
        assert feed.follows(uri)
        # On a loaded machine the first bytes may be asked for before the stream is up: the
        # rest comes by push once it is.
        wait_until(lambda: feed.live(uri, t.length), 20, "the feed is live")
        pushed = c.stats()["pushed_bytes"]
        for i in range(1, 20):
            p.send(msg(i))
            p.flush()
        col.until(lambda: len(col.values) == 20, 20, "every message")
        assert_exact(col.values, 20)
        assert not set(length_keys(uri)) & set(added), "the new file's lengths were watched"
        assert c.stats()["pushed_bytes"] > pushed
        # A reader of a shared path (the copy daemon's) expects a file as itself.
        view = c.path.for_reader("another reader")
        view.expect(t.rel, 0)
        assert "another reader" in feed._files[uri].readers
        view.leave(t.rel)
        assert "another reader" not in feed._files[uri].readers
    # Closed, the consumer refuses a seek (which would follow files in the feed for nobody),
    # and its path has left the feed.
    with pytest.raises(ClosedError, match="consumer is closed"):
        c.seek("earliest")
    assert not c.path.feed.follows(uri)
    c.path.expect(t.rel, 0)  # a closed path follows nothing
    assert not c.path.feed.follows(uri)
