"""When a Producer's writer thread writes what is pending: adaptive batching (Pravega).

An idle writer writes at once. A busy one -- its last round wrote, and messages arrived
meanwhile -- waits before the next block so that small messages under load share blocks:
the block goes when it is full (``max_block_bytes`` pending), when the delay
``recent write latency x (1 - average block size / max block size)`` (capped at
``max_delay``) has passed since its oldest message was queued, at a flush, or at close,
whichever comes first.

:class:`Batching` holds the averages and decides on one clock; the Producer's writer thread
waits on its condition for what :meth:`Batching.left` says, and is woken by what ends a wait
early (a send that fills the block, a flush, close, :meth:`Producer.wake`).
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = [
    "Batching",
]

#: Weight of the newest sample in the write-latency and block-size moving averages.
_EWMA_ALPHA = 0.2


class Batching:
    """The batching rule of one writer thread: moving averages of write latency and block size,
    and whether the next block goes now.

    Parameters
    ----------
    max_block_bytes : int
        Largest block body: this many pending bytes make a full block, which never waits.
    max_delay : float
        Cap of the delay in seconds.
    clock : callable
        Monotonic seconds (``time.monotonic``): the clock write latencies are measured and
        delays decided on.

    Not thread-safe: the Producer calls it under its lock (:meth:`record` from the writer
    thread alone).
    """

    def __init__(self, max_block_bytes: int, max_delay: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_block_bytes = max_block_bytes
        self.max_delay = max_delay
        self.clock = clock
        self.latency = 0.0  # moving average of a block's write, seconds
        self.block_bytes = 0.0  # moving average of a block's size

    def record(self, latency: float, block_bytes: int) -> None:
        """One block of ``block_bytes`` took ``latency`` seconds (on :attr:`clock`) to write."""
        self.latency += _EWMA_ALPHA * (latency - self.latency)
        self.block_bytes += _EWMA_ALPHA * (block_bytes - self.block_bytes)

    def delay(self) -> float:
        """How long a busy writer waits for more messages: shorter as blocks fill, none when
        they are full (waiting would not make them larger)."""
        fill = min(self.block_bytes / self.max_block_bytes, 1.0)
        return min(self.latency * (1.0 - fill), self.max_delay)

    def deadline(self, since: "float | None" = None) -> float:
        """When the wait for the next block ends (on :attr:`clock`): :meth:`delay` after
        ``since``, when its oldest message was queued (now if None). Counted from the message,
        as Kafka's ``linger.ms`` is from a batch's first record: messages queued while the last
        round wrote have waited already, and a default ``send()`` waited for the round and then
        the whole delay again, twice a flushing producer's wait."""
        return (self.clock() if since is None else since) + self.delay()

    def left(self, deadline: float, pending_bytes: int, flushing: bool) -> float:
        """Seconds a busy writer still waits before writing ``pending_bytes`` in a wait that ends
        at ``deadline``: 0 when the block goes now (full, a flush waits, or the deadline passed)."""
        if flushing or pending_bytes >= self.max_block_bytes:
            return 0.0
        return max(0.0, deadline - self.clock())
