"""A Release wins over every call made before it: a Propose still waiting on the draft when its
session is released (a pre-draft or catch-up the orchestrator cancelled, which the draft may not
have seen cancelled yet: gRPC orders nothing between two calls) must not re-create the session.

Each race is forced with events on a real draft service (gRPC on a real port, its compute thread,
the transformers backend on a tiny model, llama.cpp on the embedded draft), never with sleeps: the Propose waits in the compute
queue, or between two of its draft steps, while the Release is queued and answered.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from draft_service.servicer import build_server
from specdec.engine.compute import PENDING, ComputeThread
from specdec.engine.sessions import SessionStore
from specdec.models import load_hf
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.support import wait_until

PROMPT = [7, 3, 12, 5, 9, 20, 2, 11]
K = 4


def make_proposer(request, backend: str):
    if backend == "transformers":
        from draft_service.backends.hf import TransformersProposer

        return TransformersProposer(load_hf(request.getfixturevalue("tiny_models")["gpt2-draft"]),
                                    SessionStore(8, 1 << 30, 0), 8)
    from draft_service.backends.llamacpp import LlamaCppProposer
    from specdec.models import embedded_gguf_path

    return LlamaCppProposer(str(embedded_gguf_path()), 8, 64 << 20, 0, 8)


@pytest.fixture(params=["transformers", pytest.param("llamacpp", marks=pytest.mark.embedded)])
def draft(request):
    """(stub, proposer, compute, stop): a draft service whose compute thread the test starts."""
    proposer = make_proposer(request, request.param)
    compute = ComputeThread(max_queued=8, service="draft", gather_ms=0)
    server, port, _ = build_server(proposer, "127.0.0.1:0", workers=4, compute=compute)
    server.start()
    stop = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.DraftServiceStub(channel), proposer, compute, stop
    stop.set()
    compute.close()
    server.stop(0)


def propose(stub, session_id: str):
    """Propose, returning the response or the status code it ended with."""
    try:
        return stub.Propose(pb.ProposeRequest(session_id=session_id, tokens=PROMPT, max_draft_tokens=K), timeout=60)
    except grpc.RpcError as exc:
        return exc.code()


def test_a_propose_queued_before_the_release_does_not_recreate_the_session(draft):
    stub, proposer, compute, stop = draft
    with ThreadPoolExecutor(3) as pool:
        pending = pool.submit(propose, stub, "queued")
        wait_until(lambda: compute._queue.qsize() == 1, 10, "the Propose waiting for the compute thread")
        release = pool.submit(stub.Release, pb.ReleaseRequest(session_id="queued"), timeout=60)
        wait_until(lambda: compute._queue.qsize() == 2, 10, "the Release queued behind it")
        # The compute thread takes both in order: the Propose joins the batch, the Release runs at
        # once (a plain call), then the batch steps.
        serving = pool.submit(compute.serve, stop)
        outcome = pending.result(timeout=60)
        assert release.result(timeout=60).released is False  # nothing held yet when it ran
        stop.set()
        serving.result(timeout=10)
    assert outcome == grpc.StatusCode.CANCELLED
    assert "queued" not in proposer.store and len(proposer.store) == 0 and proposer.store.nbytes == 0


def test_a_propose_between_its_steps_when_released_does_not_recreate_the_session(draft, monkeypatch):
    stub, proposer, compute, stop = draft
    stepped, go = threading.Event(), threading.Event()
    first_outcome = []
    step = proposer.step

    def held_step(jobs):
        result = step(jobs)
        if not stepped.is_set():  # after the Propose's first step: its session holds the prompt
            first_outcome.append(result.outcomes[0])
            stepped.set()
            assert go.wait(30)
        return result

    monkeypatch.setattr(proposer, "step", held_step)
    with ThreadPoolExecutor(3) as pool:
        serving = pool.submit(compute.serve, stop)
        pending = pool.submit(propose, stub, "stepping")
        assert stepped.wait(30)
        assert first_outcome == [PENDING]  # K tokens take K steps: the job waits for its next one
        assert "stepping" in proposer.store
        release = pool.submit(stub.Release, pb.ReleaseRequest(session_id="stepping"), timeout=60)
        wait_until(lambda: compute._queue.qsize() == 1, 10, "the Release queued behind the step in progress")
        go.set()
        assert release.result(timeout=60).released is True
        outcome = pending.result(timeout=60)
        stop.set()
        serving.result(timeout=10)
    assert outcome == grpc.StatusCode.CANCELLED
    assert "stepping" not in proposer.store and len(proposer.store) == 0 and proposer.store.nbytes == 0


def test_a_propose_made_after_the_release_is_served(draft):
    """Only calls made before the Release lose to it: the same id used again is a new session."""
    stub, proposer, compute, stop = draft
    with ThreadPoolExecutor(1) as pool:
        serving = pool.submit(compute.serve, stop)
        first = stub.Propose(pb.ProposeRequest(session_id="again", tokens=PROMPT, max_draft_tokens=K), timeout=60)
        assert stub.Release(pb.ReleaseRequest(session_id="again"), timeout=60).released is True
        second = stub.Propose(pb.ProposeRequest(session_id="again", tokens=PROMPT, max_draft_tokens=K), timeout=60)
        stop.set()
        serving.result(timeout=10)
    assert list(second.draft_tokens) == list(first.draft_tokens) and second.cached_tokens == 0
    assert "again" in proposer.store
