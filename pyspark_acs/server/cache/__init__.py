"""pyspark_acs.server.cache."""
