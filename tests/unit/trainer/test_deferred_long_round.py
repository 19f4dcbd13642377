"""Deferred long rounds (``tailBatching.longRound.maxDeferredRounds``): while a due long
round's extra rollout replicas are not ready (a queue has not admitted them: the burst pool is
busy), the driver runs short rounds in its place instead of waiting, and the long round runs
once its replicas are there, on them, with every prompt still trained exactly once.

The plan logic is the in-process controller behind the operator's own scaler (as the
operator's report handler calls it, ``deferred`` computed as ``accept_report`` computes it):
the long round's extra replica is Ready ``HOLD_S`` after the scale-up asked for it (the
queue's wait). Each case runs the same job without deferral (max 0) as its baseline."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_driver_fake_engine import LoggedEngine
from test_early_scale_up import OperatorCapacity, SlowEngine

from rlpacer.api.job import TailBatchingActivation
from rlpacer_trainer import runtime
from rlpacer_trainer.config import RunConfig

pytestmark = pytest.mark.unit
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"
HOLD_S = 1.5  # the queue admits the long round's extra replica this long after the ask


class QueuedCapacity(OperatorCapacity):
    """The extra replica is Ready ``HOLD_S`` after it was asked for (Kueue's admission and
    the pod's start)."""

    ready_after_s = HOLD_S


def _run(max_deferred: int, steps: int = 10) -> tuple[Any, QueuedCapacity, float]:
    cfg = RunConfig.load(EXAMPLE, steps=steps)
    cfg.job.spec.prompts_per_step = 4
    cfg.job.spec.tail_batching.activation = TailBatchingActivation("Always")
    cfg.job.spec.tail_batching.long_round.rollout_replicas = 2
    cfg.job.spec.tail_batching.long_round.max_deferred_rounds = max_deferred
    cfg.job.spec.tail_batching.long_round.min_yield_ratio = "0"  # type: ignore[assignment]
    log: list[tuple[object, ...]] = []

    def factory(r: int) -> LoggedEngine:
        log.append(("start", r))
        return SlowEngine(r, log)

    ctl = QueuedCapacity(cfg)
    drv = runtime.build_driver(cfg, [SlowEngine(0, log)], controller=ctl, engine_factory=factory,
                               offered_replicas=lambda: set(range(8)))
    drv.join_wait_s = 0.0
    t0 = time.perf_counter()
    try:
        drv.run()
    finally:
        drv.close()
    return drv, ctl, time.perf_counter() - t0


def test_short_rounds_run_in_a_pending_long_rounds_place_and_it_runs_on_its_replicas() -> None:
    drv, ctl, _ = _run(max_deferred=8)
    recs = drv.records
    kinds = [r["round_kind"] for r in recs]
    deferred = [r for r in recs if r["deferred_long_round"]]
    print([(r["step"], r["round_kind"], r["deferred_long_round"],
            round(r["seconds_capacity_wait"], 2), r["replicas"]) for r in recs])
    # the long round was due (the plan said Long, ScalingUp) and short rounds ran instead
    assert deferred, kinds
    assert all(r["round_kind"] == "Short" and r["seconds_capacity_wait"] < HOLD_S / 3
               for r in deferred), deferred
    # the operator's scaler counted each and restarted the wait: LongRoundDeferred Events,
    # status.rollout.deferredRounds, no time-out, and it starts over once the long round ran
    n_ev = sum(1 for e in ctl.events if e.reason == "LongRoundDeferred")
    assert 1 <= n_ev <= len(deferred), ctl.events
    assert max(ctl.deferred_counts) >= 2, ctl.deferred_counts  # in a row, counted
    assert not any(a.reason == "ScaleUpTimedOut" for a in ctl.actions), ctl.actions
    # then the long round ran, on both replicas, each generating part of it
    longs = [r for r in recs if r["round_kind"] == "Long"]
    assert longs and kinds.index("Long") > recs.index(deferred[0]), kinds
    for r in longs:
        assert r["replicas"] == [0, 1], r
        assert {e["replica"] for e in r["engines"] if e["responses"] > 0} == {0, 1}, r
    assert ctl.deferred_counts[kinds.index("Long")] == 0, ctl.deferred_counts
    # every prompt trained at most once (one epoch), and the long round trained the prompts
    # that were queued when it was first due
    trained = Counter(p for r in recs for p in r["prompts"])
    assert max(trained.values()) == 1, trained.most_common(3)
    first_due = recs[recs.index(deferred[0]) - 1]
    assert first_due["next_round_kind"] == "Long"


def test_deferral_is_bounded_and_a_job_without_it_waits() -> None:
    """maxDeferredRounds 1: one short round in the long round's place, then the driver waits
    for the rest of the queue's hold; with 0 (the default) the long round waits it all. The
    baseline measured in the same run: the deferred job waited less for capacity."""
    d1, c1, _ = _run(max_deferred=1, steps=6)
    d0, c0, _ = _run(max_deferred=0, steps=6)
    runs = {"1": d1.records, "0": d0.records}
    assert sum(r["deferred_long_round"] for r in runs["1"]) >= 1
    assert not any(r["deferred_long_round"] for r in runs["0"])
    # never two deferred rounds in a row with a bound of 1
    flags = [r["deferred_long_round"] for r in runs["1"]]
    assert not any(a and b for a, b in itertools.pairwise(flags)), flags
    # (one the replicas became ready during is not counted: the report finds them Ready)
    assert 1 <= sum(e.reason == "LongRoundDeferred" for e in c1.events) <= sum(flags)
    assert not any(e.reason == "LongRoundDeferred" for e in c0.events)
    wait = {k: sum(r["seconds_capacity_wait"] for r in v) for k, v in runs.items()}
    print({"capacity_wait_s": wait})
    assert wait["0"] >= HOLD_S * 0.8, wait
    assert wait["1"] < wait["0"], wait
    for recs in runs.values():
        trained = Counter(p for r in recs for p in r["prompts"])
        assert max(trained.values()) == 1
