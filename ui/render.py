"""Pure functions from step events to what the page shows: token HTML with provenance, chart
series, summary numbers, the speculative-versus-plain comparison and the service panel.

Vocabulary (as in the orchestrator): a step drafts ``draft`` tokens; the target accepts the first
``accepted`` of them and adds its own ``next_token``: a *correction* replacing the first rejected
draft token, a *bonus* token when the whole draft was accepted, or a *plain* token when the step
had no draft (autoregressive decoding, or the draft was unavailable).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["accepted", "rejected", "correction", "bonus", "plain"]

KINDS: tuple[Kind, ...] = ("accepted", "rejected", "correction", "bonus", "plain")

LABELS: dict[Kind, str] = {
    "accepted": "accepted draft token",
    "rejected": "rejected draft token",
    "correction": "target correction",
    "bonus": "bonus token",
    "plain": "plain target token",
}

EXPLANATIONS: dict[Kind, str] = {
    "accepted": "the draft proposed it and the target agreed",
    "rejected": "the draft proposed it, the target disagreed; not part of the output",
    "correction": "the target's own token in place of the first rejected draft token",
    "bonus": "the target's extra token after it accepted the whole draft",
    "plain": "decoded by the target alone, without a draft",
}

# Each kind has its own background and text colour, so the stream reads in light and dark themes.
CSS = """<style>
.tok-stream { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 0.95rem;
  line-height: 1.9; white-space: pre-wrap; word-break: break-word; padding: 0.6rem 0.8rem;
  border: 1px solid rgba(128, 128, 128, 0.35); border-radius: 0.5rem; min-height: 3rem; }
