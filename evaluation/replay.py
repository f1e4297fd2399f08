"""``python -m evaluation.replay``: which draft length and confidence threshold pay on this
machine, from one pass over the target's greedy outputs instead of a benchmark per setting.

Greedy speculation is deterministic: whatever k and threshold, the output is the target's greedy
output, and a round that starts at position s accepts the draft's tokens while they equal that
output. So the tool, in this process (no RPC):

1. decodes ``--max-tokens`` greedy tokens of each prompt with the target engine;
2. asks the draft for ``max(--ks)`` tokens (threshold 0) from *every* position of those outputs,
   keeping each token's confidence;
3. measures a target pass by rows (1 up to ``max(--ks) + 1``) and a draft token, interleaved;
4. replays every (k, threshold) pair: from position s, draft until k tokens or the first below the
   threshold (that one included), accept the leading ones that match, add the target's token, go on
   from there; cost per round = pass(drafted + 1 rows) + drafted * draft token + ``--overhead-ms``.

The predicted speedup is plain decoding's cost per token (one-row pass + overhead) over that. It is
an in-process figure, above what the services reach (their verify grows more with the rows), so
use it to rank settings, and ``evaluation.bench`` to measure the chosen one.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evaluation import report
from evaluation.client import first_difference
from orchestrator.cost_fits import CostCurve

logger = logging.getLogger("evaluation.replay")


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    confidences: list[float]


@dataclass
class Replay:
    rounds: int = 0
    tokens: int = 0  # output tokens landed (accepted + the target's own)
    drafted: int = 0
    cost_ms: float = 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0


def drafted_length(proposal: Proposal, k: int, threshold: float) -> int:
    """Tokens a draft asked for ``k`` with this threshold would propose: up to k, stopping after
    the first whose confidence is below the threshold."""
    for i, confidence in enumerate(proposal.confidences[:k]):
        if confidence < threshold:
            return i + 1
    return min(k, len(proposal.tokens))


def replay(output: Sequence[int], proposals: Sequence[Proposal], k: int, threshold: float,
           pass_ms: Callable[[int], float], draft_token_ms: float, overhead_ms: float) -> Replay:
    """Speculative rounds over one greedy ``output``; ``proposals[s]``: the draft's tokens from
    position s of it (after the prompt and ``output[:s]``)."""
    r = Replay()
    s = 0
    while s < len(output):
        n = min(drafted_length(proposals[s], k, threshold), len(output) - s - 1)
        draft = proposals[s].tokens[:max(n, 0)]
        # the leading draft tokens that match the output are accepted
        first_wrong = first_difference(draft, output[s:s + len(draft)])
        accepted = len(draft) if first_wrong is None else first_wrong
        r.rounds += 1
        r.tokens += accepted + 1
        r.drafted += len(draft)
        r.cost_ms += pass_ms(len(draft) + 1) + len(draft) * draft_token_ms + overhead_ms
        s += accepted + 1
    return r


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    floats = lambda s: report.numbers(s, positive=False, empty=False)  # noqa: E731
    ints = lambda s: report.numbers(s, int, positive=False, empty=False)  # noqa: E731
    p = argparse.ArgumentParser(prog="python -m evaluation.replay", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--prompts", type=int, default=12, help="prompts of the suite, round-robin over categories (default 12)")
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per prompt (default 128)")
    p.add_argument("--ks", type=ints, default=[4, 8, 12, 16], help="draft lengths to replay (default 4,8,12,16)")
    p.add_argument("--thresholds", type=floats, default=[0.0, 0.1, 0.2, 0.3],
                   help="confidence thresholds to replay (default 0,0.1,0.2,0.3)")
    p.add_argument("--overhead-ms", type=float, default=5.0,
                   help="RPC and loop time per round outside the forward passes (default 5, as measured)")
    p.add_argument("--repeats", type=int, default=7, help="timings per cost point (default 7)")
    p.add_argument("--target", default="embedded", help="target model (default the embedded one)")
    p.add_argument("--draft", default="embedded", help="draft GGUF for llama.cpp (default the embedded one)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/replay-<timestamp>/)")
    return p.parse_args(argv)


def collect(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[int, float], float]:
    """(per prompt: output and proposals, pass ms by rows, draft ms per token)."""
    from draft_service.backends.llamacpp import LlamaCppProposer
    from evaluation.hf import encode
    from evaluation.prompts import load_suite, select
    from specdec.engine.sessions import SessionStore
    from specdec.model.gguf_convert import draft_gguf
    from specdec.models import load_hf
    from specdec.settings import default_cache_dir
    from target_service.verify import TargetEngine

    k_max = max(args.ks)
    loaded = load_hf(args.target, "float32", "cpu", default_cache_dir())
    engine = TargetEngine(loaded, SessionStore(16, 4 << 30, 0), max_draft_tokens=max(32, k_max))
    proposer = LlamaCppProposer(str(draft_gguf(args.draft, args.target)), 4, 1 << 30, 0, max(32, k_max))
    data, draft_ms = [], []
    prompts = select(load_suite(), args.prompts)
    for n, prompt in enumerate(prompts, 1):
        ids = encode(loaded.tokenizer, prompt)
        seq = list(ids)
        for _ in range(args.max_tokens):
            seq.append(engine.verify("replay", seq).next_token)
        proposals = []
        for s in range(args.max_tokens):
            p = proposer.propose("replay", seq[:len(ids) + s], k_max, 0.0)
            proposals.append(Proposal(p.tokens, p.confidences))
            if p.tokens:
                draft_ms.append(p.compute_ns / 1e6 / len(p.tokens))
        data.append({"id": prompt.id, "prompt_tokens": len(ids), "output": seq[len(ids):], "proposals": proposals})
        logger.info("prompt %d/%d (%s): output and %d proposals", n, len(prompts), prompt.id, len(proposals))
    engine.release("replay")
    proposer.release("replay")
    rng = random.Random(0)
    context = data[-1]["output"] if data else [1]
    rows = sorted({1, 2, 3, 5, 9, *(min(k, 64) + 1 for k in args.ks)})
    engine.verify("cost", context)
    times: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(args.repeats):
        for r in rows:  # interleaved, so drift of the machine hits each alike
            job = engine.prepare("cost", context + [rng.randrange(100, 1000)], [rng.randrange(100, 1000) for _ in range(r - 1)])
            t = time.perf_counter()
            engine.step([job])
            times[r].append((time.perf_counter() - t) * 1e3)
    return data, {r: statistics.median(v) for r, v in times.items()}, statistics.median(draft_ms)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, command = report.start_run("evaluation.replay", argv, args.out, "replay-")
    from specdec.process import configure_torch

    configure_torch(0)  # as the target service: all cores, bounded spin
    data, pass_points, draft_token_ms = collect(args)
    # the orchestrator's own cost curve: linear between measured sizes, never cheaper beyond them
    curve = CostCurve(decay=1.0)
    for rows, ms in pass_points.items():
        curve.add(rows, ms)

    def pass_ms(rows: int) -> float:
        return curve.predict(rows, 0.0)

    plain_ms = pass_ms(1) + args.overhead_ms
    total = sum(len(d["output"]) for d in data)
    rows = []
    for k in args.ks:
        for threshold in args.thresholds:
            r = Replay()
            for d in data:
                one = replay(d["output"], d["proposals"], k, threshold, pass_ms, draft_token_ms, args.overhead_ms)
                r.rounds += one.rounds
                r.tokens += one.tokens
                r.drafted += one.drafted
                r.cost_ms += one.cost_ms
            rows.append({"k": k, "threshold": threshold, "tokens_per_round": r.tokens_per_round,
                         "drafted_per_round": r.drafted / r.rounds, "speedup": plain_ms * total / r.cost_ms})
    best = max(rows, key=lambda row: row["speedup"])
    table = report.markdown_table(rows, [
        ("k", lambda row: str(row["k"])), ("threshold", lambda row: f"{row['threshold']:g}"),
        ("drafted/round", lambda row: report.fmt(row["drafted_per_round"], 2)),
        ("tokens/round", lambda row: report.fmt(row["tokens_per_round"], 2)),
        ("predicted speedup", lambda row: report.fmt(row["speedup"], 2, "×")),
    ])
    costs = ", ".join(f"{r} rows {ms:.1f}" for r, ms in sorted(pass_points.items()))
    text = (f"# Draft length and threshold, replayed\n\nCommand: `{command}`\n\n{len(data)} prompts, {total} greedy "
            f"tokens. Target pass (ms): {costs}; draft token {draft_token_ms:.1f} ms; {args.overhead_ms:g} ms per "
            f"round besides.\n\n{table}\n\nBest: k = {best['k']}, threshold {best['threshold']:g}.\n")
    report.write_report(out, {
        "command": command, "pass_ms": pass_points, "draft_token_ms": draft_token_ms, "rows": rows,
        "outputs": [{"id": d["id"], "prompt_tokens": d["prompt_tokens"], "output": d["output"]} for d in data],
    }, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
