"""specdec's own forward pass (specdec.model.runner) against transformers' on real architectures: the
same logits to fp32 rounding, the same keys and values in the session's cache, rows and sessions
that do not change each other's results, and the fallback to transformers where it does not apply."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.executor import Executor, ForwardRequest
from specdec.engine.sessions import SessionStore
from specdec.model.runner import PACK_EXACT_ROWS, PACK_PAD_ROWS, GPT2Runner, LlamaRunner, OutputBuffer, padded_rows
from specdec.models import load_hf

IDS = [3, 17, 5, 22, 9, 31, 4, 12, 28, 7, 19, 2, 25, 11, 6, 33, 14, 8, 21, 10, 27, 13, 30, 16, 24, 18, 29, 15, 26, 20]
ARCHS = {"llama": LlamaRunner, "gpt2": GPT2Runner}


def _lm(path: str, native: bool = True, **kwargs) -> Executor:
    """A cached LM on ``path``; ``native=False`` runs the runner's torch ops instead of
    specdec.native's kernels (both must compute what transformers computes)."""
    lm = Executor(load_hf(path).model, SessionStore(8, 1 << 30, 0), **kwargs)
    if lm.runner is not None:
        assert lm.runner.native is not None, "specdec.native did not build (is a C compiler installed?)"
        if not native:
            lm.runner.native = None
    return lm


NATIVE = pytest.mark.parametrize("native", [True, False], ids=["native", "torch-ops"])


def _reference(path: str, ids: list[int]) -> tuple[torch.Tensor, object]:
    """transformers' own logits [len(ids), V] and cache for ``ids``, from a model nothing else touched."""
    model = load_hf(path).model
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    return out.logits[0], out.past_key_values


