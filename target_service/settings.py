"""Target service configuration: SPECDEC_TARGET_* variables or CLI flags."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from specdec.model.gguf_convert import QUANTS
from specdec.settings import ModelServiceSettings


class TargetSettings(ModelServiceSettings):
    """Target service: a causal LM, from a transformers checkpoint (``gpt2`` is the mission's
    target) or a GGUF file computed in its own quantised format."""

    model_config = SettingsConfigDict(env_prefix="SPECDEC_TARGET_", cli_prog_name="python -m target_service")

    model: str = Field(
        "embedded",
        description="Hugging Face id, local checkpoint folder, .gguf file (Llama or GPT-2; computed on specdec's "
                    "kernels in the file's own format: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, F32), or "
                    "'embedded'.",
    )
    quant: Literal[QUANTS] | None = Field(  # type: ignore[valid-type]
        None,
        description="Serve the model (an id, folder or 'embedded', not a .gguf file) quantised to this GGUF type: "
                    "converted once with llama.cpp's converter and quantiser, cached under cache_dir/gguf, then run as "
                    "a .gguf target (q8_0 and q4_k_m are the common choices). Unset: the checkpoint's own weights "
                    "through transformers' loader, in `dtype`.",
    )

    port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    metrics_port: int | None = Field(9102, ge=0, le=65535, description="Prometheus /metrics port; unset disables.")
    overlap_threads: int = Field(
        1, ge=0, description="Threads of a pass verifying while a draft computes on the same host (overlapped "
                             "speculation asks for it); 0: all of `threads`."
    )
    max_queued_distributions_mb: float = Field(
        64, gt=0, description="Draft distributions (sampling) the Verify calls waiting for or in compute may hold in "
                              "all, in MiB; a call that would pass it gets RESOURCE_EXHAUSTED. The orchestrator's "
                              "draft sends at most 512 entries a token (128 KiB for 32 draft tokens).",
    )
    pack_weights: bool = Field(
        True, description="Pack the fp32 linear weights once, at load, for oneDNN: a verify of up to ~9 rows then costs "
                          "about one plain step, and a row computes the same whatever rows share its pass. The packed "
                          "copy is new memory, as large as the fp32 linear weights themselves; the row-major weights "
                          "are then no longer read; false keeps the stock kernels "
                          '(docs/benchmarks.md, "Verify cost by kernel").'
    )
    runner: Literal["auto", "transformers"] = Field(
        "auto", description="auto: specdec's own forward pass for Llama and GPT-2 models on packed weights (one fused op "
                            "where transformers dispatches several; the same logits within fp32 rounding), "
                            "transformers' forward for any other model; transformers: always transformers' forward "
                            "(docs/performance.md)."
    )
