"""``python -m orchestrator``: serve the HTTP API (default port 8000)."""

from __future__ import annotations

import uvicorn

from orchestrator.app import create_app
from orchestrator.settings import OrchestratorSettings
from orchestrator.streams import BoundedServer, bounded_protocol
from specdec.server import configure_logging


def main() -> None:
    settings = OrchestratorSettings(_cli_parse_args=True)
    configure_logging(settings.log_level)
    app = create_app(settings)

    def drain() -> None:
        rt = getattr(app.state, "rt", None)
        if rt is not None:  # None: a signal before start-up finished, nothing in progress
            rt.drain()

    # uvicorn waits this long for open requests after the signal: the drain plus a margin for the
    # terminal events (non-streaming requests get their 503 in the same time)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            timeout_graceful_shutdown=settings.drain_timeout_s + 5,
                            http=bounded_protocol(settings.header_timeout_s, settings.response_send_timeout_s))
    BoundedServer(config, settings.stream_send_buffer_kb * 1024, drain, settings.drain_timeout_s).run()


if __name__ == "__main__":
    main()
