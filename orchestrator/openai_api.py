"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both with stream), /v1/models.

The official ``openai`` client works unchanged; speculation statistics ride along in an extra
``specdec`` field of the response (and of the last stream chunk).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from orchestrator.schemas import ChatCompletionRequest, CompletionRequest
from orchestrator.service import (
    chat_prompt_ids,
    client_key,
    collect,
    encode_prompt,
    prepare,
    seed_of,
    start_stream,
    tokenize,
)
from orchestrator.streams import BoundedEventSource
from specdec.params import Sampling

router = APIRouter(prefix="/v1", tags=["openai"])


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(result: dict[str, Any]) -> dict[str, int]:
    prompt, completion = result["prompt_tokens"], len(result["token_ids"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """The one model this deployment serves (the target; the draft only speeds it up)."""
    rt = request.app.state.rt
    return {"object": "list", "data": [{"id": rt.model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completion."""
    rt = request.app.state.rt
    sampling = Sampling(body.temperature, body.top_p, body.top_k, seed_of(body.seed))
    prompt_ids = await tokenize(rt, client_key(request), encode_prompt, rt, body.prompt)
    run = prepare(rt, body, prompt_ids, body.max_tokens, body.stop, False, sampling, client_key(request))
    return await _respond(run, request, body.stream, chat=False)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completion (the prompt is built with the tokenizer's chat template)."""
    rt = request.app.state.rt
    prompt_ids = await tokenize(rt, client_key(request), chat_prompt_ids, rt, body.messages)
    sampling = Sampling(body.temperature, body.top_p, body.top_k, seed_of(body.seed))
    max_tokens = body.max_completion_tokens or body.max_tokens
    run = prepare(rt, body, prompt_ids, max_tokens, body.stop, False, sampling, client_key(request))
    return await _respond(run, request, body.stream, chat=True)


async def _respond(run: Any, request: Request, stream: bool, chat: bool):
    rt = run.rt
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = rt.model_name
    if not stream:
        _, result = await collect(run, request)
        finish = _finish(result["finish_reason"])
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result["text"]}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result["text"], "finish_reason": finish, "logprobs": None}
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": [choice], "usage": _usage(result), "specdec": result["stats"]}

    events = await start_stream(run, request)
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None, first: bool = False, extra: dict | None = None) -> str:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if delta:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return json.dumps({"id": ident, "object": kind, "created": created, "model": model, "choices": [choice],
                           **(extra or {})})

    async def sse() -> AsyncIterator[dict[str, str]]:
        if chat:
            yield {"data": chunk(None, None, first=True)}
        async for event, payload in events:
            if event == "step" and payload.text:
                yield {"data": chunk(payload.text, None)}
            elif event == "done":
                yield {"data": chunk(None, _finish(payload["finish_reason"]),
                                     extra={"usage": _usage(payload), "specdec": payload["stats"]})}
            elif event == "error":
                yield {"data": json.dumps({"error": {"message": payload["detail"], "code": payload["status"]}})}
                break
        yield {"data": "[DONE]"}

    return BoundedEventSource(sse(), rt.settings.stream_send_timeout_s)
