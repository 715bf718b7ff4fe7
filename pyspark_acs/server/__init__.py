"""Server processes of pyspark_acs: the cache server (:mod:`.cache`), its storage engine
(:mod:`.store`) and local deployments of them (:mod:`.deploy`).

Nothing is imported here on purpose: importing the package must not pull in grpc.
"""

__all__: list = []
