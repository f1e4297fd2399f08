"""``python -m evaluation.load``: throughput and per-token latency of the whole stack under
concurrent load, through the orchestrator's streaming API.

Closed loop (``--concurrency 1,2,4``): N clients, each sending its next request as soon as the
previous one ends, for ``--duration`` seconds (or ``--requests`` requests per client). Open loop
(``--rates 0.5,1,2``): requests arrive as a Poisson process at that many per second for
``--duration`` seconds, whatever the server's state; every mode gets the same seeded arrival times.
Every load point runs once per mode (``speculative``, ``autoregressive``), back to back, in an order
rotated from one load point to the next, so slow drift of the machine hits both modes alike.

Requests go to ``/v1/generate/stream``: greedy unless ``--temperature``, ``ignore_eos``,
``--max-tokens`` new tokens, prompts of the suite (evaluation/prompts.jsonl) in turn. The arrival
time of every `step` event and the number of tokens it carried are recorded; a step's tokens
arrive together.

Measures per run (mode × load point):
  aggregate tok/s   tokens delivered inside the window / the window's length; the window starts
                    after ``--warmup`` seconds and ends with the last arrival (closed loop with
                    ``--requests``: with the last response)
  ITL               inter-token latency: a step that delivered n tokens g seconds after the same
                    request's previous delivery counts as n gaps of g/n (steps in the window)
  step gap          g itself, once per step: how long a reader of the stream waits between updates
  TTFT              from sending the request (its first attempt) to the first step with a token
  e2e, req tok/s    from sending to the `done` event; the request's tokens / that time
  acceptance, mean k, batch sessions / rows   from the step events in the window
TTFT, e2e and req tok/s are over every completed request of the run (requests still running when
the window closes are waited for; their tokens after it do not count towards tok/s).

Errors are counted by HTTP status (also a status the stream reports in an `error` event); a 429
with Retry-After is retried after that delay (counted, and its wait is part of the TTFT).
Token equality: after the runs, each prompt used is generated once more alone in autoregressive
mode; every completed request of either mode must produce exactly those ids.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from evaluation import report
from evaluation.client import async_client, first_difference, generate_body, retry_after, sse_events
from evaluation.modes import rotation
from evaluation.prompts import CATEGORIES, SUITE_PATH, SUITE_VERSION, Prompt, load_suite, select, suite_digest
from evaluation.stats import add_ratios, poisson_arrivals, summarise_run

# Not __name__: run as ``python -m evaluation.load`` that would be "__main__".
logger = logging.getLogger("evaluation.load")

MODES = ("speculative", "autoregressive")
STREAM_PATH = "/v1/generate/stream"
# A request that keeps getting 429 without a deadline to stop it (closed loop with --requests).
MAX_ATTEMPTS = 30
# After a failed request a closed-loop client waits this long, so a broken server is not hammered.
FAILURE_PAUSE_S = 1.0
# Fields of the `done` event's stats each request keeps.
SERVER_STATS = ("tokens", "iterations", "elapsed_ms", "verify_compute_ms", "draft_compute_ms")


@dataclass(frozen=True)
class LoadPoint:
    """One level of offered load: ``value`` closed-loop clients, or Poisson arrivals at ``value`` requests/s."""

    loop: str  # "closed" | "open"
    value: float

    @property
    def label(self) -> str:
        return f"N={self.value:g}" if self.loop == "closed" else f"{self.value:g} req/s"


# ---- the client -------------------------------------------------------------------------------------

def step_record(t: float, data: dict[str, Any]) -> dict[str, Any]:
    """What a run keeps of a `step` event that arrived at ``t`` (s since the run started)."""
    s = {"t": round(t, 4), "n": len(data.get("tokens", ())), "k": data.get("k", 0),
         "drafted": len(data.get("draft", ())), "accepted": data.get("accepted", 0)}
    # servers without batching do not send these; 0 would be meaningless too, so both mean "unknown"
    for key in ("batch_sessions", "batch_rows"):
        if data.get(key):
            s[key] = data[key]
    return s


class LoadClient:
    """Sends generation requests to one orchestrator and records their step timings."""

    def __init__(self, http: httpx.AsyncClient, url: str, prompts: Sequence[Prompt], max_tokens: int, temperature: float,
                 speculation: dict[str, Any]) -> None:
        self.http, self.url, self.prompts = http, url, list(prompts)
        self.max_tokens, self.temperature, self.speculation = max_tokens, temperature, speculation

    async def request(self, prompt: Prompt, mode: str, t0: float, deadline: float | None,
                      max_tokens: int | None = None) -> dict[str, Any]:
        """One generation, retried after a 429's Retry-After while that ends before ``deadline``
        (perf_counter seconds). Times in the record are seconds since ``t0``.

        Record: prompt_id, start, end (None unless `done` arrived), status (200 when done, else the
        last HTTP status or None), errors (one key per failed attempt: the HTTP status, "timeout",
        "connection", "malformed" or "incomplete"), attempts, steps (:func:`step_record`), token_ids,
        server (SERVER_STATS of the `done` event).
        """
        rec: dict[str, Any] = {"prompt_id": prompt.id, "start": round(time.perf_counter() - t0, 4), "end": None,
                               "status": None, "errors": [], "attempts": 0, "steps": [], "token_ids": None}
        body = generate_body(prompt, max_tokens or self.max_tokens, temperature=self.temperature, mode=mode,
                             **(self.speculation if mode == "speculative" else {}))
        while True:
            rec["attempts"] += 1
            wait = None
            try:
                wait = await self._attempt(body, rec, t0)
            except ValueError:
                rec["errors"].append("malformed")  # an event whose data is not JSON
            except httpx.HTTPError as exc:  # a transport failure is one counted error, not the end of the run
                rec["errors"].append("timeout" if isinstance(exc, httpx.TimeoutException) else "connection")
                rec["detail"] = f"{type(exc).__name__}: {exc}"[:300]
            if wait is None or rec["attempts"] >= MAX_ATTEMPTS:
                return rec
            if deadline is not None and time.perf_counter() + wait >= deadline:
                return rec
            await asyncio.sleep(wait)

    async def _attempt(self, body: dict[str, Any], rec: dict[str, Any], t0: float) -> float | None:
        """One HTTP request; returns the Retry-After delay when it should be retried."""
        async with self.http.stream("POST", self.url + STREAM_PATH, json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")
                rec["errors"].append(str(r.status_code))
                rec["status"], rec["detail"] = r.status_code, detail[:300]
                return retry_after(r.headers.get("retry-after")) if r.status_code == 429 else None
            async for event, data in sse_events(r):
                now = time.perf_counter() - t0
                if event == "step":
                    rec["steps"].append(step_record(now, data))
                elif event == "done":
                    rec["end"], rec["status"], rec["token_ids"] = round(now, 4), 200, data.get("token_ids")
                    # the orchestrator's own account, to tell server time from client and network time
                    stats = data.get("stats") or {}
                    rec["server"] = {k: stats[k] for k in SERVER_STATS if k in stats}
                elif event == "error":
                    status = data.get("status")
                    rec["errors"].append(str(status))
                    rec["status"], rec["detail"] = status, str(data.get("detail"))[:300]
                    return None
        if rec["status"] != 200:
            rec["errors"].append("incomplete")  # the stream ended without `done`
        return None

    async def closed_loop(self, mode: str, clients: int, duration: float | None, per_client: int | None,
                          warmup: float) -> tuple[list[dict[str, Any]], tuple[float, float]]:
        """``clients`` clients sending back to back until ``duration`` s have passed or each sent
        ``per_client`` requests; the records and the measurement window."""
        t0 = time.perf_counter()
        deadline = t0 + duration if duration else None
        turn = itertools.count()  # one prompt sequence shared by all clients
        records: list[dict[str, Any]] = []

        async def client() -> None:
            sent = 0
            while (per_client is None or sent < per_client) and (deadline is None or time.perf_counter() < deadline):
                rec = await self.request(self.prompts[next(turn) % len(self.prompts)], mode, t0, deadline)
                records.append(rec)
                sent += 1
                if rec["status"] != 200:
                    await asyncio.sleep(FAILURE_PAUSE_S)

        await asyncio.gather(*(client() for _ in range(clients)))
        end = duration if duration else max((r["end"] or r["start"] for r in records), default=0.0)
        return records, (warmup, end)

    async def open_loop(self, mode: str, rate: float, duration: float, warmup: float,
                        seed: int) -> tuple[list[dict[str, Any]], tuple[float, float]]:
        """Poisson arrivals at ``rate``/s for ``duration`` s (seeded: the same times for every mode)."""
        t0 = time.perf_counter()
        tasks = []
        for i, at in enumerate(poisson_arrivals(rate, duration, random.Random(seed))):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = self.prompts[i % len(self.prompts)]
            tasks.append(asyncio.create_task(self.request(prompt, mode, t0, t0 + duration)))
        return list(await asyncio.gather(*tasks)), (warmup, duration)


# ---- the benchmark -------------------------------------------------------------------------------

def parse_env(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.load", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--concurrency", type=lambda s: report.numbers(s, int), default=[1, 2, 4, 8, 16, 32],
                   help="closed loop: comma-separated numbers of clients (default 1,2,4,8,16,32; '' for none)")
    p.add_argument("--rates", type=report.numbers, default=[],
                   help="open loop: comma-separated Poisson arrival rates in requests/s (default: none)")
    p.add_argument("--duration", type=float, default=30, help="seconds of arrivals per run (default 30)")
    p.add_argument("--requests", type=int, default=None,
                   help="closed loop: requests per client instead of --duration")
    p.add_argument("--warmup", type=float, default=5,
                   help="seconds at the start of each run left out of the aggregate tok/s and step statistics (default 5)")
    p.add_argument("--modes", type=report.names, default=list(MODES),
                   help="comma-separated: speculative, autoregressive (default both)")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per request, EOS ignored (default 48)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    p.add_argument("--controller", default=None, help="controller of speculative requests (default: the server's)")
    p.add_argument("--k", type=int, default=None, help="k of speculative requests (default: the server's)")
    p.add_argument("--max-k", type=int, default=None, help="max_k of speculative requests (default: the server's)")
    p.add_argument("--prompts", type=int, default=None, help="use N prompts of the suite, round-robin over the categories")
    p.add_argument("--categories", nargs="*", choices=CATEGORIES, help="only these prompt categories")
    p.add_argument("--prompts-file", type=Path, default=SUITE_PATH, help="a prompt suite in the format of prompts.jsonl")
    p.add_argument("--seed", type=int, default=0, help="seed of the open loop's arrival times (default 0)")
    p.add_argument("--url", default=None, help="a running orchestrator (default: start the stack on free ports)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY") or None,
                   help="API key sent as Authorization: Bearer (default: $SPECDEC_API_KEY)")
    p.add_argument("--env", type=parse_env, action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the started services (repeatable), e.g. SPECDEC_TARGET_MODEL=gpt2")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for one response (default 600)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/load-<timestamp>/)")
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: {bad or 'none'}; choose from {', '.join(MODES)}")
    if not args.concurrency and not args.rates:
        p.error("nothing to run: give --concurrency or --rates")
    if args.rates and not args.duration:
        p.error("--rates needs --duration")
    if (args.rates or not args.requests) and args.warmup >= args.duration:
        p.error(f"--warmup ({args.warmup:g} s) must be shorter than --duration ({args.duration:g} s)")
    return args


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    return [LoadPoint("closed", n) for n in args.concurrency] + [LoadPoint("open", r) for r in args.rates]


async def run_benchmark(args: argparse.Namespace, url: str, prompts: list[Prompt],
                        check: Callable[[], None] | None = None) -> dict[str, Any]:
    """Warm-up, every (load point, mode) run, then the autoregressive references and the equality
    check. ``check()`` (optional) raises when a started service has died."""
    speculation = {k: v for k, v in (("controller", args.controller), ("k", args.k), ("max_k", args.max_k)) if v is not None}
    async with async_client(args.api_key, args.timeout) as http:
        info = (await http.get(url + "/v1/info")).json()
        client = LoadClient(http, url, prompts, args.max_tokens, args.temperature, speculation)
        # one short request per mode first, so no run pays for cold caches or first-call set-up
        for mode in args.modes:
            rec = await client.request(prompts[0], mode, time.perf_counter(), None, max_tokens=8)
            if rec["status"] != 200:
                raise SystemExit(f"warm-up request ({mode}) failed: {rec['errors']} {rec.get('detail', '')}")
        points = load_points(args)
        order = [(point, mode) for i, point in enumerate(points) for mode in rotation(args.modes, i)]
        runs = []
        for j, (point, mode) in enumerate(order, 1):
            runs.append(await _run_point(client, args, point, mode, f"run {j}/{len(order)}: {mode} {point.label}"))
            if check is not None:
                check()
        references = await _references(client, args, runs, prompts)
    mismatches = _check_equality(runs, references)
    add_ratios(runs)
    return {"info": info, "runs": runs, "references": references, "mismatches": mismatches}


async def _run_point(client: LoadClient, args: argparse.Namespace, point: LoadPoint, mode: str,
                     what: str) -> dict[str, Any]:
    """One run: ``mode`` at one load point, with its records and the measurement window."""
    logger.info("%s ...", what)
    t = time.perf_counter()
    if point.loop == "closed":
        records, window = await client.closed_loop(mode, int(point.value), None if args.requests else args.duration,
                                                   args.requests, args.warmup)
    else:
        records, window = await client.open_loop(mode, point.value, args.duration, args.warmup, args.seed)
    s = summarise_run(records, window)
    # on a shared machine the load average says how far to trust a run's absolute numbers
    load_average = os.getloadavg()[0]
    logger.info("%s: %s tok/s, ITL p50/p99 %s/%s ms, TTFT p50 %s ms, %d/%d requests completed, errors %s "
                "(%.0f s, load average %.1f)", what, report.fmt(s["tokens_per_second"]),
                report.fmt(s["itl_ms"]["p50"]), report.fmt(s["itl_ms"]["p99"]), report.fmt(s["ttft_ms"]["p50"], 0),
                s["completed"], s["requests"], s["errors"] or "none", time.perf_counter() - t, load_average)
    return {"mode": mode, "loop": point.loop, "load": point.value, "label": point.label,
            "window": list(window), "load_average": load_average, "requests": records}


async def _references(client: LoadClient, args: argparse.Namespace, runs: list[dict[str, Any]],
                      prompts: list[Prompt]) -> dict[str, list[int]]:
    """Each prompt the runs used, generated once more alone in autoregressive mode (greedy runs
    only: sampled outputs have no single reference)."""
    references: dict[str, list[int]] = {}
    if args.temperature != 0:
        return references
    used = sorted({r["prompt_id"] for run in runs for r in run["requests"]})
    logger.info("autoregressive references for the %d prompts used, one request at a time", len(used))
    by_id = {p.id: p for p in prompts}
    for pid in used:
        rec = await client.request(by_id[pid], "autoregressive", time.perf_counter(), None)
        if rec["status"] == 200:
            references[pid] = rec["token_ids"]
        else:
            logger.warning("reference for %s failed: %s", pid, rec["errors"])
    return references


def _check_equality(runs: list[dict[str, Any]], references: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Mark every completed request ``identical`` to its prompt's reference or not (None without
    one), drop its ids and summarise each run; returns the mismatches."""
    mismatches = []
    for run in runs:
        for r in run["requests"]:
            ref = references.get(r["prompt_id"])
            if ref is None or r["status"] != 200:
                r["identical"] = None
            else:
                # a `done` without ids differs from the reference at once
                pos = first_difference(ref, r["token_ids"]) if r["token_ids"] is not None else 0
                r["identical"] = pos is None
                if pos is not None:
                    mismatches.append({"mode": run["mode"], "load": run["label"], "prompt_id": r["prompt_id"],
                                       "position": pos})
            del r["token_ids"]  # the reference says what they are, or the mismatch list where they differ
        run["summary"] = summarise_run(run["requests"], tuple(run["window"]))
    return mismatches


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, command = report.start_run("evaluation.load", argv, args.out, "load-", quiet=("httpx", "matplotlib"))
    prompts = select(load_suite(args.prompts_file), args.prompts, args.categories)
    if not prompts:
        raise SystemExit("no prompts selected")
    started = datetime.now().isoformat(timespec="seconds")
    t_start = time.perf_counter()
    # the benchmark runs no model itself, so the in-process thread count means nothing here
    machine = report.machine_info()
    measured = _measure(args, out, prompts)
    machine["load_average_end"] = list(os.getloadavg())

    results = {
        "started": started, "duration_s": round(time.perf_counter() - t_start, 1), "command": command,
        "args": report.args_record(args, drop=("api_key",)),
        "url": args.url, "services": measured["info"], "machine": machine,
        "suite": {"path": str(args.prompts_file), "version": SUITE_VERSION if args.prompts_file == SUITE_PATH else None,
                  "digest": suite_digest(args.prompts_file), "prompts": [p.id for p in prompts]},
        "settings": {"max_tokens": args.max_tokens, "temperature": args.temperature, "duration_s": args.duration,
                     "requests_per_client": args.requests, "warmup_s": args.warmup, "modes": args.modes},
        "mismatches": measured["mismatches"], "references": measured["references"], "runs": measured["runs"],
    }
    plot = plot_throughput_latency(results["runs"], out / "throughput_vs_itl.png")
    report.write_report(out, results, render_markdown(results, plot.name if plot else None))
    logger.info("done in %.0f s: %s", results["duration_s"], out)
    print(render_tables(results["runs"]))
    return 0


