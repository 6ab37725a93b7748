"""hilum gRPC contracts, version 1: generated ``*_pb2`` / ``*_pb2_grpc`` modules (do not edit)."""
