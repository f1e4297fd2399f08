"""Admission before work, and tokenising off the event loop: the orchestrator against a real
target service (gRPC, in this process), the draft unreachable (requests decode without drafts)."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from orchestrator.app import create_app
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
    with _client(tiny_target_server, max_concurrent_requests=1) as client:
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
