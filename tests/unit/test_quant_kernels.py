"""specdec.native's quantised linears on every GGUF format they compute: each output is the
int8-quantised x dotted with the file's own integer weights and scaled (against gguf's own
dequantisation, in float64), on the CPU's kernel and the portable one; a row's bits never depend
on the rows beside it (in one call or a weight of several formats); and the bindings refuse
what the C side cannot read with a Python error, never a crash."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from specdec.native import QUANT_FORMATS, kernels

# offsets of each format's fp16 scales in its GGUF block (random bytes elsewhere are valid quants)
SCALE_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
                 "Q5_K": [0, 2], "Q6_K": [208]}
# the bytes of the quants (zeroed, the block's dequantisation is its additive part m)
QUANT_BYTES = {"Q4_1": (4, 20), "Q5_1": (4, 24), "Q4_K": (16, 144), "Q5_K": (16, 176)}


@pytest.fixture(scope="module")
def native():
    k = kernels()
    assert k is not None, "specdec.native did not build (is a C compiler installed?)"
    return k


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """A [n, k] tensor of ``fmt`` blocks: random quants, scales, sub-scales and bit planes, with
    sane fp16 scales."""
    rng = np.random.default_rng(seed)
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[fmt]:
        d = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def reference(x: torch.Tensor, blocks: np.ndarray, fmt: str, n: int, k: int) -> torch.Tensor:
    """float64: x quantised per block of 32 to int8 (s = max|x| / 127) against the weights'
    multiplicative part, plus x itself against their additive part (m, -dmin mn)."""
    qtype = GGMLQuantizationType[fmt]
    w = dequantize(blocks, qtype).reshape(n, k).astype(np.float64)
    m = np.zeros_like(w)
    if fmt in QUANT_BYTES:
        block, nbytes = GGML_QUANT_SIZES[qtype]
        lo, hi = QUANT_BYTES[fmt]
        zeroed = blocks.reshape(n, -1, nbytes).copy()
        zeroed[:, :, lo:hi] = 0
        m = dequantize(zeroed.reshape(n, -1), qtype).reshape(n, k).astype(np.float64)
    xb = x.numpy().reshape(x.shape[0], -1, 32)
    s = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(s > 0, np.float32(1) / np.where(s > 0, s, 1), 0).astype(np.float32)
    xq = (np.clip(np.rint(xb * inv), -127, 127) * s).reshape(x.shape[0], k).astype(np.float64)
    return torch.from_numpy(xq @ (w - m).T + x.numpy().astype(np.float64) @ m.T)


SHAPES = {"Q4_K": [(40, 256), (33, 768)], "Q5_K": [(40, 256), (33, 768)], "Q6_K": [(40, 256), (33, 768)]}


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_every_format_computes_its_blocks(native, fmt):
    """1 to 40 rows (two passes of rows for 40), output counts on and off the 16-column panel,
    inputs of one to several blocks; a bias, a residual and tanh-GELU fused."""
    for n, k in SHAPES.get(fmt, [(40, 96), (16, 512), (33, 768)]):
        blocks = random_blocks(fmt, n, k, seed=n + k)
        packed = native.pack_quant(blocks, fmt, n, k)
        gen = torch.Generator().manual_seed(n)
        bias = torch.randn(n, generator=gen)
        for rows in (1, 2, 3, 17, 40):
            x = torch.randn(rows, k, generator=gen)
            want = reference(x, blocks, fmt, n, k)
            got = native.linear(x, packed, n).double()
            scale = float(want.abs().max())
            assert float((got - want).abs().max()) <= 1e-5 * scale, (fmt, n, k, rows)
            residual = torch.randn(rows, n, generator=gen)
            fused = native.linear(x, packed, n, bias, "gelu_tanh", residual).double()
            expect = torch.nn.functional.gelu(want + bias.double(), approximate="tanh") + residual.double()
            assert torch.allclose(fused, expect, rtol=1e-4, atol=1e-4 * max(scale, 1.0))


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_a_row_computes_the_same_bits_alone_or_among_others(native, fmt):
    """Batch invariance: every row of a pass of 1 to 40 rows equals, bit for bit, that row alone."""
    n, k = 48, 512
    packed = native.pack_quant(random_blocks(fmt, n, k, seed=7), fmt, n, k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([native.linear(x[i:i + 1].contiguous(), packed, n) for i in range(40)])
    for rows in (2, 5, 17, 33, 40):
        assert torch.equal(native.linear(x[:rows].contiguous(), packed, n), alone[:rows]), rows


def test_a_weight_of_several_formats_computes_each_part(native):
    """A fused q/k/v whose members a file stores in different types (Q5_0, Q6_K, Q8_0) as one
    weight: the same as each part alone (bitwise where both run the same kernel), batch-invariant."""
    k = 256
    parts = [(random_blocks(f, n, k, seed=i), f, n) for i, (f, n) in enumerate((("Q5_0", 64), ("Q6_K", 32), ("Q8_0", 40)))]
    fused = native.pack_quant_parts(parts, k)
    assert fused.fmt == "mixed" and fused.out_features == 136
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    got = native.linear(x, fused, 136)
    for (blocks, fmt, n), lo in zip(parts, (0, 64, 96), strict=True):
        alone = native.linear(x, native.pack_quant(blocks, fmt, n, k), n)
        if native.quant_isa(fmt) == "avx512-vnni":  # another kernel: the same sums, other roundings
            assert torch.allclose(got[:, lo:lo + n], alone, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got[:, lo:lo + n], alone), fmt
    rows = torch.cat([native.linear(x[i:i + 1].contiguous(), fused, 136) for i in range(9)])
    assert torch.equal(got, rows)
    with pytest.raises(ValueError, match="multiple of 16"):
        native.pack_quant_parts([(random_blocks("Q8_0", 40, k, 1), "Q8_0", 40), parts[0]], k)


def test_bindings_refuse_what_the_kernels_cannot_read(native):
    """Wrong formats, shapes, dtypes and layouts are ValueErrors naming what is wrong."""
    blocks = random_blocks("Q8_0", 16, 64, seed=0)
    with pytest.raises(ValueError, match="not IQ2_XS"):
        native.pack_quant(blocks, "IQ2_XS", 16, 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        native.pack_quant(blocks, "Q4_K", 16, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.pack_quant(blocks, "Q8_0", 16, 48)
    with pytest.raises(ValueError, match="expected"):
        native.pack_quant(blocks, "Q4_1", 16, 64)  # Q8_0 bytes read as Q4_1
    with pytest.raises(ValueError, match="uint8"):
        native.pack_quant(blocks.astype(np.int16), "Q8_0", 16, 64)
    with pytest.raises(ValueError, match="out_features > 0"):
        native.pack_quant(blocks[:0], "Q8_0", 0, 64)
    packed = native.pack_quant(blocks, "Q8_0", 16, 64)
    for x in (torch.randn(2, 32), torch.randn(2, 64, dtype=torch.float64), torch.randn(64, 2).T, torch.randn(64)):
        with pytest.raises(ValueError, match="x must be"):
            native.linear(x, packed, 16)
    with pytest.raises(ValueError, match="out_features 8"):
        native.linear(torch.randn(2, 64), packed, 8)
    with pytest.raises(ValueError, match="bias must be"):
        native.linear(torch.randn(2, 64), packed, 16, bias=torch.randn(15))
    with pytest.raises(ValueError, match="residual must be"):
        native.linear(torch.randn(2, 64), packed, 16, residual=torch.randn(3, 16))
    with pytest.raises(ValueError, match="act must be"):
        native.linear(torch.randn(2, 64), packed, 16, act="relu")
    with pytest.raises(ValueError, match="x must be"):
        native.linear([[0.0] * 64], packed, 16)


_ISA_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_quant_kernels import random_blocks
from specdec.native import QUANT_FORMATS, kernels
k = kernels()
x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
ys = {f: k.linear(x, k.pack_quant(random_blocks(f, 24, 256, 3), f, 24, 256), 24) for f in QUANT_FORMATS}
torch.save(ys, sys.argv[1])
print(" ".join(f"{f}={k.quant_isa(f)}" for f in QUANT_FORMATS))
"""


def test_every_instruction_set_computes_the_same_sums(tmp_path):
    """The kernels SPECDEC_NATIVE_ISA allows (AVX-512 VNNI, AVX2, the portable one) sum the same
    integers: the same results to fp32 rounding. Each reports the kernel it picked per format."""
    got = {}
    for cap in ("avx512", "avx2", "baseline"):
        out = tmp_path / f"{cap}.pt"
        done = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(out), os.path.dirname(__file__)],
                              capture_output=True, text=True, env={**os.environ, "SPECDEC_NATIVE_ISA": cap}, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        isas = dict(item.split("=") for item in done.stdout.split())
        assert set(isas) == set(QUANT_FORMATS)
        assert set(isas.values()) <= {"avx512-vnni", "avx2", "baseline"}
        if cap == "baseline":
            assert set(isas.values()) == {"baseline"}
        got[cap] = torch.load(out)
    for cap in ("avx512", "avx2"):
        for fmt in QUANT_FORMATS:
            assert torch.allclose(got[cap][fmt], got["baseline"][fmt], rtol=1e-5, atol=1e-6), (cap, fmt)
