"""The arithmetic ceiling of a verify pass on this machine: fp32 FMA throughput of the cores, and
what specdec.native's linear kernel reaches when its weights sit in cache.

A plain step streams the target's weights once (bound by memory); a verify of many rows does the
same streaming but k + 1 times the arithmetic, so past some row count it is bound by the cores'
FMA rate instead. This measures that rate directly, with a C loop of independent AVX-512 (or AVX2)
FMAs on every thread, and the linear kernel on an L2-resident weight at 6, 12 and 18 rows, so a
verify's linears can be priced against the hardware:

    python -m evaluation.peak            # ~10 s; prints GFLOPS and the implied 17-row floor

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


def kernel_gflops(rows: int, n: int = 768, k: int = 576, repeats: int = 200) -> float:
    """GFLOPS of specdec.native's fp32 linear on a weight that stays in cache (n x k floats)."""
    native = kernels()
    if native is None:
        raise SystemExit("specdec.native is unavailable here")
    gen = torch.Generator().manual_seed(0)
    packed = native.pack_linear(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    for _ in range(10):
        native.linear(x, packed, n)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            native.linear(x, packed, n)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return 2 * rows * n * k / best / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads (default: torch's)")
    p.add_argument("--verify-gflop", type=float, default=4.57,
                   help="GFLOP of the linears of the verify to price (default 4.57: the embedded target at 17 rows)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    peak = fma_gflops(args.threads)
    print(f"FMA peak, {args.threads} threads: {peak:.0f} GFLOPS")
    for rows in (6, 12, 18):
        got = kernel_gflops(rows)
        print(f"specdec.native linear, {rows} rows, weight in cache: {got:.0f} GFLOPS ({got / peak:.0%} of peak)")
    print(f"{args.verify_gflop} GFLOP of linears at the FMA peak: {args.verify_gflop / peak * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
