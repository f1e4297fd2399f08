"""Soak: N clients x T seconds of mixed traffic against a fresh embedded stack.

Traffic: REST generations (prompt and chat), SSE streams read to the end and streams the client
cuts after a few events, OpenAI chat and completions (plain and streamed), seeded sampling
requests (repeats must reproduce), and bad input (must get its 4xx). Afterwards every session and
every KV byte must be released on both services, and no process may have grown by 10 % or more
in resident memory since the warm-up. ``SPECDEC_SOAK_CLIENTS`` (16) and ``SPECDEC_SOAK_SECONDS``
(120) size the run; the figures land in artifacts/reliability/soak.json.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from evaluation.stats import percentile
from tests.reliability.helpers import env_float, env_int, rss_kib, summarize, wait_released, write_report
from tests.support import PROMPTS, iter_sse, running_stack

logger = logging.getLogger(__name__)

pytestmark = [pytest.mark.reliability, pytest.mark.embedded]

CLIENTS = env_int("SPECDEC_SOAK_CLIENTS", 16)
SECONDS = env_float("SPECDEC_SOAK_SECONDS", 120)
WARMUP_SECONDS = env_float("SPECDEC_SOAK_WARMUP_SECONDS", 20)
SEED = 7
MAX_RSS_GROWTH = 0.10
REQUEST_TIMEOUT_S = 120

# (body, expected status) for /v1/generate; each names its field in the 4xx detail
BAD = [
    ({"prompt": ""}, 422),
    ({"prompt": "x", "max_tokens": 0}, 422),
    ({"prompt": "x", "temperature": -1}, 422),
    ({"prompt": "x", "controller": "magic"}, 422),
    ({"prompt": "x", "k": 9, "max_k": 4}, 422),
    ({"prompt": "x", "unknown": 1}, 422),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 422),
    ({"prompt": "word " * 9000}, 400),
]
SAMPLING_SEEDS = (11, 22, 33)

# kind -> weight
MIX = {"generate": 4, "chat-on-generate": 1, "stream-full": 2, "stream-cut": 3, "openai-chat": 2, "openai-chat-stream": 1,
       "openai-completion": 1, "sampling": 2, "bad-input": 2}


@dataclass
class Tally:
    requests: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)  # "kind: what"
    examples: dict[str, str] = field(default_factory=dict)
    latency: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    sampled: dict[tuple, list[dict]] = field(default_factory=dict)  # (prompt, seed) -> steps of the first run
    sampled_repeats: int = 0
    seeded_divergences: list = field(default_factory=list)  # reported, not failed (see where it is filled)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ok(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.requests[kind] += 1
            self.latency[kind].append(seconds)

    def error(self, kind: str, what: str, example: str) -> None:
        with self.lock:
            self.requests[kind] += 1
            self.errors[f"{kind}: {what}"] += 1
            self.examples.setdefault(f"{kind}: {what}", example[:400])


def first_divergence(a: list[dict], b: list[dict]) -> str | None:
    """Where two runs of one seeded request differ although they asked the draft for the same k.

    Output equality only holds for equal k schedules (the schedule decides which random draws are
    used), and a schedule may legitimately change with timing (a draft past its deadline). So the
    runs are walked step by step while their k and draft length agree; a step that then yields
    other tokens is a real difference. None when they agree, or when the schedules part first.
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if (x["k"], len(x["draft"])) != (y["k"], len(y["draft"])):
            return None  # the schedules parted: nothing more to compare
        tokens_x = x["draft"][: x["accepted"]] + [x["correction"] if x["correction"] is not None else x["bonus"]]
        tokens_y = y["draft"][: y["accepted"]] + [y["correction"] if y["correction"] is not None else y["bonus"]]
        if x["draft"] != y["draft"] or tokens_x != tokens_y:
            return (f"step {i} (k {x['k']}): draft {x['draft']} -> {tokens_x}, then draft {y['draft']} -> {tokens_y}")
    return None


