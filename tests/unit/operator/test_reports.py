"""The step-report endpoint over an in-memory API server: persistence before the answer,
parity with the control library, idempotency, errors, conflicts, restarts, long rounds."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from operator_fakekube import FakeKube

from rlpacer.api import contract
from rlpacer.api.job import parse_spec
from rlpacer.api.protocol import PLAN_FIELDS_HEADER, plan_path, steps_path
from rlpacer.control.plan import JobController
from rlpacer.operator import hosting, names
from rlpacer.operator.kube import object_path
from rlpacer.operator.metrics import Metrics
from rlpacer.operator.runtime import Jobs, job_path
from rlpacer.operator.server import LeaderState, report_app
from rlpacer.operator.settings import OperatorSettings

pytestmark = pytest.mark.unit

NS = "team"
SPEC: dict[str, Any] = {
    "model": {"source": "builtin://tiny"},
    "data": {"source": "builtin://adder"},
    "steps": 100,
    "promptsPerStep": 4,
    "rollout": {"replicas": 1},
    "groupControl": {"stragglerRatio": "4", "targetStragglerRate": "0.2", "seed": 7},
    "tailBatching": {"longRound": {"rolloutReplicas": 3, "scaleUpTimeoutSeconds": 60}},
}


def add_job(fk: FakeKube, name: str, spec: dict[str, Any] | None = None) -> None:
    fk.put_object(
        job_path(NS, name),
        {
            "apiVersion": "rlpacer.io/v1alpha1",
            "kind": "RLTrainingJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": spec or SPEC,
        },
    )


def settings() -> OperatorSettings:
    return OperatorSettings(leader_election=False, resync_seconds=3600)


class Env:
    def __init__(self, fk: FakeKube, client: TestClient, jobs: Jobs, metrics: Metrics) -> None:
        self.fk, self.client, self.jobs, self.metrics = fk, client, jobs, metrics

    async def token(self, name: str) -> str:
        rt = await self.jobs.get(NS, name)
        assert rt is not None
        tok = await self.jobs.token(rt)
        assert tok
        return tok

    async def post(
        self, name: str, body: dict[str, Any], token: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        tok = token if token is not None else await self.token(name)
        r = await self.client.post(
            steps_path(NS, name), json=body, headers={"Authorization": f"Bearer {tok}"}
        )
        return r.status, await r.json()

    async def plan(self, name: str, fields: str | None = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {await self.token(name)}"}
        if fields is not None:
            headers[PLAN_FIELDS_HEADER] = fields
        r = await self.client.get(plan_path(NS, name), headers=headers)
        assert r.status == 200, await r.text()
        return await r.json()

    def status(self, name: str) -> dict[str, Any]:
        return self.fk.objects[job_path(NS, name)].get("status", {})


async def open_env(
    fk: FakeKube, cfg: OperatorSettings | None = None
) -> tuple[Env, Callable[[], Awaitable[None]]]:
    metrics = Metrics()
    jobs = Jobs(fk, cfg or settings(), metrics)  # type: ignore[arg-type]
    client = TestClient(TestServer(report_app(jobs, LeaderState(True), metrics)))
    await client.start_server()
    return Env(fk, client, jobs, metrics), client.close


def report(
    step: int,
    g: int,
    mx: float,
    med: float = 10.0,
    attempt: int = 0,
    kind: str = "Short",
    nxt: str = "Short",
) -> dict[str, Any]:
    return {
        "attempt": attempt,
        "step": step,
        "groupSize": g,
        "roundKind": kind,
        "lengths": {"max": int(mx), "median": med, "p90": min(mx, med * 2), "count": 4 * g},
        "seconds": {"rollout": 1.0, "train": 0.5},
        "longQueue": 0,
        "nextRoundKind": nxt,
    }


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro_fn())


async def admitted(name: str = "job") -> tuple[Env, Callable[[], Awaitable[None]]]:
    fk = FakeKube()
    add_job(fk, name)
    env, close = await open_env(fk)
    rt = await env.jobs.get(NS, name)
    assert rt is not None
    await env.jobs.reconcile(rt)  # creates children and the token Secret
    return env, close


def test_reconcile_creates_children_and_token() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            fk = env.fk
            assert fk.of_kind("statefulsets") and fk.of_kind("pods") and fk.of_kind("configmaps")
            sec = fk.objects[object_path("v1", "secrets", NS, names.secret("job"))]
            assert (
                sec["metadata"]["ownerReferences"][0]["uid"]
                == fk.objects[job_path(NS, "job")]["metadata"]["uid"]
            )
            st = env.status("job")
            assert st["summary"] == "Starting" and st["observedGeneration"] == 1
        finally:
            await close()

    run(body)


def test_reports_follow_the_library_and_persist_before_answer() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            lib = JobController(hosting.controller_config(parse_spec(SPEC)))
            rng = random.Random(3)
            g = (await env.plan("job"))["groupSize"]
            assert g == lib.plan().group_size
            for step in range(40):
                mx = 10.0 * (8 if rng.random() < (0.1 if g <= 4 else 0.6) else 2)
                code, plan = await env.post("job", report(step, g, mx))
                assert code == 200, plan
                from rlpacer.api.protocol import StepReport
                from rlpacer.operator.hosting import to_data

                want = lib.observe(to_data(StepReport.model_validate(report(step, g, mx))))
                assert plan["groupSize"] == want.group_size and plan["step"] == step + 1
                assert plan["lambda"] == want.lambda_
                # answered only after persisting: the stored state is the library's, bit-exact
                assert env.status("job")["controllerState"] == hosting.dumps(lib.state_dict())
                g = plan["groupSize"]
            st = env.status("job")
            assert st["step"] == 40 and st["groupSize"] == g and len(st["posteriors"]) == 3
        finally:
            await close()

    run(body)


def test_errors_leave_state_unchanged() -> None:
    async def body() -> None:
        env, close = await admitted("job")
        fk = env.fk
        add_job(fk, "other")
        rt_other = await env.jobs.get(NS, "other")
        assert rt_other is not None
        await env.jobs.reconcile(rt_other)
        try:
            g = (await env.plan("job"))["groupSize"]
            assert (await env.post("job", report(0, g, 20)))[0] == 200
            before = env.status("job")["controllerState"]
            code, err = await env.post("job", report(1, g, 20), token="wrong")
            assert code == 401 and err["reason"] == "Unauthorized"
            code, _ = await env.post("job", report(1, g, 20), token=await env.token("other"))
            assert code == 401
            r = await env.client.post(steps_path(NS, "job"), json=report(1, g, 20))
            assert r.status == 401
            code, err = await env.post("nope", report(1, g, 20), token="x")
            assert code == 404
            code, err = await env.post("job", report(3, g, 20))
            assert code == 422 and err["reason"] == "StepOutOfOrder", err
            code, err = await env.post("job", report(1, g, 5, med=10))
            assert code == 422 and err["reason"] == "ImpossibleLengths", err
            code, err = await env.post("job", report(1, 1000, 20))
            assert code == 422 and err["reason"] == "GroupSizeNotPlanned"
            code, err = await env.post("job", report(1, g, 20, attempt=5))
            assert code == 422 and err["reason"] == "AttemptMismatch"
            r = await env.client.post(
                steps_path(NS, "job"),
                data=b"{not json",
                headers={"Authorization": f"Bearer {await env.token('job')}"},
            )
            assert r.status == 422
            assert env.status("job")["controllerState"] == before
        finally:
            await close()

    run(body)


def test_retried_report_is_not_double_counted() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            g = (await env.plan("job"))["groupSize"]
            c1, p1 = await env.post("job", report(0, g, 100))
            state = env.status("job")["controllerState"]
            writes = sum(1 for m, p in env.fk.calls if m == "PUT")
            c2, p2 = await env.post("job", report(0, g, 100))
            assert (c1, p1) == (c2, p2)
            assert env.status("job")["controllerState"] == state
            assert sum(1 for m, p in env.fk.calls if m == "PUT") == writes  # nothing written
            assert env.metrics.steps.labels(NS, "job")._value.get() == 1
            c3, err = await env.post("job", {**report(0, g, 100), "longQueue": 7})
            assert c3 == 422 and err["reason"] == "ConflictingRepeat"
        finally:
            await close()

    run(body)


def test_write_conflicts_are_retried_and_concurrent_writer_wins_nothing() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            g = (await env.plan("job"))["groupSize"]
            env.fk.fail_next_put = 2
            code, p = await env.post("job", report(0, g, 30))
            assert code == 200 and env.status("job")["step"] == 1
            # A second operator (split brain) with its own cache advances the job...
            env2, close2 = await open_env(env.fk)
            try:
                code, p2 = await env2.post("job", report(1, p["groupSize"], 30))
                assert code == 200
                # ...the first one's cache is stale: its retry of step 1 re-reads the stored
                # state and is answered as the repeat it is, not counted again.
                code, p1b = await env.post("job", report(1, p["groupSize"], 30))
                assert code == 200 and p1b == p2
                assert env.status("job")["step"] == 2
            finally:
                await close2()
        finally:
            await close()

    run(body)


def test_restart_continues_exactly() -> None:
    async def body() -> None:
        env, close = await admitted()
        fk = env.fk
        g = (await env.plan("job"))["groupSize"]
        seq_a = []
        for step in range(10):
            _code, p = await env.post("job", report(step, g, 50 if step % 3 else 15))
            g = p["groupSize"]
        await close()
        # "Restart": a fresh operator process state over the same API server.
        env_b, close_b = await open_env(fk)
        # ... and a reference that never restarted
        ref_fk = FakeKube()
        ref_fk.objects = json.loads(json.dumps(fk.objects))
        env_r, close_r = await open_env(ref_fk)
        try:
            assert (await env_b.plan("job")) == (await env_r.plan("job"))
            gb = gr = g
            for step in range(10, 25):
                mx = 50 if step % 4 else 15
                _, pb = await env_b.post("job", report(step, gb, mx))
                _, pr = await env_r.post("job", report(step, gr, mx))
                assert pb == pr
                gb, gr = pb["groupSize"], pr["groupSize"]
                seq_a.append(gb)
            assert env_b.status("job")["controllerState"] == env_r.status("job")["controllerState"]
        finally:
            await close_b()
            await close_r()

    run(body)


def _rollout_pod(fk: FakeKube, i: int, ready: bool) -> None:
    name = f"{names.statefulset('job', contract.Role.ROLLOUT)}-{i}"
    fk.put_object(object_path("v1", "pods", NS, name), {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS,
                     "labels": names.selector("job", contract.Role.ROLLOUT)},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    })


def test_plan_names_the_ready_rollout_ordinals_to_trainers_that_ask() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            g = (await env.plan("job"))["groupSize"]
            _, p = await env.post("job", report(0, g, 20, nxt="Long"))
            assert "usableReplicas" not in p["rollout"]  # an older trainer's request
            _rollout_pod(env.fk, 0, True)
            _rollout_pod(env.fk, 1, False)  # still pending
            _rollout_pod(env.fk, 2, True)  # came up first
            rt.children_changed = True  # the pods' watch events (Kopf's handler sets it)
            await env.jobs.reconcile(rt)
            plan = await env.plan("job", fields="usableReplicas")
            assert plan["rollout"]["usableReplicas"] == [0, 2]
            assert plan["rollout"]["state"] == "ScalingUp"
            assert env.status("job")["rollout"]["readyOrdinals"] == [0, 2]
            old = await env.plan("job")  # no header: the plan an older trainer validates
            assert "usableReplicas" not in old["rollout"]
            assert old == {**plan, "rollout": {k: v for k, v in plan["rollout"].items()
                                               if k != "usableReplicas"}}
        finally:
            await close()

    run(body)


def test_long_round_plan_scales_and_reports_ready() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            g = (await env.plan("job"))["groupSize"]
            _, p = await env.post("job", report(0, g, 20, nxt="Long"))
            assert p["roundKind"] == "Long" and p["rollout"]["state"] == "ScalingUp"
            assert p["rollout"]["desiredReplicas"] == 3
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            sts_path = object_path(
                "apps/v1", "statefulsets", NS, names.statefulset("job", contract.Role.ROLLOUT)
            )
            assert env.fk.objects[sts_path]["spec"]["replicas"] == 3
            env.fk.objects[sts_path]["status"] = {"readyReplicas": 3}
            for i in range(3):
                _rollout_pod(env.fk, i, True)
            rt.children_changed = True  # the StatefulSet's watch event (Kopf's handler)
            await env.jobs.reconcile(rt)
            plan = await env.plan("job")
            assert plan["rollout"] == {"desiredReplicas": 3, "readyReplicas": 3, "state": "Ready"}
            st = env.status("job")
            assert st["summary"] == "LongRound" and st["longRounds"] == 1
            _code, p = await env.post("job", report(1, plan["groupSize"], 20, kind="Long"))
            assert p["roundKind"] == "Short" and p["rollout"]["desiredReplicas"] == 1
            await env.jobs.reconcile(rt)
            assert env.fk.objects[sts_path]["spec"]["replicas"] == 1
            reasons = [a["reason"] for a in env.status("job")["scaleActions"]]
            assert reasons == ["LongRound", "LongRoundDone"]
            assert env.metrics.series_for(NS, "job") > 0
            env.jobs.forget(NS, "job")
            assert env.metrics.series_for(NS, "job") == 0
        finally:
            await close()

    run(body)


def test_a_short_round_in_a_pending_long_rounds_place_keeps_the_scale_up_and_restarts_its_wait(
) -> None:
    """tailBatching.longRound.maxDeferredRounds: the plan said Long/ScalingUp for step 1 and
    the driver ran a short round instead; the scale-up stays pending with its timeout
    restarted, status.rollout.deferredRounds counts it, the LongRound condition says so; a
    short round the plan asked for is no deferral; the long round's report starts it over."""
    async def body() -> None:
        fk = FakeKube()
        spec = json.loads(json.dumps(SPEC))
        spec["tailBatching"]["longRound"]["maxDeferredRounds"] = 2
        add_job(fk, "job", spec)
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            g = (await env.plan("job"))["groupSize"]
            _, p = await env.post("job", report(0, g, 20, nxt="Long"))
            assert p["roundKind"] == "Long" and p["rollout"]["state"] == "ScalingUp"
            started = env.status("job")["rollout"]["scaleUpStartedAt"]
            assert env.status("job")["rollout"].get("deferredRounds", 0) == 0
            time.sleep(1.1)  # the restarted wait's time is a later second
            # step 1 ran short in the long round's place; the queue still wants a long round
            _, p = await env.post("job", report(1, p["groupSize"], 20, nxt="Long"))
            assert p["roundKind"] == "Long" and p["rollout"]["state"] == "ScalingUp", p
            assert p["rollout"]["desiredReplicas"] == 3
            ro = env.status("job")["rollout"]
            assert ro["deferredRounds"] == 1 and ro["scaleUpStartedAt"] > started, ro
            cond = {c["type"]: c for c in env.status("job")["conditions"]}["LongRound"]
            assert cond["status"] == "True" and "1 short rounds run" in cond["message"], cond
            assert env.status("job")["longRounds"] == 1  # one long round, deferred once
            _, p = await env.post("job", report(2, p["groupSize"], 20, nxt="Long"))
            assert env.status("job")["rollout"]["deferredRounds"] == 2
            # the long round ran (on what was there): the count starts over
            _, p = await env.post("job", report(3, p["groupSize"], 20, kind="Long",
                                                nxt="Long"))
            assert env.status("job")["rollout"].get("deferredRounds", 0) == 0
            _, p = await env.post("job", report(4, p["groupSize"], 20, kind="Long"))
            assert p["roundKind"] == "Short" and p["rollout"]["desiredReplicas"] == 1
            # an early scale-up's short round (the plan said Short) is not a deferral
            body_ = {**report(5, p["groupSize"], 20), "prepareLongRound": True}
            _, p = await env.post("job", body_)
            assert p["roundKind"] == "Short" and p["rollout"]["state"] == "ScalingUp", p
            _, p = await env.post("job", report(6, p["groupSize"], 20, nxt="Long"))
            assert env.status("job")["rollout"].get("deferredRounds", 0) == 0
        finally:
            await close()

    run(body)


