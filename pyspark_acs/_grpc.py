"""grpc, imported the way this package needs it: every module of pyspark_acs that uses grpc
imports it from here (``from pyspark_acs._grpc import grpc``), never directly.

Why: grpcio 1.81 and later (1.85.3 here) run their C core's fork handlers in every child that a
process holding live gRPC channels forks. A child that is about to ``exec`` (``subprocess``
with a ``preexec_fn``, which is how pyspark launches its Java gateway) restarts the event
engine's poller there, whose epoll descriptor ``close_fds`` has just closed, and aborts with
SIGABRT before it execs (grpc/grpc#43055). Measured on this machine with two threads calling a
local server: 28 of 1000 such children died; 0 of 1000 with the handlers off. A producer or a
local deployment followed by ``SparkSession.builder.getOrCreate()`` in one process hits it as
"Java gateway process exited before sending its port number" (a full test run did).

This package never uses a gRPC channel across a fork (a forked Spark worker opens its own), so
it turns the core's fork handlers off, unless the environment already says otherwise. The core
reads the variable when grpc is first imported in the process: a program that imports grpc
itself before pyspark_acs must set ``GRPC_ENABLE_FORK_SUPPORT=false`` itself (docs/deploy.md).
Child processes (cache servers, Spark's JVM and its Python workers) inherit the setting.
"""

from __future__ import annotations

import os

__all__ = ["FORK_SUPPORT_ENV", "FORK_SUPPORT_DEFAULT", "grpc"]

#: The environment variable grpcio's core reads once, at import, for its fork handlers.
FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
#: Its value here unless the environment sets one: the handlers off (see the module docstring).
FORK_SUPPORT_DEFAULT = "false"

os.environ.setdefault(FORK_SUPPORT_ENV, FORK_SUPPORT_DEFAULT)

import grpc  # noqa: E402  (after the variable: the core reads it at import)
