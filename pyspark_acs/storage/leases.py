"""Writer leases: one writer per shard (Producer) or per file (copy writer) at a time.

A lease is a small record ``{writer, nonce, expires, poisoned}``. The holder renews it well
before it expires and checks it on every renewal; a holder that finds the lease taken over
or poisoned must stop writing at once (:class:`~pyspark_acs.errors.LeasePoisonedError`).

:class:`StoreLease` keeps the record in a file of the durable store. ``pyarrow.fs`` has no
compare-and-set and no exclusive create, so the lease is as safe as the filesystem allows:

- local files: read, decide and write happen under an exclusive ``flock`` on a lock file
  beside the lease (:func:`exclusive`), so acquiring and renewing are compare-and-set among
  all processes of the machine (while no holder keeps the lock past
  :data:`LOCK_WAIT_SECONDS`: a stopped process must not block a take-over);
- other filesystems (HDFS): write, then read back to confirm; two writers acquiring at the
  same instant may both believe they hold it.

Safety does not rest on the lease: a writer acknowledges bytes only once they are verified
to lie before any seal of their file, and a writer that takes a shard over seals its
predecessor's file first (:mod:`pyspark_acs.write.file`), so a second holder can delay but
never reorder or hide acknowledged messages. The metadata-cache lease
(:mod:`pyspark_acs.cache.metadata`) uses the cache's compare-and-set and supports take-over by
poisoning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Callable, Iterator, Optional

from pyspark_acs.errors import LeasePoisonedError, StoreFileNotFoundError, WriterConflictError
from pyspark_acs.storage.store import DurableStore

__all__ = [
    "LeaseRecord",
    "StoreLease",
    "WRITER_LEASE_S",
    "exclusive",
    "lock_wait",
]

log = logging.getLogger(__name__)

#: The store's writer lease (a shard's writer: Producer, the sink's commits): a holder renews
#: every third of this; a dead holder's lease is free after it.
WRITER_LEASE_S = 10.0


#: How long :func:`exclusive` waits for a lock before going on without it. The holders
#: (an append, a lease read-decide-write) keep it for milliseconds; a holder that keeps it
#: longer is stopped (SIGSTOP, a frozen VM) or hung, and must not block a take-over forever.
LOCK_WAIT_SECONDS = 2.0


def lock_wait(store: DurableStore) -> float:
    """How long :func:`exclusive` waits on ``store`` by default: its ``lock_wait_s``, else
    :data:`LOCK_WAIT_SECONDS`."""
    wait = getattr(store, "lock_wait_s", None)
    return LOCK_WAIT_SECONDS if wait is None else wait


#: Polling interval bounds of a contended lock (seconds): flock has no timed wait.
_LOCK_POLL_MIN_S, _LOCK_POLL_MAX_S = 0.001, 0.05

#: Descriptors of the lock files open in :func:`exclusive` now. A flock belongs to the open
#: file, which a forked child shares: its copy kept a lock its parent's thread held at the fork
#: until the child exited (every later change of that stream failed meanwhile, review). The
#: child closes its copies at once (:func:`_close_inherited_locks`); the blocks that held them
#: do not run in it. Guarded by _held_lock.
_held: "set[int]" = set()
_held_lock = threading.Lock()


def _close_inherited_locks() -> None:
    global _held_lock
    _held_lock = threading.Lock()  # a parent's thread may have held it
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


@contextlib.contextmanager
def exclusive(store: DurableStore, rel: str, wait: Optional[float] = None, *, warn: bool = True,
              create: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on the file ``rel`` of ``store`` (created if missing, unless
    ``create`` is false: then a missing file raises :class:`StoreFileNotFoundError`) while the
    block runs: ``flock`` on local files, which every process of the machine honours. On
    other filesystems ``pyarrow.fs`` has no lock: the block runs unlocked.

    A holder that keeps the lock more than ``wait`` seconds (default: the store's
    :func:`lock_wait`) -- a stopped or hung process,
    which would otherwise block the writer taking its shard over forever -- is passed by:
    the block then runs unlocked, like on HDFS, with a warning. Yields whether the lock is
    held: the block decides whether going on unlocked is safe (an append is only when it is a
    recovery seal, see :meth:`pyspark_acs.write.file.DurableFile.append`; the holder resumes
    inside its block and finishes it). ``warn=False``: the caller reports a lock it did not
    get itself (the warning names appends and leases).
    """
    if not store.local:
        yield False
        return
    import fcntl

    wait = lock_wait(store) if wait is None else wait
    path = store.path(rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_CREAT if create else 0) | os.O_CLOEXEC, 0o644)
    except FileNotFoundError as exc:
        raise StoreFileNotFoundError(f"{store.uri(rel)}: gone from the store (moved aside or deleted); not "
                                     f"locked") from exc
    with _held_lock:
        _held.add(fd)
    try:
        deadline, pause = time.monotonic() + wait, _LOCK_POLL_MIN_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    if warn:
                        log.warning("%s: the lock is held for more than %.1f s (a stopped or hung writer?); not "
                                    "waiting longer (a recovery seal or a lease re-checked after the wait goes on "
                                    "without it, any other append is refused)", store.uri(rel), wait)
                    locked = False
                    break
                time.sleep(pause)
                pause = min(pause * 2, _LOCK_POLL_MAX_S)
        yield locked
    finally:
        with _held_lock:
            _held.discard(fd)
        os.close(fd)  # releases the lock (and the last copy of it: see _held)


