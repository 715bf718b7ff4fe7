"""The process-wide length poller: one batched metadata read per interval for every reader."""

from __future__ import annotations

import time

import pytest

from pyspark_acs import Consumer, Producer
from pyspark_acs.read.cachepath import CachedReadPath
from pyspark_acs.cache.poller import FORGET_AFTER_S, PUSH_SAFETY_POLL_S, LengthPoller
from pyspark_acs.server.local.deploy import LocalDeployment
from pyspark_acs.storage.store import open_store

from tests.helpers import FakeClock, wait_until


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with LocalDeployment(str(tmp_path_factory.mktemp("caches")), data_replicas=1, metadata_replicas=1) as dep:
        yield dep


def test_readers_of_one_process_share_one_poller_and_see_new_lengths(root, deployment):
    a = CachedReadPath(open_store(root), metadata_cache=deployment.metadata_endpoints)
    b = CachedReadPath(open_store(root), metadata_cache=deployment.metadata_endpoints)
    assert a.poller is b.poller is LengthPoller.shared(tuple(deployment.metadata_endpoints.split(",")))
    with Producer(root, "p", metadata_cache=deployment.metadata_endpoints) as p:
        p.send(b"one")
        p.flush()
        c1 = Consumer(root, "p", read_path=a)
        c2 = Consumer(root, "p", read_path=b)
        assert [v for x in c1.batches(timeout=0.5) for v in x.column("value").to_pylist()] == [b"one"]
        polls = a.poller.polls
        p.send(b"two")
        p.flush()
        assert [v for x in c2.batches(timeout=0.5) for v in x.column("value").to_pylist()] == [b"one", b"two"]
        assert [v for x in c1.batches(timeout=0.5) for v in x.column("value").to_pylist()] == [b"two"]
        assert a.poller.polls > polls  # the background thread did the polling
        assert c1.stats()["metadata_fallbacks"] == 0  # lengths came from the poller, not the store


def test_poller_stops_when_nothing_is_followed(deployment):
    """A file nobody asked about for forget_after_s leaves the poll; with none left the thread
    stops. On a hand-moved clock: not a moment before."""
    clock = FakeClock()
    poller = LengthPoller(tuple(deployment.metadata_endpoints.split(",")), clock=clock)
    assert poller.forget_after_s == FORGET_AFTER_S
    assert poller.lengths(["file:///nowhere.acs"]) == {"file:///nowhere.acs": (None, None)}
    rounds = poller.polls
    wait_until(lambda: poller.polls > rounds + 2, 10, "poll rounds")
    assert poller._thread is not None and "file:///nowhere.acs" in poller._asked  # not forgotten yet
    clock.advance(FORGET_AFTER_S + 0.1)
    poller.wake()
    wait_until(lambda: poller._thread is None, 10, "the poller thread to stop")
    assert "file:///nowhere.acs" not in poller._asked


def test_followed_files_wake_their_followers_and_outlive_forget(deployment):
    """The copy daemon follows its files through this poller (no second poller): a published
    length wakes the file's followers only, a followed file is polled past forget_after_s,
    a length the process published itself (notify) is seen at once, and lengths never shrink."""
    from pyspark_acs.cache.client import CacheClient
    from pyspark_acs.cache.metadata import MetadataCache

    clock = FakeClock()
    poller = LengthPoller(tuple(deployment.metadata_endpoints.split(",")), interval=0.02, forget_after_s=0.1,
                          clock=clock)
    a, b = "file:///follow/a.acs", "file:///follow/b.acs"
    wake_a, wake_b = poller.follow(a), poller.follow(b)
    with CacheClient(deployment.metadata_endpoints) as client:
        clock.advance(0.3)  # past forget_after_s: still polled because followed
        rounds = poller.polls
        poller.wake()
        wait_until(lambda: poller.polls > rounds + 1, 10, "a poll round past forget_after_s")
        assert poller._thread is not None and a in poller._asked and b in poller._asked
        MetadataCache(client).publish(a, cache_length=10, durable_length=10)
        assert wake_a.wait(5) and not wake_b.is_set()
        assert poller.lengths([a])[a] == (10, 10)
        poller.notify(b, durable_length=7)  # this process published it: no poll needed
        assert wake_b.is_set() and poller.lengths([b])[b] == (None, 7)
        MetadataCache(client).publish(a, cache_length=4)  # a lower length (a lagging writer) never lowers it
        clock.advance(2 * PUSH_SAFETY_POLL_S)  # a round after it polls a, pushed or not
        rounds = poller.polls
        poller.wake()
        wait_until(lambda: poller.polls > rounds + 1, 10, "a poll round after the lower length")
        assert poller.lengths([a])[a] == (10, 10)
    poller.unfollow(a, wake_a)
    poller.unfollow(b, wake_b)
    assert not poller.followed(a) and not poller.followed(b)


