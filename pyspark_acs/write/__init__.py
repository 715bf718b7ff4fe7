"""pyspark_acs.write."""
