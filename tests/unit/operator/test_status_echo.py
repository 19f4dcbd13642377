"""Status writes answered with metadata only: the API server's answer to a status PUT is the
whole object unless asked otherwise; the operator asks for the whole object only for a status
shape it has not yet seen stored as sent (a CRD older than the operator prunes what it lacks),
and keeps in memory exactly what is stored either way."""

from __future__ import annotations

from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, Env, add_job, open_env, report, run

from rlpacer.operator.kube import METADATA_ONLY, ApiError
from rlpacer.operator.runtime import job_path, status_shape

pytestmark = pytest.mark.unit


def _recording(fk: FakeKube, accepts: list[str], prune: str | None = None,
               refuse_metadata: bool = False) -> None:
    real = fk.request

    async def request(method: str, path: str, body: Any = None, **kw: Any) -> Any:
        if method == "PUT" and path.endswith("/status"):
            accept = kw.get("accept", "application/json")
            accepts.append(accept)
            if refuse_metadata and accept == METADATA_ONLY:
                raise ApiError(406, "NotAcceptable", "only application/json")
            if prune is not None:
                body = {**body, "status": {k: v for k, v in body["status"].items()
                                           if k != prune}}
        return await real(method, path, body, **kw)

    fk.request = request  # type: ignore[method-assign]


async def _env(accepts: list[str], **kw: Any) -> tuple[Env, Any]:
    fk = FakeKube()
    _recording(fk, accepts, **kw)
    add_job(fk, "job")
    env, close = await open_env(fk)
    rt = await env.jobs.get(NS, "job")
    assert rt is not None
    await env.jobs.reconcile(rt)
    return env, close


async def _report_and_check(env: Env, steps: int) -> None:
    g = 8
    for step in range(steps):
        code, plan = await env.post("job", report(step, g, 40.0 + 30 * step))
        assert code == 200, plan
        g = plan["groupSize"]
        rt = env.jobs.peek(NS, "job")
        assert rt is not None
        stored = env.fk.objects[job_path(NS, "job")]
        # in memory: exactly the stored status, at the stored resourceVersion
        assert rt.status.to_wire() == stored["status"]
        assert rt.rv == stored["metadata"]["resourceVersion"]


def test_writes_of_a_shape_stored_as_sent_ask_for_metadata_only() -> None:
    async def body() -> None:
        accepts: list[str] = []
        env, close = await _env(accepts)
        try:
            n0 = len(accepts)
            await _report_and_check(env, 8)
            per_report = accepts[n0:]
            assert len(per_report) == 8
            # the first report's status has a shape not yet verified (its first
            # lastReportTime, posteriors, ...): the whole object; later ones need only the
            # new resourceVersion (a shape may still change once, e.g. a condition added)
            assert per_report[0] == "application/json"
            assert per_report.count(METADATA_ONLY) >= 6, per_report
            rt = env.jobs.peek(NS, "job")
            assert rt is not None and rt.verified_shape == status_shape(rt.status.to_wire())
        finally:
            await close()

    run(body)


def test_a_crd_that_prunes_a_field_gets_whole_object_answers_and_the_stored_status() -> None:
    async def body() -> None:
        accepts: list[str] = []
        env, close = await _env(accepts, prune="lastReportTime")
        try:
            n0 = len(accepts)
            await _report_and_check(env, 5)  # in memory == stored: no lastReportTime
            assert accepts[n0:] == ["application/json"] * 5  # never verified: always echoed
            rt = env.jobs.peek(NS, "job")
            assert rt is not None and rt.status.last_report_time is None
        finally:
            await close()

    run(body)


def test_an_api_server_refusing_metadata_only_answers_gets_whole_object_writes() -> None:
    async def body() -> None:
        accepts: list[str] = []
        env, close = await _env(accepts, refuse_metadata=True)
        try:
            await _report_and_check(env, 5)  # every report answered and stored once
            assert env.jobs.echo_writes
            assert accepts.count(METADATA_ONLY) == 1  # asked once, refused, never again
            assert env.status("job")["step"] == 5
        finally:
            await close()

    run(body)


def test_status_shape() -> None:
    assert status_shape({"a": 1, "b": {"c": [1, {"d": 2}, {"e": None}]}}) == {
        ".a", ".b", ".b.c", ".b.c[].d", ".b.c[].e"}
    assert status_shape({"a": [{"x": 1}]}) == status_shape({"a": [{"x": 5}, {"x": 6}]})
