"""Spark Structured Streaming connector: ``format("acs")`` source and sink, no jars.

``pyspark_acs.DefaultSource`` is :class:`AcsDataSource`; Spark finds it after ``pip install``
because it looks for installed ``pyspark_*`` packages that export ``DefaultSource``.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader
from pyspark.sql.types import StructType

from pyspark_acs.datasource import early, workergc
from pyspark_acs.datasource.options import (SinkOptions, SourceOptions, check_source_options, parse_sink_options,
                                            parse_source_options)
from pyspark_acs.options import describe_options

# A reused Spark worker collects garbage after every task: the objects imported by now live as
# long as the worker, so later collections need not walk them (see workergc).
workergc.freeze_long_lived()
# On the driver: the sink's options are checked at writeStream...start() (see early).
early.install()

__all__ = [
    "AcsDataSource",
    "DefaultSource",
]


_DOC = """Read and write pyspark_acs streams with Spark: ``format("acs")``.

Source options (``spark.readStream.format("acs")`` / ``spark.read.format("acs")``)
--------------------------------------------------------------------------------
{source}

Batch reads prune with ``spark.sql.python.filterPushdown.enabled=true``: filters on
``stream``, ``shard`` and ``file`` skip whole shards and files, filters on ``timestamp``
skip blocks none of whose messages can match, before anything is read.

Schema: ``stream string, shard int, file string, position long, timestamp timestamp,
key binary, value binary`` (and ``headers`` with ``includeHeaders``). ``position`` is the
message's index in its file.

A streaming query runs a micro-batch only when messages arrived: a file's seal alone (the
reader moving on to the next file) moves no offset.

Sink options (``df.writeStream.format("acs")`` / ``df.write.format("acs")``)
--------------------------------------------------------------------------
A batch write needs ``.mode("append")``: Spark refuses its default mode (``ErrorIfExists``)
before the sink runs, and the sink refuses ``overwrite`` (streams are append-only)::

    df.write.format("acs").mode("append").option("root", root).option("stream", "s").save()

{sink}

Columns: ``value`` (binary or string, required), ``key`` (binary or string: picks the
shard by crc32 hash), ``shard`` (int), ``timestamp`` (default now), ``headers``
(``array<struct<key: string, value: binary>>``, Kafka's), ``stream`` (string:
without option ``stream``, routes each row to a stream, as Kafka's ``topic`` column does). The
acs source's ``file`` and ``position`` are ignored (a message gets new ones where it lands); any
other column is refused by name -- Kafka's ``topic`` and ``partition`` with what to use instead --
rather than silently dropped. Each committed micro-batch lands exactly once per batch id
and stream, after all earlier batches in every shard (see :mod:`pyspark_acs.datasource.sink`).

Option names match case-insensitively; an unknown one is refused with the nearest valid name.
The option lists above are rendered from the declarations in
:mod:`pyspark_acs.datasource.options` (:func:`pyspark_acs.options.describe_options`).
"""


def options_reference() -> str:
    """The docstring of :class:`AcsDataSource`: its prose with the option lists rendered from
    :class:`SourceOptions` and :class:`SinkOptions`."""
    return _DOC.format(source=describe_options(SourceOptions, "rst"), sink=describe_options(SinkOptions, "rst"))


class AcsDataSource(DataSource):
    __doc__ = options_reference()

    @classmethod
    def name(cls) -> str:
        """The format name: ``"acs"``."""
        return "acs"

    def schema(self) -> str:
        """The read schema as a DDL string (the fixed columns listed above, and ``headers``
        with option ``includeHeaders``).

        Spark calls it at ``load()`` (unless a schema is given): every source option is checked
        here, so a bad one fails at ``load()`` rather than once the query runs.

        Raises
        ------
        AcsOptionError
            When an option is unknown (naming the nearest valid one), missing or invalid.
        """
        from pyspark_acs.datasource.source import SCHEMA_DDL, SCHEMA_WITH_HEADERS_DDL

        opts = check_source_options(self.options)
        return SCHEMA_WITH_HEADERS_DDL if opts.include_headers else SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        """The batch reader of ``spark.read.format("acs")``; ``schema`` is not used.

        Raises
        ------
        AcsOptionError
            When an option is missing or invalid (the message names it).
        """
        from pyspark_acs.datasource.source import AcsBatchReader, AcsPruningBatchReader, pushdown_enabled

        # The pruning reader implements pushFilters, which Spark refuses unless filter pushdown
        # is enabled; it is handed out only when Spark pushes filters (see pushdown_enabled).
        reader = AcsPruningBatchReader if pushdown_enabled() else AcsBatchReader
        return reader(parse_source_options(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """The micro-batch reader of ``spark.readStream.format("acs")``; ``schema`` is not used.

        Raises
        ------
        AcsOptionError
            When an option is missing or invalid (the message names it).
        """
        from pyspark_acs.datasource.source import AcsStreamReader

        return AcsStreamReader(parse_source_options(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> Any:
        """The batch writer of ``df.write.format("acs")``; creates a missing stream (option ``shards``).

        Raises
        ------
        AcsOptionError
            For invalid options or columns, a shard count that disagrees with the stream's, or
            ``overwrite`` (streams are append-only).
        """
        from pyspark_acs.datasource.sink import AcsBatchWriter

        return AcsBatchWriter(parse_sink_options(self.options), schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        """The stream writer of ``df.writeStream.format("acs")``; creates a missing stream (option ``shards``).

        ``overwrite`` is ignored: streams are append-only.

        Raises
        ------
        AcsOptionError
            For invalid options or columns, or a shard count that disagrees with the stream's.
        """
        from pyspark_acs.datasource.sink import AcsStreamWriter

        return AcsStreamWriter(parse_sink_options(self.options), schema)


DefaultSource = AcsDataSource
