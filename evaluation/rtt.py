"""``python -m evaluation.rtt``: single-stream speedup of speculative decoding over plain decoding
as the network round trip to the draft service grows, alternating and overlapped.

Set-up: the target service runs on this host's loopback; the draft service runs in its own network
namespace (``specdec-rtt-<pid>``, a veth pair 10.231.0.1/30 on the host, 10.231.0.2/30 inside), so
its traffic crosses a real network interface; ``--no-namespace`` (or not being root, or ``ip netns``
failing) runs it on loopback instead, which the results record as ``"namespace": false``. The
orchestrator reaches the draft only through a :class:`evaluation.faultproxy.FaultProxy` on
127.0.0.1 in ``delay`` mode: every chunk is held rtt/2 in each direction, so every round trip to the
draft grows by rtt. The delay changes between settings at run time; nothing restarts. The added
round trip actually measured (median of 20 gRPC ``Info`` calls through the proxy minus the median of
20 straight to the draft) is reported next to the nominal one.

For every RTT in ``--rtt-ms`` and every prompt (``--prompts`` of the suite, round-robin over the
categories), these modes run back to back, one request at a time, in an order rotated from one
prompt to the next (after one untimed warm-up request per mode at each RTT, which also lets the
cost model learn the new round trip); greedy, ``--max-tokens`` new tokens, EOS ignored:

  autoregressive      the target alone (``mode: autoregressive``): the baseline
  alternating-cost    cost controller, draft then verify (``overlap: false``)
  overlapped-cost     cost controller, the next block drafted while this one is verified (``overlap: true``)
  alternating-k4      fixed k = 4, alternating
  overlapped-k4       fixed k = 4, overlapped

Per (RTT, mode): median tok/s over prompts (the orchestrator's own tokens / generation time), the
speedup over autoregressive at the same RTT as a ratio of the medians and as the median of the
per-prompt ratios, mean k, acceptance, the share of steps whose draft was pre-drafted, draft,
verify and loop ms per iteration, and token equality with the autoregressive output of the same
prompt at the same RTT. ``rtt.json`` and ``rtt.md`` land in ``--out``.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from evaluation import report
from evaluation.client import first_difference, generate_body, post_json, sync_client
from evaluation.faultproxy import FaultProxy
from evaluation.modes import rotation
from evaluation.procs import Service, Stack, free_port, wait_grpc
from evaluation.prompts import SUITE_VERSION, Prompt, load_suite, select, suite_digest
from evaluation.stats import mean, paired_speedup, spread, tokens_per_second

# Not __name__: run as ``python -m evaluation.rtt`` that would be "__main__".
logger = logging.getLogger("evaluation.rtt")

# Request fields of each mode (besides prompt, max_tokens, ignore_eos, temperature).
MODES: dict[str, dict[str, Any]] = {
    "autoregressive": {"mode": "autoregressive"},
    "alternating-cost": {"controller": "cost", "overlap": False},
    "overlapped-cost": {"controller": "cost", "overlap": True},
    "alternating-k4": {"controller": "fixed", "k": 4, "overlap": False},
    "overlapped-k4": {"controller": "fixed", "k": 4, "overlap": True},
}
BASELINE = "autoregressive"
HOST_ADDRESS = "10.231.0.1"  # the host's end of the veth pair
DRAFT_ADDRESS = "10.231.0.2"  # the namespace's end, where the draft listens
PREFIX_LEN = 30
RTT_CALLS = 20  # timed Info calls per round-trip measurement


# ---- the draft's network namespace ------------------------------------------------------------------

def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Namespace:
    """A network namespace joined to the host by a veth pair; ``down()`` removes both (idempotent)."""

    def __init__(self, tag: int | None = None) -> None:
        tag = os.getpid() if tag is None else tag
        self.name = f"specdec-rtt-{tag}"
        self.host_if, self.ns_if = f"srtt{tag}h"[:15], f"srtt{tag}n"[:15]
        self.created = False

    def up(self) -> None:
        """Create the namespace and the veth pair; on any failure remove what was made and raise."""
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        subnet = ipaddress.ip_interface(f"{HOST_ADDRESS}/{PREFIX_LEN}").network
        taken = subprocess.run(["ip", "-o", "-4", "addr", "show", "to", str(subnet)], check=True, capture_output=True,
                               text=True, timeout=30).stdout.strip()
        if taken:
            raise RuntimeError(f"{subnet} is already on an interface (another run's namespace?): {taken}")
        self.created = True
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{HOST_ADDRESS}/{PREFIX_LEN}", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("-n", self.name, "addr", "add", f"{DRAFT_ADDRESS}/{PREFIX_LEN}", "dev", self.ns_if)
            _ip("-n", self.name, "link", "set", self.ns_if, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.down()
            raise RuntimeError(f"{shlex.join(exc.cmd)}: {exc.stderr.strip()}") from exc
        except BaseException:
            self.down()
            raise
        logger.info("network namespace %s: %s %s/%d on the host, %s %s/%d inside", self.name, self.host_if,
                    HOST_ADDRESS, PREFIX_LEN, self.ns_if, DRAFT_ADDRESS, PREFIX_LEN)

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def down(self) -> None:
        """Remove the veth pair and the namespace (stop the processes inside first: a namespace
        with a process in it outlives ``ip netns del``)."""
        if not self.created:
            return
        self.created = False
        for args in (("link", "del", self.host_if), ("netns", "del", self.name)):
            try:
                _ip(*args)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
                pass  # already gone: deleting the namespace takes its veth end, and the peer with it
        logger.info("network namespace %s removed", self.name)


def namespace_exists(name: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return any(line.split()[0] == name for line in out.splitlines() if line.strip())


def draft_proxy(host: str, port: int) -> FaultProxy:
    """A FaultProxy on 127.0.0.1 forwarding to ``host:port`` (the draft's end of the veth pair, or loopback)."""
    return FaultProxy(port, upstream_host=host, name="draft-rtt")


def info_ms(address: str, calls: int = RTT_CALLS) -> list[float]:
    """Wall ms of ``calls`` draft ``Info`` calls over one connection (after an untimed first call)."""
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DraftServiceStub(channel)
        stub.Info(pb.InfoRequest(), timeout=30)
        out = []
        for _ in range(calls):
            t = time.perf_counter()
            stub.Info(pb.InfoRequest(), timeout=30)
            out.append((time.perf_counter() - t) * 1e3)
    return out


def measure_rtt(nominal_ms: float, direct: str, proxied: str, calls: int = RTT_CALLS) -> dict[str, Any]:
    """The round trip the proxy adds: median Info time through it minus median Info time without it."""
    straight, through = spread(info_ms(direct, calls)), spread(info_ms(proxied, calls))
    return {"nominal_ms": nominal_ms, "delay_ms": nominal_ms / 2, "direct_ms": straight, "proxied_ms": through,
            "added_ms": through["median"] - straight["median"]}


# ---- pure parts ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.rtt", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--rtt-ms", type=lambda s: report.numbers(s, positive=False, empty=False), default=[0.0, 1.0, 5.0, 20.0],
                   help="comma-separated round trips added between the orchestrator and the draft, ms (default 0,1,5,20)")
    p.add_argument("--prompts", type=int, default=4, help="prompts of the suite, round-robin over the categories (default 4)")
    p.add_argument("--max-tokens", type=int, default=96, help="new tokens per request, EOS ignored (default 96)")
    p.add_argument("--modes", type=report.names, default=list(MODES),
                   help=f"comma-separated subset of {', '.join(MODES)} (default all)")
    p.add_argument("--target", default=None, help="SPECDEC_TARGET_MODEL of the target service (default: its embedded default)")
    p.add_argument("--draft", default=None, help="SPECDEC_DRAFT_MODEL of the draft service (default: its embedded default)")
    p.add_argument("--draft-backend", default=None, choices=["llamacpp", "transformers", "ngram"],
                   help="SPECDEC_DRAFT_BACKEND of the draft service (default: its own, llamacpp)")
    p.add_argument("--no-namespace", action="store_true", help="run the draft on loopback, not in a network namespace")
    p.add_argument("--out", type=Path, default=None, help="output folder (default evaluation/results/rtt-<timestamp>/)")
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: {bad or 'none'}; choose from {', '.join(MODES)}")
    if len(set(args.modes)) != len(args.modes):
        p.error("--modes: a mode is named twice")
    if args.prompts < 1 or args.max_tokens < 1:
        p.error("--prompts and --max-tokens must be at least 1")
    return args


