"""The orchestrator end to end on the embedded default: real processes, real ports, real HTTP."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from orchestrator.schemas import Step
from specdec.native import kernels
from tests.support import PROMPTS, gen, iter_sse, sse_events, start_model_service, start_orchestrator

pytestmark = pytest.mark.embedded

@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_speculative_equals_autoregressive(embedded_stack, i):
    url = embedded_stack["url"]
    body = dict(prompt=PROMPTS[i], max_tokens=64, ignore_eos=i % 2 == 0)
    plain = gen(url, mode="autoregressive", **body)
    spec = gen(url, mode="speculative", **body)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["text"] == plain["text"]
    if body["ignore_eos"]:
        assert len(spec["token_ids"]) == 64
    st = spec["stats"]
    assert st["iterations"] < st["tokens"]  # several tokens per target pass
    assert plain["stats"]["iterations"] == plain["stats"]["tokens"]
    # every step's accounting adds up: accepted draft tokens + the target's own token
    assert sum(s["accepted"] for s in spec["steps"]) + len(spec["steps"]) >= len(spec["token_ids"])
    for s in spec["steps"]:
        assert (s["correction"] is None) != (s["bonus"] is None)
        if s["correction"] is not None:
            assert s["accepted"] < len(s["draft"])


@pytest.mark.parametrize("controller", ["fixed", "acceptance", "hf", "cost"])
def test_every_controller_keeps_the_output(embedded_stack, controller):
    url = embedded_stack["url"]
    body = dict(prompt=PROMPTS[6], max_tokens=48, ignore_eos=True)
    plain = gen(url, mode="autoregressive", **body)
    spec = gen(url, controller=controller, k=3, max_k=6, **body)
    assert spec["token_ids"] == plain["token_ids"] and spec["controller"] == controller
    k_steps = [s["k"] for s in spec["steps"]]
    # The draft shares the target's host: the first step runs plainly and alone (the first token
    # never waits for the draft's prefill), the second drafts, its Propose carrying the prompt (a
    # prompt within one catch-up chunk needs no catch-up call); speculation then lands the rest in
    # fewer steps than tokens.
    lead = next(i for i, k in enumerate(k_steps) if k > 0)
    assert lead == 1 and spec["stats"]["draft_catch_ups"] == 0
    assert sum(s["accepted"] + 1 for s in spec["steps"][lead:]) > len(k_steps) - lead
    ks = set(k_steps[lead:])
    if controller == "fixed":
        # k = 3 at every step, except where fewer tokens are left: a step lands accepted + 1
        # tokens, so with n left it drafts n - 1 (none for the very last token)
        generated = [sum(s["accepted"] + 1 for s in spec["steps"][:i]) for i in range(len(k_steps))]
        assert k_steps[lead:] == [min(3, 48 - g - 1) for g in generated[lead:]]
        assert 3 in ks
    assert max(ks) <= 6


@pytest.mark.slow
@pytest.mark.parametrize("controller", ["fixed", "cost"])
def test_overlapped_speculation_keeps_the_output(embedded_stack, controller):
    """The draft drafts the next block while the target verifies this one: same tokens as plain
    decoding, several blocks pre-drafted, and every step's time split still adds up."""
    url = embedded_stack["url"]
    for i in (0, 2, 5):
        body = dict(prompt=PROMPTS[i], max_tokens=64, ignore_eos=True)
        plain = gen(url, mode="autoregressive", **body)
        spec = gen(url, controller=controller, k=4, overlap=True, **body)
        assert spec["token_ids"] == plain["token_ids"]
        st = spec["stats"]
        assert st["predrafted_iterations"] > 0 and st["iterations"] < st["tokens"]
        assert sum(s["predrafted"] for s in spec["steps"]) == st["predrafted_iterations"]
    # a sampling request asks for overlap in vain: it runs alternating (and stays reproducible)
    body = dict(prompt=PROMPTS[0], max_tokens=16, temperature=0.8, seed=5, overlap=True)
    a, b = gen(url, **body), gen(url, **{**body, "overlap": False})
    assert a["token_ids"] == b["token_ids"] and a["stats"]["predrafted_iterations"] == 0


