"""Orchestrator configuration: SPECDEC_ORCHESTRATOR_* variables or CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specdec.settings import check_secret, check_tls

LOOPBACK_HOSTS = ("localhost", "127.0.0.1")  # bound to ::1: name the hosts in allowed_hosts

ControllerName = Literal["fixed", "acceptance", "hf", "cost"]


class OrchestratorSettings(BaseSettings):
    """How the orchestrator reaches the model services and what requests default to."""

    model_config = SettingsConfigDict(env_prefix="SPECDEC_ORCHESTRATOR_", cli_prog_name="python -m orchestrator")

    host: str = Field("127.0.0.1", description="Interface to bind (0.0.0.0: every interface, as in the containers).")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port.")
    draft_address: str = Field(
        "localhost:50051",
        description="host:port of the draft service; a comma-separated list, or a name resolving to several "
                    "addresses (a headless Service), for replicas (docs/deploy.md).",
    )
    target_address: str = Field(
        "localhost:50052",
        description="host:port of the target service; a comma-separated list, or a name resolving to several "
                    "addresses (a headless Service), for replicas: each session is pinned to one, and moves to "
                    "another when it fails (docs/deploy.md).",
    )
    replica_resolve_interval_s: float = Field(
        10.0, gt=0, description="Resolve the services' host names again this often (replicas joining or leaving)."
    )
    replica_probe_interval_s: float = Field(
        2.0, gt=0, description="Ask every replica's Info this often; one that answers again is routed to again."
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer to use (id, path or 'embedded'); default: the target's model id from Info."
    )
    draft_timeout_s: float = Field(2.0, gt=0, description="Deadline of one Propose call; past it the step runs without a draft.")
    draft_catch_up_chunk: int = Field(
        256, ge=32, description="A draft far behind the sequence (a long prompt, or after plain steps) catches up by "
                                "this many tokens per Propose, each call within draft_timeout_s (one that misses it "
                                "halves the chunk for its request, down to 32; a slow prefill never marks the draft "
                                "down).")
    target_timeout_s: float = Field(60.0, gt=0, description="Deadline of one Verify call.")
    draft_retry_s: float = Field(5.0, ge=0, description="After a draft failure, decode without drafts this long, then retry.")
    default_controller: ControllerName = Field("cost", description="Controller used when a request names none.")
    default_k: int = Field(4, ge=0, le=64, description="Initial (or, for 'fixed', constant) draft length.")
    default_max_k: int = Field(16, ge=1, le=64, description="Upper bound of k for adaptive controllers.")
    default_confidence_threshold: float = Field(
        0.1, ge=0, le=1, description="Draft stops after a token whose draft probability is below this."
    )
    default_overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="Overlapped speculation for greedy requests that do not choose (the draft drafts the next "
                            "block while the target verifies this one): on, off, or auto — while a request is the only "
                            "one in progress here and the draft computes on another host than the target (on a "
                            "shared host alternating is faster: docs/benchmarks.md, "
                            '"Overlap on shared cores").'
    )
    shared_host_max_streams: int = Field(
        1, ge=0,
        description="When the draft computes on the target's host, the cost controller drafts only while at most this "
                    "many generations are in progress here, and decodes plainly beyond (on 2 shared cores every k > 0 "
                    'loses to plain decoding from 2 streams on: docs/benchmarks.md, "Continuous batching"); 0: no '
                    "limit, the cost model alone decides.",
    )
    default_max_tokens: int = Field(
        128, ge=1, description="max_tokens when a /v1/generate request gives none (completions default to OpenAI's 16; "
                               "chat runs to EOS, the end of the context or max_tokens_limit).")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies get HTTP 413.")
    max_concurrent_requests: int = Field(
        64, ge=1, description="Generations in progress at once; more wait in the admission queue (before their prompt "
                              "is tokenised) for a slot.")
    max_concurrent_requests_per_key: int = Field(
        16, ge=1, description="Generations in progress at once under one API key (with API keys set); more wait in the "
                              "admission queue.")
    max_queued_requests: int = Field(
        256, ge=0, description="Requests that may wait in the admission queue for a slot; more get HTTP 429 at once "
                               "(0: no queue, every request over the limits gets 429).")
    queue_timeout_s: float = Field(
        30.0, gt=0, description="How long a request waits in the admission queue for a slot before it gets HTTP 429 "
                                "(with Retry-After).")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "raw_logprobs", description="The logprobs an OpenAI request gets when it names no logprobs_mode: raw_logprobs "
                                    "(the target's log-softmax at each position) or processed_logprobs (of the "
                                    "distribution each token was chosen from), as vLLM's --logprobs-mode.")
    drain_timeout_s: float = Field(
        25.0, ge=0, description="On SIGTERM the orchestrator stops admitting (503, /ready 503 `draining`) and lets the "
                                "generations in progress finish for this long; any still running then ends with a 503 "
                                "(an `error` event on a stream), so every client gets a terminal answer. Keep it below "
                                "the pod's terminationGracePeriodSeconds minus its preStop pause.",
    )
    stream_send_timeout_s: float = Field(
        30.0, gt=0, description="A stream whose client takes no event for this long is cancelled: its generation "
                                "stops, its sessions are released and its slot is freed (a client that stopped reading).",
    )
    stream_send_buffer_kb: int = Field(
        256, ge=0, description="Send buffer of each client connection in KiB (0: the kernel's own, which grows to "
                               "several MiB): what may wait for a client that stopped reading before the send timeout runs.",
    )
    response_send_timeout_s: float = Field(
        30.0, gt=0, description="A connection whose client takes no byte of a response for this long is closed and "
                                "what waits for it dropped (a non-streaming answer nobody reads; a stream is also "
                                "cancelled by stream_send_timeout_s).",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="A connection that has not sent a whole request head this long after it opened (or "
                                "after its last response) is closed: a client trickling headers holds no connection.",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request whose body has not fully arrived this long after its head gets HTTP 408.",
    )
    allowed_hosts: str | None = Field(
        None, description="Comma-separated host names the Host header may carry (`*.example.com` matches subdomains, "
                          "`*` any); others get HTTP 400. Default: bound to 127.0.0.1 or localhost, only "
                          "`localhost,127.0.0.1` (a web page's DNS rebinding cannot reach the API), else any.",
    )
    model_name: str | None = Field(None, description="Model name reported by /v1/models; default: the target's model id.")
    log_level: str = Field("INFO", description="Python logging level.")
    # A comma-separated string, not a list: pydantic-settings would otherwise expect JSON in the variable.
    api_keys: SecretStr | None = Field(
        None, description="Comma-separated API keys; when any is set, every route but /health and /ready needs "
                          "`Authorization: Bearer <key>` (docs/security.md)."
    )
    api_keys_file: Path | None = Field(
        None, description="File with one API key per line (blank lines and # comments ignored); merged with api_keys."
    )
    grpc_token: SecretStr | None = Field(None, description="Bearer token sent to both model services (their auth_token).")
    grpc_token_file: Path | None = Field(None, description="File holding grpc_token (a mounted secret); use one of the two.")
    grpc_tls_ca_file: Path | None = Field(
        None, description="PEM CA bundle: reach the model services over TLS and verify their certificates with it."
    )
    grpc_tls_cert_file: Path | None = Field(
        None, description="PEM client certificate for services that require one (mutual TLS); needs grpc_tls_ca_file."
    )
    grpc_tls_key_file: Path | None = Field(None, description="PEM private key of grpc_tls_cert_file.")
    grpc_tls_server_name: str | None = Field(
        None, description="Name to expect in the services' certificates instead of the host of their address."
    )
    draft_tls_server_name: str | None = Field(
        None, description="Name to expect in the draft service's certificate; wins over grpc_tls_server_name."
    )
    target_tls_server_name: str | None = Field(
        None, description="Name to expect in the target service's certificate; wins over grpc_tls_server_name."
    )

    def trusted_hosts(self) -> list[str]:
        """The Host header values the API answers (``allowed_hosts``, or the default for the bind address)."""
        if self.allowed_hosts is not None:
            return [h.strip() for h in self.allowed_hosts.split(",") if h.strip()] or ["*"]
        return list(LOOPBACK_HOSTS) if self.host in LOOPBACK_HOSTS else ["*"]

    @model_validator(mode="after")
    def _check_security(self):
        check_tls(self, "grpc_tls_cert_file", "grpc_tls_key_file", needs_ca="grpc_tls_ca_file")
        check_secret(self, "grpc_token")
        return self
