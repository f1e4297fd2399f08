"""Plain parameter types shared by services and the orchestrator (no torch import here, so the
orchestrator process stays light)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this decode greedily (as vLLM does): dividing logits by 1e-40 overflows to
# inf, the softmax gives NaN, and sampling would fail, while such a temperature means argmax anyway.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class Sampling:
    """Sampling transform; ``temperature < SAMPLING_EPS`` (0 in particular) is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # structured output (specdec.grammar): llguidance's grammar JSON ("" for none), constraining the
    # tokens from index ``grammar_start`` of the request's sequence on (the prompt's length)
    grammar: str = ""
    grammar_start: int = 0

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
        if self.grammar_start < 0:
            raise InvalidArgument(f"grammar_start must be >= 0, got {self.grammar_start}")


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
