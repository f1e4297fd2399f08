"""A round-robin TCP load balancer for tests (127.0.0.1 only).

Each new client connection goes to the next backend in turn and stays there (layer 4, as a
Kubernetes Service or a cloud TCP load balancer routes: a keep-alive connection is never split).
A backend whose connect fails is skipped for that connection, which then goes to the next one;
when none accepts, the client's connection is closed.

The balancer runs its own event loop in a daemon thread; ``start``, ``stop`` and the counters are
safe to use from any thread.
"""

from __future__ import annotations

import asyncio
import threading

_CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 2.0


class RoundRobinBalancer:
    """``RoundRobinBalancer([port_a, port_b]).start()`` listens on 127.0.0.1:``port``."""

    def __init__(self, backend_ports: list[int], listen_port: int = 0) -> None:
        if not backend_ports:
            raise ValueError("no backend given")
        self.backends = list(backend_ports)
        self.port = listen_port
        self.served = {p: 0 for p in self.backends}  # connections forwarded to each backend
        self.refused = {p: 0 for p in self.backends}  # connects that failed (the backend was skipped)
        self.dropped = 0  # client connections closed because no backend accepted
        self._next = 0
        self._lock = threading.Lock()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="round-robin-lb", daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """Copies of (served, refused) per backend port."""
        with self._lock:
            return dict(self.served), dict(self.refused)

    def start(self) -> RoundRobinBalancer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> RoundRobinBalancer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- event loop side -------------------------------------------------------------------------

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def _order(self) -> list[int]:
        """Backends to try for a new connection: the next in turn first, then the others."""
        with self._lock:
            start = self._next
            self._next = (self._next + 1) % len(self.backends)
        return [self.backends[(start + i) % len(self.backends)] for i in range(len(self.backends))]

    async def _connect(self) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter] | None:
        for port in self._order():
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), CONNECT_TIMEOUT_S)
            except OSError:  # refused, unreachable; TimeoutError is an OSError too
                with self._lock:
                    self.refused[port] += 1
                continue
            with self._lock:
                self.served[port] += 1
            return port, reader, writer
        return None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await self._connect()
        if upstream is None:
            with self._lock:
                self.dropped += 1
            writer.transport.abort()
            return
        _, up_reader, up_writer = upstream
        pair = (writer, up_writer)
        self._writers.update(pair)

        def abort() -> None:  # one side broke: the other learns it as a closed connection
            for w in pair:
                w.transport.abort()

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(_CHUNK):
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()  # pass a half-close on
            except (ConnectionError, OSError):
                abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            for w in pair:
                w.close()
                self._writers.discard(w)
