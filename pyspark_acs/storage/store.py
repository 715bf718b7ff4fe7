"""The durable store: append-only message files under a root URI, through ``pyarrow.fs``.

One small interface (:class:`DurableStore`) covers what producers, consumers and the copy
daemon need: append, read a byte range, length, list. A root is anything
:func:`pyarrow.fs.FileSystem.from_uri` accepts (``file:///data/acs``, ``hdfs://nn/acs``,
``s3://bucket/acs``) or a plain local path. Tests and the cache layer wrap it.

Appends need a filesystem that supports them (local files, HDFS); object stores such as S3
cannot append and are refused with a clear error when a writer opens a file.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.fs as pafs

from pyspark_acs.errors import AcsOptionError, RootNotFoundError, StaleEpochError, StoreError, StoreFileNotFoundError
from pyspark_acs.format.names import FILE_SUFFIX, shard_dir, validate_stream

__all__ = [
    "Appender",
    "DurableStore",
    "STREAM_META_FILE",
    "open_store",
    "record_time",
    "record_timestamp",
    "stream_epoch",
]

#: Per-stream metadata file (shard count), beside the shard folders.
STREAM_META_FILE = "_stream.json"
#: Lock file beside it: every change of the metadata file is a read-modify-write under it
#: (:meth:`DurableStore.update_stream_meta`), so two creators cannot both be told a count.
STREAM_LOCK_FILE = "_stream.lock"
#: How long a change of ``_stream.json`` waits for that lock (seconds) before it fails. Its
#: holders hold it for a change, which for a creator includes making every shard folder (50,000
#: folders took 4 s here), so it waits longer than the appends' lock (``LOCK_WAIT_SECONDS``).
STREAM_LOCK_WAIT_S = 30.0
#: How many open input files a store keeps for range reads (tail readers reread the same files).
MAX_OPEN_READ_FILES = 256
#: The form of the times ``_stream.json``'s records carry (a promotion's and a quarantine's
#: ``at``): UTC to the second.
RECORD_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def stream_epoch(meta: Optional[Dict[str, Any]]) -> int:
    """A stream's epoch from its ``_stream.json`` (0: never promoted, or no such stream)."""
    return int((meta or {}).get("epoch") or 0)


def record_time(seconds: Optional[float] = None) -> str:
    """A ``_stream.json`` record's time: now, or ``seconds`` since the epoch."""
    return time.strftime(RECORD_TIME_FORMAT, time.gmtime(seconds))


def record_timestamp(text: str) -> Optional[float]:
    """Seconds since the epoch of a record's time (None when it is not of that form)."""
    try:
        return float(calendar.timegm(time.strptime(text, RECORD_TIME_FORMAT)))
    except (TypeError, ValueError):
        return None


def open_filesystem(uri: str, *, option: str, what: str) -> "tuple[pafs.FileSystem, str]":
    """``(filesystem, base path)`` of a URI (``file://``, ``hdfs://``, ``s3://``, ...) or a local
    path: the one way a store root (hot or secondary tier) is resolved.

    Raises
    ------
    AcsOptionError
        Naming ``option`` when pyarrow cannot open it.
    """
    try:
        if "://" in uri:
            return pafs.FileSystem.from_uri(uri)
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise AcsOptionError(f"{option}: cannot open {what} {uri!r}: {exc}", option=option) from exc


@contextlib.contextmanager
def _translate(what: str, error: type = StoreError, missing: str = "no such file or folder") -> Iterator[None]:
    """Translate pyarrow / OS errors into ``error`` (a StoreError) with the path in the message;
    the one translation of filesystem errors, for the hot store and the secondary tier."""
    try:
        yield
    except StoreError:
        raise
    except FileNotFoundError as exc:
        raise StoreFileNotFoundError(f"{what}: {missing}") from exc
    except (OSError, pa.ArrowException) as exc:
        raise error(f"{what}: {exc}") from exc


class Appender:
    """An open append stream on one message file. Not thread-safe: one writer thread."""

    def __init__(self, store: "DurableStore", rel: str, stream: "pa.NativeFile", position: int) -> None:
        self._store = store
        self.rel = rel
        self._stream = stream
        #: Bytes in the file after the last successful write.
        self.position = position

    def write(self, data: bytes) -> int:
        """Append ``data`` and flush it to the filesystem; return the new file length."""
        with _translate(f"append to {self._store.uri(self.rel)}"):
            self._stream.write(data)
            self._stream.flush()
        self.position += len(data)
        return self.position

    def close(self) -> None:
        """Close the stream (idempotent)."""
        if not self._stream.closed:
            with _translate(f"close {self._store.uri(self.rel)}"):
                self._stream.close()


