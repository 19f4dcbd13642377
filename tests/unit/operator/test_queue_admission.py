"""Kueue admission, the pure part: the Workloads the operator makes and writes back
(rlpacer.operator.queue) and the reconcile decision of a job that names a queue
(rlpacer.operator.decide). The real flow, with Kueue's controller manager and webhooks, is
tests/integration/test_kueue_admission.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rlpacer.api import contract
from rlpacer.api.job import ManifestError, parse_spec
from rlpacer.api.protocol import RoundKind
from rlpacer.api.status import (
    ConditionType,
    Reason,
    RLTrainingJobStatus,
    Summary,
    find,
    is_true,
)
from rlpacer.operator import builders, queue, scaler
from rlpacer.operator.decide import Observed, decide, eviction_grace_left

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _spec(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "model": {"source": "builtin://tiny"},
        "data": {"source": "builtin://adder"},
        "steps": 10, "promptsPerStep": 4,
        "rollout": {"replicas": 2, "gpusPerReplica": 1},
        "trainer": {"replicas": 1, "gpusPerReplica": 2},
        "tailBatching": {"longRound": {"rolloutReplicas": 5}},
        "scheduling": {"queueName": "team"},
    }
    base.update(kw)
    return parse_spec(base)


def _wl(conds: list[tuple[str, str, str]], admission: dict[str, Any] | None = None
        ) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [
        {"type": t, "status": s, "reason": r, "message": f"{t} {r}"} for t, s, r in conds]}
    if admission is not None:
        status["admission"] = admission
    return {"apiVersion": queue.API_VERSION, "kind": "Workload",
            "metadata": {"name": "j-workload", "namespace": "ns", "generation": 1},
            "spec": {"podSets": [{"name": "rollout", "count": 2}]}, "status": status}


ADMISSION = {"clusterQueue": "cq", "podSetAssignments": [
    {"name": "rollout", "flavors": {"nvidia.com/gpu": "h100"}},
    {"name": "learner", "flavors": {"nvidia.com/gpu": "h100", "cpu": "default"}}]}
ADMITTED = _wl([("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted")],
               ADMISSION)
EVICTED = _wl([("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"),
               ("Evicted", "True", "Preempted")], ADMISSION)
PENDING = _wl([("QuotaReserved", "False", "Pending")])


# --- reading and writing Workloads ---------------------------------------------------------
def test_parse_reads_admission_eviction_and_kueues_message() -> None:
    v = queue.parse(ADMITTED)
    assert v.admitted and v.reserved and v.evicted is None and v.cluster_queue == "cq"
    assert v.flavors["learner"] == {"nvidia.com/gpu": "h100", "cpu": "default"}
    assert queue.flavor_names(v) == {"h100", "default"}
    assert v.counts == {"rollout": 2}
    e = queue.parse(EVICTED)
    assert not e.admitted and e.reserved and e.evicted == ("Preempted", "Evicted Preempted")
    p = queue.parse(PENDING)
    assert not p.admitted and not p.reserved and p.message == "QuotaReserved Pending"
    assert queue.parse(None) == queue.ABSENT and not queue.ABSENT.exists


@pytest.mark.parametrize(("reason", "requeued"), [("Preempted", "True"),
                                                  ("NodeFailures", "True"),
                                                  ("InactiveWorkload", "False")])
def test_give_back_writes_what_kueues_job_reconciler_writes(reason: str, requeued: str) -> None:
    wl = _wl([("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"),
              ("Evicted", "True", reason)], ADMISSION)
    out = queue.give_back(wl, "2026-01-01T00:00:00Z")
    conds = {c["type"]: c for c in out["status"]["conditions"]}
    assert conds["QuotaReserved"]["status"] == "False"
    assert conds["Admitted"]["status"] == "False"
    assert conds["Requeued"]["status"] == requeued and conds["Requeued"]["reason"] == reason
    assert conds["Evicted"]["status"] == "True"  # Kueue's to clear on the next admission
    assert "admission" not in out["status"]
    assert wl["status"]["admission"] == ADMISSION  # the input is not changed
    v = queue.parse(out)
    assert not v.reserved and not v.admitted


def test_finish_marks_the_workload_finished() -> None:
    out = queue.finish(ADMITTED, False, "the job Failed", "2026-01-01T00:00:00Z")
    fin = next(c for c in out["status"]["conditions"] if c["type"] == "Finished")
    assert fin["status"] == "True" and fin["reason"] == "Failed"
    assert queue.parse(out).finished and not queue.parse(ADMITTED).finished


def test_placement_takes_each_flavors_node_labels_and_tolerations() -> None:
    flavors = {"h100": {"nodeLabels": {"pool": "h100"}, "tolerations": [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "default": {"nodeLabels": {"zone": "a"}}}
    p = queue.placement(queue.parse(ADMITTED), flavors)
    assert dict(p["rollout"].node_selector) == {"pool": "h100"}
    assert dict(p["learner"].node_selector) == {"pool": "h100", "zone": "a"}
    assert p["rollout"].tolerations == ({"key": "gpu", "operator": "Exists",
                                         "effect": "NoSchedule"},)
    # onto the pods of that role, beside the job's own selector
    spec = _spec(scheduling={"queueName": "team", "nodeSelector": {"team": "rl"}})
    inputs = builders.BuildInputs(name="j", namespace="ns", uid="u", spec=spec, attempt=0,
                                  rollout_replicas=2, report_url="http://x", placement=p)
    pods = {c["metadata"]["name"]: c for c in builders.build_children(inputs)}
    rollout = pods["j-rollout"]["spec"]["template"]["spec"]
    assert rollout["nodeSelector"] == {"team": "rl", "pool": "h100"}
    assert {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"} in rollout["tolerations"]
    head = pods["j-head"]["spec"]["template"]["spec"]
    assert head["nodeSelector"] == {"team": "rl"}


def test_the_jobs_workload_has_a_pod_set_per_role_with_its_resources_and_priority() -> None:
    spec = _spec(scheduling={"queueName": "team", "priorityClassName": "high"})
    inputs = builders.BuildInputs(name="j", namespace="ns", uid="u", spec=spec, attempt=0,
                                  rollout_replicas=2, report_url="http://x")
    pods = {r: builders.pod_template_spec(inputs, r) for r in contract.Role}
    wl = queue.job_workload("j", "ns", "u", spec, pods, 1000, "rlpacer.io/v1alpha1",
                            "RLTrainingJob")
    sets = {p["name"]: p for p in wl["spec"]["podSets"]}
    assert {k: p["count"] for k, p in sets.items()} == {"head": 1, "learner": 1, "rollout": 2,
                                                         "driver": 1}
    res = sets["learner"]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"][contract.GPU_RESOURCE] == "2"  # requests from limits
    assert wl["spec"]["queueName"] == "team"
    assert wl["spec"]["priority"] == 1000
    assert wl["spec"]["priorityClassRef"] == {"group": "scheduling.k8s.io",
                                              "kind": "PriorityClass", "name": "high"}
    assert wl["metadata"]["ownerReferences"][0]["uid"] == "u"
    # no priority class: no priority fields (Kueue's default)
    bare = queue.job_workload("j", "ns", "u", _spec(), pods, None, "v", "K")
    assert "priority" not in bare["spec"]
    # the long round's extras: one pod set on the admitted rollout flavor's nodes
    lw = queue.long_round_workload("j", "ns", "u", _spec(tailBatching={"longRound": {
        "rolloutReplicas": 5, "queueName": "burst"}}), pods[contract.Role.ROLLOUT], 3, None,
        queue.Placement(node_selector={"pool": "h100"}), "v", "K")
    assert lw["spec"]["queueName"] == "burst"
    assert [(p["name"], p["count"]) for p in lw["spec"]["podSets"]] == [("rollout", 3)]
    assert lw["spec"]["podSets"][0]["template"]["spec"]["nodeSelector"] == {"pool": "h100"}
    assert lw["metadata"]["name"] == queue.long_round_name("j") != wl["metadata"]["name"]


def test_a_long_round_queue_needs_the_jobs_queue() -> None:
    with pytest.raises(ManifestError, match=r"needs scheduling\.queueName"):
        _spec(scheduling={}, tailBatching={"longRound": {"rolloutReplicas": 5,
                                                         "queueName": "burst"}})
    assert queue.long_round_queue(_spec()) == "team"
    assert queue.long_round_queue(_spec(scheduling={})) is None


# --- the reconcile decision ----------------------------------------------------------------
def _cond(st: RLTrainingJobStatus, t: ConditionType) -> Any:
    c = find(st.conditions, t)
    assert c is not None, st.conditions
    return c


def test_a_queued_job_runs_nothing_until_admitted_then_starts_as_attempt_0() -> None:
    spec = _spec()
    d = decide(spec, RLTrainingJobStatus(), Observed(queue=queue.parse(PENDING)), T0, 1)
    assert not d.workloads and d.status.summary == Summary.QUEUED
    assert d.status.start_time is None and d.status.attempt == 0
    c = _cond(d.status, ConditionType.QUEUE_ADMITTED)
    assert c.status == "False" and c.reason == Reason.WAITING_FOR_QUEUE
    assert "QuotaReserved Pending" in c.message  # Kueue's word
    assert sorted(e.reason for e in d.events) == ["Created", "Queued"]
    # still waiting: no new Event
    d = decide(spec, d.status, Observed(queue=queue.parse(PENDING)), T0, 1)
    assert not d.workloads and d.events == []
    # admitted: children, attempt 0, the clock starts now
    t1 = T0 + timedelta(minutes=5)
    d = decide(spec, d.status, Observed(queue=queue.parse(ADMITTED)), t1, 1)
    assert d.workloads and d.status.attempt == 0 and d.status.summary == Summary.STARTING
    assert d.status.start_time == "2026-01-01T00:05:00Z"
    assert _cond(d.status, ConditionType.QUEUE_ADMITTED).reason == Reason.ADMITTED_BY_KUEUE
    assert "cq" in _cond(d.status, ConditionType.QUEUE_ADMITTED).message
    assert {e.reason for e in d.events} >= {"QueueAdmitted", "Resumed"}


def test_an_evicted_job_stops_and_resumes_as_a_new_attempt_with_its_state() -> None:
    spec = _spec()
    st = decide(spec, RLTrainingJobStatus(), Observed(queue=queue.parse(ADMITTED)), T0,
                1).status
    st = decide(spec, st, Observed(driver_phase="Running", queue=queue.parse(ADMITTED)), T0,
                1).status
    st = st.model_copy(update={"step": 7, "controller_state": '{"x": 1}'})
    d = decide(spec, st, Observed(driver_phase="Running", queue=queue.parse(EVICTED)), T0, 1)
    assert not d.workloads and d.status.summary == Summary.QUEUED
    held = _cond(d.status, ConditionType.SUSPENDED)
    assert held.status == "True" and held.reason == Reason.EVICTED
    assert "Preempted" in held.message
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "Evicted")]
    # the quota given back, waiting again: still Evicted (not a new Event)
    d = decide(spec, d.status, Observed(queue=queue.parse(EVICTED)), T0, 1)
    assert d.events == [] and not d.workloads
    # admitted again: a new attempt from the last checkpoint, not a failure, state kept
    d = decide(spec, d.status, Observed(queue=queue.parse(ADMITTED)), T0, 1)
    assert d.workloads and d.status.attempt == 1 and d.status.failures == 0
    assert d.status.step == 7 and d.status.controller_state == '{"x": 1}'


def test_an_evicted_job_with_a_claim_keeps_its_pods_for_the_drivers_checkpoint() -> None:
    """checkpoint.evictionGraceSeconds (default 120 s with a claim): evicted while its driver
    runs, the job's pods are neither deleted nor re-applied until the driver stops (it is
    answered done at its next report and checkpoints there) or the grace is over."""
    spec = _spec(checkpoint={"volumeClaim": "ckpt"})
    assert spec.checkpoint.eviction_grace == 120
    st = decide(spec, RLTrainingJobStatus(), Observed(queue=queue.parse(ADMITTED)), T0,
                1).status
    st = decide(spec, st, Observed(driver_phase="Running", queue=queue.parse(ADMITTED)), T0,
                1).status
    running = Observed(driver_phase="Running", queue=queue.parse(EVICTED))
    d = decide(spec, st, running, T0, 1)
    assert d.keep_children and d.requeue_after == pytest.approx(120.5)
    held = _cond(d.status, ConditionType.SUSPENDED)
    assert held.reason == Reason.EVICTED and "checkpoints at its next step report" in held.message
    said = [e for e in d.events if e.reason == "EvictionCheckpoint"]
    assert len(said) == 1 and "kept up to 120s" in said[0].message, d.events
    assert eviction_grace_left(spec, d.status, T0 + timedelta(seconds=30)) == pytest.approx(90)
    # 30 s on, the driver still runs: still kept, the same message (no status write), said once
    d2 = decide(spec, d.status, running, T0 + timedelta(seconds=30), 1)
    assert d2.keep_children and d2.requeue_after == pytest.approx(90.5)
    assert not [e for e in d2.events if e.reason == "EvictionCheckpoint"]
    assert _cond(d2.status, ConditionType.SUSPENDED) == held
    # the driver stopped (it checkpointed at the step it was answered done at): pods deleted
    done = Observed(driver_phase="Succeeded", queue=queue.parse(EVICTED))
    d3 = decide(spec, d2.status, done, T0 + timedelta(seconds=40), 1)
    assert not d3.keep_children and not d3.workloads
    assert not is_true(d3.status.conditions, ConditionType.SUCCEEDED)  # no success
    assert "checkpoints at its next" not in _cond(d3.status, ConditionType.SUSPENDED).message
    # or the grace ran out with the driver still running: pods deleted all the same
    d4 = decide(spec, d2.status, running, T0 + timedelta(seconds=121), 1)
    assert not d4.keep_children and not d4.workloads
    # no claim: no grace (the default 0), pods deleted at once as before
    bare = _spec()
    assert bare.checkpoint.eviction_grace == 0
    st = decide(bare, RLTrainingJobStatus(), Observed(queue=queue.parse(ADMITTED)), T0,
                1).status
    d5 = decide(bare, st, running, T0, 1)
    assert not d5.keep_children and not d5.workloads
    # a grace needs a claim; 0 turns it off with one
    with pytest.raises(ManifestError, match=r"evictionGraceSeconds needs checkpoint\.volumeClaim"):
        _spec(checkpoint={"evictionGraceSeconds": 30})
    off = _spec(checkpoint={"volumeClaim": "ckpt", "evictionGraceSeconds": 0})
    assert not decide(off, d.status, running, T0, 1).keep_children


def test_kueue_not_installed_is_a_condition_and_one_warning() -> None:
    spec = _spec()
    d = decide(spec, RLTrainingJobStatus(), Observed(queue=queue.NOT_INSTALLED), T0, 1)
    assert not d.workloads and d.status.summary == Summary.QUEUED
    c = _cond(d.status, ConditionType.QUEUE_ADMITTED)
    assert c.reason == Reason.KUEUE_NOT_INSTALLED and "install Kueue" in c.message
    assert ("Warning", "KueueNotInstalled") in [(e.type, e.reason) for e in d.events]
    d = decide(spec, d.status, Observed(queue=queue.NOT_INSTALLED), T0, 1)
    assert d.events == []


def test_spec_suspend_wins_over_admission_and_a_job_without_queue_is_unchanged() -> None:
    spec = _spec(suspend=True)
    d = decide(spec, RLTrainingJobStatus(), Observed(queue=queue.parse(ADMITTED)), T0, 1)
    assert not d.workloads and d.status.summary == Summary.SUSPENDED
    assert _cond(d.status, ConditionType.QUEUE_ADMITTED).reason == Reason.SUSPENDED
    # its Workload deactivated, Kueue evicts it: no Evicted warning for the user's own suspend
    d = decide(spec, d.status, Observed(queue=queue.parse(EVICTED)), T0, 1)
    assert d.events == [] and d.status.summary == Summary.SUSPENDED
    plain = _spec(scheduling={})
    d = decide(plain, RLTrainingJobStatus(), Observed(), T0, 1)
    assert d.workloads and find(d.status.conditions, ConditionType.QUEUE_ADMITTED) is None


def test_a_pending_long_round_scale_up_is_unchanged_by_the_queue() -> None:
    # the extra replicas' Workload is the runtime's: decide still times the scale-up out
    spec = _spec()
    st = decide(spec, RLTrainingJobStatus(), Observed(queue=queue.parse(ADMITTED)), T0,
                1).status
    ro, _, _ = scaler.plan_round(st.rollout, spec, RoundKind.LONG, 0, T0)
    st = st.model_copy(update={"rollout": ro})
    d = decide(spec, st, Observed(driver_phase="Running", rollout_ready=2,
                                  queue=queue.parse(ADMITTED)), T0 + timedelta(seconds=301), 1)
    assert d.status.rollout.state == "TimedOut" and d.status.rollout.desired_replicas == 2


# --- the burst pool's order: priority first --------------------------------------------------


def _ask(ns: str, job: str, priority: int, created: str, *, reserved: bool = False,
         message: str = "", held_by: str | None = None, active: bool | None = None,
         ) -> dict[str, Any]:
    wl: dict[str, Any] = {
        "metadata": {"name": queue.long_round_name(job), "namespace": ns,
                     "creationTimestamp": created},
        "spec": {"queueName": "burst", "priority": priority,
                 "podSets": [{"name": queue.LONG_ROUND_POD_SET, "count": 2}]},
        "status": {"conditions": [{"type": "QuotaReserved",
                                   "status": "True" if reserved else "False",
                                   "reason": "Pending", "message": message}]},
    }
    if reserved:
        wl["status"]["admission"] = {"clusterQueue": "pool", "podSetAssignments": []}
    if held_by is not None:
        wl["metadata"]["annotations"] = {queue.HELD_BY_ANNOTATION: held_by}
        wl["spec"]["active"] = False
    if active is not None:
        wl["spec"]["active"] = active
    return wl


def _holds(*wls: dict[str, Any]) -> dict[str, str | None]:
    asks = [queue.pool_ask(w) for w in wls]
    assert all(a is not None for a in asks)
    return queue.pool_holds([a for a in asks if a is not None])


def test_lower_priority_long_rounds_wait_behind_the_first_higher_one() -> None:
    holds = _holds(
        _ask("team-a", "a2", 0, "2026-12-05T10:00:01Z"),
        _ask("team-b", "b1", 0, "2026-12-05T10:00:02Z"),
        _ask("team-a", "a3", 100, "2026-12-05T10:00:05Z"),
        _ask("team-c", "c1", 100, "2026-12-05T10:00:03Z"),
        _ask("team-a", "a1", 0, "2026-12-05T10:00:00Z", reserved=True),  # holds the pool
    )
    # the first-come of the highest waiting priority is named; that priority waits for Kueue
    assert holds == {"team-a/a2-long-round": "team-c/c1-long-round",
                     "team-b/b1-long-round": "team-c/c1-long-round",
                     "team-a/a3-long-round": None, "team-c/c1-long-round": None}


def test_once_no_higher_ask_waits_the_held_ones_go_and_one_priority_never_holds() -> None:
    # the high ask admitted (reserved): the low ones are let go, Kueue orders them
    holds = _holds(_ask("a", "x", 100, "2026-12-05T10:00:05Z", reserved=True),
                   _ask("a", "y", 0, "2026-12-05T10:00:01Z", held_by="a/x-long-round"),
                   _ask("b", "z", 0, "2026-12-05T10:00:02Z", held_by="a/x-long-round"))
    assert holds == {"a/y-long-round": None, "b/z-long-round": None}
    # equal priorities: nobody is held (fair share and arrival are Kueue's to apply)
    assert set(_holds(_ask("a", "x", 5, "2026-12-05T10:00:05Z"),
                      _ask("b", "y", 5, "2026-12-05T10:00:01Z")).values()) == {None}


def test_an_ask_larger_than_the_pool_holds_no_one_back() -> None:
    never = ("couldn't assign flavors to pod set rollout: insufficient quota for"
             " nvidia.com/gpu in flavor h100, previously considered podsets requests (0) +"
             " current podset request (16) > maximum capacity (2)")
    holds = _holds(_ask("a", "big", 100, "2026-12-05T10:00:00Z", message=never),
                   _ask("b", "small", 0, "2026-12-05T10:00:01Z"))
    assert holds == {"a/big-long-round": None, "b/small-long-round": None}
    # only waiting for quota (it may fit later): it holds the lower one back
    busy = "insufficient unused quota for nvidia.com/gpu in flavor h100, 2 more needed"
    holds = _holds(_ask("a", "big", 100, "2026-12-05T10:00:00Z", message=busy),
                   _ask("b", "small", 0, "2026-12-05T10:00:01Z"))
    assert holds["b/small-long-round"] == "a/big-long-round"


def test_an_ask_about_to_be_made_sorts_after_every_made_one() -> None:
    new = _ask("a", "new", 7, "")
    del new["metadata"]["creationTimestamp"]
    del new["status"]
    holds = _holds(new, _ask("b", "old", 7, "2026-12-05T10:00:00Z"),
                   _ask("c", "low", 1, "2026-12-05T09:00:00Z"))
    assert holds["c/low-long-round"] == "b/old-long-round"
    assert holds["a/new-long-round"] is None


def test_workloads_that_are_no_pool_asks_are_left_alone() -> None:
    job_wl = _ask("a", "j", 0, "2026-12-05T10:00:00Z")
    job_wl["metadata"]["name"] = queue.workload_name("j")
    assert queue.pool_ask(job_wl) is None
    gone = _ask("a", "g", 0, "2026-12-05T10:00:00Z")
    gone["metadata"]["deletionTimestamp"] = "2026-12-05T10:01:00Z"
    assert queue.pool_ask(gone) is None
    # inactive, but not by this order (Kueue's own deactivation): not waiting, never let go
    off = queue.pool_ask(_ask("a", "off", 100, "2026-12-05T10:00:00Z", active=False))
    low = queue.pool_ask(_ask("b", "low", 0, "2026-12-05T10:00:01Z"))
    assert off is not None and low is not None
    assert queue.pool_holds([off, low]) == {"b/low-long-round": None}


def test_a_held_asks_view_says_what_it_waits_behind() -> None:
    view = queue.parse(_ask("a", "y", 0, "2026-12-05T10:00:01Z", held_by="b/x-long-round"))
    assert view.held_by == "b/x-long-round" and not view.admitted
    assert "held behind b/x-long-round" in view.message
    assert "priority first" in view.message
    assert queue.parse(_ask("a", "y", 0, "2026-12-05T10:00:01Z")).held_by is None
