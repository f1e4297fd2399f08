"""DraftService servicer: protobuf <-> Proposer, errors -> status codes. Nothing else."""

from __future__ import annotations

import grpc
from prometheus_client import Counter

from draft_service.proposer import Proposer
from specdec.convert import info_to_pb, sampling_from_pb
from specdec.scheduler import ComputeThread
from specdec.server import STORE_METRICS, create_server, message_limits, rpc
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

SERVICE = "draft"
PROPOSED = Counter("specdec_draft_proposed_tokens_total", "Draft tokens proposed.")
STOPS = Counter("specdec_draft_stops_total", "Propose calls by why drafting stopped.", ["reason"])


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self, proposer: Proposer, compute: ComputeThread | None = None) -> None:
        self.proposer = proposer
        # model compute runs on the compute thread when there is one (see ComputeThread)
        self._compute = compute

    def _run(self, context: grpc.ServicerContext, fn, *args):
        if self._compute is None:
            return fn(*args)
        return self._compute.run(fn, *args, context=context)

    @rpc(SERVICE)
    def Propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext) -> pb.ProposeResponse:
        # Validation on this RPC thread: a bad request never reaches the compute thread.
        job = self.proposer.prepare(
            request.session_id,
            request.tokens,
            request.max_draft_tokens,
            request.confidence_threshold,
            sampling_from_pb(request.sampling),
            request.return_distributions,
            request.yield_cores,
        )
        result = self._compute.submit(self.proposer, job, context) if self._compute else self.proposer.run(job)
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

    @rpc(SERVICE)
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return info_to_pb(self.proposer.info(), self._compute.snapshot() if self._compute else None)

    @rpc(SERVICE)
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        released = self._run(context, self.proposer.release, request.session_id)
        return pb.ReleaseResponse(released=released)


def build_server(proposer: Proposer, address: str, workers: int = 8, compute: ComputeThread | None = None, *,
                 interceptors: list[grpc.ServerInterceptor] | None = None, credentials: grpc.ServerCredentials | None = None):
    """(server, port, health) for ``proposer`` on ``address``; see specdec.server.create_server."""
    servicer = DraftServicer(proposer, compute)
    STORE_METRICS.track(SERVICE, proposer.store)
    info = proposer.info()
    limits = message_limits(info.max_context, info.vocab_size, info.max_draft_tokens, receives_distributions=False)
    name = pb.DESCRIPTOR.services_by_name["DraftService"].full_name
    return create_server(lambda s: pb_grpc.add_DraftServiceServicer_to_server(servicer, s), [name], address, workers,
                         limits, interceptors=interceptors or (), credentials=credentials)
