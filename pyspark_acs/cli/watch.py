"""``--watch`` of ``acs status``, ``acs copy-status`` and ``acs lag``, and the progress bars of
``acs produce``: one place for how the command line refreshes things (with ``rich``).

On a terminal a watched table is redrawn in place (``rich.live.Live``); when the output is
a pipe or a file each refresh is printed after the previous one under a time line, so a log
of a watch reads as a history. Progress bars go to stderr and only on a terminal (stdout
stays the command's data).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, List, Optional, Sequence

from pyspark_acs.errors import AcsError, AcsOptionError
from pyspark_acs.units import parse_duration

__all__ = [
    "add_watch_flags",
    "progress",
    "rich_table",
    "text_table",
    "watch",
]

#: How often a watched table is refreshed unless ``--interval`` says otherwise.
DEFAULT_WATCH_INTERVAL = "2s"
#: A progress bar is redrawn at most this often (seconds).
PROGRESS_UPDATE_S = 0.1
#: Line width of a watched table written to a pipe or file (no terminal to fit: cut nothing).
PIPE_WIDTH = 400


def add_watch_flags(p) -> None:
    """``--watch``, ``--interval`` and ``--iterations`` of a command that can refresh its table."""
    p.add_argument("--watch", action="store_true",
                   help="refresh the table in place until Ctrl-C (on a pipe: print each refresh)")
    p.add_argument("--interval", default=DEFAULT_WATCH_INTERVAL, metavar="DURATION",
                   help=f"time between refreshes with --watch (default {DEFAULT_WATCH_INTERVAL}; 500ms, 2s, 1m)")
    p.add_argument("--iterations", type=int, default=None, metavar="N",
                   help="with --watch, stop after N refreshes (default: until Ctrl-C)")


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart (plain output)."""
    table = [list(head)] + [list(r) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table) + "\n"


def rich_table(title: str, head: Sequence[str], rows: Sequence[Sequence[object]]):
    """A ``rich.table.Table`` of string cells (or rich renderables such as progress bars)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name in head:
        table.add_column(name, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def watch(render: Callable[[], object], *, interval: str, iterations: Optional[int], command: str) -> int:
    """Show ``render()`` every ``interval`` until Ctrl-C (or ``iterations`` refreshes); returns 0.

    The first render runs before anything is shown, so a bad root or checkpoint fails the
    command at once with its error. A later failure (a cache going down, a file cleaned up
    under the reader) is shown in place of the table, naming the command, and the watch goes
    on: it is what the operator is watching for.

    Raises
    ------
    AcsOptionError
        For a bad ``--interval`` or ``--iterations``.
    """
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    period = parse_duration(interval, option="--interval")
    if period <= 0:
        raise AcsOptionError(f"--interval: must be more than 0, got {interval!r}", option="--interval")
    if iterations is not None and iterations < 1:
        raise AcsOptionError(f"--iterations: must be 1 or more, got {iterations}", option="--iterations")
    console = Console(file=sys.stdout)
    if not console.is_terminal:  # a pipe or a file: no width to fit, so cut no cell short
        console = Console(file=sys.stdout, width=PIPE_WIDTH)

    def frame(body: Optional[object] = None) -> object:
        from rich.console import Group

        if body is None:
            try:
                body = render()
            except AcsError as exc:
                body = Text(f"acs {command}: error: {exc}", style="bold red")
        return Group(Text(f"-- {time.strftime('%H:%M:%S')}  every {interval}  (Ctrl-C to stop)", style="dim"), body)

    first = render()  # errors here end the command (a typo is not something to watch)
    shown = 0
    try:
        if console.is_terminal:
            with Live(frame(first), console=console, auto_refresh=False, transient=False) as live:
                shown = 1
                while iterations is None or shown < iterations:
                    time.sleep(period)
                    live.update(frame(), refresh=True)
                    shown += 1
        else:
            console.print(frame(first))
            sys.stdout.flush()
            shown = 1
            while iterations is None or shown < iterations:
                time.sleep(period)
                console.print(frame())
                sys.stdout.flush()
                shown += 1
    except KeyboardInterrupt:
        pass
    return 0


class _NoProgress:
    """What :func:`progress` returns when no bar is drawn: the same calls, doing nothing."""

    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def advance(self, messages: int = 1, nbytes: int = 0) -> None:
        return None


class _Progress:
    """A rich progress bar on stderr counting messages and bytes (total known or not)."""

    def __init__(self, description: str, total: Optional[int], unit: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bytes = 0
        self._messages = 0
        self._pending = 0  # messages counted but not yet shown
        self._started = self._updated = time.monotonic()
        columns: List[object] = [TextColumn("{task.description}")]
        if total is not None:
            columns += [BarColumn(), MofNCompleteColumn()]
        else:
            columns += [TextColumn("{task.completed} " + unit)]
        columns += [TextColumn("{task.fields[size]}"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn()]
        self._progress = Progress(*columns, console=Console(file=sys.stderr), transient=False)
        self._unit = unit
        self._task = self._progress.add_task(description, total=total, size="", rate="")

    def __enter__(self) -> "_Progress":
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._flush(time.monotonic())
        self._progress.stop()

    def advance(self, messages: int = 1, nbytes: int = 0) -> None:
        """Count ``messages`` and ``nbytes`` more; the bar is redrawn at most every
        :data:`PROGRESS_UPDATE_S` (a per-message redraw cost more than the send)."""
        self._bytes += nbytes
        self._messages += messages
        self._pending += messages
        now = time.monotonic()
        if now - self._updated >= PROGRESS_UPDATE_S:
            self._flush(now)

    def _flush(self, now: float) -> None:
        from pyspark_acs.units import format_bytes

        elapsed = max(now - self._started, 1e-9)
        self._progress.update(self._task, advance=self._pending, size=format_bytes(self._bytes),
                              rate=f"{self._messages / elapsed:,.0f} {self._unit}/s {format_bytes(self._bytes / elapsed)}/s")
        self._pending = 0
        self._updated = now


def progress(description: str, *, total: Optional[int] = None, unit: str = "messages",
             enabled: Optional[bool] = None):
    """A context manager with ``advance(messages, nbytes)``: a progress bar on stderr when it is
    a terminal (or ``enabled`` is True), else nothing (``enabled`` False or a pipe)."""
    show = sys.stderr.isatty() if enabled is None else enabled
    return _Progress(description, total, unit) if show else _NoProgress()
