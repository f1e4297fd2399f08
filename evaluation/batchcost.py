"""``python -m evaluation.batchcost``: what one batched step costs each model service's engine, by
batch size, in this process (no RPC): a target pass of B sessions × q new tokens, and a draft step
that advances B sessions by one token each.

This is the table that says whether speculation can win under load: batched plain decoding gets
B tokens per target pass, speculation needs k draft steps of B sessions as well, so once a draft
step of B sessions costs about as much as a target pass of B rows, a draft token is no cheaper
than a target one and plain decoding wins. Each session has ``--context`` tokens cached first
(random ids, the same for every mode); every figure is the median of ``--repeats`` rounds, each
round timing every row count, batch size and kernel once, interleaved. A second table gives each
pass against the pass of the first row count in the same round.
The services set the same thread counts (target: all cores, with the bounded OpenMP spin;
draft: llama.cpp on one thread, as when it yields cores to a busy target), so the figures match
what they pay per step under load. ``--kernels runner runner-ops packed onednn mkl`` times the
target's passes each way the engine can run them, interleaved: specdec's own forward
(``specdec.model.runner``: the service's default for Llama and GPT-2) on specdec.native's kernels, or
on oneDNN's packed linears and torch ops (a second copy of the model), and transformers' forward with
each linear kernel of ``specdec.model.linears.FastLinears``: oneDNN on the packed weights, oneDNN on the
row-major weights from 5 rows with MKL below, and MKL alone.

``--target random:gpt2`` (or ``random:distilgpt2``) prices a model no hub is needed for: the real
configuration (transformers' ``GPT2Config`` defaults, 124M; DistilGPT-2 is the same with 6 layers)
with random weights, saved once under the cache folder and loaded through ``from_pretrained``.
Costs do not depend on the weights' values. ``--draft none`` skips the draft's table.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

from evaluation import report
from evaluation.client import write_results

logger = logging.getLogger("evaluation.batchcost")

KERNELS = ("packed", "onednn", "mkl")  # specdec.model.linears.KERNELS but native (that module imports torch)
# how a target pass can run: specdec's runner on specdec.native, the runner on oneDNN's packed
# linears and torch ops (as without a C compiler), or transformers' forward on each oneDNN/MKL kernel
VARIANTS = ("runner", "runner-ops", *KERNELS)
ON_RUNNER = ("runner", "runner-against")  # variants on the natively packed copy of the model
# transformers.GPT2Config overrides of the random models --target random:NAME builds
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {"gpt2": {}, "distilgpt2": {"n_layer": 6}}
# transformers.LlamaConfig of the random Llama models: SmolLM2-1.7B-Instruct's real configuration
# (it shares the embedded draft's tokenizer), the size CPU users serve
RANDOM_LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-1.7b": {"vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 8192,
                     "rms_norm_eps": 1e-5, "rope_theta": 130000.0, "tie_word_embeddings": True,
                     "bos_token_id": 1, "eos_token_id": 2},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.batchcost", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16],
                   help="sessions per step (default 1,2,4,8,16)")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 5],
                   help="new tokens per session in a target pass (default 1,5: a plain step and a k = 4 verify)")
    p.add_argument("--context", type=int, default=200, help="cached tokens per session (default 200)")
    p.add_argument("--repeats", type=int, default=7, help="steps measured per point (default 7)")
    p.add_argument("--target", default="embedded",
                   help="target model (default the embedded one): an id, folder or .gguf file; random:gpt2, "
                        "random:distilgpt2 or random:smollm2-1.7b for the real configuration with random weights")
    p.add_argument("--target-quant", default=None,
                   help="the target converted to this GGUF type (q8_0, q4_k_m ...: llama.cpp's converter and quantiser, "
                        "cached) and computed in it, as SPECDEC_TARGET_QUANT does")
    p.add_argument("--draft", default="embedded", help="draft GGUF for llama.cpp (default the embedded one); none skips it")
    p.add_argument("--kernels", nargs="+", choices=VARIANTS, default=["runner"],
                   help="how target passes run, compared interleaved: runner (the service's default: specdec's own "
                        "forward on specdec.native's kernels: its linears on weights packed at load and the work between "
                        "them), runner-ops (the same forward on oneDNN's packed linears and torch ops, as without a C "
                        "compiler), or transformers' forward with the linear kernel packed "
                        "(oneDNN on the packed weights), onednn (oneDNN on the row-major weights for passes of "
                        "specdec.model.linears.ONEDNN_MIN_ROWS rows or more, MKL below) or mkl (MKL at any row count); "
                        "default runner")
    p.add_argument("--native-against", type=Path, default=None, metavar="KERNELS_C",
                   help="another version of specdec/native/kernels.c (one whose linears read the same packed layout, "
                        "e.g. every specdec/native/*.c and *.h of REV written with `git show` into one folder: the files "
                        "missing there come from this checkout): adds runner-against, the runner on that "
                        "build, timed interleaved with runner on the current one")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/batchcost-<timestamp>/)")
    args = p.parse_args(argv)
    if args.native_against is not None:
        if not args.native_against.is_file():
            p.error(f"--native-against: no such file: {args.native_against}")
        args.kernels = [*dict.fromkeys(["runner", *args.kernels]), "runner-against"]
    return args


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(n)]


def random_model(name: str, cache_dir: Path) -> str:
    """The folder of ``random:NAME``: the model's real configuration with random weights (seed 0)
    and the embedded model's byte-level BPE tokenizer (costs need the shapes, not the vocabulary;
    a real BPE tokenizer lets llama.cpp's converter convert it), saved once."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from specdec.models import load_tokenizer

    if name not in RANDOM_CONFIGS and name not in RANDOM_LLAMA_CONFIGS:
        raise SystemExit(f"unknown random model {name!r}; choose from {', '.join([*RANDOM_CONFIGS, *RANDOM_LLAMA_CONFIGS])}")
    folder = cache_dir / "random-models" / f"{name}-bpe"
    if name in RANDOM_LLAMA_CONFIGS and not (folder / "config.json").exists():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(**RANDOM_LLAMA_CONFIGS[name])
        logger.info("building %s with random weights (%d layers, hidden %d) in %s", name, config.num_hidden_layers,
                    config.hidden_size, folder)
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # the initialiser's std 0.02 everywhere: logits of a trained model's scale
            for param in model.parameters():
                if param.dim() == 2:
                    param.normal_(0.0, 0.02)
        tmp = folder.with_name(folder.name + ".tmp")
        model.save_pretrained(tmp)
        load_tokenizer("embedded").save_pretrained(tmp)
        tmp.rename(folder)
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = GPT2Config(**RANDOM_CONFIGS[name])  # vocab 50257: the tokenizer's 49152 ids, padded by the converter
        logger.info("building %s with random weights (%d layers, hidden %d) in %s", name, config.n_layer, config.n_embd, folder)
        tmp = folder.with_name(folder.name + ".tmp")
        GPT2LMHeadModel(config).save_pretrained(tmp)
        load_tokenizer("embedded").save_pretrained(tmp)
        tmp.rename(folder)
    return str(folder)


