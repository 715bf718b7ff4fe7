"""The Producer's batching rule on a clock moved by hand (as kafka-python tests its accumulator's
linger): an idle writer writes at once; a busy one's next block goes when it is full, when its
delay passed on the clock, or at a flush -- never before. The rule is tested on its own
(:class:`Batching`) and through a real Producer's writer thread, whose first write is held
while the clock moves (its latency on that clock) and a second message arrives (it is busy)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Tuple

import pytest

from pyspark_acs import Producer
from pyspark_acs.write.batching import Batching

from tests.helpers import FakeClock, wait_until

WAIT_S = 20.0
#: How long the held first write takes on the clock: the writer's latency average is then a
#: fifth of it (the average's weight), and its delay just under that (blocks are small).
LATENCY_S = 10.0
BLOCK_BYTES = 1024


# -- the rule -------------------------------------------------------------------------------------


def test_the_delay_follows_latency_and_shrinks_as_blocks_fill():
    rule = Batching(BLOCK_BYTES, 60.0, FakeClock())
    assert rule.delay() == 0.0  # nothing measured: no wait
    rule.record(LATENCY_S, 0)
    assert rule.delay() == pytest.approx(LATENCY_S / 5)
    rule.record(LATENCY_S, BLOCK_BYTES * 5)  # full blocks: waiting would not make them larger
    assert rule.delay() == 0.0
    capped = Batching(BLOCK_BYTES, 0.005, FakeClock())
    capped.record(LATENCY_S, 0)
    assert capped.delay() == 0.005


def test_a_block_waits_out_its_delay_on_the_clock():
    clock = FakeClock()
    rule = Batching(BLOCK_BYTES, 60.0, clock)
    rule.record(LATENCY_S, 0)
    deadline = rule.deadline()
    assert rule.left(deadline, 10, flushing=False) == pytest.approx(2.0)
    clock.advance(1.5)
    assert rule.left(deadline, 10, flushing=False) == pytest.approx(0.5)
    clock.advance(0.5)
    assert rule.left(deadline, 10, flushing=False) == 0.0


def test_a_full_block_or_a_flush_goes_at_once():
    rule = Batching(BLOCK_BYTES, 60.0, FakeClock())
    rule.record(LATENCY_S, 0)
    deadline = rule.deadline()
    assert rule.left(deadline, 10, flushing=False) > 0
    assert rule.left(deadline, BLOCK_BYTES, flushing=False) == 0.0
    assert rule.left(deadline, 10, flushing=True) == 0.0


# -- through the Producer's writer thread ---------------------------------------------------------


def hold_first_write(p: Producer) -> Tuple[threading.Event, threading.Event]:
    """Hold the writer's first block write: ``entered`` is set when it starts, and it goes on
    once ``release`` is set (its latency is whatever the clock moved meanwhile)."""
    writer = p._shards[0].writer
    original = writer.append
    entered, release = threading.Event(), threading.Event()

    def held_append(block, count, **kwargs):
        if not entered.is_set():
            entered.set()
            release.wait(WAIT_S)
        return original(block, count, **kwargs)

    writer.append = held_append
    return entered, release


@contextlib.contextmanager
def busy_producer(root: str) -> Iterator[Tuple[Producer, FakeClock]]:
    """A Producer on a FakeClock whose writer waits for its second block to fill: the first
    block's write took LATENCY_S on the clock, and the second message arrived during it.
    Closed (with a timeout) on exit."""
    clock = FakeClock()
    p = Producer(root, "b", 1, clock=clock, max_batch_delay=60.0, max_block_bytes=BLOCK_BYTES)
    entered, release = hold_first_write(p)
    p.send(b"first")
    assert entered.wait(WAIT_S)
    clock.advance(LATENCY_S)
    p.send(b"second")
    release.set()
    wait_until(lambda: p._linger_checks > 0, WAIT_S, "the busy writer to wait for its block to fill")
    assert p.stats()["blocks"] == 1
    try:
        yield p, clock
    finally:
        p.close(timeout=WAIT_S)


def test_an_idle_writer_writes_at_once(root):
    clock = FakeClock()
    with Producer(root, "b", 1, clock=clock, max_batch_delay=60.0, max_block_bytes=BLOCK_BYTES) as p:
        p.send(b"only")
        wait_until(lambda: p.stats()["acknowledged"] == 1, WAIT_S, "the message to be written")
        assert p._linger_checks == 0


def test_a_waiting_block_goes_once_the_clock_passes_its_delay_and_not_before(root):
    with busy_producer(root) as (p, clock):
        delay = p._batching.delay()
        assert LATENCY_S / 5 * 0.9 < delay < LATENCY_S / 5
        checks = p._linger_checks
        clock.advance(delay / 2)
        p.wake()
        wait_until(lambda: p._linger_checks > checks, WAIT_S, "the writer to look at the clock again")
        assert p.stats()["blocks"] == 1  # short of its delay: it waits on
        clock.advance(delay)
        p.wake()
        wait_until(lambda: p.stats()["acknowledged"] == 2, WAIT_S, "the second block")
        assert p.stats()["blocks"] == 2


def test_a_waiting_block_that_fills_goes_at_once(root):
    with busy_producer(root) as (p, clock):
        p.send(b"x" * BLOCK_BYTES)  # the clock stands still: only the full block ends the wait
        wait_until(lambda: p.stats()["acknowledged"] == 3, WAIT_S, "the full block")


def test_flush_sends_a_waiting_block_without_waiting(root):
    with busy_producer(root) as (p, clock):
        p.flush(timeout=WAIT_S)  # the clock stands still: without the flush it would wait for good
        assert p.stats()["acknowledged"] == 2


def test_the_delay_counts_from_when_the_oldest_message_was_queued():
    clock = FakeClock()
    rule = Batching(BLOCK_BYTES, 60.0, clock)
    rule.record(LATENCY_S, 0)
    queued = clock()
    clock.advance(1.5)  # the message waited for the round in progress
    assert rule.left(rule.deadline(queued), 10, flushing=False) == pytest.approx(0.5)
    clock.advance(0.5)
    assert rule.left(rule.deadline(queued), 10, flushing=False) == 0.0


def test_a_message_queued_during_a_long_round_goes_right_after_it(root):
    """As Kafka's linger.ms counts from a batch's first record: a message that waited out the
    delay behind the round in progress is not made to wait the delay again after it."""
    clock = FakeClock()
    with Producer(root, "b", 1, clock=clock, max_batch_delay=60.0, max_block_bytes=BLOCK_BYTES) as p:
        entered, release = hold_first_write(p)
        p.send(b"first")
        assert entered.wait(WAIT_S)
        p.send(b"second")  # queued at the round's start: it waits LATENCY_S behind it
        clock.advance(LATENCY_S)
        release.set()
        # The clock stands still from here: the delay (about LATENCY_S / 5) has passed.
        wait_until(lambda: p.stats()["acknowledged"] == 2, WAIT_S, "the second block, without waiting again")
        assert p._batching.delay() > 0 and p.stats()["blocks"] == 2
