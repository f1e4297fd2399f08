"""Bodies just under the 1 MiB limit that can never fit the context: a megabyte prompt, and chats
of tens of thousands of short messages, on both chat routes. Each is refused with a 400 before
any template or tokenizer work, within a second; a normal request meanwhile gets its answer
as quickly as it would alone, and the orchestrator's memory stays flat.

SPECDEC_BIG_BODY_CLIENTS (default 16) clients send them for SPECDEC_BIG_BODY_SECONDS (default 15 s;
the attack that found it ran 32 clients for 45 s)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.reliability.helpers import env_float, env_int, rss_kib, summarize, write_report
from tests.support import wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

CLIENTS = env_int("SPECDEC_BIG_BODY_CLIENTS", 16)
SECONDS = env_float("SPECDEC_BIG_BODY_SECONDS", 15.0)
LIMIT = (1 << 20) - 4096  # under max_body_bytes: the body is read, so the routes' own checks answer


def _bodies() -> list[tuple[str, bytes]]:
    prompt = json.dumps({"prompt": "word " * (LIMIT // 5 - 20), "max_tokens": 4}).encode()
    message = {"role": "user", "content": "hi"}
    count = (LIMIT - 64) // len(json.dumps(message) + ", ")
    chat = json.dumps({"messages": [message] * count, "max_tokens": 4}).encode()
    # under the bound of 2,048 messages, but far past the context once rendered
    fewer = json.dumps({"messages": [{"role": "user", "content": "hello there " * 40}] * 2000,
                        "max_tokens": 4}).encode()
    bodies = [("/v1/completions", prompt), ("/v1/chat/completions", chat), ("/v1/generate", chat),
              ("/v1/chat/completions", fewer), ("/v1/generate", prompt)]
    assert all(len(b) <= LIMIT for _, b in bodies), [len(b) for _, b in bodies]
    return bodies


def test_bodies_that_cannot_fit_are_refused_at_once_and_cost_nothing(embedded_stack):
    url = embedded_stack["url"]
    pid = embedded_stack["orchestrator"].popen.pid
    bodies = _bodies()
    normal = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    alone = httpx.post(f"{url}/v1/generate", json=normal, timeout=120)
    t0 = time.monotonic()
    alone = httpx.post(f"{url}/v1/generate", json=normal, timeout=120)
    alone_s = time.monotonic() - t0
    assert alone.status_code == 200
    rss_before = rss_kib(pid)
    refusals: list[tuple[int, float, str]] = []
    peak = [rss_before]
    stop = time.monotonic() + SECONDS

    def attacker(i: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = i
            while time.monotonic() < stop:
                path, body = bodies[n % len(bodies)]
                n += 1
                t = time.monotonic()
                r = client.post(url + path, content=body, headers={"content-type": "application/json"})
                refusals.append((r.status_code, time.monotonic() - t, path))

    def sampler() -> None:
        while time.monotonic() < stop:
            peak[0] = max(peak[0], rss_kib(pid))
            time.sleep(0.2)  # the sampling period of the memory reading

    threads = [threading.Thread(target=attacker, args=(i,)) for i in range(CLIENTS)] + [threading.Thread(target=sampler)]
    for t in threads:
        t.start()
    # the attack under way: as many bodies refused as there are clients
    wait_until(lambda: len(refusals) >= CLIENTS, SECONDS / 2, lambda: f"{len(refusals)} bodies answered", 0.02)
    t0 = time.monotonic()
    during = httpx.post(f"{url}/v1/generate", json=normal, timeout=120)
    during_s = time.monotonic() - t0
    for t in threads:
        t.join(SECONDS + 120)
    statuses: dict[int, int] = {}
    for status, _, _ in refusals:
        statuses[status] = statuses.get(status, 0) + 1
    slowest = max(s for _, s, _ in refusals)
    report = {"clients": CLIENTS, "seconds": SECONDS, "requests": len(refusals), "statuses": statuses,
              "slowest_refusal_s": round(slowest, 3), "normal_alone_s": round(alone_s, 3),
              "normal_during_s": round(during_s, 3), "rss_before_mib": rss_before // 1024,
              "rss_peak_mib": peak[0] // 1024}
    write_report("big_bodies", report)
    summarize("bodies that cannot fit the context", [
        f"{CLIENTS} clients, {SECONDS:.0f} s: {len(refusals)} bodies of ~1 MiB, statuses {statuses}, "
        f"slowest refusal {slowest:.2f} s",
        f"a normal request: {alone_s:.2f} s alone, {during_s:.2f} s during the attack; orchestrator RSS "
        f"{rss_before // 1024} -> peak {peak[0] // 1024} MiB"])
    assert statuses == {400: len(refusals)}, report
    assert during.status_code == 200 and during.json()["token_ids"] == alone.json()["token_ids"]
    # the goal on 2 cores (what the attack found: up to 14.8 s a refusal, +907 MiB)
    assert slowest < 1.0, report
    assert peak[0] - rss_before < 300 * 1024, report
