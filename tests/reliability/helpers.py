"""What the reliability tests share beyond tests/support.py (which starts and restarts the services):
reading the services' state over gRPC and /proc, timed HTTP/SSE requests, and the JSON reports
under the artifacts folder."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.support import ROOT, iter_sse

logger = logging.getLogger(__name__)

SERVICES = {"draft": "specdec.v1.DraftService", "target": "specdec.v1.TargetService"}


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


# ---- the model services ---------------------------------------------------------------------------

def service_info(kind: str, port: int, metadata: tuple = ()) -> pb.InfoResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.DraftServiceStub(channel) if kind == "draft" else pb_grpc.TargetServiceStub(channel)
        return stub.Info(pb.InfoRequest(), timeout=10, metadata=metadata)


def held(ports: dict[str, int]) -> dict[str, dict[str, int]]:
    """Sessions and KV bytes each service holds now: {"draft": {"sessions": n, "kv_bytes": b}, ...}."""
    out = {}
    for kind, port in ports.items():
        info = service_info(kind, port)
        out[kind] = {"sessions": info.sessions, "kv_bytes": info.kv_bytes}
    return out


def wait_released(ports: dict[str, int], timeout_s: float = 15.0) -> dict[str, dict[str, int]]:
    """Poll until no service holds a session (releases are asynchronous); the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = held(ports)
        if all(v["sessions"] == 0 and v["kv_bytes"] == 0 for v in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (VmRSS of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ---- HTTP -----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One HTTP request as a test sees it."""

    kind: str
    status: int = 0  # HTTP status; 0 when the request failed below HTTP
    token_ids: list[int] = field(default_factory=list)
    events: list[tuple[str, dict]] = field(default_factory=list)  # SSE only
    event_times: list[float] = field(default_factory=list)  # time.monotonic() each event arrived
    body: Any = None
    error: str = ""  # transport error (timeout, connection reset ...)
    started: float = 0.0  # time.monotonic()
    ended: float = 0.0

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def sse_error(self) -> dict | None:
        return next((d for e, d in self.events if e == "error"), None)

    @property
    def done(self) -> dict | None:
        return next((d for e, d in self.events if e == "done"), None)

    @property
    def failed_at(self) -> float:
        """When the failure reached the client: the error event of a stream, else the response."""
        for (e, _), t in zip(self.events, self.event_times, strict=True):
            if e == "error":
                return t
        return self.ended

    @property
    def steps(self) -> list[dict]:
        """Per-step details: the stream's step events, or the steps of a /v1/generate response."""
        if self.events:
            return [d for e, d in self.events if e == "step"]
        return self.body.get("steps", []) if isinstance(self.body, dict) else []


def post(url: str, path: str, body: dict, timeout_s: float = 120.0, headers: dict | None = None,
         kind: str = "") -> Outcome:
    out = Outcome(kind or path, started=time.monotonic())
    try:
        r = httpx.post(url + path, json=body, timeout=timeout_s, headers=headers)
        out.status = r.status_code
        try:
            out.body = r.json()
        except ValueError:
            out.body = r.text
        if r.status_code == 200 and isinstance(out.body, dict):
            out.token_ids = out.body.get("token_ids", [])
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    return out


def stream(url: str, body: dict, timeout_s: float = 120.0, on_event=None, path: str = "/v1/generate/stream",
           max_events: int | None = None, headers: dict | None = None, kind: str = "") -> Outcome:
    """POST an SSE request and read it to its end (or ``max_events`` events, then hang up).

    ``on_event(outcome)`` runs after every event (a test uses it to inject a fault mid-stream).
    """
    out = Outcome(kind or path, started=time.monotonic())
    try:
        with httpx.stream("POST", url + path, json=body, timeout=timeout_s, headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                r.read()
                out.body = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
            else:
                for event in iter_sse(r):
                    out.events.append(event)
                    out.event_times.append(time.monotonic())
                    if event[0] == "step":
                        out.token_ids.extend(event[1].get("tokens", []))
                    if on_event is not None:
                        on_event(out)
                    if max_events is not None and len(out.events) >= max_events:
                        break
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    return out


def silent_stream(url: str, path: str, body: dict, headers: dict | None = None) -> socket.socket:
    """Send a streaming request on a socket with a small receive buffer and never read it."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n{extra}"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def metric(url: str, name: str) -> float:
    """The value of one sample of the orchestrator's /metrics (0 when absent)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# ---- reports --------------------------------------------------------------------------------------

# Lines printed at the end of the pytest run (tests/reliability/conftest.py).
SUMMARY: list[str] = []


def summarize(title: str, lines: list[str]) -> None:
    """Queue ``lines`` for the end-of-run summary and log them now."""
    SUMMARY.append(f"-- {title}")
    SUMMARY.extend(f"   {line}" for line in lines)
    for line in lines:
        logger.info("%s: %s", title, line)

def artifacts_dir() -> Path:
    path = Path(os.environ.get("SPECDEC_ARTIFACTS_DIR") or ROOT / "artifacts") / "reliability"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_report(name: str, data: dict[str, Any]) -> Path:
    """Write ``data`` as artifacts/reliability/<name>.json and log where."""
    path = artifacts_dir() / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    logger.info("report written to %s", path)
    return path
