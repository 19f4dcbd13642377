"""Shared pytest configuration for every tier."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# The `cluster` (session) and `namespace` fixtures: a real local Kubernetes control plane,
# shared by tests/integration and tests/e2e. It starts only when a test asks for it.
pytest_plugins = ["rlpacer.testing.pytest_plugin"]

ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to test code that is not this checkout's (a shared environment pointing elsewhere)."""
    import rlpacer
    import rlpacer_trainer

    for mod in (rlpacer, rlpacer_trainer):
        where = Path(mod.__file__ or "").resolve()
        if ROOT not in where.parents:
            pytest.exit(
                f"{mod.__name__} is imported from {where}, outside the checkout under test "
                f"({ROOT}): run the tests with this checkout's environment "
                f"({ROOT}/.venv/bin/python, made by bash scripts/setup.sh)", returncode=4)


# --- Where the time goes: wall clock per tier and per module, printed before pytest's last line ---
# A test's setup + call + teardown, attributed to its tier (tests/<tier>/...) and its module; a
# session fixture's start-up (the control plane, a Ray cluster) lands in the first test that asks
# for it. scripts/test.sh passes its own set-up and lint times in RLPACER_TIME_SETUP/_LINT, so a
# CI log's summary shows the whole budget in one table.
_TIER_S: dict[str, float] = {}
_TIER_N: dict[str, int] = {}
_MODULE_S: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    parts = Path(path).parts
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
    _TIER_S[tier] = _TIER_S.get(tier, 0.0) + report.duration
    _MODULE_S[path] = _MODULE_S.get(path, 0.0) + report.duration
    if report.when == "call":
        _TIER_N[tier] = _TIER_N.get(tier, 0) + 1


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:4.1f} s"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _TIER_S:
        return
    tr = terminalreporter
    tr.section("wall clock: set-up, lint and each tier")
    rows: list[tuple[str, str, float]] = []
    for step, var in (("set-up", "RLPACER_TIME_SETUP"), ("lint", "RLPACER_TIME_LINT")):
        raw = os.environ.get(var, "")
        if raw.replace(".", "", 1).isdigit():
            rows.append((step, "", float(raw)))
    for tier in ("unit", "setup", "integration", "e2e", "container", "other"):
        if tier in _TIER_S:
            rows.append((tier, f"{_TIER_N.get(tier, 0)} tests", _TIER_S[tier]))
    for name, what, seconds in rows:
        tr.write_line(f"{name:<12} {what:>10}  {_minutes(seconds):>14}  ({seconds:7.1f} s)")
    total = sum(s for _, _, s in rows)
    tr.write_line(f"{'total':<12} {'':>10}  {_minutes(total):>14}  ({total:7.1f} s)")
    slowest = sorted(_MODULE_S.items(), key=lambda kv: -kv[1])[:15]
    tr.write_line("slowest modules:")
    for path, seconds in slowest:
        tr.write_line(f"  {seconds:7.1f} s  {path}")
