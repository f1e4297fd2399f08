"""Structured output requests: OpenAI's ``response_format``, vLLM's ``structured_outputs`` (and its
older ``guided_*`` fields) as one llguidance grammar (specdec.grammar), compiled here once per
request so a bad schema or grammar is a 400 naming the field before any model computes.

The grammar then travels with the request's sampling parameters to both model services, which
mask their logits with it (see specdec.grammar for why speculation stays exact)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool

from specdec import grammar as gr
from specdec.errors import InvalidArgument

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


def _compile(field: str, build: Any, *args: Any) -> str:
    try:
        return gr.validate(build(*args))
    except (InvalidArgument, ValueError, TypeError) as exc:
        raise HTTPException(400, detail=f"{field}: {exc}") from exc


def from_response_format(value: Any) -> str:
    """OpenAI's ``response_format``: ``text`` (no grammar), ``json_object`` (any JSON object) or
    ``json_schema`` (``{"json_schema": {"name", "schema", "strict"}}``: JSON valid against it)."""
    if value is None:
        return ""
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise HTTPException(400, detail="response_format: give {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                        "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
    kind = value["type"]
    if kind == "text":
        return ""
    if kind == "json_object":
        return _compile("response_format", gr.from_json_schema, {"type": "object"})
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
        raise HTTPException(400, detail="response_format: json_schema must be an object with a \"schema\" object")
    return _compile("response_format", gr.from_json_schema, spec.get("schema", {}))


def from_structured_outputs(value: Any, field: str = "structured_outputs") -> str:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``, ``choice`` (a
    list of strings) and ``grammar`` (Lark, or llama.cpp's GBNF)."""
    if value is None:
        return ""
    given = [k for k in STRUCTURED_KINDS if isinstance(value, dict) and value.get(k) is not None]
    if len(given) != 1:
        raise HTTPException(400, detail=f"{field}: give exactly one of {', '.join(STRUCTURED_KINDS)}")
    kind, arg = given[0], value[given[0]]
    if kind == "json":
        if isinstance(arg, str):
            import json

            try:
                arg = json.loads(arg)
            except ValueError as exc:
                raise HTTPException(400, detail=f"{field}: json is not a JSON schema ({exc})") from exc
        return _compile(field, gr.from_json_schema, arg)
    if kind == "choice":
        return _compile(field, gr.from_choice, arg)
    if not isinstance(arg, str) or not arg:
        raise HTTPException(400, detail=f"{field}: {kind} must be a non-empty string")
    return _compile(field, gr.from_regex if kind == "regex" else gr.from_grammar, arg)


async def grammar_of(body: Any) -> str:
    """The one grammar a request asks for ("" for none); 400 when it asks for two. Compiled on a
    worker thread: a large schema takes milliseconds, which the event loop does not wait out."""
    if not any(getattr(body, name, None) is not None for name in GRAMMAR_FIELDS):
        return ""
    return await run_in_threadpool(_grammar_of, body)


GRAMMAR_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar")


def _grammar_of(body: Any) -> str:
    found: list[tuple[str, str]] = []
    if getattr(body, "response_format", None) is not None:
        found.append(("response_format", from_response_format(body.response_format)))
    if getattr(body, "structured_outputs", None) is not None:
        found.append(("structured_outputs", from_structured_outputs(body.structured_outputs)))
    for old, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(body, old, None) is not None:
            found.append((old, from_structured_outputs({kind: getattr(body, old)}, old)))
    found = [(name, g) for name, g in found if g]
    if len(found) > 1:
        raise HTTPException(400, detail=f"{found[1][0]}: only one structured output per request "
                                        f"({', '.join(name for name, _ in found)} given)")
    return found[0][1] if found else ""
