"""The orchestrator: the adaptive speculative loop behind REST, SSE and an OpenAI-compatible API."""