def _measure(args: argparse.Namespace, out: Path, prompts: list[Prompt]) -> dict[str, Any]:
    """:func:`run_benchmark` against ``--url``, or against the stack started here (stopped after)."""
    from evaluation.procs import Stack

    stack = Stack(out / "logs")
    try:
        if args.url:
            url, check = args.url.rstrip("/"), None
        else:
            env = dict(args.env)
            stack.log_dir.mkdir(parents=True, exist_ok=True)
            logger.info("starting the services (logs in %s)", stack.log_dir)
            target_port = stack.model_service("target", "target", env)
            draft_port = stack.model_service("draft", "draft", env)
            url, check = stack.orchestrator("orchestrator", draft_port, target_port, env), stack.check
        return asyncio.run(run_benchmark(args, url, prompts, check))
    finally:
        stack.close()


# ---- output ---------------------------------------------------------------------------------------

def _pair(q: dict[str, Any], digits: int = 0) -> str:
    return f"{report.fmt(q.get('p50'), digits)} / {report.fmt(q.get('p99'), digits)}"


def _errors(s: dict[str, Any]) -> str:
    return " ".join(f"{k}×{v}" for k, v in s["errors"].items()) or "0"


def _mismatches(s: dict[str, Any]) -> str:
    if not s["compared"]:
        return "–"
    return f"{s['mismatches']}/{s['compared']}" + (f" ({', '.join(s['mismatched_prompts'])})" if s["mismatches"] else "")


