"""FastAPI application: REST, SSE streaming, OpenAI-compatible routes, health and metrics.

Routes only translate HTTP <-> the loop (orchestrator.loop); errors are HTTPException(status,
detail) with a reason a client can act on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchestrator.auth import add_api_key_auth, grpc_security, may_see_details
from orchestrator.clients import DraftClient, TargetClient
from orchestrator.controller import CostModel, make_controller
from orchestrator.loop import (
    BadRequest,
    DraftHealth,
    GenerationParams,
    GenerationStats,
    ModelLimits,
    StepEvent,
    TargetBusy,
    TargetUnavailable,
    generate,
)
from orchestrator.replicas import DraftPool, TargetPool
from orchestrator.schemas import GenerateRequest, GenerateResponse, SpeculationParams, Step
from orchestrator.settings import OrchestratorSettings
from orchestrator.streams import BoundedEventSource
from specdec import params as sm
from specdec import runtime

logger = logging.getLogger(__name__)
READY_RECHECK_S = 1.0  # /ready asks the services again at most this often


@dataclass
class Runtime:
    """Process-wide state of the orchestrator."""

    settings: OrchestratorSettings
    draft: DraftPool
    target: TargetPool
    draft_health: DraftHealth
    costs: CostModel = field(default_factory=CostModel)
    tokenizer: Any = None
    limits: ModelLimits | None = None
    target_info: dict[str, Any] = field(default_factory=dict)
    draft_info: dict[str, Any] = field(default_factory=dict)
    not_ready: str = "connecting to the model services"
    # why requests decode without drafts while the orchestrator is otherwise ready ("" when not)
    degraded: str = ""
    active: int = 0
    active_per_key: dict[str, int] = field(default_factory=dict)
    # Tokenising and chat templates run here, off the event loop (a 1 MiB prompt takes long enough
    # to stall every stream), one at a time: a fast tokenizer's settings are mutated by each call,
    # so concurrent calls on one tokenizer can fail ("Already borrowed").
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))
    draining_since: float | None = None  # monotonic time of the SIGTERM that started the drain
    tokenizer_fingerprint: str = ""  # of ``tokenizer``: compared with the target's on every check
    checked_at: float = -float("inf")  # monotonic time of the last connect()

    def drain(self) -> None:
        """Stop admitting; generations in progress get ``drain_timeout_s`` to finish (SIGTERM)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            logger.info("draining: no new requests; %d in progress get %.0f s to finish",
                        self.active, self.settings.drain_timeout_s)

    def drain_expired(self) -> bool:
        return self.draining_since is not None and time.monotonic() - self.draining_since >= self.settings.drain_timeout_s

    @property
    def model_name(self) -> str:
        return self.settings.model_name or self.target_info.get("model_id", "specdec")


