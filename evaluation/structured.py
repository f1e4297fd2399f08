"""``python -m evaluation.structured``: structured output on the embedded stack, through the
OpenAI chat route (``response_format`` json_schema, strict).

Two parts, one stack (draft + target + orchestrator on the embedded default, started here):

1. **Validity.** ``--answers`` chat requests (every schema of :data:`SCHEMAS` with every request of
   :func:`requests`, round-robin), half greedy, half sampled (temperature 0.8, a seed each),
   speculation on: each answer must end (``finish_reason: stop``), parse as JSON and validate
   against its schema (``jsonschema``). Reported: how many did, tok/s and acceptance.
2. **Speed.** For ``--compare`` of those requests, four modes back to back, in an order rotated
   from one request to the next, greedy: speculative and plain (``mode: autoregressive``), each with
   the schema and without it (the same request as free text, run to the same number of tokens as
   the schema's answer, EOS ignored).
   Reported: median tok/s per mode, the paired ratios (schema / free, speculative / plain), and
   whether speculative output equals plain output under the schema, token for token.

``structured.json`` and ``structured.md`` land in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from evaluation import report
from evaluation.client import post_json, sync_client
from evaluation.modes import rotation
from evaluation.procs import Stack
from evaluation.stats import spread

logger = logging.getLogger("evaluation.structured")

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                       "city": {"type": "string", "maxLength": 30},
                       "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}},
        "required": ["name", "age", "city", "skills"], "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40}, "price": {"type": "number", "minimum": 0},
                       "currency": {"enum": ["EUR", "USD", "GBP"]}, "in_stock": {"type": "boolean"}},
        "required": ["title", "price", "currency", "in_stock"], "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {"event": {"type": "string", "maxLength": 40},
                       "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                       "attendees": {"type": "integer", "minimum": 1, "maximum": 100000}},
        "required": ["event", "date", "attendees"], "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5},
                       "sentiment": {"enum": ["positive", "negative", "mixed"]},
                       "summary": {"type": "string", "maxLength": 80}},
        "required": ["rating", "sentiment", "summary"], "additionalProperties": False,
    },
    "recipe": {
        "type": "object",
        "properties": {"dish": {"type": "string", "maxLength": 30},
                       "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                       "minItems": 1, "maxItems": 5},
                       "minutes": {"type": "integer", "minimum": 1, "maximum": 600}},
        "required": ["dish", "ingredients", "minutes"], "additionalProperties": False,
    },
}

_ASKS = {
    "person": ["a nurse from {place}", "a retired sailor who lives in {place}", "a student in {place}",
               "a chef who moved to {place}"],
    "product": ["a raincoat sold in {place}", "a coffee grinder from a shop in {place}", "a used bicycle in {place}",
                "a souvenir mug from {place}"],
    "event": ["a jazz festival in {place}", "a marathon through {place}", "a book fair in {place}",
              "a science conference in {place}"],
    "review": ["a small hotel in {place}", "a ferry ride to {place}", "a street food stall in {place}",
               "a museum in {place}"],
    "recipe": ["a soup people cook in {place}", "a dessert from {place}", "a quick breakfast in {place}",
               "a dish served at weddings in {place}"],
}
_PLACES = ["Lisbon", "Nairobi", "Oslo", "Kyoto", "Lima", "Tbilisi", "Hanoi", "Montreal", "Porto", "Dakar"]


def requests(n: int) -> list[dict[str, Any]]:
    """n (schema, message) requests, round-robin over the schemas and their asks."""
    out = []
    names = list(SCHEMAS)
    for i in range(n):
        name = names[i % len(names)]
        ask = _ASKS[name][(i // len(names)) % len(_ASKS[name])].format(place=_PLACES[(i // 20) % len(_PLACES)])
        out.append({"id": i, "schema": name, "message": f"Describe {ask} as JSON."})
    return out


def chat_body(req: dict[str, Any], max_tokens: int, schema: bool, mode: str = "speculative",
              temperature: float = 0.0, seed: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": req["message"]}], "max_tokens": max_tokens,
                            "temperature": temperature, "mode": mode}
    if seed is not None:
        body["seed"] = seed
    if schema:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": req["schema"], "schema": SCHEMAS[req["schema"]],
                                                   "strict": True}}
    return body


def post(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One chat completion: its text, finish reason and the speculation statistics it carries."""
    j, _ = post_json(client, url + "/v1/chat/completions", body, f"chat completion ({body.get('mode')})")
    stats = j["specdec"]
    return {"text": j["choices"][0]["message"]["content"], "finish_reason": j["choices"][0]["finish_reason"],
            "tokens": stats["tokens"], "elapsed_ms": stats["elapsed_ms"], "tok_s": stats["tokens_per_second"],
            "acceptance": stats["acceptance_rate"], "draft_tokens": stats["draft_tokens"]}


