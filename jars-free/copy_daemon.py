"""Run the pyspark_acs copy daemon - with ``spark-submit`` (no --jars needed) or plain ``python``.

    spark-submit jars-free/copy_daemon.py --topology topology.json --cluster B [--workers 64] [--replica 0/1]

Same flags as ``acs-copy-daemon`` (see ``docs/copy.md``); the exit status is the daemon's
(2 for a bad topology file or a --cluster not in it). Under ``spark-submit`` the daemon also
stops when the ``spark-submit`` JVM exits (``--parent-pid <the JVM>`` is added unless given), so
killing ``spark-submit`` leaves no daemon behind.
"""

import os
import sys

try:
    from pyspark_acs.server.copy.daemon import main
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pyspark_acs.server.copy.daemon import main
from pyspark_acs.server.lifetime import spark_submit_argv


def launch(argv):
    """Run the daemon with ``argv``; under ``spark-submit`` it also exits with the driver JVM."""
    return main(spark_submit_argv(argv))


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
