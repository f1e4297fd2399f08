"""GET /v1/server: a live snapshot of the whole deployment for operators and the dashboard.

Every rate and mean is windowed: the orchestrator's own Prometheus counters
(orchestrator.generation_metrics) are sampled every second and on every call, each model
service's scheduler counters (Info) whenever the route is asked (at most once a second), and a
rate is the difference between the newest sample and the oldest one in the last ``WINDOW_S``
seconds, over the time between them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import APIRouter, FastAPI, Request

from orchestrator.generation_metrics import (
    ACCEPTED_PER_POSITION,
    ACCEPTED_TOKENS,
    DRAFT_TOKENS,
    DRAFTS,
    GENERATED_TOKENS,
    K_CHOSEN,
    STEPS,
    TOKENS_PER_SECOND,
)

logger = logging.getLogger(__name__)

WINDOW_S = 10.0  # span of the windowed rates
SAMPLE_EVERY_S = 1.0  # the orchestrator's counters are sampled this often in the background
INFO_MAX_AGE_S = 1.0  # a model service's Info is asked at most this often; callers in between share it
INFO_TIMEOUT_S = 1.0  # a service slower than this to describe itself is shown as down
MODES = ("speculative", "autoregressive")
SCHEDULER_COUNTERS = ("forwards", "sessions", "rows", "busy_ns", "calls", "queue_wait_ns", "cpu_ns")


# ---- windowed rates ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """Counter differences over ``seconds`` (0 when there is a single sample: no rate yet)."""

    seconds: float
    deltas: dict[str, float] = field(default_factory=dict)

    def delta(self, key: str) -> float:
        return self.deltas.get(key, 0.0)

    def rate(self, key: str) -> float | None:
        """Increase of ``key`` per second; None without a span."""
        return self.delta(key) / self.seconds if self.seconds > 0 else None

    def ratio(self, num: str, den: str) -> float | None:
        """Increase of ``num`` per unit increase of ``den``; None when ``den`` did not move."""
        d = self.delta(den)
        return self.delta(num) / d if d > 0 else None


class RollingRates:
    """Samples ``(t, {name: counter value})`` of monotonic counters; :meth:`window` gives their
    differences over the last ``window_s`` seconds.

    The base of the window is the oldest sample at most ``window_s`` before the newest; when there
    is none but the newest, the sample just before it, however old (sparse polling still gets a
    rate, over the span it really covers). A counter absent from the base counts from 0 (a
    labelled child created since). Any counter going down means its source restarted: the
    history is dropped and the window starts again from that sample. A sample less than
    ``min_interval_s`` after the one before the newest replaces the newest, so the newest reading
    is always current while frequent callers cannot grow the history.
    """

    def __init__(self, window_s: float = WINDOW_S, min_interval_s: float = 0.25) -> None:
        self.window_s = window_s
        self.min_interval_s = min_interval_s
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def add(self, t: float, values: Mapping[str, float]) -> None:
        values = dict(values)
        if self._samples:
            last_t, last = self._samples[-1]
            if t <= last_t:  # out of order or duplicate: the newer reading already covers it
                return
            if any(values.get(k, 0.0) < v for k, v in last.items()):
                self._samples.clear()
            elif len(self._samples) >= 2 and t - self._samples[-2][0] < self.min_interval_s:
                self._samples.pop()
        self._samples.append((t, values))
        cutoff = t - self.window_s
        # keep one sample older than the window: the fallback base when nothing else is in it
        while len(self._samples) > 2 and self._samples[1][0] < cutoff:
            self._samples.popleft()

    def latest(self) -> dict[str, float]:
        """The newest sample's values (empty before the first)."""
        return dict(self._samples[-1][1]) if self._samples else {}

    def window(self) -> Window:
        if not self._samples:
            return Window(0.0)
        t, last = self._samples[-1]
        inside = [s for s in self._samples if s[0] >= t - self.window_s]
        base_t, base = inside[0] if len(inside) >= 2 else self._samples[max(len(self._samples) - 2, 0)]
        return Window(t - base_t, {k: v - base.get(k, 0.0) for k, v in last.items()})


# ---- the orchestrator's counters -----------------------------------------------------------------

def _samples(metric: Any, suffix: str) -> Iterator[tuple[dict[str, str], float]]:
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                yield sample.labels, sample.value


