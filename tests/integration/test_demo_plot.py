"""examples/demo.py's delay plot: a PNG per run with one line per cluster, or a one-line note
when matplotlib is missing (it is in the bench extra, not a dependency of the package).
The end-to-end demo run is in tests/integration/test_examples.py; this checks the plot alone, without Spark."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT

EXAMPLES = Path(ROOT) / "examples"


def _load_demo():
    spec = importlib.util.spec_from_file_location("acs_demo_plot", EXAMPLES / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _series():
    a = [(1000.0 + i * 0.01, 50.0 + (i % 7)) for i in range(500)]
    b = [(1000.0 + i * 0.01, 300.0 + (i % 11) * 10) for i in range(500)]
    return {"cluster A": a, "cluster B": b}


def test_plot_is_a_png_with_a_line_per_cluster(tmp_path):
    pytest.importorskip("matplotlib")
    demo = _load_demo()
    path = tmp_path / "delay.png"
    line = demo.write_plot(str(path), _series())
    assert line == f"delay plot: {path}"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert demo.write_plot(str(tmp_path / "none.png"), {"A": []}) == "delay plot: skipped, no messages arrived"


def test_plot_without_matplotlib_is_a_one_line_note(tmp_path, subprocess_env):
    code = textwrap.dedent(f"""
        import sys, importlib.util
        sys.modules["matplotlib"] = None  # as if it were not installed
        spec = importlib.util.spec_from_file_location("d", {str(EXAMPLES / "demo.py")!r})
        demo = importlib.util.module_from_spec(spec); spec.loader.exec_module(demo)
        print(demo.write_plot({str(tmp_path / "x.png")!r}, {{"A": [(1.0, 2.0)]}}))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith("delay plot: skipped, matplotlib is not installed"), run.stdout
    assert run.stdout.count("\n") == 1 and not (tmp_path / "x.png").exists()


def test_demo_has_a_plot_flag():
    demo = _load_demo()
    assert demo.parse_args(["--plot", "none"]).plot == "none"
    assert demo.parse_args([]).plot.endswith("acs-demo-delay.png")
