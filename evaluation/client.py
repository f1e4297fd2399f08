"""The evaluation CLIs' one HTTP client: of specdec's API, and of llama-server's for the comparison.

- :func:`sync_client`, :func:`async_client`: the httpx clients every command talks through
  (an API key as ``Authorization: Bearer``, a connect timeout apart from the answer's);
- :func:`post_json`: one request answered as a whole, timed on the client;
- :func:`generate_body`: the ``/v1/generate`` (and ``/v1/generate/stream``) request for a prompt of
  the suite;
- :func:`sse_events`: the events of a ``/v1/generate/stream`` response as they arrive;
- :func:`retry_after`: the delay a 429 asks for;
- :func:`first_difference`: where two generations of the same prompt part, token by token.

Importable without httpx, torch or the services.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from evaluation.prompts import Prompt

if TYPE_CHECKING:
    import httpx

CONNECT_TIMEOUT_S = 10.0


class RequestFailed(RuntimeError):
    """A request answered with another status than 200; the message names it, the status and the
    start of the body."""


def _headers(api_key: str | None) -> dict[str, str] | None:
    return {"authorization": f"Bearer {api_key}"} if api_key else None


def sync_client(api_key: str | None = None, timeout_s: float = 900.0) -> httpx.Client:
    """A blocking client: ``timeout_s`` for an answer (a whole generation), a few seconds to connect."""
    import httpx

    return httpx.Client(timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S), headers=_headers(api_key))


def async_client(api_key: str | None = None, timeout_s: float = 600.0) -> httpx.AsyncClient:
    """An asyncio client for many concurrent streams: no pool limit, since a request waiting for a
    client-side connection would be latency the server never caused."""
    import httpx

    return httpx.AsyncClient(headers=_headers(api_key), timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


def post_json(http: httpx.Client, url: str, body: dict[str, Any], what: str) -> tuple[Any, float]:
    """POST ``body`` as JSON to ``url``: (the answer's JSON, wall ms from sending to the whole
    answer). RequestFailed, naming ``what``, on any status but 200."""
    t0 = time.perf_counter()
    r = http.post(url, json=body)
    wall_ms = (time.perf_counter() - t0) * 1e3
    if r.status_code != 200:
        raise RequestFailed(f"{what}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json(), wall_ms


def generate_body(prompt: Prompt, max_tokens: int, **fields: Any) -> dict[str, Any]:
    """The request body generating ``max_tokens`` tokens past EOS (``ignore_eos``), greedily unless
    ``fields`` give a temperature.

    ``fields``: the other request fields (``mode``, ``controller``, ``k``, ``overlap``,
    ``include_steps``, ...), which override the defaults. A chat prompt goes as one user message
    (the server applies the tokenizer's chat template); any other as raw text to continue.
    """
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **fields}
    if prompt.chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event, data) pairs of a server-sent event stream as they arrive; comments (pings) skipped.

    An event without an ``event:`` line is a ``message``; its ``data:`` lines are joined with
    newlines and parsed as one JSON value (ValueError when they are not JSON).
    """
    event, data = None, []
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            yield event or "message", json.loads("\n".join(data))
            event, data = None, []


def retry_after(value: str | None) -> float | None:
    """Seconds of a Retry-After header (None when absent or an HTTP date, which this server never sends)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the two id sequences differ; when one is a prefix of the
    other, the shorter one's length (where it ends); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
