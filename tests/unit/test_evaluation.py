"""The benchmark harness's pure parts: prompt suite, statistics and ideal-speedup math, Markdown
rendering and results files, mode selection, and the mismatch explanation on a tiny model; the
in-process cost tools on the embedded pair. No timing assertions."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from evaluation import report
from evaluation.bench import draft_positions, parse_args, position_counts, render_markdown, render_positions
from evaluation.modes import ExtraDraft, all_modes, parse_extra_draft, pick_modes, rotation
from evaluation.prompts import CATEGORIES, Prompt, load_suite, select, suite_digest
from evaluation.stats import (
    acceptance_by_category,
    ideal_speedup,
    paired_speedup,
    percentile,
    spread,
    summarise,
    time_split,
)
from tests.support import step_json

# ---- prompt suite --------------------------------------------------------------------------------

def test_suite_has_at_least_30_prompts_over_all_six_categories():
    prompts = load_suite()
    assert len(prompts) >= 30
    assert {p.category for p in prompts} == set(CATEGORIES)
    assert len({p.id for p in prompts}) == len(prompts)
    assert any(p.chat for p in prompts) and any(not p.chat for p in prompts)
    assert len(suite_digest()) == 12


def test_suite_rejects_malformed_lines(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"id": "a", "category": "poetry", "chat": True, "text": "x"}) + "\n")
    with pytest.raises(ValueError, match="unknown category"):
        load_suite(bad)
    bad.write_text('{"id": "a"}\n')
    with pytest.raises(ValueError, match=":1:"):
        load_suite(bad)


def test_subset_is_round_robin_over_categories_and_keeps_file_order():
    prompts = load_suite()
    six = select(prompts, 6)
    assert {p.category for p in six} == set(CATEGORIES)
    assert [p.id for p in six] == [p.id for p in prompts if p in six]
    assert {p.category for p in select(prompts, None, ["code"])} == {"code"}
    with pytest.raises(ValueError, match="unknown categories"):
        select(prompts, 3, ["poetry"])


# ---- statistics -----------------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 90) == 10
    assert percentile([0, 10], 10) == pytest.approx(1.0)
    assert math.isnan(percentile([], 50))
    s = spread([3, 1, 2])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2, 1, 3, 3)


def test_ideal_speedup_on_hand_made_numbers():
    # 3 tokens per iteration; plain decoding 40 ms/token; an iteration costs 20 ms draft + 60 ms verify
    assert ideal_speedup(3.0, 40.0, 20.0, 60.0) == pytest.approx(1.5)
    # no speculation: one token per 40 ms iteration is exactly plain decoding
    assert ideal_speedup(1.0, 40.0, 0.0, 40.0) == pytest.approx(1.0)
    assert math.isnan(ideal_speedup(2.0, 40.0, 0.0, 0.0))


def _stats(tokens, iterations, draft_tokens, accepted, draft_ms, draft_c, verify_ms, verify_c, loop):
    return {"tokens": tokens, "iterations": iterations, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "draft_ms": draft_ms, "draft_compute_ms": draft_c, "verify_ms": verify_ms, "verify_compute_ms": verify_c,
            "overhead_ms": loop, "elapsed_ms": draft_ms + verify_ms + loop, "draft_fallbacks": 0}


def test_time_split_aggregates_before_dividing():
    split = time_split([_stats(30, 10, 40, 20, 250, 200, 650, 600, 10),
                        _stats(10, 10, 0, 0, 0, 0, 420, 400, 10)])
    assert split["tokens_per_iteration"] == pytest.approx(2.0)
    assert split["acceptance_rate"] == pytest.approx(0.5)
    assert split["accepted_per_iteration"] == pytest.approx(1.0)
    assert split["draft_compute_ms_per_iteration"] == pytest.approx(10.0)
    assert split["draft_rpc_ms_per_iteration"] == pytest.approx(2.5)
    assert split["verify_rpc_ms_per_iteration"] == pytest.approx(3.5)
    assert split["loop_ms_per_token"] == pytest.approx(0.5)


def _run(mode, prompt, tokens, elapsed_ms, stats=None, identical=True, category="code"):
    r = {"mode": mode, "prompt_id": prompt, "category": category, "repeat": 0, "tokens": tokens,
         "elapsed_ms": elapsed_ms, "token_ids": [], "identical": identical}
    if stats is not None:
        r.update(stats=stats, mean_k=4.0, wall_ms=elapsed_ms + 5)
    return r


def test_summary_speedups_ideal_and_fraction():
    ar = _stats(100, 100, 0, 0, 0, 0, 4200, 4000, 100)  # 40 ms compute per token
    # 25 iterations of 4 tokens: draft 20 ms + verify 60 ms compute each -> ideal 4 * 40 / 80 = 2.0
    sd = _stats(100, 25, 100, 75, 600, 500, 1600, 1500, 50)
    runs = [
        _run("hf-plain", "p1", 100, 4000), _run("hf-plain", "p2", 100, 5000),
        _run("hf-assisted", "p1", 100, 8000, identical=False), _run("hf-assisted", "p2", 100, 8000),
        _run("hf-prompt-lookup", "p1", 100, 3000), _run("hf-prompt-lookup", "p2", 100, 3000),
        _run("sd-autoregressive", "p1", 100, 4300, ar), _run("sd-autoregressive", "p2", 100, 4300, ar),
        _run("sd-fixed-k4", "p1", 100, 2150, sd), _run("sd-fixed-k4", "p2", 100, 2150, sd),
    ]
    s = summarise(runs, ["hf-plain", "hf-assisted", "hf-prompt-lookup", "sd-autoregressive", "sd-fixed-k4"],
                  assisted=["hf-assisted", "hf-prompt-lookup"])
    k4 = s["sd-fixed-k4"]
    assert k4["tokens_per_second"]["median"] == pytest.approx(100 / 2.15)
    assert k4["ideal_speedup"] == pytest.approx(2.0)
    assert k4["vs_autoregressive"]["median"] == pytest.approx(2.0)
    assert k4["fraction_of_ideal"] == pytest.approx(1.0)
    assert k4["compute_share"] == pytest.approx(2000 / 2250)  # compute over draft + verify + loop time
    assert k4["best_assisted"] == "hf-prompt-lookup"
    assert k4["vs_assisted"]["median"] == pytest.approx(3000 / 2150)
    # paired by prompt: 4000/2150 and 5000/2150, median of the two ratios
    assert k4["vs_plain"]["median"] == pytest.approx((4000 + 5000) / 2 / 2150)
    assert "ideal_speedup" not in s["sd-autoregressive"]  # no drafts, nothing to idealise
    assert s["hf-assisted"]["identical"] == 1 and s["hf-assisted"]["compared"] == 2
    assert "split" not in s["hf-plain"]


def test_overlapped_ideal_counts_only_the_draft_time_waited_for():
    ar = _stats(100, 100, 0, 0, 0, 0, 4200, 4000, 100)  # 40 ms compute per token
    # 25 iterations of 4 tokens: 20 ms of draft compute each, but the steps waited only 4 ms for drafts
    ov = dict(_stats(100, 25, 100, 75, 100, 500, 1600, 1500, 50), predrafted_iterations=20)
    alt = _stats(100, 25, 100, 75, 600, 500, 1600, 1500, 50)
    runs = [_run("sd-autoregressive", "p1", 100, 4300, ar), _run("ov", "p1", 100, 1750, ov), _run("alt", "p1", 100, 2150, alt)]
    s = summarise(runs, ["sd-autoregressive", "ov", "alt"])
    assert s["ov"]["ideal_speedup"] == pytest.approx(4 * 40 / (4 + 60))
    split = s["ov"]["split"]
    assert (split["draft_compute_ms_per_iteration"], split["draft_rpc_ms_per_iteration"]) == (4.0, 0.0)
    assert split["draft_hidden_ms_per_iteration"] == pytest.approx(16.0)
    assert s["alt"]["split"]["draft_hidden_ms_per_iteration"] == 0.0
    assert s["alt"]["ideal_speedup"] == pytest.approx(4 * 40 / (20 + 60))


def test_paired_speedup_needs_pairs():
    runs = [_run("a", "p1", 10, 1000), _run("b", "p2", 10, 500)]
    assert paired_speedup(runs, "b", "a") is None


def test_acceptance_by_category():
    runs = [_run("m", "p1", 10, 100, _stats(10, 5, 10, 5, 0, 0, 0, 0, 0), category="code"),
            _run("m", "p2", 10, 100, _stats(10, 5, 10, 10, 0, 0, 0, 0, 0), category="code"),
            _run("m", "p3", 10, 100, _stats(10, 10, 0, 0, 0, 0, 0, 0, 0), category="story")]
    assert acceptance_by_category(runs, "m") == {"code": 0.75}


# ---- modes ----------------------------------------------------------------------------------------

def test_modes_cover_every_measurement_and_patterns_select():
    names = [m.name for m in all_modes()]
    assert {"hf-plain", "hf-assisted", "hf-prompt-lookup", "sd-autoregressive", "sd-acceptance", "sd-hf", "sd-cost",
            "ngram-cost"} <= set(names)
    assert [f"sd-fixed-k{k}" for k in (*range(1, 9), 12, 16)] == [n for n in names if n.startswith("sd-fixed-")]
    assert [m.name for m in pick_modes(["sd-fixed-k[12]", "hf-plain"])] == ["hf-plain", "sd-fixed-k1", "sd-fixed-k2"]
    with pytest.raises(SystemExit, match="match no mode"):
        pick_modes(["nope"])


def test_extra_draft_specs_parse_into_name_model_and_quant():
    assert parse_extra_draft("self-q4_0=target@q4_0") == ExtraDraft("self-q4_0", "target", "q4_0")
    assert parse_extra_draft("self=target") == ExtraDraft("self", "target", None)
    assert parse_extra_draft("big=HuggingFaceTB/SmolLM2-360M@Q8_0") == ExtraDraft("big", "HuggingFaceTB/SmolLM2-360M", "q8_0")
    assert parse_extra_draft("shipped=embedded").model == "embedded"
    assert parse_extra_draft("self-q8_0=target@q8_0").env("gpt2") == {
        "SPECDEC_DRAFT_BACKEND": "llamacpp", "SPECDEC_DRAFT_MODEL": "target", "SPECDEC_DRAFT_TARGET_MODEL": "gpt2",
        "SPECDEC_DRAFT_QUANT": "q8_0"}
    assert "SPECDEC_DRAFT_QUANT" not in parse_extra_draft("self=target").env("embedded")


@pytest.mark.parametrize(("value", "why"), [
    ("self", "expected NAME=SPEC"),
    ("self=", "expected NAME=SPEC"),
    ("=target", "not a simple slug"),
    ("Self=target", "not a simple slug"),
    ("self q4=target", "not a simple slug"),
    ("self-=target", "not a simple slug"),
    ("sd=target", "clashes"),
    ("sd-q4=target", "clashes"),
    ("ngram=target", "clashes"),
    ("main=target", "clashes"),
    ("self=target@q3_k", "unknown quantisation 'q3_k'"),
    ("self=@q8_0", "names no model"),
    ("self=embedded@q8_0", "not converted"),
    ("self=/models/d.gguf@q8_0", "not converted"),
])
def test_bad_extra_draft_specs_are_refused(value, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        parse_extra_draft(value)


def test_extra_draft_option_repeats_and_refuses_duplicates(capsys):
    args = parse_args(["--extra-draft", "a=target@q4_0", "--extra-draft", "b=target@q8_0"])
    assert [e.name for e in args.extra_draft] == ["a", "b"]
    assert parse_args([]).extra_draft == []
    for argv, why in ((["--extra-draft", "a=target", "--extra-draft", "a=target@q8_0"], "a given more than once"),
                      (["--extra-draft", "sd=target"], "argument --extra-draft: 'sd=target'"),
                      (["--extra-draft", "a=target", "--url", "http://x"], "does not combine with --url")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert why in capsys.readouterr().err


def test_extra_drafts_add_their_own_stacks_and_modes():
    extras = [parse_extra_draft("self-q4_0=target@q4_0"), parse_extra_draft("self-q8_0=target@q8_0")]
    modes = all_modes(extras)
    names = [m.name for m in modes]
    assert names[:len(all_modes())] == [m.name for m in all_modes()]  # the built-in modes come first, unchanged
    assert names[len(all_modes()):] == ["self-q4_0-fixed-k4", "self-q4_0-cost", "self-q8_0-fixed-k4", "self-q8_0-cost"]
    assert len(set(names)) == len(names)
    by_name = {m.name: m for m in modes}
    # the bodies of the main draft's modes, sent to the extra draft's own orchestrator
    assert by_name["self-q8_0-cost"].body == by_name["sd-cost"].body
    assert by_name["self-q8_0-fixed-k4"].body == by_name["sd-fixed-k4"].body
    assert {by_name["self-q8_0-cost"].stack, by_name["self-q4_0-fixed-k4"].stack} == {"self-q8_0", "self-q4_0"}
    chosen = pick_modes(["sd-cost", "self-q8_0-*"], extras)
    assert [m.name for m in chosen] == ["sd-cost", "self-q8_0-fixed-k4", "self-q8_0-cost"]
    with pytest.raises(SystemExit, match="match no mode"):
        pick_modes(["self-q8_0-*"])  # without the option its modes do not exist


def test_rotation_puts_every_mode_first_once():
    modes = ["a", "b", "c"]
    firsts = [rotation(modes, i)[0] for i in range(3)]
    assert sorted(firsts) == modes
    assert sorted(rotation(modes, 5)) == modes


# ---- Markdown ---------------------------------------------------------------------------------------

def test_markdown_table_escapes_and_aligns():
    table = report.markdown_table([{"a": "x|y", "b": 1.5}], [("name", lambda r: r["a"]),
                                                              ("value", lambda r: report.fmt(r["b"], 2))])
    lines = table.splitlines()
    assert lines[0] == "| name | value |"
    assert lines[1] == "|---|---:|"
    assert lines[2] == "| x\\|y | 1.50 |"
    assert report.fmt(float("nan")) == "–" and report.fmt(None) == "–" and report.fmt(3, suffix="×") == "3×"


def test_comma_separated_options():
    assert report.numbers("1,2,4", int) == [1, 2, 4] and report.numbers("") == []
    assert report.numbers("0,2.5", positive=False) == [0, 2.5]
    for text, why in (("a", "not a comma-separated list of float"), ("0", "positive"), ("-1", "positive")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            report.numbers(text)
    with pytest.raises(argparse.ArgumentTypeError, match="at least 0"):
        report.numbers("-1", positive=False)
    with pytest.raises(argparse.ArgumentTypeError, match="one or more"):
        report.numbers(" ,", empty=False)
    assert report.names("a,,b") == ["a", "b"]


def test_machine_line_names_the_machine_and_the_load():
    m = {"cores": 2, "cpu": "EPYC", "ram_gb": 8.0, "load_average_start": [1.0, 0.5, 0.25]}
    assert report.machine_line(m, "4 threads; ") == ("Machine: 2 cores, EPYC, 8.0 GB RAM; 4 threads; load average "
                                                    "1.0/0.5/0.2 at the start, – at the end.")
    info = report.machine_info(3)
    assert info["threads"] == 3 and info["cores"] >= 1 and len(info["load_average_start"]) == 3
    assert "threads" not in report.machine_info()


# ---- results files -----------------------------------------------------------------------------------


def test_write_results_writes_strict_json_with_non_finite_numbers_as_null(tmp_path):
    results = {"speedup": math.nan, "runs": [{"ms": math.inf, "k": (1, -math.inf, 2.5)}], "out": tmp_path, "ok": 1.5}
    path = report.write_results(tmp_path, results)
    assert path == tmp_path / "results.json"
    text = path.read_text()

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in the file")

    assert json.loads(text, parse_constant=no_constants) == {
        "speedup": None, "runs": [{"ms": None, "k": [1, None, 2.5]}], "out": str(tmp_path), "ok": 1.5}
    assert text.startswith('{\n "speedup"')  # indented by one
    assert math.isnan(results["speedup"])  # the caller's results are left as they were


def test_a_report_lands_beside_its_results_and_reads_back(tmp_path):
    assert report.write_results(str(tmp_path), [1.0], "rtt.json") == Path(tmp_path) / "rtt.json"
    assert json.loads((tmp_path / "rtt.json").read_text()) == [1.0]
    md = report.write_report(tmp_path, {"a": Path("/x")}, "# R\n", "r.json", "r.md")
    assert md == tmp_path / "r.md" and md.read_text() == "# R\n"
    assert report.read_results(tmp_path, "r.json") == {"a": "/x"}
    args = argparse.Namespace(out=Path("/o"), api_key="sk", n=1)
    assert report.args_record(args, drop=("api_key",)) == {"out": "/o", "n": 1}


def test_rendered_report_has_both_tables_and_mismatches():
    ar = _stats(100, 100, 0, 0, 0, 0, 4200, 4000, 100)
    sd = _stats(100, 25, 100, 75, 600, 500, 1600, 1500, 50)
    runs = [_run("hf-plain", "p1", 100, 4000), _run("sd-autoregressive", "p1", 100, 4300, ar),
            _run("sd-fixed-k4", "p1", 100, 2150, sd)]
    summary = summarise(runs, ["hf-plain", "sd-autoregressive", "sd-fixed-k4"])
    results = {
        "started": "2026-01-01T00:00:00", "command": "python -m evaluation.bench --prompts 1", "duration_s": 60,
        "pair": {"target": "embedded", "draft": "embedded", "draft_backend": "llamacpp", "hf_assistant": ""},
        "suite": {"version": "1", "digest": "abc", "prompts": [{}]}, "max_tokens": 100, "repeats": 1,
        "machine": {"cores": 2, "cpu": "cpu", "ram_gb": 24, "torch": "t", "transformers": "x", "llama_cpp_python": "l",
                    "python": "3", "threads": 2},
        "summary": summary,
        "mismatches": [{"mode": "sd-fixed-k4", "prompt_id": "p1", "position": 7, "reference_token": 5,
                        "other_token": 6, "reference_text": "a", "other_text": "b", "top2_gap": 0.001, "other_gap": 0.001}],
    }
    md = render_markdown(results, {"speedup_vs_k": "speedup_vs_k.png"}, img_prefix="img/")
    assert "### Speed" in md and "### Time per iteration (ms)" in md
    assert "| sd-fixed-k4 | 46.5 (46.5–46.5) |" in md
    assert "2.00×" in md and "100%" in md
    assert "| sd-fixed-k4 | p1 | 7 |" in md
    assert "![speedup_vs_k](img/speedup_vs_k.png)" in md
    assert "Acceptance by draft position" not in md and "Extra drafts" not in md  # results.json of older runs

    results["pair"]["extra_drafts"] = [{"name": "self-q8_0", "model": "target", "quant": "q8_0"},
                                       {"name": "self", "model": "target", "quant": None}]
    results["draft_positions"] = {"sd-fixed-k4": {"drafted": [25, 25], "accepted": [20, 15], "acceptance": [0.8, 0.6],
                                                  "ms_per_draft_token": 2.5}}
    md = render_markdown(results, {})
    assert ("Extra drafts (llama.cpp, each with its own orchestrator over the same target): `self-q8_0` = `target` at "
            "q8_0, `self` = `target` at the service default quantisation.") in md
    assert "| sd-fixed-k4 | 25 | 80% | 60% | – | – | – | – | – | – | 2.50 |" in md
    assert md.index("### Time per iteration") < md.index("### Acceptance by draft position") < md.index("### Token equality")


# ---- acceptance by draft position ----------------------------------------------------------------------

def _step(drafted, accepted):
    return step_json(list(range(drafted)), accepted, 99)


def test_position_counts_of_one_generation():
    steps = [_step(4, 4), _step(4, 1), _step(2, 0), _step(0, 0)]  # a plain step drafts nothing
    # position i counts where the target judged it: drafted, and every token before it accepted
    assert position_counts(steps) == {"drafted": [3, 2, 1, 1], "accepted": [2, 1, 1, 1]}
    assert position_counts([_step(0, 0)]) == {"drafted": [], "accepted": []}


def test_draft_positions_sum_counts_over_runs_before_dividing():
    def run(mode, steps, draft_ms):
        tokens = sum(len(s["draft"]) for s in steps)
        return {"mode": mode, "positions": position_counts(steps),
                "stats": {"draft_tokens": tokens, "draft_compute_ms": draft_ms}}

    runs = [run("sd-fixed-k4", [_step(4, 4), _step(4, 0)], 8.0),  # 8 draft tokens
            run("sd-fixed-k4", [_step(2, 2), _step(1, 1)], 7.0),  # 3 draft tokens (drafts stopped early)
            run("sd-autoregressive", [_step(0, 0)] * 3, 0.0), {"mode": "hf-plain"}]
    pos = draft_positions(runs, ["hf-plain", "sd-autoregressive", "sd-fixed-k4", "sd-cost"])
    assert list(pos) == ["sd-fixed-k4"]  # modes with no drafts, or not run, have no row
    p = pos["sd-fixed-k4"]
    assert p["drafted"] == [4, 2, 1, 1] and p["accepted"] == [3, 2, 1, 1]
    assert p["acceptance"] == pytest.approx([0.75, 1.0, 1.0, 1.0])
    assert p["draft_tokens"] == 11 and p["ms_per_draft_token"] == pytest.approx(15.0 / 11)

    md = render_positions(pos)
    assert "### Acceptance by draft position" in md
    lines = md.splitlines()
    assert "| mode | drafting steps | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | ms/draft token |" in lines
    assert "| sd-fixed-k4 | 4 | 75% | 100% | 100% | 100% | – | – | – | – | 1.36 |" in lines
    assert render_positions({}) == ""


def test_plots_write_pngs(tmp_path):
    ar = _stats(100, 100, 0, 0, 0, 0, 4200, 4000, 100)
    sd = _stats(100, 25, 100, 75, 600, 500, 1600, 1500, 50)
    runs = [_run("hf-plain", "p1", 100, 4000), _run("sd-autoregressive", "p1", 100, 4300, ar),
            _run("sd-fixed-k4", "p1", 100, 2150, sd), _run("sd-cost", "p1", 100, 2000, sd)]
    summary = summarise(runs, ["hf-plain", "sd-autoregressive", "sd-fixed-k4", "sd-cost"])
    assert report.plot_speedup_vs_k(summary, tmp_path / "k.png").stat().st_size > 0
    assert report.plot_time_split(summary, tmp_path / "t.png").stat().st_size > 0
    assert report.plot_acceptance_by_category(runs, ["sd-fixed-k4", "sd-cost"], CATEGORIES,
                                              tmp_path / "a.png").stat().st_size > 0


# ---- mismatch explanation on a tiny model ---------------------------------------------------------------

def test_explain_mismatch_on_a_tiny_model(tiny_models):
    import torch

    from evaluation.hf import HFGenerator, encode, explain_mismatch
    from specdec.models import load_hf

    loaded = load_hf(tiny_models["llama-target"])
    prompt = Prompt("t", "story", False, "hello world")
    ids = encode(loaded.tokenizer, prompt)
    reference, _ = HFGenerator(loaded.model, loaded.tokenizer).generate(ids, 8)
    assert len(reference) == 8  # past any EOS

    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([ids + reference[:3]])).logits[0, -1]
    runner_up = int(torch.topk(logits, 2).indices[1])
    other = reference[:3] + [runner_up] + reference[4:]
    why = explain_mismatch(loaded.model, loaded.tokenizer, ids, reference, other)
    assert why["position"] == 3
    assert why["reference_token"] == reference[3] == why["top1_token"]
    assert why["other_token"] == runner_up == why["top2_token"]
    assert why["top2_gap"] == pytest.approx(why["other_gap"]) and why["top2_gap"] >= 0
    assert explain_mismatch(loaded.model, loaded.tokenizer, ids, reference, list(reference)) is None
    assert "lengths differ" in explain_mismatch(loaded.model, loaded.tokenizer, ids, reference, reference[:5])["note"]


def test_hf_generate_ignores_eos_like_specdec(tiny_models):
    """The baseline must decode past EOS exactly as a cache-free greedy loop does."""
    import torch

    from evaluation.hf import HFGenerator
    from specdec.models import load_hf

    loaded = load_hf(tiny_models["gpt2-target"])
    ids = loaded.tokenizer("abc").input_ids
    got, _ = HFGenerator(loaded.model, loaded.tokenizer).generate(ids, 12)
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(12):
            seq.append(int(loaded.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert got == seq[len(ids):]


@pytest.mark.slow
@pytest.mark.embedded
def test_batchcost_measures_both_engines(tmp_path):
    """``python -m evaluation.batchcost`` on the embedded pair: a row per batch size, positive
    times, and a step of three sessions not cheaper than one (within noise)."""
    from evaluation import batchcost

    assert batchcost.main(["--batches", "1,3", "--rows", "1,2", "--repeats", "2", "--context", "32",
                           "--kernels", *batchcost.VARIANTS, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["target_ms"]) == {f"{k}:{b}x{q}" for k in batchcost.VARIANTS for b in (1, 3) for q in (1, 2)}
    assert set(results["draft_step_ms"]) == {"1", "3"}
    assert all(v > 0 for v in results["target_ms"].values())
    assert results["draft_step_ms"]["3"] > results["draft_step_ms"]["1"] * 0.8
    assert "| 3 |" in (tmp_path / "results.md").read_text()
    assert set(results["target_relative"]) == set(results["target_ms"])
    assert all(results["target_relative"][f"{k}:{b}x1"] == 1.0 for k in batchcost.VARIANTS for b in (1, 3))
    assert "B×2 / B×1" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
@pytest.mark.embedded
def test_batchcost_times_another_build_of_the_kernels_against_this_one(tmp_path, native_linears):
    """``--native-against old.c`` builds that kernels.c and times the runner on it interleaved
    with the current build, on the same packed weights; a file that does not compile is a clear
    exit, not a traceback."""
    from evaluation import batchcost
    from specdec.native import SOURCE

    other = tmp_path / "kernels-other.c"
    other.write_text(SOURCE.read_text() + "\n/* another version */\n")
    argv = ["--batches", "1", "--rows", "1,3", "--repeats", "2", "--context", "16", "--draft", "none",
            "--native-against", str(other), "--out", str(tmp_path / "out")]
    assert batchcost.main(argv) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(results["target_ms"]) == {f"{k}:1x{q}" for k in ("runner", "runner-against") for q in (1, 3)}
    with pytest.raises(SystemExit):  # argparse's error: the file is not there
        batchcost.parse_args(["--native-against", str(tmp_path / "missing.c")])
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with pytest.raises(SystemExit, match="native-against"):
        batchcost.main([*argv[:-4], "--native-against", str(broken), "--out", str(tmp_path / "out2")])


def test_a_copy_loaded_on_another_build_packs_and_runs_on_it(tiny_models, tmp_path, native_linears):
    """What ``--native-against`` times: a copy of the model loaded inside batchcost.built_on(build)
    has every linear and the runner's own kernels on that build; a build of a kernels.c without
    sd_forward_decoder (an older one) runs the calls one by one, to the bits the current build's
    one call computes."""
    import torch

    from evaluation import batchcost
    from specdec.engine.executor import Executor
    from specdec.engine.sessions import SessionStore
    from specdec.models import load_hf
    from specdec.native import SOURCE, Kernels, build

    source = tmp_path / "kernels.c"
    source.write_text(SOURCE.read_text().replace("sd_forward_decoder", "sd_forward_elsewhere"))
    older = Kernels(build(tmp_path, source))
    assert not older.stacked
    path = tiny_models["llama-target"]
    current = Executor(load_hf(path).model, SessionStore(8, 1 << 30, 0))
    with batchcost.built_on(older):
        swapped = Executor(load_hf(path).model, SessionStore(8, 1 << 30, 0))
    assert swapped.runner.native is older and swapped.fast_linears.native is older
    assert all(lin.native is older for lin in swapped.runner._linears()) and current.runner.native is not older
    ids = [3, 17, 5, 22, 9, 31, 4, 12, 28, 7, 19, 2, 25, 11, 6, 33, 14]
    got = [lm.extend(lm.session("s"), ids[:12], ids[12:17])[0] for lm in (current, swapped)]
    assert torch.equal(*got)


def test_batchcost_relative_pairs_each_pass_with_its_own_round():
    """A pass is priced against the first row count's pass of the same round, not against a
    median taken over other minutes: a machine that slows down mid-run moves both alike."""
    import argparse

    from evaluation import batchcost

    times = {("runner", 1, 1): [10.0, 20.0, 40.0], ("runner", 1, 17): [13.0, 26.0, 60.0]}
    rel = batchcost.relative(times, argparse.Namespace(rows=[1, 17]))
    assert rel[("runner", 1, 1)] == 1.0
    assert rel[("runner", 1, 17)] == 1.3  # ratios 1.3, 1.3, 1.5; the medians' ratio would be 26 / 20


def test_batchcost_prices_a_random_model_of_a_real_configuration(tmp_path, monkeypatch):
    """``--target random:NAME`` builds the configuration with random weights once, under the cache
    folder, and times it through the runner and through transformers' forward; ``--draft none``
    leaves the draft out."""
    from evaluation import batchcost

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(batchcost.RANDOM_CONFIGS, "tiny-gpt2",
                        {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 30000, "n_positions": 64})
    argv = ["--target", "random:tiny-gpt2", "--draft", "none", "--batches", "1,2", "--rows", "1,3", "--repeats", "1",
            "--context", "8", "--kernels", "runner", "packed", "--out", str(tmp_path / "out")]
    assert batchcost.main(argv) == 0
    assert (tmp_path / "cache" / "random-models" / "tiny-gpt2-bpe" / "config.json").exists()
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(results["target_ms"]) == {f"{k}:{b}x{q}" for k in ("runner", "packed") for b in (1, 2) for q in (1, 3)}
    assert results["draft_step_ms"] == {} and "draft step" not in (tmp_path / "out" / "results.md").read_text()
    with pytest.raises(SystemExit, match="unknown random model"):
        batchcost.main(["--target", "random:nope", "--draft", "none", "--out", str(tmp_path / "bad")])


def test_lookup_walk_counts_what_prompt_lookup_would_land():
    """The walk proposes what followed the last occurrence of the suffix n-gram, advances past the
    accepted tokens plus the target's own, and counts lookups that found nothing as passes too."""
    from evaluation.lookup import walk

    # prompt 1 2 3 4; output 1 2 3 9: at "4" nothing matches (one plain pass, token 1); at "4 1"
    # the 1-gram "1" matches position 0 and proposes 2 3 4 ..., of which 2 3 land, then 9 is the
    # target's own token
    c = walk([1, 2, 3, 4, 1, 2, 3, 9], start=4, k=4, min_ngram=1, max_ngram=3)
    assert (c.positions, c.matched, c.accepted) == (2, 1, 2)
    # with bigrams at least, "4 1" is no match (a plain pass, token 2); then "1 2" proposes 3 4 1 2,
    # of which 3 lands
    c = walk([1, 2, 3, 4, 1, 2, 3, 9], start=4, k=4, min_ngram=2, max_ngram=3)
    assert (c.positions, c.matched, c.accepted) == (3, 1, 1)
    assert walk([5, 6, 7], start=1, k=4, min_ngram=2, max_ngram=3).matched == 0


