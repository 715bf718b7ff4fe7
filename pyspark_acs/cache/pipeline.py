"""One long-lived bidirectional call per replica on which requests are pipelined.

The cache client's puts go this way (``CacheServicer.PutStream``). A producer puts on every
flush -- a chunk put on each data replica, a length put on each metadata replica, about a
hundred flushes a second -- and a unary call's fixed cost on the grpc.aio server is about twice
a streamed message's (the client's CPU is the same either way).

Answers are matched to requests by order: the server answers a stream's requests one by one,
in the order they came. Failure is per stream:

* a broken stream (the replica died, refused the token, or refused a request) fails every
  request still waiting on it with the stream's error;
* a request still unanswered when a later one is sent past its deadline fails its whole stream
  with the ``expired`` error (the stream is cancelled), so a stalled replica is noticed as a
  unary call's deadline would notice it and nothing piles up behind it. A writer that stops
  sending leaves its unanswered requests to its callers' own deadlines;
* the next request opens a new stream.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable, Deque, Iterator, Optional, Tuple

__all__ = [
    "PipelinedCall",
]

#: ``deliver(response, None)`` for an answer, ``deliver(None, error)`` for a failure; called on
#: the stream's reader thread (or the sender's, for a stream that could not open).
Deliver = Callable[[Any, Optional[BaseException]], None]

_END = object()  # closes a stream's request side


class _StreamEnded(Exception):
    """A stream that ended (its server finished it) while requests still waited on it."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self._code = code

    def code(self):  # read like a gRPC status by the client's _code_name()
        return _Code(self._code)


class _Code:
    def __init__(self, name: str) -> None:
        self.name = name


class _Stream:
    """One opened stream: its request queue, its call and the answers it still owes.

    ``pending`` and ``failure`` are guarded by the owning :class:`PipelinedCall`'s lock."""

    __slots__ = ("requests", "call", "pending", "failure")

    def __init__(self) -> None:
        self.requests: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.call: Any = None
        self.pending: Deque[Tuple[float, Deliver]] = collections.deque()
        self.failure: Optional[BaseException] = None  # set when ended on purpose (expired, closed)


class PipelinedCall:
    """Requests pipelined on one bidirectional stream, reopened when it breaks.

    Parameters
    ----------
    open_stream : callable
        ``open_stream(requests)`` starts the call with an iterator of serialized requests and
        returns its iterator of answers (a gRPC stream-stream multicallable with the metadata
        bound).
    name : str
        Name of the reader threads.
    expired : callable
        Returns the error for requests whose stream was ended because one of them was still
        unanswered past its deadline (the client's DEADLINE_EXCEEDED error for the replica).
    closed : callable
        Returns the error for requests sent or waiting at :meth:`close`.
    """

    def __init__(self, open_stream: Callable[[Iterator[Any]], Iterator[Any]], *, name: str,
                 expired: Callable[[], BaseException], closed: Callable[[], BaseException]) -> None:
        self._open = open_stream
        self._name = name
        self._expired = expired
        self._closed_error = closed
        # _lock guards _stream, _closed and every _Stream's pending and failure.
        self._lock = threading.Lock()
        self._stream: Optional[_Stream] = None
        self._closed = False

    @property
    def waiting(self) -> int:
        """How many requests the open stream still owes an answer (0 without one)."""
        with self._lock:
            return len(self._stream.pending) if self._stream is not None else 0

    def send(self, payload: bytes, end: float, deliver: Deliver) -> None:
        """Send ``payload``; its answer (or its stream's failure) goes to ``deliver``.

        ``end`` is the request's deadline (``time.monotonic()``): the stream is ended with the
        ``expired`` error if the request is still unanswered when a request is sent after it.
        """
        now = time.monotonic()
        stale: Optional[_Stream] = None
        opened = False
        with self._lock:
            if self._closed:
                closed = self._closed_error()
            else:
                closed = None
                stream = self._stream
                if stream is not None and stream.pending and stream.pending[0][0] < now:
                    # Its oldest request is past its deadline: the replica stalled (or is far
                    # behind). End the stream, as a unary call's deadline would end the call.
                    stale, stream = stream, None
                    stale.failure = self._expired()
                    self._stream = None
                if stream is None:
                    stream = self._stream = _Stream()
                    opened = True
                stream.pending.append((end, deliver))
                stream.requests.put(payload)
        if closed is not None:
            deliver(None, closed)
            return
        if stale is not None:
            self._end(stale)
        if opened:
            self._start(stream)

    def close(self) -> None:
        """End the stream; requests still waiting fail with the ``closed`` error."""
        with self._lock:
            self._closed = True
            stream, self._stream = self._stream, None
            if stream is not None:
                stream.failure = self._closed_error()
        if stream is not None:
            self._end(stream)

    # -- one stream --------------------------------------------------------------------------

    def _start(self, stream: _Stream) -> None:
        try:
            call = self._open(iter(stream.requests.get, _END))
        except Exception as exc:  # the channel was closed under us, or could not start a call
            self._fail(stream, exc)
            return
        with self._lock:
            stream.call = call
            ended = stream.failure is not None  # expired or closed before the call existed
        if ended:
            call.cancel()
        threading.Thread(target=self._read, args=(stream, call), name=self._name, daemon=True).start()

    def _read(self, stream: _Stream, call: Any) -> None:
        """The stream's reader thread: hands each answer to the oldest waiting request."""
        error: Optional[BaseException] = None
        try:
            for response in call:
                with self._lock:
                    item = stream.pending.popleft() if stream.pending else None
                if item is None:
                    error = _StreamEnded(f"{self._name}: the server answered a request that was never sent",
                                         "INTERNAL")
                    call.cancel()
                    break
                item[1](response, None)
        except Exception as exc:  # grpc.RpcError: the stream broke or was cancelled
            error = exc
        self._fail(stream, error)

    def _end(self, stream: _Stream) -> None:
        """End ``stream`` on purpose (its ``failure`` is set): its reader fails what waits."""
        with self._lock:
            call = stream.call
        stream.requests.put(_END)
        if call is not None:
            call.cancel()

    def _fail(self, stream: _Stream, error: Optional[BaseException]) -> None:
        """``stream`` is over: fail what still waits on it, with why it ended."""
        with self._lock:
            if self._stream is stream:
                self._stream = None
            waiting = list(stream.pending)
            stream.pending.clear()
            if stream.failure is not None:
                error = stream.failure
        stream.requests.put(_END)
        if not waiting:
            return
        if error is None:
            error = _StreamEnded(f"{self._name}: the server ended the stream with "
                                 f"{len(waiting)} requests unanswered", "UNAVAILABLE")
        for _, deliver in waiting:
            deliver(None, error)
