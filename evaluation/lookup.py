"""``python -m evaluation.lookup DIR``: what prompt lookup (the n-gram draft) could land on the
target's own greedy outputs of a benchmark run, without running any model.

It reads the ``hf-plain`` generations of ``DIR/results.json`` (an ``evaluation.bench`` run) and
walks each prompt + output the way a speculative loop would: at every position it looks up the
longest suffix n-gram (``--min-ngram`` up to ``--max-ngram`` tokens) that occurred earlier in the
sequence, proposes up to ``--k`` of the tokens that followed it, and counts how many of them the
target's output really continues with (the target's own token is always the next one). The
totals say whether an n-gram draft in front of (or instead of) the model draft can pay on that
text: a model draft round lands ~5 tokens per verify on the embedded pair.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from draft_service.backends.ngram import find_continuation
from evaluation import report


@dataclass
class LookupCount:
    positions: int = 0  # target passes the walk took (one per lookup, matched or not)
    matched: int = 0  # lookups that found an earlier occurrence of the suffix n-gram
    accepted: int = 0  # proposed tokens the output really continued with

    def __add__(self, other: LookupCount) -> LookupCount:
        return LookupCount(self.positions + other.positions, self.matched + other.matched, self.accepted + other.accepted)

    @property
    def accepted_per_match(self) -> float:
        return self.accepted / self.matched if self.matched else 0.0


def walk(sequence: list[int], start: int, k: int, min_ngram: int, max_ngram: int) -> LookupCount:
    """Prompt lookup over ``sequence[start:]`` (the output after a prompt of ``start`` tokens): each
    step proposes up to ``k`` tokens from the context so far and advances past the accepted ones
    plus the target's own token."""
    count = LookupCount()
    i = start
    while i < len(sequence):
        draft = find_continuation(sequence[:i], k, max_ngram=max_ngram, min_ngram=min_ngram)
        count.positions += 1
        accepted = 0
        for j, token in enumerate(draft):
            if i + j >= len(sequence) or sequence[i + j] != token:
                break
            accepted += 1
        if draft:
            count.matched += 1
            count.accepted += accepted
        i += accepted + 1
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluation.lookup", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="folder of an evaluation.bench run that measured hf-plain")
    p.add_argument("--k", type=int, default=8, help="tokens proposed per lookup (default 8)")
    p.add_argument("--max-ngram", type=int, default=6, help="longest suffix n-gram looked up (default 6)")
    p.add_argument("--min-ngram", type=int, nargs="+", default=[2, 3, 4], help="shortest ones to compare (default 2 3 4)")
    args = p.parse_args(argv)

    from evaluation.hf import encode
    from evaluation.prompts import Prompt
    from specdec.models import load_tokenizer

    results = json.loads((args.results / "results.json").read_text())
    prompts = {d["id"]: Prompt(**d) for d in results["suite"]["prompts"]}
    runs = [r for r in results["runs"] if r["mode"] == "hf-plain" and r["repeat"] == 0]
    if not runs:
        raise SystemExit(f"{args.results}/results.json has no hf-plain generations")
    tokenizer = load_tokenizer(results["pair"]["target"])
    sequences = []
    for r in runs:
        prompt_ids = encode(tokenizer, prompts[r["prompt_id"]])
        sequences.append((len(prompt_ids), prompt_ids + r["token_ids"]))
    print(f"{len(runs)} generations, {sum(len(s) - n for n, s in sequences)} output tokens, k = {args.k}\n")
    totals = [{"n": n, "count": sum((walk(seq, start, args.k, n, max(n, args.max_ngram)) for start, seq in sequences),
                                    LookupCount())} for n in args.min_ngram]
    print(report.markdown_table(totals, [
        ("shortest n-gram", lambda t: str(t["n"])), ("target passes", lambda t: str(t["count"].positions)),
        ("lookups that matched", lambda t: str(t["count"].matched)), ("tokens accepted", lambda t: str(t["count"].accepted)),
        ("accepted per match", lambda t: f"{t['count'].accepted_per_match:.2f}")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