.tok { border-radius: 0.25rem; padding: 0.05rem 0.05rem; margin: 0 0.5px; cursor: help; }
.tok-accepted { background: #c3f0ca; color: #0b5d1e; }
.tok-rejected { background: #ffd8d8; color: #b42318; text-decoration: line-through;
  text-decoration-thickness: 2px; opacity: 0.85; }
.tok-correction { background: #ffe0a3; color: #7a3e00; box-shadow: inset 0 -2px 0 #e8590c; }
.tok-bonus { background: #cfe2ff; color: #123f8c; box-shadow: inset 0 -2px 0 #3b5bdb; }
.tok-plain { background: #e9ecef; color: #212529; }
.tok-empty { font-style: italic; }
.tok-legend { display: flex; flex-wrap: wrap; gap: 0.4rem 1.2rem; font-size: 0.9rem; align-items: baseline; }
.tok-legend .tok { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; padding: 0.1rem 0.35rem; }
</style>"""


@dataclass(frozen=True)
class Token:
    """One rendered token: its text, provenance and hover text."""

    text: str
    kind: Kind
    title: str


def _pct(p: float | None) -> str:
    return "n/a" if p is None else f"{100 * p:.1f} %"


def _at(values: list[float], i: int) -> float | None:
    return values[i] if 0 <= i < len(values) else None


def _title(kind: Kind, draft_conf: float | None, target_prob: float | None, extra: str = "") -> str:
    lines = [LABELS[kind]]
    if kind in ("accepted", "rejected"):
        lines.append(f"draft confidence {_pct(draft_conf)}")
    else:
        lines.append("draft confidence n/a (not drafted)")
    lines.append(f"target probability {_pct(target_prob)}")
    if extra:
        lines.append(extra)
    return "\n".join(lines)


def step_tokens(step: dict[str, Any]) -> list[Token]:
    """The tokens of one step in reading order: accepted draft tokens, the rejected ones (struck
    through where they were rejected), then the target's own token.

    The orchestrator may cut a step short (EOS, max_tokens): ``step["tokens"]`` lists what was
    kept, so tokens past it are not shown.
    """
    draft: list[int] = step.get("draft") or []
    texts: list[str] = step.get("token_texts") or []
    confs: list[float] = step.get("draft_confidences") or []
    probs: list[float] = step.get("target_probs") or []
    accepted = int(step.get("accepted", 0))
    kept = len(step.get("tokens", draft[:accepted] + [step.get("next_token")]))
    where = f"iteration {int(step.get('index', 0)) + 1}, k = {step.get('k', 0)}"
    out = []
    for i in range(min(accepted, kept)):
        text = texts[i] if i < len(texts) else f"#{draft[i]}"
        out.append(Token(text, "accepted", _title("accepted", _at(confs, i), _at(probs, i), where)))
    if kept <= accepted:
        return out
    kind: Kind = step.get("next_kind", "plain")
    if kind not in ("correction", "bonus", "plain"):
        kind = "plain"
    if kind == "correction":
        for i in range(accepted, len(draft)):
            text = texts[i] if i < len(texts) else f"#{draft[i]}"
            out.append(Token(text, "rejected", _title("rejected", _at(confs, i), _at(probs, i), where)))
    next_text = step.get("next_token_text")
    if next_text is None:
        next_text = f"#{step.get('next_token')}"
    out.append(Token(next_text, kind, _title(kind, None, step.get("next_token_prob"), where)))
    return out


def token_span(token: Token) -> str:
    """A token as an HTML span; its text and title escaped."""
    classes = f"tok tok-{token.kind}"
    text = token.text
    if text == "":
        classes += " tok-empty"
        text = "\u2205"  # an empty decoding (e.g. part of a multi-byte character) stays visible
    return f'<span class="{classes}" title="{html.escape(token.title, quote=True)}">{html.escape(text)}</span>'


def tokens_html(steps: list[dict[str, Any]]) -> str:
    """The whole answer so far as one block of spans."""
    spans = "".join(token_span(t) for step in steps for t in step_tokens(step))
    return f'<div class="tok-stream">{spans}</div>'


def legend_html() -> str:
    items = []
    samples = {"accepted": "the", "rejected": "cat", "correction": "dog", "bonus": "ran", "plain": "off"}
    for kind in KINDS:
        sample = token_span(Token(samples[kind], kind, EXPLANATIONS[kind]))
        items.append(f'<span title="{html.escape(EXPLANATIONS[kind])}">{sample} {LABELS[kind]}</span>')
    return f'<div class="tok-legend">{"".join(items)}</div>'


# ---- numbers -------------------------------------------------------------------------------------

def step_ms(step: dict[str, Any]) -> float:
    """Wall time of one step in ms, as the orchestrator measured it (draft + verify + overhead)."""
    return float(step.get("draft_ms", 0.0)) + float(step.get("verify_ms", 0.0)) + float(step.get("overhead_ms", 0.0))


def iteration_rows(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per iteration for the charts and the table.

    Columns: iteration (1-based), k (draft length asked for), drafted, accepted (draft tokens),
    tokens (appended), next (correction/bonus/plain), draft_ms, verify_ms, overhead_ms,
    elapsed_ms (cumulative), tokens_per_s (cumulative tokens / cumulative time).
    """
    rows, total_tokens, elapsed = [], 0, 0.0
    for i, step in enumerate(steps):
        total_tokens += len(step.get("tokens", []))
        elapsed += step_ms(step)
        rows.append({
            "iteration": i + 1,
            "k": int(step.get("k", 0)),
            "drafted": len(step.get("draft", [])),
            "accepted": int(step.get("accepted", 0)),
            "tokens": len(step.get("tokens", [])),
            "next": step.get("next_kind", ""),
            "draft_ms": round(float(step.get("draft_ms", 0.0)), 2),
            "verify_ms": round(float(step.get("verify_ms", 0.0)), 2),
            "overhead_ms": round(float(step.get("overhead_ms", 0.0)), 2),
            "elapsed_ms": round(elapsed, 2),
            "tokens_per_s": round(total_tokens / (elapsed / 1e3), 2) if elapsed > 0 else 0.0,
        })
    return rows


@dataclass
class Summary:
    """Figures of the summary row. Times in ms; rates as fractions."""

    tokens: int = 0
    iterations: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_per_iteration: float = 0.0
    tokens_per_second: float = 0.0
    elapsed_ms: float = 0.0
    first_token_ms: float = 0.0
    draft_ms: float = 0.0  # wall time of the draft calls, as the orchestrator saw them
    verify_ms: float = 0.0  # wall time of the target calls
    overhead_ms: float = 0.0  # loop time outside both calls
    draft_compute_ms: float = 0.0  # compute inside the draft service (the rest of draft_ms is the round trip)
    verify_compute_ms: float = 0.0  # compute inside the target service

    def share(self, part: str) -> float:
        """Fraction of the step time spent in ``part`` ("draft", "verify" or "overhead")."""
        total = self.draft_ms + self.verify_ms + self.overhead_ms
        return getattr(self, f"{part}_ms") / total if total > 0 else 0.0


def summary(steps: list[dict[str, Any]], stats: dict[str, Any] | None = None) -> Summary:
    """From the final ``stats`` of the done event when there is one, else (live) from the steps."""
    if stats:
        counts = {"tokens", "iterations", "draft_tokens", "accepted_tokens"}
        return Summary(**{f: (int if f in counts else float)(stats.get(f) or 0) for f in Summary.__dataclass_fields__})
    s = Summary(iterations=len(steps))
    for step in steps:
        s.tokens += len(step.get("tokens", []))
        s.draft_tokens += len(step.get("draft", []))
        s.accepted_tokens += int(step.get("accepted", 0))
        s.draft_ms += float(step.get("draft_ms", 0.0))
        s.verify_ms += float(step.get("verify_ms", 0.0))
        s.overhead_ms += float(step.get("overhead_ms", 0.0))
        s.draft_compute_ms += float(step.get("draft_compute_ms", 0.0))
        s.verify_compute_ms += float(step.get("verify_compute_ms", 0.0))
    s.elapsed_ms = s.draft_ms + s.verify_ms + s.overhead_ms
    s.first_token_ms = step_ms(steps[0]) if steps else 0.0
    s.acceptance_rate = s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0
    s.mean_accepted_per_iteration = s.accepted_tokens / s.iterations if s.iterations else 0.0
    s.tokens_per_second = s.tokens / (s.elapsed_ms / 1e3) if s.elapsed_ms > 0 else 0.0
    return s


@dataclass
class Generation:
    """One streamed generation as the page keeps it: its steps, the done event, or an error."""

    mode: str = "speculative"
    steps: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    error: str = ""
    error_level: Literal["error", "warning"] = "error"

    @property
    def token_ids(self) -> list[int]:
        if self.done is not None and "token_ids" in self.done:
            return list(self.done["token_ids"])
        return [t for step in self.steps for t in step.get("tokens", [])]

    @property
    def text(self) -> str:
        if self.done is not None and "text" in self.done:
            return self.done["text"]
        return "".join(step.get("text", "") for step in self.steps)

    def summary(self) -> Summary:
        return summary(self.steps, self.done.get("stats") if self.done else None)


@dataclass
class Comparison:
    """Speculative against plain decoding of the same prompt."""

    speedup: float  # speculative tokens/s over plain tokens/s (0 when either is unknown)
    identical: bool  # same token ids
    first_difference: int | None  # index of the first differing token, None when identical
    speculative_tokens: int
    plain_tokens: int


def compare(speculative: Generation, plain: Generation) -> Comparison:
    a, b = speculative.token_ids, plain.token_ids
    diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    tps_a, tps_b = speculative.summary().tokens_per_second, plain.summary().tokens_per_second
    return Comparison(
        speedup=tps_a / tps_b if tps_a > 0 and tps_b > 0 else 0.0,
        identical=diff is None, first_difference=diff, speculative_tokens=len(a), plain_tokens=len(b),
    )


# ---- requests and the service panel -------------------------------------------------------------

def build_request(text: str, chat: bool, options: dict[str, Any]) -> dict[str, Any]:
    """Body of POST /v1/generate/stream. Chat mode sends the text as one user message (the
    orchestrator applies the model's chat template); options with value None are left out so the
    server's defaults apply."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    body.update({k: v for k, v in options.items() if v is not None})
    return body


@dataclass(frozen=True)
class ServiceState:
    """One row of the service panel. ``ok`` is None when it cannot be known."""

    name: str
    ok: bool | None
    status: str
    detail: str = ""


def _describe_model(info: dict[str, Any]) -> str:
    if not info:
        return ""
    model = str(info.get("model_id", "?")).rstrip("/").rsplit("/", 1)[-1]
    parts = [model, info.get("backend", ""), info.get("dtype", ""), info.get("device", "")]
    if info.get("max_context"):
        parts.append(f"context {info['max_context']}")
    if "sessions" in info:
        parts.append(f"{info['sessions']} sessions, KV {human_bytes(int(info.get('kv_bytes', 0)))}")
    return " · ".join(str(p) for p in parts if p)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def service_states(alive: bool, error: str, ready: dict[str, Any], info: dict[str, Any]) -> list[ServiceState]:
    """Orchestrator, target and draft as the orchestrator sees them (the dashboard reaches the
    model services only through it)."""
    if not alive:
        unknown = "unknown (orchestrator unreachable)"
        return [ServiceState("orchestrator", False, "unreachable", error),
                ServiceState("target", None, unknown), ServiceState("draft", None, unknown)]
    # a degraded orchestrator is ready; its reason says which service is missing
    reason = str(ready.get("reason", "") or info.get("reason", "") or ready.get("degraded", "") or info.get("degraded", ""))
    is_ready = bool(ready.get("ready", info.get("ready", False)))
    target_info = ready.get("target") or info.get("target") or {}
    draft_info = ready.get("draft") or info.get("draft") or {}
    status = ("ready (degraded)" if reason else "ready") if is_ready else "not ready"
    orchestrator = ServiceState("orchestrator", is_ready, status, reason)
    if reason.startswith("target service") or not target_info:
        target = ServiceState("target", False, "down", reason or "no information from the target")
    else:
        target = ServiceState("target", True, "up", _describe_model(target_info))
    if reason.startswith("draft service") or not draft_info:
        draft = ServiceState("draft", False, "down", reason or "no information from the draft")
    elif info and not info.get("draft_available", True):
        draft = ServiceState("draft", False, "failing: decoding without drafts for now", _describe_model(draft_info))
    else:
        draft = ServiceState("draft", True, "up", _describe_model(draft_info))
    return [orchestrator, target, draft]
