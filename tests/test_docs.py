"""The docs' commands run as written: every code block of README.md and docs/*.md that is
marked runnable is run, as a new user would paste it.

The marker is an HTML comment on the line before the fence (GitHub does not show it)::

    <!-- runnable -->
    ```bash
    acs tree --topology examples/topology.toml --stream orders
    ```

``bash`` blocks run under ``bash -euo pipefail`` with this checkout's ``.venv/bin`` (the
interpreter running the tests) first on PATH, ``python`` blocks with that interpreter. Each
block runs in a fresh folder holding links to the checkout's ``examples/`` and ``docs/`` (so
relative paths in the docs resolve) with no ``ACS_*`` variable set; a local deployment a block
leaves running there is stopped after it. Keep runnable blocks fast (seconds).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The line that marks the next fenced block as runnable.
MARKER = "<!-- runnable -->"
#: Languages a runnable block may have.
LANGUAGES = ("bash", "python")
#: Upper bound of one block's run (a safety net; the blocks take seconds).
BLOCK_TIMEOUT_S = 120

pytestmark = pytest.mark.timeout(BLOCK_TIMEOUT_S * 2)


class Block(NamedTuple):
    doc: str
    line: int
    language: str
    code: str


def runnable_blocks(path: Path) -> List[Block]:
    """The blocks of one Markdown file marked runnable (the marker, then a fence)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == MARKER:
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            fence = re.match(r"^```(\w+)\s*$", lines[j].strip()) if j < len(lines) else None
            rel = str(path.relative_to(ROOT))
            assert fence and fence.group(1) in LANGUAGES, (
                f"{rel}:{i + 1}: {MARKER} must come right before a ```bash or ```python fence")
            end = j + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            assert end < len(lines), f"{rel}:{j + 1}: the runnable block is never closed"
            blocks.append(Block(rel, j + 1, fence.group(1), "\n".join(lines[j + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [b for doc in DOCS for b in runnable_blocks(doc)]


def test_blocks_are_marked():
    """The marker is in use where the commands a new user types first are (and not lost in an edit)."""
    docs = {b.doc for b in BLOCKS}
    assert {"README.md", "docs/topology.md"} <= docs, docs
    assert len(BLOCKS) >= 4, BLOCKS


def _stop_deployments(folder: Path, env) -> None:
    from pyspark_acs.server.local.deploy import DEPLOYMENT_FILE

    for state in folder.rglob(DEPLOYMENT_FILE):
        subprocess.run([sys.executable, "-m", "pyspark_acs.cli.main", "down", "--dir", str(state.parent)],
                       env=env, capture_output=True, timeout=60)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.doc}:{b.line}" for b in BLOCKS])
def test_runnable_block(block: Block, tmp_path, subprocess_env):
    work = tmp_path / "work"
    work.mkdir()
    for name in ("examples", "docs"):
        (work / name).symlink_to(ROOT / name)
    env = {k: v for k, v in subprocess_env.items() if not k.startswith("ACS_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    cmd = ["bash", "-euo", "pipefail", "-c", block.code] if block.language == "bash" else [sys.executable, "-c", block.code]
    try:
        run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    finally:
        _stop_deployments(work, env)
    assert run.returncode == 0, (f"{block.doc}:{block.line}: the {block.language} block exited {run.returncode}\n"
                                 f"--- block\n{block.code}--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-3000:]}")


# -- option references rendered from the declarations ------------------------------------------

#: A table rendered from an options dataclass: ``<!-- options: module.Class style -->``, the
#: table, ``<!-- /options -->``.
OPTIONS_TABLE = re.compile(r"<!-- options: (\S+) (\w+) -->\n(.*?)\n<!-- /options -->", re.S)


def _declared(path: str):
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_option_tables_in_the_docs_agree_with_the_declarations():
    from pyspark_acs.options import describe_options

    found = 0
    for doc in DOCS:
        for m in OPTIONS_TABLE.finditer(doc.read_text(encoding="utf-8")):
            found += 1
            expected = describe_options(_declared(m.group(1)), m.group(2))
            assert m.group(3) == expected, (
                f"{doc.relative_to(ROOT)}: the table of {m.group(1)} differs from its declarations; "
                f"replace it with:\n{expected}")
    assert found >= 1


def test_the_datasource_docstring_lists_every_declared_option():
    from pyspark_acs.datasource import AcsDataSource, SinkOptions, SourceOptions
    from pyspark_acs.options import describe_options

    doc = AcsDataSource.__doc__
    assert describe_options(SourceOptions, "rst") in doc and describe_options(SinkOptions, "rst") in doc
    for cls in (SourceOptions, SinkOptions):
        for f in __import__("dataclasses").fields(cls):
            assert f"\n{f.metadata['acs_name']} : " in doc, f.metadata["acs_name"]
