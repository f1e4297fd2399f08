"""Draft-length controllers: one small object per request, no model needed.

Every controller answers :meth:`next_k` before a step and learns from :meth:`observe` after it.
k == 0 means "no draft this step" (a plain decoding step through Verify).

- ``fixed``: always k.
- ``acceptance``: grow k by one after a fully accepted draft; otherwise set it to the expected
  run of accepted tokens under the recent per-token acceptance rate a, i.e. a / (1 - a).
- ``hf``: transformers' assisted-generation heuristic: +2 when all were accepted, else -1.
- ``cost`` (default): pick the k that maximises expected tokens per second, from the running
  acceptance estimate and the measured cost (orchestrator.cost_model) of drafting, verifying and
  round trips *at the current load* (both services batch concurrent requests; their cost grows
  with the rows and sessions batched, which every response reports), including k = 0 when
  speculation does not pay.
"""

from __future__ import annotations

import abc
import math

from orchestrator.controller_inputs import ALONE, Load, StepObservation
from orchestrator.cost_model import CostModel


class Controller(abc.ABC):
    name: str = ""
    probing: bool = False  # the last next_k() asked for a draft only to re-measure acceptance, not because it pays

    def __init__(self, k: int, max_k: int) -> None:
        self.max_k = max_k
        self.k = self.clamp(k)

    def clamp(self, k: float) -> int:
        return int(min(max(round(k), 0), self.max_k))

    @abc.abstractmethod
    def next_k(self, load: Load = ALONE) -> int:
        """Draft length for the next step, in [0, max_k], under ``load``."""

    @abc.abstractmethod
    def observe(self, step: StepObservation) -> None:
        """Learn from the step just done."""


class FixedController(Controller):
    name = "fixed"

    def next_k(self, load: Load = ALONE) -> int:
        return self.k

    def observe(self, step: StepObservation) -> None:
        pass


class HFController(Controller):
    """transformers' ``num_assistant_tokens_schedule="heuristic"``: +2 on full acceptance, else -1."""

    name = "hf"

    def __init__(self, k: int, max_k: int) -> None:
        super().__init__(max(k, 1), max_k)

    def next_k(self, load: Load = ALONE) -> int:
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

    def next_k(self, load: Load = ALONE) -> int:
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


