"""Draft-length controllers: one small object per request, no model needed.

Every controller answers :meth:`next_k` before a step and learns from :meth:`observe` after it.
k == 0 means "no draft this step" (a plain decoding step through Verify).

- ``fixed``: always k.
- ``acceptance``: grow k by one after a fully accepted draft; otherwise set it to the expected
  run of accepted tokens under the recent per-token acceptance rate a, i.e. a / (1 - a).
- ``hf``: transformers' assisted-generation heuristic: +2 when all were accepted, else -1.
- ``cost`` (default): pick the k that maximises expected tokens per second, from the running
  acceptance estimate and the measured cost of drafting, verifying and round trips *at the
  current load* (both services batch concurrent requests; their cost grows with the rows and
  sessions batched, which every response reports), including k = 0 when speculation does not pay.
"""

from __future__ import annotations

import abc
import bisect
import math
import time
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
    draft_catch_up: int = 1  # tokens the draft processed besides its proposals (missed since its last call)
    warm: bool = True  # False for the first step, whose cost is dominated by the prompt's prefill
    verify_rows: int = 0  # token rows of the batched forward that verified it, all sessions (0: unknown)
    verify_sessions: int = 1  # sessions in that forward
    draft_sessions: float = 1.0  # mean sessions per batched draft step of the Propose
    verify_cpu_ms: float = 0.0  # CPU time of the target's process on that forward (0: unknown)
    draft_step_cpu_ms: float = 0.0  # mean CPU time of the draft's process per draft step (0: unknown)
    predrafted: bool = False  # overlapped mode: the draft was made during the previous Verify


Site = tuple[str, float]  # where a service computes and its capacity: see compute_site


@dataclass(frozen=True)
class Topology:
    """Where each party computes (from the services' Info; None: unknown, no CPU term)."""

    target: Site | None = None
    draft: Site | None = None
    own: Site | None = None  # this process

    def draft_shares_target(self) -> bool:
        return self.target is not None and self.draft is not None and self.target[0] == self.draft[0]


@dataclass(frozen=True)
class Load:
    """What the next step is decided under, as the loop sees it: an input of :meth:`Controller.next_k`."""

    streams: int = 1  # generations in progress through this process, this one included
    overlap: bool = False  # the step runs overlapped (see CostController)
    topology: Topology = Topology()


ALONE = Load()  # one stream, alternating, hosts unknown


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


class LinearFit:
    """Exponentially weighted least squares of y on x: y ~ a + b * x, with b >= 0."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w = d * self.w + 1
        self.sx = d * self.sx + x
        self.sxx = d * self.sxx + x * x
        self.sy = d * self.sy + y
        self.sxy = d * self.sxy + x * y

    def _fit(self) -> tuple[float, float, float | None]:
        """(mean x, mean y, slope >= 0, or None while only one x has been seen); needs a point."""
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mean_x * mean_x
        slope = max((self.sxy / self.w - mean_x * mean_y) / var, 0.0) if var >= 1e-6 else None
        return mean_x, mean_y, slope

    def predict(self, x: float, default_slope_ratio: float) -> float | None:
        """None before any point; with a single x seen, the slope is ``default_slope_ratio`` of
        the mean per unit of x plus one."""
        if self.w == 0:
            return None
        mean_x, mean_y, slope = self._fit()
        if slope is None:
            slope = default_slope_ratio * mean_y / (1 + default_slope_ratio * mean_x)
        return max(mean_y + slope * (x - mean_x), 0.1)

    def intercept(self) -> float:
        """y at x = 0 (at least 0); 0 until two different x have been seen."""
        if self.w == 0:
            return 0.0
        mean_x, mean_y, slope = self._fit()
        return 0.0 if slope is None else max(mean_y - slope * mean_x, 0.0)


class CostCurve:
    """Running cost by size (token rows of a forward pass): a weighted running mean per size seen,
    read between sizes by linear interpolation and beyond them along the nearest segment (slope >= 0).

    A straight line fits a pass's cost badly once the kernel changes with the rows: the target runs
    1-4 rows through MKL and 5 or more through oneDNN, whose cost grows far more slowly (embedded
    target, 2 threads: 57 ms for 1 row, ~85 ms for 5, ~99 ms for 9). A line through those points
    prices every extra draft token at the steep 1-to-5-row slope and picks too short drafts.
    """

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._points: dict[int, tuple[float, float]] = {}  # size -> (weight, weighted sum)
        self.count = 0  # observations so far

    def add(self, x: float, y: float) -> None:
        self.count += 1
        key = max(int(round(x)), 0)
        w, total = self._points.get(key, (0.0, 0.0))
        self._points[key] = (self.decay * w + 1, self.decay * total + y)

    def _at(self, x: int) -> float:
        w, total = self._points[x]
        return total / w

    def predict(self, x: float, default_slope_ratio: float) -> float | None:
        """None before any point; with a single size seen, each extra unit of x costs
        ``default_slope_ratio`` of the cost per unit at that size (as :class:`LinearFit`)."""
        if not self._points:
            return None
        xs = sorted(self._points)
        if len(xs) == 1:
            x0, y0 = xs[0], self._at(xs[0])
            slope = default_slope_ratio * y0 / (1 + default_slope_ratio * x0)
            return max(y0 + slope * (x - x0), 0.1)
        i = bisect.bisect_left(xs, x)
        if i < len(xs) and xs[i] == x:
            return max(self._at(xs[i]), 0.1)
        lo, hi = (xs[0], xs[1]) if i == 0 else (xs[-2], xs[-1]) if i == len(xs) else (xs[i - 1], xs[i])
        y_lo, y_hi = self._at(lo), self._at(hi)
        slope = (y_hi - y_lo) / (hi - lo)
        if lo <= x <= hi:
            return max(y_lo + slope * (x - lo), 0.1)
        # beyond what was measured, from the nearest size: never cheaper for more rows
        x0, y0 = (hi, y_hi) if x > hi else (lo, y_lo)
        return max(y0 + max(slope, 0.0) * (x - x0), 0.1)


class DraftHistory:
    """How drafts fared, per draft position: decayed counts shared by every request of a process
    (see :class:`CostController`), so a new request starts from what the pair has been doing rather
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


