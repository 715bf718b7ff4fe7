"""The docs' commands run as written: every code block of README.md and docs/*.md that is
marked runnable is run, as a new user would paste it.

The marker is an HTML comment on the line before the fence (GitHub does not show it)::

    <!-- runnable -->
    ```bash
    acs tree --topology examples/topology.toml --stream orders
    ```

Each block runs in a fresh folder that stands for the checkout after ``make setup``: links to
its ``examples/`` and ``docs/`` (so relative paths in the docs resolve) and ``.venv`` linked to
the virtualenv of the interpreter running the tests, with no ``ACS_*`` variable set and nothing
of that virtualenv on PATH, nor any other ``acs`` -- as in a new user's shell, where ``acs`` is
not a command until the virtualenv is activated. ``bash`` blocks run under ``bash -euo
pipefail``: README.md's exactly as written (they activate ``.venv`` themselves, as the README
says to), a docs page's after ``. .venv/bin/activate``, which such a page states it assumes.
``python`` blocks run with the test interpreter. A local deployment a block leaves running is
stopped after it. Keep runnable blocks fast (seconds).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

from tests.helpers import ROOT as HELPERS_ROOT

ROOT = Path(HELPERS_ROOT)
#: The line that marks the next fenced block as runnable.
MARKER = "<!-- runnable -->"
#: Languages a runnable block may have.
LANGUAGES = ("bash", "python")
#: Upper bound of one block's run (a safety net; the blocks take seconds).
BLOCK_TIMEOUT_S = 120
#: How a user puts the checkout's commands on PATH (README.md, "Command line and servers").
ACTIVATE = ". .venv/bin/activate"

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


def test_a_page_with_runnable_commands_says_how_to_get_them():
    """A docs page's bash blocks run after the activation (see the module docstring): the page
    says so, and README.md's blocks activate in the block itself."""
    for doc in sorted({b.doc for b in BLOCKS if b.language == "bash"}):
        if doc == "README.md":
            first = next(b for b in BLOCKS if b.doc == doc and b.language == "bash")
            assert first.code.startswith(ACTIVATE), f"{doc}:{first.line}: the block must start with {ACTIVATE!r}"
        else:
            assert ACTIVATE in (ROOT / doc).read_text(encoding="utf-8"), f"{doc} must say {ACTIVATE!r}"


def _shell_path(path: str) -> str:
    """PATH as a new user's shell has it: without the test virtualenv's bin nor any other ``acs``."""
    venv_bin = os.path.dirname(os.path.abspath(sys.executable))
    kept = [d for d in path.split(os.pathsep)
            if d and os.path.abspath(d) != venv_bin and not shutil.which("acs", path=d)]
    return os.pathsep.join(kept)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.doc}:{b.line}" for b in BLOCKS])
def test_runnable_block(block: Block, tmp_path, subprocess_env):
    work = tmp_path / "work"
    work.mkdir()
    for name in ("examples", "docs"):
        (work / name).symlink_to(ROOT / name)
    env = {k: v for k, v in subprocess_env.items() if not k.startswith("ACS_") and k != "VIRTUAL_ENV"}
    env["PATH"] = _shell_path(env.get("PATH", ""))
    assert shutil.which("acs", path=env["PATH"]) is None
    code = block.code
    if block.language == "bash":
        if not os.path.exists(os.path.join(sys.prefix, "bin", "activate")):
            pytest.skip(f"the test interpreter {sys.executable} is not a virtualenv's: no .venv to activate")
        (work / ".venv").symlink_to(sys.prefix)  # what `make setup` leaves in the checkout
        if block.doc != "README.md":
            code = f"{ACTIVATE}\n{code}"
    cmd = ["bash", "-euo", "pipefail", "-c", code] if block.language == "bash" else [sys.executable, "-c", code]
    try:
        run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    finally:
        _stop_deployments(work, env)
    assert run.returncode == 0, (f"{block.doc}:{block.line}: the {block.language} block exited {run.returncode}\n"
                                 f"--- block\n{block.code}--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-3000:]}")


# -- the docs are reference, and every reference resolves inside the repository ----------------

#: A calendar date (2026-11-29): docs/ says how things work, not when they were measured.
DATE = re.compile(r"\b20\d{2}-[01]\d-[0-3]\d\b")
#: A section that reports a measurement run ("## Measured (2-core machine, ...)").
MEASURED_HEADING = re.compile(r"^#+\s.*\bmeasured\b", re.IGNORECASE)
#: Documents that are not in the repository: the design page that lived beside it, the paper
#: seeds it was started from (cited by title instead, docs/overview.md section 9), and issue
#: numbers of a tracker the repository does not hold.
OUTSIDE = re.compile(r"DESIGN\.md|\bseeds?[ /_]?0\d\d\b|\b\d{3}_[0-9a-f]{16}\.txt\b|\bissues? ?#?\d+\b",
                     re.IGNORECASE)


