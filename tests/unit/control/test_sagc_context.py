"""SAGC with a context: the next round's predicted straggler probability per candidate G
(rlpacer.control.sagc, ``decide(context=...)``), the length prior's risk that feeds it
(``LengthPrior.straggler_risk``), the planner's preview of the next round it is computed
from (``TailBatchingPlanner.peek_round``), and the step report that carries it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlpacer.api.protocol import StepReport
from rlpacer.control.errors import ObservationError, StateError
from rlpacer.control.length_prior import LengthPrior
from rlpacer.control.plan import (
    JobController,
    JobControllerConfig,
    LengthStats,
    ReportRejected,
    StepReportData,
)
from rlpacer.control.sagc import (
    CONTEXT_MIN,
    SAGCConfig,
    SAGCController,
    controller_from_state_dict,
)
from rlpacer.control.tail_batching import RoundKind, TailBatchingConfig, TailBatchingPlanner

pytestmark = pytest.mark.unit

CFG = SAGCConfig(candidates=(4, 8, 16), delta=0.2, tau=4.0, initial=8, seed=3, dual_step=0.1)


def _world(steps: int, ctl: SAGCController, *, give_context: bool, seed: int = 0) -> dict:
    """A workload where the round, not G alone, decides: half the rounds are risky (G=16
    straggles in 90% of them, G=8 in 40%), the rest never straggle. The context names which
    half (0.9 or 0.05 at every G); withheld, the controller sees only the mix."""
    rng = np.random.default_rng(seed)
    p = {True: {4: 0.05, 8: 0.4, 16: 0.9}, False: {4: 0.0, 8: 0.0, 16: 0.0}}
    picks: dict[bool, list[int]] = {True: [], False: []}
    stragglers = 0
    risky = bool(rng.random() < 0.5)
    ctl.decide()
    for _ in range(steps):
        g = ctl.pending
        assert g is not None
        s = bool(rng.random() < p[risky][g])
        stragglers += s
        ctl.observe(g, 100.0 if s else 2.0, 1.0)
        risky = bool(rng.random() < 0.5)
        ctx = {c: (0.9 if risky else 0.05) for c in CFG.candidates}
        g_next = ctl.decide(ctx if give_context else None)
        picks[risky].append(g_next)
    return {"picks": picks, "rate": stragglers / steps,
            "utility": float(np.mean([np.log2(g) for g in picks[True] + picks[False]]))}


def test_a_controller_never_given_a_context_decides_exactly_as_before() -> None:
    a, b = SAGCController(CFG), SAGCController(CFG)
    rng = np.random.default_rng(1)
    for _ in range(200):
        ga, gb = a.decide(), b.decide({3: 0.5, 5: 0.1})  # no candidate named: pooled draws
        assert ga == gb
        s = bool(rng.random() < 0.3)
        a.observe(ga, 9.0 if s else 2.0, 1.0)
        b.observe(gb, 9.0 if s else 2.0, 1.0)
    assert a.posterior() == b.posterior() and a.lambda_ == b.lambda_
    assert b.context_decisions == 0 and b.context_counts() == ((0, 0), (0, 0))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_context_moves_g_with_the_round_and_buys_utility_within_the_slo(seed: int) -> None:
    """Measured (seeds 0-3): G=16 in 88-96% of the safe rounds and 22-33% of the risky ones
    with the context, the same share in both halves (25-51%) without; mean log2 G 3.48-3.63
    against 3.19-3.40, straggler rate 0.23-0.245 against 0.248-0.277."""
    with_ctx = _world(600, SAGCController(CFG), give_context=True, seed=seed)
    without = _world(600, SAGCController(CFG), give_context=False, seed=seed)
    ctx16 = {k: float(np.mean([g == 16 for g in v])) for k, v in with_ctx["picks"].items()}
    # large groups go to the safe rounds, small ones to the risky rounds
    assert ctx16[False] > 0.8 and ctx16[True] < 0.4, ctx16
    plain16 = {k: float(np.mean([g == 16 for g in v])) for k, v in without["picks"].items()}
    assert abs(plain16[False] - plain16[True]) < 0.15  # blind: the same mix in both halves
    assert with_ctx["utility"] > without["utility"] + 0.15
    assert with_ctx["rate"] < without["rate"]


def test_contexts_are_counted_by_half_and_a_bad_probability_is_refused() -> None:
    ctl = SAGCController(CFG)
    _world(80, ctl, give_context=True)
    (lo_n, lo_s), (hi_n, hi_s) = ctl.context_counts()
    assert lo_n > 0 and hi_n > 0 and lo_s == 0 and hi_s > 0  # only risky rounds straggled
    assert ctl.context_decisions > 0
    low, high = ctl.context_posterior_means()[16]
    assert high > low
    ctl.observe(ctl.pending, 2.0, 1.0)  # type: ignore[arg-type]
    before = ctl.state_dict()
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ObservationError, match=r"context\[8\]"):
            ctl.decide({4: 0.5, 8: bad})
    assert ctl.state_dict() == before and ctl.pending is None  # nothing remembered


def test_the_context_waits_for_history_before_it_picks_a_posterior() -> None:
    ctl = SAGCController(CFG)
    ctl.decide()
    for i in range(CONTEXT_MIN):
        g = ctl.pending
        assert g is not None
        ctl.observe(g, 2.0, 1.0)
        ctl.decide({c: 0.1 * (i % 3) for c in CFG.candidates})
        assert ctl.context_decisions == 0  # too few contexts yet to split at their mean
    ctl.observe(ctl.pending, 2.0, 1.0)  # type: ignore[arg-type]
    ctl.decide({c: 0.9 for c in CFG.candidates})
    assert ctl.context_decisions == 1


def test_context_state_round_trips_and_an_older_state_restores() -> None:
    ctl = SAGCController(CFG)
    _world(40, ctl, give_context=True)
    state = json.loads(json.dumps(ctl.state_dict()))
    back = controller_from_state_dict(state)
    assert isinstance(back, SAGCController)
    assert back.state_dict() == ctl.state_dict()
    ctx = {c: 0.5 for c in CFG.candidates}
    for c in (ctl, back):  # continues bit for bit, contexts and all
        c.observe(c.pending, 2.0, 1.0)  # type: ignore[arg-type]
        c.decide(ctx)
    assert back.state_dict() == ctl.state_dict()
    # a state written before contexts existed: fresh context posteriors, the rest kept
    old = ctl.state_dict()
    del old["context"]
    restored = controller_from_state_dict(old)
    assert isinstance(restored, SAGCController)
    assert restored.posterior() == ctl.posterior() and restored.pending == ctl.pending
    assert restored.context_counts() == ((0, 0), (0, 0))
    bad = ctl.state_dict()
    bad["context"]["alpha"] = [[1.0], [1.0]]
    with pytest.raises(StateError, match="context alpha/beta"):
        controller_from_state_dict(bad)


def test_reconfigure_keeps_the_context_posteriors_of_kept_candidates() -> None:
    ctl = SAGCController(CFG)
    _world(60, ctl, give_context=True)
    before = ctl.context_posterior_means()
    ctl.reconfigure(SAGCConfig(candidates=(4, 8), delta=0.2, tau=4.0, initial=8, seed=3,
                               dual_step=0.1))
    after = ctl.context_posterior_means()
    assert set(after) == {4, 8} and after[8] == before[8] and after[4] == before[4]


# --- the length prior's risk --------------------------------------------------------------
def _prior(within: float, n: int = 64, seed: int = 0) -> LengthPrior:
    rng = np.random.default_rng(seed)
    prior = LengthPrior(n)
    for p in range(n):
        level = 5.0 + 0.3 * rng.standard_normal()
        prior.observe(p, [max(1, int(np.exp(level + within * rng.standard_normal())))
                          for _ in range(8)])
    return prior


def test_straggler_risk_grows_with_g_and_with_the_spread_of_lengths() -> None:
    assert LengthPrior(4).straggler_risk([0, 1], (4, 8), 4.0) == {}  # nothing learnt yet
    wide, narrow = _prior(0.4), _prior(0.1)
    prompts = list(range(32))
    risk = wide.straggler_risk(prompts, (4, 8, 16), 4.0, seed=1)
    assert set(risk) == {4, 8, 16}
    assert risk[4] < risk[8] < risk[16] and risk[16] > 0.5
    assert narrow.straggler_risk(prompts, (4, 8, 16), 4.0, seed=1) == {4: 0.0, 8: 0.0, 16: 0.0}
    assert wide.straggler_risk(prompts, (4, 8, 16), 4.0, seed=1) == risk  # deterministic
    # the race keeps each group's first G of G + extra and the first target groups: less risk
    raced = wide.straggler_risk(prompts, (4, 8, 16), 4.0, extra=2, target=24, seed=1)
    assert all(raced[g] < risk[g] for g in (8, 16))
    capped = wide.straggler_risk(prompts, (16,), 4.0, cap=300.0, seed=1)
    assert capped[16] < risk[16]  # the response limit bounds the longest
    with pytest.raises(ValueError, match="tau"):
        wide.straggler_risk(prompts, (4,), 1.0)


def test_risky_prompts_score_higher_than_safe_ones() -> None:
    """Prompts seen to vary wildly predict more risk than prompts seen to be steady (the
    population pools the within-group spread, so the difference is in their levels' spread
    and the censoring-free means: a round of long prompts among short ones straggles)."""
    prior = LengthPrior(64)
    rng = np.random.default_rng(0)
    for p in range(64):
        level = 7.0 if p < 4 else 4.0  # four prompts run 20x longer than the rest
        for _ in range(3):
            prior.observe(p, [max(1, int(np.exp(level + 0.2 * rng.standard_normal())))
                              for _ in range(8)])
    mixed = prior.straggler_risk([0, *range(8, 40)], (4, 8), 4.0, seed=0)
    plain = prior.straggler_risk(list(range(8, 41)), (4, 8), 4.0, seed=0)
    assert mixed[8] > 0.9 and plain[8] < 0.1


# --- the planner's preview ----------------------------------------------------------------
@pytest.mark.parametrize("route", [False, True])
def test_peek_round_is_what_start_round_launches(route: bool) -> None:
    planner = TailBatchingPlanner(
        TailBatchingConfig(prompts_per_step=4, prompt_overprovision=1.5, extra_responses=2),
        num_prompts=40, seed=2, epochs=3)
    pred = (lambda p: p % 3 == 0) if route else None
    for _ in range(12):
        if planner.done:
            break
        nxt = planner.peek_round(route=pred)
        plan = planner.start_round(8, route=pred)
        assert (nxt.kind, nxt.prompts, nxt.target_prompts) == (
            plan.kind, plan.prompts, plan.target_prompts)
        assert nxt.extra_responses == plan.responses_per_prompt - plan.keep_per_prompt
        for p in plan.prompts:  # the first G finish, the rest are aborted
            for i in range(plan.responses_per_prompt):
                planner.on_response_finished(p, i, 10 if p != plan.prompts[-1] else 500)
        planner.finish_round()


# --- the report ---------------------------------------------------------------------------
def _report(step: int, g: int, risk: tuple[tuple[int, float], ...] | None) -> StepReportData:
    return StepReportData(attempt=0, step=step, group_size=g, round_kind=RoundKind.SHORT,
                          lengths=LengthStats(max=9.0, median=2.0, p90=5.0, count=8),
                          next_straggler_risk=risk)


def test_a_report_carries_the_context_to_sagc_and_its_repeat_is_the_same() -> None:
    jc = JobController(JobControllerConfig(sagc=CFG))
    for step in range(CONTEXT_MIN + 3):
        plan = jc.observe(_report(step, jc.plan().group_size,
                                  ((4, 0.1), (8, 0.2 + 0.01 * step), (16, 0.9))))
    ctl = jc.controller
    assert isinstance(ctl, SAGCController) and ctl.context_decisions > 0
    last = _report(CONTEXT_MIN + 2, plan.group_size, None)
    back = JobController.from_state_dict(json.loads(json.dumps(jc.state_dict())))
    assert back.last_report == jc.last_report and back.last_report is not None
    assert back.last_report.next_straggler_risk is not None
    assert back.observe(jc.last_report) == jc.observe(jc.last_report)  # a repeat: same answer
    # stored without the key (a report accepted before it existed) still loads
    assert "next_straggler_risk" not in last.to_dict()
    assert StepReportData.from_dict(last.to_dict()) == last
    for bad, why in ((((8, 1.5),), "probability"), (((8, 0.1), (8, 0.2)), "twice")):
        with pytest.raises(ReportRejected, match=why):
            jc.observe(_report(jc.next_step, jc.plan().group_size, bad))


def test_the_wire_field_is_optional_typed_and_distinct() -> None:
    body = {"attempt": 0, "step": 0, "groupSize": 8, "roundKind": "Short",
            "lengths": {"max": 9, "median": 2.0, "p90": 5.0, "count": 8}}
    assert StepReport.model_validate(body).next_straggler_risk is None  # older trainers
    r = StepReport.model_validate({**body, "nextStragglerRisk": [
        {"groupSize": 4, "probability": 0.1}, {"groupSize": 8, "probability": 1}]})
    assert [(x.group_size, x.probability) for x in r.next_straggler_risk or []] == [
        (4, 0.1), (8, 1.0)]
    for bad in ([{"groupSize": 4, "probability": 1.2}], [{"groupSize": "4", "probability": 0.1}],
                [{"groupSize": 4, "probability": 0.1}, {"groupSize": 4, "probability": 0.2}]):
        with pytest.raises(ValueError):
            StepReport.model_validate({**body, "nextStragglerRisk": bad})