@pytest.mark.parametrize("arch", ARCHS)
@NATIVE
def test_runner_logits_match_transformers_through_prefill_verify_and_steps(tiny_models, arch, native):
    path = tiny_models[f"{arch}-target"]
    lm = _lm(path, native)
    assert isinstance(lm.runner, ARCHS[arch])
    full, _ = _reference(path, IDS)
    s = lm.session("s")
    logits, cached = lm.extend(s, IDS[:12], IDS[12:17])  # a prefill of 17 rows, 6 logits
    assert cached == 0 and torch.allclose(logits, full[11:17], atol=1e-5, rtol=1e-5)
    logits, cached = lm.extend(s, IDS[:20])  # a verify-sized pass of 3 rows over the cache
    assert cached == 17 and torch.allclose(logits, full[19:20], atol=1e-5, rtol=1e-5)
    for n in range(21, 25):  # plain steps of one row
        logits, cached = lm.extend(s, IDS[:n])
        assert cached == n - 1 and torch.allclose(logits, full[n - 1 : n], atol=1e-5, rtol=1e-5)
    logits, cached = lm.extend(s, IDS[:8], IDS[8:10])  # a rollback: 3 logits wanted, so crop to 7
    assert cached == 7 and torch.allclose(logits, full[7:10], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_stack_in_one_call_computes_what_its_calls_one_by_one_compute(tiny_models, arch, native_linears):
    """sd_forward_decoder runs the decoder layers in C with the kernels the runner otherwise calls
    one by one: the same logits and the same cache, bit for bit, through a batched prefill, a
    verify and plain steps of two sessions."""
    path = tiny_models[f"{arch}-target"]
    fused, calls = _lm(path), _lm(path)
    assert fused.runner.stack is not None and fused.runner.fused
    calls.runner.fused = False
    for lm in (fused, calls):
        lm.forward_batch([ForwardRequest(lm.session("a"), IDS[:14], 3), ForwardRequest(lm.session("b"), IDS[5:9], 1)])
    plans = [[("a", IDS[:20], 6), ("b", IDS[5:10], 1)], [("a", IDS[:21], 1)], [("b", IDS[5:11], 1), ("a", IDS[:22], 1)]]
    for plan in plans:
        got = [lm.forward_batch([ForwardRequest(lm.session(sid), ids, want) for sid, ids, want in plan])
               for lm in (fused, calls)]
        for mine, theirs in zip(*got, strict=True):
            assert torch.equal(mine.logits, theirs.logits)
    for sid in ("a", "b"):  # the cached positions (past them a grown buffer holds whatever it held)
        n = len(fused.session(sid).tokens)
        assert n == len(calls.session(sid).tokens)
        assert torch.equal(fused.session(sid).cache.kv[:, :, :, :n], calls.session(sid).cache.kv[:, :, :, :n])


def test_the_logits_buffer_is_reused_only_once_no_one_holds_the_last_logits(tiny_models, native_linears):
    lm = _lm(tiny_models["llama-target"])
    lm.runner.logits_out = OutputBuffer(floor=0)  # the tiny vocabulary's logits are far below the default floor
    full, _ = _reference(tiny_models["llama-target"], IDS)
    s = lm.session("s")
    held, _ = lm.extend(s, IDS[:10], IDS[10:14])  # 5 rows of logits, kept
    kept = held.clone()
    other, _ = lm.extend(lm.session("t"), IDS[:3], IDS[3:8])
    # the second pass could not write over logits still held: new memory, the first ones intact
    assert other.untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
    assert torch.equal(held, kept) and torch.allclose(held, full[9:14], atol=1e-5, rtol=1e-5)
    address = other.untyped_storage().data_ptr()
    del held, kept, other  # no one holds either pass's logits now
    again, _ = lm.extend(s, IDS[:10], IDS[10:14])
    assert again.untyped_storage().data_ptr() == address  # the last buffer, reused
    assert torch.allclose(again, full[9:14], atol=1e-5, rtol=1e-5)
    row = again[2]  # a view of a row keeps the buffer held too
    del again
    last, _ = lm.extend(s, IDS[:12], IDS[12:14])
    assert last.untyped_storage().data_ptr() != address
    assert torch.allclose(row, full[11], atol=1e-5, rtol=1e-5)
    assert torch.allclose(last, full[11:14], atol=1e-5, rtol=1e-5)


def test_an_output_buffer_keeps_no_small_or_huge_output():
    buf = OutputBuffer(floor=1 << 10, cap=1 << 20)
    assert buf.take(4, 16).shape == (4, 16) and buf._flat is None  # 256 bytes: below the floor
    assert buf.take(1024, 1024).shape == (1024, 1024) and buf._flat is None  # 4 MiB: above the cap
    mid = buf.take(64, 64)  # 16 KiB: kept, and reused once dropped
    address = mid.data_ptr()
    assert buf._flat is not None and buf._flat.data_ptr() == address
    del mid
    assert buf.take(32, 64).data_ptr() == address  # fewer rows fit the same buffer
    assert buf.take(128, 64).data_ptr() != address  # more do not


def test_without_torchs_storage_use_count_every_output_is_fresh(monkeypatch):
    import specdec.model.runner as runner_mod

    monkeypatch.setattr(runner_mod, "_storage_uses", None)  # a torch without the private counter
    buf = OutputBuffer(floor=0)
    a = buf.take(64, 64)
    assert buf._flat is None  # nothing kept, so nothing can be written over while held
    assert buf.take(64, 64).data_ptr() != a.data_ptr()


def test_padded_rows_bucket_long_passes_by_at_most_an_eighth():
    sizes = [padded_rows(n) for n in range(1, 4097)]
    assert sizes[:PACK_PAD_ROWS] == [PACK_PAD_ROWS] * PACK_PAD_ROWS
    assert sizes[PACK_PAD_ROWS - 1:PACK_EXACT_ROWS] == list(range(PACK_PAD_ROWS, PACK_EXACT_ROWS + 1))
    assert all(n <= p <= n * 1.125 for n, p in enumerate(sizes[PACK_EXACT_ROWS:], PACK_EXACT_ROWS + 1))
    assert sizes == sorted(sizes) and all(padded_rows(p) == p for p in sizes)  # a bucket is its own size
    # few shapes, so oneDNN's and ideep's per-shape kernel caches stay small
    assert len(set(sizes)) <= PACK_EXACT_ROWS + 8 * 6


@pytest.mark.parametrize("arch", ARCHS)
@NATIVE
def test_a_long_prefill_padded_to_its_bucket_matches_transformers(tiny_models, arch, native):
    path = tiny_models[f"{arch}-target"]
    ids = [IDS[i % len(IDS)] for i in range(PACK_EXACT_ROWS + 9)]  # 73 rows, computed as 80
    assert padded_rows(len(ids)) > len(ids)
    full, _ = _reference(path, ids)
    lm = _lm(path, native)
    logits, cached = lm.extend(lm.session("long"), ids[:-4], ids[-4:])
    assert cached == 0 and torch.allclose(logits, full[-5:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@NATIVE
def test_runner_writes_the_keys_and_values_transformers_caches(tiny_models, arch, native):
    path = tiny_models[f"{arch}-target"]
    lm = _lm(path, native)
    _, cache = _reference(path, IDS[:15])
    s = lm.session("kv")
    lm.extend(s, IDS[:9])
    lm.extend(s, IDS[:15])  # the rest written after the first 9, at their own positions
    for layer in range(len(cache.layers)):
        keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [kv_heads, 15, D]
        assert torch.allclose(s.cache.kv[layer, 0, :, :15], keys, atol=1e-5)
        assert torch.allclose(s.cache.kv[layer, 1, :, :15], values, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@NATIVE
def test_a_session_computes_the_same_alone_or_batched(tiny_models, arch, native):
    """One pass over three sessions at different cached lengths gives each session exactly the
    logits it gets in a pass of its own: no row reads another session's rows or cache."""
    path = tiny_models[f"{arch}-target"]
    alone, batched = _lm(path, native), _lm(path, native)
    plans = [(IDS[:20], IDS[:24], 3), (IDS[:3], IDS[:5], 2), ([], IDS[:11], 1)]
    results = []
    for lm in (alone, batched):
        for i, (before, _, _) in enumerate(plans):
            if before:
                lm.extend(lm.session(f"s{i}"), before)
    for i, (_, tokens, want) in enumerate(plans):
        results.append(alone.forward_batch([ForwardRequest(alone.session(f"s{i}"), tokens, want)])[0].logits)
    together = batched.forward_batch([ForwardRequest(batched.session(f"s{i}"), tokens, want)
                                      for i, (_, tokens, want) in enumerate(plans)])
    for mine, theirs in zip(results, together, strict=True):
        assert torch.equal(mine, theirs.logits)


def test_transformers_forward_of_the_same_model_still_works(tiny_models):
    """q/k/v and gate/up are packed as one weight each for the runner; the model's own forward
    (``generate`` in tests and references) reads its layers' columns of it and agrees."""
    path = tiny_models["llama-target"]
    lm = _lm(path)
    assert lm.fast_linears.packed(lm.model.model.layers[0].self_attn.k_proj).fused
    ids = torch.tensor([IDS[:6]])
    with torch.inference_mode():
        ours = lm.model.generate(ids, max_new_tokens=8, do_sample=False)
        theirs = load_hf(path).model.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.allclose(lm.model(ids).logits, load_hf(path).model(ids).logits, atol=1e-5, rtol=1e-5)
    assert ours.tolist() == theirs.tolist()


def test_unsupported_configurations_run_through_transformers(tmp_path, tiny_models):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.support import save_checkpoint

    config = GPT2Config(vocab_size=48, n_positions=64, n_embd=32, n_layer=2, n_head=2, scale_attn_by_inverse_layer_idx=True)
    torch.manual_seed(0)
    path = save_checkpoint(GPT2LMHeadModel(config), tmp_path / "odd-gpt2")
    lm = _lm(path)
    assert lm.runner is None
    full, _ = _reference(path, IDS[:10])
    logits, _ = lm.extend(lm.session("s"), IDS[:7], IDS[7:10])
    assert torch.allclose(logits, full[6:10], atol=1e-5, rtol=1e-5)
    assert _lm(tiny_models["llama-target"], use_runner=False).runner is None
    assert _lm(tiny_models["llama-target"], pack_weights=False).runner is None  # it runs on packed weights only


@pytest.mark.embedded
def test_runner_greedy_equals_generate_on_the_embedded_target(embedded_target):
    """On the real embedded model (30 layers, grouped-query attention) the runner's plain steps
    reproduce transformers' greedy ``generate`` of a fresh copy token for token."""
    fresh = load_hf("embedded")
    lm = Executor(embedded_target.model, SessionStore(4, 1 << 30, 0))
    assert isinstance(lm.runner, LlamaRunner)
    tok = fresh.tokenizer
    for i, prompt in enumerate(["The three laws of thermodynamics say that", "import numpy as np\n\ndef mean("]):
        ids = tok(prompt).input_ids
        with torch.inference_mode():
            ref = fresh.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0].tolist()
        seq, s = list(ids), lm.session(f"g{i}")
        while len(seq) < len(ref):
            logits, _ = lm.extend(s, seq)
            seq.append(int(logits[-1].argmax()))
        assert seq == ref
