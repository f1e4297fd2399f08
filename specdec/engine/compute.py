"""The compute thread of a model service and its continuous-batching scheduler.

One thread (the process's main thread) runs every forward pass. RPC threads hand it work in two
forms:

- :meth:`ComputeThread.run`: a plain function call (Release, tools), run on its own;
- :meth:`ComputeThread.submit`: a *job* for a :class:`Batcher` (Verify, Propose). Each scheduler
  step takes every job waiting when the previous forward ended and gives them, oldest first, to
  the batcher, which runs them as ONE batched forward and answers for each: a result, an error,
  or :data:`PENDING` (not finished: a prefill chunk was done, or a draft has more tokens to go;
  it stays in line for the next step, ahead of newer jobs). No fixed wait window: a lone job
  runs at once.

**Returning sessions.** A stream that decodes plainly is answered and sends its next call a few
milliseconds later (the client's round trip). Without care, the streams of a busy service split
into cohorts that alternate passes: whoever was answered by pass n is still on its way back when
pass n + 1 starts, so every pass carries half the streams and each stream gets a token every second
pass. So the scheduler keeps, per session, a running mean of the time from an answer to that
session's next call, and before a step it waits for the sessions answered by the previous step
whose return time is short (at most ``gather_ms``, and at most ``GATHER_FRACTION`` of the previous
step's time), stopping as soon as all of them are back. Sessions that go elsewhere in between (a
speculative stream drafts before it verifies again) have long return times and are never waited
for, and a lone stream never waits for anyone.

At most ``max_queued`` calls wait or run at once; more get RESOURCE_EXHAUSTED at once, so a flood
never occupies every RPC worker (health and Info keep answering) and never builds an unbounded
backlog. A job whose RPC ends (deadline passed, client gone, server stopping) is dropped before
its next step. :meth:`close` fails whatever is still queued, so shutdown never leaves an RPC
thread waiting forever.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Gauge, Histogram

from specdec.errors import Cancelled, ResourceExhausted, Unavailable

if TYPE_CHECKING:
    from specdec.settings import ModelServiceSettings

logger = logging.getLogger(__name__)

COMPUTE_QUEUE = Histogram(
    "specdec_compute_queue_seconds",
    "Time a call waited for its first forward pass on the compute thread.",
    ["service"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
)
BATCH_SESSIONS = Histogram(
    "specdec_batch_sessions", "Sessions per batched forward pass.", ["service"],
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
)
BATCH_ROWS = Histogram(
    "specdec_batch_rows", "Token rows per batched forward pass (new tokens across its sessions).", ["service"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
BATCH_GATHER = Histogram(
    "specdec_batch_gather_seconds",
    "Time a step waited for sessions answered by the previous step to send their next call.",
    ["service"],
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032),
)
QUEUE_DEPTH = Gauge("specdec_queue_depth", "Calls waiting for or in compute.", ["service"])


class Clock:
    """Time as the compute thread reads it, and its one blocking wait: the process's clocks and a
    queue's timed get. Tests pass their own, whose time moves only when they say."""

    def ns(self) -> int:
        """A monotonic instant in nanoseconds (``perf_counter_ns``)."""
        return time.perf_counter_ns()

    def cpu_ns(self) -> int:
        """CPU time of the whole process (every thread)."""
        return time.process_time_ns()

    def get(self, q: queue.SimpleQueue, timeout: float) -> Any:
        """The next item of ``q``, waiting at most ``timeout`` seconds (queue.Empty after that)."""
        return q.get(timeout=timeout)


class _Pending:
    """Marker of a job that is not finished after a step (see :class:`Batcher`)."""

    def __repr__(self) -> str:
        return "PENDING"


PENDING: Any = _Pending()


@dataclass
class StepResult:
    """What one batched step did: a result (or error, or PENDING) per job, and its size."""

    outcomes: list[Any]
    sessions: int = 0  # sessions in the forward pass (0: no forward ran)
    rows: int = 0  # token rows in it


