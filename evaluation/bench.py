"""``python -m evaluation.bench``: measured speedup of specdec against plain decoding and HF
assisted generation, on the real services.

Modes (``--modes`` takes names or shell patterns such as ``'sd-fixed-*'``):

  hf-plain            (a) greedy ``model.generate`` of the target in this process, no services
  hf-assisted         (b) HF assisted generation with the best assistant transformers can run here:
                          the target's own weights with dynamic int8 quantisation (embedded default)
                          or ``--hf-assistant`` (e.g. distilgpt2 for gpt2)
  hf-prompt-lookup    (b) HF prompt lookup decoding (``prompt_lookup_num_tokens=10``)
  sd-autoregressive   (c) specdec with no draft (``mode: autoregressive``) through the services
  sd-fixed-k1 … k8    (d) specdec speculative, fixed draft length k, alternating (``overlap: false``)
  sd-acceptance, sd-hf, sd-cost   (d) specdec speculative with each adaptive controller, alternating
  sd-overlap-fixed-k3 … k8, sd-overlap-cost   (d) overlapped: the draft drafts block i + 1 while the
                          target verifies block i (``overlap: true``)
  ngram-fixed-k4, ngram-cost      (e) a second draft service with the n-gram backend and its own orchestrator
  NAME-fixed-k4, NAME-cost        (f) per ``--extra-draft NAME=SPEC``: one more llama.cpp draft service
                          (SPEC: a SPECDEC_DRAFT_MODEL value, optionally @QUANT, e.g. ``self-q8_0=target@q8_0``)
                          and its own orchestrator

Every draft service and orchestrator shares the one target service. For each drafting mode the
report adds acceptance by draft position and the draft's compute milliseconds per drafted token.

Runs are interleaved: for every prompt and repeat all modes run back to back, in an order rotated
per prompt, so slow drift of the machine hits every mode alike. Every mode decodes exactly
``--max-tokens`` greedy tokens past EOS, and its ids are compared with hf-plain's, token for token.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from evaluation import report
from evaluation.client import first_difference, generate_body, post_json, sync_client
from evaluation.modes import ASSISTED_MODES, Mode, parse_extra_draft, pick_modes, rotation
from evaluation.prompts import CATEGORIES, SUITE_VERSION, Prompt, load_suite, select, suite_digest
from evaluation.stats import summarise
from specdec.model.gguf_convert import QUANTS

logger = logging.getLogger("evaluation.bench")

# ---- running one mode --------------------------------------------------------------------------

class Harness:
    """Holds the in-process target, the HTTP clients and the prompt ids; runs one (mode, prompt)."""

    def __init__(self, generator: Any, urls: dict[str, str], max_tokens: int, threshold: float | None,
                 api_key: str | None = None) -> None:
        self.generator, self.urls, self.max_tokens, self.threshold = generator, urls, max_tokens, threshold
        self.http = sync_client(api_key)

    def run(self, mode: Mode, prompt: Prompt, prompt_ids: list[int], max_tokens: int | None = None) -> dict[str, Any]:
        n = max_tokens or self.max_tokens
        if mode.kind == "hf":
            ids, ms = self.generator.generate(prompt_ids, n, mode.how)
            return {"tokens": len(ids), "elapsed_ms": ms, "token_ids": ids}
        # the steps give k and the acceptance by draft position
        fields: dict[str, Any] = {"include_steps": True, **mode.body}
        if self.threshold is not None and mode.body.get("mode") != "autoregressive":
            fields["confidence_threshold"] = self.threshold
        out, wall = post_json(self.http, self.urls[mode.stack] + "/v1/generate", generate_body(prompt, n, **fields),
                              f"{mode.name} on {prompt.id}")
        stats = out["stats"]
        ks = [s["k"] for s in out["steps"]]
        return {
            "tokens": stats["tokens"], "elapsed_ms": stats["elapsed_ms"], "wall_ms": wall, "token_ids": out["token_ids"],
            "stats": stats, "mean_k": sum(ks) / len(ks) if ks else None, "k_sequence": ks,
            "positions": position_counts(out["steps"]),
            "prompt_tokens_server": out["prompt_tokens"], "prompt_tokens_match": out["prompt_tokens"] == len(prompt_ids),
        }

    def close(self) -> None:
        self.http.close()


# ---- acceptance by draft position ------------------------------------------------------------------

POSITIONS_SHOWN = 8  # draft positions in the report's table (results.json keeps all)


def position_counts(steps: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per draft position i of one generation's steps: ``drafted[i]`` steps that drafted a token at
    position i with every token before it accepted (the target judged token i), ``accepted[i]``
    steps that had it accepted: their ratio is the chance a draft token is accepted once the ones
    before it were, the rate the cost controller prices each position with."""
    n = max((len(s["draft"]) for s in steps), default=0)
    return {"drafted": [sum(1 for s in steps if len(s["draft"]) > i and s["accepted"] >= i) for i in range(n)],
            "accepted": [sum(1 for s in steps if s["accepted"] > i) for i in range(n)]}


