"""pyspark_acs.storage."""
