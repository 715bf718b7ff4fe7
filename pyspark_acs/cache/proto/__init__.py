"""pyspark_acs.cache.proto."""
