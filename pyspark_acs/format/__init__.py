"""pyspark_acs.format."""
