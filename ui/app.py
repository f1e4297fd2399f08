"""The dashboard page: a prompt, the answer streaming in token by token with the provenance of
every token, live charts of each iteration, and a comparison with plain decoding.

Run with ``python -m ui`` (Streamlit). It talks to the orchestrator over HTTP only; the logic
lives in ``ui.client`` (HTTP, SSE) and ``ui.render`` (tokens, series, summaries).
"""

from __future__ import annotations

import hmac
import sys
import time
from pathlib import Path
from typing import Any

# `streamlit run ui/app.py` puts ui/ on the path, not the project root that holds the package.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402

from ui.client import OrchestratorClient, OrchestratorError, Rejected, Status  # noqa: E402
from ui.render import (  # noqa: E402
    CSS,
    Comparison,
    Generation,
    build_request,
    compare,
    iteration_rows,
    legend_html,
    service_states,
    tokens_html,
)
from ui.server_view import NO_SERVER_ROUTE, ServiceFigures, append_history, fmt, position_rows, service_figures  # noqa: E402
from ui.settings import UISettings  # noqa: E402

CONTROLLERS = ["cost", "acceptance", "hf", "fixed"]
CONTROLLER_HELP = (
    "How the draft length k adapts per request: 'cost' picks k to maximise expected tokens/s from measured "
    "acceptance and timings; 'acceptance' grows k when all are accepted and shrinks it by the acceptance rate; "
    "'hf' is Hugging Face's +2/-1 rule; 'fixed' keeps k constant."
)
REFRESH_S = 0.25  # least time between two redraws of a streaming answer
SERVER_REFRESH_S = 2.0  # how often the open Server tab asks for a new snapshot


def signed_in(password: str | None) -> bool:
    """True when no password is set or this browser session gave it; else show the sign-in form."""
    if password is None or st.session_state.get("signed_in"):
        return True
    st.title("specdec dashboard")
    with st.form("sign-in"):
        given = st.text_input("Password", type="password", key="password")
        if st.form_submit_button("Sign in"):
            if hmac.compare_digest(given.encode(), password.encode()):
                st.session_state["signed_in"] = True
                st.rerun()
            st.error("Wrong password.")
    return False


def main() -> None:
    st.set_page_config(page_title="specdec: speculative decoding, live", page_icon=":material/bolt:", layout="wide")
    settings = UISettings()
    if not signed_in(settings.dashboard_password()):
        st.stop()
    client = OrchestratorClient(settings.orchestrator_url, settings.request_timeout_s, settings.stream_timeout_s,
                                settings.orchestrator_key())
    st.html(CSS)

    with st.sidebar:
        st.header("Services")
        st.caption(f"Orchestrator: {settings.orchestrator_url}")
        st.fragment(services_panel, run_every=settings.health_interval_s)(client)
        status: Status = st.session_state["status"]
        options = decoding_controls(status.info.get("defaults", {}))

    st.title("Speculative decoding, live")
    st.caption(
        "A small draft model proposes k tokens; the target model checks them all in one forward pass, keeps the "
        "ones it agrees with and adds one token of its own. The output is exactly the target's; the draft only "
        "decides how many tokens land per target pass."
    )
    status_banner(status)
    # Switching tabs reruns the page, so the Server tab polls only while it is open.
    generate_tab, server_tab = st.tabs(["Generate", "Server"], key="view", bind="query-params")
    with generate_tab:
        generate_view(client, status, options)
    if server_tab.open:
        with server_tab:
            st.fragment(server_view, run_every=SERVER_REFRESH_S)(client)