def test_chat_messages_on_generate(embedded_stack):
    r = gen(embedded_stack["url"], messages=[{"role": "user", "content": "Say hello."}], max_tokens=16)
    assert r["text"] and r["prompt_tokens"] > 5


def test_stream_reassembles_to_the_same_text(embedded_stack):
    url = embedded_stack["url"]
    body = dict(prompt=PROMPTS[1], max_tokens=48)
    full = gen(url, **body)
    with httpx.stream("POST", url + "/v1/generate/stream", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    steps = [d for e, d in events if e == "step"]
    done = [d for e, d in events if e == "done"]
    assert len(done) == 1 and events[-1][0] == "done"
    assert "".join(s["text"] for s in steps) == done[0]["text"] == full["text"]
    assert [t for s in steps for t in s["tokens"]] == done[0]["token_ids"] == full["token_ids"]
    # the stream's steps and the response's are the one Step (the stream fills in each token's text)
    assert all(set(s) == set(Step.model_fields) | set(Step.model_computed_fields) for s in steps + full["steps"])
    assert all(Step.model_validate(s).model_dump(mode="json") == s for s in steps + full["steps"])
    assert all(s["token_texts"] is None for s in full["steps"])
    for s in steps:
        assert len(s["token_texts"]) == len(s["draft"]) and s["next_kind"] in {"bonus", "correction", "plain"}
        assert len(s["target_probs"]) == len(s["draft"]) == len(s["draft_confidences"])


def test_openai_client(embedded_stack):
    from openai import OpenAI

    client = OpenAI(base_url=embedded_stack["url"] + "/v1", api_key="unused")
    models = client.models.list()
    assert len(models.data) == 1
    model = models.data[0].id
    c = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=24, temperature=0)
    assert c.choices[0].text and c.usage.completion_tokens <= 24
    assert c.model_extra["specdec"]["tokens"] == c.usage.completion_tokens
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt=PROMPTS[3], max_tokens=24, temperature=0, stream=True))
    assert streamed == c.choices[0].text
    messages = [{"role": "user", "content": "Name two planets."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in {"stop", "length"}


def test_usage_counts_the_tokens_returned_when_a_stop_string_ends_inside_a_speculated_block(embedded_stack):
    """With speculation, a stop string may end inside a block of several accepted tokens: usage
    counts the tokens of the text returned (the fewest whose text holds it), not the whole block."""
    from openai import OpenAI

    from specdec.models import load_tokenizer

    url = embedded_stack["url"]
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    tok = load_tokenizer("embedded")
    checked = 0
    for prompt in PROMPTS[:4]:
        full = httpx.post(url + "/v1/generate", json={"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                                      "ignore_eos": False}, timeout=120).json()
        text, ids = full["text"], full["token_ids"]
        at = next((i for i in range(len(text) // 3, len(text) - 4) if text.find(text[i:i + 3]) == i
                   and text[i:i + 3].strip()), None)
        if at is None:
            continue
        stop = text[at:at + 3]
        done = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
        assert done.choices[0].text == text[:at]
        expected = next(n for n in range(len(ids) + 1) if tok.decode(ids[:n], skip_special_tokens=True).startswith(text[:at]))
        assert done.usage.completion_tokens == expected, (stop, done.usage, expected, done.model_extra["specdec"]["tokens"])
        checked += 1
    assert checked >= 2


def _same_logprobs(spec, plain) -> list:
    """Assert two chat replies carry the same text and, token by token, the same logprobs and top
    logprobs (within 1e-4); return the first's entries."""
    assert spec.choices[0].message.content == plain.choices[0].message.content
    a, b = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert len(a) == len(b) == spec.usage.completion_tokens
    for x, y in zip(a, b, strict=True):
        assert x.token == y.token and abs(x.logprob - y.logprob) <= 1e-4
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
        assert max(abs(s.logprob - t.logprob) for s, t in zip(x.top_logprobs, y.top_logprobs, strict=True)) <= 1e-4
    return a


def test_logprobs_are_the_same_with_speculation_on_and_off(embedded_stack):
    """Each token's logprob comes from the target's own verify row at its position, which is bit
    for bit the row a plain step computes: drafted or not, the same numbers (here within 1e-4)."""
    from openai import OpenAI

    client = OpenAI(base_url=embedded_stack["url"] + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    drafted = 0
    for prompt in ("Name three rivers in Europe.", "Write a haiku about the sea."):
        runs = {}
        for mode in ("speculative", "autoregressive"):
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=40, temperature=0, logprobs=True, top_logprobs=5,
                                                   extra_body={"mode": mode})
            runs[mode] = reply
        spec, plain = runs["speculative"], runs["autoregressive"]
        a = _same_logprobs(spec, plain)
        text = b"".join(bytes(e.bytes) for e in a).decode("utf-8", errors="replace")
        assert text.startswith(spec.choices[0].message.content)  # the tokens' bytes spell the answer
        drafted += spec.model_extra["specdec"]["accepted_tokens"]
    assert drafted > 0  # speculation did run: some tokens came from the draft


def test_processed_logprobs_are_the_same_with_speculation_on_and_off(embedded_stack):
    """processed_logprobs under a penalty and a bias (logit processing with each row's own
    history): the target's processed row at each position, drafted or not, the same numbers."""
    from openai import OpenAI

    client = OpenAI(base_url=embedded_stack["url"] + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    runs = {}
    for mode in ("speculative", "autoregressive"):
        runs[mode] = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "List five fruits."}], max_tokens=40, temperature=0,
            logprobs=True, top_logprobs=3, presence_penalty=0.8, logit_bias={"28": -5},
            extra_body={"mode": mode, "logprobs_mode": "processed_logprobs", "repetition_penalty": 1.2})
    spec, plain = runs["speculative"], runs["autoregressive"]
    for x in _same_logprobs(spec, plain):
        assert x.logprob == x.top_logprobs[0].logprob  # greedy on the processed row: its likeliest
    assert spec.model_extra["specdec"]["accepted_tokens"] > 0


def test_seeded_sampling_is_reproducible(embedded_stack):
    """A seed gives the same output for the same k schedule (docs/batching.md). The schedule moves
    only when a Propose misses its deadline (a draft fallback: a machine too busy), so the pair is
    repeated until two runs got the same one."""
    url = embedded_stack["url"]
    body = dict(prompt=PROMPTS[6], max_tokens=32, temperature=0.9, top_p=0.95, seed=1234)

    def schedule(r: dict) -> list[tuple[int, int]]:
        return [(s["k"], len(s["draft"])) for s in r["steps"]]

    for _ in range(3):
        a, b = gen(url, **body), gen(url, **body)
        if schedule(a) == schedule(b):
            break
    assert schedule(a) == schedule(b), "three pairs of runs never drafted alike"
    assert a["token_ids"] == b["token_ids"]
    c = gen(url, **{**body, "seed": 99})
    assert c["token_ids"] != a["token_ids"]
    assert a["stats"]["draft_tokens"] > 0  # sampling requests speculate too


def test_stop_strings_and_max_tokens(embedded_stack):
    url = embedded_stack["url"]
    r = gen(url, prompt=PROMPTS[7], max_tokens=40, stop=["\n4."])
    assert r["finish_reason"] == "stop" and "4." not in r["text"][-3:]
    r = gen(url, prompt=PROMPTS[0], max_tokens=5, ignore_eos=True)
    assert r["finish_reason"] == "length" and len(r["token_ids"]) == 5


BAD = [
    ({"prompt": ""}, 422, "prompt"),
    ({}, 422, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 422, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100000}, 422, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 422, "temperature"),
    ({"prompt": "x", "controller": "magic"}, 422, "controller"),
    ({"prompt": "x", "k": 9, "max_k": 4}, 422, "k"),
    ({"prompt": "x", "confidence_threshold": 2}, 422, "confidence_threshold"),
    ({"prompt": "x", "mode": "fast"}, 422, "mode"),
    ({"prompt": "x", "unknown": 1}, 422, "unknown"),
    ({"prompt": "word " * 9000}, 400, "prompt"),
]


@pytest.mark.parametrize("body, status, field", BAD)
def test_bad_input_gets_4xx_naming_the_field(embedded_stack, body, status, field):
    r = httpx.post(embedded_stack["url"] + "/v1/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert field in json.dumps(r.json()["detail"])


def test_oversized_body_is_413_and_service_goes_on(embedded_stack):
    url = embedded_stack["url"]
    r = httpx.post(url + "/v1/generate", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "body" in r.json()["detail"]
    assert gen(url, prompt="Hello", max_tokens=4)["token_ids"]


def test_concurrent_requests(embedded_stack):
    import concurrent.futures as cf

    url = embedded_stack["url"]
    bodies = [dict(prompt=p, max_tokens=24, ignore_eos=True) for p in PROMPTS[:3]]
    sequential = [gen(url, **b)["token_ids"] for b in bodies]
    with cf.ThreadPoolExecutor(3) as pool:
        parallel = list(pool.map(lambda b: gen(url, **b)["token_ids"], bodies))
    assert parallel == sequential


def test_health_ready_metrics(embedded_stack):
    url = embedded_stack["url"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    ready = httpx.get(url + "/ready").json()
    native = kernels()  # the default draft backend, auto, runs native where AVX2 is, else llama.cpp
    draft = "native" if native is not None and native.quant_isa("Q4_1") != "baseline" else "llamacpp"
    assert ready["ready"] and ready["draft"]["backend"] == draft and ready["target"]["backend"] == "native"
    text = httpx.get(url + "/metrics").text
    for name in ("specdec_drafts_total", "specdec_draft_tokens_total", "specdec_accepted_tokens_total",
                 "specdec_accepted_per_position_total", "specdec_k_bucket", "specdec_rpc_client_duration_seconds",
                 "specdec_request_tokens_per_second", "specdec_active_requests"):
        assert name in text, name
    assert httpx.get(url + "/docs").status_code == 200


# The two kill tests run with the reliability suite (beside tests/reliability/test_faults.py's kills
# under load); the default suite keeps one real kill (tests/service/test_replicas.py) and fakes for the
# error mapping (tests/unit/test_overlap.py, tests/service/test_hardening.py).
@pytest.mark.reliability
def test_draft_killed_mid_request_keeps_output(tmp_path, embedded_stack):
    """A draft service that dies mid-request costs speed, not correctness: same output, 200."""
    draft, draft_port = start_model_service("draft", tmp_path)
    orch, url = start_orchestrator(draft_port, embedded_stack["target_port"], tmp_path)
    try:
        body = dict(prompt=PROMPTS[6], max_tokens=96, ignore_eos=True, controller="fixed", k=2)
        plain = gen(embedded_stack["url"], mode="autoregressive", **body)
        with httpx.stream("POST", url + "/v1/generate/stream", json=body, timeout=300) as r:
            assert r.status_code == 200
            events = []
            for item in iter_sse(r):
                events.append(item)
                if len(events) == 3:
                    draft.kill()
        done = [d for e, d in events if e == "done"][0]
        assert done["token_ids"] == plain["token_ids"]
        assert done["stats"]["draft_fallbacks"] >= 1
        steps = [d for e, d in events if e == "step"]
        assert any(s["draft_error"] for s in steps) and steps[-1]["draft"] == []
        # ready but degraded without a draft (a draft outage keeps the orchestrator in its load
        # balancer), still serving the same output by plain decoding
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 200 and "unreachable" in ready.json()["degraded"]
        assert gen(url, prompt="Hi", max_tokens=4)["stats"]["draft_tokens"] == 0
    finally:
        orch.stop()
        draft.stop()


def test_target_down_is_503(tmp_path, embedded_stack):
    from tests.support import free_port

    orch, url = start_orchestrator(embedded_stack["draft_port"], free_port(), tmp_path, wait_ready=False)
    try:
        r = httpx.get(url + "/ready")
        assert r.status_code == 503 and "target" in r.json()["reason"]
        r = httpx.post(url + "/v1/generate", json={"prompt": "Hello"}, timeout=30)
        assert r.status_code == 503 and "target" in r.json()["detail"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello"}, timeout=30)
        assert r.status_code == 503
    finally:
        orch.stop()


@pytest.mark.reliability
def test_target_killed_while_serving_is_503(tmp_path, embedded_stack):
    target, target_port = start_model_service("target", tmp_path)
    orch, url = start_orchestrator(embedded_stack["draft_port"], target_port, tmp_path)
    try:
        assert gen(url, prompt="Hello", max_tokens=4)["token_ids"]
        target.kill()
        time.sleep(0.5)
        r = httpx.post(url + "/v1/generate", json={"prompt": "Hello", "max_tokens": 8}, timeout=60)
        assert r.status_code == 503 and "target" in r.json()["detail"]
        assert httpx.get(url + "/health").status_code == 200
    finally:
        orch.stop()
        target.stop()


def test_mismatched_tokenizers_refuse_to_serve(tmp_path, tiny_models, embedded_stack):
    """A draft with another tokenizer: not ready, with a clear reason, and generation refused."""
    draft, draft_port = start_model_service("draft", tmp_path, {
        "SPECDEC_DRAFT_BACKEND": "transformers", "SPECDEC_DRAFT_MODEL": tiny_models["gpt2-draft"]})
    orch, url = start_orchestrator(draft_port, embedded_stack["target_port"], tmp_path, wait_ready=False)
    try:
        deadline = time.monotonic() + 60
        while True:
            r = httpx.get(url + "/ready")
            if "tokenizers differ" in r.json()["reason"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 503 and "tokenizers differ" in r.json()["reason"]
        r = httpx.post(url + "/v1/generate", json={"prompt": "Hello"}, timeout=30)
        assert r.status_code == 503 and "tokenizers differ" in r.json()["detail"]
    finally:
        orch.stop()
        draft.stop()


def test_slow_draft_past_its_deadline_falls_back(tmp_path, embedded_stack):
    orch, url = start_orchestrator(embedded_stack["draft_port"], embedded_stack["target_port"], tmp_path,
                                   env={"SPECDEC_ORCHESTRATOR_DRAFT_TIMEOUT_S": "0.0005"})
    try:
        body = dict(prompt=PROMPTS[0], max_tokens=24, ignore_eos=True)
        r = gen(url, **body)
        assert r["token_ids"] == gen(embedded_stack["url"], mode="autoregressive", **body)["token_ids"]
        assert r["stats"]["draft_fallbacks"] >= 1 and r["stats"]["draft_tokens"] == 0
    finally:
        orch.stop()


def test_client_disconnect_releases_both_sessions(embedded_stack):
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    url = embedded_stack["url"]

    def sessions() -> tuple[int, int]:
        with grpc.insecure_channel(f"127.0.0.1:{embedded_stack['draft_port']}") as d, \
                grpc.insecure_channel(f"127.0.0.1:{embedded_stack['target_port']}") as t:
            return (pb_grpc.DraftServiceStub(d).Info(pb.InfoRequest()).sessions,
                    pb_grpc.TargetServiceStub(t).Info(pb.InfoRequest()).sessions)

    def generated() -> float:
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith('specdec_generated_tokens_total{mode="speculative"}'):
                return float(line.split()[-1])
        return 0.0

    before, tokens_before = sessions(), generated()
    body = dict(prompt=PROMPTS[6], max_tokens=400, ignore_eos=True)
    with httpx.stream("POST", url + "/v1/generate/stream", json=body, timeout=300) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("event: step")
            if seen == 3:
                break  # the client goes away mid-generation
    deadline = time.monotonic() + 30
    while sessions() != before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sessions() == before
    # the server noticed: the generation stopped long before its 400 tokens
    time.sleep(1.0)
    assert generated() - tokens_before < 200
    assert "specdec_active_requests 0.0" in httpx.get(url + "/metrics").text
