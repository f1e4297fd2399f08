"""``python -m evaluation.scaleout``: replicas behind one orchestrator, under load, with a replica killed.

For each target replica count R in ``--replicas`` (default 1,2): start R target services and
``--draft-replicas`` draft services as processes on this machine, one orchestrator given both lists
(comma-separated addresses), then ``--clients`` closed-loop clients streaming greedy speculative
requests (prompts of the suite in turn, ``--max-tokens`` each, EOS ignored) for ``--duration`` s.
With R >= 2, one target replica — the one that served the most calls so far — is killed with
SIGKILL ``--kill-at`` seconds into the run, while its streams are mid-flight.

Per configuration: requests sent, completed and failed; aggregate tokens/s over the run; the share
of committed tokens the target found in its KV cache (the orchestrator's
``specdec_target_prefix_tokens_total``: affinity keeps it high, a failover costs one re-prefill per
moved stream); failovers; calls per replica (how evenly sessions spread); and token equality of
every completed request against plain greedy decoding of the same prompt (asked once more, alone,
after the load). Replicas on one machine share its cores: R = 2 tests routing and failover, not
capacity. JSON and a Markdown table land in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import httpx

from evaluation import report
from evaluation.client import async_client
from evaluation.load import LoadClient
from evaluation.procs import Stack
from evaluation.prompts import Prompt, load_suite, select
from evaluation.stats import summarise_run
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

logger = logging.getLogger("evaluation.scaleout")

METRIC = re.compile(r'^(specdec_target_prefix_tokens_total|specdec_replica_failovers_total)\{([^}]*)\} ([0-9.e+]+)$')


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.scaleout", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=lambda s: report.numbers(s, int), default=[1, 2],
                   help="target replica counts to run, in turn (default 1,2)")
    p.add_argument("--draft-replicas", type=int, default=2, help="draft replicas (default 2)")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients (default 8)")
    p.add_argument("--duration", type=float, default=40, help="seconds of load per configuration (default 40)")
    p.add_argument("--kill-at", type=float, default=15,
                   help="kill one target replica this many seconds into the run when R >= 2 (default 15; 0: never)")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per request, EOS ignored (default 48)")
    p.add_argument("--prompts", type=int, default=None, help="use N prompts of the suite")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/scaleout-<time>/)")
    args = p.parse_args(argv)
    if not args.replicas or min(args.replicas) < 1 or args.draft_replicas < 1 or args.clients < 1:
        p.error("replica and client counts must be at least 1")
    return args


def scrape(url: str) -> dict[str, float]:
    """The counters this benchmark reads from the orchestrator's /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = METRIC.match(line)
        if m:
            out[f"{m.group(1)}{{{m.group(2)}}}"] = float(m.group(3))
    return out


def calls(port: int) -> int | None:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            return pb_grpc.TargetServiceStub(ch).Info(pb.InfoRequest(), timeout=5).scheduler.calls
    except grpc.RpcError:
        return None


