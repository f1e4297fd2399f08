"""Pure statistics of benchmark runs: spreads, per-mode summaries, speedups and the ideal speedup;
and of load runs: inter-token gaps, latency quantiles, batch sizes, arrival times.

A *run* is one generation of one prompt in one mode (a dict, as stored in results.json):
``mode``, ``prompt_id``, ``category``, ``repeat``, ``tokens``, ``elapsed_ms`` (generation time the
speed is computed from), ``token_ids``, and for specdec modes ``stats`` (the orchestrator's
GenerationStats.to_dict()), ``wall_ms`` (HTTP round trip) and ``mean_k``. A load run's *records*
are the streamed requests of evaluation.load's client (``LoadClient.request``).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

# Per-iteration time components of a specdec run, in the order the stacked bars draw them.
SPLIT_PARTS = ("draft_compute", "draft_rpc", "verify_compute", "verify_rpc", "loop")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100) with linear interpolation between order statistics
    (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: Sequence[float]) -> dict[str, float]:
    """median, p10, p90, min, max and n of ``values``."""
    return {
        "median": percentile(values, 50), "p10": percentile(values, 10), "p90": percentile(values, 90),
        "min": min(values) if values else math.nan, "max": max(values) if values else math.nan, "n": len(values),
    }


def tokens_per_second(run: dict[str, Any]) -> float:
    return run["tokens"] / (run["elapsed_ms"] / 1e3) if run["elapsed_ms"] > 0 else 0.0


def ideal_speedup(tokens_per_iteration: float, ar_verify_ms_per_token: float,
                  draft_compute_ms_per_iteration: float, verify_compute_ms_per_iteration: float) -> float:
    """Speedup over autoregressive decoding the loop would reach with no protocol or orchestration
    overhead: each iteration costs only the draft's and the target's compute, and yields
    ``tokens_per_iteration`` tokens, where plain decoding pays ``ar_verify_ms_per_token`` each.

        ideal = tokens/iteration × AR verify ms/token / (draft compute + verify compute) ms/iteration
    """
    cost = draft_compute_ms_per_iteration + verify_compute_ms_per_iteration
    return tokens_per_iteration * ar_verify_ms_per_token / cost if cost > 0 else math.nan


def time_split(stats_list: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Summed specdec stats -> ms per iteration and per token of each SPLIT_PARTS component, plus
    tokens/iteration, acceptance and mean accepted per iteration (aggregated, not averaged)."""
    t = {"tokens": 0, "iterations": 0, "draft_tokens": 0, "accepted_tokens": 0, "draft_ms": 0.0, "verify_ms": 0.0,
         "draft_compute_ms": 0.0, "verify_compute_ms": 0.0, "overhead_ms": 0.0, "draft_fallbacks": 0}
    for s in stats_list:
        for key in t:
            t[key] += s.get(key, 0)
    it, tok = max(t["iterations"], 1), max(t["tokens"], 1)
    # draft_ms is the time steps waited for drafts. Alternating, that is the whole draft compute
    # plus its RPC; overlapped, a pre-draft computes while the target verifies, and only what
    # outlasted the verify was waited for: that share of the compute is on the critical path, the
    # rest is hidden.
    on_path = min(t["draft_compute_ms"], t["draft_ms"])
    parts = {
        "draft_compute": on_path,
        "draft_rpc": t["draft_ms"] - on_path,
        "verify_compute": t["verify_compute_ms"],
        "verify_rpc": t["verify_ms"] - t["verify_compute_ms"],
        "loop": t["overhead_ms"],
    }
    out: dict[str, float] = {f"{k}_ms_per_iteration": v / it for k, v in parts.items()}
    out.update({f"{k}_ms_per_token": v / tok for k, v in parts.items()})
    out.update({
        "draft_hidden_ms_per_iteration": (t["draft_compute_ms"] - on_path) / it,
        "iterations": t["iterations"], "tokens": t["tokens"],
        "tokens_per_iteration": t["tokens"] / it,
        "acceptance_rate": t["accepted_tokens"] / t["draft_tokens"] if t["draft_tokens"] else math.nan,
        "accepted_per_iteration": t["accepted_tokens"] / it,
        "draft_tokens_per_iteration": t["draft_tokens"] / it,
        "draft_fallbacks": t["draft_fallbacks"],
    })
    return out


def paired_speedup(runs: list[dict[str, Any]], mode: str, baseline: str) -> dict[str, float] | None:
    """Spread of tokens/s ratios of ``mode`` over ``baseline`` on the same prompt and repeat (the
    runs were interleaved, so each pair saw the same machine state); None without pairs."""
    base = {(r["prompt_id"], r["repeat"]): tokens_per_second(r) for r in runs if r["mode"] == baseline}
    ratios = [tokens_per_second(r) / base[(r["prompt_id"], r["repeat"])]
              for r in runs if r["mode"] == mode and base.get((r["prompt_id"], r["repeat"]), 0) > 0]
    return spread(ratios) if ratios else None


