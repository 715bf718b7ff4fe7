"""Stream, shard and message-file names, and the folder layout of a durable store.

Layout (docs/overview.md section 1, docs/format.md section 1)::

    <root>/<stream>/<shard:05d>/<created UTC %Y%m%dT%H%M%S%fZ>-<writer id>.acs

File names sort chronologically as plain strings, so "the next file of a shard" is simply
the next name in sorted order.
"""

from __future__ import annotations

import datetime as _dt
import re
import secrets
from typing import NamedTuple

from pyspark_acs.errors import InvalidNameError

__all__ = [
    "FILE_SUFFIX",
    "MAX_SHARDS",
    "new_writer_id",
    "next_file_name",
    "parse_file_name",
    "shard_dir",
    "validate_shard",
    "validate_stream",
]

FILE_SUFFIX = ".acs"
#: Shards are folders named with five digits.
MAX_SHARDS = 100_000
_STREAM_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_WRITER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]{0,63}")
_FILE_RE = re.compile(r"(\d{8}T\d{12}Z)-([A-Za-z0-9][A-Za-z0-9_]{0,63})\.acs")
_TIME_FORMAT = "%Y%m%dT%H%M%S%fZ"


def validate_stream(name: object) -> str:
    """Return ``name`` if it is a safe stream name, else raise :class:`InvalidNameError`.

    A stream name is 1-128 characters of letters, digits, ``.``, ``_`` and ``-``, starting
    with a letter or digit (so ``..``, ``/``, empty names and control characters are refused).
    """
    if not isinstance(name, str) or not _STREAM_RE.fullmatch(name):
        shown = repr(name)[:80]
        raise InvalidNameError(
            f"invalid stream name {shown}: use 1-128 characters of letters, digits, '.', '_' or "
            f"'-', starting with a letter or digit (no '/', '..', spaces or control characters)"
        )
    return name


def validate_shard(shard: object, shards: int = MAX_SHARDS) -> int:
    """Return ``shard`` as an int if ``0 <= shard < shards``, else raise :class:`InvalidNameError`."""
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < shards:
        raise InvalidNameError(f"invalid shard {shard!r}: must be an integer in [0, {shards})")
    return shard


def new_writer_id() -> str:
    """A fresh writer id: 16 random hex digits (unique per Producer or copy writer)."""
    return secrets.token_hex(8)


def shard_dir(stream: str, shard: int) -> str:
    """The shard folder relative to the store root: ``<stream>/<shard:05d>``."""
    return f"{validate_stream(stream)}/{validate_shard(shard):05d}"



def file_name(created: _dt.datetime, writer_id: str) -> str:
    """The message-file name for a file created at ``created`` (UTC) by ``writer_id``."""
    if not _WRITER_RE.fullmatch(writer_id):
        raise InvalidNameError(
            f"invalid writer id {writer_id!r}: use 1-64 letters, digits or '_', starting with a letter or digit"
        )
    if created.tzinfo is not None:
        created = created.astimezone(_dt.timezone.utc).replace(tzinfo=None)
    return f"{created.strftime(_TIME_FORMAT)}-{writer_id}{FILE_SUFFIX}"


def next_file_name(existing: "list[str]", writer_id: str, now: "_dt.datetime | None" = None) -> str:
    """The name of a shard's next file: created now, but always sorting after every name in
    ``existing`` (readers follow a shard's files in name order, so a writer whose clock is
    behind the previous writer's must still come after it)."""
    created = now or _dt.datetime.now(_dt.timezone.utc)
    if existing:
        last = parse_file_name(max(existing)).created
        if created <= last:
            created = last + _dt.timedelta(microseconds=1)
    return file_name(created, writer_id)


class FileName(NamedTuple):
    """A parsed message-file name."""

    created: _dt.datetime
    writer_id: str


def parse_file_name(name: str) -> FileName:
    """Parse a message-file base name; raise :class:`InvalidNameError` if it is not one."""
    match = _FILE_RE.fullmatch(name)
    if not match:
        raise InvalidNameError(
            f"{name!r} is not a message file name (<UTC %Y%m%dT%H%M%S%fZ>-<writer id>.acs)"
        )
    try:
        created = _dt.datetime.strptime(match.group(1), _TIME_FORMAT)
    except ValueError as exc:
        raise InvalidNameError(f"{name!r} has an invalid creation time: {exc}") from exc
    return FileName(created.replace(tzinfo=_dt.timezone.utc), match.group(2))
