"""Streaming clients that stop reading: each stream is cancelled within the send timeout once the
bounded buffers fill, its generation stops, both sessions are released and its slot is freed.
(The OpenAI streams share the same response class; they cannot be made to run long, having no
``ignore_eos``.)"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.reliability.helpers import metric, silent_stream, summarize, wait_released, write_report
from tests.support import running_stack, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

SLOTS = 4
SEND_TIMEOUT_S = 3
MAX_TOKENS = 2048


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    env = {"SPECDEC_ORCHESTRATOR_STREAM_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S),
           "SPECDEC_ORCHESTRATOR_STREAM_SEND_BUFFER_KB": "32",
           "SPECDEC_ORCHESTRATOR_MAX_CONCURRENT_REQUESTS": str(SLOTS),
           "SPECDEC_ORCHESTRATOR_MAX_TOKENS_LIMIT": str(MAX_TOKENS)}
    with running_stack(tmp_path_factory.mktemp("silent-logs"), env) as s:
        yield s


def test_streams_whose_clients_never_read_are_cancelled_and_free_their_slots(stack):
    url = stack["url"]
    body = {"prompt": "Write a very long story about a lighthouse.", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    stalled_before = metric(url, "specdec_streams_stalled_total")
    generated_before = metric(url, 'specdec_generated_tokens_total{mode="speculative"}')
    t0 = time.monotonic()
    socks = [silent_stream(url, "/v1/generate/stream", body) for _ in range(SLOTS - 1)]
    # a chat conversation too (through the template); ignore_eos keeps every answer long
    chat = {"messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    socks.append(silent_stream(url, "/v1/generate/stream", chat))
    try:
        # every slot is taken, then freed once the streams stall
        readings: list[int] = []

        def freed() -> bool:
            readings.append(httpx.get(f"{url}/v1/server", timeout=10).json()["active_streams"])
            return max(readings) == SLOTS and readings[-1] == 0

        wait_until(freed, 240, lambda: f"active streams: {readings[:3]} ... {readings[-5:]}", 0.5)
        active = readings[-1]
        freed_after_s = time.monotonic() - t0
        stalled = metric(url, "specdec_streams_stalled_total") - stalled_before
        generated = metric(url, 'specdec_generated_tokens_total{mode="speculative"}') - generated_before
        released = wait_released(stack["ports"], timeout_s=20)
        # a fresh request is admitted and served while the silent sockets are still open
        fresh = httpx.post(f"{url}/v1/generate", json={"prompt": "Hi", "max_tokens": 8}, timeout=120)
    finally:
        for s in socks:
            s.close()
    report = {"silent_clients": SLOTS, "send_timeout_s": SEND_TIMEOUT_S, "max_tokens": MAX_TOKENS,
              "slots_freed_after_s": round(freed_after_s, 1), "streams_stalled": stalled,
              "tokens_generated_for_them": generated, "tokens_asked": SLOTS * MAX_TOKENS, "held_after": released}
    write_report("silent_clients", report)
    summarize("silent streaming clients", [
        f"{SLOTS} clients asked {MAX_TOKENS} tokens each and read nothing: cancelled after {freed_after_s:.0f} s "
        f"(send timeout {SEND_TIMEOUT_S} s, send buffer 32 KiB), {generated:.0f} of {SLOTS * MAX_TOKENS} tokens computed",
        f"held after: {released}; a fresh request then got {fresh.status_code}"])
    assert active == 0 and stalled == SLOTS, report  # the stack's own orchestrator: only these streams stalled
    assert generated < SLOTS * MAX_TOKENS / 2, report  # the answers were not computed for nobody
    assert released == {k: {"sessions": 0, "kv_bytes": 0} for k in stack["ports"]}, report
    assert fresh.status_code == 200, fresh.text
