"""Process-level setup for the model services: torch threads, metrics endpoint."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def configure_torch(threads: int) -> None:
    """Set torch's intra-op threads (0 keeps torch's default: one per core)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    logger.info("torch %s, %d threads", torch.__version__, torch.get_num_threads())


def start_metrics(port: int | None) -> None:
    """Serve Prometheus /metrics on ``port`` (None disables)."""
    if port is None:
        return
    from prometheus_client import start_http_server

    start_http_server(port)
    logger.info("metrics on :%d/metrics", port)
