"""Mutual TLS with a rotated client CA: a running model service verifies new handshakes against
the client CA file as it is now, and a CA file that does not load keeps the previous one. Real
servers on real ports, certificates made with openssl as in test_auth."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.auth import ChannelSecurity, channel, server_credentials
from specdec.server import create_server
from tests.service.test_auth import make_certs

OK, UNAVAILABLE = grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE
RELOAD_WITHIN_S = 5.0  # the files are looked at at most once a second


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Two unrelated CAs, ``a`` and ``b``, each with a server and a client certificate."""
    folder = tmp_path_factory.mktemp("pki")
    return {name: make_certs(folder / name) for name in ("a", "b")}


@pytest.fixture
def mtls_server(pki, tmp_path):
    """A started server (health only) with CA a's server certificate, demanding client certificates
    signed by the CA in the returned file (CA a at first); yields (port, client CA file)."""
    client_ca = tmp_path / "client-ca.pem"
    shutil.copy(pki["a"]["ca"], client_ca)
    server, port, _ = create_server(lambda server: None, [], "127.0.0.1:0",
                                    credentials=server_credentials(pki["a"]["server"], pki["a"]["server-key"], client_ca))
    server.start()
    yield port, client_ca
    server.stop(0)


def client(pki, signer: str) -> ChannelSecurity:
    """Trusts the server's CA (a) and presents the client certificate of CA ``signer``."""
    return ChannelSecurity.from_files(ca_file=pki["a"]["ca"], cert_file=pki[signer]["client"],
                                      key_file=pki[signer]["client-key"])


def check(port: int, security: ChannelSecurity) -> grpc.StatusCode:
    """The status of a health check over a new channel (so a new TLS handshake)."""
    try:
        with channel(f"127.0.0.1:{port}", security) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.RpcError as err:
        return err.code()
    return OK


def replace(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (as a rotated secret does), with a later mtime."""
    later = path.stat().st_mtime_ns + 1_000_000_000
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(later, later))
    os.replace(tmp, path)


def until(condition: Callable[[], bool], timeout_s: float = RELOAD_WITHIN_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_new_client_ca_is_in_force_without_a_restart(pki, mtls_server):
    port, client_ca = mtls_server
    signed_by_a, signed_by_b = client(pki, "a"), client(pki, "b")
    assert check(port, signed_by_a) == OK
    assert check(port, signed_by_b) == UNAVAILABLE
    with channel(f"127.0.0.1:{port}", signed_by_a) as open_before:
        stub = health_pb2_grpc.HealthStub(open_before)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
        replace(client_ca, pki["b"]["ca"].read_bytes())
        assert until(lambda: check(port, signed_by_b) == OK), "the new client CA was not taken up"
        assert check(port, signed_by_a) == UNAVAILABLE  # the handshake fails: a no longer signs clients
        stub.Check(health_pb2.HealthCheckRequest(), timeout=3)  # a connection already open keeps its session


@pytest.mark.parametrize("broken", ["empty", "not PEM", "truncated", "a key", "removed"])
def test_a_client_ca_that_does_not_load_keeps_the_previous_one(pki, mtls_server, caplog, broken):
    """A rotation half written (or a file gone for a moment) is logged and changes nothing; the
    next whole CA is taken up."""
    port, client_ca = mtls_server
    caplog.set_level(logging.INFO, logger="specdec.auth")
    pem = pki["b"]["ca"].read_bytes()
    if broken == "removed":
        client_ca.unlink()
    else:
        replace(client_ca, {"empty": b"", "not PEM": b"not a certificate\n", "truncated": pem[: len(pem) // 2],
                            "a key": pki["b"]["ca-key"].read_bytes()}[broken])

    def warned() -> bool:
        return any(r.levelno == logging.WARNING for r in caplog.records)

    # each handshake lets the server look at the files; stop at the warning or at a refusal
    until(lambda: check(port, client(pki, "a")) != OK or warned())
    assert check(port, client(pki, "a")) == OK, "the previous client CA is no longer in force"
    assert check(port, client(pki, "b")) == UNAVAILABLE
    assert warned(), "no warning about the client CA that does not load"
    assert not [r for r in caplog.records if "reloaded" in r.getMessage()]
    if broken == "removed":
        shutil.copy(pki["b"]["ca"], client_ca)
    else:
        replace(client_ca, pem)
    assert until(lambda: check(port, client(pki, "b")) == OK)
    assert check(port, client(pki, "a")) == UNAVAILABLE


def test_a_client_ca_that_does_not_load_at_start_is_refused(pki, tmp_path):
    empty = tmp_path / "client-ca.pem"
    empty.write_bytes(b"")
    with pytest.raises(ValueError):
        server_credentials(pki["a"]["server"], pki["a"]["server-key"], empty)
