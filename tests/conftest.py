"""Shared pytest configuration for every tier."""

from __future__ import annotations

from pathlib import Path

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