def validity(client: Any, url: str, reqs: list[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
    import jsonschema

    rows = []
    for i, req in enumerate(reqs):
        sampled = i % 2 == 1
        out = post(client, url, chat_body(req, max_tokens, True, temperature=0.8 if sampled else 0.0,
                                          seed=i if sampled else None))
        try:
            jsonschema.validate(json.loads(out["text"]), SCHEMAS[req["schema"]])
            valid, why = True, ""
        except (ValueError, jsonschema.ValidationError) as exc:
            valid, why = False, str(exc).splitlines()[0][:200]
        rows.append({**req, "sampled": sampled, **out, "valid": valid and out["finish_reason"] == "stop",
                     "why": why or ("" if out["finish_reason"] == "stop" else f"finish_reason {out['finish_reason']}")})
        logger.info("answer %d/%d (%s, %s): %s, %d tokens, %.1f tok/s", i + 1, len(reqs), req["schema"],
                    "sampled" if sampled else "greedy", "valid" if rows[-1]["valid"] else rows[-1]["why"],
                    out["tokens"], out["tok_s"])
    return rows


MODES = [("speculative", True), ("speculative", False), ("autoregressive", True), ("autoregressive", False)]


def name_of(mode: str, schema: bool) -> str:
    return f"{mode}{'+schema' if schema else ''}"


def speed(client: Any, url: str, reqs: list[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
    """Each request in the four modes at the same length: the schema's answer (greedy, so the same
    every time) sets it, and the free text runs to exactly as many tokens (EOS ignored), so the
    first token's latency weighs the same in every mode."""
    runs = []
    for i, req in enumerate(reqs):
        n = post(client, url, chat_body(req, max_tokens, True))["tokens"]  # untimed: the answer's length
        for mode, schema in rotation(MODES, i):
            body = chat_body(req, n, schema, mode=mode)
            if not schema:
                body["ignore_eos"] = True
            out = post(client, url, body)
            runs.append({"prompt_id": req["id"], "mode": name_of(mode, schema), **out})
        logger.info("speed %d/%d: %s", i + 1, len(reqs),
                    ", ".join(f"{r['mode']} {r['tok_s']:.1f}" for r in runs[-len(MODES):]))
    return runs


def summarise(answers: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {name_of(m, s): [r for r in runs if r["mode"] == name_of(m, s)] for m, s in MODES}

    def ratio(a: str, b: str) -> dict[str, float]:
        base = {r["prompt_id"]: r["tok_s"] for r in by[b]}
        return spread([r["tok_s"] / base[r["prompt_id"]] for r in by[a] if base.get(r["prompt_id"])])

    spec, plain = by["speculative+schema"], {r["prompt_id"]: r for r in by["autoregressive+schema"]}
    return {
        "answers": len(answers), "valid": sum(a["valid"] for a in answers),
        "valid_greedy": sum(a["valid"] for a in answers if not a["sampled"]),
        "valid_sampled": sum(a["valid"] for a in answers if a["sampled"]),
        "answer_tok_s": spread([a["tok_s"] for a in answers]),
        "answer_acceptance": spread([a["acceptance"] for a in answers]),
        "invalid": [{"id": a["id"], "schema": a["schema"], "why": a["why"], "text": a["text"][:300]}
                    for a in answers if not a["valid"]],
        "modes": {name: {"tok_s": spread([r["tok_s"] for r in rs]), "acceptance": spread([r["acceptance"] for r in rs]),
                         "tokens": spread([r["tokens"] for r in rs])} for name, rs in by.items()},
        "schema_over_free_speculative": ratio("speculative+schema", "speculative"),
        "schema_over_free_plain": ratio("autoregressive+schema", "autoregressive"),
        "speculative_over_plain_schema": ratio("speculative+schema", "autoregressive+schema"),
        "speculative_over_plain_free": ratio("speculative", "autoregressive"),
        "equal_under_schema": sum(r["text"] == plain[r["prompt_id"]]["text"] for r in spec),
        "compared": len(spec),
    }


def render(results: dict[str, Any]) -> str:
    s = results["summary"]
    fmt = report.fmt
    lines = [f"# Structured output (`{results['command']}`)", "", f"Machine: {results['machine'].get('cpu', '?')}", "",
             f"**Validity:** {s['valid']} of {s['answers']} answers end, parse and validate "
             f"({s['valid_greedy']} greedy, {s['valid_sampled']} sampled); median {fmt(s['answer_tok_s']['median'])} "
             f"tok/s, acceptance {fmt(100 * s['answer_acceptance']['median'])} %.", "",
             f"**Speed** ({s['compared']} requests, greedy, four modes interleaved):", "",
             report.markdown_table([{"name": name, **m} for name, m in s["modes"].items()], [
                 ("mode", lambda m: m["name"]), ("median tok/s", lambda m: fmt(m["tok_s"]["median"])),
                 ("acceptance", lambda m: f"{fmt(100 * m['acceptance']['median'])} %"),
                 ("median tokens", lambda m: fmt(m["tokens"]["median"], 0))])]
    ratios = [{"label": label, **s[key]} for key, label in (
        ("schema_over_free_speculative", "speculative: with schema / without"),
        ("schema_over_free_plain", "plain: with schema / without"),
        ("speculative_over_plain_schema", "with schema: speculative / plain"),
        ("speculative_over_plain_free", "without schema: speculative / plain"))]
    lines += ["", report.markdown_table(ratios, [
        ("paired ratio (median, p10–p90)", lambda r: r["label"]),
        ("value", lambda r: f"{fmt(r['median'], 2)}× ({fmt(r['p10'], 2)}–{fmt(r['p90'], 2)})")])]
    lines += ["", f"Speculative == plain under the schema: {s['equal_under_schema']} of {s['compared']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, default=200, help="validity requests (default 200)")
    ap.add_argument("--compare", type=int, default=12, help="requests timed in the four modes (default 12)")
    ap.add_argument("--max-tokens", type=int, default=320,
                    help="tokens per answer at most (default 320: the schemas bound their strings and arrays)")
    ap.add_argument("--url", help="an orchestrator already running (default: start the embedded stack here)")
    ap.add_argument("--out", type=Path, help="results folder (default evaluation/results/structured-<time>)")
    args = ap.parse_args(argv)
    out, command = report.start_run("evaluation.structured", argv, args.out, prefix="structured-")
    stack = None
    try:
        url = args.url
        if url is None:
            (out / "logs").mkdir(exist_ok=True)
            stack = Stack(out / "logs")
            url = stack.orchestrator("orchestrator", stack.model_service("draft", "draft", {}),
                                     stack.model_service("target", "target", {}))
        with sync_client(timeout_s=600) as client:
            warm = requests(len(SCHEMAS))
            for req in warm:  # untimed: loads both services' grammar tokenizers, lets the cost model learn
                post(client, url, chat_body(req, 32, True))
                post(client, url, chat_body(req, 32, False))
            t0 = time.monotonic()
            answers = validity(client, url, requests(args.answers), args.max_tokens)
            runs = speed(client, url, requests(args.compare), args.max_tokens)
        results = {"command": command, "machine": report.machine_info(), "seconds": round(time.monotonic() - t0, 1),
                   "summary": summarise(answers, runs), "answers": answers, "runs": runs}
    finally:
        if stack is not None:
            stack.close()
    report.write_report(out, results, render(results), "structured.json", "structured.md")
    print(render(results))
    return 0 if results["summary"]["valid"] == results["summary"]["answers"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
