"""The one report writer of the benchmark commands: the set-up every command shares (logging,
results folder, command line, the machine), the results files (strict JSON and Markdown beside
it), Markdown tables and PNG plots (matplotlib with the Agg backend)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from evaluation.stats import SPLIT_PARTS, acceptance_by_category

Cell = Callable[[dict[str, Any]], str]

RESULTS_ROOT = Path(__file__).resolve().parent / "results"


def start_run(module: str, argv: Sequence[str] | None, out: Path | None, prefix: str = "",
              quiet: Sequence[str] = ("httpx",)) -> tuple[Path, str]:
    """Configure logging (``quiet`` loggers at WARNING), create the results folder (``out``, or
    ``RESULTS_ROOT/<prefix><timestamp>``) and return it with the command line as typed."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    out = out or RESULTS_ROOT / datetime.now().strftime(f"{prefix}%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[1:] if argv is None else list(argv)
    return out, " ".join(["python", "-m", module, *(shlex.quote(a) for a in args)])


def numbers(text: str, kind: type = float, positive: bool = True, empty: bool = True) -> list[Any]:
    """An argparse option's comma-separated numbers: '1,2,4' -> [1, 2, 4], '' -> [] (an error
    unless ``empty``); each above 0 (``positive``) or at least 0, else ArgumentTypeError."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of {kind.__name__}: {text!r}") from exc
    if not values and not empty:
        raise argparse.ArgumentTypeError(f"give one or more values: {text!r}")
    if any(v < 0 or (positive and v == 0) for v in values):
        raise argparse.ArgumentTypeError(f"every value must be {'positive' if positive else 'at least 0'}: {text!r}")
    return values


def names(text: str) -> list[str]:
    """An argparse option's comma-separated names: 'a,b' -> ['a', 'b'] (empty parts dropped)."""
    return [name for name in text.split(",") if name]


def args_record(args: argparse.Namespace, drop: Sequence[str] = ()) -> dict[str, Any]:
    """A run's options as results.json records them (paths as str), less ``drop`` (secrets)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in drop}


# ---- the machine ---------------------------------------------------------------------------------

def _first_line(path: str, start: str) -> str | None:
    try:
        return next((line for line in Path(path).read_text().splitlines() if line.startswith(start)), None)
    except OSError:
        return None


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """The machine, the libraries and (when given) the compute threads of a run."""
    from importlib.metadata import PackageNotFoundError, version

    def pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cpu = _first_line("/proc/cpuinfo", "model name")
    mem = _first_line("/proc/meminfo", "MemTotal:")
    info = {
        "cpu": cpu.split(":", 1)[1].strip() if cpu else platform.processor(), "cores": os.cpu_count(),
        "ram_gb": round(int(mem.split()[1]) / 1024 / 1024, 1) if mem else None, "platform": platform.platform(),
        "python": platform.python_version(), "torch": pkg("torch"), "transformers": pkg("transformers"),
        "llama_cpp_python": pkg("llama_cpp_python"), "threads": threads,
        "load_average_start": list(os.getloadavg()),
    }
    if threads is None:
        del info["threads"]
    return info


def load_average(values: Sequence[float] | None) -> str:
    """A load average triple as 1.0/0.5/0.2 ('–' when not recorded)."""
    return "/".join(f"{v:.1f}" for v in values) if values else "–"


def machine_line(m: dict[str, Any], between: str = "") -> str:
    """The report's machine sentence of :func:`machine_info`'s record; ``between``: what the
    command adds before the load averages (threads, libraries), ending in "; "."""
    return (f"Machine: {m['cores']} cores, {m['cpu']}, {m['ram_gb']} GB RAM; {between}load average "
            f"{load_average(m.get('load_average_start'))} at the start, {load_average(m.get('load_average_end'))} "
            "at the end.")


# ---- results files -------------------------------------------------------------------------------

def finite(o: Any) -> Any:
    """``o`` with NaN and infinities as None, in nested dicts, lists and tuples (strict JSON)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [finite(v) for v in o]
    return o


def write_results(out_dir: Path, results: Any, name: str = "results.json") -> Path:
    """Write ``results`` to ``out_dir/name`` as strict JSON (NaN and infinities as null, anything
    else JSON has no type for, such as a Path, as its str), indented by 1; returns the path."""
    path = Path(out_dir) / name
    path.write_text(json.dumps(finite(results), indent=1, default=str, allow_nan=False))
    return path


def write_report(out_dir: Path, results: Any, markdown: str, json_name: str = "results.json",
                 md_name: str = "results.md") -> Path:
    """``results`` as strict JSON (:func:`write_results`) and its Markdown report beside it;
    returns the report's path."""
    write_results(out_dir, results, json_name)
    path = Path(out_dir) / md_name
    path.write_text(markdown)
    return path