class Batcher(Protocol):
    """A model engine that runs many jobs in one forward pass."""

    def step(self, jobs: list[Any]) -> StepResult:
        """One batched forward over ``jobs`` (oldest first, distinct sessions not guaranteed)."""


def run_alone(batcher: Batcher, job: Any) -> Any:
    """Run one job to its end, step after step, on the calling thread (tests, tools, no scheduler)."""
    while True:
        outcome = batcher.step([job]).outcomes[0]
        if outcome is not PENDING:
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome


@dataclass
class CpuAccounted:
    """Base of jobs whose result reports the mean process CPU time per step they were in
    (``step_cpu_ns`` of the result): the scheduler adds each step's CPU time here."""

    cpu_ns: int = field(default=0, kw_only=True)
    cpu_steps: int = field(default=0, kw_only=True)


@dataclass
class SchedulerStats:
    """Counters since start (see SchedulerStats in the proto)."""

    forwards: int = 0
    sessions: int = 0
    rows: int = 0
    busy_ns: int = 0
    calls: int = 0
    cpu_ns: int = 0
    queue_wait_ns: int = 0
    gather_ns: int = 0
    gather_waits: int = 0
    queued: int = 0
    max_queued: int = 0


@dataclass
class _Item:
    done: futures.Future
    queued_at: int  # perf_counter_ns at submission
    batcher: Batcher | None = None
    job: Any = None
    fn: Callable[..., Any] | None = None
    args: tuple = ()
    context: Any = None
    started: bool = field(default=False)

    def ended(self) -> bool:
        """The caller's RPC is over (deadline, cancellation): nobody waits for the answer."""
        return self.context is not None and not self.context.is_active()


