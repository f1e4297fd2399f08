"""The llama-server comparison over several target types (``evaluation.peer --target-quant``): the
option, what each type's servers and llama-bench are given, one type's processes stopped before the
next type's start, the ratio against the faster llama-server mode, and the report rendered from
synthetic results. Nothing is built or started here."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from evaluation import peer
from evaluation.llamacpp import VERIFY_ROWS, PeerError, llama_bench_command, parse_llama_bench_rows, run_llama_bench
from evaluation.peer import Inputs, measure_quant, parse_args, target_problem
from evaluation.peer_report import (
    BEST,
    MODES,
    find_mismatches,
    headline_table,
    overview_table,
    quant_blocks,
    render_markdown,
    render_tables,
    summarise,
    target_env,
)
from evaluation.prompts import Prompt
from specdec.model.gguf_convert import QUANTS

# ---- the option -------------------------------------------------------------------------------------


def test_target_quant_defaults_to_f32_alone():
    assert parse_args([]).target_quant == ["f32"]


def test_target_quant_takes_a_comma_separated_list_in_its_order_each_once():
    args = parse_args(["--target-quant", "f32, Q8_0,q4_k_m,q8_0"])
    assert args.target_quant == ["f32", "q8_0", "q4_k_m"]
    assert parse_args(["--target-quant", ",".join(QUANTS)]).target_quant == list(QUANTS)


@pytest.mark.parametrize("bad", ["q2_k", "", ",", "f32,q9"])
def test_unknown_target_types_are_refused_with_the_known_ones(bad, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--target-quant", bad])
    assert "q4_k_m" in capsys.readouterr().err  # the message lists what may be given


# ---- what each type's services get --------------------------------------------------------------------


def test_f32_keeps_the_fp32_target_and_other_types_quantise_it():
    assert target_env("f32") == {"SPECDEC_TARGET_MODEL": "embedded"}  # exactly the environment before types
    assert target_env("q4_k_m") == {"SPECDEC_TARGET_MODEL": "embedded", "SPECDEC_TARGET_QUANT": "q4_k_m"}


def test_a_target_that_does_not_compute_the_type_is_named():
    assert target_problem("f32", {"dtype": "float32", "backend": "torch"}) is None
    assert target_problem("q8_0", {"dtype": "Q8_0", "backend": "native"}) is None
    assert target_problem("q4_k_s", {"dtype": "gguf", "backend": "native"}) is None  # a type specdec has no name for
    # the variable not taken: the fp32 weights ran instead
    assert "float32" in target_problem("q8_0", {"dtype": "float32", "backend": "native"})
    assert "Q4_K_M" in target_problem("q4_k_m", {"dtype": "Q8_0", "backend": "native"})
    assert target_problem("q8_0", {}) is not None


def test_llama_bench_evaluates_every_verification_row_count_in_one_call():
    cmd = llama_bench_command("llama-bench", "t.gguf", 2, VERIFY_ROWS, 0)
    assert cmd[cmd.index("-p") + 1] == "1,5,9,17" and cmd[cmd.index("-n") + 1] == "0"
    rows = parse_llama_bench_rows(json.dumps([{"n_prompt": n, "n_gen": 0, "avg_ts": 100.0 * n} for n in VERIFY_ROWS]))
    assert [r["n_prompt"] for r in rows] == list(VERIFY_ROWS)
    assert all(r["ms_per_eval"] == pytest.approx(10.0) for r in rows)


def _fake_llama_bench(folder: Path) -> Path:
    """A llama-bench that prints one JSON row per -p value (or one -n row), at 100 tokens/s."""
    binary = folder / "bin" / "llama-bench"
    binary.parent.mkdir(parents=True)
    binary.write_text("""#!/usr/bin/env python3
import json, sys
a = sys.argv
p, n = [int(x) for x in a[a.index("-p") + 1].split(",")], int(a[a.index("-n") + 1])
rows = [{"n_prompt": 0, "n_gen": n}] if n else [{"n_prompt": x, "n_gen": 0} for x in p]
print(json.dumps([{**r, "avg_ts": 100.0, "n_threads": int(a[a.index("-t") + 1]), "model": a[a.index("-m") + 1]}
                  for r in rows]))
