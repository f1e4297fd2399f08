"""``python -m ui``: serve the dashboard with Streamlit (default port 8501)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ui.settings import UISettings

APP = Path(__file__).resolve().with_name("app.py")


def command(settings: UISettings | None = None) -> list[str]:
    """The ``streamlit run`` command line the dashboard is served with."""
    settings = settings or UISettings()
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.port", str(settings.port),
        "--server.headless", "true",
        "--server.address", settings.host,
        "--browser.gatherUsageStats", "false",
        # nothing edits the page in production; watching files only costs CPU
        "--server.fileWatcherType", "none",
        # a viewer's toolbar: no "Deploy" button
        "--client.toolbarMode", "viewer",
    ]


def main() -> None:
    settings = UISettings()
    if settings.orchestrator_key() and not settings.dashboard_password():
        print("warning: the dashboard generates with SPECDEC_UI_API_KEY and asks no password: whoever reaches "
              f"{settings.host}:{settings.port} uses the key; set SPECDEC_UI_PASSWORD(_FILE) (docs/security.md)",
              file=sys.stderr, flush=True)
    cmd = command(settings)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
