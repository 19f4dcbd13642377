"""The planner's forecast of the next long round (``rounds_until_long``) and the rule that
times an early scale-up by it (``ask_early``)."""

from __future__ import annotations

import random

import pytest
from test_tail_batching import run_round

from rlpacer.control.tail_batching import (
    RoundKind,
    TailBatchingConfig,
    TailBatchingPlanner,
    ask_early,
)

pytestmark = pytest.mark.unit


def test_forecast_counts_the_short_rounds_before_each_long_round() -> None:
    # P0=4, eta=1.25: each full short round launches 5 and defers exactly 1, so once one
    # round has been seen the forecast is exact: 4 short rounds, then a long one
    cfg = TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.25, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=100, seed=1)
    rng = random.Random(0)
    assert planner.rounds_until_long() is None  # nothing queued yet, nothing seen
    forecasts: list[int | None] = []
    kinds: list[RoundKind] = []
    for _ in range(12):
        kinds.append(planner.next_round_kind)
        run_round(planner, 3, rng)
        forecasts.append(planner.rounds_until_long())
    # after each round: how many short rounds remain before the next long one
    actual = []
    for i in range(len(kinds) - 1):
        nxt = kinds[i + 1:]
        actual.append(nxt.index(RoundKind.LONG) if RoundKind.LONG in nxt else None)
    known = [(f, a) for f, a in zip(forecasts, actual, strict=False) if a is not None]
    assert len(known) == 9 and all(f == a for f, a in known), (forecasts, kinds)
    assert forecasts[:5] == [3, 2, 1, 0, 4]


def test_forecast_sees_the_epoch_flush_and_is_none_when_disabled_or_done() -> None:
    # 10 prompts, P0=4, eta=1.25: after one round 5 fresh prompts remain and 1 is queued;
    # the queue would need 3 more rounds, the epoch's fresh prompts run out after 1
    cfg = TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.25, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=10, seed=1)
    run_round(planner, 3, random.Random(0))
    assert planner.long_queue_len == 1 and planner.position == 5
    assert planner.rounds_until_long() == 1
    run_round(planner, 3, random.Random(1))
    assert planner.next_round_kind is RoundKind.LONG and planner.rounds_until_long() == 0
    off = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4, enabled=False), 10, seed=1)
    run_round(off, 3, random.Random(0))
    assert off.rounds_until_long() is None
    while not planner.done:
        run_round(planner, 3, random.Random(2))
    assert planner.rounds_until_long() is None


def test_forecast_survives_a_state_round_trip_and_old_states_start_it_over() -> None:
    cfg = TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.25, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=100, seed=1)
    run_round(planner, 3, random.Random(0))
    state = planner.state_dict()
    assert TailBatchingPlanner.from_state_dict(state).rounds_until_long() == 3
    old = {k: v for k, v in state.items() if k != "queued_recent"}  # written before it
    restored = TailBatchingPlanner.from_state_dict(old)
    # nothing seen: the forecast falls back to the epoch's end (queue not empty)
    assert restored.rounds_until_long() == 19  # ceil(95 fresh / 5 launched)


@pytest.mark.parametrize(("rounds", "step_s", "lead_s", "ask"), [
    (None, 1.0, 60.0, False),  # nothing forecast
    (0, 1.0, 60.0, False),  # the next round is long: the ordinary scale-up
    (1, 30.0, 60.0, True),  # one short round left: ask now, whatever the lead
    (3, 30.0, 60.0, False),  # waiting one report still leaves 2 x 30 = 60 s: not yet
    (3, 29.0, 60.0, True),  # waiting would leave 58 s < 60 s
    (10, 1.0, 0.0, False),  # lead 0: never early
])
def test_ask_early_when_waiting_one_more_report_would_be_too_late(
        rounds: int | None, step_s: float, lead_s: float, ask: bool) -> None:
    assert ask_early(rounds, step_s, lead_s) is ask


def test_forecast_is_exact_across_epoch_ends() -> None:
    # 22 prompts an epoch, 3 epochs: four full rounds (5 launched, 1 deferred each), the
    # long round, then a last round of the 2 fresh prompts left (kept, none queued) before
    # the next epoch. The forecast after every round names the rounds that follow: the
    # epoch's last round neither counts as the queue's rate nor hides the next epoch's
    cfg = TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.25, extra_responses=1)
    planner = TailBatchingPlanner(cfg, num_prompts=22, seed=1, epochs=3)
    rng = random.Random(0)
    kinds: list[RoundKind] = []
    forecasts: list[int | None] = []
    while not planner.done:
        kinds.append(planner.next_round_kind)
        run_round(planner, 3, rng)
        forecasts.append(planner.rounds_until_long())
    actual = [kinds[i + 1:].index(RoundKind.LONG) if RoundKind.LONG in kinds[i + 1:] else None
              for i in range(len(kinds))]
    assert kinds.count(RoundKind.LONG) == 3 and len(kinds) == 18
    assert forecasts == actual, list(zip(kinds, forecasts, actual, strict=True))
