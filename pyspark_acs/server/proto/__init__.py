"""Generated protobuf/gRPC modules of the cache RPCs (see ``acs.proto``; regenerate with
``scripts/gen_proto.sh``). Nothing is imported here so the package import stays cheap."""

__all__: list = []
