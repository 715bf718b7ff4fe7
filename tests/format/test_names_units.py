"""Names, byte sizes, durations, option parsing and offsets: accepted and refused values."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import math

import pytest

from pyspark_acs.errors import AcsOptionError, InvalidNameError
from pyspark_acs.format.names import (
    file_name,
    new_writer_id,
    parse_file_name,
    shard_dir,
    validate_shard,
    validate_stream,
)
from pyspark_acs.format.offsets import Offset, format_offsets, parse_offsets
from pyspark_acs.options import (
    add_option_flags,
    bytes_parser,
    choice_parser,
    describe_options,
    duration_parser,
    option,
    parse_bool,
    parse_int,
    options_from_flags,
    parse_options,
    parse_str,
)
from pyspark_acs.units import format_bytes, parse_bytes, parse_duration

# -- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "orders", "A-1_b.c", "0", "x" * 128, "a..b", "v1.2"])
def test_safe_stream_names(name):
    assert validate_stream(name) == name
    assert shard_dir(name, 3) == f"{name}/00003"


@pytest.mark.parametrize(
    "name",
    ["", "..", ".", ".hidden", "a/b", "/abs", "a\\b", "x" * 129, "a\nb", "tab\t", "nul\0", "a b", "-lead",
     "_lead", "naïve", "a\n", None, 5, b"bytes"],
)
def test_unsafe_stream_names_are_refused(name):
    with pytest.raises(InvalidNameError, match="invalid stream name") as err:
        validate_stream(name)
    assert isinstance(err.value, ValueError)
    assert "letters, digits" in str(err.value)


def test_shards():
    assert validate_shard(0) == 0 and validate_shard(4, 5) == 4
    for bad in (-1, 5, True, 1.0, "1", None):
        with pytest.raises(InvalidNameError, match="invalid shard"):
            validate_shard(bad, 5)
    with pytest.raises(InvalidNameError):
        shard_dir("s", 100_000)


def test_file_names_round_trip_and_sort_chronologically():
    wid = new_writer_id()
    assert len(wid) == 16 and wid != new_writer_id()
    t0 = dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc)
    name = file_name(t0, wid)
    assert name == f"20260102T030405000006Z-{wid}.acs"
    parsed = parse_file_name(name)
    assert parsed.created == t0 and parsed.writer_id == wid
    # a non-UTC aware time is converted; a naive one is taken as UTC
    plus2 = dt.timezone(dt.timedelta(hours=2))
    assert file_name(t0.astimezone(plus2), wid) == name
    assert file_name(t0.replace(tzinfo=None), wid) == name
    times = [t0 + dt.timedelta(microseconds=m) for m in (0, 1, 999_999, 10**6, 86400 * 10**6, 400 * 86400 * 10**6)]
    names = [file_name(t, "zz") for t in times]
    assert sorted(reversed(names)) == names


@pytest.mark.parametrize(
    "bad", ["x.acs", "20260102T030405000006Z-w.txt", "20260102T030405Z-w.acs", "20261302T030405000006Z-w.acs",
            "20260102T030405000006Z-.acs", "../20260102T030405000006Z-w.acs", "20260102T030405000006Z-a/b.acs"]
)
def test_bad_file_names(bad):
    with pytest.raises(InvalidNameError):
        parse_file_name(bad)


def test_bad_writer_ids():
    for bad in ("", "a/b", "a-b", "x" * 65, "../x"):
        with pytest.raises(InvalidNameError, match="writer id"):
            file_name(dt.datetime(2026, 1, 1), bad)


# -- units -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("0", 0), ("4096", 4096), (4096, 4096), ("10B", 10), ("1KB", 1000), ("1kb", 1000), ("1KiB", 1024),
     ("1k", 1024), ("64MiB", 64 << 20), ("64m", 64 << 20), ("2MB", 2_000_000), ("1.5KiB", 1536),
     (" 3 GiB ", 3 << 30), ("1g", 1 << 30), ("1TB", 10**12), ("1t", 1 << 40), (".5k", 512)],
)
def test_parse_bytes_accepts(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1", "1XB", "1 2", "1e3", "MiB", True, "0x10", "1.2.3k"])
def test_parse_bytes_refuses_with_the_option_name(text):
    with pytest.raises(AcsOptionError) as err:
        parse_bytes(text, option="maxBlockBytes")
    assert err.value.option == "maxBlockBytes"
    assert str(err.value).startswith("maxBlockBytes:")
    if not isinstance(text, bool):
        assert "MiB" in str(err.value)  # says what is allowed


def test_parse_bytes_minimum():
    assert parse_bytes("1KiB", minimum=1024) == 1024
    with pytest.raises(AcsOptionError, match="at least 1024 bytes"):
        parse_bytes("1000", option="x", minimum=1024)
    with pytest.raises(AcsOptionError, match="too small"):
        parse_bytes(-5, option="x")


@pytest.mark.parametrize(
    "text, expected",
    [("60s", 60.0), ("10ms", 0.01), ("250us", 0.00025), ("2m", 120.0), ("2min", 120.0), ("1h", 3600.0),
     ("1d", 86400.0), ("0.5", 0.5), (3, 3.0), (0.25, 0.25), ("1.5 s", 1.5), ("5sec", 5.0), ("1H", 3600.0)],
)
def test_parse_duration_accepts(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "soon", "-1s", "5 parsecs", "1w", True, "1e3s", "s"])
def test_parse_duration_refuses_with_the_option_name(text):
    with pytest.raises(AcsOptionError) as err:
        parse_duration(text, option="pollInterval")
    assert err.value.option == "pollInterval" and str(err.value).startswith("pollInterval:")


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("-inf")])
def test_parse_duration_refuses_negative_and_nan(value):
    with pytest.raises(AcsOptionError, match="pollInterval"):
        parse_duration(value, option="pollInterval")


def test_parse_duration_minimum():
    with pytest.raises(AcsOptionError, match="at least 0.001 s"):
        parse_duration("0", option="x", minimum=0.001)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 20) == "3.0 MiB"
    assert format_bytes(5 << 40) == "5120.0 GiB"


# -- options -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Opts:
    path: str = option("path", parse=parse_str, doc="where", required=True)
    max_bytes: int = option("maxBytes", 1024, parse=bytes_parser(1), doc="cap")
    poll: float = option("pollInterval", 0.01, parse=duration_parser(0.0), doc="poll")
    enabled: bool = option("enabled", True, parse=parse_bool, doc="on")
    count: int = option("count", 3, parse=parse_int(1, 10), doc="how many")
    mode: str = option("mode", "fast", parse=choice_parser("fast", "safe"), doc="mode")


def test_parse_options_builds_the_dataclass_case_insensitively():
    o = parse_options(
        _Opts,
        {"PATH": "/x", "maxbytes": "2KiB", "pollInterval": "5ms", "Enabled": "no", "count": "10", "mode": "SAFE"},
        component="acs test",
    )
    assert o == _Opts("/x", 2048, 0.005, False, 10, "safe")
    assert parse_options(_Opts, {"path": "p", "count": None}, component="c").count == 3


def test_parse_options_refuses_unknown_keys_listing_valid_ones():
    with pytest.raises(AcsOptionError) as err:
        parse_options(_Opts, {"path": "/x", "maxbytez": "1"}, component="acs source")
    msg = str(err.value)
    assert msg.startswith("acs source: unknown option 'maxbytez'")
    assert "valid options are: count, enabled, maxBytes, mode, path, pollInterval" in msg
    assert err.value.option == "maxbytez"


@pytest.mark.parametrize(
    "raw, name, pattern",
    [({}, "path", "required"), ({"path": " "}, "path", "must not be empty"),
     ({"path": "p", "maxBytes": "lots"}, "maxBytes", "not a byte size"),
     ({"path": "p", "maxBytes": "0"}, "maxBytes", "at least 1"),
     ({"path": "p", "pollInterval": "-1"}, "pollInterval", "not a duration"),
     ({"path": "p", "enabled": "maybe"}, "enabled", "not a boolean"),
     ({"path": "p", "count": "1.5"}, "count", "not a whole number"),
     ({"path": "p", "count": "11"}, "count", "<= 10"),
     ({"path": "p", "count": "0"}, "count", ">= 1"),
     ({"path": "p", "mode": "slow"}, "mode", "use one of: fast, safe")],
)
def test_parse_options_bad_values_name_the_option(raw, name, pattern):
    with pytest.raises(AcsOptionError, match=pattern) as err:
        parse_options(_Opts, raw, component="c")
    assert err.value.option == name
    assert name in str(err.value)


def test_describe_options():
    text = describe_options(_Opts)
    assert "path (required): where" in text
    assert "maxBytes (default 1KiB): cap" in text
    assert "pollInterval (default 10ms): poll" in text


def test_option_flags_parse_values_and_switch_off_what_is_on_by_default():
    parser = argparse.ArgumentParser()
    add_option_flags(parser, _Opts, shown={"count": "the command's own choice"})
    args = parser.parse_args(["--path", "/x", "--max-bytes", "2KiB", "--no-enabled"])
    assert options_from_flags(_Opts, args) == _Opts("/x", 2048, 0.01, False, 3, "fast")
    args = parser.parse_args(["--path", "/x", "--enabled"])
    assert options_from_flags(_Opts, args).enabled is True
    assert options_from_flags(_Opts, parser.parse_args(["--path", "/x"])).enabled is True  # not given: the default
    text = " ".join(parser.format_help().split())
    assert "--enabled, --no-enabled" in text and "how many (default the command's own choice)" in text
    assert "cap (default 1KiB)" in text


def test_a_former_flag_name_parses_alike_hidden_from_the_help(capsys):
    parser = argparse.ArgumentParser(prog="t")
    add_option_flags(parser, _Opts, only=("path", "max_bytes"), former={"max_bytes": "--cap"})
    args = parser.parse_args(["--path", "/x", "--cap", "2KiB"])
    assert options_from_flags(_Opts, args).max_bytes == 2048
    assert "--cap" not in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--path", "/x", "--cap", "lots"])
    assert "argument --cap: 'lots' is not a byte size" in capsys.readouterr().err


# -- offsets -----------------------------------------------------------------------------------

F1 = "20260102T030405000006Z-abc.acs"


def test_offsets_round_trip():
    offs = {("s", 0): Offset(F1, 96), ("s", 1): Offset(), ("t", 2): Offset(F1, 0)}
    text = format_offsets(offs)
    assert text == {"s": {"0": {"file": F1, "length": 96}, "1": {"file": "", "length": 0}},
                    "t": {"2": {"file": F1, "length": 0}}}
    assert parse_offsets(text) == offs
    import json

    assert parse_offsets(json.dumps(text)) == offs
    assert Offset(F1, 5) < Offset(F1, 6) < Offset("20260102T030405000007Z-abc.acs", 0)
    assert Offset() < Offset(F1, 0)


@pytest.mark.parametrize(
    "bad, pattern",
    [("{nope", "not valid JSON"), ("[1]", "expected a JSON object"), ({"../x": {}}, "invalid stream name"),
     ({"s": [1]}, "must map shard numbers"), ({"s": {"a": {"file": "", "length": 0}}}, "not a shard number"),
     ({"s": {"-1": {"file": "", "length": 0}}}, "not a shard number"),
     ({"s": {"0": {"file": "../../etc/passwd", "length": 0}}}, "not a message file name"),
     ({"s": {"0": {"file": F1, "length": -1}}}, "non-negative"),
     ({"s": {"0": {"file": "", "length": 5}}}, "0 when file is empty"),
     ({"s": {"0": {"file": F1, "length": True}}}, "non-negative"),
     ({"s": {"0": {"file": F1, "length": 1, "extra": 2}}}, "expected")],
)
def test_bad_offsets_are_refused_naming_the_option(bad, pattern):
    with pytest.raises(AcsOptionError, match=pattern) as err:
        parse_offsets(bad, option="startingOffsets")
    assert err.value.option == "startingOffsets" and "startingOffsets" in str(err.value)


def test_nan_is_not_a_size_either():
    assert math.isnan(float("nan"))
    with pytest.raises(AcsOptionError):
        parse_bytes("nan")


def test_parse_options_names_the_nearest_valid_option():
    with pytest.raises(AcsOptionError) as err:
        parse_options(_Opts, {"path": "/x", "POLLINTERVALL": "1s"}, component="acs source")
    assert "unknown option 'POLLINTERVALL' (did you mean 'pollInterval'?)" in str(err.value)
    assert "valid options are: count, enabled, maxBytes, mode, path, pollInterval" in str(err.value)
    with pytest.raises(AcsOptionError) as err:  # nothing close: no guess, only the list
        parse_options(_Opts, {"path": "/x", "zzz": "1"}, component="acs source")
    assert "did you mean" not in str(err.value) and "valid options are" in str(err.value)


def test_nearest_name_is_case_insensitive_and_keeps_the_declared_spelling():
    from pyspark_acs.options import nearest_name

    assert nearest_name("strartingoffsets", ["startingOffsets", "endingOffsets", "stream"]) == "startingOffsets"
    assert nearest_name("rolBytes", ["rollBytes", "root"]) == "rollBytes"
    assert nearest_name("qqqq", ["rollBytes", "root"]) is None


def test_a_duration_that_needs_its_unit_refuses_a_bare_number():
    assert parse_duration("1d", option="--ttl", unit_required=True) == 86400.0
    assert parse_duration(1.5, option="--ttl", unit_required=True) == 1.5  # a Python number is seconds
    with pytest.raises(AcsOptionError, match=r"--ttl: '7' has no unit; add one: '7s' for seconds, '7h'"):
        parse_duration("7", option="--ttl", unit_required=True)
    assert parse_duration("7", option="--timeout") == 7.0  # timeouts and intervals: seconds


def test_durations_and_sizes_format_as_they_parse():
    from pyspark_acs.units import format_duration, format_size

    for seconds, text in ((0, "0s"), (0.01, "10ms"), (0.5, "500ms"), (60, "60s"), (3600, "1h"), (86400, "1d"),
                          (90, "90s"), (1.5, "1500ms"), (1e-6, "1us")):
        assert format_duration(seconds) == text
        assert parse_duration(text) == pytest.approx(seconds)
    for n, text in ((0, "0B"), (1000, "1000B"), (1024, "1KiB"), (64 << 20, "64MiB"), (1 << 30, "1GiB")):
        assert format_size(n) == text and parse_bytes(text) == n
