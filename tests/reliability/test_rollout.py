"""A target replica swapped for another model under load never changes an output.

Two target replicas behind one orchestrator (real processes, tiny random GPT-2 models, no draft:
the target alone decides every token); six clients send greedy requests back to back, each
compared with the answer it got before. Replica 2 is stopped and started again on its port
serving another model (other weights, a tokenizer with one more token), as a rollout to a new
model would: its sessions fail over to replica 1, and once the orchestrator has seen what it
serves it is left out of routing, not even a last resort.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdec.models import load_tokenizer
from tests.reliability.helpers import post, service_info, stream, summarize, write_report
from tests.support import free_port, make_gpt2, start_model_service, start_orchestrator

pytestmark = pytest.mark.reliability

PROMPTS = ["the sea was calm", "a lighthouse keeper", "forty-two boats", "she wrote, then", "why? because",
           "in the morning", "seven small stones", "he said: no", "over the hill", "rain, rain, rain",
           "the last letter", "quiet nights"]
CLIENTS = 6
MAX_TOKENS = 24
AFTER_SEEN_S = 4.0  # load kept on after the orchestrator has seen the other model: two probe periods


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rollout-models")
    other = make_gpt2(root / "other", 5, positions=256)
    tok = load_tokenizer(other)
    tok.add_tokens(["<extra>"])  # another vocabulary: another tokenizer fingerprint
    tok.save_pretrained(other)
    return {"pool": make_gpt2(root / "pool", 0, positions=256), "other": other}


def test_a_replica_swapped_for_another_model_never_changes_an_output(models, tmp_path):
    procs = {}
    try:
        procs["t1"], p1 = start_model_service("target", tmp_path, {"SPECDEC_TARGET_MODEL": models["pool"]})
        p2 = free_port()
        procs["t2"], _ = start_model_service("target", tmp_path, {"SPECDEC_TARGET_MODEL": models["pool"]}, port=p2,
                                             name="target-2")
        procs["orch"], url = start_orchestrator(free_port(), 0, tmp_path, {
            "SPECDEC_ORCHESTRATOR_TARGET_ADDRESS": f"127.0.0.1:{p1},127.0.0.1:{p2}"}, wait_ready=False)
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/ready", timeout=5).status_code != 200:  # degraded (no draft) is ready
            assert time.monotonic() < deadline, procs["orch"].tail()
            time.sleep(0.3)
        expected = {}
        for prompt in PROMPTS:
            out = post(url, "/v1/generate", {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True})
            assert out.status == 200, out.body
            expected[prompt] = out.token_ids
        both_served = {name: service_info("target", port).scheduler.calls for name, port in (("t1", p1), ("t2", p2))}

        stop = threading.Event()
        results: list[tuple[str, int, bool]] = []  # (prompt, status, same output)

        def client(i: int) -> None:
            n = i
            while not stop.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
                out = stream(url, body, 60.0) if n % 3 == 0 else post(url, "/v1/generate", body, 60.0)
                ok = out.status == 200 and (out.done is not None if out.events else True)
                results.append((prompt, out.status, ok and out.token_ids == expected[prompt]))
                n += CLIENTS

        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(client, i) for i in range(CLIENTS)]
            t0 = time.monotonic()
            procs["t2"].stop()  # the rollout takes replica 2 down ...
            procs["t2"], _ = start_model_service("target", tmp_path, {"SPECDEC_TARGET_MODEL": models["other"]}, port=p2,
                                                 name="target-2-other")
            served_at = time.monotonic() - t0  # ... and brings it back serving another model
            seen_at = None
            while seen_at is None and time.monotonic() - t0 < 60:
                replicas = httpx.get(f"{url}/v1/info", timeout=10).json()["replicas"]["target"]
                if any(r["address"].endswith(f":{p2}") and "another model" in r["reason"] for r in replicas):
                    seen_at = time.monotonic() - t0
                time.sleep(0.2)
            time.sleep(AFTER_SEEN_S)
            stop.set()
            for f in futures:
                f.result(timeout=90)
        other_calls = service_info("target", p2).scheduler.calls
        ready = httpx.get(f"{url}/ready", timeout=10)
    finally:
        for proc in reversed(procs.values()):
            proc.stop()
    changed = [(p, s) for p, s, same in results if not same]
    report = {"clients": CLIENTS, "requests": len(results), "changed_or_failed": changed[:10],
              "changed_or_failed_count": len(changed), "calls_before_swap": both_served,
              "other_model_served_after_s": round(served_at, 1),
              "other_model_seen_after_s": round(seen_at, 1) if seen_at is not None else None,
              "calls_served_by_the_other_model": other_calls, "ready_after": ready.status_code}
    write_report("replica_swapped_for_another_model", report)
    summarize("target replica swapped for another model", [
        f"{len(results)} greedy requests from {CLIENTS} clients while replica 2 was stopped and came back serving "
        f"another model ({served_at:.1f} s later, left out {seen_at and seen_at - served_at:.1f} s after that): "
        f"{len(changed)} changed or failed, {other_calls} calls served by the other model; /ready {ready.status_code}"])
    assert both_served["t1"] > 0 and both_served["t2"] > 0, report  # both replicas served before the swap
    assert seen_at is not None, report
    assert changed == [], report
    assert other_calls == 0, report
    assert ready.status_code == 200, report
