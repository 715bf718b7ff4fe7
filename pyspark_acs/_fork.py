"""Processes forked from this one: what a child cannot use, and the one error saying so.

With gRPC's core fork handlers off (:mod:`pyspark_acs._grpc` says why), a child forked while its
parent had gRPC open (a channel, or a server in the process) inherits the core's state mid-use:
a channel it opens then hangs on its first call, or the core aborts (with every channel of the
parent closed before the fork, the child's channels work). A process's readers
keep their shared length poller and chunk feed (and their channels) for the life of the
process, so in practice: fork before opening anything, or use ``spawn``. A Producer made
before a fork has no writer thread in the child, so its messages would never be written and
``flush()`` would wait for ever. Such a child is told so (:class:`~pyspark_acs.errors.ForkError`)
where it would use them, instead of hanging. Spark's Python workers are forked from
``pyspark.daemon``, which opens no channel, and every Spark task opens its own (per process:
``datasource/source.py`` ``_task_read_path``).

This module does not import grpc: the cache client checks it on every call, the Producer on
every send (a comparison of :data:`generation`, not a system call).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Optional, Tuple, TypeVar

__all__ = [
    "check_not_forked",
    "forked_from",
    "made_elsewhere",
    "made_here",
    "mark",
    "open_grpc",
]

T = TypeVar("T")

#: gRPC channels and servers of this process that are open (closed ones, once dropped, leave
#: it). _open_lock guards it and _opening.
_open: "weakref.WeakSet[Any]" = weakref.WeakSet()
_open_lock = threading.Lock()
#: Channels or servers being made now: a fork while one is made counts it as open.
_opening = 0
#: The process this one was forked from while that one had gRPC open (None: it was not; a
#: grandchild keeps its parent's value). Read without a lock: set once, in the child.
forked_from: Optional[int] = None
#: How many forks lie between the first process that imported this module and this one:
#: objects note it where they are made (:class:`ProcessMark`), and a child sees a larger one.
generation = 0

#: ``(generation, pid)`` of the process that made an object.
ProcessMark = Tuple[int, int]


def mark() -> ProcessMark:
    """The :data:`ProcessMark` of this process, for an object made now."""
    return generation, os.getpid()


def open_grpc(what: str, make: Callable[[], T]) -> T:
    """Make a gRPC channel or server (``make()``) and note it open; refused
    (:class:`~pyspark_acs.errors.ForkError`) in a child forked while gRPC was open. The one
    way this package opens gRPC (``SecuritySettings.channel``, the cache and copy servers)."""
    global _opening
    check_not_forked(what)
    with _open_lock:
        _opening += 1
    try:
        made = make()
        with _open_lock:
            _open.add(made)
        return made
    finally:
        with _open_lock:
            _opening -= 1


def fork_error(what: str, parent_pid: int, held: str = "had gRPC open") -> Exception:
    """The error of ``what`` used in this process, forked from ``parent_pid`` after that one
    ``held`` something a child cannot use (the one wording)."""
    from pyspark_acs.errors import ForkError

    return ForkError(
        f"{what}: process {os.getpid()} was forked from process {parent_pid}, which {held} at the "
        f"fork; a forked child cannot use it (gRPC's core state is inherited mid-use, a Producer's "
        f"writer thread is not). Start child processes with multiprocessing's 'spawn' or "
        f"'forkserver' method, or fork before opening Producers, Consumers, cache clients or "
        f"servers, and make them in the child", parent_pid=parent_pid)


def check_not_forked(what: str) -> None:
    """Raise :class:`~pyspark_acs.errors.ForkError` if this process was forked from one with
    gRPC open (``what`` names the user of gRPC)."""
    if forked_from is not None:
        raise fork_error(what, forked_from)


def made_here(made: ProcessMark) -> bool:
    """Whether an object marked ``made`` (:func:`mark`) was made in this process, not in one
    this process was forked from (then its threads are not here). Check before taking the
    object's locks: a thread of the parent may have held one."""
    return made[0] == generation


def made_elsewhere(made: ProcessMark, what: str) -> Exception:
    """The error of ``what``, made by the process ``made`` marks, used in this one (a caller
    that found not :func:`made_here`: an object whose threads this child does not have)."""
    return fork_error(what, made[1], "made it")


def _after_fork_in_child() -> None:
    global forked_from, generation, _open_lock
    generation += 1
    _open_lock = threading.Lock()  # a thread of the parent may have held it
    if len(_open) or _opening:
        forked_from = os.getppid()
        _open.clear()  # the parent's: unusable here, and not this process's to close


os.register_at_fork(after_in_child=_after_fork_in_child)
