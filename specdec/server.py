"""gRPC plumbing shared by the model services: server creation with the standard health and
reflection services, error mapping, per-RPC metrics, and the process entry point."""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.engine.compute import ComputeThread
from specdec.errors import SpecdecError
from specdec.v1 import specdec_pb2 as pb
from specdec.wire import info_to_pb

logger = logging.getLogger(__name__)

RPC_LATENCY = Histogram(
    "specdec_rpc_server_duration_seconds",
    "Server-side duration of model-service RPCs.",
    ["service", "method", "code"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
)


class StoreMetrics:
    """Prometheus collector of the session stores' size, read at scrape time.

    Reading at scrape time (instead of setting gauges after each RPC) means metrics code never
    runs on an RPC's path, so it can never fail one. One instance per process, registered once.
    """

    def __init__(self) -> None:
        self._stores: dict[str, Any] = {}

    def track(self, service: str, store: Any) -> None:
        self._stores[service] = store

    def collect(self) -> Iterable[Any]:
        sessions = GaugeMetricFamily("specdec_sessions", "Sessions held in the KV cache store.", labels=["service"])
        held = GaugeMetricFamily("specdec_kv_bytes", "Bytes of KV cache held across sessions.", labels=["service"])
        budget = GaugeMetricFamily("specdec_kv_budget_bytes", "KV cache budget in bytes.", labels=["service"])
        evictions = CounterMetricFamily("specdec_session_evictions", "Sessions evicted to respect the KV budget.",
                                        labels=["service"])
        for service, store in list(self._stores.items()):
            sessions.add_metric([service], len(store))
            held.add_metric([service], store.nbytes)
            budget.add_metric([service], store.max_bytes)
            evictions.add_metric([service], store.evictions)
        yield from (sessions, held, budget, evictions)


STORE_METRICS = StoreMetrics()
REGISTRY.register(STORE_METRICS)

# Client-side cap (the orchestrator's channels); each server derives its own limits from its model
# (see message_limits).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Room for the fixed fields of a request or response beyond its token lists.
_MESSAGE_SLACK = 64 * 1024


def message_limits(max_context: int, vocab_size: int, max_draft_tokens: int, receives_distributions: bool
                   ) -> tuple[int, int]:
    """(max receive, max send) message bytes for a model service.

    A token id is a uint32 varint (at most 5 bytes); a sparse distribution entry is an id plus a
    float (at most 9 bytes), at most ``vocab_size`` entries per draft position. The target receives
    distributions and sends a few numbers; the draft receives tokens and sends distributions.
    """
    tokens = 5 * (max_context + max_draft_tokens)
    distributions = max_draft_tokens * (9 * vocab_size + 16)
    if receives_distributions:
        return tokens + distributions + _MESSAGE_SLACK, 10 * max_draft_tokens + _MESSAGE_SLACK
    return tokens + _MESSAGE_SLACK, distributions + 10 * max_draft_tokens + _MESSAGE_SLACK


def rpc(service: str | None = None) -> Callable:
    """Decorate a servicer method: map SpecdecError to its status code, anything else to INTERNAL
    (logged with traceback), and time the call. ``service`` labels the metrics (default: the
    servicer's ``service`` attribute)."""

    def wrap(method: Callable) -> Callable:
        name = method.__name__

        @functools.wraps(method)
        def call(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            label = service or self.service
            t0 = time.perf_counter()
            code, message = "OK", ""
            try:
                return method(self, request, context)
            except SpecdecError as exc:
                code, message = exc.code, str(exc)
            except Exception:  # keep serving; the client learns it was our fault, not the details
                error_id = uuid.uuid4().hex[:12]
                logger.exception("%s.%s failed (error id %s)", label, name, error_id)
                code, message = "INTERNAL", f"internal error (id {error_id}; details in the server log)"
            finally:
                RPC_LATENCY.labels(label, name, code).observe(time.perf_counter() - t0)
            context.abort(grpc.StatusCode[code], message)

        return call

    return wrap


class _Malformed:
    """Stands in for a request whose bytes do not parse (see :class:`MalformedRequests`)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's malformed message
            return _Malformed(exc)

    return parse


def _reject(context: grpc.ServicerContext, request: _Malformed) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {type(request.error).__name__}")


class MalformedRequests(grpc.ServerInterceptor):
    """INVALID_ARGUMENT for request bytes that do not parse as the method's message (grpc-python
    itself answers INTERNAL "Exception deserializing request!", as if the server were broken).
    Wraps every handler, the standard health and reflection services included."""

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary or handler.unary_stream:
            inner = handler.unary_unary or handler.unary_stream

            def unary(request: Any, context: grpc.ServicerContext, *callback: Any) -> Any:
                if isinstance(request, _Malformed):
                    _reject(context, request)
                return inner(request, context, *callback)

            # grpc's own flags on a behavior: a non-blocking one (grpc_health's Watch) is handed a
            # send callback and holds no worker thread while its stream stays open
            for flag in ("experimental_non_blocking", "experimental_thread_pool"):
                if hasattr(inner, flag):
                    setattr(unary, flag, getattr(inner, flag))
            make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.unary_stream_rpc_method_handler
            return make(unary, request_deserializer=_safe(handler.request_deserializer),
                        response_serializer=handler.response_serializer)
        inner = handler.stream_unary or handler.stream_stream

        def checked(requests: Iterable[Any], context: grpc.ServicerContext) -> Iterable[Any]:
            for request in requests:
                if isinstance(request, _Malformed):
                    _reject(context, request)
                yield request

        def streaming(requests: Iterable[Any], context: grpc.ServicerContext) -> Any:
            return inner(checked(requests, context), context)

        make = grpc.stream_unary_rpc_method_handler if handler.stream_unary else grpc.stream_stream_rpc_method_handler
        return make(streaming, request_deserializer=_safe(handler.request_deserializer),
                    response_serializer=handler.response_serializer)


# A compute step that has not returned after this long is taken for a hang (the longest step is
# one chunk of a prefill: about a second for the embedded target's 512 rows on 2 cores).
HANG_S = 8.0


HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_READ_TIMEOUT_S = 2.0  # a Check whose message has not come by then is cancelled
HEALTH_CHECKS_PER_HOST = 4  # Checks of one host waiting for their message at once


class HealthCheckGuard(grpc.ServerInterceptor):
    """grpc.health.v1 Check needs no token (probes cannot send one), and grpc's sync server reads
    a unary request's message on a worker thread before any handler runs: callers that send a
    Check's headers and never its message would each hold a worker for as long as they like, and
    200 of them left no worker for an authenticated Info. Here a Check runs as a stream, so the
    guard runs before the message is read: at most ``per_host`` Checks from one host and
    ``max_in_flight`` in all wait for their message at once (more get RESOURCE_EXHAUSTED at once),
    and a message that has not come within ``read_timeout_s`` cancels the call. A probe sends its
    message at once and holds its place for microseconds."""

    def __init__(self, max_in_flight: int, per_host: int = HEALTH_CHECKS_PER_HOST,
                 read_timeout_s: float = HEALTH_READ_TIMEOUT_S) -> None:
        self.max_in_flight, self.per_host, self.read_timeout_s = max_in_flight, per_host, read_timeout_s
        self._in_flight: dict[str, int] = {}
        self._total = 0
        self._lock = threading.Lock()

    def _enter(self, host: str) -> bool:
        with self._lock:
            if self._total >= self.max_in_flight or self._in_flight.get(host, 0) >= self.per_host:
                return False
            self._total += 1
            self._in_flight[host] = self._in_flight.get(host, 0) + 1
            return True

    def _leave(self, host: str) -> None:
        with self._lock:
            self._total -= 1
            left = self._in_flight[host] - 1
            if left:
                self._in_flight[host] = left
            else:
                del self._in_flight[host]

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method != HEALTH_CHECK or not handler.unary_unary:
            return handler
        inner = handler.unary_unary

        def guarded(requests: Iterable[Any], context: grpc.ServicerContext) -> Any:
            host = _peer_host(context.peer())
            if not self._enter(host):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"too many health checks waiting for their message (at most {self.per_host} a host)")
            timer = threading.Timer(self.read_timeout_s, context.cancel)
            timer.daemon = True
            timer.start()
            try:
                request = next(iter(requests), None)
            finally:
                timer.cancel()
                self._leave(host)
            if request is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Check carries one HealthCheckRequest")
            return inner(request, context)

        return grpc.stream_unary_rpc_method_handler(guarded, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


def _peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.5:5000`` -> ``ipv4:10.0.0.5``, ``ipv6:[::1]:5000``
    -> ``ipv6:[::1]``); the string itself for others (``unix:...``)."""
    head, _, port = peer.rpartition(":")
    return head if head and port.isdigit() and head.count(":") >= 1 else peer


class BoundedHealth(health.HealthServicer):
    """grpc.health.v1 with at most ``max_watchers`` Watch streams open at once; more get
    RESOURCE_EXHAUSTED at once. A Watch holds no worker thread (grpc_health's non-blocking mode),
    but every open one counts against the server's ``maximum_concurrent_rpcs``: a flood of Watch
    streams, which need no token, would otherwise leave no room for the model calls."""

    def __init__(self, max_watchers: int, names: Iterable[str] = ("",)) -> None:
        super().__init__()
        self.names = list(names)  # every service name health answers for ("" is the server's)
        self.max_watchers = max_watchers
        self._watchers = 0
        self._watch_lock = threading.Lock()

    def _watch_closed(self) -> None:
        with self._watch_lock:
            self._watchers -= 1

    def Watch(self, request: Any, context: grpc.ServicerContext, send_response_callback: Any = None) -> Any:  # noqa: N802
        with self._watch_lock:
            full = self._watchers >= self.max_watchers
            if not full:
                self._watchers += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many Watch streams open (at most {self.max_watchers})")
        if not context.add_callback(self._watch_closed):  # the call already ended
            self._watch_closed()
        return super().Watch(request, context, send_response_callback)


def create_server(
    register: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    address: str,
    max_workers: int = 8,
    message_limits: tuple[int, int] = (MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES),
    *,
    interceptors: Iterable[grpc.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build a server with the servicer(s) ``register`` adds, grpc.health.v1 and reflection.

    ``message_limits`` is (max receive, max send) bytes: a larger request is refused with
    RESOURCE_EXHAUSTED before it is even parsed. RPCs beyond twice ``max_workers`` in flight are
    refused the same way instead of queueing without bound. ``interceptors`` run before every
    RPC (specdec.auth.TokenAuth); with ``credentials`` the port serves TLS instead of plaintext.
    Returns (server, bound port, health servicer); ``address`` may use port 0. Not started.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=[
            ("grpc.max_receive_message_length", message_limits[0]),
            ("grpc.max_send_message_length", message_limits[1]),
        ],
        maximum_concurrent_rpcs=2 * max_workers,
        # innermost last: health's guard, then auth (outer) answers UNAUTHENTICATED before a
        # malformed body is reported
        interceptors=[HealthCheckGuard(max(1, max_workers // 4)), *interceptors, MalformedRequests()],
    )
    register(server)
    names = list(service_names)
    health_servicer = BoundedHealth(max(1, max_workers // 8), ["", *names])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in health_servicer.names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, port, health_servicer


def watch_compute(compute: ComputeThread, health_servicer: BoundedHealth, stop: threading.Event,
                  hang_s: float = HANG_S, poll_s: float = 1.0) -> None:
    """Until ``stop``: health NOT_SERVING for every name while ``compute``'s loop has not turned for
    ``hang_s`` seconds (a forward that hangs would otherwise leave every probe green while each
    call waits out its deadline), SERVING again once it turns. Runs on its own thread."""
    hung = False
    while not stop.wait(poll_s):
        stale = compute.since_turn()
        if (stale > hang_s) != hung:
            hung = not hung
            if hung:
                logger.error("the compute thread has not come back from its work for %.0f s: health NOT_SERVING", stale)
            else:
                logger.warning("the compute thread is back: health SERVING")
            status = health_pb2.HealthCheckResponse.NOT_SERVING if hung else health_pb2.HealthCheckResponse.SERVING
            for name in health_servicer.names:
                health_servicer.set(name, status)


def serve_forever(server: grpc.Server, health_servicer: BoundedHealth, compute: ComputeThread | None = None,
                  grace_s: float = 5.0, hang_s: float = HANG_S) -> None:
    """Start ``server``, run ``compute`` on this thread until SIGINT/SIGTERM, then drain for
    ``grace_s`` seconds. While a step of ``compute`` runs longer than ``hang_s``, health says
    NOT_SERVING (:func:`watch_compute`)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    if compute is not None:
        threading.Thread(target=watch_compute, args=(compute, health_servicer, stop, hang_s), name="watchdog",
                         daemon=True).start()
        compute.serve(stop)
    else:
        stop.wait()
    logger.info("shutting down (grace %.0f s)", grace_s)
    health_servicer.enter_graceful_shutdown()
    # keep computing while in-flight calls drain
    drained = server.stop(grace_s)
    if compute is not None:
        compute.serve(drained)
        compute.close()
    drained.wait()


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


class ModelServicer:
    """What both model services' servicers share: model work on the compute thread when there is
    one (see ComputeThread), Info and Release. ``engine`` is the service's engine (the target's
    TargetEngine, the draft's Proposer): ``prepare``/``run`` jobs, ``info()``, ``release(id)`` and
    its session ``store``. A subclass adds its own RPC and names its ``service``."""

    service = ""  # the metrics' label: "draft" or "target"
    grpc_service = ""  # the service's name in specdec.v1
    receives_distributions = False  # its requests may carry sparse draft distributions (message limits)

    def __init__(self, engine: Any, compute: ComputeThread | None = None) -> None:
        self.engine = engine
        self._compute = compute

    def _submit(self, job: Any, context: grpc.ServicerContext) -> Any:
        return self._compute.submit(self.engine, job, context) if self._compute else self.engine.run(job)

    @rpc()
    def Info(self, request: Any, context: grpc.ServicerContext) -> Any:
        return info_to_pb(self.engine.info(), self._compute.snapshot() if self._compute else None)

    @rpc()
    def Release(self, request: Any, context: grpc.ServicerContext) -> Any:
        release = self.engine.release
        released = (self._compute.run(release, request.session_id, context=context) if self._compute
                    else release(request.session_id))
        return pb.ReleaseResponse(released=released)

    def build(self, add: Callable[[Any, grpc.Server], None], address: str, workers: int, *,
              interceptors: Iterable[grpc.ServerInterceptor] | None = None,
              credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, int, Any]:
        """(server, port, health) serving this servicer on ``address``; see :func:`create_server`.
        ``add``: the generated ``add_…Servicer_to_server``."""
        STORE_METRICS.track(self.service, self.engine.store)
        info = self.engine.info()
        limits = message_limits(info.max_context, info.vocab_size, info.max_draft_tokens,
                                receives_distributions=self.receives_distributions)
        name = pb.DESCRIPTOR.services_by_name[self.grpc_service].full_name
        return create_server(lambda server: add(self, server), [name], address, workers, limits,
                             interceptors=interceptors or (), credentials=credentials)
