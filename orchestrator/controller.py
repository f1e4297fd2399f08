"""Draft-length controllers: one small object per request, no model needed.

Every controller answers :meth:`next_k` before a step and learns from :meth:`observe` after it.
k == 0 means "no draft this step" (a plain decoding step through Verify).

- ``fixed``: always k.
- ``acceptance``: grow k by one after a fully accepted draft; otherwise set it to the expected
  run of accepted tokens under the recent per-token acceptance rate a, i.e. a / (1 - a).
- ``hf``: transformers' assisted-generation heuristic: +2 when all were accepted, else -1.
- ``cost`` (default): pick the k that maximises expected tokens per second, from the running
  acceptance estimate and the measured cost of drafting, verifying and round trips, including
  k = 0 when speculation does not pay.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass


@dataclass
class StepObservation:
    """What one step cost and yielded."""

    k: int  # draft length asked for
    proposed: int  # draft tokens actually proposed (early stop can make it < k)
    accepted: int  # draft tokens the target accepted
    draft_ms: float  # wall time of Propose as the client saw it (0 when no draft)
    verify_ms: float  # wall time of Verify as the client saw it
    draft_compute_ms: float = 0.0  # server-side compute of Propose
    warm: bool = True  # False for the first step, whose cost is dominated by the prompt's prefill


class Controller(abc.ABC):
    name: str = ""

    def __init__(self, k: int, max_k: int) -> None:
        self.max_k = max_k
        self.k = self.clamp(k)

    def clamp(self, k: float) -> int:
        return int(min(max(round(k), 0), self.max_k))

    @abc.abstractmethod
    def next_k(self) -> int:
        """Draft length for the next step, in [0, max_k]."""

    @abc.abstractmethod
    def observe(self, step: StepObservation) -> None:
        """Learn from the step just done."""


class FixedController(Controller):
    name = "fixed"

    def next_k(self) -> int:
        return self.k

    def observe(self, step: StepObservation) -> None:
        pass


class HFController(Controller):
    """transformers' ``num_assistant_tokens_schedule="heuristic"``: +2 on full acceptance, else -1."""

    name = "hf"

    def __init__(self, k: int, max_k: int) -> None:
        super().__init__(max(k, 1), max_k)

    def next_k(self) -> int:
        return self.k

    def observe(self, step: StepObservation) -> None:
        if step.proposed == 0:
            return
        if step.accepted == step.proposed:
            self.k = min(self.k + 2, self.max_k)
        else:
            self.k = max(self.k - 1, 1)


class AcceptanceController(Controller):
    """Grow after a fully accepted draft, otherwise follow the recent acceptance rate."""

    name = "acceptance"

    def __init__(self, k: int, max_k: int, decay: float = 0.7) -> None:
        super().__init__(max(k, 1), max_k)
        self.decay = decay
        self.rate = 0.8  # prior per-token acceptance

    def next_k(self) -> int:
        return self.k

    def observe(self, step: StepObservation) -> None:
        if step.proposed == 0:
            return
        self.rate = self.decay * self.rate + (1 - self.decay) * (step.accepted / step.proposed)
        if step.accepted == step.proposed:
            self.k = min(self.k + 1, self.max_k)
        else:
            a = min(self.rate, 0.99)
            self.k = min(max(1, math.ceil(a / (1 - a))), self.max_k)


