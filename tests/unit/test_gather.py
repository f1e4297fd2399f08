"""The scheduler waits briefly for sessions answered by the previous step that come straight back,
so busy streams share passes instead of splitting into cohorts that alternate (specdec/engine/compute.py).

The runs are discrete-event simulations on the compute thread's injectable clock: time moves only
when a pass computes or the loop waits, and each client's next call arrives at its scheduled
instant, so a run gives the same passes on any machine and under any load, and takes no wall time."""

from __future__ import annotations

import heapq
import queue
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from specdec.engine.compute import Clock, ComputeThread, StepResult, _Item


@dataclass
class Job:
    session_id: str


class WatchedCompute(ComputeThread):
    """The compute thread, recording the sessions each gather waits for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.expected: list[set[str]] = []

    def _expected(self, window: float) -> set[str]:
        sids = super()._expected(window)
        if sids:
            self.expected.append(sids)
        return sids


class SimulatedTime(Clock):
    """Simulated time: calls scheduled with :meth:`at` reach the compute thread's queue when the
    clock passes their instant; a timed get moves the clock to the next arrival or its deadline."""

    def __init__(self) -> None:
        self.t = 0
        self.arrivals: list[tuple[int, int, Any]] = []  # (instant ns, tie-break, item), a heap
        self._n = 0
        self.q: queue.SimpleQueue | None = None

    def ns(self) -> int:
        return self.t

    def cpu_ns(self) -> int:
        return self.t

    def at(self, instant: int, item: Any) -> None:
        self._n += 1
        heapq.heappush(self.arrivals, (instant, self._n, item))

    def advance(self, dt_ns: int) -> None:
        self.t += dt_ns
        self._deliver()

    def _deliver(self) -> None:
        while self.arrivals and self.arrivals[0][0] <= self.t:
            self.q.put(heapq.heappop(self.arrivals)[2])

    def get(self, q: queue.SimpleQueue, timeout: float) -> Any:
        self._deliver()
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
        deadline = self.t + int(timeout * 1e9)
        if self.arrivals and self.arrivals[0][0] <= deadline:
            self.t = self.arrivals[0][0]
            self._deliver()
            return q.get_nowait()
        self.t = deadline
        raise queue.Empty


class SimulatedPasses:
    """A batcher whose every pass takes ``pass_s`` of simulated time and records its sessions."""

    def __init__(self, clock: SimulatedTime, pass_s: float) -> None:
        self.clock, self.pass_ns = clock, int(pass_s * 1e9)
        self.passes: list[set[str]] = []

    def step(self, jobs: list[Job]) -> StepResult:
        self.clock.advance(self.pass_ns)
        self.passes.append({j.session_id for j in jobs})
        return StepResult([j.session_id for j in jobs], sessions=len(jobs), rows=len(jobs))


def run_streams(gather_ms: float, pass_s: float, think_s: dict[str, float], rounds: int
                ) -> tuple[SimulatedPasses, WatchedCompute]:
    """One client per session: call, get the answer, think ``think_s[session]``, call again."""
    clock = SimulatedTime()
    compute = WatchedCompute(max_queued=16, service="test-gather", gather_ms=gather_ms, clock=clock)
    clock.q = compute._queue
    batcher = SimulatedPasses(clock, pass_s)
    stop = threading.Event()
    left = dict.fromkeys(think_s, rounds)

    def call(sid: str, instant: int) -> None:
        item = _Item(futures.Future(), instant, batcher=batcher, job=Job(sid))
        item.done.add_done_callback(lambda done: answered(sid, done))
        clock.at(instant, item)

    def answered(sid: str, done: futures.Future) -> None:
        assert done.result() == sid
        left[sid] -= 1
        if left[sid]:
            call(sid, clock.t + int(think_s[sid] * 1e9))
        elif not any(left.values()):
            stop.set()

    for sid in think_s:
        call(sid, 0)
    compute.serve(stop)
    assert not any(left.values()) and not clock.arrivals
    return batcher, compute


def test_returning_sessions_share_passes():
    """Four streams that call again 1.0-1.3 ms after each answer: with the wait, every pass carries
    all four; without it the first back starts a pass alone, the streams split into cohorts and
    need more passes for the same work."""
    streams = {f"s{i}": 0.001 + i * 0.0001 for i in range(4)}
    gathered, compute = run_streams(30.0, 0.04, streams, rounds=10)
    alone, _ = run_streams(0.0, 0.04, streams, rounds=10)
    # no return time is known after the first pass (the first back, s0, goes alone); from then on
    # every pass carries all four, and the last the three s0 finished before
    assert [len(p) for p in gathered.passes] == [4, 1] + [4] * 8 + [3], gathered.passes
    # without the wait: a cohort of one and a cohort of three, alternating, to the end
    assert [len(p) for p in alone.passes] == [4] + [1, 3] * 9, alone.passes
    waits = compute.snapshot()
    assert 0 < waits.gather_waits < len(gathered.passes)
    # a wait lasts until the last stream is back (1.3 ms after the answer), never the whole window
    assert waits.gather_ns <= waits.gather_waits * 1_300_000


def test_a_slow_returner_is_not_waited_for():
    """A session that comes back only after 150 ms (say, it drafts elsewhere in between) never
    holds up a pass: the waits are for the fast session (back in 0.5 ms), never for the slow one,
    whose return time is over the 9 ms window (15 % of a 60 ms pass)."""
    gathered, compute = run_streams(30.0, 0.06, {"fast": 0.0005, "slow": 0.15}, rounds=12)
    assert compute.expected and all(sids == {"fast"} for sids in compute.expected), compute.expected
    stats = compute.snapshot()
    assert stats.gather_waits == len(compute.expected)
    # each wait lasts until the fast session is back (0.5 ms); after its last call the scheduler
    # cannot know it will not return, and waits out the window once
    assert stats.gather_ns == (len(compute.expected) - 1) * 500_000 + 9_000_000
    slow_passes = [p for p in gathered.passes if "slow" in p]
    assert len(slow_passes) == 12 and sum(len(p) == 1 for p in gathered.passes) >= 12


def test_a_lone_stream_never_waits():
    batcher, compute = run_streams(30.0, 0.01, {"only": 0.02}, rounds=6)
    assert len(batcher.passes) == 6
    # its return time (20 ms) is over the window (15 % of 10 ms): never expected
    stats = compute.snapshot()
    assert (stats.gather_waits, stats.gather_ns, stats.calls, stats.forwards) == (0, 0, 6, 6)
