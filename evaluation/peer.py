"""``python -m evaluation.peer``: specdec against llama.cpp's own ``llama-server`` on the same
weights, in one run.

What runs, one request at a time, interleaved per prompt (the order of the four modes rotated from
one prompt to the next, so slow drift of the machine hits every mode alike):

  llama-plain         llama-server on the target (the embedded SmolLM2-135M-Instruct, converted
                      to GGUF by llama.cpp's own converter and quantiser), no draft
  llama-spec          llama-server on the same target with the embedded Q4_1 GGUF as its draft
                      (``--spec-type draft-simple``, up to ``--draft-max`` draft tokens)
  sd-autoregressive   specdec's stack (target_service, draft_service, orchestrator with their
                      default settings) with ``mode: autoregressive``
  sd-speculative      the same stack in its default speculative mode

``--target-quant`` names the target's GGUF types, measured one after another, each with its own
servers (only one type's processes run at a time). ``f32`` (the default) is the F32 conversion in
llama-server against specdec's fp32 safetensors target; any other type T is one file, the target
converted to T, that both engines compute: llama-server loads it, specdec's target service gets
``SPECDEC_TARGET_QUANT=T`` (the same conversion, from the same cache) and runs it on its native
kernels. ``--target-quant f32,q8_0,q4_k_m`` gives one table per type and one over all of them.

llama-server and llama-bench are built once from the llama.cpp vendored in the llama-cpp-python
sdist specdec's draft runs on, with the same GGML flags (``scripts/build_llama_server.sh``), and
cached. Both engines see identical prompt tokens (llama-server's ``/completion`` gets the ids
specdec's tokenizer makes of the prompt; specdec gets the prompt text and reports how many ids it
made of it, which must match), decode greedily exactly ``--max-tokens`` tokens past EOS and return
their ids, which are compared token for token with llama-server plain's and specdec
autoregressive's. Speed is measured on the client:
tokens/s of a mode = all its generated tokens / all its HTTP wall time; per-prompt ratios pair runs
of the same prompt and repeat; specdec speculative is also set against the faster of the two
llama-server modes. ``llama-bench`` adds llama.cpp's own plain step and 1-, 5-, 9- and 17-row eval
times (a verification of k = 0, 4, 8, 16 draft tokens) of each target type. ``results.json`` and
``report.md`` land in ``--out``
(default evaluation/results/peer-<timestamp>/).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from evaluation import report
from evaluation.bench import Harness
from evaluation.client import RequestFailed, post_json
from evaluation.llamacpp import (
    PeerError,
    Process,
    build_llama,
    check_llama_dir,
    completion_body,
    llama_server_command,
    llama_version,
    run_llama_bench,
    wait_health,
)
from evaluation.modes import Mode, rotation
from evaluation.peer_report import (
    FP32,
    LABELS,
    MODES,
    find_mismatches,
    llama_bench_table,
    render_markdown,
    render_tables,
    summarise,
    target_env,
)
from evaluation.procs import Stack, free_port
from evaluation.prompts import CATEGORIES, SUITE_VERSION, Prompt, load_suite, select, suite_digest
from specdec.model.gguf_convert import QUANTS

logger = logging.getLogger(__name__)

SPECDEC_MODES = {"sd-autoregressive": Mode("sd-autoregressive", "specdec", body={"mode": "autoregressive"}),
                 "sd-speculative": Mode("sd-speculative", "specdec")}  # the server's defaults: what users get
WARMUP_TOKENS = 8


# ---- the command line ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.peer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--prompts", type=int, default=10, help="use N prompts, taken round-robin over the categories (default 10)")
    p.add_argument("--categories", nargs="*", choices=CATEGORIES, help="only these prompt categories")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[64, 128],
                   help="new tokens per generation (EOS ignored); several values give one table each (default 64 128)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (mode, prompt, length); default 1")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of llama-server's target and draft and of llama-bench (default: every core, "
                        "as specdec's services use by default)")
    p.add_argument("--ctx-size", type=int, default=4096, help="llama-server context per server (default 4096)")
    p.add_argument("--draft-max", type=int, default=16,
                   help="llama-server --spec-draft-n-max: longest draft (default 16, specdec's default max_k)")
    p.add_argument("--draft-min", type=int, default=0, help="llama-server --spec-draft-n-min (default 0)")
    p.add_argument("--draft-p-min", type=float, default=None,
                   help="llama-server --spec-draft-p-min: stop a draft below this draft probability "
                        "(default: the server's own default)")
    p.add_argument("--target-quant", type=quant_list, default=[FP32], metavar="TYPES",
                   help="comma-separated GGUF types of the target, measured one after another "
                        f"({', '.join(QUANTS)}); f32: llama-server on the F32 conversion against specdec's fp32 "
                        "target; any other: both engines on the target converted to that type (default f32)")
    p.add_argument("--kv-type", choices=["f32", "f16"], default="f32",
                   help="KV cache type of llama-server's target and of llama-bench (default f32, the precision of "
                        "specdec's target; the draft keeps llama.cpp's default, as in specdec's draft service)")
    p.add_argument("--llama-dir", type=Path, default=None,
                   help="a folder made by scripts/build_llama_server.sh (default: build or reuse the cached one)")
    p.add_argument("--no-llama-bench", action="store_true", help="skip the llama-bench measurements")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up request of each mode")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/peer-<timestamp>/)")
    p.add_argument("--report-only", type=Path, metavar="DIR",
                   help="measure nothing: re-render DIR/report.md from DIR/results.json")
    args = p.parse_args(argv)
    for name in ("prompts", "repeats", "threads", "ctx_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(n < 1 for n in args.max_tokens):
        p.error("--max-tokens values must be at least 1")
    if args.draft_max < 1 or not 0 <= args.draft_min <= args.draft_max:
        p.error("need 0 <= --draft-min <= --draft-max and --draft-max >= 1")
    if args.draft_p_min is not None and not 0 <= args.draft_p_min <= 1:
        p.error("--draft-p-min must lie in [0, 1]")
    args.max_tokens = sorted(set(args.max_tokens))
    return args


def quant_list(value: str) -> list[str]:
    """``--target-quant``'s value: GGUF types, comma-separated, each once, in the order given."""
    quants = [q.strip().lower() for q in value.split(",") if q.strip()]
    unknown = [q for q in quants if q not in QUANTS]
    if unknown or not quants:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'}: give GGUF types out of {', '.join(QUANTS)}")
    return list(dict.fromkeys(quants))


