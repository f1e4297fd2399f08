"""Any Hugging Face causal LM as a GGUF file for the llama.cpp draft backend: converted once by
llama.cpp's own converter, quantised by llama.cpp's quantiser, cached.

``python -m specdec.model.gguf_convert MODEL [--quant q8_0]`` does ahead of time what the draft service
does on its first start with ``SPECDEC_DRAFT_BACKEND=llamacpp`` and a model that is not a GGUF
file, and prints the file's path.

- **Converter.** ``convert_hf_to_gguf.py`` with its ``conversion/`` package and ``gguf-py/``, from
  the llama.cpp that llama-cpp-python vendors (the same version the draft runs on).
  ``scripts/install_llamacpp.sh`` keeps them under ``<venv>/share/specdec/llama.cpp``
  (``SPECDEC_LLAMACPP_CONVERTER`` names another folder). The converter writes ``f32``, ``f16``,
  ``bf16`` and ``q8_0`` itself; every other type is quantised from its ``f32`` output with
  ``llama_model_quantize``.
- **Cache.** ``<cache_dir>/gguf/<name>-<source digest>-<converter version>-<quant>.gguf``: the digest
  covers every file of the source folder, so new weights convert again and a second start, or a
  second service, reuses the file. A file lock makes services that start together convert once.
  A file is reused only when its SHA-256 equals the one recorded beside it (``<file>.sha256``,
  written before the file is renamed into place), else converted again: a truncated or corrupted
  file, or another one put under its name, is never served. Hashing costs ~0.1 s a 100 MB file
  (~1.5 GB/s with SHA-NI; the embedded model at q8_0, 145 MB, in 0.1 s warm, 0.4 s cold).
- **Isolation.** Both steps run in child processes (the converter loads the whole model in torch;
  llama.cpp's quantiser prints a line per tensor on stderr): their output goes to a log file beside
  the result, and a progress line reaches the service log every few seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from specdec.errors import NotFound, SpecdecError
from specdec.integrity import file_sha256, mismatch, record_sha256
from specdec.models import EMBEDDED, default_cache_dir, embedded_gguf_path, resolve_hf

logger = logging.getLogger(__name__)

CONVERTER_ENV = "SPECDEC_LLAMACPP_CONVERTER"
TARGET = "target"  # SPECDEC_DRAFT_MODEL naming the target model itself
# Types the converter writes itself; the rest go through llama_model_quantize from f32.
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANTISED_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k")
QUANTS = CONVERTER_TYPES + QUANTISED_TYPES
# Measured on the embedded target drafting for itself (docs/benchmarks.md): q8_0 keeps 96-98 % of
# draft tokens accepted at 9.2 ms a token, 1.62x plain decoding; q4_k_m 89-92 % at 8.5 ms, 1.34x;
# q4_0 75-94 % at 6.8 ms, 1.23x. A cheaper token is worth less than the acceptance it loses.
DEFAULT_QUANT = "q8_0"
# The files a conversion reads: weights, config, tokenizer (no pickles: only safetensors weights).
SOURCE_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
PROGRESS_EVERY_S = 5.0


class ConversionError(SpecdecError):
    """The model could not be converted; the message says why and what to do instead."""

    code = "FAILED_PRECONDITION"


def converter_dir() -> Path:
    """The folder holding llama.cpp's converter (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``)."""
    folder = Path(os.environ.get(CONVERTER_ENV) or Path(sys.prefix) / "share" / "specdec" / "llama.cpp")
    if not (folder / "convert_hf_to_gguf.py").is_file() or not (folder / "gguf-py").is_dir():
        raise ConversionError(
            f"llama.cpp's converter is not installed (looked in {folder}): run `make setup`, or "
            f"`bash scripts/install_llamacpp.sh {sys.executable}`, which keeps it there; or point "
            f"{CONVERTER_ENV} at a llama.cpp checkout"
        )
    return folder


def converter_version(folder: Path) -> str:
    """A short name of the converter's llama.cpp version, for cache keys (``VERSION`` file written
    at install time; else a digest of the converter script)."""
    stamp = folder / "VERSION"
    if stamp.is_file():
        return re.sub(r"[^A-Za-z0-9.]+", "-", stamp.read_text().strip())[:40]
    return "conv-" + hashlib.sha256((folder / "convert_hf_to_gguf.py").read_bytes()).hexdigest()[:12]