def orchestrator_counters() -> dict[str, float]:
    """The loop's counters as flat names: tokens (and tokens.<mode>), steps, requests (finished
    generations), drafts, draft_tokens, accepted_tokens, accepted.<position>, k_sum, k_count."""
    values: dict[str, float] = {"tokens": 0.0, "steps": 0.0, "requests": 0.0}
    for labels, v in _samples(GENERATED_TOKENS, "_total"):
        values["tokens"] += v
        values[f"tokens.{labels.get('mode', '')}"] = v
    values["steps"] = sum(v for _, v in _samples(STEPS, "_total"))
    values["requests"] = sum(v for _, v in _samples(TOKENS_PER_SECOND, "_count"))
    values["drafts"] = sum(v for _, v in _samples(DRAFTS, "_total"))
    values["draft_tokens"] = sum(v for _, v in _samples(DRAFT_TOKENS, "_total"))
    values["accepted_tokens"] = sum(v for _, v in _samples(ACCEPTED_TOKENS, "_total"))
    for labels, v in _samples(ACCEPTED_PER_POSITION, "_total"):
        values[f"accepted.{labels.get('position', '')}"] = v
    values["k_sum"] = sum(v for _, v in _samples(K_CHOSEN, "_sum"))
    values["k_count"] = sum(v for _, v in _samples(K_CHOSEN, "_count"))
    return values


def _positions(values: Mapping[str, float]) -> int:
    found = [int(k.split(".", 1)[1]) for k in values if k.startswith("accepted.") and k.split(".", 1)[1].isdigit()]
    return max(found) + 1 if found else 0


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def orchestrator_view(total: Mapping[str, float], w: Window) -> dict[str, Any]:
    """The orchestrator's part of the snapshot from cumulative counters and their window."""
    n = _positions(total)
    drafts = total.get("drafts", 0.0)
    return {
        "window_s": round(w.seconds, 3),
        "tokens_per_second": _round(w.rate("tokens"), 3),
        "tokens_per_second_by_mode": {m: _round(w.rate(f"tokens.{m}"), 3) for m in MODES},
        "requests_per_second": _round(w.rate("requests"), 3),
        "steps_per_second": _round(w.rate("steps"), 3),
        "acceptance_rate": _round(w.ratio("accepted_tokens", "draft_tokens")),
        "mean_accepted_per_draft": _round(w.ratio("accepted_tokens", "drafts")),
        "mean_k": _round(w.ratio("k_sum", "k_count"), 3),
        "acceptance_by_position": {
            "window": [_round(w.ratio(f"accepted.{i}", "drafts")) for i in range(n)],
            "cumulative": [_round(total.get(f"accepted.{i}", 0.0) / drafts if drafts else None) for i in range(n)],
        },
        "totals": {
            "tokens": int(total.get("tokens", 0)), "requests": int(total.get("requests", 0)),
            "steps": int(total.get("steps", 0)), "drafts": int(drafts),
            "draft_tokens": int(total.get("draft_tokens", 0)), "accepted_tokens": int(total.get("accepted_tokens", 0)),
            "acceptance_rate": _round(total.get("accepted_tokens", 0.0) / total["draft_tokens"])
            if total.get("draft_tokens") else None,
            "mean_k": _round(total.get("k_sum", 0.0) / total["k_count"], 3) if total.get("k_count") else None,
        },
    }


# ---- the model services --------------------------------------------------------------------------

def scheduler_counters(info: Any) -> dict[str, float]:
    s = info.scheduler
    return {name: float(getattr(s, name)) for name in SCHEDULER_COUNTERS}


def service_view(info: Any, w: Window) -> dict[str, Any]:
    """One model service's part of the snapshot from its InfoResponse and its scheduler window."""
    s = info.scheduler
    busy = w.delta("busy_ns") / (w.seconds * 1e9) if w.seconds > 0 else None
    wait = w.ratio("queue_wait_ns", "calls")
    cpu = w.delta("cpu_ns") / (w.seconds * 1e9) if w.seconds > 0 else None
    return {
        "up": True,
        "model_id": info.model_id, "backend": info.backend, "device": info.device,
        "host_id": info.host_id, "cpu_cores": _round(info.cpu_cores, 2),
        "sessions": info.sessions, "kv_bytes": info.kv_bytes, "kv_budget_bytes": info.kv_budget_bytes,
        "kv_share": _round(info.kv_bytes / info.kv_budget_bytes) if info.kv_budget_bytes else None,
        "scheduler": {
            "reported": info.HasField("scheduler"),
            "window_s": round(w.seconds, 3),
            "forwards_per_second": _round(w.rate("forwards"), 3),
            "calls_per_second": _round(w.rate("calls"), 3),
            "rows_per_second": _round(w.rate("rows"), 3),
            "mean_sessions_per_forward": _round(w.ratio("sessions", "forwards"), 3),
            "mean_rows_per_forward": _round(w.ratio("rows", "forwards"), 3),
            "busy_share": _round(busy),
            # CPU seconds per second in forward passes (all threads): 2.0 = two cores busy
            "cpu_cores_used": _round(cpu, 3),
            "mean_queue_wait_ms": _round(wait / 1e6 if wait is not None else None, 3),
            "queued": s.queued, "max_queued": s.max_queued,
            "totals": {name: getattr(s, name) for name in SCHEDULER_COUNTERS},
        },
    }


