"""The OpenAI API as the official client uses it: every field honoured or refused, errors in
OpenAI's shape (so the client raises its matching exception class). The orchestrator against a
real target service (the tiny GPT-2, gRPC, in this process), the draft unreachable."""

from __future__ import annotations

import json
import math

import openai
import pytest
from fastapi.testclient import TestClient

from orchestrator.app import create_app
from orchestrator.schemas import REFUSED_FIELDS
from orchestrator.settings import OrchestratorSettings
from tests.support import free_port

MESSAGES = [{"role": "user", "content": "a b c"}]

# A value of each refused field that asks for something (the neutral ones are accepted)
ASKING = {
    "functions": [{"name": "f"}], "function_call": {"name": "f"}, "best_of": 2,
    "suffix": "x", "audio": {"voice": "alloy"}, "modalities": ["text", "audio"], "prediction": {"type": "content"},
    "reasoning_effort": "low", "web_search_options": {},
}


@pytest.fixture(scope="module")
def served(tiny_target_server):
    port, path = tiny_target_server
    settings = OrchestratorSettings(target_address=f"127.0.0.1:{port}", draft_address=f"127.0.0.1:{free_port()}",
                                    tokenizer=path, max_tokens_limit=300, max_body_bytes=64 * 1024,
                                    default_max_tokens=8)
    with TestClient(create_app(settings), base_url="http://localhost") as http:
        assert http.get("/ready").status_code == 200
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", http_client=http, max_retries=0)
        yield http, client, client.models.list().data[0].id


def test_every_refusable_field_has_a_probe():
    assert set(ASKING) == set(REFUSED_FIELDS)


@pytest.mark.parametrize("field", sorted(ASKING))
def test_a_field_not_honoured_is_refused_by_name_on_both_endpoints(served, field):
    _, client, model = served
    calls = [lambda: client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                                    extra_body={field: ASKING[field]}),
             lambda: client.completions.create(model=model, prompt="a b", max_tokens=2,
                                               extra_body={field: ASKING[field]})]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        error = err.value.body
        assert error["param"] == field and error["type"] == "invalid_request_error", error
        assert field in error["message"] and "not supported" in error["message"]


def test_fields_that_ask_for_nothing_are_accepted(served):
    _, client, model = served
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
               "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "n": 1, "user": "u-1",
               "stream_options": {"include_usage": True}, "some_client_extension": {"x": 1}}
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0,
                                          extra_body=neutral)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    done = client.completions.create(model=model, prompt="a b", max_tokens=3, temperature=0,
                                     extra_body={"echo": False, "best_of": 1, "suffix": ""})
    assert done.usage.completion_tokens >= 1


def test_n_choices_are_the_seeded_generations_seed_plus_i(served):
    _, client, model = served
    many = client.completions.create(model=model, prompt="a b", max_tokens=6, temperature=1.0, seed=5, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.completions.create(model=model, prompt="a b", max_tokens=6, temperature=1.0, seed=5 + i)
               for i in range(3)]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in many.choices}) > 1  # sampled apart, not one answer three times
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    greedy = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_n_choices_stream_with_their_index_and_one_usage_chunk(served):
    _, client, model = served
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=9, n=2)
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=9,
                                                n=2, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_out_of_range_is_refused(served):
    _, client, model = served
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, n=n)
        assert err.value.body["param"] == "n", err.value.body


def test_an_unknown_model_is_404_model_not_found(served):
    _, client, model = served
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert model in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="a", max_tokens=2)
    assert client.completions.create(model=model, prompt="a", max_tokens=2).choices  # the served name works


def test_validation_errors_are_openai_400s(served):
    http, client, model = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"
    bad = http.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = http.post("/v1/chat/completions", json={"model": model})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    over = http.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 301})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens", over.text
    # specdec's own route keeps FastAPI's shape
    assert http.post("/v1/generate", json={"prompt": "a", "max_tokens": -1}).status_code == 422


def test_an_image_part_on_a_text_only_model_is_refused(served):
    _, client, model = served
    parts = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert err.value.body["param"].startswith("messages[0].content") and "text only" in err.value.body["message"]


def test_a_body_over_the_limit_is_an_openai_413(served):
    http, _, model = served
    r = http.post("/v1/completions", content=json.dumps({"model": model, "prompt": "a" * 70_000}),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_chat_without_max_tokens_runs_to_the_end(served):
    """OpenAI's chat has no default length: it ends at EOS, the context or the server's limit
    (300 here), not at the server's default_max_tokens (8 here) that /v1/generate uses."""
    http, client, model = served
    context = int(http.get("/v1/info").json()["target"]["max_context"])  # 96 for the tiny model
    plain = http.post("/v1/generate", json={"messages": MESSAGES, "temperature": 0, "ignore_eos": True}).json()
    assert len(plain["token_ids"]) == 8
    chat = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0)
    usage = chat.usage
    if chat.choices[0].finish_reason == "length":
        assert usage.completion_tokens == 300 or usage.total_tokens == context, usage
    else:
        assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content is not None
    capped = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=5)
    assert capped.usage.completion_tokens <= 5