def summarise(runs: list[dict[str, Any]], modes: Sequence[str], plain: str = "hf-plain",
              autoregressive: str = "sd-autoregressive", assisted: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per-mode summary: speed spread, ms/token, acceptance, time split, ideal and achieved speedups.

    ``assisted`` names the HF assisted modes; the fastest of them (median tokens/s) is the
    "best HF assisted" baseline.
    """
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
    speed = {m: spread([tokens_per_second(r) for r in rs]) for m, rs in by_mode.items() if rs}
    measured_assisted = [m for m in assisted if m in speed]
    best_assisted = max(measured_assisted, key=lambda m: speed[m]["median"]) if measured_assisted else None
    ar_cost = None
    if by_mode.get(autoregressive):
        ar = time_split(r["stats"] for r in by_mode[autoregressive])
        ar_cost = ar["verify_compute_ms_per_iteration"]  # one token per iteration
    out: dict[str, dict[str, Any]] = {}
    for m, rs in by_mode.items():
        if not rs:
            continue
        s: dict[str, Any] = {"mode": m, "runs": len(rs), "tokens_per_second": speed[m],
                             "ms_per_token": spread([r["elapsed_ms"] / max(r["tokens"], 1) for r in rs]),
                             "identical": sum(1 for r in rs if r.get("identical")), "compared": sum(
                                 1 for r in rs if r.get("identical") is not None)}
        if all(r.get("stats") for r in rs):
            split = time_split(r["stats"] for r in rs)
            s["split"] = split
            s["mean_k"] = mean([r["mean_k"] for r in rs if r.get("mean_k") is not None])
            s["http_ms_per_request"] = mean([r["wall_ms"] - r["elapsed_ms"] for r in rs if r.get("wall_ms")])
            elapsed = sum(r["stats"]["elapsed_ms"] for r in rs)
            # compute on the critical path (a pre-draft's hidden compute is not), of the loop's wall time
            compute = split["iterations"] * (split["draft_compute_ms_per_iteration"] + split["verify_compute_ms_per_iteration"])
            s["compute_share"] = compute / elapsed if elapsed > 0 else None
            if ar_cost is not None and split["draft_tokens_per_iteration"] > 0:
                # overlapped, only the draft compute a step waited for adds to its cost
                s["ideal_speedup"] = ideal_speedup(split["tokens_per_iteration"], ar_cost,
                                                   split["draft_compute_ms_per_iteration"],
                                                   split["verify_compute_ms_per_iteration"])
        for key, base in (("vs_autoregressive", autoregressive), ("vs_plain", plain), ("vs_assisted", best_assisted)):
            if base and base != m and base in speed:
                s[key] = paired_speedup(runs, m, base)
        if s.get("ideal_speedup") and s.get("vs_autoregressive"):
            s["fraction_of_ideal"] = s["vs_autoregressive"]["median"] / s["ideal_speedup"]
        out[m] = s
    if best_assisted:
        for s in out.values():
            s["best_assisted"] = best_assisted
    return out


def acceptance_by_category(runs: list[dict[str, Any]], mode: str) -> dict[str, float]:
    """Aggregated acceptance rate of ``mode`` per prompt category (categories with drafts only)."""
    totals: dict[str, list[int]] = {}
    for r in runs:
        if r["mode"] == mode and r.get("stats"):
            t = totals.setdefault(r["category"], [0, 0])
            t[0] += r["stats"]["accepted_tokens"]
            t[1] += r["stats"]["draft_tokens"]
    return {c: a / p for c, (a, p) in totals.items() if p}


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean; None for no values."""
    return sum(values) / len(values) if values else None


# ---- load runs ------------------------------------------------------------------------------------

def step_gaps(arrivals: Sequence[tuple[float, int]]) -> list[tuple[float, float, int]]:
    """(arrival, gap, tokens) of each delivery of one request after its first.

    ``arrivals``: (time in s, tokens carried) of the request's step events, in order. A step that
    carried no token delivers nothing, so its wait joins the next delivery's gap. The first
    delivery is the TTFT's, not an inter-token gap.
    """
    out: list[tuple[float, float, int]] = []
    last = None
    for t, n in arrivals:
        if n <= 0:
            continue
        if last is not None:
            out.append((t, t - last, n))
        last = t
    return out


def itl_per_token(gaps: Sequence[tuple[float, float, int]]) -> list[float]:
    """One ITL sample per token: a gap g that delivered n tokens counts as n gaps of g/n."""
    return [g / n for _, g, n in gaps for _ in range(n)]


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p99 (linear interpolation) and mean of ``values``; None for each when there are none."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": sum(values) / len(values), "n": len(values)}


