"""``python -m evaluation.pairprice``: what a target and each candidate draft cost per step on this
machine, and the speedup each draft would give over plain decoding as a function of acceptance.

Made for pairs whose weights cannot be downloaded here (GPT-2 with DistilGPT-2): ``random:gpt2``
and ``random:distilgpt2`` are the models' real configurations with random weights
(``evaluation.batchcost.random_model``); a step's cost depends on the shapes, not on the values.
Everything is measured in this process, in one run, with the services' own engines and thread
settings for a lone stream (all cores to whichever model computes, as when they alternate):

- the target: a plain step and verify passes of 2 … ``--max-k`` + 1 rows (specdec's runner);
- each draft, ``MODEL@BACKEND[:QUANT]``: milliseconds per drafted token, from one-token steps
  after ``--context`` tokens (llama.cpp: the model converted to GGUF at QUANT by
  ``specdec.model.gguf_convert``, as the draft service does; transformers: ``TransformersProposer``).

With ``--target-quant T`` the target is its GGUF conversion at T (``SPECDEC_TARGET_QUANT``'s
path: the file computed in its own format on specdec's kernels). ``--llama-bench`` adds llama.cpp's
own speculation priced the same way: llama-bench's eval of 1 … ``--max-k`` + 1 rows on the same
target file, and its one-token step of each llamacpp draft's file, both after ``--context``
tokens of depth (``-d``), fed to the same cost model.

The projection prices a step drafting k tokens with the orchestrator's own cost model
(``orchestrator.cost_model.CostModel``: the verify curve by rows and the per-token draft fit, fed
with the measurements above), and takes the expected tokens per step at a per-token acceptance a
as 1 + a + … + a^k (each draft token accepted independently with chance a): speedup(a) = max over
k of tokens(k) / round_ms(k), against 1 token per plain step. RPC round trips (a fixed cost per
call even on loopback: docs/benchmarks.md, "Per-call overhead") are not in it; ``docs/benchmarks.md``
puts a projection for the embedded pair next to what ``evaluation.bench`` measures end to end.
"""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evaluation import report

logger = logging.getLogger("evaluation.pairprice")

ACCEPTANCES = (0.6, 0.7, 0.8, 0.9, 0.95)


@dataclass(frozen=True)
class DraftSpec:
    label: str
    model: str  # a model id, folder, random:NAME, 'embedded' (shipped GGUF) or 'target'
    backend: str  # native | llamacpp | transformers
    quant: str = ""


