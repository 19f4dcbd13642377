"""A driver pod that is gone without having failed (deleted, drained, evicted, preempted):
the job resumes as a new attempt from its checkpoint, not counted against backoffLimit, and
its pod never comes back under the attempt that has already reported (issue 32, defect 1).

The decision (pure) and the reconciler's pod writes over the in-memory API server; the same
against the real API server and with the real trainer is in tests/integration."""

from __future__ import annotations

from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_decide import T0, _run, _spec
from test_reports import NS, add_job, open_env, report, run

from rlpacer.api import contract
from rlpacer.api.protocol import StepReport
from rlpacer.api.status import ConditionType, RLTrainingJobStatus, Summary
from rlpacer.operator import hosting, names, reports
from rlpacer.operator.decide import Observed, attempt_reported, rebuild_state
from rlpacer.operator.kube import object_path

pytestmark = pytest.mark.unit


def _reported(spec: Any, st: RLTrainingJobStatus, attempt: int, step: int) -> RLTrainingJobStatus:
    """``st`` after the driver of ``attempt`` reported ``step`` (accepted)."""
    g = reports.current_plan(spec, st).group_size
    body = report(step, g, 20.0, attempt=attempt)
    new, _ = reports.accept_report(spec, st, StepReport.model_validate(body), T0, 1)
    return new


def _running(backoff_limit: int = 0) -> tuple[Any, RLTrainingJobStatus]:
    """A job with backoffLimit ``backoff_limit`` whose driver of attempt 0 runs."""
    spec = _spec(backoffLimit=backoff_limit)
    st = _run(spec, RLTrainingJobStatus(), Observed(driver_phase="Running")).status
    return spec, st


def test_a_driver_gone_after_its_attempt_reported_is_a_new_attempt_not_a_failure() -> None:
    spec, st = _running()
    # gone before its attempt reported anything: created again as it was (same attempt)
    d = _run(spec, st, Observed(attempt=0, driver_phase=None))
    assert d.status.attempt == 0 and d.workloads and not d.events
    st = _reported(spec, _reported(spec, st, 0, 0), 0, 1)
    assert attempt_reported(st)
    d = _run(spec, st, Observed(attempt=0, driver_phase=None))  # deleted
    new = d.status
    assert (new.attempt, new.failures) == (1, 0) and d.workloads
    assert new.summary == Summary.RESTARTING and not any(
        c.type == ConditionType.FAILED for c in new.conditions)
    (ev,) = [e for e in d.events if e.reason == "Restarting"]
    assert "attempt 0" in ev.message and "without having failed" in ev.message
    assert "not counted against backoffLimit" in ev.message
    # the controller state is kept as it was (it continues), the step with it
    assert new.controller_state == st.controller_state and new.step == 2
    # attempt 1's pod is not there yet (the next pass creates it): no further attempt
    assert not attempt_reported(new)
    d = _run(spec, new, Observed(attempt=1, driver_phase=None))
    assert (d.status.attempt, d.status.failures) == (1, 0) and not d.events
    # a pass whose status moved to another attempt since its look did not see that one's pod
    d = _run(spec, st, Observed(attempt=0, driver_phase=None, driver_looked=False))
    assert d.status.attempt == 0 and not d.events


def test_after_a_failure_the_new_attempts_pod_is_awaited_then_its_deletion_not_counted() -> None:
    spec = _spec(backoffLimit=1)
    st = _reported(spec, _run(spec, RLTrainingJobStatus(), Observed(
        driver_phase="Running")).status, 0, 0)
    st = _run(spec, st, Observed(attempt=0, driver_phase="Failed")).status
    assert (st.attempt, st.failures) == (1, 1)
    # attempt 1's pod not there yet: the last report was attempt 0's, nothing more happens
    d = _run(spec, st, Observed(attempt=1, driver_phase=None))
    assert (d.status.attempt, d.status.failures) == (1, 1) and not d.events
    # attempt 1 reported, then its pod was deleted: attempt 2, still one failure of one
    st = _reported(spec, d.status, 1, 1)
    d = _run(spec, st, Observed(attempt=1, driver_phase=None))
    assert (d.status.attempt, d.status.failures, d.status.summary) == (2, 1, Summary.RESTARTING)


