"""HTTP client of the orchestrator: health, readiness, info and the streamed generation (SSE).

Every failure is an ``OrchestratorError`` whose message can be shown to a person as is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)


class OrchestratorError(Exception):
    """A request to the orchestrator failed; ``str(exc)`` is a sentence for the user."""


class Unreachable(OrchestratorError):
    """Nothing answers at the orchestrator's URL (refused, timed out, DNS)."""


class Rejected(OrchestratorError):
    """The orchestrator answered with an HTTP error before the stream started."""

    def __init__(self, status: int, detail: str) -> None:
        self.status, self.detail = status, detail
        if status == 503:
            message = f"The orchestrator is not ready (HTTP 503): {detail}"
        elif status == 401:
            message = f"The orchestrator wants an API key (HTTP 401): {detail}. Set SPECDEC_UI_API_KEY to one of its keys."
        else:
            message = f"The orchestrator rejected the request (HTTP {status}): {detail}"
        super().__init__(message)


class StreamFailed(OrchestratorError):
    """The generation started but failed part-way (an ``error`` event or a broken stream)."""


def describe_detail(detail: Any) -> str:
    """FastAPI's ``detail``: a string, or for validation errors a list of {loc, msg}; as one line."""
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if not isinstance(item, dict):
                parts.append(str(item))
                continue
            loc = ".".join(str(p) for p in item.get("loc", []) if p != "body")
            msg = item.get("msg", "invalid")
            parts.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(parts) or "invalid request"
    if isinstance(detail, str):
        return detail
    return json.dumps(detail)


def parse_sse(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(event name, data) per server-sent event; comments (pings) are skipped.

    ``lines`` are the stream's lines without their line endings; an event ends at a blank line.
    """
    event, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
    if data:
        yield event, "\n".join(data)


@dataclass
class Status:
    """What the service panel shows: the orchestrator's liveness, readiness and info."""

    alive: bool
    error: str = ""  # why the orchestrator could not be reached
    ready: dict[str, Any] = field(default_factory=dict)  # body of /ready (200 or 503)
    info: dict[str, Any] = field(default_factory=dict)  # body of /v1/info


class OrchestratorClient:
    """Blocking client (Streamlit runs the page in a plain thread)."""

    def __init__(self, base_url: str, timeout_s: float = 5.0, stream_timeout_s: float = 300.0,
                 api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def _get(self, path: str) -> httpx.Response:
        try:
            return httpx.get(self.base_url + path, timeout=self.timeout_s, headers=self.headers)
        except httpx.HTTPError as exc:
            raise Unreachable(self._unreachable(exc)) from exc

    def _unreachable(self, exc: Exception) -> str:
        reason = "timed out" if isinstance(exc, httpx.TimeoutException) else (str(exc) or type(exc).__name__)
        return f"Cannot reach the orchestrator at {self.base_url} ({reason}). Is it running?"

    def status(self) -> Status:
        """Liveness, readiness and info in one go; never raises."""
        try:
            health = self._get("/health")
            if health.status_code != 200:
                return Status(False, f"The orchestrator at {self.base_url} is unhealthy (HTTP {health.status_code}).")
            ready = self._get("/ready")
            info = self._get("/v1/info")
            return Status(True, "", _json(ready), _json(info) if info.status_code == 200 else {})
        except Unreachable as exc:
            return Status(False, str(exc))

    def server(self) -> dict[str, Any]:
        """GET /v1/server, the deployment's live snapshot.

        Raises Unreachable, or Rejected for an HTTP error (404: an orchestrator without the route).
        """
        response = self._get("/v1/server")
        if response.status_code != 200:
            detail = _json(response).get("detail", response.text or response.reason_phrase)
            raise Rejected(response.status_code, describe_detail(detail))
        body = _json(response)
        if not body:
            raise OrchestratorError(f"The orchestrator at {self.base_url} sent an unreadable /v1/server answer.")
        return body

    def stream(self, body: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        """POST /v1/generate/stream: ("step", event) per iteration, then ("done", result).

        Raises Unreachable, Rejected (HTTP error before the stream) or StreamFailed.
        """
        timeout = httpx.Timeout(self.stream_timeout_s, connect=self.timeout_s)
        url = self.base_url + "/v1/generate/stream"
        done = False
        try:
            with httpx.stream("POST", url, json=body, timeout=timeout, headers=self.headers) as response:
                if response.status_code != 200:
                    response.read()
                    detail = _json(response).get("detail", response.text or response.reason_phrase)
                    raise Rejected(response.status_code, describe_detail(detail))
                for event, data in parse_sse(response.iter_lines()):
                    try:
                        payload = json.loads(data)
                    except json.JSONDecodeError as exc:
                        raise StreamFailed(f"The orchestrator sent an unreadable {event!r} event.") from exc
                    if event == "error":
                        status = payload.get("status", "?")
                        detail = describe_detail(payload.get("detail", "unknown error"))
                        raise StreamFailed(f"Generation failed part-way (HTTP {status}): {detail}")
                    if event in ("step", "done"):
                        yield event, payload
                        done = done or event == "done"
        except httpx.ConnectError as exc:
            raise Unreachable(self._unreachable(exc)) from exc
        except httpx.TimeoutException as exc:
            raise StreamFailed(
                f"The orchestrator at {self.base_url} sent nothing for {self.stream_timeout_s:.0f} s; "
                "the generation was abandoned."
            ) from exc
        except httpx.HTTPError as exc:
            raise StreamFailed(f"The connection to the orchestrator broke during generation ({exc}).") from exc
        if not done:
            raise StreamFailed("The orchestrator closed the stream before the generation finished.")


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
