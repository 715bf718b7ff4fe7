"""``python -m pyspark_acs.server.copy``: run a copy daemon (same as ``acs-copy-daemon``)."""

import sys

from pyspark_acs.server.copy.daemon import main

sys.exit(main())
