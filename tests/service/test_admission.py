"""Admission before work, and tokenising off the event loop: the orchestrator against a real
target service (gRPC, in this process), the draft unreachable (requests decode without drafts)."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from orchestrator.app import create_app
from orchestrator.service import RETRY_AFTER_S, Slot
from orchestrator.settings import OrchestratorSettings
from tests.support import free_port, wait_until


class SlowTokenizer:
    """The real tokenizer, but every encode takes ``delay_s`` (as a huge prompt would) and is counted."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s, self.calls = inner, delay_s, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay_s)  # a slow encode on purpose: blocks whatever thread runs it
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _client(tiny_target_server, **settings) -> TestClient:
    port, path = tiny_target_server
    return TestClient(create_app(OrchestratorSettings(target_address=f"127.0.0.1:{port}",
                                                      draft_address=f"127.0.0.1:{free_port()}", tokenizer=path, **settings)), base_url="http://localhost")


def test_a_slow_prompt_does_not_stall_the_event_loop(tiny_target_server):
    with _client(tiny_target_server) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        rt.tokenizer = slow = SlowTokenizer(rt.tokenizer, 1.5)
        answers = {}
        routes = {"generate": ("/v1/generate", {"prompt": "ab", "max_tokens": 2}),
                  "completion": ("/v1/completions", {"prompt": "ab", "max_tokens": 2})}
        threads = [threading.Thread(target=lambda k=k, r=r: answers.__setitem__(k, client.post(r[0], json=r[1])))
                   for k, r in routes.items()]
        for t in threads:
            t.start()
        wait_until(lambda: slow.calls >= 1, 10, "a prompt being tokenised")  # the encode blocks for 1.5 s
        t0 = time.monotonic()
        assert client.get("/health").status_code == 200
        assert time.monotonic() - t0 < 0.5  # the loop kept serving
        for t in threads:
            t.join(30)
        assert {k: r.status_code for k, r in answers.items()} == {"generate": 200, "completion": 200}
        assert slow.calls == 2  # each prompt tokenised once, off the loop


def test_a_request_over_the_limit_is_refused_before_its_prompt_is_tokenised(tiny_target_server):
    with _client(tiny_target_server, max_concurrent_requests=1, max_queued_requests=0) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        rt.tokenizer = slow = SlowTokenizer(rt.tokenizer, 0)
        rt.active = 1  # the one slot is taken
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 20}]})
        assert r.status_code == 429 and "too many concurrent requests" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.headers["Retry-After"] == str(RETRY_AFTER_S)
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


def _queue_seconds(client: TestClient, model: str) -> float:
    """specdec:request_queue_time_seconds_sum of ``model`` (0 before its first sample)."""
    series = f'specdec:request_queue_time_seconds_sum{{model_name="{model}"}}'
    return next((float(line.split()[-1]) for line in client.get("/metrics").text.splitlines()
                 if line.startswith(series)), 0.0)


def test_a_request_over_the_limit_waits_in_the_queue_and_is_served_when_a_slot_frees(tiny_target_server):
    with _client(tiny_target_server, max_concurrent_requests=1, max_queued_requests=4) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        rt.tokenizer = slow = SlowTokenizer(rt.tokenizer, 0)
        held = client.portal.call(lambda: _take(rt))  # the one slot, taken on the server's loop
        queued_before = _queue_seconds(client, rt.model_name)
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(
            client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})))
        waiter.start()
        wait_until(lambda: len(rt.waiters) == 1, 10, "the request in the admission queue")
        assert _waiting(client) == 1.0
        assert slow.calls == 0 and not answers  # queued before its prompt was tokenised
        client.portal.call(held.release)
        waiter.join(30)
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json()["usage"]["completion_tokens"] == 2
        assert slow.calls == 1 and rt.active == 0 and not rt.waiters and _waiting(client) == 0.0
        # its wait counts in the queue-time histogram (this model's series: the registry is the process's)
        assert _queue_seconds(client, rt.model_name) - queued_before > 0.0


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
        wait_until(lambda: len(rt.waiters) == 1, 10, "the request in the admission queue")
        # the queue holds one: the next is refused at once, naming the limit
        full = client.post("/v1/generate", json={"prompt": "ab", "max_tokens": 2})
        assert full.status_code == 429 and "too many concurrent requests" in full.json()["detail"]
        waiter.join(30)
        waited = time.monotonic() - t0
        timed_out = answers[0]
        assert timed_out.status_code == 429 and timed_out.headers["Retry-After"] == str(RETRY_AFTER_S)
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
        wait_until(lambda: len(rt.waiters) == 1, 10, "the request in the admission queue")
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


