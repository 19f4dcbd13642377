"""Malformed, out-of-range and late step reports get a 4xx ErrorBody with a clear message
(never a 500 with a traceback, never a 503 the driver would retry forever), nothing changes,
and the answer is counted in the operator's metrics."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, SPEC, Env, add_job, admitted, open_env, report, run

from rlpacer.api.crd import schema_violations, status_schema
from rlpacer.api.job import parse_spec
from rlpacer.api.protocol import (
    LengthSummary,
    RoundKind,
    StepReport,
    release_path,
    steps_path,
)
from rlpacer.api.status import RLTrainingJobStatus
from rlpacer.control.plan import ReportRejected
from rlpacer.operator import hosting
from rlpacer.operator.kube import ApiError
from rlpacer.operator.reports import accept_report, check_report

pytestmark = pytest.mark.unit


def _errors(env: Env, code: int, reason: str) -> float:
    v = env.metrics.registry.get_sample_value(
        "rlpacer_step_report_errors_total",
        {"route": "steps", "code": str(code), "reason": reason})
    return v or 0.0


async def _raw(env: Env, data: bytes, auth: bytes | None = None) -> tuple[int, dict[str, Any]]:
    tok = auth if auth is not None else f"Bearer {await env.token('job')}".encode()
    r = await env.client.post(
        steps_path(NS, "job"), data=data,
        headers={"Authorization": tok.decode("latin-1"), "Content-Type": "application/json"})
    assert r.headers["Content-Type"].startswith("application/json"), await r.text()
    return r.status, await r.json()


def test_malformed_bodies_are_4xx_and_counted() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            g = (await env.plan("job"))["groupSize"]
            before = env.status("job")["controllerState"]
            ok = report(0, g, 20)
            cases: list[tuple[bytes, str]] = [
                (b'{"attempt": 0, "step": 0, \xff\xfe}', "not UTF-8"),
                (b'{"attempt": 1' + b"0" * 5000 + b"}", "integer"),
                (b'{"attempt": ' + str(10**30).encode() + b"}", "integer"),
                (b'{"attempt": 0, "lengths": {"median": 1e400}}', "1e400"),
                (b'{"attempt": 0, "lengths": {"median": NaN}}', "NaN"),
            ]
            for data, words in cases:
                code, err = await _raw(env, data)
                assert code == 422 and err["reason"] == "InvalidReport", (data[:60], err)
                assert words in err["message"], err
            # finite values whose sum (the step's wall clock) overflows a float
            big = {**ok, "seconds": {"rollout": 1e308, "reward": 1e308, "train": 1e308}}
            code, err = await env.post("job", big)
            assert code == 422 and "seconds" in err["message"], err
            # a bearer token that is not ASCII
            code, err = await _raw(env, b"{}", auth="Bearer t\u00f6ken".encode("latin-1"))
            assert code == 401 and err["reason"] == "Unauthorized", err
            code, err = await _raw(env, b"{}", auth="Bearer t\u00f6ken".encode())
            assert code == 401 and err["reason"] == "Unauthorized", err
            code, err = await _raw(env, b" " * (64 * 1024 + 1))
            assert code == 413 and err["reason"] == "TooLarge", err
            assert env.status("job")["controllerState"] == before
            assert _errors(env, 413, "TooLarge") == 1
            assert _errors(env, 422, "InvalidReport") == 6
            assert _errors(env, 401, "Unauthorized") == 2
            # the existing histogram keeps its labels and counts the answers too
            assert env.metrics.registry.get_sample_value(
                "rlpacer_step_report_duration_seconds_count",
                {"route": "steps", "code": "422"}) == 6
            assert (await env.post("job", ok))[0] == 200
        finally:
            await close()

    run(body)


def test_counts_and_lengths_beyond_the_spec_are_refused_and_move_nothing() -> None:
    async def body() -> None:
        env, close = await admitted()  # maxResponseTokens 512 (default), promptsPerStep 4
        try:
            g = (await env.plan("job"))["groupSize"]
            before = env.status("job")["controllerState"]
            ok = report(0, g, 20)
            cases: list[tuple[dict[str, Any], str]] = [
                ({"max": 513, "median": 10.0, "p90": 20.0, "count": 4 * g},
                 "lengths.max 513 exceeds 512 (spec.rollout.maxResponseTokens)"),
                ({"max": 10**12, "median": 10.0, "p90": 20.0, "count": 4 * g},
                 "lengths.max 1000000000000 exceeds 512"),
                ({**ok["lengths"], "count": 4 * g + 1}, f"lengths.count {4 * g + 1} exceeds"
                 f" {4 * g} (groupSize {g} x spec.promptsPerStep 4)"),
                ({**ok["lengths"], "count": 10**18}, "lengths.count 1000000000000000000"),
                ({**ok["lengths"], "aborted": 10**9}, "lengths.aborted 1000000000 exceeds"),
            ]
            for lengths, words in cases:
                code, err = await env.post("job", {**ok, "lengths": lengths})
                assert code == 422 and err["reason"] == "OutOfBounds", err
                assert words in err["message"], err
            code, err = await env.post("job", {**ok, "longQueue": 10**15})
            assert code == 422 and "longQueue 1000000000000000 exceeds" in err["message"], err
            # 10^30 is refused while parsing (outside int64), before any bound
            code, err = await env.post("job", {**ok, "lengths": {**ok["lengths"],
                                                                  "count": 10**30}})
            assert code == 422 and "out of range" in err["message"], err
            # a mean length past the longest response is impossible, named as such
            mx = ok["lengths"]["max"]
            code, err = await env.post("job", {**ok, "lengths": {**ok["lengths"],
                                                                  "mean": mx + 1.0}})
            assert code == 422 and err["reason"] == "ImpossibleLengths", err
            assert "lengths.mean" in err["message"], err
            assert env.status("job")["controllerState"] == before
            assert _errors(env, 422, "OutOfBounds") == 6
            # at the bounds: accepted
            edge = {**ok, "lengths": {"max": 512, "median": 10.0, "p90": 20.0, "mean": 60.0,
                                      "count": 4 * g, "aborted": 5 * (g + 1)}, "longQueue": 5}
            code, plan = await env.post("job", edge)
            assert code == 200, plan
        finally:
            await close()

    run(body)


def test_reports_after_the_last_step_are_refused_and_replays_still_answered() -> None:
    async def body() -> None:
        fk = FakeKube()
        add_job(fk, "job", {**SPEC, "steps": 2})
        env, close = await open_env(fk)
        try:
            rt = await env.jobs.get(NS, "job")
            assert rt is not None
            await env.jobs.reconcile(rt)
            g = (await env.plan("job"))["groupSize"]
            code, plan = await env.post("job", report(0, g, 20))
            assert code == 200 and not plan["done"]
            last = report(1, plan["groupSize"], 20)
            code, done = await env.post("job", last)
            assert code == 200 and done["done"] and done["step"] == 2
            state = env.status("job")["controllerState"]
            code, err = await env.post("job", report(2, done["groupSize"], 20))
            assert code == 422 and err["reason"] == "JobDone", err
            assert "spec.steps 2" in err["message"] and "plan said done" in err["message"]
            assert env.status("job")["step"] == 2
            assert env.status("job")["controllerState"] == state
            assert await env.post("job", last) == (200, done)  # the idempotent answer
        finally:
            await close()

    run(body)


def test_a_status_the_api_server_would_refuse_is_422_not_a_retry() -> None:
    assert schema_violations(status_schema(), {"longQueue": 2**63}) == [
        ".longQueue: 9223372036854775808 is outside int64"]
    assert schema_violations(status_schema(), {"longQueue": 2**53 - 1, "step": 3}) == []
    assert schema_violations(status_schema(), {"longQueue": 2**53}) == [
        f".longQueue: {2**53} > maximum {2**53 - 1}"]
    spec = parse_spec(SPEC)
    st = RLTrainingJobStatus(long_rounds=2**63 - 1, controller_state=hosting.new_state(spec))
    g = hosting.load(st.controller_state or "").plan().group_size
    long = StepReport.model_validate(report(0, g, 20, nxt="Long"))  # a long round next
    with pytest.raises(ReportRejected) as exc:
        accept_report(spec, st, long, datetime.now(UTC), 1)
    assert exc.value.reason == "StatusOutOfRange" and ".longRounds" in exc.value.message


def test_api_server_refusing_the_status_is_422_not_503() -> None:
    async def body() -> None:
        env, close = await admitted()
        try:
            g = (await env.plan("job"))["groupSize"]
            real = env.fk.request

            async def refuse(method: str, path: str, body: Any = None, **kw: Any) -> Any:
                if method == "PUT" and path.endswith("/status"):
                    raise ApiError(422, "Invalid", "status.longQueue: Invalid value: must be"
                                   " of type integer")
                return await real(method, path, body, **kw)

            env.fk.request = refuse  # type: ignore[method-assign]
            code, err = await env.post("job", report(0, g, 20))
            assert code == 422 and err["reason"] == "StatusRejected", err
        finally:
            await close()

    run(body)


def test_a_release_gets_the_reports_answers_when_its_status_is_not_persisted() -> None:
    """``POST release`` shares the report's commit and its answers: the API server refusing
    the status it makes is 422 StatusRejected (a retry would be refused again), one that is
    unavailable is 503 (retry); neither changes the job, and the release then goes through."""
    async def body() -> None:
        env, close = await admitted()
        try:
            g = (await env.plan("job"))["groupSize"]
            code, plan = await env.post("job", report(0, g, 20, nxt="Long"))
            assert code == 200 and plan["roundKind"] == "Long", plan
            before = env.status("job")
            real = env.fk.request
            refusal: list[ApiError] = []

            async def refuse(method: str, path: str, body: Any = None, **kw: Any) -> Any:
                if method == "PUT" and path.endswith("/status") and refusal:
                    raise refusal[0]
                return await real(method, path, body, **kw)

            env.fk.request = refuse  # type: ignore[method-assign]

            async def release() -> tuple[int, dict[str, Any]]:
                r = await env.client.post(
                    release_path(NS, "job"), json={"attempt": 0, "step": 1},
                    headers={"Authorization": f"Bearer {await env.token('job')}"})
                return r.status, await r.json()

            refusal[:] = [ApiError(422, "Invalid", "status.rollout: Invalid value")]
            code, err = await release()
            assert code == 422 and err["reason"] == "StatusRejected", err
            assert "this release makes" in err["message"], err
            refusal[:] = [ApiError(503, "ServiceUnavailable", "etcd leader changed")]
            code, err = await release()
            assert code == 503 and err["reason"] == "Unavailable", err
            assert env.status("job") == before
            refusal.clear()
            code, _ = await release()
            assert code == 200
            assert env.status("job")["rollout"]["desiredReplicas"] == 1
        finally:
            await close()

    run(body)


def _long_report(spec: dict[str, Any], count: int, queue: int) -> StepReport:
    return StepReport(attempt=0, step=0, group_size=4, round_kind=RoundKind.LONG,
                      lengths=LengthSummary(max=90, median=30.0, p90=80.0, count=count),
                      long_queue=queue)


def test_long_rounds_of_more_prompts_are_within_the_bounds_and_no_further() -> None:
    """tailBatching.longRound.prompts L: a long round reports L x G kept responses, and the
    queue before it holds up to L plus what the short rounds add (one held long round's
    short rounds, and routed prompts, included); one more is refused naming the field."""
    base = {**SPEC, "promptsPerStep": 4}  # eta 1.25: 5 launched, 1 deferred a round
    check_report(parse_spec(base), _long_report(base, 16, 5))
    with pytest.raises(ReportRejected, match=r"exceeds 16 \(groupSize 4 x spec.promptsPerStep"):
        check_report(parse_spec(base), _long_report(base, 48, 5))
    big = {**base, "tailBatching": {"longRound": {"rolloutReplicas": 3, "prompts": 12,
                                                  "maxDeferredRounds": 2},
                                    "lengthPrior": {"route": True}}}
    spec = parse_spec(big)
    check_report(spec, _long_report(big, 48, 12 + 3 * 2))
    with pytest.raises(ReportRejected) as err:
        check_report(spec, _long_report(big, 49, 0))
    assert "exceeds 48 (groupSize 4 x spec.tailBatching.longRound.prompts 12)" in str(err.value)
    with pytest.raises(ReportRejected, match="longQueue 19 exceeds 18"):
        check_report(spec, _long_report(big, 48, 19))


def test_long_round_prompts_below_a_step_are_refused_naming_the_field() -> None:
    bad = {**SPEC, "tailBatching": {"longRound": {"rolloutReplicas": 3, "prompts": 3}}}
    with pytest.raises(Exception, match=r"tailBatching.longRound.prompts must be >="
                                        r" promptsPerStep \(3 < 4\)"):
        parse_spec(bad)


def test_filled_long_rounds_are_within_the_bounds_and_no_further() -> None:
    """tailBatching.longRound.fillPrompts F: a long round keeps up to (its queued prompts + F)
    x G responses, aborts up to F x G (the fill it defers), and queues the fill it defers;
    one more of each is refused naming the field."""
    base = {**SPEC, "promptsPerStep": 4}  # eta 1.25: 5 launched, 1 deferred a round
    filled = {**base, "tailBatching": {"longRound": {"rolloutReplicas": 3, "fillPrompts": 8}}}
    spec = parse_spec(filled)
    check_report(spec, _long_report(filled, 4 * (4 + 8), 5 + 8))
    with pytest.raises(ReportRejected) as err:
        check_report(spec, _long_report(filled, 4 * 12 + 1, 0))
    assert ("exceeds 48 (groupSize 4 x a long round's prompts 4 +"
            " spec.tailBatching.longRound.fillPrompts 8)") in str(err.value)
    with pytest.raises(ReportRejected, match=r"longQueue 14 exceeds 13 .*fillPrompts 8"):
        check_report(spec, _long_report(filled, 48, 14))
    aborted = StepReport(attempt=0, step=0, group_size=4, round_kind=RoundKind.LONG,
                         lengths=LengthSummary(max=90, median=30.0, p90=80.0, count=16,
                                               aborted=32), long_queue=8)
    check_report(spec, aborted)  # 8 fill prompts x G 4 deferred (above a short round's 25)
    with pytest.raises(ReportRejected, match=r"aborted 33 exceeds 32 \(spec.tailBatching"
                                             r".longRound.fillPrompts 8 x groupSize 4\)"):
        check_report(spec, aborted.model_copy(update={"lengths": aborted.lengths.model_copy(
            update={"aborted": 33})}))
    # without the field, the same report's fill is refused
    with pytest.raises(ReportRejected):
        check_report(parse_spec(base), _long_report(base, 48, 5))


def test_a_short_round_kept_at_the_cap_is_within_the_bounds_and_no_further() -> None:
    """tailBatching.keepNearCap: a short round that reached the cap keeps every prompt it
    launched, ceil(eta x P0) x G responses (promptsPerStep 8, eta 1.25: 10 x 4); one more is
    refused naming the field, and without the field the same round is refused."""
    base = {**SPEC, "promptsPerStep": 8}
    kept = {**base, "tailBatching": {"keepNearCap": "0.1"}}
    short = StepReport(attempt=0, step=0, group_size=4, round_kind=RoundKind.SHORT,
                       lengths=LengthSummary(max=90, median=30.0, p90=80.0, count=40))
    check_report(parse_spec(kept), short)
    with pytest.raises(ReportRejected) as err:
        check_report(parse_spec(kept), short.model_copy(update={
            "lengths": short.lengths.model_copy(update={"count": 41})}))
    assert ("exceeds 40 (groupSize 4 x ceil(promptOverprovision x promptsPerStep) 10"
            " (spec.tailBatching.keepNearCap))") in str(err.value)
    with pytest.raises(ReportRejected, match=r"exceeds 32 \(groupSize 4 x spec.promptsPerStep"):
        check_report(parse_spec(base), short)
    bad = {**base, "tailBatching": {"keepNearCap": "1"}}
    with pytest.raises(Exception, match="keepNearCap must be < 1"):
        parse_spec(bad)