def test_token_protected_caches_need_the_token(tmp_path, caplog):
    from pyspark_acs.datasource.options import parse_sink_options, parse_source_options

    root = str(tmp_path / "store")
    with LocalDeployment(str(tmp_path / "secure"), data_replicas=1, metadata_replicas=1, token="s3cret") as dep:
        caches = {"data_cache": dep.data_endpoints, "metadata_cache": dep.metadata_endpoints}
        with Producer(root, "sec", cache_token="s3cret", **caches) as p:
            p.send(b"ok")
        assert p.stats()["cache_errors"] == 0
        c = Consumer(root, "sec", cache_token="s3cret", **caches)
        assert [v for b in c.batches(timeout=0.5) for v in b.column("value").to_pylist()] == [b"ok"]
        assert c.stats()["cache_bytes"] > 0 and c.stats()["durable_bytes"] == 0
        c.close()
        with Producer(root, "sec", cache_token="wrong", **caches) as p:  # the store still takes it
            p.send(b"still durable")
        assert p.stats()["cache_errors"] > 0
        assert any("UNAUTHENTICATED" in r.getMessage() or "token" in r.getMessage().lower() for r in caplog.records)
    opts = {"root": root, "stream": "sec", "cacheToken": "s3cret"}
    assert parse_source_options(opts).cache_token == "s3cret"
    assert parse_sink_options(dict(opts, checkpointLocation="/ck")).cache_token == "s3cret"


def test_closing_a_reader_releases_its_files(root, deployment):
    """A closed reader's files leave the shared poll at once (not FORGET_AFTER_S later), so
    the poller thread stops soon after the last reader of the process closed."""
    path = CachedReadPath(open_store(root), metadata_cache=deployment.metadata_endpoints)
    uri = path.store.uri("s/00000/x.acs")
    path.lengths(["s/00000/x.acs"])
    assert uri in path.poller._asked
    path.close()
    assert uri not in path.poller._asked


def test_safety_polls_of_pushed_files_are_spread_not_in_step(deployment):
    """A file whose lengths are pushed is still polled, every PUSH_SAFETY_POLL_S on average, at
    a period drawn afresh each time: pollers started together (a fleet of consumers) must not
    poll in step (their synchronized polls hit the metadata replicas in one burst each second
    and hold the producer's length puts up)."""
    from pyspark_acs.cache.poller import PUSH_SAFETY_JITTER, PUSH_SAFETY_POLL_S

    uri = "file:///spread/00000.acs"
    pollers = [LengthPoller(tuple(deployment.metadata_endpoints.split(","))) for _ in range(4)]
    seen = {i: [] for i in range(len(pollers))}
    for i, poller in enumerate(pollers):
        real = poller.meta.lengths

        def traced(uris, real=real, i=i):
            if uri in uris:
                seen[i].append(time.monotonic())
            return real(uris)

        poller.meta.lengths = traced
    try:
        for poller in pollers:
            poller.follow(uri)
        time.sleep(6 * PUSH_SAFETY_POLL_S)
    finally:
        for poller in pollers:
            poller.unfollow(uri)
    lo, hi = (1 - PUSH_SAFETY_JITTER) * PUSH_SAFETY_POLL_S, (1 + PUSH_SAFETY_JITTER) * PUSH_SAFETY_POLL_S
    gaps = []
    for i, times in seen.items():
        # The first polls come at once (a new file) until the watch confirms the keys; after
        # that only safety polls: keep the gaps of at least half a period.
        safety = [b - a for a, b in zip(times, times[1:]) if b - a >= lo - 0.05]
        assert len(safety) >= 2, f"poller {i} made no safety polls: {times}"
        assert all(g <= hi + 0.5 for g in safety), (i, safety)  # slack: a loaded machine
        gaps += safety
    # Drawn, not fixed: the periods differ (a fixed period gives gaps within a few ms).
    assert max(gaps) - min(gaps) > 0.1, gaps


def test_wait_for_change_wakes_every_waiter_at_once_and_only_for_a_change():
    """Readers blocked in wait_for_change wake when a length moves (each on its own wake
    queue, not a Condition on the poller's lock), all of them; a token older than the last
    change returns at once; a wait with nothing moving lasts its timeout, also right after a
    wake (no wake-up is left over for the next wait)."""
    import threading

    poller = LengthPoller(("127.0.0.1:1",), push=False)  # no server is asked: only notify() moves
    uri = "file:///x/s/00000/f.acs"
    poller._values[uri] = (None, None)  # a file some reader polls (notify() ignores others)
    try:
        token = poller.change_token()
        woke = []

        def wait() -> None:
            started = time.monotonic()
            poller.wait_for_change(10.0, since=token)
            woke.append(time.monotonic() - started)

        waiters = [threading.Thread(target=wait) for _ in range(3)]
        for t in waiters:
            t.start()
        wait_until(lambda: len(poller._waiting) == 3, 5, "three waiting readers", interval=0.01)
        poller.notify(uri, cache_length=100)
        for t in waiters:
            t.join(5)
        assert len(woke) == 3 and max(woke) < 5.0
        assert not poller._waiting

        started = time.monotonic()
        poller.wait_for_change(10.0, since=token)  # moved since the token: at once
        assert time.monotonic() - started < 1.0

        poller.notify(uri, cache_length=200)  # nobody waits: nothing is queued for later
        for _ in range(2):
            started = time.monotonic()
            poller.wait_for_change(0.2, since=poller.change_token())
            assert 0.15 <= time.monotonic() - started < 2.0
        assert not poller._waiting
    finally:
        poller._client.close()


