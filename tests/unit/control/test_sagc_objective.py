"""SAGC's objective per second (``SAGCConfig.objective="second"``): log2(G) per second of a
step's measured wall clock, under the same straggler SLO."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable

import pytest
from tests.unit.control.test_plan import report

from rlpacer.control.errors import ConfigError, ObservationError
from rlpacer.control.plan import JobController, JobControllerConfig, StepSecondsData
from rlpacer.control.sagc import SAGCConfig, SAGCController

pytestmark = pytest.mark.unit


def run(objective: str, seconds: Callable[[int], float], steps: int = 30,
        straggles: Callable[[int], bool] = lambda g: False, **kw: float) -> list[int]:
    """The sizes SAGC picks over ``steps`` steps whose seconds and stragglers depend on G."""
    ctl = SAGCController(SAGCConfig(objective=objective, tau=4.0, **kw))  # type: ignore[arg-type]
    out = []
    for _ in range(steps):
        g = ctl.decide()
        out.append(g)
        ctl.observe(g, 500.0 if straggles(g) else 200.0, 100.0, seconds=seconds(g))
    return out


@pytest.mark.parametrize(("per_response", "best"), [(1.0, 4), (0.1, 8), (0.01, 16)])
def test_per_second_settles_on_the_size_whose_log2_g_costs_least(
        per_response: float, best: int) -> None:
    """Steps cost 1 + k * G seconds. Per second SAGC ends on argmax log2(G) / (1 + k G):
    G=4 when the per-response part dominates, 16 when the fixed part does, 8 between (it
    must try the others to know); per step it keeps 16 whatever a step costs."""
    def cost(g: int) -> float:
        return 1.0 + per_response * g

    want = max((4, 8, 16), key=lambda g: math.log2(g) / cost(g))
    assert want == best
    picked = run("second", cost)
    assert picked[0] == 8  # step 0 runs `initial`
    assert picked[-10:] == [best] * 10
    assert run("step", cost)[-10:] == [16] * 10


def test_per_second_still_keeps_the_slo() -> None:
    """Where G=16 is the cheapest per unit of log2(G) but straggles every step, the
    multiplier prices it out as it does per step."""
    picked = run("second", lambda g: 1.0 + 0.01 * g, steps=200,
                 straggles=lambda g: g == 16, delta=0.1, dual_step=0.2)
    assert picked[-50:].count(16) <= 10
    assert 8 in picked[-50:]


def test_unmeasured_steps_leave_the_objective_per_step() -> None:
    """No seconds reported (an older trainer's report, 0): per second decides as per step,
    draw for draw."""
    assert run("second", lambda g: 0.0) == run("step", lambda g: 0.0)


def test_the_objective_is_checked_and_bad_seconds_change_nothing() -> None:
    with pytest.raises(ConfigError, match="objective"):
        SAGCConfig(objective="minute")
    ctl = SAGCController(SAGCConfig(objective="second"))
    g = ctl.decide()
    before = json.dumps(ctl.state_dict())
    for bad in (-1.0, math.nan, math.inf, "3"):
        with pytest.raises(ObservationError, match="seconds"):
            ctl.observe(g, 200.0, 100.0, seconds=bad)  # type: ignore[arg-type]
    assert json.dumps(ctl.state_dict()) == before


def test_state_keeps_the_measured_seconds_and_an_older_state_restores() -> None:
    ctl = SAGCController(SAGCConfig(objective="second"))
    for _ in range(6):
        g = ctl.decide()
        ctl.observe(g, 200.0, 100.0, seconds=1.0 + 0.5 * g)
    assert set(ctl.step_seconds()) >= {4, 8}
    again = SAGCController.from_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert again.step_seconds() == ctl.step_seconds()
    for _ in range(20):  # continues decision for decision
        g = ctl.decide()
        assert again.decide() == g
        ctl.observe(g, 200.0, 100.0, seconds=1.0 + 0.5 * g)
        again.observe(g, 200.0, 100.0, seconds=1.0 + 0.5 * g)
    old = ctl.state_dict()
    del old["step_seconds"]  # written before the objective existed
    old["config"].pop("objective")
    restored = SAGCController.from_state_dict(old)
    assert restored.step_seconds() == {} and restored.config.objective == "step"


def test_a_per_step_state_is_what_older_releases_wrote() -> None:
    """Per step (the default) neither the config's objective nor any seconds are written, so
    an operator or trainer of an older release restores the state; seconds are not kept."""
    ctl = SAGCController(SAGCConfig())
    for _ in range(4):
        g = ctl.decide()
        ctl.observe(g, 200.0, 100.0, seconds=3.0)
    state = ctl.state_dict()
    assert "step_seconds" not in state and "objective" not in state["config"]
    assert ctl.step_seconds() == {}
    assert "objective" in SAGCController(SAGCConfig(objective="second")).state_dict()["config"]


def test_the_job_controller_prices_sizes_from_the_reports_seconds() -> None:
    """Through the step-report path: each report's rollout + reward + train + sync is what
    SAGC's size is priced at; steps whose seconds grow with G move a per-second job to G=4
    while a per-step job stays at 16."""
    finals = {}
    for objective in ("step", "second"):
        jc = JobController(JobControllerConfig(sagc=SAGCConfig(objective=objective)))
        for _ in range(20):
            r = report(jc, max_len=200.0, median=100.0)
            g = r.group_size
            r = dataclasses.replace(r, seconds=StepSecondsData(
                rollout=0.5 * g, reward=0.1, train=0.5 * g, sync=0.1))
            jc.observe(r)
        finals[objective] = jc.plan().group_size
        if objective == "second":  # the reports' seconds reached it: G=8's step is 8.2 s
            assert jc.step_seconds()[8] == pytest.approx(8.2)
    assert finals == {"step": 16, "second": 4}


def test_a_policy_that_changes_the_candidates_keeps_the_kept_sizes_seconds() -> None:
    """A run-time policy's clamp (``reconfigure``) re-indexes the candidates: the measured
    seconds follow their sizes, a new size has none."""
    ctl = SAGCController(SAGCConfig(objective="second", candidates=(4, 8, 16)))
    for _ in range(6):
        g = ctl.decide()
        ctl.observe(g, 200.0, 100.0, seconds=float(g))
    seen = ctl.step_seconds()
    ctl.reconfigure(SAGCConfig(objective="second", candidates=(2, 4, 8), initial=8))
    assert ctl.step_seconds() == {g: s for g, s in seen.items() if g in (2, 4, 8)}
    assert 2 not in ctl.step_seconds()
