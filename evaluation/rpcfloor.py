"""``python -m evaluation.rpcfloor``: the round trip of a gRPC call that does no work, on this
machine, in the forms the services could use.

Every speculative iteration makes two calls (Propose, Verify) and plain decoding one per token, so
the cheapest possible call bounds the time per iteration outside the forward passes. An echo server
runs in a separate process and returns each request unchanged, in each of these forms:

  sync        ``grpc.server`` on a thread pool, as the model services run
  aio         ``grpc.aio.server`` on an event loop
  + handoff   the handler hands the request to another thread and waits for it, as the services
              hand work to their compute thread

and the client (``grpc.aio``, as the orchestrator) measures, per form, the median of ``--calls``
round trips of a unary call and of one message on an open bidirectional stream (a stream per
session would replace one unary call per step). ``--service host:port`` adds the standard health
``Check`` of a running model service: the same floor through a service's own server and threads.
``rpcfloor.json`` and ``rpcfloor.md`` land in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from evaluation import report
from evaluation.procs import ROOT, free_port

logger = logging.getLogger("evaluation.rpcfloor")

SERVICE = "specdec.rpcfloor.Echo"
SERVERS = ("sync", "aio", "sync+handoff", "aio+handoff")


def _same(data: bytes) -> bytes:
    return data


class _Handoff:
    """A thread that runs what it is handed, as a model service's compute thread does."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[bytes, futures.Future]] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="compute").start()

    def _run(self) -> None:
        while True:
            data, done = self._jobs.get()
            done.set_result(data)

    def submit(self, data: bytes) -> futures.Future:
        done: futures.Future = futures.Future()
        self._jobs.put((data, done))
        return done


def _handlers(unary: Callable, stream: Callable) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same),
        "Stream": grpc.stream_stream_rpc_method_handler(stream, _same, _same),
    })


def serve(kind: str, port: int) -> None:
    """Run the echo server of ``kind`` (one of SERVERS) on 127.0.0.1:``port`` until killed."""
    handoff = _Handoff() if kind.endswith("+handoff") else None
    if kind.startswith("sync"):
        def unary(data: bytes, context: Any) -> bytes:
            return handoff.submit(data).result() if handoff else data

        def stream(requests: Any, context: Any) -> Any:
            for data in requests:
                yield handoff.submit(data).result() if handoff else data

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        server.add_generic_rpc_handlers((_handlers(unary, stream),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def aunary(data: bytes, context: Any) -> bytes:
        return await asyncio.wrap_future(handoff.submit(data)) if handoff else data

    async def astream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for data in requests:
            yield await asyncio.wrap_future(handoff.submit(data)) if handoff else data

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handlers(aunary, astream),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _echo_round_trips(address: str, payload: bytes, calls: int, warmup: int, ready_s: float = 30.0
                            ) -> dict[str, float]:
    """Median ms of a unary round trip and of a message on an open stream to the echo server."""
    async with grpc.aio.insecure_channel(address) as channel:
        unary = channel.unary_unary(f"/{SERVICE}/Unary", request_serializer=_same, response_deserializer=_same)
        await unary(payload, timeout=ready_s, wait_for_ready=True)
        for _ in range(warmup):
            await unary(payload)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await unary(payload)
            times.append(time.perf_counter() - t0)
        call = channel.stream_stream(f"/{SERVICE}/Stream", request_serializer=_same, response_deserializer=_same)()
        stream = []
        for i in range(warmup + calls):
            t0 = time.perf_counter()
            await call.write(payload)
            echoed = await call.read()
            if i >= warmup:
                stream.append(time.perf_counter() - t0)
            if echoed != payload:
                raise RuntimeError("the echo server changed the message")
        await call.done_writing()
        return {"unary_ms": statistics.median(times) * 1e3, "stream_ms": statistics.median(stream) * 1e3}


async def _health_round_trip(address: str, calls: int, warmup: int) -> float:
    """Median ms of the standard health Check of a running service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        times = []
        for i in range(warmup + calls):
            t0 = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3


def measure(servers: Sequence[str], payload_bytes: int, calls: int, warmup: int) -> list[dict[str, Any]]:
    """Start each echo server in its own process, measure it, stop it."""
    rows = []
    payload = bytes(range(256)) * (payload_bytes // 256) + bytes(payload_bytes % 256)
    for kind in servers:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "evaluation.rpcfloor", "--serve", kind, "--port", str(port)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            found = asyncio.run(_echo_round_trips(f"127.0.0.1:{port}", payload, calls, warmup))
        finally:
            proc.kill()
            _, err = proc.communicate(timeout=10)
        logger.info("%s: unary %.3f ms, stream %.3f ms", kind, found["unary_ms"], found["stream_ms"])
        rows.append({"server": kind, **found})
        if err.strip() and proc.returncode not in (0, -9):
            logger.warning("%s server said: %s", kind, err.decode(errors="replace")[-500:])
    return rows


def render_markdown(result: dict[str, Any]) -> str:
    table = report.markdown_table(result["echo"], [
        ("server", lambda r: r["server"]),
        ("unary call (ms)", lambda r: report.fmt(r["unary_ms"], 3)),
        ("message on a stream (ms)", lambda r: report.fmt(r["stream_ms"], 3)),
    ])
    lines = [f"# gRPC round trip with no work ({result['calls']} calls, {result['payload_bytes']} B, medians)", "",
             f"`{result['command']}`", "", table, ""]
    for address, ms in result.get("services", {}).items():
        lines.append(f"- health `Check` of the service at {address}: {ms:.3f} ms")
    return "\n".join(lines).rstrip() + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m evaluation.rpcfloor", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated echo servers to measure, of {', '.join(SERVERS)} (default all)")
    parser.add_argument("--calls", type=int, default=400, help="timed round trips per form (default 400)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed round trips first (default 50)")
    parser.add_argument("--payload-bytes", type=int, default=1024,
                        help="request size (default 1024, about a Verify of 200 tokens)")
    parser.add_argument("--service", action="append", default=[], metavar="HOST:PORT",
                        help="also time the health Check of a running model service (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/rpcfloor-<timestamp>/)")
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(args.servers) - set(SERVERS))
    if unknown:
        parser.error(f"unknown server(s) {', '.join(unknown)}; choose from {', '.join(SERVERS)}")
    if args.calls < 1 or args.warmup < 0 or args.payload_bytes < 0:
        parser.error("--calls must be at least 1, --warmup and --payload-bytes at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve, args.port)
        return {}
    out, command = report.start_run("evaluation.rpcfloor", list(argv) if argv is not None else None, args.out,
                                    prefix="rpcfloor-")
    result: dict[str, Any] = {
        "command": command, "machine": report.machine_info(), "calls": args.calls, "payload_bytes": args.payload_bytes,
        "echo": measure(args.servers, args.payload_bytes, args.calls, args.warmup),
        "services": {address: asyncio.run(_health_round_trip(address, args.calls, args.warmup))
                     for address in args.service},
    }
    markdown = render_markdown(result)
    report.write_report(out, result, markdown, "rpcfloor.json", "rpcfloor.md")
    print(markdown)
    return result


if __name__ == "__main__":
    main()