def test_replay_walks_rounds_the_way_the_greedy_loop_would():
    """From each position the draft's proposal is cut at k or after its first token below the
    threshold; the leading tokens equal to the output are accepted, the target adds its own, and
    the next round starts after them. Cost: a pass of drafted + 1 rows, the draft tokens, overhead."""
    from evaluation.replay import Proposal, drafted_length, replay

    output = [10, 11, 12, 13, 14, 15]
    # proposals from every position: right except at position 2, where the draft says 99
    proposals = [Proposal((output[s:] + [0] * 8)[:6], [0.9] * 6) for s in range(len(output))]
    proposals[0] = Proposal([10, 11, 99, 13, 14, 15], [0.9, 0.9, 0.9, 0.9, 0.05, 0.9])
    assert drafted_length(proposals[0], 8, 0.1) == 5 and drafted_length(proposals[0], 3, 0.1) == 3
    assert drafted_length(proposals[0], 8, 0.0) == 6
    r = replay(output, proposals, 4, 0.1, lambda rows: 50.0 + rows, 10.0, 5.0)
    # round 1 at 0: drafts 4 (k), accepts 10 11, target gives 12 -> 3 tokens; round 2 at 3: output
    # has 3 left, so at most 2 drafted (13 14), both accepted, target gives 15 -> 3 tokens
    assert (r.rounds, r.tokens, r.drafted) == (2, 6, 6)
    assert r.cost_ms == (50 + 5 + 40 + 5) + (50 + 3 + 20 + 5)
    plain = replay(output, proposals, 0, 0.0, lambda rows: 50.0 + rows, 10.0, 5.0)
    assert (plain.rounds, plain.tokens, plain.drafted) == (6, 6, 0) and plain.cost_ms == 6 * 56


