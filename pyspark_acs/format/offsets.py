"""Consumer positions: per shard, ``{"file": <base name>, "length": <bytes consumed>}``.

An offsets dict covers several streams the way Spark's Kafka source does for topics::

    {"orders": {"0": {"file": "20261122T091242032052Z-5f2c.acs", "length": 4096},
                "1": {"file": "", "length": 0},
                "2": {"file": "20261122T091242032052Z-77ab.acs", "length": 8192, "position": 130}}}

``file == ""`` means "before the first file of the shard". Lengths are always block
boundaries. An offset names the next message to hand out: the first message of the block at
``length``, or, with ``position``, message ``position`` of the file (the ``position`` column)
inside the block at ``length`` -- a reader that stopped in the middle of a batch resumes at the
exact message. Offsets compare by file name (names sort chronologically), then by length, then
by position.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, Mapping, NamedTuple, Tuple, Union

from pyspark_acs.errors import AcsOptionError
from pyspark_acs.format.names import parse_file_name, validate_stream

__all__ = [
    "Offset",
    "OffsetMap",
    "format_offsets",
    "parse_offsets",
    "parse_timestamps",
]


class Offset(NamedTuple):
    """A position in one shard: consumed ``length`` bytes of ``file`` and, of the block at
    ``length``, the messages before message ``position`` of the file (0: none of it)."""

    file: str = ""
    length: int = 0
    #: The file's index of the next message (its ``position`` column), when that message is not
    #: the first of the block at ``length``; 0 otherwise.
    position: int = 0

    def to_json(self) -> Dict[str, Any]:
        """The JSON form: ``{"file": name, "length": bytes}``, with ``"position"`` when not 0."""
        if self.position:
            return {"file": self.file, "length": self.length, "position": self.position}
        return {"file": self.file, "length": self.length}

    @property
    def boundary(self) -> "Offset":
        """The block boundary at or before this offset (the offset without its position)."""
        return Offset(self.file, self.length) if self.position else self

    @classmethod
    def from_json(cls, value: Any, where: str = "offset") -> "Offset":
        """Build an offset from its JSON form, checking it.

        Parameters
        ----------
        value : mapping
            ``{"file": name, "length": bytes, "position": index}``; any key may be left out
            (``""``, 0 and 0).
        where : str
            What the value is, for error messages.

        Raises
        ------
        AcsOptionError
            For other keys, a file that is not a message-file name, or a length or position
            that is not a non-negative integer (or is non-zero with an empty file).
        """
        if not isinstance(value, Mapping) or set(value) - {"file", "length", "position"}:
            raise AcsOptionError(
                f"{where}: expected {{\"file\": name, \"length\": bytes[, \"position\": index]}}, got {value!r}")
        file = value.get("file", "") or ""
        length = value.get("length", 0)
        position = value.get("position", 0)
        if not isinstance(file, str) or (file and _bad_file(file)):
            raise AcsOptionError(f"{where}: {file!r} is not a message file name")
        for key, number in (("length", length), ("position", position)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0 or (not file and number):
                raise AcsOptionError(
                    f"{where}: {key} must be a non-negative integer (0 when file is empty), got {number!r}")
        return cls(file, length, position)


def _bad_file(name: str) -> bool:
    try:
        parse_file_name(name)
        return False
    except ValueError:
        return True


#: (stream, shard) -> Offset
OffsetMap = Dict[Tuple[str, int], Offset]


def _shard_entries(value: Union[str, Mapping[str, Any]], option: str, what: str) -> Iterator[Tuple[str, int, Any]]:
    """``(stream, shard, entry)`` of a per-shard JSON object ``{stream: {shard: entry}}`` (or its
    text), checking the stream names and shard numbers; ``what`` describes an entry."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise AcsOptionError(f"{option}: not valid JSON: {exc}", option=option) from exc
    if not isinstance(value, Mapping):
        raise AcsOptionError(f"{option}: expected a JSON object {{stream: {{shard: {what}}}}}", option=option)
    for stream, shards in value.items():
        try:
            validate_stream(stream)
        except ValueError as exc:
            raise AcsOptionError(f"{option}: {exc}", option=option) from exc
        if not isinstance(shards, Mapping):
            raise AcsOptionError(f"{option}: stream {stream!r} must map shard numbers to {what}", option=option)
        for shard, entry in shards.items():
            try:
                shard_i = int(shard)
                if shard_i < 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise AcsOptionError(f"{option}: {stream}/{shard!r} is not a shard number", option=option) from None
            yield stream, shard_i, entry


def parse_offsets(value: Union[str, Mapping[str, Any]], *, option: str = "offsets") -> OffsetMap:
    """Parse an offsets dict (or its JSON text) into ``{(stream, shard): Offset}``.

    Raises
    ------
    AcsOptionError
        Naming ``option`` and the bad entry.
    """
    result: OffsetMap = {}
    for stream, shard, off in _shard_entries(value, option, '{"file": ..., "length": ...}'):
        try:
            result[(stream, shard)] = Offset.from_json(off, f"{option}: {stream}/{shard}")
        except AcsOptionError as exc:
            raise AcsOptionError(str(exc), option=option) from None
    return result


def parse_timestamps(value: Union[str, Mapping[str, Any]], *, option: str = "timestamps") -> Dict[Tuple[str, int], int]:
    """Parse per-shard timestamps ``{stream: {shard: milliseconds since the epoch}}`` (or the
    JSON text), as Kafka's ``startingOffsetsByTimestamp``, into ``{(stream, shard): ms}``.

    Raises
    ------
    AcsOptionError
        Naming ``option`` and the bad entry.
    """
    result: Dict[Tuple[str, int], int] = {}
    for stream, shard, ms in _shard_entries(value, option, "milliseconds since the epoch"):
        if isinstance(ms, bool) or not isinstance(ms, int) or ms < 0:
            raise AcsOptionError(
                f"{option}: {stream}/{shard}: {ms!r} is not a timestamp; give milliseconds since the epoch (>= 0)",
                option=option,
            )
        result[(stream, shard)] = ms
    return result


def format_offsets(offsets: OffsetMap) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """``{(stream, shard): Offset}`` -> the JSON-able dict (sorted, stable)."""
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for (stream, shard), off in sorted(offsets.items()):
        out.setdefault(stream, {})[str(shard)] = off.to_json()
    return out