def target_problem(quant: str, info: dict[str, Any]) -> str | None:
    """Why specdec's target (its Info as the orchestrator's /v1/info shows it) does not compute
    ``quant``, or None. GGUF types specdec has no name for report "gguf"."""
    if quant == FP32:
        return None
    dtype, backend = str(info.get("dtype", "")), info.get("backend")
    if backend != "native" or dtype.upper() not in (quant.upper(), "GGUF"):
        return (f"specdec's target computes {dtype or '?'} on {backend or '?'}, not the GGUF {quant.upper()} file on "
                "its native kernels")
    return None


# ---- measuring ---------------------------------------------------------------------------------------

class Client:
    """Runs one request of a mode: llama-server's /completion, or specdec through bench's Harness."""

    def __init__(self, harness: Harness, llama_urls: dict[str, str]) -> None:
        self.harness, self.llama_urls = harness, llama_urls

    def run(self, mode: str, prompt: Prompt, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        if mode in SPECDEC_MODES:
            r = self.harness.run(SPECDEC_MODES[mode], prompt, prompt_ids, max_tokens=max_tokens)
            if not r["prompt_tokens_match"]:
                raise PeerError(f"specdec made {r['prompt_tokens_server']} prompt tokens of {prompt.id}, "
                                f"llama-server gets {len(prompt_ids)}: the inputs differ")
            stats = r["stats"]
            return {"tokens": len(r["token_ids"]), "elapsed_ms": r["wall_ms"], "wall_ms": r["wall_ms"],
                    "server_ms": r["elapsed_ms"], "token_ids": r["token_ids"], "mean_k": r["mean_k"],
                    "draft_tokens": stats.get("draft_tokens", 0), "accepted_tokens": stats.get("accepted_tokens", 0),
                    "iterations": stats.get("iterations"), "stats": stats}
        out, wall = post_json(self.harness.http, self.llama_urls[mode] + "/completion",
                              completion_body(prompt_ids, max_tokens), f"{mode} on {prompt.id}")
        # n_predict may overshoot to finish a multi-byte character; the comparison is over max_tokens
        ids = list(out.get("tokens") or [])[:max_tokens]
        if len(ids) != max_tokens:
            raise PeerError(f"{mode} on {prompt.id}: {len(ids)} token ids back, asked for {max_tokens}")
        t = out.get("timings") or {}
        evaluated = out.get("tokens_evaluated", t.get("prompt_n"))
        if evaluated is not None and evaluated != len(prompt_ids):
            raise PeerError(f"{mode} on {prompt.id}: evaluated {evaluated} prompt tokens, sent {len(prompt_ids)}")
        return {"tokens": len(ids), "elapsed_ms": wall, "wall_ms": wall,
                "server_ms": (t.get("prompt_ms") or 0.0) + (t.get("predicted_ms") or 0.0), "token_ids": ids,
                "draft_tokens": t.get("draft_n", 0), "accepted_tokens": t.get("draft_n_accepted", 0), "timings": t}


def measure(client: Client, prompts: list[Prompt], prompt_ids: dict[str, list[int]], lengths: Sequence[int],
            repeats: int) -> list[dict[str, Any]]:
    from tqdm import tqdm

    runs: list[dict[str, Any]] = []
    bar = tqdm(total=len(MODES) * len(prompts) * repeats * len(lengths), desc="peer", unit="run")
    try:
        for n in lengths:
            for rep in range(repeats):
                for i, p in enumerate(prompts):
                    for m in rotation(list(MODES), i + rep * len(prompts)):
                        checkpoint()
                        bar.set_postfix_str(f"{m} / {p.id} / {n}")
                        r = client.run(m, p, prompt_ids[p.id], n)
                        runs.append({"mode": m, "prompt_id": p.id, "category": p.category, "max_tokens": n,
                                     "repeat": rep, "prompt_tokens": len(prompt_ids[p.id]), **r})
                        bar.update()
    finally:
        bar.close()
    return runs


# ---- the benchmark -----------------------------------------------------------------------------------

_signalled: list[int] = []


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)  # so try/finally stops every process on SIGTERM as on Ctrl-C


