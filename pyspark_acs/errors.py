"""The exception hierarchy of pyspark_acs.

Every error the package raises on purpose derives from :class:`AcsError`. Where a
builtin exception has the same meaning, the class derives from it too, so callers
that already catch ``ValueError``, ``OSError``, ``ConnectionError`` or
``TimeoutError`` keep working::

    AcsError
    ├── AcsOptionError (ValueError)          bad option / flag value; names it and what is allowed
    │   └── RootNotFoundError                a reader's or status command's root does not exist; names it
    ├── InvalidNameError (ValueError)        unsafe stream, shard or file name
    ├── CorruptFileError (OSError)           bad bytes in a message file; names file and byte position
    │   ├── ChecksumMismatchError            body checksum does not match the header
    │   └── TruncatedBlockError              a block runs past the end of a finished file
    ├── StoreError (OSError)                 the durable store failed (pyarrow.fs errors land here)
    │   ├── StoreFileNotFoundError (FileNotFoundError)
    │   └── TierUploadError                  an upload to the secondary store failed (landed or not)
    ├── CacheError (ConnectionError)         a cache server call failed; names the endpoint
    │   ├── CacheUnavailableError            no (or too few) replicas answered; names them
    │   ├── CacheTimeoutError (TimeoutError) a replica missed the deadline
    │   └── DeploymentError                  a local cache server did not start or stop; holds its log tail
    ├── LeaseError                           one-writer-per-file violations
    │   └── WriterConflictError              another live writer holds the file or shard
    │       ├── AppendConflictError          an append landed after foreign bytes (a successor's seal)
    │       │   └── AppendLockBusyError      the file's append lock stayed held: nothing appended
    │       ├── LaterFileError               a file created under a given name was sealed unused
    │       ├── LeasePoisonedError           our lease was poisoned by a newer writer: stop
    │       └── StaleEpochError              a copy from before the stream's promotion: refused
    ├── DataLossError                        bytes a reader needed are gone; says which
    ├── AcsTimeoutError (TimeoutError)       flush/close did not finish in the time given
    ├── TopologyError (ValueError)           bad copy-daemon topology file
    ├── ClosedError (RuntimeError)           use of a closed Producer, Consumer or client
    └── ForkError (RuntimeError)             gRPC or a Producer used in a child forked from the process that opened them

gRPC and pyarrow errors are translated where they enter the package (``raise ... from exc``)
so a traceback always shows both the pyspark_acs meaning and the original cause.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "AcsError",
    "AcsOptionError",
    "AcsTimeoutError",
    "AppendConflictError",
    "AppendLockBusyError",
    "CacheError",
    "CacheTimeoutError",
    "CacheUnavailableError",
    "ChecksumMismatchError",
    "ClosedError",
    "CorruptFileError",
    "DataLossError",
    "DeploymentError",
    "ForkError",
    "InvalidNameError",
    "LaterFileError",
    "LeaseError",
    "LeasePoisonedError",
    "RootNotFoundError",
    "StaleEpochError",
    "StoreError",
    "StoreFileNotFoundError",
    "TierUploadError",
    "TopologyError",
    "TruncatedBlockError",
    "WriterConflictError",
]


class AcsError(Exception):
    """Root of every error raised by pyspark_acs."""


class AcsOptionError(AcsError, ValueError):
    """An option, flag or argument has an unknown name or a bad value.

    The message names the option and says what is allowed.
    """

    def __init__(self, message: str, *, option: Optional[str] = None) -> None:
        super().__init__(message)
        self.option = option


class RootNotFoundError(AcsOptionError):
    """The durable store root a reader or a status command was given does not exist.

    Readers never create a root (only writers do: a Producer, the sink, the copy daemon), so
    a typo in ``root`` is this error naming the root rather than an empty store whose streams
    are all missing. The message names the root and how to fix it.

    Attributes
    ----------
    root : str
        The root as given.
    path : str
        The folder that does not exist (the root resolved: an absolute path or the URI's path).
    """

    def __init__(self, message: str, *, root: str, path: str) -> None:
        super().__init__(message, option="root")
        self.root = root
        self.path = path


class InvalidNameError(AcsError, ValueError):
    """A stream, shard or file name is unsafe or malformed."""


class CorruptFileError(AcsError, OSError):
    """A message file holds bytes that are not a valid block.

    Attributes
    ----------
    path : str
        The file.
    position : int
        Byte position in the file where the bad block starts.
    """

    def __init__(self, message: str, *, path: str = "", position: int = -1) -> None:
        super().__init__(message)
        self.path = path
        self.position = position

    def __str__(self) -> str:  # OSError's __str__ would show errno formatting
        return str(self.args[0]) if self.args else ""


class ChecksumMismatchError(CorruptFileError):
    """The checksum stored in a block header does not match its body."""


class TruncatedBlockError(CorruptFileError):
    """A block claims more bytes than the finished file holds."""


class StoreError(AcsError, OSError):
    """The durable store (a ``pyarrow.fs`` filesystem) failed."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StoreFileNotFoundError(StoreError, FileNotFoundError):
    """A file or folder the caller named does not exist in the durable store."""


class TierUploadError(StoreError):
    """An upload to the secondary store failed; whether bytes landed is unknown (ambiguous).

    The mover never retries over the same object (the RocketMQ tiered-storage article's
    non-stop-write rule): it uploads to a new object name, and the abandoned one is swept once
    no record names it.
    """


class CacheError(AcsError, ConnectionError):
    """A call to a cache server failed.

    Attributes
    ----------
    endpoints : tuple of str
        The ``host:port`` endpoints involved.
    """

    def __init__(self, message: str, *, endpoints: tuple = ()) -> None:
        super().__init__(message)
        self.endpoints = tuple(endpoints)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CacheUnavailableError(CacheError):
    """Too few cache replicas answered for the call to succeed."""


class CacheTimeoutError(CacheUnavailableError, TimeoutError):
    """A cache replica did not answer within the call's deadline."""


class DeploymentError(CacheError):
    """A cache server of a local deployment failed to start or to stop; the message holds its log tail."""


class LeaseError(AcsError):
    """Base of the one-writer-per-file errors."""


class WriterConflictError(LeaseError):
    """Another live writer holds the lease of the file or shard."""


class AppendConflictError(WriterConflictError):
    """An append landed after foreign bytes (typically another writer's recovery seal), or
    the file no longer ends where this writer expected it: the bytes are not acknowledged.

    Attributes
    ----------
    path : str
        The file's URI.
    start, end : int
        The byte range this writer meant to write (and does not acknowledge).
    actual_length : int
        The file's length when the conflict was found.
    seal_at : int or None
        Position of the foreign seal that ends the file before ``start``, if one was found.
    """

    def __init__(self, message: str, *, path: str, start: int, end: int, actual_length: int,
                 seal_at: Optional[int] = None) -> None:
        super().__init__(message)
        self.path = path
        self.start = start
        self.end = end
        self.actual_length = actual_length
        self.seal_at = seal_at


class AppendLockBusyError(AppendConflictError):
    """The file's append lock was held longer than
    :data:`~pyspark_acs.storage.leases.LOCK_WAIT_SECONDS` (its holder is stopped or hung inside
    an append): nothing was appended. Only a recovery seal goes on without the lock."""


class LaterFileError(WriterConflictError):
    """A file this writer just created under a name it was given (not chosen) was sealed
    unused: another writer's file sorts after it, so it would not be where the shard ends.
    The lease may still be this writer's (the other file a deposed writer's): the caller can
    go on in a new file (the sink redirects its batch)."""


class LeasePoisonedError(WriterConflictError):
    """A newer writer poisoned our lease: this writer must stop at once.

    A :class:`WriterConflictError`: however a deposed writer finds out (its lease check, or
    the seal fence at its next append), ``except WriterConflictError`` catches it.
    """


class StaleEpochError(WriterConflictError):
    """A copy of a stream from before its promotion (``acs promote``), or into a cluster that
    holds bytes past the promotion's cut: refused, so two histories never mix.

    The stream's ``_stream.json`` counts its promotions (``epoch``); every copy names the epoch
    of the cluster it comes from. A copy from an older epoch comes from a daemon that runs a
    topology from before the promotion (a cluster that was lost and came back), and the message
    names both epochs and the stream's source since.
    """


class DataLossError(AcsError):
    """Bytes a reader needed are gone (retention, deletion or truncation).

    Attributes
    ----------
    stream, shard, file : str, int, str
        Where the loss is.
    start, end : int
        The lost byte range ``[start, end)`` in ``file`` (``end`` is -1 when unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        stream: str = "",
        shard: int = -1,
        file: str = "",
        start: int = -1,
        end: int = -1,
    ) -> None:
        super().__init__(message)
        self.stream = stream
        self.shard = shard
        self.file = file
        self.start = start
        self.end = end


class AcsTimeoutError(AcsError, TimeoutError):
    """An operation with a caller-given timeout (flush, close) did not finish in time."""


class TopologyError(AcsError, ValueError):
    """A copy-daemon topology file is malformed or inconsistent."""


class ClosedError(AcsError, RuntimeError):
    """A Producer, Consumer or client was used after ``close()``."""


class ForkError(AcsError, RuntimeError):
    """A process forked (``os.fork``, ``multiprocessing``'s default start method on Linux) from
    one that had gRPC channels open used gRPC, or used a Producer made before the fork: the
    child inherits gRPC's core state (it hangs or aborts) but not the Producer's writer thread
    (its messages would never be written). The message names both processes and the remedy.

    Attributes
    ----------
    parent_pid : int
        The process that opened the channels or made the Producer.
    """

    def __init__(self, message: str, *, parent_pid: int) -> None:
        super().__init__(message)
        self.parent_pid = parent_pid
