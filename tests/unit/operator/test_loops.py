"""The job loops' periodic resync is jittered, so 50 jobs started together do not reconcile
as one burst every period (a burst delayed every step report in flight)."""

from __future__ import annotations

import gc
import random

from rlpacer.operator.handlers import resync_wait
from rlpacer.operator.main import freeze_startup_heap


def test_resync_wait_never_exceeds_the_period_and_spreads_a_herd() -> None:
    rng = random.Random(0)
    period = 30.0
    first = [resync_wait(period, True, rng) for _ in range(50)]
    later = [resync_wait(period, False, rng) for _ in range(500)]
    assert all(0.05 * period <= w <= period for w in first)
    assert all(0.8 * period <= w <= period for w in later)
    # 50 loops that start together: their first resyncs land all over the period
    assert max(first) - min(first) > 0.6 * period
    assert len({round(w, 1) for w in first}) > 40
    # and each later pass moves a loop by up to a fifth of the period
    assert max(later) - min(later) > 0.15 * period


def test_freeze_startup_heap_moves_live_objects_out_of_the_collector() -> None:
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
