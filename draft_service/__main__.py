"""``python -m draft_service``: serve the draft model over gRPC (default port 50051)."""

from __future__ import annotations

import logging
import time

from draft_service.settings import DraftSettings
from specdec.engine.compute import ComputeThread
from specdec.errors import SpecdecError
from specdec.process import bound_openmp_spin, configure_torch, start_metrics
from specdec.server import configure_logging, serve_forever

logger = logging.getLogger("draft_service")


def main() -> None:
    bound_openmp_spin()  # first: choosing the backend may import torch
    settings = DraftSettings(_cli_parse_args=True)
    configure_logging(settings.log_level)
    from draft_service.backends import create_proposer, resolve_backend

    try:  # auto: native or llamacpp, decided before torch's threads are set
        backend = resolve_backend(settings)  # may convert the model first (once, cached)
    except SpecdecError as exc:  # a missing model, a conversion that cannot be done: say so, no traceback
        logger.error("cannot start the draft service: %s", exc)
        raise SystemExit(2) from None
    # With llama.cpp (or n-gram), torch only samples between decodes: one thread, no OpenMP
    # workers of its own; llama.cpp's threads follow SPECDEC_DRAFT_THREADS (its backend).
    configure_torch(settings.threads if backend in ("transformers", "native") else 1)
    from draft_service.servicer import build_server
    from specdec.auth import server_security

    security = server_security(settings)  # before the slow model load: a bad secret path fails at once
    t0 = time.perf_counter()
    # this (main) thread loads the model and runs every forward pass
    compute = ComputeThread.from_settings(settings, service="draft")
    try:
        proposer = create_proposer(settings, backend)
    except SpecdecError as exc:  # a missing model, a conversion that cannot be done: say so, no traceback
        logger.error("cannot start the draft service: %s", exc)
        raise SystemExit(2) from None
    server, port, health = build_server(proposer, settings.address, settings.workers, compute, **security)
    start_metrics(settings.metrics_port, settings.host)
    info = proposer.info()
    logger.info(
        "draft %s (%s backend, %s, vocab %d, context %d) ready on port %d in %.1f s",
        info.model_id, info.backend, info.dtype, info.vocab_size, info.max_context, port, time.perf_counter() - t0,
    )
    serve_forever(server, health, compute, hang_s=settings.hang_timeout_s)


if __name__ == "__main__":
    main()
