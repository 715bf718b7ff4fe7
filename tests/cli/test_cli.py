"""The ``acs`` command line.

The main flows run ``acs`` as a real subprocess (``python -m pyspark_acs.cli.main``); the many
small error and help cases call :func:`pyspark_acs.cli.main.main` in-process (same code, same
exit codes) so the file stays fast: each subprocess pays pyarrow's import.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess

import pytest

from pyspark_acs.cli.main import _load_extra_commands, build_parser, main
from pyspark_acs.write.producer import Producer

TIMEOUT = 60


@pytest.fixture
def acs(python_exe, subprocess_env):
    def run(*args, input=None, check=None):
        proc = subprocess.run(
            [python_exe, "-m", "pyspark_acs.cli.main", *args],
            input=input,
            capture_output=True,
            env=subprocess_env,
            timeout=TIMEOUT,
        )
        if check is not None:
            assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
        return proc

    return run


@pytest.fixture
def acs_inproc(capsysbinary):
    """``main(argv)`` in this process: (exit code, stdout bytes, stderr text)."""

    def run(*args):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse usage errors and --help
            code = exc.code
        out, err = capsysbinary.readouterr()
        return code, out, err.decode()

    return run


def _lines(out: bytes):
    return out.decode().splitlines()


def test_produce_with_key_separator_then_tail_json_and_text(acs, root):
    lines = b"".join(b"k%d:value %d\n" % (i % 3, i) for i in range(20)) + b"no separator here\n"
    p = acs("produce", "--root", root, "--stream", "s", "--shards", "3", "--key-separator", ":", input=lines, check=0)
    assert "sent 21 messages to stream 's'" in p.stderr.decode()
    t = acs("tail", "--root", root, "--stream", "s", "--timeout", "0.3", "--format", "json", check=0)
    recs = [json.loads(line) for line in _lines(t.stdout)]
    assert len(recs) == 21
    for key in ("k0", "k1", "k2"):
        mine = [r for r in recs if r["key"] == key]
        assert [r["value"] for r in mine] == ["value %d" % i for i in range(20) if "k%d" % (i % 3) == key]
        assert len({r["shard"] for r in mine}) == 1  # one key, one shard, in order
        for r in mine:
            assert r["stream"] == "s" and r["file"].endswith(".acs") and r["timestamp"].endswith("+00:00")
    assert [r["value"] for r in recs if r["key"] is None] == ["no separator here"]
    t = acs("tail", "--root", root, "--stream", "s", "--timeout", "0.3", check=0)
    assert sorted(_lines(t.stdout)) == sorted(["value %d" % i for i in range(20)] + ["no separator here"])


def test_files_as_messages_binary_json_and_raw(acs, acs_inproc, root, tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\xff\x00\xfe" * 100)
    acs("produce", "--root", root, "--stream", "bin", "--file", str(blob), "--file", str(blob), check=0)
    code, out, _ = acs_inproc("tail", "--root", root, "--stream", "bin", "--timeout", "0.2", "--format", "json")
    recs = [json.loads(line) for line in _lines(out)]
    assert code == 0 and len(recs) == 2 and recs[0]["value"].startswith("base64:")
    assert base64.b64decode(recs[0]["value"][7:]) == blob.read_bytes()
    assert [r["position"] for r in recs] == [0, 1]
    code, out, _ = acs_inproc("tail", "--root", root, "--stream", "bin", "--timeout", "0.2", "--format", "raw")
    assert code == 0 and out == blob.read_bytes() * 2


def test_offsets_out_then_resume_from_file_without_gap_or_duplicate(acs, acs_inproc, root, tmp_path):
    offsets = tmp_path / "offsets.json"
    with Producer(root, "r", shards=2) as p:
        for i in range(10):
            p.send(b"first %d" % i)
    t = acs("tail", "--root", root, "--stream", "r", "--timeout", "0.3", "--offsets-out", str(offsets), check=0)
    assert sorted(_lines(t.stdout)) == sorted("first %d" % i for i in range(10))
    saved = json.loads(offsets.read_text())
    assert set(saved["r"]) == {"0", "1"} and all(v["length"] > 0 for v in saved["r"].values())
    acs("produce", "--root", root, "--stream", "r", "--shards", "2",
        input=b"".join(b"second %d\n" % i for i in range(10)), check=0)
    t = acs("tail", "--root", root, "--stream", "r", "--timeout", "0.3", "--from", "@" + str(offsets),
            "--offsets-out", str(offsets), check=0)
    assert sorted(_lines(t.stdout)) == sorted("second %d" % i for i in range(10))
    # nothing new since: the resumed tail prints nothing
    code, out, _ = acs_inproc("tail", "--root", root, "--stream", "r", "--timeout", "0.2", "--from", "@" + str(offsets))
    assert (code, out) == (0, b"")
    # --from also takes the JSON itself; --shards and --max-messages narrow the output
    code, out, _ = acs_inproc("tail", "--root", root, "--stream", "r", "--timeout", "0.2", "--from",
                              json.dumps(saved), "--shards", "0")
    assert code == 0 and out and all(line.startswith("second") for line in _lines(out))
    code, out, _ = acs_inproc("tail", "--root", root, "--stream", "r", "--timeout", "0.2", "--max-messages", "3")
    assert code == 0 and len(_lines(out)) == 3
    code, out, _ = acs_inproc("tail", "--root", root, "--stream", "r", "--from", "latest", "--timeout", "0.1")
    assert (code, out) == (0, b"")


def test_max_messages_then_resume_prints_every_remaining_message_once(acs, root, tmp_path):
    """`acs tail --max-messages 10 --offsets-out o.json`, then `--from @o.json`: the saved offset
    names the 11th message, inside the batch the 10 came from (it used to be that batch's end,
    so the resume printed 0 of the 990 left)."""
    offsets = tmp_path / "o.json"
    acs("produce", "--root", root, "--stream", "s", input=b"".join(b"%d\n" % i for i in range(1, 1001)), check=0)
    t = acs("tail", "--root", root, "--stream", "s", "--max-messages", "10", "--offsets-out", str(offsets), check=0)
    assert _lines(t.stdout) == [str(i) for i in range(1, 11)]
    saved = json.loads(offsets.read_text())["s"]["0"]
    assert saved["position"] == 10  # the 11th message of the file
    t = acs("tail", "--root", root, "--stream", "s", "--timeout", "0.5", "--from", "@" + str(offsets),
            "--max-messages", "500", "--offsets-out", str(offsets), check=0)
    assert _lines(t.stdout) == [str(i) for i in range(11, 511)]
    t = acs("tail", "--root", root, "--stream", "s", "--timeout", "0.5", "--from", "@" + str(offsets), check=0)
    assert _lines(t.stdout) == [str(i) for i in range(511, 1001)]


def test_tail_of_a_truncated_file_fails_naming_the_file_and_byte(acs, root):
    """3000 messages in files of ~20 KB, the first cut to 10,000 bytes (`truncate -s 10000`):
    `acs tail` (no --timeout) stops with exit 1 and the data loss named by file and byte, after
    printing the messages before the cut; it used to print 501 of 3000 and wait forever."""
    with Producer(root, "s", roll_bytes=20000) as p:
        for i in range(3000):
            p.send(b"%d" % i)
            if i % 50 == 49:
                p.flush()  # blocks of 50 messages, as a trickle makes them
    first = sorted(os.listdir(os.path.join(root, "s", "00000")))[0]
    os.truncate(os.path.join(root, "s", "00000", first), 10000)
    t = acs("tail", "--root", root, "--stream", "s", check=1)
    err = t.stderr.decode()
    assert f"data loss in stream 's' shard 0: file {first} has no seal" in err, err
    assert "truncated or damaged" in err and len(err.strip().splitlines()) == 1
    printed = _lines(t.stdout)
    assert printed == [str(i) for i in range(len(printed))] and 0 < len(printed) < 3000


def test_ls(acs, acs_inproc, root):
    with Producer(root, "alpha", shards=2) as p:
        for v in (b"a", b"b", b"c"):
            p.send(v)
    with Producer(root, "beta") as p:
        p.send(b"x")
    out = _lines(acs("ls", "--root", root, check=0).stdout)
    # per stream a line, then per shard a summary line and one line per file with its length
    expected = []
    for stream, shards in (("alpha", 2), ("beta", 1)):
        expected.append(f"{stream}  shards={shards}")
        for shard in range(shards):
            folder = os.path.join(root, stream, "%05d" % shard)
            names = sorted(n for n in os.listdir(folder) if n.endswith(".acs"))
            sizes = [os.path.getsize(os.path.join(folder, n)) for n in names]
            expected.append(f"  shard {shard:5d}  files={len(names)}  bytes={sum(sizes)}")
            expected += [f"    {n}  {size}" for n, size in zip(names, sizes)]
    assert out == expected
    code, only, _ = acs_inproc("ls", "--root", root, "--stream", "beta")
    assert code == 0 and _lines(only)[0] == "beta  shards=1" and b"alpha" not in only
    code, _, err = acs_inproc("ls", "--root", root, "--stream", "gamma")
    assert code == 1 and "acs ls: error: --stream: no stream 'gamma'" in err


def test_unknown_option_exits_2(acs, acs_inproc, root):
    p = acs("tail", "--root", root, "--stream", "s", "--bogus", check=2)
    assert "unrecognized arguments: --bogus" in p.stderr.decode()
    for args, text in [
        (("produce", "--root", root, "--stream", "s", "--nope", "1"), "unrecognized arguments: --nope 1"),
        (("produce", "--root", root), "the following arguments are required: --stream"),
        (("nosuchcommand",), "invalid choice: 'nosuchcommand'"),
        ((), "required: COMMAND"),
        (("tail", "--root", root, "--stream", "s", "--format", "xml"), "invalid choice: 'xml'"),
        (("tail", "--root", root, "--stream", "s", "--timeout", "soon"), "argument --timeout: 'soon' is not a duration"),
        (("tail", "--root", root, "--stream", "s", "--poll-interval", "soon"),
         "argument --poll-interval: 'soon' is not a duration"),
        (("tail", "--root", root, "--stream", "s", "--max-read-bytes", "0"), "argument --max-read-bytes: '0' is too small"),
        (("tail", "--root", root, "--stream", "s", "--tier-read-policy", "disk"),
         "argument --tier-read-policy: 'disk' is not allowed; use one of: NOT_IN_DISK"),
        (("produce", "--root", root, "--stream", "s", "--shards", "0"), "argument --shards: 0 is out of range"),
        (("produce", "--root", root, "--stream", "s", "--roll-bytes", "big"), "argument --roll-bytes: 'big' is not a byte size"),
        (("produce", "--root", root, "--stream", "s", "--acknowledge", "fast"), "argument --acknowledge: 'fast' is not allowed; use one of 'published', 'durable' or 'clusters:K'"),
    ]:
        code, _, err = acs_inproc(*args)
        assert code == 2 and text in err, (args, err)


def test_bad_stream_name_exits_1_with_a_clear_message(acs, acs_inproc, root):
    p = acs("produce", "--root", root, "--stream", "../etc", input=b"x\n", check=1)
    assert p.stderr.decode().startswith("acs produce: error: invalid stream name '../etc'")
    assert "Traceback" not in p.stderr.decode()
    for cmd in ("produce", "tail", "ls"):
        for name in ("../etc", "a/b", ".hidden", "x" * 129, "bad\x01name"):
            extra = ["--timeout", "0.1"] if cmd == "tail" else []
            code, _, err = acs_inproc(cmd, "--root", root, "--stream", name, *extra)
            assert code == 1 and err.startswith(f"acs {cmd}: error: invalid stream name"), (cmd, name, err)
    assert os.listdir(root) == []


def test_library_errors_exit_1_with_one_line(acs_inproc, root, tmp_path):
    Producer(root, "two", shards=2).close()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    missing = tmp_path / "missing.json"
    tail = ("tail", "--root", root, "--stream", "two", "--timeout", "0.1")
    for args, text in [
        (("produce", "--root", root, "--stream", "two", "--shards", "3"), "has 2 shards, not 3"),
        (("tail", "--root", root, "--stream", "nope", "--timeout", "0.1"), "no stream 'nope'"),
        (tail + ("--from", "middle"), "--from: 'middle' is not allowed"),
        (tail + ("--from", "{broken"), "not valid JSON"),
        (tail + ("--from", "@" + str(missing)), f"--from: cannot read offsets from {missing}"),
        (tail + ("--from", "@" + str(bad)), f"--from: cannot read offsets from {bad}"),
        (tail + ("--shards", "0,x"), "--shards: '0,x' is not a comma-separated list"),
        (tail + ("--shards", "5"), "invalid shard 5"),
    ]:
        code, _, err = acs_inproc(*args)
        assert code == 1, (args, code, err)
        assert err.startswith(f"acs {args[0]}: error: ") and text in err and err.count("\n") == 1, (args, err)


def _all_commands():
    _load_extra_commands()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(sub.choices)


def test_every_command_has_help(acs, acs_inproc):
    top = acs("--help", check=0)
    assert b"usage: acs" in top.stdout
    commands = _all_commands()
    assert {"produce", "tail", "ls"} <= set(commands)
    for cmd in commands:
        code, out, err = acs_inproc(cmd, "--help")
        assert code == 0 and out.decode().startswith(f"usage: acs {cmd}"), (cmd, err)
    for cmd in ("produce", "tail", "ls"):
        _, out, _ = acs_inproc(cmd, "--help")
        assert b"--root" in out and b"--stream" in out


def test_ls_and_tail_of_a_missing_root_name_it_and_create_nothing(acs_inproc, tmp_path):
    typo = str(tmp_path / "typo")
    code, out, err = acs_inproc("ls", "--root", typo)
    assert code == 1 and f"no durable store at {typo!r}" in err and out == b""
    assert not os.path.exists(typo)


def test_produce_into_an_existing_stream_uses_its_shard_count(acs, root):
    Producer(root, "wide", shards=3).close()
    acs("produce", "--root", root, "--stream", "wide", input=b"a\nb\nc\n", check=0)
    out = acs("tail", "--root", root, "--stream", "wide", "--timeout", "0.5", check=0).stdout
    assert sorted(_lines(out)) == ["a", "b", "c"]
    acs("produce", "--root", root, "--stream", "fresh", input=b"x\n", check=0)  # a new stream: 1 shard
    from pyspark_acs.storage.store import open_store

    assert open_store(root).stream_shards("fresh") == 1


def test_tail_wait_follows_a_stream_created_later(python_exe, subprocess_env, root):
    tail = subprocess.Popen(
        [python_exe, "-m", "pyspark_acs.cli.main", "tail", "--root", os.path.join(root, "later"), "--stream", "s",
         "--wait", "--max-messages", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env,
    )
    try:
        import time

        deadline = time.monotonic() + TIMEOUT
        waited = b""
        while b"waiting for stream s" not in waited and time.monotonic() < deadline:
            waited += tail.stderr.read1(4096) if hasattr(tail.stderr, "read1") else b""
        assert b"waiting for stream s" in waited
        with Producer(os.path.join(root, "later"), "s") as p:
            p.send(b"one")
            p.send(b"two")
        out, err = tail.communicate(timeout=TIMEOUT)
    finally:
        tail.kill()
    assert tail.returncode == 0, err
    assert _lines(out) == ["one", "two"]


def test_tail_wait_with_a_timeout_names_what_never_came(acs_inproc, root):
    code, _, err = acs_inproc("tail", "--root", root, "--stream", "never", "--wait", "--timeout", "0.3")
    assert code == 1 and "--wait: stream never did not appear" in err


# -- durations: one rule for every flag ----------------------------------------


def test_tail_timeout_takes_a_unit_like_every_other_duration_flag(acs_inproc, tmp_path):
    root = str(tmp_path / "store")
    with Producer(root, "s") as p:
        p.send(b"a")
        p.send(b"b")
    # In this process: the flag's parsing is what is tested, not a fresh interpreter's start.
    for timeout in ("300ms", "0.3s", "0.3"):  # a bare number stays seconds for a timeout
        code, out, err = acs_inproc("tail", "--root", root, "--stream", "s", "--timeout", timeout)
        assert (code, out) == (0, b"a\nb\n"), err
    code, _, err = acs_inproc("tail", "--root", root, "--stream", "s", "--timeout", "soon")
    assert code == 2 and "argument --timeout: 'soon' is not a duration" in err, err


def test_a_retention_without_a_unit_is_refused_naming_the_unit(acs, tmp_path):
    """``--hot-retention 1`` read as one second would delete the hot copies: it is refused."""
    root = str(tmp_path / "store")
    acs("produce", "--root", root, "--stream", "s", input=b"a\n", check=0)
    cold = str(tmp_path / "cold")
    for flag in ("--hot-retention", "--secondary-retention"):
        res = acs("tier", "s", cold, "--root", root, flag, "1")
        assert res.returncode == 2, (res.stdout, res.stderr)  # a usage error, as every generated flag's
        err = res.stderr.decode()
        assert f"argument {flag}: '1' has no unit; add one: '1s' for seconds, '1h' for hours or '1d' for days" in err, err
    show = acs("tier", "s", "--root", root, check=0)
    assert b"not tiered" in show.stdout  # nothing was written
    acs("tier", "s", cold, "--root", root, "--hot-retention", "1d", check=0)
    assert b"hot retention:        1d" in acs("tier", "s", "--root", root, check=0).stdout


@pytest.mark.parametrize("argv, flag", [
    (["pyspark_acs.cli.main", "up", "--ttl", "60"], "--ttl"),
    (["pyspark_acs.cli.main", "up", "--data-ttl", "60"], "--data-ttl"),
    (["pyspark_acs.server.cache", "--role", "data", "--ttl", "60"], "--ttl"),
])
def test_a_ttl_without_a_unit_is_refused(python_exe, subprocess_env, tmp_path, argv, flag):
    res = subprocess.run([python_exe, "-m", *argv], capture_output=True, text=True, env=subprocess_env,
                         cwd=str(tmp_path), timeout=TIMEOUT)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert f"argument {flag}: '60' has no unit; add one: '60s'" in res.stderr
    assert not os.path.exists(tmp_path / ".acs-local" / "deployment.json")


# -- daemons' flags come from their option declarations -------


@pytest.mark.parametrize("module, declared", [
    ("pyspark_acs.server.cache", "pyspark_acs.server.cache.options:CacheServerOptions"),
    ("pyspark_acs.server.tier.daemon", "pyspark_acs.server.tier.options:TierMoverOptions"),
])
def test_daemon_help_is_generated_from_the_declarations_in_plain_text(python_exe, subprocess_env, module, declared):
    import dataclasses
    import importlib

    from pyspark_acs.options import flag_of
    from pyspark_acs.server.settings import METRICS_PORT_DOC

    mod, _, name = declared.partition(":")
    cls = getattr(importlib.import_module(mod), name)
    res = subprocess.run([python_exe, "-m", module, "--help"], capture_output=True, text=True, env=subprocess_env,
                         timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())  # argparse wraps lines
    for f in dataclasses.fields(cls):
        assert flag_of(f) in text, (flag_of(f), res.stdout)
        assert " ".join(f.metadata["acs_doc"].split()) in text, (f.name, res.stdout)
    assert METRICS_PORT_DOC in text and "--log-level" in text
    assert "``" not in res.stdout and ":class:" not in res.stdout and ":data:" not in res.stdout


@pytest.mark.parametrize("command, declared, own", [
    ("produce", "pyspark_acs.write.producer:ProducerOptions", ()),
    ("tail", "pyspark_acs.read.consumer:ConsumerOptions", ("start",)),  # start is tail's own --from
])
def test_produce_and_tail_flags_are_generated_from_the_declarations(acs_inproc, command, declared, own):
    import dataclasses
    import importlib

    from pyspark_acs.options import flag_of

    mod, _, name = declared.partition(":")
    cls = getattr(importlib.import_module(mod), name)
    code, out, _ = acs_inproc(command, "--help")
    assert code == 0
    text = " ".join(out.decode().split())
    for f in dataclasses.fields(cls):
        if f.name in own:
            continue
        assert flag_of(f) in text, (flag_of(f), text)
        assert " ".join(f.metadata["acs_doc"].split()) in text, (f.name, text)
    assert "Settings reference" in text


def test_produce_and_tail_settings_reach_the_producer_and_consumer(acs_inproc, root, tmp_path):
    blob = tmp_path / "blob"
    blob.write_bytes(b"x" * 3000)
    code, _, err = acs_inproc("produce", "--root", root, "--stream", "small", "--roll-bytes", "2KiB",
                              "--max-block-bytes", "1KiB", "--acknowledge", "durable",
                              *(["--file", str(blob)] * 3))
    assert code == 0, err
    code, out, _ = acs_inproc("ls", "--root", root, "--stream", "small", "--json")
    (entry,) = json.loads(out)["streams"]
    assert len(entry["shard_list"][0]["files"]) == 3  # --roll-bytes 2KiB: a new file after each message
    with Producer(root, "small") as p:  # an existing stream keeps its shard count without --shards
        p.send(b"with", headers=[("trace", b"t1")])
    code, out, err = acs_inproc("tail", "--root", root, "--stream", "small", "--timeout", "0.2", "--format", "json",
                                "--include-headers", "--max-read-bytes", "1KiB", "--poll-interval", "5ms",
                                "--no-fail-on-data-loss", "--tier-read-policy", "not_in_mem")
    assert code == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["headers"] for r in recs] == [None, None, None, [{"key": "trace", "value": "t1"}]]
    code, out, _ = acs_inproc("tail", "--root", root, "--stream", "small", "--timeout", "0.2", "--format", "json")
    assert "headers" not in json.loads(out.splitlines()[0])


# -- help text and errors a user reads -----------------------------------------


def test_cli_errors_name_the_flag_the_user_typed(acs, tmp_path):
    root = str(tmp_path / "store")
    acs("produce", "--root", root, "--stream", "s", input=b"a\n", check=0)
    res = acs("tail", "--root", root, "--stream", "s", "--from", "earlist", "--timeout", "0.1", check=1)
    err = res.stderr.decode()
    assert "--from: 'earlist' is not allowed (did you mean 'earliest'?)" in err and "start:" not in err, err
    for command in (("produce", "--root", root, "--stream", "s"), ("tail", "--root", root, "--stream", "s")):
        for flag in ("--data-cache", "--metadata-cache"):
            res = acs(*command, flag, "nohost", input=b"", check=1)
            err = res.stderr.decode()
            assert f"{flag}: 'nohost' is not an endpoint" in err and "endpoints:" not in err, err


def test_ls_has_a_description_and_json(acs, tmp_path):
    import json as _json

    root = str(tmp_path / "store")
    acs("produce", "--root", root, "--stream", "s", "--shards", "2", input=b"a\nb\n", check=0)
    assert b"List the streams of a durable store" in acs("ls", "--help", check=0).stdout
    report = _json.loads(acs("ls", "--root", root, "--json", check=0).stdout)
    (entry,) = report["streams"]
    assert entry["stream"] == "s" and entry["shards"] == 2 and entry["tier"] is None
    assert sum(sh["bytes"] for sh in entry["shard_list"]) == sum(
        f["length"] for sh in entry["shard_list"] for f in sh["files"]) > 0
    text = acs("ls", "--root", root, check=0).stdout.decode()
    assert text.startswith("s  shards=2\n  shard     0")


def test_acs_up_and_acs_cache_server_share_flag_names_and_defaults(acs, python_exe, subprocess_env):
    from pyspark_acs.server.cache.options import DEFAULT_CAPACITY_BYTES
    from pyspark_acs.units import format_size

    up = " ".join(acs("up", "--help", check=0).stdout.decode().split())
    server = subprocess.run([python_exe, "-m", "pyspark_acs.server.cache", "--help"], capture_output=True, text=True,
                            env=subprocess_env, timeout=TIMEOUT).stdout
    server = " ".join(server.split())
    data = format_size(DEFAULT_CAPACITY_BYTES["data"])
    # One declaration's text in both; acs up states the default of the data servers it sets.
    doc = "memory for entries, e.g. 1GiB"
    assert f"(default {data} on the data servers; the metadata servers keep" in up and doc in up
    assert f"(default data {data}, metadata" in server and doc in server
    for flag in ("--ttl DURATION", "--capacity SIZE", "--log-level"):
        assert flag in up and flag in server, flag
    assert "--data-ttl" not in up  # its former name still works, but is not shown
    down = " ".join(acs("down", "--help", check=0).stdout.decode().split())
    assert "Stop every server of the local deployment" in down


def test_tail_moved_to_a_lagging_copy_waits_instead_of_reporting_loss(acs, root, tmp_path):
    """`acs tail --offsets-out o.json` in the source, then `--from @o.json` against a destination
    whose copy holds half of the offset's file (docs/copy.md, "Moving a reader"): it prints
    nothing and exits 0 at its --timeout (it used to exit 1 with a DataLossError for bytes still
    coming); once the copy is whole it prints exactly the messages after the offset."""
    import shutil

    from pyspark_acs.format.names import shard_dir
    from pyspark_acs.storage.store import DurableStore

    offsets = tmp_path / "o.json"
    with Producer(root, "mv", roll_bytes=2000) as p:
        for i in range(3000):
            p.send(b"%d" % i)
            if i % 100 == 99:
                p.flush()  # blocks of 100, files of a few blocks
    t = acs("tail", "--root", root, "--stream", "mv", "--max-messages", "1000", "--offsets-out", str(offsets),
            check=0)
    assert _lines(t.stdout) == [str(i) for i in range(1000)]
    at = json.loads(offsets.read_text())["mv"]["0"]
    assert at["length"] > 0
    dest = str(tmp_path / "C")
    DurableStore(dest).create_stream("mv", 1, copied_from="A")
    src, dst = os.path.join(root, shard_dir("mv", 0)), os.path.join(dest, shard_dir("mv", 0))
    files = DurableStore(root).list_files("mv", 0)
    for name in files[:files.index(at["file"])]:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, at["file"]), "rb") as f_in, open(os.path.join(dst, at["file"]), "wb") as f_out:
        f_out.write(f_in.read()[: at["length"] // 2])
    t = acs("tail", "--root", dest, "--stream", "mv", "--timeout", "1", "--from", "@" + str(offsets), check=None)
    assert (t.returncode, t.stdout) == (0, b""), t.stderr
    for name in files[files.index(at["file"]):]:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    t = acs("tail", "--root", dest, "--stream", "mv", "--timeout", "1", "--from", "@" + str(offsets), check=0)
    assert _lines(t.stdout) == [str(i) for i in range(1000, 3000)]
