"""``python -m specdec.launch`` (``make run``): the whole stack on one machine.

Starts the draft service, the target service, the orchestrator and the dashboard under honcho
(a Foreman-style process manager: prefixed output, and one process exiting stops them all),
waits until the orchestrator reports ready, prints where to go, and stops everything on Ctrl-C.
Every process is started with the same ``python -m <package>`` command the containers use.
Configuration passes through the environment (SPECDEC_* variables, see docs/configuration.md);
``SPECDEC_PAIR=gpt2`` picks the GPT-2 / DistilGPT-2 pair, as in compose.yaml.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import threading
import time
import urllib.request

# name -> module run with `python -m`; the order is the start order.
PROCESSES: dict[str, str] = {
    "draft": "draft_service",
    "target": "target_service",
    "orchestrator": "orchestrator",
    "ui": "ui",
}


# SPECDEC_PAIR=<name>: each pair's model settings, as compose.yaml's pair-<name> entries (a test
# keeps the two equal); a variable set in the environment wins over its pair's value.
PAIRS: dict[str, dict[str, str]] = {
    "embedded": {"SPECDEC_TARGET_MODEL": "embedded", "SPECDEC_DRAFT_MODEL": "embedded",
                 "SPECDEC_DRAFT_BACKEND": "auto"},
    # DistilGPT-2 converted to GGUF (Q8_0) on the draft's first start (specdec.model.gguf_convert)
    "gpt2": {"SPECDEC_TARGET_MODEL": "gpt2", "SPECDEC_DRAFT_MODEL": "distilgpt2",
             "SPECDEC_DRAFT_BACKEND": "auto", "SPECDEC_DRAFT_QUANT": "q8_0"},
}


def pair_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the settings of the pair SPECDEC_PAIR names (default ``embedded``) filled in."""
    name = env.get("SPECDEC_PAIR") or "embedded"
    if name not in PAIRS:
        raise SystemExit(f"error: unknown SPECDEC_PAIR {name!r}; choose one of {', '.join(PAIRS)}")
    return {**PAIRS[name], **env}


def commands(python: str = "python") -> dict[str, list[str]]:
    """The command of each process, as run here and in the containers."""
    return {name: [python, "-m", module] for name, module in PROCESSES.items()
            if importlib.util.find_spec(f"{module}.__main__") is not None}


def _wait_ready(url: str, timeout_s: float, printer) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    printer(url)
                    return
        except Exception:
            pass
        time.sleep(1.0)
    printer(None)


def main(argv: list[str] | None = None) -> int:
    from honcho.manager import Manager

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(PROCESSES), help="start only these processes")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    args = parser.parse_args(argv)

    env = pair_environment(dict(os.environ))
    env.setdefault("PYTHONUNBUFFERED", "1")
    manager = Manager()
    cmds = commands(sys.executable)
    for name, cmd in cmds.items():
        if args.only and name not in args.only:
            continue
        manager.add_process(name, " ".join(cmd), env=env, cwd=os.getcwd())

    host = "localhost"
    api = f"http://{host}:{env.get('SPECDEC_ORCHESTRATOR_PORT', '8000')}"
    ui = f"http://{host}:{env.get('SPECDEC_UI_PORT', '8501')}"

    def announce(url: str | None) -> None:
        if url is None:
            sys.stdout.write(f"\n*** the stack did not become ready in {args.ready_timeout:.0f} s; see the logs above\n\n")
        else:
            lines = [f"API        {api}   (OpenAPI docs: {api}/docs)", f"OpenAI API {api}/v1"]
            if "ui" in cmds and (not args.only or "ui" in args.only):
                lines.insert(0, f"Dashboard  {ui}")
            sys.stdout.write("\n*** specdec is ready\n" + "".join(f"***   {line}\n" for line in lines)
                             + "*** Ctrl-C stops everything\n\n")
        sys.stdout.flush()

    if not args.only or "orchestrator" in args.only:
        threading.Thread(target=_wait_ready, args=(api, args.ready_timeout, announce), daemon=True).start()
    manager.loop()
    return manager.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