def _on_signal(signum: int, frame: Any) -> None:
    # grpc turns an exception raised inside a blocking call into a failed call, which
    # procs.wait_grpc simply retries; remembered, the signal stops the run at the next checkpoint
    _signalled.append(signum)
    _raise_for(signum)


def checkpoint() -> None:
    """Stop here if a signal arrived that a library swallowed."""
    if _signalled:
        _raise_for(_signalled[0])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        (args.report_only / "report.md").write_text(render_markdown(report.read_results(args.report_only)))
        return 0
    out, command = report.start_run("evaluation.peer", argv, args.out, "peer-", quiet=("httpx", "transformers"))
    previous = {}
    if threading.current_thread() is threading.main_thread():
        _signalled.clear()
        # a SIGINT ignored on purpose (nohup, a background job) stays ignored
        sigs = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]
        previous = {sig: signal.signal(sig, _on_signal) for sig in sigs}
    try:
        return run(args, out, command)
    except PeerError as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        logger.error("interrupted; every process this run started is stopped")
        return 130
    except SystemExit as exc:
        if isinstance(exc.code, int) and exc.code > 128:
            logger.error("stopped by signal %d; every process this run started is stopped", exc.code - 128)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class Inputs:
    """What every target type is measured with."""

    llama_dir: Path  # made by scripts/build_llama_server.sh
    source: Path  # the target's safetensors checkpoint
    draft_gguf: Path
    prompts: list[Prompt]
    prompt_ids: dict[str, list[int]]  # specdec's tokenizer's ids of each prompt: what llama-server gets
    tokenizer: Any
    log_dir: Path