def test_standby_answers_503() -> None:
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job")
        metrics = Metrics()
        jobs = Jobs(fk, settings(), metrics)  # type: ignore[arg-type]
        client = TestClient(TestServer(report_app(jobs, LeaderState(False), metrics)))
        await client.start_server()
        try:
            r = await client.get(plan_path(NS, "job"))
            assert r.status == 503 and (await r.json())["reason"] == "NotLeader"
        finally:
            await client.close()

    run(body)


def test_an_idle_jobs_pass_makes_no_request_until_the_watches_say_something_changed() -> None:
    """The periodic pass of a job nothing happened to reads nothing: the job is re-read only
    when the job watch saw a resourceVersion other than the one in memory, the children only
    after one of their watch events; a full pass every reapply_seconds reads everything."""

    async def body() -> None:
        env, close = await admitted()
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)  # settles: the children exist, the status written
            env.jobs.saw(NS, "job", rt.rv)  # the job watch is up to date
            rt.children_changed = False
            before = len(env.fk.calls)
            for _ in range(3):
                await env.jobs.reconcile(rt)
            assert env.fk.calls[before:] == []
            # someone else wrote the job: re-read (one GET), children untouched
            env.fk.objects[job_path(NS, "job")]["metadata"]["resourceVersion"] = "999"
            env.jobs.saw(NS, "job", "999")
            before = len(env.fk.calls)
            await env.jobs.reconcile(rt)
            assert env.fk.calls[before:] == [("GET", job_path(NS, "job"))]
            # a child's event: the children are looked at again
            rt.children_changed = True
            before = len(env.fk.calls)
            await env.jobs.reconcile(rt)
            driver = object_path("v1", "pods", NS, names.driver_pod("job", 0))
            assert ("GET", driver) in env.fk.calls[before:]
            # the full pass of reapply_seconds: everything read and applied again
            # (not 0.0: time.monotonic() may be below reapply_seconds on a fresh machine)
            rt.applied_at = time.monotonic() - env.jobs.settings.reapply_seconds - 1
            before = len(env.fk.calls)
            await env.jobs.reconcile(rt)
            calls = env.fk.calls[before:]
            assert ("GET", job_path(NS, "job")) in calls and ("GET", driver) in calls
            assert sum(m == "PATCH" for m, _ in calls) >= 3  # children re-applied
        finally:
            await close()

    run(body)


