"""gRPC plumbing shared by the model services: server creation with the standard health and
reflection services, error mapping, per-RPC metrics, and the process entry point."""

from __future__ import annotations

import functools
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, Gauge, Histogram

from specdec.errors import SpecdecError

logger = logging.getLogger(__name__)

RPC_LATENCY = Histogram(
    "specdec_rpc_server_duration_seconds",
    "Server-side duration of model-service RPCs.",
    ["service", "method", "code"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
)
SESSIONS = Gauge("specdec_sessions", "Sessions held in the KV cache store.", ["service"])
KV_BYTES = Gauge("specdec_kv_bytes", "Bytes of KV cache held across sessions.", ["service"])
KV_BUDGET = Gauge("specdec_kv_budget_bytes", "KV cache budget in bytes.", ["service"])
EVICTIONS = Counter("specdec_session_evictions_total", "Sessions evicted to respect the KV budget.", ["service"])

# Large enough for sparse draft distributions over a full vocabulary at k = 32.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def rpc(service: str) -> Callable:
    """Decorate a servicer method: map SpecdecError to its status code, anything else to INTERNAL
    (logged with traceback), and time the call."""

    def wrap(method: Callable) -> Callable:
        name = method.__name__

        @functools.wraps(method)
        def call(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.perf_counter()
            code, message = "OK", ""
            try:
                return method(self, request, context)
            except SpecdecError as exc:
                code, message = exc.code, str(exc)
            except Exception as exc:  # keep serving; the client learns it was our fault
                logger.exception("%s.%s failed", service, name)
                code, message = "INTERNAL", f"internal error: {type(exc).__name__}: {exc}"
            finally:
                RPC_LATENCY.labels(service, name, code).observe(time.perf_counter() - t0)
            context.abort(grpc.StatusCode[code], message)

        return call

    return wrap


def create_server(
    register: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    address: str,
    max_workers: int = 8,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build a server with the servicer(s) ``register`` adds, grpc.health.v1 and reflection.

    Returns (server, bound port, health servicer); ``address`` may use port 0. Not started.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, port, health_servicer


class ComputeThread:
    """Runs model compute on the thread that created it (the process's main thread).

    torch forward passes issued from gRPC worker threads measured 2-2.7x slower than the same
    calls on the thread that loaded the model (k = 0 verify: 91 ms against 34 ms, 2 threads), so
    servicers hand compute to :meth:`run`, and the main thread executes it in :meth:`serve`. Calls
    made on the owner thread itself (tests, tools) run inline.
    """

    def __init__(self) -> None:
        self._owner = threading.get_ident()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if threading.get_ident() == self._owner:
            return fn(*args)
        done: futures.Future = futures.Future()
        self._queue.put((fn, args, done))
        return done.result()

    def serve(self, stop: threading.Event) -> None:
        """Execute submitted calls until ``stop`` is set (call on the owner thread)."""
        while not stop.is_set():
            try:
                fn, args, done = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args))
                except BaseException as exc:  # delivered to the waiting RPC thread
                    done.set_exception(exc)


def serve_forever(server: grpc.Server, health_servicer: health.HealthServicer, compute: ComputeThread | None = None,
                  grace_s: float = 5.0) -> None:
    """Start ``server``, run ``compute`` on this thread until SIGINT/SIGTERM, then drain for
    ``grace_s`` seconds."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    if compute is not None:
        compute.serve(stop)
    else:
        stop.wait()
    logger.info("shutting down (grace %.0f s)", grace_s)
    health_servicer.enter_graceful_shutdown()
    # keep computing while in-flight calls drain
    drained = server.stop(grace_s)
    if compute is not None:
        compute.serve(drained)
    drained.wait()


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
