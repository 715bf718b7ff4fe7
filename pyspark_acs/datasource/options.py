"""Options of the ``acs`` Spark source and sink, parsed once from Spark's string options.

Names and meanings follow Spark's Kafka source where they overlap (``startingOffsets``,
``startingTimestamp``, ``endingOffsets``, ``failOnDataLoss``, ``maxBytesPerTrigger``,
``maxRowsPerTrigger`` ~ ``maxOffsetsPerTrigger``). Names match case-insensitively; an
unknown name is refused with the list of valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Tuple

from pyspark_acs.cache.endpoints import DATA_CACHE_ENV, METADATA_CACHE_ENV, NO_CACHE, cache_endpoints, parse_endpoints
from pyspark_acs.errors import AcsOptionError
from pyspark_acs.security import SecuritySettings, resolve_security
from pyspark_acs.format.block import DEFAULT_MAX_BLOCK_BYTES
from pyspark_acs.cache.poller import DEFAULT_POLL_INTERVAL_S
from pyspark_acs.write.shard import DEFAULT_ROLL_BYTES
from pyspark_acs.format.names import validate_stream
from pyspark_acs.format.offsets import parse_offsets, parse_timestamps
from pyspark_acs.storage.tier import parse_read_policy
from pyspark_acs.options import bytes_parser, duration_parser, option, parse_bool, parse_int, parse_options, parse_str

__all__ = [
    "SinkOptions",
    "SourceOptions",
    "check_sink_options",
    "check_source_options",
    "parse_sink_options",
    "parse_source_options",
]

#: How long a read task waits for bytes that were published but are not readable yet
#: (e.g. chunks lost with a cache replica while the durable copy is still catching up).
DEFAULT_READ_TIMEOUT_S = 60.0


def _streams(value: Any, name: str) -> Tuple[str, ...]:
    items = tuple(s.strip() for s in str(value).split(",") if s.strip())
    if not items:
        raise AcsOptionError(f"{name}: give one stream name or a comma-separated list", option=name)
    for s in items:
        try:
            validate_stream(s)
        except ValueError as exc:
            raise AcsOptionError(f"{name}: {exc}", option=name) from None
    if len(set(items)) != len(items):
        raise AcsOptionError(f"{name}: a stream is listed twice in {value!r}", option=name)
    return items


def _one_stream(value: Any, name: str) -> str:
    items = _streams(value, name)
    if len(items) != 1:
        raise AcsOptionError(
            f"{name}: option stream names one stream, got {value!r}; route rows to several streams with a "
            f"'stream' column",
            option=name,
        )
    return items[0]


def _offsets_spec(*keywords: str):
    def parse(value: Any, name: str) -> Any:
        text = str(value).strip()
        if text.lower() in keywords:
            return text.lower()
        if not text.startswith("{"):
            raise AcsOptionError(
                f"{name}: {value!r} is not allowed; use {' or '.join(repr(k) for k in keywords)} or a JSON object "
                f'like {{"stream": {{"0": {{"file": "<name>.acs", "length": 0}}}}}}',
                option=name,
            )
        parse_offsets(text, option=name)  # validate now; kept as text (hashable, picklable)
        return text

    return parse


def _timestamps_spec(value: Any, name: str) -> str:
    parse_timestamps(str(value), option=name)  # validate now; kept as text (hashable, picklable)
    return str(value)


def _endpoints(value: Any, name: str) -> str:
    """Endpoints ``host:port,...``; ``none`` (kept as ``""``) turns the cache off even when
    ``$ACS_DATA_CACHE`` / ``$ACS_METADATA_CACHE`` is set."""
    text = str(value).strip()
    if text.lower() == NO_CACHE:
        return ""
    return ",".join(parse_endpoints(text, option=name))


def _with_env_caches(opts: Any) -> Any:
    """Cache endpoints not given as options come from the driver's environment (``acs up``'s
    exports), resolved here, once, so every task reads through the caches the planner used.
    So do the token and TLS files (:func:`pyspark_acs.security.resolve_security`): the token
    is read from its file on the driver and travels in the options (:meth:`_Secured.security`)."""
    sec = resolve_security(token=opts.cache_token, token_file=opts.token_file, tls_cert=opts.tls_cert,
                           tls_key=opts.tls_key, tls_ca=opts.tls_ca, mtls=opts.mtls)
    return replace(
        opts,
        data_cache=cache_endpoints(opts.data_cache, DATA_CACHE_ENV),
        metadata_cache=cache_endpoints(opts.metadata_cache, METADATA_CACHE_ENV),
        cache_token=sec.token, token_file=None, tls_cert=sec.tls_cert, tls_key=sec.tls_key, tls_ca=sec.tls_ca,
        mtls=sec.mtls,
    )


class _Secured:
    """Options carrying security settings, as plain data: the driver resolves them once and
    every client, read path and writer the source or sink builds (on the driver and in the
    Spark Python workers, whose environment is not the driver's) is given :meth:`security`."""

    def security(self) -> SecuritySettings:
        """The token and TLS settings these options carry."""
        return SecuritySettings(token=self.cache_token, tls_cert=self.tls_cert, tls_key=self.tls_key,
                                tls_ca=self.tls_ca, mtls=bool(self.mtls))


_SECURITY_DOCS = {
    "cacheToken": "Shared token of token-protected cache servers (default $ACS_CACHE_TOKEN).",
    "tokenFile": "File holding the cache/copy token, read on the driver (default $ACS_TOKEN_FILE).",
    "tlsCa": "CA bundle: connect to the caches with TLS (default $ACS_TLS_CA).",
    "tlsCert": "Client certificate chain for mutual TLS (default $ACS_TLS_CERT).",
    "tlsKey": "Its private key (default $ACS_TLS_KEY).",
    "mtls": "Present tlsCert/tlsKey to the servers (default $ACS_TLS_MTLS).",
}
_CACHE_DOC = ("host:port,host:port,... Lengths are polled from the metadata cache and bytes "
              "read from the data cache, with the durable store as the fallback; without them everything "
              "comes from the durable store. When not given, the driver's $ACS_DATA_CACHE / "
              "$ACS_METADATA_CACHE are used (acs up prints them); none turns a cache off even then.")
_SINK_CACHE_DOC = ("host:port,... (default $ACS_DATA_CACHE / $ACS_METADATA_CACHE; none turns "
                   "a cache off): written like a Producer, durable store, then chunks, then lengths.")


@dataclass(frozen=True)
class SourceOptions(_Secured):
    """Options of ``spark.readStream.format("acs")`` and ``spark.read.format("acs")``."""

    root: str = option("root", parse=parse_str, required=True,
                       doc="Durable store root of this cluster: a local path or URI (file:///, hdfs://); "
                           "load(path) sets it too.")
    streams: Tuple[str, ...] = option("stream", parse=_streams, required=True,
                                      doc="A stream name or a comma-separated list.")
    data_cache: Optional[str] = option("dataCache", None, parse=_endpoints, doc="Data-cache endpoints. " + _CACHE_DOC)
    metadata_cache: Optional[str] = option("metadataCache", None, parse=_endpoints,
                                           doc="Metadata-cache endpoints. " + _CACHE_DOC)
    cache_token: Optional[str] = option("cacheToken", None, parse=parse_str, doc=_SECURITY_DOCS["cacheToken"])
    token_file: Optional[str] = option("tokenFile", None, parse=parse_str, doc=_SECURITY_DOCS["tokenFile"])
    tls_ca: Optional[str] = option("tlsCa", None, parse=parse_str, doc=_SECURITY_DOCS["tlsCa"])
    tls_cert: Optional[str] = option("tlsCert", None, parse=parse_str, doc=_SECURITY_DOCS["tlsCert"])
    tls_key: Optional[str] = option("tlsKey", None, parse=parse_str, doc=_SECURITY_DOCS["tlsKey"])
    mtls: Optional[bool] = option("mtls", None, parse=parse_bool, doc=_SECURITY_DOCS["mtls"])
    starting_offsets: Optional[str] = option(
        "startingOffsets", None, parse=_offsets_spec("earliest", "latest"), shown="latest (streams), earliest (batch)",
        doc='Where a new query starts: earliest, latest or offsets JSON as '
            '{"stream": {"0": {"file": "...acs", "length": 0}}}; shards missing from the JSON start at the '
            'earliest position.',
    )
    starting_timestamp: Optional[int] = option(
        "startingTimestamp", None, parse=parse_int(0),
        doc="Milliseconds since the epoch: per shard, start at the first block holding a message at or after "
            "it (offsets are block boundaries, so earlier messages of that block come too).",
    )
    starting_by_timestamp: Optional[str] = option(
        "startingOffsetsByTimestamp", None, parse=_timestamps_spec,
        doc='Per shard, milliseconds since the epoch, as Kafka\'s: {"stream": {"0": 1700000000000}}; each '
            'named shard starts as with startingTimestamp, the others by startingOffsets.',
    )
    ending_offsets: Optional[str] = option(
        "endingOffsets", None, parse=_offsets_spec("latest"), shown="latest",
        doc="Batch reads only: latest or offsets JSON (a streaming query refuses it: use "
            "trigger(availableNow=True)).",
    )
    ending_timestamp: Optional[int] = option(
        "endingTimestamp", None, parse=parse_int(0),
        doc="Batch reads only, milliseconds since the epoch: each shard is read up to the first block whose "
            "first message is stamped at or after it, and rows stamped at or after it are dropped.",
    )
    max_bytes_per_trigger: Optional[int] = option(
        "maxBytesPerTrigger", None, parse=bytes_parser(1),
        doc="Admission control through Spark's ReadLimit: bytes (8MiB) per micro-batch, split across shards "
            "in proportion to their backlog. Offsets are block boundaries, so a single block larger than a "
            "shard's share is still read whole. Trigger.AvailableNow honours it (several bounded batches); "
            "once reads all.",
    )
    max_rows_per_trigger: Optional[int] = option(
        "maxRowsPerTrigger", None, parse=parse_int(1),
        doc="As maxBytesPerTrigger, in messages per micro-batch (Kafka's maxOffsetsPerTrigger).",
    )
    fail_on_data_loss: bool = option(
        "failOnDataLoss", True, parse=parse_bool,
        doc="When a file in the offsets is gone or shorter than the offset: fail naming stream, shard, file "
            "and bytes (true), or log and continue at the next available data (false).",
    )
    include_headers: bool = option(
        "includeHeaders", False, parse=parse_bool,
        doc="Add a headers column (array<struct<key: string, value: binary>>, null for messages sent "
            "without headers), as Spark's Kafka source does.",
    )
    tier_read_policy: str = option(
        "tierReadPolicy", "NOT_IN_DISK", parse=parse_read_policy,
        doc="Which tier tiered files are read from: NOT_IN_DISK, NOT_IN_MEM or FORCE (docs/tiered.md).",
    )
    poll_interval: float = option(
        "pollInterval", DEFAULT_POLL_INTERVAL_S, parse=duration_parser(0.0),
        doc="How often a read task retries bytes that are published but not yet readable.",
    )
    max_bytes_per_second: Optional[int] = option(
        "maxBytesPerSecond", None, parse=bytes_parser(1), doc="Read-rate cap of one read task."
    )
    read_timeout: float = option(
        "readTimeout", DEFAULT_READ_TIMEOUT_S, parse=duration_parser(0.001),
        doc="How long a task waits for such bytes before failing with a data-loss error.",
    )
    min_partitions: Optional[int] = option(
        "minPartitions", None, parse=parse_int(1), shown="one task per shard",
        doc="At least this many read tasks per batch read or micro-batch, as Kafka's: shard ranges are split "
            "at block boundaries in proportion to their bytes.",
    )


def _sink_acknowledge(value: Any, name: str) -> str:
    from pyspark_acs.write.confirm import CLUSTERS_PREFIX, clusters_needed

    if isinstance(value, str) and value.startswith(CLUSTERS_PREFIX):
        clusters_needed(value, name)
        return value
    if value != "published":
        raise AcsOptionError(f"{name}: {value!r} is not allowed; use 'published' or 'clusters:K' (durable in K "
                             f"clusters: the source and K-1 destinations)", option=name)
    return value


@dataclass(frozen=True)
class SinkOptions(_Secured):
    """Options of ``df.writeStream.format("acs")`` and ``df.write.format("acs")``."""

    root: str = option("root", parse=parse_str, required=True,
                       doc="Durable store root: a local path or URI; save(path) sets it too.")
    stream: Optional[str] = option(
        "stream", None, parse=_one_stream, shown="required unless the DataFrame has a stream column",
        doc="The target stream of every row; it overrides a stream column (as Kafka's topic option overrides "
            "the topic column), so a source's rows can be written to another stream.",
    )
    shards: Optional[int] = option(
        "shards", None, parse=parse_int(1, 99_999), shown="required when a stream does not exist yet",
        doc="Shard count of a stream the sink creates (also one a stream column names); must match when it "
            "exists.",
    )
    data_cache: Optional[str] = option("dataCache", None, parse=_endpoints, doc="Data-cache endpoints. " + _SINK_CACHE_DOC)
    metadata_cache: Optional[str] = option("metadataCache", None, parse=_endpoints,
                                           doc="Metadata-cache endpoints. " + _SINK_CACHE_DOC)
    cache_token: Optional[str] = option("cacheToken", None, parse=parse_str, doc=_SECURITY_DOCS["cacheToken"])
    token_file: Optional[str] = option("tokenFile", None, parse=parse_str, doc=_SECURITY_DOCS["tokenFile"])
    tls_ca: Optional[str] = option("tlsCa", None, parse=parse_str, doc=_SECURITY_DOCS["tlsCa"])
    tls_cert: Optional[str] = option("tlsCert", None, parse=parse_str, doc=_SECURITY_DOCS["tlsCert"])
    tls_key: Optional[str] = option("tlsKey", None, parse=parse_str, doc=_SECURITY_DOCS["tlsKey"])
    mtls: Optional[bool] = option("mtls", None, parse=parse_bool, doc=_SECURITY_DOCS["mtls"])
    max_block_bytes: int = option(
        "maxBlockBytes", DEFAULT_MAX_BLOCK_BYTES, parse=bytes_parser(1024), doc="Largest block body."
    )
    roll_bytes: int = option(
        "rollBytes", DEFAULT_ROLL_BYTES, parse=bytes_parser(1), doc="A new file starts at this size."
    )
    acknowledge: str = option(
        "acknowledge", "published", parse=_sink_acknowledge, metavar="{published,clusters:K}",
        doc="When a batch's commit returns: published (durable and published here), or clusters:K (also "
            "durable in K-1 destinations, as the copy daemons confirm; needs metadataCache).",
    )
    ack_timeout: float = option(
        "ackTimeout", 60.0, parse=duration_parser(0.001),
        doc="How long a commit with acknowledge=clusters:K waits for the destinations (the batch fails after it "
            "and its retry waits again; nothing is appended twice).",
    )
    sink_id: Optional[str] = option(
        "sinkId", None, parse=parse_str, shown="the query's checkpointLocation",
        doc="Identity of the sink for exactly-once.",
    )
    checkpoint_location: Optional[str] = option(
        "checkpointLocation", None, parse=parse_str, doc="Set by Spark from the query; identifies the sink."
    )
    query_name: Optional[str] = option("queryName", None, parse=parse_str, doc="Set by Spark from queryName(); unused.")


def _with_path(raw: Mapping[str, Any]) -> dict:
    """``load(path)``/``save(path)`` pass the path as option "path": it means root."""
    opts = dict(raw)
    path = next((k for k in opts if k.lower() == "path"), None)
    if path is not None:
        value = opts.pop(path)
        if not any(k.lower() == "root" for k in opts):
            opts["root"] = value
    return opts


def check_source_options(raw: Mapping[str, Any]) -> SourceOptions:
    """Parse the source options and check how they combine, without the driver's environment.

    What :meth:`AcsDataSource.schema` runs at ``load()``, so a bad option fails there.

    Raises
    ------
    AcsOptionError
        Naming the option (an unknown one with the nearest valid name).
    """
    opts = parse_options(SourceOptions, _with_path(raw), component="acs source")
    if opts.starting_timestamp is not None and (opts.starting_offsets or opts.starting_by_timestamp):
        other = "startingOffsets" if opts.starting_offsets else "startingOffsetsByTimestamp"
        raise AcsOptionError(
            f"acs source: give startingTimestamp or {other}, not both", option="startingTimestamp"
        )
    if opts.ending_offsets is not None and opts.ending_timestamp is not None:
        raise AcsOptionError("acs source: give endingOffsets or endingTimestamp, not both", option="endingTimestamp")
    for name, value in (("startingOffsets", opts.starting_offsets), ("endingOffsets", opts.ending_offsets),
                        ("startingOffsetsByTimestamp", opts.starting_by_timestamp)):
        if value and value.startswith("{"):
            parse = parse_timestamps if name == "startingOffsetsByTimestamp" else parse_offsets
            unknown = {s for s, _ in parse(value, option=name)} - set(opts.streams)
            if unknown:
                raise AcsOptionError(
                    f"{name}: streams {sorted(unknown)} are not in option stream={','.join(opts.streams)}", option=name
                )
    return opts


def parse_source_options(raw: Mapping[str, Any]) -> SourceOptions:
    """Parse and check the source options (raises AcsOptionError naming the option), with the
    caches and security settings of the driver's environment filled in."""
    return _with_env_caches(check_source_options(raw))


def check_sink_options(raw: Mapping[str, Any]) -> SinkOptions:
    """Parse the sink options without the driver's environment (the check ``start()`` runs)."""
    return parse_options(SinkOptions, _with_path(raw), component="acs sink")


def parse_sink_options(raw: Mapping[str, Any]) -> SinkOptions:
    """Parse and check the sink options (raises AcsOptionError naming the option)."""
    return _with_env_caches(check_sink_options(raw))
