"""Parsing of byte sizes and durations given as strings (flags, Spark options).

Sizes accept a plain number of bytes or a number with a unit: ``B``, ``KB``/``MB``/``GB``/``TB``
(powers of 1000) and ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024); ``k``, ``m``, ``g`` are
read as the binary units, as Spark does. Durations accept ``us``, ``ms``, ``s``, ``m``/``min``,
``h`` and ``d``; a bare number means seconds for timeouts and intervals. Retentions and TTLs
(``unit_required=True``) refuse a bare number: ``--hot-retention 1`` read as one second would
delete hot copies a user meant to keep for a day, so the unit must be written.

Every duration and size flag and option of the package is read by these two functions.
"""

from __future__ import annotations

import re
from typing import Union

from pyspark_acs.errors import AcsOptionError

__all__ = [
    "format_bytes",
    "format_duration",
    "format_size",
    "parse_bytes",
    "parse_duration",
]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {
    "": 1.0,
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: Union[str, int], *, option: str = "size", minimum: int = 0) -> int:
    """Parse a byte size such as ``"64MiB"``, ``"1gb"`` or ``4096``.

    Raises
    ------
    AcsOptionError
        Naming ``option`` when the value is not a size or is below ``minimum``.
    """
    if isinstance(value, bool):
        raise AcsOptionError(f"{option}: expected a byte size, got {value!r}", option=option)
    if isinstance(value, int):
        result = value
    else:
        match = _NUMBER_UNIT.match(str(value))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _SIZE_UNITS:
            raise AcsOptionError(
                f"{option}: {value!r} is not a byte size; use a number with an optional unit "
                f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '64MiB'",
                option=option,
            )
        result = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if result < minimum:
        raise AcsOptionError(
            f"{option}: {value!r} is too small; it must be at least {minimum} bytes", option=option
        )
    return result


def parse_duration(
    value: Union[str, int, float], *, option: str = "duration", minimum: float = 0.0, unit_required: bool = False
) -> float:
    """Parse a duration such as ``"60s"``, ``"10ms"``, ``"24h"`` or ``0.5`` into seconds.

    With ``unit_required`` (retentions and TTLs) a string without a unit (``"1"``) is refused;
    numbers given as Python ``int``/``float`` are seconds either way.

    Raises
    ------
    AcsOptionError
        Naming ``option`` when the value is not a duration, lacks a required unit or is below
        ``minimum``.
    """
    if isinstance(value, bool):
        raise AcsOptionError(f"{option}: expected a duration, got {value!r}", option=option)
    if isinstance(value, (int, float)):
        result = float(value)
    else:
        match = _NUMBER_UNIT.match(str(value))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _DURATION_UNITS:
            raise AcsOptionError(
                f"{option}: {value!r} is not a duration; use a number with a unit "
                f"(us, ms, s, m, h, d), e.g. '500ms' or '60s'",
                option=option,
            )
        if unit_required and not unit:
            number = match.group(1)
            raise AcsOptionError(
                f"{option}: {value!r} has no unit; add one: '{number}s' for seconds, '{number}h' for hours or "
                f"'{number}d' for days",
                option=option,
            )
        result = float(match.group(1)) * _DURATION_UNITS[unit]
    if result != result:  # NaN compares false with everything, so the minimum check would pass it
        raise AcsOptionError(f"{option}: {value!r} is not a duration", option=option)
    if result < minimum:
        raise AcsOptionError(
            f"{option}: {value!r} is too small; it must be at least {minimum} s", option=option
        )
    return result


def format_bytes(n: float) -> str:
    """Format a byte count for people: ``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_duration(seconds: float) -> str:
    """A duration as :func:`parse_duration` reads it back: ``3600`` -> ``'1h'``, ``0.01`` -> ``'10ms'``."""
    if seconds == 0:
        return "0s"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        count = seconds / size
        if count >= 1 and abs(count - round(count)) < 1e-9:
            return f"{round(count)}{unit}"
    return f"{seconds:g}s"


def format_size(n: int) -> str:
    """A byte size as :func:`parse_bytes` reads it back: ``1 << 20`` -> ``'1MiB'``, ``1000`` -> ``'1000B'``."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"
