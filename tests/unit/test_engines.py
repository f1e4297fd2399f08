"""Draft and target engines on tiny real architectures (GPT-2, Llama), no gRPC."""

from __future__ import annotations

import pytest

from draft_service.backends.hf import TransformersProposer
from draft_service.proposer import StopReason
from specdec import sampling as sm
from specdec.engine.sessions import SessionStore
from specdec.errors import InvalidArgument
from specdec.models import load_hf
from target_service.verify import TargetEngine
from tests.support import greedy_reference

ARCHS = ["gpt2", "llama"]


def store(max_bytes: int = 1 << 30, max_sessions: int = 16) -> SessionStore:
    return SessionStore(max_sessions, max_bytes, ttl_s=0)


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def target(tiny_models, arch):
    return TargetEngine(load_hf(tiny_models[f"{arch}-target"]), store())


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return [7, 3, 12, 5, 9, 20, 2, 11]


def test_verify_matches_step_by_step_greedy(target, prompt):
    ref = greedy_reference(target.loaded.model, prompt, 6)
    # draft = the first 3 reference tokens, then a wrong one, then anything
    wrong = (ref[3] + 1) % target.info().vocab_size
    draft = ref[:3] + [wrong, ref[4]]
    v = target.verify("greedy", prompt, draft)
    assert (v.num_accepted, v.next_token) == (3, ref[3])
    # a draft identical to the target's greedy continuation is accepted in full, plus the bonus
    v = target.verify("greedy", prompt, ref[:5])
    assert (v.num_accepted, v.next_token) == (5, ref[5])
    # an empty draft is one plain decoding step
    v = target.verify("plain", prompt)
    assert (v.num_accepted, v.next_token) == (0, ref[0])


def test_cache_reuses_exactly_the_common_prefix(target, prompt):
    sid = "prefix"
    target.verify(sid, prompt, [1, 2, 3])
    session = target.store.get_or_create(sid, lambda: None)
    assert session.cache.length == len(prompt) + 3
    # same prompt, one accepted draft token + next token: everything before them is reused
    v = target.verify(sid, prompt + [1, 4])
    assert v.cached_tokens == len(prompt) + 1
    assert session.cache.length == len(prompt) + 2
    # a sequence diverging at position 5 reuses exactly 5 tokens
    diverged = prompt[:5] + [30, 31, 32]
    v = target.verify(sid, diverged, [4])
    assert v.cached_tokens == 5
    assert session.cache.length == len(diverged) + 1
    # and the result equals a fresh session's (cache reuse changes nothing)
    fresh = target.verify("fresh-" + sid, diverged, [4])
    assert (v.num_accepted, v.next_token) == (fresh.num_accepted, fresh.next_token)


def test_greedy_decoding_by_repeated_verify_with_cache(target, prompt):
    ref = greedy_reference(target.loaded.model, prompt, 12)
    seq = list(prompt)
    while len(seq) < len(prompt) + 12:
        seq.append(target.verify("loop", seq).next_token)
    assert seq[len(prompt):] == ref


@pytest.fixture(scope="module")
def same_draft(tiny_models, arch):
    """A draft that is the target model itself: its proposals must be accepted in full."""
    return TransformersProposer(load_hf(tiny_models[f"{arch}-target"]), store(), max_draft_tokens=8)


@pytest.fixture(scope="module")
def other_draft(tiny_models, arch):
    return TransformersProposer(load_hf(tiny_models[f"{arch}-draft"]), store(), max_draft_tokens=8)


def test_identical_draft_is_accepted_in_full(target, same_draft, prompt):
    p = same_draft.propose("same", prompt, 6)
    assert p.stop_reason is StopReason.MAX_TOKENS and len(p.tokens) == 6
    v = target.verify("same", prompt, p.tokens)
    assert v.num_accepted == 6
    assert p.tokens + [v.next_token] == greedy_reference(target.loaded.model, prompt, 7)


def test_draft_cache_reuse_and_divergence(other_draft, prompt):
    p1 = other_draft.propose("d", prompt, 4)
    assert p1.cached_tokens == 0
    # the target accepted 2 tokens and corrected the third: the draft's cache covers prompt + 2
    seq = prompt + p1.tokens[:2] + [(p1.tokens[2] + 1) % 40]
    p2 = other_draft.propose("d", seq, 4)
    assert p2.cached_tokens == len(prompt) + 2
    fresh = other_draft.propose("d-fresh", seq, 4)
    assert p2.tokens == fresh.tokens


