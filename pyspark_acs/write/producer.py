"""The Producer: appends messages to the chronological message files of a stream's shards.

This is the paper's "File interface" on the write side. Messages are buffered per shard and
written as blocks by one background writer thread through one
:class:`~pyspark_acs.write.shard.ShardWriter` per shard (lease, recovery of a predecessor's
file, durable append verified against seals, chunks to the data cache, lengths to the
metadata cache, roll-over, seals).

Batching is adaptive (Pravega): when the writer is idle a block is written at once; while
it is busy, the next block waits ``recent write latency x (1 - average block size / max
block size)`` (capped) so that small messages under load share blocks, or less when the block
fills or a flush waits (:mod:`pyspark_acs.write.batching`).
"""

from __future__ import annotations

import bisect
import datetime as _dt
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from pyspark_acs import _fork
from pyspark_acs.cache.endpoints import DATA_CACHE_ENV, METADATA_CACHE_ENV, cache_endpoints
from pyspark_acs.errors import AcsOptionError, AcsTimeoutError, ClosedError, LeaseError
from pyspark_acs.format.block import DEFAULT_MAX_BLOCK_BYTES, encode_block
from pyspark_acs.format.names import MAX_SHARDS, new_writer_id, validate_shard, validate_stream
from pyspark_acs.options import bytes_parser, duration_parser, option, parse_int, parse_options
from pyspark_acs.storage.leases import WRITER_LEASE_S
from pyspark_acs.storage.store import DurableStore, open_store
from pyspark_acs.errors import AppendConflictError
from pyspark_acs.write.batching import Batching
from pyspark_acs.write.confirm import CLUSTERS_PREFIX, ConfirmWatch, clusters_needed, wait_confirmed
from pyspark_acs.write.shard import DEFAULT_ROLL_BYTES, DEFAULT_ROLL_SECONDS, ShardWriter, shard_for_key

__all__ = [
    "ACKNOWLEDGE_MODES",
    "DEFAULT_ACKNOWLEDGE",
    "Producer",
    "ProducerOptions",
]

log = logging.getLogger(__name__)

#: Cap on the adaptive batching delay: latency matters more than block fill.
DEFAULT_MAX_BATCH_DELAY_S = 0.005
#: When a message counts as acknowledged (``flush()`` returns): ``"published"`` once it is
#: durable, verified and its file's lengths are published to the caches; ``"durable"`` once it
#: is durable and verified, its cache writes following on the file's shadow thread (the paper's
#: producer: "writes ... to the underlying Colossus file and then asynchronously shadows"). See
#: :class:`Producer`.
ACKNOWLEDGE_PUBLISHED = "published"
ACKNOWLEDGE_DURABLE = "durable"
ACKNOWLEDGE_MODES = (ACKNOWLEDGE_PUBLISHED, ACKNOWLEDGE_DURABLE)
DEFAULT_ACKNOWLEDGE = ACKNOWLEDGE_PUBLISHED
#: How long close() without a timeout waits for other clusters' confirmations
#: (acknowledge="clusters:K"), after the files are sealed (seconds).
CLOSE_CONFIRM_S = 60.0
#: A shard keeps at most this many block marks for clusters:K before it merges them per file
#: (a writer that sends without flushing; a merged mark waits for its file's longest length).
MAX_MARKS = 10_000
#: send() blocks while this many bytes wait to be written (back-pressure).
DEFAULT_MAX_PENDING_BYTES = 64 * 1024 * 1024


#: Bytes a message is accounted for beyond its key, value and headers (its offsets and
#: timestamp in a block): the one rule of pending bytes and of the writer's block cut.
_MESSAGE_OVERHEAD_BYTES = 16
#: Messages the writer first looks at to cut a block (doubled until the block's end is in it).
_CUT_WINDOW = 1024
#: Value types :meth:`Producer.send_many` queues as they are.
_PLAIN = frozenset((bytes, type(None)))


def _as_bytes(value: Any, what: str) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be bytes, str or None, not {type(value).__name__}")


def _as_headers(headers: Any) -> Optional[List[Tuple[str, Optional[bytes]]]]:
    """Message headers as ``[(str key, bytes or None value)]`` (None: no headers), checked now
    so a bad header fails ``send`` rather than the writer thread."""
    if headers is None:
        return None
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    out = []
    try:
        for key, value in pairs:
            if not isinstance(key, str):
                raise TypeError(f"header key {key!r} is not a str")
            key.encode("utf-8")  # keys are stored as UTF-8: refuse now, not in the writer thread
            out.append((key, _as_bytes(value, f"header {key!r} value")))
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        raise TypeError(f"headers must be (str key, bytes value) pairs or a mapping: {exc}") from None
    return out


def _headers_size(headers: Optional[List[Tuple[str, Optional[bytes]]]]) -> int:
    """Bytes ``headers`` add to a block (keys, values and 8 bytes of offsets per pair)."""
    if not headers:
        return 0
    return sum(len(k) + (len(v) if v else 0) + 8 for k, v in headers)


