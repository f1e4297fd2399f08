"""The arithmetic ceiling of a verify pass on this machine: fp32 FMA throughput of the cores, and
what specdec.native's linear kernel reaches when its weights sit in cache.

A plain step streams the target's weights once (bound by memory); a verify of many rows does the
same streaming but k + 1 times the arithmetic, so past some row count it is bound by the cores'
FMA rate instead. This measures that rate directly, with a C loop of independent AVX-512 (or AVX2)
FMAs on every thread, and the linear kernel on an L2-resident weight at 6, 12 and 18 rows, so a
verify's linears can be priced against the hardware:

    python -m evaluation.peak            # ~10 s; prints GFLOPS and the implied 17-row floor
    python -m evaluation.peak --quant    # the same for quantised weights: AVX2's int8 chains

A quantised weight's products are summed in int8/int16 (``specdec/native/quant.h``): per 32
products one ``vpmaddubsw`` and, every few, a ``vpmaddwd`` widening to int32 (4- to 6-bit
quants), or ``vpsignb`` + ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd`` each time (Q8_0, whose
signed weights need the sign trick). ``--quant`` times those chains alone, in registers, on every
thread (GMAC/s: the most products a second the instruction set allows the kernels), and the
quantised kernels on cache-resident weights.

Nothing else should run meanwhile (it measures the cores).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdec.native import compiler, kernels

_FMA_LOOP = r"""
#include <stdint.h>
#include <omp.h>
typedef float v16 __attribute__((vector_size(64)));
/* 12 independent accumulators per thread: enough to cover FMA latency on two pipes. Cloned per
 * instruction set and picked at load, as specdec.native's kernels are. */
__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) double sd_peak(int64_t iters) {
    double t0 = omp_get_wtime();
    float sink = 0.0f;
#pragma omp parallel reduction(+ : sink)
    {
        v16 a[12], m = {1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f,
                        1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f,
                        1.0000001f, 1.0000001f};
        for (int i = 0; i < 12; i++) a[i] = m * (float)(i + omp_get_thread_num());
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < 12; i++) a[i] = a[i] * m + m;
        for (int i = 0; i < 12; i++) sink += a[i][0];
    }
    return (omp_get_wtime() - t0) + 0.0 * sink;
}
"""


_INT8_LOOP = r"""
#include <stdint.h>
#include <omp.h>
/* Eight independent chains of one format's integer sums per thread, in registers: "nibbles"
 * (4-bit quants: four vpmaddubsw summed in int16, then one vpmaddwd + vpaddd) and "bytes" (Q8_0:
 * vpsignb + vpmaddubsw + vpmaddwd + vpaddd each). Returns seconds; every chain sums 32 products an
 * instruction. */
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"
#define NIB(t, a) "vpmaddubsw %%ymm13, %%ymm12, %%ymm" t "\n vpaddw %%ymm" t ", %%ymm" a ", %%ymm" a "\n"
#define BYTE(t, a) "vpsignb %%ymm12, %%ymm13, %%ymm" t "\n vpmaddubsw %%ymm" t ", %%ymm12, %%ymm" t "\n" \
                   "vpmaddwd %%ymm14, %%ymm" t ", %%ymm" t "\n vpaddd %%ymm" t ", %%ymm" a ", %%ymm" a "\n"
