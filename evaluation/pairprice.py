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
  ``specdec.gguf_convert``, as the draft service does; transformers: ``TransformersProposer``).

The projection prices a step drafting k tokens with the orchestrator's own cost model
(``orchestrator.controller.CostModel``: the verify curve by rows and the per-token draft fit, fed
with the measurements above), and takes the expected tokens per step at a per-token acceptance a
as 1 + a + … + a^k (each draft token accepted independently with chance a): speedup(a) = max over
k of tokens(k) / round_ms(k), against 1 token per plain step. RPC round trips (about 1 ms a step on
loopback, docs/performance.md) are not in it; ``docs/benchmarks.md`` puts a projection for the
embedded pair next to what ``evaluation.bench`` measures end to end.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evaluation import report
from evaluation.client import write_results

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
        from specdec.gguf_convert import DEFAULT_QUANT, QUANTS

        quant = quant or DEFAULT_QUANT
        if quant not in QUANTS:
            raise argparse.ArgumentTypeError(f"{spec!r}: unknown quantisation {quant!r}; one of {', '.join(QUANTS)}")
    return DraftSpec(spec, model, backend, quant)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.pairprice", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--target", default="random:gpt2", help="target model (default random:gpt2)")
    p.add_argument("--drafts", nargs="+", type=parse_draft,
                   default=[parse_draft(s) for s in (
                       "random:distilgpt2@transformers", "random:distilgpt2@native:q8_0", "random:distilgpt2@llamacpp:f16",
                       "random:distilgpt2@llamacpp:q8_0", "random:distilgpt2@llamacpp:q4_0",
                       "random:distilgpt2@llamacpp:q4_k_m", "target@llamacpp:q8_0", "target@llamacpp:q4_0")],
                   help="drafts, MODEL@BACKEND[:QUANT] (default: DistilGPT-2 on transformers, on specdec.native at "
                        "q8_0 and on llama.cpp at f16 q8_0 q4_0 q4_k_m, and the target itself at q8_0 and q4_0)")
    p.add_argument("--acceptances", type=lambda s: [float(x) for x in s.split(",")], default=list(ACCEPTANCES),
                   help="per-token acceptance rates to project (default 0.6,0.7,0.8,0.9,0.95)")
    p.add_argument("--max-k", type=int, default=12, help="longest draft priced (default 12)")
    p.add_argument("--context", type=int, default=200, help="cached tokens before each measured step (default 200)")
    p.add_argument("--repeats", type=int, default=15, help="steps measured per point (median; default 15)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/pairprice-<timestamp>/)")
    args = p.parse_args(argv)
    for a in args.acceptances:
        if not 0 <= a < 1:
            p.error(f"acceptance {a} must be in [0, 1)")
    if not 1 <= args.max_k <= 31:
        p.error("--max-k must be 1 to 31 (the target engine verifies up to 32 draft tokens)")
    return args


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(n)]


def target_costs(target: str, rows: list[int], context: int, repeats: int) -> dict[int, float]:
    """Median ms of one target pass of q new rows (1: a plain step) after ``context`` cached tokens:
    ``evaluation.batchcost``'s measurement for one session on specdec's runner."""
    from evaluation.batchcost import target_costs as batch_costs

    costs, _ = batch_costs(argparse.Namespace(target=target, rows=rows, batches=[1], context=context, repeats=repeats,
                                              kernels=["runner"], native_against=None))
    return {q: costs[("runner", 1, q)] for q in rows}


def make_proposer(spec: DraftSpec, target: str, max_draft: int):
    from specdec.settings import default_cache_dir

    if spec.backend == "native":
        from draft_service.backends.native import NativeProposer
        from specdec.gguf_convert import draft_gguf
        from specdec.sessions import SessionStore

        return NativeProposer(draft_gguf(spec.model, target, spec.quant, default_cache_dir()),
                              SessionStore(2, 1 << 30, 0), max_draft)
    if spec.backend == "llamacpp":
        from draft_service.backends.llamacpp import LlamaCppProposer
        from specdec.gguf_convert import draft_gguf

        # lookup guesses off: they speed up text that repeats, which random ids do not
        return LlamaCppProposer(str(draft_gguf(spec.model, target, spec.quant, default_cache_dir())), 2, 1 << 30, 0,
                                max_draft, lookup_ngram=0)
    from draft_service.backends.hf import TransformersProposer
    from specdec.models import load_hf
    from specdec.sessions import SessionStore

    model = target if spec.model == "target" else spec.model
    return TransformersProposer(load_hf(model, "float32", "cpu", default_cache_dir()), SessionStore(2, 1 << 30, 0),
                                max_draft)


def draft_cost(proposer, context: int, repeats: int) -> float:
    """Median ms of a one-token draft step after ``context`` tokens (the prefill not counted)."""
    rng = random.Random(1)
    job = proposer.prepare("d", _ids(rng, context), repeats + 2)
    while not job.drafted:  # the prefill (in chunks) and the first token
        proposer.step([job])
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        proposer.step([job])
        times.append((time.perf_counter() - t) * 1e3)
    proposer.release("d")
    return statistics.median(times)


def projected_speedup(verify_ms: dict[int, float], draft_token_ms: float, acceptance: float, max_k: int
                      ) -> tuple[float, int]:
    """(speedup over plain decoding, best k) for a lone stream, priced by the orchestrator's cost model."""
    from orchestrator.controller import CostModel

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
           projection: dict[str, dict[float, tuple[float, int]]]) -> str:
    plain = verify_ms[1]
    lines = ["Target passes (ms):", "",
             "| rows | " + " | ".join(str(q) for q in verify_ms) + " |", "|---|" + "---:|" * len(verify_ms),
             "| ms | " + " | ".join(report.fmt(v) for v in verify_ms.values()) + " |", ""]
    head = ["draft", "ms per token", "÷ target step", *(f"a = {a:g}" for a in args.acceptances)]
    lines += ["Projected speedup over plain decoding (best k), by per-token acceptance a:", "",
              "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for label, ms in drafts.items():
        cells = [f"`{label}`", report.fmt(ms), f"{ms / plain:.2f}",
                 *(f"{s:.2f}× (k={k})" for s, k in projection[label].values())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, command = report.start_run("evaluation.pairprice", argv, args.out, "pairprice-")
    from evaluation.batchcost import resolve_target
    from specdec.runtime import configure_torch

    configure_torch(0)  # as the target service: all cores, bounded spin
    target = resolve_target(args.target)
    rows = list(range(1, args.max_k + 2))
    verify_ms = target_costs(target, rows, args.context, args.repeats)
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
    table = render(args, verify_ms, drafts, projection)
    results: dict[str, Any] = {
        "command": command, "target": args.target, "verify_ms": verify_ms, "draft_token_ms": drafts,
        "projection": {label: {str(a): {"speedup": s, "k": k} for a, (s, k) in by_a.items()}
                       for label, by_a in projection.items()},
    }
    write_results(out, results)
    (out / "results.md").write_text(f"# Pair prices\n\nCommand: `{command}`\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
