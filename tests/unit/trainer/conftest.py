"""Fixtures shared by the trainer's unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def close_drivers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each driver built by ``runtime.build_driver`` in the test has its reward workers stopped
    with the test, not with the session."""
    from rlpacer_trainer import runtime

    made: list[Any] = []
    real = runtime.build_driver

    def build(*args: Any, **kw: Any) -> Any:
        made.append(real(*args, **kw))
        return made[-1]

    monkeypatch.setattr(runtime, "build_driver", build)
    yield
    for drv in made:
        drv.close()
