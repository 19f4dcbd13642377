"""SAGC and the fixed controller: invariants, behaviour, errors, state round trips."""

from __future__ import annotations

import json
import math
import time
from itertools import combinations
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlpacer.control.errors import ConfigError, ObservationError, StateError
from rlpacer.control.sagc import (
    FixedConfig,
    FixedController,
    GroupControlMode,
    SAGCConfig,
    SAGCController,
    controller_from_state_dict,
    make_controller,
)

pytestmark = pytest.mark.unit


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(state, allow_nan=False))
    return out


def _drive(ctl: SAGCController, p: dict[int, float], steps: int, seed: int) -> list[int]:
    """Run ``steps`` steps where a step at G straggles with probability p[G]."""
    rng = np.random.default_rng(seed)
    chosen = []
    for _ in range(steps):
        g = ctl.decide()
        chosen.append(g)
        straggle = rng.random() < p[g]
        ctl.observe(g, max_len=1000.0 if straggle else 150.0, median_len=100.0)
    return chosen


# --- configuration errors -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"candidates": ()}, "candidates"),
        ({"candidates": (8, 4, 16)}, "candidates"),
        ({"candidates": (4, 8, 8, 16)}, "candidates"),
        ({"candidates": (0, 4, 8)}, "candidates[0]"),
        ({"candidates": (4, 8.0, 16)}, "candidates[1]"),
        ({"candidates": "4,8"}, "candidates"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"delta": -0.1}, "delta"),
        ({"delta": float("nan")}, "delta"),
        ({"tau": 1.0}, "tau"),
        ({"tau": 0.5}, "tau"),
        ({"forgetting": 0.0}, "forgetting"),
        ({"forgetting": 1.01}, "forgetting"),
        ({"dual_step": -0.01}, "dual_step"),
        ({"lambda_max": 0.0}, "lambda_max"),
        ({"lambda_max": -1.0}, "lambda_max"),
        ({"radius": -1}, "radius"),
        ({"radius": 1.5}, "radius"),
        ({"initial": 6}, "initial"),
        ({"seed": -1}, "seed"),
        ({"prior_mean": 0.0}, "prior_mean"),
        ({"prior_mean": 1.0}, "prior_mean"),
        ({"prior_strength": 0.0}, "prior_strength"),
        ({"decay_unchosen": "yes"}, "decay_unchosen"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        SAGCConfig(**kwargs)
    assert err.value.field == field
    assert field in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"group_size": 0}, "group_size"), ({"tau": 1.0}, "tau"), ({"forgetting": 2.0}, "forgetting")],
)
def test_bad_fixed_config(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        FixedConfig(**kwargs)


def test_config_accepts_a_list_and_freezes_it() -> None:
    cfg = SAGCConfig(candidates=[2, 4], initial=2)  # type: ignore[arg-type]
    assert cfg.candidates == (2, 4)
    with pytest.raises(AttributeError):
        cfg.delta = 0.5  # type: ignore[misc]


def test_mode_registry_fails_loudly() -> None:
    assert GroupControlMode.parse("SAGC") is GroupControlMode.SAGC
    assert GroupControlMode.parse("fixed") is GroupControlMode.FIXED
    assert isinstance(make_controller("SAGC"), SAGCController)
    fixed = make_controller(GroupControlMode.FIXED, SAGCConfig(initial=16))
    assert isinstance(fixed, FixedController)
    assert fixed.decide() == 16
    with pytest.raises(ConfigError, match="unknown group-control mode 'bandit'"):
        make_controller("bandit")


# --- the algorithm --------------------------------------------------------------------------
def test_decide_is_idempotent_until_observed() -> None:
    ctl = SAGCController(SAGCConfig(seed=3))
    g = ctl.decide()
    state = ctl.state_dict()
    assert all(ctl.decide() == g for _ in range(5))
    assert ctl.state_dict() == state  # no draws consumed
    ctl.observe(g, max_len=812, median_len=140)
    assert ctl.pending is None


@pytest.mark.parametrize("initial", [4, 8, 16])
def test_step_0_runs_initial_then_climbs_with_lambda_zero(initial: int) -> None:
    ctl = SAGCController(SAGCConfig(initial=initial))
    assert ctl.lambda_ == 0.0
    assert ctl.current == initial
    assert ctl.decide() == initial  # the documented first group size, not a draw
    ctl.observe(initial, max_len=200, median_len=100)  # not a straggler
    # lambda = 0: the largest allowed size wins from the second step on
    assert ctl.decide() == min(initial * 2, 16)


@pytest.mark.parametrize(
    ("g", "max_len", "median_len", "match"),
    [
        (16, 800, 100, "decided group size is"),
        (8, 0, 100, "max_len"),
        (8, 100, 0, "median_len"),
        (8, -5, 100, "max_len"),
        (8, float("nan"), 100, "max_len"),
        (8, float("inf"), 100, "max_len"),
        (8, 50, 100, "max_len .* < median_len"),
        (8, True, 1, "max_len"),
    ],
)
def test_invalid_observation_raises_and_changes_nothing(
    g: int, max_len: float, median_len: float, match: str
) -> None:
    ctl = SAGCController(SAGCConfig(radius=0))  # radius 0: the pending G is 8
    assert ctl.decide() == 8
    before = ctl.state_dict()
    with pytest.raises(ObservationError, match=match):
        ctl.observe(g, max_len, median_len)
    assert ctl.state_dict() == before


def test_observe_without_decide_raises() -> None:
    ctl = SAGCController(SAGCConfig())
    with pytest.raises(ObservationError, match="call decide"):
        ctl.observe(8, 100, 50)


def test_update_rules_match_the_algorithm() -> None:
    cfg = SAGCConfig(radius=0, forgetting=0.9, dual_step=0.5, delta=0.2, tau=4.0)
    ctl = SAGCController(cfg)
    a0, b0 = cfg.alpha0, cfg.beta0
    g = ctl.decide()
    assert ctl.observe(g, max_len=500, median_len=100) is True  # 5 > tau
    post = ctl.posterior()
    assert post[8] == pytest.approx((0.9 * a0 + 1, 0.9 * b0))
    assert post[4] == pytest.approx((a0, b0))  # unchosen arms untouched by default
    assert ctl.lambda_ == pytest.approx(0.5 * 0.8)
    ctl.decide()
    assert ctl.observe(8, max_len=400, median_len=100) is False  # ratio 4 is not > tau
    assert ctl.lambda_ == pytest.approx(0.4 - 0.5 * 0.2)


def test_unchosen_arms_decay_toward_the_prior_when_asked() -> None:
    cfg = SAGCConfig(radius=0, forgetting=0.5, decay_unchosen=True)
    ctl = SAGCController(cfg)
    for _ in range(30):
        ctl.observe(ctl.decide(), 1000, 100)
    a, b = ctl.posterior()[4]
    assert a == pytest.approx(cfg.alpha0) and b == pytest.approx(cfg.beta0)
    assert ctl.posterior_means()[8] > 0.9


def test_lambda_is_clipped() -> None:
    ctl = SAGCController(SAGCConfig(dual_step=5.0, lambda_max=3.0))
    for _ in range(5):
        ctl.observe(ctl.decide(), 1000, 10)
    assert ctl.lambda_ == 3.0
    for _ in range(10):
        ctl.observe(ctl.decide(), 10, 10)
    assert ctl.lambda_ == 0.0


observations = st.lists(
    st.tuples(st.booleans(), st.floats(1.0, 1e5), st.floats(1.0, 50.0)), min_size=1, max_size=60
)


@st.composite
def configs(draw: st.DrawFn) -> SAGCConfig:
    cands = tuple(sorted(draw(st.sets(st.integers(1, 64), min_size=1, max_size=6))))
    return SAGCConfig(
        candidates=cands,
        delta=draw(st.floats(0.01, 0.99)),
        tau=draw(st.floats(1.01, 40.0)),
        forgetting=draw(st.floats(0.05, 1.0)),
        dual_step=draw(st.floats(0.0, 5.0)),
        lambda_max=draw(st.floats(0.1, 50.0)),
        radius=draw(st.integers(0, 3)),
        initial=draw(st.sampled_from(cands)),
        seed=draw(st.integers(0, 2**32)),
        decay_unchosen=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), obs=observations)
