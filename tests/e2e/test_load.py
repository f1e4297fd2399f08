"""The load benchmark: its statistics (evaluation.stats) on hand-made timings, and one short real run
on tiny models."""

from __future__ import annotations

import json
import random

import pytest

from evaluation.load import main, parse_args, render_tables
from evaluation.stats import (
    add_ratios,
    batch_means,
    itl_per_token,
    poisson_arrivals,
    quantiles,
    step_gaps,
    summarise_run,
)

# ---- statistics on hand-made numbers -------------------------------------------------------------


def test_step_gaps_and_itl_spread_a_step_over_its_tokens():
    # first delivery at 0.5 s is the TTFT's; the empty step at 0.7 s delivers nothing, so the
    # next gap runs from 0.5 to 0.9 s and carries 2 tokens
    gaps = step_gaps([(0.5, 1), (0.7, 0), (0.9, 2), (1.0, 1)])
    assert gaps == [(0.9, pytest.approx(0.4), 2), (1.0, pytest.approx(0.1), 1)]
    assert itl_per_token(gaps) == pytest.approx([0.2, 0.2, 0.1])
    assert step_gaps([(0.3, 4)]) == []  # a single step has no inter-token gap
    assert step_gaps([]) == []


def test_quantiles_interpolate_and_are_none_without_values():
    q = quantiles([10.0, 20.0, 30.0, 40.0, 50.0])
    assert q["p50"] == 30.0 and q["mean"] == 30.0 and q["n"] == 5
    assert q["p90"] == pytest.approx(46.0) and q["p99"] == pytest.approx(49.6)
    assert quantiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}


def test_batch_means_count_each_forward_once():
    # a forward of 2 sessions and 10 rows is seen by both sessions' steps; one of 1 session and 3 rows once
    sessions, rows = batch_means([(2, 10), (2, 10), (1, 3)])
    assert sessions == pytest.approx(1.5) and rows == pytest.approx(6.5)
    assert batch_means([]) == (None, None)


def _step(t, n, k=0, drafted=0, accepted=0, **batch):
    return {"t": t, "n": n, "k": k, "drafted": drafted, "accepted": accepted, **batch}


def _record(pid, start, end, steps, status=200, errors=(), attempts=1, identical=True):
    return {"prompt_id": pid, "start": start, "end": end, "status": status, "errors": list(errors),
            "attempts": attempts, "steps": steps, "identical": identical}


def test_summarise_run_on_two_requests():
    a = _record("p1", 0.0, 2.0, [_step(0.5, 1, 2, 2, 0), _step(1.0, 3, 2, 2, 2), _step(2.0, 2, 2, 2, 1)])
    a["server"] = {"tokens": 6, "iterations": 3, "elapsed_ms": 1500.0, "verify_compute_ms": 300.0}
    # retried once after a 429; its batch fields make the batch means known
    b = _record("p2", 1.0, 4.0, [_step(2.0, 2, 4, 4, 1, batch_sessions=2, batch_rows=10),
                                 _step(3.0, 4, 4, 4, 3, batch_sessions=1, batch_rows=5)],
                errors=["429"], attempts=2, identical=False)
    failed = _record("p3", 1.5, None, [], status=503, errors=["503"], identical=None)
    s = summarise_run([a, b, failed], (0.8, 3.0))
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == {"429": 1, "503": 1} and s["retries"] == 1
    # in the window [0.8, 3.0]: a's steps at 1.0 and 2.0 (5 tokens), b's at 2.0 and 3.0 (6 tokens)
    assert s["tokens"] == 11 and s["tokens_per_second"] == pytest.approx(11 / 2.2)
    # gaps in the window: a 0.5 s (3 tokens) and 1.0 s (2 tokens), b 1.0 s (4 tokens); b's first is its TTFT
    assert s["step_gap_ms"]["n"] == 3 and s["step_gap_ms"]["p50"] == pytest.approx(1000)
    assert s["itl_ms"]["n"] == 9 and s["itl_ms"]["mean"] == pytest.approx((3 * 500 / 3 + 2 * 500 + 4 * 250) / 9)
    assert s["ttft_ms"]["p50"] == pytest.approx(750) and s["ttft_ms"]["n"] == 2  # 500 and 1000 ms
    assert s["e2e_ms"]["mean"] == pytest.approx(2500)
    assert s["request_tokens_per_second"]["p50"] == pytest.approx((6 / 2 + 6 / 3) / 2)
    assert s["mean_k"] == pytest.approx(3.0) and s["acceptance_rate"] == pytest.approx(7 / 12)
    assert s["batch_steps"] == 2 and s["batch_sessions"] == pytest.approx(4 / 3)
    assert s["compared"] == 2 and s["mismatches"] == 1 and s["mismatched_prompts"] == ["p2"]
    # only a reported what the server measured
    assert s["server_tokens_per_second"]["n"] == 1 and s["server_tokens_per_second"]["p50"] == pytest.approx(4.0)
    assert s["verify_compute_ms_per_iteration"] == pytest.approx(100.0)


def test_summarise_run_without_tokens_reports_unknowns():
    s = summarise_run([_record("p1", 0.0, None, [], status=None, errors=["connection"], identical=None)], (1.0, 1.0))
    assert s["tokens_per_second"] is None and s["mean_k"] is None and s["acceptance_rate"] is None
    assert s["batch_sessions"] is None and s["ttft_ms"]["p50"] is None and s["errors"] == {"connection": 1}


def _run(mode, loop, load, tps):
    return {"mode": mode, "loop": loop, "load": load, "label": str(load), "summary": {"tokens_per_second": tps}}


