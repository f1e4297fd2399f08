"""``python -m draft_service``: serve the draft model over gRPC (default port 50051)."""

from __future__ import annotations

import logging
import time

from draft_service.settings import DraftSettings
from specdec.runtime import configure_torch, start_metrics
from specdec.server import configure_logging, serve_forever

logger = logging.getLogger("draft_service")


def main() -> None:
    settings = DraftSettings(_cli_parse_args=True)
    configure_logging(settings.log_level)
    configure_torch(settings.threads)
    from draft_service.backends import create_proposer
    from draft_service.servicer import build_server

    t0 = time.perf_counter()
    proposer = create_proposer(settings)
    server, port, health = build_server(proposer, settings.address, settings.workers)
    start_metrics(settings.metrics_port)
    info = proposer.info()
    logger.info(
        "draft %s (%s backend, %s, vocab %d, context %d) ready on port %d in %.1f s",
        info.model_id, info.backend, info.dtype, info.vocab_size, info.max_context, port, time.perf_counter() - t0,
    )
    serve_forever(server, health)


if __name__ == "__main__":
    main()
