"""How drafts fared at each draft position, counted across steps: the acceptance record the
cost controller prices draft lengths from (orchestrator.controller.CostController)."""

from __future__ import annotations

from orchestrator.controller_inputs import StepObservation


class DraftHistory:
    """How drafts fared, per draft position: decayed counts shared by every request of a process
    (see :class:`orchestrator.controller.CostController`), so a new request starts from what the pair has been doing rather
    than from a blind prior.

    ``reached[j]``/``passed[j]``: steps whose draft reached position j with every token before it
    accepted, and those that accepted j too; ``could_continue[j]``/``continued[j]``: drafts asked
    for j or more that got to j - 1, and those that drafted j too; ``successes``/``failures``:
    accepted tokens and rejections (alpha's counts)."""

    SIZE = 66  # positions 0..65: max_k is at most 64, and the overlapped guess is one more

    def __init__(self, size: int = SIZE) -> None:
        self.reached = [0.0] * size
        self.passed = [0.0] * size
        self.could_continue = [0.0] * size
        self.continued = [0.0] * size
        self.successes = self.failures = 0.0

    def record(self, step: StepObservation, decay: float, position_decay: float) -> None:
        """Count one step that proposed a draft."""
        self.successes = decay * self.successes + step.accepted
        self.failures = decay * self.failures + (1 if step.accepted < step.proposed else 0)
        # positions the draft reached with all before accepted, and those accepted too
        _tally(self.reached, self.passed, position_decay, 1, min(step.proposed, step.accepted + 1), step.accepted)
        # positions it was asked for and could go on to, and those it drafted
        _tally(self.could_continue, self.continued, position_decay, 2, min(step.k, step.proposed + 1), step.proposed)

    def seed(self, size: int, alpha_weight: float, position_weight: float) -> DraftHistory:
        """A copy of ``size`` positions scaled down to a prior: alpha's counts to ``alpha_weight``
        pseudo-tokens, each pair of position counts to at most ``position_weight`` pseudo-steps."""
        out = DraftHistory(size)
        total = self.successes + self.failures
        if total > 0:
            out.successes, out.failures = (alpha_weight * self.successes / total, alpha_weight * self.failures / total)
        for tried, hits, own_tried, own_hits in ((self.reached, self.passed, out.reached, out.passed),
                                                  (self.could_continue, self.continued, out.could_continue, out.continued)):
            scale = min(1.0, position_weight / max(max(tried), 1e-9))
            for j in range(min(size, len(tried))):
                own_tried[j], own_hits[j] = tried[j] * scale, hits[j] * scale
        return out


def _tally(tried: list[float], hits: list[float], decay: float, first: int, last: int, last_hit: int) -> None:
    """Decay per-position counts, then count positions first..last as tried and those up to
    ``last_hit`` as hits."""
    for j in range(first, len(tried)):
        tried[j] *= decay
        hits[j] *= decay
    for j in range(first, min(last, len(tried) - 1) + 1):
        tried[j] += 1
        hits[j] += 1 if j <= last_hit else 0
