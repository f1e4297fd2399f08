"""DraftService servicer: protobuf <-> Proposer, errors -> status codes. Nothing else."""

from __future__ import annotations

import grpc
from prometheus_client import Counter

from draft_service.proposer import Proposer
from specdec.convert import info_to_pb, sampling_from_pb
from specdec.server import EVICTIONS, KV_BUDGET, KV_BYTES, SESSIONS, ComputeThread, create_server, rpc
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

SERVICE = "draft"
PROPOSED = Counter("specdec_draft_proposed_tokens_total", "Draft tokens proposed.")
STOPS = Counter("specdec_draft_stops_total", "Propose calls by why drafting stopped.", ["reason"])


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self, proposer: Proposer, compute: ComputeThread | None = None) -> None:
        self.proposer = proposer
        # model compute runs on the compute thread when there is one (see ComputeThread)
        self._run = compute.run if compute is not None else (lambda fn, *args: fn(*args))
        self._evictions_seen = 0

    @rpc(SERVICE)
    def Propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext) -> pb.ProposeResponse:
        result = self._run(
            self.proposer.propose,
            request.session_id,
            request.tokens,
            request.max_draft_tokens,
            request.confidence_threshold,
            sampling_from_pb(request.sampling),
            request.return_distributions,
        )
        PROPOSED.inc(len(result.tokens))
        STOPS.labels(result.stop_reason.name.lower()).inc()
        self._export_store()
        return pb.ProposeResponse(
            draft_tokens=result.tokens,
            confidences=result.confidences,
            stop_reason=result.stop_reason.value,
            distributions=[pb.SparseDistribution(token_ids=ids, probs=pr) for ids, pr in result.distributions],
            cached_tokens=result.cached_tokens,
            compute_ns=result.compute_ns,
        )

    @rpc(SERVICE)
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return info_to_pb(self.proposer.info())

    @rpc(SERVICE)
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        released = self._run(self.proposer.release, request.session_id)
        self._export_store()
        return pb.ReleaseResponse(released=released)

    def _export_store(self) -> None:
        store = self.proposer.store
        SESSIONS.labels(SERVICE).set(len(store))
        KV_BYTES.labels(SERVICE).set(store.nbytes)
        KV_BUDGET.labels(SERVICE).set(store.max_bytes)
        EVICTIONS.labels(SERVICE).inc(store.evictions - self._evictions_seen)
        self._evictions_seen = store.evictions


def build_server(proposer: Proposer, address: str, workers: int = 8, compute: ComputeThread | None = None):
    """(server, port, health) for ``proposer`` on ``address``; see specdec.server.create_server."""
    servicer = DraftServicer(proposer, compute)
    name = pb.DESCRIPTOR.services_by_name["DraftService"].full_name
    return create_server(lambda s: pb_grpc.add_DraftServiceServicer_to_server(servicer, s), [name], address, workers)
