"""The dashboard in a real browser against the real stack on the embedded default: type a prompt,
watch the answer arrive, check each token's provenance is styled distinctly and the numbers show;
then watch the Server tab while a generation runs.

Needs Debian's chromium at /usr/bin/chromium (playwright drives it; it never downloads a browser).
The screenshots are kept in the tests' tmp dirs (SPECDEC_UPDATE_DOCS=1 copies them to docs/dashboard.png
and docs/server.png).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, Proc, free_port, wait_http

CHROMIUM = Path("/usr/bin/chromium")
ANSWER_TIMEOUT_MS = 180_000  # another process may be using both cores
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.browser, pytest.mark.embedded]


@pytest.fixture(scope="module", autouse=True)
def chromium():
    """The browser tests run, or fail saying how to make them run: never skipped unasked (a green
    suite without them would hide a broken dashboard). SPECDEC_SKIP_BROWSER=1 skips them on purpose."""
    if CHROMIUM.exists():
        return
    if os.environ.get("SPECDEC_SKIP_BROWSER") == "1":
        pytest.skip("SPECDEC_SKIP_BROWSER=1")
    pytest.fail("the dashboard's browser tests need Debian's chromium at /usr/bin/chromium: install it with "
                "`sudo apt-get install -y chromium` (or run with SPECDEC_SKIP_BROWSER=1 to leave them out)",
                pytrace=False)


@pytest.fixture(scope="module")
def dashboard(embedded_stack, tmp_path_factory):
    """``python -m ui`` watching the embedded stack's orchestrator; yields its URL."""
    port = free_port()
    log_dir = tmp_path_factory.mktemp("ui-logs")
    proc = Proc("ui", "ui", {"SPECDEC_UI_ORCHESTRATOR_URL": embedded_stack["url"], "SPECDEC_UI_PORT": str(port)},
                log_dir)
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", proc, timeout_s=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def test_dashboard_shows_speculation(dashboard, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(dashboard)
            sidebar = page.get_by_test_id("stSidebar")
            # the service panel has asked the orchestrator, which is ready
            expect(sidebar.get_by_text("orchestrator: ready")).to_be_visible()
            expect(sidebar.get_by_text("draft: up")).to_be_visible()

            # a fixed k drafts on every step, whatever the cost controller would make of a busy machine
            sidebar.get_by_test_id("stSelectbox").click()
            page.get_by_role("option", name="fixed").click()
            expect(sidebar.get_by_role("combobox", name="k controller")).to_have_value("fixed")
            max_tokens = sidebar.get_by_label("Max tokens")
            max_tokens.fill("40")
            max_tokens.press("Enter")
            expect(max_tokens).to_have_value("40")
            page.get_by_role("textbox", name="Prompt").fill("The three primary colors are")
            # count redraws that show tokens while the answer is still being generated
            page.evaluate("""() => {
                window.liveRedraws = 0;
                new MutationObserver(() => {
                    if (document.querySelector('.tok-stream .tok') && document.body.innerText.includes('generating:'))
                        window.liveRedraws++;
                }).observe(document.body, {subtree: true, childList: true, characterData: true});
            }""")
            page.get_by_role("button", name="Generate", exact=True).click()

            # the finished answer has its table of iterations; live redraws do not
            expect(page.get_by_text("Per-iteration data")).to_be_visible(timeout=ANSWER_TIMEOUT_MS)
            stream = page.locator(".tok-stream").last
            accepted = stream.locator(".tok.tok-accepted")
            target_own = stream.locator(".tok.tok-correction, .tok.tok-bonus")
            assert page.evaluate("window.liveRedraws") > 0, "the answer did not stream in"
            assert accepted.count() > 0, stream.inner_html()
            assert target_own.count() > 0, stream.inner_html()

            def colours(locator) -> tuple[str, str]:
                return tuple(locator.evaluate("e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).color]"))

            seen = {"accepted": colours(accepted.first)}
            for kind in ("correction", "bonus", "rejected", "plain"):
                spans = stream.locator(f".tok.tok-{kind}")
                if spans.count():
                    seen[kind] = colours(spans.first)
            # legend samples exist for every kind, so all five styles can be compared
            for kind in ("accepted", "rejected", "correction", "bonus", "plain"):
                seen[f"legend-{kind}"] = colours(page.locator(f".tok-legend .tok-{kind}").first)
            assert len({seen[f"legend-{k}"] for k in ("accepted", "rejected", "correction", "bonus", "plain")}) == 5
            assert seen["accepted"] == seen["legend-accepted"]
            assert all(seen[k] != seen["accepted"] for k in seen if not k.endswith("accepted"))
            decoration = page.locator(".tok-legend .tok-rejected").evaluate(
                "e => getComputedStyle(e).textDecorationLine")
            assert "line-through" in decoration
            assert "draft confidence" in accepted.first.get_attribute("title")
            assert "target probability" in target_own.first.get_attribute("title")

            # the summary row and both charts
            labels = page.get_by_test_id("stMetricLabel").all_inner_texts()
            for label in ("Acceptance rate", "Accepted / iteration", "Tokens/s", "Draft time", "Verify time",
                          "Overhead"):
                assert any(label in text for text in labels), labels
            values = dict(zip(labels, page.get_by_test_id("stMetricValue").all_inner_texts(), strict=True))
            assert float(next(v for k, v in values.items() if "Tokens/s" in k)) > 0
            assert values[next(k for k in values if "Acceptance rate" in k)].endswith("%")
            expect(page.get_by_text("finish: length")).to_be_visible()
            charts = page.get_by_test_id("stVegaLiteChart")
            expect(charts.nth(1)).to_be_visible()
            # Kept in the test's tmp dir (and under $SPECDEC_ARTIFACTS_DIR when set, e.g. by CI);
            # SPECDEC_UPDATE_DOCS=1 refreshes docs/dashboard.png.
            fit_and_keep(page, tmp_path / "dashboard.png")
        finally:
            browser.close()


