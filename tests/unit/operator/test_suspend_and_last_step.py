"""Step reports a job must not act on: while it is suspended (issue 32, defect 5), and the
long round the last step's report asks for (issue 34)."""

from __future__ import annotations

from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, SPEC, Env, add_job, admitted, open_env, report, run

from rlpacer.api import contract
from rlpacer.api.status import ConditionType
from rlpacer.operator import names
from rlpacer.operator.kube import object_path
from rlpacer.operator.runtime import job_path

pytestmark = pytest.mark.unit


def _set_spec(env: Env, name: str, **fields: Any) -> None:
    """A user's edit of the spec (a new generation and resourceVersion)."""
    obj = env.fk.objects[job_path(NS, name)]
    obj["spec"] = {**obj["spec"], **fields}
    obj["metadata"]["generation"] += 1
    env.fk._bump(obj)


def test_a_suspended_job_refuses_reports_409_and_resumes_at_the_right_step() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            g = (await env.plan("job"))["groupSize"]
            for step in range(3):
                code, plan = await env.post("job", report(step, g, 20))
                assert code == 200
                g = plan["groupSize"]
            _set_spec(env, "job", suspend=True)
            state = env.status("job")["controllerState"]
            # before the operator's pass saw the suspend (its write conflicts, it re-reads)
            code, err = await env.post("job", report(3, g, 20))
            assert code == 409 and err["reason"] == "JobSuspended", err
            assert "suspended" in err["message"]
            await env.jobs.reconcile(rt)
            assert env.status("job")["summary"] == "Suspended"
            # and after: refused, the step does not advance, nothing is written
            code, err = await env.post("job", report(3, g, 20))
            assert code == 409 and err["reason"] == "JobSuspended", err
            st = env.status("job")
            assert st["step"] == 3 and st["controllerState"] == state
            # resumed: a new attempt, which continues from the step the job stood at
            _set_spec(env, "job", suspend=False)
            await env.jobs.reconcile(rt)
            assert env.status("job")["attempt"] == 1
            code, err = await env.post("job", report(3, g, 20))
            assert code == 422 and err["reason"] == "AttemptMismatch"
            code, plan = await env.post("job", report(3, g, 20, attempt=1))
            assert code == 200 and plan["step"] == 4, plan
            assert env.status("job")["step"] == 4
        finally:
            await close()

    run(body)


@pytest.mark.parametrize(("nxt", "queue"), [("Long", 0), ("Long", 4), ("Short", 4)])
def test_the_last_steps_report_scales_nothing_up_for_a_round_that_never_runs(
    nxt: str, queue: int,
) -> None:
    """The planner asks for a long round next (or its queue is full), but the step just
    reported was the job's last (the plan says done): no scale-up (desiredReplicas stays at
    the short round's count, never ScalingUp), no LongRound, no scale action or Event, and the
    rollout StatefulSet keeps its replicas through the operator's next pass."""

    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job", {**SPEC, "steps": 3})
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            sts_path = object_path(
                "apps/v1", "statefulsets", NS, names.statefulset("job", contract.Role.ROLLOUT))
            assert env.fk.objects[sts_path]["spec"]["replicas"] == 1
            g = (await env.plan("job"))["groupSize"]
            for step in range(2):
                code, plan = await env.post("job", report(step, g, 20))
                assert code == 200 and not plan["done"]
                g = plan["groupSize"]
            code, plan = await env.post(
                "job", {**report(2, g, 20, nxt=nxt), "longQueue": queue})
            assert code == 200 and plan["done"] and plan["step"] == 3, plan
            assert plan["rollout"]["desiredReplicas"] == 1, plan
            assert plan["rollout"]["state"] == "Ready", plan
            st = env.status("job")
            assert st["rollout"]["desiredReplicas"] == 1 and st.get("scaleActions", []) == []
            assert st["rollout"]["state"] == "Ready", st["rollout"]
            assert st.get("longRounds", 0) == 0
            lr = next((c for c in st["conditions"]
                       if c["type"] == ConditionType.LONG_ROUND.value), None)
            assert lr is None or lr["status"] == "False", lr
            # the plan read afterwards says the same (done, nothing pending)
            again = await env.plan("job")
            assert again["done"] and again["rollout"]["desiredReplicas"] == 1, again
            assert again["rollout"]["state"] == "Ready", again
            await env.jobs.reconcile(rt)
            assert env.fk.objects[sts_path]["spec"]["replicas"] == 1
            assert not [e for e in env.fk.of_kind("events")
                        if e["reason"] in ("ScalingUp", "ScaledDown")]
        finally:
            await close()

    run(body)


