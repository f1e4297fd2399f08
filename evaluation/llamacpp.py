"""llama.cpp for the comparison with specdec (``evaluation.peer``, ``evaluation.pairprice``): the
llama-server and llama-bench binaries built once by ``scripts/build_llama_server.sh`` and located,
their command lines, llama-bench's results, and llama-server as a process with a specdec service's
life cycle."""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evaluation.procs import ROOT, Service, wait_ready

logger = logging.getLogger(__name__)

BUILD_SCRIPT = ROOT / "scripts" / "build_llama_server.sh"


class PeerError(RuntimeError):
    """A step of the comparison failed; the message says which and what to do."""


# ---- command lines ---------------------------------------------------------------------------------

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
                        kv_type: str | None = None, depth: int = 0, repetitions: int | None = None) -> list[str]:
    """llama-bench's command line (several prompt lengths: one test each); ``kv_type`` None keeps
    its default (f16); ``depth``: tokens already in the context of each test; ``repetitions`` None
    keeps its default."""
    counts = [n_prompt] if isinstance(n_prompt, int) else list(n_prompt)
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, counts)), "-n", str(n_gen)]
    if kv_type is not None:
        cmd += ["-ctk", kv_type, "-ctv", kv_type]
    if depth:
        cmd += ["-d", str(depth)]
    if repetitions is not None:
        cmd += ["-r", str(repetitions)]
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
                    quant: str, models: Sequence[str] = ("target", "draft")) -> list[dict[str, Any]]:
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
