"""grpc, imported the way this package needs it: every module of pyspark_acs that uses grpc
imports it from here (``from pyspark_acs._grpc import grpc``), never directly.

Why: grpcio 1.81 and later (1.85.3 here) run their C core's fork handlers in every child that a
process holding live gRPC channels forks. A child that is about to ``exec`` (``subprocess``
with a ``preexec_fn``, which is how pyspark launches its Java gateway) restarts the event
engine's poller there, whose epoll descriptor ``close_fds`` has just closed, and aborts with
SIGABRT before it execs (grpc/grpc#43055; with two threads calling a local server, about 3 % of
such children die, none with the handlers off). A producer or a
local deployment followed by ``SparkSession.builder.getOrCreate()`` in one process hits it as
"Java gateway process exited before sending its port number" (a full test run did).

This package never uses a gRPC channel across a fork (a forked Spark worker opens its own; a
child forked while channels were open is refused gRPC, see :mod:`pyspark_acs._fork`), so it
turns the core's fork handlers off, unless the environment already says otherwise. The core
reads the variable when grpc is first imported in the process: a program that imports grpc
itself before pyspark_acs must set ``GRPC_ENABLE_FORK_SUPPORT=false`` itself (docs/deploy.md).
Child processes (cache servers, Spark's JVM and its Python workers) inherit the setting.

**Polling on the waiting thread.** In the same way it turns off two of the core's EventEngine
experiments, ``event_engine_client`` and ``event_engine_listener`` (``GRPC_EXPERIMENTS``), for
the grpcio versions in :data:`LEGACY_POLLING_GRPCIO`. With them on, a message that arrives is
read from the socket on one of the EventEngine's threads and handed to the thread that waits
for it; with them off, the waiting thread polls the socket itself: one thread wake less per
message, and this package's traffic is many small messages (a push per producer flush): a tenth
to a fifth less CPU per message for a follower, a relay and a producer. The core reads the
variable once, at import, so it is set for the import only and the environment is
restored right after: child processes (which may run another grpcio) do not inherit it, and
each process of this package applies the rule itself when it imports it. A value the
environment already has is kept (the empty string gives grpc's own defaults), and a program
that imports grpc itself first keeps its own.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "grpc",
]

#: The environment variable grpcio's core reads once, at import, for its fork handlers.
FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
#: Its value here unless the environment sets one: the handlers off (see the module docstring).
FORK_SUPPORT_DEFAULT = "false"

os.environ.setdefault(FORK_SUPPORT_ENV, FORK_SUPPORT_DEFAULT)

#: The environment variable grpcio's core reads once, at import, for its experiments.
EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
#: Its value here unless the environment sets one: polling on the waiting thread (see above).
EXPERIMENTS_DEFAULT = "-event_engine_client,-event_engine_listener"
#: grpcio versions ``(major, minor)`` from (inclusive) and to (exclusive) that were measured
#: with :data:`EXPERIMENTS_DEFAULT`: a later one may have made them final, and the core logs an
#: error for each experiment it no longer knows. Measure again before widening it.
LEGACY_POLLING_GRPCIO = ((1, 85), (1, 86))


def _grpcio_version() -> tuple:
    # grpc/_grpcio_metadata.py, read without importing grpc (the core must not load before the
    # variables are set) or importlib.metadata (25 ms in every process of this package).
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("grpc")
        path = os.path.join(os.path.dirname(spec.origin), "_grpcio_metadata.py")
        with open(path, encoding="utf-8") as f:
            found = re.search(r"__version__\s*=\s*[\"']+(\d+)\.(\d+)", f.read())
        if found:
            return int(found.group(1)), int(found.group(2))
    except (AttributeError, ImportError, OSError, TypeError, ValueError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(x) for x in version("grpcio").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return ()


#: What this package set :data:`EXPERIMENTS_ENV` to for grpc's import (None: it set nothing,
#: the environment chose or the grpcio version is outside :data:`LEGACY_POLLING_GRPCIO`).
EXPERIMENTS_APPLIED = None
if (EXPERIMENTS_ENV not in os.environ and "grpc" not in sys.modules  # imported already: read already
        and LEGACY_POLLING_GRPCIO[0] <= _grpcio_version() < LEGACY_POLLING_GRPCIO[1]):
    EXPERIMENTS_APPLIED = EXPERIMENTS_DEFAULT
    os.environ[EXPERIMENTS_ENV] = EXPERIMENTS_APPLIED
try:
    import grpc  # noqa: E402  (after the variables: the core reads them at import)
finally:
    if EXPERIMENTS_APPLIED is not None:
        os.environ.pop(EXPERIMENTS_ENV, None)  # read at import: no child inherits it
