"""API keys on the HTTP API, the token and (mutual) TLS on gRPC, and the whole stack through them.

Certificates are made at test time with the openssl command line (a throw-away CA, a server
certificate for localhost/127.0.0.1 and a client certificate), never stored in the repository.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import Request
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pydantic import ValidationError

from orchestrator.app import create_app
from orchestrator.auth import OPEN_PATHS, api_key_id, key_id, load_api_keys
from orchestrator.openai_errors import OPENAI_PATHS
from orchestrator.settings import OrchestratorSettings
from specdec import healthcheck
from specdec.auth import ChannelSecurity, TokenAuth, channel, read_secret, server_credentials, server_security
from specdec.engine.sessions import SessionStore
from specdec.models import load_hf
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from target_service.servicer import build_server as build_target
from target_service.settings import TargetSettings
from target_service.verify import TargetEngine
from tests.support import ROOT, Proc, free_port, start_orchestrator

KEYS = ["sk-alpha-0123456789", "sk-beta-9876543210"]
TOKEN = "grpc-token-for-tests"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


# ---- certificates ------------------------------------------------------------------------------

def make_certs(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate (localhost, 127.0.0.1) and a client certificate, all signed by it,
    plus an unrelated CA; the same openssl steps as docs/security.md."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        run("req", "-x509", *ec, "-days", "1", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-subj", f"/CN=specdec {ca}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, extensions in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
                             ("client", "extendedKeyUsage=clientAuth\n")):
        (folder / f"{name}.ext").write_text(extensions)
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=specdec-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
            "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return {p.stem if p.suffix == ".pem" else f"{p.stem}-key": p for p in folder.iterdir() if p.suffix in (".pem", ".key")}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


# ---- secrets and settings ----------------------------------------------------------------------

def test_read_secret_inline_file_or_neither(tmp_path):
    file = tmp_path / "token"
    file.write_text("  from-file\n")
    assert read_secret("inline", None) == "inline"
    assert read_secret(None, file) == "from-file"
    assert read_secret("", None) is None and read_secret(None, None) is None  # `VAR=` leaves auth off
    with pytest.raises(ValueError, match="both"):
        read_secret("inline", file)


def test_api_keys_from_the_variable_and_the_file_merge(tmp_path, monkeypatch):
    file = tmp_path / "keys"
    file.write_text("# rotated 2024-05\nkey-from-file\n\n  second-from-file  \nsk-one\n")
    monkeypatch.setenv("SPECDEC_ORCHESTRATOR_API_KEYS", "sk-one, sk-two,")  # not JSON: a plain comma list
    monkeypatch.setenv("SPECDEC_ORCHESTRATOR_API_KEYS_FILE", str(file))
    settings = OrchestratorSettings()
    assert load_api_keys(settings) == ["sk-one", "sk-two", "key-from-file", "second-from-file"]
    assert "sk-one" not in repr(settings)  # a secret, never printed
    monkeypatch.setenv("SPECDEC_ORCHESTRATOR_API_KEYS", "")
    monkeypatch.delenv("SPECDEC_ORCHESTRATOR_API_KEYS_FILE")
    assert load_api_keys(OrchestratorSettings()) == []


def test_key_id_is_short_stable_and_not_the_key():
    assert key_id("sk-alpha-0123456789") == key_id("sk-alpha-0123456789") != key_id("sk-beta-9876543210")
    assert re.fullmatch(r"[0-9a-f]{8}", key_id("sk-alpha-0123456789"))


def test_every_process_binds_loopback_by_default():
    from ui.__main__ import command
    from ui.settings import UISettings

    assert TargetSettings.model_fields["host"].default == "127.0.0.1"
    assert OrchestratorSettings.model_fields["host"].default == "127.0.0.1"
    cmd = command(UISettings())
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    dockerfile = (ROOT / "Dockerfile").read_text()
    for process in ("DRAFT", "TARGET", "ORCHESTRATOR", "UI"):  # containers must listen on their own interface
        assert f"SPECDEC_{process}_HOST=0.0.0.0" in dockerfile


def test_metrics_listen_where_the_service_does():
    from specdec.process import start_metrics

    port = free_port()
    start_metrics(port, "127.0.0.1")
    listening = Path("/proc/net/tcp").read_text().splitlines()[1:]
    local = {line.split()[1] for line in listening if line.split()[3] == "0A"}  # LISTEN
    assert f"0100007F:{port:04X}" in local and f"00000000:{port:04X}" not in local
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200


@pytest.mark.parametrize("kwargs, message", [
    ({"tls_cert_file": "c.pem"}, "go together"),
    ({"tls_client_ca_file": "ca.pem"}, "needs tls_cert_file"),
    ({"auth_token": "t", "auth_token_file": "t.txt"}, "not both"),
])
def test_service_settings_refuse_half_configured_security(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        TargetSettings(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"grpc_tls_cert_file": "c.pem", "grpc_tls_key_file": "k.pem"}, "needs grpc_tls_ca_file"),
    ({"grpc_tls_key_file": "k.pem", "grpc_tls_ca_file": "ca.pem"}, "go together"),
    ({"grpc_token": "t", "grpc_token_file": "t.txt"}, "not both"),
])
def test_orchestrator_settings_refuse_half_configured_security(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        OrchestratorSettings(**kwargs)


# ---- HTTP: API keys ----------------------------------------------------------------------------

def _settings(**kwargs) -> OrchestratorSettings:
    # nothing listens at these addresses: routes answer "not ready", which is all these tests need
    return OrchestratorSettings(draft_address=f"127.0.0.1:{free_port()}", target_address=f"127.0.0.1:{free_port()}",
                                **kwargs)


def _every_request(app) -> list[tuple[str, str]]:
    """(method, path) of every route of ``app`` (included routers too), path parameters filled in."""
    seen = set()
    for route in iter_route_contexts(app.routes):
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                seen.add((method, re.sub(r"\{[^}]+\}", "x", route.path)))
    return sorted(seen | {("GET", "/docs"), ("GET", "/openapi.json")})


@pytest.fixture(scope="module")
def protected(tmp_path_factory):
    file = tmp_path_factory.mktemp("keys") / "keys"
    file.write_text(f"# mounted secret\n{KEYS[1]}\n")
    app = create_app(_settings(api_keys=KEYS[0], api_keys_file=file))
    with TestClient(app, raise_server_exceptions=False, base_url="http://localhost") as client:
        yield app, client


def test_every_route_but_health_and_ready_needs_a_key(protected):
    app, client = protected
    requests = _every_request(app)
    paths = {path for _, path in requests}
    assert {"/v1/generate", "/v1/generate/stream", "/v1/completions", "/v1/chat/completions", "/v1/models",
            "/metrics", "/v1/info", "/docs", "/openapi.json", "/health", "/ready"} <= paths
    for method, path in requests:
        if path in OPEN_PATHS:
            assert client.request(method, path).status_code != 401, path
            continue
        for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": f"Basic {KEYS[0]}"},
                        {"authorization": "Bearer"}):
            r = client.request(method, path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer"
            # OpenAI's routes answer in OpenAI's shape (the client raises AuthenticationError)
            body = r.json()
            assert "API key" in (body["error"]["message"] if path.startswith(OPENAI_PATHS) else body["detail"])
        for key in KEYS:  # from the variable and from the file
            r = client.request(method, path, headers={"authorization": f"Bearer {key}"}, json={})
            assert r.status_code != 401, (method, path, r.status_code, r.text)


def test_messages_say_what_is_wrong(protected):
    _, client = protected
    assert "missing API key" in client.get("/v1/info").json()["detail"]
    assert client.get("/v1/info", headers={"authorization": "Bearer nope"}).json() == {"detail": "invalid API key"}
    assert client.get("/v1/info", headers={"authorization": f"bearer {KEYS[0]}"}).status_code == 200  # scheme: any case


def test_health_and_ready_stay_open(protected):
    _, client = protected
    assert client.get("/health").status_code == 200
    r = client.get("/ready")
    assert r.status_code == 503 and "unreachable" in r.json()["reason"]  # open, and honest about the services
    # but the details (models, replica addresses) only for a caller with a valid key
    assert set(r.json()) == {"ready", "reason", "degraded"}
    assert set(client.get("/ready", headers={"authorization": "Bearer nope"}).json()) == {"ready", "reason", "degraded"}
    detailed = client.get("/ready", headers={"authorization": f"Bearer {KEYS[0]}"}).json()
    assert {"draft", "target", "replicas"} <= set(detailed)
    # the reason names the unreachable address for a caller with a key, never for anyone else
    address = app_settings(client).target_address
    assert address in detailed["reason"]
    assert address not in r.json()["reason"] and address.rsplit(":", 1)[0] not in r.json()["reason"]
    assert r.json()["reason"].startswith("target service at … unreachable")


def app_settings(client):
    return client.app.state.rt.settings


def test_openapi_declares_the_bearer_scheme(protected):
    _, client = protected
    schema = client.get("/openapi.json", headers={"authorization": f"Bearer {KEYS[0]}"}).json()
    (name, scheme), = schema["components"]["securitySchemes"].items()
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
    assert schema["security"] == [{name: []}]
    assert schema["paths"]["/health"]["get"]["security"] == []
    assert schema["paths"]["/ready"]["get"]["security"] == []
    assert "security" not in schema["paths"]["/v1/generate"]["post"]  # inherits the global requirement


def test_request_scope_carries_the_key_id_never_the_key():
    app = create_app(_settings(api_keys=",".join(KEYS)))

    @app.get("/test/whoami")
    async def whoami(request: Request) -> dict:
        return {"id": api_key_id(request)}

    with TestClient(app, base_url="http://localhost") as client:
        for key in KEYS:
            assert client.get("/test/whoami", headers={"authorization": f"Bearer {key}"}).json() == {"id": key_id(key)}
    open_app = create_app(_settings())
    open_app.get("/test/whoami")(whoami)
    with TestClient(open_app, base_url="http://localhost") as client:
        assert client.get("/test/whoami").json() == {"id": None}


def test_without_keys_everything_stays_open():
    app = create_app(_settings())
    with TestClient(app, raise_server_exceptions=False, base_url="http://localhost") as client:
        for method, path in _every_request(app):
            assert client.request(method, path, json={}).status_code != 401, path
        assert "securitySchemes" not in client.get("/openapi.json").json().get("components", {})


# ---- gRPC: token, TLS, mutual TLS --------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_models):
    return TargetEngine(load_hf(tiny_models["gpt2-target"]), SessionStore(4, 1 << 30, 0), max_draft_tokens=8)


@pytest.fixture
def serve(engine):
    """serve(**create_server kwargs) -> port of a started target service; stopped after the test."""
    servers = []

    def start(**kwargs) -> int:
        server, port, _ = build_target(engine, "127.0.0.1:0", **kwargs)
        server.start()
        servers.append(server)
        return port

    yield start
    for server in servers:
        server.stop(0)


def info(port: int, security: ChannelSecurity | None = None, metadata=None, address: str = "127.0.0.1") -> pb.InfoResponse:
    with channel(f"{address}:{port}", security) as ch:
        return pb_grpc.TargetServiceStub(ch).Info(pb.InfoRequest(), timeout=5, metadata=metadata)


def health(port: int, security: ChannelSecurity | None = None) -> int:
    with channel(f"127.0.0.1:{port}", security) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kwargs)
    return err.value


def test_token_is_required_except_for_health(serve):
    port = serve(interceptors=[TokenAuth(TOKEN)])
    missing = rpc_error(info, port)
    assert missing.code() == UNAUTHENTICATED and "authorization: Bearer" in missing.details()
    wrong = rpc_error(info, port, ChannelSecurity(token="not-the-token"))
    assert wrong.code() == UNAUTHENTICATED and wrong.details() == "invalid token"
    assert rpc_error(info, port, metadata=(("authorization", f"Basic {TOKEN}"),)).code() == UNAUTHENTICATED
    assert info(port, ChannelSecurity(token=TOKEN)).max_context > 0
    assert info(port, metadata=(("authorization", f"Bearer {TOKEN}"),)).max_context > 0
    # probes carry no token
    assert health(port) == health_pb2.HealthCheckResponse.SERVING
    assert healthcheck.main([f"127.0.0.1:{port}"]) == 0


def test_token_guards_streaming_rpcs_too(serve):
    port = serve(interceptors=[TokenAuth(TOKEN)])
    request = reflection_pb2.ServerReflectionRequest(list_services="")

    def list_services(security: ChannelSecurity | None) -> set[str]:
        with channel(f"127.0.0.1:{port}", security) as ch:
            replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([request]), timeout=5)
            return {s.name for r in replies for s in r.list_services_response.service}

    assert rpc_error(list_services, None).code() == UNAUTHENTICATED
    assert "specdec.v1.TargetService" in list_services(ChannelSecurity(token=TOKEN))


def test_health_checks_that_never_send_their_message_hold_no_workers(serve):
    """200 Health/Check calls (no token needed) that send headers and never their message: an
    authenticated Info still answers within 2 s, the server ends every one of them itself (most at
    once, the few it let wait after the read timeout), and a real Check answers afterwards."""
    port = serve(workers=136, interceptors=[TokenAuth(TOKEN)])
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    never = threading.Event()
    held = []
    try:
        silent = ch.stream_unary("/grpc.health.v1.Health/Check", request_serializer=lambda r: r,
                                 response_deserializer=health_pb2.HealthCheckResponse.FromString)

        def no_body():
            never.wait()
            yield b""

        t0 = time.monotonic()
        for _ in range(200):
            held.append(silent.future(no_body(), timeout=60))
        for _ in range(3):
            t = time.monotonic()
            assert info(port, ChannelSecurity(token=TOKEN)).max_context > 0
            assert time.monotonic() - t < 2
        codes = collections.Counter(f.exception(timeout=20).code() for f in held)
        ended_s = time.monotonic() - t0
        assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 190, codes
        assert sum(codes.values()) == 200 and ended_s < 15, (codes, ended_s)  # none left waiting for ever
        assert health(port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        never.set()
        for call in held:
            call.cancel()
        ch.close()


def test_unauthenticated_floods_leave_room_for_authenticated_calls(serve):
    """200 callers with no token who open a call and never send its body, and 200 Watch streams
    (which need no token), leave an authenticated Info answering within 2 s. The server has 136
    worker threads and room for 272 calls in flight, as the services' defaults."""
    port = serve(workers=136, interceptors=[TokenAuth(TOKEN)])
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    held = []
    try:
        # a unary method called with a request stream that never yields: headers, then nothing
        silent = ch.stream_unary("/specdec.v1.TargetService/Info", request_serializer=lambda r: r,
                                 response_deserializer=pb.InfoResponse.FromString)
        never = threading.Event()

        def no_body():
            never.wait()
            yield b""

        for _ in range(200):
            held.append(silent.future(no_body(), timeout=60))
        watch = health_pb2_grpc.HealthStub(ch).Watch
        for _ in range(200):
            held.append(watch(health_pb2.HealthCheckRequest(), timeout=60))
        t0 = time.monotonic()
        assert info(port, ChannelSecurity(token=TOKEN)).max_context > 0
        assert time.monotonic() - t0 < 2
        # the body-less calls were refused without waiting for a body
        assert all(f.exception(timeout=5).code() == UNAUTHENTICATED for f in held[:200])
        # some Watch streams stay open (each first sends the current status), the rest are refused
        codes = collections.Counter()
        for stream in held[200:]:
            try:
                codes[next(stream).status] += 1
            except grpc.RpcError as err:
                codes[err.code()] += 1
        assert codes[health_pb2.HealthCheckResponse.SERVING] >= 1 and codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 100
        assert health(port) == health_pb2.HealthCheckResponse.SERVING
        # closing the open Watch streams gives their places back
        for call in held:
            call.cancel()
        deadline = time.monotonic() + 5
        while True:
            try:
                assert next(watch(health_pb2.HealthCheckRequest(), timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, err
                time.sleep(0.1)
    finally:
        never.set()
        for call in held:
            call.cancel()
        ch.close()


def test_tls_refuses_plaintext_and_unknown_servers(serve, certs):
    port = serve(credentials=server_credentials(certs["server"], certs["server-key"]))
    assert rpc_error(info, port).code() == grpc.StatusCode.UNAVAILABLE
    assert rpc_error(info, port, ChannelSecurity(ca=certs["other-ca"].read_bytes())).code() == grpc.StatusCode.UNAVAILABLE
    tls = ChannelSecurity.from_files(ca_file=certs["ca"])
    assert info(port, tls).max_context > 0
    assert info(port, tls, address="localhost").max_context > 0
    # the container health check, by flag and by variable
    assert healthcheck.main([f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    assert healthcheck.main([f"127.0.0.1:{port}", "--tls-ca", str(certs["ca"])]) == 0


def test_a_renewed_certificate_is_served_without_a_restart(serve, certs, tmp_path, monkeypatch):
    """Certificate rotation (cert-manager, a new secret): the files change under a running server,
    and new connections get the new certificate; a half-written rotation keeps the previous one."""
    import time

    from specdec import auth

    renewed = make_certs(tmp_path / "renewed")  # another CA, another server certificate
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(certs["server"], cert)
    shutil.copy(certs["server-key"], key)
    made: list = []
    real = auth.ReloadingCertificates
    monkeypatch.setattr(auth, "ReloadingCertificates",
                        lambda *a, **kw: made.append(real(*a, **{**kw, "check_every_s": 0.0})) or made[-1])
    port = serve(credentials=server_credentials(cert, key))
    old_ca, new_ca = ChannelSecurity.from_files(ca_file=certs["ca"]), ChannelSecurity.from_files(ca_file=renewed["ca"])
    assert info(port, old_ca).max_context > 0
    assert rpc_error(info, port, new_ca).code() == grpc.StatusCode.UNAVAILABLE
    key.write_text("not a key")  # half written: the previous certificate stays
    assert info(port, old_ca).max_context > 0
    time.sleep(0.01)
    shutil.copy(renewed["server"], cert)
    shutil.copy(renewed["server-key"], key)
    assert info(port, new_ca).max_context > 0
    assert rpc_error(info, port, old_ca).code() == grpc.StatusCode.UNAVAILABLE
    assert made[0].reloads == 1


def test_mutual_tls_needs_a_client_certificate(serve, certs, monkeypatch):
    port = serve(credentials=server_credentials(certs["server"], certs["server-key"], certs["ca"]))
    assert rpc_error(info, port, ChannelSecurity.from_files(ca_file=certs["ca"])).code() == grpc.StatusCode.UNAVAILABLE
    mtls = ChannelSecurity.from_files(ca_file=certs["ca"], cert_file=certs["client"], key_file=certs["client-key"])
    assert info(port, mtls).max_context > 0
    assert healthcheck.main([f"127.0.0.1:{port}", "--tls-ca", str(certs["ca"]), "--timeout", "2"]) == 1
    monkeypatch.setenv("SPECDEC_HEALTHCHECK_TLS_CA_FILE", str(certs["ca"]))
    monkeypatch.setenv("SPECDEC_HEALTHCHECK_TLS_CERT_FILE", str(certs["client"]))
    monkeypatch.setenv("SPECDEC_HEALTHCHECK_TLS_KEY_FILE", str(certs["client-key"]))
    assert healthcheck.main([f"127.0.0.1:{port}"]) == 0


def test_each_service_may_have_its_own_certificate_name(serve, certs):
    """One shared name for both services' certificates, or each its own (draft and target behind
    different names): a service's own name wins, and TLS checks it."""
    from orchestrator.auth import grpc_security

    settings = OrchestratorSettings(grpc_tls_ca_file=certs["ca"], grpc_tls_server_name="shared.example",
                                    target_tls_server_name="localhost")
    assert grpc_security(settings, "draft").server_name == "shared.example"
    assert grpc_security(settings, "target").server_name == "localhost"
    assert grpc_security(settings).server_name == "shared.example"
    port = serve(credentials=server_credentials(certs["server"], certs["server-key"]))
    assert info(port, grpc_security(settings, "target")).max_context > 0  # the certificate names localhost
    assert rpc_error(info, port, grpc_security(settings, "draft")).code() == grpc.StatusCode.UNAVAILABLE


def test_server_security_from_settings(serve, certs, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    settings = TargetSettings(auth_token_file=token_file, tls_cert_file=certs["server"], tls_key_file=certs["server-key"],
                              tls_client_ca_file=certs["ca"])
    port = serve(**server_security(settings))
    mtls = dict(ca_file=certs["ca"], cert_file=certs["client"], key_file=certs["client-key"])
    assert rpc_error(info, port, ChannelSecurity.from_files(**mtls)).code() == UNAUTHENTICATED
    assert info(port, ChannelSecurity.from_files(token=TOKEN, **mtls)).max_context > 0
    assert server_security(TargetSettings()) == {"interceptors": [], "credentials": None}  # defaults: as before


# ---- the whole stack through API keys, tokens and mutual TLS -----------------------------------

def _start_secure_service(kind: str, env: dict[str, str], log_dir: Path, security: ChannelSecurity) -> tuple[Proc, int]:
    """Like tests.support.start_model_service, but waits over TLS (its health check is plaintext)."""
    port = free_port()
    prefix = f"SPECDEC_{kind.upper()}_"
    proc = Proc(kind, f"{kind}_service", {prefix + "PORT": str(port), prefix + "HOST": "127.0.0.1",
                                          prefix + "METRICS_PORT": str(free_port()), **env}, log_dir)
    deadline = time.monotonic() + 180
    while healthcheck.check_grpc(f"127.0.0.1:{port}", timeout_s=1, security=security) is not None:
        if not proc.alive() or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"{kind} did not come up over TLS:\n{proc.tail()}")
        time.sleep(0.3)
    return proc, port


@pytest.fixture(scope="module")
def secure_stack(tmp_path_factory, tiny_models, certs):
    root = tmp_path_factory.mktemp("secure-stack")
    (root / "grpc-token").write_text(TOKEN + "\n")
    (root / "api-keys").write_text(f"# one key per line\n{KEYS[1]}\n")
    tls = {"TLS_CERT_FILE": str(certs["server"]), "TLS_KEY_FILE": str(certs["server-key"]),
           "TLS_CLIENT_CA_FILE": str(certs["ca"])}
    probe = ChannelSecurity.from_files(ca_file=certs["ca"], cert_file=certs["client"], key_file=certs["client-key"])
    procs: list[Proc] = []
    try:
        target, target_port = _start_secure_service("target", {
            "SPECDEC_TARGET_MODEL": tiny_models["gpt2-target"], "SPECDEC_TARGET_AUTH_TOKEN": TOKEN,
            **{f"SPECDEC_TARGET_{k}": v for k, v in tls.items()}}, root, probe)
        procs.append(target)
        draft, draft_port = _start_secure_service("draft", {
            "SPECDEC_DRAFT_MODEL": tiny_models["gpt2-draft"], "SPECDEC_DRAFT_BACKEND": "transformers",
            "SPECDEC_DRAFT_AUTH_TOKEN_FILE": str(root / "grpc-token"),
            **{f"SPECDEC_DRAFT_{k}": v for k, v in tls.items()}}, root, probe)
        procs.append(draft)
        orch, url = start_orchestrator(draft_port, target_port, root, env={
            "SPECDEC_ORCHESTRATOR_API_KEYS": KEYS[0], "SPECDEC_ORCHESTRATOR_API_KEYS_FILE": str(root / "api-keys"),
            "SPECDEC_ORCHESTRATOR_GRPC_TOKEN_FILE": str(root / "grpc-token"),
            "SPECDEC_ORCHESTRATOR_GRPC_TLS_CA_FILE": str(certs["ca"]),
            "SPECDEC_ORCHESTRATOR_GRPC_TLS_CERT_FILE": str(certs["client"]),
            "SPECDEC_ORCHESTRATOR_GRPC_TLS_KEY_FILE": str(certs["client-key"]),
        })
        procs.append(orch)
        yield {"url": url, "draft_port": draft_port, "target_port": target_port, "probe": probe}
    finally:
        for p in reversed(procs):
            p.stop()


def test_stack_generates_through_token_and_mutual_tls(secure_stack):
    url = secure_stack["url"]
    body = {"prompt": "the cat sat", "max_tokens": 12, "ignore_eos": True, "controller": "fixed", "k": 3}
    assert httpx.post(url + "/v1/generate", json=body, timeout=60).status_code == 401
    r = httpx.post(url + "/v1/generate", json=body, timeout=60, headers={"authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["token_ids"]) == 12
    assert out["stats"]["draft_tokens"] > 0  # the draft answered too, over its own TLS channel
    # the services themselves refuse a caller with the client certificate but no token
    assert rpc_error(info, secure_stack["target_port"], secure_stack["probe"]).code() == UNAUTHENTICATED


def test_openai_client_with_api_key(secure_stack):
    import openai

    client = openai.OpenAI(base_url=secure_stack["url"] + "/v1", api_key=KEYS[1], max_retries=0)  # the key from the file
    model = client.models.list().data[0].id
    c = client.completions.create(model=model, prompt="a b c", max_tokens=8, temperature=0)
    assert c.usage.completion_tokens >= 1 and c.model_extra["specdec"]["tokens"] == c.usage.completion_tokens
    streamed = list(client.completions.create(model=model, prompt="a b c", max_tokens=8, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == c.choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secure_stack["url"] + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_channel_security_never_prints_its_secrets():
    from specdec.auth import ChannelSecurity

    security = ChannelSecurity(token="s3cret-token", ca=b"CA PEM", cert=b"CERT PEM", key=b"PRIVATE KEY PEM")
    shown = repr(security) + str(security) + f"{security}"
    assert "s3cret-token" not in shown and "PRIVATE KEY" not in shown
    assert "CA PEM" in shown  # what is not secret stays visible for debugging
