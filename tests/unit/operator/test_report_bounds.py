"""Malformed, out-of-range and late step reports get a 4xx ErrorBody with a clear message
(never a 500 with a traceback, never a 503 the driver would retry forever), nothing changes,
and the answer is counted in the operator's metrics."""

from __future__ import annotations

from typing import Any

import pytest
from test_reports import NS, Env, admitted, report, run

from rlpacer.api.protocol import steps_path

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
