"""What ``python -m evaluation.peer`` measured, as results and as its report: the four modes, token
equality against both references, tokens/s and the like-for-like ratios, the tables of one target
type and of all of them, and ``report.md``."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evaluation import report
from evaluation.client import first_difference
from evaluation.stats import paired_speedup, spread, tokens_per_second

MODES = ("llama-plain", "llama-spec", "sd-autoregressive", "sd-speculative")
LABELS = {"llama-plain": "llama-server plain", "llama-spec": "llama-server speculative",
          "sd-autoregressive": "specdec autoregressive", "sd-speculative": "specdec speculative"}
# (specdec mode, llama-server mode) compared like for like
PAIRS = (("sd-autoregressive", "llama-plain"), ("sd-speculative", "llama-spec"))
# (speculative, plain) of each engine
OWN_SPEEDUPS = (("llama-spec", "llama-plain"), ("sd-speculative", "sd-autoregressive"))
REFERENCES = ("llama-plain", "sd-autoregressive")
LLAMA_MODES = ("llama-plain", "llama-spec")
BEST = "sd-speculative/llama-best"  # the ratios' key of specdec speculative against the faster llama-server mode
FP32 = "f32"  # the target type measured as before quantised targets: specdec's own fp32 weights


def target_env(quant: str) -> dict[str, str]:
    """The environment of specdec's target service for one target type: at f32 its default fp32
    weights, exactly as before quantised targets; otherwise the embedded model converted to
    ``quant`` (the file llama-server gets: ensure_gguf, same source, same cache)."""
    env = {"SPECDEC_TARGET_MODEL": "embedded"}
    return env if quant == FP32 else {**env, "SPECDEC_TARGET_QUANT": quant}


# ---- results ---------------------------------------------------------------------------------------

def find_mismatches(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run against the same prompt, length and repeat of every reference mode: marks
    ``differs_from`` on the runs ({reference: first differing position or None}) and returns one
    entry per differing pair, in run order."""
    refs = {(r["mode"], r["max_tokens"], r["prompt_id"], r["repeat"]): r["token_ids"] for r in runs if r["mode"] in REFERENCES}
    out = []
    for r in runs:
        r["differs_from"] = {}
        for ref in REFERENCES:
            if ref == r["mode"]:
                continue
            ids = refs.get((ref, r["max_tokens"], r["prompt_id"], r["repeat"]))
            if ids is None:
                continue
            pos = first_difference(ids, r["token_ids"])
            r["differs_from"][ref] = pos
            if pos is not None:
                out.append({"mode": r["mode"], "reference": ref, "max_tokens": r["max_tokens"], "prompt_id": r["prompt_id"],
                            "repeat": r["repeat"], "position": pos,
                            "reference_token": ids[pos] if pos < len(ids) else None,
                            "other_token": r["token_ids"][pos] if pos < len(r["token_ids"]) else None})
    return out


