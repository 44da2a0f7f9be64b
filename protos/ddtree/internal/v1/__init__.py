"""Generated gRPC stubs (make protos); the .proto files beside them are the source."""
