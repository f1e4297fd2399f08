"""GET /v1/server and the dashboard's Server tab: windowed rates on hand-made samples, the route
in-process and against real services on tiny models, and the tab (AppTest) against a fake orchestrator."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from orchestrator.app import create_app
from orchestrator.server_stats import RollingRates, ServiceProbe, Window, orchestrator_view, service_view
from orchestrator.settings import OrchestratorSettings
from specdec.v1 import specdec_pb2 as pb
from tests.support import APP, free_port, messages, start_model_service, start_orchestrator, wait_until
from ui import server_view as sv

# ---- RollingRates --------------------------------------------------------------------------------


def test_rates_need_two_samples():
    r = RollingRates(10)
    assert r.window() == Window(0.0) and r.window().rate("x") is None
    r.add(5.0, {"x": 3})
    w = r.window()
    assert w.seconds == 0 and w.rate("x") is None and w.delta("x") == 0 and r.latest() == {"x": 3}


def test_rate_over_the_last_window():
    r = RollingRates(10)
    for t in range(21):  # 5 tokens a second for 20 s, then the last 10 s at 5/s too
        r.add(float(t), {"tokens": 5.0 * t, "drafts": 2.0 * t, "accepted": 1.0 * t})
    w = r.window()
    assert w.seconds == 10 and w.rate("tokens") == 5.0 and w.delta("tokens") == 50
    assert w.ratio("accepted", "drafts") == 0.5 and w.ratio("accepted", "missing") is None
    assert len(r._samples) <= 12  # bounded by the window, not by how long it ran


def test_a_burst_leaves_the_window():
    r = RollingRates(10)
    r.add(0.0, {"tokens": 0})
    r.add(1.0, {"tokens": 100})  # a burst, then nothing
    for t in range(2, 13):
        r.add(float(t), {"tokens": 100})
    assert r.window().rate("tokens") == 0.0


def test_sparse_samples_use_the_span_they_cover():
    r = RollingRates(10)
    r.add(0.0, {"tokens": 0})
    r.add(30.0, {"tokens": 60})  # nothing else in the window: fall back to the previous sample
    assert r.window().seconds == 30 and r.window().rate("tokens") == 2.0
    r.add(31.0, {"tokens": 70})  # now the window holds two samples: the old one no longer counts
    assert r.window().seconds == 1 and r.window().rate("tokens") == 10.0


def test_close_samples_replace_the_newest():
    r = RollingRates(10, min_interval_s=0.25)
    r.add(0.0, {"x": 0})
    r.add(0.1, {"x": 1})  # the first pair is kept whatever its spacing: a rate as soon as possible
    assert r.window() == Window(0.1, {"x": 1})
    for i in range(11, 60):  # a caller polling every 10 ms: the newest reading moves, at most 4 a second stay
        r.add(i / 100, {"x": i})
    assert r.latest() == {"x": 59} and len(r._samples) <= 5
    assert r.window().seconds == pytest.approx(0.59) and r.window().delta("x") == 59


def test_counter_appearing_later_counts_from_zero():
    r = RollingRates(10)
    r.add(0.0, {"drafts": 0})
    r.add(2.0, {"drafts": 4, "accepted.3": 2})  # a label child created since the base sample
    assert r.window().delta("accepted.3") == 2 and r.window().ratio("accepted.3", "drafts") == 0.5


def test_restart_resets_the_window():
    r = RollingRates(10)
    r.add(0.0, {"forwards": 100})
    r.add(1.0, {"forwards": 150})
    r.add(2.0, {"forwards": 3})  # the service restarted: its counters began again
    assert r.window() == Window(0.0, {"forwards": 0.0})
    r.add(3.0, {"forwards": 13})
    assert r.window().rate("forwards") == 10.0


def test_older_or_repeated_samples_are_ignored():
    r = RollingRates(10)
    r.add(1.0, {"x": 1})
    r.add(2.0, {"x": 3})
    r.add(2.0, {"x": 99})
    r.add(1.5, {"x": 0})
    assert r.latest() == {"x": 3} and r.window().rate("x") == 2.0


# ---- the snapshot's parts ------------------------------------------------------------------------

def test_orchestrator_view_from_counters():
    total = {"tokens": 300, "tokens.speculative": 250, "tokens.autoregressive": 50, "steps": 120, "requests": 6,
             "drafts": 100, "draft_tokens": 300, "accepted_tokens": 210, "accepted.0": 90, "accepted.1": 70,
             "accepted.2": 50, "k_sum": 360, "k_count": 120}
    w = Window(10.0, {"tokens": 80, "tokens.speculative": 80, "steps": 20, "requests": 2, "drafts": 20,
                      "draft_tokens": 60, "accepted_tokens": 45, "accepted.0": 18, "accepted.1": 15, "accepted.2": 12,
                      "k_sum": 60, "k_count": 20})
    v = orchestrator_view(total, w)
    assert v["window_s"] == 10 and v["tokens_per_second"] == 8.0 and v["requests_per_second"] == 0.2
    assert v["tokens_per_second_by_mode"] == {"speculative": 8.0, "autoregressive": 0.0}
    assert v["acceptance_rate"] == 0.75 and v["mean_accepted_per_draft"] == 2.25 and v["mean_k"] == 3.0
    assert v["acceptance_by_position"] == {"window": [0.9, 0.75, 0.6], "cumulative": [0.9, 0.7, 0.5]}
    assert v["totals"]["acceptance_rate"] == 0.7 and v["totals"]["mean_k"] == 3.0 and v["totals"]["drafts"] == 100
    # nothing drafted in the window: unknown, not zero
    quiet = orchestrator_view(total, Window(10.0, {"tokens": 0}))
    assert quiet["acceptance_rate"] is None and quiet["acceptance_by_position"]["window"] == [None] * 3
    assert quiet["tokens_per_second"] == 0.0
    empty = orchestrator_view({}, Window(0.0))
    assert empty["tokens_per_second"] is None and empty["acceptance_by_position"] == {"window": [], "cumulative": []}


def test_service_view_from_info():
    info = pb.InfoResponse(model_id="/m/tiny", backend="transformers", device="cpu", sessions=3, kv_bytes=1 << 20,
                           kv_budget_bytes=4 << 20,
                           scheduler=pb.SchedulerStats(forwards=500, sessions=900, rows=4000, busy_ns=7 * 10**9,
                                                       calls=800, queue_wait_ns=8 * 10**9, queued=2, max_queued=64))
    w = Window(2.0, {"forwards": 100, "sessions": 250, "rows": 600, "busy_ns": 1.5e9, "calls": 200,
                     "queue_wait_ns": 0.5e9})
    v = service_view(info, w)
    assert v["up"] and v["sessions"] == 3 and v["kv_share"] == 0.25 and v["model_id"] == "/m/tiny"
    s = v["scheduler"]
    assert s["reported"] and s["forwards_per_second"] == 50 and s["calls_per_second"] == 100
    assert s["mean_sessions_per_forward"] == 2.5 and s["mean_rows_per_forward"] == 6.0
    assert s["busy_share"] == 0.75 and s["mean_queue_wait_ms"] == 2.5
    assert (s["queued"], s["max_queued"], s["totals"]["forwards"]) == (2, 64, 500)
    # a service that fills no scheduler counters: shapes stay, figures are unknown
    bare = service_view(pb.InfoResponse(model_id="m"), Window(0.0))
    assert not bare["scheduler"]["reported"] and bare["scheduler"]["busy_share"] is None and bare["kv_share"] is None


# ---- the route, in-process -----------------------------------------------------------------------

def _settings() -> OrchestratorSettings:
    return OrchestratorSettings(draft_address=f"127.0.0.1:{free_port()}", target_address=f"127.0.0.1:{free_port()}")


def test_route_answers_with_both_services_down():
    with TestClient(create_app(_settings()), base_url="http://localhost") as client:
        r = client.get("/v1/server")
        assert r.status_code == 200
        body = r.json()
        assert body["ready"] is False and "unreachable" in body["reason"]
        assert body["active_streams"] == 0 and body["max_concurrent_requests"] == 64
        for name in ("draft", "target"):
            service = body["services"][name]
            assert service["up"] is False and service["reason"].startswith("UNAVAILABLE")
            assert service["address"].startswith("127.0.0.1:")
        assert "/v1/server" in client.get("/openapi.json").json()["paths"]


class FakeInfo:
    """A model service's Info: each call finds 10 more forwards of 2 sessions and 8 rows each."""

    def __init__(self) -> None:
        self.calls = 0

    async def info(self, timeout_s: float = 2.0) -> pb.InfoResponse:
        self.calls += 1
        n = self.calls
        return pb.InfoResponse(model_id="fake", sessions=2, kv_bytes=100, kv_budget_bytes=1000,
                               scheduler=pb.SchedulerStats(forwards=10 * n, sessions=20 * n, rows=80 * n,
                                                           calls=20 * n, queue_wait_ns=20 * n * 10**6, max_queued=8))


