"""One frozen options dataclass per component, parsed once from strings.

A component declares its options as a frozen dataclass whose fields carry an
:func:`option` marker: the external name (Spark-style camelCase for DataSource
options, snake_case elsewhere), a parser from string, and a one-line help text.
:func:`parse_options` builds the dataclass from a ``Mapping[str, str]`` (Spark options,
CLI flags), matching names case-insensitively as Spark does and refusing unknown keys with
a message that lists the valid ones.

:data:`REFERENCE` names every component's options dataclass; the tables of README.md
("Settings reference") and docs/*.md are rendered from them by :func:`describe_options`, between
``<!-- options: module.Class style -->`` and ``<!-- /options -->``. After changing a declaration,
regenerate them with ``python -m pyspark_acs.options --write-docs`` (``--check`` only compares;
with no flag, every component's reference is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Type, TypeVar

from pyspark_acs.errors import AcsOptionError
from pyspark_acs.units import format_duration, format_size, parse_bytes, parse_duration

__all__ = [
    "add_option_flags",
    "bytes_parser",
    "choice_parser",
    "describe_options",
    "duration_parser",
    "flag_of",
    "flag_type",
    "nearest_name",
    "option",
    "options_from_flags",
    "parse_bool",
    "parse_int",
    "parse_options",
    "parse_str",
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
    flag: Optional[str] = None,
    metavar: Optional[str] = None,
    many: bool = False,
    shown: Optional[str] = None,
) -> Any:
    """Declare a dataclass field as an option called ``name``.

    ``parse(value, name)`` turns the string value into the field's type and raises
    :class:`AcsOptionError` naming ``name`` when it cannot.

    The rest shapes the command-line flag :func:`add_option_flags` makes of it: ``flag``
    (default ``--`` and the name in kebab case), ``metavar``, ``many`` (a repeatable flag, or a
    comma-separated list in a string mapping; the field holds a tuple) and ``shown``, the
    default as the reference states it when the value alone does not say it (e.g. a default
    that depends on another option).
    """
    meta = {"acs_name": name, "acs_parse": parse, "acs_doc": doc, "acs_required": required, "acs_flag": flag,
            "acs_metavar": metavar, "acs_many": many, "acs_shown": shown}
    if default is _MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _fields(cls: type) -> dict:
    return {f.metadata["acs_name"].lower(): f for f in dataclasses.fields(cls) if "acs_name" in f.metadata}


def _declared(cls: type) -> list:
    return [f for f in dataclasses.fields(cls) if "acs_name" in f.metadata]


def _parse_value(f: dataclasses.Field, value: Any, name: str) -> Any:
    parse = f.metadata["acs_parse"]
    if not f.metadata.get("acs_many"):
        return parse(value, name)
    items = value if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v.strip()]
    return tuple(parse(v, name) for v in items)


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


def parse_options(cls: Type[T], raw: Mapping[str, Any], *, component: str, none_given: bool = False) -> T:
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
    none_given : bool
        ``None`` is a value given (and checked by the parser) rather than "not given": for
        Python APIs whose every argument has a default of its own.

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
        if value is None and not none_given:
            continue
        kwargs[f.name] = _parse_value(f, value, f.metadata["acs_name"])
    for f in fields.values():
        if f.metadata["acs_required"] and f.name not in kwargs:
            name = f.metadata["acs_name"]
            raise AcsOptionError(
                f"{component}: option {name!r} is required ({f.metadata['acs_doc']})", option=name
            )
    return cls(**kwargs)


def default_text(f: dataclasses.Field) -> str:
    """An option's default as the reference states it: ``required``, ``64MiB``, ``10s``, ``none``."""
    if f.metadata.get("acs_shown"):
        return f.metadata["acs_shown"]
    if f.metadata["acs_required"]:
        return "required"
    default = f.default
    if default is None or default == ():
        return "none"
    kind = getattr(f.metadata["acs_parse"], "acs_kind", None)
    if kind == "bytes" and isinstance(default, int):
        return format_size(default)
    if kind == "duration" and isinstance(default, (int, float)):
        return format_duration(default)
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, tuple):
        return "/".join(str(x) for x in default)
    return str(default)


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a declared option: ``--`` and the name in kebab case."""
    if f.metadata.get("acs_flag"):
        return f.metadata["acs_flag"]
    name = re.sub(r"(?<=[a-z0-9])([A-Z])", r"-\1", f.metadata["acs_name"]).replace("_", "-").lower()
    return f"--{name}"


def describe_options(cls: type, style: str = "text") -> str:
    """The reference of ``cls``'s options, rendered from their declarations.

    ``style`` ``"text"``: one line per option, ``name (default X): doc``; ``"rst"``: a numpydoc
    style list (``name : default X`` then the indented doc), for docstrings; ``"markdown"``: a
    table ``| name | default | meaning |``; ``"flags"``: as ``"markdown"`` with the flags.
    """
    rows = [(f.metadata["acs_name"], flag_of(f), default_text(f), f.metadata["acs_doc"]) for f in _declared(cls)]
    if style == "text":
        return "\n".join(f"{name} ({'required' if d == 'required' else f'default {d}'}): {doc}"
                         for name, _, d, doc in rows)
    if style == "rst":
        out = []
        shown = {f.metadata["acs_name"]: bool(f.metadata.get("acs_shown")) for f in _declared(cls)}
        for name, _, d, doc in rows:
            head = d if d == "required" else "optional" if d == "none" else d if shown[name] else f"``{d}``"
            out.append(f"{name} : {head}")
            out.extend("    " + line for line in textwrap.wrap(doc, 88))
        return "\n".join(out)
    if style in ("markdown", "flags"):
        head = "| flag | default | meaning |" if style == "flags" else "| name | default | meaning |"
        out = [head, "|---|---|---|"]
        for name, flag, d, doc in rows:
            cell = doc.replace("|", "\\|")
            out.append(f"| `{flag if style == 'flags' else name}` | {d} | {cell} |")
        return "\n".join(out)
    raise ValueError(f"describe_options: style {style!r} is not text, rst, markdown or flags")


#: Every component that takes settings: (title, its options dataclass as ``module.Class``, the
#: style its table has in README.md's settings reference). Named as strings: the components import
#: this module. The daemons set theirs as flags, so their tables show the flags.
REFERENCE = (
    ("Producer", "pyspark_acs.write.producer.ProducerOptions", "markdown"),
    ("Consumer", "pyspark_acs.read.consumer.ConsumerOptions", "markdown"),
    ("Spark source", "pyspark_acs.datasource.options.SourceOptions", "markdown"),
    ("Spark sink", "pyspark_acs.datasource.options.SinkOptions", "markdown"),
    ("acs-cache-server", "pyspark_acs.server.cache.options.CacheServerOptions", "flags"),
    ("acs-copy-daemon", "pyspark_acs.server.copy.options.CopyDaemonOptions", "markdown"),
    ("acs-tier-mover", "pyspark_acs.server.tier.options.TierMoverOptions", "flags"),
    ("Tier settings", "pyspark_acs.storage.tier_settings.TierSettings", "markdown"),
)
#: A table rendered from an options dataclass in a Markdown file: the marker naming the class
#: and style, the table, the end marker.
OPTION_TABLE = re.compile(r"(<!-- options: (\S+) (\w+) -->\n)(.*?)(\n<!-- /options -->)", re.S)
#: The command that regenerates the tables (named in the docs test's failure message).
WRITE_DOCS_COMMAND = "python -m pyspark_acs.options --write-docs"


def declared_class(path: str) -> type:
    """The options dataclass named ``module.Class``."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def render_option_tables(text: str) -> str:
    """``text`` (Markdown) with every marked options table rendered afresh from its declarations."""
    return OPTION_TABLE.sub(
        lambda m: m.group(1) + describe_options(declared_class(m.group(2)), m.group(3)) + m.group(5), text)


