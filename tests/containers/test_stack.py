"""The containers, for real (`make test-containers`): the image built from the Dockerfile, the
stack brought up from compose.yaml + compose.grpc.yaml by the Docker Compose binary, then

- every health check passes and the published APIs answer: REST, server-sent events, the official
  OpenAI client, grpcurl against both model services, the dashboard;
- each container stays within its compose memory limit;
- a killed draft comes back through its restart policy without a single failed request (the
  orchestrator decodes without drafts meanwhile) and drafting resumes;
- a killed target comes back and requests succeed again;
- the draft image converts a model for llama.cpp into its gguf-cache volume;
- SPECDEC_PAIR=gpt2 resolves (compose config: those weights cannot be downloaded here);
- teardown leaves no container, network or volume of the project.

The tests run in file order on one stack; the last one takes it down.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from specdec.native import kernels
from tests.containers.conftest import PORTS, PROJECT, SERVICES, Stack, podman, tool
from tests.support import wait_until

pytestmark = pytest.mark.containers

PROMPT = "The three primary colors are"
# Token ids of the embedded model (SmolLM2's tokenizer), as in the README's grpcurl example.
TOKENS = [504, 1296, 3003, 4683, 359]


def generate(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **body})


def mebibytes(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)\s*([kMGT]i?B|B)", text.strip()).groups()
    return float(number) * {"B": 1 / 2**20, "kB": 1e3 / 2**20, "kiB": 1 / 1024, "MB": 1e6 / 2**20, "MiB": 1,
                            "GB": 1e9 / 2**20, "GiB": 1024, "TB": 1e12 / 2**20}[unit]


# -- up and healthy ------------------------------------------------------------------------------


def test_every_service_becomes_healthy(stack: Stack) -> None:
    ps = [json.loads(line) for line in stack.compose("ps", "--format", "json").stdout.splitlines() if line.strip()]
    health = {entry["Service"]: entry.get("Health") or entry.get("State") for entry in ps}
    assert health == dict.fromkeys(SERVICES, "healthy"), health
    for service in SERVICES:
        state = stack.inspect(service)["State"]
        assert state["Running"] is True and state["Health"]["Status"] == "healthy", (service, state)
        assert state["Health"]["FailingStreak"] == 0, (service, state["Health"])
        # Start to healthy, per container: the first passing check since this start (healthy by
        # a check of its own, not by a status left from an earlier run of the container)
        start_to_healthy = first_healthy_after_start(state)
        assert start_to_healthy is not None, f"{service}: no passing health check since it started: {state['Health']}"
        stack.figures.setdefault("start_to_healthy_s", {})[service] = start_to_healthy


def first_healthy_after_start(state: dict) -> float | None:
    def seconds(stamp: str) -> float:  # RFC 3339 with nanoseconds and a zone offset
        stamp = re.sub(r"(\.\d{6})\d*", r"\1", stamp.replace("Z", "+00:00"))
        stamp = re.sub(r" ([+-]\d\d):?(\d\d)$", r"\1:\2", stamp.split(" m=")[0].replace(" UTC", "+00:00"))
        from datetime import datetime
        return datetime.fromisoformat(stamp).timestamp()

    started = seconds(state["StartedAt"])
    for entry in state["Health"].get("Log") or []:
        if entry.get("ExitCode") == 0 and seconds(entry["Start"]) >= started:
            return round(seconds(entry["End"]) - started, 1)
    return None


def published(stack: Stack, service: str) -> dict[str, list[tuple[str, str]]]:
    """The running container's published ports: {"50051/tcp": [(host ip, host port)], ...}."""
    ports = stack.inspect(service)["NetworkSettings"]["Ports"] or {}
    return {port: [(b["HostIp"], b["HostPort"]) for b in bindings or []] for port, bindings in ports.items()
            if bindings}


def test_model_services_are_not_published_by_compose_yaml_alone(stack: Stack) -> None:
    alone = json.loads(Stack(env=stack.env, files=("compose.yaml",)).compose("config", "--format", "json").stdout)
    for service in ("draft", "target"):
        assert alone["services"][service].get("ports", []) == [], alone["services"][service]["ports"]
        assert set(alone["services"][service]["networks"]) == {"models"}
    # The grpc override publishes each on loopback only, on a network of their own; the models
    # network stays internal (no port can be published from it).
    for service, port in (("draft", 50051), ("target", 50052)):
        host_port = str(PORTS[f"SPECDEC_{service.upper()}_PORT"])
        assert published(stack, service) == {f"{port}/tcp": [("127.0.0.1", host_port)]}, published(stack, service)
    assert published(stack, "orchestrator") == {"8000/tcp": [("127.0.0.1", str(PORTS["SPECDEC_ORCHESTRATOR_PORT"]))]}
    networks = json.loads(podman("network", "inspect", f"{PROJECT}_models"))
    assert networks[0]["internal"] is True


