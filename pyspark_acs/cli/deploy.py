"""``acs up``, ``acs down`` and ``acs status``: a local cache deployment and what it holds.

Registered with :func:`pyspark_acs.cli.main.register_command` when ``acs`` starts::

    acs up [--dir .acs-local] [--data-replicas 3] [--metadata-replicas 3] [--capacity 256MiB] [--ttl 60s]
           [--tier-mover --root ROOT [--tier-interval 10s]]
    acs down [--dir .acs-local]
    acs status --root ROOT [--stream S] [--metadata-cache EPS] [--data-cache EPS] [--dir .acs-local] [--json]

``up`` starts the servers in the background (they outlive the command) and prints their
endpoints and the ``export ACS_DATA_CACHE=... ACS_METADATA_CACHE=...`` lines (with
``--tier-mover``, also a tier mover over ``--root``: docs/tiered.md); ``down`` stops them all. ``status`` prints, per stream and shard, each file's durable length, the cache and
durable lengths published in the metadata cache and how many bytes the cache is behind,
then the health of every cache server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Optional, Tuple

from pyspark_acs.cache.endpoints import DATA_CACHE_ENV, METADATA_CACHE_ENV, cache_endpoints
from pyspark_acs.cli.main import add_cache_flags, check_cache_flags, register_command
from pyspark_acs.cli.watch import add_watch_flags
from pyspark_acs.errors import AcsOptionError
from pyspark_acs.options import add_option_flags, duration_parser, flag_type, options_from_flags
from pyspark_acs.server.cache.options import DEFAULT_CAPACITY_BYTES, ROLE_DEFAULT_TTL_S, CacheServerOptions
from pyspark_acs.units import format_duration, format_size

__all__: list = []

#: Where ``acs up`` keeps its deployment state unless told otherwise.
DEFAULT_DIR = ".acs-local"
#: Environment variables ``acs up`` tells the shell to set; every entry point reads them.
ENV_DATA = DATA_CACHE_ENV
ENV_METADATA = METADATA_CACHE_ENV
#: The deployment folder ``acs up`` used: ``acs status`` and ``acs down`` find it anywhere.
ENV_DEPLOYMENT = "ACS_DEPLOYMENT"
#: ``acs up --dir X`` leaves this file in the folder it ran in, naming X: ``acs down`` and
#: ``acs status`` run there without ``--dir`` find the deployment (``acs down`` removes it).
POINTER_FILE = ".acs-deployment"


def deployment_dir(given: Optional[str]) -> Tuple[str, str]:
    """The deployment folder ``acs down``/``acs status`` use, and how it was found.

    ``--dir`` when given, else ``$ACS_DEPLOYMENT``, else the folder :data:`POINTER_FILE` in the
    current folder names (left by ``acs up --dir``), else :data:`DEFAULT_DIR`.
    """
    if given:
        return given, "--dir"
    if os.environ.get(ENV_DEPLOYMENT):
        return os.environ[ENV_DEPLOYMENT], f"${ENV_DEPLOYMENT}"
    try:
        with open(POINTER_FILE, encoding="utf-8") as f:
            pointed = f.read().strip()
    except OSError:
        pointed = ""
    if pointed:
        return pointed, f"./{POINTER_FILE}, left by 'acs up --dir'"
    return DEFAULT_DIR, "the default"


def _write_pointer(folder: str) -> None:
    """Name a non-default deployment folder in :data:`POINTER_FILE` here (see :func:`deployment_dir`)."""
    if os.path.abspath(folder) == os.path.abspath(DEFAULT_DIR):
        return
    try:
        with open(POINTER_FILE, "w", encoding="utf-8") as f:
            f.write(os.path.abspath(folder) + "\n")
    except OSError:  # a read-only folder: --dir then stays needed, which the hint below says
        pass


def _replicas(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 0 or n > 64:
        raise argparse.ArgumentTypeError(f"{n} is out of range (0-64)")
    return n


# -- up / down ------------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    """``acs up``: start a local deployment in ``args.dir`` and print its endpoints and ``export`` line.

    Returns 0.

    Raises
    ------
    DeploymentError
        If ``args.dir`` already holds a running deployment, or a server fails to start.
    """
    from pyspark_acs.server.local.deploy import acs_up

    if (args.cluster is None) != (args.topology is None):
        raise AcsOptionError("--cluster and --topology go together: name the cluster this deployment is and "
                             "the topology file to record it in", option="--cluster")
    if args.tier_mover and args.root is None:
        raise AcsOptionError("--tier-mover: give the hot store root it tiers with --root", option="--tier-mover")
    if args.cluster is not None and args.root is None:
        raise AcsOptionError("--root: give the cluster's durable store root to record in the topology file",
                             option="--root")
    links = [_link(text) for text in args.link]
    tier_interval = args.tier_interval
    # The settings its flags give the data servers, with acs-cache-server's declared defaults.
    server = options_from_flags(CacheServerOptions, args, role="data")
    security, exports = _security(args, server)
    if args.topology is not None:
        from pyspark_acs.server.copy.topology import check_writable

        check_writable(args.topology)  # before any server starts
    dep = acs_up(
        args.dir,
        data_replicas=args.data_replicas,
        metadata_replicas=args.metadata_replicas,
        capacity=DEFAULT_CAPACITY_BYTES["data"] if server.capacity is None else server.capacity,
        data_ttl=ROLE_DEFAULT_TTL_S["data"] if server.ttl is None else server.ttl,
        log_level=args.log_level,  # not given: the servers' own default
        host=server.host,
        base_port=args.base_port,
        security=security,
        insecure=server.insecure,
        tier_mover_root=args.root if args.tier_mover else None,
        tier_interval=tier_interval,
    )
    data, meta = dep.data_endpoints, dep.metadata_endpoints
    for role in ("data", "metadata"):
        for s in dep.servers[role]:
            print(f"{s.name}  {s.endpoint}  pid={s.pid}  metrics={s.metrics_url or '-'}  log={s.log_path}")
    mover = dep.tier_mover
    if mover is not None:
        print(f"{mover.name}  tier mover of {args.root}  pid={mover.pid}  metrics={mover.metrics_url or '-'}  "
              f"log={mover.log_path}")
    print(f"data cache:     {data}")
    print(f"metadata cache: {meta}")
    if args.cluster is not None:
        from pyspark_acs.server.copy.topology import set_cluster

        copy_port = args.copy_port if args.copy_port is not None else _free_port(server.host)
        host = f"[{server.host}]" if ":" in server.host else server.host
        try:
            set_cluster(args.topology, args.cluster, {
                "root": args.root, "data_cache": data, "metadata_cache": meta, "copy_daemon": f"{host}:{copy_port}",
            }, links)
        except BaseException:
            from pyspark_acs.server.local.deploy import acs_down

            acs_down(args.dir)  # no servers left behind that no file records
            raise
        print(f"topology:       cluster {args.cluster} recorded in {args.topology} (copy daemon port {copy_port}); "
              f"start it with: acs-copy-daemon --topology {args.topology} --cluster {args.cluster}")
    _write_pointer(args.dir)
    extra = "".join(f" {k}={v}" for k, v in exports.items())
    print(f"export {ENV_DATA}={data} {ENV_METADATA}={meta} {ENV_DEPLOYMENT}={os.path.abspath(args.dir)}{extra}")
    print(f"stop with: acs down (in this folder) or acs down --dir {args.dir}", file=sys.stderr)
    sys.stdout.flush()
    return 0


def _security(args: argparse.Namespace, server: CacheServerOptions):
    """The servers' security settings of ``acs up`` (``server``: those its flags give) and the
    variables the export line adds.

    ``--secure`` makes a self-signed CA, certificates and a token file under ``DIR/tls``
    (kept across restarts); explicit ``--token-file``/``--tls-*`` flags win over it, and the
    environment (``$ACS_CACHE_TOKEN``, ``$ACS_TOKEN_FILE``, ``$ACS_TLS_*``) fills the rest.

    Raises
    ------
    AcsOptionError
        For unreadable files, or a non-loopback ``--host`` without TLS and a token and without
        ``--insecure``.
    """
    from pyspark_acs.security import (ENV_MTLS, ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TOKEN, ENV_TOKEN_FILE,
                                      check_bind, resolve_security)

    made = {}
    if args.secure:
        from pyspark_acs.server.local.tls import make_local_tls

        made = make_local_tls(os.path.join(args.dir, "tls"), [server.host])
    token_file = server.token_file or (made.get("token_file") if not os.environ.get(ENV_TOKEN) else None)
    security = resolve_security(token_file=token_file, tls_cert=server.tls_cert or made.get("cert"),
                                tls_key=server.tls_key or made.get("key"), tls_ca=server.tls_ca or made.get("ca"),
                                mtls=server.mtls)
    check_bind(server.host, security, server.insecure, what="acs up")
    exports = {}
    if token_file:
        exports[ENV_TOKEN_FILE] = os.path.abspath(token_file)
    for name, value in ((ENV_TLS_CA, security.tls_ca), (ENV_TLS_CERT, security.tls_cert),
                        (ENV_TLS_KEY, security.tls_key)):
        if value and os.environ.get(name) != value:
            exports[name] = os.path.abspath(value)
    if security.mtls and not os.environ.get(ENV_MTLS):
        exports[ENV_MTLS] = "1"  # clients present the same certificate (it allows client auth too)
    return security, exports


def _link(text: str):
    """``CLUSTER`` or ``CLUSTER:COST`` of ``--link``."""
    name, _, cost = text.partition(":")
    try:
        return name, int(cost) if cost else 1
    except ValueError:
        raise AcsOptionError(f"--link: {text!r} is not CLUSTER or CLUSTER:COST (a whole number)",
                             option="--link") from None


def _free_port(host: str) -> int:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cmd_down(args: argparse.Namespace) -> int:
    """``acs down``: stop the deployment in the folder :func:`deployment_dir` finds; returns 0
    (also when there is none, saying where it looked and how to name another folder)."""
    from pyspark_acs.server.local.deploy import acs_down, load_deployment

    folder, how = deployment_dir(args.dir)
    if load_deployment(folder) is None:
        hint = "" if args.dir else (f"; if 'acs up --dir DIR' started it, run 'acs down --dir DIR' (or set "
                                    f"${ENV_DEPLOYMENT}=DIR, as acs up's export line does)")
        print(f"acs down: no deployment in {os.path.abspath(folder)} ({how}){hint}", file=sys.stderr)
        return 0
    stopped = acs_down(folder)
    try:
        with open(POINTER_FILE, encoding="utf-8") as f:
            if os.path.abspath(f.read().strip()) == os.path.abspath(folder):
                os.remove(POINTER_FILE)
    except OSError:
        pass
    print(f"stopped {len(stopped)} servers" + (f": {' '.join(stopped)}" if stopped else ""))
    return 0


# -- status ---------------------------------------------------------------------------------


def _client(endpoints: Optional[str], name: str):
    if not endpoints:
        return None
    from pyspark_acs.cache.client import CacheClient

    return CacheClient(endpoints, name=name)


def status_report(
    root: str,
    *,
    stream: Optional[str] = None,
    data_cache: Optional[str] = None,
    metadata_cache: Optional[str] = None,
) -> Dict[str, Any]:
    """What ``acs status`` prints, as a JSON-able dict.

    ``{"streams": [{"stream", "shards": [{"shard", "head", "files": [{"file", "durable",
    "published_cache", "published_durable", "behind"}], "quarantined": [...]}]}], "servers":
    [{"role", "endpoint", "healthy", ...stats}]}``. ``behind`` is the durable length minus the
    published cache length (``None`` when the metadata cache does not know the file or is not
    given). ``quarantined``: the shard's ranges past a promotion's cut that this cluster moved
    aside when it took the new history (``file``, ``start``, ``end``, ``epoch``, ``source``,
    ``moved_to`` as a URI; docs/copy.md, "Quarantine").
    """
    from pyspark_acs.cache.metadata import MetadataCache
    from pyspark_acs.format.names import shard_dir
    from pyspark_acs.read.positions import quarantine_entries
    from pyspark_acs.storage.store import open_store
    from pyspark_acs.storage.tier_settings import tier_summary
    from pyspark_acs.errors import CacheError

    data = _client(data_cache, "data cache")
    meta_client = _client(metadata_cache, "metadata cache")
    try:
        store = open_store(root, create=False)
    except BaseException:
        for c in (data, meta_client):
            if c is not None:
                c.close()
        raise
    meta = MetadataCache(meta_client) if meta_client else None
    report: Dict[str, Any] = {"root": store.root, "streams": [], "servers": [], "errors": []}
    try:
        streams = [stream] if stream else store.list_streams()
        for name in streams:
            shards = store.stream_shards(name)
            if shards is None:
                raise AcsOptionError(f"stream: no stream {name!r} in {store.root}", option="stream")
            entry: Dict[str, Any] = {"stream": name, "shards": [], "tier": tier_summary(store, name)}
            meta_here = store.stream_meta(name)
            for shard in range(shards):
                folder = shard_dir(name, shard)
                files = store.list_files(name, shard)
                rels = [f"{folder}/{f}" for f in files]
                durable = store.lengths(rels) if rels else {}
                published: Dict[str, Any] = {}
                head = None
                if meta is not None:
                    try:
                        uris = [store.uri(r) for r in rels]
                        got = meta.lengths(uris) if uris else {}
                        published = {r: got[store.uri(r)] for r in rels}
                        head = meta.heads([store.uri(folder)])[store.uri(folder)]
                    except CacheError as exc:
                        report["errors"].append(f"{name}/{shard}: metadata cache: {exc}")
                rows = []
                for f, r in zip(files, rels):
                    pc, pd = published.get(r, (None, None))
                    d = durable.get(r)
                    rows.append({
                        "file": f,
                        "durable": d,
                        "published_cache": pc,
                        "published_durable": pd,
                        "behind": (d - pc) if (d is not None and pc is not None) else None,
                    })
                quarantined = [{k: e.get(k) for k in ("file", "start", "end", "epoch", "source")}
                               | {"moved_to": store.uri(e["moved_to"])}
                               for e in quarantine_entries(meta_here, shard, moved_only=True)]
                entry["shards"].append({"shard": shard, "head": head, "files": rows, "quarantined": quarantined})
            report["streams"].append(entry)
        for role, client in (("data", data), ("metadata", meta_client)):
            if client is None:
                continue
            health = client.health()
            stats = client.stats()
            for ep in client.endpoints:
                s = stats.get(ep, {})
                report["servers"].append({
                    "role": role,
                    "endpoint": ep,
                    "healthy": bool(health.get(ep)),
                    "entries": s.get("entries"),
                    "used_bytes": s.get("used_bytes"),
                    "capacity_bytes": s.get("capacity_bytes"),
                    "uptime_s": round(s["uptime_s"], 1) if "uptime_s" in s else None,
                    "error": s.get("error"),
                })
    finally:
        for c in (data, meta_client):
            if c is not None:
                c.close()
        store.close()
    return report


def _fmt(v: Any) -> str:
    return "-" if v is None else str(v)


def _print_status(report: Dict[str, Any]) -> None:
    print(f"root {report['root']}")
    for entry in report["streams"]:
        print(f"stream {entry['stream']}  shards={len(entry['shards'])}")
        if (entry.get("tier") or {}).get("uri"):
            print(f"  {entry['tier']['line']}")
        for sh in entry["shards"]:
            print(f"  shard {sh['shard']}  files={len(sh['files'])}  head={_fmt(sh['head'])}")
            for row in sh["files"]:
                print(
                    f"    {row['file']}  durable={_fmt(row['durable'])}  "
                    f"published_cache={_fmt(row['published_cache'])}  "
                    f"published_durable={_fmt(row['published_durable'])}  behind={_fmt(row['behind'])}"
                )
            for q in sh.get("quarantined") or ():
                print(f"    quarantined: {q['file']} bytes [{q['start']}, {q['end']}) past the cut of promotion "
                      f"epoch {q['epoch']} (new source {q['source']}), moved to {q['moved_to']}")
    if report["servers"]:
        print("cache servers")
        for s in report["servers"]:
            state = "healthy" if s["healthy"] else f"DOWN ({s['error'] or 'no answer'})"
            extra = ""
            if s["healthy"]:
                extra = f"  entries={_fmt(s['entries'])}  used={_fmt(s['used_bytes'])}/{_fmt(s['capacity_bytes'])}"
            print(f"  {s['role']:<8}  {s['endpoint']}  {state}{extra}")
    for e in report["errors"]:
        print(f"warning: {e}", file=sys.stderr)


def _status_renderable(report: Dict[str, Any]):
    """``acs status --watch``: one row per shard (its newest file, the bytes the cache is
    behind over all its files) and one per cache server, as rich tables."""
    from rich.console import Group
    from rich.text import Text

    from pyspark_acs.cli.watch import rich_table

    rows = []
    for entry in report["streams"]:
        for sh in entry["shards"]:
            newest = sh["files"][-1] if sh["files"] else None
            behind = [r["behind"] for r in sh["files"] if r["behind"] is not None]
            rows.append([entry["stream"], str(sh["shard"]), str(len(sh["files"])), _fmt(newest and newest["file"]),
                         _fmt(newest and newest["durable"]), _fmt(newest and newest["published_cache"]),
                         _fmt(newest and newest["published_durable"]), _fmt(sum(behind) if behind else None),
                         _fmt(sh["head"])])
    parts: list = [rich_table(f"root {report['root']}", ["stream", "shard", "files", "newest file", "durable",
                                                        "published_cache", "published_durable", "behind", "head"], rows)]
    if report["servers"]:
        servers = []
        for s in report["servers"]:
            state = "healthy" if s["healthy"] else f"DOWN ({s['error'] or 'no answer'})"
            used = f"{_fmt(s['used_bytes'])}/{_fmt(s['capacity_bytes'])}" if s["healthy"] else "-"
            servers.append([s["role"], s["endpoint"], state, _fmt(s["entries"] if s["healthy"] else None), used,
                            _fmt(s["uptime_s"])])
        parts.append(rich_table("cache servers", ["role", "endpoint", "state", "entries", "used/capacity", "uptime_s"],
                                servers))
    parts += [Text(f"warning: {e}", style="yellow") for e in report["errors"]]
    return Group(*parts)


def cmd_status(args: argparse.Namespace) -> int:
    """``acs status``: print :func:`status_report` as text, or as JSON with ``--json``, or refresh
    a table in place with ``--watch``; returns 0.

    Each cache is its flag's, else its variable's (``$ACS_DATA_CACHE`` / ``$ACS_METADATA_CACHE``;
    ``none`` turns it off); with neither flag given nor set in the environment, the deployment's
    in ``--dir``.

    Raises
    ------
    AcsOptionError
        If ``--stream`` names no stream of the store.
    """
    check_cache_flags(args)
    # Each as every command takes it (given, else the environment's; none: no cache) ...
    data, meta = cache_endpoints(args.data_cache, ENV_DATA), cache_endpoints(args.metadata_cache, ENV_METADATA)
    folder, _ = deployment_dir(args.dir)
    if args.data_cache is None and args.metadata_cache is None and data is None and meta is None:
        # ... and with neither flag given nor in the environment, the local deployment's in --dir.
        from pyspark_acs.server.local.deploy import load_deployment

        state = load_deployment(folder)
        if state is not None:
            data = state.get("data_endpoints") or None
            meta = state.get("metadata_endpoints") or None
        else:
            print(f"acs status: no cache endpoints: none given (--data-cache/--metadata-cache), ${ENV_DATA} / "
                  f"${ENV_METADATA} unset, and no deployment in {os.path.abspath(folder)} (--dir, "
                  f"${ENV_DEPLOYMENT}); showing the durable store only", file=sys.stderr)
    if args.watch:
        from pyspark_acs.cli.watch import watch

        def render():
            return _status_renderable(status_report(args.root, stream=args.stream, data_cache=data,
                                                    metadata_cache=meta))

        return watch(render, interval=args.interval, iterations=args.iterations, command="status")
    report = status_report(args.root, stream=args.stream, data_cache=data, metadata_cache=meta)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_status(report)
    return 0


# -- registration ---------------------------------------------------------------------------


def _data_only(by_role: Dict[str, str]) -> str:
    return f"{by_role['data']} on the data servers; the metadata servers keep {by_role['metadata']}"


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a local deployment of cache servers in the background",
                       description="Start data and metadata cache servers as background processes; "
                                   "print their endpoints and the export lines for the shell.")
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"deployment folder: logs, pids, state (default {DEFAULT_DIR})")
    p.add_argument("--data-replicas", type=_replicas, default=3, help="data-cache servers (default 3)")
    p.add_argument("--metadata-replicas", type=_replicas, default=3, help="metadata-cache servers (default 3)")
    # The servers' own settings, generated from acs-cache-server's declarations; --capacity and
    # --ttl set the data servers' only (the metadata servers keep their role's defaults).
    add_option_flags(p, CacheServerOptions, only=("capacity", "ttl", "log_level", "host"), former={"ttl": "--data-ttl"},
                     shown={"capacity": _data_only({r: format_size(b) for r, b in DEFAULT_CAPACITY_BYTES.items()}),
                            "ttl": _data_only({r: format_duration(t) for r, t in ROLE_DEFAULT_TTL_S.items()})})
    p.add_argument("--base-port", type=int, default=None, metavar="N",
                   help="fixed ports: gRPC from N (data servers, then metadata), then the metrics ports "
                        "(default: free ports)")
    p.add_argument("--cluster", default=None, help="record this deployment as cluster NAME in --topology")
    p.add_argument("--topology", default=None, metavar="FILE.json",
                   help="topology file to add or update the cluster's entry in (created if missing)")
    p.add_argument("--root", default=None,
                   help="the cluster's durable store root (with --cluster; the hot store with --tier-mover)")
    p.add_argument("--tier-mover", action="store_true",
                   help="also run a tier mover over --root (streams with a tier: acs tier); stopped by acs down")
    p.add_argument("--tier-interval", default="10s", type=flag_type(duration_parser(0.01), "--tier-interval"),
                   help="time between the tier mover's passes (default 10s)")
    p.add_argument("--copy-port", type=int, default=None, help="the cluster's copy daemon port (default: a free one)")
    p.add_argument("--link", action="append", default=[], metavar="CLUSTER[:COST]",
                   help="a link from this cluster to another (repeatable; cost 1 by default)")
    s = p.add_argument_group("security (docs/security.md)")
    s.add_argument("--secure", action="store_true",
                   help="make a self-signed CA, certificates and a token file under DIR/tls and serve TLS with "
                        "a token; the export line names the files")
    add_option_flags(s, CacheServerOptions, only=("token_file", "tls_cert", "tls_key", "tls_ca", "mtls", "insecure"))
    p.set_defaults(func=cmd_up)


def _add_down(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="stop the local deployment started by 'acs up'",
                       description="Stop every server of the local deployment 'acs up' started (SIGTERM, then "
                                   "SIGKILL) and remove its state file. Without --dir: $ACS_DEPLOYMENT, else the "
                                   f"folder ./{POINTER_FILE} names (acs up --dir leaves it), else {DEFAULT_DIR}.")
    p.add_argument("--dir", default=None,
                   help=f"deployment folder (default ${ENV_DEPLOYMENT}, else the one ./{POINTER_FILE} names, "
                        f"else {DEFAULT_DIR})")
    p.set_defaults(func=cmd_down)


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="per shard: durable and published lengths, bytes behind; cache health",
                       description="Per stream and shard, each file's durable length, the cache and durable "
                                   "lengths published in the metadata cache and the bytes the cache is "
                                   "behind; then each cache server's health. Endpoints default to "
                                   f"${ENV_DATA} / ${ENV_METADATA}, else the deployment in --dir.")
    p.add_argument("--root", required=True, help="durable store root: a local folder or a URI")
    p.add_argument("--stream", default=None, help="only this stream")
    add_cache_flags(p, otherwise=", else the deployment in --dir, when neither flag is given")
    p.add_argument("--dir", default=None,
                   help=f"local deployment to ask when no endpoints are given (default ${ENV_DEPLOYMENT}, else the "
                        f"one ./{POINTER_FILE} names, else {DEFAULT_DIR})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_watch_flags(p)
    p.set_defaults(func=cmd_status)


register_command("up", _add_up)
register_command("down", _add_down)
register_command("status", _add_status)
