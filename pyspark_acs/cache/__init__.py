"""pyspark_acs.cache."""