def folder_digest(folder: Path) -> str:
    """sha256 over the names and contents of every file in ``folder`` (first 16 hex digits)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        with path.open("rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:16]


def source_folder(model: str, cache_dir: Path) -> Path:
    """The checkpoint folder of ``model``: the embedded default's safetensors cache, a local
    folder, or a Hugging Face id's snapshot (downloaded once, or found in the hub cache offline)."""
    if model == EMBEDDED:
        return Path(resolve_hf(EMBEDDED, cache_dir))
    path = Path(model).expanduser()
    if path.exists():
        return Path(resolve_hf(model, cache_dir))  # checks it is a checkpoint folder
    if model.startswith(("/", ".", "~")) or model.endswith(".gguf"):
        raise NotFound(f"no such file or folder: {model!r}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=list(SOURCE_PATTERNS)))
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, gated, network: all "not found here"
        raise NotFound(
            f"cannot find model {model!r} to convert for llama.cpp: {str(exc).rstrip('. ')}. Give a local checkpoint folder, a "
            "Hugging Face id (downloaded once; offline it must already be in HF_HOME), a .gguf file or 'embedded'."
        ) from exc


def cache_path(cache_dir: Path, source: Path, digest: str, version: str, quant: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", source.name)[:60]
    return cache_dir / "gguf" / f"{name}-{digest}-{version}-{quant}.gguf"


def converter_environment(folder: Path) -> dict[str, str]:
    """The converter's environment: its own gguf-py first on the path (the gguf from PyPI may be
    another version than the converter was written against)."""
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = os.pathsep.join([str(folder / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run(cmd: list[str], what: str, log: Path, env: dict[str, str] | None, timeout_s: float) -> None:
    """Run one step with its output appended to ``log``, a progress line every few seconds."""
    t0 = time.perf_counter()
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.perf_counter() - t0
                    if elapsed > timeout_s:
                        proc.kill()
                        proc.wait()
                        raise ConversionError(f"{what} took more than {timeout_s:.0f} s; its log: {log}") from None
                    logger.info("%s: %.0f s so far", what, elapsed)
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
    if rc != 0:
        raise ConversionError(_explain_failure(what, log, rc))


def _explain_failure(what: str, log: Path, rc: int) -> str:
    text = log.read_text(errors="replace")
    tail = "\n".join(text.strip().splitlines()[-8:])
    unsupported = re.search(r"Model (\S+) is not supported", text)
    if unsupported:
        return (f"llama.cpp's converter does not support the architecture {unsupported.group(1)}: run this draft "
                "with SPECDEC_DRAFT_BACKEND=transformers (any causal LM), or give a .gguf file made elsewhere "
                f"(log: {log})")
    if "pre-tokenizer was not recognized" in text:
        return (f"llama.cpp's converter does not know this model's tokenizer (its BPE pre-tokenizer): use "
                f"SPECDEC_DRAFT_BACKEND=transformers, or give a .gguf file (log: {log})")
    return f"{what} failed (exit {rc}); the end of its log ({log}):\n{tail}"


def quantise(source: Path, out: Path, quant: str, threads: int = 0) -> None:
    """``llama_model_quantize`` from a GGUF file to another type (run in a child process)."""
    import ctypes

    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}", None)
    if ftype is None:
        raise ConversionError(f"llama.cpp has no quantisation type {quant!r}; choose one of {', '.join(QUANTS)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise ConversionError(f"llama_model_quantize to {quant} failed (code {rc})")


# Configuration keys the converter reads under names that transformers no longer writes:
# {model_type: {key the converter reads: key transformers writes}}. GPT-2 checkpoints saved by
# transformers 5 have n_positions but no n_ctx (those on the hub still carry both).
LEGACY_CONFIG_KEYS = {"gpt2": {"n_ctx": "n_positions"}}


def staged_source(source: Path, stage: Path) -> Path:
    """``source`` as the converter needs it: ``source`` itself, or, where its config.json lacks a key
    the converter reads, a folder of links to its files with that key filled in."""
    config = json.loads((source / "config.json").read_text())
    missing = {old: config[new] for old, new in LEGACY_CONFIG_KEYS.get(config.get("model_type", ""), {}).items()
               if old not in config and new in config}
    if not missing:
        return source
    stage.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "config.json":
            (stage / path.name).symlink_to(path.resolve())
    (stage / "config.json").write_text(json.dumps({**config, **missing}, indent=1))
    return stage


def remote_code(source: Path) -> list[str]:
    """What in checkpoint folder ``source`` is code a converter could run: Python files, and the
    ``auto_map`` entries of its JSON configs that point at them. llama.cpp's converter loads some
    tokenizers with ``trust_remote_code=True``, so such a folder is refused, never converted."""
    found = sorted(p.name for p in source.rglob("*.py"))
    for name in ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
        try:
            data = json.loads((source / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            found.append(f"{name}: auto_map")
    return found


def convert(source: Path, out: Path, quant: str, log: Path, timeout_s: float = 3600) -> None:
    """Write ``out`` from the checkpoint folder ``source`` at ``quant`` (no caching, no lock).
    A folder holding remote code is refused (:func:`remote_code`): docs/security.md."""
    import tempfile

    code = remote_code(source)
    if code:
        raise ConversionError(
            f"{source} holds code ({', '.join(code[:5])}) that llama.cpp's converter may run "
            "(it loads some tokenizers with trust_remote_code=True), so specdec does not convert it; convert it "
            "yourself where you trust that code and give the .gguf file as SPECDEC_DRAFT_MODEL, or use "
            "SPECDEC_DRAFT_BACKEND=transformers (which never runs remote code)")

    with tempfile.TemporaryDirectory(prefix="specdec-convert-") as tmp:
        _convert(staged_source(source, Path(tmp) / source.name), out, quant, log, timeout_s)


def _convert(source: Path, out: Path, quant: str, log: Path, timeout_s: float) -> None:
    folder = converter_dir()
    env = converter_environment(folder)
    if quant in CONVERTER_TYPES:
        _run([sys.executable, str(folder / "convert_hf_to_gguf.py"), str(source), "--outtype", quant,
              "--outfile", str(out)], "converting to GGUF", log, env, timeout_s)
        return
    full = out.with_name(out.name + ".f32")
    try:
        _run([sys.executable, str(folder / "convert_hf_to_gguf.py"), str(source), "--outtype", "f32",
              "--outfile", str(full)], "converting to GGUF", log, env, timeout_s)
        _run([sys.executable, "-m", "specdec.model.gguf_convert", "--quantise-file", str(full), str(out), quant],
             f"quantising to {quant}", log, None, timeout_s)
    finally:
        full.unlink(missing_ok=True)


def draft_gguf(model: str, target_model: str = EMBEDDED, quant: str = DEFAULT_QUANT,
               cache_dir: Path | None = None) -> Path:
    """The GGUF file the llama.cpp draft runs, from ``SPECDEC_DRAFT_MODEL``: ``embedded`` is the
    shipped Q4_1 draft file; ``target`` the target model itself (``target_model``) converted to
    ``quant`` (self-speculation); a .gguf file as given; any other model converted to ``quant``."""
    if model == EMBEDDED:
        return embedded_gguf_path()
    if model == TARGET:
        return ensure_gguf(target_model, quant, cache_dir)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise NotFound(f"{model!r} is a file but not a .gguf file; give a .gguf file or a checkpoint folder")
        return path
    return ensure_gguf(model, quant, cache_dir)


def ensure_gguf(model: str, quant: str = DEFAULT_QUANT, cache_dir: Path | None = None) -> Path:
    """``model`` (a Hugging Face id, a checkpoint folder or ``embedded``: its fp32 weights) as a
    GGUF file at ``quant``, converted once and cached."""
    if quant not in QUANTS:
        raise ConversionError(f"unknown quantisation {quant!r}; choose one of {', '.join(QUANTS)}")
    cache_dir = cache_dir or default_cache_dir()
    source = source_folder(model, cache_dir)
    if not (source / "config.json").is_file():
        raise NotFound(f"{source} holds no config.json; it is not a transformers checkpoint")
    folder = converter_dir()
    out = cache_path(cache_dir, source, folder_digest(source), converter_version(folder), quant)
    if out.is_file():
        problem = mismatch(out)
        if problem is None:
            logger.info("GGUF of %s at %s: %s (cached)", model, quant, out)
            return out
        logger.warning("not reusing %s (%s): converting again", out, problem)
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if out.is_file() and mismatch(out) is None:  # another process converted it while this one waited
            logger.info("GGUF of %s at %s: %s (converted by another process)", model, quant, out)
            return out
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        log = out.with_suffix(".log")
        log.unlink(missing_ok=True)
        logger.info("converting %s to GGUF %s for llama.cpp, once (log: %s)", model, quant, log)
        t0 = time.perf_counter()
        try:
            convert(source, tmp, quant, log)
            # recorded from the file about to be renamed: the name never holds a file without its record
            record_sha256(out, file_sha256(tmp))
            tmp.rename(out)
        finally:
            tmp.unlink(missing_ok=True)
        elapsed = time.perf_counter() - t0
        meta = {"model": model, "source": str(source), "quant": quant, "seconds": round(elapsed, 1),
                "bytes": out.stat().st_size}
        out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
        logger.info("converted %s to %s in %.1f s (%.0f MB): %s", model, quant, elapsed, out.stat().st_size / 1e6, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.model.gguf_convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="Hugging Face id, local checkpoint folder or 'embedded'")
    parser.add_argument("--quant", default=DEFAULT_QUANT, choices=QUANTS, help=f"GGUF type (default {DEFAULT_QUANT})")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $SPECDEC_CACHE_DIR or ~/.cache/specdec")
    parser.add_argument("--quantise-file", nargs=3, metavar=("IN", "OUT", "TYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.quantise_file:
            src, dst, quant = args.quantise_file
            quantise(Path(src), Path(dst), quant)
            return 0
        if not args.model:
            parser.error("give a model")
        print(ensure_gguf(args.model, args.quant, args.cache_dir))
    except SpecdecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
