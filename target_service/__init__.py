"""The target model service: verifies draft tokens in one forward pass (gRPC, port 50052)."""