def service_env(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """(target env, draft env): only the settings given on the command line."""
    target = {"SPECDEC_TARGET_MODEL": args.target} if args.target else {}
    draft = {k: v for k, v in (("SPECDEC_DRAFT_MODEL", args.draft), ("SPECDEC_DRAFT_BACKEND", args.draft_backend)) if v}
    return target, draft


def request_body(prompt: Prompt, mode: str, max_tokens: int) -> dict[str, Any]:
    """The /v1/generate body of ``mode`` (a key of MODES)."""
    return generate_body(prompt, max_tokens, **MODES[mode])


def run_row(rtt: float, mode: str, prompt: Prompt, order: int, out: dict[str, Any], wall_ms: float) -> dict[str, Any]:
    """What a run keeps of one /v1/generate response (token ids until the equality check)."""
    s = out["stats"]
    ks = [st["k"] for st in out.get("steps", [])]
    return {
        "rtt_ms": rtt, "mode": mode, "prompt_id": prompt.id, "category": prompt.category, "repeat": 0, "order": order,
        "tokens": s["tokens"], "elapsed_ms": s["elapsed_ms"], "wall_ms": round(wall_ms, 3),
        "tokens_per_second": s["tokens_per_second"], "iterations": s["iterations"],
        "draft_tokens": s.get("draft_tokens", 0), "accepted_tokens": s.get("accepted_tokens", 0),
        "acceptance_rate": s["acceptance_rate"], "draft_ms_per_iteration": s["draft_ms_per_iteration"],
        "verify_ms_per_iteration": s["verify_ms_per_iteration"], "overhead_ms_per_iteration": s["overhead_ms_per_iteration"],
        "predrafted_iterations": s.get("predrafted_iterations", 0), "predrafts_dropped": s.get("predrafts_dropped", 0),
        "draft_fallbacks": s.get("draft_fallbacks", 0),
        "steps": len(ks), "mean_k": sum(ks) / len(ks) if ks else None, "k_sequence": ks,
        "token_ids": out["token_ids"],
    }


def check_equality(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set ``identical`` (and ``first_mismatch``) of every speculative row against the autoregressive
    row of the same RTT and prompt (None without one); drop the token ids. Returns the mismatches."""
    refs = {(r["rtt_ms"], r["prompt_id"]): r["token_ids"] for r in rows if r["mode"] == BASELINE}
    mismatches = []
    for r in rows:
        ref = refs.get((r["rtt_ms"], r["prompt_id"]))
        if r["mode"] == BASELINE or ref is None:
            r["identical"], r["first_mismatch"] = None, None
        else:
            r["first_mismatch"] = first_difference(ref, r["token_ids"])
            r["identical"] = r["first_mismatch"] is None
            if not r["identical"]:
                mismatches.append({k: r[k] for k in ("rtt_ms", "mode", "prompt_id", "first_mismatch")})
    for r in rows:
        r.pop("token_ids", None)
    return mismatches


def _median(values: Sequence[float]) -> float | None:
    return spread(values)["median"] if values else None


def summarise(rows: Sequence[dict[str, Any]], rtts: Sequence[dict[str, Any]], modes: Sequence[str]) -> list[dict[str, Any]]:
    """One entry per (RTT, mode) with runs, in RTT order then ``modes`` order. ``rtts``: the
    :func:`measure_rtt` results (``nominal_ms``, ``added_ms``)."""
    out = []
    for m in rtts:
        at = [r for r in rows if r["rtt_ms"] == m["nominal_ms"]]
        base = [tokens_per_second(r) for r in at if r["mode"] == BASELINE]
        base_median = _median(base)
        for mode in modes:
            rs = [r for r in at if r["mode"] == mode]
            if not rs:
                continue
            tps = spread([tokens_per_second(r) for r in rs])
            s: dict[str, Any] = {"rtt_ms": m["nominal_ms"], "measured_rtt_ms": m.get("added_ms"), "mode": mode,
                                 "runs": len(rs), "tokens_per_second": tps}
            if mode != BASELINE and base_median:
                paired = paired_speedup(list(at), mode, BASELINE)
                s["vs_autoregressive"] = {"ratio_of_medians": tps["median"] / base_median,
                                          "median_of_ratios": paired["median"] if paired else None,
                                          "per_prompt": paired}
            else:
                s["vs_autoregressive"] = None
            steps = sum(r["steps"] for r in rs if r.get("mean_k") is not None)
            k_sum = sum(r["mean_k"] * r["steps"] for r in rs if r.get("mean_k") is not None)
            iterations = sum(r["iterations"] for r in rs)
            drafted = sum(r.get("draft_tokens", 0) for r in rs)
            s.update({
                "mean_k": k_sum / steps if steps and mode != BASELINE else None,
                "acceptance_rate": sum(r.get("accepted_tokens", 0) for r in rs) / drafted if drafted else None,
                "predrafted_share": sum(r["predrafted_iterations"] for r in rs) / iterations if iterations else None,
                "tokens_per_iteration": sum(r["tokens"] for r in rs) / iterations if iterations else None,
                "draft_ms_per_iteration": mean([r["draft_ms_per_iteration"] for r in rs]),
                "verify_ms_per_iteration": mean([r["verify_ms_per_iteration"] for r in rs]),
                "overhead_ms_per_iteration": mean([r["overhead_ms_per_iteration"] for r in rs]),
                "draft_fallbacks": sum(r.get("draft_fallbacks", 0) for r in rs),
                "compared": sum(r.get("identical") is not None for r in rs),
                "mismatches": sum(r.get("identical") is False for r in rs),
            })
            out.append(s)
    return out


def _mismatch_cell(s: dict[str, Any]) -> str:
    return f"{s['mismatches']}/{s['compared']}" if s["compared"] else "–"


def _vs(s: dict[str, Any], key: str) -> str:
    return report.fmt((s.get("vs_autoregressive") or {}).get(key), 2, "×")


COLUMNS: list[tuple[str, report.Cell]] = [
    ("RTT (ms)", lambda s: f"{s['rtt_ms']:g}"),
    ("measured (ms)", lambda s: report.fmt(s["measured_rtt_ms"], 1)),
    ("mode", lambda s: s["mode"]),
    ("tok/s (median)", lambda s: report.fmt(s["tokens_per_second"]["median"])),
    ("vs AR (ratio of medians)", lambda s: _vs(s, "ratio_of_medians")),
    ("vs AR (median of ratios)", lambda s: _vs(s, "median_of_ratios")),
    ("mean k", lambda s: report.fmt(s["mean_k"], 2)),
    ("acceptance", lambda s: report.fmt(report.pct(s["acceptance_rate"]), 0, "%")),
    ("predrafted", lambda s: report.fmt(report.pct(s["predrafted_share"]), 0, "%") if s["mode"] != BASELINE else "–"),
    ("draft / verify ms per iter", lambda s: f"{report.fmt(s['draft_ms_per_iteration'])} / "
                                             f"{report.fmt(s['verify_ms_per_iteration'])}"),
    ("mismatches", _mismatch_cell),
]


def render_table(summary: Sequence[dict[str, Any]]) -> str:
    return report.markdown_table(summary, COLUMNS)


def render_markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    services = results.get("services") or {}
    target = (services.get("target") or {}).get("model_id", "?")
    draft = services.get("draft") or {}
    where = (f"in network namespace `{results['namespace_name']}` ({DRAFT_ADDRESS}, veth from {HOST_ADDRESS})"
             if results["namespace"] else f"on loopback (no network namespace: {results.get('namespace_error') or '?'})")
    mismatches = results["mismatches"]
    lines = [
        f"# Round trip to the draft {results['started']}", "",
        f"Command: `{results['command']}`", "",
        f"Target `{target}` on loopback; draft `{draft.get('model_id', '?')}` ({draft.get('backend', '?')}) {where}, "
        f"reached through a delay proxy on 127.0.0.1. {len(results['prompts'])} prompt{'s' * (len(results['prompts']) != 1)} "
        f"({', '.join(results['prompts'])}), {results['settings']['max_tokens']} new tokens each (EOS ignored), greedy, "
        f"one request at a time. Run took {results['duration_s'] / 60:.1f} min.", "",
        report.machine_line(m), "",
        "RTT: the round trip added to every draft call (nominal); measured: median of "
        f"{RTT_CALLS} `Info` calls through the proxy minus the median of {RTT_CALLS} straight to the draft. "
        "tok/s: the orchestrator's tokens per second of generation; vs AR: against autoregressive at the same RTT. "
        "Predrafted: share of steps whose draft was made while the previous block was verified.", "",
        render_table(results["summary"]), "",
        "### Token equality", "",
    ]
    if mismatches:
        cols: list[tuple[str, report.Cell]] = [("RTT (ms)", lambda x: f"{x['rtt_ms']:g}"), ("mode", lambda x: x["mode"]),
                                                ("prompt", lambda x: x["prompt_id"]),
                                                ("first differing position", lambda x: str(x["first_mismatch"]))]
        lines += [report.markdown_table(mismatches, cols), ""]
    elif any(s["compared"] for s in results["summary"]):
        lines += ["Every speculative run produced exactly the ids of autoregressive decoding of its prompt at the same RTT.",
                  ""]
    else:
        lines += ["Not checked (no autoregressive runs).", ""]
    return "\n".join(lines)


# ---- the benchmark --------------------------------------------------------------------------------------

def generate(http: Any, url: str, prompt: Prompt, mode: str, max_tokens: int) -> tuple[dict[str, Any], float]:
    """One /v1/generate of ``mode``: (the response, wall ms on the client)."""
    return post_json(http, url + "/v1/generate", request_body(prompt, mode, max_tokens), f"{mode} on {prompt.id}")


def run_benchmark(args: argparse.Namespace, url: str, proxy: FaultProxy, direct: str, prompts: list[Prompt],
                  stack: Stack) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    rtts: list[dict[str, Any]] = []
    with sync_client() as http:
        info = http.get(url + "/v1/info").json()
        for rtt in args.rtt_ms:
            proxy.delay(rtt / 2)
            m = measure_rtt(rtt, direct, f"127.0.0.1:{proxy.port}")
            rtts.append(m)
            logger.info("RTT %g ms: measured %.2f ms added (Info median %.2f ms through the proxy, %.2f ms straight)",
                        rtt, m["added_ms"], m["proxied_ms"]["median"], m["direct_ms"]["median"])
            for mode in args.modes:  # untimed; also lets the cost model learn the new round trip
                generate(http, url, prompts[0], mode, args.max_tokens)
            for i, prompt in enumerate(prompts):
                for order, mode in enumerate(rotation(list(args.modes), i)):
                    out, wall = generate(http, url, prompt, mode, args.max_tokens)
                    stack.check()
                    row = run_row(rtt, mode, prompt, order, out, wall)
                    rows.append(row)
                    logger.info("RTT %g ms, %s, %s: %.1f tok/s, %d iterations, mean k %s, %d predrafted, %d draft fallbacks",
                                rtt, prompt.id, mode, row["tokens_per_second"], row["iterations"],
                                report.fmt(row["mean_k"], 2), row["predrafted_iterations"], row["draft_fallbacks"])
                    if row["draft_fallbacks"]:
                        logger.warning("%s at RTT %g ms: %d steps ran without a draft (draft call failed or timed out)",
                                       mode, rtt, row["draft_fallbacks"])
    mismatches = check_equality(rows)
    for x in mismatches:
        logger.warning("mismatch: %s at RTT %g ms on %s, first at position %s", x["mode"], x["rtt_ms"], x["prompt_id"],
                       x["first_mismatch"])
    if BASELINE not in args.modes:
        logger.warning("no autoregressive runs: no speedups and no token equality check")
    return {"info": info, "rows": rows, "rtts": rtts, "mismatches": mismatches}


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so try/finally tears the namespace down on SIGTERM as on Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, command = report.start_run("evaluation.rtt", argv, args.out, "rtt-")
    prompts = select(load_suite(), args.prompts, None)
    started = datetime.now().isoformat(timespec="seconds")
    t_start = time.perf_counter()
    machine = report.machine_info()
    measured = measure(args, out / "logs", prompts)
    machine["load_average_end"] = list(os.getloadavg())

    summary = summarise(measured["rows"], measured["rtts"], args.modes)
    results = {
        "started": started, "duration_s": round(time.perf_counter() - t_start, 1), "command": command,
        "args": report.args_record(args), "machine": machine, "services": measured["info"],
        "namespace": measured["namespace"], "namespace_name": measured["namespace_name"],
        "namespace_error": measured["namespace_error"], "draft_address": measured["draft_address"],
        "suite": {"version": SUITE_VERSION, "digest": suite_digest()}, "prompts": [p.id for p in prompts],
        "settings": {"max_tokens": args.max_tokens, "temperature": 0, "modes": {m: MODES[m] for m in args.modes},
                     "rtt_calls": RTT_CALLS},
        "rtts": measured["rtts"], "mismatches": measured["mismatches"], "summary": summary, "rows": measured["rows"],
    }
    report.write_report(out, results, render_markdown(results), "rtt.json", "rtt.md")
    logger.info("done in %.0f s: %s", results["duration_s"], out)
    print(render_table(summary))
    return 1 if measured["mismatches"] else 0


def measure(args: argparse.Namespace, log_dir: Path, prompts: list[Prompt]) -> dict[str, Any]:
    """The services started (the draft in its namespace where it can be, behind the delay proxy),
    :func:`run_benchmark`, everything stopped and the namespace removed again, on SIGTERM too."""
    target_env, draft_env = service_env(args)
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(log_dir)
    netns = Namespace()
    proxy: FaultProxy | None = None

    def teardown() -> None:
        stack.close()  # the draft first among them: a namespace with a process in it outlives its deletion
        if proxy is not None:
            proxy.stop()
        netns.down()

    atexit.register(teardown)
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    try:
        namespace, why_not = _namespace(args, netns)
        host = DRAFT_ADDRESS if namespace else "127.0.0.1"
        logger.info("starting the services (logs in %s)", log_dir)
        target_port = stack.model_service("target", "target", target_env)
        draft_port = free_port()
        env = {"SPECDEC_DRAFT_HOST": host, "SPECDEC_DRAFT_PORT": str(draft_port),
               "SPECDEC_DRAFT_METRICS_PORT": str(free_port()), **draft_env}
        draft = Service("draft", "draft_service", env, log_dir, prefix=netns.exec_prefix() if namespace else ())
        stack.services.append(draft)
        logger.info("starting draft on %s:%d", host, draft_port)
        wait_grpc(draft_port, draft, host=host)
        proxy = draft_proxy(host, draft_port).start()
        logger.info("delay proxy 127.0.0.1:%d -> %s:%d", proxy.port, host, draft_port)
        url = stack.orchestrator("orchestrator", f"127.0.0.1:{proxy.port}", target_port)
        measured = run_benchmark(args, url, proxy, f"{host}:{draft_port}", prompts, stack)
    finally:
        teardown()
        atexit.unregister(teardown)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return {**measured, "namespace": namespace, "namespace_name": netns.name if namespace else None,
            "namespace_error": why_not, "draft_address": f"{host}:{draft_port}"}


def _namespace(args: argparse.Namespace, netns: Namespace) -> tuple[bool, str | None]:
    """(whether the draft gets ``netns``, why not): up unless --no-namespace or it cannot be made."""
    if args.no_namespace:
        logger.info("--no-namespace: the draft runs on loopback")
        return False, "--no-namespace"
    try:
        netns.up()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        why_not = f"{type(exc).__name__}: {exc}"
        logger.warning("no network namespace (%s): the draft runs on loopback instead", why_not)
        return False, why_not
    return True, None


if __name__ == "__main__":
    raise SystemExit(main())
