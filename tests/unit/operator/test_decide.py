"""The reconcile decision and the scaler: lifecycle, restarts, deadlines, long rounds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rlpacer.api import contract
from rlpacer.api.job import parse_spec
from rlpacer.api.protocol import RoundKind
from rlpacer.api.status import ConditionType, RLTrainingJobStatus, Summary, is_true
from rlpacer.operator import scaler
from rlpacer.operator.decide import Observed, decide, restart_attempt
from rlpacer.operator.runtime import last_error_line

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _spec(**kw: object):
    base = {
        "model": {"source": "builtin://tiny"},
        "data": {"source": "builtin://adder"},
        "steps": 10,
        "promptsPerStep": 4,
        "rollout": {"replicas": 1},
        "tailBatching": {"longRound": {"rolloutReplicas": 3, "scaleUpTimeoutSeconds": 60}},
        "backoffLimit": 1,
    }
    base.update(kw)
    return parse_spec(base)


def _run(spec, st, obs, t=T0):
    return decide(spec, st, obs, t, 1)


def test_admit_run_succeed_ttl() -> None:
    spec = _spec(ttlSecondsAfterFinished=30)
    d = _run(spec, RLTrainingJobStatus(), Observed())
    assert is_true(d.status.conditions, ConditionType.ADMITTED) and d.workloads
    assert d.status.summary == Summary.STARTING and d.status.rollout.desired_replicas == 1
    d = _run(spec, d.status, Observed(driver_phase="Running", rollout_ready=1))
    assert d.status.summary == Summary.RUNNING
    assert is_true(d.status.conditions, ConditionType.ROLLOUT_READY)
    d = _run(spec, d.status, Observed(driver_phase="Succeeded"))
    assert d.status.summary == Summary.SUCCEEDED and not d.workloads
    assert d.status.completion_time is not None
    d2 = _run(spec, d.status, Observed(), T0 + timedelta(seconds=10))
    assert not d2.delete_job and d2.requeue_after == pytest.approx(20)
    assert _run(spec, d.status, Observed(), T0 + timedelta(seconds=31)).delete_job


def test_restart_within_backoff_then_fail() -> None:
    spec = _spec()
    st = _run(spec, RLTrainingJobStatus(), Observed(driver_phase="Running")).status
    d = _run(spec, st, Observed(driver_phase="Failed", driver_message="OOMKilled"))
    assert d.status.attempt == 1 and d.status.failures == 1 and d.workloads
    assert d.status.summary == Summary.RESTARTING
    assert any(e.reason == "Restarting" for e in d.events)
    d = _run(spec, d.status, Observed(driver_phase="Failed"))
    assert d.status.summary == Summary.FAILED and not d.workloads
    failed = next(c for c in d.status.conditions if c.type == ConditionType.FAILED)
    assert failed.reason == "BackoffLimitExceeded"


def test_an_operator_restart_is_a_new_attempt_not_a_failure() -> None:
    """restart_attempt (the driver runs with another Ray token than the job's): attempt + 1,
    failures unchanged (backoffLimit 0 still survives it), back to short-round capacity."""
    spec = _spec(backoffLimit=0)
    st = _run(spec, RLTrainingJobStatus(), Observed(driver_phase="Running")).status
    st.rollout = st.rollout.model_copy(update={"desired_replicas": 3, "state": "ScalingUp"})
    new, ev = restart_attempt(spec, st, "another Ray token", T0, 1)
    assert (new.attempt, new.failures) == (1, 0) and st.attempt == 0  # st untouched
    assert new.summary == Summary.RESTARTING and ev.reason == "Restarting"
    assert "another Ray token" in ev.message and "attempt 1" in ev.message
    assert new.rollout.desired_replicas == 1 and new.rollout.state == "Ready"
    d = _run(spec, new, Observed(attempt=1, driver_phase="Running"))
    assert d.status.summary == Summary.RUNNING and d.workloads


def test_suspend_resume_is_a_new_attempt_not_a_failure() -> None:
    spec = _spec()
    st = _run(spec, RLTrainingJobStatus(), Observed(driver_phase="Running")).status
    d = _run(_spec(suspend=True), st, Observed(driver_phase="Running"))
    assert d.status.summary == Summary.SUSPENDED and not d.workloads
    d = _run(spec, d.status, Observed(), T0 + timedelta(seconds=5))
    assert d.status.attempt == 1 and d.status.failures == 0 and d.workloads
    assert not is_true(d.status.conditions, ConditionType.SUSPENDED)


def test_active_deadline() -> None:
    spec = _spec(activeDeadlineSeconds=100)
    st = _run(spec, RLTrainingJobStatus(), Observed(driver_phase="Running")).status
    d = _run(spec, st, Observed(driver_phase="Running"), T0 + timedelta(seconds=50))
    assert d.requeue_after == pytest.approx(50) and d.workloads
    d = _run(spec, st, Observed(driver_phase="Running"), T0 + timedelta(seconds=100))
    assert d.status.summary == Summary.FAILED and not d.workloads
    assert any(e.reason == "DeadlineExceeded" for e in d.events)


def test_long_round_scale_up_ready_then_down() -> None:
    spec = _spec()
    ro = RLTrainingJobStatus().rollout.model_copy(
        update={"desired_replicas": 1, "ready_replicas": 1}
    )
    ro, actions, ev = scaler.plan_round(ro, spec, RoundKind.LONG, 5, T0)
    assert ro.desired_replicas == 3 and ro.state == "ScalingUp" and actions[0].to_replicas == 3
    ro, _, ev = scaler.observe(ro, spec, 2, 5, T0 + timedelta(seconds=10))
    assert ro.state == "ScalingUp" and not ev
    ro, _, ev = scaler.observe(ro, spec, 3, 5, T0 + timedelta(seconds=20))
    assert ro.state == "Ready" and ev[0].reason == "ScaledUp"
    ro, actions, ev = scaler.plan_round(ro, spec, RoundKind.SHORT, 6, T0 + timedelta(seconds=30))
    assert ro.desired_replicas == 1 and actions[0].reason == "LongRoundDone"


def test_scale_up_timeout_scales_back_to_what_is_ready() -> None:
    spec = _spec()
    ro = RLTrainingJobStatus().rollout.model_copy(
        update={"desired_replicas": 1, "ready_replicas": 1}
    )
    ro, _, _ = scaler.plan_round(ro, spec, RoundKind.LONG, 5, T0)
    assert scaler.seconds_to_deadline(ro, spec, T0 + timedelta(seconds=45)) == pytest.approx(15)
    ro, actions, ev = scaler.observe(ro, spec, 2, 5, T0 + timedelta(seconds=61))
    assert ro.state == "TimedOut" and ro.desired_replicas == 2
    assert ev[0].type == "Warning" and ev[0].reason == "ScaleUpTimedOut"
    assert actions[0].from_replicas == 3 and actions[0].to_replicas == 2
    # the next short round goes back to the short-round capacity
    ro, actions, _ = scaler.plan_round(ro, spec, RoundKind.SHORT, 6, T0 + timedelta(seconds=90))
    assert ro.desired_replicas == 1 and ro.state == "Ready"


def test_timeout_scales_back_only_above_the_highest_ready_replica() -> None:
    spec = _spec()  # long round: 3 replicas
    ro = RLTrainingJobStatus().rollout.model_copy(
        update={"desired_replicas": 1, "ready_replicas": 1})
    ro, _, _ = scaler.observe(ro, spec, 1, 5, T0, ordinals=[0])
    ro, _, _ = scaler.plan_round(ro, spec, RoundKind.LONG, 5, T0)
    late = T0 + timedelta(seconds=61)
    # in order: 0 and 1 ready, 2 pending -> back to 2, the pending 2 goes
    done, acts, _ = scaler.observe(ro, spec, 2, 5, late, ordinals=[0, 1])
    assert done.desired_replicas == 2 and acts[0].to_replicas == 2
    assert scaler.capacity(done).usable_replicas == [0, 1]
    # only 0 ready -> back to the short round's 1
    done, acts, _ = scaler.observe(ro, spec, 1, 5, late, ordinals=[0])
    assert done.desired_replicas == 1 and acts[0].to_replicas == 1
    # ordinals unknown (an older CRD pruned them): the ready count
    ro_no = ro.model_copy(update={"ready_ordinals": None})
    done, _, _ = scaler.observe(ro_no, spec, 2, 5, late)
    assert done.desired_replicas == 2


def test_decide_times_out_a_pending_scale_up() -> None:
    spec = _spec()
    st = _run(spec, RLTrainingJobStatus(), Observed(driver_phase="Running", rollout_ready=1)).status
    ro, _, _ = scaler.plan_round(st.rollout, spec, RoundKind.LONG, 0, T0)
    st = st.model_copy(update={"rollout": ro})
    d = _run(
        spec, st, Observed(driver_phase="Running", rollout_ready=1), T0 + timedelta(seconds=30)
    )
    assert d.requeue_after is not None and d.requeue_after <= 31
    d = _run(
        spec, st, Observed(driver_phase="Running", rollout_ready=1), T0 + timedelta(seconds=61)
    )
    assert d.status.rollout.state == "TimedOut" and d.status.rollout.desired_replicas == 1
    assert d.status.scale_actions[-1].reason == "ScaleUpTimedOut"
    lr = next(c for c in d.status.conditions if c.type == ConditionType.LONG_ROUND)
    assert lr.reason == "ScaleUpTimedOut"


def _pod(i: int, ready: bool, deleting: bool = False, sts: str = "job-rollout") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"{sts}-{i}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta,
            "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_ready_ordinals_and_usable_replicas_with_a_gap() -> None:
    pods = [_pod(2, True), _pod(0, True), _pod(1, False), _pod(3, True, deleting=True),
            _pod(4, True, sts="other-rollout")]
    assert scaler.ready_ordinals(pods, "job-rollout") == [0, 2]
    spec = _spec()
    ro = RLTrainingJobStatus().rollout.model_copy(
        update={"desired_replicas": 1, "ready_replicas": 1})
    assert scaler.capacity(ro).usable_replicas is None  # never observed: field left out
    ro, _, _ = scaler.observe(ro, spec, 1, 5, T0, ordinals=[0])
    ro, _, _ = scaler.plan_round(ro, spec, RoundKind.LONG, 5, T0)
    assert scaler.capacity(ro).usable_replicas == [0]  # scaling up: only 0 so far
    # 2 came up before 1: both 0 and 2 may serve while the scale-up waits for 1
    ro, _, _ = scaler.observe(ro, spec, 2, 5, T0 + timedelta(seconds=10), ordinals=[2, 0])
    assert ro.state == "ScalingUp" and scaler.capacity(ro).usable_replicas == [0, 2]
    # timed out: a StatefulSet scales down from its highest ordinal, so scaling back to the
    # ready count (2) would delete the ready 2 and keep the pending 1. The count keeps every
    # ready replica (3: the pending 1 stays, unused); both ready ones serve the round.
    ro, acts, ev = scaler.observe(ro, spec, 2, 5, T0 + timedelta(seconds=61), ordinals=[0, 2])
    cap = scaler.capacity(ro)
    assert ro.state == "TimedOut" and cap.desired_replicas == 3 and cap.usable_replicas == [0, 2]
    assert (acts[0].from_replicas, acts[0].to_replicas) == (3, 3)
    assert ev[0].reason == "ScaleUpTimedOut" and "scaled back" not in ev[0].message
    # the long round done: back to short capacity, the extra replicas are not usable
    ro, _, _ = scaler.observe(ro, spec, 3, 6, T0 + timedelta(seconds=70), ordinals=[0, 1, 2])
    ro, _, _ = scaler.plan_round(ro, spec, RoundKind.SHORT, 6, T0 + timedelta(seconds=90))
    assert scaler.capacity(ro).usable_replicas == [0]


def test_a_long_round_right_after_a_scale_down_waits_for_its_replicas() -> None:
    """A short round cuts the long round's replicas; another long round asked for before any
    pod was seen going (a one-second short round) must wait for its replicas to be ready
    again, not start at once on the cut pods' stale readiness (they are being deleted)."""
    spec = _spec()
    ro = RLTrainingJobStatus().rollout.model_copy(
        update={"desired_replicas": 1, "ready_replicas": 1})
    ro, _, _ = scaler.observe(ro, spec, 1, 1, T0, ordinals=[0])
    ro, _, _ = scaler.plan_round(ro, spec, RoundKind.LONG, 1, T0)
    ro, _, _ = scaler.observe(ro, spec, 3, 1, T0 + timedelta(seconds=20), ordinals=[0, 1, 2])
    assert ro.state == "Ready" and scaler.capacity(ro).usable_replicas == [0, 1, 2]
    # step 2 short: cut to 1; no pod observed since
    ro, acts, _ = scaler.plan_round(ro, spec, RoundKind.SHORT, 2, T0 + timedelta(seconds=30))
    assert (acts[0].from_replicas, acts[0].to_replicas) == (3, 1)
    assert ro.ready_ordinals == [0] and ro.ready_replicas == 1
    # step 3 long again, one second later: scaling up, only replica 0 usable
    ro, acts, _ = scaler.plan_round(ro, spec, RoundKind.LONG, 3, T0 + timedelta(seconds=31))
    assert ro.state == "ScalingUp" and scaler.capacity(ro).usable_replicas == [0]
    assert (acts[0].from_replicas, acts[0].to_replicas) == (1, 3)
    # ready once the pods are seen ready (not being deleted) again
    ro, _, ev = scaler.observe(ro, spec, 3, 3, T0 + timedelta(seconds=50), ordinals=[0, 1, 2])
    assert ro.state == "Ready" and ev[-1].reason == "ScaledUp"


def test_a_policy_tightened_while_a_scale_up_pends_cuts_it_at_once() -> None:
    """The long round asked for the spec's replicas; a policy then allows fewer: the next
    observation (a reconcile pass, no report) cuts the pending scale-up to the cap, recorded
    and told, and the round can start once that many are ready. Never below the short
    round's replicas; no cap (or a looser one) changes nothing."""
    spec = _spec()
    long_r = scaler.long_replicas(spec)
    short = scaler.short_replicas(spec)
    assert long_r > short + 1, (long_r, short)
    ro = RLTrainingJobStatus().rollout.model_copy(
        update={"desired_replicas": short, "ready_replicas": short})
    ro, _, _ = scaler.plan_round(ro, spec, RoundKind.LONG, 3, T0)
    assert ro.state == "ScalingUp" and ro.desired_replicas == long_r
    same, acts, evs = scaler.observe(ro, spec, short, 3, T0, long_cap=None)
    assert same.desired_replicas == long_r and not acts and not evs
    same, acts, _ = scaler.observe(ro, spec, short, 3, T0, long_cap=long_r + 4)
    assert same.desired_replicas == long_r and not acts
    cut, acts, evs = scaler.observe(ro, spec, short, 3, T0 + timedelta(seconds=5),
                                    long_cap=short + 1)
    assert cut.state == "ScalingUp" and cut.desired_replicas == short + 1
    assert [(a.reason, a.from_replicas, a.to_replicas) for a in acts] == [
        ("PolicyClamped", long_r, short + 1)]
    assert [e.reason for e in evs] == ["PolicyClamped"] and "pending scale-up" in evs[0].message
    ready, acts, evs = scaler.observe(cut, spec, short + 1, 3, T0 + timedelta(seconds=6),
                                      long_cap=short + 1)
    assert ready.state == "Ready" and not acts and [e.reason for e in evs] == ["ScaledUp"]
    floor, acts, _ = scaler.observe(ro, spec, short, 3, T0, long_cap=0)
    assert floor.desired_replicas == short and floor.state == "Ready"
    assert [a.to_replicas for a in acts] == [short]


def test_a_ready_replica_above_a_cut_scale_up_does_not_make_it_ready() -> None:
    """1 -> 3 replicas with Parallel pods: 0 and 2 come up, 1 pends; a policy then cuts the
    scale-up to 2. The StatefulSet counts 2 ready, but the cut deletes replica 2: the round
    would run one short. Ready only once 0 and 1 are."""
    spec = _spec(rollout={"replicas": 1}, tailBatching={"longRound": {"rolloutReplicas": 3}})
    ro = RLTrainingJobStatus().rollout.model_copy(
        update={"desired_replicas": 1, "ready_replicas": 1, "ready_ordinals": [0]})
    ro, _, _ = scaler.plan_round(ro, spec, RoundKind.LONG, 3, T0)
    assert ro.state == "ScalingUp" and ro.desired_replicas == 3
    cut, acts, _ = scaler.observe(ro, spec, 2, 3, T0, ordinals=[0, 2], long_cap=2)
    assert [a.reason for a in acts] == ["PolicyClamped"] and cut.desired_replicas == 2
    assert cut.state == "ScalingUp", "replica 2 goes with the cut; 1 is not ready yet"
    # the StatefulSet deletes 2 (its ready count drops to 1); then 1 comes up
    gone, _, evs = scaler.observe(cut, spec, 1, 3, T0 + timedelta(seconds=3), ordinals=[0],
                                  long_cap=2)
    assert gone.state == "ScalingUp" and not evs
    done, _, evs = scaler.observe(gone, spec, 2, 3, T0 + timedelta(seconds=9),
                                  ordinals=[0, 1], long_cap=2)
    assert done.state == "Ready" and [e.reason for e in evs] == ["ScaledUp"]
    assert scaler.capacity(done).usable_replicas == [0, 1]
    # scaled back to 1, replicas 1 and 2 still terminating: the StatefulSet may still count
    # them ready, the ordinals (never a deleting pod) do not; the next long round waits
    back = done.model_copy(update={"desired_replicas": 1, "state": "Ready",
                                   "ready_replicas": 3, "ready_ordinals": [0]})
    again, _, _ = scaler.plan_round(back, spec, RoundKind.LONG, 4, T0 + timedelta(seconds=20))
    assert again.state == "ScalingUp"
    up, _, _ = scaler.observe(again, spec, 3, 4, T0 + timedelta(seconds=21), ordinals=[0])
    assert up.state == "ScalingUp"


def test_the_ready_count_is_the_ready_pods_when_the_statefulsets_count_lags() -> None:
    """A busy control plane: the scale-up's pods are Ready (ordinals 0 and 1) while the
    StatefulSet still counts 1. The plan says Ready with 2 ready, as its Event does; a
    terminating pod the StatefulSet still counts is not counted."""
    spec = _spec(rollout={"replicas": 1}, tailBatching={"longRound": {"rolloutReplicas": 2}})
    ro = RLTrainingJobStatus().rollout.model_copy(
        update={"desired_replicas": 1, "ready_replicas": 1, "ready_ordinals": [0]})
    ro, _, _ = scaler.plan_round(ro, spec, RoundKind.LONG, 3, T0)
    done, _, evs = scaler.observe(ro, spec, 1, 3, T0 + timedelta(seconds=4), ordinals=[1, 0])
    assert done.state == "Ready" and done.ready_replicas == 2
    assert [e.message for e in evs] == ["2/2 rollout replicas ready after 4s"]
    cap = scaler.capacity(done)
    assert cap.ready_replicas == 2 and cap.usable_replicas == [0, 1]
    gone, _, _ = scaler.observe(done, spec, 2, 4, T0 + timedelta(seconds=9), ordinals=[0])
    assert gone.ready_replicas == 1


@pytest.mark.parametrize("exit_code", [contract.EXIT_DATA_INVALID, 1, 2, 137, None])
def test_bad_data_fails_the_job_at_once_other_exits_retry(exit_code: int | None) -> None:
    spec = _spec(backoffLimit=3, ttlSecondsAfterFinished=60)
    st = _run(spec, RLTrainingJobStatus(), Observed(driver_phase="Running")).status
    why = "spec.data.source: /d/train.jsonl line 7: field 'meta.question' missing"
    d = _run(spec, st, Observed(driver_phase="Failed", driver_message=why,
                                driver_exit_code=exit_code))
    if exit_code != contract.EXIT_DATA_INVALID:
        assert d.status.summary == Summary.RESTARTING and d.status.failures == 1
        return
    assert d.status.summary == Summary.FAILED and not d.workloads
    assert d.status.failures == 0 and d.status.attempt == 0  # no backoffLimit retry spent
    failed = next(c for c in d.status.conditions if c.type == ConditionType.FAILED)
    assert failed.reason == "DataInvalid" and why in failed.message
    assert [e.reason for e in d.events] == ["DataInvalid"]
    assert d.requeue_after == pytest.approx(60)  # the TTL clock of a finished job


def test_the_drivers_error_line_is_the_message() -> None:
    tail = ("Traceback ...\nerror: data invalid: spec.data.source: /d/t.jsonl line 3: not valid"
            " JSON\n\n")
    assert last_error_line(tail) == ("data invalid: spec.data.source: /d/t.jsonl line 3: not"
                                     " valid JSON")
    assert last_error_line("a\nlast words\n") == "last words"
    assert len(last_error_line("error: " + "x" * 5000)) == 1024