def _columns(loop: str) -> list[tuple[str, report.Cell]]:
    cols: list[tuple[str, report.Cell]] = [
        ("N" if loop == "closed" else "rate (req/s)", lambda r: f"{r['load']:g}"),
        ("mode", lambda r: r["mode"]),
        ("requests", lambda r: str(r["summary"]["completed"])),
        ("tok/s", lambda r: report.fmt(r["summary"]["tokens_per_second"])),
        ("vs N=1", lambda r: report.fmt(r["summary"]["vs_n1"], 2, "×")),
        ("spec/AR", lambda r: report.fmt(r["summary"]["vs_autoregressive"], 2, "×")),
        ("req tok/s p50", lambda r: report.fmt(r["summary"]["request_tokens_per_second"]["p50"])),
        ("ITL p50 / p99 (ms)", lambda r: _pair(r["summary"]["itl_ms"], 1)),
        ("step gap p50 / p99 (ms)", lambda r: _pair(r["summary"]["step_gap_ms"])),
        ("TTFT p50 / p99 (ms)", lambda r: _pair(r["summary"]["ttft_ms"])),
        ("e2e p50 / p99 (s)", lambda r: _pair({k: v / 1e3 if v is not None else None
                                                 for k, v in r["summary"]["e2e_ms"].items()}, 1)),
        ("acceptance", lambda r: report.fmt(report.pct(r["summary"]["acceptance_rate"]), 0, "%")),
        ("mean k", lambda r: report.fmt(r["summary"]["mean_k"], 2)),
        ("batch sessions / rows", lambda r: f"{report.fmt(r['summary']['batch_sessions'], 2)} / "
                                            f"{report.fmt(r['summary']['batch_rows'], 1)}"),
        ("errors", lambda r: _errors(r["summary"])),
        ("mismatches", lambda r: _mismatches(r["summary"])),
    ]
    return [c for c in cols if not (loop == "open" and c[0] == "vs N=1")]


