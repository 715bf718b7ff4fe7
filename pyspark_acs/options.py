"""One frozen options dataclass per component, parsed once from strings.

A component declares its options as a frozen dataclass whose fields carry an
:func:`option` marker: the external name (Spark-style camelCase for DataSource
options, snake_case elsewhere), a parser from string, and a one-line help text.
:func:`parse_options` builds the dataclass from a ``Mapping[str, str]`` (Spark options,
CLI flags), matching names case-insensitively as Spark does and refusing unknown keys with
a message that lists the valid ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any, Callable, Mapping, Optional, Type, TypeVar

from pyspark_acs.errors import AcsOptionError
from pyspark_acs.units import parse_bytes, parse_duration

__all__ = [
    "bytes_parser",
    "choice_parser",
    "describe_options",
    "duration_parser",
    "flag_type",
    "nearest_name",
    "option",
    "parse_bool",
    "parse_int",
    "parse_options",
    "parse_str",
    "unknown_option_error",
]

T = TypeVar("T")
_MISSING = dataclasses.MISSING


def option(
    name: str,
    default: Any = _MISSING,
    *,
    parse: Callable[[str, str], Any],
    doc: str = "",
    required: bool = False,
) -> Any:
    """Declare a dataclass field as an option called ``name``.

    ``parse(value, name)`` turns the string value into the field's type and raises
    :class:`AcsOptionError` naming ``name`` when it cannot.
    """
    meta = {"acs_name": name, "acs_parse": parse, "acs_doc": doc, "acs_required": required}
    if default is _MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _fields(cls: type) -> dict:
    return {f.metadata["acs_name"].lower(): f for f in dataclasses.fields(cls) if "acs_name" in f.metadata}


def nearest_name(key: str, names) -> Optional[str]:
    """The name in ``names`` closest to ``key`` (case-insensitive), or ``None`` when none is close.

    Used to say "did you mean ..." for a misspelt option or flag.
    """
    by_lower = {str(n).lower(): n for n in names}
    found = difflib.get_close_matches(str(key).lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[found[0]] if found else None


def unknown_option_error(component: str, key: str, names) -> AcsOptionError:
    """The error for an unknown option ``key``: the nearest valid name, then all of them."""
    nearest = nearest_name(key, names)
    hint = f" (did you mean {nearest!r}?)" if nearest else ""
    valid = ", ".join(sorted(names))
    return AcsOptionError(f"{component}: unknown option {key!r}{hint}; valid options are: {valid}", option=str(key))


def parse_options(cls: Type[T], raw: Mapping[str, Any], *, component: str) -> T:
    """Build ``cls`` from string options.

    Parameters
    ----------
    cls : type
        A frozen dataclass whose fields were declared with :func:`option`.
    raw : Mapping[str, str]
        The options; names match case-insensitively. Values that are not strings are passed
        through the parser as they are (``None`` means "not given").
    component : str
        Named in error messages, e.g. ``"acs source"``.

    Raises
    ------
    AcsOptionError
        For an unknown name (with the nearest valid one and the list of all), a missing required option or a bad value.
    """
    fields = _fields(cls)
    kwargs = {}
    for key, value in raw.items():
        f = fields.get(str(key).lower())
        if f is None:
            raise unknown_option_error(component, str(key), [f.metadata["acs_name"] for f in fields.values()])
        if value is None:
            continue
        name = f.metadata["acs_name"]
        kwargs[f.name] = f.metadata["acs_parse"](value, name)
    for f in fields.values():
        if f.metadata["acs_required"] and f.name not in kwargs:
            name = f.metadata["acs_name"]
            raise AcsOptionError(
                f"{component}: option {name!r} is required ({f.metadata['acs_doc']})", option=name
            )
    return cls(**kwargs)


def describe_options(cls: type) -> str:
    """One line per option: name, default and help; for docs and ``--help``."""
    lines = []
    for f in dataclasses.fields(cls):
        if "acs_name" not in f.metadata:
            continue
        default = "required" if f.metadata["acs_required"] else f"default {f.default!r}"
        lines.append(f"{f.metadata['acs_name']} ({default}): {f.metadata['acs_doc']}")
    return "\n".join(lines)


def flag_type(parse: Callable[[Any, str], Any], flag: str) -> Callable[[str], Any]:
    """An argparse ``type=`` running ``parse(text, flag)``; an :class:`AcsOptionError` becomes
    argparse's usage error (exit 2), which names the flag once ("argument --flag: ...")."""

    def convert(text: str) -> Any:
        try:
            return parse(text, flag)
        except AcsOptionError as exc:
            message = str(exc)
            if message.startswith(f"{flag}: "):
                message = message[len(flag) + 2:]
            raise argparse.ArgumentTypeError(message) from exc

    convert.__name__ = flag.lstrip("-")
    return convert


# -- parsers: (value, option name) -> typed value --------------------------------------------


def parse_str(value: Any, name: str) -> str:
    """Any string; empty is refused."""
    text = str(value).strip()
    if not text:
        raise AcsOptionError(f"{name}: must not be empty", option=name)
    return text


def parse_bool(value: Any, name: str) -> bool:
    """``true``/``false`` (any case), also ``1``/``0``, ``yes``/``no``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise AcsOptionError(f"{name}: {value!r} is not a boolean; use true or false", option=name)


def parse_int(minimum: Optional[int] = None, maximum: Optional[int] = None) -> Callable[[Any, str], int]:
    """A parser for whole numbers within ``[minimum, maximum]``."""

    def parse(value: Any, name: str) -> int:
        try:
            result = int(str(value).strip())
        except ValueError:
            raise AcsOptionError(f"{name}: {value!r} is not a whole number", option=name) from None
        if (minimum is not None and result < minimum) or (maximum is not None and result > maximum):
            lo = "" if minimum is None else f">= {minimum}"
            hi = "" if maximum is None else f"<= {maximum}"
            raise AcsOptionError(
                f"{name}: {result} is out of range; it must be {' and '.join(x for x in (lo, hi) if x)}",
                option=name,
            )
        return result

    return parse


def bytes_parser(minimum: int = 0) -> Callable[[Any, str], int]:
    """A parser for byte sizes (``"64MiB"``) of at least ``minimum`` bytes."""

    def parse(value: Any, name: str) -> int:
        return parse_bytes(value, option=name, minimum=minimum)

    parse.acs_kind = "bytes"  # type: ignore[attr-defined] # how describe_options shows a default
    return parse


def duration_parser(minimum: float = 0.0, *, unit_required: bool = False) -> Callable[[Any, str], float]:
    """A parser for durations (``"10ms"``) into seconds; a bare number is seconds, or refused with
    ``unit_required`` (retentions and TTLs, see :mod:`pyspark_acs.units`)."""

    def parse(value: Any, name: str) -> float:
        return parse_duration(value, option=name, minimum=minimum, unit_required=unit_required)

    parse.acs_kind = "duration"  # type: ignore[attr-defined]
    return parse


def choice_parser(*choices: str) -> Callable[[Any, str], str]:
    """A parser that accepts one of ``choices`` (case-insensitive) and returns it lower-cased."""

    def parse(value: Any, name: str) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise AcsOptionError(
                f"{name}: {value!r} is not allowed; use one of: {', '.join(choices)}", option=name
            )
        return text

    return parse
