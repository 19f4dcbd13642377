"""The per-prompt length prior, and routing predicted-long prompts straight to long rounds."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import numpy as np
import pytest

from rlpacer.control.errors import ConfigError, StateError
from rlpacer.control.length_prior import LengthPrior
from rlpacer.control.tail_batching import RoundKind, TailBatchingConfig, TailBatchingPlanner

pytestmark = pytest.mark.unit


def _population(
    n: int, between: float, within: float, seed: int = 0
) -> tuple[np.ndarray, np.random.Generator]:
    rng = np.random.default_rng(seed)
    return rng.normal(6.0, between, size=n), rng


def _group(level: float, rng: np.random.Generator, within: float, k: int = 8) -> list[int]:
    return [max(1, round(math.exp(level + within * z))) for z in rng.standard_normal(k)]


def test_an_unseen_prompt_gets_the_population_and_a_seen_one_its_own_level() -> None:
    levels, rng = _population(300, between=0.6, within=0.4)
    pr = LengthPrior(300)
    for p in range(200):
        pr.observe(p, _group(levels[p], rng, 0.4))
    pop = pr.calibration()["population"]
    assert abs(pop["level"] - 6.0) < 0.15
    assert abs(pop["between_var"] - 0.36) < 0.12 and abs(pop["within_var"] - 0.16) < 0.03
    unseen = pr.predict(250)
    assert unseen.seen == 0 and abs(unseen.level - pop["level"]) < 1e-9
    hi, lo = int(np.argmax(levels[:200])), int(np.argmin(levels[:200]))
    assert pr.predict(hi).level > pop["level"] + 0.5 > pop["level"] - 0.5 > pr.predict(lo).level
    assert pr.level_rank(hi) > 0.9 and pr.level_rank(lo) < 0.1
    # shrinkage: one group pulls the level most of the way (within var << between var)
    assert abs(pr.predict(hi).level - levels[hi]) < 0.3


def test_calibration_is_near_the_nominal_quantiles_on_log_normal_lengths() -> None:
    levels, rng = _population(400, between=0.5, within=0.7, seed=1)
    pr = LengthPrior(400)
    for _epoch in range(3):
        for p in range(400):
            pr.observe(p, _group(levels[p], rng, 0.7))
    cal = pr.calibration()
    for kind in ("seen", "unseen"):
        row = cal[kind]
        assert row["responses"] > 0
        for q, key in ((0.1, "below_p10"), (0.5, "below_p50"), (0.9, "below_p90")):
            assert abs(row[key] - q) < 0.04, (kind, key, row)
    # the level explains part of a group's mean: between 0.25, noise of a mean 0.49 / 8
    assert 0.6 < cal["level_skill"] < 0.95


def test_without_a_between_prompt_spread_the_level_has_no_skill() -> None:
    levels, rng = _population(300, between=0.0, within=0.8, seed=2)
    pr = LengthPrior(300)
    for _epoch in range(2):
        for p in range(300):
            pr.observe(p, _group(levels[p], rng, 0.8))
    assert pr.calibration()["level_skill"] < 0.1


def test_censored_responses_count_at_the_longest_finished() -> None:
    a, b = LengthPrior(2), LengthPrior(2)
    for pr in (a, b):
        pr.observe(1, [100, 100, 100, 100])  # a population to shrink toward
    a.observe(0, [100, 200, 300])
    b.observe(0, [100, 200, 300], censored=2)
    assert b.predict(0).level > a.predict(0).level
    assert b.predict(0).seen == 5


def test_state_round_trips_through_json_and_rejects_garbage() -> None:
    levels, rng = _population(50, between=0.5, within=0.5, seed=3)
    pr = LengthPrior(50)
    for p in range(40):
        pr.observe(p, _group(levels[p], rng, 0.5))
    again = LengthPrior.from_state_dict(json.loads(json.dumps(pr.state_dict())))
    for p in (0, 17, 45):
        assert again.predict(p) == pr.predict(p)
    assert again.calibration() == pr.calibration()
    with pytest.raises(StateError):
        LengthPrior.from_state_dict({"kind": "length_prior", "version": 99})
    bad = pr.state_dict()
    bad["count"]["999"] = 3
    with pytest.raises(StateError, match="unknown prompt"):
        LengthPrior.from_state_dict(bad)
    with pytest.raises(ValueError, match="outside"):
        pr.observe(50, [3])
    with pytest.raises(ValueError, match=">= 1 token"):
        pr.observe(1, [0])


# --- forgetting -------------------------------------------------------------------------------
def _drift(pr: LengthPrior, levels: np.ndarray, rng: np.random.Generator, shift: float,
           epochs: int) -> list[tuple[float, int]]:
    """Epochs of every prompt, lengths shifted by ``shift`` (log) from the second epoch on
    (a policy that learned to stop rambling); each later response's predicted-median
    coverage: (fraction of its group at or below the predicted median, group size)."""
    cover = []
    for epoch in range(epochs):
        for p in range(len(levels)):
            g = _group(levels[p] + (shift if epoch else 0.0), rng, 0.4)
            if epoch:
                med = pr.quantile(p, 0.5)
                cover.append((sum(x <= med for x in g) / len(g), len(g)))
            pr.observe(p, g)
    return cover


def test_forgetting_follows_lengths_that_drift_and_keeps_each_prompts_rank() -> None:
    levels, _ = _population(200, between=0.5, within=0.4, seed=5)
    runs = {}
    for half_life in (None, 800.0):  # four epochs of 200 prompts
        pr = LengthPrior(200, half_life=half_life)
        cover = _drift(pr, levels, np.random.default_rng(7), shift=-2.0, epochs=3)
        runs[half_life] = (pr, float(np.mean([c for c, _ in cover[-200:]])))
    stale, fresh = runs[None][0], runs[800.0][0]
    # every prompt's lengths fell by e^2 after the first epoch: in the third, a prior that
    # weighs all epochs alike predicts a median that nearly every response falls below; with
    # forgetting about half of them do
    assert runs[None][1] > 0.9
    assert abs(runs[800.0][1] - 0.5) < 0.1
    pop = {k: r[0].calibration()["population"]["level"] for k, r in runs.items()}
    assert pop[800.0] < pop[None]  # the level follows too, slowly at this half-life
    # a prompt keeps its place in the population (its offset from the level), so routing
    # and dispatch still tell long prompts from short ones
    hi, lo = int(np.argmax(levels)), int(np.argmin(levels))
    assert fresh.level_rank(hi) > 0.8 and fresh.level_rank(lo) < 0.2
    assert abs(fresh.predict(hi).level - (levels[hi] - 2.0)) < 0.3 < abs(
        stale.predict(hi).level - (levels[hi] - 2.0))
    assert fresh.predict(hi).seen == stale.predict(hi).seen == 24  # seen, whatever the weight
    assert fresh.calibration()["half_life"] == 800.0 and stale.calibration()["half_life"] is None


def test_a_long_half_life_on_a_workload_that_does_not_drift_stays_calibrated() -> None:
    levels, rng = _population(400, between=0.5, within=0.7, seed=1)
    pr = LengthPrior(400, half_life=2000)
    for _epoch in range(3):
        for p in range(400):
            pr.observe(p, _group(levels[p], rng, 0.7))
    cal = pr.calibration()
    for kind in ("seen", "unseen"):
        for q, key in ((0.1, "below_p10"), (0.5, "below_p50"), (0.9, "below_p90")):
            assert abs(cal[kind][key] - q) < 0.05, (kind, key, cal[kind])


def test_forgetting_state_round_trips_and_a_state_from_before_forgetting_loads() -> None:
    levels, rng = _population(60, between=0.5, within=0.5, seed=3)
    pr = LengthPrior(60, half_life=25)
    for p in list(range(50)) * 2:
        pr.observe(p, _group(levels[p], rng, 0.5))
    again = LengthPrior.from_state_dict(json.loads(json.dumps(pr.state_dict())))
    assert again.half_life == 25
    for p in (0, 17, 55):
        assert again.predict(p) == pr.predict(p)
    for q in (pr, again):  # and they go on alike
        q.observe(3, [40, 50, 60])
    assert again.predict(3) == pr.predict(3) and again.predict(40) == pr.predict(40)
    # a checkpoint written before forgetting existed (state version 1): the same prior
    plain = LengthPrior(60)
    for p in range(40):
        plain.observe(p, _group(levels[p], rng, 0.5))
    v1 = plain.state_dict()  # without forgetting, written as before it existed
    assert v1["version"] == 1 and set(v1) == {
        "kind", "version", "num_prompts", "count", "sum", "population", "calibration"}
    assert all(isinstance(x, int) for x in (v1["population"][0], v1["population"][5],
                                            *v1["count"].values()))
    old = LengthPrior.from_state_dict(json.loads(json.dumps(v1)))
    assert old.half_life is None and old.groups == 40
    for p in (0, 39, 45):
        assert old.predict(p) == plain.predict(p)
    old.observe(0, [10, 20])
    plain.observe(0, [10, 20])
    assert old.predict(0) == plain.predict(0)
    # forgetting turned on for a prior restored without it (and off again): the same
    # predictions at once, the evidence re-expressed as offsets from today's level
    before = [old.predict(p) for p in (0, 39, 45)]
    for h in (100.0, None):
        old.half_life = h
        for p, b in zip((0, 39, 45), before, strict=True):
            assert old.predict(p).level == pytest.approx(b.level, abs=1e-9)
    with pytest.raises(ConfigError, match="half_life"):
        LengthPrior(10, half_life=0.5)
    bad = pr.state_dict()
    del bad["stamp"]["0"]
    with pytest.raises(StateError, match="disagree"):
        LengthPrior.from_state_dict(bad)


# --- routing in the planner ------------------------------------------------------------------
def _finish(planner: TailBatchingPlanner, rng: random.Random) -> None:
    plan = planner.current_round
    assert plan is not None
    ev = [(p, i) for p in plan.prompts for i in range(plan.responses_per_prompt)]
    rng.shuffle(ev)
    aborted: set[tuple[int, int]] = set()
    for p, i in ev:
        if (p, i) in aborted:
            continue
        d = planner.on_response_finished(p, i)
        aborted.update(d.abort_responses)
        for q in d.abort_prompts:
            aborted.update((q, j) for j in range(plan.responses_per_prompt))
        if d.round_complete:
            return


def test_routed_prompts_skip_the_race_and_are_trained_once_in_a_long_round() -> None:
    cfg = TailBatchingConfig(prompts_per_step=8, prompt_overprovision=1.5)
    planner = TailBatchingPlanner(cfg, num_prompts=96, seed=0, epochs=2)
    flagged = set(range(0, 96, 5))  # a fifth of the prompts "predicted long"
    rng = random.Random(0)
    trained: Counter[tuple[int, int]] = Counter()
    routed_total = 0
    while not planner.done:
        epoch = planner.epoch
        plan = planner.start_round(4, route=lambda p: p in flagged)
        assert not set(plan.prompts) & set(plan.routed)
        if plan.kind is RoundKind.SHORT:
            assert len(plan.routed) <= 12 - 8  # at most launched - P0 a round
            assert set(plan.routed) <= flagged
            assert len(plan.prompts) >= plan.target_prompts
        else:
            assert plan.routed == []
        _finish(planner, rng)
        res = planner.finish_round()
        routed_total += len(res.routed)
        for p in res.kept:
            trained[(epoch, p)] += 1
    assert routed_total > 0
    assert set(trained.values()) == {1} and len(trained) == 2 * 96  # every prompt, once an epoch


def test_an_aborted_round_routes_nothing() -> None:
    cfg = TailBatchingConfig(prompts_per_step=4, prompt_overprovision=2.0)
    planner = TailBatchingPlanner(cfg, num_prompts=40, seed=1)
    before = planner.state_dict()
    plan = planner.start_round(2, route=lambda p: True)
    assert len(plan.routed) == 4 and len(plan.prompts) == 8
    planner.abort_round()
    assert planner.state_dict() == before
    plan = planner.start_round(2, route=lambda p: True)
    _finish(planner, random.Random(1))
    res = planner.finish_round()
    assert res.routed == plan.routed
    assert set(plan.routed) <= set(planner.long_queue)
    assert planner.position == 12


def test_no_routing_in_a_plain_round() -> None:
    cfg = TailBatchingConfig(prompts_per_step=4, enabled=False)
    planner = TailBatchingPlanner(cfg, num_prompts=40, seed=1)
    assert planner.start_round(2, route=lambda p: True).routed == []


def test_calibration_counts_an_aborted_response_as_above_where_its_bound_says_so() -> None:
    """Each group's slowest response aborted (as a racing short round does): it is imputed
    from the prompt's predictive distribution above the group's longest finished length, and
    judged as above every predicted quantile at or below that length, so the population's
    level and spread and the quantiles stay calibrated (counted among the judged responses)."""
    levels, rng = _population(400, between=0.4, within=0.6, seed=4)
    pr = LengthPrior(400)
    for _epoch in range(3):
        for p in range(400):
            g = sorted(_group(levels[p], rng, 0.6, k=5))
            pr.observe(p, g[:-1], censored=1)
    cal = pr.calibration()
    seen = cal["seen"]
    assert seen["responses"] == 2 * 400 * 5
    assert abs(seen["below_p50"] - 0.5) < 0.05, seen
    assert abs(seen["below_p10"] - 0.1) < 0.03, seen
    pop = cal["population"]  # truth: level 6.0, within 0.36, between 0.16
    assert abs(pop["level"] - 6.0) < 0.08 and abs(pop["within_var"] - 0.36) < 0.05, pop
