"""``POST release`` in the operator's pure parts: the scaler's early scale-back of a long
round's added replicas, and what the endpoint accepts (the real API server's test:
tests/integration/test_operator.py::test_a_long_round_releases_its_added_replicas_before_its_report)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rlpacer.api.job import parse_spec
from rlpacer.api.protocol import ReleaseRequest, RoundKind
from rlpacer.api.status import RLTrainingJobStatus, RolloutStatus
from rlpacer.control.plan import ReportRejected
from rlpacer.operator import hosting, reports, scaler

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
SPEC = parse_spec({
    "model": {"source": "builtin://tiny"}, "data": {"source": "builtin://adder"},
    "steps": 10, "promptsPerStep": 4, "rollout": {"replicas": 1, "gpusPerReplica": 0},
    "tailBatching": {"longRound": {"rolloutReplicas": 3}},
})


def _long_round_status(step: int = 1) -> RLTrainingJobStatus:
    ro, _, _ = scaler.plan_round(RolloutStatus(desired_replicas=1, ready_replicas=1,
                                               ready_ordinals=[0], state="Ready"),
                                 SPEC, RoundKind.LONG, step, NOW)
    ro = ro.model_copy(update={"ready_replicas": 3, "ready_ordinals": [0, 1, 2],
                               "state": "Ready"})
    return RLTrainingJobStatus(step=step, round_kind="Long", attempt=0, rollout=ro,
                               controller_state=hosting.new_state(SPEC))


def test_release_scales_back_to_the_short_rounds_count_and_drops_the_cut_ordinals() -> None:
    st = _long_round_status()
    new, acc = reports.accept_release(SPEC, st, ReleaseRequest(attempt=0, step=1), NOW)
    ro = new.rollout
    assert (ro.desired_replicas, ro.state, ro.ready_ordinals, ro.ready_replicas) == (
        1, "Ready", [0], 1)
    assert [(a.reason, a.from_replicas, a.to_replicas, a.step) for a in new.scale_actions] == [
        ("LongRoundReleased", 3, 1, 1)]
    assert [e.reason for e in acc.events] == ["ScaledDown"] and acc.new
    assert acc.plan.rollout.desired_replicas == 1  # the answer: the plan with its capacity
    # a repeat finds nothing to release: the same status, nothing new
    again, acc2 = reports.accept_release(SPEC, new, ReleaseRequest(attempt=0, step=1), NOW)
    assert again == new and not acc2.new and acc2.events == []
    # the step's report of the long round, a short one next, then changes no capacity
    ro2, actions, _ = scaler.plan_round(new.rollout, SPEC, RoundKind.SHORT, 2, NOW)
    assert actions == [] and ro2.desired_replicas == 1


@pytest.mark.parametrize(("req", "why"), [
    (ReleaseRequest(attempt=1, step=1), "AttemptMismatch"),
    (ReleaseRequest(attempt=0, step=2), "NotALongRound"),
])
def test_release_is_refused_for_another_attempt_or_step(req: ReleaseRequest, why: str) -> None:
    st = _long_round_status()
    with pytest.raises(ReportRejected) as err:
        reports.accept_release(SPEC, st, req, NOW)
    assert err.value.reason == why


def test_release_is_refused_when_the_step_under_way_is_short() -> None:
    st = _long_round_status().model_copy(update={"round_kind": "Short"})
    with pytest.raises(ReportRejected, match="not a long round under way"):
        reports.accept_release(SPEC, st, ReleaseRequest(attempt=0, step=1), NOW)
