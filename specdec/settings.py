"""Settings shared by both model services (pydantic-settings: environment variables, then CLI
flags such as ``--model gpt2 --port 50052``). Each service subclasses with its own prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings

from specdec.models import EMBEDDED, default_cache_dir


class ModelServiceSettings(BaseSettings):
    """Common configuration of a model service."""

    model: str = Field(
        EMBEDDED,
        description="Hugging Face id, local checkpoint folder (or .gguf file for llamacpp), or 'embedded'.",
    )
    host: str = Field("0.0.0.0", description="Interface to bind.")
    port: int = Field(ge=0, le=65535, description="gRPC port (0 picks a free one).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weight dtype for the transformers backend (fp32 keeps verify numerics exact)."
    )
    device: str = Field("cpu", description="torch device for the transformers backend.")
    threads: int = Field(0, ge=0, description="Compute threads; 0 uses all cores.")
    max_sessions: int = Field(64, ge=1, description="Sessions kept in the KV cache store (LRU beyond).")
    kv_budget_mb: float = Field(1024, gt=0, description="KV cache budget in MiB across sessions (LRU eviction).")
    session_ttl_s: float = Field(600, ge=0, description="Drop sessions idle this long (0 keeps them).")
    max_draft_tokens: int = Field(32, ge=1, le=256, description="Largest draft a request may ask for / verify.")
    workers: int = Field(8, ge=1, description="gRPC worker threads (compute itself is serialised per model).")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus /metrics port; unset disables.")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Where converted models are cached.")
    log_level: str = Field("INFO", description="Python logging level.")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def kv_budget_bytes(self) -> int:
        return int(self.kv_budget_mb * 1024 * 1024)
