"""Request and response bodies of the HTTP API (pydantic; validation errors name the field)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, computed_field, field_validator, model_validator

from orchestrator.settings import ControllerName
from specdec.params import MAX_LOGIT_BIAS

# Bounds of what the wire protocol carries (SamplingParams.top_k is uint32, seed uint64 — kept
# below 2**63 so it also fits signed consumers).
MAX_TOP_K = (1 << 32) - 1
MAX_SEED = 1 << 63
# messages per conversation, as OpenAI's bound (a chat template spends several tokens a message:
# 2,048 of them fill more than an 8k context); orchestrator.app.BodyLimit counts them in the raw
# body, so a 50,000-message body is refused before it is parsed
MAX_MESSAGES = 2048
MAX_CHOICES = 16  # n per request (each choice holds a slot of max_concurrent_requests)


def valid_text(value: str) -> str:
    """Reject strings that are not Unicode text: JSON may carry a lone surrogate (``"\\udcff"``),
    which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds a lone surrogate at position {exc.start}, which is not valid Unicode text") from None
    return value


Text = Annotated[str, AfterValidator(valid_text)]


def stop_list(v: list[str] | str | None) -> list[str]:
    """Stop strings as a list: at most 8, each 1..64 characters (each is searched for on every step)."""
    stops = [v] if isinstance(v, str) else list(v or [])
    if len(stops) > 8 or any(not s or len(s) > 64 for s in stops):
        raise ValueError("stop takes at most 8 non-empty strings of at most 64 characters")
    return stops


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type", "text")
                if kind != "text":  # never dropped silently: the answer would ignore what was sent
                    raise ValueError(f"part {i} is of type {kind!r}: the served model reads text only")
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError("a text part needs a string 'text'")
                valid_text(text)
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class SpeculationParams(BaseModel):
    """Knobs of the speculative loop (all optional; defaults come from the server settings)."""

    mode: Literal["speculative", "autoregressive"] = Field(
        "speculative", description="'autoregressive' decodes with the target alone: the baseline."
    )
    controller: ControllerName | None = Field(None, description="How k adapts: fixed, acceptance, hf or cost.")
    k: int | None = Field(None, ge=0, le=64, description="Initial draft length (constant for 'fixed').")
    max_k: int | None = Field(None, ge=1, le=64, description="Largest draft length an adaptive controller may pick.")
    confidence_threshold: float | None = Field(
        None, ge=0, le=1, description="Draft stops after a token whose draft probability is below this."
    )
    overlap: bool | None = Field(
        None, description="Draft the next block while the target verifies this one (greedy requests; "
                          "default: the server's setting)."
    )


class SamplingFields(BaseModel):
    temperature: float = Field(0.0, ge=0, le=10, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="Keep the k most likely tokens (0: all).")
    seed: int | None = Field(None, ge=0, lt=MAX_SEED, description="Makes sampling reproducible.")


class ProcessingFields(BaseModel):
    """Logit processing, applied by both models at every position with its own history (so
    speculation stays lossless under it: specdec.sampling.process)."""

    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Minus this x the token's count in the output so far.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Minus this once the token is in the output.")
    repetition_penalty: float | None = Field(
        None, gt=0, le=10, description="vLLM's: > 1 penalises every token of prompt and output (1: off).")
    min_p: float | None = Field(None, ge=0, le=1, description="Keep tokens with at least min_p x the top token's "
                                                              "probability (sampling only).")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100], added to its logit.")

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"{len(v)} tokens, over the {MAX_LOGIT_BIAS} allowed")
        for key, bias in v.items():
            if not key.isdigit() or int(key) >= 2**32:
                raise ValueError(f"{key!r} is not a token id")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of {key} is {bias}; biases lie in [-100, 100]")
        return v

    def processing(self) -> dict[str, Any]:
        """The fields as specdec.params.Sampling takes them."""
        return {"frequency_penalty": self.frequency_penalty or 0.0, "presence_penalty": self.presence_penalty or 0.0,
                "repetition_penalty": self.repetition_penalty or 1.0, "min_p": self.min_p or 0.0,
                "logit_bias": tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))}


class GenerateRequest(SpeculationParams, SamplingFields, ProcessingFields):
    model_config = ConfigDict(extra="forbid")

    prompt: Text | None = Field(None, min_length=1, description="Text to continue (no chat template applied).")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, max_length=MAX_MESSAGES,
        description="A conversation, formatted with the tokenizer's chat template (instead of prompt)."
    )
    max_tokens: int | None = Field(None, ge=1, description="New tokens to generate at most.")
    stop: list[Text] | Text | None = Field(None, description="Stop when any of these strings is generated.")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens.")
    response_format: dict[str, Any] | None = Field(
        None, description="As OpenAI's: {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                          "{\"name\", \"schema\"}}: the output follows it.")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="Exactly one of json (a schema), regex, choice (strings), grammar (Lark or GBNF): the "
                          "output follows it.")
    include_steps: bool = Field(True, description="Include per-step details in the response.")

    _stops = field_validator("stop")(classmethod(lambda cls, v: stop_list(v)))

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenLogprob(BaseModel):
    """The target's raw log-probability of one emitted token, from its own verify row."""

    logprob: float = Field(description="log p of the token emitted (log-softmax of the target's logits).")
    top_ids: list[int] = Field(description="The most likely tokens there, most likely first.")
    top_logprobs: list[float] = Field(description="Their log-probabilities.")