def one_request(client: httpx.Client, kind: str, rng: random.Random, tally: Tally) -> None:
    """Send one request of ``kind`` and record whether it got what that kind must get."""
    prompt = rng.choice(PROMPTS)
    t0 = time.monotonic()

    def expect(r: httpx.Response, status: int = 200) -> bool:
        if r.status_code != status:
            tally.error(kind, f"HTTP {r.status_code}", r.text)
            return False
        return True

    try:
        if kind == "generate":
            r = client.post("/v1/generate", json={"prompt": prompt, "max_tokens": rng.randint(4, 24),
                                                  "ignore_eos": rng.random() < 0.5})
            if not expect(r):
                return
        elif kind == "chat-on-generate":
            r = client.post("/v1/generate", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 12})
            if not expect(r):
                return
        elif kind in ("stream-full", "stream-cut"):
            cut = rng.randint(1, 4) if kind == "stream-cut" else None
            body = {"prompt": prompt, "max_tokens": 64 if cut else rng.randint(8, 24), "ignore_eos": True}
            with client.stream("POST", "/v1/generate/stream", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    tally.error(kind, f"HTTP {r.status_code}", r.text)
                    return
                events = []
                for event in iter_sse(r):
                    events.append(event)
                    if cut is not None and len(events) >= cut:
                        break  # the client goes away mid-generation
            names = [e for e, _ in events]
            if "error" in names:
                tally.error(kind, "error event", json.dumps(events[names.index("error")][1]))
                return
            if cut is None and names[-1:] != ["done"]:
                tally.error(kind, "stream ended without done", json.dumps(names[-3:]))
                return
        elif kind == "openai-chat":
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                          "max_tokens": 16, "temperature": 0})
            if not expect(r):
                return
            if r.json()["choices"][0]["message"]["role"] != "assistant":
                tally.error(kind, "malformed", r.text)
                return
        elif kind == "openai-chat-stream":
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0, "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    tally.error(kind, f"HTTP {r.status_code}", r.text)
                    return
                data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
            if data[-1:] != ["[DONE]"] or any('"error"' in d for d in data):
                tally.error(kind, "bad stream", json.dumps(data[-3:]))
                return
        elif kind == "openai-completion":
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
            if not expect(r):
                return
        elif kind == "sampling":
            seed = rng.choice(SAMPLING_SEEDS)
            index = PROMPTS.index(prompt) % 3
            r = client.post("/v1/generate", json={"prompt": PROMPTS[index], "max_tokens": 16, "temperature": 0.8,
                                                  "top_p": 0.95, "seed": seed})
            if not expect(r):
                return
            steps = r.json()["steps"]
            with tally.lock:
                first = tally.sampled.setdefault((index, seed), steps)
            if first is not steps:
                tally.sampled_repeats += 1
                diverged = first_divergence(first, steps)
                if diverged is not None:
                    # Known limitation (docs/batching.md): llama.cpp's kernels depend on what else the
                    # shared KV pool holds, so under load a seeded request's draft — and with it the
                    # sampled output — can change. The output stays distributed exactly as the
                    # target's (lossless verification); it is counted and reported, not failed.
                    tally.seeded_divergences.append(f"prompt {index}, seed {seed}: {diverged}")
                    return
        elif kind == "bad-input":
            body, status = rng.choice(BAD)
            r = client.post("/v1/generate", json=body)
            if not expect(r, status):
                return
            if not r.json().get("detail"):
                tally.error(kind, "no detail", r.text)
                return
        else:  # pragma: no cover - MIX and this function list the same kinds
            raise AssertionError(kind)
    except httpx.HTTPError as exc:
        tally.error(kind, type(exc).__name__, str(exc))
        return
    tally.ok(kind, time.monotonic() - t0)


def traffic(url: str, clients: int, seconds: float, tally: Tally, seed: int) -> None:
    """``clients`` threads sending mixed requests back to back for ``seconds``."""
    end = time.monotonic() + seconds
    kinds, weights = list(MIX), list(MIX.values())

    def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
            while time.monotonic() < end:
                one_request(client, rng.choices(kinds, weights)[0], rng, tally)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + REQUEST_TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads), "a soak client hung"