""")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return folder


def test_llama_bench_rows_of_one_type_name_their_type_and_row_count(tmp_path):
    llama = _fake_llama_bench(tmp_path / "llama")
    rows = run_llama_bench(llama, Path("/g/t-q8_0.gguf"), Path("/g/d.gguf"), 2, "f32", tmp_path, "q8_0")
    assert [r["name"] for r in rows] == ["target plain step", "target 1-row eval", "target 5-row eval", "target 9-row eval",
                                         "target 17-row eval", "draft plain step"]
    assert all(r["target_quant"] == "q8_0" and "t-q8_0.gguf" in r["command"] for r in rows if r["model"] == "target")
    assert "target_quant" not in rows[-1] and "d.gguf" in rows[-1]["command"]
    later = run_llama_bench(llama, Path("/g/t-q4_0.gguf"), Path("/g/d.gguf"), 2, "f32", tmp_path, "q4_0", ("target",))
    assert {r["model"] for r in later} == {"target"} and len(later) == 1 + len(VERIFY_ROWS)


# ---- one type after another, with its own processes -----------------------------------------------------


class _Events:
    """What the fake processes saw, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []


def _fakes(monkeypatch, events: _Events, dtype: dict[str, str]) -> None:
    """Stack, llama-server processes, the harness and the measurement replaced by recorders;
    the target's Info reports ``dtype[quant]`` for the type it was started with."""
    started: dict[str, str] = {}

    class Stack:
        def __init__(self, log_dir):
            self.services, self.log_dir = [], log_dir

        def model_service(self, name, kind, env):
            events.log.append(("start", (name, dict(env))))
            if kind == "target":
                started["quant"] = env.get("SPECDEC_TARGET_QUANT", "f32")
            return 1

        def orchestrator(self, name, draft, target, env=None):
            events.log.append(("start", (name, None)))
            return "http://sd"

        def close(self):
            events.log.append(("close", [s.name for s in self.services]))

    class Process:
        def __init__(self, name, cmd, log_dir):
            self.name, self.cmd = name, cmd
            events.log.append(("start", (name, cmd)))

    class Response:
        def __init__(self, body):
            self.body = body

        def json(self):
            return self.body

    class Http:
        def get(self, url):
            if url.endswith("/v1/info"):
                return Response({"target": {"dtype": dtype[started["quant"]], "backend": "native"}})
            return Response({"url": url})

    class Harness:
        def __init__(self, *a):
            self.http = Http()

        def close(self):
            pass

    def measure(client, prompts, prompt_ids, lengths, repeats):
        events.log.append(("measure", started["quant"]))
        same = [1, 2, 3, 4]
        return [_run(m, "a", same, 100.0) for m in MODES]

    monkeypatch.setattr(peer, "Stack", Stack)
    monkeypatch.setattr(peer, "Process", Process)
    monkeypatch.setattr(peer, "Harness", Harness)
    monkeypatch.setattr(peer, "wait_health", lambda url, proc: None)
    monkeypatch.setattr(peer, "measure", measure)


class _Tokenizer:
    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def _inputs(tmp_path: Path) -> Inputs:
    prompts = [Prompt("a", "code", False, "def f():")]
    return Inputs(tmp_path / "llama", tmp_path / "src", tmp_path / "d.gguf", prompts, {"a": [5, 6]}, _Tokenizer(),
                  tmp_path / "logs")


def test_each_type_gets_its_file_its_environment_and_its_own_processes(tmp_path, monkeypatch):
    events = _Events()
    _fakes(monkeypatch, events, {"f32": "float32", "q8_0": "Q8_0"})
    args = parse_args(["--target-quant", "f32,q8_0", "--max-tokens", "4", "--no-llama-bench", "--no-warmup",
                       "--threads", "2"])
    inputs = _inputs(tmp_path)
    blocks = {}
    for quant in args.target_quant:
        blocks[quant], runs, bench = measure_quant(args, inputs, quant, tmp_path / f"t-{quant}.gguf", bench_draft=False)
        assert {r["target_quant"] for r in runs} == {quant} and bench == []
        assert (tmp_path / "logs" / quant).is_dir()

    for quant, block in blocks.items():
        plain, spec = block["llama_plain_command"], block["llama_spec_command"]
        assert plain[plain.index("-m") + 1] == spec[spec.index("-m") + 1] == str(tmp_path / f"t-{quant}.gguf")
        assert spec[spec.index("-md") + 1] == str(tmp_path / "d.gguf") and "-md" not in plain
        assert block["specdec_target_env"] == target_env(quant) and block["target_gguf"].endswith(f"t-{quant}.gguf")
        assert set(block["summary"]) == {"4"}
    targets = [env for kind, (name, env) in (e for e in events.log if e[0] == "start") if name == "target"]
    assert targets == [{"SPECDEC_TARGET_MODEL": "embedded"},
                       {"SPECDEC_TARGET_MODEL": "embedded", "SPECDEC_TARGET_QUANT": "q8_0"}]
    # every process of the first type is stopped before the second type's first one starts
    kinds = [kind for kind, _ in events.log]
    assert kinds == ["start"] * 5 + ["measure", "close"] + ["start"] * 5 + ["measure", "close"]
    first_close = events.log[6][1]
    assert first_close == ["llama-plain", "llama-spec"]  # the llama-servers too (the fake stack holds only those)


