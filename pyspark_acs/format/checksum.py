"""The checksum of message files: CRC-32, zlib's (the ISO-HDLC polynomial), in one place.

Block headers and bodies carry it (:mod:`pyspark_acs.format.block`), the copy daemon checks
each copied block's body with it, and the tier mover compares whole files with it. Every
reader checks every block it decodes, so it runs on every byte a consumer receives and a
producer writes.

It is computed with ISA-L (the ``isal`` package, a dependency) where that imports, and with
:func:`zlib.crc32` otherwise: the same values either way (ISA-L's ``crc32`` is a drop-in for
zlib's), so files written with one are read with the other; ISA-L is about twenty times
faster.
"""

from __future__ import annotations

import zlib
from typing import Callable

__all__ = [
    "crc32",
]

try:  # ISA-L's SIMD CRC-32 (python-isal), the values of zlib.crc32
    from isal.isal_zlib import crc32 as _crc32
    FAST = True
except ImportError:  # pragma: no cover - isal is a dependency; a platform without its wheel
    _crc32 = zlib.crc32
    FAST = False

#: ``crc32(data, value=0)``: zlib's CRC-32 of ``data`` (any bytes-like object), continuing from
#: ``value`` (a running checksum over several pieces), as an unsigned 32-bit int.
crc32: Callable[..., int] = _crc32
