"""Run the pyspark_acs tier mover - with ``spark-submit`` or plain ``python``.

    spark-submit jars-free/tier_mover.py --root /data/acs [--interval 10s] [--once]

A thin launcher around :func:`pyspark_acs.server.tier.daemon.main` (the ``acs-tier-mover``
command; ``--help`` lists the flags, ``docs/tiered.md`` explains them). It needs no jars and
creates no SparkContext. Under ``spark-submit`` it also stops when the ``spark-submit`` JVM
exits (it adds ``--parent-pid <the JVM>`` unless given).
"""

from __future__ import annotations

import os
import sys

try:
    from pyspark_acs.server.tier.daemon import main
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pyspark_acs.server.tier.daemon import main


def launch(argv):
    """Run the mover with ``argv``; under ``spark-submit`` it also exits with the driver JVM."""
    argv = list(argv)
    launched_by_spark_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    if launched_by_spark_submit and not any(a == "--parent-pid" or a.startswith("--parent-pid=") for a in argv):
        argv += ["--parent-pid", str(os.getppid())]
    return main(argv)


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
