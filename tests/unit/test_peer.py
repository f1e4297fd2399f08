"""The llama-server comparison (evaluation/peer.py, llamacpp.py, peer_report.py): argument parsing,
the command lines and request it builds, the flag choice it shares with install_llamacpp.sh, and the
statistics and tables. Nothing is built or started here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from evaluation import peer
from evaluation.llamacpp import (
    PeerError,
    completion_body,
    llama_bench_command,
    llama_server_command,
    parse_llama_bench,
    run_step,
)
from evaluation.peer import parse_args
from evaluation.peer_report import (
    LABELS,
    find_mismatches,
    headline_table,
    mismatch_lines,
    per_prompt_table,
    render_markdown,
    summarise,
)
from tests.support import ROOT

# ---- arguments ------------------------------------------------------------------------------------


def test_defaults():
    args = parse_args([])
    assert args.prompts == 10 and args.max_tokens == [64, 128] and args.repeats == 1
    assert args.draft_max == 16 and args.draft_min == 0 and args.draft_p_min is None
    assert args.ctx_size == 4096 and args.kv_type == "f32" and args.threads == (os.cpu_count() or 1)
    assert args.llama_dir is None and args.out is None and not args.no_llama_bench and not args.no_warmup


def test_options():
    args = parse_args(["--prompts", "2", "--max-tokens", "128", "8", "8", "--repeats", "3", "--threads", "4",
                       "--draft-max", "8", "--draft-min", "1", "--draft-p-min", "0.5", "--kv-type", "f16",
                       "--llama-dir", "/x", "--no-llama-bench"])
    assert args.prompts == 2 and args.max_tokens == [8, 128] and args.repeats == 3 and args.threads == 4
    assert (args.draft_max, args.draft_min, args.draft_p_min, args.kv_type) == (8, 1, 0.5, "f16")
    assert args.llama_dir == Path("/x") and args.no_llama_bench


@pytest.mark.parametrize("bad", [["--prompts", "0"], ["--max-tokens", "0"], ["--repeats", "0"],
                                 ["--draft-max", "0"], ["--draft-min", "17"], ["--draft-p-min", "1.5"],
                                 ["--kv-type", "q8_0"]])
def test_bad_options_exit(bad, capsys):
    with pytest.raises(SystemExit):
        parse_args(bad)


# ---- what llama-server and llama-bench are asked ------------------------------------------------------


def test_plain_server_command():
    cmd = llama_server_command("/b/llama-server", "/m/t.gguf", 8123, 2)
    assert cmd[0] == "/b/llama-server"
    assert cmd[cmd.index("-m") + 1] == "/m/t.gguf" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-c") + 1] == "4096" and cmd[cmd.index("-np") + 1] == "1"
    assert cmd[cmd.index("-ctk") + 1] == "f32" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "-md" not in cmd and not any(a.startswith("--spec") for a in cmd)


def test_speculative_server_command():
    cmd = llama_server_command("llama-server", "t.gguf", 1, 2, draft="d.gguf")
    assert cmd[cmd.index("-md") + 1] == "d.gguf" and cmd[cmd.index("--spec-type") + 1] == "draft-simple"
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "16" and cmd[cmd.index("--spec-draft-n-min") + 1] == "0"
    assert cmd[cmd.index("-td") + 1] == "2" and cmd[cmd.index("-tbd") + 1] == "2"
    assert "--spec-draft-p-min" not in cmd  # the server's default unless asked
    cmd = llama_server_command("llama-server", "t.gguf", 1, 3, draft="d.gguf", draft_max=8, draft_min=1, draft_p_min=0.25)
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "8" and cmd[cmd.index("--spec-draft-p-min") + 1] == "0.25"


def test_completion_body_is_greedy_fixed_length_and_returns_ids():
    body = completion_body((1, 2, 3), 64)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 64
    assert body["temperature"] == 0 and body["top_k"] == 1
    assert body["ignore_eos"] is True and body["return_tokens"] is True and body["cache_prompt"] is False
    json.dumps(body)


def test_llama_bench_command_and_parse():
    cmd = llama_bench_command("llama-bench", "t.gguf", 2, 0, 64)
    assert cmd[cmd.index("-p") + 1] == "0" and cmd[cmd.index("-n") + 1] == "64" and cmd[-2:] == ["-o", "json"]
    assert "-ctk" not in cmd  # its default; it knows no f32 KV cache
    cmd = llama_bench_command("llama-bench", "t.gguf", 2, 16, 0, "q8_0")
    assert cmd[cmd.index("-ctk") + 1] == "q8_0" and cmd[cmd.index("-ctv") + 1] == "q8_0"
    gen = parse_llama_bench(json.dumps([{"n_prompt": 0, "n_gen": 64, "avg_ts": 20.0, "stddev_ts": 0.5, "n_threads": 2,
                                         "type_k": "f32", "build_commit": "unknown"}]))
    assert gen["tokens_per_second"] == 20.0 and gen["ms_per_eval"] == pytest.approx(50.0) and gen["threads"] == 2
    rows = parse_llama_bench(json.dumps([{"n_prompt": 16, "n_gen": 0, "avg_ts": 160.0}]))
    assert rows["ms_per_eval"] == pytest.approx(100.0)  # all 16 rows in one eval
    with pytest.raises(ValueError):
        parse_llama_bench("[]")


# ---- the flags shared with install_llamacpp.sh ---------------------------------------------------------


def _install_script_flags(tmp_path: Path, env: dict[str, str]) -> str:
    """The flags install_llamacpp.sh announces before building, run against a Python that fails at
    once (so nothing is built or installed)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install_llamacpp.sh"), str(fake)], capture_output=True, text=True,
                       env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}, timeout=60)
    found = re.search(r"with: (.*) \(\d+ parallel jobs; a few minutes\)", r.stdout)
    assert found, r.stdout + r.stderr
    return found.group(1)


