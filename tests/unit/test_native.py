"""specdec.native's kernels against torch references: the same values to fp32 rounding, and rows
that never change each other's results (bit for bit), which is what lets a verify pass compute
exactly what plain steps compute. Also how the library is built, found and refused."""

from __future__ import annotations

import math
import os
import stat

import pytest
import torch
import torch.nn.functional as F

import specdec.native as native_mod
from specdec.model.ragged import Segment, SessionKV
from specdec.native import NativeError, build, kernels


@pytest.fixture(scope="module")
def native():
    k = kernels()
    assert k is not None, "specdec.native did not build (is a C compiler installed?)"
    return k


def test_add_norm_matches_torch_and_adds_the_residual_in_place(native):
    """RMSNorm (no bias) and LayerNorm (a bias) of each row, after ``x += delta`` when a delta is
    given; tails past the last 16 floats included."""
    gen = torch.Generator().manual_seed(0)
    for rows, n in [(1, 576), (4, 576), (9, 37), (17, 16)]:  # 37: a tail past the last 16 floats
        x, w, b = torch.randn(rows, n, generator=gen) * 3, torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        delta = torch.randn(rows, n, generator=gen)
        assert torch.allclose(native.add_norm(x.clone(), None, w, None, 1e-5), F.rms_norm(x, (n,), w, 1e-5),
                              rtol=1e-5, atol=1e-6)
        assert torch.allclose(native.add_norm(x.clone(), None, w, b, 1e-5), F.layer_norm(x, (n,), w, b, 1e-5),
                              rtol=1e-4, atol=1e-5)
        residual = x.clone()
        out = native.add_norm(residual, delta, w, None, 1e-5)
        assert torch.equal(residual, x + delta)  # the residual stream carries the sum on
        assert torch.allclose(out, F.rms_norm(x + delta, (n,), w, 1e-5), rtol=1e-5, atol=1e-6)


