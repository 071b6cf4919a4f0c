"""Generated gRPC stubs of agent/proto/kvfabric/v1/engine.proto.

Do not edit engine_pb2*.py*: run agent/python/regen.sh (CI checks they are
not stale with `regen.sh --check`)."""