class CostController(Controller):
    """Choose k in [0, max_k] maximising expected tokens per step / (draft_ms(k) + verify_ms(k)).

    Expected tokens at k are 1 + sum over j <= k of the chance that the first j draft tokens are
    all accepted, from the acceptance *at each position* given the ones before it were accepted,
    counted over recent steps (:meth:`acceptance_at`). A single per-token rate alpha
    (accepted / (accepted + rejections), a step that accepted everything counting no rejection)
    is their prior. Acceptance is not geometric: a draft fails at a few hard tokens and runs long
    through easy text, and the confidence threshold cuts it where it is unsure, so a draft that
    got to position 6 is accepted there far more often than alpha says. Priced at alpha alone, the
    late draft tokens look worth too little, and `cost` chooses shorter drafts than a long fixed k
    that gets more tokens per step at the same iteration cost (docs/benchmarks.md, "The cost
    controller").

    A step asking for k seldom pays for k draft tokens: the draft stops early after a token it is
    unsure of (the confidence threshold) or at EOS, and the target then verifies fewer rows. So the
    cost of k is priced at the *expected* draft length, from the chance that a draft asked to go
    past position j - 1 went on to j (:meth:`continue_at`), counted like acceptance. Priced at k
    itself, a long k looks as dear as a draft that never stops early, and the controller chose
    too short drafts (docs/benchmarks.md, "The cost controller"). While a cost is unknown the
    controller explores; after choosing k = 0 it probes a small draft ``probe_every`` plain steps
    later so it notices when the text becomes predictable again, and twice as many plain steps
    after each probe that still leaves k = 0 the best (up to MAX_PROBE_GAP): a probe costs the
    draft's catch-up on every token it missed plus a verify of two rows, and where speculation
    cannot pay at all (a quantised target whose step costs what a draft token does) probes at a
    fixed gap cost a visible share of plain decoding's speed, hence the doubling
    (docs/benchmarks.md, "The cost controller").

    Costs are properties of the deployment, not of the text, so the orchestrator passes one
    process-wide :class:`CostModel` to every request's controller. Acceptance depends on the text,
    so each request counts its own, starting from the pair's recent record across requests
    (``CostModel.history``) scaled down to a prior of at most HISTORY_PRIOR steps.

    Overlapped (``Load.overlap``, given by the loop for the step, see orchestrator.loop): the draft
    of block i + 1 (k + 1 tokens, the first a guess of the bonus token) runs while block i is
    verified. With probability c = alpha^(k+1) the target takes the whole block and the guess, and
    the step costs
    max(verify(k), draft(k + 1)); otherwise the pre-draft is dropped and the step costs its verify
    plus a draft of k from the true sequence before the next one. So a step is expected to cost
    c * max(V, D(k+1)) + (1 - c) * (V + D(k)): overlap pays most where the draft is slow or far
    (a round trip to another host) and acceptance is high.
    """

    name = "cost"

    def __init__(self, k: int, max_k: int, costs: CostModel | None = None, decay: float = 0.8,
                 probe_every: int = 8) -> None:
        super().__init__(k, max_k)
        self.costs = costs or CostModel()
        self.decay = decay
        self.probe_every = probe_every
        # This request's own counts (see DraftHistory), starting from the process's history scaled
        # down to a prior; with no history yet, alpha's prior is 0.8 (4 accepted, 1 rejection).
        own = self.costs.history.seed(max_k + 2, self.ALPHA_PRIOR, self.HISTORY_PRIOR)
        if own.successes + own.failures == 0:
            own.successes, own.failures = 4.0, 1.0
        self.own = own
        self._plain_steps = 0
        self._probe_gap = probe_every  # plain steps before the next probe
        self.last_choice: dict[int, float] = {}  # expected tokens/ms by k at the last decision

    POSITION_DECAY = 0.95  # per step with a draft: position counts fill slower than alpha's
    POSITION_PRIOR = 2.0  # pseudo-steps at alpha behind each position's own count
    ALPHA_PRIOR = 5.0  # pseudo-tokens of alpha a request starts with
    HISTORY_PRIOR = 4.0  # at most this many pseudo-steps per position taken from earlier requests
    MAX_PROBE_GAP = 64  # plain steps between probes at most

    @property
    def alpha(self) -> float:
        return self.own.successes / (self.own.successes + self.own.failures)

    def acceptance_at(self, j: int) -> float:
        """Chance that draft token j (1-based) is accepted when tokens 1..j-1 were (see
        :meth:`acceptances`)."""
        return self.acceptances(j)[-1] if j >= 1 else 1.0

    def acceptances(self, n: int) -> list[float]:
        """[acceptance at positions 1..n]: each position's own recent rate, shrunk towards the
        position before it (position 1: towards alpha), and never below alpha.

        Shrinking towards the previous position carries what the draft does at positions it
        often reaches to the ones it seldom reaches: a draft that got past its hard tokens is
        accepted more, not less, further on, so pricing the late tokens of a long draft at alpha
        made `cost` stop drafts short of where they still paid (docs/benchmarks.md, "The cost
        controller"). Never below alpha:
        a position reached rarely would otherwise keep one unlucky rejection for many steps, and
        the controller would stop drafting that far, so never learn better; alpha already counts
        every rejection, wherever it fell."""
        alpha = self.alpha
        out: list[float] = []
        prior = alpha
        for j in range(1, n + 1):
            reached = self.own.reached[j] if j < len(self.own.reached) else 0.0
            passed = self.own.passed[j] if j < len(self.own.passed) else 0.0
            prior = max((passed + self.POSITION_PRIOR * prior) / (reached + self.POSITION_PRIOR), alpha)
            out.append(prior)
        return out

    def continue_at(self, j: int) -> float:
        """Chance that a draft asked for at least j tokens, having drafted j - 1, drafts token j
        too (j = 1: always); a prior of POSITION_PRIOR drafts that never stop early."""
        if j <= 1:
            return 1.0
        asked = self.own.could_continue[j] if j < len(self.own.could_continue) else 0.0
        went = self.own.continued[j] if j < len(self.own.continued) else 0.0
        return (went + self.POSITION_PRIOR) / (asked + self.POSITION_PRIOR)

    def reach(self, n: int) -> list[float]:
        """[chance that a draft asked for n tokens or more drafts at least j, for j = 0..n]."""
        out = [1.0]
        for j in range(1, n + 1):
            out.append(out[-1] * self.continue_at(j))
        return out

    def survival(self, n: int) -> list[float]:
        """[chance that draft tokens 1..j are all accepted once drafted, for j = 0..n] (j = 0: 1).
        A step asking for k is expected to land ``sum(reach(k)[j] * survival(k)[j])`` tokens: the
        accepted draft plus the target's own."""
        out = [1.0]
        for a in self.acceptances(n):
            out.append(out[-1] * a)
        return out

    def next_k(self, load: Load = ALONE) -> int:
        if not self.costs.speculation_allowed(load):
            self.k, self.probing = 0, False
            return 0
        if self.costs.verify_ms(0) is None or self.costs.draft_ms(1) is None:
            return max(self.k, 1)  # explore: we need both costs before comparing
        survival = self.survival(self.max_k + 1)  # once per decision; k + 1 for the overlapped guess
        reach = self.reach(self.max_k + 1)
        rates, tokens, drafted = {}, 0.0, 0.0
        for k in range(0, self.max_k + 1):
            # token k lands if the draft got that far and it and every one before it were accepted
            tokens += reach[k] * survival[k]
            drafted += reach[k] if k else 0.0
            rates[k] = tokens / self.round_ms(drafted, survival[k + 1], load)
        self.last_choice = rates
        best = max(rates, key=rates.get)
        self.probing = False
        if best == 0:
            self._plain_steps += 1
            if self._plain_steps >= self._probe_gap:
                best, self.probing = 1, True
                self._plain_steps = 0
                self._probe_gap = max(min(2 * self._probe_gap, self.MAX_PROBE_GAP), self.probe_every)
        else:
            self._plain_steps = 0
            self._probe_gap = self.probe_every
        self.k = best
        return best

    def round_ms(self, k: float, whole_block: float | None = None, load: Load = ALONE) -> float:
        """Expected milliseconds per step drafting k tokens (an expected, possibly fractional
        count), alternating or overlapped (``load.overlap``, see the class docstring);
        ``whole_block``: the chance that the k draft tokens and the bonus guess are all accepted
        (default: from the acceptance estimates)."""
        if not load.overlap or k == 0:
            return self.costs.round_ms(k, load)
        verify, draft, predraft = self.costs.verify_ms(k), self.costs.draft_ms(k), self.costs.draft_ms(k + 1)
        c = self.survival(math.ceil(k) + 1)[-1] if whole_block is None else whole_block
        wall = c * max(verify, predraft) + (1 - c) * (verify + draft)
        return max(wall, self.costs.cpu_round_ms(k, load))

    def observe(self, step: StepObservation) -> None:
        self.costs.observe(step, self.decay, self.POSITION_DECAY)
        if step.proposed:
            self.own.record(step, self.decay, self.POSITION_DECAY)


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
