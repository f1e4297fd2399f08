"""Sampling requests with long prompts cannot take every step: SPECDEC_SAMPLING_FLOOD_CLIENTS
(default 8 in CI; 16 here passed: the attack that found it sent 48) sampling chats with ~1,000-token prompts, and
meanwhile a greedy request. Each sampling pass runs alone (a seeded request's output must not
depend on the load) but counts against the step's row budget, so the greedy request gets its
tokens within 30 s, no request gets a 5xx, and both services' gRPC health stays SERVING (their
hang watchdog never trips) while /ready stays 200."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.reliability.helpers import env_int, service_info, summarize, write_report
from tests.support import wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

CLIENTS = env_int("SPECDEC_SAMPLING_FLOOD_CLIENTS", 8)
NOTE = "Remember to water the plants, feed the cat, check the mail and call the bank before noon. "


def test_sampling_requests_with_long_prompts_leave_every_step_room_for_others(embedded_stack):
    url, ports = embedded_stack["url"], embedded_stack["ports"]
    long_prompt = "Here are my notes for the week: " + NOTE * 55 + "Summarise them."  # ~1,000 tokens
    statuses: list[int] = []

    def sampler(i: int) -> None:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 24, "temperature": 1.0, "seed": i})
        statuses.append(r.status_code)

    health: dict[str, list[int]] = {"draft": [], "target": []}
    ready: list[int] = []
    done = threading.Event()

    def poll() -> None:
        channels = {k: grpc.insecure_channel(f"127.0.0.1:{p}") for k, p in ports.items()}
        while not done.is_set():
            for kind, channel in channels.items():
                try:
                    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
                except grpc.RpcError:
                    status = -1
                health[kind].append(status)
            ready.append(httpx.get(f"{url}/ready", timeout=10).status_code)
            time.sleep(1.0)  # the polling period of the health and readiness readings
        for channel in channels.values():
            channel.close()

    threads = [threading.Thread(target=sampler, args=(i,)) for i in range(CLIENTS)]
    poller = threading.Thread(target=poll)
    poller.start()
    for t in threads:
        t.start()
    try:  # the sampling prefills under way: every chat admitted, and the target computing for them
        wait_until(lambda: httpx.get(f"{url}/v1/server", timeout=10).json()["active_streams"] == CLIENTS
                   and service_info("target", ports["target"]).scheduler.queued > 0, 60,
                   "the sampling chats admitted and at the target", 0.05)
    except AssertionError:
        done.set()  # the poller's loop ends with the test
        raise
    t0 = time.monotonic()
    greedy = httpx.post(f"{url}/v1/generate", timeout=600,
                        json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    greedy_s = time.monotonic() - t0
    for t in threads:
        t.join(900)
    done.set()
    poller.join(30)
    serving = health_pb2.HealthCheckResponse.SERVING
    report = {"clients": CLIENTS, "statuses": {s: statuses.count(s) for s in set(statuses)},
              "greedy_s": round(greedy_s, 2), "greedy_status": greedy.status_code,
              "health_not_serving": {k: sum(1 for s in v if s != serving) for k, v in health.items()},
              "health_polls": {k: len(v) for k, v in health.items()},
              "ready_not_200": sum(1 for s in ready if s != 200)}
    write_report("sampling_flood", report)
    summarize("sampling requests with long prompts", [
        f"{CLIENTS} sampling chats of ~1,000-token prompts: statuses {report['statuses']}; a greedy request "
        f"meanwhile: {greedy.status_code} in {greedy_s:.1f} s; health not SERVING {report['health_not_serving']} "
        f"of {report['health_polls']} polls; /ready not 200: {report['ready_not_200']}"])
    assert statuses == [200] * CLIENTS, report
    assert greedy.status_code == 200 and greedy_s < 30, report
    assert report["health_not_serving"] == {"draft": 0, "target": 0} and report["ready_not_200"] == 0, report
