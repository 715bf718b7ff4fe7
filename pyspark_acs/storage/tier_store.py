"""The secondary store: objects written once and read by range, through ``pyarrow.fs``."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple

import pyarrow as pa
import pyarrow.fs as pafs

from pyspark_acs.errors import AcsOptionError, StoreError, StoreFileNotFoundError, TierUploadError
from pyspark_acs.storage.store import _translate as _store_translate, open_filesystem

__all__ = [
    "TierStore",
    "public_uri",
]

#: Open input files a reader keeps on the secondary store.
MAX_OPEN_OBJECTS = 64


def _translate(what: str, error: type = StoreError) -> "contextlib.AbstractContextManager[None]":
    """The store's one translation of filesystem errors, for objects of the secondary tier."""
    return _store_translate(what, error, missing="no such object")


def public_uri(uri: str) -> str:
    """``uri`` without its query and ``user:secret@`` part (credentials may sit in either)."""
    uri = uri.split("?", 1)[0]
    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


class TierStore:
    """Objects in a secondary store (write once, read by range), through ``pyarrow.fs``.

    Parameters
    ----------
    uri : str
        Anything :func:`pyarrow.fs.FileSystem.from_uri` accepts: ``s3://bucket/prefix`` (add
        ``?endpoint_override=host:port&scheme=http`` for an S3-compatible server),
        ``gs://bucket/prefix``, ``file:///path``, or a plain local path.
    """

    def __init__(self, uri: str) -> None:
        if not isinstance(uri, str) or not uri.strip():
            raise AcsOptionError("tier uri: the secondary store must be a non-empty URI or path", option="uri")
        self.uri_root = uri
        self.fs, base = open_filesystem(uri, option="uri", what="secondary store")
        self.base = base.rstrip("/")
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self._lock = threading.Lock()  # guards _files and _stats
        self._files: "OrderedDict[str, pa.NativeFile]" = OrderedDict()
        self._stats = {"tier_requests": 0, "tier_bytes": 0}

    def __repr__(self) -> str:
        return f"TierStore({self.where()!r})"

    def where(self) -> str:
        """The URI without credentials and query, for messages."""
        return public_uri(self.uri_root)

    def check(self) -> None:
        """Reach the store once: a local folder is created; an object store's bucket must exist.

        Raises
        ------
        AcsOptionError
            The endpoint cannot be reached or the bucket does not exist (names the URI).
        """
        if self.local:
            os.makedirs(self.base, exist_ok=True)
            return
        bucket = self.base.split("/", 1)[0]
        try:
            kind = self.fs.get_file_info(bucket).type
        except (OSError, pa.ArrowException) as exc:
            raise AcsOptionError(f"tier uri: cannot reach secondary store {self.where()}: {exc}", option="uri") from exc
        if kind != pafs.FileType.Directory:
            raise AcsOptionError(f"tier uri: bucket {bucket!r} of {self.where()} does not exist; create it first",
                                 option="uri")

    def path(self, key: str) -> str:
        """Filesystem path of object ``key``."""
        return f"{self.base}/{key}"

    def put(self, key: str, parts: Iterable[bytes]) -> int:
        """Write object ``key`` from ``parts`` (large objects go up as a multipart upload: an
        S3 object appears only when the upload completes). Returns the bytes written.

        Raises
        ------
        TierUploadError
            Any failure: the object may be absent, partial or complete (ambiguous).
        """
        n = 0
        with _translate(f"upload {self.where()}/{key}", TierUploadError):
            if self.local:
                self.fs.create_dir(self.path(key).rsplit("/", 1)[0], recursive=True)
            with self.fs.open_output_stream(self.path(key)) as out:
                for part in parts:
                    out.write(part)
                    n += len(part)
        return n

    def read(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of object ``key`` (one ranged request)."""
        if end <= start:
            return b""
        path = self.path(key)
        with self._lock:
            f = self._files.get(path)
            if f is not None:
                self._files.move_to_end(path)
        with _translate(f"read {self.where()}/{key} bytes [{start}, {end})"):
            if f is None:
                f = self.fs.open_input_file(path)
                with self._lock:
                    self._files[path] = f
                    while len(self._files) > MAX_OPEN_OBJECTS:
                        self._files.popitem(last=False)
            data = f.read_at(end - start, start)
        with self._lock:
            self._stats["tier_requests"] += 1
            self._stats["tier_bytes"] += len(data)
        return data

    def size(self, key: str) -> Optional[int]:
        """The object's size in bytes, ``None`` if absent."""
        with _translate(f"stat {self.where()}/{key}"):
            info = self.fs.get_file_info(self.path(key))
        return int(info.size) if info.type == pafs.FileType.File else None

    def delete(self, key: str) -> None:
        """Delete object ``key`` (absent is fine)."""
        with self._lock:
            self._files.pop(self.path(key), None)
        try:
            with _translate(f"delete {self.where()}/{key}"):
                self.fs.delete_file(self.path(key))
        except StoreFileNotFoundError:
            pass

    def list(self, prefix: str) -> List[Tuple[str, int, Optional[float]]]:
        """``(key, size, mtime seconds or None)`` of every object under ``prefix``."""
        with _translate(f"list {self.where()}/{prefix}"):
            sel = pafs.FileSelector(self.path(prefix), allow_not_found=True, recursive=True)
            infos = self.fs.get_file_info(sel)
        out = []
        for i in infos:
            if i.type != pafs.FileType.File:
                continue
            mtime = i.mtime.timestamp() if i.mtime is not None else None
            out.append((i.path[len(self.base) + 1:], int(i.size), mtime))
        return sorted(out)

    def stats(self) -> Dict[str, int]:
        """``tier_requests`` (ranged reads) and ``tier_bytes`` read since creation."""
        with self._lock:
            return dict(self._stats)