def test_ratios_against_n1_and_autoregressive():
    runs = [_run("speculative", "closed", 1, 50.0), _run("autoregressive", "closed", 1, 25.0),
            _run("speculative", "closed", 4, 100.0), _run("autoregressive", "closed", 4, 80.0),
            _run("speculative", "open", 0.5, 20.0), _run("autoregressive", "open", 0.5, None)]
    add_ratios(runs)
    s = [r["summary"] for r in runs]
    assert s[0]["vs_n1"] == 1.0 and s[2]["vs_n1"] == 2.0 and s[3]["vs_n1"] == pytest.approx(3.2)
    assert s[0]["vs_autoregressive"] == 2.0 and s[2]["vs_autoregressive"] == pytest.approx(1.25)
    assert s[1]["vs_autoregressive"] is None  # no ratio of a mode to itself
    assert s[4]["vs_n1"] is None and s[4]["vs_autoregressive"] is None  # open loop has no N=1; AR unknown


def test_poisson_arrivals_are_seeded_and_inside_the_duration():
    times = poisson_arrivals(10.0, 100.0, random.Random(1))
    assert times == sorted(times) and 0 < times[0] and times[-1] < 100.0
    assert 900 < len(times) < 1100  # mean 1000, sd ~32
    assert times == poisson_arrivals(10.0, 100.0, random.Random(1))


def test_arguments():
    args = parse_args(["--concurrency", "1,4", "--rates", "0.5,2", "--env", "A=b=c"])
    assert args.concurrency == [1, 4] and args.rates == [0.5, 2.0] and args.env == [("A", "b=c")]
    assert parse_args(["--concurrency", "", "--rates", "1"]).concurrency == []  # open loop only
    for bad in (["--modes", "beam"], ["--concurrency", "", "--rates", ""], ["--concurrency", "0"],
                ["--duration", "3", "--warmup", "5"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# ---- a real run on tiny models -----------------------------------------------------------------


@pytest.mark.slow
def test_load_benchmark_end_to_end_on_tiny_models(tmp_path, tiny_models):
    """The benchmark starts the stack itself (on tiny models) and runs the closed loop at N = 1, 2
    and the open loop at one rate, a few seconds each; the outputs hold sane numbers."""
    suite = tmp_path / "prompts.jsonl"
    suite.write_text("".join(json.dumps({"id": f"p{i}", "category": "story", "chat": False, "text": text}) + "\n"
                             for i, text in enumerate(["the quick brown fox", "hello world, this is", "once upon a"])))
    out = tmp_path / "out"
    env = [f"SPECDEC_TARGET_MODEL={tiny_models['gpt2-target']}", "SPECDEC_TARGET_THREADS=1",
           f"SPECDEC_DRAFT_MODEL={tiny_models['gpt2-draft']}", "SPECDEC_DRAFT_BACKEND=transformers",
           "SPECDEC_DRAFT_THREADS=1"]
    argv = ["--concurrency", "1,2", "--rates", "3", "--duration", "2", "--warmup", "0.5", "--max-tokens", "12",
            "--controller", "fixed", "--k", "2", "--prompts-file", str(suite), "--out", str(out)]
    for e in env:
        argv += ["--env", e]
    assert main(argv) == 0

    results = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert (out / "throughput_vs_itl.png").stat().st_size > 0
    runs = {(r["loop"], r["load"], r["mode"]): r for r in results["runs"]}
    assert set(runs) == {(loop, load, mode) for loop, load in (("closed", 1), ("closed", 2), ("open", 3.0))
                         for mode in ("speculative", "autoregressive")}
    assert set(results["references"]) <= {"p0", "p1", "p2"} and results["references"]
    for (loop, load, mode), run in runs.items():
        s = run["summary"]
        assert s["completed"] > 0 and s["failed"] == 0 and s["errors"] == {}, (loop, load, mode, s)
        assert s["tokens_per_second"] > 0 and s["tokens"] <= sum(x["n"] for r in run["requests"] for x in r["steps"])
        for r in run["requests"]:
            assert sum(x["n"] for x in r["steps"]) == 12  # ignore_eos: exactly max_tokens each
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
        assert 0 < s["itl_ms"]["p50"] <= s["itl_ms"]["p99"] and s["step_gap_ms"]["p50"] >= s["itl_ms"]["p50"]
        assert s["compared"] == s["completed"]
        # the server's own speed bounds the client's: the client also waits for the network and the first step
        assert s["server_tokens_per_second"]["p50"] >= s["request_tokens_per_second"]["p50"] * 0.9
        assert s["verify_compute_ms_per_iteration"] > 0
        if mode == "speculative":
            assert s["mean_k"] > 0 and 0 <= s["acceptance_rate"] <= 1 and s["vs_autoregressive"] > 0
        else:
            assert s["mean_k"] == 0 and s["acceptance_rate"] is None
        if loop == "closed":
            # one request at a time cannot be batched with anything: its output must be the reference's
            assert s["vs_n1"] > 0 and (load != 1 or s["mismatches"] == 0)
        # batch fields are optional in step events; when present the means are at least one session
        assert s["batch_sessions"] is None or s["batch_sessions"] >= 1
    assert runs[("closed", 1, "speculative")]["summary"]["vs_n1"] == 1.0
    assert "| 1 | speculative |" in md and "| 2 | autoregressive |" in md and "| 3 | speculative |" in md
    assert "![aggregate tok/s against p99 ITL](throughput_vs_itl.png)" in md
    assert render_tables(results["runs"]) in md
