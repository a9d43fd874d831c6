"""A pytest plugin (loaded by conftest.py): one closing line that counts the skipped tests by reason, so a skip
that is new, or one that the README would call tested, is seen at the end of `make test`:

    skipped by reason: 12 x needs a CUDA device; CI has none | 1 x could not import 'wandb': ...
"""

from __future__ import annotations

from collections import Counter


def skip_reasons(reports) -> Counter:
    """reason -> number of skipped tests, from pytest's skipped reports."""
    reasons: Counter = Counter()
    for rep in reports:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    return reasons


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    reasons = skip_reasons(terminalreporter.stats.get("skipped", []))
    if reasons:
        terminalreporter.write_line("skipped by reason: " + " | ".join(f"{n} x {r}" for r, n in reasons.most_common()))