def batch_means(batches: Sequence[tuple[float, float]]) -> tuple[float | None, float | None]:
    """Mean sessions and mean token rows per target forward, from the (batch_sessions, batch_rows)
    of step events.

    A forward shared by s sessions shows up in the step events of all s, so each event weighs 1/s:
    forwards = Σ 1/s, sessions per forward = events / forwards, rows per forward = Σ rows/s / forwards.
    Exact when every session of a forward is one of the measured requests.
    """
    forwards = sum(1 / s for s, _ in batches)
    if not forwards:
        return None, None
    return len(batches) / forwards, sum(r / s for s, r in batches) / forwards


def summarise_run(records: Sequence[dict[str, Any]], window: tuple[float, float]) -> dict[str, Any]:
    """Statistics of one run from its request records (see :meth:`evaluation.load.LoadClient.request`); ``window``
    is (start, end) in seconds since the run started. Latencies in ms."""
    lo, hi = window
    tokens = drafted = accepted = 0
    ks: list[int] = []
    gaps: list[tuple[float, float, int]] = []
    batches: list[tuple[float, float]] = []
    for r in records:
        for s in r["steps"]:
            if lo <= s["t"] <= hi:
                tokens += s["n"]
                ks.append(s["k"])
                drafted += s["drafted"]
                accepted += s["accepted"]
                if s.get("batch_sessions") and s.get("batch_rows"):
                    batches.append((s["batch_sessions"], s["batch_rows"]))
        gaps += [g for g in step_gaps([(s["t"], s["n"]) for s in r["steps"]]) if lo <= g[0] <= hi]
    done = [r for r in records if r["status"] == 200 and r["end"] is not None]
    ttft, e2e, speed = [], [], []
    for r in done:
        first = next((s["t"] for s in r["steps"] if s["n"] > 0), None)
        if first is not None:
            ttft.append(first - r["start"])
        e2e.append(r["end"] - r["start"])
        if r["end"] > r["start"]:
            speed.append(sum(s["n"] for s in r["steps"]) / (r["end"] - r["start"]))
    server = [r["server"] for r in done if r.get("server")]
    server_speed = [x["tokens"] / x["elapsed_ms"] * 1e3 for x in server if x.get("tokens") and x.get("elapsed_ms")]
    iterations = sum(x.get("iterations", 0) for x in server)
    compared = [r for r in done if r.get("identical") is not None]
    sessions, rows = batch_means(batches)
    return {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "errors": dict(sorted(Counter(e for r in records for e in r["errors"]).items())),
        "retries": sum(r["attempts"] - 1 for r in records),
        "window_s": hi - lo, "tokens": tokens, "tokens_per_second": tokens / (hi - lo) if hi > lo else None,
        "request_tokens_per_second": quantiles(speed),
        "ttft_ms": quantiles([x * 1e3 for x in ttft]),
        "itl_ms": quantiles([x * 1e3 for x in itl_per_token(gaps)]),
        "step_gap_ms": quantiles([g * 1e3 for _, g, _ in gaps]),
        "e2e_ms": quantiles([x * 1e3 for x in e2e]),
        "server_tokens_per_second": quantiles(server_speed),
        "verify_compute_ms_per_iteration": (sum(x.get("verify_compute_ms", 0.0) for x in server) / iterations
                                            if iterations else None),
        "steps": len(ks), "mean_k": sum(ks) / len(ks) if ks else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "batch_steps": len(batches), "batch_sessions": sessions, "batch_rows": rows,
        "compared": len(compared), "mismatches": sum(not r["identical"] for r in compared),
        "mismatched_prompts": sorted({r["prompt_id"] for r in compared if not r["identical"]}),
    }


def add_ratios(runs: Sequence[dict[str, Any]]) -> None:
    """Set ``vs_n1`` (aggregate tok/s over the same mode's at N=1, closed loop) and
    ``vs_autoregressive`` (over autoregressive at the same load point) in every run's summary."""
    tps = {(r["loop"], r["load"], r["mode"]): r["summary"]["tokens_per_second"] for r in runs}
    for r in runs:
        s, own = r["summary"], r["summary"]["tokens_per_second"]
        base = tps.get(("closed", 1, r["mode"])) if r["loop"] == "closed" else None
        ar = tps.get((r["loop"], r["load"], "autoregressive")) if r["mode"] != "autoregressive" else None
        s["vs_n1"] = own / base if own and base else None
        s["vs_autoregressive"] = own / ar if own and ar else None


def poisson_arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival times (s) in [0, duration) of a Poisson process with ``rate`` arrivals per second."""
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times
