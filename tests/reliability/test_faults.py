"""Fault scenarios under load on the embedded stack as real processes, with a fault proxy on each
gRPC link: orchestrator -> proxy -> draft service, orchestrator -> proxy -> target service.

Each scenario runs several concurrent greedy requests (streaming and not, ``ignore_eos``, 48
tokens), injects one fault once the streams are under way, and checks what a client sees:

- a draft that dies, freezes or whose link misbehaves costs speed only: every request is a 200
  whose tokens equal the plain autoregressive output, and no step waits past the draft deadline;
- a target that dies or whose link misbehaves fails the affected requests quickly and clearly
  (503, or an ``error`` event once a stream has started), and once the target or the link is back
  the next request succeeds, without restarting the orchestrator.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from evaluation.faultproxy import FaultProxy
from tests.reliability.helpers import Outcome, post, stream, summarize, write_report
from tests.support import PROMPTS, Proc, free_port, start_model_service, start_orchestrator

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

DRAFT_TIMEOUT_S = 1.0
TARGET_TIMEOUT_S = 3.0
DRAFT_RETRY_S = 2.0
SLACK_S = 0.75  # scheduling and RPC overhead on a loaded 2-core machine
CONCURRENT = 6  # half streaming, half not
MAX_TOKENS = 48
KILL_DEADLINE_S = 1.0  # a dead target must be reported within this long

RESULTS: dict[str, dict] = {}


@dataclass
class FaultStack:
    log_dir: Path
    draft: Proc
    target: Proc
    draft_port: int
    target_port: int
    draft_link: FaultProxy
    target_link: FaultProxy
    orchestrator: Proc
    url: str
    reference: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> autoregressive tokens
    restarts: int = 0
    stopped: bool = False

    def restart(self, kind: str) -> float:
        """Start ``kind`` again on its port (after it died); returns when it serves."""
        self.restarts += 1
        port = self.draft_port if kind == "draft" else self.target_port
        proc, _ = start_model_service(kind, self.log_dir, port=port, name=f"{kind}-{self.restarts}")
        setattr(self, kind, proc)
        return time.monotonic()

    def heal(self) -> None:
        self.draft_link.heal()
        self.target_link.heal()
        if self.stopped:
            os.kill(self.draft.popen.pid, signal.SIGCONT)
            self.stopped = False
        for kind in ("draft", "target"):
            if not getattr(self, kind).alive():
                self.restart(kind)

    def body(self, i: int, **extra) -> dict:
        # fixed k: every step asks the draft, so a draft fault is felt at once
        return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                "controller": "fixed", "k": 3, **extra}


def speculating(url: str, deadline_s: float) -> float | None:
    """Send short requests until one verifies a non-empty draft; seconds it took, None if never."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        r = httpx.post(url + "/v1/generate", json={"prompt": PROMPTS[0], "max_tokens": 6, "ignore_eos": True,
                                                   "controller": "fixed", "k": 3}, timeout=30)
        if r.status_code == 200 and any(s["draft"] for s in r.json()["steps"]):
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fault-stack")
    draft_port, target_port = free_port(), free_port()
    procs: list[Proc] = []
    links: list[FaultProxy] = []
    s: FaultStack | None = None
    try:
        procs.append(start_model_service("draft", log_dir, port=draft_port, name="draft-0")[0])
        procs.append(start_model_service("target", log_dir, port=target_port, name="target-0")[0])
        links += [FaultProxy(draft_port, name="draft-link").start(), FaultProxy(target_port, name="target-link").start()]
        orch, url = start_orchestrator(links[0].port, links[1].port, log_dir, env={
            "SPECDEC_ORCHESTRATOR_DRAFT_TIMEOUT_S": str(DRAFT_TIMEOUT_S),
            "SPECDEC_ORCHESTRATOR_TARGET_TIMEOUT_S": str(TARGET_TIMEOUT_S),
            "SPECDEC_ORCHESTRATOR_DRAFT_RETRY_S": str(DRAFT_RETRY_S),
        })
        procs.append(orch)
        s = FaultStack(log_dir, procs[0], procs[1], draft_port, target_port, links[0], links[1], orch, url)
        for i in range(CONCURRENT):
            r = post(url, "/v1/generate", s.body(i, mode="autoregressive"))
            assert r.status == 200, r.body
            s.reference[i] = r.token_ids
        yield s
        write_report("faults", RESULTS)
    finally:
        for link in links:
            link.stop()
        if s is not None:  # the services may have been restarted: stop the current ones
            procs = [s.draft, s.target, s.orchestrator]
        for p in procs:
            if p.alive():
                os.kill(p.popen.pid, signal.SIGCONT)  # a stopped process would ignore SIGTERM
            p.stop()