def test_confidence_early_stop(other_draft, prompt):
    full = other_draft.propose("c", prompt, 8, confidence_threshold=0.0)
    assert len(full.tokens) == 8 and full.stop_reason is StopReason.MAX_TOKENS
    # cut at the first token less confident than every token before it
    confs = full.confidences
    i = next(i for i in range(1, len(confs)) if confs[i] < min(confs[:i]))
    threshold = (confs[i] + min(confs[:i])) / 2
    early = other_draft.propose("c", prompt, 8, confidence_threshold=threshold)
    assert early.stop_reason is StopReason.LOW_CONFIDENCE
    assert early.tokens == full.tokens[: i + 1]  # the low-confidence token is still returned
    assert all(c >= threshold for c in early.confidences[:-1]) and early.confidences[-1] < threshold
    # threshold 1 stops after the first token
    one = other_draft.propose("c", prompt, 8, confidence_threshold=1.0)
    assert len(one.tokens) == 1 and one.stop_reason is StopReason.LOW_CONFIDENCE


def test_draft_stops_at_context_limit(other_draft):
    max_ctx = other_draft.info().max_context
    p = other_draft.propose("ctx", [5] * (max_ctx - 3), 8)
    assert len(p.tokens) == 2 and p.stop_reason is StopReason.CONTEXT_LIMIT