def test_a_prompt_that_cannot_fit_is_refused_before_any_template_or_tokenizer_work(tiny_target_server):
    """More characters than the context's tokens could hold, or more messages than it has tokens:
    a 400 from the lengths alone, on every route, while the tokenizer is never called."""
    with _client(tiny_target_server) as client:
        assert client.get("/ready").status_code == 200
        rt = client.app.state.rt
        rt.tokenizer = slow = SlowTokenizer(rt.tokenizer, 0)
        context = rt.limits.target_max_context
        assert rt.token_chars == 1 and rt.encodes_spaces  # the tiny tokenizer: a token per character
        too_long = "a" * (context * rt.token_chars * 2 + 1)
        for path, body in (("/v1/completions", {"prompt": too_long}), ("/v1/generate", {"prompt": too_long}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]})):
            r = client.post(path, json={**body, "max_tokens": 2})
            assert r.status_code == 400 and "characters cannot fit" in r.text, (path, r.text)
        many = [{"role": "user", "content": "a"}] * (context + 1)
        for path in ("/v1/chat/completions", "/v1/generate"):
            r = client.post(path, json={"messages": many, "max_tokens": 2})
            assert r.status_code == 400 and "messages cannot fit" in r.text, (path, r.text)
        assert slow.calls == 0
        # OpenAI's bound of 2,048 messages comes first, counted in the raw body (also on the REST route)
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}] * 2049})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        r = client.post("/v1/generate", json={"messages": [{"role": "user", "content": "a"}] * 30000})
        assert r.status_code == 400 and "more than 2048 messages" in r.json()["detail"]
        # a quote inside a string is escaped: text quoting "role" is no message (its size refuses it here)
        r = client.post("/v1/completions", json={"prompt": '"role"' * 2049, "max_tokens": 1})
        assert r.status_code == 400 and "characters cannot fit" in r.json()["error"]["message"], r.text
        assert slow.calls == 0
        # a prompt that may fit is tokenised as ever (and refused by its token count when over)
        r = client.post("/v1/completions", json={"prompt": "a" * (context + 8), "max_tokens": 2})
        assert r.status_code == 400 and "tokens, over the model's context" in r.text and slow.calls == 1
        assert client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2}).status_code == 200


def test_the_longest_token_bounds_the_characters_of_a_token():
    from orchestrator.runtime import longest_token_chars
    from specdec.models import load_tokenizer

    tok = load_tokenizer("embedded")
    longest, spaces = longest_token_chars(tok)
    assert spaces  # byte-level BPE: whitespace is text it encodes
    sample = "Hello, world! Ünïcödé text, 1234567890, and a run of spaces:            end. ----------------"
    ids = tok(sample, add_special_tokens=False).input_ids
    assert max(len(tok.decode([i])) for i in ids) <= longest
    assert 8 <= longest <= 256


def test_a_tokenizer_that_drops_whitespace_has_only_its_other_characters_counted():
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from orchestrator.runtime import longest_token_chars
    from orchestrator.schemas import ChatMessage
    from orchestrator.service import prompt_size

    inner = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "bcd": 2}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>")
    assert longest_token_chars(tok) == (3, False)
    rt = SimpleNamespace(encodes_spaces=False)
    assert prompt_size(rt, "a   bcd \n a") == (5, 0)
    assert prompt_size(rt, None, [ChatMessage(role="user", content=" a "), ChatMessage(role="user", content="bcd")]) == (4, 2)
    assert prompt_size(SimpleNamespace(encodes_spaces=True), "a   bcd") == (7, 0)