@pytest.fixture
def healthy(stack):
    """The stack with every process up, both links passing, and speculation working."""
    stack.heal()
    assert stack.orchestrator.alive(), stack.orchestrator.tail()
    assert speculating(stack.url, 30) is not None, "the stack does not speculate before the scenario"
    yield stack
    stack.heal()


def run_load(stack: FaultStack, inject: Callable[[], None] | None = None) -> tuple[list[Outcome], float | None]:
    """CONCURRENT requests (even: streaming, odd: not); ``inject`` runs once the streams have had two
    steps each. Returns the outcomes and when the fault was injected (time.monotonic())."""
    streams = CONCURRENT // 2 + CONCURRENT % 2
    under_way = threading.Barrier(streams + 1)
    outcomes: list[Outcome | None] = [None] * CONCURRENT

    def on_event(out: Outcome) -> None:
        if inject is not None and len(out.events) == 2:
            try:
                under_way.wait(timeout=60)
            except threading.BrokenBarrierError:
                pass

    def worker(i: int) -> None:
        if i % 2 == 0:
            outcomes[i] = stream(stack.url, stack.body(i), timeout_s=120, on_event=on_event, kind="stream")
            if inject is not None and len(outcomes[i].events) < 2:  # ended early: do not hold the others back
                under_way.abort()
        else:
            outcomes[i] = post(stack.url, "/v1/generate", stack.body(i), timeout_s=120, kind="generate")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(CONCURRENT)]
    for t in threads:
        t.start()
    t_fault = None
    if inject is not None:
        try:
            under_way.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass
        t_fault = time.monotonic()
        inject()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hung past 180 s"
    return [o for o in outcomes if o is not None], t_fault


def timings(outcomes: list[Outcome]) -> str:
    """One line per request: what it got, how long it took, its slowest draft and verify calls."""
    return "\n".join(
        f"  {o.kind} {o.status} {o.seconds:.1f} s, {len(o.steps)} steps, slowest draft "
        f"{max((s['draft_ms'] for s in o.steps), default=0):.0f} ms, slowest verify "
        f"{max((s['verify_ms'] for s in o.steps), default=0):.0f} ms{' ' + str(o.sse_error) if o.sse_error else ''}"
        for o in outcomes)


def assert_identical_200s(stack: FaultStack, outcomes: list[Outcome]) -> None:
    for i, out in enumerate(outcomes):
        assert out.status == 200 and not out.error, (i, out.status, out.error, out.body)
        assert out.sse_error is None, f"request {i}: {out.sse_error}\n{timings(outcomes)}"
        if out.kind == "stream":
            assert out.done is not None, (i, out.events[-1:])
            assert out.done["token_ids"] == stack.reference[i]
        assert out.token_ids == stack.reference[i], f"request {i}: output differs from the autoregressive one"


def longest_draft_wait_ms(outcomes: list[Outcome]) -> float:
    return max((s["draft_ms"] for o in outcomes for s in o.steps), default=0.0)


def fallbacks(outcomes: list[Outcome]) -> int:
    return sum(1 for o in outcomes for s in o.steps if s.get("draft_error"))


