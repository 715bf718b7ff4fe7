"""A stream's tier settings: the secondary store and the retention of both tiers, set and shown."""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Optional

from pyspark_acs.errors import AcsOptionError, StoreError
from pyspark_acs.format.names import shard_dir
from pyspark_acs.options import bytes_parser, duration_parser, option, parse_options, parse_str
from pyspark_acs.storage.store import STREAM_META_FILE, DurableStore
from pyspark_acs.storage.tier_manifest import read_manifest
from pyspark_acs.storage.tier_store import TierStore, public_uri

__all__ = [
    "TierSettings",
    "configure_tier",
    "stream_tier_settings",
    "tier_summary",
]


#: Retention values that mean "no limit": the retention is removed.
NO_LIMIT = ("forever", "none", "unbounded")


def _retention(parse: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """A retention's parser: ``None`` or one of :data:`NO_LIMIT` is no limit, else ``parse``."""

    def retention(value: Any, name: str) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in NO_LIMIT):
            return None
        return parse(value, name)

    return retention


@dataclass(frozen=True)
class TierSettings:
    """Tiering and retention settings of one stream (in its metadata file, key ``"tier"``).

    The settings are declared with :func:`~pyspark_acs.options.option` (``acs tier`` makes its
    flags of them, README.md's "Settings reference" lists them). ``owner`` is no setting: a
    random id of this stream in this hot store, part of every object name the mover writes, so
    the mover sweeps only its own objects and two clusters (or streams) pointed at the same
    bucket prefix never delete each other's objects.
    """

    uri: Optional[str] = option(
        "uri", None, parse=parse_str, metavar="URI",
        doc="the secondary store: s3://bucket/prefix[?endpoint_override=host:port&scheme=http], "
            "gs://bucket/prefix or a folder; not set, the stream is not tiered and nothing is deleted",
    )
    hot_retention_s: Optional[float] = option(
        "hot_retention_s", None, parse=_retention(duration_parser(0.0, unit_required=True)),
        flag="--hot-retention", metavar="AGE", shown="forever",
        doc="hot copies of tiered files older than this (since their last write) are deleted, e.g. 1d; "
            "forever keeps them",
    )
    hot_retention_bytes: Optional[int] = option(
        "hot_retention_bytes", None, parse=_retention(bytes_parser(0)), metavar="SIZE", shown="unbounded",
        doc="the stream's hot files are kept below this size by deleting the oldest tiered hot copies, e.g. "
            "10GiB (a hot file not yet verified in the secondary store stays, so lagging uploads may exceed "
            "it); unbounded: no limit",
    )
    secondary_retention_s: Optional[float] = option(
        "secondary_retention_s", None, parse=_retention(duration_parser(0.0, unit_required=True)),
        flag="--secondary-retention", metavar="AGE", shown="forever",
        doc="files older than this are deleted from both tiers, e.g. 90d; forever keeps them",
    )
    owner: Optional[str] = None

    @property
    def enabled(self) -> bool:
        """Whether the stream has a secondary store."""
        return bool(self.uri)

    def to_json(self) -> Dict[str, Any]:
        """The settings as the plain dict kept in the stream metadata."""
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any, where: str = "stream metadata") -> "TierSettings":
        """Settings from the stream metadata's ``"tier"`` value (``None``: not tiered)."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise StoreError(f"{where}: malformed tier settings {raw!r}")
        known = {k: raw.get(k) for k in ("uri", "hot_retention_s", "hot_retention_bytes", "secondary_retention_s",
                                          "owner")}
        return cls(**known)

    def describe(self) -> str:
        """A one-line summary for ``acs ls`` / ``acs status``."""
        if not self.enabled:
            return "tier: none"
        uri = public_uri(self.uri)

        def age(v: Optional[float]) -> str:
            return "forever" if v is None else f"{v:g}s"

        hot_bytes = "unbounded" if self.hot_retention_bytes is None else f"{self.hot_retention_bytes}B"
        return (f"tier: {uri} hot: {age(self.hot_retention_s)}/{hot_bytes} "
                f"secondary: {age(self.secondary_retention_s)}")


def _no_stream(store: DurableStore, stream: str) -> AcsOptionError:
    return AcsOptionError(f"stream: no stream {stream!r} in {store.root}", option="stream")


def _stream_meta(store: DurableStore, stream: str) -> Dict[str, Any]:
    meta = store.stream_meta(stream)
    if meta is None:
        raise _no_stream(store, stream)
    return meta


def stream_tier_settings(store: DurableStore, stream: str) -> TierSettings:
    """The tier settings of ``stream`` (not tiered when its metadata has none)."""
    meta = _stream_meta(store, stream)
    return TierSettings.from_json(meta.get("tier"), store.uri(f"{stream}/{STREAM_META_FILE}"))


def configure_tier(
    root: "str | DurableStore",
    stream: str,
    uri: Optional[str],
    *,
    hot_retention_s: Optional[float] = None,
    hot_retention_bytes: Optional[int] = None,
    secondary_retention_s: Optional[float] = None,
) -> TierSettings:
    """Set (or with ``uri=None`` clear) the secondary store and retention of an existing stream.

    A retention is seconds or bytes, or a string with its unit (``"1d"``, ``"10GiB"``);
    ``None`` (or ``"forever"``) is no limit. The secondary store is opened once to check the
    URI. Returns the settings written.
    ``acs tier`` (:mod:`pyspark_acs.cli.tier`) calls it.

    Raises
    ------
    AcsOptionError
        No such stream, a URI pyarrow cannot open, or a retention that is negative or a string
        without its unit (names the option);
        turning tiering off, or pointing the stream at another location, while files of the
        stream are recorded in its secondary store (their only copy may be there: they would
        become unreadable).
    """
    from pyspark_acs.storage.store import open_store

    given = parse_options(TierSettings, {"uri": uri, "hot_retention_s": hot_retention_s,
                                         "hot_retention_bytes": hot_retention_bytes,
                                         "secondary_retention_s": secondary_retention_s}, component="configure_tier")
    store = open_store(root)
    if uri is not None:
        TierStore(uri).check()  # raises naming the URI when it cannot be reached
    _stream_meta(store, stream)  # no such stream: say so before taking its lock
    written: List[TierSettings] = []

    def change(meta: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        if meta is None:  # deleted since the check above
            raise _no_stream(store, stream)
        current = TierSettings.from_json(meta.get("tier"))
        if current.enabled and (uri is None or public_uri(uri) != public_uri(current.uri)):
            # Tier records name objects of the current location: readers find them nowhere else.
            recorded = sum(len(read_manifest(store, stream, shard)) for shard in range(meta["shards"]))
            if recorded:
                what = "turning tiering off" if uri is None else f"moving it to {public_uri(uri)}"
                raise AcsOptionError(
                    f"uri: {recorded} files of stream {stream!r} are recorded in its secondary store "
                    f"{public_uri(current.uri)} (their only copy may be there); {what} would leave them "
                    f"unreadable. Keep the secondary store (a retention of None stops deletions), or let "
                    f"secondary_retention_s delete them first", option="uri")
        # The owner id outlives reconfiguration: objects written under it stay this stream's.
        owner = current.owner or secrets.token_hex(4)
        settings = replace(given, owner=owner)
        written.append(settings)
        meta["tier"] = settings.to_json() if settings.enabled else None
        return meta

    # Under the stream's lock: a copy daemon marking the stream a copy at the same moment keeps
    # its field, and this keeps ours.
    store.update_stream_meta(stream, change)
    return written[-1]


def tier_summary(store: DurableStore, stream: str) -> Dict[str, Any]:
    """A stream's tier settings and state, for ``acs ls`` / ``acs status``: the settings
    (``uri`` without credentials), ``tiered_files`` (recorded in the secondary store),
    ``secondary_only`` (of those, no longer in the hot store), ``hot_files``, ``hot_bytes``
    and ``line`` (a one-line text form)."""
    settings = stream_tier_settings(store, stream)
    out: Dict[str, Any] = settings.to_json()
    out["uri"] = public_uri(settings.uri) if settings.uri else None
    tiered = secondary_only = hot_files = hot_bytes = 0
    for shard in range(store.stream_shards(stream) or 0):
        records = read_manifest(store, stream, shard)
        hot = DurableStore.list_files(store, stream, shard)  # the hot store's own listing
        lengths = store.lengths([f"{shard_dir(stream, shard)}/{f}" for f in hot]) if hot else {}
        tiered += len(records)
        secondary_only += len(set(records) - set(hot))
        hot_files += len(hot)
        hot_bytes += sum(n or 0 for n in lengths.values())
    out.update(tiered_files=tiered, secondary_only=secondary_only, hot_files=hot_files, hot_bytes=hot_bytes)
    out["line"] = (f"{settings.describe()}  tiered_files={tiered} secondary_only={secondary_only} "
                   f"hot_files={hot_files} hot_bytes={hot_bytes}")
    return out
