"""pyspark_acs.server.copy."""