def test_a_target_not_on_the_wanted_type_stops_the_run_before_measuring(tmp_path, monkeypatch):
    events = _Events()
    _fakes(monkeypatch, events, {"q4_k_m": "float32"})
    args = parse_args(["--target-quant", "q4_k_m", "--max-tokens", "4", "--no-llama-bench", "--no-warmup"])
    with pytest.raises(PeerError, match=r"computes float32 on native, not the GGUF Q4_K_M"):
        measure_quant(args, _inputs(tmp_path), "q4_k_m", tmp_path / "t.gguf", bench_draft=False)
    assert ("measure", "q4_k_m") not in events.log and events.log[-1][0] == "close"


# ---- statistics and the report ------------------------------------------------------------------------


def _run(mode, prompt, ids, wall_ms, n=4, repeat=0, drafted=0, accepted=0, quant=None):
    r = {"mode": mode, "prompt_id": prompt, "category": "code", "max_tokens": n, "repeat": repeat, "prompt_tokens": 5,
         "tokens": len(ids), "elapsed_ms": wall_ms, "wall_ms": wall_ms, "token_ids": ids,
         "draft_tokens": drafted, "accepted_tokens": accepted}
    return {"target_quant": quant, **r} if quant else r


def _runs(quant: str, spec_ms: tuple[float, float]) -> list[dict[str, Any]]:
    """Two prompts; llama-server speculative is faster on "a", plain on "b"."""
    same = [1, 2, 3, 4]
    return [
        _run("llama-plain", "a", same, 100.0, quant=quant),
        _run("llama-spec", "a", same, 50.0, drafted=8, accepted=6, quant=quant),
        _run("sd-autoregressive", "a", [1, 2, 9, 4], 100.0, quant=quant),
        _run("sd-speculative", "a", [1, 2, 9, 4], spec_ms[0], drafted=4, accepted=4, quant=quant),
        _run("llama-plain", "b", same, 80.0, quant=quant),
        _run("llama-spec", "b", same, 100.0, drafted=8, accepted=2, quant=quant),
        _run("sd-autoregressive", "b", same, 100.0, quant=quant),
        _run("sd-speculative", "b", same, spec_ms[1], drafted=2, accepted=1, quant=quant),
    ]


def test_speculative_is_set_against_the_faster_llama_server_mode():
    runs = _runs("q8_0", (25.0, 40.0))
    find_mismatches(runs)
    best = summarise(runs, [4])["4"]["ratios"][BEST]
    # in total: llama-spec (8 tokens in 150 ms) beats llama-plain (180 ms); specdec spec took 65 ms
    assert best["peer"] == "llama-spec" and best["total"] == pytest.approx(150 / 65)
    # per prompt: a against llama-spec (50 ms / 25 ms), b against llama-plain (80 ms / 40 ms)
    assert best["per_prompt"]["n"] == 2 and best["per_prompt"]["min"] == pytest.approx(2.0)
    assert best["per_prompt"]["max"] == pytest.approx(2.0)
    assert "sd-speculative/llama-best" not in summarise([r for r in runs if r["mode"] != "sd-speculative"], [4])["4"]["ratios"]


def _results(quants: tuple[str, ...]) -> dict[str, Any]:
    by_quant, runs, bench = {}, [], []
    for i, quant in enumerate(quants):
        rs = _runs(quant, (25.0 + 5 * i, 40.0))
        mismatches = find_mismatches(rs)
        by_quant[quant] = {
            "target_gguf": f"/g/t-{quant}.gguf", "specdec_target_env": target_env(quant),
            "llama_plain_command": ["llama-server", "-m", f"/g/t-{quant}.gguf"],
            "llama_spec_command": ["llama-server", "-m", f"/g/t-{quant}.gguf", "-md", "/g/d.gguf"],
            "services": {"specdec": {"target": {"dtype": "float32" if quant == "f32" else quant.upper(), "backend": "native"}}},
            "summary": summarise(rs, [4]), "mismatches": mismatches,
        }
        runs += rs
        bench += [{"name": "target plain step", "model": "target", "target_quant": quant, "n_prompt": 0, "n_gen": 64,
                   "tokens_per_second": 20.0, "ms_per_eval": 50.0}]
        bench += [{"name": f"target {n}-row eval", "model": "target", "target_quant": quant, "n_prompt": n, "n_gen": 0,
                   "tokens_per_second": 20.0 * n / (1 + i + n / 17), "ms_per_eval": 50.0 * (1 + i + n / 17)}
                  for n in VERIFY_ROWS]
    bench.append({"name": "draft plain step", "model": "draft", "n_prompt": 0, "n_gen": 64, "tokens_per_second": 200.0,
                  "ms_per_eval": 5.0})
    return {
        "started": "2026-12-06T12:00:00", "duration_s": 90.0, "command": "python -m evaluation.peer --target-quant f32,q8_0",
        "machine": {"cores": 2, "cpu": "AMD EPYC", "ram_gb": 8.0}, "llama_cpp": {"source": "llama-cpp-python 0.3.36"},
        "suite": {"version": "1", "digest": "abc"}, "prompts": ["a", "b"], "repeats": 1, "max_tokens": [4],
        "setup": {"target_source": "/m", "draft_gguf": "/g/d.gguf", "target_quants": list(quants), "threads": 2,
                  "completion_fields": {"temperature": 0.0}, "specdec_fields": {"temperature": 0}},
        "llama_bench": bench, "by_quant": by_quant, "runs": runs,
    }


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]


