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

from fastapi import APIRouter, HTTPException, Request

from orchestrator.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from orchestrator.streams import BoundedEventSource
from specdec import params as sm

router = APIRouter(prefix="/v1", tags=["openai"])


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(result: dict[str, Any]) -> dict[str, int]:
    prompt, completion = result["prompt_tokens"], len(result["token_ids"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def special_strings(tok: Any) -> list[str]:
    """The texts a tokenizer turns into special tokens (``<|im_start|>``, ``<|endoftext|>``, …)."""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    return sorted({*tok.all_special_tokens, *(a.content for a in added.values() if a.special)} - {""})


def chat_prompt(rt: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template (a plain transcript
    for tokenizers without one, such as GPT-2's).

    What users write is text, never control tokens: ``<|im_start|>system`` typed into a message
    stays those characters, so no one forges a turn of another role. Only the template's own
    markup becomes special tokens: a message holding such text is rendered with a placeholder in
    its place, and its content tokenised apart with special tokens split into plain text."""
    tok = rt.tokenizer
    if not getattr(tok, "chat_template", None):
        transcript = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
        return tok(transcript, split_special_tokens=True).input_ids
    specials = special_strings(tok)
    if not any(s in m["content"] for m in messages for s in specials):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids
    marks = [f"\ue000specdec-content-{i}\ue001" for i in range(len(messages))]
    text = tok.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)],
                                   add_generation_prompt=True, tokenize=False)
    if any(text.count(mark) != 1 for mark in marks):
        raise ValueError("this chat template rewrites message content, so content holding special-token text "
                         f"({', '.join(specials[:3])}, …) cannot be kept as text; remove it from the messages")
    ids: list[int] = []
    for m, mark in zip(messages, marks, strict=True):
        before, text = text.split(mark)
        ids += tok(before, add_special_tokens=False).input_ids
        ids += tok(m["content"], add_special_tokens=False, split_special_tokens=True).input_ids
    return ids + tok(text, add_special_tokens=False).input_ids


def chat_prompt_ids(rt: Any, messages: list[ChatMessage]) -> list[int]:
    """Validated chat messages -> prompt token ids (HTTP 400 when the template rejects them)."""
    from orchestrator.app import require_ready

    require_ready(rt)
    try:
        return chat_prompt(rt, [{"role": m.role, "content": m.text()} for m in messages])
    except Exception as exc:  # a template may reject a conversation shape (e.g. roles out of order)
        raise HTTPException(400, detail=f"messages: the chat template rejected them: {exc}") from exc


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """The one model this deployment serves (the target; the draft only speeds it up)."""
    rt = request.app.state.rt
    return {"object": "list", "data": [{"id": rt.model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completion."""
    from orchestrator.app import client_key, encode_prompt, prepare, tokenize

    rt = request.app.state.rt
    sampling = sm.Sampling(body.temperature, body.top_p, body.top_k, _seed(body.seed))
    prompt_ids = await tokenize(rt, client_key(request), encode_prompt, rt, body.prompt)
    run = prepare(rt, body, prompt_ids, body.max_tokens, body.stop, False, sampling, client_key(request))
    return await _respond(run, request, body.stream, chat=False)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completion (the prompt is built with the tokenizer's chat template)."""
    from orchestrator.app import client_key, prepare, tokenize

    rt = request.app.state.rt
    prompt_ids = await tokenize(rt, client_key(request), chat_prompt_ids, rt, body.messages)
    sampling = sm.Sampling(body.temperature, body.top_p, body.top_k, _seed(body.seed))
    max_tokens = body.max_completion_tokens or body.max_tokens
    run = prepare(rt, body, prompt_ids, max_tokens, body.stop, False, sampling, client_key(request))
    return await _respond(run, request, body.stream, chat=True)


def _seed(seed: int | None) -> int:
    from orchestrator.app import _seed as seed_of

    return seed_of(seed)


async def _respond(run: Any, request: Request, stream: bool, chat: bool):
    from orchestrator.app import collect, start_stream

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
            if event == "step" and payload["text"]:
                yield {"data": chunk(payload["text"], None)}
            elif event == "done":
                yield {"data": chunk(None, _finish(payload["finish_reason"]),
                                     extra={"usage": _usage(payload), "specdec": payload["stats"]})}
            elif event == "error":
                yield {"data": json.dumps({"error": {"message": payload["detail"], "code": payload["status"]}})}
                break
        yield {"data": "[DONE]"}

    return BoundedEventSource(sse(), rt.settings.stream_send_timeout_s)
