"""evaluation.client: request bodies, answered requests and their failures, the SSE parser over a
real httpx stream, Retry-After and token comparison. No services, no models."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from sse_starlette import ServerSentEvent

from evaluation.client import (
    RequestFailed,
    first_difference,
    generate_body,
    post_json,
    retry_after,
    sse_events,
    sync_client,
)
from evaluation.prompts import Prompt

# ---- generate_body --------------------------------------------------------------------------------


def test_generate_body_sends_plain_prompts_as_text_and_chat_prompts_as_a_user_message():
    plain, chat = Prompt("p", "story", False, "Once upon"), Prompt("c", "chat_qa", True, "Why is the sky blue?")
    assert generate_body(plain, 16) == {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "prompt": "Once upon"}
    assert generate_body(chat, 16) == {"max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                       "messages": [{"role": "user", "content": "Why is the sky blue?"}]}


def test_generate_body_adds_the_mode_and_controller_fields_and_they_override_the_defaults():
    plain = Prompt("p", "story", False, "Once upon")
    body = generate_body(plain, 8, mode="speculative", controller="fixed", k=4, overlap=False, include_steps=True)
    assert body == {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "mode": "speculative", "controller": "fixed",
                    "k": 4, "overlap": False, "include_steps": True, "prompt": "Once upon"}
    assert generate_body(plain, 8, temperature=0.7)["temperature"] == 0.7  # sampled when asked


# ---- sse_events -------------------------------------------------------------------------------------

# What the orchestrator's stream sends (sse_starlette's encoder): \r\n line ends, a keep-alive
# comment, data over two lines, an event without a name
WIRE = b"".join([
    ServerSentEvent(comment="ping").encode(),
    ServerSentEvent(event="step", data='{"tokens": [5, 6],\n "k": 3}').encode(),
    ServerSentEvent(data="[1, 2]").encode(),
    ServerSentEvent(comment="ping").encode(),
    ServerSentEvent(event="done", data=json.dumps({"token_ids": [5, 6, 7]})).encode(),
])


def streaming_client(chunks: AsyncIterator[bytes]) -> httpx.AsyncClient:
    """A client whose every response streams ``chunks`` as its body."""
    return httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=chunks)))


async def events_of(chunks: AsyncIterator[bytes]) -> list[tuple[str, object]]:
    async with streaming_client(chunks) as http, http.stream("POST", "http://specdec/v1/generate/stream") as r:
        return [e async for e in sse_events(r)]


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


@pytest.mark.parametrize("size", [1, 7, len(WIRE)])
async def test_sse_events_parse_named_multi_line_and_unnamed_events_and_skip_comments(size):
    # chunk boundaries anywhere, even inside a \r\n, change nothing
    assert await events_of(pieces(WIRE, size)) == [("step", {"tokens": [5, 6], "k": 3}), ("message", [1, 2]),
                                                   ("done", {"token_ids": [5, 6, 7]})]


async def test_sse_events_yield_each_event_before_the_next_is_sent():
    first_read = asyncio.Event()

    async def server() -> AsyncIterator[bytes]:
        yield ServerSentEvent(event="step", data='{"n": 1}').encode()
        await first_read.wait()  # the parser must hand the first event over before this returns
        yield ServerSentEvent(event="done", data='{"n": 2}').encode()

    async def read() -> list[tuple[str, object]]:
        seen = []
        async with streaming_client(server()) as http, http.stream("POST", "http://specdec/v1/generate/stream") as r:
            async for event in sse_events(r):
                seen.append(event)
                first_read.set()
        return seen

    assert await asyncio.wait_for(read(), timeout=10) == [("step", {"n": 1}), ("done", {"n": 2})]


async def test_sse_events_drop_an_event_the_stream_ends_inside():
    cut = ServerSentEvent(event="step", data='{"n": 1}').encode() + b"event: done\r\ndata: {}\r\n"
    assert await events_of(pieces(cut, len(cut))) == [("step", {"n": 1})]


async def test_sse_events_raise_valueerror_on_data_that_is_not_json():
    # the load benchmark counts this as a "malformed" response
    with pytest.raises(ValueError):
        await events_of(pieces(b"event: step\ndata: {not json\n\n", 64))


# ---- first_difference -------------------------------------------------------------------------------


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([], []) is None
    assert first_difference([1, 2, 3], [9, 2, 3]) == 0
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2, 9]) == 2
    assert first_difference([1, 2, 3], [1, 2]) == 2  # a prefix differs where it ends, either way round
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [7]) == 0
    assert first_difference([1, 5, 3], [1, 2]) == 1  # a real difference comes before the length's
    assert first_difference((1, 2), [1, 2]) is None  # any sequences of ids


# ---- post_json and retry_after ---------------------------------------------------------------------


def test_post_json_returns_the_answer_with_its_wall_time_and_names_a_failure():
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        if request.url.path == "/full":
            return httpx.Response(429, text="x" * 600)
        return httpx.Response(200, json={"ok": True})

    with httpx.Client(transport=httpx.MockTransport(answer)) as http:
        out, wall_ms = post_json(http, "http://h/v1/generate", {"a": 1}, "mode on p")
        assert out == {"ok": True} and wall_ms >= 0
        with pytest.raises(RequestFailed, match=r"^mode on p: HTTP 429: x{500}$"):  # the body's start only
            post_json(http, "http://h/full", {}, "mode on p")
    assert seen == [("/v1/generate", {"a": 1}), ("/full", {})]


def test_clients_send_the_api_key_and_wait_for_a_whole_answer():
    with sync_client("sk-1", timeout_s=60) as http:
        assert http.headers["authorization"] == "Bearer sk-1"
        assert (http.timeout.read, http.timeout.connect) == (60, 10)
    with sync_client() as http:
        assert "authorization" not in http.headers


def test_retry_after_reads_seconds_only():
    assert retry_after("1") == 1.0 and retry_after("0.5") == 0.5 and retry_after("-3") == 0.0
    assert retry_after(None) is None and retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