@pytest.mark.parametrize("nxt", ["Long", "Short"])
def test_a_long_last_step_asks_for_no_more_capacity_and_gives_back_what_the_driver_released(
    nxt: str,
) -> None:
    """The last step is a long round (scaled up for it). Its report asking for another long
    round scales nothing up: no scale action, no ScalingUp Event, the StatefulSet keeps the
    long round's replicas (the driver, whose planner says Long, still holds engines on them;
    they go with the job's end, not under a live engine). One asking for a short round
    scales back down as on any step (the driver released the long round's engines before
    it)."""

    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job", {**SPEC, "steps": 3})
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            g = (await env.plan("job"))["groupSize"]
            _, plan = await env.post("job", report(0, g, 20))
            _, plan = await env.post("job", report(1, plan["groupSize"], 20, nxt="Long"))
            assert plan["rollout"]["desiredReplicas"] == 3  # step 2, the last, is long
            code, plan = await env.post("job", report(2, plan["groupSize"], 20, kind="Long",
                                                      nxt=nxt))
            assert code == 200 and plan["done"], plan
            st = env.status("job")
            actions = [(a["reason"], a["step"]) for a in st["scaleActions"]]
            if nxt == "Long":
                assert actions == [("LongRound", 2)] and plan["rollout"]["desiredReplicas"] == 3
            else:
                assert actions == [("LongRound", 2), ("LongRoundDone", 3)]
                assert plan["rollout"]["desiredReplicas"] == 1
            assert st["longRounds"] == 1
            lr = next(c for c in st["conditions"] if c["type"] == ConditionType.LONG_ROUND.value)
            assert lr["status"] == "False", lr
            await env.jobs.reconcile(rt)
            sts = env.fk.objects[object_path(
                "apps/v1", "statefulsets", NS, names.statefulset("job", contract.Role.ROLLOUT))]
            assert sts["spec"]["replicas"] == plan["rollout"]["desiredReplicas"]
            ups = [e["message"] for e in env.fk.of_kind("events") if e["reason"] == "ScalingUp"]
            assert len(ups) == 1 and ups[0].startswith("step 2 "), ups
        finally:
            await close()

    run(body)


def test_an_early_scale_up_holds_through_short_rounds_and_never_outlives_the_job() -> None:
    """A report whose next round is short but that asks ahead (``prepareLongRound``) scales
    the rollout up at once (an EarlyScaleUp action and Event), and the plan's short round is
    ScalingUp without a long round begun; reports that keep asking hold the capacity without
    a new action; the long round then uses it; one that stops asking scales back down. The
    last step's report never scales up, asking or not. An older trainer's report (no field)
    scales nothing up before the long round."""

    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job", {**SPEC, "steps": 6})
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            g = (await env.plan("job"))["groupSize"]
            _, plan = await env.post("job", report(0, g, 20))
            assert plan["rollout"]["desiredReplicas"] == 1  # an older trainer: no field
            _, plan = await env.post("job", {**report(1, plan["groupSize"], 20),
                                             "prepareLongRound": True})
            assert plan["roundKind"] == "Short" and plan["rollout"]["desiredReplicas"] == 3
            assert plan["rollout"]["state"] == "ScalingUp", plan
            st = env.status("job")
            assert [(a["reason"], a["step"]) for a in st["scaleActions"]] == [
                ("EarlyScaleUp", 2)]
            assert st.get("longRounds", 0) == 0  # no long round begun
            await env.jobs.reconcile(rt)
            sts = env.fk.objects[object_path(
                "apps/v1", "statefulsets", NS, names.statefulset("job", contract.Role.ROLLOUT))]
            assert sts["spec"]["replicas"] == 3
            _, plan = await env.post("job", {**report(2, plan["groupSize"], 20, nxt="Long"),
                                             "prepareLongRound": False})
            assert plan["rollout"]["desiredReplicas"] == 3
            _, plan = await env.post("job", {**report(3, plan["groupSize"], 20, kind="Long"),
                                             "prepareLongRound": True})
            assert plan["rollout"]["desiredReplicas"] == 3  # held: asked ahead again
            _, plan = await env.post("job", report(4, plan["groupSize"], 20))
            assert plan["rollout"]["desiredReplicas"] == 1  # not asked: back down
            code, plan = await env.post("job", {**report(5, plan["groupSize"], 20),
                                                "prepareLongRound": True})
            assert code == 200 and plan["done"] and plan["rollout"]["desiredReplicas"] == 1
            st = env.status("job")
            assert [(a["reason"], a["step"]) for a in st["scaleActions"]] == [
                ("EarlyScaleUp", 2), ("LongRoundDone", 5)], st["scaleActions"]
            ups = [e["message"] for e in env.fk.of_kind("events") if e["reason"] == "ScalingUp"]
            assert len(ups) == 1 and "forecast" in ups[0], ups
        finally:
            await close()

    run(body)
