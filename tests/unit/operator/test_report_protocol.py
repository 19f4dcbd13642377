"""Regressions pinned from fuzzing the step-report endpoint (test_report_fuzz.py), its
per-job request rate, and version tolerance of the protocol (unknown fields)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, Env, add_job, admitted, open_env, report, run
from yarl import URL

from rlpacer.api.protocol import Plan, StepReport, plan_path, steps_path, unknown_fields
from rlpacer.operator.server import TokenBucket
from rlpacer.operator.settings import OperatorSettings

pytestmark = pytest.mark.unit


async def _send(env: Env, method: str, path: str, **kw: Any) -> tuple[int, Any, Any]:
    r = await env.client.request(method, URL(path, encoded=True), **kw)
    assert r.headers["Content-Type"].startswith("application/json"), (r.status, await r.text())
    return r.status, await r.json(), r.headers


def test_wrong_method_and_unknown_path_answer_json() -> None:
    # found by the fuzzer: GET .../steps was aiohttp's 405 in text/plain (no ErrorBody)
    async def body() -> None:
        env, close = await admitted()
        try:
            code, err, headers = await _send(env, "GET", steps_path(NS, "job"))
            assert code == 405 and err["reason"] == "MethodNotAllowed", err
            assert "POST" in headers["Allow"] and err["code"] == 405
            code, err, _ = await _send(env, "DELETE", plan_path(NS, "job"))
            assert code == 405 and err["reason"] == "MethodNotAllowed", err
            code, err, _ = await _send(env, "POST", "/v1/namespaces/team/rltrainingjobs/job/step")
            assert code == 404 and err["reason"] == "NotFound", err
            code, err, _ = await _send(env, "GET", "/v2/anything")
            assert code == 404 and err["reason"] == "NotFound", err
        finally:
            await close()

    run(body)


def test_names_that_cannot_be_a_job_are_404_without_asking_the_api_server() -> None:
    # found by review of the fuzzed paths: the name was spliced into the API server's URL,
    # so "job%3Fx%3D1" (name "job?x=1") read the job "job" (its token then passed)
    async def body() -> None:
        env, close = await admitted()
        try:
            tok = await env.token("job")
            calls = len(env.fk.calls)
            for name in ["job%3Fx%3D1", "job%3F", "%2E%2E", "job%2Fstatus", "JOB", "a" * 64,
                         "-job", "job%00", "j%C3%B6b"]:
                path = f"/v1/namespaces/{NS}/rltrainingjobs/{name}/steps"
                code, err, _ = await _send(env, "POST", path, json=report(0, 8, 20),
                                           headers={"Authorization": f"Bearer {tok}"})
                assert code == 404 and err["reason"] == "NotFound", (name, err)
            code, err, _ = await _send(env, "GET", "/v1/namespaces/t%3Fx/rltrainingjobs/job/plan",
                                       headers={"Authorization": f"Bearer {tok}"})
            assert code == 404, err
            assert len(env.fk.calls) == calls  # not one request to the API server
        finally:
            await close()

    run(body)


def test_names_of_no_job_leave_nothing_in_memory() -> None:
    # found by the fuzzer: every unknown name left a lock in Jobs._loading for good
    async def body() -> None:
        env, close = await admitted()
        try:
            for i in range(200):
                code, err, _ = await _send(env, "GET", plan_path(NS, f"nope-{i}"))
                assert code == 404, err
            assert not env.jobs._loading or set(env.jobs._loading) <= {(NS, "job")}
            assert set(env.jobs._jobs) == {(NS, "job")}
        finally:
            await close()

    run(body)


# -- rate ----------------------------------------------------------------------------------

def test_token_bucket() -> None:
    b = TokenBucket(rate=20, burst=50, now=0.0)
    assert all(b.take(0.0) == 0.0 for _ in range(50))
    assert b.take(0.0) == pytest.approx(0.05)
    assert b.take(0.05) == 0.0  # one token back after 1/20 s
    assert b.take(0.05) > 0
    assert all(b.take(100.0) == 0.0 for _ in range(50))  # refills to the burst, no more
    assert b.take(100.0) > 0


def test_settings_of_the_rate() -> None:
    s = OperatorSettings.load(env={"RLPACER_OPERATOR_REPORT_RATE_PER_SECOND": "5",
                                   "RLPACER_OPERATOR_REPORT_BURST": "7"})
    assert (s.report_rate_per_second, s.report_burst) == (5.0, 7)
    d = OperatorSettings.load(env={})
    assert (d.report_rate_per_second, d.report_burst) == (20.0, 50)
    with pytest.raises(SystemExit, match="report_burst"):
        OperatorSettings.load(env={"RLPACER_OPERATOR_REPORT_BURST": "0"})


def test_rate_is_per_job_counts_plan_reads_and_not_strangers() -> None:
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job")
        add_job(fk, "other")
        cfg = OperatorSettings(leader_election=False, resync_seconds=3600,
                               report_rate_per_second=1, report_burst=3)
        env, close = await open_env(fk, cfg)
        try:
            for n in ("job", "other"):
                rt = await env.jobs.get(NS, n)
                assert rt is not None
                await env.jobs.reconcile(rt)
            # strangers (no or a wrong token) spend nothing of the job's budget
            for _ in range(10):
                assert (await env.post("job", report(0, 8, 20), token="wrong"))[0] == 401
            g = (await env.plan("job"))["groupSize"]  # 1
            code, p = await env.post("job", report(0, g, 20))  # 2
            assert code == 200
            assert (await env.post("job", report(0, g, 20))) == (200, p)  # 3 (a replay)
            g = p["groupSize"]
            state = env.status("job")["controllerState"]
            code, err, headers = await _send(
                env, "POST", steps_path(NS, "job"), json=report(1, g, 20),
                headers={"Authorization": f"Bearer {await env.token('job')}"})
            assert code == 429 and err["reason"] == "TooManyRequests", err
            assert headers["Retry-After"] == "1" and "1 requests/s (burst 3)" in err["message"]
            assert env.status("job")["controllerState"] == state  # nothing moved
            code, err, _ = await _send(
                env, "GET", plan_path(NS, "job"),
                headers={"Authorization": f"Bearer {await env.token('job')}"})
            assert code == 429, err
            assert await env.plan("other")  # another job has its own budget
            await asyncio.sleep(1.05)
            assert (await env.post("job", report(1, g, 20)))[0] == 200
            assert env.metrics.report_throttled.labels(NS, "job")._value.get() == 2
            assert env.metrics.registry.get_sample_value(
                "rlpacer_step_report_errors_total",
                {"route": "steps", "code": "429", "reason": "TooManyRequests"}) == 1
        finally:
            await close()

    run(body)


# -- versions ------------------------------------------------------------------------------

def test_unknown_fields_are_named() -> None:
    raw = {**report(0, 8, 20), "futureKnob": 1, "lambda_": 2,
           "lengths": {**report(0, 8, 20)["lengths"], "p99": 30.0},
           "seconds": {"rollout": 1.0, "gpu": {"x": 1}}}
    assert sorted(unknown_fields(StepReport, raw)) == ["futureKnob", "lambda_", "lengths.p99",
                                                       "seconds.gpu"]
    assert unknown_fields(StepReport, report(0, 8, 20)) == []
    assert unknown_fields(Plan, {"lambda": 0.1, "lambda_": 0.2, "rollout": {"z": 1}}) == [
        "rollout.z"]
    many = {f"k{i}": i for i in range(1000)}
    assert len(unknown_fields(StepReport, many)) == 16  # bounded, whatever a body holds
    assert unknown_fields(StepReport, {"x" * 500: 1}) == ["x" * 64]


def test_a_newer_trainers_report_is_accepted_logged_once_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        env, close = await admitted()
        ref, close_ref = await admitted()
        try:
            g = (await env.plan("job"))["groupSize"]
            for step in range(3):
                newer = {**report(step, g, 20), "tokensPerSecond": 1234.5,
                         "lengths": {**report(step, g, 20)["lengths"], "p99": 19.0}}
                code, plan = await env.post("job", newer)
                code_ref, plan_ref = await ref.post("job", report(step, g, 20))
                assert (code, plan) == (code_ref, plan_ref) == (200, plan_ref)
                g = plan["groupSize"]
            # the same state as without the extra fields: they were ignored, not stored
            assert env.status("job")["controllerState"] == ref.status("job")["controllerState"]
            assert env.metrics.report_unknown_fields.labels("steps")._value.get() == 3
            logged = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
            assert len(logged) == 1 and "lengths.p99, tokensPerSecond" in logged[0], logged
        finally:
            await close()
            await close_ref()

    with caplog.at_level(logging.INFO, logger="rlpacer.operator.reports"):
        run(body)


def test_a_newer_operators_plan_reads_in_this_version() -> None:
    wire = {"step": 3, "groupSize": 8, "lambda": 0.25, "stragglerRate": 0.1, "done": False,
            "roundKind": "Short", "budget": {"gpuHours": 2},
            "rollout": {"desiredReplicas": 2, "readyReplicas": 2, "state": "Ready", "z": 1}}
    plan = Plan.model_validate(wire)
    assert plan.step == 3 and plan.lambda_ == 0.25 and plan.rollout.desired_replicas == 2
    assert "budget" not in plan.to_wire()  # ignored, not carried along


def test_an_older_trainers_report_without_the_optional_fields_is_accepted() -> None:
    """Only the fields v1 has always required (no seconds, longQueue, nextRoundKind, reward,
    lengths.aborted): accepted, read with the defaults, nothing counted as unknown."""
    async def body() -> None:
        env, close = await admitted()
        ref, close_ref = await admitted()
        try:
            g = (await env.plan("job"))["groupSize"]
            for step in range(3):
                full = report(step, g, 20)
                older = {k: full[k] for k in ("attempt", "step", "groupSize", "roundKind")}
                older["lengths"] = {k: full["lengths"][k] for k in ("max", "median", "p90",
                                                                    "count")}
                defaults = {**full, "seconds": {}, "longQueue": 0, "nextRoundKind": "Short"}
                code, plan = await env.post("job", older)
                code_ref, plan_ref = await ref.post("job", defaults)
                assert (code, plan) == (code_ref, plan_ref) == (200, plan_ref), plan
                g = plan["groupSize"]
            assert env.status("job")["controllerState"] == ref.status("job")["controllerState"]
            assert env.metrics.report_unknown_fields.labels("steps")._value.get() == 0
        finally:
            await close()
            await close_ref()

    run(body)
