"""Rewards scored off the critical path (RollPacker's reward stage).

Each response is submitted for scoring the moment it finishes, while the rest of the round is
still generating; the driver only waits for whatever is unfinished when the rollout ends (the
``reward`` seconds of a step report are that wait, not the total scoring time). Every call
has a timeout: a call that overruns scores 0.0 and is counted; Python threads cannot be
killed, so the overrunning call finishes in the background and its result is ignored.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Hashable
from typing import Any


class RewardScorer:
    """Scores responses on a small thread pool; ``collect`` waits with per-call timeouts."""

    def __init__(self, fn: Callable[..., float], timeout_s: float, workers: int = 2) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self.pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self.pending: dict[Hashable, tuple[cf.Future[float], float]] = {}
        self.timeouts = 0

    def submit(self, key: Hashable, *args: Any) -> None:
        self.pending[key] = (self.pool.submit(self.fn, *args), time.monotonic())

    def collect(self) -> tuple[dict[Hashable, float], float]:
        """All pending scores and the seconds spent waiting for them."""
        t0 = time.monotonic()
        out: dict[Hashable, float] = {}
        for key, (fut, started) in self.pending.items():
            left = self.timeout_s - (time.monotonic() - started)
            try:
                out[key] = float(fut.result(timeout=max(0.0, left)))
            except cf.TimeoutError:
                self.timeouts += 1
                out[key] = 0.0
        self.pending.clear()
        return out, time.monotonic() - t0

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