def _message_bytes(value: Optional[bytes], key: Optional[bytes],
                   headers: Optional[List[Tuple[str, Optional[bytes]]]]) -> int:
    """The bytes one message is accounted for (pending bytes, the writer's block cut): its
    value, key and headers and :data:`_MESSAGE_OVERHEAD_BYTES`. The list-at-a-time paths of
    :meth:`Producer.send_many` and :meth:`Producer._take_block` add up the same terms."""
    return (len(value) if value else 0) + (len(key) if key else 0) + _headers_size(headers) + _MESSAGE_OVERHEAD_BYTES


def _timestamp_us(timestamp: Any) -> int:
    if timestamp is None:
        return time.time_ns() // 1000
    if isinstance(timestamp, _dt.datetime):
        if timestamp.tzinfo is None:
            timestamp = timestamp.replace(tzinfo=_dt.timezone.utc)
        return int(timestamp.timestamp() * 1_000_000)
    if isinstance(timestamp, (int, float)) and not isinstance(timestamp, bool):
        return int(timestamp)
    raise TypeError("timestamp must be a datetime or microseconds since the epoch")


def _acknowledge(value: Any, name: str) -> str:
    if isinstance(value, str) and value.startswith(CLUSTERS_PREFIX):
        clusters_needed(value, name)
        return value
    if value not in ACKNOWLEDGE_MODES:
        raise AcsOptionError(
            f"{name}: {value!r} is not allowed; use one of {', '.join(map(repr, ACKNOWLEDGE_MODES))} or "
            f"'clusters:K' (durable in K clusters: the source and K-1 destinations)", option=name
        )
    return value


@dataclass(frozen=True)
class ProducerOptions:
    """Validated Producer settings (see :class:`Producer` for their meaning), declared with
    :func:`~pyspark_acs.options.option` and built by :func:`~pyspark_acs.options.parse_options`
    (:meth:`from_values`); ``acs produce``'s flags are generated from the same declarations."""

    shards: int = option("shards", 1, parse=parse_int(1, MAX_SHARDS), metavar="N",
                         doc="shards of the stream; an existing stream must have this many")
    max_block_bytes: int = option("max_block_bytes", DEFAULT_MAX_BLOCK_BYTES, parse=bytes_parser(1024),
                                  doc="largest block body")
    roll_bytes: int = option("roll_bytes", DEFAULT_ROLL_BYTES, parse=bytes_parser(1),
                             doc="a new file starts at this size")
    roll_seconds: float = option("roll_seconds", DEFAULT_ROLL_SECONDS, parse=duration_parser(0.001),
                                 doc="a new file starts at this age")
    max_batch_delay: float = option("max_batch_delay", DEFAULT_MAX_BATCH_DELAY_S, parse=duration_parser(0.0),
                                    doc="cap of the adaptive batching delay")
    max_pending_bytes: int = option("max_pending_bytes", DEFAULT_MAX_PENDING_BYTES, parse=bytes_parser(1),
                                    doc="send() blocks while this many bytes are buffered")
    lease_seconds: float = option("lease_seconds", WRITER_LEASE_S, parse=duration_parser(0.1),
                                  doc="shard lease; a crashed producer's shards are free after it")
    acknowledge: str = option("acknowledge", DEFAULT_ACKNOWLEDGE, parse=_acknowledge,
                              metavar="{published,durable,clusters:K}",
                              doc="when a message counts as acknowledged: published, durable, or durable in "
                                  "K clusters (clusters:K; needs the metadata cache)")

    @classmethod
    def from_values(cls, **values: Any) -> "ProducerOptions":
        """Parse the Producer's keyword arguments (numbers or strings such as ``"1MiB"``, ``"5ms"``).

        Raises
        ------
        AcsOptionError
            Naming the option and what it allows.
        """
        return parse_options(cls, values, component="Producer", none_given=True)


class _Shard:
    """Per-shard write state. Fields marked (lock) are guarded by Producer._lock; the rest
    belong to the writer thread alone."""

    def __init__(self, index: int, writer: ShardWriter) -> None:
        self.index = index
        self.values: List[Optional[bytes]] = []  # (lock) pending messages
        self.keys: List[Optional[bytes]] = []  # (lock)
        self.timestamps: List[int] = []  # (lock)
        self.headers: List[Optional[list]] = []  # (lock) per message: None or [(key, value)]
        self.pending_bytes = 0  # (lock)
        # Messages ever queued to this shard, and how many of them are acknowledged: durable,
        # verified and (acknowledge="published") their lengths published. Both count in queue
        # order, so a flush waits on each shard's own count (a global count let messages queued
        # to another shard after the flush stand in for this shard's last blocks).
        self.queued = 0  # (lock)
        self.acknowledged = 0  # (lock)
        # Messages of this shard's current round appended with more_follows: durable, their
        # lengths still with the file's shadow thread; acknowledged at the round's last block
        # of the shard, which settles them first. Writer thread only.
        self.unsettled = 0
        # acknowledge="clusters:K": (messages written so far, file, its length after them) per
        # block, dropped once confirmed in K clusters (lock). A flush waits on the files and
        # lengths up to the first mark covering its messages.
        self.written = 0  # (lock)
        self.marks: List[Tuple[int, str, int]] = []  # (lock)
        self.writer = writer  # writer thread (and the constructor before it starts)


