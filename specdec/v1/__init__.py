"""Generated protobuf and gRPC stubs of proto/specdec/v1 (regenerate with `make proto`)."""