async def run_config(args: argparse.Namespace, replicas: int, prompts: list[Prompt], log_dir: Path) -> dict[str, Any]:
    """One configuration: its services started, the load (one target replica killed into it when
    ``replicas`` >= 2), the references, its services stopped again."""
    stack = Stack(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        targets = [stack.model_service(f"target-{i}", "target", {}) for i in range(replicas)]
        drafts = [stack.model_service(f"draft-{i}", "draft", {}) for i in range(args.draft_replicas)]
        url = stack.orchestrator("orchestrator", ",".join(f"127.0.0.1:{p}" for p in drafts),
                                 ",".join(f"127.0.0.1:{p}" for p in targets),
                                 {"SPECDEC_ORCHESTRATOR_REPLICA_PROBE_INTERVAL_S": "1"})
        target_procs = [s for s in stack.services if s.name.startswith("target-")]
        async with async_client() as http:
            client = LoadClient(http, url, prompts, args.max_tokens, 0.0, {})
            for p in prompts[: max(replicas, 2)]:  # warm every replica's first-call set-up
                await client.request(p, "speculative", time.perf_counter(), None, max_tokens=4)
            before, calls_before = scrape(url), [calls(p) or 0 for p in targets]
            killed: dict[str, Any] = {}
            t = time.perf_counter()
            (records, window), _ = await asyncio.gather(
                client.closed_loop("speculative", args.clients, args.duration, None, 0.0),
                _kill_one(args, targets, target_procs, calls_before, killed))
            elapsed = time.perf_counter() - t
            after, calls_after = scrape(url), [calls(p) for p in targets]
            references: dict[str, list[int]] = {}
            for pid in sorted({r["prompt_id"] for r in records}):
                rec = await client.request(next(p for p in prompts if p.id == pid), "autoregressive",
                                           time.perf_counter(), None)
                if rec["status"] == 200:
                    references[pid] = rec["token_ids"]
    finally:
        stack.close()
    per_replica = [None if a is None else a - b for a, b in zip(calls_after, calls_before, strict=True)]
    if killed:
        per_replica[killed["replica"]] = killed["calls_before_kill"][killed["replica"]]
    return {"target_replicas": replicas, "draft_replicas": args.draft_replicas, "clients": args.clients,
            "elapsed_s": round(elapsed, 1), "calls_per_replica": per_replica, "killed": killed or None,
            **_outcome(records, window, references, before, after)}


async def _kill_one(args: argparse.Namespace, targets: list[int], procs: list[Any], calls_before: list[int],
                    killed: dict[str, Any]) -> None:
    """``--kill-at`` s into the load, SIGKILL the target replica that served the most calls so far
    (with two replicas or more); ``killed`` says which, when and the calls each had served."""
    if len(targets) < 2 or not args.kill_at:
        return
    await asyncio.sleep(args.kill_at)
    served = [(calls(p) or 0) - c0 for p, c0 in zip(targets, calls_before, strict=True)]
    victim = max(range(len(targets)), key=lambda i: served[i])
    killed.update(replica=victim, at_s=args.kill_at, calls_before_kill=served)
    logger.info("killing target-%d (SIGKILL) after %.0f s; calls per replica so far %s", victim, args.kill_at, served)
    os.kill(procs[victim].popen.pid, signal.SIGKILL)


def _outcome(records: list[dict[str, Any]], window: tuple[float, float], references: dict[str, list[int]],
             before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the load of one configuration did: requests, errors, tok/s, the share of the prefix
    the target found cached, failovers, and how many completed requests equal plain decoding."""
    summary = summarise_run(records, window)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    cached = delta('specdec_target_prefix_tokens_total{source="cached"}')
    computed = delta('specdec_target_prefix_tokens_total{source="computed"}')
    completed = [r for r in records if r["status"] == 200]
    compared = [r for r in completed if r["prompt_id"] in references]
    return {
        "requests": len(records), "completed": len(completed), "failed": len(records) - len(completed),
        "errors": summary["errors"], "tokens_per_second": summary["tokens_per_second"],
        "cache_share": round(cached / (cached + computed), 4) if cached + computed else None,
        "prefix_tokens": {"cached": cached, "computed": computed},
        "failovers": {k.split("{", 1)[1].rstrip("}"): delta(k) for k in after
                      if k.startswith("specdec_replica_failovers_total")},
        "compared": len(compared), "identical": sum(r["token_ids"] == references[r["prompt_id"]] for r in compared),
    }


def render(results: dict[str, Any]) -> str:
    columns: list[tuple[str, report.Cell]] = [
        ("replicas", lambda c: f"{c['target_replicas']} × target, {c['draft_replicas']} × draft"),
        ("clients", lambda c: str(c["clients"])), ("requests", lambda c: str(c["requests"])),
        ("failed", lambda c: str(c["failed"])), ("tok/s", lambda c: report.fmt(c["tokens_per_second"])),
        ("prefix from cache", lambda c: report.fmt(report.pct(c["cache_share"]), 1, " %")),
        ("failovers", lambda c: f"{sum(c['failovers'].values()):g}"),
        ("calls per target replica", lambda c: " / ".join("–" if n is None else str(n) for n in c["calls_per_replica"])),
        ("killed", lambda c: f"target-{c['killed']['replica']} at {c['killed']['at_s']:g} s" if c["killed"] else "–"),
        ("identical to plain", lambda c: f"{c['identical']}/{c['compared']}"),
    ]
    return (f"# Scale-out\n\n`{results['command']}` ({results['started']})\n\n"
            + report.markdown_table(results["configs"], columns) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, command = report.start_run("evaluation.scaleout", argv, args.out, "scaleout-")
    prompts = select(load_suite(), args.prompts, None)
    started = datetime.now().isoformat(timespec="seconds")
    configs = []
    for replicas in args.replicas:
        logger.info("%d target replica(s), %d draft replica(s), %d clients, %g s", replicas, args.draft_replicas,
                    args.clients, args.duration)
        configs.append(asyncio.run(run_config(args, replicas, prompts, out / f"logs-{replicas}")))
        c = configs[-1]
        logger.info("%d replica(s): %d/%d requests completed, %s tok/s, cache share %s, identical %d/%d",
                    replicas, c["completed"], c["requests"], report.fmt(c["tokens_per_second"]), c["cache_share"],
                    c["identical"], c["compared"])
    results = {"started": started, "command": command, "machine": report.machine_info(), "configs": configs,
               "args": report.args_record(args)}
    report.write_report(out, results, render(results))
    print(render(results))
    failed = any(c["failed"] or c["identical"] != c["compared"] for c in configs)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
