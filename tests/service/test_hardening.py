"""Regression tests for defects found by hand-made bad input and code review: thread safety of the
session store and metrics, cache state after a failed forward, validation of draft distributions,
the compute thread's bounds and cancellation, error texts, and the orchestrator's input checks."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import sampling as sm
from specdec.engine.compute import ComputeThread
from specdec.engine.sessions import SessionStore
from specdec.errors import Cancelled, InvalidArgument, ResourceExhausted, Unavailable
from specdec.models import load_hf
from specdec.server import STORE_METRICS, message_limits
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from target_service.servicer import build_server as build_target
from target_service.verify import TargetEngine
from tests.support import PROMPT, EngineTarget, greedy_reference, wait_until


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return load_hf(tiny_models["llama-target"])


@pytest.fixture
def engine(loaded):
    return TargetEngine(loaded, SessionStore(8, 1 << 30, 0), max_draft_tokens=8)


# ---- session store -------------------------------------------------------------------------------

def test_store_size_can_be_read_while_another_thread_evicts():
    """Readers on RPC threads (Info, metrics) used to iterate the session map while the compute
    thread reordered and evicted it: RuntimeError, which became an INTERNAL for a good request."""
    store = SessionStore(max_sessions=4, max_bytes=1 << 40, ttl_s=0)
    stop, errors = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            try:
                # 4 sessions of at most 600 bytes: a total that drifted from its sessions shows here
                assert 0 <= store.nbytes <= 4 * 600 and len(store) <= 4
            except Exception as exc:  # noqa: BLE001 - any failure here is the bug
                errors.append(exc)
                return

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for i in range(30_000):
            session = store.get_or_create(f"s{i % 9}", lambda: None)  # 9 ids over 4 slots: constant eviction
            store.update(session, [1] * (i % 7), 100 * (i % 7))
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert errors == []
    assert store.nbytes == sum(s.nbytes for s in store._sessions.values())


def test_store_byte_total_follows_every_kind_of_removal():
    evicted = []
    store = SessionStore(max_sessions=2, max_bytes=1000, ttl_s=0, on_evict=lambda s: evicted.append(s.session_id))
    a = store.get_or_create("a", lambda: None)
    store.update(a, [1, 2], 200)
    b = store.get_or_create("b", lambda: None)
    store.update(b, [1], 300)
    assert store.nbytes == 500
    store.get_or_create("c", lambda: None)  # count bound: a (LRU) goes
    assert evicted == ["a"] and store.nbytes == 300
    store.update(a, [9], 999)  # a stale handle of an evicted session changes nothing
    assert store.nbytes == 300
    assert store.release("b") and store.nbytes == 0
    c = store.get_or_create("c", lambda: None)
    store.update(c, [1], 400)
    store.reset(c)
    assert store.nbytes == 0 and c.tokens == []
    store.update(c, [1], 400)
    store.clear()
    assert store.nbytes == 0 and len(store) == 0


def test_store_metrics_are_read_at_scrape_time():
    from prometheus_client import generate_latest

    store = SessionStore(4, 4096, 0)
    STORE_METRICS.track("test-store", store)
    s = store.get_or_create("x", lambda: None)
    store.update(s, [1, 2, 3], 1234)
    text = generate_latest().decode()
    assert 'specdec_kv_bytes{service="test-store"} 1234.0' in text
    assert 'specdec_sessions{service="test-store"} 1.0' in text
    assert 'specdec_kv_budget_bytes{service="test-store"} 4096.0' in text
    assert 'specdec_session_evictions_total{service="test-store"} 0.0' in text


# ---- cache state after failures -----------------------------------------------------------------

def test_a_failed_forward_resets_the_session(engine, monkeypatch):
    """extend() used to crop the cache before the forward; when the forward raised, the session
    still claimed the old tokens, and the next call reused a cache that did not hold them."""
    model = engine.lm.model
    ref = greedy_reference(model, PROMPT + [4, 4, 4], 3)
    engine.verify("s", PROMPT + [4, 4, 4])  # the cache now holds 11 tokens

    def broken(self, *args, **kwargs):
        raise RuntimeError("forward failed")

    monkeypatch.setattr(type(model), "forward", broken)
    if engine.lm.runner is not None:  # specdec's own forward (specdec.model.runner) serves this model
        monkeypatch.setattr(engine.lm.runner, "forward", lambda batch: broken(None))
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.verify("s", PROMPT[:5] + [6])  # crops to 5, then fails
    monkeypatch.undo()
    session = engine.store.get_or_create("s", lambda: None)
    assert session.tokens == [] and session.cache.length == 0 and engine.store.nbytes == 0
    seq = PROMPT + [4, 4, 4]
    for want in ref:  # the next calls re-prefill and decode exactly the plain greedy tokens
        v = engine.verify("s", seq)
        assert v.next_token == want
        seq.append(v.next_token)


def test_a_refused_reservation_leaves_the_session_intact(engine):
    engine.verify("keep", PROMPT)
    session = engine.store.get_or_create("keep", lambda: None)
    tokens, nbytes, held = list(session.tokens), session.nbytes, session.cache.length
    capacity = session.cache.capacity
    engine.store.max_bytes = nbytes  # no room to grow the buffer
    try:
        with pytest.raises(ResourceExhausted):
            engine.lm.extend(session, PROMPT + [1] * capacity)
    finally:
        engine.store.max_bytes = 1 << 30
    assert session.tokens == tokens and session.nbytes == nbytes and session.cache.length == held
    assert engine.verify("keep", PROMPT + [1]).cached_tokens == len(PROMPT)


# ---- the target's input checks ------------------------------------------------------------------

SAMPLING = sm.Sampling(temperature=1.0, seed=3)


@pytest.mark.parametrize(
    "dists, message",
    [
        ([([1, 2], [0.5])], "2 token_ids but 1 probs"),
        ([([1, 99], [0.5, 0.5])], "outside the vocabulary"),
        ([([1, 2], [0.5, float("nan")])], "non-finite"),
        ([([1, 2], [1.5, -0.5])], "negative"),
        ([([1, 2], [0.2, 0.2])], "sums to"),
        ([([1, 1], [0.5, 0.5])], "repeats"),
        ([([], [])], "empty"),
        ([([2], [1.0])], "probability 0 to its own draft token 1"),
        ([([1], [1.0]), ([1], [1.0])], "one draft distribution per draft token"),
    ],
)
def test_target_rejects_bad_draft_distributions(engine, dists, message):
    with pytest.raises(InvalidArgument, match=message):
        engine.verify("d", PROMPT, [1], SAMPLING, dists)


def _support(vocab: int, token: int, entries: int) -> tuple[list[int], list[float]]:
    ids = [token, *[i for i in range(vocab) if i != token][:entries - 1]]
    return ids, [1.0 / len(ids)] * len(ids)


def test_a_waiting_verification_holds_its_draft_distributions_sparse(engine):
    """A prepared (waiting) job used to hold k dense [V] rows: 32 draft tokens of GPT-2 were 6.4 MB
    each, 0.8 GB for 128 waiting. Now it holds what was sent, and the verification is the same."""
    vocab = engine.info().vocab_size
    draft = [3, 5, 7, 9]
    dists = [_support(vocab, x, 16) for x in draft]
    job = engine.prepare("sparse", PROMPT, draft, SAMPLING, dists)
    assert job.distribution_bytes == len(draft) * 16 * 8 < len(draft) * vocab * 4
    # the same acceptance and next token as the same distributions sent over the whole vocabulary
    got = engine.run(job)
    padded = []
    for ids, probs in dists:
        row = dict(zip(ids, probs, strict=True))
        padded.append((list(range(vocab)), [row.get(i, 0.0) for i in range(vocab)]))
    dense = engine.verify("dense", PROMPT, draft, SAMPLING, padded)
    assert (got.num_accepted, got.next_token) == (dense.num_accepted, dense.next_token)


def test_verifications_past_the_distribution_limit_are_resource_exhausted(loaded):
    """Draft distributions of the calls waiting count against max_queued_distributions_mb: a call
    that would pass it is refused before it waits, and what a call held is given back."""
    vocab = loaded.model.config.vocab_size
    draft = [3, 5, 7, 9]
    whole = [_support(vocab, x, vocab) for x in draft]  # the whole vocabulary per token
    cost = len(draft) * vocab * 8
    engine = TargetEngine(loaded, SessionStore(8, 1 << 30, 0), max_draft_tokens=8,
                          max_queued_distribution_bytes=cost + cost // 2)
    server, port, _ = build_target(engine, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TargetServiceStub(channel)

            def verify(session: str) -> pb.VerifyResponse:
                return stub.Verify(pb.VerifyRequest(
                    session_id=session, tokens=PROMPT, draft_tokens=draft,
                    sampling=pb.SamplingParams(temperature=1.0, seed=1),
                    draft_distributions=[pb.SparseDistribution(token_ids=i, probs=p) for i, p in whole]), timeout=30)

            assert verify("a").compute_ns > 0  # one fits, and gives back what it held
            assert verify("b").compute_ns > 0
            with engine.held_distributions.hold(cost // 2 + 1):  # another call's distributions, waiting
                with pytest.raises(grpc.RpcError) as err:
                    verify("c")
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_queued_distributions_mb" in err.value.details()
            assert engine.held_distributions.held == 0
            assert verify("d").compute_ns > 0
    finally:
        server.stop(0)


def test_temperature_below_epsilon_is_greedy(engine):
    """temperature 1e-40 used to divide the logits into inf, and sampling failed on NaN."""
    assert sm.Sampling(temperature=1e-40).greedy and not sm.Sampling(temperature=1e-3).greedy
    greedy = engine.verify("g0", PROMPT)
    tiny = engine.verify("g1", PROMPT, sampling=sm.Sampling(temperature=1e-40, seed=1))
    assert tiny.next_token == greedy.next_token
    with pytest.raises(InvalidArgument, match="temperature"):
        engine.verify("g2", PROMPT, sampling=sm.Sampling(temperature=float("inf")))


def test_eos_ids_include_the_generation_config(tmp_path):
    from transformers import GenerationConfig

    from specdec.engine.requests import eos_ids
    from tests.support import make_gpt2

    folder = make_gpt2(tmp_path / "m", 0)
    GenerationConfig(eos_token_id=[0, 5]).save_pretrained(folder)
    loaded = load_hf(folder)
    assert 5 in eos_ids(loaded.model.config, loaded.tokenizer, loaded.model.generation_config)
    assert TargetEngine(loaded, SessionStore(2, 1 << 30, 0)).info().eos_token_ids == [0, 5]


def test_message_limits_follow_the_model():
    receive, send = message_limits(max_context=100, vocab_size=1000, max_draft_tokens=4, receives_distributions=True)
    assert 4 * 9 * 1000 < receive < 4 * 9 * 1000 + 200 * 1024 and send < 100 * 1024
    receive, send = message_limits(100, 1000, 4, receives_distributions=False)
    assert receive < 100 * 1024 and send > 4 * 9 * 1000


# ---- the compute thread -------------------------------------------------------------------------

def test_compute_queue_is_bounded():
    compute = ComputeThread(max_queued=2)
    stop = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        waiting = [pool.submit(compute.run, lambda: "ran") for _ in range(2)]
        # both are queued; the compute thread has not started serving
        wait_until(lambda: compute.snapshot().queued == 2, 10, lambda: f"{compute.snapshot().queued} calls queued, not 2")
        with pytest.raises(ResourceExhausted, match="2 calls are already waiting"):
            pool.submit(compute.run, lambda: "x").result()
        pool.submit(lambda: [f.result() for f in waiting] and stop.set())
        compute.serve(stop)
    assert [f.result() for f in waiting] == ["ran", "ran"]


def test_close_fails_queued_calls_instead_of_hanging():
    compute = ComputeThread()
    with ThreadPoolExecutor(2) as pool:
        queued = pool.submit(compute.run, lambda: "never")
        wait_until(lambda: compute.snapshot().queued == 1, 10, "the call queued")
        compute.close()
        with pytest.raises(Unavailable):
            queued.result(timeout=5)
        with pytest.raises(Unavailable):
            pool.submit(compute.run, lambda: 1).result(timeout=5)


@pytest.fixture
def busy_target(engine):
    """A target server whose compute thread is not serving yet: calls queue up."""
    compute = ComputeThread(max_queued=2, service="target")
    server, port, _ = build_target(engine, "127.0.0.1:0", workers=6, compute=compute)
    server.start()
    stop = threading.Event()
    yield f"127.0.0.1:{port}", compute, stop
    stop.set()
    compute.close()
    server.stop(0)


def test_deadline_drops_queued_work_and_health_still_answers(busy_target, engine):
    address, compute, stop = busy_target
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(pb.VerifyRequest(session_id="late", tokens=PROMPT), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # the late call gave its place back once its RPC ended (the server sees that after the client)
        wait_until(lambda: compute.snapshot().queued == 0, 10, "the late call's place given back")
        # compute is saturated by queued calls, yet health, Info and bad input answer at once
        with ThreadPoolExecutor(2) as pool:
            queued = [pool.submit(stub.Verify, pb.VerifyRequest(session_id=f"q{i}", tokens=PROMPT), timeout=30)
                      for i in range(2)]
            wait_until(lambda: compute.snapshot().queued == 2, 10,
                       lambda: f"{compute.snapshot().queued} Verify calls queued, not 2")
            with pytest.raises(grpc.RpcError) as full:
                stub.Verify(pb.VerifyRequest(session_id="over", tokens=PROMPT), timeout=5)
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
            assert stub.Info(pb.InfoRequest(), timeout=2).vocab_size == engine.lm.vocab_size
            with pytest.raises(grpc.RpcError) as bad:  # validated on the RPC thread, never queued
                stub.Verify(pb.VerifyRequest(session_id="bad", tokens=[10_000]), timeout=2)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            threading.Thread(target=compute.serve, args=(stop,), daemon=True).start()
            assert all(f.result().compute_ns > 0 for f in queued)
    # the call whose deadline passed never ran: its session was never created
    assert "late" not in engine.store


def test_cancelled_work_is_reported_as_cancelled():
    compute = ComputeThread()

    class Context:
        def __init__(self) -> None:
            self.registered = threading.Event()

        def add_callback(self, callback) -> bool:
            self.callback = callback
            self.registered.set()
            return True

    context = Context()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(compute.run, lambda: "never", context=context)
        assert context.registered.wait(10)  # the call is queued, its end watched
        context.callback()  # the RPC ended
        with pytest.raises(Cancelled):
            pending.result(timeout=5)


def test_internal_errors_do_not_leak_exception_text(engine, monkeypatch):
    server, port, _ = build_target(engine, "127.0.0.1:0")
    server.start()
    monkeypatch.setattr(engine, "run", lambda job: (_ for _ in ()).throw(RuntimeError("secret /etc/path detail")))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.TargetServiceStub(channel).Verify(pb.VerifyRequest(session_id="i", tokens=PROMPT), timeout=10)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "secret" not in err.value.details() and "server log" in err.value.details()
    finally:
        server.stop(0)


def test_oversized_messages_are_refused_before_parsing(engine):
    server, port, _ = build_target(engine, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 1 << 26)]) as channel:
            stub = pb_grpc.TargetServiceStub(channel)
            huge = pb.VerifyRequest(session_id="big", tokens=[1] * 3_000_000)
            with pytest.raises(grpc.RpcError) as err:
                stub.Verify(huge, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert stub.Verify(pb.VerifyRequest(session_id="ok", tokens=PROMPT), timeout=30).compute_ns > 0
    finally:
        server.stop(0)


# ---- the orchestrator ---------------------------------------------------------------------------

@pytest.fixture
def app():
    from orchestrator.app import create_app
    from orchestrator.settings import OrchestratorSettings

    # no model services behind it: these checks happen before any generation
    return create_app(OrchestratorSettings(draft_address="127.0.0.1:1", target_address="127.0.0.1:1",
                                           max_body_bytes=4096))


async def _post(app, path: str, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # which does not run the lifespan: it is entered here
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        return await client.post(path, **kwargs)


async def test_chunked_body_over_the_limit_is_413(app):
    async def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1024
        yield b'"}'

    r = await _post(app, "/v1/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "4096 bytes" in r.json()["detail"]


async def test_a_body_that_does_not_arrive_in_time_is_408_and_the_connection_closed():
    from orchestrator.app import create_app
    from orchestrator.settings import OrchestratorSettings

    app = create_app(OrchestratorSettings(draft_address="127.0.0.1:1", target_address="127.0.0.1:1",
                                          body_timeout_s=0.5))

    async def trickle():
        yield b'{"prompt": "'
        await asyncio.sleep(3)  # the behaviour under test: a client stalled mid-body, past body_timeout_s
        yield b'x"}'

    t0 = time.monotonic()
    r = await _post(app, "/v1/completions", content=trickle(), headers={"content-type": "application/json"})
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
    assert r.headers["connection"] == "close" and time.monotonic() - t0 < 2.5


@pytest.mark.parametrize("host, allowed, status", [
    ("localhost:8000", None, 200),
    ("127.0.0.1:8000", None, 200),
    ("attacker.example:8000", None, 400),  # a page whose name now resolves to 127.0.0.1 (DNS rebinding)
    ("attacker.example", "api.example,*.internal", 400),
    ("models.internal", "api.example,*.internal", 200),
    ("attacker.example", "*", 200),
])
async def test_the_host_header_is_checked_against_allowed_hosts(host, allowed, status):
    from orchestrator.app import create_app
    from orchestrator.settings import OrchestratorSettings

    app = create_app(OrchestratorSettings(draft_address="127.0.0.1:1", target_address="127.0.0.1:1",
                                          allowed_hosts=allowed))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        r = await client.get("/health", headers={"host": host})
    assert r.status_code == status, r.text


def test_any_host_is_allowed_by_default_when_bound_beyond_loopback():
    from orchestrator.settings import OrchestratorSettings

    assert OrchestratorSettings(host="0.0.0.0").trusted_hosts() == ["*"]
    assert OrchestratorSettings().trusted_hosts() == ["localhost", "127.0.0.1"]


@pytest.mark.parametrize(
    "path, raw, field",
    [
        ("/v1/generate", b'{"prompt": "\\udcff"}', "prompt"),
        ("/v1/generate", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
        ("/v1/generate", b'{"messages": [{"role": "user", "content": "a\\udcffb"}]}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udcff"}]}]}',
         "messages"),
        ("/v1/completions", b'{"prompt": ["\\udcff"]}', "prompt"),
        ("/v1/generate", b'{"prompt": "x", "temperature": NaN}', "temperature"),
        ("/v1/generate", b'{"prompt": "x", "top_p": Infinity}', "top_p"),
        ("/v1/generate", b'{"prompt": "x", "top_k": 8589934592}', "top_k"),
        ("/v1/generate", b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}', "stop"),
    ],
)
async def test_unencodable_or_out_of_range_input_is_refused(app, path, raw, field):
    """422 naming the field on specdec's routes; on the OpenAI routes OpenAI's 400 with the field
    as its param."""
    r = await _post(app, path, content=raw, headers={"content-type": "application/json"})
    if path == "/v1/generate":
        assert r.status_code == 422, r.text
        assert field in r.text
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].startswith(field), error


def _runtime(max_concurrent: int = 2, per_key: int = 1):
    from orchestrator.generation import DraftHealth, ModelLimits
    from orchestrator.runtime import Runtime
    from orchestrator.settings import OrchestratorSettings

    settings = OrchestratorSettings(max_concurrent_requests=max_concurrent, max_concurrent_requests_per_key=per_key,
                                    max_queued_requests=0)
    rt = Runtime(settings=settings, draft=None, target=None, draft_health=DraftHealth(1.0))
    rt.tokenizer, rt.not_ready = object(), ""
    rt.limits = ModelLimits(100, 8, 100, 8, {0})
    return rt


def test_admission_limits_answer_429_with_retry_after():
    """Without a queue (max_queued_requests=0) a request over the limits gets 429 at once; a
    refusal in prepare gives its slot back."""
    from fastapi import HTTPException

    from orchestrator.schemas import GenerateRequest
    from orchestrator.service import admit, prepare

    rt = _runtime(max_concurrent=2, per_key=1)
    body = GenerateRequest(prompt="x")

    def take(key):
        (slot,) = asyncio.run(admit(rt, key))
        return prepare(rt, body, [1, 2], 4, None, False, sm.Sampling(), slot)

    first = take("k1")
    with pytest.raises(HTTPException) as err:
        take("k1")
    assert err.value.status_code == 429 and err.value.headers["Retry-After"] == "1" and "API key" in err.value.detail
    second = take("k2")
    with pytest.raises(HTTPException) as err:
        take("k3")
    assert err.value.status_code == 429 and "Retry-After" in err.value.headers
    first.release()
    first.release()  # idempotent
    assert rt.active == 1 and rt.active_per_key == {"k2": 1}
    (slot,) = asyncio.run(admit(rt, "k1"))
    with pytest.raises(HTTPException) as err:  # a prompt over the context: refused, its slot freed
        prepare(rt, body, list(range(1, 101)), 4, None, False, sm.Sampling(), slot)
    assert err.value.status_code == 400 and rt.active == 1 and slot.released
    second.release()
    assert rt.active == 0 and rt.active_per_key == {}


class _OutOfVocabDraft:
    """A faulty draft whose proposals hold ids the target does not have."""

    service = "draft"
    in_flight = 0

    def __init__(self) -> None:
        self.calls, self.released = 0, []

    async def propose(self, session_id, tokens, k, threshold, sampling, yield_cores=False):
        from orchestrator.clients import Proposed

        self.calls += 1
        return Proposed([1, 10_000][:k], [0.9, 0.9][:k], "max_tokens", [], len(tokens), 1.0, 1.0)

    async def release(self, session_id: str) -> bool:
        self.released.append(session_id)
        return True


async def test_a_draft_the_target_refuses_costs_a_retry_not_the_request(engine):
    """A target INVALID_ARGUMENT caused by the draft's tokens used to become the user's 400."""
    from orchestrator.controller import make_controller
    from orchestrator.generation import BadRequest, DraftHealth, GenerationParams, ModelLimits
    from orchestrator.loop import generate
    from orchestrator.schemas import Step

    target, draft = EngineTarget(engine), _OutOfVocabDraft()
    limits = ModelLimits(engine.lm.max_context, 8, 1000, 8, set())
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=6, ignore_eos=True)
    background: set[asyncio.Task] = set()
    events = [e async for e in generate(params, draft, target, make_controller("fixed", 2, 2, None), limits,
                                        DraftHealth(1.0), lambda ids: "", background=background)]
    steps = [e for e in events if isinstance(e, Step)]
    stats = events[-1].stats
    assert [t for s in steps for t in s.tokens] == greedy_reference(engine.lm.model, PROMPT, 6)
    assert draft.calls == 1 and stats.draft_fallbacks == 1 and "refused" in steps[0].draft_error
    # the user's own bad input is still a 400
    bad = GenerationParams(prompt_ids=[10_000], max_tokens=2)
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        async for _ in generate(bad, draft, target, make_controller("fixed", 2, 2, None), limits,
                                DraftHealth(1.0), lambda ids: "", background=background):
            pass
    # sessions are released by a task the caller's set keeps a reference to until it has run
    assert background
    await asyncio.gather(*background)
    assert len(target.released) == 2 and not background


async def test_a_draft_with_a_larger_vocabulary_is_refused():
    from orchestrator.runtime import connect

    class Info:
        def __init__(self, vocab: int) -> None:
            self.vocab = vocab

        async def info(self):
            return pb.InfoResponse(model_id=f"m{self.vocab}", vocab_size=self.vocab, tokenizer_fingerprint="f",
                                   max_context=100, max_draft_tokens=8)

    rt = _runtime()
    rt.draft, rt.target = Info(50_000), Info(49_152)
    await connect(rt)
    assert "vocabulary" in rt.not_ready and "50000" in rt.not_ready


@pytest.mark.slow
def test_orchestrator_prompt_over_the_target_kv_budget_is_400(tmp_path, tiny_models):
    """A prompt the target's KV budget cannot hold used to fail with 503, as if the server broke."""
    from tests.support import start_model_service, start_orchestrator

    target_env = {"SPECDEC_TARGET_MODEL": tiny_models["gpt2-target"], "SPECDEC_TARGET_KV_BUDGET_MB": "0.02",
                  "SPECDEC_TARGET_THREADS": "1"}
    draft_env = {"SPECDEC_DRAFT_BACKEND": "transformers", "SPECDEC_DRAFT_MODEL": tiny_models["gpt2-draft"],
                 "SPECDEC_DRAFT_THREADS": "1"}
    target, target_port = start_model_service("target", tmp_path, target_env)
    draft, draft_port = start_model_service("draft", tmp_path, draft_env)
    orch, url = start_orchestrator(draft_port, target_port, tmp_path)
    try:
        context = httpx.get(url + "/ready").json()["target"]["max_context"]
        assert 2 < context < 96  # the budget, not the model's 96 positions, bounds it
        r = httpx.post(url + "/v1/generate", json={"prompt": "ab " * context}, timeout=60)
        assert r.status_code == 400 and "context" in r.json()["detail"]
        r = httpx.post(url + "/v1/generate", json={"prompt": "ab", "max_tokens": 200, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["finish_reason"] == "length"
        assert len(r.json()["token_ids"]) + r.json()["prompt_tokens"] == context
        r = httpx.post(url + "/v1/generate", json={"prompt": "x", "temperature": 1e-40, "max_tokens": 5}, timeout=60)
        greedy = httpx.post(url + "/v1/generate", json={"prompt": "x", "max_tokens": 5}, timeout=60)
        assert r.status_code == 200 and r.json()["token_ids"] == greedy.json()["token_ids"]
    finally:
        for p in (orch, draft, target):
            p.stop()


async def test_a_busy_target_is_waited_for_then_reported_as_429(engine):
    """RESOURCE_EXHAUSTED (a full queue) mid-stream is retried briefly; only a target that stays
    full fails the request, as busy (HTTP 429), not as down."""
    from orchestrator.controller import make_controller
    from orchestrator.generation import DraftHealth, GenerationParams, ModelLimits, TargetBusy
    from orchestrator.loop import generate
    from orchestrator.schemas import Step

    class Busy(EngineTarget):
        def __init__(self, engine, refusals: int) -> None:
            super().__init__(engine)
            self.refusals = refusals

        async def verify(self, *args, **kwargs):
            if self.refusals:
                self.refusals -= 1
                raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "128 calls are already waiting")
            return await super().verify(*args, **kwargs)

    limits = ModelLimits(engine.lm.max_context, 8, 1000, 8, set())
    params = GenerationParams(prompt_ids=PROMPT, max_tokens=3, ignore_eos=True, mode="autoregressive")
    target = Busy(engine, refusals=3)
    events = [e async for e in generate(params, _OutOfVocabDraft(), target, make_controller("fixed", 0, 1, None),
                                        limits, DraftHealth(1.0), lambda ids: "", background=set())]
    assert [t for e in events if isinstance(e, Step) for t in e.tokens] == greedy_reference(engine.lm.model, PROMPT, 3)
    with pytest.raises(TargetBusy, match="busy"):
        async for _ in generate(params, _OutOfVocabDraft(), Busy(engine, refusals=100),
                                make_controller("fixed", 0, 1, None), limits, DraftHealth(1.0), lambda ids: "",
                                background=set()):
            pass


def test_undecodable_requests_are_invalid_argument_and_auth_comes_first(engine):
    """grpc-python answers INTERNAL ("Exception deserializing request!") for bytes that do not parse,
    as if the server were broken; every method, health included, now says INVALID_ARGUMENT, and a
    server with a token still says UNAUTHENTICATED first."""
    from specdec.auth import TokenAuth

    for interceptors, want in (([], grpc.StatusCode.INVALID_ARGUMENT), ([TokenAuth("t")], grpc.StatusCode.UNAUTHENTICATED)):
        server, port, _ = build_target(engine, "127.0.0.1:0", interceptors=interceptors)
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                for method, expected in (("/specdec.v1.TargetService/Verify", want),
                                         ("/grpc.health.v1.Health/Check", grpc.StatusCode.INVALID_ARGUMENT)):
                    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
                    with pytest.raises(grpc.RpcError) as err:
                        call(b"\xff\xff\xff", timeout=10)
                    assert err.value.code() == expected, (method, err.value.details())
        finally:
            server.stop(0)


async def test_a_route_before_start_up_is_503_not_a_crash(app):
    """The runtime is built by the lifespan: a request that reaches a route before it (or an app
    served without its lifespan) gets a 503 that says to retry, not a 500."""
    transport = httpx.ASGITransport(app=app)  # no lifespan: app.state has no runtime
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        r = await client.post("/v1/generate", json={"prompt": "hello", "max_tokens": 2})
        info = await client.get("/v1/info")
    assert r.status_code == 503 and "starting" in r.json()["detail"]
    assert info.status_code == 503