def test_overview_has_one_row_per_type_with_the_ratio_and_the_identity_columns():
    table = overview_table(_results(("f32", "q8_0"))["by_quant"])
    header, _, *rows = _rows(table)
    assert header[:2] == ["target", "new tokens"]
    for label in ("specdec spec / faster llama-server", "faster llama-server", "specdec AR / llama-server plain",
                  "specdec AR ≠ llama-server plain", "specdec spec ≠ specdec AR", "llama-server spec ≠ plain"):
        assert label in header
    col = {h: i for i, h in enumerate(header)}
    assert [r[0] for r in rows] == ["F32", "Q8_0"]
    assert rows[0][col["specdec spec / faster llama-server"]] == f"{150 / 65:.2f}×"
    assert rows[1][col["specdec spec / faster llama-server"]] == f"{150 / 70:.2f}×"
    assert rows[0][col["faster llama-server"]] == "speculative"
    assert rows[0][col["specdec AR ≠ llama-server plain"]] == "1/2"  # prompt a: 9 where llama-server has 3
    assert rows[0][col["specdec spec ≠ specdec AR"]] == "0/2" and rows[0][col["llama-server spec ≠ plain"]] == "0/2"


def test_headline_table_has_the_faster_llama_server_column():
    s = _results(("q8_0",))["by_quant"]["q8_0"]["summary"]["4"]
    header, _, *rows = _rows(headline_table(s))
    i = header.index("specdec spec / faster llama-server")
    assert rows[0][i] == f"{150 / 65:.2f}×" and rows[1][i].startswith("2.00× (2.00–2.00)")


def test_report_has_every_type_its_commands_and_its_llama_bench_rows():
    results = _results(("f32", "q8_0"))
    md = render_markdown(results)
    assert "### Every target type" in md
    for quant in ("F32", "Q8_0"):
        assert f"### 4 new tokens, target {quant}" in md and f"### Per prompt, 4 new tokens, target {quant}" in md
        assert f"llama-server plain ({quant}): `llama-server -m /g/t-{quant.lower()}.gguf`" in md
    assert "Target F32: specdec: `/m` as safetensors, fp32 (its Info: dtype float32" in md
    assert "Target Q8_0: one file, `t-q8_0.gguf`" in md and "SPECDEC_TARGET_QUANT=q8_0" in md
    assert "Target F32: an eval of 1 / 5 / 9 / 17 rows costs" in md
    assert "Target Q8_0: an eval of 1 / 5 / 9 / 17 rows costs" in md and "3.00× one plain step" in md
    bench = md.split("### llama-bench")[1]
    assert "| target Q8_0 |" in bench and "| draft Q4_1 |" in bench and "target 17-row eval" in bench
    # each type's per-prompt table holds its own runs only: two prompts
    per_prompt = md.split("### Per prompt, 4 new tokens, target Q8_0")[1].split("###")[0]
    assert len([line for line in per_prompt.splitlines() if line.startswith("| ")]) == 3
    assert render_tables(results) in md


def test_results_from_before_types_render_as_one_f32_type():
    results = _results(("f32",))
    block = results.pop("by_quant")["f32"]
    for r in results["runs"]:
        del r["target_quant"]
    results["setup"].update(target_gguf=block["target_gguf"], llama_plain_command=block["llama_plain_command"],
                            llama_spec_command=block["llama_spec_command"])
    results.update(summary=block["summary"], mismatches=block["mismatches"], services=block["services"])
    assert list(quant_blocks(results)) == ["f32"]
    md = render_markdown(results)
    assert "### 4 new tokens\n" in md and "### Every target type" not in md  # the headings it had
    assert "Target F32: specdec" in md


def test_report_only_renders_a_written_results_file(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(_results(("f32", "q4_k_m"))))
    assert peer.main(["--report-only", str(tmp_path)]) == 0
    assert "### 4 new tokens, target Q4_K_M" in (tmp_path / "report.md").read_text()
