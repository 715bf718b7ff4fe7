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

# A reused Spark worker collects garbage after every task: the objects imported by now live as
# long as the worker, so later collections need not walk them (see workergc).
workergc.freeze_long_lived()
# On the driver: the sink's options are checked at writeStream...start() (see early).
early.install()

__all__ = ["AcsDataSource", "DefaultSource", "SinkOptions", "SourceOptions"]


class AcsDataSource(DataSource):
    """Read and write pyspark_acs streams with Spark: ``format("acs")``.

    Source options (``spark.readStream.format("acs")`` / ``spark.read.format("acs")``)
    --------------------------------------------------------------------------------
    root : required
        Durable store root of this cluster: a local path or URI (``file:///``, ``hdfs://``).
        ``load(path)`` sets it too.
    stream : required
        A stream name or a comma-separated list.
    dataCache, metadataCache : optional
        Cache endpoints ``host:port,host:port,...``. Lengths are polled from the metadata
        cache and bytes read from the data cache, with the durable store as the fallback;
        without them everything comes from the durable store. When not given, the driver's
        ``$ACS_DATA_CACHE`` / ``$ACS_METADATA_CACHE`` are used (``acs up`` prints them);
        ``none`` turns a cache off even then.
    cacheToken : optional
        Shared token of token-protected cache servers (default ``$ACS_CACHE_TOKEN``).
    startingOffsets : ``latest`` (streams) / ``earliest`` (batch) / JSON
        Where a new query starts; JSON as ``{"stream": {"0": {"file": "...acs", "length": 0}}}``.
        Shards missing from the JSON start at the earliest position.
    startingTimestamp : optional
        Milliseconds since the epoch: per shard, start at the first block holding a message at
        or after it (offsets are block boundaries, so earlier messages of that block come too).
    startingOffsetsByTimestamp : optional
        Per shard, milliseconds since the epoch, as Kafka's: ``{"stream": {"0": 1700000000000}}``;
        each named shard starts as with ``startingTimestamp``, the others by ``startingOffsets``.
    endingOffsets : ``latest`` (default) / JSON
        Batch reads only (a streaming query refuses it: use ``trigger(availableNow=True)``).
    endingTimestamp : optional
        Batch reads only, milliseconds since the epoch: each shard is read up to the first block
        whose first message is stamped at or after it, and rows stamped at or after it are dropped.
    maxBytesPerTrigger, maxRowsPerTrigger : optional
        Admission control through Spark's ``ReadLimit``: bytes (``"8MiB"``) or messages per
        micro-batch, split across shards in proportion to their backlog. Offsets are block
        boundaries, so a single block larger than a shard's share is still read whole.
        ``Trigger.AvailableNow`` honours them (several bounded batches); ``once`` reads all.
    includeHeaders : ``false``
        Add a ``headers`` column (``array<struct<key: string, value: binary>>``, null for
        messages sent without headers), as Spark's Kafka source does.
    failOnDataLoss : ``true``
        When a file in the offsets is gone or shorter than the offset: fail naming stream,
        shard, file and bytes (true), or log and continue at the next available data (false).
    pollInterval : ``10ms``
        How often a read task retries bytes that are published but not yet readable.
    readTimeout : ``60s``
        How long a task waits for such bytes before failing with a data-loss error.
    maxBytesPerSecond : optional
        Read-rate cap of one read task.
    minPartitions : optional
        At least this many read tasks per batch read or micro-batch, as Kafka's: shard ranges
        are split at block boundaries in proportion to their bytes (default: one task per shard).

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

    root : required
    stream : required unless the DataFrame has a ``stream`` column
        The target stream of every row; it overrides a ``stream`` column (as Kafka's ``topic``
        option overrides the ``topic`` column), so a source's rows can be written to another stream.
    shards : required when a stream does not exist yet (also one a ``stream`` column names);
        must match when it does.
    dataCache, metadataCache, cacheToken : optional
        Written like a Producer: durable store, then chunks, then lengths.
    maxBlockBytes : ``1MiB``;  rollBytes : ``64MiB``
    sinkId : optional
        Identity of the sink for exactly-once; defaults to the query's checkpointLocation.

    Columns: ``value`` (binary or string, required), ``key`` (binary or string: picks the
    shard by crc32 hash), ``shard`` (int), ``timestamp`` (default now), ``headers``
    (``array<struct<key: string, value: binary>>``, Kafka's), ``stream`` (string:
    without option ``stream``, routes each row to a stream, as Kafka's ``topic`` column does). The acs source's ``file``
    and ``position`` are ignored (a message gets new ones where it lands); any other column is
    refused by name -- Kafka's ``topic`` and ``partition`` with what to use instead --
    rather than silently dropped. Each committed micro-batch lands exactly once per batch id
    and stream, after all earlier batches in every shard (see :mod:`pyspark_acs.datasource.sink`).
    """

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
