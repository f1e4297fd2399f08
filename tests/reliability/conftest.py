"""Reliability suite: fixtures of its own and the summary printed at the end of the run.

Tests add lines with :func:`tests.reliability.helpers.summarize`; they are printed after pytest's
own summary, so the figures of a run can be read (and copied) in one place.
"""

from __future__ import annotations

from tests.reliability import helpers


def pytest_terminal_summary(terminalreporter) -> None:
    if not helpers.SUMMARY:
        return
    terminalreporter.write_sep("=", "reliability figures")
    for line in helpers.SUMMARY:
        terminalreporter.write_line(line)