class ServiceProbe:
    """A model service's last Info, asked at most once per ``INFO_MAX_AGE_S``, and its scheduler window."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rates = RollingRates()
        self.view: dict[str, Any] = {}
        self.polled_at = float("-inf")
        self._lock = asyncio.Lock()

    async def read(self, client: Any, address: str) -> dict[str, Any]:
        async with self._lock:  # concurrent callers share one Info call
            if time.monotonic() - self.polled_at >= INFO_MAX_AGE_S:
                self.view = await self._poll(client)
                self.polled_at = time.monotonic()
            return {**self.view, "address": address, "age_s": round(time.monotonic() - self.polled_at, 3)}

    async def _poll(self, client: Any) -> dict[str, Any]:
        try:
            info = await client.info(timeout_s=INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return {"up": False, "reason": f"{exc.code().name}: {exc.details()}"}
        except Exception as exc:  # whatever fails here, the snapshot must still answer
            logger.warning("Info of the %s service failed: %s", self.name, exc, exc_info=True)
            return {"up": False, "reason": f"{type(exc).__name__}: {exc}"}
        self.rates.add(time.monotonic(), scheduler_counters(info))
        return service_view(info, self.rates.window())


class ServerStats:
    """Process-wide state behind /v1/server (one per app)."""

    def __init__(self) -> None:
        self.local = RollingRates()
        self.services = {"draft": ServiceProbe("draft"), "target": ServiceProbe("target")}

    def sample(self) -> None:
        self.local.add(time.monotonic(), orchestrator_counters())

    async def sample_forever(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_EVERY_S)


def server_stats(app: FastAPI) -> ServerStats:
    stats = getattr(app.state, "server_stats", None)
    if stats is None:
        stats = app.state.server_stats = ServerStats()
    return stats


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    task = asyncio.create_task(server_stats(app).sample_forever())
    try:
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


router = APIRouter(lifespan=_lifespan)


@router.get("/v1/server", tags=["ops"])
async def server(request: Request) -> dict[str, Any]:
    """A live snapshot of the deployment. Windowed figures cover the last ~10 s (`window_s`) and are
    `null` while there is nothing to divide by; cumulative ones count since the orchestrator started.

    - `ready`, `reason`: as `/ready`. `active_streams`: generations in progress; `max_concurrent_requests`;
      `queued_requests`: requests in the admission queue, waiting for a slot.
    - `tokens_per_second` (and `tokens_per_second_by_mode`), `requests_per_second` (finished
      generations), `steps_per_second` (target passes): rates over the window.
    - `acceptance_rate`: accepted / drafted tokens; `mean_accepted_per_draft`; `mean_k`: mean draft
      length chosen per step (0 for plain steps). All over the window.
    - `acceptance_by_position`: `window` and `cumulative` lists, entry i = share of drafts whose
      token at position i was accepted (i = 0 up to the furthest position ever accepted).
    - `totals`: tokens, requests, steps, drafts, draft_tokens, accepted_tokens, acceptance_rate, mean_k.
    - `services.draft`, `services.target`: `{"up": false, "reason", "address", "age_s"}` when the
      service does not answer Info within 1 s; else `up`, `model_id`, `backend`, `device`,
      `sessions`, `kv_bytes`, `kv_budget_bytes`, `kv_share`, `address`, `age_s` (Info is read at
      most once a second) and `scheduler`: `reported` (false: the service fills no scheduler
      counters), `window_s`, `forwards_per_second`, `calls_per_second`, `rows_per_second`,
      `mean_sessions_per_forward` and `mean_rows_per_forward` (batch size), `busy_share` (time in
      forward passes / wall time), `mean_queue_wait_ms` (arrival to first forward, per call),
      `queued`, `max_queued` (now) and `totals` (the raw counters).
    """
    rt = request.app.state.rt
    stats = server_stats(request.app)
    stats.sample()  # the background sample may be up to a second old
    draft, target = await asyncio.gather(
        stats.services["draft"].read(rt.draft, rt.settings.draft_address),
        stats.services["target"].read(rt.target, rt.settings.target_address),
    )
    return {
        "timestamp": round(time.time(), 3),
        "ready": not rt.not_ready,
        "reason": rt.not_ready,
        "degraded": rt.degraded,
        "active_streams": rt.active,
        "max_concurrent_requests": rt.settings.max_concurrent_requests,
        "queued_requests": len(rt.waiters),
        **orchestrator_view(stats.local.latest(), stats.local.window()),
        "services": {"draft": draft, "target": target},
    }
