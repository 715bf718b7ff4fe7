"""The ``acs`` command line: produce, tail, ls (and the deployment and copy commands).

Every command has ``--help``. Errors from the library are printed as one line
``acs: error: ...`` with exit code 1; bad usage exits with code 2 (argparse).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import sys
from typing import Callable, Dict, Optional, Sequence

from pyspark_acs.errors import AcsError, AcsOptionError
from pyspark_acs.options import add_option_flags, duration_parser, flag_type, options_from_flags

__all__ = [
    "add_cache_flags",
    "check_cache_flags",
    "main",
]

#: How often ``acs tail --wait`` looks for a stream that does not exist yet.
STREAM_WAIT_POLL_S = 0.5
#: How long a Ctrl-C'd ``acs produce`` waits for the messages it sent to be acknowledged (s).
INTERRUPT_WAIT_S = 5.0
#: Exit code of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED_EXIT = 130
#: How often ``acs produce`` looks for a Ctrl-C while its final flush waits (s).
FLUSH_STEP_S = 0.1


def _add_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", required=True, help="durable store root: a local folder or a URI (file://, hdfs://)")


def check_cache_flags(args: argparse.Namespace) -> None:
    """``--data-cache`` / ``--metadata-cache`` checked under their own names (a library error
    would name its parameter, ``endpoints``)."""
    from pyspark_acs.cache.endpoints import NO_CACHE, parse_endpoints

    for flag, value in (("--data-cache", getattr(args, "data_cache", None)),
                        ("--metadata-cache", getattr(args, "metadata_cache", None))):
        if value is not None and value.strip().lower() not in ("", NO_CACHE):
            parse_endpoints(value, option=flag)


def add_cache_flags(p: argparse.ArgumentParser, otherwise: str = "") -> None:
    """``--data-cache`` / ``--metadata-cache``, the same for every command that reads through the
    caches (checked by :func:`check_cache_flags`): not given, ``$ACS_DATA_CACHE`` /
    ``$ACS_METADATA_CACHE`` (:func:`~pyspark_acs.cache.endpoints.cache_endpoints`), then what
    ``otherwise`` says (the command's own fallback); ``none`` turns a cache off."""
    from pyspark_acs.cache.endpoints import DATA_CACHE_ENV, METADATA_CACHE_ENV

    for role, env in (("data", DATA_CACHE_ENV), ("metadata", METADATA_CACHE_ENV)):
        p.add_argument(f"--{role}-cache", default=None, metavar="HOST:PORT,...",
                       help=f"{role}-cache endpoints, or none (default: ${env}{otherwise})")


class _CommandParser(argparse.ArgumentParser):
    """A command's parser that adds some of its flags only when the command is parsed or its
    help shown (:meth:`defer`): the flags generated from the Producer's and Consumer's
    declarations import those modules, and pyarrow with them, which ``acs up``, ``acs --help``
    and the other commands do not need."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deferred: list = []

    def defer(self, add: Callable[[argparse.ArgumentParser], None]) -> None:
        self._deferred.append(add)

    def _complete(self) -> None:
        while self._deferred:
            self._deferred.pop(0)(self)

    def parse_known_args(self, *args, **kwargs):
        self._complete()
        return super().parse_known_args(*args, **kwargs)

    def format_usage(self) -> str:
        self._complete()
        return super().format_usage()

    def format_help(self) -> str:
        self._complete()
        return super().format_help()


def _producer_flags(p: argparse.ArgumentParser) -> None:
    """The Producer's settings as flags, generated from their declarations; without --shards an
    existing stream keeps its own count."""
    from pyspark_acs.write.producer import ProducerOptions

    group = p.add_argument_group("Producer settings", "as the Producer's keyword arguments (README.md, "
                                                      "\"Settings reference\")")
    add_option_flags(group, ProducerOptions, shown={"shards": "the existing stream's count, or 1 for a new stream"})


def _consumer_flags(p: argparse.ArgumentParser) -> None:
    """The Consumer's settings as flags, generated from their declarations (start is --from)."""
    from pyspark_acs.read.consumer import ConsumerOptions

    group = p.add_argument_group("Consumer settings", "as the Consumer's keyword arguments (README.md, "
                                                      "\"Settings reference\")")
    add_option_flags(group, ConsumerOptions, exclude=("start",))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``acs`` (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="acs",
        description="pyspark_acs: ordered message delivery through files (Fast ACS).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_CommandParser)

    p = sub.add_parser("produce", help="send lines (or whole files) from stdin into a stream",
                       description="Send each line of stdin as one message (or each --file as one message). "
                                   "Ctrl-C stops reading, waits at most 5 s for what was sent to be "
                                   "acknowledged, prints 'sent N (M acknowledged)' and exits 130; "
                                   "a second Ctrl-C exits at once.")
    _add_root(p)
    p.add_argument("--stream", required=True, help="stream name")
    p.defer(_producer_flags)
    p.add_argument("--key-separator", default=None, metavar="SEP",
                   help="split each line at the first SEP into key and value (key picks the shard)")
    p.add_argument("--shard", type=int, default=None, help="send every message to this shard")
    p.add_argument("--file", action="append", default=[], metavar="PATH",
                   help="send the content of PATH as one message (repeatable); stdin is then not read")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr: messages, bytes, rate (default: when stderr is a terminal)")
    add_cache_flags(p)
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("tail", help="print messages of a stream as they arrive",
                       description="Follow a stream and print its messages in order per shard.")
    _add_root(p)
    p.add_argument("--stream", required=True, help="stream name (or a comma-separated list)")
    p.add_argument("--from", dest="start", default="earliest",
                   help="earliest (default), latest, an offsets JSON object, or @FILE holding one")
    p.add_argument("--format", choices=("text", "json", "raw"), default="text",
                   help="text: value per line; json: one object per message; raw: value bytes only")
    p.add_argument("--timeout", type=flag_type(duration_parser(0.0), "--timeout"), default=None, metavar="DURATION",
                   help="stop after this long without new messages, e.g. 5s or 500ms; a bare number is seconds "
                        "(default: follow forever)")
    p.add_argument("--max-messages", type=int, default=None, help="stop after this many messages")
    p.add_argument("--offsets-out", default=None, metavar="FILE",
                   help="write the final offsets JSON here (resume later with --from @FILE)")
    p.add_argument("--shards", default=None, help="comma-separated shards to follow (default all)")
    p.add_argument("--wait", action="store_true",
                   help="wait for streams, and the root, that do not exist yet instead of failing "
                        "(a missing root is an error without it)")
    add_cache_flags(p)
    p.defer(_consumer_flags)
    p.set_defaults(func=cmd_tail)

    p = sub.add_parser("ls", help="list streams, shards, files and lengths",
                       description="List the streams of a durable store: per stream its shard count (and tier, "
                                   "when tiered), per shard its files and bytes, per file its length.")
    _add_root(p)
    p.add_argument("--stream", default=None, help="only this stream")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_ls)

    for name, func in _EXTRA_COMMANDS.items():
        func(sub)
    return parser


#: Further commands register here: name -> function(subparsers) adding the parser.
_EXTRA_COMMANDS: Dict[str, Callable[[argparse._SubParsersAction], None]] = {}


def _read_path(args: argparse.Namespace, root: str, tier_read_policy: str):
    """The read path of ``acs tail`` (a tailing reader: bytes pushed): caches when given, else
    the durable store alone."""
    from pyspark_acs.cache.endpoints import DATA_CACHE_ENV, METADATA_CACHE_ENV, cache_endpoints
    from pyspark_acs.read.readpath import open_read_path

    return open_read_path(
        root, data_cache=cache_endpoints(getattr(args, "data_cache", None), DATA_CACHE_ENV),
        metadata_cache=cache_endpoints(getattr(args, "metadata_cache", None), METADATA_CACHE_ENV), push=True,
        tier_read_policy=tier_read_policy,
    )


def cmd_produce(args: argparse.Namespace) -> int:
    """``acs produce``. Ctrl-C stops reading the input, waits at most
    :data:`INTERRUPT_WAIT_S` for what was sent to be acknowledged, prints ``sent N (M
    acknowledged)`` and exits 130; a second Ctrl-C exits at once (see :class:`_CtrlC`)."""
    from pyspark_acs.write.producer import Producer, ProducerOptions

    check_cache_flags(args)
    from pyspark_acs.storage.store import open_store

    try:
        opts = options_from_flags(ProducerOptions, args)
        if args.shards is None:  # an existing stream's own count, else the declared default
            store = open_store(args.root)
            opts = dataclasses.replace(opts, shards=store.stream_shards(args.stream) or opts.shards)
            store.close()
        producer = Producer(args.root, args.stream, **dataclasses.asdict(opts), data_cache=args.data_cache,
                            metadata_cache=args.metadata_cache)
    except KeyboardInterrupt:
        print(f"acs produce: interrupted before stream {args.stream!r} was open: sent 0 (0 acknowledged)",
              file=sys.stderr)
        return INTERRUPTED_EXIT
    from pyspark_acs.cli.watch import progress

    # A bar on stderr when it is a terminal (--progress/--no-progress to choose); stdin has
    # no known total, --file has.
    bar = progress(f"produce {args.stream}", total=len(args.file) if args.file else None, enabled=args.progress)
    ctrl_c = _CtrlC(producer, args.stream)
    try:
        try:
            with bar:
                _send_input(args, producer, bar, ctrl_c)
            _flush(producer, ctrl_c)
            producer.close()
        except KeyboardInterrupt:
            return ctrl_c.finish()
        except BaseException:
            producer.close()  # what was sent before the error is still written (as `with` did)
            raise
    finally:
        ctrl_c.restore()
    print(f"sent {producer.stats()['sent']} messages to stream {args.stream!r}", file=sys.stderr)
    return 0


class _CtrlC:
    """Ctrl-C of ``acs produce``, taken without breaking the Producer.

    Python raises KeyboardInterrupt between any two bytecodes of the main thread: inside
    ``Producer.send`` it can leave the Producer's lock held (between a ``with`` taking it and
    the block starting) or a message half queued, and the flush after it then never returns.
    So the first Ctrl-C raises only while the main thread waits for input (:attr:`safe`);
    elsewhere it is noted (:attr:`stopped`) and acted on when the send returns. A second
    Ctrl-C exits at once, whatever the main thread is doing.

    SIGINT that was ignored when ``acs`` started (``nohup``) stays ignored.
    """

    def __init__(self, producer, stream: str) -> None:
        import signal
        import threading

        self.producer = producer
        self.stream = stream
        #: A Ctrl-C came: stop reading input.
        self.stopped = False
        #: The main thread waits for input: a KeyboardInterrupt there breaks nothing.
        self.safe = False
        self._previous = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.stopped:
            import os

            # The main thread may be inside the Producer's lock or a write to sys.stderr: so
            # the lock-free counts and os.write.
            sent, acked = self.producer.counts_unlocked()
            os.write(2, f"acs produce: interrupted again: exiting at once: sent {sent} ({acked} acknowledged) "
                        f"to stream {self.stream!r}\n".encode())
            os._exit(INTERRUPTED_EXIT)
        self.stopped = True
        if self.safe:
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if a Ctrl-C came (where the main thread is at a safe point)."""
        if self.stopped:
            raise KeyboardInterrupt

    def finish(self) -> int:
        """After the first Ctrl-C: wait at most :data:`INTERRUPT_WAIT_S` for what was sent to
        be acknowledged (and the files sealed), print ``sent N (M acknowledged)``, return 130.
        Messages a second Ctrl-C leaves unacknowledged may or may not be in the store (the
        shard's next writer seals a file its take-over finds unsealed)."""
        self.stopped = True  # from now on a Ctrl-C exits at once
        sent, _ = self.producer.counts_unlocked()
        print(f"acs produce: interrupted: waiting up to {INTERRUPT_WAIT_S:g} s for the {sent} messages sent to be "
              f"acknowledged (Ctrl-C again to exit at once)", file=sys.stderr, flush=True)
        from pyspark_acs.errors import AcsTimeoutError

        timed_out = False
        try:
            # close() may wait its timeout twice: once for the flush, once for the writer to stop.
            self.producer.close(timeout=INTERRUPT_WAIT_S / 2)
        except AcsTimeoutError:
            timed_out = True
        except AcsError as exc:
            print(f"acs produce: error: {exc}", file=sys.stderr)
        sent, acked = self.producer.counts_unlocked()
        if timed_out and sent > acked:
            print(f"acs produce: {sent - acked} messages not acknowledged within {INTERRUPT_WAIT_S:g} s (the store "
                  f"does not answer?): they may or may not be in the stream", file=sys.stderr)
        elif timed_out:
            print(f"acs produce: the files were not sealed within {INTERRUPT_WAIT_S:g} s (the store does not "
                  f"answer?); the next writer of the stream seals them", file=sys.stderr)
        print(f"acs produce: interrupted: sent {sent} ({acked} acknowledged) to stream {self.stream!r}",
              file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT

    def restore(self) -> None:
        """Put back the SIGINT handler there was (``main()`` may run in a caller's process)."""
        if self._previous is not None:
            import signal

            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def _send_input(args: argparse.Namespace, producer, bar, ctrl_c: _CtrlC) -> None:
    """Send each --file, else each line of stdin, as one message; raise KeyboardInterrupt at
    the first safe point after a Ctrl-C."""
    if args.file:
        for path in args.file:
            ctrl_c.safe = True
            try:
                ctrl_c.check()
                with open(path, "rb") as f:
                    data = f.read()
            finally:
                ctrl_c.safe = False
            producer.send(data, shard=args.shard)
            bar.advance(1, len(data))
        return
    sep = args.key_separator.encode() if args.key_separator else None
    readline = sys.stdin.buffer.readline
    while True:
        ctrl_c.safe = True
        try:
            ctrl_c.check()  # a Ctrl-C during the last send
            line = readline()
        finally:
            ctrl_c.safe = False
        if not line:
            return
        line = line.rstrip(b"\n")
        key = None
        if sep is not None and sep in line:
            key, line = line.split(sep, 1)
        producer.send(line, key=key, shard=args.shard)
        bar.advance(1, len(line))


def _flush(producer, ctrl_c: _CtrlC) -> None:
    """``producer.flush()`` in steps, so that a Ctrl-C meanwhile (noted, not raised: the main
    thread is in the Producer) ends it with KeyboardInterrupt."""
    from pyspark_acs.errors import AcsTimeoutError

    while True:
        ctrl_c.check()
        try:
            producer.flush(timeout=FLUSH_STEP_S)
            return
        except AcsTimeoutError:
            continue


def _start_spec(text: str):
    """``--from``: the Consumer's ``start`` (:func:`~pyspark_acs.read.consumer.parse_start`), or
    @FILE holding offsets JSON, checked here so an error names the flag."""
    from pyspark_acs.options import nearest_name
    from pyspark_acs.read.consumer import START_WORDS, parse_start

    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                spec = json.load(f)
        except (OSError, ValueError) as exc:
            raise AcsOptionError(f"--from: cannot read offsets from {text[1:]}: {exc}", option="--from") from exc
        return parse_start(spec, "--from")
    if text.strip().lower() in START_WORDS or text.lstrip().startswith("{"):
        return parse_start(text, "--from")
    # The flag's own wording: it takes @FILE too, and JSON text rather than a dict.
    nearest = nearest_name(text.strip(), START_WORDS)
    hint = f" (did you mean {nearest!r}?)" if nearest else ""
    raise AcsOptionError(f"--from: {text!r} is not allowed{hint}; use earliest, latest, an offsets JSON object "
                         f"or @FILE holding one", option="--from")


def _wait_for_streams(root: str, streams: Sequence[str], timeout: Optional[float]) -> None:
    """Block until the root and every stream exist (saying on stderr what it waits for, the
    root by its full path so a typo shows); with a timeout, fail naming what is still missing.

    Like a Kafka consumer started before its broker or topic, ``--wait`` waits for a root that
    does not exist yet too (a Producer about to be started creates it); without ``--wait`` a
    missing root is an error."""
    import time

    from pyspark_acs.errors import RootNotFoundError
    from pyspark_acs.storage.store import open_store

    deadline = None if timeout is None else time.monotonic() + timeout
    said = None
    while True:
        no_root = None
        try:
            store = open_store(root, create=False)
            try:
                missing = [s for s in streams if store.stream_shards(s) is None]
            finally:
                store.close()
        except RootNotFoundError as exc:  # the root itself is not there yet
            no_root, missing = exc.path, list(streams)
        if not missing:
            return
        what = f"stream {', '.join(missing)} in {root}"
        if no_root is not None:
            what += f" (the root {no_root} does not exist yet: check --root if nothing is about to write there)"
        if what != said:
            print(f"acs tail: waiting for {what} ...", file=sys.stderr, flush=True)
            said = what
        if deadline is not None and time.monotonic() >= deadline:
            gone = f"root {no_root} does not exist and " if no_root is not None else ""
            raise AcsOptionError(
                f"--wait: {gone}stream {', '.join(missing)} did not appear in {root} within {timeout} s",
                option="--wait",
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
    from pyspark_acs.read.consumer import Consumer, ConsumerOptions

    streams = [s.strip() for s in args.stream.split(",") if s.strip()]
    try:
        shards = [int(s) for s in args.shards.split(",")] if args.shards else None
    except ValueError:
        raise AcsOptionError(f"--shards: {args.shards!r} is not a comma-separated list of shard numbers",
                             option="--shards") from None
    check_cache_flags(args)
    opts = options_from_flags(ConsumerOptions, args, start=_start_spec(args.start))
    if args.wait:
        _wait_for_streams(args.root, streams, args.timeout)
    from pyspark_acs.errors import RootNotFoundError

    try:
        read_path = _read_path(args, args.root, opts.tier_read_policy)
    except RootNotFoundError as exc:
        raise RootNotFoundError(f"{exc}; or add --wait to wait for it", root=exc.root, path=exc.path) from None
    consumer = Consumer(args.root, streams, shards, read_path=read_path, **dataclasses.asdict(opts))
    out = sys.stdout.buffer
    seen = 0
    printed: Optional[int] = None  # rows printed of the batch being printed (None: all of it)
    try:
        for batch in consumer.batches(timeout=args.timeout):
            printed = 0  # before anything else: a Ctrl-C from here on resumes at this batch
            rows = batch.to_pydict()
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
                    if opts.include_headers:
                        headers = rows["headers"][i]
                        rec["headers"] = None if headers is None else [
                            {"key": h["key"], "value": _as_text(h["value"])} for h in headers]
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


def ls_report(root: str, stream: Optional[str] = None) -> dict:
    """What ``acs ls`` prints, as a JSON-able dict: ``{"root", "streams": [{"stream", "shards",
    "tier", "shard_list": [{"shard", "bytes", "files": [{"file", "length"}]}]}]}`` (``tier`` is
    ``None`` for a stream that is not tiered)."""
    from pyspark_acs.format.names import shard_dir
    from pyspark_acs.storage.store import open_store
    from pyspark_acs.storage.tier import tiered_store
    from pyspark_acs.storage.tier_settings import tier_summary

    store = tiered_store(open_store(root, create=False))  # files in either tier
    report: dict = {"root": store.root, "streams": []}
    for name in [stream] if stream else store.list_streams():
        shards = store.stream_shards(name)
        if shards is None:
            raise AcsOptionError(f"--stream: no stream {name!r} in {store.root}", option="--stream")
        summary = tier_summary(store.hot, name)
        entry = {"stream": name, "shards": shards, "tier": summary if summary["uri"] else None, "shard_list": []}
        for shard in range(shards):
            files = store.list_files(name, shard)
            lengths = store.lengths([f"{shard_dir(name, shard)}/{f}" for f in files])
            rows = [{"file": f, "length": lengths[f"{shard_dir(name, shard)}/{f}"]} for f in files]
            entry["shard_list"].append({"shard": shard, "bytes": sum(r["length"] or 0 for r in rows), "files": rows})
        report["streams"].append(entry)
    return report


def cmd_ls(args: argparse.Namespace) -> int:
    report = ls_report(args.root, args.stream)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for entry in report["streams"]:
        print(f"{entry['stream']}  shards={entry['shards']}")
        if entry["tier"]:  # only tiered streams get the line (untiered output stays as it was)
            print(f"  {entry['tier']['line']}")
        for sh in entry["shard_list"]:
            print(f"  shard {sh['shard']:5d}  files={len(sh['files'])}  bytes={sh['bytes']}")
            for row in sh["files"]:
                print(f"    {row['file']}  {row['length']}")
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