def read_results(folder: Path, name: str = "results.json") -> dict[str, Any]:
    """A results file written by :func:`write_results` (what the ``--report-only`` renderers read)."""
    return json.loads((Path(folder) / name).read_text())


# ---- tables --------------------------------------------------------------------------------------

def fmt(value: Any, digits: int = 1, suffix: str = "") -> str:
    """A number for a table cell; '–' for missing or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, int):
        return f"{value}{suffix}"
    return f"{value:.{digits}f}{suffix}"


def _get(d: dict[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, Cell]]) -> str:
    """A GitHub Markdown table: one row per dict, one column per (header, cell function);
    numeric-looking columns are right-aligned."""
    cells = [[cell(r).replace("|", "\\|") for _, cell in columns] for r in rows]
    numeric = [all(re.match(r"^[-+]?[\d.–×%\s()/]+$", row[i]) for row in cells) if cells else False
               for i in range(len(columns))]
    lines = ["| " + " | ".join(h for h, _ in columns) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def _speed(s: dict[str, Any]) -> str:
    t = s["tokens_per_second"]
    return f"{fmt(t['median'])} ({fmt(t['p10'])}–{fmt(t['p90'])})"


def _ratio(key: str) -> Cell:
    return lambda s: fmt(_get(s, key, "median"), 2, "×")


SPEED_COLUMNS: list[tuple[str, Cell]] = [
    ("mode", lambda s: s["mode"]),
    ("tok/s median (p10–p90)", _speed),
    ("ms/token", lambda s: fmt(s["ms_per_token"]["median"])),
    ("mean k", lambda s: fmt(s.get("mean_k"), 2)),
    ("acceptance", lambda s: fmt(pct(_get(s, "split", "acceptance_rate")), 0, "%")),
    ("accepted/iter", lambda s: fmt(_get(s, "split", "accepted_per_iteration"), 2)),
    ("tokens/iter", lambda s: fmt(_get(s, "split", "tokens_per_iteration"), 2)),
    ("vs specdec AR", _ratio("vs_autoregressive")),
    ("ideal", lambda s: fmt(s.get("ideal_speedup"), 2, "×")),
    ("of ideal", lambda s: fmt(pct(s.get("fraction_of_ideal")), 0, "%")),
    ("vs HF plain", _ratio("vs_plain")),
    ("vs best HF assisted", _ratio("vs_assisted")),
    ("identical to HF plain", lambda s: f"{s['identical']}/{s['compared']}" if s["compared"] else "–"),
]

SPLIT_COLUMNS: list[tuple[str, Cell]] = [
    ("mode", lambda s: s["mode"]),
    ("iterations", lambda s: fmt(_get(s, "split", "iterations"))),
    ("draft compute", lambda s: fmt(_get(s, "split", "draft_compute_ms_per_iteration"))),
    ("draft RPC", lambda s: fmt(_get(s, "split", "draft_rpc_ms_per_iteration"))),
    ("draft hidden behind verify", lambda s: fmt(_get(s, "split", "draft_hidden_ms_per_iteration"))),
    ("verify compute", lambda s: fmt(_get(s, "split", "verify_compute_ms_per_iteration"))),
    ("verify RPC", lambda s: fmt(_get(s, "split", "verify_rpc_ms_per_iteration"))),
    ("loop", lambda s: fmt(_get(s, "split", "loop_ms_per_iteration"))),
    ("compute share of loop time", lambda s: fmt(pct(s.get("compute_share")), 0, "%")),
    ("HTTP per request", lambda s: fmt(s.get("http_ms_per_request"))),
    ("draft fallbacks", lambda s: fmt(_get(s, "split", "draft_fallbacks"))),
]


def pct(x: float | None) -> float | None:
    """A share as a percentage (None stays None, NaN becomes None)."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else 100 * x


def render_tables(summary: dict[str, dict[str, Any]]) -> str:
    """The speed table (all modes) and the per-iteration time split table (specdec modes), in ms."""
    rows = list(summary.values())
    out = ["### Speed", "", markdown_table(rows, SPEED_COLUMNS), ""]
    split_rows = [s for s in rows if "split" in s]
    if split_rows:
        out += ["### Time per iteration (ms)", "", markdown_table(split_rows, SPLIT_COLUMNS), ""]
    return "\n".join(out)