def compute_site(host_id: str, device: str, cpu_cores: float) -> tuple[str, float] | None:
    """Where a model service computes, from its Info: (site, capacity), None when its host is unknown.

    Services whose sites are equal compete for the same compute. A service on the CPU computes on
    its host's cores: the site is the host (``host_id``) and the capacity its cores. One on an
    accelerator computes there: the site is the host and the device (a bare ``cuda`` is device 0,
    as torch and llama.cpp take it), with the capacity of one device running one pass at a time.
    So a target on ``cuda:0`` and a draft on the CPU of the same host do not share compute (the
    target's host-side work, launching kernels, is small next to a CPU draft's), while two
    services on one GPU do.
    """
    if not host_id:
        return None
    kind = device.split(":", 1)[0]
    if kind in ("", "cpu"):
        return host_id, cpu_cores
    return f"{host_id}/{device if ':' in device else device + ':0'}", 1.0


class CostModel:
    """Running estimates of what a step costs, in milliseconds of wall time as the client sees it,
    as functions of the load the model services batch together.

    - Verify: one batched forward pass whose cost grows with its token rows R across all sessions
      in it: verify_ms ~ f(R), a :class:`CostCurve` (not a line: the kernels change with R). A
      request choosing k adds k + 1 rows; the other sessions sharing
      the pass (``verify_sessions``, a running mean of what the target reports) add theirs, so
      with everyone at k the pass has ``verify_sessions * (k + 1)`` rows.
    - Draft: a fixed cost per Propose call (its round trip: large when the draft is on another host)
      plus k batched draft steps, each costing more with the sessions sharing it:
      draft_ms ~ call + k * (c + d * S), S the running mean of sessions per draft step; ``call``
      is the intercept of Propose wall time against the tokens it proposed.

    Both fits are measured at run time from what the services report with every call, so as the
    machine fills, verify and draft cost more, and the k that maximises tokens per second falls,
    down to 0 (plain decoding) when speculation would not pay. Calls where the draft first had to
    catch up on many tokens it had not seen (after plain steps) are left out of the draft fit: that
    catch-up is a one-off, and counting it as a per-step cost would make drafting look too
    expensive ever to resume.

    Wall time alone misjudges a busy machine. When the services share CPU cores (one host, or
    containers on one host), every draft step takes cores the target's forward would use, and once
    the cores are saturated aggregate throughput is set by CPU time per token, not by anyone's
    latency. So the model also fits what a step costs the machine — the process CPU time both
    services report per pass (``step_cpu_ms``: all threads) against rows and sessions, and this
    process's own CPU per step — and is told with each decision (a :class:`Load`: the streams in
    progress and the :class:`Topology` read from Info) which services share a host and how many
    cores it has. :meth:`round_ms` is then the larger of a stream's wall time per step and the time
    the busiest host needs to run one step of *every* stream in progress: the second term is what
    makes k fall to 0 at high concurrency, where plain decoding wins on CPU per token.
    """

    MAX_CATCH_UP = 3  # tokens a draft processes besides its own in steady state: 1-2
    # A draft cost not confirmed by any Propose for this long is forgotten (the controller then
    # explores again). Without this, one burst of slow Proposes (another process briefly taking
    # the cores) could price drafting out for good: once k = 0 wins, no request drafts again, the
    # draft falls behind, and probes of a draft that is behind never reach the fit (catch-up).
    DRAFT_COST_TTL_S = 20.0

    def __init__(self, decay: float = 0.9, share_decay: float = 0.8, shared_host_max_streams: int = 0) -> None:
        self.shared_host_max_streams = shared_host_max_streams
        self.history = DraftHistory()  # how drafts fared, across every request sharing this model
        self.verify = CostCurve(decay)  # wall ms of Verify by token rows of its forward pass
        self.draft_step = LinearFit(decay)  # wall ms per draft step (the call's fixed cost aside) by sessions per step
        self.draft_call = LinearFit(decay)  # wall ms of a Propose by tokens proposed: intercept = fixed cost per call
        self.draft_measured_at = -math.inf  # time.monotonic() of the last Propose in the draft fit
        self.share_decay = share_decay
        self.verify_sessions = 1.0  # running mean of sessions per verify pass
        self.draft_sessions = 1.0  # running mean of sessions per draft step
        # What steps cost the machine: process CPU ms per target pass by rows, per draft step by
        # sessions, and this process's CPU ms per step of any stream.
        self.verify_cpu = CostCurve(decay)
        self.draft_cpu = LinearFit(decay)
        self.own_cpu_ms = 0.0
        self._own_mark: tuple[float, float, int] | None = None  # (monotonic, process CPU s, steps)
        self._steps = 0

    def speculation_allowed(self, load: Load = ALONE) -> bool:
        """False while the draft shares the target's host and more than ``shared_host_max_streams``
        generations are in progress: there the draft's compute is the target's, and batched plain
        decoding (nearly free extra rows) beats speculation (see docs/batching.md for the measurement)."""
        limit = self.shared_host_max_streams
        return not (load.topology.draft_shares_target() and limit and load.streams > limit)

    def observe(self, step: StepObservation, decay: float, position_decay: float) -> None:
        """Learn from one step of any request: what its Verify and Propose cost (warm steps only:
        a first step's cost is its prompt's prefill) and, when it drafted, how the draft fared
        (``history``, with these decays: see :meth:`DraftHistory.record`)."""
        # Costs are wall times as the client sees them: tokens per second is what is maximised.
        if step.warm:
            self.observe_verify(step.proposed, step.verify_ms, step.verify_rows, step.verify_sessions,
                                step.verify_cpu_ms)
            # A pre-draft's wall time ran next to the previous Verify and drafted one token more
            # (the bonus guess): it says nothing clean about what a Propose costs on its own.
            if step.proposed and not step.predrafted:
                self.observe_draft(step.proposed, step.draft_ms, step.draft_catch_up, step.draft_sessions,
                                   step.draft_step_cpu_ms)
        if step.proposed:
            self.history.record(step, decay, position_decay)

    def observe_verify(self, k: int, ms: float, rows: int = 0, sessions: int = 1, cpu_ms: float = 0.0) -> None:
        """A Verify of k draft tokens took ``ms``; its forward had ``rows`` rows across ``sessions``
        sessions (0 rows: unknown, taken as this request's own k + 1) and cost the target's process
        ``cpu_ms`` of CPU time (0: not reported)."""
        d = self.share_decay
        self.verify_sessions = d * self.verify_sessions + (1 - d) * max(sessions, 1)
        rows = rows if rows > 0 else k + 1
        self.verify.add(rows, ms)
        if cpu_ms > 0:
            self.verify_cpu.add(rows, cpu_ms)
        self._count_step()

    def observe_draft(self, proposed: int, ms: float, catch_up: int = 1, sessions: float = 1.0,
                      step_cpu_ms: float = 0.0) -> None:
        if proposed <= 0:
            return
        d = self.share_decay
        self.draft_sessions = d * self.draft_sessions + (1 - d) * max(sessions, 1.0)
        if catch_up <= self.MAX_CATCH_UP:
            now = time.monotonic()
            if now - self.draft_measured_at > self.DRAFT_COST_TTL_S:  # stale: measure afresh
                self.draft_call, self.draft_step = LinearFit(self.draft_call.decay), LinearFit(self.draft_step.decay)
            self.draft_measured_at = now
            self.draft_call.add(proposed, ms)
            fixed = min(self.draft_call.intercept(), 0.9 * ms)
            self.draft_step.add(max(sessions, 1.0), (ms - fixed) / proposed)
            if step_cpu_ms > 0:
                self.draft_cpu.add(max(sessions, 1.0), step_cpu_ms)

    def _count_step(self, window_s: float = 0.5) -> None:
        """This process's CPU per step, over windows of at least ``window_s``."""
        self._steps += 1
        now, cpu = time.monotonic(), time.process_time()
        if self._own_mark is None:
            self._own_mark = (now, cpu, self._steps)
            return
        t0, cpu0, steps0 = self._own_mark
        if now - t0 >= window_s:
            per_step = (cpu - cpu0) * 1e3 / max(self._steps - steps0, 1)
            self.own_cpu_ms = per_step if self.own_cpu_ms == 0 else 0.7 * self.own_cpu_ms + 0.3 * per_step
            self._own_mark = (now, cpu, self._steps)

    def verify_ms(self, k: float) -> float | None:
        """Expected wall ms of a Verify of k draft tokens (k may be an expected, fractional count)."""
        # until two row counts have been seen: each extra row costs 10 % of a one-row pass
        return self.verify.predict(self.verify_sessions * (k + 1), 0.1)

    def draft_ms(self, k: float) -> float | None:
        """Expected wall ms of a Propose that drafts k tokens (k may be fractional, an expected
        count); None while unknown (or stale)."""
        if k == 0:
            return 0.0
        if time.monotonic() - self.draft_measured_at > self.DRAFT_COST_TTL_S:
            return None
        step = self.draft_step.predict(self.draft_sessions, 0.2)
        return None if step is None else self.draft_call.intercept() + k * step

    def cpu_round_ms(self, k: float, load: Load = ALONE) -> float:
        """Time the busiest host needs to run one step of every stream in progress, all at k, from
        CPU time per step and its cores (0 when nothing is known)."""
        n = max(float(load.streams), self.verify_sessions)
        demand: dict[str, float] = {}
        cores: dict[str, float] = {}

        def add(host: Site | None, ms: float | None) -> None:
            if host is None or ms is None:
                return
            demand[host[0]] = demand.get(host[0], 0.0) + ms
            cores[host[0]] = max(host[1], 0.01)

        s = max(self.verify_sessions, 1.0)
        pass_cpu = self.verify_cpu.predict(s * (k + 1), 0.1)
        sites = load.topology
        add(sites.target, None if pass_cpu is None else n * pass_cpu / s)
        if k:
            sd = max(self.draft_sessions, 1.0)
            step_cpu = self.draft_cpu.predict(sd, 0.2)
            add(sites.draft, None if step_cpu is None else n * k * step_cpu / sd)
        add(sites.own, n * self.own_cpu_ms)
        return max((ms / cores[h] for h, ms in demand.items()), default=0.0)

    def round_ms(self, k: float, load: Load = ALONE) -> float | None:
        """Expected milliseconds per step of one stream drafting k tokens: its own wall time, or what
        the machine needs for everyone's step when that is longer (None until both costs are known)."""
        verify, draft = self.verify_ms(k), self.draft_ms(k)
        if verify is None or draft is None:
            return None
        return max(verify + draft, self.cpu_round_ms(k, load))


