"""The model side of a service, one room per part: requests (checks), sessions (the store), kv (the
KV manager), planner (which sessions run how many rows a step), executor (the forward path), compute
(the compute thread and its scheduler). No grpc here."""