def _add(lists: list[list[int]]) -> list[int]:
    """Element-wise sum of lists of different lengths."""
    n = max((len(x) for x in lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(n)]


def draft_positions(runs: list[dict[str, Any]], modes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per mode that drafted, over all its runs: acceptance at each draft position (accepted at i /
    steps that reached i, see :func:`position_counts`; counts summed before dividing, as time_split does) and
    the draft's server compute ms per drafted token."""
    out: dict[str, dict[str, Any]] = {}
    for m in modes:
        rs = [r for r in runs if r["mode"] == m and r.get("positions") and r.get("stats")]
        drafted = _add([r["positions"]["drafted"] for r in rs])
        if not drafted:
            continue  # not a drafting mode, or one whose controller never drafted
        accepted = _add([r["positions"]["accepted"] for r in rs])
        tokens = sum(r["stats"]["draft_tokens"] for r in rs)
        ms = sum(r["stats"]["draft_compute_ms"] for r in rs)
        # a position no step reached in these runs (a count of 0) has no acceptance
        out[m] = {"acceptance": [a / d if d else None for a, d in zip(accepted, drafted, strict=True)], "drafted": drafted,
                  "accepted": accepted, "draft_tokens": tokens, "draft_compute_ms": ms,
                  "ms_per_draft_token": ms / tokens if tokens else None}
    return out


def render_positions(positions: dict[str, dict[str, Any]]) -> str:
    """The acceptance-by-position table (mode × positions 0…7, ms per draft token); '' without drafts."""
    if not positions:
        return ""

    def at(i: int) -> report.Cell:
        return lambda p: report.fmt(report.pct(p["acceptance"][i]), 0, "%") if i < len(p["acceptance"]) else "–"

    columns: list[tuple[str, report.Cell]] = [
        ("mode", lambda p: p["mode"]), ("drafting steps", lambda p: report.fmt(p["drafted"][0])),
        *[(str(i), at(i)) for i in range(POSITIONS_SHOWN)],
        ("ms/draft token", lambda p: report.fmt(p["ms_per_draft_token"], 2)),
    ]
    rows = [{"mode": m, **p} for m, p in positions.items()]
    return "\n".join([
        "### Acceptance by draft position", "",
        "Position i: draft tokens accepted at i / steps whose draft reached i with every token before it accepted (all prompts "
        "and repeats). ms/draft token: the draft's server compute / tokens it drafted.", "",
        report.markdown_table(rows, columns), "",
    ])


# ---- the benchmark -------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--target", default="embedded", help="target model: HF id, local folder, or 'embedded' (default)")
    p.add_argument("--draft", default="embedded", help="draft model of the main draft service (id, folder, .gguf or 'embedded')")
    p.add_argument("--draft-backend", default="auto", choices=["auto", "native", "llamacpp", "transformers", "ngram"],
                   help="backend of the main draft service (default auto, the service's own default)")
    p.add_argument("--extra-draft", action="append", type=parse_extra_draft, default=[], metavar="NAME=SPEC",
                   help="one more llama.cpp draft service and orchestrator over the same target, with modes NAME-fixed-k4 "
                        "and NAME-cost; SPEC: a SPECDEC_DRAFT_MODEL value ('target': the target itself), optionally "
                        f"@QUANT ({', '.join(QUANTS)}), e.g. self-q8_0=target@q8_0; repeatable")
    p.add_argument("--hf-assistant", default=None,
                   help="assistant of hf-assisted: 'int8' (the target with dynamic int8 quantisation) or a model id/path; "
                        "default: --draft when the draft backend is transformers, else int8")
    p.add_argument("--prompts", type=int, default=None, help="use N prompts, taken round-robin over the categories")
    p.add_argument("--categories", nargs="*", choices=CATEGORIES, help="only these prompt categories")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per generation (EOS ignored); default 128")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (mode, prompt); default 1")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads of every model (default: each service's own default; all cores in-process)")
    p.add_argument("--modes", nargs="*", help="mode names or shell patterns (default: all)")
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="draft confidence threshold sent with speculative requests (default: the server's)")
    p.add_argument("--url", default=None, help="use this running orchestrator for the sd-* modes instead of starting services")
    p.add_argument("--ngram-url", default=None, help="with --url: a running orchestrator over an n-gram draft for ngram-* modes")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY") or None,
                   help="API key for orchestrators that require one (default: $SPECDEC_API_KEY)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/<timestamp>/)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each mode")
    p.add_argument("--report-only", type=Path, metavar="DIR",
                   help="measure nothing: re-render results.md and the plots of DIR/results.json")
    args = p.parse_args(argv)
    names = [e.name for e in args.extra_draft]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        p.error(f"--extra-draft: {', '.join(twice)} given more than once")
    if args.extra_draft and args.url:
        p.error("--extra-draft starts its own services: it does not combine with --url")
    return args


