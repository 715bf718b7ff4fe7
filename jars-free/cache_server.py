"""Launch one cache server replica (data or metadata) - with ``spark-submit`` or plain ``python``.

A thin launcher around :func:`pyspark_acs.server.cache.server.main` (the ``acs-cache-server``
command): every argument is passed through unchanged, so ``--help`` lists them all::

    spark-submit jars-free/cache_server.py --role data --port 7101 --capacity 1GiB --ttl 60s
    python jars-free/cache_server.py --role metadata --port 7111

It needs no jars (``spark-submit`` without ``--jars`` or ``--packages``): the server is pure
Python (gRPC). Spark's driver JVM only launches this script; it creates no SparkContext.
Once listening it prints one line (``acs-cache-server role=... listening on HOST:PORT
metrics=...``); SIGTERM or Ctrl-C stops it gracefully. Under ``spark-submit`` it also stops when the
``spark-submit`` JVM exits (it adds ``--parent-pid <the JVM>`` unless given). The exit status
is the server's (2 for a bad flag).
"""

from __future__ import annotations

import os
import sys

try:
    from pyspark_acs.server.cache.server import main
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pyspark_acs.server.cache.server import main
from pyspark_acs.server.lifetime import spark_submit_argv


def launch(argv):
    """Run the server with ``argv``; under ``spark-submit`` it also exits with the driver JVM."""
    return main(spark_submit_argv(argv))


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