def test_a_child_someone_else_changed_is_applied_again_on_its_event_not_on_a_timer() -> None:
    """Drift repair without polling: a StatefulSet whose spec someone changed (its watch event
    carries another generation than the operator's apply left) or a changed ConfigMap (another
    resourceVersion) is applied again on the next pass; an event of the operator's own apply,
    or of a status update (same generation), makes no request."""

    async def body() -> None:
        env, close = await admitted()
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            env.jobs.saw(NS, "job", rt.rv)
            sts = names.statefulset("job", contract.Role.ROLLOUT)
            sts_path = object_path("apps/v1", "statefulsets", NS, sts)
            mine = env.fk.objects[sts_path]["metadata"]
            # the StatefulSet controller's status update: same generation
            env.jobs.child_event(NS, "job", "StatefulSet", sts, "MODIFIED",
                                 {**mine, "resourceVersion": "900"})
            before = len(env.fk.calls)
            await env.jobs.reconcile(rt)
            assert [c for c in env.fk.calls[before:] if c[0] == "PATCH"] == []
            # someone scaled it by hand: a new generation, applied again
            env.jobs.child_event(NS, "job", "StatefulSet", sts, "MODIFIED",
                                 {**mine, "generation": int(mine["generation"]) + 1})
            cm = names.config_map("job")
            env.jobs.child_event(NS, "job", "ConfigMap", cm, "MODIFIED",
                                 {"name": cm, "resourceVersion": "901"})
            before = len(env.fk.calls)
            await env.jobs.reconcile(rt)
            patched = {p for m, p in env.fk.calls[before:] if m == "PATCH"}
            assert patched == {sts_path, object_path("v1", "configmaps", NS, cm)}
            # the operator's own applies' events: nothing more
            for path, kind, name in ((sts_path, "StatefulSet", sts),
                                     (object_path("v1", "configmaps", NS, cm), "ConfigMap", cm)):
                env.jobs.child_event(NS, "job", kind, name, "MODIFIED",
                                     env.fk.objects[path]["metadata"])
            before = len(env.fk.calls)
            await env.jobs.reconcile(rt)
            assert [c for c in env.fk.calls[before:] if c[0] == "PATCH"] == []
        finally:
            await close()

    run(body)
