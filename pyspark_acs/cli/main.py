"""The ``acs`` command line: produce, tail, ls (and the deployment and copy commands).

Every command has ``--help``. Errors from the library are printed as one line
``acs: error: ...`` with exit code 1; bad usage exits with code 2 (argparse).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from typing import Callable, Dict, Optional, Sequence

from pyspark_acs.errors import AcsError, AcsOptionError

__all__ = ["DEFAULT_NEW_SHARDS", "STREAM_WAIT_POLL_S", "build_parser", "main"]

#: Shards of a stream ``acs produce`` creates without ``--shards``.
DEFAULT_NEW_SHARDS = 1
#: How often ``acs tail --wait`` looks for a stream that does not exist yet.
STREAM_WAIT_POLL_S = 0.5


def _add_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", required=True, help="durable store root: a local folder or a URI (file://, hdfs://)")


def _add_caches(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-cache", default=None, metavar="HOST:PORT,...", help="data-cache endpoints, or none (default: $ACS_DATA_CACHE)")
    p.add_argument("--metadata-cache", default=None, metavar="HOST:PORT,...", help="metadata-cache endpoints, or none (default: $ACS_METADATA_CACHE)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``acs`` (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="acs",
        description="pyspark_acs: ordered message delivery through files (Fast ACS).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("produce", help="send lines (or whole files) from stdin into a stream",
                       description="Send each line of stdin as one message (or each --file as one message).")
    _add_root(p)
    p.add_argument("--stream", required=True, help="stream name")
    p.add_argument("--shards", type=int, default=None,
                   help="shard count when creating the stream (default 1); an existing stream keeps its own")
    p.add_argument("--key-separator", default=None, metavar="SEP",
                   help="split each line at the first SEP into key and value (key picks the shard)")
    p.add_argument("--shard", type=int, default=None, help="send every message to this shard")
    p.add_argument("--file", action="append", default=[], metavar="PATH",
                   help="send the content of PATH as one message (repeatable); stdin is then not read")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr: messages, bytes, rate (default: when stderr is a terminal)")
    _add_caches(p)
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("tail", help="print messages of a stream as they arrive",
                       description="Follow a stream and print its messages in order per shard.")
    _add_root(p)
    p.add_argument("--stream", required=True, help="stream name (or a comma-separated list)")
    p.add_argument("--from", dest="start", default="earliest",
                   help="earliest (default), latest, an offsets JSON object, or @FILE holding one")
    p.add_argument("--format", choices=("text", "json", "raw"), default="text",
                   help="text: value per line; json: one object per message; raw: value bytes only")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop after this many seconds without new messages (default: follow forever)")
    p.add_argument("--max-messages", type=int, default=None, help="stop after this many messages")
    p.add_argument("--offsets-out", default=None, metavar="FILE",
                   help="write the final offsets JSON here (resume later with --from @FILE)")
    p.add_argument("--shards", default=None, help="comma-separated shards to follow (default all)")
    p.add_argument("--wait", action="store_true",
                   help="wait for streams (and the root) that do not exist yet instead of failing")
    _add_caches(p)
    p.set_defaults(func=cmd_tail)

    p = sub.add_parser("ls", help="list streams, shards, files and lengths")
    _add_root(p)
    p.add_argument("--stream", default=None, help="only this stream")
    p.set_defaults(func=cmd_ls)

    for name, func in _EXTRA_COMMANDS.items():
        func(sub)
    return parser


#: Further commands register here: name -> function(subparsers) adding the parser.
_EXTRA_COMMANDS: Dict[str, Callable[[argparse._SubParsersAction], None]] = {}


def _read_path(args: argparse.Namespace, root: str):
    """The read path of ``acs tail`` (a tailing reader: bytes pushed): caches when given, else
    the durable store alone."""
    from pyspark_acs.cache.endpoints import DATA_CACHE_ENV, METADATA_CACHE_ENV, cache_endpoints
    from pyspark_acs.read.readpath import open_read_path

    return open_read_path(
        root, data_cache=cache_endpoints(getattr(args, "data_cache", None), DATA_CACHE_ENV),
        metadata_cache=cache_endpoints(getattr(args, "metadata_cache", None), METADATA_CACHE_ENV), push=True,
    )


def cmd_produce(args: argparse.Namespace) -> int:
    from pyspark_acs.write.producer import Producer

    from pyspark_acs.storage.store import open_store

    shards = args.shards
    if shards is None:  # an existing stream's own count, else one shard
        store = open_store(args.root)
        shards = store.stream_shards(args.stream) or DEFAULT_NEW_SHARDS
        store.close()
    from pyspark_acs.cli.watch import progress

    count = 0
    # A bar on stderr when it is a terminal (--progress/--no-progress to choose); stdin has
    # no known total, --file has.
    bar = progress(f"produce {args.stream}", total=len(args.file) if args.file else None, enabled=args.progress)
    with Producer(args.root, args.stream, shards=shards, data_cache=args.data_cache,
                  metadata_cache=args.metadata_cache) as producer, bar:
        if args.file:
            for path in args.file:
                with open(path, "rb") as f:
                    data = f.read()
                producer.send(data, shard=args.shard)
                count += 1
                bar.advance(1, len(data))
        else:
            sep = args.key_separator.encode() if args.key_separator else None
            for line in sys.stdin.buffer:
                line = line.rstrip(b"\n")
                key = None
                if sep is not None and sep in line:
                    key, line = line.split(sep, 1)
                producer.send(line, key=key, shard=args.shard)
                count += 1
                bar.advance(1, len(line))
    print(f"sent {count} messages to stream {args.stream!r}", file=sys.stderr)
    return 0


def _start_spec(text: str):
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            raise AcsOptionError(f"--from: cannot read offsets from {text[1:]}: {exc}", option="--from") from exc
    return text


def _wait_for_streams(root: str, streams: Sequence[str], timeout: Optional[float]) -> None:
    """Block until every stream exists (saying once on stderr what it waits for); with a
    timeout, fail naming the streams still missing."""
    import time

    from pyspark_acs.storage.store import open_store

    deadline = None if timeout is None else time.monotonic() + timeout
    said = False
    while True:
        try:
            store = open_store(root, create=False)
            try:
                missing = [s for s in streams if store.stream_shards(s) is None]
            finally:
                store.close()
        except AcsOptionError:  # the root itself is not there yet
            missing = list(streams)
        if not missing:
            return
        if not said:
            print(f"acs tail: waiting for stream {', '.join(missing)} in {root} ...", file=sys.stderr, flush=True)
            said = True
        if deadline is not None and time.monotonic() >= deadline:
            raise AcsOptionError(
                f"--wait: stream {', '.join(missing)} did not appear in {root} within {timeout} s", option="--wait"
            )
        time.sleep(STREAM_WAIT_POLL_S)


def _as_text(b: Optional[bytes]) -> Optional[str]:
    if b is None:
        return None
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(b).decode()


def cmd_tail(args: argparse.Namespace) -> int:
    from pyspark_acs.read.consumer import Consumer

    streams = [s.strip() for s in args.stream.split(",") if s.strip()]
    try:
        shards = [int(s) for s in args.shards.split(",")] if args.shards else None
    except ValueError:
        raise AcsOptionError(f"--shards: {args.shards!r} is not a comma-separated list of shard numbers",
                             option="--shards") from None
    if args.wait:
        _wait_for_streams(args.root, streams, args.timeout)
    consumer = Consumer(
        args.root, streams, shards, start=_start_spec(args.start), read_path=_read_path(args, args.root)
    )
    out = sys.stdout.buffer
    seen = 0
    printed: Optional[int] = None  # rows printed of the batch being printed (None: all of it)
    try:
        for batch in consumer.batches(timeout=args.timeout):
            rows = batch.to_pydict()
            printed = 0
            for i in range(batch.num_rows):
                if args.format == "raw":
                    out.write(rows["value"][i] or b"")
                elif args.format == "text":
                    out.write((rows["value"][i] or b"") + b"\n")
                else:
                    rec = {
                        "stream": rows["stream"][i],
                        "shard": rows["shard"][i],
                        "file": rows["file"][i],
                        "position": rows["position"][i],
                        "timestamp": rows["timestamp"][i].isoformat(),
                        "key": _as_text(rows["key"][i]),
                        "value": _as_text(rows["value"][i]),
                    }
                    out.write(json.dumps(rec).encode() + b"\n")
                seen += 1
                printed = i + 1
                if args.max_messages is not None and seen >= args.max_messages:
                    break
            out.flush()
            if printed == batch.num_rows:
                printed = None
            if args.max_messages is not None and seen >= args.max_messages:
                break
    except KeyboardInterrupt:
        pass
    finally:
        if args.offsets_out:
            # Exact: a partly printed batch (--max-messages, Ctrl-C) resumes at its next row.
            with open(args.offsets_out, "w", encoding="utf-8") as f:
                json.dump(consumer.offsets(consumed=printed), f)
        consumer.close()
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from pyspark_acs.format.names import shard_dir
    from pyspark_acs.storage.store import open_store
    from pyspark_acs.storage.tier import tier_summary, tiered_store

    store = tiered_store(open_store(args.root, create=False))  # files in either tier
    streams = [args.stream] if args.stream else store.list_streams()
    for stream in streams:
        shards = store.stream_shards(stream)
        if shards is None:
            raise AcsOptionError(f"stream: no stream {stream!r} in {store.root}", option="stream")
        print(f"{stream}  shards={shards}")
        summary = tier_summary(store.hot, stream)
        if summary["uri"]:  # only tiered streams get the line (untiered output stays as it was)
            print(f"  {summary['line']}")
        for shard in range(shards):
            files = store.list_files(stream, shard)
            lengths = store.lengths([f"{shard_dir(stream, shard)}/{f}" for f in files])
            total = sum(v or 0 for v in lengths.values())
            print(f"  shard {shard:5d}  files={len(files)}  bytes={total}")
            for f in files:
                print(f"    {f}  {lengths[f'{shard_dir(stream, shard)}/{f}']}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``acs`` console script."""
    _load_extra_commands()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AcsError as exc:
        print(f"acs {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `acs tail | head`
        return 0


def _load_extra_commands() -> None:
    """Import the modules that add commands (deployment, status, copy tree) if present."""
    import importlib

    for module in ("pyspark_acs.cli.deploy", "pyspark_acs.cli.copy", "pyspark_acs.cli.lag", "pyspark_acs.cli.tier"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def register_command(name: str, add_parser: Callable[[argparse._SubParsersAction], None]) -> None:
    """Add a subcommand (used by :mod:`pyspark_acs.cli.deploy`)."""
    _EXTRA_COMMANDS[name] = add_parser


if __name__ == "__main__":  # pragma: no cover
    # Run as `python -m pyspark_acs.cli.main`: this module is __main__, while the command modules
    # register with `pyspark_acs.cli.main`; call that module's main so their commands are there.
    from pyspark_acs.cli.main import main as _main

    sys.exit(_main())
