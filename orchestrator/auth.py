"""API keys for the HTTP API (OpenAI style: ``Authorization: Bearer <key>``) and the credentials
the orchestrator presents to the model services.

With no key configured the API stays open. With keys, :class:`APIKeyAuth` (pure ASGI, so it also
covers /docs and /openapi.json, and costs one hash per request) answers 401 on every path but
``OPEN_PATHS``, and records which key was used as a short id (:func:`api_key_id`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from orchestrator.openai_errors import error_bytes, is_openai_path
from orchestrator.settings import OrchestratorSettings
from specdec.auth import ChannelSecurity

logger = logging.getLogger(__name__)

# Liveness and readiness probes (compose, Kubernetes, the launcher) carry no credentials, and
# neither route reveals more than whether the stack is up.
OPEN_PATHS = frozenset({"/health", "/ready"})
SCHEME = "APIKey"  # name of the security scheme in the OpenAPI document


def parse_key_file(text: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments are skipped."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def load_api_keys(settings: OrchestratorSettings) -> list[str]:
    """Keys of ``api_keys`` (comma-separated) and ``api_keys_file`` (one per line), without duplicates."""
    inline = settings.api_keys.get_secret_value() if settings.api_keys else ""
    keys = [k.strip() for k in inline.split(",") if k.strip()]
    if settings.api_keys_file is not None:
        keys += parse_key_file(Path(settings.api_keys_file).read_text(encoding="utf-8"))
    return list(dict.fromkeys(keys))


def key_id(key: str) -> str:
    """A short stable name of ``key`` for logs and limits: 8 hex digits of its SHA-256, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def api_key_id(request: Request) -> str | None:
    """Id of the API key that authenticated ``request``; None when the API is open."""
    return request.scope.get("state", {}).get("api_key_id")


def may_see_details(request: Request) -> bool:
    """Whether an open route (/ready) may show its details: the API is open, or a valid key came."""
    state = request.scope.get("state", {})
    return not state.get("api_keys_required") or state.get("api_key_id") is not None


class APIKeyAuth:
    """ASGI middleware: 401 unless ``Authorization: Bearer <key>`` names one of ``keys``.

    Keys are compared as SHA-256 digests with ``hmac.compare_digest``, against every key, so the
    time taken says nothing about how much of a guess was right nor which key matched. The id of
    the matching key goes to ``scope["state"]["api_key_id"]`` for inner middleware and routes.
    """

    def __init__(self, app: Any, keys: Iterable[str], open_paths: Iterable[str] = OPEN_PATHS) -> None:
        self.app = app
        self._digests = [(hashlib.sha256(k.encode()).digest(), key_id(k)) for k in keys]
        self._open = frozenset(open_paths)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or not self._digests:
            return await self.app(scope, receive, send)
        if scope["path"] in self._open:
            # open to all, but a valid key may see more (/ready's details): say whether one came
            state = scope.setdefault("state", {})
            state["api_keys_required"] = True
            given = _bearer(scope)
            if given and (matched := self._match(given)) is not None:
                state["api_key_id"] = matched
            return await self.app(scope, receive, send)
        given = _bearer(scope)
        if not given:
            return await _reject(scope, send, "missing API key: send the header 'Authorization: Bearer <key>'")
        matched = self._match(given)
        if matched is None:
            return await _reject(scope, send, "invalid API key")
        scope.setdefault("state", {})["api_key_id"] = matched
        await self.app(scope, receive, send)

    def _match(self, given: str) -> str | None:
        digest = hashlib.sha256(given.encode()).digest()
        matched = None
        for known, ident in self._digests:
            if hmac.compare_digest(digest, known):
                matched = ident
        return matched


def _bearer(scope: dict) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header, or None."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, credential = value.decode("latin-1").partition(" ")
            return credential.strip() if scheme.lower() == "bearer" else None
    return None


async def _reject(scope: dict, send: Any, detail: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": detail})
        return
    body = error_bytes(401, detail) if is_openai_path(scope.get("path", "")) else json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]})
    await send({"type": "http.response.body", "body": body})


def add_api_key_auth(app: FastAPI, settings: OrchestratorSettings) -> None:
    """Protect ``app`` with the configured keys (nothing to do when there are none) and declare the
    bearer scheme in its OpenAPI document, so /docs shows an Authorize button and generated clients
    send the header. Call after the other middleware: this one then runs first."""
    keys = load_api_keys(settings)
    if not keys:
        logger.info("API keys: none configured, the HTTP API is open to whoever reaches it")
        return
    logger.info("API keys: %d configured (ids %s); open paths: %s", len(keys), ", ".join(key_id(k) for k in keys),
                ", ".join(sorted(OPEN_PATHS)))
    app.add_middleware(APIKeyAuth, keys=keys)
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})[SCHEME] = {
            "type": "http", "scheme": "bearer", "description": "An API key of the orchestrator (api_keys).",
        }
        schema["security"] = [{SCHEME: []}]
        for path in OPEN_PATHS:
            for operation in schema.get("paths", {}).get(path, {}).values():
                operation["security"] = []
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def grpc_security(settings: OrchestratorSettings, service: str | None = None) -> ChannelSecurity:
    """Token and TLS files of the orchestrator's channels to a model service (``service``: "draft"
    or "target", whose own expected certificate name, when set, wins over the shared one)."""
    own = getattr(settings, f"{service}_tls_server_name", None) if service else None
    return ChannelSecurity.from_files(
        token=settings.grpc_token, token_file=settings.grpc_token_file, ca_file=settings.grpc_tls_ca_file,
        cert_file=settings.grpc_tls_cert_file, key_file=settings.grpc_tls_key_file,
        server_name=own or settings.grpc_tls_server_name,
    )