class DurableStore:
    """Append-only files under one root, through a ``pyarrow.fs.FileSystem``.

    Paths given to methods are relative to the root (``"<stream>/<shard:05d>/<file>"``).

    Parameters
    ----------
    root : str
        A URI or local path. A local root folder is created if missing.
    filesystem : pyarrow.fs.FileSystem, optional
        Use this filesystem with ``root`` as its base path instead of resolving the URI
        (for wrapping, e.g. a SubTreeFileSystem or a test filesystem).
    create : bool
        Create a missing local root folder (writers). Readers and status commands pass False:
        a missing root is then :class:`~pyspark_acs.errors.RootNotFoundError` naming it, not an
        empty store (and no folder is made where a typo points).
    stream_lock_wait_s : float
        How long a change of ``_stream.json`` waits for its lock (default
        :data:`STREAM_LOCK_WAIT_S`).
    lock_wait_s : float, optional
        How long an append or a lease change waits for a lock its holder keeps (stopped or
        hung) before going on without it (default
        :data:`~pyspark_acs.storage.leases.LOCK_WAIT_SECONDS`; tests pass less). Every process
        of a store must use the same value: a lease change that took this long reads again.
        Not carried to other processes (a pickled store has the default).
    """

    def __init__(self, root: str, filesystem: Optional[pafs.FileSystem] = None, *, create: bool = True,
                 stream_lock_wait_s: float = STREAM_LOCK_WAIT_S, lock_wait_s: Optional[float] = None) -> None:
        if not isinstance(root, str) or not root.strip():
            raise AcsOptionError("root: the durable store root must be a non-empty URI or path", option="root")
        self.root = root
        if filesystem is not None:
            self.fs, base = filesystem, root
        else:
            self.fs, base = open_filesystem(root, option="root", what="durable store")
        self.base = base.rstrip("/") or "/"
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self.create = create
        self.stream_lock_wait_s = stream_lock_wait_s
        self.lock_wait_s = lock_wait_s  # None: LOCK_WAIT_SECONDS (leases.lock_wait)
        if not create:
            with _translate(f"stat {root}"):
                kind = self.fs.get_file_info(self.base).type
            if kind == pafs.FileType.NotFound:
                raise RootNotFoundError(
                    f"root: no durable store at {root!r}: {self.base} does not exist; give the root a Producer, "
                    f"`acs produce` or the sink wrote to (a typo?)", root=root, path=self.base)
            if kind != pafs.FileType.Directory:
                raise AcsOptionError(f"root: no durable store at {root!r}: {self.base} is not a folder", option="root")
        elif self.local:
            os.makedirs(self.base, exist_ok=True)
        # _files_lock guards _files (the LRU of open input files shared by reader threads).
        self._files_lock = threading.Lock()
        self._files: "OrderedDict[str, pa.NativeFile]" = OrderedDict()

    def __repr__(self) -> str:
        return f"DurableStore({self.root!r})"

    def __reduce__(self):  # only the root crosses process boundaries; files reopen there
        # A reader's store stays a reader's there: it never creates the root either.
        return (_reopen_store, (self.root, self.create))

    # -- paths -----------------------------------------------------------------------------

    def path(self, rel: str) -> str:
        """Filesystem path of ``rel``."""
        return f"{self.base}/{rel}" if rel else self.base

    def uri(self, rel: str) -> str:
        """A globally unique name of ``rel`` (used for chunk and metadata keys and messages)."""
        scheme = "file" if self.local else self.fs.type_name
        return f"{scheme}://{self.path(rel)}"

    # -- reading ---------------------------------------------------------------------------

    def length(self, rel: str) -> int:
        """Current length in bytes of a file; raises StoreFileNotFoundError if absent."""
        with _translate(f"length of {self.uri(rel)}"):
            info = self.fs.get_file_info(self.path(rel))
        if info.type != pafs.FileType.File:
            raise StoreFileNotFoundError(f"length of {self.uri(rel)}: no such file")
        return int(info.size)

    def lengths(self, rels: Sequence[str]) -> Dict[str, Optional[int]]:
        """Lengths of several files in one call; ``None`` for a missing file."""
        if not rels:
            return {}
        with _translate(f"lengths under {self.root}"):
            infos = self.fs.get_file_info([self.path(r) for r in rels])
        return {r: (int(i.size) if i.type == pafs.FileType.File else None) for r, i in zip(rels, infos)}

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists (a file or a folder)."""
        with _translate(f"stat {self.uri(rel)}"):
            return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def read(self, rel: str, start: int, end: int) -> bytes:
        """Read bytes ``[start, end)`` of a file.

        Returns fewer bytes only if the file is shorter than ``end``.
        """
        if end <= start:
            return b""
        path = self.path(rel)
        for attempt in (0, 1):
            f = self._input_file(path, reopen=attempt == 1)
            with _translate(f"read {self.uri(rel)} bytes [{start}, {end})"):
                data = f.read_at(end - start, start)
            # A handle opened earlier may not see bytes appended since on some filesystems.
            if len(data) == end - start:
                return data
        return data

    def _input_file(self, path: str, reopen: bool = False) -> "pa.NativeFile":
        with self._files_lock:
            f = self._files.get(path)
            if f is not None and not reopen:
                self._files.move_to_end(path)
                return f
        with _translate(f"open {path}"):
            f = self.fs.open_input_file(path)
        # Handles dropped here are not closed explicitly: another thread may be inside
        # read_at on one; the NativeFile closes itself once the last reference goes.
        with self._files_lock:
            self._files.pop(path, None)
            self._files[path] = f
            while len(self._files) > MAX_OPEN_READ_FILES:
                self._files.popitem(last=False)
        return f

    def modified(self, rel: str) -> Optional[float]:
        """When ``rel`` was last written (seconds since the epoch), or None if it does not
        exist or the filesystem does not say."""
        with _translate(f"look at {self.uri(rel)}"):
            info = self.fs.get_file_info(self.path(rel))
        if info.type == pafs.FileType.NotFound or info.mtime is None:
            return None
        return info.mtime.timestamp()

    def read_small(self, rel: str) -> Optional[bytes]:
        """Whole content of a small file, or None if it does not exist."""
        try:
            with _translate(f"read {self.uri(rel)}"):
                with self.fs.open_input_stream(self.path(rel)) as f:
                    return f.read()
        except StoreFileNotFoundError:
            return None

    def list_dir(self, rel: str) -> List[str]:
        """Sorted base names of the entries of a folder ([] if it does not exist)."""
        return sorted(i.base_name for i in self._list_infos(rel))

    def _list_infos(self, rel: str) -> List[pafs.FileInfo]:
        with _translate(f"list {self.uri(rel)}"):
            sel = pafs.FileSelector(self.path(rel), allow_not_found=True, recursive=False)
            return self.fs.get_file_info(sel)

    def list_streams(self) -> List[str]:
        """Streams in this store (folders holding a stream metadata file)."""
        return [s for s in self.list_dir("") if self.exists(f"{s}/{STREAM_META_FILE}")]

    def list_files(self, stream: str, shard: int) -> List[str]:
        """Message files of a shard, oldest first."""
        return [name for name, _ in self.list_file_lengths(stream, shard)]

    def list_file_lengths(self, stream: str, shard: int) -> List[Tuple[str, int]]:
        """Message files of a shard with their lengths in bytes, oldest first (one listing)."""
        infos = self._list_infos(shard_dir(stream, shard))
        return sorted((i.base_name, int(i.size)) for i in infos
                      if i.type == pafs.FileType.File and i.base_name.endswith(FILE_SUFFIX))

    def stream_shards(self, stream: str) -> Optional[int]:
        """Number of shards of ``stream``, or None if the stream does not exist."""
        meta = self.stream_meta(stream)
        return None if meta is None else meta["shards"]

    def writer_shards(self, stream: str) -> Optional[int]:
        """:meth:`stream_shards` for a writer of messages (a Producer, the sink), which a copy
        is refused (see :meth:`create_stream`).

        Raises
        ------
        AcsOptionError
            The stream is a copy the copy daemon keeps (option ``stream``).
        """
        meta = self.stream_meta(stream)
        if meta is None:
            return None
        self._refuse_copy(stream, meta)
        return meta["shards"]

    def _refuse_copy(self, stream: str, meta: Dict[str, Any]) -> None:
        if meta.get("quarantine") and not meta.get("copied_from"):
            raise AcsOptionError(
                f"stream: {stream!r} in {self.root} is taking a promotion's new history (epoch "
                f"{meta['quarantine'].get('epoch')}): another cluster is its source now; Producers and sinks write "
                f"a stream in its source cluster (the topology's 'source')", option="stream")
        if meta.get("copied_from"):
            raise AcsOptionError(
                f"stream: {stream!r} in {self.root} is a copy kept by the copy daemon (copied from cluster "
                f"{meta['copied_from']!r}); Producers and sinks write a stream in its source cluster (the "
                f"topology's 'source'), never in a copy", option="stream"
            )

    def _refuse_own(self, stream: str, meta: Dict[str, Any], copied_from: str) -> None:
        """Refuse to make ``stream`` a copy from ``copied_from`` when it is this cluster's own
        history: no ``copied_from``, and a file in a shard (a Producer or sink wrote it here).
        Marked a copy, its own files would mix with the source's, and a cluster made the
        source (promoted) would silently become a copy again under a stale copy daemon."""
        if not any(self.list_files(stream, shard) for shard in range(meta["shards"])):
            return
        raise AcsOptionError(
            f"stream: {stream!r} in {self.root} holds files written in this cluster (its _stream.json has no "
            f"copied_from), so a copy of it from cluster {copied_from!r} is refused: two histories would mix. "
            f"A Producer or sink wrote here before the copy daemon created the stream, or this cluster is the "
            f"stream's source and the copy tree is wrong: write the stream only in its source cluster (the "
            f"topology's 'source') and remove this cluster's {stream!r}, or fix the topology", option="stream"
        )

    def stream_meta(self, stream: str) -> Optional[Dict[str, Any]]:
        """The stream's metadata file as a dict (``shards``; ``copied_from``: for a copy, the
        cluster it was copied from; ``tier``: :mod:`pyspark_acs.storage.tier_settings`' settings), or
        None if the stream does not exist.

        Raises
        ------
        StoreError
            The file is not such an object (naming it).
        """
        raw = self.read_small(f"{validate_stream(stream)}/{STREAM_META_FILE}")
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
            meta["shards"] = int(meta["shards"])
            return meta
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{self.uri(stream + '/' + STREAM_META_FILE)}: malformed stream metadata: {exc}") from exc

    # -- writing ---------------------------------------------------------------------------

    def create_stream(self, stream: str, shards: int, *, copied_from: Optional[str] = None, epoch: int = 0,
                      promotions: Sequence[Dict[str, Any]] = (), cluster: Optional[str] = None,
                      on_adopt: Optional[Callable[[Dict[str, Any]], Optional[Dict[str, Any]]]] = None) -> int:
        """Create ``stream`` with ``shards`` shards, or check that an existing one matches.

        ``copied_from``: the stream is a copy the copy daemon keeps, copied from that cluster
        (its writer passes it). A writer of messages (Producer, sink: no ``copied_from``) is refused a
        stream that is a copy: its take-over would seal the files being copied, and its own
        files would mix with the source's history.

        ``epoch`` and ``promotions`` (copies only): the parent cluster's promotion count and
        records (:mod:`pyspark_acs.server.copy.promote`). The epoch rule lives here:

        - a copy from an older epoch than this cluster's is refused (:class:`StaleEpochError`:
          its daemon has not seen the promotion);
        - a newer epoch is adopted, records with it, once ``on_adopt(existing)`` passes (it
          returns keys to set, None to remove, or raises: the copy daemon's quarantine,
          :mod:`pyspark_acs.server.copy.quarantine`); a stream that is this
          cluster's own history is refused as a copy (:meth:`_refuse_own`) unless this
          cluster (``cluster``) is the source the promotion deposed;
        - at the same epoch the copy must carry the same promotion (its ``id``); its record
          is taken only when it moves on from ``fenced`` to ``cut``.

        Callers that race to create one stream (producers of several shard counts starting at
        once) are decided by :meth:`update_stream_meta`'s lock: the first one's count stands and
        the others are refused, never told a count the stream does not have.

        Returns the shard count.

        Raises
        ------
        AcsOptionError
            When the shard count disagrees (option ``shards``), or a writer of messages asks
            for a copy (option ``stream``).
        StaleEpochError
            A copy from an older epoch or another promotion, or one this cluster cannot adopt.
        """

        def change(existing: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
            if existing is None:
                for shard in range(shards):
                    self.make_dirs(shard_dir(stream, shard))
                meta: Dict[str, Any] = {"shards": shards, "format": 1}
                if copied_from is not None:
                    meta["copied_from"] = copied_from
                    if epoch:
                        meta.update(epoch=epoch, promotions=list(promotions))
                return meta
            if existing["shards"] != shards:
                raise AcsOptionError(
                    f"shards: stream {stream!r} in {self.root} has {existing['shards']} shards, not {shards}",
                    option="shards",
                )
            if copied_from is None:
                self._refuse_copy(stream, existing)
                return None
            here = stream_epoch(existing)
            ours = list(existing.get("promotions") or [])
            theirs = list(promotions)
            if epoch < here:
                last = ours[-1] if ours else {}
                raise StaleEpochError(
                    f"stream {stream!r} in {self.root} was promoted (epoch {here}: source {last.get('source')!r}"
                    f" since {last.get('at', '?')}); a copy from cluster {copied_from!r} at epoch {epoch} is "
                    f"refused: that cluster's copy daemon runs a topology from before the promotion, or has not "
                    f"been fenced yet while it is under way. Give it the current topology file (its stream's "
                    f"source is {last.get('source')!r})")
            if epoch > here:
                deposed = cluster is not None and any(r.get("previous") == cluster for r in theirs[len(ours):])
                if not existing.get("copied_from") and not deposed:
                    self._refuse_own(stream, existing, copied_from)
                new = dict(existing, copied_from=copied_from, epoch=epoch, promotions=theirs)
                new.update((on_adopt(existing) if on_adopt is not None else None) or {})
                return {k: v for k, v in new.items() if v is not None}  # a key given as None goes
            if existing.get("copied_from") != copied_from and not existing.get("copied_from"):
                self._refuse_own(stream, existing, copied_from)  # this cluster is the source
            if epoch:
                mine, yours = ours[-1] if ours else {}, theirs[-1] if theirs else {}
                if mine.get("id") != yours.get("id"):
                    raise StaleEpochError(
                        f"stream {stream!r} in {self.root}: a copy from cluster {copied_from!r} carries another "
                        f"promotion at epoch {epoch} (to {yours.get('source')!r}) than this cluster's (to "
                        f"{mine.get('source')!r}); two promotions ran at once: run acs promote again for one of them")
                if mine.get("state") == "fenced" and yours.get("state") == "cut":
                    return dict(existing, copied_from=copied_from, promotions=ours[:-1] + [yours])
            if existing.get("copied_from") != copied_from:
                # A copy whose parent changed (the copy tree was rebuilt), or a stream a writer
                # created here and wrote nothing to: say so now.
                return dict(existing, copied_from=copied_from)
            return None

        # The common case, an existing stream that matches, needs no write and so no lock.
        # A newer epoch always writes, and its on_adopt moves files: only under the lock.
        existing = self.stream_meta(stream)
        if existing is not None and epoch <= stream_epoch(existing) and change(existing) is None:
            return existing["shards"]
        return self.update_stream_meta(stream, change)["shards"]

    def update_stream_meta(
        self, stream: str, change: "Callable[[Optional[Dict[str, Any]]], Optional[Dict[str, Any]]]"
    ) -> Dict[str, Any]:
        """Change the stream's metadata file: ``change`` gets the current metadata (None when
        the stream does not exist) and returns what to write, or None to leave it; an exception
        it raises leaves the file as it was. Returns the metadata after the change.

        The read, ``change`` and the write run under the lock file :data:`STREAM_LOCK_FILE`
        (:func:`pyspark_acs.storage.leases.exclusive`), so concurrent changes (creators of one
        stream, the copy daemon marking a copy, ``acs tier``) each see the one before: none is
        lost, and no caller is told a shard count the stream does not have. On filesystems
        without locks (HDFS, object stores) the change runs unlocked, as their other
        read-modify-writes do.

        Raises
        ------
        StoreError
            The metadata file is malformed or cannot be written (naming it), or the lock was
            held for more than ``stream_lock_wait_s`` (naming the lock file).
        """
        from pyspark_acs.storage.leases import exclusive  # leases builds on this module

        rel = f"{validate_stream(stream)}/{STREAM_META_FILE}"
        lock = f"{stream}/{STREAM_LOCK_FILE}"
        with exclusive(self, lock, self.stream_lock_wait_s, warn=False) as locked:
            if self.local and not locked:
                # Going on unlocked would bring back the race the lock exists for.
                raise StoreError(
                    f"{self.uri(lock)}: held by another process for more than {self.stream_lock_wait_s:.0f} s (a "
                    f"stopped or hung creator of stream {stream!r}?); {rel} was not changed")
            current = self.stream_meta(stream)
            new = change(None if current is None else dict(current))
            if new is None:
                if current is None:
                    raise StoreError(f"{self.uri(rel)}: no stream {stream!r} to change")
                return current
            self.write_small(rel, json.dumps(new).encode())
            return new

    def make_dirs(self, rel: str) -> None:
        """Create the folder ``rel`` with its parents (existing folders are fine)."""
        with _translate(f"create folder {self.uri(rel)}"):
            self.fs.create_dir(self.path(rel), recursive=True)

    def write_small(self, rel: str, data: bytes) -> None:
        """Replace a small file's content (write to a temporary name, then move over)."""
        tmp = f"{rel}.tmp-{os.getpid()}-{threading.get_ident()}"
        with _translate(f"write {self.uri(rel)}"):
            if "/" in rel:  # like open_appender, create the folder (a copy target may not have it)
                self.fs.create_dir(self.path(rel.rsplit("/", 1)[0]), recursive=True)
            with self.fs.open_output_stream(self.path(tmp)) as f:
                f.write(data)
            self.fs.move(self.path(tmp), self.path(rel))

    def delete(self, rel: str) -> None:
        """Delete a file (missing is fine)."""
        try:
            with _translate(f"delete {self.uri(rel)}"):
                self.fs.delete_file(self.path(rel))
        except StoreFileNotFoundError:
            pass
        self.forget(rel)

    def move(self, rel: str, to: str) -> None:
        """Move the file ``rel`` to ``to`` (its folder created; a file there is replaced).

        Raises
        ------
        StoreFileNotFoundError
            There is no file ``rel`` (naming it).
        """
        with _translate(f"move {self.uri(rel)} to {self.uri(to)}"):
            if "/" in to:
                self.fs.create_dir(self.path(to.rsplit("/", 1)[0]), recursive=True)
            self.fs.move(self.path(rel), self.path(to))
        self.forget(rel)

    def forget(self, rel: str) -> None:
        """Drop this store's open read handle of ``rel``: the next read opens the file again
        (a file replaced at its path, as a quarantine does, is then read anew)."""
        with self._files_lock:
            self._files.pop(self.path(rel), None)  # closes when unreferenced (see _input_file)

    def open_appender(self, rel: str) -> Appender:
        """Open ``rel`` for appending (created if missing)."""
        path = self.path(rel)
        with _translate(f"open {self.uri(rel)} for append"):
            self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            info = self.fs.get_file_info(path)
            position = int(info.size) if info.type == pafs.FileType.File else 0
            try:
                stream = self.fs.open_append_stream(path, compression=None)
            except (NotImplementedError, pa.ArrowNotImplementedError) as exc:
                raise StoreError(
                    f"{self.root}: the {self.fs.type_name} filesystem cannot append; message files need "
                    f"an appendable store (local folders, HDFS)"
                ) from exc
        return Appender(self, rel, stream, position)

    def close(self) -> None:
        """Close cached input files."""
        with self._files_lock:
            files, self._files = list(self._files.values()), OrderedDict()
        for f in files:
            f.close()


def _reopen_store(root: str, create: bool = True) -> DurableStore:
    return DurableStore(root, create=create)


def open_store(root: "str | DurableStore", *, create: bool = True) -> DurableStore:
    """A :class:`DurableStore` for ``root`` (returned as is if it already is one).

    ``create=False`` (readers, ``acs ls``, status commands): a missing root raises
    :class:`~pyspark_acs.errors.RootNotFoundError` (an :class:`AcsOptionError`) naming it.
    """
    return root if isinstance(root, DurableStore) else DurableStore(root, create=create)
