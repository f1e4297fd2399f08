"""Long prompts keep speculating: a question after ~2,000 tokens of notes drafts at (at least half)
the rate the question alone gets, with output identical to plain decoding and no draft fallback.
The draft catches up on the prompt a chunk per Propose (orchestrator.loop, draft_catch_up_chunk),
each within the usual deadline, where one Propose of the whole prompt used to miss it and mark the
draft down for every request."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.reliability.helpers import summarize, write_report

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

QUESTION = "Now answer this: what should I pack for a three-day hiking trip in the mountains?"
NEW_TOKENS = 96


def _notes(tokenizer, tokens: int) -> str:
    texts = [json.loads(line)["text"] for line in
             (Path(__file__).parents[2] / "evaluation" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    lines, n = [], 0
    while len(tokenizer("\n".join(lines)).input_ids) < tokens:
        lines.append(f"Note {n + 1}: {texts[n % len(texts)]}")
        n += 1
    return "Here are my notes:\n" + "\n".join(lines) + "\n\n"


def _generate(url: str, content: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/generate", timeout=600, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("prompt_tokens", [2000])
def test_a_long_prompt_speculates_with_identical_output_and_no_fallback(embedded_stack, prompt_tokens):
    from specdec.models import load_tokenizer

    url = embedded_stack["url"]
    long_prompt = _notes(load_tokenizer("embedded"), prompt_tokens) + QUESTION
    short = _generate(url, QUESTION, temperature=0)
    long = _generate(url, long_prompt, temperature=0)
    plain = _generate(url, long_prompt, temperature=0, mode="autoregressive")
    sampled = _generate(url, long_prompt, temperature=0.8, seed=5)

    def rate(r: dict) -> float:
        return r["stats"]["accepted_tokens"] / max(r["stats"]["tokens"], 1)

    report = {"prompt_tokens": {"short": short["prompt_tokens"], "long": long["prompt_tokens"]},
              "accepted_per_token": {"short": round(rate(short), 3), "long": round(rate(long), 3),
                                     "long_sampled": round(rate(sampled), 3)},
              "fallbacks": {k: r["stats"]["draft_fallbacks"] for k, r in
                            (("short", short), ("long", long), ("long_sampled", sampled))},
              "catch_ups": {k: r["stats"]["draft_catch_ups"] for k, r in (("long", long), ("long_sampled", sampled))}}
    write_report("long_prompts", report)
    summarize("long prompts", [
        f"{long['prompt_tokens']}-token prompt: {long['stats']['accepted_tokens']} of {long['stats']['tokens']} tokens "
        f"from the draft (the question alone, {short['prompt_tokens']} tokens: {short['stats']['accepted_tokens']} "
        f"of {short['stats']['tokens']}); sampled: {sampled['stats']['accepted_tokens']}; "
        f"fallbacks {report['fallbacks']}, catch-up calls {report['catch_ups']}"])
    assert long["prompt_tokens"] >= prompt_tokens
    assert long["token_ids"] == plain["token_ids"]  # speculation never changes greedy output
    assert all(n == 0 for n in report["fallbacks"].values()), report
    assert rate(long) >= 0.5 * rate(short) and rate(short) > 0, report
    assert sampled["stats"]["accepted_tokens"] > 0, report
