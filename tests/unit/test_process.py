"""Process-level setup of the model services (specdec.process), in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# After a 4 MiB block is freed, glibc's dynamic threshold maps only blocks above 4 MiB on their own:
# a 2 MiB block then comes from the heap. With the threshold fixed it is mapped (and unmapped when
# freed, so memory a released session held goes back to the system).
PROBE = textwrap.dedent("""
    import ctypes, os, sys
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    if sys.argv[1] == "configured":
        from specdec.process import configure_allocator
        assert configure_allocator()
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(4 << 20))
    before = libc.mallinfo2().hblks
    block = libc.malloc(2 << 20)
    print(libc.mallinfo2().hblks - before)
    libc.free(block)
""")


# 16 blocks of 512 KiB (below the mmap threshold: from the heap), freed: with the mmap threshold
# alone fixed, glibc trims the heap's free top back (and the next temporaries fault it in again);
# configured, it keeps up to 16 MiB of it.
TRIM_PROBE = textwrap.dedent("""
    import ctypes, sys
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc = ctypes.CDLL(None)
    if sys.argv[1] == "configured":
        from specdec.process import configure_allocator
        assert configure_allocator()
    else:
        assert libc.mallopt(-3, 1 << 20)
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(512 << 10) for _ in range(16)]
    for b in reversed(blocks):
        libc.free(b)
    print(libc.mallinfo2().arena >= 8 << 20)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_configure_allocator_keeps_the_heaps_free_top():
    kept = {how: subprocess.run([sys.executable, "-c", TRIM_PROBE, how], capture_output=True, text=True, check=True,
                                env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")})
            .stdout.strip() for how in ("mmap-only", "configured")}
    assert kept == {"mmap-only": "False", "configured": "True"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_configure_allocator_maps_large_blocks_on_their_own():
    mapped = {how: subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, check=True)
              .stdout.strip() for how in ("stock", "configured")}
    assert mapped == {"stock": "0", "configured": "1"}
