"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both with stream), /v1/models.

The official ``openai`` client works unchanged; speculation statistics ride along in an extra
``specdec`` field of the response (and of the last stream chunk).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from orchestrator import tools
from orchestrator.openai_errors import OpenAIError, error_body
from orchestrator.schemas import MAX_SEED, ChatCompletionRequest, CompletionRequest, OpenAIRequest
from orchestrator.service import (
    chat_prompt_ids,
    client_key,
    collect,
    encode_prompt,
    prepare,
    prompt_size,
    seed_of,
    start_stream,
    tokenize,
)
from orchestrator.streams import BoundedEventSource
from orchestrator.structured import grammar_of
from specdec.params import Sampling

router = APIRouter(prefix="/v1", tags=["openai"])


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's characters back to the bytes they stand for: GPT-2's table, which every
    byte-level BPE tokenizer shares (printable Latin-1 bytes stand for themselves, the other 68
    for the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def _piece(tokenizer: Any, token_id: int) -> tuple[str, bytes]:
    """A token's own bytes (a byte-level BPE token may hold part of a character) and its text."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id)) or ""
    table = _byte_decoder()
    if token_id in getattr(tokenizer, "all_special_ids", ()):
        raw = piece.encode()
    elif piece and all(c in table for c in piece):
        raw = bytes(table[c] for c in piece)
    elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # SentencePiece byte fallback
        raw = bytes([int(piece[3:5], 16)])
    else:
        raw = piece.replace("\u2581", " ").encode()
    return raw.decode("utf-8", errors="replace"), raw


def _chat_logprobs(tokenizer: Any, ids: list[int], entries: list[Any]) -> dict[str, Any]:
    content = []
    for token_id, e in zip(ids, entries, strict=False):
        text, raw = _piece(tokenizer, token_id)
        tops = []
        for top_id, lp in zip(e.top_ids, e.top_logprobs, strict=True):
            top_text, top_raw = _piece(tokenizer, top_id)
            tops.append({"token": top_text, "logprob": lp, "bytes": list(top_raw)})
        content.append({"token": text, "logprob": e.logprob, "bytes": list(raw), "top_logprobs": tops})
    return {"content": content, "refusal": None}


def _completion_logprobs(tokenizer: Any, ids: list[int], entries: list[Any], top: int, offset: int = 0
                         ) -> dict[str, Any]:
    """OpenAI's legacy shape; text_offset counts characters from the completion's start (``offset``
    for the tokens before these)."""
    tokens, offsets = [], []
    for token_id in ids[:len(entries)]:
        offsets.append(offset)
        text = _piece(tokenizer, token_id)[0]
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_piece(tokenizer, i)[0]: lp for i, lp in zip(e.top_ids, e.top_logprobs, strict=True)}
                             for e in entries] if top else None,
            "text_offset": offsets}


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(results: list[dict[str, Any]]) -> dict[str, int]:
    # the tokens of the text returned: a stop string may end inside a block of accepted tokens; the
    # choices share one prompt
    prompt, completion = results[0]["prompt_tokens"], sum(r["completion_tokens"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """The one model this deployment serves (the target; the draft only speeds it up)."""
    rt = request.app.state.rt
    return {"object": "list", "data": [{"id": rt.model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}


def check_model(rt: Any, body: OpenAIRequest) -> None:
    """404 (OpenAI's model_not_found) for a model this server does not serve; none given is the
    served one."""
    if not rt.settings.model_name and not rt.target_info:
        return  # the served name is not known yet: the request is refused as not ready anyway
    if body.model is not None and body.model != rt.model_name:
        raise OpenAIError(404, f"the model {body.model!r} does not exist here; this server serves {rt.model_name!r} "
                               "(GET /v1/models)", param="model", code="model_not_found")


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completion."""
    rt = request.app.state.rt
    check_model(rt, body)
    if body.tools or body.tool_choice not in (None, "none", "auto"):
        raise HTTPException(400, detail="tools: tool calls are a chat completions feature (/v1/chat/completions)")
    sampling = Sampling(body.temperature, body.top_p, body.top_k, seed_of(body.seed), await grammar_of(body),
                        **body.processing())
    prompt_ids, slots = await tokenize(rt, client_key(request), encode_prompt, rt, body.prompt, n=body.n,
                                       size=prompt_size(rt, body.prompt))
    runs = _runs(rt, body, prompt_ids, body.max_tokens, sampling, slots)
    return await _respond(runs, request, body.stream, chat=False, echo=body.prompt if body.echo else "")


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completion (the prompt is built with the tokenizer's chat template)."""
    rt = request.app.state.rt
    check_model(rt, body)
    grammar = await grammar_of(body)
    tool_plan = await run_in_threadpool(tools.plan, body.tools, body.tool_choice)
    if tool_plan is not None and tool_plan.forced:
        if grammar:
            raise HTTPException(400, detail=f"tool_choice: {body.tool_choice!r} generates a tool call, which cannot "
                                            "also follow response_format; drop one of them")
        grammar = tool_plan.grammar  # the call is generated under the grammar of its parameters
    sampling = Sampling(body.temperature, body.top_p, body.top_k, seed_of(body.seed), grammar, **body.processing())
    prompt_ids, slots = await tokenize(rt, client_key(request), chat_prompt_ids, rt, body.messages, tool_plan,
                                       n=body.n, size=prompt_size(rt, None, body.messages))
    # OpenAI's chat has no default length: to EOS or the end of the context (up to the server's limit)
    max_tokens = body.max_completion_tokens or body.max_tokens or rt.settings.max_tokens_limit
    runs = _runs(rt, body, prompt_ids, max_tokens, sampling, slots)
    return await _respond(runs, request, body.stream, chat=True, tool_plan=tool_plan)


def _runs(rt: Any, body: OpenAIRequest, prompt_ids: list[int], max_tokens: int | None, sampling: Sampling,
          slots: list[Any]) -> list[Any]:
    """One :class:`Run` per choice, each on its slot; choice i samples with seed + i (a greedy
    request's choices are alike). A refusal releases every slot."""
    runs = []
    processed = (body.logprobs_mode or rt.settings.logprobs_mode) == "processed_logprobs"
    try:
        for i, slot in enumerate(slots):
            choice = dataclasses.replace(sampling, seed=(sampling.seed + i) % MAX_SEED)
            runs.append(prepare(rt, body, prompt_ids, max_tokens, body.stop, body.ignore_eos, choice, slot,
                                body.logprob_count(), processed))
    except BaseException:
        for slot in slots:
            slot.release()
        raise
    return runs


def _message(text: str, tool_plan: Any, finish: str) -> tuple[dict[str, Any], str]:
    """The chat reply's message and finish_reason: with tools, the calls parsed out of the text."""
    if tool_plan is not None:
        content, calls = tools.parse(text, tool_plan)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, finish


async def _respond(runs: list[Any], request: Request, stream: bool, chat: bool, tool_plan: Any = None,
                   echo: str = ""):
    """The reply to a request's choices: the whole completion, or its event stream; a failure
    before streaming starts (for a whole completion: any failure) frees every choice's slot."""
    reply = _Reply(runs, stream, chat, tool_plan, echo)
    try:
        if not stream:
            return reply.completion(await _all(collect(run, request) for run in runs))
        streams = await _all(start_stream(run, request) for run in runs)
    except BaseException:
        for run in runs:  # the choices that never started hold their slots until here
            run.release()
        raise
    return BoundedEventSource(reply.sse(streams), reply.rt.settings.stream_send_timeout_s)


class _Reply:
    """One OpenAI reply to a request's choices (``runs``): a whole completion, or its stream of
    chunks, in the chat or the legacy completion shape."""

    def __init__(self, runs: list[Any], stream: bool, chat: bool, tool_plan: Any, echo: str) -> None:
        self.rt = runs[0].rt
        self.tokenizer = self.rt.tokenizer
        self.ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = self.rt.model_name
        self.top = runs[0].params.logprobs
        self.wants_logprobs = self.top is not None
        self.kind = ("chat.completion" if chat else "text_completion") + (".chunk" if stream and chat else "")
        self.chat, self.tool_plan, self.echo = chat, tool_plan, echo
        # With stop strings a step's tokens may end past the text returned: their logprobs come with
        # the last chunk, cut to the tokens of the text; without, with each step's text.
        # With tools the text is held until the end, where the calls are parsed out of it.
        self.per_step = not runs[0].params.stop and tool_plan is None
        self.several = len(runs) > 1

    def logprobs_of(self, ids: list[int], entries: list[Any], offset: int = 0) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        return (_chat_logprobs(self.tokenizer, ids, entries) if self.chat
                else _completion_logprobs(self.tokenizer, ids, entries, self.top, offset))

    def completion(self, results: list[Any]) -> dict[str, Any]:
        """The whole reply, from each choice's (_, result)."""
        choices = []
        for index, (_, result) in enumerate(results):
            finish = _finish(result["finish_reason"])
            lp = self.logprobs_of(result["token_ids"], result["logprobs"] or [])
            if self.chat:
                message, finish = _message(result["text"], self.tool_plan, finish)
                choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": lp})
            else:
                choices.append({"index": index, "text": self.echo + result["text"], "finish_reason": finish,
                                "logprobs": lp})
        stats = [result["stats"] for _, result in results]
        return {"id": self.ident, "object": self.kind, "created": self.created, "model": self.model, "choices": choices,
                "usage": _usage([result for _, result in results]),
                "specdec": stats if self.several else stats[0]}

    def chunk(self, index: int, delta: str | None, finish: str | None, first: bool = False, extra: dict | None = None,
              logprobs: dict[str, Any] | None = None, calls: list[dict[str, Any]] | None = None) -> str:
        if self.chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if delta:
                d["content"] = delta
            if calls:
                d["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            choice = {"index": index, "delta": d, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
        return json.dumps({"id": self.ident, "object": self.kind, "created": self.created, "model": self.model,
                           "choices": [choice], **(extra or {})})

    async def choice_sse(self, index: int, events: AsyncIterator[Any]) -> AsyncIterator[tuple[str, Any]]:
        """("data", chunk) items of one choice, then ("done", its result) or ("error", body)."""
        try:
            async for item in self._choice_items(index, events):
                yield item
        finally:
            await events.aclose()  # a client gone: the generation ends and frees its slot now

    async def _choice_items(self, index: int, events: AsyncIterator[Any]) -> AsyncIterator[tuple[str, Any]]:
        offset = 0
        if self.chat:
            yield "data", self.chunk(index, None, None, first=True)
        elif self.echo:
            yield "data", self.chunk(index, self.echo, None)
        async for event, payload in events:
            if event == "step" and self.tool_plan is not None:
                continue  # the text comes with "done", the calls parsed out of it
            if event == "step" and (payload.text or (self.per_step and self.wants_logprobs and payload.tokens)):
                lp = self.logprobs_of(payload.tokens, payload.logprobs or [], offset) if self.per_step else None
                offset += len(payload.text)
                yield "data", self.chunk(index, payload.text, None, logprobs=lp)
            elif event == "done":
                for item in self._last_chunks(index, payload):
                    yield item
            elif event == "error":
                yield "error", json.dumps(error_body(payload["status"], payload["detail"]))
                return

    def _last_chunks(self, index: int, payload: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        """A choice's closing items: the tool calls parsed out of its text, its finish, its result."""
        lp = None
        if self.wants_logprobs and not self.per_step:
            lp = self.logprobs_of(payload["token_ids"], payload["logprobs"] or [])
        finish = _finish(payload["finish_reason"])
        if self.tool_plan is not None:
            message, finish = _message(payload["text"], self.tool_plan, finish)
            if message["content"] or message.get("tool_calls"):
                yield "data", self.chunk(index, message["content"], None, calls=message.get("tool_calls"))
        # one choice: usage and statistics ride on its last chunk; several: a chunk of their own
        extra = None if self.several else {"usage": _usage([payload]), "specdec": payload["stats"]}
        yield "data", self.chunk(index, None, finish, logprobs=lp, extra=extra)
        yield "done", payload

    async def sse(self, streams: list[AsyncIterator[Any]]) -> AsyncIterator[dict[str, str]]:
        results = []
        async for item, data in merge([self.choice_sse(i, events) for i, events in enumerate(streams)]):
            if item == "done":
                results.append(data)
                continue
            yield {"data": data}
            if item == "error":
                break
        else:
            if self.several:
                yield {"data": json.dumps({"id": self.ident, "object": self.kind, "created": self.created,
                                           "model": self.model, "choices": [], "usage": _usage(results),
                                           "specdec": [r["stats"] for r in results]})}
        yield {"data": "[DONE]"}


async def _all(calls: Any) -> list[Any]:
    """Every awaitable's result, in order; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async iterators as they come (one: that iterator as is); closing this
    one cancels and closes them all."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))  # a slow client slows the choices
    end = object()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        finally:
            await queue.put(end)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is end:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