def test_a_missing_or_wrong_api_key_is_an_openai_401(tiny_target_server):
    port, path = tiny_target_server
    settings = OrchestratorSettings(target_address=f"127.0.0.1:{port}", draft_address=f"127.0.0.1:{free_port()}",
                                    tokenizer=path, api_keys="sk-right")
    with TestClient(create_app(settings), base_url="http://localhost") as http:
        for key in ("sk-wrong", None):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            r = http.post("/v1/chat/completions", json={"messages": MESSAGES}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="sk-wrong", http_client=http,
                               max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        assert http.post("/v1/generate", json={"prompt": "a"}).json()["detail"]  # specdec's route: its own shape


def test_chat_logprobs_come_from_the_target_for_every_token_returned(served):
    _, client, model = served
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert entry.logprob == tops[0]  # greedy: the token emitted is the most likely one
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content
    streamed = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True))
    entries = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, top_logprobs=2)
    assert "logprobs" in err.value.body["message"]


def test_completion_logprobs_in_openais_legacy_shape(served):
    _, client, model = served
    done = client.completions.create(model=model, prompt="a b", max_tokens=8, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    n = done.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == chosen  # greedy: the chosen token is the likeliest
    with_stop = client.completions.create(model=model, prompt="a b", max_tokens=8, temperature=0, logprobs=0,
                                          stop=[done.choices[0].text[3:5] or "zz"])
    assert len(with_stop.choices[0].logprobs.token_logprobs) == with_stop.usage.completion_tokens
    assert with_stop.choices[0].logprobs.top_logprobs is None
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="a", max_tokens=2, logprobs=21)


def test_processed_logprobs_are_those_of_the_distribution_sampled_from(served):
    _, client, model = served

    def chat(**kw):
        return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, logprobs=True,
                                              top_logprobs=3, **kw)

    # temperature 0.7, top-k 2: two tokens per position carry the whole probability, the third is excluded
    raw = chat(temperature=0.7, seed=3, extra_body={"top_k": 2})
    done = chat(temperature=0.7, seed=3, extra_body={"top_k": 2, "logprobs_mode": "processed_logprobs"})
    assert done.choices[0].message.content == raw.choices[0].message.content  # the mode changes no token
    for p, r in zip(done.choices[0].logprobs.content, raw.choices[0].logprobs.content, strict=True):
        tops = [t.logprob for t in p.top_logprobs]
        assert tops[2] == -9999.0 and abs(math.exp(tops[0]) + math.exp(tops[1]) - 1) < 1e-4
        assert p.logprob in tops[:2] and p.logprob > r.logprob - 1e-6  # renormalised over two: never lower
        assert [t.token for t in p.top_logprobs[:2]] == [t.token for t in r.top_logprobs[:2]]
        # the raw pair at temperature 0.7, renormalised: the processed pair
        a, b = (t.logprob / 0.7 for t in r.top_logprobs[:2])
        assert abs(tops[0] - (a - math.log(math.exp(a) + math.exp(b)))) < 1e-3
    # greedy with a bias against the raw favourite: processed sees the bias, raw does not
    first = raw.choices[0].logprobs.content[0].top_logprobs[0]
    token_id = client_token_id(served, first.token)
    greedy = {mode: chat(temperature=0, logit_bias={str(token_id): -100}, extra_body={"logprobs_mode": mode})
              for mode in ("raw_logprobs", "processed_logprobs")}
    raw_first = greedy["raw_logprobs"].choices[0].logprobs.content[0]
    processed_first = greedy["processed_logprobs"].choices[0].logprobs.content[0]
    assert raw_first.top_logprobs[0].token == first.token  # raw: the model's own favourite, bias unseen
    assert first.token not in [t.token for t in processed_first.top_logprobs]
    assert processed_first.logprob == processed_first.top_logprobs[0].logprob  # greedy took the likeliest
    with pytest.raises(openai.BadRequestError) as err:
        chat(temperature=0, extra_body={"logprobs_mode": "raw_logits"})
    assert err.value.body["param"] == "logprobs_mode"


def client_token_id(served, text: str) -> int:
    http = served[0]
    return http.app.state.rt.tokenizer.convert_tokens_to_ids(text)


def test_structured_output_on_a_tokenizer_llguidance_cannot_read_is_a_400(served):
    """The tiny target's word-level tokenizer has no byte decoder: the target refuses the grammar
    with the reason, the client gets a 400 (not a 5xx), and the next request is served."""
    _, client, model = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       response_format={"type": "json_object"})
    assert "structured output is unavailable" in err.value.body["message"], err.value.body
    assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2).choices[0].message.content


def test_echo_returns_the_prompt_first(served):
    _, client, model = served
    plain = client.completions.create(model=model, prompt="a b", max_tokens=3, temperature=0)
    echoed = client.completions.create(model=model, prompt="a b", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "a b" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="a b", max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="a b", max_tokens=3, echo=True, logprobs=2)
    assert "echo" in err.value.body["message"]