def summarise(runs: list[dict[str, Any]], lengths: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Per max-tokens value: per mode, tokens/s (all tokens / all HTTP wall time, and its spread
    over prompts), acceptance, differing outputs; and the ratios of each like-for-like pair."""
    out: dict[str, dict[str, Any]] = {}
    for n in lengths:
        at = [r for r in runs if r["max_tokens"] == n]
        modes: dict[str, dict[str, Any]] = {}
        for m in MODES:
            rs = [r for r in at if r["mode"] == m]
            if not rs:
                continue
            tokens, wall = sum(r["tokens"] for r in rs), sum(r["wall_ms"] for r in rs)
            drafted = sum(r.get("draft_tokens") or 0 for r in rs)
            s: dict[str, Any] = {
                "mode": m, "runs": len(rs), "tokens": tokens, "wall_ms": wall,
                "tokens_per_second": tokens / (wall / 1e3) if wall > 0 else None,
                "ms_per_token": wall / tokens if tokens else None,
                "per_prompt_tokens_per_second": spread([tokens_per_second(r) for r in rs]),
                "acceptance_rate": sum(r.get("accepted_tokens") or 0 for r in rs) / drafted if drafted else None,
                "draft_tokens": drafted,
            }
            for ref in REFERENCES:
                compared = [r for r in rs if ref in r.get("differs_from", {})]
                if compared:
                    s[f"differ_from_{ref}"] = sum(r["differs_from"][ref] is not None for r in compared)
                    s[f"compared_with_{ref}"] = len(compared)
            modes[m] = s
        ratios = {}
        for a, b in (*PAIRS, *OWN_SPEEDUPS):
            if a in modes and b in modes and modes[b]["tokens_per_second"]:
                ratios[f"{a}/{b}"] = {"total": modes[a]["tokens_per_second"] / modes[b]["tokens_per_second"],
                                      "per_prompt": paired_speedup(at, a, b)}
        best = best_speedup(at, modes)
        if best is not None:
            ratios[BEST] = best
        out[str(n)] = {"max_tokens": n, "modes": modes, "ratios": ratios}
    return out


def best_speedup(runs: list[dict[str, Any]], modes: dict[str, dict[str, Any]], mode: str = "sd-speculative",
                 peers: Sequence[str] = LLAMA_MODES) -> dict[str, Any] | None:
    """``mode`` against the faster of ``peers``: in total against the peer with the higher total
    tokens/s (named in ``peer``), per prompt against the faster peer on that prompt and repeat;
    None without ``mode`` or any peer."""
    measured = [m for m in peers if m in modes and modes[m]["tokens_per_second"]]
    if not measured or not modes.get(mode, {}).get("tokens_per_second"):
        return None
    peer = max(measured, key=lambda m: modes[m]["tokens_per_second"])
    fastest: dict[tuple[str, int], float] = {}
    for r in runs:
        if r["mode"] in measured:
            key = (r["prompt_id"], r["repeat"])
            fastest[key] = max(fastest.get(key, 0.0), tokens_per_second(r))
    per_prompt = [tokens_per_second(r) / fastest[(r["prompt_id"], r["repeat"])]
                  for r in runs if r["mode"] == mode and fastest.get((r["prompt_id"], r["repeat"]), 0) > 0]
    return {"total": modes[mode]["tokens_per_second"] / modes[peer]["tokens_per_second"], "peer": peer,
            "per_prompt": spread(per_prompt) if per_prompt else None}


def _tps(s: dict[str, Any] | None) -> str:
    return report.fmt(s["tokens_per_second"]) if s else "–"


def _spread(x: dict[str, Any] | None, digits: int = 1, suffix: str = "") -> str:
    if not x:
        return "–"
    return f"{report.fmt(x['median'], digits, suffix)} ({report.fmt(x['p10'], digits)}–{report.fmt(x['p90'], digits)})"


def _ratio(r: dict[str, Any] | None, per_prompt: bool = False) -> str:
    if not r:
        return "–"
    return _spread(r["per_prompt"], 2, "×") if per_prompt else report.fmt(r["total"], 2, "×")


def headline_table(length_summary: dict[str, Any]) -> str:
    """One length's table: the four modes as columns, then the like-for-like ratios."""
    modes, ratios = length_summary["modes"], length_summary["ratios"]

    def differ(ref: str) -> dict[str, str]:
        return {m: (f"{s[f'differ_from_{ref}']}/{s[f'compared_with_{ref}']}" if f"compared_with_{ref}" in s else "–")
                for m, s in modes.items()}

    own = {a: _ratio(ratios.get(f"{a}/{b}")) for a, b in OWN_SPEEDUPS}
    rows: list[dict[str, Any]] = [
        {"measure": "tok/s (all tokens / all HTTP wall time)", **{m: _tps(s) for m, s in modes.items()},
         "plain": _ratio(ratios.get("sd-autoregressive/llama-plain")), "spec": _ratio(ratios.get("sd-speculative/llama-spec")),
         "best": _ratio(ratios.get(BEST))},
        {"measure": "tok/s per prompt, median (p10–p90)",
         **{m: _spread(s["per_prompt_tokens_per_second"]) for m, s in modes.items()},
         "plain": _ratio(ratios.get("sd-autoregressive/llama-plain"), True),
         "spec": _ratio(ratios.get("sd-speculative/llama-spec"), True), "best": _ratio(ratios.get(BEST), True)},
        {"measure": "ms per token (HTTP wall)", **{m: report.fmt(s["ms_per_token"]) for m, s in modes.items()}},
        {"measure": "speculative over the same engine's plain", **own},
        {"measure": "draft acceptance", **{m: report.fmt(report.pct(s["acceptance_rate"]), 0, "%")
                                           for m, s in modes.items() if s["acceptance_rate"] is not None}},
        {"measure": "outputs differing from llama-server plain", **differ("llama-plain")},
        {"measure": "outputs differing from specdec autoregressive", **differ("sd-autoregressive")},
    ]
    columns: list[tuple[str, report.Cell]] = [("", lambda r: r["measure"])]
    columns += [(LABELS[m], lambda r, m=m: r.get(m, "–")) for m in MODES]
    columns += [("specdec AR / llama-server plain", lambda r: r.get("plain", "–")),
                ("specdec spec / llama-server spec", lambda r: r.get("spec", "–")),
                ("specdec spec / faster llama-server", lambda r: r.get("best", "–"))]
    return report.markdown_table(rows, columns)


def _differ(s: dict[str, Any] | None, ref: str) -> str:
    if not s or f"compared_with_{ref}" not in s:
        return "–"
    return f"{s[f'differ_from_{ref}']}/{s[f'compared_with_{ref}']}"


def overview_table(blocks: dict[str, dict[str, Any]]) -> str:
    """One row per (target type, length): the four modes' tok/s, specdec speculative against the
    faster llama-server mode, and which outputs differ token for token."""
    rows = []
    for quant, block in blocks.items():
        for key, s in block["summary"].items():
            modes, ratios = s["modes"], s["ratios"]
            best = ratios.get(BEST)
            rows.append({"quant": quant.upper(), "tokens": key, **{m: _tps(modes.get(m)) for m in MODES},
                         "best": _ratio(best), "best_per_prompt": _ratio(best, True),
                         "peer": LABELS[best["peer"]].removeprefix("llama-server ") if best else "–",
                         "plain": _ratio(ratios.get("sd-autoregressive/llama-plain")),
                         "ar_vs_llama": _differ(modes.get("sd-autoregressive"), "llama-plain"),
                         "spec_vs_ar": _differ(modes.get("sd-speculative"), "sd-autoregressive"),
                         "llama_spec_vs_plain": _differ(modes.get("llama-spec"), "llama-plain")})
    columns: list[tuple[str, report.Cell]] = [("target", lambda r: r["quant"]), ("new tokens", lambda r: r["tokens"])]
    columns += [(f"{LABELS[m]} tok/s", lambda r, m=m: r[m]) for m in MODES]
    columns += [("specdec spec / faster llama-server", lambda r: r["best"]),
                ("per prompt, median (p10–p90)", lambda r: r["best_per_prompt"]),
                ("faster llama-server", lambda r: r["peer"]),
                ("specdec AR / llama-server plain", lambda r: r["plain"]),
                ("specdec AR ≠ llama-server plain", lambda r: r["ar_vs_llama"]),
                ("specdec spec ≠ specdec AR", lambda r: r["spec_vs_ar"]),
                ("llama-server spec ≠ plain", lambda r: r["llama_spec_vs_plain"])]
    return report.markdown_table(rows, columns)


def mismatch_lines(mismatches: Sequence[dict[str, Any]], length: int, prompt_count: int) -> list[str]:
    """Per (mode, reference): how many outputs differ and where the first one does."""
    lines = []
    for ref in REFERENCES:
        for m in MODES:
            here = [x for x in mismatches if x["max_tokens"] == length and x["mode"] == m and x["reference"] == ref]
            if not here:
                continue
            x = here[0]
            lines.append(f"- {LABELS[m]} vs {LABELS[ref]}: {len(here)} of {prompt_count} differ; first: `{x['prompt_id']}` "
                         f"(repeat {x['repeat']}) at position {x['position']}: {_token(x, 'reference')} against "
                         f"{_token(x, 'other')}")
    return lines or ["- every output is identical token for token across the four modes"]


def _token(x: dict[str, Any], which: str) -> str:
    tok = x.get(f"{which}_token")
    if tok is None:
        return "(end)"
    text = x.get(f"{which}_text")
    return f"{tok} {text!r}" if text is not None else str(tok)


def per_prompt_table(runs: list[dict[str, Any]], length: int) -> str:
    at = [r for r in runs if r["max_tokens"] == length]
    ids = list(dict.fromkeys(r["prompt_id"] for r in at))
    rows = []
    for pid in ids:
        row: dict[str, Any] = {"prompt": pid}
        for m in MODES:
            rs = [r for r in at if r["prompt_id"] == pid and r["mode"] == m]
            wall = sum(r["wall_ms"] for r in rs)
            row[m] = sum(r["tokens"] for r in rs) / (wall / 1e3) if wall > 0 else None
            row["category"], row["prompt_tokens"] = (rs[0]["category"], rs[0]["prompt_tokens"]) if rs else ("", None)
        rows.append(row)

    def ratio(a: str, b: str) -> report.Cell:
        return lambda r: report.fmt(r[a] / r[b], 2, "×") if r.get(a) and r.get(b) else "–"

    columns: list[tuple[str, report.Cell]] = [("prompt", lambda r: r["prompt"]), ("category", lambda r: r["category"]),
                                              ("prompt tokens", lambda r: report.fmt(r["prompt_tokens"]))]
    columns += [(f"{LABELS[m]} tok/s", lambda r, m=m: report.fmt(r.get(m))) for m in MODES]
    columns += [("specdec AR / llama-server plain", ratio("sd-autoregressive", "llama-plain")),
                ("specdec spec / llama-server spec", ratio("sd-speculative", "llama-spec"))]
    return report.markdown_table(rows, columns)


def _bench_model(r: dict[str, Any]) -> str:
    return f"target {r.get('target_quant', FP32).upper()}" if r.get("model", "target") == "target" else "draft Q4_1"


def llama_bench_table(rows: Sequence[dict[str, Any]]) -> str:
    columns: list[tuple[str, report.Cell]] = [
        ("llama-bench", lambda r: r["name"]), ("model", _bench_model), ("rows per eval", lambda r: str(r["n_prompt"] or 1)),
        ("tokens/s", lambda r: report.fmt(r["tokens_per_second"])), ("ms per eval", lambda r: report.fmt(r["ms_per_eval"], 2)),
        ("threads", lambda r: report.fmt(r.get("threads"))), ("KV type", lambda r: str(r.get("type_k") or "–")),
    ]
    return report.markdown_table(rows, columns)


def quant_blocks(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per target type: its file, commands, services, summary and mismatches. A results.json from
    before ``--target-quant`` holds one F32 type at its top level."""
    if "by_quant" in results:
        return results["by_quant"]
    setup = results["setup"]
    return {FP32: {"target_gguf": setup["target_gguf"], "llama_plain_command": setup["llama_plain_command"],
                   "llama_spec_command": setup["llama_spec_command"], "services": results.get("services") or {},
                   "summary": results["summary"], "mismatches": results["mismatches"]}}


def runs_of(runs: Sequence[dict[str, Any]], quant: str) -> list[dict[str, Any]]:
    """The runs of one target type (runs from before ``--target-quant`` are F32)."""
    return [r for r in runs if r.get("target_quant", FP32) == quant]


def render_tables(results: dict[str, Any]) -> str:
    """The overview over the target types, then each type's per-length tables with their mismatch
    notes (what the command prints at the end)."""
    blocks = quant_blocks(results)
    out = ["### Every target type", "", overview_table(blocks), ""] if "by_quant" in results else []
    prompt_count = len(results["prompts"]) * results["repeats"]
    for quant, block in blocks.items():
        suffix = f", target {quant.upper()}" if "by_quant" in results else ""
        for key, s in block["summary"].items():
            out += [f"### {key} new tokens{suffix}", "", headline_table(s), "",
                    *mismatch_lines(block["mismatches"], s["max_tokens"], prompt_count), ""]
    return "\n".join(out)


def target_line(quant: str, block: dict[str, Any], source: str) -> str:
    """What each engine computes of the target at ``quant``."""
    name = Path(block["target_gguf"]).name
    info = (block.get("services") or {}).get("specdec", {}).get("target") or {}
    reported = f" (its Info: dtype {info['dtype']}, backend {info.get('backend', '?')})" if info.get("dtype") else ""
    if quant == FP32:
        return (f"Target F32: specdec: `{source}` as safetensors, fp32{reported}; llama-server: the same weights as GGUF "
                f"F32 `{name}` by llama.cpp's converter.")
    env = " ".join(f"{k}={v}" for k, v in (block.get("specdec_target_env") or target_env(quant)).items())
    return (f"Target {quant.upper()}: one file, `{name}` (llama.cpp's converter and quantiser), in both: llama-server "
            f"loads it; specdec's target service (`{env}`) runs it{reported}.")


def render_markdown(results: dict[str, Any]) -> str:
    m, llama = results["machine"], results["llama_cpp"]
    setup = results["setup"]
    blocks = quant_blocks(results)
    bench = results.get("llama_bench") or []
    lines = [
        f"# specdec against llama-server {results['started']}", "",
        f"Command: `{results['command']}`", "",
        f"Target: `{setup['target_source']}` at {', '.join(q.upper() for q in blocks)}, one type after another, each "
        f"with its own servers. Draft: the embedded Q4_1 GGUF `{Path(setup['draft_gguf']).name}` in both.", "",
        f"Prompts: {len(results['prompts'])} of suite v{results['suite']['version']} ({results['suite']['digest']}), "
        f"{results['repeats']} repeat(s), greedy, EOS ignored, one request at a time, the four modes interleaved per "
        f"prompt. tok/s = generated tokens / HTTP wall time on the client (prefill included). "
        f"Run took {results['duration_s'] / 60:.1f} min.", "",
        f"llama.cpp: {llama.get('source', '?')}; GGML flags `{' '.join(llama.get('ggml_flags', []))}`; other cmake flags "
        f"`{' '.join(llama.get('cmake_flags', []))}`; {llama.get('compiler', '?')}; `llama-server --version`: "
        f"{results.get('llama_server_version', '?')}.", "",
        report.machine_line(m, f"llama-server {setup['threads']} threads for the target and {setup['threads']} for the "
                               "draft; specdec's services at their defaults (all cores); "), "",
        "Requests: llama-server `/completion` with `" + json.dumps(setup["completion_fields"]) + "` and the prompt as ids; "
        "specdec `/v1/generate` with `" + json.dumps(setup["specdec_fields"]) + "` and the prompt text "
        "(its prompt token count checked against the ids).", "",
    ]
    for quant, block in blocks.items():
        lines += [target_line(quant, block, setup["target_source"]), "",
                  f"llama-server plain ({quant.upper()}): `" + shlex.join(block["llama_plain_command"]) + "`", "",
                  f"llama-server speculative ({quant.upper()}): `" + shlex.join(block["llama_spec_command"]) + "`", ""]
    lines += [render_tables(results)]
    for quant, block in blocks.items():
        suffix = f", target {quant.upper()}" if "by_quant" in results else ""
        for key in block["summary"]:
            lines += [f"### Per prompt, {key} new tokens{suffix}", "",
                      per_prompt_table(runs_of(results["runs"], quant), int(key)), ""]
    if bench:
        lines += ["### llama-bench (target and draft alone, llama.cpp's own timing)", "", llama_bench_table(bench), "",
                  *bench_cost_lines(bench)]
    return "\n".join(lines)


def bench_cost_lines(bench: Sequence[dict[str, Any]]) -> list[str]:
    """Per target type: what an eval of several rows costs in plain steps."""
    lines = []
    for quant in dict.fromkeys(r.get("target_quant", FP32) for r in bench if r.get("model", "target") == "target"):
        rows = [r for r in bench if r.get("model", "target") == "target" and r.get("target_quant", FP32) == quant]
        step = next((r for r in rows if not r["n_prompt"]), None)
        evals = [r for r in rows if r["n_prompt"]]
        if step and evals:
            counts = " / ".join(str(r["n_prompt"]) for r in evals)
            costs = " / ".join(f"{r['ms_per_eval'] / step['ms_per_eval']:.2f}×" for r in evals)
            lines += [f"Target {quant.upper()}: an eval of {counts} rows costs {costs} one plain step.", ""]
    return lines
