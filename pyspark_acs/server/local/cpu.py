"""CPU seconds used by local processes, from Linux ``/proc``: how the demo and the benchmarks
say where a run's CPU went (cache servers, copy daemons, Spark's JVM and its Python workers).
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List

__all__ = [
    "cpu_measurable",
    "cpu_seconds",
]


def cpu_measurable() -> bool:
    """Whether :func:`cpu_seconds` can measure anything here (Linux ``/proc``)."""
    return os.path.isdir("/proc")


def _stat_fields() -> Dict[int, List[str]]:
    """Every process's ``/proc/<pid>/stat`` fields after ``pid (comm)``; empty without /proc."""
    out: Dict[int, List[str]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                out[int(entry)] = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
    return out


def cpu_seconds(pids: Iterable[int], *, descendants: bool = True) -> float:
    """CPU seconds (user + system) that ``pids`` used so far, summed.

    Parameters
    ----------
    pids : iterable of int
        Processes; ones that are gone count 0.
    descendants : bool, default True
        Count each process's descendants too, those that exited and were waited for included
        (the kernel's ``cutime``/``cstime``): Spark's JVM with its Python workers, say. Do not
        pass a process together with one of its descendants then: it would count twice.

    Returns
    -------
    float
        0.0 where there is no ``/proc`` (not Linux). A descendant that exited under a parent
        which ignores ``SIGCHLD`` (pyspark's daemon does) was never waited for: its CPU is lost
        to the count, so the figure is a lower bound where workers come and go.
    """
    stats = _stat_fields()
    if not stats:
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    children: Dict[int, List[int]] = {}
    if descendants:
        for pid, fields in stats.items():
            children.setdefault(int(fields[1]), []).append(pid)
    # fields 14-17 of stat (utime stime cutime cstime) are 11-14 here, after pid, comm, state
    last = 15 if descendants else 13
    total = 0.0
    for root in pids:
        todo = [root]
        while todo:
            pid = todo.pop()
            fields = stats.get(pid)
            if fields is None:
                continue
            total += sum(int(x) for x in fields[11:last]) / tick
            if descendants:
                todo.extend(children.get(pid, []))
    return total