def generate_view(client: OrchestratorClient, status: Status, options: dict[str, Any]) -> None:
    """The Generate tab: legend, prompt, and the answer streaming in (or the last one, on reruns)."""
    st.html(legend_html())

    chat = st.radio("Input", ["Plain prompt", "Chat"], horizontal=True, key="input_style",
                    help="Chat sends your text as a user message; the orchestrator applies the model's chat "
                         "template. Plain continues the text as is.") == "Chat"
    if chat and status.info and not status.info.get("has_chat_template", False):
        st.caption("The target model has no chat template; the orchestrator may refuse chat input.")
    with st.form("prompt_form", border=False):
        text = st.text_area("Message" if chat else "Prompt", key="prompt", height=110,
                            placeholder="Write a haiku about speculative decoding." if chat
                            else "The three laws of robotics are")
        buttons = st.container(horizontal=True)
        generate = buttons.form_submit_button("Generate", type="primary", key="generate")
        both = buttons.form_submit_button("Compare with plain decoding", key="compare",
                                        help="Runs the prompt speculatively, then with the target alone, and "
                                             "shows the speedup and whether the outputs are identical.")

    if generate or both:
        if not text.strip():
            st.warning("Write a prompt first.")
            return
        body = build_request(text, chat, options)
        result = run_compare(client, body) if both else run_single(client, body)
        st.session_state["result"] = result
    elif "result" in st.session_state:
        show_result(st.session_state["result"])


# ---- sidebar -------------------------------------------------------------------------------------

def services_panel(client: OrchestratorClient) -> None:
    """Health of the three services; reruns by itself every few seconds."""
    status = client.status()
    st.session_state["status"] = status
    for state in service_states(status.alive, status.error, status.ready, status.info):
        icon = {True: ":green[:material/check_circle:]", False: ":red[:material/error:]",
                None: ":gray[:material/help:]"}[state.ok]
        st.markdown(f"{icon} **{state.name}**: {state.status}")
        if state.detail:
            st.caption(state.detail)


def decoding_controls(defaults: dict[str, Any]) -> dict[str, Any]:
    """The request's knobs; defaults come from the orchestrator's /v1/info."""
    st.header("Decoding")
    mode = st.radio("Mode", ["speculative", "autoregressive"], key="mode", horizontal=True,
                    help="'autoregressive' decodes with the target alone: the baseline.")
    controller = defaults.get("controller", "cost")
    controller = st.selectbox("k controller", CONTROLLERS, key="controller", help=CONTROLLER_HELP,
                              index=CONTROLLERS.index(controller) if controller in CONTROLLERS else 0)
    left, right = st.columns(2)
    k = left.number_input("k", min_value=0, max_value=64, value=int(defaults.get("k", 4)), key="k",
                          help="Initial draft length (constant for the 'fixed' controller).")
    max_k = right.number_input("max k", min_value=1, max_value=64, value=int(defaults.get("max_k", 16)),
                               key="max_k", help="Largest draft length an adaptive controller may pick.")
    threshold = st.slider("Confidence threshold", 0.0, 1.0, float(defaults.get("confidence_threshold", 0.1)),
                          0.05, key="threshold",
                          help="The draft stops early after a token it is less sure of than this.")
    choices = ["auto", "on", "off"]
    default_overlap = defaults.get("overlap", "off")
    overlap = st.radio("Overlap drafting with verification", choices, horizontal=True, key="overlap",
                       index=choices.index(default_overlap) if default_overlap in choices else 2,
                       help="The draft drafts the next block while the target verifies this one (greedy only); "
                            "auto: while this is the only request in progress.")
    st.header("Sampling")
    limit = int(defaults.get("max_tokens_limit", 4096))
    max_tokens = st.number_input("Max tokens", min_value=1, max_value=limit,
                                 value=min(int(defaults.get("max_tokens", 128)), limit), key="max_tokens")
    temperature = st.slider("Temperature", 0.0, 2.0, 0.0, 0.05, key="temperature", help="0 is greedy decoding.")
    top_p = st.slider("Top-p", 0.05, 1.0, 1.0, 0.05, key="top_p", help="Nucleus sampling mass.")
    left, right = st.columns(2)
    top_k = left.number_input("Top-k", min_value=0, value=0, key="top_k", help="0 keeps all tokens.")
    seed = right.number_input("Seed", min_value=0, value=None, key="seed", placeholder="random",
                              help="Makes sampling reproducible; empty picks one.")
    ignore_eos = st.checkbox("Ignore end of sequence", key="ignore_eos",
                             help="Keep generating up to max tokens.")
    return {
        "mode": mode, "controller": controller, "k": int(k), "max_k": int(max_k),
        "confidence_threshold": round(float(threshold), 4),
        "overlap": {"on": True, "off": False}.get(overlap), "max_tokens": int(max_tokens),
        "temperature": round(float(temperature), 4), "top_p": round(float(top_p), 4), "top_k": int(top_k),
        "seed": int(seed) if seed is not None else None, "ignore_eos": bool(ignore_eos),
    }


