"""Step bookkeeping: what each stage of a step found (:class:`StepInProgress`), what the
controller learns from it, the :class:`~orchestrator.schemas.Step` event every client gets, and a
generation's running totals (:class:`GenerationStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrator.clients import Proposed, Verified
from orchestrator.controller_inputs import StepObservation
from orchestrator.schemas import Step, TokenLogprob


@dataclass
class GenerationStats:
    tokens: int = 0
    iterations: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_ms: float = 0.0  # wall time of Propose calls as the orchestrator saw them
    verify_ms: float = 0.0  # wall time of Verify calls
    draft_compute_ms: float = 0.0  # server-side compute of Propose calls
    verify_compute_ms: float = 0.0  # server-side compute of Verify calls
    overhead_ms: float = 0.0  # loop time outside both RPCs
    elapsed_ms: float = 0.0
    first_token_ms: float = 0.0
    draft_fallbacks: int = 0
    predrafted: int = 0  # steps whose draft came from a pre-draft (overlapped mode)
    predrafts_dropped: int = 0  # pre-drafts cancelled or unusable (rejection, or a different bonus token)
    draft_catch_ups: int = 0  # background Proposes that brought the draft's cache up to date (steps ran plainly meanwhile)

    def record_step(self, step: StepInProgress, overhead_ms: float) -> None:
        """Add one finished step (``overhead_ms``: its time outside both RPCs)."""
        v = step.verified
        self.iterations += 1
        self.tokens += len(step.new)
        self.proposed += len(step.tokens)
        self.accepted += v.num_accepted
        self.draft_ms += step.draft_wait_ms
        self.verify_ms += v.wall_ms
        self.draft_compute_ms += step.draft_compute_ms
        self.verify_compute_ms += v.compute_ms
        self.overhead_ms += overhead_ms

    def to_dict(self) -> dict[str, Any]:
        it = max(self.iterations, 1)
        seconds = self.elapsed_ms / 1e3
        return {
            "tokens": self.tokens,
            "iterations": self.iterations,
            "draft_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "mean_accepted_per_iteration": self.accepted / it,
            "mean_tokens_per_iteration": self.tokens / it,
            "tokens_per_second": self.tokens / seconds if seconds > 0 else 0.0,
            "elapsed_ms": self.elapsed_ms,
            "first_token_ms": self.first_token_ms,
            "draft_ms": self.draft_ms,
            "verify_ms": self.verify_ms,
            "draft_compute_ms": self.draft_compute_ms,
            "verify_compute_ms": self.verify_compute_ms,
            # RPC round trips, (de)serialisation and queueing: wall minus server compute
            "rpc_overhead_ms": (self.draft_ms - self.draft_compute_ms) + (self.verify_ms - self.verify_compute_ms),
            "overhead_ms": self.overhead_ms,
            "draft_ms_per_iteration": self.draft_ms / it,
            "verify_ms_per_iteration": self.verify_ms / it,
            "overhead_ms_per_iteration": self.overhead_ms / it,
            "draft_fallbacks": self.draft_fallbacks,
            "predrafted_iterations": self.predrafted,
            "predrafts_dropped": self.predrafts_dropped,
            "draft_catch_ups": self.draft_catch_ups,
        }


@dataclass
class StepInProgress:
    """One iteration in the making: what each stage of
    :class:`orchestrator.loop.SpeculativeRequest` found."""

    t_start: float
    k: int = 0
    draft_error: str = ""
    proposal: Proposed | None = None
    draft_ms: float = 0.0  # the Propose's wall time (0 for a pre-draft: counted in the step that made it)
    draft_wait_ms: float = 0.0  # what this step waited for drafts
    predrafted: bool = False
    tokens: list[int] = field(default_factory=list)  # the draft verified
    verified: Verified | None = None  # the target's answer (set by verify)
    new: list[int] = field(default_factory=list)  # tokens appended
    kind: Literal["bonus", "correction", "plain"] = "plain"
    done: bool = False
    text: str = ""

    @property
    def draft_compute_ms(self) -> float:
        """Server-side compute of the step's Propose (0 without one)."""
        return self.proposal.compute_ms if self.proposal else 0.0

    def observation(self, warm: bool, draft_catch_up: int) -> StepObservation:
        """What the controller learns from this step (the only place one is made): ``warm`` is
        False for the first step (its cost is the prompt's prefill); ``draft_catch_up``: tokens the
        draft processed besides its proposals."""
        v, proposal = self.verified, self.proposal
        return StepObservation(
            k=self.k, proposed=len(self.tokens), accepted=v.num_accepted, draft_ms=self.draft_ms, verify_ms=v.wall_ms,
            draft_compute_ms=self.draft_compute_ms, warm=warm, draft_catch_up=draft_catch_up,
            verify_rows=v.batch_rows, verify_sessions=v.batch_sessions,
            draft_sessions=proposal.batch_sessions if proposal else 1.0,
            verify_cpu_ms=v.step_cpu_ms, draft_step_cpu_ms=proposal.step_cpu_ms if proposal else 0.0,
            predrafted=self.predrafted,
        )

    def event(self, index: int, overhead_ms: float) -> Step:
        """The step as every client gets it: the ``index``-th of its generation, ``overhead_ms`` of
        its time spent outside both RPCs."""
        v, proposal = self.verified, self.proposal
        return Step(
            index=index, k=self.k, draft=self.tokens,
            draft_confidences=proposal.confidences if proposal else [],
            target_probs=v.target_probs, accepted=v.num_accepted, next_token=v.next_token, next_kind=self.kind,
            next_token_prob=v.next_token_prob, tokens=self.new, text=self.text, draft_ms=self.draft_wait_ms,
            logprobs=[TokenLogprob(logprob=lp, top_ids=ids, top_logprobs=lps)
                      for lp, ids, lps in v.logprobs[:len(self.new)]] if v.logprobs is not None else None,
            verify_ms=v.wall_ms, draft_compute_ms=self.draft_compute_ms,
            verify_compute_ms=v.compute_ms, overhead_ms=overhead_ms,
            draft_stop_reason=proposal.stop_reason if proposal else "", draft_error=self.draft_error,
            batch_sessions=v.batch_sessions, batch_rows=v.batch_rows,
            draft_batch_sessions=proposal.batch_sessions if proposal else 0.0, predrafted=self.predrafted,
        )