def resolve_target(target: str) -> str:
    """A model id or folder, with ``random:NAME`` built (once) by :func:`random_model`."""
    from specdec.settings import default_cache_dir

    if target.startswith("random:"):
        return random_model(target.removeprefix("random:"), default_cache_dir())
    return target


def target_costs(args: argparse.Namespace) -> tuple[dict[tuple[str, int, int], float],
                                                   dict[tuple[str, int, int], list[float]]]:
    from specdec.engine.sessions import SessionStore
    from specdec.model.linears import fast_linears
    from specdec.models import LoadedModel, load_hf
    from specdec.settings import default_cache_dir
    from target_service.verify import GGUFModel, TargetEngine, target_gguf

    target = resolve_target(args.target)
    path = target_gguf(target, args.target_quant, default_cache_dir())
    if path is not None and any(k not in ON_RUNNER for k in args.kernels):
        raise SystemExit("a GGUF target runs on specdec's runner only (--kernels runner)")

    def engine_for(native: bool) -> TargetEngine:
        if path is not None:
            gguf = GGUFModel.load(path)
            loaded = LoadedModel(gguf.model, None, str(path), str(path), gguf.load_s)
            return TargetEngine(loaded, SessionStore(512, 8 << 30, 0), max_draft_tokens=32, gguf=gguf)
        loaded = load_hf(target, "float32", "cpu", default_cache_dir())
        # the row-major weights stay only when other kernels are compared (the service frees them)
        fast_linears(loaded.model, keep_row_major=any(k in ("onednn", "mkl") for k in args.kernels), native=native)
        return TargetEngine(loaded, SessionStore(512, 8 << 30, 0), max_draft_tokens=32, native=native)

    # "runner": specdec.native's linears and kernels (the service's default); every other variant
    # on a second copy of the model whose weights are packed for oneDNN, as without specdec.native
    engines = {}
    natives: dict[str, Any] = {}  # runner and runner-against: the build each runs on
    if "runner" in args.kernels:
        engines["runner"] = engine_for(True)
        if engines["runner"].lm.runner is None or engines["runner"].lm.runner.native is None:
            raise SystemExit("specdec.native's kernels or the runner are unavailable here (see the log)")
        natives["runner"] = engines["runner"].lm.runner.native
        if args.native_against is not None:
            from specdec.native import Kernels, NativeError, build

            try:
                natives["runner-against"] = Kernels(build(source=args.native_against.resolve()))
            except (NativeError, OSError) as exc:
                raise SystemExit(f"--native-against {args.native_against}: {exc}") from None
    if any(k not in ON_RUNNER for k in args.kernels):
        engines["other"] = engine_for(False)
    if "other" in engines:
        other = engines["other"]
        available = ("runner-ops",) * (other.lm.runner is not None) + other.lm.fast_linears.kernels
        missing = [k for k in args.kernels if k not in ON_RUNNER and k not in available]
        if missing:
            raise SystemExit(f"this model and torch build cannot run {', '.join(missing)}; they have "
                             f"runner, {', '.join(available)}")
    runners = {name: engine.lm.runner for name, engine in engines.items()}  # _select takes them away
    rng = random.Random(0)
    # every (rows, batch) pair's sessions cached first, then each round times every pair and kernel
    # once, interleaved, so drift of the machine hits each alike (and a ratio within one round
    # compares passes a few ms apart)
    pairs = [(q, b) for q in args.rows for b in args.batches]
    seqs = {(q, b): [_ids(rng, args.context) for _ in range(b)] for q, b in pairs}
    for engine in engines.values():
        for (q, b), group in seqs.items():
            for i, s in enumerate(group):
                engine.verify(f"t{q}-{b}-{i}", s)
    times: dict[tuple[str, int, int], list[float]] = {(k, b, q): [] for k in args.kernels for q, b in pairs}
    for _ in range(args.repeats):
        for q, b in pairs:
            for kernel in args.kernels:
                name = "runner" if kernel in ON_RUNNER else "other"
                engine = engines[name]
                _select(engine, runners[name], kernel)
                if kernel in natives and runners["runner"].native is not natives[kernel]:
                    runners["runner"].use_kernels(natives[kernel])
                # each step: the session's next token (uncached) plus q - 1 draft tokens
                jobs = [engine.prepare(f"t{q}-{b}-{i}", s + _ids(rng, 1), _ids(rng, q - 1))
                        for i, s in enumerate(seqs[(q, b)])]
                t = time.perf_counter()
                engine.step(jobs)
                times[(kernel, b, q)].append((time.perf_counter() - t) * 1e3)
    for engine in engines.values():
        for (q, b), group in seqs.items():
            for i in range(len(group)):
                engine.release(f"t{q}-{b}-{i}")
    out: dict[tuple[str, int, int], float] = {}
    for (kernel, b, q), ms in times.items():
        out[(kernel, b, q)] = statistics.median(ms)
        logger.info("target (%s): %d sessions × %d rows: %.1f ms", kernel, b, q, out[(kernel, b, q)])
    return out, times


