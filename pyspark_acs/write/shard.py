"""The shard writer: the one way bytes are written to a shard (docs/overview.md section 6).

The Producer and the Spark sink's commit write through :class:`ShardWriter`; it holds every
rule of writing a shard:

- which shard a key goes to (:func:`shard_for_key`);
- the lease: the metadata-cache lease when a metadata cache is given (a new writer poisons
  the old one), and the store lease file :data:`LEASE_FILE` in the shard folder (forced
  when the metadata-cache lease is held; the only one otherwise);
- take-over = recovery: before writing anything, the newest file of the shard is sealed at
  its durable length if its writer left it unsealed (a recovery seal, with ``void_from``
  when the file ends in a torn block). That seal is the fence that stops a deposed writer
  (:mod:`pyspark_acs.write.file`);
- the next file's name (:func:`~pyspark_acs.format.names.next_file_name`: after every
  existing file), the shard head key in the metadata cache;
- appends through :class:`~pyspark_acs.write.file.FileWriter` (durable, verify, chunks,
  lengths), per-message accounting (the next message index of the file);
- roll over by size and age (seal, then the next file), seal on close.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any, Callable, List, NamedTuple, Optional, Set, Tuple

from pyspark_acs.errors import (AppendConflictError, CacheError, LaterFileError, LeaseError, StaleEpochError,
                                StoreError, StoreFileNotFoundError, WriterConflictError)
from pyspark_acs.format.block import HEADER_SIZE, encode_seal
from pyspark_acs.format.names import next_file_name, shard_dir
from pyspark_acs.storage.leases import WRITER_LEASE_S, StoreLease
from pyspark_acs.storage.store import DurableStore
from pyspark_acs.write.file import FileTail, FileWriter, scan_file

__all__ = [
    "DEFAULT_ROLL_BYTES",
    "DEFAULT_ROLL_SECONDS",
    "OpenFile",
    "ShardWriter",
    "shard_for_key",
]

log = logging.getLogger(__name__)

DEFAULT_ROLL_BYTES = 64 * 1024 * 1024
DEFAULT_ROLL_SECONDS = 600.0
#: The store lease of a shard: a file in the shard folder.
LEASE_FILE = "_writer.lease"
#: A recovery seal that keeps losing the race against a deposed writer's appends gives up.
_RECOVERY_ATTEMPTS = 20
#: How often a writer tries again to seal an empty stray the store refused to seal (seconds).
STRAY_RETRY_S = 1.0
_CLAIM_ATTEMPTS = 5  # new files a claim may start over on (each after deposed writers' later files)


def shard_for_key(key: bytes, shards: int) -> int:
    """The shard of a key: crc32 of the key bytes modulo the shard count (stable everywhere)."""
    return zlib.crc32(key) % shards


class OpenFile(NamedTuple):
    """A file a writer continues: its name, the length it ends at, the next message index."""

    file: str
    length: int
    next_index: int


class ShardWriter:
    """Writes one shard: lease, recovery, appends, roll-over, seals.

    Parameters
    ----------
    store : DurableStore
    stream : str
    shard : int
    writer_id : str
        Put in the names of the files this writer creates and in its leases.
    data : CacheClient, optional
        Data cache (chunks of every append).
    meta : MetadataCache, optional
        Metadata cache (lengths, shard head, the lease).
    lease_seconds : float
    roll_bytes, roll_seconds : int, float
        A file is sealed and the next one started at this size / age.
    on_cache_error : callable(what, exc), optional
        Cache failures (never raised): logged and counted by the caller.
    what : str, optional
        Names the writer in messages (default: the shard and stream).
    lease_clock : callable
        Wall-clock seconds (``time.time``) of the store lease's expiry
        (:class:`~pyspark_acs.storage.leases.StoreLease`'s ``clock``).

    Not thread-safe: one writer thread. Call :meth:`acquire`, then :meth:`recover` before
    the first append.
    """

    def __init__(self, store: DurableStore, stream: str, shard: int, writer_id: str, *, data: Any = None,
                 meta: Any = None, lease_seconds: float = WRITER_LEASE_S,
                 roll_bytes: int = DEFAULT_ROLL_BYTES, roll_seconds: float = DEFAULT_ROLL_SECONDS,
                 on_cache_error: Optional[Callable[[str, Exception], None]] = None,
                 what: Optional[str] = None, lease_clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.lease_clock = lease_clock
        self.stream = stream
        self.shard = shard
        self.writer_id = writer_id
        self.data = data
        self.meta = meta
        self.lease_seconds = lease_seconds
        self.roll_bytes = roll_bytes
        self.roll_seconds = roll_seconds
        self.on_cache_error = on_cache_error or self._log_cache_error
        self.dir = shard_dir(stream, shard)
        self.shard_uri = store.uri(self.dir)
        self.what = what or f"shard {shard} of stream {stream!r} in {store.root}"
        self.leases: List[Any] = []
        self.writer: Optional[FileWriter] = None  # the open file
        self.file = ""  # its base name (the last one after a seal; '' before the first file)
        self.next_index = 0  # the next message's index in the open file
        self.opened_at = 0.0  # monotonic time the open file was opened
        self.files_opened = 0
        self.overlapped_appends = 0  # appends whose cache writes overlapped the next (more_follows)
        self.recovered: List[str] = []  # files this writer sealed for a predecessor
        # The shard's files as this writer last listed them (recover, then each claim): a file
        # sorting before a new one of ours and not in it appeared since, a deposed writer's.
        self._listed: Set[str] = set()
        # Empty strays the store refused to seal, tried again by seal_strays_left (no sooner
        # than _strays_retry_at, monotonic); the writer's own thread alone touches both.
        self._strays_left: Set[str] = set()
        self._strays_retry_at = 0.0

    # -- lease -----------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the shard's lease(s).

        Raises
        ------
        WriterConflictError
            Another live writer holds the shard (store lease) or would not let go.
        """
        force = False
        if self.meta is not None:
            lease = self.meta.lease(self.shard_uri, self.writer_id, self.what, self.lease_seconds)
            try:
                lease.acquire()
                self.leases.append(lease)
                force = True  # the cache lease is the authority: take the store lease over too
            except CacheError as exc:
                log.warning("%s: metadata cache unavailable for the lease, using the store lease: %s", self.what, exc)
        store_lease = StoreLease(self.store, f"{self.dir}/{LEASE_FILE}", self.writer_id, self.what, self.lease_seconds,
                                 clock=self.lease_clock)
        try:
            store_lease.acquire(force=force)
        except BaseException:
            self.release()
            raise
        self.leases.append(store_lease)

    def check_leases(self, *, every: bool = False) -> None:
        """Renew due leases (``every``: all of them now); a lost one raises
        LeasePoisonedError (stop writing at once).

        A metadata cache that does not answer does not stop writes (availability first,
        paper section 3): the seal fence still protects the shard. While the metadata-cache
        lease is ours, the store lease is renewed with ``force`` (a resumed deposed writer
        may have written its record over ours: it stops at its own cache-lease check).
        """
        authority = False  # the cache lease was ours at its last check (it comes first in the list)
        for lease in self.leases:
            due = every or lease.due()
            if isinstance(lease, StoreLease):
                if due:
                    lease.renew(force=authority)
                continue
            if due:
                try:
                    lease.check()
                except CacheError as exc:
                    log.warning("%s: lease check skipped, metadata cache unavailable: %s", self.what, exc)
                    continue
            authority = True

    def release(self) -> None:
        """Give the leases up (those still ours)."""
        leases, self.leases = self.leases, []
        for lease in leases:
            lease.release()

    # -- recovery --------------------------------------------------------------------------

    def files(self) -> List[str]:
        """The shard's message files, oldest first."""
        return self.store.list_files(self.stream, self.shard)

    def recover(self, resume: Optional[OpenFile] = None) -> Optional[FileTail]:
        """Make the shard ready for this writer; call with the lease held, before appending.

        With ``resume`` (a file this writer left unsealed, e.g. the sink's file of its last
        batch): when it is still the newest file, or absent and named after every existing
        file, and ends at ``resume.length``, it stays open for the next append (a file created
        here is claimed like :meth:`open_new`'s, but keeps its name: :class:`LaterFileError`
        when another writer's file sorts after it, WriterConflictError when the lease is lost,
        the file then sealed empty). Otherwise (or without ``resume``) the newest file is
        sealed at its durable length if it is not sealed yet (recovery: the predecessor
        stopped or was deposed), and the next append starts a new file.

        Either way deposed writers' strays are sealed (:meth:`_seal_strays`).

        Returns the walk of the newest file when it was examined (None otherwise).
        """
        self._close_writer()
        listing = self.store.list_file_lengths(self.stream, self.shard)
        files = [name for name, _ in listing]
        newest = files[-1] if files else None
        self._listed = set(files)
        if resume is not None:
            if newest == resume.file or (resume.file not in files and (newest is None or resume.file > newest)):
                length = self.store.lengths([f"{self.dir}/{resume.file}"]).get(f"{self.dir}/{resume.file}") or 0
                if length == resume.length:
                    self._seal_strays(listing, keep=resume.file)
                    if resume.file != newest and newest is not None:
                        self._seal_predecessor(newest)
                    self._open(resume.file, resume.length, resume.next_index)
                    if resume.file != newest:
                        # Created now (a sink's planned file): fenced like any new file.
                        self._claim(resume.file)
                    return None
        if newest is None:
            return None
        self._seal_strays(listing)
        return self._seal_predecessor(newest)

    def _seal_strays(self, listing: List[Tuple[str, int]], keep: Optional[str] = None) -> None:
        """Seal the files a deposed writer may have left unsealed before the newest file
        (``listing``: the shard's files and lengths, oldest first; ``keep``: a file resumed).

        A writer that stalls past its lease and then creates a file seals it in its claim; if
        it dies first, the file stays, unsealed, wherever its name sorts (named before the
        stall, it may sort before the new holder's files), and readers reaching it would wait
        there for good: the newest file is the only one a recovery seals. Such a file is
        always empty (a writer appends nothing before its claim passes) and a sealed file
        never is, so every empty file is sealed here (:meth:`_seal_stray`), at the cost of the
        listing recovery makes anyway; and when the newest file holds no message (empty, or
        a deposed writer's file its claim sealed unused), the last file holding messages too
        (its writer's last one, which the newest-file rule would miss; fenced as the newest
        file is). The newest file is left to the caller.
        """
        if not listing:
            return
        newest, newest_size = listing[-1]
        if newest_size <= HEADER_SIZE:
            # The newest file holds no message (empty, or a lone seal: a deposed writer's file
            # its claim sealed unused), so the last writer's last file may sort before it,
            # unsealed, with acknowledged bytes and a deposed writer's append in flight: fenced
            # like the newest file, so a refusal stops this take-over. (Any block holding a
            # message is longer than a header.)
            last_full = next((name for name, size in reversed(listing) if size > HEADER_SIZE), None)
            if last_full is not None and last_full != keep:
                self._seal_predecessor(last_full)
        for name, size in listing:
            if size == 0 and name not in (newest, keep):
                self._seal_stray(name)

    def _seal_stray(self, name: str) -> None:
        """Seal an empty file a deposed writer left unsealed before the newest file, if it can be.

        Failing to is no reason to stop this writer (HDFS refuses a second appender until the
        dead writer's lease on the file expires), as long as the file is still empty (nothing
        to fence): readers wait at it until it is sealed, and the writer tries again every
        :data:`STRAY_RETRY_S` (:meth:`seal_strays_left`) and at each new file (its claim seals
        the files it has not listed). A file that holds bytes by then raises as any fence.
        """
        rel = f"{self.dir}/{name}"
        try:
            self._seal_predecessor(name)
        except (StoreError, AppendConflictError) as exc:
            if self.store.lengths([rel]).get(rel):
                raise
            self._listed.discard(name)
            # Warned once per stray (it is tried again about every second while refused).
            report = log.debug if name in self._strays_left else log.warning
            self._strays_left.add(name)
            report("%s: could not seal %s, an empty file a deposed writer left unsealed; readers reaching it "
                   "wait there until it is sealed (tried again every %.0f s): %s",
                   self.what, self.store.uri(rel), STRAY_RETRY_S, exc)
        else:
            self._strays_left.discard(name)

    def seal_strays_left(self) -> None:
        """Try again to seal the strays whose seal the store refused (housekeeping: at most
        every :data:`STRAY_RETRY_S`)."""
        now = time.monotonic()
        if not self._strays_left or now < self._strays_retry_at:
            return
        self._strays_retry_at = now + STRAY_RETRY_S
        for name in sorted(self._strays_left):
            self._seal_stray(name)

    def _seal_predecessor(self, name: str) -> Optional[FileTail]:
        """Seal ``name`` at its durable length unless sealed (the recovery seal, the fence).

        A file that is gone is left gone (None): the tier mover deletes the hot copy of a
        sealed, tiered file at any time, and appending the seal would create an empty sealed
        file in its place, which readers would take for the whole file.
        """
        rel = f"{self.dir}/{name}"
        for _ in range(_RECOVERY_ATTEMPTS):
            length = self.store.lengths([rel]).get(rel)
            if length is None:
                return None
            try:
                tail = scan_file(self.store, rel, length=length)
            except StoreFileNotFoundError:
                return None  # deleted since (a tiered file's hot copy): sealed before, gone now
            if tail.sealed:
                return tail
            void_from = tail.end if tail.torn else None
            writer = FileWriter(self.store, rel, data=self.data, meta=self.meta, position=tail.length,
                                on_cache_error=self.on_cache_error)
            try:
                # The fence itself: it must land even past a writer stopped holding the
                # file's append lock (its late bytes land after the seal, never read).
                writer.append(encode_seal(tail.next_index, void_from=void_from), past_a_stopped_writer=True)
            except AppendConflictError as exc:
                log.info("%s: the predecessor appended while we sealed %s; walking it again: %s", self.what, rel, exc)
                continue
            finally:
                writer.close()
            self.recovered.append(name)
            if tail.torn:
                log.warning("%s: sealed %s after its writer stopped; bytes [%d, %d) are a torn block (never "
                            "acknowledged) and the seal voids them", self.what, self.store.uri(rel), tail.end,
                            tail.length)
            else:
                log.info("%s: sealed %s at byte %d after its writer stopped", self.what, self.store.uri(rel),
                         tail.length)
            return tail._replace(sealed_at=tail.length)
        raise AppendConflictError(
            f"{self.store.uri(rel)}: could not seal the file: its writer keeps appending (is it still alive?)",
            path=self.store.uri(rel), start=0, end=0, actual_length=-1,
        )

    # -- files -----------------------------------------------------------------------------

    def _open(self, name: str, length: int, next_index: int) -> None:
        rel = f"{self.dir}/{name}"
        self.writer = FileWriter(self.store, rel, data=self.data, meta=self.meta, position=length,
                                 on_cache_error=self.on_cache_error)
        self.file = name
        self.next_index = next_index
        self.opened_at = time.monotonic()
        if self.meta is not None:
            try:
                self.meta.set_head(self.shard_uri, name)
            except CacheError as exc:
                self.on_cache_error("head", exc)

    def new_file_name(self) -> str:
        """The name the next new file gets (after every existing file of the shard)."""
        return next_file_name(self.files(), self.writer_id)

    def open_new(self, name: Optional[str] = None) -> str:
        """Seal the open file (if any) and start a new one (named ``name`` or by the name rule)."""
        self.seal()
        named = name is not None
        return self._claim(self._start_file(name or self.new_file_name()), may_rename=not named)

    def _start_file(self, name: str) -> str:
        """Create and open the new file ``name`` (empty; a claim makes it this writer's).

        Raises
        ------
        StaleEpochError
            The stream became a copy since this writer started, or is being quarantined (a
            promotion made another cluster its source, and this cluster takes the new
            history): no file of this writer's may start in it, or its messages would be read
            as the copy's. Looked at after the file exists (and the file removed then): a
            quarantine lists the shard after its fence, so either it sees the file or the
            writer sees the fence."""
        self._open(name, 0, 0)
        meta = self.store.stream_meta(self.stream) or {}
        if meta.get("copied_from") or meta.get("quarantine"):
            self._close_writer()
            self.store.delete(f"{self.dir}/{name}")
            source = meta.get("copied_from") or "another cluster"
            raise StaleEpochError(
                f"stream {self.stream!r} in {self.store.root} is a copy of {source!r} now (promotion epoch "
                f"{meta.get('epoch') or (meta.get('quarantine') or {}).get('epoch', 0)}): this writer "
                f"({self.writer_id}) was deposed and starts no new file in shard {self.shard}; write the stream in "
                f"its source cluster")
        self.files_opened += 1
        return name

    def _claim(self, name: str, *, may_rename: bool = False) -> str:
        """A new file is this writer's only if the lease still holds once it exists and no file
        sorts after it. A writer that stalled past its lease between its last check and
        creating the file (the take-over's recovery could not seal a file that did not exist
        yet) seals its own empty file and stops, so no unfenced file enters the shard. Files
        sorting before ``name`` that appeared since this writer last listed the shard and are
        not sealed are sealed: the recovery seal fences them too. They are a deposed writer's:
        created while this one took over, or named before our last file and created after it
        (a writer that died before its own claim sealed it; no take-over's recovery, which
        seals the newest file, would).

        A file sorting after ours while the lease still holds was created by a deposed writer
        (it named its file after our take-over, then stalled before its own check, which
        fails). With ``may_rename`` (the name is ours to choose) such files are sealed, our
        empty file is sealed unused, and the claim starts over on a file named after them; the
        lease holder goes on where both would otherwise stop. Without it (a name the caller
        planned, e.g. a sink's) this writer stops.

        Returns the name of the claimed file.

        Raises
        ------
        WriterConflictError
            This writer was deposed; the new file is sealed empty.
        LaterFileError
            Without ``may_rename``: a file sorts after ``name``; the new file is sealed empty.
        """
        for _ in range(_CLAIM_ATTEMPTS):
            # Listed before the lease check: a file seen here existed before the check passed, so
            # (as far as the leases tell) its writer did not hold the lease when it created it:
            # one that took the shard over from us first fails our check. The leases can be
            # wrong (a stalled holder of the cache lease takes the store lease back with force,
            # or a wiped metadata cache lets it re-put its record); what keeps acknowledged
            # bytes readable then is the seal, which lands at the file's durable length: the
            # other writer's later appends are refused, never hidden.
            files = self.files()
            later = [f for f in files if f > name]
            try:
                self.check_leases(every=True)
            except LeaseError as exc:
                self.seal()
                raise WriterConflictError(
                    f"{self.what}: new file {self.store.uri(self.dir + '/' + name)} was sealed unused, this "
                    f"writer was deposed: {exc}"
                ) from exc
            # Without a lease (released) nothing says the later file is a deposed writer's.
            if later and not (may_rename and self.leases):
                self.seal()
                raise LaterFileError(
                    f"{self.what}: new file {self.store.uri(self.dir + '/' + name)} was sealed unused: "
                    f"{later[0]} sorts after it"
                )
            if not later:
                break
            log.info("%s: %s sorts after our new file %s but we hold the lease (a deposed writer's file); "
                     "sealing it and ours, and starting a file after it", self.what, ", ".join(later), name)
            # Ours first: if sealing a later file fails (a store error; HDFS refuses a second
            # appender while the deposed writer's stream is open), what stays unsealed is the
            # newest file, which the next take-over's recovery seals. Ours, left unsealed
            # before it, would hold its readers forever.
            self.seal()
            for other in later:
                self._seal_predecessor(other)
            name = self._start_file(self.new_file_name())
        else:
            self.seal()
            raise WriterConflictError(
                f"{self.what}: new file {self.store.uri(self.dir + '/' + name)} was sealed unused: other writers' "
                f"files kept sorting after it ({_CLAIM_ATTEMPTS} attempts)"
            )
        unlisted = [other for other in files if other < name and other not in self._listed]
        self._listed = set(files)
        self._listed.add(name)
        for other in unlisted:
            self._seal_stray(other)
        return name

    @property
    def position(self) -> int:
        """Length of the open file (0 when none is open)."""
        return self.writer.position if self.writer is not None else 0

    def append(self, data: bytes, messages: int, *, more_follows: bool = False) -> int:
        """Append whole blocks holding ``messages`` messages; return the file's new length.

        Opens a new file when none is open; rolls over after the append when the file reached
        ``roll_bytes``. ``more_follows``: another append comes right away, so this one's cache
        writes may overlap it (:meth:`FileWriter.append`); the last of a burst leaves it False,
        unless the caller acknowledges at the durable append (``Producer(acknowledge="durable")``).

        Raises
        ------
        AppendConflictError
            The bytes are not acknowledged (another writer sealed or appended to the file).
        """
        if self.writer is None:
            self.open_new()
        end = self.writer.append(data, messages=(self.next_index, messages), more_follows=more_follows)
        if self.writer.shadows(more_follows):
            self.overlapped_appends += 1
        self.next_index += messages
        if end >= self.roll_bytes:
            self.seal()
        return end

    def roll_if_old(self) -> None:
        """Seal the open file when it is ``roll_seconds`` old (the next append starts a new one)."""
        if self.writer is not None and time.monotonic() - self.opened_at >= self.roll_seconds:
            self.seal()

    def seal(self) -> None:
        """Seal the open file (readers move on at the seal) and close it.

        A file another writer already sealed exactly where this writer's bytes end (its
        recovery seal after taking the shard over) counts as sealed: every byte of this
        writer lies before that seal and was acknowledged, so reporting a conflict here would
        make a caller resend messages readers already have. Whether this writer may go on is
        decided where it next writes (:meth:`open_new` checks the lease).

        Raises
        ------
        AppendConflictError
            The file holds foreign bytes before this writer's end (it is not ours any more).
        """
        if self.writer is None:
            return
        try:
            self.writer.append(encode_seal(self.next_index))
        except AppendConflictError as exc:
            if exc.seal_at != exc.start:
                raise
            log.info("%s: %s was sealed at byte %d, where our bytes end, by another writer (it took the "
                     "shard over); every byte of ours lies before the seal", self.what, self.writer.uri, exc.seal_at)
        finally:
            self._close_writer()

    def close_file(self) -> None:
        """Stop writing the open file without sealing it (its last bytes were a seal already,
        or the writer continues it later)."""
        self._close_writer()

    def seal_file(self, name: str) -> Optional[FileTail]:
        """Seal the shard's file ``name`` where its valid bytes end, unless it is sealed (as a
        recovery seal; for a file this writer will not continue)."""
        if name == self.file:
            self._close_writer()
        return self._seal_predecessor(name)

    def _close_writer(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            finally:
                self.writer = None  # self.file keeps the last file's name (Producer.current_files)

    def close(self, seal: bool = True) -> None:
        """Seal the open file (unless ``seal`` is false) and release the leases."""
        try:
            if seal:
                self.seal()
            else:
                self._close_writer()
        finally:
            self.release()

    def current(self) -> Optional[OpenFile]:
        """The open file, where the next append goes (None when none is open)."""
        if self.writer is None:
            return None
        return OpenFile(self.file, self.writer.position, self.next_index)

    def _log_cache_error(self, what: str, exc: Exception) -> None:
        log.warning("%s: cache write of %s failed, readers use the durable store: %s", self.what, what, exc)
