"""Settings shared by both model services (pydantic-settings: environment variables, then CLI
flags such as ``--model gpt2 --port 50052``). Each service subclasses with its own prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings

from specdec.models import EMBEDDED, default_cache_dir


def check_tls(settings: BaseSettings, cert: str, key: str, *, needs_cert: str = "", needs_ca: str = "") -> None:
    """The TLS fields of ``settings`` (server side or client side) make sense together: a
    certificate and its key both or neither; ``needs_cert`` (a client CA: mutual TLS) only with a
    certificate; a client certificate only with ``needs_ca`` (the CA it trusts)."""
    if (getattr(settings, cert) is None) != (getattr(settings, key) is None):
        raise ValueError(f"{cert} and {key} go together: set both, or neither")
    if needs_cert and getattr(settings, needs_cert) is not None and getattr(settings, cert) is None:
        raise ValueError(f"{needs_cert} (mutual TLS) needs {cert} and {key}")
    if needs_ca and getattr(settings, cert) is not None and getattr(settings, needs_ca) is None:
        raise ValueError(f"{cert} (mutual TLS) needs {needs_ca}")


def check_secret(settings: BaseSettings, name: str) -> None:
    """A secret comes from ``name`` or from ``name``_file, never both."""
    value: SecretStr | None = getattr(settings, name)
    if value is not None and value.get_secret_value().strip() and getattr(settings, f"{name}_file") is not None:
        raise ValueError(f"set {name} or {name}_file, not both")


class ModelServiceSettings(BaseSettings):
    """Common configuration of a model service."""

    model: str = Field(
        EMBEDDED,
        description="Hugging Face id, local checkpoint folder (or .gguf file for llamacpp), or 'embedded'.",
    )
    host: str = Field("127.0.0.1", description="Interface to bind (0.0.0.0: every interface, as in the containers).")
    port: int = Field(ge=0, le=65535, description="gRPC port (0 picks a free one).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weight dtype for the transformers backend (fp32 keeps verify numerics exact)."
    )
    device: str = Field("cpu", description="torch device for the transformers backend.")
    threads: int = Field(0, ge=0, description="Compute threads; 0 uses all cores.")
    max_sessions: int = Field(
        128, ge=1, description="Sessions kept in the KV cache store (LRU beyond); above the concurrent streams served."
    )
    kv_budget_mb: float = Field(1024, gt=0, description="KV cache budget in MiB across sessions (LRU eviction).")
    session_ttl_s: float = Field(600, ge=0, description="Drop sessions idle this long (0 keeps them).")
    max_draft_tokens: int = Field(32, ge=1, le=256, description="Largest draft a request may ask for / verify.")
    max_batch_rows: int = Field(
        256, ge=1, description="Token rows per batched forward pass (new tokens across its sessions); long prompts "
                               "are prefilled in chunks within it (specdec.engine.planner)."
    )
    shared_prefill_rows: int = Field(
        64, ge=0,
        description="Rows of long prefills in a pass that also decodes for other sessions (their inter-token latency); "
                    "a prefill alone uses max_batch_rows. 0: always max_batch_rows.",
    )

    workers: int = Field(
        136, ge=5, description="gRPC worker threads; at least max_queued_calls + 4, so health and Info always find one."
    )
    max_queued_calls: int = Field(
        128, ge=1,
        description="Model calls waiting for or in compute at once (each stream has at most one); more get RESOURCE_EXHAUSTED.",
    )
    batch_gather_ms: float = Field(
        30.0, ge=0, le=1000,
        description="Before a batched step, wait up to this long (and at most 15 % of the previous step) for the "
                    "sessions the previous step answered whose clients answer quickly; 0 never waits (docs/batching.md).",
    )
    hang_timeout_s: float = Field(
        8.0, gt=0, description="A forward pass still running after this long is taken for a hang: gRPC health says "
                               "NOT_SERVING until it returns (probes then restart or route around the service).",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535,
        description="Prometheus /metrics port, on the same interface as the gRPC port (host); unset disables.",
    )
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Where converted models are cached.")
    log_level: str = Field("INFO", description="Python logging level.")
    auth_token: SecretStr | None = Field(
        None, description="Require `authorization: Bearer <token>` on every RPC but grpc.health.v1 (docs/security.md)."
    )
    auth_token_file: Path | None = Field(None, description="File holding auth_token (a mounted secret); use one of the two.")
    tls_cert_file: Path | None = Field(None, description="PEM certificate chain of this service: serve TLS instead of plaintext.")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_client_ca_file: Path | None = Field(
        None, description="PEM CA bundle: require client certificates signed by it (mutual TLS); needs tls_cert_file."
    )

    @model_validator(mode="after")
    def _check_security(self):
        check_tls(self, "tls_cert_file", "tls_key_file", needs_cert="tls_client_ca_file")
        check_secret(self, "auth_token")
        return self

    @model_validator(mode="after")
    def _check_workers(self):
        if self.workers < self.max_queued_calls + 4:
            raise ValueError(f"workers ({self.workers}) must be at least max_queued_calls + 4 ({self.max_queued_calls + 4}), "
                             "so calls that do not compute (health, Info) always find a free thread")
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def kv_budget_bytes(self) -> int:
        return int(self.kv_budget_mb * 1024 * 1024)
