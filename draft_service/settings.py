"""Draft service configuration: SPECDEC_DRAFT_* variables or CLI flags."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import SettingsConfigDict

from specdec.model.gguf_convert import DEFAULT_QUANT, QUANTS
from specdec.models import EMBEDDED
from specdec.settings import ModelServiceSettings


class DraftSettings(ModelServiceSettings):
    """Draft service: llama.cpp on the embedded GGUF by default."""

    model_config = SettingsConfigDict(env_prefix="SPECDEC_DRAFT_", cli_prog_name="python -m draft_service")

    backend: Literal["auto", "native", "llamacpp", "transformers", "ngram"] = Field(
        "auto", description="Draft backend: native (a GGUF draft on specdec's own kernels: Llama and GPT-2 files of "
                            "Q4_0 ... Q8_0 and K-quant linears, on CPUs with AVX2), llamacpp (any GGUF, llama.cpp), auto "
                            "(native where it applies, else llamacpp; the log says which and why), transformers (any "
                            "causal LM), ngram (prompt lookup).",
    )
    model: str = Field(
        EMBEDDED,
        description="Hugging Face id, local checkpoint folder, .gguf file (llamacpp), 'embedded', or 'target' (llamacpp: "
                    "the target model itself, converted: self-speculation with no second model). With llamacpp a "
                    "model that is not a .gguf file is converted once with llama.cpp's converter and cached under "
                    "cache_dir/gguf (`python -m specdec.model.gguf_convert MODEL` does it ahead of time).",
    )
    quant: Literal[QUANTS] = Field(  # type: ignore[valid-type]
        DEFAULT_QUANT,
        description="native and llamacpp backends: the GGUF type a converted model gets (not the shipped embedded file, nor a "
                    ".gguf file given as model); q8_0 is the fastest end to end: lower types cost less per "
                    "token but lose more acceptance than that saves (docs/benchmarks.md, "
                    '"The embedded target drafting for itself").',
    )
    target_model: str = Field(
        EMBEDDED, validation_alias=AliasChoices("target_model", "SPECDEC_DRAFT_TARGET_MODEL", "SPECDEC_TARGET_MODEL"),
        description="The target model, for model=target: SPECDEC_DRAFT_TARGET_MODEL, else SPECDEC_TARGET_MODEL.",
    )
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    threads: int = Field(0, ge=0, description="Compute threads; 0 uses every core the process may use.")
    overlap_threads: int = Field(
        1, ge=0, description="Threads of a draft step while the target computes on the same host (the Propose says "
                             "`yield_cores`: overlapped pre-drafts, catch-ups, concurrent streams); 0: all of `threads`."
    )
    metrics_port: int | None = Field(9101, ge=0, le=65535, description="Prometheus /metrics port; unset disables.")
    kv_budget_mb: float = Field(256, gt=0, description="KV cache budget in MiB across sessions (LRU eviction).")
    lookup_ngram: int = Field(
        3, ge=0,
        description="llamacpp backend, greedy requests: when the sequence's last this-many tokens occurred "
                    "before, the draft decodes what followed them as a guess in the same pass and keeps the part it "
                    "would have drafted itself, one pass for several tokens on text that repeats (docs/performance.md); "
                    "0 turns it off.",
    )
    lookup_max_tokens: int = Field(
        16, ge=1, description="llamacpp backend: most guessed tokens in one pass (a guess starts at 2 tokens and "
                              "doubles while it is taken whole)."
    )
    gpu_layers: int = Field(
        0, ge=-1,
        description="llamacpp backend: model layers offloaded to the GPU (llama.cpp's n_gpu_layers); -1: all, 0: none "
                    "(the draft on the CPU). Needs a CUDA build of llama-cpp-python (the CUDA image, or "
                    "SPECDEC_LLAMACPP_CUDA=1 scripts/install_llamacpp.sh); without one the draft stays on the CPU, "
                    "logs a warning and reports device cpu in Info.",
    )
    ngram_max: int = Field(3, ge=1, description="ngram backend: longest suffix n-gram to look up.")
    ngram_min: int = Field(1, ge=1, description="ngram backend: shortest suffix n-gram to look up.")
    ngram_vocab_size: int = Field(1 << 20, ge=1, description="ngram backend: ids must be below this.")
    ngram_max_context: int = Field(1 << 20, ge=2, description="ngram backend: longest sequence accepted.")

    @model_validator(mode="after")
    def _check_ngram(self) -> DraftSettings:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        return self