class FailingInfo:
    async def info(self, timeout_s: float = 2.0) -> pb.InfoResponse:
        raise RuntimeError("broken channel")


async def test_probe_windows_the_scheduler_counters_and_caches_info(monkeypatch):
    from orchestrator import server_stats

    # the probe's clock, moved by hand: the Info cache's age and the window's span are exact
    now = [100.0]
    monkeypatch.setattr(server_stats, "time", SimpleNamespace(monotonic=lambda: now[0], time=lambda: now[0]))
    probe, fake = ServiceProbe("target"), FakeInfo()
    # the first reading has nothing to compare with; Info is read at most once a second
    first = [await probe.read(fake, "t:1") for _ in range(3)]
    assert fake.calls == 1 and first[0]["scheduler"]["forwards_per_second"] is None
    now[0] += 0.5
    cached = await probe.read(fake, "t:1")
    assert fake.calls == 1 and cached["age_s"] == 0.5 and cached["scheduler"] == first[0]["scheduler"]
    now[0] += 0.75  # 1.25 s after the first reading: past the Info cache
    view = await probe.read(fake, "t:1")
    assert fake.calls == 2 and view["address"] == "t:1" and view["kv_share"] == 0.1 and view["age_s"] == 0
    s = view["scheduler"]
    assert s["mean_sessions_per_forward"] == 2.0 and s["mean_rows_per_forward"] == 8.0
    assert s["mean_queue_wait_ms"] == 1.0 and s["window_s"] == 1.25 and s["forwards_per_second"] == 10 / 1.25
    down = await ServiceProbe("draft").read(FailingInfo(), "d:1")
    assert down == {"up": False, "reason": "RuntimeError: broken channel", "address": "d:1", "age_s": down["age_s"]}