@pytest.fixture(scope="module")
def soak_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("soak-stack")) as stack:
        yield stack


def test_soak_mixed_traffic(soak_stack):
    url, ports = soak_stack["url"], soak_stack["ports"]
    procs = {name: soak_stack[name] for name in ("draft", "target", "orchestrator")}

    # Warm-up: the same traffic, so allocator pools, caches and lazy imports are in place before
    # the baseline is read.
    warm = Tally()
    traffic(url, CLIENTS, WARMUP_SECONDS, warm, SEED + 1)
    wait_released(ports)
    rss_before = {name: rss_kib(p.popen.pid) for name, p in procs.items()}

    tally = Tally()
    t0 = time.monotonic()
    traffic(url, CLIENTS, SECONDS, tally, SEED)
    seconds = time.monotonic() - t0
    released = wait_released(ports, timeout_s=20)
    rss_after = {name: rss_kib(p.popen.pid) for name, p in procs.items()}
    growth = {name: (rss_after[name] - rss_before[name]) / rss_before[name] for name in procs}
    alive = {name: p.alive() for name, p in procs.items()}
    total = sum(tally.requests.values())

    report = {
        "clients": CLIENTS, "seconds": round(seconds, 1), "warmup_seconds": WARMUP_SECONDS, "seed": SEED,
        "requests": total, "requests_per_second": round(total / seconds, 2),
        "requests_by_kind": dict(sorted(tally.requests.items())),
        "errors_by_kind": dict(sorted(tally.errors.items())), "error_examples": tally.examples,
        "latency_s": {k: {"p50": round(percentile(v, 50), 2), "p95": round(percentile(v, 95), 2), "max": round(max(v), 2)}
                      for k, v in sorted(tally.latency.items())},
        "seeded_sampling_repeats_compared": tally.sampled_repeats,
        "seeded_sampling_divergences": tally.seeded_divergences,
        "held_after": released, "rss_kib_before": rss_before, "rss_kib_after": rss_after,
        "rss_growth_percent": {k: round(100 * v, 2) for k, v in growth.items()}, "alive": alive,
        "warmup_requests": sum(warm.requests.values()), "warmup_errors": dict(warm.errors),
    }
    write_report("soak", report)
    summarize(f"soak ({CLIENTS} clients x {seconds:.0f} s)", [
        f"requests {total} ({total / seconds:.1f}/s): {dict(sorted(tally.requests.items()))}",
        f"errors {sum(tally.errors.values())}: {dict(sorted(tally.errors.items())) or 'none'}",
        f"seeded sampling repeats compared {tally.sampled_repeats}, changed under load {len(tally.seeded_divergences)}",
        f"held after release: {released}",
        "RSS KiB before -> after: " + ", ".join(
            f"{k} {rss_before[k]} -> {rss_after[k]} ({100 * growth[k]:+.1f} %)" for k in procs),
    ])

    # every check is made, so that one failing run reports all it found
    problems = []
    if not all(alive.values()):
        problems.append(f"processes died: { {k: procs[k].tail() for k, v in alive.items() if not v} }")
    if tally.errors or warm.errors:
        problems.append("unexpected responses: " + json.dumps({"errors": dict(tally.errors), "warm-up": dict(warm.errors),
                                                              "examples": tally.examples}, indent=1))
    missing = [k for k in MIX if tally.requests[k] == 0]
    if missing:
        problems.append(f"kinds never sent: {missing}")
    if released != {k: {"sessions": 0, "kv_bytes": 0} for k in ports}:
        failed = [line for line in procs["orchestrator"].log.read_text(errors="replace").splitlines() if "release of" in line]
        problems.append(f"sessions leaked: {released}; failed releases in the orchestrator log: {failed[-5:]}")
    if not all(g < MAX_RSS_GROWTH for g in growth.values()):
        problems.append(f"RSS growth over {100 * MAX_RSS_GROWTH:.0f} %: {report['rss_growth_percent']}")
    assert not problems, "\n".join(problems)
