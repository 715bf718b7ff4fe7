"""Replica health as a cache client sees it: each replica's channel, down marks and back-off."""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional

from pyspark_acs.cache.pipeline import PipelinedCall
from pyspark_acs.cache.wire import CACHE_MAX_MESSAGE_BYTES

__all__ = [
    "CHANNEL_OPTIONS",
    "Down",
    "Replica",
    "code_name",
    "deadline_error",
    "describe",
]

#: A replica that failed is skipped this long before one request probes it again ...
DOWN_BACKOFF_INITIAL_S = 1.0
#: ... doubling after each failed probe up to this.
DOWN_BACKOFF_MAX_S = 10.0

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", CACHE_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", CACHE_MAX_MESSAGE_BYTES),
    # A restarted replica must be reachable again within about a second, not after gRPC's
    # default reconnect back-off of up to two minutes. Not "grpc.min_reconnect_backoff_ms":
    # gRPC takes it as the connect timeout too, and with 100 ms every connection whose
    # HTTP/2 handshake needs longer (a 300 ms round trip, a slow TLS handshake) failed with
    # "timed out before receiving SETTINGS frame" and the replica was marked down (test:
    # test_cache_connect.py, through a relay that delays every byte).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Each channel connects on its own. gRPC otherwise shares one connection per address among
    # a process's channels with the same settings, and with it the connection's failure: a client
    # made after a replica came back on its address failed at once with the "Connection refused"
    # of an older client's back-off (tests/cache/test_cache_connect.py).
    ("grpc.use_local_subchannel_pool", 1),
    # Failover and hedging happen in the client, across replicas; gRPC retrying one replica
    # would only spend the deadline.
    ("grpc.enable_retries", 0),
    ("grpc.keepalive_time_ms", 30000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Server-streaming calls (Follow: pushed file bytes) are read on the calling thread, not
    # through the channel's spin thread: one thread wake less per pushed message
    # (pyspark_acs.cache.push).
    ("SingleThreadedUnaryStream", 1),
]

# Status codes that say "this replica is not answering" (mark it down); others (a refused
# token, a bad request) come from a live replica.
_TRANSPORT_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


def code_name(exc: BaseException) -> str:
    """The gRPC status name of a call's error (``UNAVAILABLE``, ...), else its class name."""
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return code().name
        except (AttributeError, TypeError):
            return "UNKNOWN"
    return type(exc).__name__


def describe(exc: BaseException) -> str:
    """``CODE: details`` of a call's error, on one line, for error messages."""
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    text = " ".join(str(text or "").split())
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{code_name(exc)}: {text}" if text else code_name(exc)


class Down(Exception):
    """Stands for a replica skipped because it is marked down (never raised to callers).

    ``code``: the status of the failure that marked it, so a call whose replicas all timed out
    (an overloaded or hung cache) stays a timeout when later calls skip them
    (:class:`~pyspark_acs.errors.CacheTimeoutError`), and one they refused stays unavailable.
    """

    def __init__(self, retry_in: float, code: str = "UNAVAILABLE") -> None:
        why = "a failure" if code == "UNAVAILABLE" else code
        super().__init__(f"marked down after {why}; next probe in {retry_in:.1f} s")
        self._code = _DeadlineCode if code == "DEADLINE_EXCEEDED" else _DownCode

    def code(self):  # so code_name() reports it like a gRPC status
        return self._code


class _DownCode:
    name = "UNAVAILABLE"


class _DeadlineCode:
    name = "DEADLINE_EXCEEDED"


class _NoAnswer(Exception):
    def code(self):
        return _DeadlineCode


def deadline_error(endpoint: str, deadline: float) -> BaseException:
    """Stands for a replica that gave no answer within the call's deadline."""
    return _NoAnswer(f"no answer from {endpoint} within {deadline:.3f} s")


class Replica:
    """One endpoint's connection and health state.

    Fields are guarded by ``lock``, the owning client's lock (it also guards the client's
    channel creation and close). ``deadline`` is the client's call deadline: how long a probe
    holds other calls off the replica.
    """

    __slots__ = ("endpoint", "lock", "deadline", "channel", "stub", "raw", "puts", "unary_puts",
                 "down_until", "backoff", "marked_at", "down_code")

    def __init__(self, endpoint: str, lock: threading.Lock, deadline: float) -> None:
        self.endpoint = endpoint
        self.lock = lock
        self.deadline = deadline
        self.channel = None
        self.stub = None
        self.raw: Dict[str, Any] = {}  # method -> multicallable taking serialized requests
        self.puts: Optional[PipelinedCall] = None  # the PutStream every Put to it goes on
        self.unary_puts = False  # it answered PutStream UNIMPLEMENTED (a server from before it)
        self.down_until = 0.0  # 0: up; else monotonic time before which it is skipped
        self.backoff = DOWN_BACKOFF_INITIAL_S
        self.marked_at = 0.0  # monotonic time it was last marked down
        self.down_code = "UNAVAILABLE"  # the status of the failure that last marked it down

    def usable(self, now: float) -> bool:
        """Whether to send to it now; lets one probe through once a down replica's back-off ends."""
        with self.lock:
            if self.down_until == 0.0:
                return True
            if now >= self.down_until:
                # This caller probes; others keep skipping it until the probe's deadline passes.
                self.down_until = now + self.deadline
                return True
            return False

    def down(self, now: float) -> Down:
        """What a call skipping it records for it (:class:`Down`, with the failure's status)."""
        return Down(self.retry_in(now), self.down_code)

    def retry_in(self, now: float) -> float:
        """Seconds until its next probe (0 when it is up)."""
        with self.lock:
            return max(0.0, self.down_until - now)

    def mark(self, exc: Optional[BaseException], sent: Optional[float] = None) -> None:
        """Record the outcome of a call to it sent at ``sent`` (runs in gRPC callback threads too).

        A transport failure marks the replica down for its back-off. The back-off doubles only
        when a call sent while the replica was already down fails (a failed probe): calls that
        were in flight when the first failure marked it down say nothing new. Counting each of
        them doubled it to the 10 s maximum after a stall of one deadline (a writer putting every
        10 ms has ~30 puts in flight), leaving a recovered replica out of every call that long.
        Nor does such a call mark the replica down again when it fails after the replica
        recovered (a straggler of the old failure): a new failure shows in the calls sent since.
        """
        with self.lock:
            if exc is None:
                self.down_until = 0.0
                self.backoff = DOWN_BACKOFF_INITIAL_S
            elif code_name(exc) in _TRANSPORT_CODES:
                was_down = self.down_until != 0.0
                if sent is not None and sent < self.marked_at:
                    return  # in flight before the mark: the same failure, already counted
                now = time.monotonic()
                self.down_until = now + self.backoff
                self.marked_at = now
                self.down_code = code_name(exc)
                if was_down:  # a failed probe: wait longer next time
                    self.backoff = min(self.backoff * 2.0, DOWN_BACKOFF_MAX_S)