# -- the APIs ------------------------------------------------------------------------------------


def test_rest_generate(client: httpx.Client) -> None:
    reply = generate(client, max_tokens=24)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["text"].strip() and len(body["token_ids"]) == 24
    assert body["mode"] == "speculative" and body["steps"]
    steps, stats = body["steps"], body["stats"]
    assert [t for s in steps for t in s["tokens"]] == body["token_ids"]
    # the totals are the steps' own: what was drafted, and what of it the target accepted
    assert stats["draft_tokens"] == sum(len(s["draft"]) for s in steps) > 0
    assert stats["accepted_tokens"] == sum(s["accepted"] for s in steps)
    # Output is the target's own: plain decoding gives the same tokens.
    plain = generate(client, max_tokens=24, mode="autoregressive").json()
    assert plain["token_ids"] == body["token_ids"] and plain["text"] == body["text"]


def test_streamed_generate(client: httpx.Client) -> None:
    events: list[tuple[str, dict]] = []
    body = {"messages": [{"role": "user", "content": "Explain gravity in one sentence."}], "max_tokens": 24}
    with client.stream("POST", "/v1/generate/stream", json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in reply.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                events.append((event, json.loads(line.split(":", 1)[1])))
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "done" and kinds.count("done") == 1 and set(kinds) == {"step", "done"}
    # the steps carry every token of the answer, in order
    done = events[-1][1]
    assert [t for kind, data in events if kind == "step" for t in data["tokens"]] == done["token_ids"]
    assert 0 < len(done["token_ids"]) <= 24


def test_openai_client_chat(stack: Stack) -> None:
    client = OpenAI(base_url=f"{stack.api}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "Name three rivers."}])
    assert reply.choices[0].message.content.strip()
    specdec = reply.model_extra["specdec"]
    assert specdec["tokens"] == reply.usage.completion_tokens
    assert specdec["draft_tokens"] > 0 and specdec["acceptance_rate"] == pytest.approx(
        specdec["accepted_tokens"] / specdec["draft_tokens"])
    hello = [{"role": "user", "content": "Say hello."}]
    chunks = list(client.chat.completions.create(model=model, temperature=0, max_tokens=16, stream=True, messages=hello))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # greedy: the stream says what the same request answers in one piece
    whole = client.chat.completions.create(model=model, temperature=0, max_tokens=16, messages=hello)
    assert streamed.strip() and streamed == whole.choices[0].message.content


def grpcurl(*args: str) -> str:
    done = subprocess.run([tool("grpcurl"), "-plaintext", "-max-time", "60", *args], capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr
    return done.stdout


def field(reply: dict, name: str):
    """A field of grpcurl's JSON output, by its proto name or its lowerCamel JSON name."""
    camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), name)
    return reply[name] if name in reply else reply[camel]


def test_grpcurl_draft_service(stack: Stack) -> None:
    address = stack.grpc("draft")
    services = grpcurl(address, "list").split()
    assert {"specdec.v1.DraftService", "grpc.health.v1.Health"} <= set(services)
    assert json.loads(grpcurl(address, "grpc.health.v1.Health/Check"))["status"] == "SERVING"
    reply = json.loads(grpcurl("-d", json.dumps({"session_id": "ctest", "tokens": TOKENS, "max_draft_tokens": 4}),
                               address, "specdec.v1.DraftService/Propose"))
    # no confidence threshold asked: a whole draft of 4
    assert len(field(reply, "draft_tokens")) == 4 and field(reply, "stop_reason") == "DRAFT_STOP_REASON_MAX_TOKENS", reply
    info = json.loads(grpcurl(address, "specdec.v1.DraftService/Info"))
    # auto: specdec's kernels where this CPU runs their vector form (the image ships them built)
    native = kernels()
    assert info["backend"] == ("native" if native is not None and native.quant_isa("Q4_1") != "baseline" else "llamacpp")


def test_grpcurl_target_service(stack: Stack, client: httpx.Client) -> None:
    address = stack.grpc("target")
    assert "specdec.v1.TargetService" in grpcurl(address, "list").split()
    assert json.loads(grpcurl(address, "grpc.health.v1.Health/Check"))["status"] == "SERVING"
    draft = [260, 3003]  # " the primary"
    reply = json.loads(grpcurl("-d", json.dumps({"session_id": "ctest", "tokens": TOKENS, "draft_tokens": draft}),
                               address, "specdec.v1.TargetService/Verify"))
    # Greedy verification against the target's own greedy continuation of PROMPT (whose tokens
    # TOKENS are): the draft's agreeing prefix is accepted, then the target's next token.
    plain = generate(client, max_tokens=len(draft) + 1, mode="autoregressive").json()["token_ids"]
    agree = next((i for i, (d, t) in enumerate(zip(draft, plain, strict=False)) if d != t), len(draft))
    accepted = int(reply.get("num_accepted", reply.get("numAccepted", 0)))  # proto3 JSON leaves a 0 out
    assert (accepted, int(field(reply, "next_token"))) == (agree, plain[agree]), (reply, plain)
    # Both services hold the same tokenizer (the orchestrator refuses a pair otherwise).
    fingerprints = {field(json.loads(grpcurl(stack.grpc(s), f"specdec.v1.{s.capitalize()}Service/Info")),
                          "tokenizer_fingerprint") for s in ("draft", "target")}
    assert len(fingerprints) == 1 and len(next(iter(fingerprints))) == 64, fingerprints
    # Both model services load the kernels the image ships prebuilt (as the services' own user):
    # without them the target would fall back to torch ops and the draft to llama.cpp.
    for service in ("draft", "target"):
        assert "native kernels unavailable" not in stack.logs(service, tail=2000), stack.logs(service)


def test_dashboard_answers(stack: Stack) -> None:
    assert httpx.get(f"{stack.ui}/_stcore/health", timeout=30).text.strip() == "ok"
    page = httpx.get(stack.ui, timeout=30)
    assert page.status_code == 200 and "<title>" in page.text.lower().replace("<title >", "<title>")
    # The dashboard reaches the orchestrator by its service name on the compose network.
    podman("exec", stack.container("ui"), "python", "-m", "specdec.healthcheck", "http://orchestrator:8000/ready")


# -- resources -----------------------------------------------------------------------------------


def test_memory_stays_within_the_compose_limits(stack: Stack, client: httpx.Client) -> None:
    config = json.loads(stack.compose("config", "--format", "json").stdout)
    for _ in range(3):  # some load first, so the model services hold sessions
        assert generate(client, max_tokens=48).status_code == 200
    stats = json.loads(podman("stats", "--no-stream", "--format", "json", *[stack.container(s) for s in SERVICES]))
    by_id = {entry["id"][:12]: entry for entry in stats}
    figures = {}
    for service in SERVICES:
        entry = by_id[stack.container(service)[:12]]
        used, limit = (mebibytes(x) for x in entry["mem_usage"].split("/"))
        expected = int(config["services"][service]["deploy"]["resources"]["limits"]["memory"]) / 2**20
        pid = stack.main_pid(service)
        status = Path(f"/proc/{pid}/status").read_text()
        figures[service] = {"used_mib": round(used), "limit_mib": round(limit), "compose_limit_mib": round(expected),
                            "rss_mib": round(int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024),
                            "peak_rss_mib": round(int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) / 1024),
                            "threads": int(re.search(r"Threads:\s+(\d+)", status)[1]),
                            "open_files": len(os.listdir(f"/proc/{pid}/fd"))}
        assert abs(limit - expected) < 1, f"{service}: engine limit {limit} MiB, compose says {expected} MiB"
        assert used < 0.8 * limit, f"{service}: {used:.0f} of {limit:.0f} MiB"
    stack.figures["memory"] = figures