def _info_dict(info: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


async def connect(rt: Runtime) -> None:
    """Read both services' Info, load the tokenizer, check they are compatible; set readiness."""
    rt.checked_at = time.monotonic()
    try:
        target = await rt.target.info()
    except grpc.aio.AioRpcError as exc:
        rt.not_ready = f"target service at {rt.settings.target_address} unreachable: {exc.code().name}"
        return
    rt.target_info = _info_dict(target)
    try:
        draft = await rt.draft.info()
        rt.draft_info = _info_dict(draft)
    except grpc.aio.AioRpcError as exc:
        # requests still decode (target only, the same output): ready, but degraded
        rt.degraded = f"draft service at {rt.settings.draft_address} unreachable: {exc.code().name}; decoding without drafts"
        rt.draft_info = {}
        draft = None
    if draft is not None and draft.tokenizer_fingerprint and draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        rt.not_ready = (
            f"draft and target tokenizers differ (draft {draft.model_id}: {draft.tokenizer_fingerprint[:12]}, "
            f"target {target.model_id}: {target.tokenizer_fingerprint[:12]}); pair models that share a tokenizer"
        )
        return
    if draft is not None and draft.tokenizer_fingerprint and draft.vocab_size > target.vocab_size:
        # Same tokenizer, but a larger embedding table could let the draft propose ids the target
        # cannot take (each such step would be verified again without its draft).
        rt.not_ready = (
            f"the draft's vocabulary ({draft.model_id}: {draft.vocab_size} ids) is larger than the target's "
            f"({target.model_id}: {target.vocab_size} ids); pair a draft whose ids the target accepts"
        )
        return
    if rt.tokenizer is not None and rt.tokenizer_fingerprint != target.tokenizer_fingerprint:
        # the target now serves another model (a rollout): text must not be decoded with the old vocabulary
        logger.warning("the target's tokenizer changed (%s): loading it again", target.model_id)
        rt.tokenizer, rt.tokenizer_fingerprint, rt.limits = None, "", None
    if rt.tokenizer is None:
        from specdec.models import load_tokenizer, tokenizer_fingerprint

        spec = rt.settings.tokenizer or target.model_id
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, spec)
        except Exception as exc:
            rt.not_ready = f"cannot load tokenizer {spec!r}: {exc}"
            return
        fingerprint = await asyncio.to_thread(tokenizer_fingerprint, tokenizer)
        if fingerprint != target.tokenizer_fingerprint:
            rt.not_ready = f"tokenizer {spec!r} does not match the target's ({target.model_id})"
            return
        rt.tokenizer, rt.tokenizer_fingerprint = tokenizer, fingerprint
    own = runtime.host_id(), runtime.cpu_cores()
    rt.costs.set_hosts((target.host_id, target.cpu_cores) if target.host_id else None,
                       (draft.host_id, draft.cpu_cores) if draft is not None and draft.host_id else None, own)
    rt.limits = ModelLimits(
        target_max_context=target.max_context,
        target_max_draft=target.max_draft_tokens,
        draft_max_context=draft.max_context if draft is not None else 0,
        draft_max_draft=draft.max_draft_tokens if draft is not None else 0,
        eos_token_ids=set(target.eos_token_ids),
        draft_shares_host=draft is not None and bool(target.host_id) and draft.host_id == target.host_id,
    )
    rt.not_ready = ""
    if draft is not None:
        rt.degraded = ""


async def _keep_connected(rt: Runtime) -> None:
    while True:
        await connect(rt)
        # a missing draft is looked for as often as a missing target: requests speculate again
        # within 2 s of the draft coming back
        await asyncio.sleep(2.0 if rt.not_ready or rt.degraded else 15.0)


