"""Server-sent event responses that a client which stops reading cannot hold.

A client that opens a stream and never reads it would otherwise be served as if it read: every
event is computed and buffered (in the kernel's socket buffers, then in the server's), the slot and
both model sessions stay taken, and once the buffers fill nothing ever frees them. Two bounds end
that: the send buffer of every client connection is fixed (:class:`BoundedServer`), so at most a
few hundred KiB wait for a silent client, and an event that cannot be handed to the connection
within ``send_timeout`` seconds cancels the stream (:class:`BoundedEventSource`): the generator is
closed, which stops the loop, releases both sessions and frees the slot.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from prometheus_client import Counter
from sse_starlette.sse import AppStatus, EventSourceResponse, SendTimeoutError

logger = logging.getLogger(__name__)

DRAIN_MARGIN_S = 3.0  # after the drain's time: every stream has sent its terminal event by then


def _cut_streams() -> None:
    AppStatus.should_exit = True


STALLED = Counter("specdec_streams_stalled_total", "Event streams cancelled because the client took no event in time.")


class BoundedEventSource(EventSourceResponse):
    """An ``EventSourceResponse`` with a send timeout whose expiry ends the stream quietly (a
    warning and :data:`STALLED`, not an application error): the client is gone or not reading."""

    def __init__(self, content: Any, send_timeout: float, ping: float = 15) -> None:
        super().__init__(content, ping=ping, send_timeout=send_timeout)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            STALLED.inc()
            client = scope.get("client") or ("?", 0)
            logger.warning("stream to %s:%s cancelled: the client took no event for %.0f s", *client[:2], self.send_timeout)


class BoundedServer(uvicorn.Server):
    """uvicorn's server whose client connections each get a send buffer of ``send_buffer_bytes``
    (0: the kernel's own): Linux copies it from the listening socket to every accepted one, and a
    fixed size also turns the kernel's growth of it off, so a client that stops reading blocks the
    next send after a few hundred KiB instead of several MiB.

    **Graceful drain.** The first SIGTERM (or SIGINT) calls ``on_drain`` (the application stops
    admitting and gives the generations in progress ``drain_s`` to finish, then ends each with a
    terminal 503 of its own), and uvicorn stops listening and waits for the open requests.
    sse-starlette's own reaction to the signal, cutting every stream at once with no terminal
    event, is turned off; it is set off only after ``drain_s`` plus a margin, as a backstop. A
    second signal exits at once, as uvicorn does."""

    def __init__(self, config: uvicorn.Config, send_buffer_bytes: int,
                 on_drain: Callable[[], None] | None = None, drain_s: float = 0.0) -> None:
        super().__init__(config)
        self.send_buffer_bytes = send_buffer_bytes
        self.on_drain = on_drain
        self.drain_s = drain_s
        if on_drain is not None:
            AppStatus.disable_automatic_graceful_drain()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self.on_drain is not None:
            self.on_drain()
            try:
                loop = asyncio.get_running_loop()
                # from a signal handler: through the loop's wake-up pipe, so a loop asleep in select() sees it
                loop.call_soon_threadsafe(loop.call_later, self.drain_s + DRAIN_MARGIN_S, _cut_streams)
            except RuntimeError:  # no loop running (a signal outside serve): nothing to schedule
                pass
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.send_buffer_bytes:
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
