"""The draft model service: proposes draft tokens with their confidences (gRPC, port 50051)."""