@dataclass
class CostModel:
    """Running estimates of what a step costs, in milliseconds.

    Verify cost is modelled as linear in the number of tokens verified (a + b * k), fitted by
    exponentially weighted least squares; draft cost as a per-call overhead plus a per-token cost.
    """

    decay: float = 0.9
    # weighted sums for the verify regression over (k, ms)
    _w: float = 0.0
    _sk: float = 0.0
    _skk: float = 0.0
    _sy: float = 0.0
    _sky: float = 0.0
    draft_per_token_ms: float | None = None
    draft_call_ms: float = 1.0  # round trip and fixed cost of a Propose call

    def observe_verify(self, k: int, ms: float) -> None:
        d = self.decay
        self._w = d * self._w + 1
        self._sk = d * self._sk + k
        self._skk = d * self._skk + k * k
        self._sy = d * self._sy + ms
        self._sky = d * self._sky + k * ms

    def observe_draft(self, proposed: int, ms: float, compute_ms: float) -> None:
        if proposed <= 0:
            return
        per_token = compute_ms / proposed
        overhead = max(ms - compute_ms, 0.0)
        if self.draft_per_token_ms is None:
            self.draft_per_token_ms, self.draft_call_ms = per_token, overhead
        else:
            d = self.decay
            self.draft_per_token_ms = d * self.draft_per_token_ms + (1 - d) * per_token
            self.draft_call_ms = d * self.draft_call_ms + (1 - d) * overhead

    def verify_ms(self, k: int) -> float | None:
        if self._w == 0:
            return None
        mean_k, mean_y = self._sk / self._w, self._sy / self._w
        var = self._skk / self._w - mean_k * mean_k
        if var < 1e-6:
            # one k seen so far: assume each extra verified token costs 10 % of a step
            slope = 0.1 * mean_y / (1 + 0.1 * mean_k)
        else:
            slope = max((self._sky / self._w - mean_k * mean_y) / var, 0.0)
        return max(mean_y + slope * (k - mean_k), 0.1)

    def draft_ms(self, k: int) -> float | None:
        if k == 0:
            return 0.0
        if self.draft_per_token_ms is None:
            return None
        return self.draft_call_ms + self.draft_per_token_ms * k


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per step with per-token acceptance alpha and k draft tokens (accepted
    draft tokens plus the target's own token): (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class CostController(Controller):
    """Choose k in [0, max_k] maximising expected_tokens(alpha, k) / (draft_ms(k) + verify_ms(k)).

    alpha is the per-token acceptance estimate: accepted / (accepted + rejections) over recent
    steps (a step that accepted everything counts no rejection). While a cost is unknown the
    controller explores; after choosing k = 0 it probes a small draft every ``probe_every`` steps
    so it notices when the text becomes predictable again.

    Costs are properties of the deployment, not of the text, so the orchestrator passes one
    process-wide :class:`CostModel` to every request's controller; acceptance stays per request.
    """

    name = "cost"

    def __init__(self, k: int, max_k: int, costs: CostModel | None = None, decay: float = 0.8,
                 probe_every: int = 8) -> None:
        super().__init__(k, max_k)
        self.costs = costs or CostModel()
        self.decay = decay
        self.probe_every = probe_every
        # pseudo-counts of accepted tokens and rejections: prior alpha = 0.8
        self.successes, self.failures = 4.0, 1.0
        self._plain_steps = 0
        self.last_choice: dict[int, float] = {}  # expected tokens/ms by k at the last decision

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def next_k(self) -> int:
        if self.costs.verify_ms(0) is None or self.costs.draft_ms(1) is None:
            return max(self.k, 1)  # explore: we need both costs before comparing
        rates = {}
        for k in range(0, self.max_k + 1):
            cost = self.costs.verify_ms(k) + self.costs.draft_ms(k)
            rates[k] = expected_tokens(self.alpha, k) / cost
        self.last_choice = rates
        best = max(rates, key=rates.get)
        if best == 0:
            self._plain_steps += 1
            if self._plain_steps % self.probe_every == 0:
                best = 1
        else:
            self._plain_steps = 0
        self.k = best
        return best

    def observe(self, step: StepObservation) -> None:
        # Costs are wall times as the client sees them: tokens per second is what we maximise.
        if step.warm:
            self.costs.observe_verify(step.proposed, step.verify_ms)
            if step.proposed:
                self.costs.observe_draft(step.proposed, step.draft_ms, step.draft_compute_ms or step.draft_ms)
        if step.proposed:
            rejected = 1 if step.accepted < step.proposed else 0
            self.successes = self.decay * self.successes + step.accepted
            self.failures = self.decay * self.failures + rejected


def make_controller(name: str, k: int, max_k: int, costs: CostModel | None = None) -> Controller:
    """Controller by request name (see module docstring)."""
    if name == "fixed":
        return FixedController(k, max_k)
    if name == "hf":
        return HFController(k, max_k)
    if name == "acceptance":
        return AcceptanceController(k, max_k)
    if name == "cost":
        return CostController(k, max_k, costs)
    raise ValueError(f"unknown controller {name!r}; choose fixed, acceptance, hf or cost")