def test_a_wake_left_over_from_a_timed_out_wait_does_not_end_the_next_one():
    """A wake-up that lands as a wait times out stays in the thread's queue; the next wait
    drains it first and lasts its timeout; an interrupted wait leaves no queue registered."""
    poller = LengthPoller(("127.0.0.1:1",), push=False)
    try:
        poller.wait_for_change(0.01)  # makes this thread's wake queue
        poller._wakes.queue.put(None)  # as _moved() would have, just after the timeout
        started = time.monotonic()
        poller.wait_for_change(0.2, since=poller.change_token())
        assert 0.15 <= time.monotonic() - started < 2.0
        assert not poller._waiting

        class Interrupted(Exception):
            pass

        real = poller._wakes.queue
        poller._wakes.queue = type("Q", (), {"empty": lambda self: True,
                                             "get": lambda self, timeout=None: (_ for _ in ()).throw(Interrupted())})()
        with pytest.raises(Interrupted):
            poller.wait_for_change(5.0)
        assert not poller._waiting
        poller._wakes.queue = real
    finally:
        poller._client.close()


def test_bytes_a_feed_pushed_before_a_files_first_lengths_are_kept():
    """A reader follows a file in the feed as soon as it moves to it, so the feed may push the
    file's first bytes while its first lengths are still being read. That read can return the
    length from before those bytes were published; the pushed length is merged into it, not
    dropped (a reader whose producer then went idle waited for the next safety poll). Files
    nobody covers are still ignored, and an uncover forgets what was kept."""
    poller = LengthPoller(("127.0.0.1:1",), push=False)  # the metadata reads are stood in for below
    uri, other = "file:///x/s/00000/f.acs", "file:///x/s/00000/g.acs"
    poller.meta.lengths = lambda uris: {u: (None, None) for u in uris}  # read before the publish
    try:
        poller.cover(uri, lambda known: True)
        poller.notify(uri, cache_length=4096, fed=True)  # pushed during the first read
        poller.notify(other, cache_length=4096, fed=True)  # not covered, not polled: ignored
        assert poller.lengths([uri, other]) == {uri: (4096, None), other: (None, None)}
        poller.notify(uri, cache_length=8192, fed=True)  # known now: the usual way
        assert poller.lengths([uri])[uri] == (8192, None)
        third = "file:///x/s/00000/h.acs"
        poller.cover(third, lambda known: True)
        poller.notify(third, cache_length=100, fed=True)
        poller.uncover(third)
        assert third not in poller._early
    finally:
        poller._client.close()


def test_a_joining_readers_published_length_is_its_first_poll():
    """A reader joining at the published length read it by a consistent read through the
    poller's client: seeded, its first lengths() and the thread's next safety poll do not read
    the same keys again (three consistent reads per joining reader became one; with many
    joining at once, the metadata replicas they all wait on got three times the reads)."""
    clock = FakeClock()
    poller = LengthPoller(("127.0.0.1:1",), clock=clock)  # the metadata reads are stood in for below
    uri = "file:///x/s/00000/f.acs"
    reads = []
    poller.meta.lengths = lambda uris: reads.append(list(uris)) or {u: (4096, 4096) for u in uris}
    poller.cover(uri, lambda known: True)  # a live feed pushes its bytes: no Watch, safety polls only
    try:
        poller.seed(uri, (2048, 1024))
        assert poller.lengths([uri]) == {uri: (2048, 1024)}
        wait_until(lambda: poller.polls >= 1, 10, "the poller thread's first round")
        assert reads == []  # neither the first lengths() nor the round read the seeded file
        clock.advance(PUSH_SAFETY_POLL_S)  # past half a safety period: the next safety poll reads it
        poller._next_full_poll = 0.0
        poller.wake()
        wait_until(lambda: reads, 10, "the safety poll")
        assert reads[-1] == [uri]
        wait_until(lambda: poller.lengths([uri])[uri] == (4096, 4096), 10, "the polled lengths")
        poller.seed(uri, (1, 1))  # lengths only grow
        assert poller.lengths([uri])[uri] == (4096, 4096)
    finally:
        poller._client.close()