class Producer:
    """Append messages to a stream in a durable store.

    Parameters
    ----------
    root : str or DurableStore
        Durable store root: a URI (``file:///data/acs``, ``hdfs://...``) or a local path.
    stream : str
        Stream name; created with ``shards`` shards if it does not exist.
    shards : int
        Number of shards of the stream. Must match an existing stream.
    max_block_bytes : int
        Largest block body (default 1 MiB); a larger single message gets a block of its own.
    roll_bytes : int
        Start a new file when the current one reaches this size (default 64 MiB).
    roll_seconds : float
        Start a new file when the current one is this old (default 600 s).
    max_batch_delay : float
        Cap of the adaptive batching delay in seconds (default 5 ms).
    max_pending_bytes : int
        ``send`` blocks while this many bytes are buffered (default 64 MiB).
    lease_seconds : float
        Shard lease duration; a crashed producer's shards are free after it (default 10 s).
    acknowledge : {"published", "durable", "clusters:K"}
        When a message counts as acknowledged, i.e. when ``flush()`` returns for it. With
        ``"clusters:K"``, once it is published here and durable in K clusters: this one (the
        stream's source) and K-1 of its destinations, as the copy daemons confirm in this
        cluster's metadata cache (needed: refused without ``metadata_cache``); a message
        acknowledged so survives the loss of this cluster (docs/copy.md, "Acknowledgements
        that survive a cluster"). With
        ``"published"`` (default), that is once it is durable, verified against the seals, and
        its file's lengths are published to the caches. With ``"durable"``, it is once it is
        durable and verified; its chunks and lengths follow on the file's shadow thread, in
        order, coalesced while the caches lag. A flush then waits on the caches only past
        :data:`~pyspark_acs.write.file.SHADOW_MAX_BYTES` of unpublished bytes per file, and at
        a roll (a file reaching ``roll_bytes`` or ``roll_seconds``: the old file's lengths and
        its seal are published before the rolling block counts). Readers see an acknowledged
        message once the shadow thread published its length (moments later; with the caches
        stalled, once a reader checks the store's size of a length that stood still, at most
        every second), so a bounded read planned right after ``flush()`` (a Spark batch ending
        at ``latest``) may end before it. ``close()`` publishes everything in both modes.
        It is not the default: on a busy machine flushes no longer wait on starved caches, but
        on a quiet one blocks are smaller (flushes return sooner), so there are more pushes and
        a longer delay tail (docs/cache.md, "Writes").
    writer_id : str, optional
        Writer id put in file names; random by default.
    data_cache : str or CacheClient, optional
        Data-cache endpoints (``host:port,...``): every block is also written there as
        4 KiB chunks, so consumers read from memory.
    metadata_cache : str or CacheClient, optional
        Metadata-cache endpoints: file lengths and shard heads are published there, and
        the shard lease lives there (a new Producer then takes over a shard by poisoning
        the old one's lease instead of being refused).
        When not given, ``$ACS_DATA_CACHE`` / ``$ACS_METADATA_CACHE`` are used (what ``acs up``
        prints); ``"none"`` turns a cache off even then.
    cache_token : str, optional
        Shared token of token-protected cache servers (default ``$ACS_CACHE_TOKEN``).
    security : SecuritySettings, optional
        Token and TLS settings of token- or TLS-protected caches
        (:class:`~pyspark_acs.security.SecuritySettings`; default from the environment, see
        docs/security.md).
    clock : callable
        Monotonic seconds (``time.monotonic``): the clock of the batching rule (write latencies
        and the busy writer's wait, :class:`~pyspark_acs.write.batching.Batching`). The wait
        itself is a real one; :meth:`wake` has the writer look at the clock again.
    lease_clock : callable
        Wall-clock seconds (``time.time``) of the store leases' expiry
        (:class:`~pyspark_acs.storage.leases.StoreLease`).

    Notes
    -----
    Messages of one shard are written in ``send`` order. ``flush()`` returns once every
    message sent before it is in the durable store, or raises the error that stopped the
    writer. A second Producer for a shard that a live Producer holds is refused with
    :class:`~pyspark_acs.errors.WriterConflictError` (with a metadata cache it takes the
    shard over instead: the first one stops with
    :class:`~pyspark_acs.errors.LeasePoisonedError`).

    Taking a shard over, a Producer first seals the newest file of the shard if its writer
    left it unsealed (a crash, or a writer deposed while it stalled). That seal is a fence:
    a deposed Producer whose block lands after it gets
    :class:`~pyspark_acs.errors.WriterConflictError` from ``flush()`` naming the file and the
    messages and bytes that were not acknowledged; readers never see them.

    Examples
    --------
    >>> with Producer("/tmp/acs", "orders", shards=4) as p:   # doctest: +SKIP
    ...     p.send(b"hello", key=b"customer-1")
    """

    def __init__(
        self,
        root: Union[str, DurableStore],
        stream: str,
        shards: int = 1,
        *,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
        roll_bytes: int = DEFAULT_ROLL_BYTES,
        roll_seconds: float = DEFAULT_ROLL_SECONDS,
        max_batch_delay: float = DEFAULT_MAX_BATCH_DELAY_S,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        lease_seconds: float = WRITER_LEASE_S,
        acknowledge: str = DEFAULT_ACKNOWLEDGE,
        writer_id: Optional[str] = None,
        data_cache: Any = None,
        metadata_cache: Any = None,
        cache_token: Optional[str] = None,
        security: Any = None,
        clock: Callable[[], float] = time.monotonic,
        lease_clock: Callable[[], float] = time.time,
    ) -> None:
        self.options = ProducerOptions.from_values(
            shards=shards, max_block_bytes=max_block_bytes, roll_bytes=roll_bytes, roll_seconds=roll_seconds,
            max_batch_delay=max_batch_delay, max_pending_bytes=max_pending_bytes, lease_seconds=lease_seconds,
            acknowledge=acknowledge,
        )
        self.stream = validate_stream(stream)
        #: The process that made this Producer: the only one with its writer thread.
        self._made = _fork.mark()
        self.store = open_store(root)
        self.writer_id = writer_id or new_writer_id()
        self.shards = self.store.create_stream(stream, self.options.shards)
        # _lock guards the pending lists of every _Shard, _pending_bytes, _stats, _error,
        # _closed, _round_robin, _batching, _lingering, _linger_checks and _flushing; _cond (on
        # _lock) signals the writer thread and waiters in flush()/send().
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending_bytes = 0
        #: When the oldest message not in the writer's current round was queued (the batching
        #: clock; None: none is), where the busy writer's wait is counted from.
        self._pending_since: Optional[float] = None
        self._round_robin = 0
        self._writer_idle = False  # (lock) the writer thread waits for messages
        self._batching = Batching(self.options.max_block_bytes, self.options.max_batch_delay, clock)
        self._lingering = False  # (lock) the busy writer waits for its block to fill
        self._linger_checks = 0  # (lock) times it looked at the rule and went on waiting
        self._flushing = 0  # (lock) flush() calls waiting: a waiting block goes at once
        self._error: Optional[BaseException] = None
        self._closed = False
        self._stats = {"messages": 0, "blocks": 0, "bytes": 0, "cache_errors": 0}
        self._own_clients: list = []
        self._data = meta_client = None
        data_cache = cache_endpoints(data_cache, DATA_CACHE_ENV)
        metadata_cache = cache_endpoints(metadata_cache, METADATA_CACHE_ENV)
        if data_cache or metadata_cache:  # grpc is imported only when caches are used
            from pyspark_acs.cache.client import client_for

            self._data = client_for(data_cache, "data cache", self._own_clients, cache_token, security)
            meta_client = client_for(metadata_cache, "metadata cache", self._own_clients, cache_token, security)
        self._meta = None
        if meta_client is not None:
            from pyspark_acs.cache.metadata import MetadataCache

            self._meta = MetadataCache(meta_client)
        #: The clusters a flush waits for (acknowledge="clusters:K"; 1: this one alone), and the
        #: pushes of their confirmations (opened at the first flush that waits).
        self._clusters = clusters_needed(self.options.acknowledge)
        self._confirm_watch: Optional[ConfirmWatch] = None
        if self._clusters > 1 and self._meta is None:
            for c in self._own_clients:
                c.close()
            raise AcsOptionError(
                f"acknowledge: {self.options.acknowledge!r} needs the metadata cache (metadata_cache=... or "
                f"${METADATA_CACHE_ENV}): the copy daemons confirm there what other clusters hold", option="acknowledge")
        self._shards = [
            _Shard(i, ShardWriter(
                self.store, self.stream, i, self.writer_id, data=self._data, meta=self._meta,
                lease_seconds=self.options.lease_seconds, roll_bytes=self.options.roll_bytes,
                roll_seconds=self.options.roll_seconds, on_cache_error=self._cache_error, lease_clock=lease_clock,
            ))
            for i in range(self.shards)
        ]
        try:
            for sh in self._shards:
                # Lease, then recovery: the predecessor's unsealed file is sealed (fenced)
                # before this Producer writes anything.
                sh.writer.acquire()
                sh.writer.recover()
        except BaseException:
            for sh in self._shards:
                sh.writer.release()
            for c in self._own_clients:
                c.close()
            raise
        self._thread = threading.Thread(target=self._run, name=f"acs-producer-{self.stream}", daemon=True)
        self._thread.start()

    # -- public API ------------------------------------------------------------------------

    def send(
        self,
        value: Union[bytes, str, None],
        key: Union[bytes, str, None] = None,
        shard: Optional[int] = None,
        timestamp: Union[int, _dt.datetime, None] = None,
        headers: Optional[Any] = None,
    ) -> int:
        """Queue one message; return the shard it goes to.

        Parameters
        ----------
        value : bytes or str
            The message (str is encoded as UTF-8).
        key : bytes or str, optional
            Picks the shard by hash when ``shard`` is not given.
        shard : int, optional
            Explicit shard; otherwise by key hash, else round-robin.
        timestamp : datetime or int (µs since the epoch), optional
            Producer timestamp; default now.
        headers : list of (str, bytes) pairs or mapping, optional
            Message headers, as Kafka's (read back with ``Consumer(include_headers=True)`` or
            the Spark source's ``includeHeaders``).
        """
        value_b = _as_bytes(value, "value")
        key_b = _as_bytes(key, "key")
        ts = _timestamp_us(timestamp)
        hdrs = _as_headers(headers)
        size = _message_bytes(value_b, key_b, hdrs)
        self._check_process()
        with self._cond:
            self._check_open()
            if shard is None:
                shard = self._shard_for(key_b)
            else:
                validate_shard(shard, self.shards)
            while self._pending_bytes >= self.options.max_pending_bytes and self._error is None:
                self._cond.wait(0.1)
            self._check_open()
            sh = self._shards[shard]
            sh.values.append(value_b)
            sh.keys.append(key_b)
            sh.timestamps.append(ts)
            sh.headers.append(hdrs)
            sh.pending_bytes += size
            sh.queued += 1
            self._pending_bytes += size
            self._wake_writer()
        return shard

    def send_many(
        self,
        values: "List[Union[bytes, str, None]]",
        keys: "Optional[List[Union[bytes, str, None]]]" = None,
        shard: Optional[int] = None,
        timestamp: Union[int, _dt.datetime, None] = None,
    ) -> None:
        """Queue many messages at once (one lock round trip instead of one per message).

        Shards are chosen as by :meth:`send`: ``shard`` for all, else each key's hash, else
        round-robin. ``timestamp`` applies to every message (default now). Order is kept.
        """
        # Plain bytes (the common case) are taken as they are: their types are checked at C
        # speed (map, set) instead of a Python call per message.
        values = values if isinstance(values, (list, tuple)) else list(values)  # any iterable
        vals = values if set(map(type, values)) <= _PLAIN else [_as_bytes(v, "value") for v in values]
        n = len(vals)
        ks = None if keys is None else [_as_bytes(k, "key") for k in keys]
        if ks is not None and len(ks) != n:
            raise ValueError(f"send_many: {len(ks)} keys for {n} values")
        ts = _timestamp_us(timestamp)
        self._check_process()
        with self._cond:
            self._check_open()
            if shard is not None:
                validate_shard(shard, self.shards)
            while self._pending_bytes >= self.options.max_pending_bytes and self._error is None:
                self._cond.wait(0.1)
            self._check_open()
            added = 0
            if shard is not None or ks is None:
                # One shard, or round-robin: each shard's messages are one slice, queued with
                # list operations (a Python step per message is a fifth of a producer's CPU).
                if shard is not None:
                    slices = [(shard, vals)]
                else:
                    first, count = self._round_robin, self.shards
                    slices = [(t, vals[(t - first) % count::count]) for t in range(count)] if count > 1 \
                        else [(0, vals)]
                    self._round_robin = (first + n) % count
                for target, part in slices:
                    if not part:
                        continue
                    m = len(part)
                    size = sum(map(len, filter(None, part))) + _MESSAGE_OVERHEAD_BYTES * m
                    sh = self._shards[target]
                    sh.values.extend(part)
                    if ks is None:
                        sh.keys.extend([None] * m)
                    else:  # one shard for all: every key goes with it
                        sh.keys.extend(ks)
                        size += sum(map(len, filter(None, ks)))
                    sh.timestamps.extend([ts] * m)
                    sh.headers.extend([None] * m)
                    sh.pending_bytes += size
                    sh.queued += m
                    added += size
            else:
                for v, k in zip(vals, ks):
                    sh = self._shards[self._shard_for(k)]
                    size = _message_bytes(v, k, None)
                    sh.values.append(v)
                    sh.keys.append(k)
                    sh.timestamps.append(ts)
                    sh.headers.append(None)
                    sh.pending_bytes += size
                    sh.queued += 1
                    added += size
            self._pending_bytes += added
            self._wake_writer()

    def _wake_writer(self) -> None:
        """After messages were queued: note when the oldest of them not in the writer's round
        came (its batching wait counts from it), and wake the writer if it sleeps, or if it
        waits for its block to fill and the block is full. Only then: a notify per message costs
        more than the message (the busy writer picks pending messages up after its current
        write). Caller holds _lock."""
        if self._pending_since is None:
            self._pending_since = self._batching.clock()
        if self._writer_idle:
            self._writer_idle = False
            self._cond.notify_all()
        elif self._lingering and self._pending_bytes >= self.options.max_block_bytes:
            self._cond.notify_all()

    def _shard_for(self, key: Optional[bytes]) -> int:
        """The shard of a message sent without an explicit one: its key's hash, else the next
        in round-robin. Caller holds _lock."""
        if key is not None:
            return shard_for_key(key, self.shards)
        shard = self._round_robin
        self._round_robin = (shard + 1) % self.shards
        return shard

    def flush(self, timeout: Optional[float] = None) -> None:
        """Block until every message sent so far is acknowledged: durable, verified against the
        seals, and (with ``acknowledge="published"``, the default) its file's length published to
        the caches (when there are caches; a failed cache write is counted in
        ``stats()["cache_errors"]``, never fails the message: readers fall back to the store);
        raise the writer's error if any. Messages other threads send meanwhile are not waited for.

        With ``acknowledge="clusters:K"``, it then waits until K-1 destinations confirm the
        bytes (a timeout names each and how far it confirmed).

        Raises
        ------
        TimeoutError
            If ``timeout`` seconds pass first.
        """
        self._check_process()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._confirm(self._flush_local(timeout, deadline), deadline)

    def _flush_local(self, timeout: Optional[float], deadline: Optional[float]) -> Optional[tuple]:
        """:meth:`flush` in this cluster; returns what K clusters must hold for it then
        (:meth:`_needed`; None without ``clusters:K``)."""
        needed = None
        with self._cond:
            targets = [(sh, sh.queued) for sh in self._shards]
            self._flushing += 1  # a block waiting to fill goes now
            if self._lingering:
                self._cond.notify_all()
            try:
                while self._error is None:
                    short = sum(max(0, t - sh.acknowledged) for sh, t in targets)
                    if not short:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise AcsTimeoutError(f"flush: {short} messages not yet acknowledged after {timeout} s")
                    self._cond.wait(left if left is not None else 0.5)
            finally:
                self._flushing -= 1
            if self._error is not None:
                raise self._error
            if self._clusters > 1:
                needed = self._needed(targets)
        return needed

    def _confirm(self, needed: Optional[tuple], deadline: Optional[float], what: str = "flush") -> None:
        """Wait until K-1 destinations confirm ``needed`` (:meth:`_flush_local`'s), then drop
        the marks it covered."""
        if not needed or not needed[0]:
            return
        files, covered = needed
        with self._cond:
            if self._confirm_watch is None:
                self._confirm_watch = ConfirmWatch(self._meta.client)
            watch = self._confirm_watch
        wait_confirmed(self._meta, self.store.uri(self.stream), files, self._clusters, deadline=deadline,
                       what=f"{what} of stream {self.stream!r}", watch=watch)
        with self._cond:
            for sh, upto in covered:
                sh.marks = [m for m in sh.marks if m[0] > upto]

    def _needed(self, targets: List[Tuple["_Shard", int]]) -> "tuple[Dict[str, int], List[tuple]]":
        """``({file uri: length}, [(shard, messages covered)])``: what K clusters must hold for
        the messages of ``targets`` (each shard's marks up to the first covering its target).
        Caller holds _lock."""
        needed: Dict[str, int] = {}
        covered = []
        for sh, target in targets:
            upto = 0
            for count, rel, end in sh.marks:
                if upto >= target:
                    break
                uri = self.store.uri(rel)
                needed[uri] = max(needed.get(uri, 0), end)
                upto = count
            if upto:
                covered.append((sh, upto))
        return needed, covered

    def wake(self) -> None:
        """Have the writer thread look at its batching rule again now: a block waiting to fill
        goes if the Producer's ``clock`` passed its delay meanwhile (a test's clock moved by
        hand), else it waits on."""
        self._check_process()
        with self._cond:
            self._cond.notify_all()

    def close(self, timeout: Optional[float] = None) -> None:
        """Flush, seal the open files, release the shard leases and stop the writer thread.

        With ``acknowledge="clusters:K"`` the flush waits for the destinations' confirmations
        after the files are sealed and the leases released, at most ``timeout`` (without one,
        :data:`CLOSE_CONFIRM_S`), then raises naming what was not confirmed; a ``with`` block
        left by an exception does not wait for them."""
        self._close(timeout, confirm=True)

    def _close(self, timeout: Optional[float], confirm: bool) -> None:
        self._check_process()
        with self._cond:
            if self._closed:
                return
        deadline = None if timeout is None else time.monotonic() + timeout
        needed = None
        try:
            if self._error is None:
                needed = self._flush_local(timeout, deadline)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(timeout)
        if self._thread.is_alive():
            if self._confirm_watch is not None:
                self._confirm_watch.close()
            raise AcsTimeoutError(
                f"close: the writer of stream {self.stream!r} is still writing after {timeout} s "
                f"(the store does not answer?); it keeps trying in the background"
            )
        try:
            if confirm and needed:  # the files are sealed and the leases free meanwhile
                self._confirm(needed, deadline if deadline is not None else time.monotonic() + CLOSE_CONFIRM_S,
                              what="close")
        finally:
            if self._confirm_watch is not None:
                self._confirm_watch.close()
            self.store.close()
            for c in self._own_clients:
                c.close()
        if self._error is not None and not isinstance(self._error, ClosedError):
            raise self._error

    def stats(self) -> Dict[str, float]:
        """Counters: messages, blocks, bytes and files written; messages sent (taken by
        ``send``/``send_many``) and acknowledged (what ``flush()`` waits for, see
        ``acknowledge``); blocks whose cache writes overlapped the next block's durable append
        (``overlapped_blocks``, a backlog's blocks but the last of each round; every block with
        ``acknowledge="durable"``); batching averages."""
        self._check_process()
        with self._lock:
            files = sum(sh.writer.files_opened for sh in self._shards)
            overlapped = sum(sh.writer.overlapped_appends for sh in self._shards)
            return dict(self._stats, files=files, overlapped_blocks=overlapped,
                        write_latency_s=self._batching.latency, avg_block_bytes=self._batching.block_bytes,
                        sent=sum(sh.queued for sh in self._shards),
                        acknowledged=sum(sh.acknowledged for sh in self._shards))

    def counts_unlocked(self) -> Tuple[int, int]:
        """``(sent, acknowledged)`` as :meth:`stats` counts them, read without the Producer's
        lock: for a signal handler, which runs in the main thread and may have interrupted it
        while it held that lock (taking it there would never return). Each count is one int,
        so each is a value it had; the two may be from moments apart."""
        return sum(sh.queued for sh in self._shards), sum(sh.acknowledged for sh in self._shards)

    def current_files(self) -> Dict[int, str]:
        """The file each shard is writing now ('' before its first block)."""
        return {sh.index: sh.writer.file for sh in self._shards}

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc: Any) -> None:
        # Left by an exception: flushed, sealed and released, without waiting for other clusters.
        self._close(None, confirm=exc[0] is None)

    # -- writer thread ---------------------------------------------------------------------

    def _check_process(self) -> None:
        """Refuse a forked child (before taking a lock: the parent's writer thread may have held
        it at the fork, and nothing releases it in the child)."""
        if not _fork.made_here(self._made):
            raise _fork.made_elsewhere(self._made, f"Producer of stream {self.stream!r}")

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ClosedError(f"producer for stream {self.stream!r} is closed")

    def _run(self) -> None:
        try:
            busy = False
            while True:
                with self._cond:
                    if self._pending_bytes == 0 and not self._closed:
                        busy = False
                        self._writer_idle = True
                        self._cond.wait(self._idle_wait())
                        self._writer_idle = False
                    closing = self._closed
                    pending = self._pending_bytes
                if busy and pending and pending < self.options.max_block_bytes:
                    self._linger()
                self._housekeeping()
                wrote = self._write_pending()
                busy = wrote > 0
                if closing and not wrote:
                    break
        except BaseException as exc:  # handed to the caller through send/flush/close
            if isinstance(exc, LeaseError) and not isinstance(exc, AppendConflictError):
                exc = self._deposed(exc)
            log.error("producer for stream %r stopped: %s", self.stream, exc)
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            self._finish()

    def _deposed(self, exc: LeaseError) -> LeaseError:
        """The same error naming what is not acknowledged: a lease check (or the check of a new
        file) found this producer deposed before it wrote the pending messages. (An append the
        seal fence refused names its messages itself: AppendConflictError.)"""
        with self._cond:
            unwritten = sum(sh.queued for sh in self._shards) - self._stats["messages"]
        files = ", ".join(f"shard {sh.index} {sh.writer.file}" for sh in self._shards if sh.writer.file)
        named = type(exc)(
            f"{exc}; {unwritten} message(s) sent since the last acknowledged one are not acknowledged and were "
            f"not written (last files: {files or 'none'})"
        )
        named.__cause__ = exc
        return named

    def _idle_wait(self) -> float:
        # Wake up for lease renewal and age-based rollover even without traffic.
        return max(0.01, min(self.options.lease_seconds / 3, self.options.roll_seconds) / 2)

    def _linger(self) -> None:
        """The busy writer's wait for its next block to fill (:class:`Batching`): until the block
        is full, its delay passed on the clock, a flush waits or the Producer closes. On the
        condition, so that what ends it early wakes it (:meth:`_wake_writer`, :meth:`flush`,
        :meth:`close`, :meth:`wake`)."""
        with self._cond:
            deadline = self._batching.deadline(self._pending_since)
            self._lingering = True
            try:
                while not self._closed:
                    left = self._batching.left(deadline, self._pending_bytes, self._flushing > 0)
                    if left <= 0:
                        break
                    self._linger_checks += 1
                    self._cond.wait(left)
            finally:
                self._lingering = False

    def _housekeeping(self) -> None:
        for sh in self._shards:
            sh.writer.check_leases()  # a poisoned lease raises LeasePoisonedError: the writer stops
            sh.writer.roll_if_old()
            sh.writer.seal_strays_left()

    def _write_pending(self) -> int:
        """Write the pending messages as blocks; return how many were written.

        A round writes what was queued when it started, one block per shard in turn, so a
        shard that never empties (a hot key) cannot starve the others, and housekeeping
        (lease renewal, age rollover) runs between the turns.
        """
        written = 0
        durable_ack = self.options.acknowledge == ACKNOWLEDGE_DURABLE
        with self._lock:
            budgets = [len(sh.values) for sh in self._shards]
            self._pending_since = None  # what is queued from now on waits from its own arrival
        while any(budgets):
            for i, sh in enumerate(self._shards):
                if budgets[i] <= 0:
                    continue
                with self._lock:
                    take, size = self._take_block(sh, budgets[i])
                    values, keys, stamps = sh.values[:take], sh.keys[:take], sh.timestamps[:take]
                    headers = sh.headers[:take]
                    del sh.values[:take], sh.keys[:take], sh.timestamps[:take], sh.headers[:take]
                    sh.pending_bytes -= size
                    self._pending_bytes -= size
                budgets[i] -= take
                # More of this shard's round follows: its cache writes may overlap the next block.
                # Acknowledged when durable: every block's cache writes go to the shadow thread.
                more_follows = budgets[i] > 0 or durable_ack
                rel, end = self._write_block(sh, values, keys, stamps, headers, more_follows=more_follows)
                written += take
                with self._cond:
                    self._stats["messages"] += take
                    if self._clusters > 1:
                        sh.written += take
                        sh.marks.append((sh.written, rel, end))
                        if len(sh.marks) > MAX_MARKS:
                            last = {m[1]: m for m in sh.marks}
                            sh.marks = sorted(last.values())
                    if durable_ack:
                        sh.acknowledged += take
                    elif more_follows:
                        sh.unsettled += take
                    else:  # this append settled the shard's earlier blocks of the round first
                        sh.acknowledged += sh.unsettled + take
                        sh.unsettled = 0
                    self._cond.notify_all()
            self._housekeeping()
        return written

    def _take_block(self, sh: _Shard, limit: int, first_window: int = _CUT_WINDOW) -> "tuple[int, int]":
        """How many of the first ``limit`` pending messages fit one block (at least one), and
        their accounted bytes, looking at ``first_window`` messages first. Caller holds _lock."""
        most = self.options.max_block_bytes
        if limit == len(sh.values) and sh.pending_bytes <= most:
            return limit, sh.pending_bytes
        # Values alone (the common case): running sizes at C speed and a binary search, not a
        # Python step per message. Looked at in windows that double, so the cost follows the
        # block, not everything pending (a writer behind its sender has many blocks queued).
        window = min(limit, first_window)
        while True:
            values = sh.values[:window]
            if None in values or sh.keys[:window].count(None) != window or sh.headers[:window].count(None) != window:
                break  # keys, headers or null values: the rule below, message by message
            ends = list(itertools.accumulate(map(len, values)))
            if window == limit or ends[-1] + _MESSAGE_OVERHEAD_BYTES * window > most:
                take = max(1, bisect.bisect_right(range(window), most, key=lambda i: ends[i] + _MESSAGE_OVERHEAD_BYTES * (i + 1)))
                return take, ends[take - 1] + _MESSAGE_OVERHEAD_BYTES * take
            window = min(limit, 2 * window)
        total = 0
        for i in range(limit):
            size = _message_bytes(sh.values[i], sh.keys[i], sh.headers[i])
            if i and total + size > most:
                return i, total
            total += size
        return limit, total

    def _write_block(self, sh: _Shard, values: list, keys: list, stamps: list, headers: list, *,
                     more_follows: bool = False) -> Tuple[str, int]:
        """Write one block through the shard writer (verified against seals before it counts);
        ``more_follows``: the shard's next block comes right after it (:meth:`ShardWriter.append`).
        Returns the file it went to (relative to the root) and the file's length after it.

        Cache failures never fail the producer (the durable store has the bytes and readers
        fall back to it); they are logged and counted in ``stats()["cache_errors"]``.
        """
        writer = sh.writer
        writer.check_leases()  # never write after a newer writer took the shard over
        if writer.writer is None:
            writer.open_new()
        any_key = any(k is not None for k in keys)
        any_headers = any(h is not None for h in headers)
        block = encode_block(values, keys if any_key else None, stamps, first_index=writer.next_index,
                             headers=headers if any_headers else None)
        clock = self._batching.clock
        rel = f"{writer.dir}/{writer.file}"
        started = clock()
        end = writer.append(block, len(values), more_follows=more_follows)
        latency = clock() - started
        with self._lock:
            self._batching.record(latency, len(block))
            self._stats["blocks"] += 1
            self._stats["bytes"] += len(block)
        return rel, end

    def _cache_error(self, what: str, exc: Exception) -> None:
        with self._lock:
            self._stats["cache_errors"] += 1
            first = self._stats["cache_errors"] == 1 or self._stats["cache_errors"] % 1000 == 0
        if first:
            log.warning("producer for stream %r: cache write of %s failed (%d so far): %s", self.stream, what,
                        self._stats["cache_errors"], exc)

    def _finish(self) -> None:
        """Writer-thread exit: seal files and release leases (best effort after an error)."""
        for sh in self._shards:
            try:
                sh.writer.close(seal=self._error is None)
            except Exception as exc:  # any: every shard still gets closed and its leases released
                log.warning("producer for stream %r: cleanup of shard %d failed: %s", self.stream, sh.index, exc)
                with self._cond:
                    if self._error is None:
                        self._error = exc
        with self._cond:
            self._cond.notify_all()
