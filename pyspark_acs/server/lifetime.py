"""How long a server process lives: until told to stop, or until the process it serves exits.

One rule for every server (``acs-cache-server``, ``acs-copy-daemon``, ``acs-tier-mover``) and
every ``spark-submit`` launcher in ``jars-free/``: with ``--parent-pid PID`` a server stops when ``PID`` exits, and a
launcher run by ``spark-submit`` passes the ``spark-submit`` JVM as that parent, because a
SIGTERM to ``spark-submit`` ends the JVM but not its Python child (the server would be orphaned,
still holding its port).
"""

from __future__ import annotations

import os
import threading
from typing import List, Sequence

__all__ = [
    "spark_submit_argv",
    "watch_parent",
]

#: How often a server checks that its parent process still runs.
PARENT_POLL_S = 0.5


def parent_pid_flag(text: str) -> int:
    """``--parent-pid``'s value: a process id (argparse ``type``)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a process id") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a process id")
    return value


def watch_parent(pid: int, stop: threading.Event) -> threading.Thread:
    """Set ``stop`` once process ``pid`` no longer runs (checked every :data:`PARENT_POLL_S`)."""

    def run() -> None:
        while not stop.wait(PARENT_POLL_S):
            if os.getppid() == pid:
                continue  # still our parent: alive
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                stop.set()
            except PermissionError:
                pass  # alive, owned by someone else

    thread = threading.Thread(target=run, name="acs-parent-watch", daemon=True)
    thread.start()
    return thread


def spark_submit_argv(argv: Sequence[str]) -> List[str]:
    """``argv`` of a ``jars-free`` launcher, with ``--parent-pid <the spark-submit JVM>`` added when
    ``spark-submit`` runs it (and none was given)."""
    argv = list(argv)
    launched_by_spark_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    if launched_by_spark_submit and not any(a == "--parent-pid" or a.startswith("--parent-pid=") for a in argv):
        argv += ["--parent-pid", str(os.getppid())]
    return argv
