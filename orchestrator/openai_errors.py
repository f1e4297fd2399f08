"""OpenAI's error shape for the OpenAI-compatible routes.

Every error of ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` (validation,
refused fields, an unknown model, a missing key, a body too large, admission, readiness) is
answered as OpenAI answers it::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "logit_bias", "code": null}}

with OpenAI's status codes, so the official ``openai`` client raises its matching exception class
(``BadRequestError`` for 400, ``AuthenticationError`` for 401, ``NotFoundError`` for 404,
``RateLimitError`` for 429, ``InternalServerError`` for 5xx). Request validation is a 400 there, as
OpenAI's (FastAPI's default is 422, which the client maps to ``UnprocessableEntityError``).
specdec's own routes (``/v1/generate`` …) keep FastAPI's ``{"detail": …}``.
"""

from __future__ import annotations

import json
from typing import Any

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")

# status -> (type, code) as OpenAI's API sends them
_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", None),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "service_unavailable"),
}


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind, default_code = _KINDS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return {"error": {"message": message, "type": kind, "param": param, "code": code or default_code}}


def error_bytes(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    """The body as ASCII JSON (an echoed input may hold a lone surrogate)."""
    return json.dumps(error_body(status, message, param, code), ensure_ascii=True, allow_nan=False).encode()


class OpenAIError(Exception):
    """An error of an OpenAI route, with the field it concerns (``param``) and OpenAI's ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def param_of(loc: Any) -> str | None:
    """A validation error's location as OpenAI names a parameter: ``messages[0].content``."""
    parts = [p for p in (loc or ()) if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or None