#: Fields of a lease record and the JSON types each may hold.
_FIELDS = {"writer": (str,), "nonce": (str,), "expires": (int, float), "poisoned": (bool,),
           "host": (str,), "pid": (int,), "since": (int, float)}


def _shape_problem(doc: object) -> Optional[str]:
    """Why ``doc`` (parsed JSON) is not a lease record, or ``None``."""
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    for name in ("writer", "nonce", "expires"):
        if name not in doc:
            return f"no {name!r}"
    for name, types in _FIELDS.items():
        value = doc.get(name)
        if value is None and name not in ("writer", "nonce", "expires"):
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            return f"{name!r} is {type(value).__name__}"
    if not -1e18 < float(doc["expires"]) < 1e18:
        return "'expires' out of range"
    return None


class LeaseRecord(dict):
    """The lease value: a JSON object with ``writer``, ``nonce``, ``expires``, ``poisoned`` (and
    ``host``, ``pid``, and ``since``: when the writer began to acquire it; records written before
    it was added have none)."""

    @classmethod
    def new(cls, writer: str, seconds: float, since: Optional[float] = None,
            now: Optional[float] = None) -> "LeaseRecord":
        """A fresh record for ``writer``: random nonce, this host and pid, expiring ``seconds``
        after ``now`` (wall-clock seconds; default: the time now); ``since`` is when the writer
        began to acquire (default: ``now``)."""
        now = time.time() if now is None else now
        return cls(
            writer=writer,
            nonce=secrets.token_hex(8),
            expires=now + seconds,
            poisoned=False,
            host=socket.gethostname(),
            pid=os.getpid(),
            since=now if since is None else since,
        )

    @classmethod
    def decode(cls, raw: Optional[bytes], where: str = "") -> Optional["LeaseRecord"]:
        """Parse a stored record; ``None`` for no content or invalid JSON (a torn write).

        ``where`` (the lease file or key) only serves error messages.

        Raises
        ------
        WriterConflictError
            For valid JSON that is not a lease record (not an object, or ``writer``, ``nonce``,
            ``expires``, ``poisoned`` of the wrong type): someone else wrote it, so no writer
            may take it over blindly.
        """
        if not raw:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            return None  # a torn lease file is treated as no lease
        problem = _shape_problem(doc)
        if problem is not None:
            raise WriterConflictError(f"lease {where or '<record>'}: not a lease record ({problem}); "
                                      f"remove it if no writer of this package wrote it")
        return cls(doc)

    def encode(self) -> bytes:
        """The record as JSON bytes (sorted keys)."""
        return json.dumps(self, sort_keys=True).encode()

    def live(self, now: Optional[float] = None) -> bool:
        """Whether the lease is unexpired at ``now`` (wall-clock seconds since the epoch; default: now)."""
        return float(self.get("expires", 0)) > (time.time() if now is None else now)

    def same_holder(self, other: "Optional[LeaseRecord]") -> bool:
        """Whether ``other`` is this same acquisition: same writer and nonce (``None`` never is)."""
        return other is not None and other.get("writer") == self["writer"] and other.get("nonce") == self["nonce"]

    def describe(self, now: Optional[float] = None) -> str:
        """Holder (writer, pid, host) and time to expiry at ``now`` (wall-clock seconds;
        default: the time now), for error messages."""
        left = float(self.get("expires", 0)) - (time.time() if now is None else now)
        return (
            f"writer {self.get('writer')} (pid {self.get('pid')} on {self.get('host')}), "
            f"lease expires in {max(left, 0):.1f} s"
        )


