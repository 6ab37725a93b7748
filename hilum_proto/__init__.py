"""hilum_proto — the Python side of hilum's gRPC contracts.

The contracts themselves are language-neutral ``.proto`` files in the top-level ``proto/`` folder
(``proto/hilum/v1/*.proto``, package ``hilum.v1``). The modules generated from them are committed in
``hilum_proto.v1`` (``hilum_proto.v1.coordinator_pb2`` / ``hilum_proto.v1.coordinator_pb2_grpc``, ...).
Regenerate with ``python -m hilum_proto.generate``; a test fails when the committed code is stale.
``hilum_proto.tls`` opens every gRPC channel and binds every server. Conversions between messages and
hilum's dataclasses live at each tier's gRPC edge and nowhere else.
"""

__all__: list[str] = []