def parse_draft(spec: str) -> DraftSpec:
    """``MODEL@BACKEND[:QUANT]``, e.g. ``random:distilgpt2@native:q8_0``, ``target@llamacpp:q4_0``,
    ``random:distilgpt2@transformers``."""
    model, sep, how = spec.rpartition("@")
    if not sep or not model:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected MODEL@BACKEND[:QUANT]")
    backend, _, quant = how.partition(":")
    if backend not in ("native", "llamacpp", "transformers"):
        raise argparse.ArgumentTypeError(f"{spec!r}: backend must be native, llamacpp or transformers")
    if backend == "transformers" and quant:
        raise argparse.ArgumentTypeError(f"{spec!r}: the transformers backend takes no quantisation")
    if backend in ("native", "llamacpp"):
        from specdec.model.gguf_convert import DEFAULT_QUANT, QUANTS

        quant = quant or DEFAULT_QUANT
        if quant not in QUANTS:
            raise argparse.ArgumentTypeError(f"{spec!r}: unknown quantisation {quant!r}; one of {', '.join(QUANTS)}")
    return DraftSpec(spec, model, backend, quant)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.pairprice", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--target", default="random:gpt2", help="target model (default random:gpt2)")
    p.add_argument("--target-quant", default=None,
                   help="run the target on its GGUF conversion at this type (q8_0, q4_k_m, ...; default: fp32)")
    p.add_argument("--llama-bench", nargs="?", const="build", default=None, metavar="DIR",
                   help="also price llama.cpp's own speculation from llama-bench on the same files (needs "
                        "--target-quant; DIR: a folder made by scripts/build_llama_server.sh, default: build or "
                        "reuse the cached one)")
    p.add_argument("--threads", type=int, default=0, help="llama-bench's threads (default: every core)")
    p.add_argument("--drafts", nargs="+", type=parse_draft,
                   default=[parse_draft(s) for s in (
                       "random:distilgpt2@transformers", "random:distilgpt2@native:q8_0", "random:distilgpt2@llamacpp:f16",
                       "random:distilgpt2@llamacpp:q8_0", "random:distilgpt2@llamacpp:q4_0",
                       "random:distilgpt2@llamacpp:q4_k_m", "target@llamacpp:q8_0", "target@llamacpp:q4_0")],
                   help="drafts, MODEL@BACKEND[:QUANT] (default: DistilGPT-2 on transformers, on specdec.native at "
                        "q8_0 and on llama.cpp at f16 q8_0 q4_0 q4_k_m, and the target itself at q8_0 and q4_0)")
    p.add_argument("--acceptances", type=lambda s: report.numbers(s, positive=False, empty=False), default=list(ACCEPTANCES),
                   help="per-token acceptance rates to project (default 0.6,0.7,0.8,0.9,0.95)")
    p.add_argument("--max-k", type=int, default=12, help="longest draft priced (default 12)")
    p.add_argument("--context", type=int, default=200, help="cached tokens before each measured step (default 200)")
    p.add_argument("--repeats", type=int, default=15, help="steps measured per point (median; default 15)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/pairprice-<timestamp>/)")
    args = p.parse_args(argv)
    for a in args.acceptances:
        if not 0 <= a < 1:
            p.error(f"acceptance {a} must be in [0, 1)")
    if args.llama_bench and not args.target_quant:
        p.error("--llama-bench prices llama.cpp on the target's GGUF file: give --target-quant too")
    if not 1 <= args.max_k <= 31:
        p.error("--max-k must be 1 to 31 (the target engine verifies up to 32 draft tokens)")
    return args


def target_costs(target: str, rows: list[int], context: int, repeats: int, quant: str | None = None
                 ) -> dict[int, float]:
    """Median ms of one target pass of q new rows (1: a plain step) after ``context`` cached tokens:
    ``evaluation.batchcost``'s measurement for one session on specdec's runner (on the target's
    GGUF conversion at ``quant`` when given)."""
    from evaluation.batchcost import target_costs as batch_costs

    costs, _ = batch_costs(argparse.Namespace(target=target, rows=rows, batches=[1], context=context, repeats=repeats,
                                              kernels=["runner"], native_against=None, target_quant=quant))
    return {q: costs[("runner", 1, q)] for q in rows}


def make_proposer(spec: DraftSpec, target: str, max_draft: int):
    from specdec.settings import default_cache_dir

    if spec.backend == "native":
        from draft_service.backends.native import NativeProposer
        from specdec.engine.sessions import SessionStore
        from specdec.model.gguf_convert import draft_gguf

        return NativeProposer(draft_gguf(spec.model, target, spec.quant, default_cache_dir()),
                              SessionStore(2, 1 << 30, 0), max_draft)
    if spec.backend == "llamacpp":
        from draft_service.backends.llamacpp import LlamaCppProposer
        from specdec.model.gguf_convert import draft_gguf

        # lookup guesses off: they speed up text that repeats, which random ids do not
        return LlamaCppProposer(str(draft_gguf(spec.model, target, spec.quant, default_cache_dir())), 2, 1 << 30, 0,
                                max_draft, lookup_ngram=0)
    from draft_service.backends.hf import TransformersProposer
    from specdec.engine.sessions import SessionStore
    from specdec.models import load_hf

    model = target if spec.model == "target" else spec.model
    return TransformersProposer(load_hf(model, "float32", "cpu", default_cache_dir()), SessionStore(2, 1 << 30, 0),
                                max_draft)