# ---- the route against real services on tiny models ----------------------------------------------

@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory, tiny_models):
    """target + draft (the same tiny checkpoint, so drafts get accepted) + orchestrator, as processes."""
    log_dir = tmp_path_factory.mktemp("server-view")
    model = tiny_models["gpt2-target"]
    procs = []
    try:
        target, target_port = start_model_service("target", log_dir, {"SPECDEC_TARGET_MODEL": model,
                                                                      "SPECDEC_TARGET_THREADS": "1"})
        procs.append(target)
        draft, draft_port = start_model_service("draft", log_dir, {
            "SPECDEC_DRAFT_BACKEND": "transformers", "SPECDEC_DRAFT_MODEL": model, "SPECDEC_DRAFT_THREADS": "1"})
        procs.append(draft)
        orch, url = start_orchestrator(draft_port, target_port, log_dir)
        procs.append(orch)
        yield {"url": url, "draft": draft, "target": target}
    finally:
        for p in reversed(procs):
            p.stop()


def test_server_after_generations(tiny_stack):
    url = tiny_stack["url"]
    for prompt in ("hello world", "the cat sat"):
        r = httpx.post(url + "/v1/generate", timeout=120, json={
            "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "controller": "fixed", "k": 3})
        assert r.status_code == 200, r.text
    body = httpx.get(url + "/v1/server", timeout=10).json()
    assert body["ready"] is True and body["active_streams"] == 0
    assert 0 < body["window_s"] <= 11.5
    assert body["tokens_per_second"] > 0 and body["requests_per_second"] > 0
    # this module's own orchestrator: the two generations above are all it ever served
    assert body["totals"]["tokens"] == 48 and body["totals"]["requests"] == 2
    assert 0 < body["mean_k"] <= 3
    by_position = body["acceptance_by_position"]
    assert 1 <= len(by_position["cumulative"]) <= 3 and len(by_position["window"]) == len(by_position["cumulative"])
    assert all(0 <= x <= 1 for x in by_position["cumulative"]) and by_position["cumulative"][0] > 0
    assert 0 < body["acceptance_rate"] <= 1
    for name in ("draft", "target"):
        service = body["services"][name]
        assert service["up"] is True, service
        # the requests above left their sessions released: what the services report now is what they hold
        assert isinstance(service["sessions"], int) and service["kv_budget_bytes"] > 0
        assert (service["sessions"] == 0) == (service["kv_bytes"] == 0), service
        s = service["scheduler"]
        # both services schedule on a compute thread (max_queued_calls: 128 by default), which served the requests
        assert s["reported"] is True and s["max_queued"] == 128, s
        assert s["totals"]["forwards"] > 0 and s["totals"]["rows"] >= s["totals"]["forwards"], s
    # every step verified once on the target, and each generation's session released there
    assert body["services"]["target"]["scheduler"]["totals"]["calls"] >= body["totals"]["steps"], body


def test_a_dead_service_shows_as_down(tiny_stack):
    seen: list[dict[str, Any]] = []

    def shown_down(name: str) -> dict[str, Any] | None:
        """The snapshot's services once ``name`` shows down (Info is cached up to a second)."""
        r = httpx.get(tiny_stack["url"] + "/v1/server", timeout=10)
        assert r.status_code == 200, r.text  # the snapshot answers whatever is down
        seen.append(services := r.json()["services"])
        return services if not services[name]["up"] else None

    tiny_stack["draft"].kill()
    services = wait_until(lambda: shown_down("draft"), 10, lambda: f"the draft still shown up: {seen[-1]}", 0.05)
    draft = services["draft"]
    assert set(draft) == {"up", "reason", "address", "age_s"} and draft["reason"].startswith("UNAVAILABLE"), draft
    assert services["target"]["up"] is True
    tiny_stack["target"].kill()
    services = wait_until(lambda: shown_down("target"), 10, lambda: f"the target still shown up: {seen[-1]}", 0.05)
    assert services["target"]["reason"].startswith("UNAVAILABLE") and services["draft"]["up"] is False, services


# ---- ui.server_view ------------------------------------------------------------------------------

def snapshot(**changes: Any) -> dict[str, Any]:
    body = {
        "timestamp": 1.0, "ready": True, "reason": "", "active_streams": 3, "max_concurrent_requests": 64,
        "window_s": 10.0, "tokens_per_second": 42.5, "tokens_per_second_by_mode": {"speculative": 42.5,
                                                                                  "autoregressive": 0.0},
        "requests_per_second": 0.4, "steps_per_second": 12.0, "acceptance_rate": 0.8, "mean_accepted_per_draft": 2.1,
        "mean_k": 3.25, "acceptance_by_position": {"window": [0.9, 0.7, None], "cumulative": [0.88, 0.66, 0.4]},
        "totals": {"tokens": 1234, "requests": 17, "steps": 400, "drafts": 350, "draft_tokens": 1000,
                   "accepted_tokens": 700, "acceptance_rate": 0.7, "mean_k": 3.1},
        "services": {
            "target": {"up": True, "model_id": "/cache/SmolLM2-135M-Instruct", "backend": "transformers",
                       "device": "cpu", "sessions": 3, "kv_bytes": 3 << 20, "kv_budget_bytes": 12 << 20,
                       "kv_share": 0.25, "address": "target:50052", "age_s": 0.2,
                       "scheduler": {"reported": True, "window_s": 9.5, "forwards_per_second": 11.0,
                                     "calls_per_second": 25.0, "rows_per_second": 90.0, "mean_sessions_per_forward": 2.4,
                                     "mean_rows_per_forward": 8.2, "busy_share": 0.62, "mean_queue_wait_ms": 4.5,
                                     "queued": 2, "max_queued": 64, "totals": {}}},
            "draft": {"up": False, "reason": "UNAVAILABLE: connection refused", "address": "draft:50051", "age_s": 0.1},
        },
    }
    body.update(changes)
    return body


def test_service_figures():
    up = sv.service_figures("target", snapshot()["services"]["target"])
    assert up.up and up.headline == "SmolLM2-135M-Instruct · transformers · cpu"
    assert (up.batch_sessions, up.batch_rows, up.forwards_per_second) == ("2.40", "8.2", "11.0")
    assert (up.queue, up.queue_wait, up.sessions) == ("2 / 64", "4.5 ms", "3")
    assert up.busy == 0.62 and up.kv == 0.25 and up.kv_text == "KV cache 3.0 MB of 12.0 MB (25%)"
    down = sv.service_figures("draft", snapshot()["services"]["draft"])
    assert not down.up and down.headline == "down at draft:50051: UNAVAILABLE: connection refused"
    bare = sv.service_figures("draft", {"up": True, "model_id": "m", "scheduler": {"reported": False, "busy_share": None}})
    assert bare.batch_sessions == "n/a" and bare.busy == 0.0 and bare.busy_text.startswith("Busy n/a")
    assert not bare.reported and bare.kv_text == "KV cache 0 B (no budget reported)"
    assert sv.share(1.7) == 1.0 and sv.share(None) == 0.0


def test_position_rows_and_history():
    assert sv.position_rows(snapshot()) == [{"position": "1", "recent": 0.9, "since start": 0.88},
                                            {"position": "2", "recent": 0.7, "since start": 0.66},
                                            {"position": "3", "recent": None, "since start": 0.4}]
    assert sv.position_rows({}) == []
    history: list[dict[str, Any]] = []
    for t in (0.0, 100.0, 350.0):
        history = sv.append_history(history, t, snapshot())
    assert [p["t"] for p in history] == [100.0, 350.0]  # the first is over 5 minutes old
    assert sv.append_history([], 1.0, snapshot(tokens_per_second=None))[-1]["tokens_per_s"] == 0.0


# ---- the Server tab (AppTest) --------------------------------------------------------------------

@pytest.fixture
def fake(fake_orchestrator, monkeypatch):
    fake_orchestrator.reset(snapshot())
    monkeypatch.setenv("SPECDEC_UI_ORCHESTRATOR_URL", fake_orchestrator.url)
    return fake_orchestrator


def server_tab(tab: str = "Server"):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["view"] = tab
    at.run()
    assert not at.exception, at.exception
    return at


def test_server_tab_shows_the_numbers(fake):
    at = server_tab()
    values = [(m.label, m.value) for m in at.metric]
    assert values[:5] == [("Active streams", "3 / 64"), ("Tokens/s", "42.5"), ("Requests/s", "0.40"),
                          ("Acceptance rate", "80%"), ("Mean k", "3.25")]
    # the target's figures; the draft is down, so it has none
    assert values[5:] == [("Batch size", "2.40"), ("Rows / forward", "8.2"), ("Forwards/s", "11.0"),
                          ("Queue", "2 / 64"), ("Queue wait", "4.5 ms"), ("Sessions", "3")]
    panel = messages(at.markdown)
    assert "**target**: SmolLM2-135M-Instruct · transformers · cpu" in panel
    assert "**draft**: down at draft:50051: UNAVAILABLE: connection refused" in panel
    bars = at.get("progress")
    assert [b.proto.text for b in bars] == ["Busy 62% of the time (forward passes / wall time)",
                                            "KV cache 3.0 MB of 12.0 MB (25%)"]
    assert len(at.get("vega_lite_chart")) == 2  # tokens/s history and acceptance by position
    assert "1234 tokens, 17 generations" in messages(at.caption)
    assert not at.error and not at.warning
    assert len(at.session_state["server_history"]) == 1


def test_server_tab_sends_the_api_key(fake, monkeypatch):
    monkeypatch.setenv("SPECDEC_UI_API_KEY", "sk-dashboard")
    server_tab()
    assert ("/v1/server", "Bearer sk-dashboard") in fake.gets


def test_generate_tab_does_not_poll_the_server_view(fake):
    at = server_tab("Generate")
    assert "/v1/server" not in [path for path, _ in fake.gets]
    assert at.text_area(key="prompt").label == "Prompt" and not at.metric


def test_server_tab_on_an_older_orchestrator(fake):
    fake.server_body = None  # 404, as before /v1/server existed
    at = server_tab()
    assert sv.NO_SERVER_ROUTE in messages(at.warning)
    assert not at.error and not at.metric


def test_server_tab_with_the_orchestrator_not_ready(fake):
    fake.mode = "not_ready"
    fake.server_body = snapshot(ready=False, reason="target service at t:1 unreachable: UNAVAILABLE",
                                tokens_per_second=None, acceptance_rate=None, mean_k=None,
                                acceptance_by_position={"window": [], "cumulative": []},
                                services={"target": {"up": False, "reason": "UNAVAILABLE: refused"},
                                          "draft": {"up": False, "reason": "UNAVAILABLE: refused"}})
    at = server_tab()
    assert "The orchestrator is up but not ready: target service at t:1 unreachable" in messages(at.warning)
    assert dict((m.label, m.value) for m in at.metric)["Tokens/s"] == "n/a"
    assert "No draft token accepted yet." in messages(at.caption)
    assert "**target**: down: UNAVAILABLE: refused" in messages(at.markdown)


def test_server_tab_with_the_orchestrator_down(monkeypatch):
    monkeypatch.setenv("SPECDEC_UI_ORCHESTRATOR_URL", f"http://127.0.0.1:{free_port()}")
    at = server_tab()
    assert messages(at.error).count("Cannot reach the orchestrator") == 2  # the banner and the tab
    assert not at.metric


def test_client_server_errors(fake):
    from ui.client import OrchestratorClient, Rejected, Unreachable

    assert OrchestratorClient(fake.url).server()["active_streams"] == 3
    fake.server_body = None
    with pytest.raises(Rejected) as exc:
        OrchestratorClient(fake.url).server()
    assert exc.value.status == 404
    with pytest.raises(Unreachable):
        OrchestratorClient(f"http://127.0.0.1:{free_port()}").server()