def rerender(folder: Path) -> None:
    """Plots and results.md again from ``folder/results.json`` (after changing the renderers)."""
    results = report.read_results(folder)
    results["summary"] = summarise(results["runs"], results["modes"], assisted=ASSISTED_MODES)
    results["draft_positions"] = draft_positions(results["runs"], results["modes"])
    plots = write_plots(results, folder)
    (folder / "results.md").write_text(render_markdown(results, plots))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        logging.basicConfig(level=logging.INFO)
        rerender(args.report_only)
        return 0
    out, command = report.start_run("evaluation.bench", argv, args.out, quiet=("httpx", "transformers", "matplotlib"))

    prompts = select(load_suite(), args.prompts, args.categories)
    modes = _modes(args)
    if not modes or not prompts:
        raise SystemExit("nothing to run: no modes or no prompts selected")
    t_start = time.perf_counter()
    started = datetime.now().isoformat(timespec="seconds")
    measured = _run_modes(args, out, modes, prompts)
    names = [m.name for m in modes]
    summary = summarise(measured["runs"], names, assisted=ASSISTED_MODES)
    positions = draft_positions(measured["runs"], names)
    elapsed_s = time.perf_counter() - t_start
    results = {
        "started": started, "duration_s": round(elapsed_s, 1), "command": command,
        "args": report.args_record(args, drop=("api_key",)),
        "suite": {"version": SUITE_VERSION, "digest": suite_digest(), "prompts": [p.to_dict() for p in prompts]},
        "pair": {"target": args.target, "draft": args.draft, "draft_backend": args.draft_backend,
                 "hf_assistant": measured["assistant"], "services": measured["info"],
                 "extra_drafts": [{"name": e.name, "model": e.model, "quant": e.quant} for e in args.extra_draft]},
        "machine": measured["machine"], "max_tokens": args.max_tokens, "repeats": args.repeats,
        "modes": names, "summary": summary, "draft_positions": positions, "mismatches": measured["mismatches"],
        "runs": measured["runs"],
    }
    report.write_report(out, results, render_markdown(results, write_plots(results, out)))
    logger.info("done in %.0f s: %s", elapsed_s, out)
    print(report.render_tables(summary))
    print(render_positions(positions))
    return 0


