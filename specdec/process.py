"""Process-level setup for the model services: torch threads, metrics endpoint."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


# OpenMP spin iterations before an idle thread sleeps (libgomp's default is 300,000). The target
# and the draft alternate on the same cores: after a Verify, a long spin keeps both cores busy while
# the draft drafts; much shorter spins slow the target's forward. Passive waiting
# (OMP_WAIT_POLICY=PASSIVE) is worse still for both: llama.cpp's threads, which libgomp also serves,
# meet at a barrier after every op and then sleep at each one (docs/benchmarks.md, "Threads and
# processes"; the reasoning: docs/performance.md, "Threads and processes").
SPIN_COUNT = 20_000

# glibc malloc: blocks of at least this many bytes are mapped on their own and unmapped when freed.
# glibc's default threshold starts at 128 KiB but rises after each large free (up to 32 MiB), after
# which KV buffers (the embedded target: 2.9 MiB per 64 cached tokens) and big activations come
# from the heap, whose holes a server that creates and drops sessions of every length never gives
# back (docs/performance.md, "Memory under mixed traffic").
# A fixed threshold turns the dynamic one off. Below it, a decoding step's own blocks (logits of
# a few rows, activations) stay on the heap and are reused. MALLOC_MMAP_THRESHOLD_ in the
# environment (glibc's own setting) wins.
MMAP_THRESHOLD = 1 << 20
# With the mmap threshold fixed, glibc gives the heap's free top back to the system whenever it
# exceeds 128 KiB (M_TRIM_THRESHOLD's default), and the next temporaries fault it in again page by
# page: a sampling verify's per-row top-k / top-p sorts would fault their pages in afresh every
# pass (docs/benchmarks.md, "Logits memory and sampling transforms"). Up to this much free top
# stays (a bound, not growth).
# MALLOC_TRIM_THRESHOLD_ in the environment wins.
TRIM_THRESHOLD = 16 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)


def configure_allocator() -> bool:
    """Fix glibc malloc's mmap threshold at :data:`MMAP_THRESHOLD` (see there), so memory freed
    by released sessions goes back to the system, and its trim threshold at
    :data:`TRIM_THRESHOLD`. Returns whether the mmap threshold applied (False off glibc, or when
    the environment sets the threshold itself)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def bound_openmp_spin() -> None:
    """Bound the OpenMP spin of every thread this process's libgomp will run (``GOMP_SPINCOUNT``,
    unless the environment says otherwise). libgomp reads it when torch is first imported, so a
    service whose start-up may import torch before :func:`configure_torch` (the draft's ``auto``
    backend choice builds specdec.native) calls this first. Unbounded, an idle draft's threads
    spin after every Propose on the cores the target's Verify is using (docs/benchmarks.md, "The
    native draft backend")."""
    if "torch" not in sys.modules:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))


def configure_torch(threads: int) -> None:
    """Fix malloc's mmap threshold (:func:`configure_allocator`), set torch's intra-op threads (0
    keeps torch's default: one per core) and bound the OpenMP
    spin of every thread this process's libgomp runs, torch's and llama.cpp's (``GOMP_SPINCOUNT``,
    unless the environment says otherwise), so that the cores are free soon after a forward pass.
    libgomp reads it when torch is first imported, so this must run before anything imports torch.
    """
    if "torch" in sys.modules and "GOMP_SPINCOUNT" not in os.environ:
        logger.warning("torch was imported before configure_torch; OpenMP wait settings cannot apply")
    else:
        bound_openmp_spin()
    allocator = configure_allocator()
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    logger.info("torch %s, %d threads, OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s, malloc mmap threshold %s",
                torch.__version__, torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY", "default"),
                os.environ.get("GOMP_SPINCOUNT", "default"),
                f"{MMAP_THRESHOLD} B" if allocator else os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc's"))


def start_metrics(port: int | None, host: str = "127.0.0.1") -> None:
    """Serve Prometheus /metrics on ``host``:``port`` (None disables). Services pass their own
    ``host``, so metrics are no more exposed than the gRPC port (loopback unless configured)."""
    if port is None:
        return
    from prometheus_client import start_http_server

    start_http_server(port, addr=host.strip("[]"))
    logger.info("metrics on %s:%d/metrics", host, port)


def host_id() -> str:
    """An id of the machine's running kernel: processes (and containers) on one host share it, so
    a client can tell which services compete for the same CPU cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return socket.gethostname()


def cpu_cores() -> float:
    """CPU cores this process may use: its affinity, capped by a cgroup v2 (or v1) CPU quota."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = float(os.cpu_count() or 1)
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            with open(path) as f:
                fields = f.read().split()
        except OSError:
            continue
        if path.endswith("cpu.max") and len(fields) == 2 and fields[0] != "max":
            cores = min(cores, int(fields[0]) / int(fields[1]))
        elif path.endswith("quota_us") and fields and int(fields[0]) > 0:
            with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
                cores = min(cores, int(fields[0]) / int(f.read()))
        break
    return max(cores, 0.01)