__attribute__((target("arch=x86-64-v3"))) double sd_int8_peak(int64_t iters, int bytes) {
    double t0 = omp_get_wtime();
#pragma omp parallel
    {
        for (int64_t it = 0; it < iters; it++) {
            if (bytes)
                __asm__ volatile(BYTE("8", "0") BYTE("9", "1") BYTE("10", "2") BYTE("11", "3")
                                 BYTE("8", "4") BYTE("9", "5") BYTE("10", "6") BYTE("11", "7") ::: CLOBBER);
            else /* 8 products chains: 4 x (maddubs + add16), then the widening of the four */
                __asm__ volatile(NIB("8", "0") NIB("9", "1") NIB("10", "2") NIB("11", "3")
                                 NIB("8", "0") NIB("9", "1") NIB("10", "2") NIB("11", "3")
                                 "vpmaddwd %%ymm14, %%ymm0, %%ymm8\n vpaddd %%ymm8, %%ymm4, %%ymm4\n"
                                 "vpmaddwd %%ymm14, %%ymm1, %%ymm9\n vpaddd %%ymm9, %%ymm5, %%ymm5\n" ::: CLOBBER);
        }
    }
    return omp_get_wtime() - t0;
}
"""


# without -ffp-contract=fast the loop's a * m + m compiles to a multiply and an add, and the
# "ceiling" reads below the kernel's own rate
FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp")


def fma_gflops(threads: int, iters: int = 20_000_000) -> float:
    """fp32 GFLOPS of ``threads`` threads running independent 16-lane FMAs."""
    cc = compiler()
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "peak.c", Path(tmp) / "peak.so"
        src.write_text(_FMA_LOOP)
        subprocess.run([cc, *FLAGS, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read when the library's OpenMP runtime starts
        try:
            peak = ctypes.CDLL(str(lib))
        finally:  # not left for processes started later
            if before is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = before
        peak.sd_peak.argtypes = [ctypes.c_int64]
        peak.sd_peak.restype = ctypes.c_double
        peak.sd_peak(iters // 10)  # warm up the threads and the clock
        seconds = min(peak.sd_peak(iters) for _ in range(3))
    return threads * iters * 12 * 16 * 2 / seconds / 1e9


def int8_gmacs(threads: int, bytes_chain: bool, iters: int = 20_000_000) -> float:
    """Products a second (G) of ``threads`` threads running the integer chain of 4-bit quants, or
    with ``bytes_chain`` of Q8_0 (x86-64 with AVX2 only)."""
    cc = compiler()
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "int8.c", Path(tmp) / "int8.so"
        src.write_text(_INT8_LOOP)
        subprocess.run([cc, *FLAGS, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        peak = ctypes.CDLL(str(lib))
        peak.sd_int8_peak.argtypes = [ctypes.c_int64, ctypes.c_int]
        peak.sd_int8_peak.restype = ctypes.c_double
        peak.sd_int8_peak(iters // 10, int(bytes_chain))
        seconds = min(peak.sd_int8_peak(iters, int(bytes_chain)) for _ in range(3))
    return threads * iters * 8 * 32 / seconds / 1e9


def _native():
    native = kernels()
    if native is None:
        raise SystemExit("specdec.native is unavailable here")
    return native


def _linear_seconds(native, x: torch.Tensor, packed, n: int, repeats: int) -> float:
    """Best of 5 means over ``repeats`` calls of ``native.linear(x, packed, n)``, after 10 warm-ups."""
    for _ in range(10):
        native.linear(x, packed, n)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            native.linear(x, packed, n)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def quant_kernel_gmacs(fmt: str, rows: int, n: int = 2048, k: int = 2048, repeats: int = 50) -> float:
    """Products a second (G) of specdec.native's kernel for ``fmt`` on a weight in cache (L3: 2.3 MB at
    Q4_0, 4.4 MB at Q8_0)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    native = _native()
    rng = np.random.default_rng(0)
    blocks = quants.quantize(rng.standard_normal((n, k), dtype=np.float32), getattr(GGMLQuantizationType, fmt))
    packed = native.pack_quant(blocks, fmt, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
    best = _linear_seconds(native, x, packed, n, repeats)
    return rows * n * k / best / 1e9


def kernel_gflops(rows: int, n: int = 768, k: int = 576, repeats: int = 200) -> float:
    """GFLOPS of specdec.native's fp32 linear on a weight that stays in cache (n x k floats)."""
    native = _native()
    gen = torch.Generator().manual_seed(0)
    packed = native.pack_linear(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    best = _linear_seconds(native, x, packed, n, repeats)
    return 2 * rows * n * k / best / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads (default: torch's)")
    p.add_argument("--verify-gflop", type=float, default=4.57,
                   help="GFLOP of the linears of the verify to price (default 4.57: the embedded target at 17 rows)")
    p.add_argument("--quant", action="store_true",
                   help="the integer ceiling of quantised weights instead (AVX2's int8 chains, Q4_0 and Q8_0 kernels)")
    p.add_argument("--verify-gmac", type=float, default=2.29,
                   help="--quant: G products of the verify to price (default 2.29: the embedded target's linears and "
                        "head, 134.5 M a row, at 17 rows)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quant:
        for fmt, chain in (("Q4_0", False), ("Q8_0", True)):
            peak = int8_gmacs(args.threads, chain)
            print(f"{fmt}'s integer chain, {args.threads} threads: {peak:.0f} G products/s; "
                  f"{args.verify_gmac} G products at that rate: {args.verify_gmac / peak * 1e3:.1f} ms")
            for rows in (6, 12, 18):
                got = quant_kernel_gmacs(fmt, rows)
                print(f"  specdec.native {fmt}, {rows} rows, weight in cache: {got:.0f} G products/s "
                      f"({got / peak:.0%} of the chain)")
        return
    peak = fma_gflops(args.threads)
    print(f"FMA peak, {args.threads} threads: {peak:.0f} GFLOPS")
    for rows in (6, 12, 18):
        got = kernel_gflops(rows)
        print(f"specdec.native linear, {rows} rows, weight in cache: {got:.0f} GFLOPS ({got / peak:.0%} of peak)")
    print(f"{args.verify_gflop} GFLOP of linears at the FMA peak: {args.verify_gflop / peak * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
