"""ComputeThread: calls from RPC threads run on the owner (main) thread; errors come back."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec.engine.compute import ComputeThread


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


def test_a_hung_step_turns_health_not_serving_until_it_returns():
    """The watchdog flips every health name to NOT_SERVING once the compute loop has not turned
    for the hang timeout, and back to SERVING when the step returns; an idle loop stays SERVING."""
    import time

    from grpc_health.v1 import health_pb2

    from specdec.server import BoundedHealth, watch_compute

    compute = ComputeThread(4, "watchdog-test", 0)
    health = BoundedHealth(4, ["", "svc"])
    for name in health.names:
        health.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop, release = threading.Event(), threading.Event()

    def status(name: str) -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=name), None).status

    def wait_for(want: int, within_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < within_s:
            if all(status(n) == want for n in health.names):
                return time.monotonic() - t0
            time.sleep(0.02)
        raise AssertionError(f"health did not become {want} within {within_s} s")

    watchdog = threading.Thread(target=watch_compute, args=(compute, health, stop, 0.5, 0.05))
    watchdog.start()
    with ThreadPoolExecutor(2) as pool:
        def drive() -> None:
            time.sleep(1.0)  # idle: the loop turns every 0.1 s, so no alarm
            assert all(status(n) == health_pb2.HealthCheckResponse.SERVING for n in health.names)
            hung = pool.submit(compute.run, release.wait)  # a step that does not come back
            try:
                assert wait_for(health_pb2.HealthCheckResponse.NOT_SERVING, 2.0) >= 0.4
                release.set()
                wait_for(health_pb2.HealthCheckResponse.SERVING, 1.0)
                assert hung.result(timeout=1) is True
            finally:
                release.set()
                stop.set()

        driver = pool.submit(drive)
        compute.serve(stop)
        driver.result()
    watchdog.join()
