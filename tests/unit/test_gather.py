"""The scheduler waits briefly for sessions answered by the previous step that come straight back,
so busy streams share passes instead of splitting into cohorts that alternate (specdec/engine/compute.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from specdec.engine.compute import ComputeThread, StepResult


@dataclass
class Job:
    session_id: str


class PassRecorder:
    """A batcher whose every pass takes ``pass_s`` and records the sessions in it."""

    def __init__(self, pass_s: float) -> None:
        self.pass_s = pass_s
        self.passes: list[set[str]] = []

    def step(self, jobs: list[Job]) -> StepResult:
        time.sleep(self.pass_s)
        self.passes.append({j.session_id for j in jobs})
        return StepResult([j.session_id for j in jobs], sessions=len(jobs), rows=len(jobs))


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


def run_streams(gather_ms: float, pass_s: float, think_s: dict[str, float], rounds: int) -> tuple[PassRecorder, WatchedCompute]:
    """One client thread per session: call, get the answer, think ``think_s[session]``, call again."""
    batcher = PassRecorder(pass_s)
    compute = WatchedCompute(max_queued=16, service="test-gather", gather_ms=gather_ms)
    stop = threading.Event()
    start = threading.Barrier(len(think_s))

    def client(sid: str) -> None:
        start.wait()
        for _ in range(rounds):
            assert compute.submit(batcher, Job(sid)) == sid
            time.sleep(think_s[sid])

    def stop_when_done() -> None:
        for t in threads:
            t.join()
        stop.set()

    threads = [threading.Thread(target=client, args=(sid,)) for sid in think_s]
    for t in threads:
        t.start()
    threading.Thread(target=stop_when_done).start()
    compute.serve(stop)
    return batcher, compute


def test_returning_sessions_share_passes():
    """Four streams that call again 1 ms after each answer: with the wait, (nearly) every pass
    carries all four; without it they split into cohorts and need more passes for the same work."""
    streams = {f"s{i}": 0.001 for i in range(4)}
    gathered, compute = run_streams(30.0, 0.04, streams, rounds=10)
    alone, _ = run_streams(0.0, 0.04, streams, rounds=10)
    full = sum(len(p) == 4 for p in gathered.passes)
    # (a pass may miss a stream whose thread the OS woke late: other tests share the cores)
    assert len(gathered.passes) <= 10 + 3 and full >= 7, gathered.passes
    assert len(gathered.passes) < len(alone.passes), (gathered.passes, alone.passes)
    stats = compute.snapshot()
    assert stats.gather_waits > 0
    # each wait is bounded by 15 % of a 40 ms pass
    assert stats.gather_ns / stats.gather_waits < 0.15 * 0.04 * 1e9 * 1.5


def test_a_slow_returner_is_not_waited_for():
    """A session that comes back only after 150 ms (say, it drafts elsewhere in between) never
    holds up a pass: the fast session's passes run back to back, without waiting for it."""
    gathered, compute = run_streams(30.0, 0.06, {"fast": 0.0005, "slow": 0.15}, rounds=12)
    # the waits are for the fast session (back in ~0.5 ms), never for the slow one, whose return
    # time is over the 9 ms window (15 % of a 60 ms pass); how long each wait lasted depends on when
    # the OS wakes the fast client's thread, which other processes on the cores can delay
    assert compute.expected and all(sids == {"fast"} for sids in compute.expected), compute.expected
    assert compute.snapshot().gather_waits == len(compute.expected)
    slow_passes = [p for p in gathered.passes if "slow" in p]
    assert len(slow_passes) == 12 and sum(len(p) == 1 for p in gathered.passes) >= 12


def test_a_lone_stream_never_waits():
    batcher, compute = run_streams(30.0, 0.01, {"only": 0.02}, rounds=6)
    assert len(batcher.passes) == 6
    # its return time (20 ms) is over the window (15 % of 10 ms): never expected
    assert compute.snapshot().gather_waits == 0