def _run_modes(args: argparse.Namespace, out: Path, modes: list[Mode], prompts: list[Prompt]) -> dict[str, Any]:
    """The target loaded here, the services started (or reached), every mode run on every prompt
    (after an untimed warm-up each) and compared with hf-plain; every service stopped again.
    Returns the runs, the mismatches, each orchestrator's /v1/info, the machine and the assistant."""
    from evaluation.hf import encode, explain_mismatch
    from evaluation.procs import Stack

    target, generator, assistant_desc, machine = _in_process(args, modes)
    prompt_ids = {p.id: encode(target.tokenizer, p) for p in prompts}
    stack = Stack(out / "logs")
    harness = None
    try:
        urls = _stack_urls(args, modes, stack)
        harness = Harness(generator, urls, args.max_tokens, args.confidence_threshold, args.api_key)
        info = {name: harness.http.get(url + "/v1/info").json() for name, url in urls.items()}
        if not args.no_warmup:
            from tqdm import tqdm

            first = prompts[0]
            for m in tqdm(modes, desc="warm-up", unit="mode", leave=False):
                harness.run(m, first, prompt_ids[first.id], max_tokens=8)
        runs = measure(harness, modes, prompts, prompt_ids, args.repeats)
        machine["load_average_end"] = list(os.getloadavg())
        mismatches = _compare_outputs(runs, prompts, prompt_ids, generator, target, args.max_tokens, explain_mismatch)
    finally:
        if harness is not None:
            harness.close()
        stack.close()
    return {"runs": runs, "mismatches": mismatches, "info": info, "machine": machine, "assistant": assistant_desc}


def _in_process(args: argparse.Namespace, modes: list[Mode]) -> tuple[Any, Any, str, dict[str, Any]]:
    """The target loaded in this process (the hf-* modes and the reference outputs), the HF
    generator over it (with an assistant for hf-assisted), the assistant's description and the
    machine's description."""
    import torch
    from transformers.utils import logging as hf_logging

    from evaluation.hf import HFGenerator, int8_assistant
    from specdec.models import load_hf

    hf_logging.set_verbosity_error()
    in_process_threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(in_process_threads)
    machine = report.machine_info(in_process_threads)
    machine["service_threads"] = args.threads or "service defaults"
    logger.info("loading target %s in this process (%d threads)", args.target, in_process_threads)
    target = load_hf(args.target)
    assistant, assistant_desc = None, ""
    if any(m.how == "assisted" for m in modes):
        choice = args.hf_assistant or (args.draft if args.draft_backend == "transformers" else "int8")
        if choice == "int8":
            assistant, assistant_desc = int8_assistant(target.model), f"{args.target} with torch dynamic int8 (Linear layers)"
        else:
            assistant, assistant_desc = load_hf(choice).model, choice
        logger.info("hf-assisted assistant: %s", assistant_desc)
    return target, HFGenerator(target.model, target.tokenizer, assistant), assistant_desc, machine


def _modes(args: argparse.Namespace) -> list[Mode]:
    """The modes to run: --modes, less those whose stack this run cannot start or reach."""
    modes = pick_modes(args.modes, args.extra_draft)
    if args.url and any(m.stack == "ngram" for m in modes) and not args.ngram_url:
        logger.warning("--url without --ngram-url: skipping the ngram-* modes")
        modes = [m for m in modes if m.stack != "ngram"]
    if args.draft_backend == "ngram":
        modes = [m for m in modes if m.stack != "ngram"]  # the main stack is the n-gram one already
    for e in args.extra_draft:
        if not any(m.stack == e.name for m in modes):
            logger.warning("--extra-draft %s: --modes selects none of its modes; not starting it", e.name)
    return modes