def fit_and_keep(page, shot: Path) -> None:
    """Grow the window to the whole page (it scrolls inside its main section), take the screenshot,
    keep it under $SPECDEC_ARTIFACTS_DIR when set, and in docs/ with SPECDEC_UPDATE_DOCS=1."""
    height = page.evaluate("""() => Math.max(...['stMain', 'stSidebarContent'].map(
        id => document.querySelector(`[data-testid=${id}]`)?.scrollHeight || 0))""")
    page.set_viewport_size({"width": 1440, "height": max(1000, min(height + 40, 4000))})
    # the charts redraw at the new size: wait until the layout and every chart's drawing hold still
    # between two looks
    page.wait_for_function("""() => {
        const boxes = [...document.querySelectorAll('[data-testid=stVegaLiteChart]')].map(chart => {
            const drawn = chart.querySelector('canvas, svg');
            return [chart, drawn].map(e => e ? `${e.clientWidth}x${e.clientHeight}` : '-').join('/');
        });
        const now = boxes.join() + '|' + document.querySelector('[data-testid=stMain]')?.scrollHeight;
        const still = window.layoutSeen === now;
        window.layoutSeen = now;
        return still;
    }""", polling=250, timeout=10_000)
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("SPECDEC_ARTIFACTS_DIR"):
        artifacts = Path(os.environ["SPECDEC_ARTIFACTS_DIR"])
        artifacts.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, artifacts / shot.name)
    if os.environ.get("SPECDEC_UPDATE_DOCS") == "1":
        shutil.copyfile(shot, ROOT / "docs" / shot.name)


def test_server_tab_while_generating(dashboard, embedded_stack, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    done = threading.Event()

    def generate() -> None:
        # one stream after another until the tab has been checked: a lone 160-token answer can end
        # between two of the tab's refreshes on a fast machine
        while not done.is_set():
            httpx.post(embedded_stack["url"] + "/v1/generate", timeout=ANSWER_TIMEOUT_MS / 1e3, json={
                "prompt": "List the planets of the solar system, one line each, with one fact about each.",
                "max_tokens": 160, "ignore_eos": True, "controller": "fixed", "k": 4})  # drafts on every step

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        load = threading.Thread(target=generate, daemon=True)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(dashboard + "/?view=Server")  # the tab is bound to the URL
            expect(page.get_by_role("tab", name="Server", selected=True)).to_be_visible()
            expect(page.get_by_text("Model services")).to_be_visible()
            load.start()
            metric = page.get_by_test_id("stMetric")
            streams = metric.filter(has_text="Active streams").get_by_test_id("stMetricValue")
            expect(streams).to_have_text("1 / 64", timeout=ANSWER_TIMEOUT_MS)
            page.wait_for_function("""() => {
                const m = [...document.querySelectorAll('[data-testid=stMetric]')].find(e => e.innerText.includes('Tokens/s'));
                return parseFloat(m?.querySelector('[data-testid=stMetricValue]')?.innerText) > 0;
            }""", timeout=ANSWER_TIMEOUT_MS)
            main = page.get_by_test_id("stMain")
            for name in ("target", "draft"):  # up: model · backend · device
                expect(main.get_by_text(re.compile(rf"{name}: .+ · "))).to_be_visible()
            expect(page.get_by_test_id("stProgress").first).to_be_visible()
            expect(page.get_by_test_id("stVegaLiteChart").nth(1)).to_be_visible()  # acceptance by position
            fit_and_keep(page, tmp_path / "server.png")
        finally:
            done.set()
            browser.close()
            load.join(ANSWER_TIMEOUT_MS / 1e3)
