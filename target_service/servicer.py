"""TargetService servicer: protobuf <-> TargetEngine, errors -> status codes. Nothing else."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import Counter

from specdec.engine.compute import ComputeThread
from specdec.server import ModelServicer, rpc
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.wire import sampling_from_pb
from target_service.verify import TargetEngine

logger = logging.getLogger(__name__)

SERVICE = "target"
VERIFIED = Counter("specdec_target_draft_tokens_total", "Draft tokens verified by the target.")
ACCEPTED = Counter("specdec_target_accepted_tokens_total", "Draft tokens the target accepted.")
STEPS = Counter("specdec_target_verifications_total", "Verify calls (one forward pass each).")


class TargetServicer(ModelServicer, pb_grpc.TargetServiceServicer):
    service = SERVICE
    grpc_service = "TargetService"
    receives_distributions = True

    @rpc()
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
            request.top_logprobs if request.return_logprobs else None,
            request.processed_logprobs,
        )
        with self.engine.held_distributions.hold(job.distribution_bytes):
            result = self._submit(job, context)
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
            logprobs=[pb.TokenLogprobs(logprob=lp, top_token_ids=ids, top_logprobs=lps)
                      for lp, ids, lps in result.logprobs or ()],
        )


def build_server(engine: TargetEngine, address: str, workers: int = 8, compute: ComputeThread | None = None, *,
                 interceptors: list[grpc.ServerInterceptor] | None = None, credentials: grpc.ServerCredentials | None = None):
    """(server, port, health) for ``engine`` on ``address``; see specdec.server.create_server."""
    return TargetServicer(engine, compute).build(pb_grpc.add_TargetServiceServicer_to_server, address, workers,
                                                 interceptors=interceptors, credentials=credentials)
