"""The cache's byte-carrying messages on the wire, encoded and split by hand.

``GetResponse`` (a batched read) and ``FileBytes`` (a Follow push) are a ``data`` field of
joined values beside a few small per-key fields. Built the generated way, protobuf (upb) copies
``data`` into the message's arena when the message is made and again when it is serialized, and
the reader's parse copies it into an arena and once more into the ``bytes`` that ``.data``
returns. Encoded by hand, the values are copied once, into the body, and :func:`split` hands
``data`` out without parsing it.

The encoding is the message's own protobuf wire format, so the generated code still parses it
(a server answers an older client, and the other way round): the small fields
are serialized by protobuf, then the ``data`` field is appended as one length-delimited
record. Protobuf parsers accept the fields of a message in any order; for a singular field seen
twice, the last one wins, and :func:`split` follows the same rule.

A body :func:`split` does not recognise as that shape goes to the generated parser whole, so
every body is read (or refused, with protobuf's ``DecodeError``) exactly as the generated code
would. Used by the cache server's ``Get`` and ``Follow`` handlers (:func:`encode`, which they return
as bytes: :mod:`pyspark_acs.server.strict` passes bytes through unserialized) and by the cache
client's stubs for those two methods (:func:`split`, as the response deserializer).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, NamedTuple, Tuple, Type

__all__ = [
    "CACHE_MAX_MESSAGE_BYTES",
    "encode",
    "split",
]

#: Largest gRPC message of the cache protocol, either way, for client and server alike: a
#: batched put or get of several MiB of 4 KiB chunks (the client splits batches at 4 MiB;
#: 64 MiB leaves room for callers that do not).
CACHE_MAX_MESSAGE_BYTES = 64 * 1024**2

#: Protobuf wire types (the low three bits of a field's key).
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WithData(NamedTuple):
    """A message split from its ``data`` field: ``message`` holds every other field."""

    message: Any
    data: bytes


_DATA_KEYS: Dict[Type[Any], Tuple[int, bytes]] = {}


def _data_key(message_type: Type[Any]) -> Tuple[int, bytes]:
    """The ``data`` field's number and its encoded key (length-delimited), per message type."""
    known = _DATA_KEYS.get(message_type)
    if known is None:
        number = message_type.DESCRIPTOR.fields_by_name["data"].number
        known = _DATA_KEYS[message_type] = (number, _varint((number << 3) | _LEN))
    return known


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(message: Any, parts: Iterable[bytes], size: int, *, data_first: bool = False) -> bytes:
    """``message`` (every field set but ``data``) with ``data`` = ``parts`` joined, ``size``
    bytes long in all, as one wire-format body: the parts are copied once, into it.

    ``data_first``: the ``data`` record leads the body (for messages with many small records,
    such as a ``PutRequest``'s keys: :func:`split` then finds it without walking them).

    The caller knows ``size`` already (it checked it against its limits); a wrong one makes an
    invalid body, so it is checked here too.
    """
    _, key = _data_key(type(message))
    head = key + _varint(size)
    rest = message.SerializeToString()
    body = b"".join([head, *parts, rest]) if data_first else b"".join([rest, head, *parts])
    if len(body) - len(head) - len(rest) != size:
        raise ValueError(f"encode: parts of {len(body) - len(head) - len(rest)} bytes, not the {size} announced")
    return body


#: Records :func:`split` walks before it leaves a body to the generated parser: our servers send
#: four or five (the small fields, then ``data``); a body of many small records (valid, if odd)
#: would cost a Python loop per record.
MAX_SCANNED_RECORDS = 16


def _read_varint(raw: bytes, pos: int, end: int) -> Tuple[int, int]:
    """The varint at ``pos`` and the position after it; ``(-1, pos)`` when the body ends first
    or it is longer than ten bytes (the caller then leaves the body to protobuf)."""
    value = shift = 0
    while pos < end and shift < 70:
        b = raw[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def _generic(raw: bytes, message_type: Type[Any]) -> WithData:
    """The generated parser's reading of ``raw`` (it raises ``DecodeError`` for a bad body)."""
    message = message_type.FromString(raw)
    return WithData(message, message.data)


def split(raw: bytes, message_type: Type[Any], *, view: bool = False) -> WithData:
    """Parse ``raw`` as ``message_type``, its ``data`` field apart: the inverse of
    :func:`encode`. It reads every body exactly as the generated parser does -- it only finds
    the ``data`` records itself, in the common shapes (a body that starts with its one ``data``
    record, or at most :data:`MAX_SCANNED_RECORDS` records; minimally encoded ``data`` keys and
    lengths, no groups), cuts them out and hands the rest to the generated parser; any other
    body goes to that parser whole.

    ``view``: ``data`` is a memoryview of ``raw`` (no copy) where split found it itself; a body
    left to the generated parser gives ``bytes`` either way. Both join and slice alike.

    Raises
    ------
    google.protobuf.message.DecodeError
        If ``raw`` is not a valid encoding (from the generated parser, for either path).
    """
    number, data_key = _data_key(message_type)
    end = len(raw)
    if raw[: len(data_key)] == data_key:
        # Data first (encode(data_first=True)). The rest is taken as it is only when it holds
        # no data record of its own (protobuf's last one would win): a non-empty one shows in
        # the parsed ``data``, an empty one makes the rest longer than its canonical size.
        length, at = _read_varint(raw, len(data_key), end)
        past = at + length
        if length >= 0 and past <= end and at - len(data_key) == len(_varint(length)):
            rest = message_type.FromString(raw[past:])
            if not rest.data and rest.ByteSize() == end - past:
                return WithData(rest, memoryview(raw)[at:past] if view else raw[at:past])
    pos = 0
    data_at = None  # (first, past) byte of the last data field's value
    cuts = []  # (first, past) byte of each data record, key included
    records = 0
    while pos < end:
        records += 1
        if records > MAX_SCANNED_RECORDS:
            return _generic(raw, message_type)
        start = pos
        key, pos = _read_varint(raw, pos, end)
        wire = key & 7
        if key < 8 or pos - start > 5:  # no field number, cut short, or longer than a key can be
            return _generic(raw, message_type)
        if wire == _LEN:
            length, at = _read_varint(raw, pos, end)
            past = at + length
            if length < 0 or past > end:
                return _generic(raw, message_type)
            if key >> 3 == number:
                if raw[start:pos] != data_key or at - pos != len(_varint(length)):
                    return _generic(raw, message_type)  # padded: the generated parser decides
                data_at = (at, past)
                cuts.append((start, past))
            pos = past
        elif wire == _VARINT:
            value, pos = _read_varint(raw, pos, end)
            if value < 0:
                return _generic(raw, message_type)
        elif wire == _I64:
            pos += 8
        elif wire == _I32:
            pos += 4
        else:  # a group (3, 4) or no wire type at all (6, 7)
            return _generic(raw, message_type)
    if pos > end:  # a fixed-size field cut short
        return _generic(raw, message_type)
    if not cuts:
        return WithData(message_type.FromString(raw), b"")
    if len(cuts) == 1:
        first, past = cuts[0]
        rest = raw[:first] + raw[past:] if past < end else raw[:first]
    else:
        pieces, at = [], 0
        for first, past in cuts:
            pieces.append(raw[at:first])
            at = past
        pieces.append(raw[at:])
        rest = b"".join(pieces)
    data = memoryview(raw)[data_at[0]:data_at[1]] if view else raw[data_at[0]:data_at[1]]
    return WithData(message_type.FromString(rest), data)
