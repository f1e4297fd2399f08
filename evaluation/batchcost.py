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
on oneDNN's packed linears and torch ops, and transformers' forward with each linear kernel of
``specdec.model.linears.FastLinears``: oneDNN on the packed weights, oneDNN on the row-major weights
from ONEDNN_MIN_ROWS rows with MKL below, and MKL alone. Each way of packing the weights loads its own
copy of the model (specdec.native's panels, oneDNN's blocks, the row-major weights kept), as the
service loads one; ``--native-against`` loads one more, packed and run by that build.

``--target random:gpt2`` (or ``random:distilgpt2``) prices a model no hub is needed for: the real
configuration (transformers' ``GPT2Config`` defaults, 124M; DistilGPT-2 is the same with 6 layers)
with random weights, saved once under the cache folder and loaded through ``from_pretrained``.
Costs do not depend on the weights' values. ``--draft none`` skips the draft's table.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from evaluation import report
from specdec.model.linears import KERNELS as LINEAR_KERNELS
from specdec.model.linears import ONEDNN_MIN_ROWS

logger = logging.getLogger("evaluation.batchcost")

KERNELS = tuple(k for k in LINEAR_KERNELS if k != "native")  # transformers' forward on each; "native" is the runner's
# how a target pass can run: specdec's runner on specdec.native, the runner on oneDNN's packed
# linears and torch ops (as without a C compiler), or transformers' forward on each oneDNN/MKL kernel
VARIANTS = ("runner", "runner-ops", *KERNELS)
ON_RUNNER = ("runner", "runner-against")  # variants on specdec.native's packing
# the copy of the model each variant runs on: weights packed for specdec.native (by this checkout's
# build, or by --native-against's), packed for oneDNN, or kept row-major
COPY_OF = {"runner": "native", "runner-against": "against", "runner-ops": "packed", "packed": "packed",
           "onednn": "row-major", "mkl": "row-major"}
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
    p.add_argument("--batches", type=lambda s: report.numbers(s, int, empty=False), default=[1, 2, 4, 8, 16],
                   help="sessions per step (default 1,2,4,8,16)")
    p.add_argument("--rows", type=lambda s: report.numbers(s, int, empty=False), default=[1, 5],
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
                        f"{ONEDNN_MIN_ROWS} rows or more, MKL below) or mkl (MKL at any row count); default runner")
    p.add_argument("--native-against", type=Path, default=None, metavar="KERNELS_C",
                   help="another version of specdec/native/kernels.c (one whose linears read the same packed layout, "
                        "e.g. every specdec/native/*.c and *.h of REV written with `git show` into one folder: the files "
                        "missing there come from this checkout): adds runner-against, the runner on a copy of the model "
                        "packed and run by that build, timed interleaved with runner on the current one")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/batchcost-<timestamp>/)")
    args = p.parse_args(argv)
    if args.native_against is not None:
        if not args.native_against.is_file():
            p.error(f"--native-against: no such file: {args.native_against}")
        args.kernels = [*dict.fromkeys(["runner", *args.kernels]), "runner-against"]
    return args