def run(args: argparse.Namespace, out: Path, command: str) -> int:
    started = datetime.now().isoformat(timespec="seconds")
    t_start = time.perf_counter()
    inputs, targets, llama_info = prepare(args, out / "logs")
    machine = report.machine_info(args.threads)
    machine["service_threads"] = "service defaults"
    by_quant: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []
    bench_rows: list[dict[str, Any]] = []
    for i, (quant, target_gguf) in enumerate(targets.items()):
        by_quant[quant], quant_runs, quant_bench = measure_quant(args, inputs, quant, target_gguf, bench_draft=i == 0)
        runs += quant_runs
        bench_rows += quant_bench
    machine["load_average_end"] = list(os.getloadavg())
    results = {
        "started": started, "duration_s": round(time.perf_counter() - t_start, 1), "command": command,
        "args": report.args_record(args), "machine": machine, "llama_cpp": llama_info,
        "llama_server_version": llama_version(inputs.llama_dir / "bin" / "llama-server"),
        "llama_dir": str(inputs.llama_dir), "suite": {"version": SUITE_VERSION, "digest": suite_digest()},
        "prompts": [p.id for p in inputs.prompts], "repeats": args.repeats, "max_tokens": args.max_tokens,
        "setup": {"target_source": str(inputs.source), "draft_gguf": str(inputs.draft_gguf),
                  "target_quants": list(targets), "threads": args.threads, "kv_type": args.kv_type,
                  "completion_fields": {k: v for k, v in completion_body([], 0).items() if k not in ("prompt", "n_predict")},
                  "specdec_fields": {"ignore_eos": True, "temperature": 0}},
        "llama_bench": bench_rows, "by_quant": by_quant, "runs": runs,
    }
    report.write_report(out, results, render_markdown(results), md_name="report.md")
    logger.info("done in %.0f s: %s", results["duration_s"], out)
    print(render_tables(results))
    if bench_rows:
        print(llama_bench_table(bench_rows))
    return 0


def prepare(args: argparse.Namespace, log_dir: Path) -> tuple[Inputs, dict[str, Path], dict[str, Any]]:
    """Everything measured before any server starts: the prompts and their ids, llama.cpp's
    binaries (built on the first run), the target converted to each type; (the inputs, each
    type's file, llama.cpp's build-info.json)."""
    from evaluation.hf import encode
    from specdec.errors import NotFound, SpecdecError
    from specdec.model.gguf_convert import ensure_gguf
    from specdec.models import default_cache_dir, embedded_gguf_path, load_tokenizer, resolve_hf

    prompts = select(load_suite(), args.prompts, args.categories)
    if not prompts:
        raise PeerError("no prompts selected")
    log_dir.mkdir(parents=True, exist_ok=True)
    llama_dir = args.llama_dir.expanduser().resolve() if args.llama_dir else build_llama()
    llama_info = check_llama_dir(llama_dir)
    try:
        source = Path(resolve_hf("embedded"))
        draft_gguf = embedded_gguf_path()
    except NotFound as exc:
        raise PeerError(f"{exc} (run 'make setup')") from exc
    # F32: the same numbers as specdec's fp32 target (llama.cpp's converter, the version the draft
    # runs). Every type is converted before anything is measured: a failing one costs no measurement.
    targets = {}
    for quant in args.target_quant:
        logger.info("the target as GGUF %s (converted once, cached)", quant.upper())
        try:
            targets[quant] = ensure_gguf(str(source), quant, default_cache_dir())
        except SpecdecError as exc:
            raise PeerError(str(exc)) from exc
    tokenizer = load_tokenizer("embedded")
    prompt_ids = {p.id: encode(tokenizer, p) for p in prompts}
    longest = max(len(v) for v in prompt_ids.values()) + max(args.max_tokens)
    if longest >= args.ctx_size:
        raise PeerError(f"a prompt plus {max(args.max_tokens)} tokens needs {longest} positions, over --ctx-size {args.ctx_size}")
    return Inputs(llama_dir, source, draft_gguf, prompts, prompt_ids, tokenizer, log_dir), targets, llama_info


