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
from uvicorn.protocols.http.h11_impl import H11Protocol

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


CONNECTIONS_STALLED = Counter(
    "specdec_connections_stalled_total",
    "Client connections closed because the client took no byte of a response for response_send_timeout_s.")
HEADERS_LATE = Counter("specdec_connections_headers_late_total",
                       "Client connections closed because no whole request head arrived within header_timeout_s.")


class BoundedProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with two time bounds that uvicorn lacks.

    - **Head.** A connection must send a whole request head within ``header_timeout`` of opening
      (or of its last response); else it is closed. uvicorn's keep-alive timer is reset by any byte,
      so a client sending one byte every few seconds would hold its connection for ever.
    - **Send.** A response the client takes no byte of for ``send_timeout`` is dropped: the
      connection is aborted, which frees what waits in its buffer. asyncio hands a non-streaming
      body to the transport whole, and closing a transport waits for its buffer to drain, so an
      answer nobody reads would otherwise be held, with its connection, as long as the peer lives.
    """

    header_timeout: float = 10.0
    send_timeout: float = 30.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_cycle: Any = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._written = self._send_mark = 0
        write = transport.write

        def counted(data: bytes) -> None:  # bytes handed over; less the buffer: bytes the client took
            self._written += len(data)
            write(data)

        transport.write = counted
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.cycle is not self._head_cycle:  # a request's head arrived
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            if self.cycle is not None and self.cycle.response_complete:
                self._arm_head()
            if self.transport.get_write_buffer_size():
                self._arm_send()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_send()

    def _arm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.cycle is self._head_cycle and not self.transport.is_closing():
            HEADERS_LATE.inc()
            logger.warning("connection from %s closed: no whole request head within %.0f s",
                           _peer(self.client), self.header_timeout)
            self.transport.abort()

    def _arm_send(self) -> None:
        if self._send_timer is None:
            self._send_mark = self._sent()
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_check)

    def _sent(self) -> int:
        return self._written - self.transport.get_write_buffer_size()

    def _send_check(self) -> None:
        """Abort when bytes wait here and the client took none since the timer was armed; re-arm
        while it takes some (a slow reader)."""
        self._send_timer = None
        buffered = self.transport.get_write_buffer_size()
        if not buffered:
            return
        if self._sent() > self._send_mark:
            self._arm_send()
            return
        CONNECTIONS_STALLED.inc()
        logger.warning("connection from %s closed: the client took no byte of its response for %.0f s (%d bytes "
                       "dropped)", _peer(self.client), self.send_timeout, buffered)
        self.transport.abort()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def bounded_protocol(header_timeout: float, send_timeout: float) -> type[BoundedProtocol]:
    """A :class:`BoundedProtocol` with these bounds, for ``uvicorn.Config(http=...)``."""
    return type("BoundedProtocol", (BoundedProtocol,), {"header_timeout": header_timeout, "send_timeout": send_timeout})


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
