"""Admission before work, and tokenising off the event loop: the orchestrator against a real
target service (gRPC, in this process), the draft unreachable (requests decode without drafts)."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from orchestrator.app import create_app
from orchestrator.service import Slot
from orchestrator.settings import OrchestratorSettings
from tests.support import free_port


class SlowTokenizer:
    """The real tokenizer, but every encode takes ``delay_s`` (as a huge prompt would) and is counted."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s, self.calls = inner, delay_s, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay_s)  # blocks whatever thread runs it
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _client(tiny_target_server, **settings) -> TestClient:
    port, path = tiny_target_server
    return TestClient(create_app(OrchestratorSettings(target_address=f"127.0.0.1:{port}",
                                                      draft_address=f"127.0.0.1:{free_port()}", tokenizer=path, **settings)))


def test_a_slow_prompt_does_not_stall_the_event_loop(tiny_target_server):
    with _client(tiny_target_server) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        rt.tokenizer = SlowTokenizer(rt.tokenizer, 1.5)
        answers = {}
        routes = {"generate": ("/v1/generate", {"prompt": "ab", "max_tokens": 2}),
                  "completion": ("/v1/completions", {"prompt": "ab", "max_tokens": 2})}
        threads = [threading.Thread(target=lambda k=k, r=r: answers.__setitem__(k, client.post(r[0], json=r[1])))
                   for k, r in routes.items()]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the prompts are being tokenised now
        t0 = time.monotonic()
        assert client.get("/health").status_code == 200
        assert time.monotonic() - t0 < 0.5  # the loop kept serving
        for t in threads:
            t.join(30)
        assert {k: r.status_code for k, r in answers.items()} == {"generate": 200, "completion": 200}


def test_a_request_over_the_limit_is_refused_before_its_prompt_is_tokenised(tiny_target_server):
    with _client(tiny_target_server, max_concurrent_requests=1, max_queued_requests=0) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        rt.tokenizer = slow = SlowTokenizer(rt.tokenizer, 0)
        rt.active = 1  # the one slot is taken
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 100_000}]})
        assert r.status_code == 429 and "too many concurrent requests" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.headers["Retry-After"]
        assert slow.calls == 0
        rt.active = 0
        assert client.post("/v1/generate", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        assert slow.calls == 1


def _waiting(client: TestClient) -> float:
    """The admission queue's depth as /metrics exports it."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("specdec:num_requests_waiting{"):
            return float(line.split()[-1])
    return 0.0


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_request_over_the_limit_waits_in_the_queue_and_is_served_when_a_slot_frees(tiny_target_server):
    with _client(tiny_target_server, max_concurrent_requests=1, max_queued_requests=4) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        rt.tokenizer = slow = SlowTokenizer(rt.tokenizer, 0)
        held = client.portal.call(lambda: _take(rt))  # the one slot, taken on the server's loop
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(
            client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})))
        waiter.start()
        _until(lambda: len(rt.waiters) == 1)
        assert _waiting(client) == 1.0
        assert slow.calls == 0 and not answers  # queued before its prompt was tokenised
        client.portal.call(held.release)
        waiter.join(30)
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json()["usage"]["completion_tokens"] == 2
        assert slow.calls == 1 and rt.active == 0 and not rt.waiters and _waiting(client) == 0.0
        # its wait counts in the queue-time histogram: a sample above the slot's ~0 s
        queue_sum = next(float(line.split()[-1]) for line in client.get("/metrics").text.splitlines()
                         if line.startswith("specdec:request_queue_time_seconds_sum"))
        assert queue_sum > 0.0


async def _take(rt) -> Slot:
    return Slot.take(rt, None)


def test_the_admission_queue_times_out_and_fills_up_with_429s(tiny_target_server):
    with _client(tiny_target_server, max_concurrent_requests=1, max_queued_requests=1, queue_timeout_s=1.5) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        held = client.portal.call(lambda: _take(rt))
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(
            client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})))
        t0 = time.monotonic()
        waiter.start()
        _until(lambda: len(rt.waiters) == 1)
        # the queue holds one: the next is refused at once, naming the limit
        full = client.post("/v1/generate", json={"prompt": "ab", "max_tokens": 2})
        assert full.status_code == 429 and "too many concurrent requests" in full.json()["detail"]
        waiter.join(30)
        waited = time.monotonic() - t0
        timed_out = answers[0]
        assert timed_out.status_code == 429 and timed_out.headers["Retry-After"]
        assert "queue_timeout_s" in timed_out.json()["error"]["message"]
        assert 1.5 <= waited < 10
        assert not rt.waiters and rt.active == 1  # the waiter left no slot behind
        client.portal.call(held.release)
        assert client.post("/v1/generate", json={"prompt": "ab", "max_tokens": 2}).status_code == 200


def test_a_drain_answers_the_queued_requests_503(tiny_target_server):
    with _client(tiny_target_server, max_concurrent_requests=1) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        held = client.portal.call(lambda: _take(rt))
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(
            client.post("/v1/generate", json={"prompt": "ab", "max_tokens": 2})))
        waiter.start()
        _until(lambda: len(rt.waiters) == 1)
        t0 = time.monotonic()
        rt.drain()  # as SIGTERM does, from outside the loop's turn
        waiter.join(30)
        assert answers[0].status_code == 503 and "shutting down" in answers[0].json()["detail"]
        assert time.monotonic() - t0 < 5  # at once, not after queue_timeout_s
        client.portal.call(held.release)


def test_n_choices_take_their_slots_together(tiny_target_server):
    with _client(tiny_target_server, max_concurrent_requests=2, queue_timeout_s=1.0) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        # more choices than slots could ever free: a 400 naming n, not a wait
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        held = client.portal.call(lambda: _take(rt))
        # one slot free, two asked: the request waits for both (it never runs one choice alone)
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "n": 2})
        assert r.status_code == 429 and "queue_timeout_s" in r.json()["error"]["message"]
        assert rt.active == 1
        client.portal.call(held.release)
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2 and rt.active == 0
