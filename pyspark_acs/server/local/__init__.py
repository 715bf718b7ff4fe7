"""pyspark_acs.server.local."""
