"""The fault proxy itself, against a local echo server: each mode does what it says.

Fast (about two seconds), so it runs with the default suite too; it carries no `reliability` mark.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from evaluation.faultproxy import FaultProxy


@pytest.fixture
def echo_port():
    """A threaded TCP echo server on 127.0.0.1."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    server.close()


@pytest.fixture
def proxy(echo_port):
    with FaultProxy(echo_port, name="test") as p:
        yield p


def connect(proxy: FaultProxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    s.settimeout(1.0)
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def test_pass_forwards_both_ways(proxy):
    with connect(proxy) as s:
        s.sendall(b"hello")
        assert recv_exactly(s, 5) == b"hello"
    assert proxy.connections == 1 and proxy.bytes == {"up": 5, "down": 5}


def test_delay_adds_latency_each_way(proxy):
    proxy.delay(100)
    with connect(proxy) as s:
        t0 = time.monotonic()
        s.sendall(b"ping")
        assert recv_exactly(s, 4) == b"ping"
        assert time.monotonic() - t0 >= 0.2  # 100 ms up, 100 ms down
        proxy.heal()
        t0 = time.monotonic()
        s.sendall(b"pong")
        assert recv_exactly(s, 4) == b"pong" and time.monotonic() - t0 < 0.1


def test_drop_blackholes_then_resets_the_damaged_connection(proxy):
    proxy.drop()
    with connect(proxy) as s:
        s.sendall(b"lost")
        with pytest.raises(TimeoutError):
            s.recv(10)
        proxy.heal()  # the stream lost bytes: the proxy resets it
        with pytest.raises(ConnectionResetError):
            s.recv(10)
    with connect(proxy) as s:  # new connections are forwarded again
        s.sendall(b"back")
        assert recv_exactly(s, 4) == b"back"


def test_reset_sends_rst_to_open_and_new_connections(proxy):
    with connect(proxy) as s:
        s.sendall(b"x")
        assert recv_exactly(s, 1) == b"x"
        proxy.reset()
        with pytest.raises(ConnectionResetError):
            s.sendall(b"y")
            s.recv(1)
    # a new connection is reset at once, possibly before connect() itself returns
    with pytest.raises(ConnectionResetError), connect(proxy) as s:
        s.sendall(b"z")
        s.recv(1)
    proxy.heal()
    with connect(proxy) as s:
        s.sendall(b"ok")
        assert recv_exactly(s, 2) == b"ok"


def test_stall_cuts_mid_message_and_resumes(proxy):
    proxy.stall(after_bytes=3)
    with connect(proxy) as s:
        s.sendall(b"abcdefgh")
        assert recv_exactly(s, 3) == b"abc"
        with pytest.raises(TimeoutError):
            s.recv(10)  # the rest is held, the connection stays open
        proxy.heal()
        assert recv_exactly(s, 5) == b"defgh"


def test_upstream_down_closes_the_client(echo_port):
    from tests.support import free_port

    with FaultProxy(free_port(), name="nowhere") as p:
        try:
            with connect(p) as s:
                assert s.recv(1) == b""
        except ConnectionResetError:
            pass  # closed either way (even during connect()); what matters is that it does not hang


def test_local_networks_only():
    """Loopback and private addresses (a veth into a namespace of our own); nothing public."""
    for public in ("8.8.8.8", "2001:4860:4860::8888"):
        with pytest.raises(ValueError, match="private"):
            FaultProxy(80, upstream_host=public)
    assert FaultProxy(80, upstream_host="10.231.0.2").upstream == ("10.231.0.2", 80)