def render_mismatches(mismatches: Sequence[dict[str, Any]], limit: int = 40) -> str:
    if not mismatches:
        return "Every mode produced exactly the ids of HF plain greedy decoding on every prompt.\n"
    cols: list[tuple[str, Cell]] = [
        ("mode", lambda m: m["mode"]), ("prompt", lambda m: m["prompt_id"]), ("position", lambda m: str(m["position"])),
        ("reference token", lambda m: f"{m.get('reference_token')} {m.get('reference_text', '')!r}"),
        ("mode's token", lambda m: f"{m.get('other_token')} {m.get('other_text', '')!r}"),
        ("top-2 logit gap", lambda m: fmt(m.get("top2_gap"), 4)),
        ("mode's token logit gap", lambda m: fmt(m.get("other_gap"), 4)),
    ]
    more = f"\n\n({len(mismatches) - limit} more in results.json)" if len(mismatches) > limit else ""
    return markdown_table(list(mismatches)[:limit], cols) + more + "\n"


# ---- plots -------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure(width: float, height: float) -> tuple[Any, Any]:
    """A new (figure, axes) of that size in inches, on the Agg backend."""
    return _plt().subplots(figsize=(width, height))


def save_plot(fig: Any, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` as a PNG and close it; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_speedup_vs_k(summary: dict[str, dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Achieved (and ideal) speedup over specdec autoregressive for fixed k = 1…8; adaptive
    controllers as points at their mean chosen k."""
    fixed = sorted((int(m.rsplit("k", 1)[1]), s) for m, s in summary.items()
                   if re.fullmatch(r"sd-fixed-k\d+", m) and s.get("vs_autoregressive"))
    adaptive = [(m, s) for m, s in summary.items()
                if not re.fullmatch(r"sd-fixed-k\d+", m) and s.get("vs_autoregressive") and s.get("mean_k")]
    if not fixed and not adaptive:
        return None
    fig, ax = figure(7, 4.2)
    if fixed:
        ks = [k for k, _ in fixed]
        ax.plot(ks, [s["vs_autoregressive"]["median"] for _, s in fixed], "o-", label="fixed k (achieved)")
        lo = [s["vs_autoregressive"]["p10"] for _, s in fixed]
        hi = [s["vs_autoregressive"]["p90"] for _, s in fixed]
        ax.fill_between(ks, lo, hi, alpha=0.15, label="fixed k, p10–p90 over prompts")
        ideal = [(k, s.get("ideal_speedup")) for k, s in fixed if s.get("ideal_speedup")]
        if ideal:
            ax.plot([k for k, _ in ideal], [v for _, v in ideal], "s--", color="gray", label="fixed k (ideal: no overhead)")
    markers = "D^vP*Xh"
    for i, (m, s) in enumerate(adaptive):
        ax.plot([s["mean_k"]], [s["vs_autoregressive"]["median"]], markers[i % len(markers)], markersize=9,
                linestyle="none", label=f"{m} (at its mean k)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over specdec autoregressive (median)")
    ax.set_title(title or "Speedup vs draft length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save_plot(fig, path)


def plot_time_split(summary: dict[str, dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Stacked bars: ms per generated token of each time component, per specdec mode; HF modes as
    a single 'in-process generate' bar."""
    rows = list(summary.values())
    if not rows:
        return None
    fig, ax = figure(max(7, 0.55 * len(rows) + 2), 4.5)
    names = [s["mode"] for s in rows]
    bottom = [0.0] * len(rows)
    labels = {"draft_compute": "draft compute", "draft_rpc": "draft RPC + serialisation",
              "verify_compute": "verify compute", "verify_rpc": "verify RPC + serialisation",
              "loop": "orchestrator loop"}
    for part in SPLIT_PARTS:
        vals = [_get(s, "split", f"{part}_ms_per_token") or 0.0 for s in rows]
        ax.bar(names, vals, bottom=bottom, label=labels[part])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    hf = [s["ms_per_token"]["median"] if "split" not in s else 0.0 for s in rows]
    if any(hf):
        ax.bar(names, hf, bottom=bottom, label="in-process generate (HF)", color="lightgray", edgecolor="gray")
    ax.set_ylabel("ms per generated token")
    ax.set_title(title or "Where the time goes")
    ax.tick_params(axis="x", rotation=60)
    for lbl in ax.get_xticklabels():
        lbl.set_horizontalalignment("right")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return save_plot(fig, path)


def plot_acceptance_by_category(runs: list[dict[str, Any]], modes: Sequence[str], categories: Sequence[str],
                                path: Path, title: str = "") -> Path | None:
    """Grouped bars: aggregated acceptance rate per prompt category for each drafting mode."""
    data = {m: acceptance_by_category(runs, m) for m in modes}
    data = {m: d for m, d in data.items() if d}
    cats = [c for c in categories if any(c in d for d in data.values())]
    if not data or not cats:
        return None
    fig, ax = figure(8, 4.8)
    width = 0.8 / len(data)
    for i, (m, d) in enumerate(data.items()):
        xs = [j + (i - (len(data) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, [100 * d.get(c, 0.0) for c in cats], width, label=m)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("draft tokens accepted (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title or "Acceptance by prompt category")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.grid(axis="y", alpha=0.3)
    return save_plot(fig, path)
