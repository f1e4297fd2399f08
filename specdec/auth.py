"""Authentication and TLS between the orchestrator and the model services.

Server side: :class:`TokenAuth`, a ``grpc.ServerInterceptor`` that asks every RPC but the standard
health service for ``authorization: Bearer <token>``, and :func:`server_credentials` (TLS, or
mutual TLS when a client CA is given). :func:`server_security` turns a service's settings into the
``interceptors`` and ``credentials`` of ``specdec.server.create_server``.

Client side: :class:`ChannelSecurity` (token and TLS files) and :func:`aio_channel` /
:func:`channel`, which open a plaintext or TLS channel that sends the token with every call.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from pydantic import SecretStr

if TYPE_CHECKING:
    from specdec.settings import ModelServiceSettings

logger = logging.getLogger(__name__)

# Container and Kubernetes probes speak grpc.health.v1 and cannot send a token; health says
# nothing a port scan would not.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def read_secret(value: SecretStr | str | None, file: Path | None) -> str | None:
    """The secret given inline or in ``file`` (surrounding whitespace stripped); None when neither
    is set. An empty value counts as unset, so ``VAR=`` in a compose file leaves auth off."""
    inline = value.get_secret_value() if isinstance(value, SecretStr) else value
    inline = (inline or "").strip()
    from_file = Path(file).read_text(encoding="utf-8").strip() if file else ""
    if inline and from_file:
        raise ValueError(f"the secret is set both inline and in {file}; set one of them")
    return inline or from_file or None


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The credential of an ``authorization: Bearer <credential>`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, credential = str(value).partition(" ")
            if scheme.lower() == "bearer":
                return credential.strip()
    return None


class TokenAuth(grpc.ServerInterceptor):
    """Require ``authorization: Bearer <token>`` on every RPC outside ``exempt`` (method prefixes);
    otherwise the call ends with UNAUTHENTICATED before the servicer runs."""

    def __init__(self, token: str, exempt: Sequence[str] = EXEMPT_PREFIXES) -> None:
        if not token:
            raise ValueError("TokenAuth needs a non-empty token")
        self._token = token.encode()
        self._exempt = tuple(exempt)

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        given = _bearer(handler_call_details.invocation_metadata)
        if given is None:
            return _denied(handler, "missing token: send metadata 'authorization: Bearer <token>'")
        if not hmac.compare_digest(given.encode(), self._token):
            return _denied(handler, "invalid token")
        return handler


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler that aborts with UNAUTHENTICATED without reading the request.

    It always takes the request as a stream, whatever the method's shape (the wire format is the
    same): grpc's sync server reads a unary request's message in a worker thread before any handler
    runs, so a caller with no token who sends headers and never a body would hold that thread for
    as long as it likes. A streaming handler runs at once with the unread stream and aborts."""

    def abort(request_iterator: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return make(abort, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ReloadingCertificates:
    """The server's certificate, key and client CA, read again when their files change: gRPC asks
    before each new TLS handshake (at most once every ``check_every_s`` are the files looked at), so
    a renewed certificate or client CA (cert-manager, a rotated secret) is in force without a
    restart. A set of files that cannot be read or does not parse (a rotation half written, an
    empty CA file) keeps the previous one."""

    def __init__(self, cert_file: Path, key_file: Path, client_ca_file: Path | None = None,
                 check_every_s: float = 1.0) -> None:
        self.files = [Path(cert_file), Path(key_file), *([Path(client_ca_file)] if client_ca_file else [])]
        self.check_every_s = check_every_s
        self._checked = time.monotonic()
        self._stamp = self._stamps()
        self.initial = self._config()
        self.reloads = 0

    def _stamps(self) -> tuple:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in (f.stat() for f in self.files))

    def _config(self) -> Any:
        import ssl

        # gRPC takes any bytes here and fails only at the next handshake: check that the key
        # parses and belongs to the certificate first (OpenSSL, through Python's ssl)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.files[0], self.files[1])
        cert, key = (f.read_bytes() for f in self.files[:2])
        ca = self.files[2].read_bytes() if len(self.files) > 2 else None
        if ca is not None:
            # an empty or truncated CA would refuse every client; non-ASCII bytes can only be in
            # comments between the PEM blocks, which ssl will not take in a str
            context.load_verify_locations(cadata=ca.decode("ascii", "ignore"))
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def __call__(self) -> Any:
        """The fetcher gRPC calls: a new configuration when the files changed, else None (keep)."""
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return None
        self._checked = now
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            config = self._config()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            logger.warning("TLS files changed but do not load (%s); keeping the previous certificate and client CA", exc)
            return None
        changed = [str(f) for f, old, new in zip(self.files, self._stamp, stamp, strict=True) if old != new]
        self._stamp = stamp
        self.reloads += 1
        logger.info("TLS files reloaded: %s", ", ".join(changed))
        return config


def server_credentials(cert_file: Path | None, key_file: Path | None,
                       client_ca_file: Path | None = None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files, read again when they change (:class:`ReloadingCertificates`);
    with ``client_ca_file`` clients must present a certificate signed by it (mutual TLS). None
    without a certificate (plaintext)."""
    if cert_file is None and key_file is None:
        if client_ca_file is not None:
            raise ValueError("a client CA needs the server's own certificate and key (TLS) too")
        return None
    if cert_file is None or key_file is None:
        raise ValueError("TLS needs both a certificate and its private key")
    certificates = ReloadingCertificates(cert_file, key_file, client_ca_file)
    return grpc.dynamic_ssl_server_credentials(certificates.initial, certificates,
                                               require_client_authentication=client_ca_file is not None)


def server_security(settings: ModelServiceSettings) -> dict[str, Any]:
    """``interceptors`` and ``credentials`` for ``create_server`` from a model service's settings."""
    token = read_secret(settings.auth_token, settings.auth_token_file)
    credentials = server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
    transport = "plaintext" if credentials is None else "mutual TLS" if settings.tls_client_ca_file else "TLS"
    logger.info("gRPC on %s: %s, %s", settings.address, transport,
                "token required" if token else "no token (anyone who reaches the port may call)")
    if token and credentials is None and settings.host not in LOOPBACK_HOSTS:
        logger.info("the token crosses the network in clear text; enable TLS between hosts (docs/security.md)")
    return {"interceptors": [TokenAuth(token)] if token else [], "credentials": credentials}


# ---- client side ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches a model service: a bearer token and/or TLS (PEM file contents)."""

    # the secrets stay out of repr (a log line or a traceback of a settings object shows the rest)
    token: str | None = field(default=None, repr=False)
    ca: bytes | None = None  # trust these CAs for the server's certificate; None: plaintext
    cert: bytes | None = None  # client certificate chain (mutual TLS)
    key: bytes | None = field(default=None, repr=False)  # its private key
    server_name: str | None = None  # name expected in the server's certificate instead of the address's host

    @classmethod
    def from_files(cls, token: SecretStr | str | None = None, token_file: Path | None = None,
                   ca_file: Path | None = None, cert_file: Path | None = None, key_file: Path | None = None,
                   server_name: str | None = None) -> ChannelSecurity:
        if (cert_file is None) != (key_file is None):
            raise ValueError("a client certificate needs its private key and the other way round")
        if cert_file is not None and ca_file is None:
            raise ValueError("a client certificate (mutual TLS) needs TLS: set the CA file of the services too")
        return cls(
            token=read_secret(token, token_file),
            ca=Path(ca_file).read_bytes() if ca_file else None,
            cert=Path(cert_file).read_bytes() if cert_file else None,
            key=Path(key_file).read_bytes() if key_file else None,
            server_name=server_name or None,
        )

    @property
    def tls(self) -> bool:
        return self.ca is not None

    def describe(self) -> str:
        transport = "plaintext" if not self.tls else "mutual TLS" if self.cert else "TLS"
        return f"{transport}, {'with' if self.token else 'no'} token"

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


# The token rides in an interceptor rather than call credentials: gRPC refuses call credentials on
# plaintext channels, and plaintext on a private network is a supported set-up.

def _with_metadata(details: Any, extra: tuple[tuple[str, str], ...], aio: bool = False) -> Any:
    metadata = (*(details.metadata or ()), *extra)
    return details._replace(metadata=grpc.aio.Metadata(*metadata) if aio else metadata)


class _AioToken(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
                grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_metadata(client_call_details, self._metadata, True), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_metadata(client_call_details, self._metadata, True), request)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_metadata(client_call_details, self._metadata, True), request_iterator)

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_metadata(client_call_details, self._metadata, True), request_iterator)


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(_with_metadata(client_call_details, self._metadata), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(_with_metadata(client_call_details, self._metadata), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(_with_metadata(client_call_details, self._metadata), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(_with_metadata(client_call_details, self._metadata), request_iterator)


def aio_channel(address: str, security: ChannelSecurity | None = None,
                options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to ``address``: TLS when ``security`` has a CA, the token on every call."""
    security = security or ChannelSecurity()
    options = [*options, *security.options()]
    interceptors = [_AioToken(security.metadata())] if security.token else None
    if security.tls:
        return grpc.aio.secure_channel(address, security.channel_credentials(), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def channel(address: str, security: ChannelSecurity | None = None,
            options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """The blocking counterpart of :func:`aio_channel` (tools, health checks, tests)."""
    security = security or ChannelSecurity()
    options = [*options, *security.options()]
    if security.tls:
        ch = grpc.secure_channel(address, security.channel_credentials(), options=options)
    else:
        ch = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, _SyncToken(security.metadata())) if security.token else ch