@pytest.mark.parametrize("avx512", ["auto", "off"])
def test_build_script_chooses_the_flags_install_llamacpp_does(tmp_path, avx512):
    env = {"SPECDEC_LLAMACPP_AVX512": avx512}
    ours = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_server.sh"), "--print-flags"], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=60, check=True).stdout.strip()
    assert ours == _install_script_flags(tmp_path, env)
    assert "-DGGML_NATIVE=OFF" in ours and "-DGGML_AMX_TILE=OFF" in ours
    if avx512 == "off":
        assert "-DGGML_AVX512=OFF" in ours
    else:  # Linux names them avx512f, avx512_vnni, avx512vbmi (no underscore) and avx512_bf16
        flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
        has = {"avx512f", "avx512_vnni", "avx512vbmi", "avx512_bf16"} <= flags
        assert ("-DGGML_AVX512=ON" in ours) == has, (sorted(f for f in flags if f.startswith("avx512")), ours)


def test_build_script_builds_the_same_version():
    def version(name: str) -> str:
        return re.search(r"^VERSION=(\S+)", (ROOT / "scripts" / name).read_text(), re.M).group(1)

    assert version("build_llama_server.sh") == version("install_llamacpp.sh")


def test_make_target():
    makefile = (ROOT / "Makefile").read_text()
    assert "bench-peer" in re.search(r"^\.PHONY:.*$", makefile, re.M).group(0)
    assert re.search(r"^bench-peer: setup\n\t\$\(PY\) -m evaluation\.peer \$\(BENCH_ARGS\)$", makefile, re.M)


# ---- preparation helpers ---------------------------------------------------------------------------------


def test_failed_step_names_itself_with_its_log(tmp_path):
    log = tmp_path / "step.log"
    with pytest.raises(PeerError, match=r"(?s)the thing failed \(exit status 3\).*boom"):
        run_step(["sh", "-c", "echo boom >&2; exit 3"], "the thing", log)
    assert run_step(["sh", "-c", "echo out; echo err >&2"], "echo", tmp_path / "ok.log", capture=True) == "out\n"


# ---- statistics and tables -------------------------------------------------------------------------------


def _run(mode, prompt, ids, wall_ms, n=4, repeat=0, drafted=0, accepted=0):
    return {"mode": mode, "prompt_id": prompt, "category": "code", "max_tokens": n, "repeat": repeat, "prompt_tokens": 5,
            "tokens": len(ids), "elapsed_ms": wall_ms, "wall_ms": wall_ms, "token_ids": ids,
            "draft_tokens": drafted, "accepted_tokens": accepted}


def _runs():
    same = [1, 2, 3, 4]
    return [
        _run("llama-plain", "a", same, 100.0), _run("llama-spec", "a", same, 50.0, drafted=8, accepted=6),
        _run("sd-autoregressive", "a", [1, 2, 9, 4], 200.0), _run("sd-speculative", "a", [1, 2, 9, 4], 40.0, drafted=4,
                                                                  accepted=4),
        _run("llama-plain", "b", same, 100.0), _run("llama-spec", "b", same, 100.0),
        _run("sd-autoregressive", "b", same, 100.0), _run("sd-speculative", "b", same, 25.0, drafted=2, accepted=1),
    ]


def test_mismatches_against_both_references():
    runs = _runs()
    mismatches = find_mismatches(runs)
    pairs = {(x["mode"], x["reference"], x["prompt_id"]) for x in mismatches}
    assert pairs == {("sd-autoregressive", "llama-plain", "a"), ("sd-speculative", "llama-plain", "a"),
                     ("llama-plain", "sd-autoregressive", "a"), ("llama-spec", "sd-autoregressive", "a")}
    x = next(x for x in mismatches if x["mode"] == "sd-speculative")
    assert (x["position"], x["reference_token"], x["other_token"]) == (2, 3, 9)
    assert runs[0]["differs_from"] == {"sd-autoregressive": 2}  # no comparison with itself
    assert runs[3]["differs_from"] == {"llama-plain": 2, "sd-autoregressive": None}


