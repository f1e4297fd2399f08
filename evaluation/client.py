"""The evaluation CLIs' one client of specdec's HTTP API, and how they record what they measured.

- :func:`generate_body`: the ``/v1/generate`` (and ``/v1/generate/stream``) request for a prompt of
  the suite;
- :func:`sse_events`: the events of a ``/v1/generate/stream`` response as they arrive;
- :func:`first_difference`: where two generations of the same prompt part, token by token;
- :func:`write_results`: a results file as strict JSON, which the ``--report-only`` re-renderers
  read back.

Importable without httpx, torch or the services.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evaluation.prompts import Prompt

if TYPE_CHECKING:
    import httpx


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


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the two id sequences differ; when one is a prefix of the
    other, the shorter one's length (where it ends); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def finite(o: Any) -> Any:
    """``o`` with NaN and infinities as None, in nested dicts, lists and tuples (strict JSON)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [finite(v) for v in o]
    return o


def write_results(out_dir: Path, results: Any, name: str = "results.json") -> Path:
    """Write ``results`` to ``out_dir/name`` as strict JSON (NaN and infinities as null, anything
    else JSON has no type for, such as a Path, as its str), indented by 1; returns the path."""
    path = Path(out_dir) / name
    path.write_text(json.dumps(finite(results), indent=1, default=str, allow_nan=False))
    return path
