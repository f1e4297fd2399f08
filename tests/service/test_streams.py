"""orchestrator.streams: a stream whose client takes no event ends within the send timeout, and
client connections get the configured send buffer."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import subprocess
import threading
import time

import pytest
import uvicorn
from prometheus_client import REGISTRY

from orchestrator.streams import BoundedEventSource, BoundedServer, bounded_protocol
from tests.support import free_port, wait_until


def _sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_a_stream_whose_client_takes_nothing_ends_quietly_and_closes_its_generator():
    closed = asyncio.Event()

    async def events():
        try:
            for i in range(10_000):
                yield {"data": str(i)}
        finally:
            closed.set()  # what releases the sessions and the slot in the orchestrator

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) > 3:  # the client's buffers are full: nothing more is taken
            await asyncio.Event().wait()

    async def receive() -> dict:
        await asyncio.Event().wait()  # no disconnect either: the client just stopped reading
        return {}

    before = _sample("specdec_streams_stalled_total")
    response = BoundedEventSource(events(), send_timeout=0.2)
    t0 = time.monotonic()
    # returns (no exception for the server to log as an application error) soon after the timeout
    await asyncio.wait_for(response({"type": "http", "method": "POST", "client": ("127.0.0.1", 1)}, receive, send), 5)
    assert time.monotonic() - t0 < 2
    assert closed.is_set() and _sample("specdec_streams_stalled_total") == before + 1
    assert len(sent) == 4


class _Serving:
    """An ASGI app on a real uvicorn server with :class:`BoundedProtocol`'s bounds."""

    def __init__(self, app, header_timeout: float = 60.0, send_timeout: float = 60.0,
                 send_buffer: int = 16 * 1024) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="off", log_level="warning",
                                http=bounded_protocol(header_timeout, send_timeout))
        self.server = BoundedServer(config, send_buffer)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Serving:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "uvicorn started")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def connections(self) -> int:
        return len(self.server.server_state.connections)

    def wait_connections(self, n: int, timeout: float) -> float:
        """Seconds until the server holds ``n`` client connections."""
        t0 = time.monotonic()
        wait_until(lambda: self.connections() == n, timeout, lambda: f"{self.connections()} connections, not {n}")
        return time.monotonic() - t0


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss to read a socket's send buffer")
def test_client_connections_get_the_configured_send_buffer():
    async def app(scope, receive, send):  # an ASGI app that never answers: only the socket matters
        await asyncio.Event().wait()

    with _Serving(app, send_buffer=48 * 1024) as serving:
        with socket.create_connection(("127.0.0.1", serving.port)):
            serving.wait_connections(1, 5)  # accepted: the server's socket exists, with its buffer set
            out = subprocess.run(["ss", "-tmnH", "state", "established", f"( sport = :{serving.port} )"],
                                 capture_output=True, text=True, check=True).stdout
        # the kernel doubles what setsockopt asks for; tb is the socket's send buffer
        assert re.findall(r"\btb(\d+)", out) == [str(2 * 48 * 1024)], out


BIG = 8 << 20  # a non-streaming answer far over every buffer on the way


async def _big_answer(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(BIG).encode())]})
    await send({"type": "http.response.body", "body": b"x" * BIG})


def _ask(port: int, rcvbuf: int = 4096) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    return sock


def test_a_non_streaming_answer_nobody_reads_is_dropped_after_the_send_timeout():
    """The whole body waits in the server's transport; closing it would wait for the client for
    ever. The connection is aborted once the client took no byte for the send timeout."""
    before = _sample("specdec_connections_stalled_total")
    with _Serving(_big_answer, send_timeout=1.0) as serving:
        socks = [_ask(serving.port) for _ in range(4)]
        try:
            serving.wait_connections(4, 5)
            dropped_after = serving.wait_connections(0, 10)
            assert dropped_after < 6
            assert _sample("specdec_connections_stalled_total") == before + 4
            for sock in socks:  # what the client gets: a reset, or the stream ends short of the body
                sock.settimeout(5)
                got = 0
                with contextlib.suppress(ConnectionResetError):  # a dropped connection ends either way
                    while chunk := sock.recv(1 << 16):
                        got += len(chunk)
                assert got < BIG
        finally:
            for sock in socks:
                sock.close()


def test_a_slow_reader_is_not_dropped():
    """A client that keeps taking bytes, however slowly, gets its whole answer."""
    before = _sample("specdec_connections_stalled_total")
    with _Serving(_big_answer, send_timeout=1.0) as serving:
        with _ask(serving.port, rcvbuf=1 << 20) as sock:
            sock.settimeout(10)
            got, head = 0, b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(1)
            while got < BIG:
                chunk = sock.recv(512 << 10)
                assert chunk, f"closed after {got} of {BIG} bytes"
                got += len(chunk)
                time.sleep(0.3)  # the behaviour under test: a slow reader (~1.7 MB/s), never idle for the timeout
            assert got == BIG
    assert _sample("specdec_connections_stalled_total") == before


def test_a_connection_trickling_its_request_head_is_closed_after_the_header_timeout():
    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    before = _sample("specdec_connections_headers_late_total")
    with _Serving(ok, header_timeout=1.0) as serving:
        with socket.create_connection(("127.0.0.1", serving.port)), \
                socket.create_connection(("127.0.0.1", serving.port)) as trickle:
            serving.wait_connections(2, 5)
            t0 = time.monotonic()
            trickle.settimeout(0.25)
            closed = False
            for byte in b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 40:
                try:
                    trickle.send(bytes([byte]))
                    if trickle.recv(1) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
            assert closed and time.monotonic() - t0 < 4
            serving.wait_connections(0, 5)  # the silent one too
        assert _sample("specdec_connections_headers_late_total") == before + 2
        # a client that sends its request in time is served, and its keep-alive connection then
        # falls under the same bound again (before uvicorn's own 5 s keep-alive timeout)
        with socket.create_connection(("127.0.0.1", serving.port)) as quick:
            quick.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            quick.settimeout(5)
            answer = b""
            while not answer.endswith(b"\r\n\r\nok"):  # the head and the body may come in two segments
                chunk = quick.recv(4096)
                assert chunk, f"closed after {answer!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 ")
            t0 = time.monotonic()
            with contextlib.suppress(ConnectionResetError):
                assert quick.recv(4096) == b""
            assert time.monotonic() - t0 < 3
        assert _sample("specdec_connections_headers_late_total") == before + 3