def status_banner(status: Status) -> None:
    if not status.alive:
        st.error(status.error)
    elif not status.ready.get("ready", False):
        reason = status.ready.get("reason") or status.info.get("reason") or "no reason given"
        st.warning(f"The orchestrator is up but not ready: {reason}. Generation will fail until it is.")
    elif status.info and not status.info.get("draft_available", True):
        st.info("The draft service is failing: the orchestrator decodes with the target alone (plain tokens) "
                "until it is back.")


# ---- generation ----------------------------------------------------------------------------------

def stream_into(client: OrchestratorClient, body: dict[str, Any], compact: bool = False) -> Generation:
    """Run one generation, redrawing the answer, charts and numbers as steps arrive."""
    gen = Generation(mode=body.get("mode", "speculative"))
    area = st.empty()
    last = 0.0
    try:
        for event, payload in client.stream(body):
            if event == "step":
                gen.steps.append(payload)
            else:
                gen.done = payload
            if event == "step" and time.monotonic() - last >= REFRESH_S:
                with area.container():
                    show_generation(gen, compact, live=True)
                last = time.monotonic()
    except OrchestratorError as exc:
        gen.error = str(exc)
        gen.error_level = "warning" if isinstance(exc, Rejected) and exc.status == 503 else "error"
    with area.container():
        show_generation(gen, compact)
    return gen


def run_single(client: OrchestratorClient, body: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "single", "runs": [stream_into(client, body)]}


def run_compare(client: OrchestratorClient, body: dict[str, Any]) -> dict[str, Any]:
    verdict = st.empty()
    left, right = st.columns(2)
    with left:
        st.subheader("Speculative")
        speculative = stream_into(client, {**body, "mode": "speculative"}, compact=True)
    with right:
        st.subheader("Plain (target alone)")
        plain = stream_into(client, {**body, "mode": "autoregressive"}, compact=True)
    result = {"kind": "compare", "runs": [speculative, plain], "sampled": body.get("temperature", 0) > 0}
    with verdict.container():
        show_verdict(result)
    return result


def show_result(result: dict[str, Any]) -> None:
    """Redraw a finished result (reruns of the page keep the last answer on screen)."""
    if result["kind"] == "single":
        show_generation(result["runs"][0])
        return
    show_verdict(result)
    for column, title, gen in zip(st.columns(2), ["Speculative", "Plain (target alone)"], result["runs"],
                                  strict=True):
        with column:
            st.subheader(title)
            show_generation(gen, compact=True)


def show_verdict(result: dict[str, Any]) -> None:
    speculative, plain = result["runs"]
    if speculative.error or plain.error or speculative.done is None or plain.done is None:
        st.error("The comparison is incomplete: one of the runs failed (see below).")
        return
    c: Comparison = compare(speculative, plain)
    a, b = speculative.summary(), plain.summary()
    cols = st.columns(4)
    cols[0].metric("Speedup", f"{c.speedup:.2f}×" if c.speedup else "n/a",
                   help="Speculative tokens/s divided by plain tokens/s.")
    cols[1].metric("Tokens/s, speculative", f"{a.tokens_per_second:.1f}")
    cols[2].metric("Tokens/s, plain", f"{b.tokens_per_second:.1f}")
    cols[3].metric("Identical output", "yes" if c.identical else "no")
    if c.identical:
        st.success(f"Identical output: all {c.speculative_tokens} token ids match.")
    else:
        note = (" With temperature > 0 both runs sample the target's distribution, so they may differ."
                if result.get("sampled") else "")
        st.warning(f"The outputs differ from token {c.first_difference + 1} on "
                   f"({c.speculative_tokens} speculative tokens, {c.plain_tokens} plain).{note}")


