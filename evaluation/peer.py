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
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from evaluation import report
from evaluation.bench import Harness, Mode, _jsonable, machine_info, rotation
from evaluation.client import first_difference, write_results
from evaluation.procs import ROOT, Service, Stack, free_port, wait_ready
from evaluation.prompts import CATEGORIES, SUITE_VERSION, Prompt, load_suite, select, suite_digest
from evaluation.stats import paired_speedup, spread, tokens_per_second
from specdec.model.gguf_convert import QUANTS

logger = logging.getLogger(__name__)

MODES = ("llama-plain", "llama-spec", "sd-autoregressive", "sd-speculative")
LABELS = {"llama-plain": "llama-server plain", "llama-spec": "llama-server speculative",
          "sd-autoregressive": "specdec autoregressive", "sd-speculative": "specdec speculative"}
SPECDEC_MODES = {"sd-autoregressive": Mode("sd-autoregressive", "specdec", body={"mode": "autoregressive"}),
                 "sd-speculative": Mode("sd-speculative", "specdec")}  # the server's defaults: what users get
# (specdec mode, llama-server mode) compared like for like
PAIRS = (("sd-autoregressive", "llama-plain"), ("sd-speculative", "llama-spec"))
# (speculative, plain) of each engine
OWN_SPEEDUPS = (("llama-spec", "llama-plain"), ("sd-speculative", "sd-autoregressive"))
REFERENCES = ("llama-plain", "sd-autoregressive")
LLAMA_MODES = ("llama-plain", "llama-spec")
BEST = "sd-speculative/llama-best"  # the ratios' key of specdec speculative against the faster llama-server mode
FP32 = "f32"  # the target type measured as before quantised targets: specdec's own fp32 weights
BUILD_SCRIPT = ROOT / "scripts" / "build_llama_server.sh"
WARMUP_TOKENS = 8


class PeerError(RuntimeError):
    """A step of the benchmark failed; the message says which and what to do."""


# ---- command lines ---------------------------------------------------------------------------------

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


def target_env(quant: str) -> dict[str, str]:
    """The environment of specdec's target service for one target type: at f32 its default fp32
    weights, exactly as before quantised targets; otherwise the embedded model converted to
    ``quant`` (the file llama-server gets: ensure_gguf, same source, same cache)."""
    env = {"SPECDEC_TARGET_MODEL": "embedded"}
    return env if quant == FP32 else {**env, "SPECDEC_TARGET_QUANT": quant}


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


def llama_server_command(binary: Path | str, target: Path | str, port: int, threads: int, ctx_size: int = 4096,
                         kv_type: str = "f32", draft: Path | str | None = None, draft_max: int = 16, draft_min: int = 0,
                         draft_p_min: float | None = None) -> list[str]:
    """llama-server's command line: one slot (one stream, as measured), the whole context for it;
    with ``draft``, classic draft-model speculation."""
    cmd = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size), "-np", "1",
           "-ctk", kv_type, "-ctv", kv_type]
    if draft is not None:
        # named explicitly: with no --spec-type this version loads a plain draft model but never
        # drafts with it (it infers a type only from draft metadata such as MTP heads)
        cmd += ["-md", str(draft), "--spec-type", "draft-simple",
                "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", str(draft_min),
                "-td", str(threads), "-tbd", str(threads)]
        if draft_p_min is not None:
            cmd += ["--spec-draft-p-min", str(draft_p_min)]
    return cmd


def completion_body(prompt_ids: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """A greedy ``/completion`` request for exactly ``max_tokens`` tokens past EOS that returns the ids.

    cache_prompt is off so every request prefills its whole prompt, as specdec's do: a repeat or a
    warm-up must not find its prompt already in the KV cache."""
    return {"prompt": list(prompt_ids), "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "seed": 0,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "stream": False}


# k + 1 rows: the verification of a draft of k = 0, 4, 8 and 16 tokens (16: --draft-max's default)
VERIFY_ROWS = (1, 5, 9, 17)
LLAMA_BENCH_RUNS = (
    # name, model, prompt tokens (one eval of each count), generated tokens
    ("target plain step", "target", (0,), 64),
    ("target eval", "target", VERIFY_ROWS, 0),
    ("draft plain step", "draft", (0,), 64),
)


def llama_bench_command(binary: Path | str, model: Path | str, threads: int, n_prompt: int | Sequence[int], n_gen: int,
                        kv_type: str | None = None) -> list[str]:
    """llama-bench's command line (several prompt lengths: one test each); ``kv_type`` None keeps
    its default (f16)."""
    counts = [n_prompt] if isinstance(n_prompt, int) else list(n_prompt)
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, counts)), "-n", str(n_gen)]
    if kv_type is not None:
        cmd += ["-ctk", kv_type, "-ctv", kv_type]
    return cmd + ["-o", "json"]


def parse_llama_bench(stdout: str) -> dict[str, Any]:
    """The first llama-bench JSON result -> tokens/s and ms per eval (the whole batch: one step for
    ``-n``, all ``-p`` rows at once for ``-p``)."""
    return parse_llama_bench_rows(stdout)[0]