class CostController(Controller):
    """Choose k in [0, max_k] maximising expected tokens per step / (draft_ms(k) + verify_ms(k)).

    Expected tokens at k are 1 + sum over j <= k of the chance that the first j draft tokens are
    all accepted, from the acceptance *at each position* given the ones before it were accepted,
    counted over recent steps (:meth:`acceptance_at`). A single per-token rate alpha
    (accepted / (accepted + rejections), a step that accepted everything counting no rejection)
    is their prior. Acceptance is not geometric: a draft fails at a few hard tokens and runs long
    through easy text, and the confidence threshold cuts it where it is unsure, so a draft that
    got to position 6 is accepted there far more often than alpha says. Measured on the embedded
    pair (12 prompts): alpha ~0.81 priced the 7th and 8th draft tokens at a fifth of a token each,
    and `cost` chose k ~6.4 for 4.86 tokens per step, where fixed k = 8 got 5.26 at the same
    iteration cost.

    A step asking for k seldom pays for k draft tokens: the draft stops early after a token it is
    unsure of (the confidence threshold) or at EOS, and the target then verifies fewer rows. So the
    cost of k is priced at the *expected* draft length, from the chance that a draft asked to go
    past position j - 1 went on to j (:meth:`continue_at`), counted like acceptance. Priced at k
    itself, a long k looks as dear as a draft that never stops early, and the controller chose
    shorter drafts than fixed k = 8 on the embedded pair. While a cost is unknown the
    controller explores; after choosing k = 0 it probes a small draft ``probe_every`` plain steps
    later so it notices when the text becomes predictable again, and twice as many plain steps
    after each probe that still leaves k = 0 the best (up to MAX_PROBE_GAP): a probe costs the
    draft's catch-up on every token it missed plus a verify of two rows, and where speculation
    cannot pay at all (a quantised target whose step costs what a draft token does) probes every
    8 steps cost 10-18 % of plain decoding's speed (docs/performance.md).

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
        accepted more, not less, further on (embedded pair: ~0.85 at position 1, 0.95+ from
        position 4), so pricing the 12th-16th token at alpha made `cost` stop drafts short of
        where they still paid (mean k 10.5 against fixed k = 16's better 13.5). Never below alpha:
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