def test_silu_mul_matches_torch_across_the_exp_range(native):
    gate = torch.cat((torch.linspace(-100, 100, 1001), torch.tensor([-1e4, 1e4, 0.0]))).repeat(2, 1)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(1))
    got = native.silu_mul(torch.cat((gate, up), dim=1))
    assert torch.isfinite(got).all()
    assert torch.allclose(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary on [T, heads, D]: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _layout(heads: int, kvh: int, d: int, plans: list[tuple[int, int]], layers: int = 2, seed: int = 0):
    """Packed q/k/v rows for segments of (cached, new) tokens, their sessions' KV buffers with
    random cached keys and values, and rotary tables."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(new for _, new in plans)
    width = (heads + 2 * kvh) * d
    qkv = torch.randn(rows, width, generator=gen)
    segments, offset = [], 0
    for cached, new in plans:
        kv = SessionKV(layers, kvh, d, torch.float32, torch.device("cpu"))
        kv.ensure(cached + new, 4096)
        kv.kv.copy_(torch.randn(kv.kv.shape, generator=gen))
        segments.append(Segment(kv, cached, new, offset))
        offset += new
    positions = torch.cat([torch.arange(c, c + n) for c, n in plans]).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = positions[:, None] * inv[None]
    cos, sin = torch.cat((angles.cos(),) * 2, dim=-1), torch.cat((angles.sin(),) * 2, dim=-1)
    return qkv, segments, cos.contiguous(), sin.contiguous()


def _reference(qkv, segments, cos, sin, heads, kvh, d, layer, rotary):
    """Rotated q/k per row, then per segment softmax(q k^T / sqrt(d)) v causal over its session."""
    t = qkv.shape[0]
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kvh) * d].view(t, kvh, d)
    v = qkv[:, (heads + kvh) * d :].view(t, kvh, d)
    if rotary:
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    out = torch.zeros(t, heads * d)
    kvs = []
    for seg in segments:
        lo, hi, end = seg.offset, seg.offset + seg.rows, seg.start + seg.rows
        keys = torch.cat((seg.kv.kv[layer, 0, :, : seg.start], k[lo:hi].transpose(0, 1)), dim=1)
        values = torch.cat((seg.kv.kv[layer, 1, :, : seg.start], v[lo:hi].transpose(0, 1)), dim=1)
        kvs.append((keys, values))
        mask = torch.ones(seg.rows, end, dtype=torch.bool).tril(diagonal=seg.start)
        o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), keys, values, attn_mask=mask,
                                           enable_gqa=kvh != heads)  # [heads, rows, D]
        out[lo:hi] = o.transpose(0, 1).reshape(seg.rows, heads * d)
    return out, kvs


@pytest.mark.parametrize("heads,kvh,d,rotary", [(9, 3, 64, True), (4, 4, 40, False), (2, 1, 128, True)])
def test_attention_matches_sdpa_and_writes_the_rotated_keys(native, heads, kvh, d, rotary):
    """Three sessions at different cached lengths (one with nothing cached), grouped-query or
    not, head sizes on and off the 16-float vectors, with and without rotary, on layer 1."""
    plans = [(20, 3), (0, 7), (130, 1)]
    qkv, segments, cos, sin = _layout(heads, kvh, d, plans)
    want, kvs = _reference(qkv.clone(), segments, cos, sin, heads, kvh, d, 1, rotary)
    out = torch.zeros(qkv.shape[0], heads * d)
    native.attention(qkv, (0, heads * d, (heads + kvh) * d), heads, kvh, d, cos if rotary else None,
                     sin if rotary else None, native.segment_table(segments), 1, d ** -0.5, out)
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-5)
    for seg, (keys, values) in zip(segments, kvs, strict=True):
        end = seg.start + seg.rows
        assert torch.allclose(seg.kv.kv[1, 0, :, :end], keys, atol=1e-5)
        assert torch.equal(seg.kv.kv[1, 1, :, :end], values)


@pytest.mark.parametrize("heads,kvh,d", [(9, 3, 64), (4, 4, 40), (2, 1, 128)])
def test_attention_rows_are_independent_bit_for_bit(native, heads, kvh, d):
    """A segment of 17 rows computes exactly what 17 one-row passes compute, and a session's rows
    do not change when other sessions share the pass (the verify = plain steps contract). The
    kernel takes a KV head's queries 16 at a time (51, 17 and 34 of them here), each alone in
    its vector lane; head sizes on and off the 16-float vectors."""
    offsets = (0, heads * d, (heads + kvh) * d)
    qkv, segments, cos, sin = _layout(heads, kvh, d, [(300, 17)], layers=1, seed=3)
    snapshot = segments[0].kv.kv.clone()
    together = torch.zeros(17, heads * d)
    native.attention(qkv.clone(), offsets, heads, kvh, d, cos, sin, native.segment_table(segments), 0, 0.125,
                     together)
    segments[0].kv.kv.copy_(snapshot)
    for r in range(17):  # the same tokens one at a time, each after the ones before it
        one = Segment(segments[0].kv, 300 + r, 1, 0)
        out = torch.zeros(1, heads * d)
        native.attention(qkv[r : r + 1].clone(), offsets, heads, kvh, d, cos[r : r + 1].contiguous(),
                         sin[r : r + 1].contiguous(), native.segment_table([one]), 0, 0.125, out)
        assert torch.equal(out[0], together[r]), f"row {r} differs"
    # beside two other sessions, in the middle of the pass
    other, others, ocos, osin = _layout(heads, kvh, d, [(50, 5), (0, 4)], layers=1, seed=4)
    segments[0].kv.kv.copy_(snapshot)
    mine = Segment(segments[0].kv, 300, 17, 5)
    packed = torch.cat((other[:5], qkv, other[5:]))
    pcos, psin = torch.cat((ocos[:5], cos, ocos[5:])), torch.cat((osin[:5], sin, osin[5:]))
    out = torch.zeros(packed.shape[0], heads * d)
    table = native.segment_table([others[0], mine, Segment(others[1].kv, 0, 4, 22)])
    native.attention(packed, offsets, heads, kvh, d, pcos, psin, table, 0, 0.125, out)
    assert torch.equal(out[5:22], together)


def test_a_row_after_a_huge_score_gap_stays_finite(native):
    """Scores far below the row's maximum underflow to ~0 (exp is clamped), never NaN."""
    heads, kvh, d = 1, 1, 16
    qkv, segments, _, _ = _layout(heads, kvh, d, [(3, 1)], layers=1)
    segments[0].kv.kv[0, 0, 0, 0] = torch.full((d,), 1e4)  # one key that dominates
    qkv[0, :d] = 10.0
    out = torch.zeros(1, d)
    native.attention(qkv, (0, d, 2 * d), heads, kvh, d, None, None, native.segment_table(segments), 0, 1.0, out)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0], segments[0].kv.kv[0, 1, 0, 0], atol=1e-4)


