"""Run the pyspark_acs tier mover - with ``spark-submit`` (no --jars needed) or plain ``python``.

    spark-submit jars-free/tier_mover.py --root /data/acs [--interval 10s] [--once]

Same flags as ``acs-tier-mover`` (see ``docs/tiered.md``); the exit status is the mover's (2 for
a bad flag or root). It creates no SparkContext. Under ``spark-submit`` the mover also stops
when the ``spark-submit`` JVM exits (``--parent-pid <the JVM>`` is added unless given), so
killing ``spark-submit`` leaves no mover behind.
"""

import os
import sys

try:
    from pyspark_acs.server.tier.daemon import main
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pyspark_acs.server.tier.daemon import main
from pyspark_acs.server.lifetime import spark_submit_argv


def launch(argv):
    """Run the mover with ``argv``; under ``spark-submit`` it also exits with the driver JVM."""
    return main(spark_submit_argv(argv))


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