# -- restarts ------------------------------------------------------------------------------------


class Load:
    """Sequential requests in a thread, each outcome recorded."""

    def __init__(self, client: httpx.Client, **body) -> None:
        self.client, self.body = client, body
        self.outcomes: list[tuple[float, int, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                reply = generate(self.client, **self.body)
                self.outcomes.append((time.monotonic(), reply.status_code,
                                      reply.json() if reply.status_code == 200 else {"error": reply.text[:300]}))
            except httpx.HTTPError as exc:
                self.outcomes.append((time.monotonic(), 0, {"error": repr(exc)}))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(180)


def kill(stack: Stack, service: str) -> int:
    """SIGKILL the service's process, as a crash or the OOM killer would; returns the restart count before."""
    before = stack.inspect(service)["RestartCount"]
    os.kill(stack.main_pid(service), signal.SIGKILL)
    return before


def wait_restarted(stack: Stack, service: str, before: int, timeout_s: float = 300) -> float:
    start = time.monotonic()
    wait_until(lambda: stack.inspect(service)["RestartCount"] > before, 60,
               lambda: f"{service} was not restarted\n{stack.logs(service)}", 0.5)
    return time.monotonic() - start + stack.wait_healthy(service, timeout_s)


def drafting(outcomes: list[tuple[float, int, dict]], since: float) -> bool:
    """The last two requests ended after ``since``, both speculating with the draft, none without it."""
    last = outcomes[-2:]
    return len(last) == 2 and all(
        at > since and status == 200 and body["stats"]["draft_tokens"] > 0 and body["stats"]["draft_fallbacks"] == 0
        for at, status, body in last)


def test_killed_draft_restarts_without_a_failed_request(stack: Stack, client: httpx.Client) -> None:
    # A fixed k: every step asks the draft, so its absence and its return both show.
    with Load(client, controller="fixed", k=4) as load:
        wait_until(lambda: len(load.outcomes) >= 2, 120, "two requests served before the kill", 0.2)
        before = kill(stack, "draft")
        killed_at = time.monotonic()
        back = wait_restarted(stack, "draft", before)
        healthy_at = time.monotonic()
        # the orchestrator retries a failed draft after draft_retry_s (5 s): drafting resumes
        wait_until(lambda: drafting(load.outcomes, healthy_at), 60,
                   lambda: f"no drafting since the draft came back: {load.outcomes[-2:]}", 0.5)
    stack.figures["draft_restart_to_healthy_s"] = round(back, 1)
    failed = [(status, body) for _, status, body in load.outcomes if status != 200]
    assert not failed, failed[:3]
    after = [body for at, _, body in load.outcomes if at > killed_at]
    assert any(body["stats"]["draft_fallbacks"] > 0 for body in after), "no request noticed the draft was down"
    latest = load.outcomes[-2:]
    assert all(body["stats"]["draft_tokens"] > 0 and body["stats"]["draft_fallbacks"] == 0 for _, _, body in latest)


def test_killed_target_restarts_and_requests_succeed_again(stack: Stack, client: httpx.Client) -> None:
    assert generate(client).status_code == 200
    before = kill(stack, "target")
    back = wait_restarted(stack, "target", before)
    stack.figures["target_restart_to_healthy_s"] = round(back, 1)
    statuses: list[int] = []

    def served() -> bool:
        reply = generate(client)
        statuses.append(reply.status_code)
        if reply.status_code != 200:
            assert reply.status_code == 503, reply.text  # down: 503 with the reason, nothing else
        return reply.status_code == 200

    wait_until(served, 120, lambda: f"no success within 120 s of the target's return: {statuses[-5:]}", 1)
    assert all(generate(client).status_code == 200 for _ in range(3))
    stack.wait_healthy("orchestrator", 120)  # raises with the logs when it does not get there


# -- the gpt2 pair, resolved only ------------------------------------------------------------------


def test_draft_image_converts_models_for_llamacpp(stack: Stack) -> None:
    """The image carries llama.cpp's converter and its dependencies, and the draft container may
    write the gguf-cache volume: the embedded target converts to q8_0, as SPECDEC_DRAFT_MODEL=target
    does on a draft's first start, and a second run reuses the file."""
    cmd = ("exec", "-T", "draft", "python", "-m", "specdec.model.gguf_convert", "embedded", "--quant", "q8_0")
    first = stack.compose(*cmd, timeout=300)
    path = first.stdout.strip().splitlines()[-1]
    assert path.startswith("/opt/specdec/cache/gguf/") and path.endswith("-q8_0.gguf"), first.stdout + first.stderr
    assert "converted embedded to q8_0 in" in first.stderr
    again = stack.compose(*cmd, timeout=120)
    assert again.stdout.strip().splitlines()[-1] == path and "(cached)" in again.stderr


def test_gpt2_pair_resolves(stack: Stack) -> None:
    config = json.loads(stack.compose("config", "--format", "json", SPECDEC_PAIR="gpt2").stdout)
    draft, target = config["services"]["draft"], config["services"]["target"]
    assert (target["environment"]["SPECDEC_TARGET_MODEL"], draft["environment"]["SPECDEC_DRAFT_MODEL"],
            draft["environment"]["SPECDEC_DRAFT_BACKEND"]) == ("gpt2", "distilgpt2", "auto")
    assert {"hub", "models", "grpc"} <= set(draft["networks"]) and draft["environment"]["HF_HUB_OFFLINE"] == "0"
    assert config["services"]["draft"]["image"] == stack.env["SPECDEC_IMAGE"]


# -- teardown ------------------------------------------------------------------------------------


def test_teardown_leaves_nothing_behind(stack: Stack) -> None:
    assert any(stack.project_leftovers().values())
    stack.save_logs()
    stack.down()
    assert stack.project_leftovers() == {"containers": [], "networks": [], "volumes": []}
    for port in PORTS.values():  # published ports are released
        with __import__("socket").socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, port