@pytest.mark.parametrize("how", ["deleted", "DisruptionTarget"])
def test_a_driver_that_ended_failed_by_a_disruption_is_not_counted(how: str) -> None:
    """Failed while being deleted (a kubelet ends a deleted pod Failed before it goes), or
    Failed with the DisruptionTarget condition (a node-pressure eviction leaves the pod):
    neither counts against backoffLimit 0, whether the attempt reported or not. While the
    deleted pod still runs, nothing happens: it goes first (never two drivers at once)."""
    spec, st = _running()
    d = _run(spec, st, Observed(attempt=0, driver_phase="Running", driver_deleting=True))
    assert d.status.attempt == 0 and not d.events
    obs = Observed(attempt=0, driver_phase="Failed", driver_exit_code=143,
                   driver_deleting=how == "deleted",
                   driver_disruption="TerminationByKubelet" if how != "deleted" else None)
    d = _run(spec, st, obs)
    assert (d.status.attempt, d.status.failures, d.status.summary) == (1, 0, Summary.RESTARTING)
    (ev,) = [e for e in d.events if e.reason == "Restarting"]
    assert ("TerminationByKubelet" in ev.message) == (how != "deleted")
    # the same exit without either is the trainer's failure: backoffLimit 0 is exceeded
    d = _run(spec, st, Observed(attempt=0, driver_phase="Failed", driver_exit_code=143))
    assert d.status.summary == Summary.FAILED and d.status.failures == 1


def test_after_a_rebuilt_controller_state_a_gone_driver_is_a_new_attempt() -> None:
    """A rebuilt state (someone broke status.controllerState) keeps no record of who reported
    and stands at the status's step: a driver of the same attempt restarting from its
    checkpoint would be refused, so its absence is taken as gone once the job has run."""
    spec, st = _running()
    st = _reported(spec, _reported(spec, st, 0, 0), 0, 1)
    ctl, _ = rebuild_state(spec, st)
    st.controller_state = hosting.dumps(ctl.state_dict())
    assert ctl.last_report is None and attempt_reported(st)
    assert _run(spec, st, Observed(attempt=0, driver_phase=None)).status.attempt == 1


# --- the reconciler's pod writes, over the in-memory API server ---------------------------


def _driver(attempt: int) -> str:
    return object_path("v1", "pods", NS, names.driver_pod("job", attempt))


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_a_deleted_driver_comes_back_as_the_next_attempt_and_its_reports_are_accepted() -> None:
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job", {**_spec_wire(), "backoffLimit": 0})
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            fk.objects[_driver(0)]["status"] = {"phase": "Running"}
            g = (await env.plan("job"))["groupSize"]
            for step in range(2):
                code, plan = await env.post("job", report(step, g, 20.0))
                assert code == 200, plan
                g = plan["groupSize"]
            # kubectl delete pod job-driver-0 (its watch event: the next pass looks)
            del fk.objects[_driver(0)]
            env.jobs.child_event(NS, "job", "Pod", names.driver_pod("job", 0), "DELETED", {})
            await env.jobs.reconcile(rt)
            st = env.status("job")
            assert (st["attempt"], st.get("failures", 0), st["summary"]) == (1, 0, "Restarting")
            assert _driver(0) not in fk.objects  # never again under attempt 0
            assert _env(fk.objects[_driver(1)])[contract.ENV_ATTEMPT] == "1"
            # the replacement found no checkpoint: step 0 of attempt 1 is accepted, and the
            # controller continues where it was (the plan's step follows the report)
            assert (await env.plan("job"))["step"] == 2
            code, plan = await env.post("job", report(0, g, 20.0, attempt=1))
            assert code == 200 and plan["step"] == 1, plan
            code, err = await env.post("job", report(1, plan["groupSize"], 20.0))
            assert code == 422 and err["reason"] == "AttemptMismatch", err
            # settled: later passes start nothing new
            fk.objects[_driver(1)]["status"] = {"phase": "Running"}
            for _ in range(2):
                rt.applied.clear()
                rt.children_changed = True
                await env.jobs.reconcile(rt)
            assert env.status("job")["attempt"] == 1 and _driver(0) not in fk.objects
        finally:
            await close()

    run(body)


