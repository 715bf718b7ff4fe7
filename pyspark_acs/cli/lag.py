"""``acs lag``: how far a Spark query's checkpoint is behind its streams, per shard.

Registered with :func:`pyspark_acs.cli.main.register_command` when ``acs`` starts::

    acs lag --checkpoint /tmp/ckpt --root /data/acs [--stream orders] [--json] [--watch [--interval 2s]]

Kafka users read consumer-group lag; a Structured Streaming query keeps its position in its
checkpoint instead (:mod:`pyspark_acs.read.lag` reads it), so ``acs lag`` takes the
checkpoint folder and prints, per stream and shard, the committed offset, the readable end
of the shard and the bytes and messages in between.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional

from pyspark_acs.cli.main import add_cache_flags, check_cache_flags, register_command
from pyspark_acs.cli.watch import add_watch_flags, rich_table, text_table, watch

__all__: list = []

_HEAD = ["source", "stream", "shard", "committed", "end", "bytes_behind", "messages_behind", "copy_behind"]


def _offset_text(off: Dict[str, Any]) -> str:
    return f"{off['file']}:{off['length']}" if off["file"] else "(start)"


def lag_report(checkpoint: str, root: str, *, stream: Optional[str] = None, data_cache: Optional[str] = None,
               metadata_cache: Optional[str] = None) -> Dict[str, Any]:
    """What ``acs lag`` prints, as a JSON-able dict.

    ``{"checkpoint", "root", "committed_batch", "running_batch", "basis": "committed" |
    "running", "shards": [{"source", "stream", "shard", "committed", "end", "bytes_behind",
    "messages_behind", "copy_behind_bytes", "waiting"}], "bytes_behind", "messages_behind"}``:
    ``copy_behind_bytes`` is how much of the committed offset's file this cluster's copy still
    lacks (a checkpoint moved to a destination that is behind it; ``waiting`` says why). With
    no batch committed yet the offsets of the running batch are the basis (where the query will
    be once it commits).
    """
    from pyspark_acs.cache.endpoints import DATA_CACHE_ENV, METADATA_CACHE_ENV, cache_endpoints
    from pyspark_acs.read.lag import checkpoint_lag, read_checkpoint
    from pyspark_acs.read.readpath import open_read_path
    from pyspark_acs.storage.store import open_store

    found = read_checkpoint(checkpoint)
    basis, sources = ("committed", found.committed) if found.committed else ("running", found.running)
    store = open_store(root, create=False)  # a missing root is an error naming it
    path = open_read_path(store, data_cache=cache_endpoints(data_cache, DATA_CACHE_ENV),
                          metadata_cache=cache_endpoints(metadata_cache, METADATA_CACHE_ENV))
    rows: List[Dict[str, Any]] = []
    try:
        for index, offsets in sorted(sources.items()):
            streams = None if stream is None else [stream]
            if stream is not None and not any(s == stream for s, _ in offsets):
                continue
            for lag in checkpoint_lag(path, offsets, streams):
                rows.append({"source": index, **lag.to_json()})
    finally:
        path.close()
    if stream is not None and not rows:
        from pyspark_acs.errors import AcsOptionError

        raise AcsOptionError(f"--stream: the checkpoint {checkpoint!r} has no offsets of stream {stream!r}",
                             option="--stream")
    return {
        "checkpoint": checkpoint, "root": root, "committed_batch": found.committed_batch,
        "running_batch": found.running_batch, "basis": basis, "shards": rows,
        "bytes_behind": sum(r["bytes_behind"] for r in rows),
        "messages_behind": sum(r["messages_behind"] for r in rows),
    }


def _summary(report: Dict[str, Any]) -> str:
    committed = report["committed_batch"]
    text = f"checkpoint {report['checkpoint']}: " + (
        f"batch {committed} committed" if committed is not None else "no batch committed yet (counting from the running batch's end)")
    if report["running_batch"] is not None and committed is not None:
        text += f", batch {report['running_batch']} running"
    text += f"; behind: {report['bytes_behind']} bytes, {report['messages_behind']} messages"
    copy = sum(r["copy_behind_bytes"] for r in report["shards"])
    if copy:
        text += f"; this cluster's copy is {copy} bytes short of the checkpoint (a query here waits for it)"
    return text


def _cells(report: Dict[str, Any]) -> List[List[str]]:
    return [[str(r["source"]), r["stream"], str(r["shard"]), _offset_text(r["committed"]), _offset_text(r["end"]),
             str(r["bytes_behind"]), str(r["messages_behind"]), str(r["copy_behind_bytes"])]
            for r in report["shards"]]


def cmd_lag(args: argparse.Namespace) -> int:
    """``acs lag``: print :func:`lag_report` as a table, as JSON (``--json``), or refresh it (``--watch``)."""
    check_cache_flags(args)

    def report() -> Dict[str, Any]:
        return lag_report(args.checkpoint, args.root, stream=args.stream, data_cache=args.data_cache,
                          metadata_cache=args.metadata_cache)

    if args.watch:
        def render():
            from rich.console import Group
            from rich.text import Text

            rep = report()
            return Group(rich_table(f"lag of {args.checkpoint}", _HEAD, _cells(rep)), Text(_summary(rep)))

        return watch(render, interval=args.interval, iterations=args.iterations, command="lag")
    rep = report()
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(_summary(rep))
        print(text_table(_HEAD, _cells(rep)), end="")
    return 0


def _add_lag(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lag", help="bytes and messages a Spark query's checkpoint is behind, per shard",
                       description="Read a Structured Streaming query's committed offsets from its checkpoint "
                                   "(offsets/ and commits/) and print, per stream and shard, the bytes and "
                                   "messages between them and the readable end of the shard (as Kafka's "
                                   "consumer-group lag). With a metadata cache the end counts bytes published "
                                   "but not yet durable.")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="the query's checkpointLocation (folder or URI)")
    p.add_argument("--root", required=True, help="durable store root of the streams the query reads")
    p.add_argument("--stream", default=None, help="only this stream")
    add_cache_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_watch_flags(p)
    p.set_defaults(func=cmd_lag)


register_command("lag", _add_lag)
