"""Pure functions from the orchestrator's ``/v1/server`` snapshots to what the Server tab shows:
the tokens/s history, acceptance by draft position, and each model service's batching figures.

Windowed figures are ``null`` in the snapshot while there is nothing to divide by; they show as
"n/a" here, never as 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ui.render import human_bytes

HISTORY_S = 300.0  # how far back the tokens/s chart reaches
NA = "n/a"

NO_SERVER_ROUTE = (
    "This orchestrator has no Server view (GET /v1/server answers 404): it is older than this dashboard. "
    "Generation still works; upgrade the orchestrator to watch the deployment live."
)


def fmt(x: Any, spec: str = ".1f", suffix: str = "") -> str:
    """``x`` formatted, or "n/a" when the orchestrator sent null (or nothing)."""
    return NA if x is None else f"{format(float(x), spec)}{suffix}"


def share(x: Any) -> float:
    """A fraction for a progress bar: null counts as 0, and it never leaves [0, 1]."""
    return min(max(float(x or 0.0), 0.0), 1.0)


def append_history(history: list[dict[str, Any]], now: float, snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """``history`` plus this snapshot's point, without points older than ``HISTORY_S`` before ``now``.

    A point: t (unix seconds, the dashboard's clock), tokens_per_s (0 while the window is empty)
    and active_streams.
    """
    point = {"t": now, "tokens_per_s": float(snapshot.get("tokens_per_second") or 0.0),
             "active_streams": int(snapshot.get("active_streams") or 0)}
    return [p for p in history if p["t"] >= now - HISTORY_S] + [point]


def position_rows(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Acceptance by draft position for the bar chart: position (1 = the first drafted token),
    share over the window (None when no draft was verified in it) and since the orchestrator started."""
    by_position = snapshot.get("acceptance_by_position") or {}
    window, cumulative = by_position.get("window") or [], by_position.get("cumulative") or []
    return [{"position": str(i + 1),
             "recent": window[i] if i < len(window) else None,
             "since start": cumulative[i] if i < len(cumulative) else None}
            for i in range(max(len(window), len(cumulative)))]


@dataclass(frozen=True)
class ServiceFigures:
    """One model service as the Server tab shows it (strings are ready to display)."""

    name: str
    up: bool
    headline: str  # model · backend · device, or why it is down
    batch_sessions: str = NA  # mean sessions per forward pass
    batch_rows: str = NA  # mean token rows per forward pass
    forwards_per_second: str = NA
    queue: str = NA  # calls waiting now / most that may wait
    queue_wait: str = NA  # mean wait from arrival to the first forward
    sessions: str = NA  # sessions held in the KV cache
    busy: float = 0.0  # share of wall time in forward passes, for a progress bar
    busy_text: str = NA
    kv: float = 0.0  # KV bytes held over the budget, for a progress bar
    kv_text: str = NA
    reported: bool = False  # the service fills the scheduler counters


def service_figures(name: str, view: dict[str, Any]) -> ServiceFigures:
    if not view.get("up", False):
        reason = view.get("reason") or "no answer"
        where = f" at {view['address']}" if view.get("address") else ""
        return ServiceFigures(name, False, f"down{where}: {reason}")
    model = str(view.get("model_id", "?")).rstrip("/").rsplit("/", 1)[-1]
    headline = " · ".join(str(p) for p in (model, view.get("backend", ""), view.get("device", "")) if p)
    s = view.get("scheduler") or {}
    busy = s.get("busy_share")
    kv_bytes, budget = int(view.get("kv_bytes") or 0), int(view.get("kv_budget_bytes") or 0)
    kv_share = view.get("kv_share")
    kv_text = f"KV cache {human_bytes(kv_bytes)}" + (
        f" of {human_bytes(budget)} ({fmt(kv_share, '.0%')})" if budget else " (no budget reported)")
    max_queued = s.get("max_queued") or 0
    return ServiceFigures(
        name, True, headline,
        batch_sessions=fmt(s.get("mean_sessions_per_forward"), ".2f"),
        batch_rows=fmt(s.get("mean_rows_per_forward"), ".1f"),
        forwards_per_second=fmt(s.get("forwards_per_second"), ".1f"),
        queue=f"{int(s.get('queued') or 0)} / {max_queued}" if max_queued else str(int(s.get("queued") or 0)),
        queue_wait=fmt(s.get("mean_queue_wait_ms"), ".1f", " ms"),
        sessions=str(int(view.get("sessions") or 0)),
        busy=share(busy), busy_text=f"Busy {fmt(busy, '.0%')} of the time (forward passes / wall time)" + (
            f", using {fmt(s.get('cpu_cores_used'), '.1f')} of {fmt(view.get('cpu_cores'), '.0f')} cores"
            if s.get("cpu_cores_used") is not None and view.get("cpu_cores") else ""),
        kv=share(kv_share), kv_text=kv_text,
        reported=bool(s.get("reported", False)),
    )