def test_docs_hold_no_dates_and_no_measured_sections():
    """docs/*.md is present-tense reference: measurements live in benchmarks/RESULTS.md, with
    their command, commit and date, and the history of both is git's."""
    found = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if DATE.search(line) or MEASURED_HEADING.match(line):
                found.append(f"docs/{doc.name}:{n}: {line.strip()[:100]}")
    assert not found, "dated or 'Measured' text in docs/ (move figures to benchmarks/RESULTS.md):\n" + "\n".join(found)


def _tracked_text_files() -> List[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}): the tracked files are unknown")
    return [ROOT / rel for rel in listed.stdout.decode().split("\0") if rel]


def test_no_reference_to_documents_outside_the_repository():
    """Words, data flow and formats are in docs/overview.md; code and docs cite its sections
    (or a paper by title), never a file or tracker the repository does not hold."""
    found = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary, or deleted in the work tree
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def test_benchmark_results_name_command_commit_and_date():
    """Every table in benchmarks/RESULTS.md is dated and comes with a command, so it can be
    run again; every benchmark script has a section there."""
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", results, flags=re.MULTILINE)[1:]
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    named = set(re.findall(r"`?([a-z_]+\.py)`?", results))
    assert scripts <= named, f"benchmarks without a section in RESULTS.md: {sorted(scripts - named)}"
    for section in sections:
        title = section.splitlines()[0]
        if title.startswith("Not measured"):
            continue
        assert "```" in section, f"RESULTS.md section {title!r} has no command"
        assert DATE.search(section) and re.search(r"\b[0-9a-f]{7}\b", section), (
            f"RESULTS.md section {title!r} names no commit and date")


# -- option references rendered from the declarations ------------------------------------------


def test_option_tables_in_the_docs_agree_with_the_declarations():
    """Every table between ``<!-- options: module.Class style -->`` and ``<!-- /options -->`` is
    what :func:`~pyspark_acs.options.describe_options` renders from the declarations now."""
    from pyspark_acs.options import OPTION_TABLE, WRITE_DOCS_COMMAND, declared_class, describe_options

    found, stale = 0, []
    for doc in DOCS:
        for m in OPTION_TABLE.finditer(doc.read_text(encoding="utf-8")):
            found += 1
            expected = describe_options(declared_class(m.group(2)), m.group(3))
            if m.group(4) != expected:
                stale.append(f"{doc.relative_to(ROOT)}: the table of {m.group(2)} differs from its declarations; "
                             f"it should be:\n{expected}")
    assert not stale, f"stale option tables: run `{WRITE_DOCS_COMMAND}` to regenerate them\n" + "\n".join(stale)
    assert found >= 1


def test_the_readme_settings_reference_has_every_component():
    """README.md's "Settings reference" holds one rendered table per component that takes
    settings (:data:`pyspark_acs.options.REFERENCE`), in the style listed there."""
    from pyspark_acs.options import OPTION_TABLE, REFERENCE, WRITE_DOCS_COMMAND

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Settings reference\n", 1)[1].split("\n## ", 1)[0]
    tables = [(m.group(2), m.group(3)) for m in OPTION_TABLE.finditer(section)]
    wanted = [(path, style) for _, path, style in REFERENCE]
    assert tables == wanted, (
        f"README.md's settings reference must hold, in order, a table per component: add the markers "
        f"<!-- options: CLASS STYLE --> and <!-- /options --> for each of {wanted} and run `{WRITE_DOCS_COMMAND}`")
    for title, _, _ in REFERENCE:
        assert f"\n### {title}\n" in section, title


def test_write_docs_regenerates_a_stale_table(tmp_path):
    from pyspark_acs.options import describe_options, main
    from pyspark_acs.read.consumer import ConsumerOptions

    (tmp_path / "docs").mkdir()
    readme = tmp_path / "README.md"
    marker = "<!-- options: pyspark_acs.read.consumer.ConsumerOptions markdown -->"
    readme.write_text(f"# x\n\n{marker}\n| old |\n<!-- /options -->\n", encoding="utf-8")
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert main(["--write-docs", "--root", str(tmp_path)]) == 0
    assert readme.read_text(encoding="utf-8") == (
        f"# x\n\n{marker}\n{describe_options(ConsumerOptions, 'markdown')}\n<!-- /options -->\n")
    assert main(["--check", "--root", str(tmp_path)]) == 0


def test_the_datasource_docstring_lists_every_declared_option():
    from pyspark_acs.datasource import AcsDataSource, SinkOptions, SourceOptions
    from pyspark_acs.options import describe_options

    doc = AcsDataSource.__doc__
    assert describe_options(SourceOptions, "rst") in doc and describe_options(SinkOptions, "rst") in doc
    for cls in (SourceOptions, SinkOptions):
        for f in __import__("dataclasses").fields(cls):
            assert f"\n{f.metadata['acs_name']} : " in doc, f.metadata["acs_name"]