def _doc_files(root: Path) -> List[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m pyspark_acs.options``: print every component's reference, or (``--write-docs``)
    rewrite the option tables of README.md and docs/*.md from the declarations, or (``--check``)
    exit 1 naming the files whose tables differ from them."""
    parser = argparse.ArgumentParser(prog="python -m pyspark_acs.options",
                                     description="The options reference of every component, from the declarations.")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write-docs", action="store_true", help="rewrite the option tables in README.md and docs/*.md")
    what.add_argument("--check", action="store_true", help="exit 1 if a table in README.md or docs/*.md is stale")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout holding README.md and docs/ (default: this package's)")
    parser.add_argument("--style", default="text", choices=("text", "markdown", "flags", "rst"),
                        help="how the printed reference is rendered (default text)")
    args = parser.parse_args(argv)
    if not (args.write_docs or args.check):
        for title, path, _ in REFERENCE:
            print(f"{title} ({path})\n{describe_options(declared_class(path), args.style)}\n")
        return 0
    stale = []
    for doc in _doc_files(Path(args.root)):
        text = doc.read_text(encoding="utf-8")
        fresh = render_option_tables(text)
        if fresh != text:
            stale.append(str(doc))
            if args.write_docs:
                doc.write_text(fresh, encoding="utf-8")
    verb = "rewrote" if args.write_docs else "stale (run " + WRITE_DOCS_COMMAND + "):"
    for doc in stale:
        print(f"{verb} {doc}")
    return 1 if stale and args.check else 0


def add_option_flags(parser: Any, cls: type, *, only: Optional[Sequence[str]] = None,
                     exclude: Sequence[str] = (), shown: Mapping[str, str] = {},
                     former: Mapping[str, str] = {}) -> None:
    """Add one argparse flag per option of ``cls`` (or of the fields named in ``only``).

    Each flag's help is the option's doc and default, its value is parsed by the option's parser
    at argparse time (a bad value is a usage error naming the flag), a boolean option is a
    switch (``--name``, and ``--no-name`` too when it is on by default), a ``many`` option is
    repeatable, and a required option is a required flag. A flag not given leaves ``None``:
    :func:`options_from_flags` then takes the declared default, unless the command resolves it
    otherwise; ``shown`` (field name -> text) then states that default in the help instead.
    ``former`` (field name -> flag) keeps a renamed flag working under its old name, parsed
    alike and left out of the help.
    """
    for f in _declared(cls):
        if (only is not None and f.name not in only) or f.name in exclude:
            continue
        flag = flag_of(f)
        d = shown.get(f.name) or default_text(f)
        doc = f.metadata["acs_doc"]
        quiet = d in ("required", "none") or "(default" in doc or (f.metadata["acs_parse"] is parse_bool and d == "false")
        help_text = (doc if quiet else f"{doc} (default {d})").replace("%", "%%")
        kw: Dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        choices = getattr(f.metadata["acs_parse"], "acs_choices", None)
        if f.metadata["acs_parse"] is parse_bool:
            # A switch that is on by default needs its --no- form to be turned off at all.
            kw["action"] = argparse.BooleanOptionalAction if f.default is True else "store_true"
        elif choices:  # argparse lists them in usage and refuses others ("invalid choice")
            kw["choices"] = choices
        else:
            kw["type"] = flag_type(f.metadata["acs_parse"], flag)
            kw["metavar"] = f.metadata.get("acs_metavar") or _metavar(f)
            if f.metadata.get("acs_many"):
                kw["action"] = "append"
        if f.metadata["acs_required"]:
            kw["required"] = True
        parser.add_argument(flag, **kw)
        if f.name in former:
            old = former[f.name]
            if "type" in kw:  # its errors name the flag as typed
                kw["type"] = flag_type(f.metadata["acs_parse"], old)
            parser.add_argument(old, **{**kw, "help": argparse.SUPPRESS, "required": False})


def _metavar(f: dataclasses.Field) -> str:
    kind = getattr(f.metadata["acs_parse"], "acs_kind", None)
    return {"bytes": "SIZE", "duration": "DURATION"}.get(kind, f.name.upper())


def options_from_flags(cls: Type[T], args: Any, **values: Any) -> T:
    """``cls`` from the flags :func:`add_option_flags` added (already parsed by argparse); a flag
    not given keeps the declared default. ``values`` set fields that no flag gave."""
    kwargs = {}
    for f in _declared(cls):
        value = getattr(args, f.name, None)
        # False is given only by the --no- form of a switch that is on by default.
        if value is not None and (value is not False or f.default is True):
            kwargs[f.name] = tuple(value) if f.metadata.get("acs_many") else value
    kwargs.update(values)
    return cls(**kwargs)


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


def choice_parser(*choices: str, upper: bool = False) -> Callable[[Any, str], str]:
    """A parser that accepts one of ``choices`` (case-insensitive) and returns it lower-cased
    (upper-cased with ``upper``, for choices such as log levels)."""

    def parse(value: Any, name: str) -> str:
        text = str(value).strip().lower()
        if text not in [c.lower() for c in choices]:
            raise AcsOptionError(
                f"{name}: {value!r} is not allowed; use one of: {', '.join(choices)}", option=name
            )
        return text.upper() if upper else text

    parse.acs_choices = choices  # type: ignore[attr-defined] # the flag's metavar lists them
    return parse


if __name__ == "__main__":  # pragma: no cover
    # Run as `python -m pyspark_acs.options`: this file is __main__; the components import
    # `pyspark_acs.options`, so run that module's main (one set of parsers, one REFERENCE).
    from pyspark_acs.options import main as _main

    sys.exit(_main())
