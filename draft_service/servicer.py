"""DraftService servicer: protobuf <-> Proposer, errors -> status codes. Nothing else."""

from __future__ import annotations

import grpc
from prometheus_client import Counter

from draft_service.proposer import Proposer
from specdec.engine.compute import ComputeThread
from specdec.server import ModelServicer, rpc
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.wire import sampling_from_pb

SERVICE = "draft"
PROPOSED = Counter("specdec_draft_proposed_tokens_total", "Draft tokens proposed.")
STOPS = Counter("specdec_draft_stops_total", "Propose calls by why drafting stopped.", ["reason"])


class DraftServicer(ModelServicer, pb_grpc.DraftServiceServicer):
    service = SERVICE
    grpc_service = "DraftService"

    @rpc()
    def Propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext) -> pb.ProposeResponse:
        # Validation on this RPC thread: a bad request never reaches the compute thread.
        job = self.engine.prepare(
            request.session_id,
            request.tokens,
            request.max_draft_tokens,
            request.confidence_threshold,
            sampling_from_pb(request.sampling),
            request.return_distributions,
            request.yield_cores,
        )
        result = self._submit(job, context)
        PROPOSED.inc(len(result.tokens))
        STOPS.labels(result.stop_reason.name.lower()).inc()
        return pb.ProposeResponse(
            draft_tokens=result.tokens,
            confidences=result.confidences,
            stop_reason=result.stop_reason.value,
            distributions=[pb.SparseDistribution(token_ids=ids, probs=pr) for ids, pr in result.distributions],
            cached_tokens=result.cached_tokens,
            compute_ns=result.compute_ns,
            batch_sessions=result.batch_sessions,
            steps=result.steps,
            queue_ns=result.queue_ns,
            step_cpu_ns=result.step_cpu_ns,
        )


def build_server(proposer: Proposer, address: str, workers: int = 8, compute: ComputeThread | None = None, *,
                 interceptors: list[grpc.ServerInterceptor] | None = None, credentials: grpc.ServerCredentials | None = None):
    """(server, port, health) for ``proposer`` on ``address``; see specdec.server.create_server."""
    return DraftServicer(proposer, compute).build(pb_grpc.add_DraftServiceServicer_to_server, address, workers,
                                                  interceptors=interceptors, credentials=credentials)