def relative(times: dict[tuple[str, int, int], list[float]], args: argparse.Namespace) -> dict[tuple[str, int, int], float]:
    """Each pass against the pass of the first row count in the same round (same kernel and
    batch), median over the rounds: the noise-robust form of "a verify of q rows costs x plain steps"."""
    q0 = args.rows[0]
    return {(kernel, b, q): statistics.median(t / base for t, base in zip(ms, times[(kernel, b, q0)], strict=True))
            for (kernel, b, q), ms in times.items()}


def _select(engine: Any, runner: Any, kernel: str) -> None:
    """Make ``engine`` run its passes as ``kernel`` says: its ``runner``, or transformers' forward
    on one linear kernel."""
    lm = engine.lm
    lm.runner = runner if kernel.startswith("runner") else None
    if not kernel.startswith("runner"):
        lm.fast_linears.kernel = kernel
    elif lm.fast_linears.kernels:
        lm.fast_linears.kernel = lm.fast_linears.kernels[0]


def draft_costs(args: argparse.Namespace) -> dict[int, float]:
    if args.draft == "none":
        return {}
    from draft_service.backends.llamacpp import LlamaCppProposer
    from specdec.model.gguf_convert import draft_gguf

    # one thread: what a draft step costs while the target computes on the same cores (under load)
    gguf = draft_gguf(args.draft, resolve_target(args.target))
    proposer = LlamaCppProposer(str(gguf), max(args.batches) * 2, 1 << 30, 0, 64, threads=1)
    rng = random.Random(1)
    out = {}
    for b in args.batches:
        jobs = [proposer.prepare(f"d{b}-{i}", _ids(rng, args.context), args.repeats + 2) for i in range(b)]
        while not all(j.drafted for j in jobs):  # the prefill (in chunks of n_batch rows) and a first token
            proposer.step([j for j in jobs if not j.drafted])
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            proposer.step(jobs)
            times.append((time.perf_counter() - t) * 1e3)
        for j in jobs:
            proposer.release(j.session_id)
        out[b] = statistics.median(times)
        logger.info("draft: %d sessions: %.1f ms", b, out[b])
    return out


