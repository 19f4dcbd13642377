"""The step-report endpoint of a real operator process against the real API server, fuzzed:
a few hundred hostile bodies, paths that splice into the API server's URL, then the per-job
request rate, all over the endpoint's TLS. Every answer is JSON, never a 500; nothing
rejected changes the stored status.
(The many-example properties run in process: tests/unit/operator/test_report_fuzz.py.)"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_operator import (
    OperatorProc,
    apply,
    client_context,
    crds,
    small_job,
    status,
    token,
    wait,
)

from rlpacer.api.protocol import steps_path
from rlpacer.testing.cluster import LocalCluster

pytestmark = pytest.mark.integration
__all__ = ["crds"]  # the module-scoped fixture, shared with test_operator

RATE, BURST = 1, 400


@pytest.fixture
def throttled_operator(cluster: LocalCluster, crds: None,
                       namespace: str) -> Iterator[OperatorProc]:
    op = OperatorProc(cluster, namespace, report_rate=RATE, report_burst=BURST).start()
    op.wait_ready()
    try:
        yield op
    finally:
        op.kill(signal.SIGTERM)


def send(url: str, data: bytes, headers: dict[str, str],
         method: str = "POST") -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30, context=client_context()) as r:
            code, hdrs, text = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        code, hdrs, text = e.code, dict(e.headers), e.read()
    assert hdrs.get("Content-Type", "").startswith("application/json"), (code, text[:200])
    return code, hdrs, json.loads(text)


values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
    st.text(max_size=10), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def test_fuzzed_reports_against_the_real_api_server(
    cluster: LocalCluster, throttled_operator: OperatorProc, namespace: str
) -> None:
    op = throttled_operator
    t_start = time.monotonic()
    apply(cluster, small_job("fz", namespace, steps=1000))
    tok = token(cluster, namespace, "fz")
    url = op.base + steps_path(namespace, "fz")
    auth = {"Authorization": f"Bearer {tok}", "Content-Type": "application/json"}
    code, _, plan = send(op.base + f"/v1/namespaces/{namespace}/rltrainingjobs/fz/plan", None,
                         auth, "GET")  # type: ignore[arg-type]
    assert code == 200, plan
    g = plan["groupSize"]
    # the job's own start settles first (Starting -> Running once its rollout pod is ready,
    # and the RolloutReady condition saying so: a reconcile writes it, possibly after an
    # accepted report recorded the ready replica): from then on only accepted reports may
    # change the stored status
    def running() -> bool:
        st0 = status(cluster, namespace, "fz")
        ready = [c for c in st0.get("conditions", []) if c.get("type") == "RolloutReady"]
        return (st0.get("summary") == "Running"
                and (st0.get("rollout") or {}).get("readyReplicas", 0) >= 1
                and [c.get("status") for c in ready] == ["True"])

    wait(cluster, running, "job fz Running with its rollout replica ready", timeout=120)
    nxt: dict[str, Any] = {"step": 0, "g": g, "last": None}
    sent = [1]

    def valid() -> dict[str, Any]:
        step, gg = nxt["step"], nxt["g"]
        return {"attempt": 0, "step": step, "groupSize": gg, "roundKind": "Short",
                "lengths": {"max": 300, "median": 100.0, "p90": 150.0, "count": 8 * gg},
                "seconds": {"rollout": 30.0, "train": 10.0}, "longQueue": 0,
                "nextRoundKind": "Short"}

    # no shrinking: the job moves on between examples, and each example spends its budget
    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(kind=st.sampled_from(["field", "lengths", "drop", "extra", "raw", "valid"]),
           key=st.sampled_from(["attempt", "step", "groupSize", "roundKind", "lengths",
                                "seconds", "longQueue", "nextRoundKind", "reward", "max",
                                "median", "p90", "count", "aborted"]),
           value=values, raw=st.binary(max_size=200))
    def one(kind: str, key: str, value: Any, raw: bytes) -> None:
        body = valid()
        if kind == "field":
            body[key] = value
        elif kind == "lengths":
            body["lengths"][key] = value
        elif kind == "drop":
            body.pop(key, None)
        elif kind == "extra":
            body[f"x-{key}"] = value  # unknown: ignored, the report is still valid
        data = raw if kind == "raw" else json.dumps(body).encode()
        before = status(cluster, namespace, "fz")
        code, _, answer = send(url, data, auth)
        sent[0] += 1
        assert code in (200, 413, 422), (code, answer, data[:200])
        if code == 200:
            if answer["step"] == nxt["step"] + 1:  # accepted: the next template is one on
                nxt.update(step=answer["step"], g=answer["groupSize"], last=answer)
        else:
            assert answer["code"] == code and answer["reason"] and answer["message"], answer
            assert status(cluster, namespace, "fz") == before, (code, answer)
        if kind == "valid" or kind == "extra":
            # (an integer outside int64 is refused wherever it is, an unknown field included)
            assert code == 200 or "out of range" in answer["message"], (answer, data[:300])

    one()
    assert nxt["step"] >= 20  # the valid and tolerated ones advanced the job throughout
    st_ = status(cluster, namespace, "fz")
    assert st_["step"] == nxt["step"]

    # a name that would splice a query into the API server's URL reads no job (404), and
    # does not reach the job "fz" (whose token would then pass)
    before = status(cluster, namespace, "fz")
    for name in ["fz%3Fx%3D1", "fz%3F", "%2E%2E", "FZ"]:
        code, _, answer = send(op.base + f"/v1/namespaces/{namespace}/rltrainingjobs/{name}"
                               "/steps", json.dumps(valid()).encode(), auth)
        assert code == 404 and answer["reason"] == "NotFound", (name, answer)  # not charged
    code, hdrs, answer = send(url, b"{}", auth, "GET")
    assert code == 405 and answer["reason"] == "MethodNotAllowed" and "POST" in hdrs["Allow"]
    assert status(cluster, namespace, "fz") == before

    # the rate: past BURST requests (+ RATE per second) the job gets 429 with Retry-After
    replay = {**valid(), "step": nxt["step"] - 1}
    for _ in range(BURST + 50):
        code, hdrs, answer = send(url, json.dumps(replay).encode(), auth)
        if code == 429:
            break
        sent[0] += 1
        assert code in (200, 422), answer
    else:
        raise AssertionError("no 429 past the burst")
    assert answer["reason"] == "TooManyRequests" and int(hdrs["Retry-After"]) >= 1
    assert BURST <= sent[0] <= BURST + RATE * (time.monotonic() - t_start) + 1, sent
    m = op.metrics()
    assert f'rlpacer_step_report_throttled_total{{job="fz",namespace="{namespace}"}} 1.0' in m
    assert 'rlpacer_step_report_unknown_fields_total{route="steps"}' in m
    assert 'code="500"' not in m
