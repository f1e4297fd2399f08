"""A fault-injecting TCP proxy for reliability tests and the round-trip benchmark (127.0.0.1 only).

It forwards bytes between a listen port and an upstream ``host:port`` and can switch, at run time
and for existing as well as new connections, between these modes:

- ``pass``: forward as is.
- ``delay``: hold every chunk ``delay_ms`` before forwarding it, in both directions. Chunks keep
  their order and are pipelined, so the added latency is constant rather than cumulative.
- ``drop`` (blackhole): accept connections but never forward a byte; data read is discarded.
  A connection that lost bytes has a broken byte stream, so it is reset when the mode changes
  again (as TCP would give up on it); new connections are then forwarded normally.
- ``reset``: reset every open connection (RST through ``SO_LINGER`` 0) and every new one at once.
- ``stall``: forward at most ``stall_after`` more bytes per direction of each connection (counted
  from the switch for open connections, from accept for new ones), then hold the rest: the peer
  sees a message cut in the middle and nothing more. Held bytes go out when the mode changes, as
  after a network stall that TCP rides out.

The proxy runs its own event loop in a daemon thread; every public method is thread-safe.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

Mode = Literal["pass", "delay", "drop", "reset", "stall"]
_CHUNK = 64 * 1024
_EOF = b""  # the sender closed its side (FIN): pass it on as a half-close
_RST = None  # the sender's connection was reset: reset the whole proxied connection


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s socket with an RST instead of a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


@dataclass
class _Direction:
    """One direction of a proxied connection: chunks read, queued and written in order."""

    name: str  # "up" (client -> upstream) or "down"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # (read time, bytes | _EOF | _RST)
    budget: float = float("inf")  # bytes still allowed through while stalled
    done: bool = False  # EOF passed on


@dataclass
class _Conn:
    ident: int
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    up: _Direction = field(default_factory=lambda: _Direction("up"))
    down: _Direction = field(default_factory=lambda: _Direction("down"))
    damaged: bool = False  # bytes were discarded: the stream cannot be resumed
    closed: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)

    def close(self, rst: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for w in (self.client, self.upstream):
            if w is None:
                continue
            if rst:
                _rst(w)
            else:
                w.close()
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()


class FaultProxy:
    """``FaultProxy(upstream_port).start()`` listens on 127.0.0.1:``port``; see the module doc."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", listen_port: int = 0,
                 name: str = "proxy") -> None:
        if upstream_host != "localhost" and not ipaddress.ip_address(upstream_host).is_private:
            raise ValueError("the fault proxy forwards to loopback or private addresses only (a local veth, say)")
        self.name = name
        self.upstream = (upstream_host, upstream_port)
        self.port = listen_port
        self.mode: Mode = "pass"
        self.delay_ms = 0.0
        self.stall_after = 0
        self.connections = 0  # accepted so far
        self.bytes = {"up": 0, "down": 0}  # forwarded so far
        self._ids = itertools.count()
        self._conns: dict[int, _Conn] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"faultproxy-{name}", daemon=True)
        self._server: asyncio.Server | None = None
        self._changed: asyncio.Event | None = None

    # ---- control (any thread) ------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def set_mode(self, mode: Mode, delay_ms: float = 0.0, stall_after: int = 0) -> None:
        if mode not in ("pass", "delay", "drop", "reset", "stall"):
            raise ValueError(f"unknown mode {mode!r}")
        self._call(self._set_mode(mode, delay_ms, stall_after))

    def heal(self) -> None:
        self.set_mode("pass")

    def delay(self, ms: float) -> None:
        self.set_mode("delay", delay_ms=ms)

    def drop(self) -> None:
        self.set_mode("drop")

    def reset(self) -> None:
        self.set_mode("reset")

    def stall(self, after_bytes: int) -> None:
        self.set_mode("stall", stall_after=after_bytes)

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # ---- event loop side -------------------------------------------------------------------------

    async def _start(self) -> None:
        self._changed = asyncio.Event()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns.values()):
            conn.close(rst=True)
        self._conns.clear()

    async def _set_mode(self, mode: Mode, delay_ms: float, stall_after: int) -> None:
        previous = self.mode
        self.mode, self.delay_ms, self.stall_after = mode, float(delay_ms), int(stall_after)
        logger.info("%s: %s -> %s (delay %.0f ms, stall after %d bytes)", self.name, previous, mode, delay_ms, stall_after)
        for conn in list(self._conns.values()):
            if mode == "reset" or (conn.damaged and mode != "drop"):
                self._forget(conn, rst=True)
            elif mode == "stall":
                conn.up.budget = conn.down.budget = self.stall_after
        # wake writers waiting on a stall or a delay, so they re-read the mode
        self._changed.set()
        self._changed = asyncio.Event()

    def _forget(self, conn: _Conn, rst: bool) -> None:
        conn.close(rst=rst)
        self._conns.pop(conn.ident, None)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = _Conn(next(self._ids), writer)
        if self.mode == "reset":
            _rst(writer)
            return
        self._conns[conn.ident] = conn
        if self.mode == "stall":
            conn.up.budget = conn.down.budget = self.stall_after
        if self.mode == "drop":
            # a blackhole never reaches the upstream; the connection lives until the mode changes
            conn.damaged = True
            conn.tasks.append(asyncio.current_task())
            try:
                while not conn.closed and await reader.read(_CHUNK):
                    pass
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                self._forget(conn, rst=False)
            return
        try:
            up_reader, conn.upstream = await asyncio.open_connection(*self.upstream)
        except OSError:
            # upstream down: the client sees the connection close, as with a dead server behind a proxy
            self._forget(conn, rst=True)
            return
        conn.tasks += [
            asyncio.create_task(self._read(conn, reader, conn.up)),
            asyncio.create_task(self._read(conn, up_reader, conn.down)),
            asyncio.create_task(self._write(conn, conn.up, conn.upstream)),
            asyncio.create_task(self._write(conn, conn.down, writer)),
        ]

    async def _read(self, conn: _Conn, reader: asyncio.StreamReader, d: _Direction) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if self.mode == "drop" and data:
                    conn.damaged = True
                    continue
                d.queue.put_nowait((time.monotonic(), data))
                if not data:
                    return
        except (ConnectionError, OSError):
            d.queue.put_nowait((time.monotonic(), _RST))
        except asyncio.CancelledError:
            pass

    async def _write(self, conn: _Conn, d: _Direction, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                read_at, data = await d.queue.get()
                if data is _RST:
                    self._forget(conn, rst=True)
                    return
                if data == _EOF:
                    if writer.can_write_eof():
                        writer.write_eof()
                    d.done = True
                    if conn.up.done and conn.down.done:
                        self._forget(conn, rst=False)
                    return
                while data:
                    changed = self._changed
                    if self.mode == "drop":
                        conn.damaged = True
                        break
                    if self.mode == "delay":
                        wait = read_at + self.delay_ms / 1e3 - time.monotonic()
                        if wait > 0:
                            await asyncio.sleep(wait)
                            continue  # the mode may have changed meanwhile
                    allowed = d.budget if self.mode == "stall" else len(data)
                    if allowed <= 0:
                        await changed.wait()
                        continue
                    chunk, data = data[: int(allowed)], data[int(allowed):]
                    if self.mode == "stall":
                        d.budget -= len(chunk)
                    self.bytes[d.name] += len(chunk)  # counted first: the peer may read it before write() returns
                    writer.write(chunk)
                    await writer.drain()
        except (ConnectionError, OSError):
            self._forget(conn, rst=True)
        except asyncio.CancelledError:
            pass
