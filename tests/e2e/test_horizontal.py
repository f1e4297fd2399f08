"""The orchestrator scales horizontally: two orchestrator processes over one draft and one target,
behind a round-robin TCP balancer, serve every kind of request, each produce the target's greedy
output token for token, keep serving when one of them dies, and the dashboard works through the
balancer. Nothing a request needs is kept in an orchestrator between requests (docs/deploy.md)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.lb import RoundRobinBalancer
from tests.support import APP, PROMPTS, gen, iter_sse, messages, metrics, start_orchestrator, stream_html, submit

pytestmark = [pytest.mark.embedded, pytest.mark.slow]

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair(embedded_stack, tmp_path_factory):
    """Two orchestrators on the embedded stack's draft and target, and a balancer in front of them."""
    dirs = [tmp_path_factory.mktemp(f"orchestrator-{name}") for name in ("a", "b")]
    with ThreadPoolExecutor(2) as pool:  # both start (load the tokenizer, connect) at once
        started = list(pool.map(
            lambda d: start_orchestrator(embedded_stack["draft_port"], embedded_stack["target_port"], d), dirs))
    procs = [p for p, _ in started]
    urls = [u for _, u in started]
    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    lb = RoundRobinBalancer(ports).start()
    try:
        yield {"lb": lb, "url": lb.url, "procs": procs, "urls": urls, "ports": ports,
               "single": embedded_stack["url"]}
    finally:
        lb.stop()
        for p in procs:
            p.stop()


def counters(url: str) -> dict[str, float]:
    """Finished generations and generated tokens, from one orchestrator's own /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return {"requests": total("specdec_request_tokens_per_second_count"),
            "tokens": total("specdec_generated_tokens_total")}


def served(pair) -> list[dict[str, float]]:
    return [counters(u) for u in pair["urls"]]


def served_counts(pair) -> list[int]:
    """Connections the balancer gave each orchestrator so far."""
    served_by, _ = pair["lb"].counts()
    return [served_by[p] for p in pair["ports"]]


def delta(after: list[dict[str, float]], before: list[dict[str, float]], key: str) -> list[float]:
    return [a[key] - b[key] for a, b in zip(after, before, strict=True)]


def stream(url: str, **body) -> dict:
    with httpx.stream("POST", url + "/v1/generate/stream", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = list(iter_sse(r))
    assert events[-1][0] == "done", events[-1]
    steps = [d for e, d in events if e == "step"]
    done = events[-1][1]
    assert [t for s in steps for t in s["tokens"]] == done["token_ids"]
    return done


def chat(url: str, content: str) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_spread_over_both_orchestrators(pair):
    url = pair["url"]
    before = served(pair)
    body = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    done = [gen(url, prompt=PROMPTS[0], **body), gen(url, prompt=PROMPTS[3], **body),
            stream(url, prompt=PROMPTS[0], **body), stream(url, prompt=PROMPTS[3], **body)]
    assert all(len(d["token_ids"]) == MAX_TOKENS for d in done)
    replies = [chat(url, "Name three rivers."), chat(url, "Name three rivers.")]
    for reply in replies:
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
        assert reply["specdec"]["tokens"] == reply["usage"]["completion_tokens"] > 0
    assert replies[0]["choices"][0]["message"]["content"] == replies[1]["choices"][0]["message"]["content"]
    # the same request gives the same tokens whichever orchestrator took it
    assert done[0]["token_ids"] == done[2]["token_ids"] and done[1]["token_ids"] == done[3]["token_ids"]

    after = served(pair)
    requests = delta(after, before, "requests")
    tokens = delta(after, before, "tokens")
    assert sum(requests) == len(done) + len(replies), requests
    assert all(n > 0 for n in requests), f"one orchestrator served nothing: {requests}"
    assert sum(tokens) == sum(len(d["token_ids"]) for d in done) + sum(r["usage"]["completion_tokens"] for r in replies)
    assert all(n > 0 for n in served_counts(pair)), pair["lb"].counts()


def single_reference(pair, prompt: str) -> dict:
    """Greedy output of the embedded stack's own orchestrator (asked once per prompt)."""
    cache = pair.setdefault("references", {})
    if prompt not in cache:
        cache[prompt] = gen(pair["single"], prompt=prompt, max_tokens=MAX_TOKENS)
    return cache[prompt]


def test_greedy_output_equals_a_single_orchestrator(pair):
    """Each orchestrator learns its own costs, so their k schedules differ; the tokens may not."""
    prompts = [PROMPTS[2], PROMPTS[6]]
    before = served(pair)
    for prompt in prompts:
        body = dict(prompt=prompt, max_tokens=MAX_TOKENS)
        reference = single_reference(pair, prompt)
        # two requests in a row go to the two orchestrators in turn
        first, second = gen(pair["url"], **body), gen(pair["url"], **body)
        assert first["token_ids"] == second["token_ids"] == reference["token_ids"], prompt
        assert first["text"] == reference["text"]
    requests = delta(served(pair), before, "requests")
    assert requests == [len(prompts), len(prompts)], requests


def test_dashboard_through_the_balancer(pair, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("SPECDEC_UI_ORCHESTRATOR_URL", pair["url"])
    before = served_counts(pair)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    # /health, /ready and /v1/info went over separate connections: both orchestrators answered
    panel = messages(at.sidebar.markdown)
    assert "**orchestrator**: ready" in panel and "**target**: up" in panel and "**draft**: up" in panel, panel
    assert "SmolLM2-135M-Instruct" in messages(at.sidebar.caption)
    assert f"Orchestrator: {pair['url']}" in messages(at.sidebar.caption)
    assert not at.error and not at.warning
    at.number_input(key="max_tokens").set_value(MAX_TOKENS)
    at.checkbox(key="ignore_eos").check()
    at.run()
    # speculative, then plain decoding: two streams, each on a connection of its own
    submit(at, PROMPTS[6], button="compare")
    assert not at.error, messages(at.error)
    assert f"Identical output: all {MAX_TOKENS} token ids match." in messages(at.success)
    speculative, plain = stream_html(at)
    assert speculative.count('class="tok tok-') >= MAX_TOKENS  # every token drawn with its provenance
    assert plain.count('class="tok tok-plain') == MAX_TOKENS
    assert "Speedup" in metrics(at)
    grew = [a - b for a, b in zip(served_counts(pair), before, strict=True)]
    assert all(n > 0 for n in grew), grew


def test_one_orchestrator_killed(pair):
    """The balancer skips the dead one; new requests keep succeeding with the same output."""
    url, (dead, alive) = pair["url"], pair["procs"]
    body = dict(prompt=PROMPTS[6], max_tokens=MAX_TOKENS)
    reference = single_reference(pair, PROMPTS[6])
    dead.kill()
    _, refused_before = pair["lb"].counts()
    before = counters(pair["urls"][1])
    results = [gen(url, **body), stream(url, **body), gen(url, **body)]
    assert all(r["token_ids"] == reference["token_ids"] for r in results)
    # greedy chat through the survivor answers as the embedded stack's own orchestrator does
    answer = chat(url, "Say hello.")["choices"][0]["message"]
    assert answer["content"] and answer == chat(pair["single"], "Say hello.")["choices"][0]["message"]
    assert counters(pair["urls"][1])["requests"] - before["requests"] == len(results) + 1
    _, refused = pair["lb"].counts()
    assert refused[pair["ports"][0]] > refused_before[pair["ports"][0]]  # it was tried and skipped
    assert alive.alive() and httpx.get(url + "/ready", timeout=10).status_code == 200
