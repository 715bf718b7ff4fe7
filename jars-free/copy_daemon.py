"""Run the pyspark_acs copy daemon through spark-submit (no --jars needed).

    spark-submit jars-free/copy_daemon.py --topology topology.json --cluster B [--workers 64] [--replica 0/1]

Same flags as ``acs-copy-daemon`` (see ``docs/copy.md``); the exit status is the daemon's
(2 for a bad topology file or a --cluster not in it).
"""

import sys

from pyspark_acs.server.copy.daemon import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