def test_sampling_proposal_carries_distributions(target, other_draft, prompt):
    s = sm.Sampling(temperature=0.8, top_k=10, seed=3)
    p = other_draft.propose("s", prompt, 4, sampling=s, return_distributions=True)
    assert len(p.distributions) == len(p.tokens)
    for tok, conf, (ids, probs) in zip(p.tokens, p.confidences, p.distributions, strict=True):
        assert len(ids) <= 10 and tok in ids
        assert abs(probs[ids.index(tok)] - conf) < 1e-6
        assert abs(sum(probs) - 1) < 1e-4
    again = other_draft.propose("s2", prompt, 4, sampling=s, return_distributions=True)
    assert again.tokens == p.tokens  # seeded
    v = target.verify("s", prompt, p.tokens, s, p.distributions)
    assert 0 <= v.num_accepted <= len(p.tokens)
    with pytest.raises(InvalidArgument, match="one draft distribution per draft token"):
        target.verify("s", prompt, p.tokens, s, [])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: t.verify("x", []), "must not be empty"),
        (lambda t: t.verify("x", [1, 10_000]), "outside the vocabulary"),
        (lambda t: t.verify("x", [1], [10_000]), "outside the vocabulary"),
        (lambda t: t.verify("", [1]), "session_id"),
        (lambda t: t.verify("x", [1] * 96), "maximum context"),
        (lambda t: t.verify("x", [1], [1] * 40), "over the maximum"),
        (lambda t: t.verify("x", [1], sampling=sm.Sampling(temperature=-1)), "temperature"),
    ],
)
def test_target_rejects_bad_input(target, call, message):
    with pytest.raises(InvalidArgument, match=message):
        call(target)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokens=[], max_draft_tokens=2), "must not be empty"),
        (dict(tokens=[1], max_draft_tokens=0), "max_draft_tokens"),
        (dict(tokens=[1], max_draft_tokens=9), "max_draft_tokens"),
        (dict(tokens=[1], max_draft_tokens=2, confidence_threshold=1.5), "confidence_threshold"),
        (dict(tokens=[1], max_draft_tokens=2, confidence_threshold=-0.1), "confidence_threshold"),
        (dict(tokens=[99], max_draft_tokens=2), "outside the vocabulary"),
        (dict(tokens=[1] * 97, max_draft_tokens=2), "maximum context"),
    ],
)
def test_draft_rejects_bad_input(other_draft, kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        other_draft.propose("bad", **kwargs)


def test_kv_budget_evicts_then_refuses(tiny_models):
    loaded = load_hf(tiny_models["gpt2-target"])
    engine = TargetEngine(loaded, store(max_bytes=1))  # placeholder budget, replaced below
    per_token = engine.lm.bytes_per_token
    engine.store.max_bytes = per_token * 40
    engine.verify("a", [1] * 30)
    engine.verify("b", [2] * 30)  # 30 + 31 tokens > 40: a is evicted
    assert "a" not in engine.store and "b" in engine.store
    assert engine.store.nbytes <= engine.store.max_bytes
    # alone over the budget: the budget bounds the context, so this is the client's input problem
    assert engine.info().max_context == 40
    with pytest.raises(InvalidArgument, match="maximum context of 40"):
        engine.verify("c", [3] * 45)
    # still serving afterwards
    assert engine.verify("d", [4] * 10).num_accepted == 0


def test_release_frees_the_session(target, prompt):
    target.verify("rel", prompt)
    assert target.release("rel") is True
    assert target.release("rel") is False
    assert "rel" not in target.store


def test_cache_bytes_are_accounted(target, prompt):
    target.verify("bytes", prompt, [1, 2])
    session = target.store.get_or_create("bytes", lambda: None)
    kv = session.cache.kv
    # the store is charged for the buffer's whole capacity, which holds at least the tokens
    assert session.nbytes == kv.numel() * kv.element_size() == session.cache.capacity * target.lm.bytes_per_token
    assert session.cache.capacity >= session.cache.length == len(prompt) + 2


def test_fast_linears_match_the_stock_kernel_and_pick_by_rows(tiny_models):
    """Inside a forward of the engine, linears run through the chosen kernel: oneDNN on weights
    packed at load ("packed", the default where the build has it, on every call), oneDNN on the
    row-major weight from ONEDNN_MIN_ROWS rows with MKL's ``(W @ x.T).T`` below ("onednn", without
    packing), or MKL alone ("mkl"); all agree with ``F.linear`` on a copy of the model nothing
    touched, to rounding. Outside (``generate``, other users of the model) the row-major kernels
    leave the stock one running."""
    import torch

    from specdec.model.linears import ONEDNN_MIN_ROWS
    from specdec.model.runner import padded_rows

    path = tiny_models["llama-target"]
    stock_model = load_hf(path).model
    packed = TargetEngine(load_hf(path), SessionStore(2, 1 << 30, 0), native=False).lm
    if packed.fast_linears.kernels != ("packed",):
        pytest.skip("this torch build has no oneDNN weight prepack")
    row_major = TargetEngine(load_hf(path), SessionStore(2, 1 << 30, 0), pack_weights=False).lm
    assert row_major.fast_linears.kernels == ("onednn", "mkl") and row_major.fast_linears.released == 0
    rows = (1, 2, 4, ONEDNN_MIN_ROWS, 9, 40)
    for kernel, lm in (("packed", packed), ("onednn", row_major), ("mkl", row_major)):
        fast = lm.fast_linears
        fast.kernel = kernel
        calls: list[tuple[int, bool]] = []
        onednn = fast._onednn
        fast._onednn = lambda x, w, *rest, onednn=onednn, calls=calls: (calls.append((x.shape[0], w.is_mkldnn)),
                                                                         onednn(x, w, *rest))[1]
        name, linear = next((n, m) for n, m in lm.model.named_modules() if type(m) is torch.nn.Linear)
        stock = dict(stock_model.named_modules())[name]
        for n in rows:
            x = torch.randn(1, n, stock.in_features)
            want = torch.nn.functional.linear(x, stock.weight, stock.bias)
            with torch.inference_mode(), fast.active():
                y = linear(x)
            assert y.shape == want.shape and torch.allclose(y, want, rtol=1e-5, atol=1e-5), (kernel, n)
        expected = {"packed": [(padded_rows(n), True) for n in rows],  # fewer rows padded
                    "onednn": [(n, False) for n in rows if n >= ONEDNN_MIN_ROWS], "mkl": []}[kernel]
        assert calls == expected, kernel
        if kernel != "packed":  # a packed layer without its row-major weight runs packed everywhere
            linear(torch.randn(1, 9, stock.in_features))  # not inside a forward of the engine: stock
            assert calls == expected, kernel
        fast._onednn = onednn


def test_native_linears_match_the_stock_kernel_at_every_row_count(tiny_models, native_linears):
    """Where specdec.native builds, the engine's linears run on its kernel (weights packed in
    panels at load) for any number of rows, a lone row included, and agree with ``F.linear`` on a
    copy of the model nothing touched."""
    import torch

    path = tiny_models["gpt2-target"]  # Conv1D layers (weight [in, out]) and biases
    stock = dict(load_hf(path).model.named_modules())
    engine = TargetEngine(load_hf(path), SessionStore(2, 1 << 30, 0))
    fast = engine.lm.fast_linears
    assert fast.kernel == "native" and fast.kernels == ("native",), "specdec.native did not build"
    native, calls = fast.native, []

    class Counting:
        def __getattr__(self, name):
            return getattr(native, name)

        def linear(self, x, *args, **kwargs):
            calls.append(x.shape[0])
            return native.linear(x, *args, **kwargs)

    fast.native = Counting()
    for name, module in [(n, m) for n, m in engine.lm.model.named_modules() if type(m).__name__ == "Conv1D"][:4]:
        for n in (1, 2, 3, 9, 70):
            calls.clear()
            x = torch.randn(1, n, stock[name].weight.shape[0])
            want = torch.addmm(stock[name].bias, x.view(n, -1), stock[name].weight).view(1, n, -1)
            with torch.inference_mode(), fast.active():
                y = module(x)
            assert calls == [n]  # no padding: the kernel takes a lone row as it is
            assert y.shape == want.shape and torch.allclose(y, want, rtol=1e-5, atol=1e-5), (name, n)


@pytest.mark.parametrize("native", [True, False], ids=["native", "onednn"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_layers_free_their_row_major_weights_and_keep_their_outputs(tiny_models, arch, native, native_linears):
    """Each packed layer drops its row-major weight (a tied lm_head keeps it: the input embeddings
    hold it) and serves every call from the packed one, inside an engine's forward or not
    (``generate``): the hidden states are the same bit for bit either way, and the logits those of
    the stock kernels to rounding."""
    import torch

    stock = load_hf(tiny_models[f"{arch}-target"]).model
    engine = TargetEngine(load_hf(tiny_models[f"{arch}-target"]), SessionStore(2, 1 << 30, 0), native=native)
    fast = engine.lm.fast_linears
    assert fast.kernel in ("native", "packed") and (fast.kernel == "native") == native
    if fast.kernel != "packed" and not native:
        pytest.skip("this torch build has no oneDNN weight prepack")
    model = engine.lm.model
    # nn.Linear, and GPT-2's Conv1D (weight [in, out])
    linears = [m for m in model.modules() if type(m).__name__ in ("Linear", "Conv1D")]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert fast.count == len(linears) and fast.released == fast.count - (1 if tied else 0) > 0
    assert all(m.weight.numel() == 0 for m in linears if not (tied and m is model.get_output_embeddings()))
    ids = torch.tensor([[5, 9, 2, 7, 1]])
    with torch.inference_mode():
        with fast.active():
            inside = model(input_ids=ids, output_hidden_states=True)
        outside = model(input_ids=ids, output_hidden_states=True)
        assert torch.equal(inside.hidden_states[-1], outside.hidden_states[-1])
        assert torch.allclose(outside.logits, stock(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 9)


def test_pack_weights_false_keeps_the_row_major_kernels(tiny_models):
    engine = TargetEngine(load_hf(tiny_models["llama-target"]), SessionStore(2, 1 << 30, 0), pack_weights=False)
    fast = engine.lm.fast_linears
    assert "packed" not in fast.kernels and not fast._packed
    _verifies_like_plain_greedy(engine, tiny_models["llama-target"])


def _verifies_like_plain_greedy(engine: TargetEngine, path: str) -> None:
    """A verify whose draft is the model's own greedy continuation accepts it whole and adds the
    next greedy token; a wrong draft token is replaced by the greedy one (reference: a separate,
    unmodified copy of the model, decoding without a cache)."""
    ref = greedy_reference(load_hf(path).model, [1, 2, 3], 3)
    v = engine.verify("s", [1, 2, 3], ref[:2])
    assert (v.num_accepted, v.next_token) == (2, ref[2])
    wrong = (ref[0] + 1) % 20 + 3
    v = engine.verify("t", [1, 2, 3], [wrong, ref[1]])
    assert (v.num_accepted, v.next_token) == (0, ref[0])


@pytest.mark.parametrize("native", [True, False], ids=["native", "onednn"])
def test_packed_linears_sum_a_row_alike_whatever_rows_surround_it(tiny_models, native):
    """With packed weights (specdec.native's or oneDNN's) a row's output does not depend on the
    other rows of the pass (bit for bit, 1 to 33 rows): a verify of k draft tokens computes each
    row's linears exactly as a plain step of that row would."""
    import torch

    engine = TargetEngine(load_hf(tiny_models["llama-target"]), SessionStore(2, 1 << 30, 0), native=native)
    fast = engine.lm.fast_linears
    if fast.kernel != ("native" if native else "packed"):
        pytest.skip("this torch build has no oneDNN weight prepack")
    torch.manual_seed(0)
    for linear in [m for m in engine.lm.model.modules() if type(m) is torch.nn.Linear]:
        x = torch.randn(33, linear.in_features)
        with torch.inference_mode(), fast.active():
            whole = linear(x)
            for n in (1, 2, 3, 5, 8, 9, 17):
                assert torch.equal(linear(x[:n]), whole[:n]), (linear, n)
                assert torch.equal(linear(x[-n:]), whole[-n:]), (linear, n)


def test_a_build_whose_prepack_fails_keeps_the_row_major_kernels(monkeypatch, tiny_models):
    import torch

    from specdec.model import linears as engine_module

    def broken(*args):
        raise RuntimeError("no prepack in this build")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken)
    assert engine_module._onednn_pack() is None
    engine = TargetEngine(load_hf(tiny_models["llama-target"]), SessionStore(2, 1 << 30, 0), native=False)
    assert engine.lm.fast_linears.kernel == "onednn" and engine.lm.fast_linears.released == 0
    _verifies_like_plain_greedy(engine, tiny_models["llama-target"])


def test_no_onednn_kernel_means_mkl(monkeypatch):
    import torch

    from specdec.model import linears as engine

    def broken(*args):
        raise RuntimeError("no oneDNN kernel in this build")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    assert engine._onednn_linear() is None
    assert engine._onednn_pack() is None  # packing needs the oneDNN kernel too


def test_a_build_without_onednn_runs_mkl_and_verifies_alike(monkeypatch, tiny_models):
    """Without oneDNN every linear runs on MKL (F.linear) with the row-major weights kept, and the
    engine still verifies exactly as plain greedy decoding."""
    import torch

    def broken(*args):
        raise RuntimeError("no oneDNN kernel in this build")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    engine = TargetEngine(load_hf(tiny_models["llama-target"]), SessionStore(2, 1 << 30, 0), native=False)
    fast = engine.lm.fast_linears
    assert (fast.kernel, fast.kernels, fast.released) == ("mkl", ("mkl",), 0)
    _verifies_like_plain_greedy(engine, tiny_models["llama-target"])
    # specdec.native needs no oneDNN: its packed linears and the runner still serve
    engine = TargetEngine(load_hf(tiny_models["llama-target"]), SessionStore(2, 1 << 30, 0))
    assert engine.lm.fast_linears.kernel == "native" and engine.lm.runner is not None
    _verifies_like_plain_greedy(engine, tiny_models["llama-target"])


def test_without_avx512_linears_run_on_onednn_and_the_rest_on_native(monkeypatch, tiny_models):
    """specdec.native's linears compute several rows slowly without AVX-512: there the weights
    are packed for oneDNN, while the runner keeps the native kernels between the linears; it
    still verifies exactly as plain greedy decoding."""
    from specdec.native import kernels

    lib = kernels()
    assert lib is not None, "specdec.native did not build"
    monkeypatch.setattr(lib, "isa", "avx2")
    engine = TargetEngine(load_hf(tiny_models["llama-target"]), SessionStore(2, 1 << 30, 0))
    if engine.lm.fast_linears.kernel != "packed":
        pytest.skip("this torch build has no oneDNN weight prepack")
    assert engine.lm.runner is not None and engine.lm.runner.native is lib
    _verifies_like_plain_greedy(engine, tiny_models["llama-target"])
