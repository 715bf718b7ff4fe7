"""The acs sink's options checked on the driver at ``writeStream...start()``.

Spark calls a Python data source's ``streamWriter`` only once the query runs, in its stream
execution thread: a misspelt sink option would surface at ``awaitTermination`` inside the
query's failure. No Python code of the source runs while ``start()`` executes, so
:func:`install` wraps pyspark's (classic) ``DataStreamWriter``: ``format``/``option``/
``options`` also keep what they were given, and ``start()`` parses the acs sink's options
first and raises :class:`~pyspark_acs.errors.AcsOptionError` naming the option (and the
nearest valid name) before the query exists. Other formats pass through untouched.

It is installed when :mod:`pyspark_acs.datasource` is imported (``pyspark_acs.register``
imports it). Spark Connect's writer is another class and is not wrapped: there the error
arrives with the query's failure.
"""

from __future__ import annotations

import functools
from typing import Any, Dict

__all__ = [
    "install",
]

_INSTALLED = "_acs_checks_options"


def _recorded(writer: Any) -> Dict[str, Any]:
    opts = writer.__dict__.get("_acs_options")
    if opts is None:
        opts = writer.__dict__["_acs_options"] = {}
    return opts


def _check(writer: Any, path: Any, extra: Dict[str, Any]) -> None:
    from pyspark_acs.datasource.options import check_sink_options

    fmt = writer.__dict__.get("_acs_format")
    if fmt is None or str(fmt).lower() != "acs":
        return
    raw = {k: v for k, v in {**_recorded(writer), **extra}.items() if v is not None}
    if path is not None:
        raw["path"] = path
    check_sink_options(raw)


def install() -> None:
    """Wrap pyspark's classic ``DataStreamWriter`` once (idempotent)."""
    try:
        from pyspark.sql.streaming.readwriter import DataStreamWriter
    except ImportError:  # pragma: no cover - pyspark is a dependency of this subpackage
        return
    if getattr(DataStreamWriter, _INSTALLED, False):
        return
    from pyspark.sql.readwriter import to_str

    original_format, original_option = DataStreamWriter.format, DataStreamWriter.option
    original_options, original_start = DataStreamWriter.options, DataStreamWriter.start

    @functools.wraps(original_format)
    def format(self, source):  # noqa: A001 - the method's own name
        self.__dict__["_acs_format"] = source
        return original_format(self, source)

    @functools.wraps(original_option)
    def option(self, key, value):
        _recorded(self)[key] = to_str(value)
        return original_option(self, key, value)

    @functools.wraps(original_options)
    def options(self, **opts):
        _recorded(self).update({k: to_str(v) for k, v in opts.items()})
        return original_options(self, **opts)

    @functools.wraps(original_start)
    def start(self, path=None, format=None, outputMode=None, partitionBy=None, queryName=None, **opts):
        if format is not None:
            self.__dict__["_acs_format"] = format
        _check(self, path, {k: to_str(v) for k, v in opts.items()})
        return original_start(self, path, format, outputMode, partitionBy, queryName, **opts)

    DataStreamWriter.format = format
    DataStreamWriter.option = option
    DataStreamWriter.options = options
    DataStreamWriter.start = start
    setattr(DataStreamWriter, _INSTALLED, True)
