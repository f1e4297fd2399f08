"""ComputeThread: calls from RPC threads run on the owner (main) thread; errors come back."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec.scheduler import ComputeThread


def test_calls_run_on_the_owner_thread_and_errors_propagate():
    compute = ComputeThread()
    owner = threading.get_ident()
    stop = threading.Event()

    def boom() -> None:
        raise ValueError("bad input")

    with ThreadPoolExecutor(4) as pool:
        idents = [pool.submit(compute.run, threading.get_ident) for _ in range(8)]
        failing = pool.submit(compute.run, boom)
        pool.submit(lambda: [f.result() for f in idents] and failing.exception() and stop.set())
        compute.serve(stop)
        assert {f.result() for f in idents} == {owner}
        with pytest.raises(ValueError, match="bad input"):
            failing.result()
    # on the owner thread itself the call is inline
    assert compute.run(lambda x: x + 1, 1) == 2