def draft_cost(proposer, context: int, repeats: int) -> float:
    """Median ms of a one-token draft step after ``context`` tokens (the prefill not counted)."""
    from evaluation.batchcost import draft_step_ms, random_ids

    return draft_step_ms(proposer, [proposer.prepare("d", random_ids(random.Random(1), context), repeats + 2)], repeats)


def llama_bench_costs(llama_dir: Path, model: Path, rows: list[int] | None, context: int, threads: int,
                      log: Path) -> dict[int, float]:
    """llama-bench's ms per eval of each row count in ``rows`` (None: one generated token, the
    draft's step) after ``context`` tokens of depth, on ``threads`` threads; its output in ``log``."""
    from evaluation.llamacpp import llama_bench_command, parse_llama_bench_rows, run_step

    cmd = llama_bench_command(llama_dir / "bin" / "llama-bench", model, threads, rows or 0, 0 if rows else 32,
                              depth=context, repetitions=5)
    logger.info("llama-bench: %s", " ".join(cmd[1:]))
    stdout = run_step(cmd, "llama-bench", log, timeout_s=1800, capture=True)
    return {(r["n_prompt"] or 1): r["ms_per_eval"] for r in parse_llama_bench_rows(stdout)}


def projected_speedup(verify_ms: dict[int, float], draft_token_ms: float, acceptance: float, max_k: int
                      ) -> tuple[float, int]:
    """(speedup over plain decoding, best k) for a lone stream, priced by the orchestrator's cost model."""
    from orchestrator.cost_model import CostModel

    costs = CostModel()
    for _ in range(3):  # fitted as the services report them, a few of each
        for rows, ms in verify_ms.items():
            costs.observe_verify(rows - 1, ms, rows=rows)
        for k in (1, 2, 4, 8):
            costs.observe_draft(k, k * draft_token_ms)
    plain = costs.round_ms(0)
    best, best_k = 1.0, 0
    for k in range(1, max_k + 1):
        tokens = sum(acceptance ** j for j in range(k + 1))
        speedup = tokens / costs.round_ms(k) * plain
        if speedup > best:
            best, best_k = speedup, k
    return best, best_k


def render(args: argparse.Namespace, verify_ms: dict[int, float], drafts: dict[str, float],
           projection: dict[str, dict[float, tuple[float, int]]], llama: dict[str, Any] | None = None) -> str:
    passes = [{"engine": "specdec", "ms": verify_ms}, *([{"engine": "llama.cpp", "ms": llama["verify_ms"]}] if llama else [])]
    pass_columns: list[tuple[str, report.Cell]] = [("engine", lambda r: r["engine"])]
    pass_columns += [(f"{q} row{'s' if q > 1 else ''}", lambda r, q=q: report.fmt(r["ms"][q]) if q in r["ms"] else "–")
                     for q in verify_ms]
    rows = [{"engine": "specdec", "step_ms": verify_ms[1], "label": label, "ms": ms, "by_a": projection[label]}
            for label, ms in drafts.items()]
    if llama:
        rows += [{"engine": "llama.cpp", "step_ms": llama["verify_ms"][1], "label": label, "ms": ms,
                  "by_a": llama["projection"][label]} for label, ms in llama["draft_token_ms"].items()]

    def at(a: float) -> report.Cell:
        def cell(r: dict[str, Any]) -> str:
            s, k = r["by_a"][a]
            return f"{s:.2f}× (k={k}), {1e3 * s / r['step_ms']:.1f} tok/s"
        return cell

    columns: list[tuple[str, report.Cell]] = [
        ("engine", lambda r: r["engine"]), ("draft", lambda r: f"`{r['label']}`"),
        ("ms per token", lambda r: report.fmt(r["ms"])), ("÷ target step", lambda r: f"{r['ms'] / r['step_ms']:.2f}"),
        *((f"a = {a:g}", at(a)) for a in args.acceptances)]
    return "\n".join(["Target passes (ms):", "", report.markdown_table(passes, pass_columns), "",
                      "Projected speedup over the engine's own plain decoding (best k), and tokens/s, by per-token "
                      "acceptance a:", "", report.markdown_table(rows, columns)])


