"""The round-trip benchmark (evaluation/rtt.py): its pure parts, then one short real run on tiny models
with the draft in a network namespace behind the delay proxy."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from evaluation.prompts import Prompt
from evaluation.rtt import (
    MODES,
    Namespace,
    check_equality,
    main,
    namespace_exists,
    parse_args,
    render_markdown,
    render_table,
    request_body,
    service_env,
    summarise,
)
from tests.support import make_gpt2

# ---- argument parsing -------------------------------------------------------------------------------


def test_defaults():
    args = parse_args([])
    assert args.rtt_ms == [0, 1, 5, 20] and args.prompts == 4 and args.max_tokens == 96
    assert args.modes == list(MODES) and args.out is None and not args.no_namespace
    assert service_env(args) == ({}, {})  # the services' embedded defaults: nothing passed


def test_options():
    args = parse_args(["--rtt-ms", "0,2.5,40", "--prompts", "2", "--max-tokens", "8", "--modes",
                       "autoregressive,overlapped-k4", "--target", "t", "--draft", "d", "--draft-backend", "transformers",
                       "--no-namespace", "--out", "x"])
    assert args.rtt_ms == [0, 2.5, 40] and args.modes == ["autoregressive", "overlapped-k4"] and args.no_namespace
    assert service_env(args) == ({"SPECDEC_TARGET_MODEL": "t"},
                                 {"SPECDEC_DRAFT_MODEL": "d", "SPECDEC_DRAFT_BACKEND": "transformers"})
    assert service_env(parse_args(["--draft-backend", "ngram"])) == ({}, {"SPECDEC_DRAFT_BACKEND": "ngram"})


@pytest.mark.parametrize("bad", [["--rtt-ms", "-1"], ["--rtt-ms", ""], ["--rtt-ms", "a"], ["--modes", "beam"],
                                 ["--modes", ""], ["--modes", "overlapped-k4,overlapped-k4"], ["--prompts", "0"],
                                 ["--draft-backend", "onnx"]])
def test_bad_arguments(bad):
    with pytest.raises(SystemExit):
        parse_args(bad)


def test_request_bodies():
    raw, chat = Prompt("a", "story", False, "once"), Prompt("b", "chat_qa", True, "hi?")
    assert request_body(raw, "autoregressive", 8) == {"max_tokens": 8, "ignore_eos": True, "temperature": 0,
                                                      "mode": "autoregressive", "prompt": "once"}
    body = request_body(chat, "overlapped-k4", 8)
    assert body["messages"] == [{"role": "user", "content": "hi?"}] and "prompt" not in body
    assert (body["controller"], body["k"], body["overlap"]) == ("fixed", 4, True)
    assert request_body(raw, "alternating-cost", 8)["overlap"] is False


# ---- summary, ratios and rendering from hand-made rows ----------------------------------------------


def row(rtt: float, mode: str, prompt: str, tps: float, ids: list[int], **kw) -> dict:
    r = {"rtt_ms": rtt, "mode": mode, "prompt_id": prompt, "repeat": 0, "tokens": 10, "elapsed_ms": 10_000 / tps,
         "tokens_per_second": tps, "iterations": 10, "draft_tokens": 0, "accepted_tokens": 0,
         "draft_ms_per_iteration": 0.0, "verify_ms_per_iteration": 5.0, "overhead_ms_per_iteration": 1.0,
         "predrafted_iterations": 0, "steps": 10, "mean_k": 0.0, "token_ids": ids}
    return {**r, **kw}


def hand_made() -> tuple[list[dict], list[dict]]:
    ids = [1, 2, 3]
    rows = [
        # RTT 0: AR 10 and 20 tok/s; alternating 15 and 60 (ratios 1.5, 3); overlapped 20, 20 (2, 1)
        row(0, "autoregressive", "p1", 10, ids), row(0, "autoregressive", "p2", 20, ids),
        row(0, "alternating-k4", "p1", 15, ids, iterations=4, draft_tokens=16, accepted_tokens=8, mean_k=4.0, steps=4),
        row(0, "alternating-k4", "p2", 60, ids, iterations=6, draft_tokens=24, accepted_tokens=4, mean_k=4.0, steps=6),
        row(0, "overlapped-k4", "p1", 20, ids, predrafted_iterations=3, mean_k=2.0, steps=2),
        row(0, "overlapped-k4", "p2", 20, [1, 2, 4], predrafted_iterations=1, mean_k=5.0, steps=8),
        # RTT 20: one prompt only
        row(20, "autoregressive", "p1", 10, ids), row(20, "alternating-k4", "p1", 5, [1, 2]),
    ]
    rtts = [{"nominal_ms": 0, "added_ms": 0.4}, {"nominal_ms": 20, "added_ms": 20.7}]
    return rows, rtts


def test_equality_check_against_autoregressive_at_the_same_rtt():
    rows, _ = hand_made()
    mismatches = check_equality(rows)
    assert mismatches == [{"rtt_ms": 0, "mode": "overlapped-k4", "prompt_id": "p2", "first_mismatch": 2},
                          {"rtt_ms": 20, "mode": "alternating-k4", "prompt_id": "p1", "first_mismatch": 2}]
    assert all("token_ids" not in r for r in rows)
    assert [r["identical"] for r in rows] == [None, None, True, True, True, False, None, False]
    # no autoregressive run: nothing to compare with
    lone = [row(0, "overlapped-k4", "p1", 20, [1])]
    assert check_equality(lone) == [] and lone[0]["identical"] is None


def test_summary_ratios_and_means():
    rows, rtts = hand_made()
    check_equality(rows)
    summary = summarise(rows, rtts, ["autoregressive", "alternating-k4", "overlapped-k4", "alternating-cost"])
    by = {(s["rtt_ms"], s["mode"]): s for s in summary}
    assert list(by) == [(0, "autoregressive"), (0, "alternating-k4"), (0, "overlapped-k4"),
                        (20, "autoregressive"), (20, "alternating-k4")]  # modes without runs are left out
    ar, alt, ovl = by[(0, "autoregressive")], by[(0, "alternating-k4")], by[(0, "overlapped-k4")]
    assert ar["tokens_per_second"]["median"] == pytest.approx(15) and ar["vs_autoregressive"] is None
    assert ar["mean_k"] is None and ar["measured_rtt_ms"] == 0.4
    # ratio of medians 37.5 / 15 = 2.5; median of the per-prompt ratios (1.5, 3) = 2.25: not the same thing
    assert alt["vs_autoregressive"]["ratio_of_medians"] == pytest.approx(2.5)
    assert alt["vs_autoregressive"]["median_of_ratios"] == pytest.approx(2.25)
    assert alt["vs_autoregressive"]["per_prompt"]["n"] == 2
    assert alt["mean_k"] == pytest.approx(4.0) and alt["acceptance_rate"] == pytest.approx(12 / 40)
    assert alt["tokens_per_iteration"] == pytest.approx(20 / 10) and alt["predrafted_share"] == 0
    assert (alt["compared"], alt["mismatches"]) == (2, 0)
    assert ovl["vs_autoregressive"]["ratio_of_medians"] == pytest.approx(20 / 15)
    assert ovl["vs_autoregressive"]["median_of_ratios"] == pytest.approx(1.5)
    assert ovl["mean_k"] == pytest.approx((2 * 2 + 5 * 8) / 10)  # weighted by steps
    assert ovl["predrafted_share"] == pytest.approx(4 / 20) and ovl["acceptance_rate"] is None
    assert (ovl["compared"], ovl["mismatches"]) == (2, 1)
    late = by[(20, "alternating-k4")]
    assert late["measured_rtt_ms"] == 20.7 and late["vs_autoregressive"]["ratio_of_medians"] == pytest.approx(0.5)
    assert late["vs_autoregressive"]["median_of_ratios"] == pytest.approx(0.5)
    # without an autoregressive baseline there is no ratio
    alone = summarise([r for r in rows if r["mode"] != "autoregressive"], rtts, ["alternating-k4"])
    assert all(s["vs_autoregressive"] is None for s in alone)


def test_table_and_markdown():
    rows, rtts = hand_made()
    mismatches = check_equality(rows)
    summary = summarise(rows, rtts, list(MODES))
    table = render_table(summary)
    lines = table.splitlines()
    assert len(lines) == 2 + len(summary)
    assert lines[0].startswith("| RTT (ms) | measured (ms) | mode | tok/s (median) | vs AR (ratio of medians) |")
    assert "| 0 | 0.4 | alternating-k4 | 37.5 | 2.50× | 2.25× | 4.00 | 30% | 0% |" in table
    assert "| 0 | 0.4 | overlapped-k4 | 20.0 | 1.33× | 1.50× | 4.40 | – | 20% | 0.0 / 5.0 | 1/2 |" in table
    assert "| 0 | 0.4 | autoregressive | 15.0 | – | – | – | – | – | 0.0 / 5.0 | – |" in table
    assert "| 20 | 20.7 | alternating-k4 | 5.0 | 0.50× | 0.50× |" in table
    machine = {"cores": 2, "cpu": "x", "ram_gb": 1, "load_average_start": [1, 1, 1], "load_average_end": [2, 2, 2]}
    results = {"started": "now", "command": "python -m evaluation.rtt", "machine": machine, "namespace": True,
               "namespace_name": "specdec-rtt-1", "services": {"target": {"model_id": "t"}, "draft": {"model_id": "d"}},
               "prompts": ["p1", "p2"], "settings": {"max_tokens": 8}, "duration_s": 60, "summary": summary,
               "mismatches": mismatches}
    md = render_markdown(results)
    assert table in md and "specdec-rtt-1" in md and "| 20 | alternating-k4 | p1 | 2 |" in md
    clean = render_markdown({**results, "namespace": False, "mismatches": []})
    assert "on loopback" in clean and "Every speculative run produced exactly" in clean


def test_namespace_needs_root_and_fits_interface_names(monkeypatch):
    ns = Namespace(4194304)  # the largest pid Linux hands out
    assert ns.name == "specdec-rtt-4194304" and len(ns.host_if) <= 15 and len(ns.ns_if) <= 15 and ns.host_if != ns.ns_if
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError):
        ns.up()  # main() logs it and runs the draft on loopback
    assert not ns.created
    ns.down()  # nothing made, nothing to remove


# ---- a real run ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rtt_benchmark_end_to_end_on_tiny_models(tmp_path, monkeypatch):
    """Tiny models, RTT 0 and 20 ms, one prompt, 64 tokens: the proxy adds the round trip it should,
    every speculative mode matches autoregressive decoding, and the namespace is gone afterwards.
    The models hold 256 positions: a request's first steps run plainly while the draft catches up on
    the prompt in the background, and over 20 ms that took ~15 tiny-model steps, longer than the
    ~20 tokens the fixtures' 96-position models leave after the prompt."""
    monkeypatch.setenv("SPECDEC_TARGET_THREADS", "1")
    monkeypatch.setenv("SPECDEC_DRAFT_THREADS", "1")
    out = tmp_path / "out"
    target, draft = make_gpt2(tmp_path / "target", 0, positions=256), make_gpt2(tmp_path / "draft", 1, positions=256)
    argv = ["--target", target, "--draft", draft, "--draft-backend", "transformers",
            "--rtt-ms", "0,20", "--prompts", "1", "--max-tokens", "64", "--out", str(out)]
    assert main(argv) == 0

    results = json.loads((out / "rtt.json").read_text())
    assert (out / "rtt.md").read_text().count("\n| ") == len(results["summary"]) + 1
    assert results["mismatches"] == [] and all(s["mismatches"] == 0 for s in results["summary"])
    assert sum(s["compared"] for s in results["summary"]) == (len(MODES) - 1) * 2  # speculative modes x RTTs
    added = {m["nominal_ms"]: m["added_ms"] for m in results["rtts"]}
    assert added[20] >= 15 and added[0] < 10, added
    assert {(s["rtt_ms"], s["mode"]) for s in results["summary"]} == {(r, m) for r in (0, 20) for m in MODES}
    assert len(results["rows"]) == 2 * len(MODES)
    for r in results["rows"]:
        assert r["tokens"] == 64 and r["tokens_per_second"] > 0 and r["draft_fallbacks"] == 0, r
        if r["mode"] == "autoregressive":
            assert r["mean_k"] == 0 and r["predrafted_iterations"] == 0
        elif r["mode"].endswith("-k4"):
            assert r["mean_k"] > 0  # fixed k (the cost controller may well choose k = 0 on tiny models)
    for s in results["summary"]:
        if s["mode"] != "autoregressive":
            assert s["vs_autoregressive"]["ratio_of_medians"] > 0 and not math.isnan(s["vs_autoregressive"]["median_of_ratios"])
    # the draft's round trip shows in its calls: a drafting step (alternating, fixed k) waits one RTT
    # at least (the first steps run plainly while the draft catches up on the prompt in the background)
    def per_drafted_step(r):
        drafted = sum(1 for k in r["k_sequence"] if k > 0)
        assert drafted >= 1, r["k_sequence"]
        return r["draft_ms_per_iteration"] * r["iterations"] / drafted

    slow = {r["rtt_ms"]: per_drafted_step(r) for r in results["rows"] if r["mode"] == "alternating-k4"}
    assert slow[20] >= slow[0] + 15, slow
    if os.geteuid() == 0:
        assert results["namespace"] is True and results["namespace_error"] is None
        assert results["draft_address"].startswith("10.231.0.2:")
        assert not namespace_exists(results["namespace_name"])
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"srtt{os.getpid()}h" not in links
    else:
        assert results["namespace"] is False and results["namespace_error"]