def show_generation(gen: Generation, compact: bool = False, live: bool = False) -> None:
    """Tokens with provenance, the summary row, the charts and the per-iteration table."""
    if gen.error:
        (st.warning if gen.error_level == "warning" else st.error)(gen.error)
        if not gen.steps:
            return
    s = gen.summary()
    if live:
        st.caption(f":material/hourglass_top: generating: {s.tokens} tokens in {s.iterations} iterations")
    elif gen.done is not None:
        fallbacks = int(gen.done.get("stats", {}).get("draft_fallbacks", 0))
        st.caption(f"{s.tokens} tokens in {s.iterations} iterations · finish: {gen.done.get('finish_reason', '?')}"
                   f" · mode {gen.done.get('mode', gen.mode)} · controller {gen.done.get('controller', '?')}"
                   f" · prompt {gen.done.get('prompt_tokens', '?')} tokens · first token {s.first_token_ms:.0f} ms"
                   + (f" · draft failed on {fallbacks} step{'s' if fallbacks > 1 else ''}" if fallbacks else ""))
    st.html(tokens_html(gen.steps))

    speculative = gen.mode == "speculative"
    row = st.columns(3)
    row[0].metric("Acceptance rate", f"{s.acceptance_rate:.0%}" if speculative and s.draft_tokens else "n/a",
                  help=f"{s.accepted_tokens} of {s.draft_tokens} draft tokens accepted.")
    row[1].metric("Accepted / iteration", f"{s.mean_accepted_per_iteration:.2f}",
                  help=f"Mean accepted draft tokens per target pass; {s.tokens} tokens in {s.iterations} passes.")
    row[2].metric("Tokens/s", f"{s.tokens_per_second:.1f}", help=f"{s.tokens} tokens in {s.elapsed_ms:.0f} ms.")
    row = st.columns(3)
    for column, part, label in zip(row, ["draft", "verify", "overhead"], ["Draft time", "Verify time", "Overhead"],
                                   strict=True):
        ms = getattr(s, f"{part}_ms")
        detail = f"{s.share(part):.0%} of the time (draft / verify / overhead)."
        if part != "overhead":
            compute = getattr(s, f"{part}_compute_ms")
            detail += f" {compute:.0f} ms computing in the service, {max(ms - compute, 0):.0f} ms in the round trip."
        column.metric(label, f"{ms:.0f} ms", help=detail)
    st.caption(f"Time split draft / verify / overhead: {s.share('draft'):.0%} / {s.share('verify'):.0%} / "
               f"{s.share('overhead'):.0%}")

    rows = iteration_rows(gen.steps)
    if not rows:
        return
    frame = pd.DataFrame(rows)
    charts = [st.container()] * 2 if compact else st.columns(2)
    with charts[0]:
        st.markdown("**Draft length k and accepted tokens per iteration**")
        if speculative:
            st.line_chart(frame, x="iteration", y=["k", "accepted"], height=220, color=["#868e96", "#2b8a3e"])
        else:
            st.caption("No drafts: the target decodes alone, one token per iteration.")
    with charts[1]:
        st.markdown("**Tokens/s so far**")
        st.line_chart(frame, x="iteration", y="tokens_per_s", height=220, color="#1971c2")
    if not live:
        with st.expander("Per-iteration data"):
            st.dataframe(frame, hide_index=True)
        with st.expander("Output text"):
            st.text(gen.text)



# ---- the Server tab ------------------------------------------------------------------------------