@pytest.mark.slow
def test_build_reuses_its_library_and_rebuilds_for_a_changed_source(tmp_path, monkeypatch):
    umask = os.umask(0o022)  # a build's usual umask (the image's)
    try:
        first = build(tmp_path)
    finally:
        os.umask(umask)
    assert first.exists() and build(tmp_path) == first  # the same source and flags: no new build
    assert first.stat().st_mode & 0o044 == 0o044  # readable by other users (the image builds as root)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, first.name + ".sha256"]  # no temporary file left
    monkeypatch.setenv("CC", "no-such-cc-here")
    assert build(tmp_path) == first  # a prebuilt library needs no compiler
    monkeypatch.delenv("CC")
    changed = tmp_path / "src" / "kernels.c"
    changed.parent.mkdir()
    changed.write_text(native_mod.SOURCE.read_text() + "\nint sd_changed(void) { return 1; }\n")
    monkeypatch.setattr(native_mod, "SOURCE", changed)
    second = build(tmp_path)
    assert second != first and second.exists()


def test_the_library_name_covers_every_source_file(tmp_path):
    """Every C file and header of the package is in a build's sources, so a change to any part
    (attention.c, not only kernels.c) names a new library instead of loading a stale one."""
    copy = tmp_path / "src"
    copy.mkdir()
    for f in native_mod.sources():
        (copy / f.name).write_bytes(f.read_bytes())
    before = native_mod.library_name(copy / "kernels.c")
    assert before == native_mod.library_name()  # the same files: the same name
    (copy / "attention.c").write_text((copy / "attention.c").read_text() + "\n/* changed */\n")
    assert native_mod.library_name(copy / "kernels.c") != before


@pytest.mark.slow
def test_another_versions_folder_builds_from_its_own_files(tmp_path):
    """Another version's specdec/native (here: the fp32 parts folded back into kernels.c, as before
    they were split) builds from that folder's files alone, not mixed with this package's parts
    (whose symbols it defines too); a lone kernels.c copied elsewhere takes this package's."""
    old = tmp_path / "old"
    old.mkdir()
    folded = ["rowwise.c", "attention.c", "linear.c"]
    for f in native_mod.FOLDER.glob("*.[ch]"):
        if f.name not in folded:
            (old / f.name).write_bytes(f.read_bytes())
    with (old / "kernels.c").open("a") as out:
        for name in folded:
            out.write((native_mod.FOLDER / name).read_text())
    assert {p.name for p in native_mod.sources(old / "kernels.c")}.isdisjoint(folded)
    assert all(p.parent == old for p in native_mod.sources(old / "kernels.c"))
    lone = tmp_path / "lone" / "kernels.c"
    lone.parent.mkdir()
    lone.write_bytes(native_mod.SOURCE.read_bytes())
    assert [p.name for p in native_mod.sources(lone)] == [p.name for p in native_mod.sources()]
    library = build(tmp_path / "build", old / "kernels.c")
    assert native_mod.Kernels(library).isa in ("avx512", "avx2", "baseline")


def test_a_missing_or_failing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-here")
    with pytest.raises(NativeError, match="no C compiler"):
        build(tmp_path)
    failing = tmp_path / "cc-fails"
    failing.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "broken 0"; exit 0; fi\n'
                       'echo "kernels.c:1: error: boom" >&2; exit 1\n')
    failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(failing))
    with pytest.raises(NativeError, match="boom"):
        build(tmp_path / "out")
    assert not [p for p in (tmp_path / "out").iterdir()]  # nothing half-written left


def test_kernels_fall_back_to_none_when_disabled_or_unbuildable(tmp_path, monkeypatch):
    try:
        kernels.cache_clear()
        monkeypatch.setenv("SPECDEC_NATIVE", "0")
        assert kernels() is None
        kernels.cache_clear()
        monkeypatch.setenv("SPECDEC_NATIVE", "1")
        monkeypatch.setenv("SPECDEC_NATIVE_DIR", str(tmp_path))
        monkeypatch.setenv("CC", "no-such-cc-here")
        assert kernels() is None
    finally:
        kernels.cache_clear()