def counted_fallbacks(outcomes: list[Outcome]) -> int:
    """Draft failures the requests' final stats count. A background catch-up that fails after its
    request's last step has no step left to report it on (the request no longer needed the draft),
    but its stats count it."""
    total = 0
    for o in outcomes:
        final = o.done if o.events else o.body if isinstance(o.body, dict) else None
        total += int(((final or {}).get("stats") or {}).get("draft_fallbacks", 0))
    return total


def record(name: str, outcomes: list[Outcome], **figures) -> None:
    statuses: dict[str, int] = {}
    for o in outcomes:
        key = "error event" if o.sse_error is not None else str(o.status or o.error.split(":")[0])
        statuses[key] = statuses.get(key, 0) + 1
    RESULTS[name] = {"requests": len(outcomes), "outcomes": statuses, **figures}
    summarize(f"fault: {name}", [f"{len(outcomes)} requests -> {statuses}; "
                                 + ", ".join(f"{k} {v}" for k, v in figures.items())])


# ---- the draft fails: speed only -------------------------------------------------------------------

def test_draft_sigkill_mid_stream_keeps_every_output(healthy):
    stack = healthy
    outcomes, _ = run_load(stack, inject=lambda: stack.draft.popen.send_signal(signal.SIGKILL))
    record("draft SIGKILL", outcomes, steps_without_draft_after_failure=fallbacks(outcomes),
           longest_draft_wait_ms=round(longest_draft_wait_ms(outcomes)))
    assert_identical_200s(stack, outcomes)
    assert fallbacks(outcomes) >= 1, "the draft's death was not even noticed"
    assert longest_draft_wait_ms(outcomes) <= (DRAFT_TIMEOUT_S + SLACK_S) * 1e3


def test_draft_restart_resumes_speculation(healthy):
    stack = healthy
    stack.draft.kill()
    r = post(stack.url, "/v1/generate", stack.body(1))  # runs without drafts meanwhile
    assert r.status == 200 and r.token_ids == stack.reference[1]
    serving_at = stack.restart("draft")
    resumed = speculating(stack.url, DRAFT_RETRY_S + 15)
    record("draft restarted", [r], speculation_resumed_after_s=None if resumed is None else round(resumed, 2))
    assert resumed is not None and resumed <= DRAFT_RETRY_S + 5, f"speculation resumed after {resumed} s"
    assert time.monotonic() - serving_at < DRAFT_RETRY_S + 20


def test_draft_sigstop_falls_back_at_the_deadline(healthy):
    stack = healthy

    def freeze() -> None:
        os.kill(stack.draft.popen.pid, signal.SIGSTOP)
        stack.stopped = True

    try:
        outcomes, _ = run_load(stack, inject=freeze)
    finally:
        os.kill(stack.draft.popen.pid, signal.SIGCONT)
        stack.stopped = False
    wait = longest_draft_wait_ms(outcomes)
    record("draft SIGSTOP", outcomes, steps_without_draft_after_failure=fallbacks(outcomes),
           longest_draft_wait_ms=round(wait))
    assert_identical_200s(stack, outcomes)
    assert fallbacks(outcomes) >= 1
    assert DRAFT_TIMEOUT_S * 1e3 * 0.9 <= wait <= (DRAFT_TIMEOUT_S + SLACK_S) * 1e3, wait
    assert speculating(stack.url, DRAFT_RETRY_S + 15) is not None, "no speculation after SIGCONT"


@pytest.mark.parametrize("fault", ["drop", "reset", "stall"])
def test_draft_link_fault_keeps_every_output(healthy, fault):
    stack = healthy
    inject = {"drop": stack.draft_link.drop, "reset": stack.draft_link.reset,
              "stall": lambda: stack.draft_link.stall(after_bytes=24)}[fault]
    outcomes, _ = run_load(stack, inject=inject)
    wait = longest_draft_wait_ms(outcomes)
    stack.draft_link.heal()
    resumed = speculating(stack.url, DRAFT_RETRY_S + 15)
    record(f"draft link {fault}", outcomes, steps_without_draft_after_failure=fallbacks(outcomes),
           longest_draft_wait_ms=round(wait), speculation_resumed_after_heal_s=None if resumed is None else round(resumed, 2))
    assert_identical_200s(stack, outcomes)
    assert fallbacks(outcomes) >= 1 or counted_fallbacks(outcomes) >= 1, "the fault was not felt"
    assert wait <= (DRAFT_TIMEOUT_S + SLACK_S) * 1e3, f"a step waited {wait:.0f} ms for the draft"
    assert resumed is not None and resumed <= DRAFT_RETRY_S + 5, f"speculation resumed after {resumed} s"


