"""orchestrator.streams: a stream whose client takes no event ends within the send timeout, and
client connections get the configured send buffer."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import subprocess
import threading
import time

import pytest
import uvicorn
from prometheus_client import REGISTRY

from orchestrator.streams import BoundedEventSource, BoundedServer
from tests.support import free_port


def _stalled() -> float:
    return REGISTRY.get_sample_value("specdec_streams_stalled_total") or 0.0


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

    before = _stalled()
    response = BoundedEventSource(events(), send_timeout=0.2)
    t0 = time.monotonic()
    # returns (no exception for the server to log as an application error) soon after the timeout
    await asyncio.wait_for(response({"type": "http", "method": "POST", "client": ("127.0.0.1", 1)}, receive, send), 5)
    assert time.monotonic() - t0 < 2
    assert closed.is_set() and _stalled() == before + 1
    assert len(sent) == 4


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss to read a socket's send buffer")
def test_client_connections_get_the_configured_send_buffer():
    async def app(scope, receive, send):  # an ASGI app that never answers: only the socket matters
        await asyncio.Event().wait()

    port = free_port()
    server = BoundedServer(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"), 48 * 1024)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", port)):
            time.sleep(0.2)
            out = subprocess.run(["ss", "-tmnH", "state", "established", f"( sport = :{port} )"],
                                 capture_output=True, text=True, check=True).stdout
        # the kernel doubles what setsockopt asks for; tb is the socket's send buffer
        assert re.findall(r"\btb(\d+)", out) == [str(2 * 48 * 1024)], out
    finally:
        server.should_exit = True
        thread.join(10)