def measure_quant(args: argparse.Namespace, inputs: Inputs, quant: str, target_gguf: Path,
                  bench_draft: bool) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """One target type: llama-bench on its file (and on the draft with ``bench_draft``), then both
    llama-servers and specdec's stack on it, every mode on every prompt, all of them stopped again;
    (its results block, its runs, its llama-bench rows). Logs go to ``<log_dir>/<quant>/``."""
    t0 = time.perf_counter()
    log_dir = inputs.log_dir / quant
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("target %s: %s", quant.upper(), target_gguf)
    checkpoint()
    bench = [] if args.no_llama_bench else run_llama_bench(
        inputs.llama_dir, target_gguf, inputs.draft_gguf, args.threads, args.kv_type, log_dir, quant,
        ("target", "draft") if bench_draft else ("target",))

    server_bin = inputs.llama_dir / "bin" / "llama-server"
    plain_cmd = llama_server_command(server_bin, target_gguf, free_port(), args.threads, args.ctx_size, args.kv_type)
    spec_cmd = llama_server_command(server_bin, target_gguf, free_port(), args.threads, args.ctx_size, args.kv_type,
                                    draft=inputs.draft_gguf, draft_max=args.draft_max, draft_min=args.draft_min,
                                    draft_p_min=args.draft_p_min)
    env = target_env(quant)
    measured, services = _serve_and_measure(args, log_dir, plain_cmd, spec_cmd, quant, env, inputs.prompts,
                                            inputs.prompt_ids)
    runs = [{"target_quant": quant, **r} for r in measured]

    mismatches = find_mismatches(runs)
    for x in mismatches:
        x["target_quant"] = quant
        for which in ("reference", "other"):
            if x[f"{which}_token"] is not None:
                x[f"{which}_text"] = inputs.tokenizer.decode([x[f"{which}_token"]])
    if not any(r.get("draft_tokens") for r in runs if r["mode"] == "llama-spec"):
        logger.warning("llama-server speculative drafted no tokens at all: check %s", log_dir / "llama-spec.log")
    block = {"target_gguf": str(target_gguf), "specdec_target_env": env, "llama_plain_command": plain_cmd,
             "llama_spec_command": spec_cmd, "services": services, "duration_s": round(time.perf_counter() - t0, 1),
             "summary": summarise(runs, args.max_tokens), "mismatches": mismatches}
    return block, runs, bench


def _serve_and_measure(args: argparse.Namespace, log_dir: Path, plain_cmd: list[str], spec_cmd: list[str], quant: str,
                       env: dict[str, str], prompts: list[Any], prompt_ids: dict[str, list[int]]
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start both llama-servers and specdec's stack at its defaults, its target at ``quant``
    (``env``: :func:`target_env`), run every mode on every prompt, stop them all; (runs, each server's
    /props or /v1/info)."""
    import httpx

    stack = Stack(log_dir)
    harness = None
    try:
        llama_urls = {}
        for mode, cmd in (("llama-plain", plain_cmd), ("llama-spec", spec_cmd)):
            logger.info("starting %s: %s", LABELS[mode], shlex.join(cmd))
            proc = Process(mode, cmd, log_dir)
            stack.services.append(proc)
            url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
            wait_health(url, proc)
            llama_urls[mode] = url
        logger.info("starting specdec's services with their default settings, the target at %s (logs in %s)",
                    quant.upper(), log_dir)
        try:
            tport = stack.model_service("target", "target", env)
            checkpoint()
            dport = stack.model_service("draft", "draft", {"SPECDEC_DRAFT_MODEL": "embedded"})
            checkpoint()
            sd_url = stack.orchestrator("orchestrator", dport, tport)
        except (RuntimeError, TimeoutError) as exc:
            checkpoint()  # a service that died of the same Ctrl-C is no failure to report
            raise PeerError(f"specdec's services did not come up: {exc}") from exc
        harness = Harness(None, {"main": sd_url}, max(args.max_tokens), None)
        client = Client(harness, llama_urls)
        try:
            services = {"specdec": harness.http.get(sd_url + "/v1/info").json()}
            problem = target_problem(quant, services["specdec"].get("target") or {})
            if problem:
                raise PeerError(f"{problem}; see {log_dir / 'target.log'}")
            for mode, url in llama_urls.items():
                services[mode] = harness.http.get(url + "/props").json()
            if not args.no_warmup:
                first = prompts[0]
                for m in MODES:
                    client.run(m, first, prompt_ids[first.id], WARMUP_TOKENS)
            return measure(client, prompts, prompt_ids, args.max_tokens, args.repeats), services
        except RequestFailed as exc:
            raise PeerError(str(exc)) from exc
        except httpx.HTTPError as exc:
            dead = [f"{s.name} exited:\n{s.tail()}" for s in stack.services if not s.alive()]
            raise PeerError(f"a request failed ({type(exc).__name__}: {exc})" + ("; " + "; ".join(dead) if dead else "")) from exc
    finally:
        if harness is not None:
            harness.close()
        stack.close()


if __name__ == "__main__":
    raise SystemExit(main())