class Step(BaseModel):
    """One step of the speculative loop (one target pass): what ``orchestrator.loop.generate``
    yields, ``/v1/generate`` lists under ``steps`` and ``/v1/generate/stream`` sends as a ``step``
    event, the same object all the way. Times are milliseconds of wall time as the orchestrator saw
    them; lists marked [n] hold one entry per draft token."""

    index: int = Field(description="0-based step number within the generation.")
    k: int = Field(description="Draft length asked for (0: a plain step, no draft).")
    draft: list[int] = Field(description="[n] Draft tokens proposed and verified (n <= k: the draft may stop early).")
    draft_confidences: list[float] = Field(description="[n] The draft's probability of each of its tokens.")
    target_probs: list[float] = Field(description="[n] The target's probability of each draft token.")
    accepted: int = Field(description="Leading draft tokens the target accepted.")
    next_token: int = Field(description="The target's own token: correction, bonus, or the plain step's token.")
    next_kind: Literal["bonus", "correction", "plain"] = Field(
        description="correction: replaces the first rejected draft token; bonus: follows a fully accepted draft; "
                    "plain: a step without a draft.")
    next_token_prob: float = Field(description="The target's probability of next_token.")
    tokens: list[int] = Field(description="Tokens appended by this step (after EOS, max_tokens and context cuts).")
    text: str = Field(description="Text delta of this step.")
    draft_ms: float = Field(description="Time this step waited for its draft (0 for a pre-drafted step).")
    verify_ms: float = Field(description="Wall time of the Verify call.")
    draft_compute_ms: float = Field(description="The draft service's compute for this step's draft.")
    verify_compute_ms: float = Field(description="The target service's compute for this step.")
    overhead_ms: float = Field(description="Step wall time in neither call (orchestrator bookkeeping).")
    draft_stop_reason: str = Field(
        "", description="Why the draft stopped (max_tokens, low_confidence, eos, context_limit, no_candidate; '' without one).")
    draft_error: str = Field("", description="Why this step ran without a draft, when the draft failed ('' otherwise).")
    batch_sessions: int = Field(1, description="Sessions in the target's batched pass that verified this step.")
    batch_rows: int = Field(0, description="Token rows in that pass, across its sessions (0: not reported).")
    draft_batch_sessions: float = Field(0.0, description="Mean sessions per batched draft step (0: no draft).")
    predrafted: bool = Field(False, description="The draft was made while the previous step was verified (overlap).")
    token_texts: list[str] | None = Field(
        None, description="[n] Text of each draft token on its own (the stream only; null in /v1/generate).")
    next_token_text: str | None = Field(
        None, description="Text of next_token on its own (the stream only; null in /v1/generate).")
    logprobs: list[TokenLogprob] | None = Field(
        None, description="[len(tokens)] Each appended token's logprob, when the request asked for logprobs.")

    @computed_field(description="next_token when it replaced the first rejected draft token, else null.")
    @property
    def correction(self) -> int | None:
        return self.next_token if self.next_kind == "correction" else None

    @computed_field(description="next_token after a fully accepted draft or in a plain step, else null.")
    @property
    def bonus(self) -> int | None:
        return self.next_token if self.next_kind != "correction" else None


class GenerationStatsOut(BaseModel):
    """What one generation cost and gained (``orchestrator.step_accounting.GenerationStats.to_dict``;
    a test keeps the two equal, so a renamed figure fails there instead of in the dashboard or the
    benchmark)."""

    tokens: int = Field(description="Tokens generated.")
    iterations: int = Field(description="Loop steps: one target pass each.")
    draft_tokens: int = Field(description="Draft tokens proposed.")
    accepted_tokens: int = Field(description="Draft tokens the target accepted.")
    acceptance_rate: float = Field(description="accepted_tokens / draft_tokens (0 without drafts).")
    mean_accepted_per_iteration: float
    mean_tokens_per_iteration: float
    tokens_per_second: float
    elapsed_ms: float = Field(description="Wall time of the whole generation.")
    first_token_ms: float = Field(description="Wall time until the first step's tokens.")
    draft_ms: float = Field(description="Time the stream waited for drafts (Propose wall time).")
    verify_ms: float = Field(description="Wall time of Verify calls.")
    draft_compute_ms: float = Field(description="The draft service's compute for this stream.")
    verify_compute_ms: float = Field(description="The target service's compute for this stream.")
    rpc_overhead_ms: float = Field(description="RPC wall time not spent computing: round trips, queueing, (de)serialising.")
    overhead_ms: float = Field(description="Loop time outside both RPCs (orchestrator bookkeeping).")
    draft_ms_per_iteration: float
    verify_ms_per_iteration: float
    overhead_ms_per_iteration: float
    draft_fallbacks: int = Field(description="Steps run without a draft because the draft failed.")
    predrafted_iterations: int = Field(description="Steps whose draft was drafted during the previous verify (overlapped).")
    predrafts_dropped: int = Field(description="Pre-drafts cancelled or unusable.")
    draft_catch_ups: int = Field(description="Background Proposes that brought the draft's cache up to date.")