def _stack_urls(args: argparse.Namespace, modes: list[Mode], stack: Any) -> dict[str, str]:
    """The orchestrator URL of each stack the modes use: given (--url, --ngram-url) or started."""
    urls: dict[str, str] = {}
    # without --threads the services run with their own defaults, which is what users get
    threads = {"SPECDEC_TARGET_THREADS": str(args.threads)} if args.threads else {}
    draft_threads = {"SPECDEC_DRAFT_THREADS": str(args.threads)} if args.threads else {}
    if args.url:
        urls["main"] = args.url.rstrip("/")
        if args.ngram_url:
            urls["ngram"] = args.ngram_url.rstrip("/")
        return urls
    if not any(m.kind == "specdec" for m in modes):
        return urls
    logger.info("starting the services (logs in %s)", stack.log_dir)
    stack.log_dir.mkdir(parents=True, exist_ok=True)
    tport = stack.model_service("target", "target", {"SPECDEC_TARGET_MODEL": args.target, **threads})
    # SPECDEC_DRAFT_TARGET_MODEL: for --draft target, the model the target service runs
    dport = stack.model_service("draft", "draft", {"SPECDEC_DRAFT_MODEL": args.draft,
                                                   "SPECDEC_DRAFT_BACKEND": args.draft_backend,
                                                   "SPECDEC_DRAFT_TARGET_MODEL": args.target, **draft_threads})
    urls["main"] = stack.orchestrator("orchestrator", dport, tport)
    if any(m.stack == "ngram" for m in modes):
        nport = stack.model_service("draft-ngram", "draft", {"SPECDEC_DRAFT_BACKEND": "ngram"})
        urls["ngram"] = stack.orchestrator("orchestrator-ngram", nport, tport)
    for e in args.extra_draft:
        if any(m.stack == e.name for m in modes):
            # a first start converts the model (its log says how far); a failed one ends the bench
            eport = stack.model_service(f"draft-{e.name}", "draft", {**e.env(args.target), **draft_threads})
            urls[e.name] = stack.orchestrator(f"orchestrator-{e.name}", eport, tport)
    return urls


def _compare_outputs(runs: list[dict[str, Any]], prompts: list[Prompt], prompt_ids: dict[str, list[int]],
                     generator: Any, target: Any, max_tokens: int, explain: Any) -> list[dict[str, Any]]:
    """Every run against hf-plain's ids for the same prompt (computed untimed when hf-plain was not
    measured): marks each run ``identical`` (or its ``mismatch``) and returns the mismatches."""
    reference: dict[str, list[int]] = {}
    for r in runs:
        if r["mode"] == "hf-plain" and r["repeat"] == 0:
            reference[r["prompt_id"]] = r["token_ids"]
    for p in prompts:
        if p.id not in reference:
            reference[p.id], _ = generator.generate(prompt_ids[p.id], max_tokens, "plain")
    mismatches = []
    explained: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in runs:
        ref = reference[r["prompt_id"]]
        pos = first_difference(ref, r["token_ids"])
        r["identical"] = pos is None
        if pos is not None:
            other = r["token_ids"][pos] if pos < len(r["token_ids"]) else -1
            key = (r["prompt_id"], pos, other)
            if key not in explained:
                explained[key] = explain(target.model, target.tokenizer, prompt_ids[r["prompt_id"]], ref,
                                         r["token_ids"]) or {}
            r["mismatch"] = explained[key]
            mismatches.append({"mode": r["mode"], "prompt_id": r["prompt_id"], "repeat": r["repeat"], **explained[key]})
    return mismatches