def test_exp_is_accurate_over_softmax_inputs(native):
    """softmax through the kernel's own exp: one key per score, values one-hot, so the output is
    the softmax itself."""
    d = 16
    scores = torch.linspace(-80, 0, 15)
    qkv = torch.zeros(1, 3 * d)
    qkv[0, 0] = 1.0
    kv = SessionKV(1, 1, d, torch.float32, torch.device("cpu"))
    kv.ensure(16, 16)
    kv.kv.zero_()
    kv.kv[0, 0, 0, :15, 0] = scores
    for j in range(16):
        kv.kv[0, 1, 0, j, j] = 1.0
    qkv[0, d:2 * d] = 0.0  # the new row's key: score 0
    qkv[0, 2 * d:] = torch.eye(d)[15]
    out = torch.zeros(1, d)
    native.attention(qkv, (0, d, 2 * d), 1, 1, d, None, None, native.segment_table([Segment(kv, 15, 1, 0)]), 0,
                     1.0, out)
    want = torch.softmax(torch.cat((scores, torch.zeros(1))), 0)
    assert torch.allclose(out[0], want, rtol=1e-5, atol=1e-30)
    assert math.isclose(float(out.sum()), 1.0, rel_tol=1e-6)
    assert os.path.exists(native_mod.kernels().path)


@pytest.mark.parametrize("n,k", [(200, 72), (576, 576), (16, 1536)])
def test_linear_rows_are_the_same_bits_in_every_schedule(native, n, k):
    """A pass of up to 17 rows runs as column passes (every row against one panel), one of up to
    51 in column passes of 17 rows and the rest, a larger one in 6-row x 4-panel tiles: each output
    is still one lane summed over k in order, so a row computes the same bits alone, in a
    verify-sized pass, in a few verifies batched or in a prefill-sized one (weights with whole
    groups of panels and a lone last one; bias, tanh-GELU and residual fused; the column passes
    read x transposed into a buffer of the calling thread's, grown from one k to the next)."""
    gen = torch.Generator().manual_seed(11)
    w, x = torch.randn(n, k, generator=gen), torch.randn(60, k, generator=gen)
    bias, residual = torch.randn(n, generator=gen), torch.randn(60, n, generator=gen)
    panels = native.pack_linear(w)
    alone = torch.cat([native.linear(x[i:i + 1].contiguous(), panels, n, bias, "gelu_tanh", residual[i:i + 1].contiguous())
                       for i in range(60)])
    want = F.gelu(x @ w.T + bias, approximate="tanh") + residual
    assert torch.allclose(alone, want, rtol=1e-4, atol=1e-4)
    for rows in (2, 6, 13, 17, 18, 35, 51, 52, 60):
        together = native.linear(x[:rows].contiguous(), panels, n, bias, "gelu_tanh", residual[:rows].contiguous())
        assert torch.equal(together, alone[:rows]), f"{rows} rows differ from the same rows alone"


_ISA_SCRIPT = """
import sys, torch
from specdec.native import kernels
k = kernels()
gen = torch.Generator().manual_seed(7)
w, x = torch.randn(200, 72, generator=gen), torch.randn(9, 72, generator=gen)
b = torch.randn(200, generator=gen)
y = k.linear(x, k.pack_linear(w), 200, b)
rows = torch.cat([k.linear(x[i:i + 1].contiguous(), k.pack_linear(w), 200, b) for i in range(9)])
assert torch.equal(y, rows), "rows differ"
torch.save(y, sys.argv[1])
print(k.isa)
"""


def test_linears_on_every_instruction_set_agree(tmp_path):
    """The linears' AVX2 path (the one a CPU without AVX-512 runs) sums each output in the order
    the AVX-512 path does: the same bits; the baseline (no FMA) rounds differently, to 1e-5. Each
    is row-independent. SPECDEC_NATIVE_ISA caps the instruction set, in a process of its own."""
    import subprocess
    import sys

    got = {}
    for cap in ("avx512", "avx2", "baseline"):
        out = tmp_path / f"{cap}.pt"
        env = {**os.environ, "SPECDEC_NATIVE_ISA": cap}
        done = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(out)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        got[done.stdout.split()[-1]] = torch.load(out)
    assert "baseline" in got  # the cap always reaches the baseline
    if "avx512" in got and "avx2" in got:
        assert torch.equal(got["avx512"], got["avx2"])
    fast = got.get("avx512", got.get("avx2"))
    if fast is not None:
        assert torch.allclose(fast, got["baseline"], rtol=1e-5, atol=1e-5)


