"""What a speculative step costs, measured at run time from what the model services report:
the process-wide :class:`CostModel` every request's cost controller shares."""

from __future__ import annotations

import math
import time

from orchestrator.controller_inputs import ALONE, Load, Site, StepObservation
from orchestrator.cost_fits import CostCurve, LinearFit
from orchestrator.draft_history import DraftHistory


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
        decoding (nearly free extra rows) beats speculation (docs/benchmarks.md, "Continuous
        batching")."""
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
        # until two row counts have been seen, assume each extra row costs 10 % of a one-row pass
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
