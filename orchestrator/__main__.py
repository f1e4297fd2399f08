"""``python -m orchestrator``: serve the HTTP API (default port 8000)."""

from __future__ import annotations

import uvicorn

from orchestrator.app import create_app
from orchestrator.settings import OrchestratorSettings
from orchestrator.streams import listening_socket
from specdec.server import configure_logging


def main() -> None:
    settings = OrchestratorSettings(_cli_parse_args=True)
    configure_logging(settings.log_level)
    # the socket is bound here so that every client connection gets a bounded send buffer
    sock = listening_socket(settings.host, settings.port, settings.stream_send_buffer_kb * 1024)
    config = uvicorn.Config(create_app(settings), log_level=settings.log_level.lower(), timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
