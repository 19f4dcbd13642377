"""The straggler SLO: its rate over short rounds only, and the feasibility verdict."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rlpacer.api.protocol import RoundKind
from rlpacer.control.plan import (
    SLO_MIN_AT_SMALLEST,
    JobController,
    JobControllerConfig,
    LengthStats,
    SLOState,
    StepReportData,
    beta_above,
    straggler_slo_verdict,
)
from rlpacer.control.sagc import GroupControlMode, SAGCConfig

pytestmark = pytest.mark.unit


def step(jc: JobController, ratio: float, kind: RoundKind = RoundKind.SHORT,
         next_kind: RoundKind = RoundKind.SHORT) -> None:
    p = jc.plan()
    jc.observe(StepReportData(
        attempt=0, step=p.step, group_size=p.group_size, round_kind=kind,
        lengths=LengthStats(max=100.0 * ratio, median=100.0, p90=100.0 * ratio, count=8),
        next_round_kind=next_kind))


def sagc() -> JobController:
    cfg = SAGCConfig(tau=4.0, delta=0.2, dual_step=1.0, seed=0)
    return JobController(JobControllerConfig(sagc=cfg))


def run(jc: JobController, ratios: list[float]) -> list[SLOState]:
    states, prev = [], None
    for r in ratios:
        step(jc, r)
        prev = jc.slo_verdict(prev).state
        states.append(prev)
    return states


def test_beta_above_matches_closed_forms() -> None:
    assert beta_above(0.25, 1, 1) == pytest.approx(0.75)
    for a, x in ((3.0, 0.4), (0.5, 0.2), (7.3, 0.9)):  # Beta(a, 1): P(p > x) = 1 - x**a
        assert beta_above(x, a, 1) == pytest.approx(1 - x**a, abs=1e-10)
        assert beta_above(x, 1, a) == pytest.approx((1 - x) ** a, abs=1e-10)
    rng = np.random.default_rng(0)
    for a, b, x in ((2.5, 4.0, 0.3), (30.0, 2.0, 0.9), (0.3, 0.2, 0.7)):
        mc = float((rng.beta(a, b, 200_000) > x).mean())
        assert beta_above(x, a, b) == pytest.approx(mc, abs=0.005)
    assert (beta_above(0.0, 2, 2), beta_above(1.0, 2, 2)) == (1.0, 0.0)


def test_feasible_steps_give_no_breach() -> None:
    jc = sagc()
    states = run(jc, [1.5] * 40)
    assert states[:4] == [SLOState.UNKNOWN] * 4  # too few short rounds to judge
    assert set(states[4:]) == {SLOState.MET}
    v = jc.slo_verdict()
    assert v.met is True and v.rate == 0.0 and "within" in v.message()


def test_every_g_straggling_is_infeasible_with_the_rates_per_g() -> None:
    jc = sagc()
    states = run(jc, [8.0] * 40)
    assert states[-1] is SLOState.INFEASIBLE
    # Exceeded first (the smallest G untried), Infeasible once G=4 is shown to straggle
    first = states.index(SLOState.INFEASIBLE)
    assert SLOState.EXCEEDED in states[:first]
    v = jc.slo_verdict(SLOState.INFEASIBLE)
    d = v.to_dict()
    per = {e["group_size"]: e for e in d["per_size"]}
    assert per.keys() == {4, 8, 16}
    assert per[4]["observations"] >= SLO_MIN_AT_SMALLEST
    assert sum(e["observations"] for e in per.values()) == 40
    assert all(e["rate"] == 1.0 for e in per.values() if e["observations"])
    assert d["rate"] == 1.0 and d["target"] == 0.2 and d["state"] == "Infeasible"
    msg = v.message()
    assert "no candidate G can meet targetStragglerRate 0.2 at stragglerRatio 4" in msg
    for g, e in per.items():
        assert f"G={g} {e['stragglers']}/{e['observations']} (1.00)" in msg
    assert v.brief() == "INFEASIBLE 1.00>0.2"
    json.dumps(d)  # JSON-ready (the run's summary)


def test_a_larger_g_straggling_says_nothing_about_the_smallest() -> None:
    # G=4 meets the SLO, larger sizes straggle: SAGC can meet it, never Infeasible.
    jc = sagc()
    prev, seen = None, set()
    for _ in range(60):
        step(jc, 1.5 if jc.plan().group_size == 4 else 8.0)
        prev = jc.slo_verdict(prev).state
        seen.add(prev)
    assert SLOState.INFEASIBLE not in seen
    assert jc.slo_verdict(prev).sizes[0].rate == 0.0


def test_noise_at_the_smallest_candidate_is_not_infeasible() -> None:
    sizes = {4: (3, 2, 0.4 * 0.857 + 1.9, 1.6 * 0.857 + 1.0), 8: (10, 10, 9.0, 0.1)}
    v = straggler_slo_verdict(mode=GroupControlMode.SAGC, target=0.25, tau=4.0,
                              prior=(0.5, 1.5), short_window=(13, 12), sizes=sizes)
    assert v.state is SLOState.EXCEEDED  # 2 of 3 at G=4: not enough to say infeasible
    assert "G=4 2/3 (0.67)" in v.message() and "smallest candidate G=4" in v.message()


def test_hysteresis_keeps_a_verdict_until_the_evidence_turns() -> None:
    def verdict(window: tuple[int, int], previous: SLOState | None = None) -> SLOState:
        return straggler_slo_verdict(
            mode=GroupControlMode.SAGC, target=0.2, tau=4.0, prior=(0.4, 1.6),
            short_window=window, sizes={4: (5, 1, 1.0, 4.0)}, previous=previous).state

    # 6 of 20 short rounds (0.3 > 0.2) is not confidently over: Met when new ...
    assert verdict((20, 6)) is SLOState.MET
    # ... and still Exceeded when it was (P(rate > 0.2) is above 0.5)
    assert verdict((20, 6), SLOState.EXCEEDED) is SLOState.EXCEEDED
    assert verdict((20, 12)) is SLOState.EXCEEDED
    assert verdict((20, 2), SLOState.EXCEEDED) is SLOState.MET


def test_long_rounds_are_excluded_from_the_slo_rate() -> None:
    jc = sagc()
    for i in range(30):  # every third step a long round, always a straggler
        long = i % 3 == 2
        nxt = RoundKind.LONG if i % 3 == 1 else RoundKind.SHORT
        step(jc, 9.0 if long else 1.5, RoundKind.LONG if long else RoundKind.SHORT, nxt)
    assert jc.long_rounds == 10
    assert jc.straggler_rate == 0.0 and jc.plan().straggler_rate == 0.0
    assert jc.long_round_straggler_rate == 1.0
    assert jc.all_steps_straggler_rate == pytest.approx(1 / 3)
    v = jc.slo_verdict()
    assert v.state is SLOState.MET and (v.short_rounds, v.long_rounds, v.long_stragglers) == (
        20, 10, 10)
    assert "long rounds (excluded, stragglers by design): 10/10" in v.message()
    assert sum(e.observations for e in v.sizes) == 20  # SAGC saw the short rounds only


def test_fixed_g_over_the_target_is_exceeded() -> None:
    cfg = JobControllerConfig(mode="Fixed", sagc=SAGCConfig(initial=16, tau=4.0, delta=0.25))
    jc = JobController(cfg)
    states = run(jc, [8.0] * 10)
    assert states[-1] is SLOState.EXCEEDED
    v = jc.slo_verdict(SLOState.EXCEEDED)
    assert [(e.group_size, e.observations, e.stragglers) for e in v.sizes] == [(16, 10, 10)]
    assert "Fixed mode" in v.message()
    ok = JobController(cfg)
    assert run(ok, [1.5] * 10)[-1] is SLOState.MET


def test_windows_survive_the_state_and_older_states_restore() -> None:
    jc = sagc()
    for i in range(12):
        step(jc, 8.0 if i % 2 else 1.5, RoundKind.LONG if i == 5 else RoundKind.SHORT,
             RoundKind.LONG if i == 4 else RoundKind.SHORT)
    state = jc.state_dict()
    back = JobController.from_state_dict(json.loads(json.dumps(state)))
    assert back.state_dict() == state
    assert back.slo_verdict() == jc.slo_verdict()
    # a state written before the short-round rate: no short/long windows
    old = {k: v for k, v in state.items() if k not in ("short_window", "long_window")}
    restored = JobController.from_state_dict(old)
    assert restored.straggler_rate == 0.0 and restored.long_round_straggler_rate is None
    assert restored.all_steps_straggler_rate == jc.all_steps_straggler_rate
    step(restored, 8.0)
    assert restored.straggler_rate == 1.0
    assert not math.isnan(restored.slo_verdict().p_above_target)
