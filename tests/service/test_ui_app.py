"""The dashboard page (Streamlit AppTest) against a fake orchestrator on a real port, and the pure
functions behind it (ui.render, ui.client)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import (
    IDS,
    INFO_MODEL,
    SPECULATIVE,
    TEXTS,
    app,
    done,
    free_port,
    messages,
    metrics,
    stats,
    step,
    stream_html,
    submit,
)
from ui import render
from ui.client import OrchestratorClient, Rejected, StreamFailed, Unreachable, describe_detail, parse_sse


@pytest.fixture
def fake(fake_orchestrator, monkeypatch):
    fake_orchestrator.reset()
    monkeypatch.setenv("SPECDEC_UI_ORCHESTRATOR_URL", fake_orchestrator.url)
    return fake_orchestrator


# ---- the page ------------------------------------------------------------------------------------

def test_services_and_defaults_from_the_orchestrator(fake):
    at = app()
    panel = messages(at.sidebar.markdown)
    assert "**orchestrator**: ready" in panel and "**target**: up" in panel and "**draft**: up" in panel
    assert "SmolLM2-135M-Instruct · transformers · float32" in messages(at.sidebar.caption)
    assert at.number_input(key="k").value == 4 and at.number_input(key="max_k").value == 8
    assert at.selectbox(key="controller").value == "cost"
    assert not at.error and not at.warning
    legend = next(h.value for h in at.html if "tok-legend" in h.value)
    for kind in render.KINDS:
        assert f"tok tok-{kind}" in legend and render.LABELS[kind] in legend


def test_generate_shows_provenance_charts_and_summary(fake):
    at = submit(app(), "Once upon a time")
    body = fake.requests[-1]
    assert body["prompt"] == "Once upon a time" and "messages" not in body
    assert body["mode"] == "speculative" and body["controller"] == "cost" and body["k"] == 4
    assert body["max_k"] == 8 and body["max_tokens"] == 128 and body["temperature"] == 0.0 and "seed" not in body

    [html] = stream_html(at)
    assert html.count("tok tok-accepted") == 5  # 2 + 3
    assert html.count("tok tok-rejected") == 4  # 2 in step 0, 2 in step 2
    assert html.count("tok tok-correction") == 2 and html.count("tok tok-bonus") == 1
    assert "tok-plain" not in html
    # order: accepted, accepted, rejected (struck through where rejected), rejected, correction
    order = [html.index(s) for s in ['"> The<', '"> cat<', '"> &lt;b&gt;&amp;<', '"> x<', '"> dog<']]
    assert order == sorted(order)
    assert "draft confidence 90.0 %" in html and "target probability 80.0 %" in html  # hover text

    m = metrics(at)
    assert m["Acceptance rate"] == "56%" and m["Accepted / iteration"] == "1.67" and m["Tokens/s"] == "40.0"
    assert m["Draft time"] == "36 ms" and m["Verify time"] == "60 ms" and m["Overhead"] == "3 ms"
    draft_help = next(x.help for x in at.metric if x.label == "Draft time")
    assert "36% of the time" in draft_help and "27 ms computing in the service, 9 ms in the round trip" in draft_help
    assert "Time split draft / verify / overhead: 36% / 61% / 3%" in messages(at.caption)
    assert "8 tokens in 3 iterations · finish: length · mode speculative · controller cost" in messages(at.caption)

    frame = at.dataframe[0].value
    assert frame["k"].tolist() == [4, 3, 4] and frame["accepted"].tolist() == [2, 3, 0]
    assert frame["tokens"].tolist() == [3, 4, 1]
    # cumulative tokens/s from the step timings: 3 tokens in 37 ms, 7 in 70 ms, 8 in 99 ms
    assert frame["tokens_per_s"].tolist() == pytest.approx([81.08, 100.0, 80.81], abs=0.01)
    assert len(at.get("vega_lite_chart")) == 2
    assert not at.error


def test_answer_survives_a_rerun(fake):
    at = submit(app(), "Once upon a time")
    at.slider(key="temperature").set_value(0.7).run()
    assert len(stream_html(at)) == 1 and len(fake.requests) == 1


def test_options_reach_the_request(fake):
    at = app()
    at.radio(key="mode").set_value("autoregressive")
    at.selectbox(key="controller").set_value("fixed")
    at.number_input(key="k").set_value(2)
    at.slider(key="temperature").set_value(0.5)
    at.number_input(key="seed").set_value(7)
    at.checkbox(key="ignore_eos").check()
    assert at.radio(key="overlap").value == "off"  # the server's default (DEFAULTS has none: off)
    at.radio(key="overlap").set_value("on")
    at.run()
    submit(at, "Hello")
    body = fake.requests[-1]
    assert body["mode"] == "autoregressive" and body["controller"] == "fixed" and body["k"] == 2
    assert body["temperature"] == 0.5 and body["seed"] == 7 and body["ignore_eos"] is True
    assert body["overlap"] is True
    at.radio(key="overlap").set_value("auto")
    at.run()
    submit(at, "Hello")
    assert "overlap" not in fake.requests[-1]  # auto: the server's default decides
    [html] = stream_html(at)
    assert html.count("tok tok-plain") == 8 and "tok-accepted" not in html
    assert metrics(at)["Acceptance rate"] == "n/a"
    assert len(at.get("vega_lite_chart")) == 1  # tokens/s only: k and accepted are all zero


def test_chat_mode_sends_messages(fake):
    at = app()
    at.radio(key="input_style").set_value("Chat").run()
    submit(at, "Tell me a story")
    body = fake.requests[-1]
    assert body["messages"] == [{"role": "user", "content": "Tell me a story"}] and "prompt" not in body


def test_compare_with_plain_decoding(fake):
    at = submit(app(), "Once upon a time", button="compare")
    assert [r["mode"] for r in fake.requests] == ["speculative", "autoregressive"]
    assert fake.requests[0]["prompt"] == fake.requests[1]["prompt"]
    assert metrics(at)["Speedup"] == "2.00×"
    assert "Identical output: all 8 token ids match." in messages(at.success)
    speculative, plain = stream_html(at)
    assert "tok-accepted" in speculative and "tok-plain" in plain and "tok-accepted" not in plain


def test_compare_reports_a_difference(fake):
    fake.mode = "plain_differs"
    at = submit(app(), "Once upon a time", button="compare")
    assert "The outputs differ from token 8 on" in messages(at.warning)
    assert metrics(at)["Identical output"] == "no"


def test_orchestrator_down(monkeypatch):
    monkeypatch.setenv("SPECDEC_UI_ORCHESTRATOR_URL", f"http://127.0.0.1:{free_port()}")
    at = app()
    assert "Cannot reach the orchestrator at http://127.0.0.1:" in messages(at.error)
    assert "**orchestrator**: unreachable" in messages(at.sidebar.markdown)
    submit(at, "Hello")
    assert messages(at.error).count("Cannot reach the orchestrator") >= 2  # banner and the failed request
    assert not stream_html(at)


def test_orchestrator_not_ready(fake):
    fake.mode = "not_ready"
    at = app()
    assert "not ready: target service at 127.0.0.1:1 unreachable" in messages(at.warning)
    assert "**target**: down" in messages(at.sidebar.markdown)
    submit(at, "Hello")
    assert "The orchestrator is not ready (HTTP 503): not ready: target service" in messages(at.warning)
    assert not at.error


def test_draft_failing_is_reported(fake):
    fake.mode = "draft_failing"
    at = app()
    assert "**draft**: failing" in messages(at.sidebar.markdown)
    assert "decodes with the target alone" in messages(at.info)


@pytest.mark.parametrize(("mode", "message"), [
    ("bad_input", "rejected the request (HTTP 422): max_tokens: Input should be less than or equal to 4096"),
    ("bad_prompt", "rejected the request (HTTP 400): prompt: 9000 tokens, over the model's context of 8191"),
])
def test_rejected_input_shows_the_detail(fake, mode, message):
    fake.mode = mode
    at = submit(app(), "Hello")
    assert message in messages(at.error)
    assert not stream_html(at)


def test_failure_mid_stream_keeps_the_partial_answer(fake):
    fake.mode = "mid_error"
    at = submit(app(), "Hello")
    assert "Generation failed part-way (HTTP 503): target service: UNAVAILABLE: gone" in messages(at.error)
    [html] = stream_html(at)
    assert html.count("tok-accepted") == 2 and html.count("tok-correction") == 1


def test_empty_prompt_is_not_sent(fake):
    at = submit(app(), "   ")
    assert "Write a prompt first." in messages(at.warning) and not fake.requests


# ---- ui.render -----------------------------------------------------------------------------------

def kinds(s: dict[str, Any]) -> list[tuple[str, str]]:
    return [(t.kind, t.text) for t in render.step_tokens(s)]


def test_step_tokens_correction():
    assert kinds(SPECULATIVE[0]) == [("accepted", " The"), ("accepted", " cat"), ("rejected", " <b>&"),
                                     ("rejected", " x"), ("correction", " dog")]


def test_step_tokens_bonus_and_plain():
    assert kinds(SPECULATIVE[1]) == [("accepted", " ran"), ("accepted", " off"), ("accepted", " to"),
                                     ("bonus", " the")]
    assert kinds(step(0, 0, [], 0, 30, "plain")) == [("plain", " park")]


def test_step_tokens_cut_at_eos_or_max_tokens():
    # the step was trimmed after one accepted token: the rest of it is not shown
    assert kinds(step(0, 4, [10, 11, 12], 2, 20, "correction", tokens=[10])) == [("accepted", " The")]
    # trimmed right after the accepted prefix: the correction was not kept, so neither are the rejected
    assert kinds(step(0, 4, [10, 11, 12], 2, 20, "correction", tokens=[10, 11])) == [
        ("accepted", " The"), ("accepted", " cat")]


def test_step_tokens_titles():
    accepted, *_, correction = render.step_tokens(SPECULATIVE[0])
    assert accepted.title.splitlines() == ["accepted draft token", "draft confidence 90.0 %",
                                           "target probability 80.0 %", "iteration 1, k = 4"]
    assert correction.title.splitlines()[:3] == ["target correction", "draft confidence n/a (not drafted)",
                                                 "target probability 60.0 %"]


def test_token_span_escapes_text_and_title():
    span = render.token_span(render.Token('<script>"&', "bonus", 'a "quoted" <title>'))
    assert span == ('<span class="tok tok-bonus" title="a &quot;quoted&quot; &lt;title&gt;">'
                    "&lt;script&gt;&quot;&amp;</span>")
    assert 'class="tok tok-plain tok-empty"' in render.token_span(render.Token("", "plain", "t"))


def test_css_gives_every_kind_its_own_colours():
    colours = {}
    for kind in render.KINDS:
        rule = render.CSS.split(f".tok-{kind} {{", 1)[1].split("}", 1)[0]
        colours[kind] = rule
        assert "background" in rule and "color" in rule
    assert len(set(colours.values())) == len(render.KINDS)
    assert "line-through" in colours["rejected"]


def test_iteration_rows_and_live_summary():
    rows = render.iteration_rows(SPECULATIVE)
    assert [(r["iteration"], r["k"], r["drafted"], r["accepted"], r["tokens"], r["next"]) for r in rows] == [
        (1, 4, 4, 2, 3, "correction"), (2, 3, 3, 3, 4, "bonus"), (3, 4, 2, 0, 1, "correction")]
    assert [r["elapsed_ms"] for r in rows] == [37.0, 70.0, 99.0]
    s = render.summary(SPECULATIVE)
    assert (s.tokens, s.iterations, s.draft_tokens, s.accepted_tokens) == (8, 3, 9, 5)
    assert s.acceptance_rate == pytest.approx(5 / 9) and s.mean_accepted_per_iteration == pytest.approx(5 / 3)
    assert s.tokens_per_second == pytest.approx(8 / 0.099)
    assert (s.draft_ms, s.verify_ms, s.overhead_ms) == (36.0, 60.0, 3.0)
    assert (s.draft_compute_ms, s.verify_compute_ms) == (27.0, 54.0)
    assert s.share("verify") == pytest.approx(60 / 99)
    assert render.summary([]).tokens_per_second == 0.0 and render.summary([]).share("draft") == 0.0


def test_summary_prefers_the_final_stats():
    s = render.summary(SPECULATIVE, stats(8, 3, 9, 5, 40.0))
    assert s.tokens_per_second == 40.0 and s.elapsed_ms == 200.0 and s.first_token_ms == 30.0
    assert isinstance(s.tokens, int) and s.acceptance_rate == pytest.approx(5 / 9)


def test_compare():
    spec = render.Generation("speculative", SPECULATIVE, done(IDS, "speculative", stats(8, 3, 9, 5, 40.0)))
    plain = render.Generation("autoregressive", [], done(IDS, "autoregressive", stats(8, 8, 0, 0, 16.0)))
    c = render.compare(spec, plain)
    assert c.identical and c.first_difference is None and c.speedup == pytest.approx(2.5)
    plain.done["token_ids"] = IDS[:3] + [99] + IDS[4:]
    assert render.compare(spec, plain).first_difference == 3
    plain.done["token_ids"] = IDS[:5]  # a prefix: differs where the shorter one ends
    assert render.compare(spec, plain).first_difference == 5
    assert render.compare(spec, render.Generation("autoregressive")).speedup == 0.0


def test_generation_without_done_uses_the_steps():
    gen = render.Generation("speculative", SPECULATIVE)
    assert gen.token_ids == IDS and gen.text == "".join(TEXTS[t] for t in IDS)


def test_build_request():
    options = {"mode": "speculative", "k": 4, "seed": None}
    assert render.build_request("hi", False, options) == {"prompt": "hi", "mode": "speculative", "k": 4}
    assert render.build_request("hi", True, options) == {
        "messages": [{"role": "user", "content": "hi"}], "mode": "speculative", "k": 4}


def test_service_states():
    down = render.service_states(False, "Cannot reach", {}, {})
    assert [(s.name, s.ok) for s in down] == [("orchestrator", False), ("target", None), ("draft", None)]
    ready = {"ready": True, "reason": "", "draft": INFO_MODEL, "target": INFO_MODEL}
    up = render.service_states(True, "", ready, {"draft_available": True})
    assert [s.ok for s in up] == [True, True, True]
    assert up[1].detail == "SmolLM2-135M-Instruct · transformers · float32 · cpu · context 8192 · 1 sessions, KV 2.0 MB"
    no_draft = {"ready": False, "reason": "draft service at x unreachable: UNAVAILABLE", "draft": {},
                "target": INFO_MODEL}
    assert [s.ok for s in render.service_states(True, "", no_draft, {})] == [False, True, False]
    degraded = {"ready": True, "reason": "", "degraded": "draft service at x unreachable: UNAVAILABLE; decoding without drafts",
                "draft": {}, "target": INFO_MODEL}
    states = render.service_states(True, "", degraded, {})
    assert [(s.ok, s.status) for s in states] == [(True, "ready (degraded)"), (True, "up"), (False, "down")]
    assert "decoding without drafts" in states[2].detail
    failing = render.service_states(True, "", ready, {"draft_available": False})[2]
    assert failing.ok is False and failing.status.startswith("failing")


# ---- ui.client -----------------------------------------------------------------------------------

def test_parse_sse():
    lines = ["event: step", "data: {\"a\": 1}", "", ": ping - 2024", "", "data: x", "data: y", "",
             "event: done", "data:{}"]
    assert list(parse_sse(lines)) == [("step", '{"a": 1}'), ("message", "x\ny"), ("done", "{}")]


def test_describe_detail():
    assert describe_detail("not ready") == "not ready"
    assert describe_detail([{"loc": ["body", "k"], "msg": "too big"}, {"loc": ["body"], "msg": "bad"}]) == (
        "k: too big; bad")
    assert describe_detail({"x": 1}) == '{"x": 1}'


def test_client_errors(fake):
    client = OrchestratorClient(fake.url)
    assert [e for e, _ in client.stream({"prompt": "x"})] == ["step", "step", "step", "done"]
    fake.mode = "bad_input"
    with pytest.raises(Rejected) as exc:
        list(client.stream({"prompt": "x"}))
    assert exc.value.status == 422 and exc.value.detail.startswith("max_tokens:")
    fake.mode = "mid_error"
    with pytest.raises(StreamFailed, match="part-way"):
        list(client.stream({"prompt": "x"}))
    with pytest.raises(Unreachable, match="Cannot reach"):
        list(OrchestratorClient(f"http://127.0.0.1:{free_port()}").stream({"prompt": "x"}))
    status = OrchestratorClient(f"http://127.0.0.1:{free_port()}").status()
    assert not status.alive and "Cannot reach" in status.error


def test_launch_command(monkeypatch):
    from ui.__main__ import APP as app_path
    from ui.__main__ import command

    monkeypatch.setenv("SPECDEC_UI_PORT", "8765")
    cmd = command()
    assert cmd[1:5] == ["-m", "streamlit", "run", str(app_path)] and app_path.name == "app.py"
    assert cmd[cmd.index("--server.port") + 1] == "8765"
    assert cmd[cmd.index("--server.headless") + 1] == "true"
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"  # local only unless SPECDEC_UI_HOST says otherwise
    assert cmd[cmd.index("--browser.gatherUsageStats") + 1] == "false"


def test_a_password_guards_the_dashboard(fake, monkeypatch):
    """With SPECDEC_UI_PASSWORD the page shows only a sign-in form, sends nothing to the orchestrator,
    and opens once this browser session gives the right password."""
    monkeypatch.setenv("SPECDEC_UI_PASSWORD", "s3cret pass")
    at = app()
    assert [t.label for t in at.text_input] == ["Password"] and not at.text_area and not fake.gets
    at.text_input(key="password").input("wrong")
    at.button[0].click().run()
    assert "Wrong password." in messages(at.error) and not at.text_area and not fake.gets
    at.text_input(key="password").input("s3cret pass")
    at.button[0].click().run()
    assert not at.exception and at.text_area(key="prompt") is not None and fake.gets
    assert "**orchestrator**: ready" in messages(at.sidebar.markdown)


def test_the_launcher_warns_of_a_key_without_a_password(monkeypatch, capsys):
    import ui.__main__ as launcher

    monkeypatch.setattr(launcher.os, "execv", lambda *a: None)
    monkeypatch.setenv("SPECDEC_UI_API_KEY", "k")
    monkeypatch.delenv("SPECDEC_UI_PASSWORD", raising=False)
    launcher.main()
    assert "asks no password" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_UI_PASSWORD", "p")
    launcher.main()
    assert capsys.readouterr().err == ""