@pytest.mark.embedded
def test_replay_runs_on_the_embedded_pair(tmp_path):
    from evaluation import replay

    assert replay.main(["--prompts", "1", "--max-tokens", "12", "--ks", "2,4", "--thresholds", "0,0.5",
                        "--repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["k"], r["threshold"]) for r in results["rows"]] == [(2, 0.0), (2, 0.5), (4, 0.0), (4, 0.5)]
    assert all(r["speedup"] > 0 and 1 <= r["tokens_per_round"] <= r["k"] + 1 for r in results["rows"])
    assert len(results["outputs"][0]["output"]) == 12 and results["draft_token_ms"] > 0
    assert "predicted speedup" in (tmp_path / "results.md").read_text()


def test_a_draft_position_no_step_reached_has_no_acceptance():
    """A mode whose drafts always stopped before some position it asked for (the position counts
    carry a 0 there) reports no acceptance at it, not a division by zero after the whole run."""
    runs = [{"mode": "sd-cost", "positions": {"drafted": [3, 2, 0, 0], "accepted": [3, 1, 0, 0]},
             "stats": {"draft_tokens": 5, "draft_compute_ms": 20.0}}]
    p = draft_positions(runs, ["sd-cost"])["sd-cost"]
    assert p["acceptance"] == [1.0, 0.5, None, None]
    assert "| sd-cost | 3 | 100% | 50% | – | – | – | – | – | – | 4.00 |" in render_positions({"sd-cost": p}).splitlines()


def test_peak_prices_the_kernel_against_a_real_fma_ceiling(capsys, tmp_path):
    """evaluation.peak's ceiling is a loop of FMAs: compiled as it compiles it, the AVX-512 clone
    is fused multiply-adds (the first version, without -ffp-contract, was a multiply and an add,
    and read below the kernel's own rate). No timing is asserted: this VM's speed drifts."""
    import platform
    import subprocess

    import torch

    from evaluation import peak
    from specdec.native import compiler

    if platform.machine() in ("x86_64", "AMD64"):
        src = tmp_path / "peak.c"
        src.write_text(peak._FMA_LOOP)
        subprocess.run([compiler(), *peak.FLAGS, "-S", str(src), "-o", str(tmp_path / "peak.s")], check=True)
        asm = (tmp_path / "peak.s").read_text()
        clone = asm[asm.index("sd_peak.avx512f:"):]
        assert "vfmadd" in clone[:clone.index("ret")]
    threads = torch.get_num_threads()
    try:
        peak.main(["--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "FMA peak, 1 threads" in out and out.count("weight in cache") == 3