class GenerateResponse(BaseModel):
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: Literal["stop", "length", "cancelled"]
    mode: str
    controller: str
    steps: list[Step]
    stats: GenerationStatsOut


# ---- OpenAI-compatible bodies (the fields the official client sends) --------------------------

# OpenAI request fields this server does not honour (yet), each with the values that ask for
# nothing (OpenAI's defaults): any other value is refused with a 400 naming the field, never
# accepted and ignored (a client asking for JSON, logprobs or a penalty must be able to tell).
REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"), "best_of": (None, 1), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
}


def _refuse(value: Any, info: Any) -> Any:
    if value in REFUSED_FIELDS[info.field_name]:
        return value
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ValueError(f"{info.field_name}={shown} is not supported by this server; leave it unset "
                     "(docs/api.md lists the fields honoured)")


class OpenAIRequest(SpeculationParams, ProcessingFields):
    """Fields both OpenAI endpoints share, with OpenAI's defaults (temperature 1). Fields OpenAI
    defines that are not honoured are refused unless they ask for nothing (REFUSED_FIELDS);
    fields OpenAI does not define are ignored (as vLLM does: clients add their own)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: list[Text] | Text | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None  # OpenAI's end-user id: nothing to do with it here
    ignore_eos: bool = Field(False, description="vLLM's extension: keep generating past end-of-sequence tokens.")

    _stops = field_validator("stop")(classmethod(lambda cls, v: stop_list(v)))
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices to generate, each its own generation (and slot); "
                                                     "choice i samples with seed + i.")

    logprobs: bool | int | None = Field(
        None, description="chat: true for each token's logprob; completions: the number of top logprobs (0-20).")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="chat: most likely tokens per position (0-20).")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = Field(
        None, description="vLLM's names: raw_logprobs, the target's log-softmax of its logits; processed_logprobs, the "
                          "distribution each token was chosen from (after logit_bias, penalties, the grammar, "
                          "temperature, top-k, top-p and min_p; what it excludes is -9999). Default: the server's "
                          "logprobs_mode.")
    response_format: Any = Field(None, description="text, json_object or json_schema (strict): the output follows it.")
    structured_outputs: Any = Field(
        None, description="vLLM's extension: exactly one of json (a schema), regex, choice (strings), grammar (Lark "
                          "or GBNF).")
    tools: Any = Field(None, description="chat: functions the model may call (orchestrator.tools).")
    tool_choice: Any = Field(None, description="chat: none, auto (the default with tools), required, or a named function.")
    parallel_tool_calls: bool | None = Field(
        None, description="chat: accepted; auto returns every call the model writes, a forced choice one call.")
    functions: Any = None
    function_call: Any = None
    best_of: Any = None
    suffix: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    guided_json: Any = Field(None, description="vLLM's older spelling of structured_outputs.json.")
    guided_regex: Any = Field(None, description="vLLM's older spelling of structured_outputs.regex.")
    guided_choice: Any = Field(None, description="vLLM's older spelling of structured_outputs.choice.")
    guided_grammar: Any = Field(None, description="vLLM's older spelling of structured_outputs.grammar.")

    _refused = field_validator(*REFUSED_FIELDS)(classmethod(lambda cls, v, info: _refuse(v, info)))


class CompletionRequest(OpenAIRequest):
    prompt: Text | list[Text]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool | None = Field(None, description="Return the prompt before the completion (not with logprobs).")

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None and self.logprobs is not False:
            raise ValueError("echo with logprobs would need the prompt's logprobs, which are not computed; "
                             "ask for one of them")
        return self

    @field_validator("logprobs")
    @classmethod
    def _top_count(cls, v: bool | int | None) -> bool | int | None:
        if v is not None and not isinstance(v, bool) and not 0 <= v <= 20:
            raise ValueError(f"logprobs={v}: give 0 to 20 (the most likely tokens per position)")
        return v

    def logprob_count(self) -> int | None:
        """None for no logprobs, else how many top tokens per position (OpenAI's integer)."""
        return None if self.logprobs is None or self.logprobs is False else int(self.logprobs)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str:
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt is supported")
            v = v[0]
        if not v:
            raise ValueError("prompt must not be empty")
        return v


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and self.logprobs is not True:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs is True else None