def test_invariants_hold_for_any_config_and_observations(
    cfg: SAGCConfig, obs: list[tuple[bool, float, float]]
) -> None:
    ctl = SAGCController(cfg)
    cands = cfg.candidates
    for straggle, median, ratio in obs:
        prev = cands.index(ctl.current)
        g = ctl.decide()
        assert g in cands
        assert abs(cands.index(g) - prev) <= cfg.radius
        max_len = median * (cfg.tau * 1.5 if straggle else min(ratio, cfg.tau))
        ctl.observe(g, max_len, median)
        assert 0.0 <= ctl.lambda_ <= cfg.lambda_max
        assert all(0.0 <= p <= 1.0 for p in ctl.posterior_means().values())
    assert ctl.steps == len(obs)


@settings(max_examples=40, deadline=None)
@given(cfg=configs(), obs=observations, split=st.integers(0, 60))
def test_state_round_trip_continues_identically(
    cfg: SAGCConfig, obs: list[tuple[bool, float, float]], split: int
) -> None:
    ctl = SAGCController(cfg)
    split = min(split, len(obs))

    def step(c: SAGCController, item: tuple[bool, float, float]) -> int:
        straggle, median, _ = item
        g = c.decide()
        c.observe(g, median * (cfg.tau + 1 if straggle else 1.0), median)
        return g

    for item in obs[:split]:
        step(ctl, item)
    if split % 2:
        ctl.decide()  # a pending decision is part of the state too
    clone = SAGCController.from_state_dict(_roundtrip(ctl.state_dict()))
    assert clone.state_dict() == ctl.state_dict()
    for item in obs[split:]:
        assert step(clone, item) == step(ctl, item)
    assert clone.state_dict() == ctl.state_dict()
    assert [ctl.decide() for _ in range(1)] == [clone.decide()]


