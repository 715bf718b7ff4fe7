"""``acs tier``: set, change, turn off and show a stream's tiered storage settings.

Registered with :func:`pyspark_acs.cli.main.register_command` when ``acs`` starts::

    acs tier STREAM --root R                      # show the settings and tier state
    acs tier STREAM URI --root R [--hot-retention 1d] [--hot-retention-bytes 10GiB] [--secondary-retention 90d]
    acs tier STREAM --root R --hot-retention 12h  # change one setting, keep the others
    acs tier STREAM --root R --off                # stop tiering (refused while files live in the tier)

The retention flags are generated from the declarations of
:class:`pyspark_acs.storage.tier_settings.TierSettings`: durations and sizes are read by
:mod:`pyspark_acs.units` (``90d``, ``12h``, ``10GiB``); a retention needs its unit (a bare
``1`` is refused rather than read as one second); ``forever`` (or ``none``) removes a
retention; a bad value is a usage error naming the flag. A retention flag not given keeps its
current value. The settings are written by :func:`pyspark_acs.storage.tier_settings.configure_tier`, the one
writer of them, which checks the URI (the bucket must exist) and refuses to strand tiered files.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, Optional

from pyspark_acs.cli.main import register_command
from pyspark_acs.errors import AcsOptionError
from pyspark_acs.units import format_bytes

__all__: list = []

#: The TierSettings fields ``acs tier`` sets with flags (the URI is its second argument).
_RETENTIONS = ("hot_retention_s", "hot_retention_bytes", "secondary_retention_s")
#: A retention flag's value when not given (not a string: argparse would parse one).
_UNCHANGED = object()


def _retention_flags(p: argparse.ArgumentParser) -> None:
    """The retention flags, generated from TierSettings' declarations (deferred: that module
    imports pyarrow, which the other commands do not need). A flag not given is
    :data:`_UNCHANGED`, so that it keeps the stream's value while ``forever`` (None) removes it."""
    from pyspark_acs.options import add_option_flags
    from pyspark_acs.storage.tier_settings import TierSettings

    add_option_flags(p, TierSettings, only=_RETENTIONS, shown={f: "unchanged" for f in _RETENTIONS})
    p.set_defaults(**{f: _UNCHANGED for f in _RETENTIONS})


def _flags() -> Dict[str, str]:
    """Field -> flag of the retentions."""
    import dataclasses

    from pyspark_acs.options import flag_of
    from pyspark_acs.storage.tier_settings import TierSettings

    return {f.name: flag_of(f) for f in dataclasses.fields(TierSettings) if f.name in _RETENTIONS}


def _age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "forever"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _show(summary: Dict[str, Any], stream: str) -> None:
    if not summary["uri"]:
        print(f"stream {stream}: not tiered (hot files: {summary['hot_files']}, hot bytes: {summary['hot_bytes']})")
        return
    hot_bytes = summary["hot_retention_bytes"]
    print(f"stream {stream}: tiered to {summary['uri']}")
    print(f"  hot retention:        {_age(summary['hot_retention_s'])}")
    print(f"  hot retention bytes:  "
          f"{'unbounded' if hot_bytes is None else f'{format_bytes(hot_bytes)} ({hot_bytes} B)'}")
    print(f"  secondary retention:  {_age(summary['secondary_retention_s'])}")
    print(f"  tiered files: {summary['tiered_files']} (only in the secondary store: {summary['secondary_only']}), "
          f"hot files: {summary['hot_files']}, hot bytes: {summary['hot_bytes']}")


def cmd_tier(args: argparse.Namespace) -> int:
    """Run ``acs tier``."""
    from pyspark_acs.storage.store import open_store
    from pyspark_acs.storage.tier_settings import configure_tier, stream_tier_settings, tier_summary

    given = {field: getattr(args, field) for field in _RETENTIONS if getattr(args, field) is not _UNCHANGED}
    named = ", ".join(flag for field, flag in _flags().items() if field in given)
    if args.off and (args.uri or given):
        raise AcsOptionError(f"--off: takes no URI and no retention flags (got {args.uri or named})",
                             option="--off")
    store = open_store(args.root, create=False)  # a missing root is an error naming it
    try:
        current = stream_tier_settings(store, args.stream)  # no such stream: an error naming it
        if args.off:
            configure_tier(store, args.stream, None)
        elif args.uri or given:
            uri = args.uri or current.uri
            if not uri:
                raise AcsOptionError(f"URI: stream {args.stream!r} is not tiered; give the secondary store's URI "
                                     f"(e.g. s3://bucket/prefix) with {named}", option="URI")
            values = {field: getattr(current, field) for field in _RETENTIONS}
            values.update(given)  # a flag not given keeps the stream's value
            configure_tier(store, args.stream, uri, **values)
        summary = tier_summary(store, args.stream)
    finally:
        store.close()
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        _show(summary, args.stream)
    return 0


def _add_tier(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tier", help="set, change, turn off or show a stream's tiered storage",
                       description="Set, change, turn off or show a stream's tiered storage: sealed files move "
                       "to a secondary store (acs-tier-mover) and stay readable by the same offsets; see "
                       "docs/tiered.md. A retention flag not given keeps its value; 'forever' removes it.")
    p.add_argument("stream", metavar="STREAM", help="stream name (the stream must exist)")
    p.add_argument("uri", metavar="URI", nargs="?", default=None,
                   help="secondary store: s3://bucket/prefix[?endpoint_override=host:port&scheme=http], "
                        "gs://bucket/prefix, or a folder (default: the stream's current one)")
    p.add_argument("--root", required=True, help="durable (hot) store root: a local folder or a URI")
    p.defer(_retention_flags)
    p.add_argument("--off", action="store_true",
                   help="stop tiering the stream (refused while files of it are recorded in the secondary store)")
    p.add_argument("--json", action="store_true", help="print the settings and tier state as JSON")
    p.set_defaults(func=cmd_tier)


register_command("tier", _add_tier)
