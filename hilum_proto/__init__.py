"""hilum_proto — hilum's gRPC contracts.

The ``.proto`` sources are in ``hilum_proto/hilum/v1/`` (package ``hilum.v1``); the generated modules are
committed next to them and imported as ``hilum_proto.hilum.v1.coordinator_pb2`` /
``hilum_proto.hilum.v1.coordinator_pb2_grpc``. Regenerate with ``python -m hilum_proto.generate``; a test fails when
the committed code is stale. Conversions between messages and hilum's dataclasses live in
``global_coord.convert`` and are used only at the gRPC edge.
"""

__all__: list[str] = []
