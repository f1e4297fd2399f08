"""``python -m orchestrator``: serve the HTTP API (default port 8000)."""

from __future__ import annotations

import uvicorn

from orchestrator.app import create_app
from orchestrator.settings import OrchestratorSettings
from orchestrator.streams import BoundedServer
from specdec.server import configure_logging


def main() -> None:
    settings = OrchestratorSettings(_cli_parse_args=True)
    configure_logging(settings.log_level)
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), timeout_graceful_shutdown=5)
    BoundedServer(config, settings.stream_send_buffer_kb * 1024).run()


if __name__ == "__main__":
    main()
