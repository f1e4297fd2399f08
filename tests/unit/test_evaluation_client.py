"""evaluation.client: request bodies, the SSE parser over a real httpx stream, token comparison and
results files. No services, no models."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sse_starlette import ServerSentEvent

from evaluation.client import first_difference, generate_body, sse_events, write_results
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


# ---- write_results ----------------------------------------------------------------------------------


def test_write_results_writes_strict_json_with_non_finite_numbers_as_null(tmp_path):
    results = {"speedup": math.nan, "runs": [{"ms": math.inf, "k": (1, -math.inf, 2.5)}], "out": tmp_path, "ok": 1.5}
    path = write_results(tmp_path, results)
    assert path == tmp_path / "results.json"
    text = path.read_text()

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in the file")

    assert json.loads(text, parse_constant=no_constants) == {
        "speedup": None, "runs": [{"ms": None, "k": [1, None, 2.5]}], "out": str(tmp_path), "ok": 1.5}
    assert text.startswith('{\n "speedup"')  # indented by one
    assert math.isnan(results["speedup"])  # the caller's results are left as they were


def test_write_results_takes_the_file_name(tmp_path):
    assert write_results(str(tmp_path), [1.0], "rtt.json") == Path(tmp_path) / "rtt.json"
    assert json.loads((tmp_path / "rtt.json").read_text()) == [1.0]
