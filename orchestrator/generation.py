"""What a generation is given and gives back: its parameters, the services' limits, its result,
and the errors that end it (each mapped to an HTTP status by the routes)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from orchestrator.controller_inputs import Topology
from orchestrator.step_accounting import GenerationStats
from specdec.params import Sampling

logger = logging.getLogger(__name__)

Mode = Literal["speculative", "autoregressive"]


class TargetUnavailable(Exception):
    """The target service cannot serve: the request fails with 503 and this reason."""


class TargetBusy(TargetUnavailable):
    """The target has no room right now (RESOURCE_EXHAUSTED: queue or KV budget full): HTTP 429."""


class BadRequest(Exception):
    """The target rejected the request's input (INVALID_ARGUMENT): HTTP 400 with this reason."""


@dataclass
class GenerationParams:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    mode: Mode = "speculative"
    confidence_threshold: float = 0.0
    ignore_eos: bool = False
    # Pre-draft the next block while this one is verified (greedy only): True always, False never,
    # None while this is the only generation in progress and the draft computes on another host
    # (``in_progress`` of generate: under concurrency the batched passes already fill the cores, and
    # a Verify yielding cores to one stream's pre-draft would slow everyone's).
    overlap: bool | None = False
    # None: no logprobs; n >= 0: each emitted token's raw logprob from the target's own verify row,
    # with the n most likely tokens' (the same bits whether the token was drafted or not)
    logprobs: int | None = None
    # the logprobs of the distribution each token was chosen from instead (vLLM's processed_logprobs)
    processed_logprobs: bool = False
    model_name: str = ""  # the served name: the model_name label of the vLLM-named metrics
    # tokens a draft far behind (a long prompt) prefills per call (OrchestratorSettings.draft_catch_up_chunk)
    draft_catch_up_chunk: int = 256
    queued_s: float = 0.0  # time in the orchestrator's admission queue (part of request_queue_time_seconds)


@dataclass
class ModelLimits:
    """What the loop needs to know of the services (from their Info)."""

    target_max_context: int
    target_max_draft: int
    draft_max_context: int
    draft_max_draft: int
    eos_token_ids: set[int]
    draft_shares_host: bool = False  # draft and target compute on the same host (their Info's host_id)
    topology: Topology = field(default_factory=Topology)  # where each party computes (the cost controller's input)


@dataclass
class GenerationResult:
    """How a generation ended: the last item ``generate`` yields, after its steps."""

    finish_reason: str  # "stop" (EOS or stop string), "length" (max_tokens or context), "cancelled"
    text: str
    stats: GenerationStats
    # generated tokens the text covers: all of them, but where a stop string cut the text (it may
    # end inside a block of accepted tokens), the fewest whose text holds what is returned
    text_tokens: int | None = None


@dataclass
class DraftHealth:
    """Process-wide: after a draft failure, decode without drafts for ``retry_s``, then retry."""

    retry_s: float
    down_until: float = 0.0
    last_error: str = ""

    def usable(self) -> bool:
        return time.monotonic() >= self.down_until

    def failed(self, reason: str) -> None:
        self.down_until = time.monotonic() + self.retry_s
        if reason != self.last_error:
            logger.warning("draft service failed (%s); decoding without drafts for %.0f s", reason, self.retry_s)
        self.last_error = reason

    def succeeded(self) -> None:
        if self.last_error:
            logger.info("draft service is back")
        self.last_error = ""