def test_delay_on_both_links_keeps_every_output(healthy):
    stack = healthy

    def delay() -> None:
        stack.draft_link.delay(50)
        stack.target_link.delay(50)

    t0 = time.monotonic()
    outcomes, _ = run_load(stack, inject=delay)
    record("50 ms delay on both links", outcomes, seconds=round(time.monotonic() - t0, 1),
           steps_without_draft=fallbacks(outcomes))
    assert_identical_200s(stack, outcomes)


# ---- the target fails: a clear, quick error, then recovery -------------------------------------------

def assert_failed_clearly(outcomes: list[Outcome], t_fault: float, within_s: float) -> list[float]:
    """Every request either finished before the fault or failed with 503 / an error event within
    ``within_s`` of it. Returns how long each failure took to reach its client."""
    delays = []
    for i, out in enumerate(outcomes):
        assert not out.error, (i, out.error)
        if out.status == 200 and out.sse_error is None and (out.done is not None or out.kind == "generate"):
            assert out.ended <= t_fault + 0.2, (i, "succeeded long after the target failed")
            continue
        if out.sse_error is not None:
            assert out.sse_error["status"] == 503 and "target" in out.sse_error["detail"], out.sse_error
        else:
            assert out.status == 503 and "target" in str(out.body["detail"]), (i, out.status, out.body)
        delays.append(out.failed_at - t_fault)
    assert delays, "no request was in flight when the target failed"
    assert max(delays) <= within_s, f"failures reached the clients {[round(d, 2) for d in delays]} s after the fault"
    return delays


def test_target_sigkill_fails_fast_then_recovers_after_restart(healthy):
    stack = healthy
    outcomes, t_fault = run_load(stack, inject=lambda: stack.target.popen.send_signal(signal.SIGKILL))
    try:
        delays = assert_failed_clearly(outcomes, t_fault, KILL_DEADLINE_S)
    finally:
        record("target SIGKILL", outcomes, slowest_failure_s=round(max(
            (o.failed_at - t_fault for o in outcomes if o.status != 200 or o.sse_error), default=0), 2))
    assert stack.orchestrator.alive()
    stack.restart("target")
    # the very next request, through the same orchestrator
    r = post(stack.url, "/v1/generate", stack.body(1))
    RESULTS["target SIGKILL"]["first_request_after_restart"] = r.status
    assert r.status == 200 and r.token_ids == stack.reference[1], (r.status, r.body)
    assert delays


@pytest.mark.parametrize("fault", ["reset", "stall"])
def test_target_link_fault_fails_within_the_deadline_then_heals(healthy, fault):
    stack = healthy
    inject = {"reset": stack.target_link.reset, "stall": lambda: stack.target_link.stall(after_bytes=24)}[fault]
    outcomes, t_fault = run_load(stack, inject=inject)
    try:
        assert_failed_clearly(outcomes, t_fault, TARGET_TIMEOUT_S + SLACK_S)
    finally:
        record(f"target link {fault}", outcomes, slowest_failure_s=round(max(
            (o.failed_at - t_fault for o in outcomes if o.status != 200 or o.sse_error), default=0), 2))
    stack.target_link.heal()
    r = post(stack.url, "/v1/generate", stack.body(1))
    RESULTS[f"target link {fault}"]["first_request_after_heal"] = r.status
    assert r.status == 200 and r.token_ids == stack.reference[1], (r.status, r.body)
    outcomes, _ = run_load(stack)
    assert_identical_200s(stack, outcomes)