class BodyLimit:
    """ASGI middleware: 413 for request bodies over ``max_bytes``, declared or streamed (chunked).

    The body is read here, up to the limit, and replayed to the app: a limit hit while the app
    itself reads would surface inside the framework's body parsing, which turns any error there
    into a 400. Bodies are small (1 MiB by default), so buffering them costs nothing.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        if scope.get("method") in ("GET", "HEAD", "OPTIONS") and declared is None \
                and b"chunked" not in headers.get(b"transfer-encoding", b""):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._reject(send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later reads wait for the disconnect, as usual

        await self.app(scope, replay, send)

    async def _reject(self, send: Any) -> None:
        body = json.dumps({"detail": f"request body over {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """422 with pydantic's errors, made safe to render: an echoed input may hold a lone surrogate
    or NaN, which the default handler fails to encode (a 500 for a client's mistake)."""
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


def create_app(settings: OrchestratorSettings | None = None) -> FastAPI:
    settings = settings or OrchestratorSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        rt = Runtime(
            settings=settings,
            draft=DraftPool(settings.draft_address,
                            lambda address, security: DraftClient(address, settings.draft_timeout_s, security),
                            grpc_security(settings), settings.replica_resolve_interval_s,
                            settings.replica_probe_interval_s),
            target=TargetPool(settings.target_address,
                              lambda address, security: TargetClient(address, settings.target_timeout_s, security),
                              grpc_security(settings), settings.replica_resolve_interval_s,
                              settings.replica_probe_interval_s),
            draft_health=DraftHealth(settings.draft_retry_s),
            costs=CostModel(shared_host_max_streams=settings.shared_host_max_streams),
        )
        app.state.rt = rt
        await connect(rt)
        rt.draft.start()
        rt.target.start()
        task = asyncio.create_task(_keep_connected(rt))
        logger.info("orchestrator: draft %s, target %s, %s", settings.draft_address, settings.target_address,
                    "ready" if not rt.not_ready else f"not ready: {rt.not_ready}")
        try:
            yield
        finally:
            task.cancel()
            await rt.draft.close()
            await rt.target.close()
            rt.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="specdec orchestrator",
        description="Speculative decoding: a draft model proposes, the target verifies; output equals the target's.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _validation_error)
    add_api_key_auth(app, settings)  # outermost: a request without a valid key is refused before its body is read

    from orchestrator.openai_api import router as openai_router
    from orchestrator.server_stats import router as server_router

    app.include_router(openai_router)
    app.include_router(server_router)  # GET /v1/server, and its background sampler

    @app.get("/health", tags=["ops"])
    async def health() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/ready", tags=["ops"])
    async def ready(request: Request) -> JSONResponse:
        """The target reachable and every model compatible (re-checked on every call): 200, with
        ``degraded`` saying why when requests decode without drafts (the draft unreachable; the
        output is the same, only slower), 503 with ``reason`` otherwise. A draft outage must not
        take every orchestrator out of a load balancer."""
        rt: Runtime = request.app.state.rt
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
        return JSONResponse(body, status_code=200 if not rt.not_ready else 503)

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        """Prometheus metrics."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/info", tags=["ops"])
    async def info(request: Request) -> dict[str, Any]:
        """Models, readiness and request defaults (what the dashboard shows)."""
        rt: Runtime = request.app.state.rt
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

    @app.post("/v1/generate", response_model=GenerateResponse, tags=["generate"])
    async def generate_route(body: GenerateRequest, request: Request) -> GenerateResponse:
        """Generate a continuation of `prompt`; the response lists every speculative step."""
        rt: Runtime = request.app.state.rt
        prompt_ids = await tokenize(rt, client_key(request), request_prompt, rt, body)
        run = prepare(rt, body, prompt_ids, body.max_tokens, body.stop, body.ignore_eos,
                      sm.Sampling(body.temperature, body.top_p, body.top_k, _seed(body.seed)), client_key(request))
        steps, result = await collect(run, request)
        return GenerateResponse(
            text=result["text"], token_ids=result["token_ids"], prompt_tokens=run.prompt_tokens,
            finish_reason=result["finish_reason"], mode=body.mode, controller=run.controller_name,
            steps=[to_step(s) for s in steps] if body.include_steps else [], stats=result["stats"],
        )

    @app.post("/v1/generate/stream", tags=["generate"])
    async def generate_stream(body: GenerateRequest, request: Request) -> BoundedEventSource:
        """The same as /v1/generate as server-sent events: a `step` event per iteration (accepted and
        rejected draft tokens, correction or bonus, text delta, timings), then one `done` event."""
        rt: Runtime = request.app.state.rt
        prompt_ids = await tokenize(rt, client_key(request), request_prompt, rt, body)
        run = prepare(rt, body, prompt_ids, body.max_tokens, body.stop, body.ignore_eos,
                      sm.Sampling(body.temperature, body.top_p, body.top_k, _seed(body.seed)), client_key(request))
        events = await start_stream(run, request)

        async def sse() -> AsyncIterator[dict[str, str]]:
            async for kind, payload in events:
                if kind == "step":
                    payload = {**payload, "token_texts": [rt.tokenizer.decode([t]) for t in payload["draft"]],
                               "next_token_text": rt.tokenizer.decode([payload["next_token"]])}
                yield {"event": kind, "data": json.dumps(payload)}

        return BoundedEventSource(sse(), rt.settings.stream_send_timeout_s)

    return app


# ---- shared by the REST and OpenAI routes ------------------------------------------------------

@dataclass
class Run:
    """A validated generation, ready to start; it holds a concurrency slot until :meth:`release`."""

    rt: Runtime
    params: GenerationParams
    controller_name: str
    k: int
    max_k: int
    prompt_tokens: int
    key: str | None = None
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.rt.active -= 1
        self.rt.costs.streams = max(self.rt.active, 1)
        if self.key is not None:
            left = self.rt.active_per_key.get(self.key, 1) - 1
            if left > 0:
                self.rt.active_per_key[self.key] = left
            else:
                self.rt.active_per_key.pop(self.key, None)


# How long a client told 429 should wait before retrying: about one short generation.
RETRY_AFTER_S = 1


def too_busy(detail: str) -> HTTPException:
    return HTTPException(429, detail=detail, headers={"Retry-After": str(RETRY_AFTER_S)})


def client_key(request: Request | None) -> str | None:
    """Identity of the API key that authenticated the request (None without API keys)."""
    return getattr(request.state, "api_key_id", None) if request is not None else None


def _seed(seed: int | None) -> int:
    # an unseeded sampling request still needs a seed for the keyed random streams
    return seed if seed is not None else time.time_ns() & 0x7FFFFFFFFFFFFFFF


def require_ready(rt: Runtime) -> None:
    if rt.draining_since is not None:
        raise HTTPException(503, detail="the server is shutting down; retry on another replica",
                            headers={"Retry-After": "1"})
    if rt.tokenizer is None or rt.limits is None:
        raise HTTPException(503, detail=f"not ready: {rt.not_ready}")
    if rt.not_ready.startswith(("draft and target tokenizers differ", "the draft's vocabulary")):
        raise HTTPException(503, detail=f"not ready: {rt.not_ready}")


async def tokenize(rt: Runtime, key: str | None, fn: Callable[..., list[int]], *args: Any) -> list[int]:
    """``fn(*args)`` (prompt -> token ids) on :attr:`Runtime.tokenizer_thread`, after the admission
    checks that need no tokens: a request that would get 429 is refused before its prompt costs anything."""
    require_ready(rt)
    check_admission(rt, key)
    return await asyncio.get_running_loop().run_in_executor(rt.tokenizer_thread, fn, *args)


def check_admission(rt: Runtime, key: str | None) -> None:
    """429 when every slot, or every slot of ``key``, is taken (takes none)."""
    s = rt.settings
    if rt.active >= s.max_concurrent_requests:
        raise too_busy(f"too many concurrent requests (limit {s.max_concurrent_requests}); retry shortly")
    if key is not None and rt.active_per_key.get(key, 0) >= s.max_concurrent_requests_per_key:
        raise too_busy(f"too many concurrent requests for this API key (limit {s.max_concurrent_requests_per_key}); "
                       "retry shortly")


def encode_prompt(rt: Runtime, prompt: str) -> list[int]:
    require_ready(rt)
    try:
        return rt.tokenizer(prompt).input_ids
    except Exception as exc:  # text the tokenizer cannot encode is the client's problem, not ours
        raise HTTPException(400, detail=f"prompt: the tokenizer cannot encode it: {exc}") from exc


def request_prompt(rt: Runtime, body: GenerateRequest) -> list[int]:
    """Token ids of a /v1/generate body: its prompt as is, or its messages through the chat template."""
    if body.messages is None:
        return encode_prompt(rt, body.prompt)
    from orchestrator.openai_api import chat_prompt_ids

    return chat_prompt_ids(rt, body.messages)


def prepare(rt: Runtime, spec: SpeculationParams, prompt_ids: list[int], max_tokens: int | None,
            stop: list[str] | str | None, ignore_eos: bool, sampling: sm.Sampling, key: str | None = None) -> Run:
    require_ready(rt)
    s = rt.settings
    limits = rt.limits
    if not prompt_ids:
        raise HTTPException(400, detail="prompt: encodes to no tokens")
    if len(prompt_ids) >= limits.target_max_context:
        raise HTTPException(
            400, detail=f"prompt: {len(prompt_ids)} tokens, over the model's context of {limits.target_max_context - 1}"
        )
    max_tokens = max_tokens if max_tokens is not None else s.default_max_tokens
    if max_tokens > s.max_tokens_limit:
        raise HTTPException(422, detail=f"max_tokens: {max_tokens} is over the limit of {s.max_tokens_limit}")
    name = spec.controller or s.default_controller
    if name == "cost" and not sampling.greedy:
        # Sampled output depends on the k schedule, and the cost controller's schedule depends on
        # timings; the acceptance rule depends only on the (seeded) outcomes, so a seeded sampling
        # request stays reproducible.
        name = "acceptance"
    k = spec.k if spec.k is not None else s.default_k
    max_k = spec.max_k if spec.max_k is not None else max(s.default_max_k, k)
    if k > max_k:
        raise HTTPException(422, detail=f"k: {k} is over max_k {max_k}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    params = GenerationParams(
        prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling, stop=stops, mode=spec.mode,
        confidence_threshold=(spec.confidence_threshold if spec.confidence_threshold is not None
                              else s.default_confidence_threshold),
        ignore_eos=ignore_eos,
        overlap=spec.overlap if spec.overlap is not None else {"on": True, "off": False, "auto": None}[s.default_overlap],
    )
    # Admission last (again: slots may have filled while the prompt was tokenised): everything
    # above only reads, so a rejected request holds no slot.
    check_admission(rt, key)
    rt.active += 1
    rt.costs.streams = rt.active
    if key is not None:
        rt.active_per_key[key] = rt.active_per_key.get(key, 0) + 1
    return Run(rt, params, name, k, max_k, len(prompt_ids), key)


async def events(run: Run, request: Request | None) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """("step", StepEvent dict) per iteration, then ("done", result); errors as HTTPException."""
    rt = run.rt
    controller = make_controller(run.controller_name, run.k, run.max_k, rt.costs)
    token_ids: list[int] = []
    tokenizer = rt.tokenizer  # the one this request was tokenised with, whatever a re-check loads meanwhile

    async def stop() -> bool:
        """The client went away, or the drain's time is up."""
        return rt.drain_expired() or (request is not None and await request.is_disconnected())

    try:
        async for item in generate(run.params, rt.draft, rt.target, controller, rt.limits, rt.draft_health,
                                   lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop,
                                   in_progress=lambda: rt.active):
            if isinstance(item, StepEvent):
                token_ids.extend(item.tokens)
                yield "step", item.to_dict()
            else:
                finish, text, stats = item
                if finish == "cancelled" and rt.drain_expired():
                    raise HTTPException(503, detail=f"the server shut down before the answer was complete "
                                                    f"({len(token_ids)} tokens generated); retry the request")
                yield "done", result_dict(finish, text, token_ids, stats, run)
    except TargetBusy as exc:
        raise too_busy(str(exc)) from exc
    except TargetUnavailable as exc:
        raise HTTPException(503, detail=str(exc)) from exc
    except BadRequest as exc:
        raise HTTPException(400, detail=str(exc)) from exc
    finally:
        run.release()


def result_dict(finish: str, text: str, token_ids: list[int], stats: GenerationStats, run: Run) -> dict[str, Any]:
    return {"text": text, "token_ids": token_ids, "finish_reason": finish, "prompt_tokens": run.prompt_tokens,
            "mode": run.params.mode, "controller": run.controller_name, "stats": stats.to_dict()}


async def collect(run: Run, request: Request | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    steps, result = [], {}
    async for kind, payload in events(run, request):
        if kind == "step":
            steps.append(payload)
        else:
            result = payload
    return steps, result


async def start_stream(run: Run, request: Request) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Run the first step before the response starts, so a target that is down still gets a
    proper 503 instead of an event stream; later failures become an `error` event."""
    gen = events(run, request)
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:  # pragma: no cover - a generation always yields at least "done"
        first = None

    async def rest() -> AsyncIterator[tuple[str, dict[str, Any]]]:
        try:
            if first is not None:
                yield first
            async for item in gen:
                yield item
        except HTTPException as exc:
            yield "error", {"status": exc.status_code, "detail": exc.detail}
        finally:
            await gen.aclose()

    return rest()


def to_step(s: dict[str, Any]) -> Step:
    correction = s["next_token"] if s["next_kind"] == "correction" else None
    bonus = s["next_token"] if s["next_kind"] != "correction" else None
    return Step(draft=s["draft"], accepted=s["accepted"], correction=correction, bonus=bonus, k=s["k"],
                draft_ms=round(s["draft_ms"], 3), verify_ms=round(s["verify_ms"], 3), predrafted=s["predrafted"])