class ComputeThread:
    """Runs model compute on the thread that created it (the process's main thread).

    torch forward passes issued from gRPC worker threads ran several times slower than the same
    calls on the thread that loaded the model (docs/benchmarks.md, "Threads and processes"), so
    servicers hand compute to :meth:`run` / :meth:`submit`, and the main thread executes it in
    :meth:`serve`. Calls made on the owner thread itself (tests, tools) run inline.
    """

    GATHER_FRACTION = 0.15  # a step waits for returning sessions at most this share of the previous step's time
    RETURN_DECAY = 0.7  # weight of the past in a session's running return time

    @classmethod
    def from_settings(cls, settings: ModelServiceSettings, *, service: str) -> ComputeThread:
        """The compute thread of a model service (``max_queued_calls``, ``batch_gather_ms``), owned
        by the calling thread."""
        return cls(settings.max_queued_calls, service, settings.batch_gather_ms)

    def __init__(self, max_queued: int = 32, service: str = "", gather_ms: float = 30.0,
                 clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self._owner = threading.get_ident()
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._slots = threading.Semaphore(max_queued)
        self.max_queued = max_queued
        self._service = service
        self._closed = False
        self._waiting: list[_Item] = []  # batch jobs in line, oldest first (unfinished ones keep their place)
        self._lock = threading.Lock()
        self._in_flight = 0
        self.stats = SchedulerStats(max_queued=max_queued)
        self.gather_s = gather_ms / 1e3
        self._answered: dict[str, float] = {}  # sessions answered by the last step -> when
        self._returns: dict[str, tuple[float, float]] = {}  # session -> (running return time s, last answer)
        self._last_step_s = 0.0
        # the clock's seconds at the compute loop's last turn: it turns at least every 0.1 s while
        # idle and after every step, so a stale one means a step that hangs (see specdec.server)
        self.heartbeat = self._now()
        QUEUE_DEPTH.labels(service).set_function(lambda: self._in_flight)

    # ---- called from RPC threads ------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, context: Any = None) -> Any:
        """Run ``fn(*args)`` on the compute thread and return its result (raising its exception).

        Raises ResourceExhausted when ``max_queued`` calls are already waiting, Unavailable when
        the thread has stopped, Cancelled when ``context``'s RPC ended before the call ran.
        """
        if threading.get_ident() == self._owner:
            return fn(*args)
        return self._wait(_Item(futures.Future(), self.clock.ns(), fn=fn, args=args, context=context))

    def submit(self, batcher: Batcher, job: Any, context: Any = None) -> Any:
        """Run ``job`` in ``batcher``'s batched steps; return its result (raising its error).

        On the owner thread the job runs alone, step after step, inline.
        """
        if threading.get_ident() == self._owner:
            return run_alone(batcher, job)
        return self._wait(_Item(futures.Future(), self.clock.ns(), batcher=batcher, job=job, context=context))

    def _wait(self, item: _Item) -> Any:
        if self._closed:
            raise Unavailable("the service is shutting down")
        if not self._slots.acquire(blocking=False):
            raise ResourceExhausted(f"{self.max_queued} calls are already waiting for the model; retry shortly")
        with self._lock:
            self._in_flight += 1
        try:
            self._queue.put(item)
            if item.context is not None and not item.context.add_callback(item.done.cancel):
                item.done.cancel()  # the RPC had already ended
            if self._closed:  # closed between the check above and the put: nobody will serve it
                self._fail(item.done)
            try:
                return item.done.result()
            except futures.CancelledError:
                raise Cancelled("the call ended (deadline passed or client went away) before the model ran it") from None
        finally:
            with self._lock:
                self._in_flight -= 1
            self._slots.release()

    # ---- the compute thread -----------------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        """Execute submitted work until ``stop`` is set (call on the owner thread)."""
        while not stop.is_set():
            self.heartbeat = self._now()
            waiting = self._waiting
            try:
                # Block only when nothing is in line: a pending job must not wait for new arrivals.
                first = self.clock.get(self._queue, 0.1) if not waiting else self._queue.get_nowait()
            except queue.Empty:
                first = None
            if first is not None:
                self._admit(first)
            self._drain()
            if waiting and self.gather_s > 0:
                self._gather()
            if self._waiting:
                self._waiting = self._step(self._waiting)

    def _drain(self) -> None:
        while True:
            try:
                self._admit(self._queue.get_nowait())
            except queue.Empty:
                return

    def _admit(self, item: _Item) -> None:
        if item.batcher is None:
            self._run_plain(item)
            return
        if not item.done.set_running_or_notify_cancel():
            return
        self._waiting.append(item)
        sid = getattr(item.job, "session_id", None)
        if sid is None:
            return
        self._answered.pop(sid, None)
        if sid in self._returns:
            mean, answered = self._returns[sid]
            gap = item.queued_at / 1e9 - answered  # when the call was made, not when this thread got to it
            mean = gap if math.isinf(mean) else self.RETURN_DECAY * mean + (1 - self.RETURN_DECAY) * gap
            self._returns[sid] = (mean, answered)

    def _gather(self) -> None:
        """Wait (briefly) for the sessions answered by the last step that come back quickly."""
        window = min(self.gather_s, self.GATHER_FRACTION * self._last_step_s)
        expected = self._expected(window)
        if not expected:
            return
        t0 = self._now()
        deadline = t0 + window
        while expected.intersection(self._answered):
            left = deadline - self._now()
            if left <= 0:
                break
            try:
                self._admit(self.clock.get(self._queue, left))
            except queue.Empty:
                break
            self._drain()
        waited = self._now() - t0
        self.stats.gather_ns += int(waited * 1e9)
        self.stats.gather_waits += 1
        BATCH_GATHER.labels(self._service).observe(waited)

    def _expected(self, window: float) -> set[str]:
        """The sessions answered by the last step whose mean return time is within ``window``."""
        return {sid for sid in self._answered if self._returns.get(sid, (math.inf, 0.0))[0] <= window}

    def _answer(self, item: _Item, now: float) -> None:
        """Note that ``item``'s session was answered at ``now`` (see :meth:`_gather`)."""
        sid = getattr(item.job, "session_id", None)
        if sid is None:
            return
        self._answered[sid] = now
        mean = self._returns[sid][0] if sid in self._returns else math.inf
        self._returns[sid] = (mean, now)
        if len(self._returns) > 4 * self.max_queued:  # forget the sessions answered longest ago
            for old, _ in sorted(self._returns.items(), key=lambda kv: kv[1][1])[: len(self._returns) // 2]:
                del self._returns[old]

    def _run_plain(self, item: _Item) -> None:
        if not item.done.set_running_or_notify_cancel():
            return
        self._observe_wait(item)
        try:
            item.done.set_result(item.fn(*item.args))
        except BaseException as exc:  # delivered to the waiting RPC thread
            item.done.set_exception(exc)

    def _step(self, waiting: list[_Item]) -> list[_Item]:
        """One batched step per batcher over the jobs in line; returns those still unfinished."""
        live = []
        for item in waiting:
            if item.ended():
                item.done.set_exception(Cancelled("the call ended (deadline passed or client went away)"))
            else:
                live.append(item)
        self._answered = {}
        step_t0 = self._now()
        by_batcher: dict[int, list[_Item]] = {}
        for item in live:
            by_batcher.setdefault(id(item.batcher), []).append(item)
        still: set[int] = set()
        for items in by_batcher.values():
            for item in items:
                if not item.started:
                    item.started = True
                    self._observe_wait(item)
            t0, cpu0 = self.clock.ns(), self.clock.cpu_ns()
            try:
                result = items[0].batcher.step([item.job for item in items])
                outcomes = result.outcomes
            except BaseException as exc:  # a bug in the batcher: fail its jobs, keep serving
                logger.exception("batched step failed")
                result, outcomes = StepResult([], 0, 0), [exc] * len(items)
            busy = self.clock.ns() - t0
            # CPU of the whole process (every thread) during the step: what the step cost the
            # machine, which on shared cores is what other work can no longer use.
            cpu = self.clock.cpu_ns() - cpu0
            if result.sessions:
                self.stats.forwards += 1
                self.stats.sessions += result.sessions
                self.stats.rows += result.rows
                self.stats.busy_ns += busy
                self.stats.cpu_ns += cpu
                BATCH_SESSIONS.labels(self._service).observe(result.sessions)
                BATCH_ROWS.labels(self._service).observe(result.rows)
                for item in items:
                    if isinstance(item.job, CpuAccounted):
                        item.job.cpu_ns += cpu
                        item.job.cpu_steps += 1
            for item, outcome in zip(items, outcomes, strict=True):
                if outcome is PENDING:
                    still.add(id(item))
                elif isinstance(outcome, BaseException):
                    item.done.set_exception(outcome)
                else:
                    if isinstance(item.job, CpuAccounted) and item.job.cpu_steps and hasattr(outcome, "step_cpu_ns"):
                        outcome.step_cpu_ns = item.job.cpu_ns // item.job.cpu_steps
                    item.done.set_result(outcome)
                if outcome is not PENDING:
                    self.stats.calls += 1
        now = self._now()
        self._last_step_s = now - step_t0
        for item in live:
            if id(item) not in still:
                self._answer(item, now)
        return [item for item in live if id(item) in still]

    def _now(self) -> float:
        return self.clock.ns() / 1e9

    def since_turn(self) -> float:
        """Seconds since the compute loop last turned (a hang watchdog reads it; specdec.server)."""
        return self._now() - self.heartbeat

    def _observe_wait(self, item: _Item) -> None:
        wait = self.clock.ns() - item.queued_at
        self.stats.queue_wait_ns += wait
        if item.job is not None and hasattr(item.job, "queue_ns"):
            item.job.queue_ns = wait
        COMPUTE_QUEUE.labels(self._service).observe(wait / 1e9)

    def snapshot(self) -> SchedulerStats:
        """The counters now (for Info)."""
        stats = SchedulerStats(**vars(self.stats))
        stats.queued = self._in_flight
        return stats

    def close(self) -> None:
        """Stop accepting work and fail every queued call with UNAVAILABLE."""
        self._closed = True
        for item in self._waiting:
            item.done.set_exception(Unavailable("the service is shutting down"))
        self._waiting = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._fail(item.done)

    @staticmethod
    def _fail(done: futures.Future) -> None:
        if done.set_running_or_notify_cancel():
            done.set_exception(Unavailable("the service is shutting down"))