def measure(harness: Harness, modes: list[Mode], prompts: list[Prompt], prompt_ids: dict[str, list[int]],
            repeats: int) -> list[dict[str, Any]]:
    from tqdm import tqdm

    runs: list[dict[str, Any]] = []
    bar = tqdm(total=len(modes) * len(prompts) * repeats, desc="benchmark", unit="run")
    try:
        for rep in range(repeats):
            for i, p in enumerate(prompts):
                for m in rotation(modes, i + rep * len(prompts)):
                    bar.set_postfix_str(f"{m.name} / {p.id}")
                    r = harness.run(m, p, prompt_ids[p.id])
                    runs.append({"mode": m.name, "prompt_id": p.id, "category": p.category, "repeat": rep,
                                 "prompt_tokens": len(prompt_ids[p.id]), **r})
                    bar.update()
    finally:
        bar.close()
    return runs


def write_plots(results: dict[str, Any], out: Path) -> dict[str, str]:
    summary, runs = results["summary"], results["runs"]
    pair = f"{results['pair']['target']} / {results['pair']['draft']} ({results['pair']['draft_backend']})"
    plots: dict[str, str] = {}
    extra = tuple(f"{e['name']}-" for e in results["pair"].get("extra_drafts", []))
    drafting = [m for m in results["modes"] if m.startswith(("sd-", "ngram-", *extra)) and m != "sd-autoregressive"]
    for name, path in (
        ("speedup_vs_k", report.plot_speedup_vs_k(summary, out / "speedup_vs_k.png", f"Speedup vs k — {pair}")),
        ("time_split", report.plot_time_split(summary, out / "time_split.png", f"Time per generated token — {pair}")),
        ("acceptance_by_category", report.plot_acceptance_by_category(
            runs, [m for m in drafting if m in ("sd-fixed-k1", "sd-fixed-k4", "sd-fixed-k8", "sd-acceptance", "sd-hf",
                                                "sd-cost") or m.startswith(("ngram-", *extra))],
            CATEGORIES, out / "acceptance_by_category.png", f"Acceptance by prompt category — {pair}")),
    ):
        if path is not None:
            plots[name] = path.name
    return plots


def render_markdown(results: dict[str, Any], plots: dict[str, str], img_prefix: str = "") -> str:
    m = results["machine"]
    lines = [
        f"# Benchmark {results['started']}", "",
        f"Command: `{results['command']}`", "",
        f"Pair: target `{results['pair']['target']}`, draft `{results['pair']['draft']}` "
        f"({results['pair']['draft_backend']}); hf-assisted assistant: {results['pair']['hf_assistant'] or '–'}.", "",
        f"Prompts: {len(results['suite']['prompts'])} of suite v{results['suite']['version']} "
        f"({results['suite']['digest']}), {results['max_tokens']} new tokens each (EOS ignored), "
        f"{results['repeats']} repeat(s), modes interleaved. Run took {results['duration_s'] / 60:.1f} min.", "",
        report.machine_line(m, f"torch {m['torch']}, transformers {m['transformers']}, llama-cpp-python "
                               f"{m['llama_cpp_python']}, Python {m['python']}; {m['threads']} threads in-process, "
                               f"services: {m.get('service_threads', m['threads'])} threads; "),
    ]
    extras = results["pair"].get("extra_drafts")
    if extras:
        lines += ["", "Extra drafts (llama.cpp, each with its own orchestrator over the same target): " + ", ".join(
            f"`{e['name']}` = `{e['model']}` at {e['quant'] or 'the service default quantisation'}" for e in extras) + "."]
    positions = render_positions(results.get("draft_positions", {}))
    lines += [
        "", report.render_tables(results["summary"]), *([positions] if positions else []),
        "### Token equality against hf-plain", "",
        report.render_mismatches(results["mismatches"]), "",
    ]
    for name, file in plots.items():
        lines += [f"![{name}]({img_prefix}{file})", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
