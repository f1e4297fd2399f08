"""Process-level setup for the model services: torch threads, metrics endpoint."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


def configure_torch(threads: int) -> None:
    """Set torch's intra-op threads (0 keeps torch's default: one per core).

    Also makes torch's OpenMP threads sleep instead of spin between parallel regions
    (``OMP_WAIT_POLICY=PASSIVE`` unless the environment says otherwise). The draft (llama.cpp) and
    target (torch) processes alternate on the same cores; a spinning OpenMP team left behind by a
    Verify steals the cores from llama.cpp's barrier-synchronised threads, which measured Propose
    at 1-3 s instead of ~0.1 s for 4-6 tokens. libgomp reads the variable when torch is first
    imported, so this must run before anything imports torch.
    """
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    elif "OMP_WAIT_POLICY" not in os.environ:
        logger.warning("torch was imported before configure_torch; its OpenMP threads keep spinning")
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    logger.info("torch %s, %d threads, OMP_WAIT_POLICY=%s", torch.__version__, torch.get_num_threads(),
                os.environ.get("OMP_WAIT_POLICY", "unset"))


def start_metrics(port: int | None) -> None:
    """Serve Prometheus /metrics on ``port`` (None disables)."""
    if port is None:
        return
    from prometheus_client import start_http_server

    start_http_server(port)
    logger.info("metrics on :%d/metrics", port)
