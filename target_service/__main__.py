"""``python -m target_service``: serve the target model over gRPC (default port 50052)."""

from __future__ import annotations

import logging
import time

from specdec.engine.compute import ComputeThread
from specdec.process import configure_torch, start_metrics
from specdec.server import configure_logging, serve_forever
from target_service.settings import TargetSettings

logger = logging.getLogger("target_service")


def main() -> None:
    settings = TargetSettings(_cli_parse_args=True)
    configure_logging(settings.log_level)
    configure_torch(settings.threads)
    from specdec.auth import server_security
    from target_service.servicer import build_server
    from target_service.verify import TargetEngine

    security = server_security(settings)  # before the slow model load: a bad secret path fails at once
    t0 = time.perf_counter()
    # this (main) thread loads the model and runs every forward pass
    compute = ComputeThread.from_settings(settings, service="target")
    engine = TargetEngine.from_settings(settings)
    server, port, health = build_server(engine, settings.address, settings.workers, compute, **security)
    start_metrics(settings.metrics_port, settings.host)
    info = engine.info()
    logger.info(
        "target %s (%s, %s, vocab %d, context %d) ready on port %d in %.1f s",
        info.model_id, info.architecture, info.dtype, info.vocab_size, info.max_context, port, time.perf_counter() - t0,
    )
    serve_forever(server, health, compute, hang_s=settings.hang_timeout_s)


if __name__ == "__main__":
    main()