def test_summary_speeds_and_ratios():
    runs = _runs()
    find_mismatches(runs)
    s = summarise(runs, [4])["4"]
    plain = s["modes"]["llama-plain"]
    assert plain["tokens"] == 8 and plain["tokens_per_second"] == pytest.approx(8 / 0.2)
    assert s["modes"]["sd-speculative"]["tokens_per_second"] == pytest.approx(8 / 0.065)
    assert s["modes"]["llama-spec"]["acceptance_rate"] == pytest.approx(0.75)
    assert s["modes"]["llama-plain"]["acceptance_rate"] is None
    assert s["modes"]["sd-speculative"]["differ_from_llama-plain"] == 1
    assert s["modes"]["sd-speculative"]["compared_with_llama-plain"] == 2
    # totals: all tokens over all wall time; per prompt: the spread of paired ratios
    r = s["ratios"]["sd-autoregressive/llama-plain"]
    assert r["total"] == pytest.approx((8 / 0.3) / (8 / 0.2)) and r["per_prompt"]["median"] == pytest.approx(0.75)
    assert s["ratios"]["sd-speculative/sd-autoregressive"]["total"] == pytest.approx(0.3 / 0.065)


def test_headline_table_has_one_column_per_mode_and_the_two_ratios():
    runs = _runs()
    mismatches = find_mismatches(runs)
    table = headline_table(summarise(runs, [4])["4"])
    header = table.splitlines()[0]
    for label in ("llama-server plain", "llama-server speculative", "specdec autoregressive", "specdec speculative",
                  "specdec AR / llama-server plain", "specdec spec / llama-server spec"):
        assert label in header
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "40.0" in rows["tok/s (all tokens / all HTTP wall time)"]
    assert "0.67×" in rows["tok/s (all tokens / all HTTP wall time)"]  # specdec AR against llama plain
    assert "1/2" in rows["outputs differing from llama-server plain"]
    assert "75%" in rows["draft acceptance"]
    lines = mismatch_lines(mismatches, 4, 2)
    assert any(line.startswith("- specdec speculative vs llama-server plain: 1 of 2 differ; first: `a`") and "position 2" in line
               for line in lines)
    assert mismatch_lines([], 4, 2) == ["- every output is identical token for token across the four modes"]


def test_markdown_report_renders_from_results_alone():
    runs = _runs()
    mismatches = find_mismatches(runs)
    results = {
        "started": "2026-12-02T22:00:00", "duration_s": 60.0, "command": "python -m evaluation.peer --prompts 2",
        "machine": {"cores": 2, "cpu": "AMD EPYC", "ram_gb": 8.0, "load_average_start": [1.0, 1.0, 1.0],
                    "load_average_end": [2.0, 1.0, 1.0]},
        "llama_cpp": {"source": "llama-cpp-python 0.3.36 vendored llama.cpp", "ggml_flags": ["-DGGML_NATIVE=OFF"],
                      "cmake_flags": ["-DLLAMA_CURL=OFF"], "compiler": "c++ 12"},
        "llama_server_version": "version: 0 (unknown)", "suite": {"version": "1", "digest": "abc"},
        "prompts": ["a", "b"], "repeats": 1, "max_tokens": [4],
        "setup": {"target_source": "/m", "target_gguf": "/g/t.gguf", "draft_gguf": "/g/d.gguf", "threads": 2,
                  "llama_plain_command": ["llama-server", "-m", "t"], "llama_spec_command": ["llama-server", "-md", "d"],
                  "completion_fields": {"temperature": 0.0}, "specdec_fields": {"temperature": 0}},
        "llama_bench": [{"name": "target plain step", "n_prompt": 0, "tokens_per_second": 20.0, "ms_per_eval": 50.0},
                        {"name": "target 16-row eval", "n_prompt": 16, "tokens_per_second": 160.0, "ms_per_eval": 100.0}],
        "summary": summarise(runs, [4]), "mismatches": mismatches, "runs": runs,
    }
    md = render_markdown(results)
    assert "### 4 new tokens" in md and "### Per prompt, 4 new tokens" in md
    assert "llama-cpp-python 0.3.36 vendored llama.cpp" in md and "AMD EPYC" in md
    assert "costs 2.00× one plain step" in md
    table = per_prompt_table(runs, 4)
    assert len(table.splitlines()) == 4
    assert all(f"{label} tok/s" in table.splitlines()[0] for label in LABELS.values())


def test_a_swallowed_signal_still_stops_the_run(monkeypatch):
    monkeypatch.setattr(peer, "_signalled", [])
    peer.checkpoint()  # nothing arrived: goes on
    monkeypatch.setattr(peer, "_signalled", [signal.SIGTERM])
    with pytest.raises(SystemExit) as exc:
        peer.checkpoint()
    assert exc.value.code == 128 + signal.SIGTERM
    monkeypatch.setattr(peer, "_signalled", [signal.SIGINT])
    with pytest.raises(KeyboardInterrupt):
        peer.checkpoint()