class StoreLease:
    """A lease kept as a file in the durable store.

    Parameters
    ----------
    store : DurableStore
    rel : str
        The lease file, relative to the store root.
    writer : str
        Our writer id.
    what : str
        What the lease protects, for messages (e.g. ``"shard 0 of stream 'orders'"``).
    seconds : float
        Lease duration.
    clock : callable
        Wall-clock seconds since the epoch (``time.time``): records cross processes, so their
        expiry is wall time; this clock writes it and decides whether a record read has
        expired. A test passes a clock it moves past an expiry instead of sleeping. Renewal
        pacing (:meth:`due`) and the stall check stay on ``time.monotonic``: a step of the
        wall clock must not stop renewals.
    """

    def __init__(self, store: DurableStore, rel: str, writer: str, what: str, seconds: float = WRITER_LEASE_S,
                 *, clock: Callable[[], float] = time.time):
        self.store = store
        self.clock = clock
        self.rel = rel
        self.writer = writer
        self.what = what
        self.seconds = seconds
        self.record: Optional[LeaseRecord] = None
        self._renewed = 0.0
        self._lock = rel + ".lock"  # the lock file of read-decide-write (local files)

    def acquire(self, force: bool = False) -> None:
        """Take the lease; raise WriterConflictError if another live writer holds it.

        ``force`` takes it regardless (the caller already holds the authoritative
        metadata-cache lease; the old holder sees the change at its next check and stops).
        """
        with exclusive(self.store, self._lock):
            read_at = time.monotonic()  # before the read: a stop inside it counts
            current = self._read()
            now = self.clock()
            if not force and current is not None and current.live(now) and current.get("writer") != self.writer:
                raise WriterConflictError(f"{self.what} is held by {current.describe(now)}; stop that writer or wait")
            record = LeaseRecord.new(self.writer, self.seconds, now=now)
            if not force and self._changed_since(current, read_at):
                raise WriterConflictError(f"{self.what}: another writer took the lease while this one was held up "
                                          f"taking it")
            self.store.write_small(self.rel, record.encode())
            if not record.same_holder(self._read()):
                raise WriterConflictError(f"{self.what}: another writer took the lease at the same moment")
        self.record = record
        self._renewed = time.monotonic()

    def due(self) -> bool:
        """True when a third of the lease has passed since the last renewal."""
        return time.monotonic() - self._renewed >= self.seconds / 3

    def renew(self, force: bool = False) -> None:
        """Check the lease is still ours and extend it; raise LeasePoisonedError if not.

        ``force`` takes it back instead (the caller still holds the authoritative
        metadata-cache lease, like :meth:`acquire`'s ``force``): a deposed writer that was
        stopped inside its own renewal, lock held, may write its record over ours once it
        resumes; it then stops at its next cache-lease check, and we must not.
        """
        with exclusive(self.store, self._lock):
            read_at = time.monotonic()  # before the read: a stop inside it counts
            current = self._read()
            if force and self.record is not None and not self.record.same_holder(current):
                log.warning("%s: the store lease was overwritten by %s; taking it back (we hold the cache lease)",
                            self.what, current.describe(self.clock()) if current else "nobody")
                current = self.record
            if self.record is None or not self.record.same_holder(current) or current.get("poisoned"):
                holder = current.describe(self.clock()) if current else "nobody"
                raise LeasePoisonedError(f"{self.what}: our lease was taken over (now held by {holder}); stopping")
            if not force and self._changed_since(current, read_at):
                raise LeasePoisonedError(f"{self.what}: our lease was taken over while this writer was held up "
                                         f"renewing it; stopping")
            self.record = LeaseRecord(self.record, expires=self.clock() + self.seconds)
            self.store.write_small(self.rel, self.record.encode())
        self._renewed = time.monotonic()

    check = renew

    def _read(self) -> Optional[LeaseRecord]:
        """The stored record (``None``: none, or torn)."""
        return LeaseRecord.decode(self.store.read_small(self.rel), self.store.uri(self.rel))

    def _changed_since(self, current: Optional[LeaseRecord], read_at: float) -> bool:
        """Whether the record read as ``current`` (the read began at monotonic ``read_at``)
        may have been replaced: when this read-decide-write took the store's lock wait
        (:func:`lock_wait`, :data:`LOCK_WAIT_SECONDS` by default) or more (this process was
        stopped or hung inside it, lock held), another writer may have passed the lock
        (:func:`exclusive`) and taken the expired lease meanwhile; writing over its record would
        make both believe they hold it (the tier mover has no seal to fence it). Read again
        then. (A stop inside the write itself is not seen: a few system calls instead of the
        whole block.)"""
        return time.monotonic() - read_at >= lock_wait(self.store) and self._read() != current

    def release(self) -> None:
        """Give the lease up if it is still ours."""
        if self.record is None:
            return
        with exclusive(self.store, self._lock):
            if self.record.same_holder(self._read()):
                self.store.delete(self.rel)
        self.record = None
