"""pyspark_acs.cli."""