def parse_llama_bench_rows(stdout: str) -> list[dict[str, Any]]:
    """Every llama-bench JSON result (one per test), as :func:`parse_llama_bench` reads one."""
    rows = json.loads(stdout)
    if not rows:
        raise ValueError("llama-bench printed no results")
    return [_bench_row(r) for r in rows]


def _bench_row(r: dict[str, Any]) -> dict[str, Any]:
    n = r.get("n_gen") or r.get("n_prompt") or 0
    tps = float(r["avg_ts"])
    per_eval = 1e3 / tps if r.get("n_gen") else 1e3 * n / tps
    return {"n_prompt": r.get("n_prompt"), "n_gen": r.get("n_gen"), "tokens_per_second": tps,
            "stddev_tokens_per_second": r.get("stddev_ts"), "ms_per_eval": per_eval, "threads": r.get("n_threads"),
            "type_k": r.get("type_k"), "flash_attn": r.get("flash_attn"), "build_commit": r.get("build_commit"),
            "cpu_info": r.get("cpu_info")}


# ---- processes ---------------------------------------------------------------------------------------

def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a child started with its own session and everything it started (cmake, make, compilers)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def run_step(cmd: Sequence[str], what: str, log: Path | None = None, env: dict[str, str] | None = None,
             timeout_s: float | None = None, capture: bool = False) -> str:
    """Run one preparation step to completion; its output goes to ``log`` (stderr to the terminal
    without one). Returns stdout when ``capture``. A failure raises PeerError with the log's tail;
    an interruption stops the step's whole process group before it propagates."""
    sink = log.open("w") if log is not None else None
    try:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE if capture else sink, stderr=sink,
                                stdin=subprocess.DEVNULL, env=env, text=True, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except BaseException as exc:
            _kill_group(proc)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise PeerError(f"{what}: no result after {timeout_s:.0f} s{_log_hint(log)}") from exc
            raise
    finally:
        if sink is not None:
            sink.close()
    if proc.returncode != 0:
        raise PeerError(f"{what} failed (exit status {proc.returncode}){_log_hint(log)}")
    return stdout or ""


def _log_hint(log: Path | None, n: int = 25) -> str:
    if log is None or not log.is_file():
        return ""
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    return f"; the end of {log}:\n{tail}"


class Process(Service):
    """A server binary (llama-server) with the life cycle of a specdec service: log file, stop, tail."""

    # Service.__init__ would start ``python -m <module>``; this starts the binary instead
    def __init__(self, name: str, cmd: Sequence[str], log_dir: Path) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log = log_dir / f"{name}.log"
        self.popen = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_health(url: str, proc: Service, timeout_s: float = 300) -> None:
    """Wait until llama-server answers 200 on /health (503 while it loads the models)."""
    try:
        wait_ready(url, proc, timeout_s, path="/health")
    except (RuntimeError, TimeoutError) as exc:
        raise PeerError(str(exc)) from exc


# ---- preparation: binaries, converter, GGUF ----------------------------------------------------------

def build_llama(python: str = sys.executable) -> Path:
    """The folder of scripts/build_llama_server.sh's result (built on the first run, minutes)."""
    logger.info("llama-server and llama-bench: %s", BUILD_SCRIPT.relative_to(ROOT))
    t0 = time.perf_counter()
    stdout = run_step(["bash", str(BUILD_SCRIPT), python], "building llama-server (scripts/build_llama_server.sh)",
                      capture=True)
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise PeerError("scripts/build_llama_server.sh printed no folder")
    folder = Path(lines[-1])
    logger.info("llama.cpp binaries in %s (%.0f s)", folder, time.perf_counter() - t0)
    return folder


def check_llama_dir(folder: Path) -> dict[str, Any]:
    """The build-info.json of a folder made by the build script, after checking it holds everything."""
    need = [folder / "bin" / "llama-server", folder / "bin" / "llama-bench", folder / "build-info.json"]
    missing = [str(p) for p in need if not p.exists()]
    if missing:
        raise PeerError(f"{folder} is not a llama-server build (missing {', '.join(missing)}); "
                        "run scripts/build_llama_server.sh or drop --llama-dir")
    return json.loads((folder / "build-info.json").read_text())


def llama_version(binary: Path) -> str:
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"? ({exc})"
    return " ".join((r.stdout + r.stderr).split())


def bench_name(name: str, row: dict[str, Any]) -> str:
    """A llama-bench row's name: "target eval" becomes "target 17-row eval" after its row count."""
    return name.replace(" eval", f" {row['n_prompt']}-row eval") if row.get("n_prompt") else name