def random_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` token ids drawn from ``rng`` (costs depend on how many, not on which)."""
    return [rng.randrange(1000, 20000) for _ in range(n)]


def random_model(name: str, cache_dir: Path) -> str:
    """The folder of ``random:NAME``: the model's real configuration with random weights (seed 0)
    and the embedded model's byte-level BPE tokenizer (costs need the shapes, not the vocabulary;
    a real BPE tokenizer lets llama.cpp's converter convert it), saved once."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name not in RANDOM_CONFIGS and name not in RANDOM_LLAMA_CONFIGS:
        raise SystemExit(f"unknown random model {name!r}; choose from {', '.join([*RANDOM_CONFIGS, *RANDOM_LLAMA_CONFIGS])}")
    folder = cache_dir / "random-models" / f"{name}-bpe"
    if (folder / "config.json").exists():
        return str(folder)
    torch.manual_seed(0)
    llama = name in RANDOM_LLAMA_CONFIGS
    # GPT-2's vocab 50257: the tokenizer's 49152 ids, padded by the converter
    config = LlamaConfig(**RANDOM_LLAMA_CONFIGS[name]) if llama else GPT2Config(**RANDOM_CONFIGS[name])
    logger.info("building %s with random weights (%d layers, hidden %d) in %s", name, config.num_hidden_layers,
                config.hidden_size, folder)
    model = LlamaForCausalLM(config) if llama else GPT2LMHeadModel(config)
    if llama:
        with torch.no_grad():  # the initialiser's std 0.02 everywhere: logits of a trained model's scale
            for param in model.parameters():
                if param.dim() == 2:
                    param.normal_(0.0, 0.02)
    _save(model, folder)
    return str(folder)


def _save(model: Any, folder: Path) -> None:
    """``model`` and the embedded tokenizer into ``folder``, which appears only once complete."""
    from specdec.models import load_tokenizer

    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    load_tokenizer("embedded").save_pretrained(tmp)
    tmp.rename(folder)


def resolve_target(target: str) -> str:
    """A model id or folder, with ``random:NAME`` built (once) by :func:`random_model`."""
    from specdec.settings import default_cache_dir

    if target.startswith("random:"):
        return random_model(target.removeprefix("random:"), default_cache_dir())
    return target


def target_costs(args: argparse.Namespace) -> tuple[dict[tuple[str, int, int], float],
                                                   dict[tuple[str, int, int], list[float]]]:
    """Median ms of a target pass of each (kernel variant, sessions B, rows q), and each round's
    times. Every (rows, batch) pair's sessions are cached first, then each round times every pair
    and variant once, interleaved, so drift of the machine hits each alike (and a ratio within one
    round compares passes a few ms apart)."""
    engines = _engines(args)
    runners = {copy: engine.lm.runner for copy, engine in engines.items()}  # _select takes them away
    rng = random.Random(0)
    pairs = [(q, b) for q in args.rows for b in args.batches]
    seqs = {(q, b): [random_ids(rng, args.context) for _ in range(b)] for q, b in pairs}
    for engine in engines.values():
        for (q, b), group in seqs.items():
            for i, s in enumerate(group):
                engine.verify(f"t{q}-{b}-{i}", s)
    times: dict[tuple[str, int, int], list[float]] = {(k, b, q): [] for k in args.kernels for q, b in pairs}
    for _ in range(args.repeats):
        for q, b in pairs:
            for kernel in args.kernels:
                engine = engines[COPY_OF[kernel]]
                _select(engine, runners[COPY_OF[kernel]], kernel)
                # each step: the session's next token (uncached) plus q - 1 draft tokens
                jobs = [engine.prepare(f"t{q}-{b}-{i}", s + random_ids(rng, 1), random_ids(rng, q - 1))
                        for i, s in enumerate(seqs[(q, b)])]
                t = time.perf_counter()
                engine.step(jobs)
                times[(kernel, b, q)].append((time.perf_counter() - t) * 1e3)
    for engine in engines.values():
        for (q, b), group in seqs.items():
            for i in range(len(group)):
                engine.release(f"t{q}-{b}-{i}")
    out = {key: statistics.median(ms) for key, ms in times.items()}
    for (kernel, b, q), ms in out.items():
        logger.info("target (%s): %d sessions × %d rows: %.1f ms", kernel, b, q, ms)
    return out, times


def _engines(args: argparse.Namespace) -> dict[str, Any]:
    """A target engine on its own copy of the model for each copy ``--kernels`` needs (COPY_OF);
    SystemExit when this machine cannot run one of the variants."""
    from specdec.settings import default_cache_dir
    from target_service.verify import target_gguf

    target = resolve_target(args.target)
    path = target_gguf(target, args.target_quant, default_cache_dir())
    if path is not None and any(k not in ON_RUNNER for k in args.kernels):
        raise SystemExit("a GGUF target runs on specdec's runner only (--kernels runner)")
    against = _against_build(args.native_against) if "runner-against" in args.kernels else None
    engines = {copy: _load_copy(target, path, copy, against if copy == "against" else None)
               for copy in dict.fromkeys(COPY_OF[k] for k in args.kernels)}
    for copy in ("native", "against"):
        if copy in engines and (engines[copy].lm.runner is None or engines[copy].lm.runner.native is None):
            raise SystemExit("specdec.native's kernels or the runner are unavailable here (see the log)")
    have = {k for k in VARIANTS if k not in ON_RUNNER and COPY_OF[k] in engines and k in _runs(engines[COPY_OF[k]])}
    missing = [k for k in args.kernels if k not in ON_RUNNER and k not in have]
    if missing:
        raise SystemExit(f"this model and torch build cannot run {', '.join(missing)}; they have "
                         f"runner, {', '.join(k for k in VARIANTS if k in have)}")
    return engines


def _runs(engine: Any) -> tuple[str, ...]:
    """The variants other than the runner's that ``engine``'s copy of the model can run."""
    return ("runner-ops",) * (engine.lm.runner is not None) + engine.lm.fast_linears.kernels


def _load_copy(target: str, path: Path | None, copy: str, build: Any = None) -> Any:
    """A target engine on a copy of the model of its own, packed as ``copy`` says (COPY_OF): the
    service's way ("native", or "against": by ``build``, another specdec.native library), oneDNN's
    packed weights with the runner on torch ops ("packed"), or no packing ("row-major")."""
    from specdec.engine.sessions import SessionStore
    from specdec.models import LoadedModel, load_hf
    from specdec.settings import default_cache_dir
    from target_service.verify import GGUFModel, TargetEngine

    store = SessionStore(512, 8 << 30, 0)
    with built_on(build) if build is not None else contextlib.nullcontext():
        if path is not None:
            gguf = GGUFModel.load(path)
            loaded = LoadedModel(gguf.model, None, str(path), str(path), gguf.load_s)
            return TargetEngine(loaded, store, max_draft_tokens=32, gguf=gguf)
        loaded = load_hf(target, "float32", "cpu", default_cache_dir())
        return TargetEngine(loaded, store, max_draft_tokens=32, pack_weights=copy != "row-major",
                            native=copy in ("native", "against"))


def _against_build(source: Path) -> Any:
    """The specdec.native library built from ``source`` (--native-against's kernels.c)."""
    from specdec.native import Kernels, NativeError, build

    try:
        return Kernels(build(source=source.resolve()))
    except (NativeError, OSError) as exc:
        raise SystemExit(f"--native-against {source}: {exc}") from None


@contextlib.contextmanager
def built_on(build: Any) -> Iterator[None]:
    """Models loaded inside pack their linears for, and run their runner on, ``build`` instead of
    this checkout's library: the two modules that take the build at load see ``build``."""
    from specdec.model import linears, runner

    with mock.patch.object(linears, "kernels", lambda: build), mock.patch.object(runner, "kernels", lambda: build):
        yield


def relative(times: dict[tuple[str, int, int], list[float]], args: argparse.Namespace) -> dict[tuple[str, int, int], float]:
    """Each pass against the pass of the first row count in the same round (same kernel and
    batch), median over the rounds: the noise-robust form of "a verify of q rows costs x plain steps"."""
    q0 = args.rows[0]
    return {(kernel, b, q): statistics.median(t / base for t, base in zip(ms, times[(kernel, b, q0)], strict=True))
            for (kernel, b, q), ms in times.items()}


def _select(engine: Any, runner: Any, kernel: str) -> None:
    """Make ``engine`` run its passes as ``kernel`` says: its copy's ``runner``, or transformers'
    forward on one linear kernel."""
    engine.lm.runner = runner if kernel.startswith("runner") else None
    if not kernel.startswith("runner"):
        engine.lm.fast_linears.kernel = kernel


def draft_costs(args: argparse.Namespace) -> dict[int, float]:
    """Median ms of a draft step of each batch size (llama.cpp, one thread); {} with ``--draft none``."""
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
        jobs = [proposer.prepare(f"d{b}-{i}", random_ids(rng, args.context), args.repeats + 2) for i in range(b)]
        out[b] = draft_step_ms(proposer, jobs, args.repeats)
        logger.info("draft: %d sessions: %.1f ms", b, out[b])
    return out


def draft_step_ms(proposer: Any, jobs: list[Any], repeats: int) -> float:
    """Median ms of ``repeats`` steps advancing every one of ``jobs`` (prepared with room for them
    and two more) by a token, after their prefills; the jobs' sessions are released after."""
    while not all(j.drafted for j in jobs):  # the prefill (in chunks of n_batch rows) and a first token
        proposer.step([j for j in jobs if not j.drafted])
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        proposer.step(jobs)
        times.append((time.perf_counter() - t) * 1e3)
    for j in jobs:
        proposer.release(j.session_id)
    return statistics.median(times)


def render(target: dict[tuple[str, int, int], float], draft: dict[int, float], args: argparse.Namespace,
           rel: dict[tuple[str, int, int], float] | None = None) -> str:
    def name(kernel: str, what: str) -> str:
        return what if len(args.kernels) == 1 else f"{what}, {kernel}"

    cols = [(kernel, q) for kernel in args.kernels for q in args.rows]
    columns: list[tuple[str, report.Cell]] = [("sessions B", lambda b: str(b["b"]))]
    columns += [(name(k, f"target B×{q} (ms)"), lambda b, k=k, q=q: report.fmt(target[(k, b["b"], q)])) for k, q in cols]
    # the draft's two columns (none with --draft none): a step, then per session
    step = [("draft step (ms)", lambda b: report.fmt(draft[b["b"]]))] if draft else []
    columns += [*step, *((name(k, f"target per row, q={q} (ms)"),
                          lambda b, k=k, q=q: report.fmt(target[(k, b["b"], q)] / (b["b"] * q))) for k, q in cols)]
    columns += [("draft per session (ms)", lambda b: report.fmt(draft[b["b"]] / b["b"]))] if draft else []
    rows = [{"b": b} for b in args.batches]
    lines = [report.markdown_table(rows, columns)]
    if rel and len(args.rows) > 1:
        q0, later = args.rows[0], args.rows[1:]
        ratios: list[tuple[str, report.Cell]] = [("sessions B", lambda b: str(b["b"]))]
        ratios += [(name(k, f"B×{q} / B×{q0}"), lambda b, k=k, q=q: f"{rel[(k, b['b'], q)]:.2f}×")
                   for k in args.kernels for q in later]
        lines += ["", f"Each pass against the pass of {q0} row{'s' * (q0 > 1)} a session in the same round (median of "
                  "the rounds' ratios):", "", report.markdown_table(rows, ratios)]
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
        "command": command, "args": report.args_record(args),
        "target_ms": {f"{kernel}:{b}x{q}": ms for (kernel, b, q), ms in target.items()}, "draft_step_ms": draft,
        "target_relative": {f"{kernel}:{b}x{q}": r for (kernel, b, q), r in rel.items()},
    }
    report.write_report(out, results, f"# Batched step cost\n\nCommand: `{command}`\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
