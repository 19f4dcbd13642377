"""LongRoundYield: a due long round runs only when it is expected to train."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlpacer.api.protocol import RoundKind
from rlpacer.control.errors import ConfigError, StateError
from rlpacer.control.long_rounds import LongRoundYield, YieldConfig

pytestmark = pytest.mark.unit
S, L = RoundKind.SHORT, RoundKind.LONG


def test_runs_until_both_kinds_were_measured() -> None:
    y = LongRoundYield()
    assert y.should_run_long()  # nothing known
    y.observe(S, 20, 2.0)
    assert y.should_run_long()  # no long round measured yet
    y.observe(L, 0, 2.0)
    assert not y.should_run_long()  # 0 groups/s against 10 groups/s


def test_a_long_round_that_trains_as_well_as_a_short_one_runs() -> None:
    y = LongRoundYield(YieldConfig(min_ratio=0.25))
    y.observe(S, 20, 2.0)  # 10/s
    y.observe(L, 6, 2.0)  # 3/s >= 0.25 * 10/s
    assert y.should_run_long()
    y.observe(L, 1, 4.0)  # the running sums: (1.5 + 0.5) / (0.5 + 2) = 0.8/s < 2.5/s
    assert y.yield_per_s(L) == pytest.approx(2.0 / 2.5)
    assert not y.should_run_long()


def test_probe_after_retiring_several_in_a_row() -> None:
    y = LongRoundYield(YieldConfig(probe_every=3))
    y.observe(S, 20, 2.0)
    y.observe(L, 0, 2.0)
    decisions = []
    for _ in range(3):
        decisions.append(y.should_run_long())
        y.note_retired()
    assert decisions == [False, False, False] and y.should_run_long()  # the probe
    y.observe(L, 0, 2.0)  # the probe ran and still trained nothing
    assert not y.should_run_long() and y.retired_in_a_row == 0 and y.retired_rounds == 3


def test_min_ratio_zero_always_runs() -> None:
    y = LongRoundYield(YieldConfig(min_ratio=0.0))
    y.observe(S, 20, 2.0)
    y.observe(L, 0, 2.0)
    assert y.should_run_long()


def test_state_round_trip_and_old_states() -> None:
    y = LongRoundYield()
    y.observe(S, 20, 2.0)
    y.observe(L, 1, 3.0)
    y.note_retired()
    back = LongRoundYield.from_state_dict(json.loads(json.dumps(y.state_dict())))
    assert back.state_dict() == y.state_dict()
    assert back.should_run_long() == y.should_run_long()
    assert LongRoundYield.from_state_dict(None).state_dict() == LongRoundYield().state_dict()
    with pytest.raises(StateError):
        LongRoundYield.from_state_dict({"sums": {}})


@pytest.mark.parametrize("kw", [{"min_ratio": -0.1}, {"probe_every": 0}, {"smoothing": 0.0},
                                {"smoothing": 1.5}])
def test_bad_config_names_the_field(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        YieldConfig(**kw)  # type: ignore[arg-type]


def test_impossible_observations_are_refused() -> None:
    with pytest.raises(ValueError):
        LongRoundYield().observe(S, -1, 1.0)
    with pytest.raises(ValueError):
        LongRoundYield().observe(S, 1, float("nan"))


# --- the planner retires due long rounds that do not pay ---------------------------------
def _epochs_of(ratio: float, *, epochs: int = 2, state_every: int = 0
               ) -> tuple[list[tuple[int, str, list[int]]], Any]:
    """Drives a planner (P0=4, G=4, every short round races 8 prompts) over ``epochs`` epochs
    of 40 prompts, as on the tiny task: every short-round group trains, no long-round group
    does (all wrong). Returns (epoch, Short|Long|Retired, prompts) per round and retirement,
    and the planner. ``state_every``: restore from a JSON state every that many rounds."""
    from rlpacer.control.tail_batching import TailBatchingConfig, TailBatchingPlanner

    cfg = TailBatchingConfig(prompts_per_step=4, prompt_overprovision=2.0, extra_responses=0,
                             min_yield_ratio=ratio, yield_probe_every=2)
    planner = TailBatchingPlanner(cfg, num_prompts=40, seed=1, epochs=epochs)
    rounds: list[tuple[int, str, list[int]]] = []
    while not planner.done:
        if state_every and planner.rounds % state_every == 0:
            planner = TailBatchingPlanner.from_state_dict(
                json.loads(json.dumps(planner.state_dict())))
        epoch = planner.epoch
        plan = planner.start_round(4)
        order = sorted(((p * 7919 + i * 104729) % 997, p, i) for p in plan.prompts
                       for i in range(plan.responses_per_prompt))
        gone: set[int] = set()
        for n, p, i in order:
            if p not in gone:
                gone.update(planner.on_response_finished(p, i, n).abort_prompts)
        res = planner.finish_round()
        rounds.append((epoch, res.kind.value, sorted(res.kept)))
        planner.observe_yield(res.kind, len(res.kept) if res.kind is S else 0, 2.0)
        epoch = planner.epoch
        if retired := planner.retire_due_long_rounds():
            rounds.append((epoch, "Retired", sorted(retired)))
    return rounds, planner


def test_the_planner_retires_long_rounds_that_train_nothing_and_probes_again() -> None:
    off, p_off = _epochs_of(0.0, epochs=3)
    on, p_on = _epochs_of(0.25, epochs=3)
    kinds_on = [k for _, k, _ in on]
    assert "Retired" not in [k for _, k, _ in off] and p_off.retired == 0
    longs_off = sum(len(ps) for _, k, ps in off if k == "Long")
    longs_on = sum(len(ps) for _, k, ps in on if k == "Long")
    assert 0 < longs_on < longs_off and p_on.retired == longs_off - longs_on
    # the first long round runs (nothing measured yet); then retirements, and after
    # yield_probe_every=2 retired in a row a probe runs again
    first = kinds_on.index("Long")
    assert "Retired" not in kinds_on[:first] and kinds_on.count("Long") >= 2
    assert p_on.yields.retired_rounds == sum(
        -(-len(ps) // 4) for _, k, ps in on if k == "Retired")
    assert p_on.consumed + p_on.retired == 120 and p_on.done
    for epoch in range(3):  # once per epoch, trained or retired; retired ones back next epoch
        trained = [p for e, k, ps in on if e == epoch and k != "Retired" for p in ps]
        retired = [p for e, k, ps in on if e == epoch and k == "Retired" for p in ps]
        assert len(trained) == len(set(trained)) and not set(trained) & set(retired)
        assert sorted(trained + retired) == list(range(40))
    # the short rounds trained the same prompts either way: no informative group was lost
    assert [ps for _, k, ps in on if k == "Short"] == [ps for _, k, ps in off if k == "Short"]


def test_a_planner_restored_between_rounds_retires_the_same() -> None:
    straight, _ = _epochs_of(0.25, epochs=2)
    restored, _ = _epochs_of(0.25, epochs=2, state_every=3)
    assert restored == straight and any(k == "Retired" for _, k, _ in straight)


def test_older_planner_states_load_with_nothing_retired() -> None:
    from rlpacer.control.tail_batching import TailBatchingConfig, TailBatchingPlanner

    state = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4), 12).state_dict()
    for k in ("yield", "retired"):
        state.pop(k)
    for k in ("min_yield_ratio", "yield_probe_every"):
        state["config"].pop(k)
    state["version"] = 2
    planner = TailBatchingPlanner.from_state_dict(state)
    assert planner.config.min_yield_ratio == 0.0 and planner.retired == 0
    assert planner.retire_due_long_rounds() == []


def test_retiring_mid_round_is_refused() -> None:
    from rlpacer.control.tail_batching import (
        PlannerError,
        TailBatchingConfig,
        TailBatchingPlanner,
    )

    planner = TailBatchingPlanner(TailBatchingConfig(prompts_per_step=4, min_yield_ratio=0.5), 12)
    planner.start_round(2)
    with pytest.raises(PlannerError, match="between rounds"):
        planner.retire_due_long_rounds()
