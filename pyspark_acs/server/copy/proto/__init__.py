"""pyspark_acs.server.copy.proto."""
