"""FastAPI application: REST, SSE streaming, OpenAI-compatible routes, health and metrics.

Routes only translate HTTP <-> the loop (orchestrator.loop); errors are HTTPException(status,
detail) with a reason a client can act on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from orchestrator.auth import add_api_key_auth, may_see_details
from orchestrator.openai_api import router as openai_router
from orchestrator.openai_errors import OpenAIError, error_bytes, is_openai_path, param_of
from orchestrator.runtime import READY_RECHECK_S, Runtime, connect, keep_connected
from orchestrator.schemas import MAX_MESSAGES, GenerateRequest, GenerateResponse
from orchestrator.server_stats import router as server_router
from orchestrator.service import (
    Run,
    client_key,
    collect,
    prepare,
    prompt_size,
    request_prompt,
    seed_of,
    start_stream,
    tokenize,
)
from orchestrator.settings import OrchestratorSettings
from orchestrator.streams import BoundedEventSource
from orchestrator.structured import grammar_of
from specdec.params import Sampling

logger = logging.getLogger(__name__)


class BodyLimit:
    """ASGI middleware: 413 for request bodies over ``max_bytes``, declared or streamed (chunked).

    The body is read here, up to the limit, and replayed to the app: a limit hit while the app
    itself reads would surface inside the framework's body parsing, which turns any error there
    into a 400. Bodies are small (1 MiB by default), so buffering them costs nothing.
    """

    def __init__(self, app: Any, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(scope, send)
        if scope.get("method") in ("GET", "HEAD", "OPTIONS") and declared is None \
                and b"chunked" not in headers.get(b"transfer-encoding", b""):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client went away mid-body
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        return await self._reject(scope, send)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await self._refuse(scope, send, 408, f"request body not received within {self.timeout_s:.0f} s",
                                      close=True)
        # `"role"` can only stand in JSON as a key (inside a string a quote is escaped): a count of
        # them over the bound refuses a body of tens of thousands of messages before it is parsed
        # (parsing a megabyte of them holds the event loop: docs/benchmarks.md, "Reliability
        # suite"), where the schema would say the same after
        body = b"".join(chunks)
        if body.count(b'"role"') > MAX_MESSAGES:
            return await self._refuse(scope, send, 400, f"messages: more than {MAX_MESSAGES} messages",
                                      "messages")
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads wait for the disconnect, as usual

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, send: Any) -> None:
        await self._refuse(scope, send, 413, f"request body over {self.max_bytes} bytes")

    async def _refuse(self, scope: dict, send: Any, status: int, message: str, param: str | None = None,
                      close: bool = False) -> None:
        body = (error_bytes(status, message, param) if is_openai_path(scope.get("path", ""))
                else json.dumps({"detail": message}).encode())
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status,
                    "headers": headers + ([(b"connection", b"close")] if close else [])})
        await send({"type": "http.response.body", "body": body})


def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """422 with pydantic's errors, made safe to render: an echoed input may hold a lone surrogate
    or NaN, which the default handler fails to encode (a 500 for a client's mistake). On the
    OpenAI routes: a 400 in OpenAI's shape, naming the first field at fault."""
    if is_openai_path(request.url.path):
        first = (exc.errors() or [{}])[0]
        param = param_of(first.get("loc"))
        if first.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {first.get('msg', '')}", None
        else:
            message = "; ".join(f"{param_of(e.get('loc')) or 'body'}: {_plain(e.get('msg', ''))}" for e in exc.errors())
        return Response(error_bytes(400, message, param), status_code=400, media_type="application/json")
    errors = []
    for error in exc.errors():
        item = {"loc": list(error.get("loc", ())), "msg": str(error.get("msg", "")), "type": str(error.get("type", ""))}
        try:
            json.dumps(error.get("input"), allow_nan=False)
            text = json.dumps(error.get("input"), ensure_ascii=True)
            if len(text) <= 256:
                item["input"] = json.loads(text)
        except (TypeError, ValueError):
            pass
        errors.append(item)
    # ASCII-escaped JSON, sent as is (a lone surrogate in an echoed input stays escaped)
    body = json.dumps({"detail": errors}, ensure_ascii=True, allow_nan=False)
    return Response(body, status_code=422, media_type="application/json")


def _plain(msg: str) -> str:
    """pydantic's "Value error, ..." without its prefix."""
    return msg.removeprefix("Value error, ")


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """HTTP errors: OpenAI's shape on its routes (a 422 there is OpenAI's 400), FastAPI's
    ``{"detail"}`` elsewhere."""
    if not is_openai_path(request.url.path):
        return await http_exception_handler(request, exc)
    status = 400 if exc.status_code == 422 else exc.status_code
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    param = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else None
    return Response(error_bytes(status, message, param), status_code=status, media_type="application/json",
                    headers=dict(exc.headers or {}))


def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return Response(error_bytes(exc.status, exc.message, exc.param, exc.code), status_code=exc.status,
                    media_type="application/json")


def runtime(request: Request) -> Runtime:
    """The app's :class:`Runtime` (a route dependency); 503 before start-up built it."""
    rt = getattr(request.app.state, "rt", None)
    if rt is None:
        raise HTTPException(503, detail="the orchestrator is starting: retry shortly")
    return rt


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Connect to both services at start (a service down is retried in the background), close at the end."""
    settings: OrchestratorSettings = app.state.settings
    rt = app.state.rt = Runtime.from_settings(settings)  # its channels belong to the server's event loop
    await connect(rt)
    rt.draft.start()
    rt.target.start()
    task = asyncio.create_task(keep_connected(rt))
    logger.info("orchestrator: draft %s, target %s, %s", settings.draft_address, settings.target_address,
                "ready" if not rt.not_ready else f"not ready: {rt.not_ready}")
    try:
        yield
    finally:
        task.cancel()
        await rt.draft.close()
        await rt.target.close()
        rt.tokenizer_thread.shutdown(wait=False, cancel_futures=True)


def create_app(settings: OrchestratorSettings | None = None) -> FastAPI:
    app = FastAPI(
        title="specdec orchestrator",
        description="Speculative decoding: a draft model proposes, the target verifies; output equals the target's.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings = settings or OrchestratorSettings()
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OpenAIError, _openai_error)
    add_api_key_auth(app, settings)  # a request without a valid key is refused before its body is read
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.trusted_hosts())  # outermost
    app.include_router(ops_router)
    app.include_router(generate_router)
    app.include_router(openai_router)
    app.include_router(server_router)  # GET /v1/server, and its background sampler
    return app


ops_router = APIRouter(tags=["ops"])
generate_router = APIRouter(tags=["generate"])


@ops_router.get("/health")
async def health() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


# What a reason may name that an anonymous caller must not learn: quoted names, parenthesised
# details, paths, host:port addresses, IPv4 addresses
_PRIVATE = re.compile(r"'[^']*'|\"[^\"]*\"|\([^)]*\)|\S*[/\\]\S*|\b[\w.-]+:\d+\b|\b\d{1,3}(?:\.\d{1,3}){3}\b")


def public_reason(reason: str) -> str:
    """``reason`` with its addresses, paths and names cut out (what /ready tells anonymous callers
    when API keys are required)."""
    return re.sub(r"\s+", " ", _PRIVATE.sub("…", reason)).strip()


@ops_router.get("/ready")
async def ready(request: Request, rt: Runtime = Depends(runtime)) -> JSONResponse:
    """The target reachable and every model compatible (re-checked on every call): 200, with
    ``degraded`` saying why when requests decode without drafts (the draft unreachable; the
    output is the same, only slower), 503 with ``reason`` otherwise. A draft outage must not
    take every orchestrator out of a load balancer."""
    if rt.draining_since is not None:  # out of the load balancer while the streams in progress finish
        return JSONResponse({"ready": False, "reason": "draining: the server is shutting down", "degraded": ""},
                            status_code=503)
    # Probes come often and from anyone: the services are asked again at most once a second.
    if time.monotonic() - rt.checked_at >= READY_RECHECK_S:
        await connect(rt)
    body: dict[str, Any] = {"ready": not rt.not_ready, "reason": rt.not_ready, "degraded": rt.degraded}
    if may_see_details(request):  # model paths, replica addresses, sessions: not for anonymous callers
        body |= {"draft": rt.draft_info, "target": rt.target_info,
                 "replicas": {"draft": rt.draft.replicas.describe(), "target": rt.target.replicas.describe()}}
    else:  # the reasons too, without what they name (a probe needs only the status)
        body |= {"reason": public_reason(rt.not_ready), "degraded": public_reason(rt.degraded)}
    return JSONResponse(body, status_code=200 if not rt.not_ready else 503)


@ops_router.get("/metrics")
async def metrics() -> Response:
    """Prometheus metrics."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@ops_router.get("/v1/info")
async def info(rt: Runtime = Depends(runtime)) -> dict[str, Any]:
    """Models, readiness and request defaults (what the dashboard shows)."""
    settings = rt.settings
    return {
        "ready": not rt.not_ready,
        "reason": rt.not_ready,
        "degraded": rt.degraded,
        "draft": rt.draft_info,
        "target": rt.target_info,
        "draft_available": rt.draft_health.usable(),
        "replicas": {"draft": rt.draft.replicas.describe(), "target": rt.target.replicas.describe()},
        "defaults": {
            "controller": settings.default_controller, "k": settings.default_k, "max_k": settings.default_max_k,
            "confidence_threshold": settings.default_confidence_threshold, "overlap": settings.default_overlap,
            "max_tokens": settings.default_max_tokens, "max_tokens_limit": settings.max_tokens_limit,
        },
        "has_chat_template": bool(getattr(rt.tokenizer, "chat_template", None)),
    }


async def _prepare(rt: Runtime, body: GenerateRequest, request: Request) -> Run:
    sampling = Sampling(body.temperature, body.top_p, body.top_k, seed_of(body.seed), await grammar_of(body),
                        **body.processing())
    prompt_ids, [slot] = await tokenize(rt, client_key(request), request_prompt, rt, body,
                                        size=prompt_size(rt, body.prompt, body.messages))
    return prepare(rt, body, prompt_ids, body.max_tokens, body.stop, body.ignore_eos, sampling, slot)


@generate_router.post("/v1/generate", response_model=GenerateResponse)
async def generate_route(body: GenerateRequest, request: Request, rt: Runtime = Depends(runtime)) -> GenerateResponse:
    """Generate a continuation of `prompt`; the response lists every speculative step."""
    run = await _prepare(rt, body, request)
    steps, result = await collect(run, request)
    return GenerateResponse(
        text=result["text"], token_ids=result["token_ids"], prompt_tokens=run.prompt_tokens,
        finish_reason=result["finish_reason"], mode=body.mode, controller=run.controller_name,
        steps=steps if body.include_steps else [], stats=result["stats"],
    )


@generate_router.post("/v1/generate/stream")
async def generate_stream(body: GenerateRequest, request: Request,
                          rt: Runtime = Depends(runtime)) -> BoundedEventSource:
    """The same as /v1/generate as server-sent events: a `step` event per iteration (accepted and
    rejected draft tokens, correction or bonus, text delta, timings), then one `done` event."""
    run = await _prepare(rt, body, request)
    events = await start_stream(run, request)
    tokenizer = rt.tokenizer

    async def sse() -> AsyncIterator[dict[str, str]]:
        async for kind, payload in events:
            if kind == "step":
                texts = {"token_texts": [tokenizer.decode([t]) for t in payload.draft],
                         "next_token_text": tokenizer.decode([payload.next_token])}
                yield {"event": kind, "data": payload.model_copy(update=texts).model_dump_json()}
            else:
                yield {"event": kind, "data": json.dumps(payload)}

    return BoundedEventSource(sse(), rt.settings.stream_send_timeout_s)
