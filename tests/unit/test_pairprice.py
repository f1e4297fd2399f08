"""evaluation.pairprice: draft specs and the projection from the orchestrator's cost model (no models)."""

from __future__ import annotations

import argparse

import pytest

from evaluation.pairprice import DraftSpec, parse_args, parse_draft, projected_speedup, render


def test_draft_specs():
    assert parse_draft("random:distilgpt2@llamacpp:q8_0") == DraftSpec("random:distilgpt2@llamacpp:q8_0",
                                                                       "random:distilgpt2", "llamacpp", "q8_0")
    assert parse_draft("target@llamacpp").quant == "q8_0"  # the service's default
    assert parse_draft("distilgpt2@transformers") == DraftSpec("distilgpt2@transformers", "distilgpt2", "transformers")
    for bad, why in (("distilgpt2", "MODEL@BACKEND"), ("x@onnx", "backend"), ("x@transformers:q4_0", "no quantisation"),
                     ("x@llamacpp:q3_x", "unknown quantisation")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_draft(bad)
    with pytest.raises(SystemExit):
        parse_args(["--acceptances", "0.5,1.0"])
    for bad in ("0", "32"):  # the engine verifies up to 32 draft tokens: k + 1 rows
        with pytest.raises(SystemExit):
            parse_args(["--max-k", bad])


def test_projection_follows_the_costs():
    # a flat verify (10 ms at any row count): speculation pays when drafts are cheap
    flat = {q: 10.0 for q in range(1, 10)}
    def by_hand(draft_ms: float, a: float) -> tuple[float, int]:
        rates = {k: sum(a ** j for j in range(k + 1)) / (10.0 + k * draft_ms) * 10.0 for k in range(9)}
        best = max(rates, key=rates.get)
        return rates[best], best

    speedup, k = projected_speedup(flat, 1.0, 0.9, 8)
    assert (round(speedup, 6), k) == tuple(round(x, 6) for x in by_hand(1.0, 0.9)) and k > 0
    free, _ = projected_speedup(flat, 0.2, 0.8, 8)
    cheap, _ = projected_speedup(flat, 1.0, 0.8, 8)
    dear, _ = projected_speedup(flat, 6.0, 0.8, 8)
    assert free > cheap > dear >= 1.0
    # a draft as dear as the target: plain decoding (k = 0) wins
    assert projected_speedup(flat, 10.0, 0.6, 8) == (1.0, 0)
    # higher acceptance, longer drafts
    assert projected_speedup(flat, 1.0, 0.95, 8)[1] >= projected_speedup(flat, 1.0, 0.6, 8)[1]


def test_llama_cpp_is_priced_on_the_targets_gguf_only():
    with pytest.raises(SystemExit):
        parse_args(["--llama-bench"])  # no --target-quant: no file both engines compute
    args = parse_args(["--llama-bench", "/x", "--target-quant", "q4_k_m"])
    assert (args.llama_bench, args.target_quant) == ("/x", "q4_k_m")
    assert parse_args(["--llama-bench", "--target-quant", "q8_0"]).llama_bench == "build"


def test_the_table_sets_each_engine_against_its_own_plain_step():
    args = parse_args(["--acceptances", "0.8", "--max-k", "2", "--drafts", "embedded@native", "embedded@llamacpp"])
    ours = {1: 10.0, 2: 11.0, 3: 12.0}
    theirs = {1: 8.0, 2: 14.0, 3: 20.0}
    llama = {"verify_ms": theirs, "draft_token_ms": {"embedded@llamacpp": 4.0},
             "projection": {"embedded@llamacpp": {0.8: projected_speedup(theirs, 4.0, 0.8, 2)}}}
    table = render(args, ours, {"embedded@native": 2.0},
                   {"embedded@native": {0.8: projected_speedup(ours, 2.0, 0.8, 2)}}, llama)
    lines = table.splitlines()
    assert "| specdec | 10.0 | 11.0 | 12.0 |" in lines and "| llama.cpp | 8.0 | 14.0 | 20.0 |" in lines
    ours_speedup, k = projected_speedup(ours, 2.0, 0.8, 2)
    assert f"{ours_speedup:.2f}× (k={k}), {100 * ours_speedup:.1f} tok/s" in table
    assert "| llama.cpp | `embedded@llamacpp` | 4.0 | 0.50 |" in table  # against llama.cpp's own step
