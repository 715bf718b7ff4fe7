"""pyspark_acs.cache.proto."""

# Before the generated modules import grpc: the fork-handler setting (see pyspark_acs._grpc).
import pyspark_acs._grpc  # noqa: F401