def render_tables(runs: Sequence[dict[str, Any]]) -> str:
    """Markdown tables of the closed-loop and the open-loop runs, rows by load point then mode."""
    out = []
    for loop, title in (("closed", "Closed loop (N concurrent clients)"), ("open", "Open loop (Poisson arrivals)")):
        rows = sorted((r for r in runs if r["loop"] == loop), key=lambda r: (r["load"], MODES.index(r["mode"])))
        if rows:
            out += [f"### {title}", "", report.markdown_table(rows, _columns(loop)), ""]
    return "\n".join(out)


def render_markdown(results: dict[str, Any], plot: str | None) -> str:
    m, st = results["machine"], results["settings"]
    target = (results["services"].get("target") or {}).get("model_id", "?")
    draft = results["services"].get("draft") or {}
    length = (f"{st['duration_s']:g} s of arrivals per run" if not st["requests_per_client"]
              else f"{st['requests_per_client']} requests per client")
    suite = results["suite"]
    suite_name = f"suite v{suite['version']}" if suite["version"] else f"`{suite['path']}`"
    lines = [
        f"# Load benchmark {results['started']}", "",
        f"Command: `{results['command']}`", "",
        f"Stack: {results['url'] or 'started by the benchmark'}; target `{target}`, draft `{draft.get('model_id', '?')}` "
        f"({draft.get('backend', '?')}).", "",
        f"Requests: {st['max_tokens']} new tokens (EOS ignored), temperature {st['temperature']:g}, "
        f"{len(suite['prompts'])} prompts of {suite_name} ({suite['digest']}) in turn; {length}, the first {st['warmup_s']:g} s "
        f"left out of tok/s and the step statistics. Run took {results['duration_s'] / 60:.1f} min.", "",
        report.machine_line(m), "",
        render_tables(results["runs"]), "### Token equality", "",
    ]
    if results["mismatches"]:
        cols: list[tuple[str, report.Cell]] = [("mode", lambda x: x["mode"]), ("load", lambda x: x["load"]),
                                                ("prompt", lambda x: x["prompt_id"]), ("position", lambda x: str(x["position"]))]
        lines += [report.markdown_table(results["mismatches"], cols), ""]
    elif results["references"]:
        lines += ["Every completed request produced exactly the ids of its prompt's autoregressive reference.", ""]
    else:
        lines += ["Not checked (sampled outputs have no single reference).", ""]
    if plot:
        lines += [f"![aggregate tok/s against p99 ITL]({plot})", ""]
    return "\n".join(lines)


def plot_throughput_latency(runs: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Aggregate tok/s (x) against p99 ITL (y): one line per mode (and loop), points labelled by load."""
    lines: dict[str, list[tuple[float, float, str]]] = {}
    for r in sorted(runs, key=lambda r: r["load"]):
        x, y = r["summary"]["tokens_per_second"], r["summary"]["itl_ms"]["p99"]
        if x is not None and y is not None:
            lines.setdefault(f"{r['mode']} ({r['loop']} loop)", []).append((x, y, r["label"]))
    if not lines:
        return None
    fig, ax = report.figure(7, 4.5)
    for name, pts in lines.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        for x, y, label in pts:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("aggregate tokens/s")
    ax.set_ylabel("p99 inter-token latency (ms)")
    ax.set_title("Throughput against latency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return report.save_plot(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
