"""``python -m pyspark_acs.cli``: the ``acs`` command."""

import sys

from pyspark_acs.cli.main import main

sys.exit(main())
