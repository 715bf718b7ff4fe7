"""pyspark_acs.read."""
