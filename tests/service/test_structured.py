"""Structured output through the official ``openai`` client against the real embedded stack (draft,
target and orchestrator as processes, speculation on): the answer follows the schema, regex or
choice; speculative output equals plain output under the same schema; bad requests are refused."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.embedded

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "employed"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASKS = ["Describe a software engineer from Lisbon.", "Invent a character for a fantasy novel.",
        "Tell me about your grandmother."]


@pytest.fixture(scope="module")
def client(embedded_stack):
    return openai.OpenAI(base_url=embedded_stack["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, content: str, **kw):
    return client.chat.completions.create(model=None, messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.parametrize("ask", ASKS)
def test_json_schema_answers_validate_and_speculation_keeps_them(client, ask):
    outs = {}
    for mode in ("speculative", "autoregressive"):
        r = chat(client, ask, temperature=0, max_tokens=200, response_format=SCHEMA_FORMAT, extra_body={"mode": mode})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        outs[mode] = r.choices[0].message.content
        jsonschema.validate(json.loads(outs[mode]), PERSON)
    assert outs["speculative"] == outs["autoregressive"]
    assert r.model_extra["specdec"]["draft_tokens"] == 0  # the second was plain


def test_sampled_json_schema_answers_validate(client):
    for seed in range(4):
        r = chat(client, ASKS[seed % len(ASKS)], temperature=0.9, seed=seed, max_tokens=200,
                 response_format=SCHEMA_FORMAT)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        assert r.model_extra["specdec"]["draft_tokens"] > 0  # speculation stayed on


def test_n_sampled_choices_under_a_schema_are_the_seeded_single_requests(client):
    many = chat(client, ASKS[0], temperature=0.9, seed=21, n=3, max_tokens=200, response_format=SCHEMA_FORMAT)
    assert len(many.choices) == 3 and len(many.model_extra["specdec"]) == 3
    for i, choice in enumerate(many.choices):
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        one = chat(client, ASKS[0], temperature=0.9, seed=21 + i, max_tokens=200, response_format=SCHEMA_FORMAT)
        assert choice.message.content == one.choices[0].message.content
    assert sum(stats["draft_tokens"] for stats in many.model_extra["specdec"]) > 0  # speculation stayed on


def test_json_object_is_an_object(client):
    r = chat(client, "List three colours.", temperature=0, max_tokens=150, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_streamed_json_schema_answer_validates(client):
    stream = chat(client, ASKS[0], temperature=0, max_tokens=200, response_format=SCHEMA_FORMAT, stream=True)
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    whole = chat(client, ASKS[0], temperature=0, max_tokens=200, response_format=SCHEMA_FORMAT)
    assert "".join(parts) == whole.choices[0].message.content
    jsonschema.validate(json.loads("".join(parts)), PERSON)


@pytest.mark.parametrize("spec, check", [
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"choice": ["positive", "negative", "neutral"]}, lambda t: t in ("positive", "negative", "neutral")),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),  # GBNF, as llama.cpp's server takes
    ({"grammar": 'start: ("ha")+ "!"'}, lambda t: re.fullmatch(r"(ha)+!", t)),  # Lark
])
def test_structured_outputs_extension(client, spec, check):
    r = client.completions.create(model=None, prompt="Answer:", max_tokens=30, temperature=0,
                                  extra_body={"structured_outputs": spec})
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), r.choices[0].text


def test_vllms_older_guided_fields(client):
    r = client.completions.create(model=None, prompt="Sentiment of 'great film':", max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["good", "bad"]})
    assert r.choices[0].text in ("good", "bad")


def test_native_generate_takes_a_schema_too(embedded_stack):
    r = httpx.post(embedded_stack["url"] + "/v1/generate", timeout=300, json={
        "prompt": "A person as JSON:", "max_tokens": 200, "response_format": SCHEMA_FORMAT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "stop"
    jsonschema.validate(json.loads(body["text"]), PERSON)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "only one"),
])
def test_bad_structured_requests_are_400s_naming_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "x", max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body


def test_ignore_eos_with_a_grammar_is_refused(embedded_stack):
    r = httpx.post(embedded_stack["url"] + "/v1/generate", timeout=60, json={
        "prompt": "x", "max_tokens": 4, "ignore_eos": True, "structured_outputs": {"choice": ["a", "b"]}})
    assert r.status_code == 400 and "ignore_eos" in r.json()["detail"]
