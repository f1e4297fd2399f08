"""Tool calls through the official ``openai`` client against the real embedded stack, speculation
on: a forced or required call is generated under the grammar of its parameters (always parses,
validates, and equals plain decoding); streaming sends the calls as deltas; bad tool requests are
400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.embedded

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Lima right now?"}]


@pytest.fixture(scope="module")
def client(embedded_stack):
    return openai.OpenAI(base_url=embedded_stack["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)


def check_call(call, names):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_a_named_function_is_called_with_valid_arguments_and_speculation_keeps_them(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    replies = {}
    for mode in ("speculative", "autoregressive"):
        r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
                                           max_tokens=120, extra_body={"mode": mode})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
        assert len(c.message.tool_calls) == 1
        check_call(c.message.tool_calls[0], {"get_weather"})
        replies[mode] = c.message.tool_calls[0].function.arguments
    assert replies["speculative"] == replies["autoregressive"]


def test_required_calls_one_of_the_tools(client):
    for seed in range(3):
        r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0.8, seed=seed, max_tokens=120)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        check_call(r.choices[0].message.tool_calls[0], {"get_weather", "get_time"})
        assert r.model_extra["specdec"]["draft_tokens"] > 0


def test_a_streamed_call_arrives_as_deltas(client):
    stream = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=120, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in PARAMS
    jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


def test_auto_answers_with_text_or_a_valid_call(client):
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80)
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            assert call.function.name in PARAMS and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content


def test_a_conversation_with_a_tool_result_is_answered(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Lima", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 19, "sky": "overcast"})},
    ]
    r = client.chat.completions.create(model=None, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    assert not r.choices[0].message.tool_calls


@pytest.mark.parametrize("kwargs, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "function name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools", "do not compile"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=None, messages=ASK, max_tokens=4, **kwargs)
    assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body


def test_tools_on_completions_are_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=None, prompt="x", max_tokens=4, extra_body={"tools": TOOLS})
    assert err.value.body["param"] == "tools"