def run_llama_bench(llama_dir: Path, target: Path, draft: Path, threads: int, kv_type: str, log_dir: Path,
                    quant: str = FP32, models: Sequence[str] = ("target", "draft")) -> list[dict[str, Any]]:
    """llama-bench's runs of ``models`` (the target at ``quant``, the draft), one row per test."""
    out: list[dict[str, Any]] = []
    for i, (name, which, n_prompt, n_gen) in enumerate(LLAMA_BENCH_RUNS):
        if which not in models:
            continue
        model = target if which == "target" else draft
        # The draft's KV stays at llama.cpp's default, as in llama-server and specdec's draft
        # service. llama-bench has no f32 KV cache at all; from an empty context, as here, the KV
        # type hardly changes a step.
        kv = kv_type if which == "target" and kv_type != "f32" else None
        cmd = llama_bench_command(llama_dir / "bin" / "llama-bench", model, threads, n_prompt, n_gen, kv)
        logger.info("llama-bench: %s (%s)", name, shlex.join(cmd[1:]))
        stdout = run_step(cmd, f"llama-bench ({name})", log_dir / f"llama-bench-{i}.log", timeout_s=900, capture=True)
        try:
            rows = parse_llama_bench_rows(stdout)
        except (ValueError, KeyError, TypeError) as exc:
            raise PeerError(f"llama-bench ({name}): unreadable output ({exc}): {stdout[:300]!r}") from exc
        out += [{"name": bench_name(name, row), "model": which, **({"target_quant": quant} if which == "target" else {}),
                 "command": shlex.join(cmd), **row} for row in rows]
    return out


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
        url = self.llama_urls[mode]
        t0 = time.perf_counter()
        resp = self.harness.http.post(url + "/completion", json=completion_body(prompt_ids, max_tokens))
        wall = (time.perf_counter() - t0) * 1e3
        if resp.status_code != 200:
            raise PeerError(f"{mode} on {prompt.id}: HTTP {resp.status_code}: {resp.text[:500]}")
        out = resp.json()
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
        f"Machine: {m['cores']} cores, {m['cpu']}, {m['ram_gb']} GB RAM; llama-server {setup['threads']} threads for the "
        f"target and {setup['threads']} for the draft; specdec's services at their defaults (all cores); load average "
        f"{_load(m.get('load_average_start'))} at the start, {_load(m.get('load_average_end'))} at the end.", "",
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


def _load(values: list[float] | None) -> str:
    return "/".join(f"{v:.1f}" for v in values) if values else "–"


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
        results = json.loads((args.report_only / "results.json").read_text())
        (args.report_only / "report.md").write_text(render_markdown(results))
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
    from evaluation.hf import encode
    from specdec.errors import NotFound, SpecdecError
    from specdec.model.gguf_convert import ensure_gguf
    from specdec.models import default_cache_dir, embedded_gguf_path, load_tokenizer, resolve_hf

    started = datetime.now().isoformat(timespec="seconds")
    t_start = time.perf_counter()
    prompts = select(load_suite(), args.prompts, args.categories)
    if not prompts:
        raise PeerError("no prompts selected")
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    llama_dir = args.llama_dir.expanduser().resolve() if args.llama_dir else build_llama()
    llama_info = check_llama_dir(llama_dir)
    server_bin = llama_dir / "bin" / "llama-server"
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
    inputs = Inputs(llama_dir, source, draft_gguf, prompts, prompt_ids, tokenizer, log_dir)

    machine = machine_info(args.threads)
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
        "args": _jsonable(vars(args)), "machine": machine, "llama_cpp": llama_info,
        "llama_server_version": llama_version(server_bin), "llama_dir": str(llama_dir),
        "suite": {"version": SUITE_VERSION, "digest": suite_digest()}, "prompts": [p.id for p in prompts],
        "repeats": args.repeats, "max_tokens": args.max_tokens,
        "setup": {"target_source": str(source), "draft_gguf": str(draft_gguf), "target_quants": list(targets),
                  "threads": args.threads, "kv_type": args.kv_type,
                  "completion_fields": {k: v for k, v in completion_body([], 0).items() if k not in ("prompt", "n_predict")},
                  "specdec_fields": {"ignore_eos": True, "temperature": 0}},
        "llama_bench": bench_rows, "by_quant": by_quant, "runs": runs,
    }
    write_results(out, results)
    (out / "report.md").write_text(render_markdown(results))
    logger.info("done in %.0f s: %s", results["duration_s"], out)
    print(render_tables(results))
    if bench_rows:
        print(llama_bench_table(bench_rows))
    return 0


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
    measured, services = _serve_and_measure(args, log_dir, plain_cmd, spec_cmd, quant, inputs.prompts, inputs.prompt_ids)
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
                       prompts: list[Any], prompt_ids: dict[str, list[int]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start both llama-servers and specdec's stack at its defaults, its target at ``quant``
    (:func:`target_env`), run every mode on every prompt, stop them all; (runs, each server's
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
            tport = stack.model_service("target", "target", target_env(quant))
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
        except httpx.HTTPError as exc:
            dead = [f"{s.name} exited:\n{s.tail()}" for s in stack.services if not s.alive()]
            raise PeerError(f"a request failed ({type(exc).__name__}: {exc})" + ("; " + "; ".join(dead) if dead else "")) from exc
    finally:
        if harness is not None:
            harness.close()
        stack.close()


if __name__ == "__main__":
    raise SystemExit(main())
