"""Pre-reading: how far ahead a reader fetches from the secondary store, and what it holds read ahead."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

__all__ = [
    "PREREAD_TTL_S",
    "ReadAhead",
]

#: Smallest pre-reading window (bytes): where a reader starts, and the floor of halving.
PREREAD_MIN_BYTES = 256 * 1024
#: Largest pre-reading window (bytes): bounds the memory one reader holds per shard.
PREREAD_MAX_BYTES = 32 * 1024 * 1024
#: Read-ahead bytes not read within this many seconds are dropped (and the window halves);
#: the default of ``ReadAhead(ttl_s=)``.
PREREAD_TTL_S = 30.0
#: Read-ahead buffers a reader keeps (one per file it reads; least recently used dropped first).
PREREAD_MAX_BUFFERS = 16


class PrereadWindow:
    """How far ahead a reader fetches from the secondary store: additive increase,
    multiplicative decrease (the RocketMQ article, section 3.5.2). Not thread-safe (its owner's
    lock)."""

    def __init__(self, minimum: int = PREREAD_MIN_BYTES, maximum: int = PREREAD_MAX_BYTES) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.size = minimum

    def grow(self, step: int) -> None:
        """Read-ahead was used: widen by ``step`` (the reader's request size), up to the maximum."""
        self.size = min(self.maximum, self.size + max(step, 1))

    def shrink(self) -> None:
        """Read-ahead was dropped unread: halve, down to the minimum."""
        self.size = max(self.minimum, self.size // 2)


@dataclass
class _Buffer:
    start: int  # file position of data[0]
    data: bytes
    used: int  # file position up to which it was read
    at: float  # when it was kept (the ReadAhead's clock)

    @property
    def end(self) -> int:
        return self.start + len(self.data)


def _window_key(rel: str) -> str:
    """The window of a file's reads: its shard folder's (one window carries across files)."""
    return rel.rsplit("/", 1)[0]


class ReadAhead:
    """One reader's read-ahead from the secondary store: a buffer per file it reads (at most
    PREREAD_MAX_BUFFERS, least recently used dropped first; dropped after ``ttl_s`` idle,
    :data:`PREREAD_TTL_S` by default, on ``clock``, monotonic seconds) and a
    :class:`PrereadWindow` per shard. Thread-safe."""

    def __init__(self, ttl_s: float = PREREAD_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()  # guards _buffers, _windows and _stats
        self._buffers: "OrderedDict[str, _Buffer]" = OrderedDict()
        self._windows: Dict[str, PrereadWindow] = {}
        self._stats = {"preread_hits": 0, "preread_dropped_bytes": 0}

    def take(self, rel: str, at: int, end: int) -> Tuple[Optional[bytes], int]:
        """``(bytes, 0)``: the bytes of ``rel`` from ``at`` on (up to ``end``) held read ahead
        (read-ahead was used: the window widens); ``(None, size)``: none held at ``at``, fetch
        ``size`` bytes (what is asked for, at least the shard's window)."""
        with self._lock:
            self._expire()
            buf = self._buffers.get(rel)
            window = self._windows.setdefault(_window_key(rel), PrereadWindow())
            if buf is not None and buf.start <= at < buf.end:
                take = min(end, buf.end) - at
                buf.used = max(buf.used, at + take)
                self._buffers.move_to_end(rel)
                self._stats["preread_hits"] += 1
                window.grow(take)
                return buf.data[at - buf.start: at - buf.start + take], 0
            return None, max(end - at, window.size)

    def keep(self, rel: str, at: int, data: bytes, used: int) -> None:
        """Hold ``data``, fetched from ``rel`` at ``at`` and read up to ``used``, as the file's
        read-ahead (in place of what it held)."""
        with self._lock:
            old = self._buffers.pop(rel, None)
            if old is not None:
                self._drop(old, _window_key(rel))
            self._buffers[rel] = _Buffer(at, data, used, self.clock())
            while len(self._buffers) > PREREAD_MAX_BUFFERS:
                k, b = self._buffers.popitem(last=False)
                self._drop(b, _window_key(k))

    def window(self, shard_folder: str) -> int:
        """The current pre-reading window of a shard (by its folder) in bytes."""
        with self._lock:
            w = self._windows.get(shard_folder)
            return w.size if w is not None else PREREAD_MIN_BYTES

    def stats(self) -> Dict[str, int]:
        """``preread_hits`` (reads answered from read-ahead) and ``preread_dropped_bytes``."""
        with self._lock:
            return dict(self._stats)

    def clear(self) -> None:
        """Drop every buffer (the windows stay)."""
        with self._lock:
            self._buffers.clear()

    def _drop(self, buf: _Buffer, window_key: str) -> None:
        """A buffer leaves (under _lock): unread read-ahead halves the window."""
        unread = buf.end - buf.used
        if unread > 0:
            self._stats["preread_dropped_bytes"] += unread
            w = self._windows.get(window_key)
            if w is not None:
                w.shrink()

    def _expire(self) -> None:
        """Drop buffers idle for ``ttl_s`` (under _lock)."""
        now = self.clock()
        for k in [k for k, b in self._buffers.items() if now - b.at > self.ttl_s]:
            self._drop(self._buffers.pop(k), _window_key(k))
