"""Processes forked from this one: what a child cannot use, and the one error saying so.

With gRPC's core fork handlers off (:mod:`pyspark_acs._grpc` says why), a child forked while its
parent had channels open inherits the core's state mid-use: a channel it opens then hangs, or
the core aborts (measured: 8 of 8 children hung on their first call; with every channel of the
parent closed first, 8 of 8 worked). A Producer made before a fork has no writer thread in the
child, so its messages would never be written and ``flush()`` would wait for ever. Such a child
is told so (:class:`~pyspark_acs.errors.ForkError`) where it would use them, instead of
hanging. Spark's Python workers are forked from ``pyspark.daemon``, which opens no channel, and
every Spark task opens its own (per process: ``datasource/source.py`` ``_task_read_path``).

This module does not import grpc: the cache client checks it on every call.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Optional

__all__ = ["check_not_forked", "check_same_process", "fork_error", "forked_from", "opened_channel"]

#: Channels of this process that are open (closed ones, once dropped, leave it).
#: _open_channels_lock guards it.
_open_channels: "weakref.WeakSet[Any]" = weakref.WeakSet()
_open_channels_lock = threading.Lock()
#: The process this one was forked from while that one had channels open (None: it was not;
#: a grandchild keeps its parent's value). Read without a lock: set once, in the child.
forked_from: Optional[int] = None


def opened_channel(channel: Any) -> Any:
    """Note a channel this process opened (the one place: ``SecuritySettings.channel``)."""
    with _open_channels_lock:
        _open_channels.add(channel)
    return channel


def fork_error(what: str, parent_pid: int, held: str = "had gRPC channels open") -> Exception:
    """The error of ``what`` used in this process, forked from ``parent_pid`` after that one
    ``held`` something a child cannot use (the one wording)."""
    from pyspark_acs.errors import ForkError

    return ForkError(
        f"{what}: process {os.getpid()} was forked from process {parent_pid}, which {held} at the "
        f"fork; a forked child cannot use it (gRPC's core state is inherited mid-use, a Producer's "
        f"writer thread is not). Start child processes with multiprocessing's 'spawn' or "
        f"'forkserver' method, or fork before opening Producers, Consumers or cache clients, and "
        f"make them in the child", parent_pid=parent_pid)


def check_not_forked(what: str) -> None:
    """Raise :class:`~pyspark_acs.errors.ForkError` if this process was forked from one with
    gRPC channels open (``what`` names the user of gRPC)."""
    if forked_from is not None:
        raise fork_error(what, forked_from)


def check_same_process(made_in: int, what: str) -> None:
    """Raise :class:`~pyspark_acs.errors.ForkError` if this is not process ``made_in``, which
    made ``what`` (an object whose threads the child does not have). Call it before taking the
    object's locks: a thread of the parent may have held one at the fork."""
    if os.getpid() != made_in:
        raise fork_error(what, made_in, "made it")


def _after_fork_in_child() -> None:
    global forked_from, _open_channels_lock
    _open_channels_lock = threading.Lock()  # a thread of the parent may have held it
    if len(_open_channels):
        forked_from = os.getppid()
        _open_channels.clear()  # the parent's: unusable here, and not this process's to close


os.register_at_fork(after_in_child=_after_fork_in_child)
