"""Serving one generation request, whatever route it came by (REST in orchestrator.app, OpenAI in
orchestrator.openai_api): readiness and admission checks, tokenising off the event loop, chat
templates, the request's :class:`Run` (its slot), and its events from the loop as HTTP errors a
client can act on."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request
from prometheus_client import Gauge

from orchestrator.controller import make_controller
from orchestrator.generation import (
    BadRequest,
    GenerationParams,
    GenerationResult,
    TargetBusy,
    TargetUnavailable,
)
from orchestrator.loop import generate
from orchestrator.runtime import Runtime
from orchestrator.schemas import ChatMessage, GenerateRequest, SpeculationParams, Step
from specdec.params import Sampling

WAITING = Gauge("specdec:num_requests_waiting", "Requests in the admission queue, waiting for a slot.", ["model_name"])


@dataclass
class Slot:
    """One of ``max_concurrent_requests`` (and of the key's ``max_concurrent_requests_per_key``),
    held from admission to :meth:`release`; a release wakes the admission queue."""

    rt: Runtime
    key: str | None = None
    queued_s: float = 0.0  # how long the request waited in the admission queue for it
    released: bool = False

    @classmethod
    def take(cls, rt: Runtime, key: str | None, queued_s: float = 0.0) -> Slot:
        rt.active += 1
        if key is not None:
            rt.active_per_key[key] = rt.active_per_key.get(key, 0) + 1
        return cls(rt, key, queued_s)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.rt.active -= 1
        if self.key is not None:
            left = self.rt.active_per_key.get(self.key, 1) - 1
            if left > 0:
                self.rt.active_per_key[self.key] = left
            else:
                self.rt.active_per_key.pop(self.key, None)
        self.rt.wake_waiters()


@dataclass
class Run:
    """A validated generation, ready to start; it holds its :class:`Slot` until :meth:`release`."""

    rt: Runtime
    params: GenerationParams
    controller_name: str
    k: int
    max_k: int
    prompt_tokens: int
    slot: Slot

    def release(self) -> None:
        self.slot.release()


# How long a client told 429 should wait before retrying: about one short generation.
RETRY_AFTER_S = 1


def too_busy(detail: str) -> HTTPException:
    return HTTPException(429, detail=detail, headers={"Retry-After": str(RETRY_AFTER_S)})


def client_key(request: Request | None) -> str | None:
    """Identity of the API key that authenticated the request (None without API keys)."""
    return getattr(request.state, "api_key_id", None) if request is not None else None


def seed_of(seed: int | None) -> int:
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


async def tokenize(rt: Runtime, key: str | None, fn: Callable[..., list[int]], *args: Any, n: int = 1,
                   size: tuple[int, int] = (0, 0)) -> tuple[list[int], list[Slot]]:
    """The prompt's ``size`` (characters, messages: :func:`check_size`), ``n`` slots (:func:`admit`:
    the admission queue; one per choice), then ``fn(*args)`` (prompt -> token ids) on
    :attr:`Runtime.tokenizer_thread`: a request too large or that cannot be admitted is refused
    before its prompt costs anything, and the tokenizer's queue holds no more than the slots. The
    slots go to :func:`prepare`; they are released here when tokenising fails."""
    check_size(rt, *size)
    slots = await admit(rt, key, n)
    try:
        ids = await asyncio.get_running_loop().run_in_executor(rt.tokenizer_thread, fn, *args)
    except BaseException:
        for slot in slots:
            slot.release()
        raise
    return ids, slots


# A prompt's characters may exceed what its tokens could stand for by this factor before it is
# refused unread (a normaliser may fold several characters into one, NFKC's e + U+0301 into é).
CHARS_SLACK = 2


def check_size(rt: Runtime, text_chars: int, messages: int = 0) -> None:
    """400 for a prompt that cannot fit the context whatever its tokens: more characters than
    ``context x the longest token x CHARS_SLACK``, or more messages than the context has tokens
    (each message renders to one at least). Cheap (the lengths only), so a megabyte prompt or a chat
    of thirty thousand messages is refused before it is templated, tokenised or queued."""
    require_ready(rt)
    context = rt.limits.target_max_context
    if messages > context:
        raise HTTPException(400, detail=f"messages: {messages} messages cannot fit the model's context of "
                                        f"{context} tokens")
    most = context * rt.token_chars * CHARS_SLACK
    if text_chars > most:
        raise HTTPException(400, detail=f"prompt: {text_chars} characters cannot fit the model's context of {context} "
                                        f"tokens (one token holds at most {rt.token_chars} characters)")


def has_slot(rt: Runtime, key: str | None, n: int = 1) -> bool:
    s = rt.settings
    return rt.active + n <= s.max_concurrent_requests and (
        key is None or rt.active_per_key.get(key, 0) + n <= s.max_concurrent_requests_per_key)


def check_admission(rt: Runtime, key: str | None) -> None:
    """429 when every slot, or every slot of ``key``, is taken (takes none)."""
    s = rt.settings
    if rt.active >= s.max_concurrent_requests:
        raise too_busy(f"too many concurrent requests (limit {s.max_concurrent_requests}); retry shortly")
    if key is not None and rt.active_per_key.get(key, 0) >= s.max_concurrent_requests_per_key:
        raise too_busy(f"too many concurrent requests for this API key (limit {s.max_concurrent_requests_per_key}); "
                       "retry shortly")


async def admit(rt: Runtime, key: str | None, n: int = 1) -> list[Slot]:
    """``n`` free slots at once (taken together: a request of several choices never holds part of
    them while it waits), else a place in the admission queue until they free (in order among the
    waiters whose key has room). 400 when ``n`` is over a limit it could never fit; 429 when the
    queue is full (``max_queued_requests``) or no slot freed within ``queue_timeout_s``; 503 when
    the server starts draining or stops being ready meanwhile."""
    require_ready(rt)
    s = rt.settings
    limit = min(s.max_concurrent_requests, s.max_concurrent_requests_per_key if key is not None else n)
    if n > limit:
        raise HTTPException(400, detail=f"n: {n} choices, over this server's {limit} concurrent generations "
                                        "per request; send fewer")
    if has_slot(rt, key, n):
        return [Slot.take(rt, key) for _ in range(n)]
    if len(rt.waiters) >= s.max_queued_requests:
        check_admission(rt, key)  # raises the 429 that names the limit
        raise too_busy(f"too many concurrent requests (limit {s.max_concurrent_requests}, {n} asked); retry shortly")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + s.queue_timeout_s
    gauge = WAITING.labels(rt.model_name)
    while True:
        waiter = loop.create_future()
        rt.waiters.append(waiter)
        gauge.set(len(rt.waiters))
        try:
            await asyncio.wait_for(waiter, max(deadline - loop.time(), 0))
        except TimeoutError:
            raise too_busy(f"no slot freed within queue_timeout_s ({s.queue_timeout_s:g} s): "
                           f"{rt.active} generations in progress, {len(rt.waiters) - 1} others waiting; "
                           "retry shortly") from None
        finally:
            rt.waiters.remove(waiter)
            gauge.set(len(rt.waiters))
        # checked and taken in one turn of the loop: the waiters ahead took theirs first
        require_ready(rt)
        if has_slot(rt, key, n):
            return [Slot.take(rt, key, loop.time() - t0) for _ in range(n)]


def prompt_size(rt: Runtime, prompt: str | None, messages: list[ChatMessage] | None = None) -> tuple[int, int]:
    """(characters, messages) of a request's prompt, for :func:`check_size`: the characters its
    tokenizer encodes (not whitespace, for one that drops it)."""
    texts = [prompt or ""] if messages is None else [m.text() for m in messages]
    chars = sum(len(t) if rt.encodes_spaces else len("".join(t.split())) for t in texts)
    return chars, 0 if messages is None else len(messages)


# Tokenising a long text starts with a prefix of this many characters per token the context holds,
# growing 4x a try: a text far over the context is refused after a prefix, not read whole.
PREFIX_CHARS_PER_TOKEN = 8


def encode_bounded(rt: Any, text: str, what: str = "prompt", most: int | None = None, **kwargs: Any) -> list[int]:
    """``rt.tokenizer(text, **kwargs).input_ids``, but a 400 as soon as a prefix of ``text``
    holds more tokens than the context (or ``most``): the whole text holds at least the prefix's
    tokens but one (the prefix's last may merge with what follows), so a megabyte prompt costs the
    tokenizer what the context's worth of text costs, not its whole length."""
    context = rt.limits.target_max_context
    most = context - 1 if most is None else most
    size = max(context, 1) * PREFIX_CHARS_PER_TOKEN
    while size < len(text):
        prefix = rt.tokenizer(text[:size], **kwargs).input_ids
        if len(prefix) - 1 > most:
            raise HTTPException(400, detail=f"{what}: more than {len(prefix) - 1} tokens (in its first {size} "
                                            f"characters), over the model's context of {context - 1}")
        size *= 4
    return rt.tokenizer(text, **kwargs).input_ids


def encode_prompt(rt: Runtime, prompt: str) -> list[int]:
    require_ready(rt)
    try:
        return encode_bounded(rt, prompt)
    except HTTPException:
        raise
    except Exception as exc:  # text the tokenizer cannot encode is the client's problem, not ours
        raise HTTPException(400, detail=f"prompt: the tokenizer cannot encode it: {exc}") from exc


def request_prompt(rt: Runtime, body: GenerateRequest) -> list[int]:
    """Token ids of a /v1/generate body: its prompt as is, or its messages through the chat template."""
    if body.messages is None:
        return encode_prompt(rt, body.prompt)
    return chat_prompt_ids(rt, body.messages)


def prepare(rt: Runtime, spec: SpeculationParams, prompt_ids: list[int], max_tokens: int | None,
            stop: list[str] | str | None, ignore_eos: bool, sampling: Sampling, slot: Slot,
            logprobs: int | None = None, processed_logprobs: bool = False) -> Run:
    """The request's :class:`Run`, holding ``slot`` (from :func:`tokenize`). Any refusal here
    releases the slot."""
    try:
        params, name, k, max_k = _params(rt, spec, prompt_ids, max_tokens, stop, ignore_eos, sampling, logprobs,
                                         processed_logprobs, slot.queued_s)
    except BaseException:
        slot.release()
        raise
    return Run(rt, params, name, k, max_k, len(prompt_ids), slot)


def _params(rt: Runtime, spec: SpeculationParams, prompt_ids: list[int], max_tokens: int | None,
            stop: list[str] | str | None, ignore_eos: bool, sampling: Sampling, logprobs: int | None,
            processed_logprobs: bool, queued_s: float) -> tuple[GenerationParams, str, int, int]:
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
    if sampling.grammar:
        if ignore_eos:
            raise HTTPException(400, detail="ignore_eos: a structured output ends with the end-of-sequence token its "
                                            "grammar allows; leave ignore_eos unset")
        sampling = dataclasses.replace(sampling, output_start=len(prompt_ids))  # the output starts after the prompt
    params = GenerationParams(
        prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling, stop=stops, mode=spec.mode,
        confidence_threshold=(spec.confidence_threshold if spec.confidence_threshold is not None
                              else s.default_confidence_threshold),
        ignore_eos=ignore_eos,
        overlap=spec.overlap if spec.overlap is not None else {"on": True, "off": False, "auto": None}[s.default_overlap],
        logprobs=logprobs,
        processed_logprobs=processed_logprobs,
        model_name=rt.model_name,
        queued_s=queued_s,
        draft_catch_up_chunk=s.draft_catch_up_chunk,
    )
    return params, name, k, max_k


# What a generation sends its route: ("step", Step) per iteration, then ("done", result_dict), or in
# a stream ("error", {"status", "detail"}) after a failure past the first step.
Event = tuple[str, Step | dict[str, Any]]


async def events(run: Run, request: Request | None) -> AsyncIterator[Event]:
    """("step", Step) per iteration, then ("done", result); errors as HTTPException."""
    rt = run.rt
    controller = make_controller(run.controller_name, run.k, run.max_k, rt.costs)
    token_ids: list[int] = []
    logprobs: list[Any] = []
    tokenizer = rt.tokenizer  # the one this request was tokenised with, whatever a re-check loads meanwhile

    async def stop() -> bool:
        """The client went away, or the drain's time is up."""
        return rt.drain_expired() or (request is not None and await request.is_disconnected())

    try:
        async for item in generate(run.params, rt.draft, rt.target, controller, rt.limits, rt.draft_health,
                                   lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop,
                                   in_progress=lambda: rt.active, background=rt.background):
            if isinstance(item, Step):
                token_ids.extend(item.tokens)
                logprobs.extend(item.logprobs or ())
                yield "step", item
            else:
                if item.finish_reason == "cancelled" and rt.drain_expired():
                    raise HTTPException(503, detail=f"the server shut down before the answer was complete "
                                                    f"({len(token_ids)} tokens generated); retry the request")
                yield "done", result_dict(item, token_ids, run, logprobs)
    except TargetBusy as exc:
        raise too_busy(str(exc)) from exc
    except TargetUnavailable as exc:
        raise HTTPException(503, detail=str(exc)) from exc
    except BadRequest as exc:
        raise HTTPException(400, detail=str(exc)) from exc
    finally:
        run.release()


def result_dict(result: GenerationResult, token_ids: list[int], run: Run, logprobs: list[Any] | None = None
                ) -> dict[str, Any]:
    covered = len(token_ids) if result.text_tokens is None else min(result.text_tokens, len(token_ids))
    return {"text": result.text, "token_ids": token_ids, "completion_tokens": covered,
            "logprobs": logprobs[:covered] if run.params.logprobs is not None else None,
            "finish_reason": result.finish_reason,
            "prompt_tokens": run.prompt_tokens, "mode": run.params.mode, "controller": run.controller_name,
            "stats": result.stats.to_dict()}


async def collect(run: Run, request: Request | None) -> tuple[list[Step], dict[str, Any]]:
    steps: list[Step] = []
    result: dict[str, Any] = {}
    async for kind, payload in events(run, request):
        if kind == "step":
            steps.append(payload)
        else:
            result = payload
    return steps, result


async def start_stream(run: Run, request: Request) -> AsyncIterator[Event]:
    """Run the first step before the response starts, so a target that is down still gets a
    proper 503 instead of an event stream; later failures become an `error` event."""
    gen = events(run, request)
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:  # pragma: no cover - a generation always yields at least "done"
        first = None

    async def rest() -> AsyncIterator[Event]:
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


def special_strings(tok: Any) -> list[str]:
    """The texts a tokenizer turns into special tokens (``<|im_start|>``, ``<|endoftext|>``, …)."""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    return sorted({*tok.all_special_tokens, *(a.content for a in added.values() if a.special)} - {""})


def chat_prompt(rt: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template (a plain transcript
    for tokenizers without one, such as GPT-2's).

    What users write is text, never control tokens: ``<|im_start|>system`` typed into a message
    stays those characters, so no one forges a turn of another role. Only the template's own
    markup becomes special tokens: a message holding such text is rendered with a placeholder in
    its place, and its content tokenised apart with special tokens split into plain text.
    ``tools``: passed to a template that renders them (orchestrator.tools)."""
    tok = rt.tokenizer
    extra = {"tools": tools} if tools else {}
    if not getattr(tok, "chat_template", None):
        transcript = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
        return encode_bounded(rt, transcript, "messages", split_special_tokens=True)
    specials = special_strings(tok)
    if not any(s in m["content"] for m in messages for s in specials):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        return encode_bounded(rt, text, "messages", add_special_tokens=False)
    marks = [f"\ue000specdec-content-{i}\ue001" for i in range(len(messages))]
    text = tok.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)],
                                   add_generation_prompt=True, tokenize=False, **extra)
    if any(text.count(mark) != 1 for mark in marks):
        raise ValueError("this chat template rewrites message content, so content holding special-token text "
                         f"({', '.join(specials[:3])}, …) cannot be kept as text; remove it from the messages")
    ids: list[int] = []
    most = rt.limits.target_max_context - 1
    for m, mark in zip(messages, marks, strict=True):
        before, text = text.split(mark)
        ids += tok(before, add_special_tokens=False).input_ids
        ids += encode_bounded(rt, m["content"], "messages", max(most - len(ids), 0), add_special_tokens=False,
                              split_special_tokens=True)
    return ids + tok(text, add_special_tokens=False).input_ids


def chat_prompt_ids(rt: Any, messages: list[ChatMessage], tool_plan: Any = None) -> list[int]:
    """Validated chat messages -> prompt token ids (HTTP 400 when the template rejects them);
    ``tool_plan``: the request's orchestrator.tools.ToolPlan, for the tools it offers."""
    from orchestrator import tools

    require_ready(rt)
    try:
        rendered, offered = tools.messages_for(tool_plan, messages, tools.template_takes_tools(rt.tokenizer))
        return chat_prompt(rt, rendered, offered)
    except HTTPException:
        raise
    except Exception as exc:  # a template may reject a conversation shape (e.g. roles out of order)
        raise HTTPException(400, detail=f"messages: the chat template rejected them: {exc}") from exc