def test_a_driver_deleted_during_a_pass_is_not_applied_back_under_its_attempt() -> None:
    """The pass looked at the driver (Running), then the pod was deleted (KWOK, or a forced
    deletion, removes it at once) and its DELETED event cleared the applied children while
    the pass applied the others: the pass must not create it again under attempt 0 (a
    server-side apply would), which would restart the trainer from its checkpoint under an
    attempt whose later steps the controller already has."""

    class DeletesTheDriver(FakeKube):
        armed = False

        async def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
            if self.armed and obj["kind"] == "StatefulSet":
                self.armed = False
                del self.objects[_driver(0)]
                jobs.child_event(NS, "job", "Pod", names.driver_pod("job", 0), "DELETED", {})
            return await super().apply(obj, field_manager)

    async def body() -> None:
        nonlocal jobs
        fk = DeletesTheDriver()
        add_job(fk, "job", {**_spec_wire(), "backoffLimit": 0})
        env, close = await open_env(fk)
        jobs = env.jobs
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            fk.objects[_driver(0)]["status"] = {"phase": "Running"}
            g = (await env.plan("job"))["groupSize"]
            assert (await env.post("job", report(0, g, 20.0)))[0] == 200
            rt.applied.clear()  # a full pass: every child applied
            rt.children_changed = True
            fk.armed = True
            await env.jobs.reconcile(rt)
            assert _driver(0) not in fk.objects
            await env.jobs.reconcile(rt)  # the DELETED event's pass
            st = env.status("job")
            assert (st["attempt"], st.get("failures", 0)) == (1, 0)
            assert _driver(0) not in fk.objects and _driver(1) in fk.objects
        finally:
            await close()

    jobs: Any = None
    run(body)


def test_a_driver_evicted_by_its_kubelet_is_not_counted() -> None:
    """A node-pressure eviction leaves the pod Failed with DisruptionTarget=True."""

    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job", {**_spec_wire(), "backoffLimit": 0})
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            fk.objects[_driver(0)]["status"] = {
                "phase": "Failed", "reason": "Evicted",
                "message": "The node was low on resource: memory.",
                "conditions": [{"type": "DisruptionTarget", "status": "True",
                                "reason": "TerminationByKubelet"}]}
            rt.children_changed = True
            await env.jobs.reconcile(rt)
            st = env.status("job")
            assert (st["attempt"], st.get("failures", 0), st["summary"]) == (1, 0, "Restarting")
            assert _driver(1) in fk.objects
        finally:
            await close()

    run(body)


def _spec_wire() -> dict[str, Any]:
    from test_reports import SPEC

    return dict(SPEC)


def test_a_suspended_job_with_a_claim_lets_its_driver_checkpoint_at_its_next_report() -> None:
    """``spec.suspend`` while the driver runs, with a checkpoint claim (evictionGraceSeconds
    defaults to 120 s): the pods are kept, ``GET plan`` says done, the next report is
    accepted and answered done (the driver checkpoints there and stops); once the driver has
    stopped the pods go, and the resumed attempt starts from the step after that report."""
    from datetime import timedelta

    spec = _spec(checkpoint={"volumeClaim": "ckpt"}, steps=10)
    running = Observed(driver_phase="Running")
    st = _run(spec, RLTrainingJobStatus(), running).status
    for step in range(3):
        st = _reported(spec, st, 0, step)
    suspended = spec.model_copy(update={"suspend": True})
    d = _run(suspended, st, running)
    assert d.keep_children and d.workloads and d.status.summary == Summary.SUSPENDED
    said = {e.reason: e.message for e in d.events}
    assert "once the driver has checkpointed" in said["Suspended"], said
    assert "suspended with the driver running" in said["EvictionCheckpoint"], said
    assert reports.current_plan(suspended, d.status, now=T0).done
    g = reports.current_plan(spec, st).group_size
    st2, acc = reports.accept_report(
        suspended, d.status, StepReport.model_validate(report(3, g, 20.0)),
        T0 + timedelta(seconds=5), 1)
    assert acc.plan.done and st2.step == 4
    assert any(e.reason == "EvictionCheckpoint" and "after the suspend" in e.message
               for e in acc.events), acc.events
    # the driver stopped: the pods go; resumed, attempt 1 starts at step 4
    d = _run(suspended, st2, Observed(driver_phase="Succeeded"), T0 + timedelta(seconds=6))
    assert not d.keep_children and not d.workloads
    assert d.status.summary == Summary.SUSPENDED
    d = _run(spec, d.status, Observed(driver_phase=None), T0 + timedelta(seconds=7))
    assert d.status.attempt == 1 and d.status.step == 4
    # the grace over with the driver still running: pods deleted all the same, and a late
    # report is refused (409: the resumed attempt redoes that step from the checkpoint)
    held = _run(suspended, st, running).status
    assert not _run(suspended, held, running, T0 + timedelta(seconds=121)).keep_children
    with pytest.raises(reports.JobSuspended):
        reports.accept_report(suspended, held, StepReport.model_validate(report(3, g, 20.0)),
                              T0 + timedelta(seconds=121), 1)
    # no claim: no grace, pods deleted at once and the report refused, as before
    bare = _spec()
    bst = _run(bare, RLTrainingJobStatus(), running).status
    d = _run(bare.model_copy(update={"suspend": True}), bst, running)
    assert not d.keep_children and not d.workloads
    assert "pods deleted; resume" in {e.reason: e.message for e in d.events}["Suspended"]
