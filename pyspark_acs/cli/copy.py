"""``acs tree``, ``acs copy-status`` and ``acs promote``: the copy tree, per-hop copy state and source of a stream.

Registered with :func:`pyspark_acs.cli.main.register_command` when ``acs`` starts::

    acs tree --topology topology.json [--stream orders] [--unhealthy B]
    acs copy-status --topology topology.json --stream orders [--json]
    acs promote orders --to B --topology topology.json [--timeout 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from pyspark_acs.cli.main import register_command
from pyspark_acs.cli.watch import add_watch_flags

__all__: list = []


def cmd_tree(args: argparse.Namespace) -> int:
    """Print the copy tree of one stream, or of every stream in the topology file."""
    from pyspark_acs.server.copy.tree import build_copy_tree
    from pyspark_acs.server.copy.topology import load_topology

    topology = load_topology(args.topology)
    names = [args.stream] if args.stream else sorted(topology.streams)
    unhealthy = {c.strip() for c in (args.unhealthy or "").split(",") if c.strip()}
    for i, name in enumerate(names):
        tree = build_copy_tree(topology, name, unhealthy_clusters=unhealthy)
        if args.json:
            print(json.dumps(tree.to_dict(), indent=2))
        else:
            print(("\n" if i else "") + tree.render(), end="")
    return 0


def cmd_copy_status(args: argparse.Namespace) -> int:
    """Print lengths, bytes behind and delays of every cluster of a stream, per shard.

    What could not be reached or read (a cluster's root that does not exist, a metadata cache
    of which fewer than a majority of replicas answer) is printed on stderr, one line each, and
    the exit code is then 1: the table beside it is not the state of the copies. A silent
    minority of replicas is a warning line. ``--watch`` shows those lines under each refresh
    and goes on (it is what the operator watches for).
    """
    from pyspark_acs.server.copy.status import copy_status, format_status, problems
    from pyspark_acs.server.copy.topology import load_topology

    topology = load_topology(args.topology)
    if args.watch:
        from pyspark_acs.cli.watch import watch

        return watch(lambda: _copy_status_table(args.stream, copy_status(topology, args.stream)),
                     interval=args.interval, iterations=args.iterations, command="copy-status")
    rows = copy_status(topology, args.stream)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_status(rows), end="")
    sys.stdout.flush()
    for line in problems(rows, "warnings"):
        print(f"acs copy-status: warning: {line}", file=sys.stderr)
    found = problems(rows)
    for line in found:
        print(f"acs copy-status: error: {line}", file=sys.stderr)
    return 1 if found else 0


def _copy_status_table(stream: str, rows):
    """``acs copy-status --watch``: the rows as a rich table, with a bar per cluster of how much
    of the source's newest file it holds (the copy of that file in progress)."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.text import Text

    from pyspark_acs.cli.watch import rich_table
    from pyspark_acs.server.copy.status import format_delay, problems

    source = {r["shard"]: r for r in rows if r["parent"] is None}
    cells = []
    for r in rows:
        src = source.get(r["shard"])
        total = src["durable_length"] if src and src["file"] == r["file"] else None
        bar = ProgressBar(total=float(total), completed=float(r["durable_length"] or 0), width=20) if total else "-"
        cells.append([str(r["shard"]), ("  " * r["depth"]) + r["cluster"], r["parent"] or "-", r["file"] or "-",
                      _n(r["durable_length"]), _n(r["cache_length"]), _n(r["bytes_behind"]), bar,
                      format_delay(r["durable_delay_s"]), format_delay(r["cache_delay_s"]), format_delay(r["hop_delay_s"])])
    table = rich_table(f"copy status of stream {stream}",
                       ["shard", "cluster", "parent", "newest file", "durable", "cache", "behind", "newest file copied",
                        "delay(durable)", "delay(cache)", "hop"], cells)
    warnings = [Text(f"acs copy-status: warning: {line}", style="yellow") for line in problems(rows, "warnings")]
    errors = [Text(f"acs copy-status: error: {line}", style="bold red") for line in problems(rows)]
    return Group(table, *warnings, *errors)


def cmd_promote(args: argparse.Namespace) -> int:
    """Make a destination the source of a stream (pyspark_acs.server.copy.promote), printing
    each step; exit 1 when a copy daemon that answers did not take the new topology in time."""
    from pyspark_acs.errors import AcsTimeoutError
    from pyspark_acs.server.copy.promote import promote

    def say(line: str) -> None:
        print(f"acs promote: {line}", file=sys.stderr, flush=True)

    try:
        report = promote(args.topology, args.stream, args.to, timeout=args.timeout, progress=say)
    except AcsTimeoutError as exc:
        print(f"acs promote: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        cut = ", ".join(f"shard {s}: {f} at byte {n}" for s, (f, n) in sorted(report.cut.items())) or "no files yet"
        print(f"{report.source} is the source of {report.stream} (epoch {report.epoch}, after {report.previous}); "
              f"cut: {cut}")
    return 0


def _n(value) -> str:
    return "-" if value is None else str(value)


def _add_tree(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tree", help="draw the copy tree of a stream (from a topology file)",
                       description="Draw the copy tree(s) the copy daemons build from a topology file.")
    p.add_argument("--topology", required=True, metavar="FILE", help="topology file (.json or .toml)")
    p.add_argument("--stream", default=None, help="only this stream (default: every stream)")
    p.add_argument("--unhealthy", default=None, metavar="C1,C2", help="treat these clusters as unhealthy")
    p.add_argument("--json", action="store_true", help="print JSON instead of a drawing")
    p.set_defaults(func=cmd_tree)


def _add_copy_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("copy-status", help="per-hop copy state of a stream: lengths, bytes behind, delay",
                       description="Lengths at each cluster, bytes behind the source and copy delay per hop.")
    p.add_argument("--topology", required=True, metavar="FILE", help="topology file (.json or .toml)")
    p.add_argument("--stream", required=True, help="stream name")
    p.add_argument("--json", action="store_true", help="print JSON rows")
    add_watch_flags(p)
    p.set_defaults(func=cmd_copy_status)


def _add_promote(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("promote", help="make a destination the source of a stream (the source is lost, or a move)",
                       description="Bring cluster TO to the longest copy of the stream any reachable cluster holds, "
                                   "seal it there, record the cut, make TO the source in the topology file and wait "
                                   "until every reachable copy daemon runs it. Safe to run again.")
    p.add_argument("stream", help="stream name")
    p.add_argument("--to", required=True, metavar="CLUSTER", help="the destination cluster to make the source")
    p.add_argument("--topology", required=True, metavar="FILE.json", help="the topology file the copy daemons read")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for the copy daemons to run the new topology (default 60)")
    p.add_argument("--json", action="store_true", help="print what was done as JSON")
    p.set_defaults(func=cmd_promote)


register_command("tree", _add_tree)
register_command("promote", _add_promote)
register_command("copy-status", _add_copy_status)