def render(target: dict[tuple[str, int, int], float], draft: dict[int, float], args: argparse.Namespace,
           rel: dict[tuple[str, int, int], float] | None = None) -> str:
    def name(kernel: str, what: str) -> str:
        return what if len(args.kernels) == 1 else f"{what}, {kernel}"

    cols = [(kernel, q) for kernel in args.kernels for q in args.rows]
    # the draft's two columns (none with --draft none): a step, then per session
    draft_head = ["draft step (ms)", "draft per session (ms)"] if draft else []
    head = ["sessions B", *(name(k, f"target B×{q} (ms)") for k, q in cols), *draft_head[:1],
            *(name(k, f"target per row, q={q} (ms)") for k, q in cols), *draft_head[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b in args.batches:
        drafted = [report.fmt(draft[b]), report.fmt(draft[b] / b)] if draft else []
        cells = [str(b), *(report.fmt(target[(k, b, q)]) for k, q in cols), *drafted[:1],
                 *(report.fmt(target[(k, b, q)] / (b * q)) for k, q in cols), *drafted[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    if rel and len(args.rows) > 1:
        q0, later = args.rows[0], args.rows[1:]
        rows = f"{q0} row{'s' * (q0 > 1)}"
        lines += ["", f"Each pass against the pass of {rows} a session in the same round (median of the rounds' ratios):",
                  "", "| sessions B | " + " | ".join(name(k, f"B×{q} / B×{q0}") for k in args.kernels for q in later) + " |",
                  "|" + "---:|" * (1 + len(args.kernels) * len(later))]
        for b in args.batches:
            lines.append(f"| {b} | " + " | ".join(f"{rel[(k, b, q)]:.2f}×" for k in args.kernels for q in later) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, command = report.start_run("evaluation.batchcost", argv, args.out, "batchcost-")
    from specdec.process import configure_torch

    configure_torch(0)  # as the target service: all cores, bounded spin
    target, times = target_costs(args)
    rel = relative(times, args)
    draft = draft_costs(args)
    table = render(target, draft, args, rel)
    results: dict[str, Any] = {
        "command": command, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "target_ms": {f"{kernel}:{b}x{q}": ms for (kernel, b, q), ms in target.items()}, "draft_step_ms": draft,
        "target_relative": {f"{kernel}:{b}x{q}": r for (kernel, b, q), r in rel.items()},
    }
    write_results(out, results)
    (out / "results.md").write_text(f"# Batched step cost\n\nCommand: `{command}`\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
