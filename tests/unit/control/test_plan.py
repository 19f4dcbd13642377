"""JobController: the step-report protocol rules, idempotency, long rounds, state."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlpacer.control.errors import ConfigError, StateError
from rlpacer.control.plan import (
    JobController,
    JobControllerConfig,
    LengthStats,
    ReportRejected,
    StepReportData,
    StepSecondsData,
)
from rlpacer.control.sagc import GroupControlMode, SAGCConfig
from rlpacer.control.tail_batching import RoundKind

pytestmark = pytest.mark.unit


def report(
    jc: JobController,
    *,
    step: int | None = None,
    attempt: int | None = None,
    g: int | None = None,
    kind: RoundKind = RoundKind.SHORT,
    next_kind: RoundKind = RoundKind.SHORT,
    max_len: float = 300.0,
    median: float = 100.0,
    **lengths: Any,
) -> StepReportData:
    plan = jc.plan()
    ln = {"max": max_len, "median": median, "p90": min(max_len, median * 2), "count": 64}
    return StepReportData(
        attempt=jc.attempt if attempt is None else attempt,
        step=plan.step if step is None else step,
        group_size=plan.group_size if g is None else g,
        round_kind=kind,
        lengths=LengthStats(**(ln | lengths)),
        seconds=StepSecondsData(rollout=10.0, reward=1.0, train=5.0, sync=1.0),
        long_queue=3,
        next_round_kind=next_kind,
        reward=0.5,
    )


def test_initial_plan() -> None:
    jc = JobController(JobControllerConfig(sagc=SAGCConfig(initial=8, radius=0)))
    plan = jc.plan()
    assert (plan.step, plan.group_size, plan.round_kind) == (0, 8, RoundKind.SHORT)
    assert plan.lambda_ == 0.0 and plan.straggler_rate == 0.0 and plan.straggler is None
    assert jc.plan() == plan  # pure


def test_observe_returns_the_next_plan() -> None:
    jc = JobController()
    first = jc.plan()
    nxt = jc.observe(report(jc, max_len=900, next_kind=RoundKind.LONG))
    assert nxt.step == 1 and nxt.round_kind is RoundKind.LONG
    assert nxt.straggler is True and nxt.straggler_rate == 1.0
    assert jc.controller.steps == 1
    assert nxt.lambda_ > 0.0
    assert first.step == 0


def test_long_rounds_do_not_feed_sagc_by_default() -> None:
    jc = JobController()
    jc.observe(report(jc, next_kind=RoundKind.LONG))
    g = jc.plan().group_size
    sagc_state = jc.controller.state_dict()
    plan = jc.observe(report(jc, kind=RoundKind.LONG, max_len=5000))
    assert jc.controller.state_dict() == sagc_state  # SAGC untouched
    assert plan.group_size == g  # its pending decision carries over to the next short round
    assert jc.long_rounds == 1
    assert plan.straggler is True
    # the SLO's rate is over short rounds; the long round is counted apart
    assert jc.straggler_rate == 0.0 and jc.long_round_straggler_rate == 1.0
    assert jc.all_steps_straggler_rate == 0.5


def test_long_rounds_feed_sagc_when_configured() -> None:
    jc = JobController(JobControllerConfig(long_rounds_feed_sagc=True))
    jc.observe(report(jc, kind=RoundKind.LONG, max_len=5000))
    assert jc.controller.steps == 1 and jc.long_rounds == 1


def test_fixed_mode() -> None:
    jc = JobController(JobControllerConfig(mode="Fixed", sagc=SAGCConfig(initial=4)))
    for _ in range(5):
        assert jc.observe(report(jc, max_len=1000)).group_size == 4
    assert jc.lambda_ == 0.0 and jc.posterior_means().keys() == {4}


def test_repeat_is_idempotent_and_a_conflicting_repeat_is_rejected() -> None:
    jc = JobController()
    r = report(jc)
    answer = jc.observe(r)
    state = jc.state_dict()
    assert jc.observe(r) == answer
    assert jc.state_dict() == state
    changed = dataclasses.replace(r, long_queue=99)
    with pytest.raises(ReportRejected) as err:
        jc.observe(changed)
    assert err.value.reason == "ConflictingRepeat"
    assert jc.state_dict() == state


def _rejects(jc: JobController, r: StepReportData, reason: str) -> None:
    state = jc.state_dict()
    with pytest.raises(ReportRejected) as err:
        jc.observe(r)
    assert err.value.reason == reason, err.value
    assert err.value.message
    assert jc.state_dict() == state


def test_step_order_within_an_attempt() -> None:
    jc = JobController()
    jc.observe(report(jc))
    jc.observe(report(jc))
    assert jc.next_step == 2
    _rejects(jc, report(jc, step=3), "StepOutOfOrder")  # skipping ahead
    _rejects(jc, report(jc, step=0), "StepOutOfOrder")  # going backwards


def test_new_attempt_may_restart_at_an_earlier_step() -> None:
    jc = JobController()
    for _ in range(4):
        jc.observe(report(jc))
    learnt = jc.controller.steps
    _rejects(jc, report(jc, attempt=1, step=5), "StepOutOfOrder")  # beyond next (4)
    plan = jc.observe(report(jc, attempt=1, step=2))  # restart from a checkpoint at step 1
    assert plan.step == 3 and jc.attempt == 1
    assert jc.controller.steps == learnt + 1  # what it learnt is kept
    _rejects(jc, report(jc, attempt=0, step=3), "StaleAttempt")
    assert jc.observe(report(jc, attempt=2, step=jc.next_step)).step == 4


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"g": 5}, "GroupSizeNotPlanned"),
        ({"max_len": 50.0, "median": 100.0, "p90": 50.0}, "ImpossibleLengths"),
        ({"median": 0.0, "p90": 0.0, "max_len": 0.0}, "ImpossibleLengths"),
        ({"p90": 400.0}, "ImpossibleLengths"),
        ({"p90": 50.0}, "ImpossibleLengths"),
        ({"count": 0}, "ImpossibleLengths"),
        ({"mean": 301.0}, "ImpossibleLengths"),
        ({"mean": 0.0}, "ImpossibleLengths"),
        ({"mean": float("nan")}, "InvalidReport"),
        ({"mean": -1.0}, "InvalidReport"),
        ({"count": -1}, "InvalidReport"),
        ({"aborted": -2}, "InvalidReport"),
        ({"max_len": float("nan")}, "InvalidReport"),
        ({"max_len": float("inf")}, "InvalidReport"),
        ({"step": -1, "attempt": 1}, "InvalidReport"),
    ],
)
def test_impossible_reports_are_rejected(overrides: dict[str, Any], reason: str) -> None:
    jc = JobController()
    jc.observe(report(jc))
    _rejects(jc, report(jc, **overrides), reason)


def test_negative_seconds_and_queue_are_rejected() -> None:
    jc = JobController()
    r = report(jc)
    _rejects(jc, dataclasses.replace(r, seconds=StepSecondsData(rollout=-1.0)), "InvalidReport")
    _rejects(jc, dataclasses.replace(r, long_queue=-1), "InvalidReport")
    _rejects(jc, dataclasses.replace(r, reward=float("nan")), "InvalidReport")


def test_windowed_straggler_rate() -> None:
    jc = JobController(JobControllerConfig(straggler_window=3))
    rates = [jc.observe(report(jc, max_len=m)).straggler_rate for m in (900, 200, 200, 200, 900)]
    assert rates == pytest.approx([1.0, 0.5, 1 / 3, 0.0, 1 / 3])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"straggler_window": 0}, "straggler_window"),
        ({"mode": "PID"}, "mode"),
        ({"long_rounds_feed_sagc": "no"}, "long_rounds_feed_sagc"),
        ({"sagc": {"delta": 0.2}}, "sagc"),
    ],
)
def test_bad_config(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        JobControllerConfig(**kwargs)
    assert err.value.field == field


@settings(max_examples=30, deadline=None)
@given(
    ratios=st.lists(st.floats(1.0, 30.0), min_size=1, max_size=40),
    split=st.integers(0, 40),
    long_every=st.integers(2, 6),
    mode=st.sampled_from(list(GroupControlMode)),
    feed=st.booleans(),
)
def test_state_round_trip_is_bit_exact(
    ratios: list[float], split: int, long_every: int, mode: GroupControlMode, feed: bool
) -> None:
    cfg = JobControllerConfig(mode=mode, straggler_window=7, long_rounds_feed_sagc=feed)
    jc = JobController(cfg)

    def step(c: JobController, i: int, ratio: float) -> Any:
        kind = RoundKind.LONG if i % long_every == 0 else RoundKind.SHORT
        return c.observe(report(c, kind=kind, max_len=100.0 * ratio, p90=100.0 * ratio))

    split = min(split, len(ratios))
    for i, r in enumerate(ratios[:split]):
        step(jc, i, r)
    text = json.dumps(jc.state_dict(), allow_nan=False)
    clone = JobController.from_state_dict(json.loads(text))
    assert json.dumps(clone.state_dict(), allow_nan=False) == text
    assert clone.plan() == jc.plan()
    last = jc.last_report
    if last is not None:  # the last answer survives the restore: a repeat still gets it
        assert clone.observe(last) == jc.observe(last)
    for i, r in enumerate(ratios[split:], start=split):
        assert step(clone, i, r) == step(jc, i, r)
    assert clone.state_dict() == jc.state_dict()


def test_corrupt_state_is_rejected() -> None:
    state = JobController().state_dict()
    with pytest.raises(StateError):
        JobController.from_state_dict(state | {"kind": "x"})
    with pytest.raises((StateError, ConfigError)):
        JobController.from_state_dict(state | {"next_round_kind": "Medium"})
    bad = json.loads(json.dumps(state))
    bad["controller"]["pending"] = None
    with pytest.raises(StateError, match="pending"):
        JobController.from_state_dict(bad)
