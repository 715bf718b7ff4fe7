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
from pyspark_acs.security import SecuritySettings, install_default, resolve_security
from pyspark_acs.format.block import DEFAULT_MAX_BLOCK_BYTES
from pyspark_acs.read.consumer import DEFAULT_POLL_INTERVAL_S
from pyspark_acs.write.shard import DEFAULT_ROLL_BYTES
from pyspark_acs.format.names import validate_stream
from pyspark_acs.format.offsets import parse_offsets, parse_timestamps
from pyspark_acs.storage.tier import parse_read_policy
from pyspark_acs.options import bytes_parser, duration_parser, option, parse_bool, parse_int, parse_options, parse_str

__all__ = ["SinkOptions", "SourceOptions", "parse_sink_options", "parse_source_options"]

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
    is read from its file on the driver and travels in the options."""
    sec = resolve_security(token=opts.cache_token, token_file=opts.token_file, tls_cert=opts.tls_cert,
                           tls_key=opts.tls_key, tls_ca=opts.tls_ca, mtls=opts.mtls)
    if sec.token or sec.client_tls:  # the driver's own clients (the planner's) use them too
        install_default(sec)
    return replace(
        opts,
        data_cache=cache_endpoints(opts.data_cache, DATA_CACHE_ENV),
        metadata_cache=cache_endpoints(opts.metadata_cache, METADATA_CACHE_ENV),
        cache_token=sec.token, token_file=None, tls_cert=sec.tls_cert, tls_key=sec.tls_key, tls_ca=sec.tls_ca,
        mtls=sec.mtls,
    )


class _Secured:
    """Options carrying security settings: once unpickled in a Spark Python worker they become
    that process's default (:func:`pyspark_acs.security.install_default`), so every client a
    task opens uses the driver's token and TLS files."""

    def security(self) -> SecuritySettings:
        """The token and TLS settings these options carry."""
        return SecuritySettings(token=self.cache_token, tls_cert=self.tls_cert, tls_key=self.tls_key,
                                tls_ca=self.tls_ca, mtls=bool(self.mtls))

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if state.get("cache_token") or state.get("tls_ca") or state.get("tls_cert"):
            install_default(self.security())


_SECURITY_DOCS = {
    "tokenFile": "file holding the cache/copy token, read on the driver ($ACS_TOKEN_FILE)",
    "tlsCa": "CA bundle: connect to the caches with TLS ($ACS_TLS_CA)",
    "tlsCert": "client certificate chain for mutual TLS ($ACS_TLS_CERT)",
    "tlsKey": "its private key ($ACS_TLS_KEY)",
    "mtls": "present tlsCert/tlsKey to the servers ($ACS_TLS_MTLS)",
}


@dataclass(frozen=True)
class SourceOptions(_Secured):
    """Options of ``spark.readStream.format("acs")`` and ``spark.read.format("acs")``."""

    root: str = option("root", parse=parse_str, required=True, doc="durable store root URI or path")
    streams: Tuple[str, ...] = option("stream", parse=_streams, required=True, doc="stream name or comma list")
    data_cache: Optional[str] = option("dataCache", None, parse=_endpoints, doc="data-cache endpoints host:port,... or none (default $ACS_DATA_CACHE)")
    metadata_cache: Optional[str] = option(
        "metadataCache", None, parse=_endpoints,
        doc="metadata-cache endpoints host:port,... or none (default $ACS_METADATA_CACHE)",
    )
    cache_token: Optional[str] = option(
        "cacheToken", None, parse=parse_str, doc="token of token-protected cache servers ($ACS_CACHE_TOKEN)"
    )
    token_file: Optional[str] = option("tokenFile", None, parse=parse_str, doc=_SECURITY_DOCS["tokenFile"])
    tls_ca: Optional[str] = option("tlsCa", None, parse=parse_str, doc=_SECURITY_DOCS["tlsCa"])
    tls_cert: Optional[str] = option("tlsCert", None, parse=parse_str, doc=_SECURITY_DOCS["tlsCert"])
    tls_key: Optional[str] = option("tlsKey", None, parse=parse_str, doc=_SECURITY_DOCS["tlsKey"])
    mtls: Optional[bool] = option("mtls", None, parse=parse_bool, doc=_SECURITY_DOCS["mtls"])
    starting_offsets: Optional[str] = option(
        "startingOffsets", None, parse=_offsets_spec("earliest", "latest"),
        doc="earliest | latest | offsets JSON (default: latest for streams, earliest for batch)",
    )
    starting_timestamp: Optional[int] = option(
        "startingTimestamp", None, parse=parse_int(0), doc="ms since the epoch: start at the first message at or after it"
    )
    starting_by_timestamp: Optional[str] = option(
        "startingOffsetsByTimestamp", None, parse=_timestamps_spec,
        doc='per shard, ms since the epoch: {"stream": {"0": 1700000000000}} (other shards: startingOffsets)',
    )
    ending_offsets: Optional[str] = option(
        "endingOffsets", None, parse=_offsets_spec("latest"), doc="batch reads only: latest | offsets JSON"
    )
    ending_timestamp: Optional[int] = option(
        "endingTimestamp", None, parse=parse_int(0),
        doc="batch reads only, ms since the epoch: stop before the first message at or after it",
    )
    max_bytes_per_trigger: Optional[int] = option(
        "maxBytesPerTrigger", None, parse=bytes_parser(1), doc="bytes per micro-batch, split over shards by backlog"
    )
    max_rows_per_trigger: Optional[int] = option(
        "maxRowsPerTrigger", None, parse=parse_int(1), doc="messages per micro-batch, split over shards by backlog"
    )
    fail_on_data_loss: bool = option("failOnDataLoss", True, parse=parse_bool, doc="fail when data is gone (true)")
    include_headers: bool = option(
        "includeHeaders", False, parse=parse_bool, doc="add the messages' headers column (false), as Kafka's"
    )
    tier_read_policy: str = option(
        "tierReadPolicy", "NOT_IN_DISK", parse=parse_read_policy,
        doc="which tier tiered files are read from: NOT_IN_DISK | NOT_IN_MEM | FORCE (NOT_IN_DISK)",
    )
    poll_interval: float = option(
        "pollInterval", DEFAULT_POLL_INTERVAL_S, parse=duration_parser(0.0), doc="read retry interval (10ms)"
    )
    max_bytes_per_second: Optional[int] = option(
        "maxBytesPerSecond", None, parse=bytes_parser(1), doc="read-rate cap of one read task"
    )
    read_timeout: float = option(
        "readTimeout", DEFAULT_READ_TIMEOUT_S, parse=duration_parser(0.001),
        doc="how long a task waits for published bytes to become readable (60s)",
    )
    min_partitions: Optional[int] = option(
        "minPartitions", None, parse=parse_int(1),
        doc="at least this many read tasks per batch: large shard ranges split at block boundaries (as Kafka's)",
    )