_NO_MEMORY_SCRIPT = """
import resource, torch
from specdec.native import kernels
k = kernels()
gen = torch.Generator().manual_seed(3)
K = 1 << 18  # 17 rows of it transposed: 17 MiB a thread
w, x = torch.randn(32, K, generator=gen), torch.randn(17, K, generator=gen)
panels = k.pack_linear(w)
alone = torch.cat([k.linear(x[i:i + 1].contiguous(), panels, 32) for i in range(17)])  # one row: x itself
out = torch.empty(17, 32)
mapped = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (mapped + (8 << 20), resource.RLIM_INFINITY))
try:
    try:
        bytearray(16 << 20)
    except MemoryError:
        pass
    else:
        raise SystemExit("the address-space limit did not bite")
    k.linear(x, panels, 32, out=out)
finally:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
assert torch.equal(out, alone), "rows differ"
print("ok")
"""


def test_column_passes_without_memory_for_x_transposed_run_as_tiles(native):
    """A 17-row pass whose threads cannot get the buffer for x transposed (the address space
    limited just above what the process maps) runs as 6 x 4 tiles: the same bits as each row alone,
    no crash. In a process of its own."""
    import subprocess
    import sys

    if native.isa != "avx512":
        pytest.skip("column passes (and their transposed x) are the AVX-512 schedule")
    # under AddressSanitizer (make test-native-asan) an allocation past the limit aborts the
    # process unless the allocator may return NULL, as the C library's does
    asan = ":".join(o for o in (os.environ.get("ASAN_OPTIONS", ""), "allocator_may_return_null=1") if o)
    done = subprocess.run([sys.executable, "-c", _NO_MEMORY_SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ASAN_OPTIONS": asan})
    assert done.returncode == 0 and done.stdout.split()[-1] == "ok", done.stderr[-2000:]


# ---- Linears on GGUF-quantised blocks (the native draft backend) ----

def _gguf_blocks(fmt: str, n: int, k: int, seed: int = 0):
    """Random weights quantised by the gguf package (llama.cpp's own quantiser, in numpy): the raw
    blocks [n, k / 32 * block bytes] and their dequantised fp32 values [n, k]."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[fmt]
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quantize(w, qtype)
    return blocks, torch.from_numpy(dequantize(blocks, qtype).reshape(n, k).astype(np.float32))


def _quant_reference(x: torch.Tensor, w: torch.Tensor, fmt: str, blocks) -> torch.Tensor:
    """What the kernel computes, in float64: x quantised per block of 32 to int8 as llama.cpp does
    (s = max|x| / 127, q = round(x / s)), dotted with the dequantised weights block by block."""
    import numpy as np

    rows, k = x.shape
    xb = x.double().view(rows, k // 32, 32)
    s = xb.abs().amax(-1, keepdim=True) / 127
    qx = torch.where(s > 0, torch.round(xb / torch.where(s > 0, s, 1)), 0)
    xq = (qx * s).view(rows, k)
    if fmt == "Q4_1":  # its min term multiplies the exact block sum of x, not the quantised one
        raw = np.asarray(blocks).reshape(w.shape[0], k // 32, 20)
        m = torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16).astype(np.float64)[:, :, 0])  # [n, blocks]
        return (xq @ (w.double() - m.repeat_interleave(32, 1)).T + xb.sum(-1) @ m.T).float()
    return (xq @ w.double().T).float()


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n", [16, 40, 80, 192])
def test_quantised_linear_computes_the_block_sums(native, fmt, n):
    """Each row's output is its int8-quantised blocks dotted with the weights' blocks, scaled: the
    float64 reference to fp32 rounding, for 1 to 5 rows, output counts on and off the 16-column
    panel and the 4-panel group, with a bias, a residual and tanh-GELU fused."""
    k = 96
    blocks, w = _gguf_blocks(fmt, n, k, seed=n)
    packed = native.pack_quant(blocks, fmt, n, k)
    gen = torch.Generator().manual_seed(1)
    bias, residual = torch.randn(n, generator=gen), torch.randn(5, n, generator=gen)
    for rows in range(1, 6):
        x = torch.randn(rows, k, generator=gen)
        want = _quant_reference(x, w, fmt, blocks)
        got = native.linear(x, packed, n)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (rows, (got - want).abs().max())
        fused = native.linear(x, packed, n, bias, "gelu_tanh", residual[:rows].contiguous())
        assert torch.allclose(fused, F.gelu(want + bias, approximate="tanh") + residual[:rows], rtol=1e-4, atol=1e-4)
        # within the int8 rounding of x of the exact product
        assert torch.allclose(got, x @ w.T, rtol=0.05, atol=0.05 * float((x @ w.T).abs().max()))
    rows = torch.cat([native.linear(x[i:i + 1].contiguous(), packed, n) for i in range(x.shape[0])])
    assert torch.equal(native.linear(x, packed, n), rows)  # a row's result never depends on the others


def test_layers_of_quantised_and_fp32_storage_are_not_fused():
    """A Llama layer's q, k and v share one packed weight only when all are quantised or none is:
    with q in Q8_0, k in Q4_1 and v in fp32, each packs alone on its own storage and computes its
    own product (an unwritten placeholder never reaches a kernel)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.model.linears import FastLinears
    from specdec.native import QuantWeight

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    attn = model.model.layers[0].self_attn
    quant, want = {}, {}
    for module, fmt in ((attn.q_proj, "Q8_0"), (attn.k_proj, "Q4_1")):
        blocks, w = _gguf_blocks(fmt, *module.weight.shape, seed=len(quant))
        quant[id(module)] = (fmt, blocks)
        want[id(module)] = w
        with torch.no_grad():
            module.weight.zero_()  # a placeholder: packing it would give zeros, not the blocks' product
    want[id(attn.v_proj)] = attn.v_proj.weight.detach().clone()
    fast = FastLinears(model, quant=quant)
    q, k, v = (fast.packed(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert (q.weight.fmt, k.weight.fmt, isinstance(v.weight, QuantWeight)) == ("Q8_0", "Q4_1", False)
    assert not (q.fused or k.fused or v.fused) and fast.quantised == 2
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), fast.active():
        for module in (attn.q_proj, attn.k_proj, attn.v_proj):
            ref = x @ want[id(module)].T  # within the int8 rounding of x
            assert torch.allclose(module(x), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))


def test_linear_into_a_given_output_checks_its_shape_and_type(native):
    w, x = torch.randn(32, 16), torch.randn(3, 16)
    panels = native.pack_linear(w)
    out = torch.empty(3, 32)
    assert native.linear(x, panels, 32, out=out) is out
    assert torch.allclose(out, x @ w.T, atol=1e-5)
    for bad in (torch.empty(2, 32), torch.empty(3, 32, dtype=torch.float64), torch.empty(32, 3).T):
        with pytest.raises(ValueError, match="out must be"):
            native.linear(x, panels, 32, out=bad)


def test_layers_of_different_block_types_fuse_as_parts():
    """q in Q8_0, k in Q4_1, v in Q5_0 (a Q4_K_M file mixes types so within a layer): one weight of
    three parts, each member's columns its own product."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.model.linears import FastLinears

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    attn = model.model.layers[0].self_attn
    quant, want = {}, {}
    for module, fmt in ((attn.q_proj, "Q8_0"), (attn.k_proj, "Q4_1"), (attn.v_proj, "Q5_0")):
        blocks = quantize(module.weight.detach().numpy(), GGMLQuantizationType[fmt])
        quant[id(module)] = (fmt, blocks)
        want[id(module)] = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).reshape(module.weight.shape))
        with torch.no_grad():
            module.weight.zero_()
    fast = FastLinears(model, quant=quant)
    q, k, v = (fast.packed(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert q.weight is k.weight is v.weight and q.weight.fmt == "mixed" and q.fused and fast.quantised == 3
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), fast.active():
        for module in (attn.q_proj, attn.k_proj, attn.v_proj):
            ref = x @ want[id(module)].T  # within the int8 rounding of x
            assert torch.allclose(module(x), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))
