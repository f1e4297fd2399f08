"""TargetService servicer: protobuf <-> TargetEngine, errors -> status codes. Nothing else."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import Counter

from specdec.convert import info_to_pb, sampling_from_pb
from specdec.scheduler import ComputeThread
from specdec.server import STORE_METRICS, create_server, message_limits, rpc
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
        self._compute = compute

    def _run(self, context: grpc.ServicerContext, fn, *args):
        if self._compute is None:
            return fn(*args)
        return self._compute.run(fn, *args, context=context)

    @rpc(SERVICE)
    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyResponse:
        # Validation on this RPC thread: a bad request never reaches the compute thread.
        job = self.engine.prepare(
            request.session_id,
            request.tokens,
            request.draft_tokens,
            sampling_from_pb(request.sampling),
            [(d.token_ids, d.probs) for d in request.draft_distributions],
            request.return_target_probs,
            request.yield_cores,
        )
        result = self._compute.submit(self.engine, job, context) if self._compute else self.engine.run(job)
        STEPS.inc()
        VERIFIED.inc(len(job.draft))
        ACCEPTED.inc(result.num_accepted)
        return pb.VerifyResponse(
            num_accepted=result.num_accepted,
            next_token=result.next_token,
            target_probs=result.target_probs,
            next_token_prob=result.next_token_prob,
            cached_tokens=result.cached_tokens,
            compute_ns=result.compute_ns,
            batch_sessions=result.batch_sessions,
            batch_rows=result.batch_rows,
            queue_ns=result.queue_ns,
            step_cpu_ns=result.step_cpu_ns,
        )

    @rpc(SERVICE)
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return info_to_pb(self.engine.info(), self._compute.snapshot() if self._compute else None)

    @rpc(SERVICE)
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        released = self._run(context, self.engine.release, request.session_id)
        return pb.ReleaseResponse(released=released)


def build_server(engine: TargetEngine, address: str, workers: int = 8, compute: ComputeThread | None = None, *,
                 interceptors: list[grpc.ServerInterceptor] | None = None, credentials: grpc.ServerCredentials | None = None):
    """(server, port, health) for ``engine`` on ``address``; see specdec.server.create_server."""
    servicer = TargetServicer(engine, compute)
    STORE_METRICS.track(SERVICE, engine.store)
    info = engine.info()
    limits = message_limits(info.max_context, info.vocab_size, info.max_draft_tokens, receives_distributions=True)
    name = pb.DESCRIPTOR.services_by_name["TargetService"].full_name
    return create_server(lambda s: pb_grpc.add_TargetServiceServicer_to_server(servicer, s), [name], address, workers,
                         limits, interceptors=interceptors or (), credentials=credentials)
