"""TargetService servicer: protobuf <-> TargetEngine, errors -> status codes. Nothing else."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import Counter

from specdec.convert import info_to_pb, sampling_from_pb
from specdec.server import EVICTIONS, KV_BUDGET, KV_BYTES, SESSIONS, ComputeThread, create_server, rpc
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from target_service.engine import TargetEngine

logger = logging.getLogger(__name__)

SERVICE = "target"
VERIFIED = Counter("specdec_target_draft_tokens_total", "Draft tokens verified by the target.")
ACCEPTED = Counter("specdec_target_accepted_tokens_total", "Draft tokens the target accepted.")
STEPS = Counter("specdec_target_verifications_total", "Verify calls (one forward pass each).")


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetEngine, compute: ComputeThread | None = None) -> None:
        self.engine = engine
        # model compute runs on the compute thread when there is one (see ComputeThread)
        self._run = compute.run if compute is not None else (lambda fn, *args: fn(*args))
        self._evictions_seen = 0

    @rpc(SERVICE)
    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyResponse:
        result = self._run(
            self.engine.verify,
            request.session_id,
            request.tokens,
            request.draft_tokens,
            sampling_from_pb(request.sampling),
            [(d.token_ids, d.probs) for d in request.draft_distributions],
            request.return_target_probs,
        )
        STEPS.inc()
        VERIFIED.inc(len(request.draft_tokens))
        ACCEPTED.inc(result.num_accepted)
        self._export_store()
        return pb.VerifyResponse(
            num_accepted=result.num_accepted,
            next_token=result.next_token,
            target_probs=result.target_probs,
            next_token_prob=result.next_token_prob,
            cached_tokens=result.cached_tokens,
            compute_ns=result.compute_ns,
        )

    @rpc(SERVICE)
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return info_to_pb(self.engine.info())

    @rpc(SERVICE)
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        released = self._run(self.engine.release, request.session_id)
        self._export_store()
        return pb.ReleaseResponse(released=released)

    def _export_store(self) -> None:
        store = self.engine.store
        SESSIONS.labels(SERVICE).set(len(store))
        KV_BYTES.labels(SERVICE).set(store.nbytes)
        KV_BUDGET.labels(SERVICE).set(store.max_bytes)
        EVICTIONS.labels(SERVICE).inc(store.evictions - self._evictions_seen)
        self._evictions_seen = store.evictions


def build_server(engine: TargetEngine, address: str, workers: int = 8, compute: ComputeThread | None = None):
    """(server, port, health) for ``engine`` on ``address``; see specdec.server.create_server."""
    servicer = TargetServicer(engine, compute)
    name = pb.DESCRIPTOR.services_by_name["TargetService"].full_name
    return create_server(lambda s: pb_grpc.add_TargetServiceServicer_to_server(servicer, s), [name], address, workers)