def measure_llama(args: argparse.Namespace, target: str, log_dir: Path) -> dict[str, Any]:
    """llama.cpp's own pair, priced as specdec's: its verify curve on the target's file and its
    step on each llamacpp draft's file (llama-bench, its output under ``log_dir``), projected with
    the same cost model. SystemExit when llama.cpp cannot be built or run."""
    import os

    from evaluation.batchcost import resolve_target
    from evaluation.llamacpp import PeerError, build_llama, check_llama_dir
    from specdec.model.gguf_convert import draft_gguf
    from specdec.settings import default_cache_dir
    from target_service.verify import target_gguf

    try:
        folder = build_llama() if args.llama_bench == "build" else Path(args.llama_bench)
        check_llama_dir(folder)
        threads = args.threads or len(os.sched_getaffinity(0))
        target_file = target_gguf(target, args.target_quant, default_cache_dir())
        verify = llama_bench_costs(folder, target_file, list(range(1, args.max_k + 2)), args.context, threads,
                                   log_dir / "llama-bench-target.log")
        drafts = {}
        for i, spec in enumerate(s for s in args.drafts if s.backend == "llamacpp"):
            path = draft_gguf(resolve_target(spec.model), target, spec.quant, default_cache_dir())
            drafts[spec.label] = llama_bench_costs(folder, path, None, args.context, threads,
                                                   log_dir / f"llama-bench-draft-{i}.log")[1]
    except PeerError as exc:
        raise SystemExit(str(exc)) from None
    projection = {label: {a: projected_speedup(verify, ms, a, args.max_k) for a in args.acceptances}
                  for label, ms in drafts.items()}
    return {"verify_ms": verify, "draft_token_ms": drafts, "projection": projection, "llama_dir": str(folder)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, command = report.start_run("evaluation.pairprice", argv, args.out, "pairprice-")
    from evaluation.batchcost import resolve_target
    from specdec.process import configure_torch

    configure_torch(0)  # as the target service: all cores, bounded spin
    target = resolve_target(args.target)
    rows = list(range(1, args.max_k + 2))
    verify_ms = target_costs(target, rows, args.context, args.repeats, args.target_quant)
    logger.info("target: plain step %.1f ms, %d rows %.1f ms", verify_ms[1], rows[-1], verify_ms[rows[-1]])
    drafts: dict[str, float] = {}
    for spec in args.drafts:
        proposer = make_proposer(DraftSpec(spec.label, resolve_target(spec.model), spec.backend, spec.quant), target,
                                 args.repeats + 4)
        drafts[spec.label] = draft_cost(proposer, args.context, args.repeats)
        logger.info("draft %s: %.2f ms per token", spec.label, drafts[spec.label])
        del proposer
    projection = {label: {a: projected_speedup(verify_ms, ms, a, args.max_k) for a in args.acceptances}
                  for label, ms in drafts.items()}
    llama = measure_llama(args, target, out) if args.llama_bench else None
    table = render(args, verify_ms, drafts, projection, llama)
    results: dict[str, Any] = {
        "command": command, "target": args.target, "verify_ms": verify_ms, "draft_token_ms": drafts,
        "projection": {label: {str(a): {"speedup": s, "k": k} for a, (s, k) in by_a.items()}
                       for label, by_a in projection.items()},
        "target_quant": args.target_quant,
        **({"llama_cpp": {**llama, "projection": {label: {str(a): {"speedup": s, "k": k} for a, (s, k) in by_a.items()}
                                                  for label, by_a in llama["projection"].items()}}} if llama else {}),
    }
    report.write_report(out, results, f"# Pair prices\n\nCommand: `{command}`\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
