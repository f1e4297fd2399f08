"""Async gRPC clients of the two model services, with deadlines and per-RPC latency metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Histogram

from specdec.auth import ChannelSecurity, aio_channel
from specdec.params import Sampling
from specdec.server import MAX_MESSAGE_BYTES
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.wire import sampling_to_pb

RPC_CLIENT_LATENCY = Histogram(
    "specdec_rpc_client_duration_seconds",
    "Round-trip duration of model-service RPCs seen by the orchestrator.",
    ["service", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    # reconnect quickly once a restarted service is back
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    # Verify is idempotent (stateless protocol): a call that could not reach the target (connection
    # refused or reset, e.g. while it restarts) is retried a few times within ~1 s before the
    # request fails with 503. Propose is not retried: a step without a draft costs nothing.
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps({"methodConfig": [{
        "name": [{"service": "specdec.v1.TargetService", "method": "Verify"}],
        "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "0.4s", "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"]},
    }]})),
]


@dataclass
class Proposed:
    tokens: list[int]
    confidences: list[float]
    stop_reason: str
    distributions: list[tuple[list[int], list[float]]]
    cached_tokens: int  # leading request tokens already in the draft's cache
    compute_ms: float
    wall_ms: float
    batch_sessions: float = 1.0  # mean sessions per batched draft step it took part in
    queue_ms: float = 0.0  # wait before its first draft step
    step_cpu_ms: float = 0.0  # mean CPU time of the draft's process per draft step (0: not reported)


@dataclass
class Verified:
    num_accepted: int
    next_token: int
    target_probs: list[float]
    next_token_prob: float
    cached_tokens: int
    compute_ms: float
    wall_ms: float
    batch_sessions: int = 1  # sessions in the target's forward pass that verified it
    batch_rows: int = 0  # token rows in that pass (0: not reported)
    queue_ms: float = 0.0  # wait before that pass
    step_cpu_ms: float = 0.0  # CPU time of the target's process on that pass (0: not reported)
    # asked for: per emitted token (accepted draft tokens, then next_token) its raw logprob and
    # the top (ids, logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] | None = None


NOT_SERVING = "gRPC health NOT_SERVING (a forward pass has run past its hang timeout)"


class NotServing(grpc.aio.AioRpcError):
    """A service that answers, but whose gRPC health says NOT_SERVING (UNAVAILABLE to callers;
    its details, :data:`NOT_SERVING`, are the replica's reason for being down)."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), NOT_SERVING)


class _Client:
    service = ""

    def __init__(self, address: str, timeout_s: float, security: ChannelSecurity | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        # plaintext or TLS, with the bearer token on every call when one is configured
        self.channel = aio_channel(address, security, _CHANNEL_OPTIONS)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def info(self, timeout_s: float = 2.0) -> pb.InfoResponse:
        """Info, read beside the service's gRPC health: a service whose health says NOT_SERVING (a
        forward pass past its hang timeout) raises :class:`NotServing`, so readiness and routing
        agree with what its probes see. A health call that fails says nothing (Info decides)."""
        info, health = await asyncio.gather(
            self.stub.Info(pb.InfoRequest(), timeout=timeout_s),
            self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s),
            return_exceptions=True)
        if isinstance(info, BaseException):
            raise info
        if not isinstance(health, BaseException) and health.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            raise NotServing()
        return info

    async def release(self, session_id: str) -> bool:
        # Release waits for the compute thread, behind batched steps that may include long
        # prefills: a generous deadline and one retry, so a busy service still frees the session now
        # rather than at its idle TTL.
        for attempt in (1, 2):
            try:
                response = await self.stub.Release(pb.ReleaseRequest(session_id=session_id), timeout=10.0)
                return response.released
            except grpc.aio.AioRpcError as exc:
                if attempt == 2 or exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                      grpc.StatusCode.UNAVAILABLE):
                    raise
                await asyncio.sleep(0.5)
        return False

    async def close(self) -> None:
        await self.channel.close()


class DraftClient(_Client):
    service = "draft"

    def __init__(self, address: str, timeout_s: float, security: ChannelSecurity | None = None) -> None:
        super().__init__(address, timeout_s, security)
        self.stub = pb_grpc.DraftServiceStub(self.channel)

    async def propose(self, session_id: str, tokens: Sequence[int], k: int, threshold: float,
                      sampling: Sampling, yield_cores: bool = False) -> Proposed:
        request = pb.ProposeRequest(
            session_id=session_id, tokens=tokens, max_draft_tokens=k, confidence_threshold=threshold,
            sampling=sampling_to_pb(sampling), return_distributions=not sampling.greedy, yield_cores=yield_cores,
        )
        t0 = time.perf_counter()
        r = await self.stub.Propose(request, timeout=self.timeout_s)
        wall = time.perf_counter() - t0
        RPC_CLIENT_LATENCY.labels(self.service, "Propose").observe(wall)
        return Proposed(
            tokens=list(r.draft_tokens),
            confidences=list(r.confidences),
            stop_reason=pb.DraftStopReason.Name(r.stop_reason).removeprefix("DRAFT_STOP_REASON_").lower(),
            distributions=[(list(d.token_ids), list(d.probs)) for d in r.distributions],
            cached_tokens=r.cached_tokens,
            compute_ms=r.compute_ns / 1e6,
            wall_ms=wall * 1e3,
            batch_sessions=r.batch_sessions or 1.0,
            queue_ms=r.queue_ns / 1e6,
            step_cpu_ms=r.step_cpu_ns / 1e6,
        )


class TargetClient(_Client):
    service = "target"

    def __init__(self, address: str, timeout_s: float, security: ChannelSecurity | None = None) -> None:
        super().__init__(address, timeout_s, security)
        self.stub = pb_grpc.TargetServiceStub(self.channel)

    async def verify(self, session_id: str, tokens: Sequence[int], draft: Sequence[int], sampling: Sampling,
                     distributions: Sequence[tuple[list[int], list[float]]] = (),
                     return_target_probs: bool = True, yield_cores: bool = False,
                     logprobs: int | None = None, processed_logprobs: bool = False) -> Verified:
        request = pb.VerifyRequest(
            session_id=session_id, tokens=tokens, draft_tokens=draft, sampling=sampling_to_pb(sampling),
            draft_distributions=[pb.SparseDistribution(token_ids=i, probs=p) for i, p in distributions],
            return_target_probs=return_target_probs, yield_cores=yield_cores,
            return_logprobs=logprobs is not None, top_logprobs=logprobs or 0, processed_logprobs=processed_logprobs,
        )
        t0 = time.perf_counter()
        r = await self.stub.Verify(request, timeout=self.timeout_s)
        wall = time.perf_counter() - t0
        RPC_CLIENT_LATENCY.labels(self.service, "Verify").observe(wall)
        return Verified(
            num_accepted=r.num_accepted,
            next_token=r.next_token,
            target_probs=list(r.target_probs),
            next_token_prob=r.next_token_prob,
            cached_tokens=r.cached_tokens,
            compute_ms=r.compute_ns / 1e6,
            wall_ms=wall * 1e3,
            batch_sessions=r.batch_sessions or 1,
            batch_rows=r.batch_rows,
            queue_ms=r.queue_ns / 1e6,
            step_cpu_ms=r.step_cpu_ns / 1e6,
            logprobs=[(e.logprob, list(e.top_token_ids), list(e.top_logprobs)) for e in r.logprobs]
            if logprobs is not None else None,
        )
