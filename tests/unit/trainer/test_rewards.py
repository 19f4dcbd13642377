"""Rewards scored off the critical path, with a per-call timeout."""

from __future__ import annotations

import time

import pytest

from rlpacer_trainer.rewards import RewardScorer

pytestmark = pytest.mark.unit


def test_scores_and_timeouts() -> None:
    def fn(x: float) -> float:
        if x < 0:
            time.sleep(1.0)
        return x

    s = RewardScorer(fn, timeout_s=0.2, workers=2)
    s.submit("a", 1.0)
    s.submit("b", -1.0)
    s.submit("c", 0.5)
    out, waited = s.collect()
    assert out == {"a": 1.0, "b": 0.0, "c": 0.5}
    assert s.timeouts == 1 and waited < 0.9
    s.close()
