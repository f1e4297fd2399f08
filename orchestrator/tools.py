"""Tool calls for ``/v1/chat/completions``: ``tools`` and ``tool_choice`` as OpenAI defines them.

- **The prompt.** Tools reach the model through its chat template (``tools=``) when the template
  has a tools branch. Many templates have none, and transformers then drops ``tools`` without a
  word: that is detected (the template renders the same with and without a tool) and the tools go
  into a Hermes-style system message instead, the format vLLM's ``hermes`` parser reads::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Lima"}}
      </tool_call>

  Earlier turns of the conversation are rendered the same way: an assistant message's
  ``tool_calls`` as such blocks, a ``tool`` message's content inside ``<tool_response>`` tags.
- **The answer.** ``auto``: the model writes freely and every well-formed block is parsed out of
  the text. ``required`` or a named function: the output is generated under a grammar (one block
  whose JSON is ``{"name": <one of the allowed tools>, "arguments": <valid against its
  parameters>}``, specdec.grammar), so it always parses. ``none``: the tools are not offered.
  Either way a reply with calls has ``content`` (the text before the first block, or null),
  ``tool_calls`` and ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException

from specdec import grammar as gr

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OPEN = re.compile(r"<tool_call>")
SPACE = re.compile(r"\s*")
CLOSE = re.compile(r"\s*(?:</tool_call>|$)")

SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


@dataclass
class ToolPlan:
    """What a chat request's ``tools`` / ``tool_choice`` ask for."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, validated
    choice: str  # auto | required | a function name
    grammar: str = ""  # for required or a named function: the grammar of one call
    names: list[str] = field(default_factory=list)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def plan(tools: Any, tool_choice: Any) -> ToolPlan | None:
    """The plan of a request (None: no tools offered); 400 naming the field when malformed."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise HTTPException(400, detail="tool_choice: no tools are given")
        return None
    if not isinstance(tools, list):
        raise HTTPException(400, detail="tools: a list of {\"type\": \"function\", \"function\": {...}} objects")
    checked, names = [], []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
            raise HTTPException(400, detail=f"tools: tools[{i}] needs type \"function\" and a function name of "
                                            "letters, digits, _ or - (at most 64)")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise HTTPException(400, detail=f"tools: tools[{i}].function.parameters must be a JSON schema object")
        if fn["name"] in names:
            raise HTTPException(400, detail=f"tools: two tools are named {fn['name']!r}")
        names.append(fn["name"])
        checked.append({"type": "function", "function": {**fn, "parameters": params}})
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan(checked, "auto", names=names)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        allowed = checked
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        name = tool_choice["function"].get("name")
        allowed = [t for t in checked if t["function"]["name"] == name]
        if not allowed:
            raise HTTPException(400, detail=f"tool_choice: no tool is named {name!r} (tools: {', '.join(names)})")
    else:
        raise HTTPException(400, detail="tool_choice: give none, auto, required or "
                                        "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    choice = "required" if tool_choice == "required" else allowed[0]["function"]["name"]
    return ToolPlan(checked, choice, _call_grammar(allowed), names)


def _call_grammar(allowed: list[dict[str, Any]]) -> str:
    """One ``<tool_call>`` block whose JSON names one of ``allowed`` with arguments valid against
    its parameters."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]}}
             for t in allowed]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": gr.JSON_OPTIONS}
    lark = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema) + "\n"
    try:
        return gr.validate(gr.from_grammar(lark))
    except Exception as exc:  # noqa: BLE001 - llguidance says which schema it cannot compile
        raise HTTPException(400, detail=f"tools: a tool's parameters do not compile to a grammar: {exc}") from exc


# ---- the prompt ----------------------------------------------------------------------------------

_DUMMY_TOOL = [{"type": "function", "function": {"name": "specdec_probe_tool", "parameters": {"type": "object"}}}]


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (transformers drops them silently
    otherwise)."""
    cached = getattr(tokenizer, "_specdec_takes_tools", None)
    if cached is not None:
        return cached
    takes = False
    if getattr(tokenizer, "chat_template", None):
        probe = [{"role": "user", "content": "hi"}]
        try:
            with_tools = tokenizer.apply_chat_template(probe, tools=_DUMMY_TOOL, tokenize=False, add_generation_prompt=True)
            takes = "specdec_probe_tool" in with_tools
        except Exception:  # noqa: BLE001 - a template that fails with tools does not take them
            takes = False
    try:
        tokenizer._specdec_takes_tools = takes
    except AttributeError:  # pragma: no cover - a tokenizer object without attributes
        pass
    return takes


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return "<tool_call>\n" + json.dumps({"name": fn.get("name", ""), "arguments": args}) + "\n</tool_call>"


def messages_for(plan_: ToolPlan | None, messages: list[Any], takes_tools: bool) -> tuple[list[dict[str, Any]], Any]:
    """(messages for the chat template, the ``tools`` argument for it or None)."""
    out = []
    for m in messages:
        extra = m.model_extra or {}
        calls = extra.get("tool_calls") or []
        if takes_tools:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if calls:
                d["tool_calls"] = calls
            if extra.get("tool_call_id"):
                d["tool_call_id"] = extra["tool_call_id"]
            out.append(d)
        elif m.role == "tool":
            out.append({"role": "tool", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
        else:
            text = m.text()
            if calls:
                text = "\n".join([text] * bool(text) + [_call_text(c) for c in calls])
            out.append({"role": m.role, "content": text})
    if plan_ is None:
        return out, None
    if takes_tools:
        return out, plan_.tools
    system = SYSTEM.format(tools="\n".join(json.dumps(t) for t in plan_.tools))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "role": "system", "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


# ---- the answer ----------------------------------------------------------------------------------

def parse(text: str, plan_: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply: every well-formed ``<tool_call>`` block naming an offered
    tool becomes a call; content is the text before the first block (None when empty). A reply
    without one keeps its whole text as content."""
    calls = []
    first = None
    decoder = json.JSONDecoder()
    done = 0  # end of the last call read: a "<tool_call>" inside it is its text, not a call
    for match in OPEN.finditer(text):
        if match.start() < done:
            continue
        # the JSON is read as JSON (a string inside it may hold "</tool_call>"), then the closing tag
        try:
            value, end = decoder.raw_decode(text, SPACE.match(text, match.end()).end())
        except ValueError:
            continue
        if not CLOSE.match(text, end) or not isinstance(value, dict) or value.get("name") not in plan_.names:
            continue
        args = value.get("arguments", value.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": value["name"], "arguments": json.dumps(args)}})
        first = match.start() if first is None else first
        done = end
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls
