"""Generated protobuf and gRPC stubs for the layertap.v1 API. Do not edit."""
