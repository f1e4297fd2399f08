"""Run the health checks of running podman containers, for hosts without systemd.

podman schedules each container's health check with a systemd timer; where systemd is not PID 1
(a plain VM, a CI container) no check ever runs, every container stays `starting`, and compose's
`depends_on: condition: service_healthy` waits forever. This loop does what the timers would:
`podman healthcheck run` for every running container that has a health check, every
`--start-interval` seconds until it is healthy (podman 4 does not know compose's start_interval),
then at the container's own interval. podman itself applies retries and start_period.

    python3 scripts/containers/healthchecks.py [--label com.docker.compose.project=specdec]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

NS = 1e9


def containers(label: str | None) -> list[dict]:
    args = ["podman", "ps", "--format", "json"]
    if label:
        args += ["--filter", f"label={label}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    return json.loads(done.stdout or "[]") if done.returncode == 0 else []


def health_config(cid: str) -> tuple[float, str] | None:
    done = subprocess.run(["podman", "inspect", "--format", "{{json .Config.Healthcheck}}|{{.State.Health.Status}}", cid],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return None
    config, _, status = done.stdout.strip().rpartition("|")
    check = json.loads(config or "null")
    if not check or not check.get("Test") or check["Test"][0] == "NONE":
        return None
    return (check.get("Interval") or 30 * NS) / NS, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", help="only containers with this label (key=value)")
    parser.add_argument("--start-interval", type=float, default=2.0, help="seconds between checks until healthy")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between looks for due checks")
    args = parser.parse_args(argv)
    due: dict[str, float] = {}
    while True:
        now = time.monotonic()
        for c in containers(args.label):
            cid = c["Id"]
            key = f"{cid}@{c.get('StartedAt')}"  # a restarted container is checked as a new one
            if due.get(key, 0) > now:
                continue
            found = health_config(cid)
            if found is None:
                due[key] = now + 3600
                continue
            interval, status = found
            subprocess.run(["podman", "healthcheck", "run", cid], capture_output=True, timeout=120)
            _, status = health_config(cid) or (interval, status)
            due[key] = time.monotonic() + (interval if status == "healthy" else args.start_interval)
        time.sleep(args.poll)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