@dataclass(frozen=True)
class SinkOptions(_Secured):
    """Options of ``df.writeStream.format("acs")`` and ``df.write.format("acs")``."""

    root: str = option("root", parse=parse_str, required=True, doc="durable store root URI or path")
    stream: Optional[str] = option(
        "stream", None, parse=_one_stream,
        doc="target stream of every row, overriding a 'stream' column (required without one)",
    )
    shards: Optional[int] = option(
        "shards", None, parse=parse_int(1, 99_999),
        doc="shard count (required to create a missing stream, also one a 'stream' column names)",
    )
    data_cache: Optional[str] = option("dataCache", None, parse=_endpoints, doc="data-cache endpoints host:port,... or none (default $ACS_DATA_CACHE)")
    metadata_cache: Optional[str] = option(
        "metadataCache", None, parse=_endpoints,
        doc="metadata-cache endpoints host:port,... or none (default $ACS_METADATA_CACHE)",
    )
    cache_token: Optional[str] = option(
        "cacheToken", None, parse=parse_str, doc="token of token-protected cache servers ($ACS_CACHE_TOKEN)"
    )
    token_file: Optional[str] = option("tokenFile", None, parse=parse_str, doc=_SECURITY_DOCS["tokenFile"])
    tls_ca: Optional[str] = option("tlsCa", None, parse=parse_str, doc=_SECURITY_DOCS["tlsCa"])
    tls_cert: Optional[str] = option("tlsCert", None, parse=parse_str, doc=_SECURITY_DOCS["tlsCert"])
    tls_key: Optional[str] = option("tlsKey", None, parse=parse_str, doc=_SECURITY_DOCS["tlsKey"])
    mtls: Optional[bool] = option("mtls", None, parse=parse_bool, doc=_SECURITY_DOCS["mtls"])
    max_block_bytes: int = option(
        "maxBlockBytes", DEFAULT_MAX_BLOCK_BYTES, parse=bytes_parser(1024), doc="block size (1MiB)"
    )
    roll_bytes: int = option(
        "rollBytes", DEFAULT_ROLL_BYTES, parse=bytes_parser(1), doc="file rollover size (64MiB)"
    )
    sink_id: Optional[str] = option(
        "sinkId", None, parse=parse_str, doc="identity for exactly-once (default: the query's checkpointLocation)"
    )
    checkpoint_location: Optional[str] = option(
        "checkpointLocation", None, parse=parse_str, doc="set by Spark from the query; identifies the sink"
    )
    query_name: Optional[str] = option("queryName", None, parse=parse_str, doc="set by Spark from queryName(); unused")


def _with_path(raw: Mapping[str, Any]) -> dict:
    """``load(path)``/``save(path)`` pass the path as option "path": it means root."""
    opts = dict(raw)
    path = next((k for k in opts if k.lower() == "path"), None)
    if path is not None:
        value = opts.pop(path)
        if not any(k.lower() == "root" for k in opts):
            opts["root"] = value
    return opts


def parse_source_options(raw: Mapping[str, Any]) -> SourceOptions:
    """Parse and check the source options (raises AcsOptionError naming the option)."""
    opts = _with_env_caches(parse_options(SourceOptions, _with_path(raw), component="acs source"))
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


def parse_sink_options(raw: Mapping[str, Any]) -> SinkOptions:
    """Parse and check the sink options (raises AcsOptionError naming the option)."""
    return _with_env_caches(parse_options(SinkOptions, _with_path(raw), component="acs sink"))
