"""Start the real services (``python -m <package>``) on free local ports and stop them again."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One service process with its output in ``<log_dir>/<name>.log``, optionally under a command
    prefix that execs it (``ip netns exec <ns>``: the pid stays the service's)."""

    def __init__(self, name: str, module: str, env: dict[str, str], log_dir: Path, prefix: Sequence[str] = ()) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", module], cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=self.log.open("w"), stderr=subprocess.STDOUT,
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if not self.alive():
            return
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def check(self) -> None:
        if not self.alive():
            raise RuntimeError(f"{self.name} exited:\n{self.tail()}")


def wait_grpc(port: int, service: Service, timeout_s: float = 300, host: str = "127.0.0.1") -> None:
    """Wait until ``service`` answers SERVING on ``host:port`` (raises when it exits or times out)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            service.check()
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.3)
    raise TimeoutError(f"{service.name} not serving on {host}:{port} after {timeout_s:.0f} s:\n{service.tail()}")


def answered(response: Any, path: str, status: int = 200) -> bool:
    """Whether ``response`` to ``path`` is the wanted ``status``; the orchestrator's ``/ready`` also
    has to be without ``degraded`` (it is 200 while the draft is not connected yet)."""
    if response.status_code != status:
        return False
    return not (path.endswith("/ready") and status == 200 and response.json().get("degraded"))


def wait_ready(url: str, service: Service, timeout_s: float = 300, path: str = "/ready") -> None:
    """Wait until ``url + path`` answers 200, and for the orchestrator's ``/ready`` until it is not
    degraded either (both model services connected); raises when ``service`` exits or it times out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        service.check()
        try:
            if answered(httpx.get(url + path, timeout=2), path):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url}{path} not 200 after {timeout_s:.0f} s:\n{service.tail()}")


class Stack:
    """Model services and orchestrators started for one benchmark; ``close()`` stops them all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.services: list[Service] = []

    def model_service(self, name: str, kind: str, env: dict[str, str]) -> int:
        """Start ``draft_service`` or ``target_service`` (kind) as ``name``; return its gRPC port."""
        port = free_port()
        prefix = "SPECDEC_DRAFT_" if kind == "draft" else "SPECDEC_TARGET_"
        svc = Service(name, f"{kind}_service", {prefix + "PORT": str(port), prefix + "HOST": "127.0.0.1",
                                                prefix + "METRICS_PORT": str(free_port()), **env}, self.log_dir)
        self.services.append(svc)
        logger.info("starting %s on port %d", name, port)
        wait_grpc(port, svc)
        return port

    def orchestrator(self, name: str, draft: int | str, target: int | str, env: dict[str, str] | None = None) -> str:
        """Start an orchestrator over the two services (a local port, or an address setting such as
        a list of replicas); return its base URL once it is ready."""
        port = free_port()

        def address(where: int | str) -> str:
            return f"127.0.0.1:{where}" if isinstance(where, int) else where

        svc = Service(name, "orchestrator", {
            "SPECDEC_ORCHESTRATOR_PORT": str(port), "SPECDEC_ORCHESTRATOR_HOST": "127.0.0.1",
            "SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS": address(draft),
            "SPECDEC_ORCHESTRATOR_TARGET_ADDRESS": address(target), **(env or {}),
        }, self.log_dir)
        self.services.append(svc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, svc)
        return url

    def check(self) -> None:
        for svc in self.services:
            svc.check()

    def close(self) -> None:
        for svc in reversed(self.services):
            svc.stop()
        self.services.clear()
