"""``python -m pyspark_acs.server.cache``: run one cache replica (same as ``acs-cache-server``)."""

import sys

from pyspark_acs.server.cache.server import main

sys.exit(main())
