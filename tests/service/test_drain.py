"""SIGTERM drains the orchestrator: no new requests, the generations in progress finish within the
drain time, any still running then end with a terminal 503 (an `error` event on a stream), and the
process exits. Real processes: the embedded target service and an orchestrator (no draft: it
decodes degraded, which changes nothing here)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.support import free_port, iter_sse, start_model_service, start_orchestrator, wait_until

pytestmark = [pytest.mark.embedded, pytest.mark.slow]

DRAIN_S = 6.0


@pytest.fixture()
def target(tmp_path):
    proc, port = start_model_service("target", tmp_path)
    yield port
    proc.stop()


def _stream(url: str, body: dict, out: list, started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/generate/stream", json=body, timeout=60) as r:
        out.append(("status", r.status_code))
        for event, data in iter_sse(r):
            out.append((event, data))
            started.set()


def test_sigterm_drains_then_ends_every_stream_with_a_terminal_event(target, tmp_path):
    orch, url = start_orchestrator(free_port(), target, tmp_path, {
        "SPECDEC_ORCHESTRATOR_DRAIN_TIMEOUT_S": str(DRAIN_S)}, wait_ready=False)
    try:
        wait_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200, 60,  # degraded (no draft) is ready
                   lambda: f"the orchestrator not ready:\n{orch.tail()}", 0.1)
        long, short = [], []
        long_started, short_started = threading.Event(), threading.Event()
        prompt = "Tell me a very long story about a lighthouse keeper."
        threads = [threading.Thread(target=_stream, args=(url, {"prompt": prompt, "max_tokens": 1500,
                                                                 "ignore_eos": True}, long, long_started)),
                   threading.Thread(target=_stream, args=(url, {"prompt": prompt, "max_tokens": 8,
                                                                 "ignore_eos": True}, short, short_started))]
        threads[0].start()
        assert long_started.wait(30)
        threads[1].start()
        assert short_started.wait(30)
        t_signal = time.monotonic()
        orch.popen.send_signal(signal.SIGTERM)

        def refused() -> bool:
            """No new requests: a 503 while the listening socket is still open, then no connection at all."""
            try:
                r = httpx.post(url + "/v1/generate", json={"prompt": "hi", "max_tokens": 4}, timeout=5)
            except httpx.TransportError:
                return True
            assert r.status_code == 503 and "shutting down" in r.json()["detail"], r.text
            return False

        wait_until(refused, 10, "the listening socket closed after SIGTERM", 0.05)
        for t in threads:
            t.join(DRAIN_S + 15)
            assert not t.is_alive()
        # the short one finished normally within the drain time
        assert short[0] == ("status", 200) and short[-1][0] == "done", short[-2:]
        assert len(short[-1][1]["token_ids"]) == 8
        # the long one could not: its terminal event says so, after the drain time and not much later
        assert long[0] == ("status", 200) and long[-1][0] == "error", long[-3:]
        assert long[-1][1]["status"] == 503 and "shut down" in long[-1][1]["detail"]
        steps = [d for e, d in long if e == "step"]
        assert 0 < sum(len(s["tokens"]) for s in steps) < 1500
        orch.popen.wait(DRAIN_S + 15)
        # uvicorn re-raises the signal once shut down, so the exit status says "terminated by SIGTERM"
        assert orch.popen.returncode == -signal.SIGTERM, orch.tail()
        assert "Application shutdown complete" in orch.log.read_text()
        assert time.monotonic() - t_signal < DRAIN_S + 10
        assert "draining: no new requests; 2 in progress" in orch.log.read_text()
    finally:
        orch.stop()
