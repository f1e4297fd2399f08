"""Plain parameter types shared by services and the orchestrator (no torch import here, so the
orchestrator process stays light)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this decode greedily (as vLLM does): dividing logits by 1e-40 overflows to
# inf, the softmax gives NaN, and sampling would fail, while such a temperature means argmax anyway.
SAMPLING_EPS = 1e-5
MAX_LOGIT_BIAS = 1024  # tokens a logit_bias may name
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True)
class Sampling:
    """Sampling transform; ``temperature < SAMPLING_EPS`` (0 in particular) is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # structured output (specdec.grammar): llguidance's grammar JSON ("" for none), constraining the
    # tokens from index ``output_start`` of the request's sequence on (the prompt's length)
    grammar: str = ""
    output_start: int = 0
    # logit processing before the transform (specdec.sampling.process), OpenAI's and vLLM's meanings:
    # presence / frequency penalties count the output's tokens (from output_start), the repetition
    # penalty every token of the sequence; logit_bias adds to the named tokens' logits; min_p drops
    # tokens under min_p x the top token's probability (after temperature)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0

    @property
    def processes(self) -> bool:
        """Whether the logits are processed before the transform (penalties or a bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self) -> None:
        from specdec.errors import InvalidArgument

        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):  # also rejects NaN
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if self.output_start < 0:
            raise InvalidArgument(f"output_start must be >= 0, got {self.output_start}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also rejects NaN
                raise InvalidArgument(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidArgument(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got "
                                  f"{self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias holds {len(self.logit_bias)} tokens, over the {MAX_LOGIT_BIAS} allowed")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise InvalidArgument(f"logit_bias: token {token} with bias {bias}; biases lie in [-100, 100]")


@dataclass
class ModelInfo:
    """What a model service tells about itself (see InfoResponse in the proto)."""

    model_id: str
    architecture: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_context: int
    dtype: str
    device: str
    backend: str
    max_draft_tokens: int
    eos_token_ids: list[int] = field(default_factory=list)
    sessions: int = 0
    kv_bytes: int = 0
    kv_budget_bytes: int = 0
