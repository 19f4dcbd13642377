"""The StragglerSLOMet condition and its Events, judged on the job's real controller."""

from __future__ import annotations

import pytest

from rlpacer.api.protocol import RoundKind
from rlpacer.api.status import ConditionType, RLTrainingJobStatus, find
from rlpacer.control.plan import JobController, JobControllerConfig, LengthStats, StepReportData
from rlpacer.control.sagc import SAGCConfig
from rlpacer.operator import enforce

pytestmark = pytest.mark.unit


def feed(jc: JobController, st: RLTrainingJobStatus, ratios: list[float]) -> list[str]:
    reasons = []
    for r in ratios:
        p = jc.plan()
        jc.observe(StepReportData(
            attempt=0, step=p.step, group_size=p.group_size, round_kind=RoundKind.SHORT,
            lengths=LengthStats(max=100.0 * r, median=100.0, p90=100.0 * r, count=8)))
        events = enforce.judge_straggler_slo(st, jc, now=f"t{p.step}", generation=1)
        reasons += [e.reason for e in events]
        assert all(e.type == ("Normal" if e.reason == "StragglerSLOMet" else "Warning")
                   for e in events)
    return reasons


def test_condition_and_one_event_per_transition() -> None:
    jc = JobController(JobControllerConfig(sagc=SAGCConfig(tau=4.0, delta=0.2, dual_step=1.0)))
    st = RLTrainingJobStatus()
    assert feed(jc, st, [1.5] * 4) == []
    assert find(st.conditions, ConditionType.STRAGGLER_SLO_MET) is None  # not judged yet
    assert feed(jc, st, [1.5] * 10) == []  # within the target: True, no Event
    c = find(st.conditions, ConditionType.STRAGGLER_SLO_MET)
    assert c is not None and (c.status, c.reason) == ("True", "WithinTarget")
    # every G straggles: Exceeded, then Infeasible, one Event each, however long it lasts
    assert feed(jc, st, [8.0] * 60) == ["StragglerSLOExceeded", "StragglerSLOInfeasible"]
    c = find(st.conditions, ConditionType.STRAGGLER_SLO_MET)
    assert c is not None and (c.status, c.reason) == ("False", "Infeasible")
    assert "targetStragglerRate 0.2" in c.message and "G=4 " in c.message
    assert c.last_transition_time != "t73"  # the status flipped once, at the breach
    # the workload calms down: back within the target, one Normal Event
    assert feed(jc, st, [1.5] * 60) == ["StragglerSLOMet"]
    c = find(st.conditions, ConditionType.STRAGGLER_SLO_MET)
    assert c is not None and (c.status, c.reason) == ("True", "WithinTarget")