def server_view(client: OrchestratorClient) -> None:
    """The deployment live, from /v1/server; reruns by itself every SERVER_REFRESH_S."""
    try:
        snapshot = client.server()
    except Rejected as exc:
        if exc.status == 404:
            st.warning(NO_SERVER_ROUTE)
        else:
            (st.warning if exc.status == 503 else st.error)(str(exc))
        return
    except OrchestratorError as exc:
        st.error(str(exc))
        return
    history = append_history(st.session_state.get("server_history", []), time.time(), snapshot)
    st.session_state["server_history"] = history
    if not snapshot.get("ready", False):
        st.warning(f"The orchestrator is up but not ready: {snapshot.get('reason') or 'no reason given'}.")

    window = float(snapshot.get("window_s") or 0.0)
    totals = snapshot.get("totals") or {}
    cols = st.columns(5)
    cols[0].metric("Active streams", f"{snapshot.get('active_streams', 0)} / {snapshot.get('max_concurrent_requests', '?')}",
                   help="Generations in progress, and how many may run at once before requests get HTTP 429.")
    cols[1].metric("Tokens/s", fmt(snapshot.get("tokens_per_second")),
                   help="Tokens generated per second across all requests, over the window.")
    cols[2].metric("Requests/s", fmt(snapshot.get("requests_per_second"), ".2f"),
                   help="Generations finished per second, over the window.")
    cols[3].metric("Acceptance rate", fmt(snapshot.get("acceptance_rate"), ".0%"),
                   help="Accepted draft tokens over drafted tokens, over the window. Since start: "
                        f"{fmt(totals.get('acceptance_rate'), '.0%')}.")
    cols[4].metric("Mean k", fmt(snapshot.get("mean_k"), ".2f"),
                   help="Mean draft length chosen per step (0 for plain steps), over the window.")
    st.caption(f"Rates over the last {window:.0f} s (n/a: nothing happened in it). Since the orchestrator started: "
               f"{totals.get('tokens', 0)} tokens, {totals.get('requests', 0)} generations, "
               f"{totals.get('steps', 0)} target passes.")

    left, right = st.columns(2)
    with left:
        st.markdown("**Tokens/s, last 5 minutes**")
        frame = pd.DataFrame(history)
        frame["seconds"] = (frame["t"] - history[-1]["t"]).round(1)  # 0 is now: no clock-time axis to read
        st.line_chart(frame, x="seconds", y="tokens_per_s", height=240, color="#1971c2",
                      x_label="seconds (0 = now)", y_label="tokens/s")
    with right:
        st.markdown("**Acceptance by draft position**")
        rows = position_rows(snapshot)
        if rows:
            st.bar_chart(pd.DataFrame(rows), x="position", y=["recent", "since start"], stack=False, height=240,
                         color=["#2b8a3e", "#adb5bd"], x_label="draft position (1 = first drafted token)",
                         y_label="accepted share")
            st.caption("Share of verified drafts whose token at that position was accepted: recent (the window) "
                       "and since the orchestrator started.")
        else:
            st.caption("No draft token accepted yet.")

    st.subheader("Model services")
    services = snapshot.get("services") or {}
    for column, name in zip(st.columns(2), ("target", "draft"), strict=True):
        with column:
            service_panel(service_figures(name, services.get(name) or {}))


def service_panel(f: ServiceFigures) -> None:
    icon = ":green[:material/check_circle:]" if f.up else ":red[:material/error:]"
    st.markdown(f"{icon} **{f.name}**: {f.headline}")
    if not f.up:
        return
    row = st.columns(3)
    row[0].metric("Batch size", f.batch_sessions, help="Mean sessions per batched forward pass, over the window.")
    row[1].metric("Rows / forward", f.batch_rows,
                  help="Mean token rows per forward pass (new tokens across its sessions), over the window.")
    row[2].metric("Forwards/s", f.forwards_per_second, help="Batched forward passes per second, over the window.")
    row = st.columns(3)
    row[0].metric("Queue", f.queue, help="Calls waiting for or in compute now / most that may wait.")
    row[1].metric("Queue wait", f.queue_wait, help="Mean time from a call's arrival to its first forward pass.")
    row[2].metric("Sessions", f.sessions, help="Sessions held in the KV cache.")
    st.progress(f.busy, text=f.busy_text)
    st.progress(f.kv, text=f.kv_text)
    if not f.reported:
        st.caption("This service reports no scheduler counters: batch, queue and busy figures are n/a.")


main()