def test_deterministic_under_a_seed() -> None:
    p = {4: 0.05, 8: 0.3, 16: 0.7}
    assert _drive(SAGCController(SAGCConfig(seed=7)), p, 200, 1) == _drive(
        SAGCController(SAGCConfig(seed=7)), p, 200, 1
    )


# --- behaviour ------------------------------------------------------------------------------
def test_no_stragglers_climbs_to_the_largest_size() -> None:
    ctl = SAGCController(SAGCConfig(candidates=(2, 4, 8, 16, 32), initial=2))
    chosen = _drive(ctl, {2: 0.0, 4: 0.0, 8: 0.0, 16: 0.0, 32: 0.0}, 100, 0)
    assert chosen[:5] == [2, 4, 8, 16, 32]  # initial, then one notch per step (radius 1)
    assert set(chosen[4:]) == {32}
    assert ctl.lambda_ == 0.0


def test_steep_straggler_probability_settles_at_small_sizes() -> None:
    ctl = SAGCController(SAGCConfig(delta=0.2, dual_step=0.2, forgetting=0.98, lambda_max=30))
    # Steep and concave in log2 G, so 16 is off the optimum (a 4/8 mix with 62% at 4).
    chosen = _drive(ctl, {4: 0.05, 8: 0.45, 16: 0.99}, 1500, 0)
    late = chosen[500:]
    assert late.count(4) / len(late) > 0.5
    assert late.count(16) / len(late) < 0.05
    assert float(np.mean(late)) < 8
    assert ctl.posterior_means()[4] < ctl.posterior_means()[8] < ctl.posterior_means()[16]


def _lp_optimum(p: dict[int, float], delta: float) -> float:
    """max E[log2 G] over mixtures of at most two sizes with E[p] <= delta (the LP optimum)."""
    best = max((math.log2(g) for g in p if p[g] <= delta), default=-math.inf)
    for a, b in combinations(sorted(p), 2):
        if p[a] <= delta < p[b]:
            x = (delta - p[a]) / (p[b] - p[a])
            best = max(best, (1 - x) * math.log2(a) + x * math.log2(b))
    return best


@pytest.mark.parametrize(
    "p",
    [{4: 0.05, 8: 0.15, 16: 0.5}, {4: 0.1, 8: 0.35, 16: 0.6}, {4: 0.0, 8: 0.1, 16: 0.3}],
)
def test_known_p_converges_to_the_constrained_optimum(p: dict[int, float]) -> None:
    delta = 0.2
    cfg = SAGCConfig(delta=delta, forgetting=1.0, dual_step=0.05, lambda_max=50, seed=1)
    ctl = SAGCController(cfg)
    chosen = _drive(ctl, p, 6000, 2)
    late = chosen[2000:]
    rate = ctl.stragglers / ctl.steps
    assert rate <= delta + 0.02
    mean_u = float(np.mean(np.log2(late)))
    assert mean_u == pytest.approx(_lp_optimum(p, delta), abs=0.2)


def test_decide_and_observe_cost_well_under_a_millisecond() -> None:
    ctl = SAGCController(SAGCConfig())
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        g = ctl.decide()
        ctl.observe(g, 900 if i % 3 == 0 else 300, 100)
    per_step = (time.perf_counter() - t0) / n
    assert per_step < 1e-3


# --- fixed controller and state errors -------------------------------------------------------
def test_fixed_controller_has_the_same_interface() -> None:
    ctl = FixedController(FixedConfig(group_size=8, tau=4.0))
    assert ctl.decide() == 8 and ctl.decide() == 8
    assert ctl.observe(8, 500, 100) is True
    assert ctl.lambda_ == 0.0
    assert set(ctl.posterior_means()) == {8} and set(ctl.posterior()) == {8}
    with pytest.raises(ObservationError):
        ctl.observe(8, 500, 100)  # nothing pending
    ctl.decide()
    before = ctl.state_dict()
    with pytest.raises(ObservationError):
        ctl.observe(16, 500, 100)
    assert ctl.state_dict() == before
    clone = controller_from_state_dict(_roundtrip(ctl.state_dict()))
    assert isinstance(clone, FixedController)
    assert clone.state_dict() == ctl.state_dict()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.update(kind="other"),
        lambda s: s.update(version=99),
        lambda s: s.update(alpha=[1.0]),
        lambda s: s.update(beta=[1.0, -1.0, 1.0]),
        lambda s: s.update(current=5),
        lambda s: s.update(rng={"bit_generator": "MT19937"}),
        lambda s: s["config"].update(delta=2.0),
        lambda s: s.pop("lambda"),
    ],
)
def test_corrupt_state_is_rejected(mutate: Any) -> None:
    state = SAGCController(SAGCConfig()).state_dict()
    mutate(state)
    with pytest.raises((StateError, ConfigError)):
        SAGCController.from_state_dict(state)


def test_unknown_controller_kind() -> None:
    with pytest.raises(StateError, match="unknown controller kind"):
        controller_from_state_dict({"kind": "pid"})
