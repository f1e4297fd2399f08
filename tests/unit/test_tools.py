"""orchestrator.tools without a model: the plan of a request, the prompt it renders, the calls
parsed out of a reply."""

from __future__ import annotations

import json

import pytest
from fastapi import HTTPException

from orchestrator import tools
from orchestrator.schemas import ChatMessage
from specdec import grammar as gr
from specdec.models import load_tokenizer

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}
G = {"type": "function", "function": {"name": "g"}}


def test_the_plan_of_each_tool_choice():
    assert tools.plan(None, None) is None and tools.plan([F], "none") is None
    auto = tools.plan([F, G], None)
    assert auto.choice == "auto" and not auto.forced and not auto.grammar and auto.names == ["f", "g"]
    named = tools.plan([F, G], {"type": "function", "function": {"name": "g"}})
    assert named.choice == "g" and named.forced and named.grammar
    assert tools.plan([F, G], "required").choice == "required"
    with pytest.raises(HTTPException, match="no tool is named"):
        tools.plan([F], {"type": "function", "function": {"name": "h"}})


def test_a_forced_call_grammar_accepts_a_valid_call_only():
    tok = load_tokenizer("embedded")
    grammars = gr.Grammars(lambda: tok, 49152, [2])
    grammar = tools.plan([F, G], {"type": "function", "function": {"name": "f"}}).grammar
    good = tok.encode('<tool_call>\n{"name":"f","arguments":{"x":3}}\n</tool_call>')
    assert grammars.state("ok", grammar, 0, good) is not None
    assert grammars.state("ok", grammar, 0, good).mask().nonzero().flatten().tolist() == [2]  # then only EOS
    assert grammars.state("name", grammar, 0, tok.encode('<tool_call>\n{"name":"g"')) is None
    assert grammars.state("args", grammar, 0, tok.encode('<tool_call>\n{"name":"f","arguments":{"x":"3"')) is None


def test_a_template_without_a_tools_branch_gets_the_tools_in_a_system_message():
    tok = load_tokenizer("embedded")
    assert tools.template_takes_tools(tok) is False  # SmolLM2's template has no tools branch
    history = [ChatMessage(role="user", content="hi"),
               ChatMessage(role="assistant", content=None,
                           tool_calls=[{"id": "c", "type": "function",
                                        "function": {"name": "f", "arguments": json.dumps({"x": 1})}}]),
               ChatMessage(role="tool", tool_call_id="c", content="42")]
    rendered, offered = tools.messages_for(tools.plan([F], None), history, False)
    assert offered is None and rendered[0]["role"] == "system" and '"name": "f"' in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert rendered[3] == {"role": "tool", "content": "<tool_response>\n42\n</tool_response>"}
    # a template that takes tools gets them, and the messages as they are
    rendered, offered = tools.messages_for(tools.plan([F], None), history, True)
    assert offered[0]["function"]["name"] == "f" and rendered[1]["tool_calls"][0]["id"] == "c"


def test_calls_are_parsed_out_of_a_reply():
    plan = tools.plan([F, G], None)
    content, calls = tools.parse('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>\n'
                                 '<tool_call>{"name": "g", "arguments": {}}</tool_call>', plan)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 2}),
                                                                                               ("g", {})]
    assert len({c["id"] for c in calls}) == 2
    # malformed JSON, unknown names: not calls; the text stays content
    text = '<tool_call>{"name": "h", "arguments": {}}</tool_call> <tool_call>{oops</tool_call>'
    assert tools.parse(text, plan) == (text, [])


def test_a_closing_tag_inside_a_string_does_not_end_the_call():
    plan = tools.plan([F, G], None)
    text = '<tool_call>\n{"name": "g", "arguments": {"note": "}}</tool_call> inside"}}\n</tool_call>'
    content, calls = tools.parse(text, plan)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"note": "}}</tool_call> inside"}
