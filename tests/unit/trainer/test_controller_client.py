"""Controller clients: in-process (JobController) and HTTP (the step-report protocol)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from rlpacer.api.protocol import LengthSummary, RolloutState, RoundKind, StepReport
from rlpacer.control.plan import JobControllerConfig
from rlpacer.testing.jsonhttp import JSONHandler
from rlpacer_trainer.controller_client import ControllerError, HTTPController, InProcessController

pytestmark = pytest.mark.unit


def _report(step: int, g: int, attempt: int = 0) -> StepReport:
    return StepReport(attempt=attempt, step=step, group_size=g, round_kind=RoundKind.SHORT,
                      lengths=LengthSummary(max=40, median=8, p90=20, count=32, aborted=4),
                      long_queue=2, next_round_kind=RoundKind.SHORT, reward=0.5)


def test_in_process_plans_and_persists() -> None:
    ctl = InProcessController(JobControllerConfig(), total_steps=3)
    plan = ctl.plan()
    assert plan.step == 0 and plan.group_size in (4, 8, 16) and not plan.done
    nxt = ctl.report(_report(0, plan.group_size))
    assert nxt.step == 1 and ctl.last_straggler is True  # 40/8 > tau=4
    state = ctl.state_dict()
    again = ctl.report(_report(0, plan.group_size))  # idempotent repeat
    assert again == nxt
    other = InProcessController(JobControllerConfig(), total_steps=3)
    other.load_state_dict(state)
    assert other.plan() == ctl.plan()


class _Fake(JSONHandler):
    server: Any

    def _plan(self, step: int, state: str = "Ready") -> dict[str, Any]:
        return {"step": step, "groupSize": 8, "roundKind": "Short", "lambda": 0.1,
                "rollout": {"desiredReplicas": 2, "readyReplicas": 1, "state": state}}

    def do_GET(self) -> None:
        s = self.server
        s.gets += 1
        plan = self._plan(1, "ScalingUp" if s.gets < 3 else "Ready")
        if self.headers["X-RLPacer-Plan-Fields"] == "usableReplicas":  # the trainer asks
            plan["rollout"]["usableReplicas"] = [0, 2]
        self.send_json(200, plan)

    def do_POST(self) -> None:
        s = self.server
        body = self.read_json()
        s.posts.append((self.path, self.headers["Authorization"], body))
        if len(s.posts) == 1:
            return self.send_json(503, {"code": 503, "reason": "Unavailable", "message": "try"})
        if body["step"] == 7:
            return self.send_json(422, {"code": 422, "reason": "StepOutOfOrder", "message": "no"})
        self.send_json(200, self._plan(body["step"] + 1))


@pytest.fixture
def server() -> Iterator[Any]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    srv.gets, srv.posts = 0, []  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()


def test_http_retries_same_body_and_polls_scaling(server: Any) -> None:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    ctl = HTTPController(url, "ns", "job", "tok", backoff_s=0.01, poll_s=0.01)
    plan = ctl.report(_report(0, 8))
    assert plan.step == 1 and plan.lambda_ == 0.1
    assert len(server.posts) == 2 and server.posts[0][2] == server.posts[1][2]
    path, auth, body = server.posts[1]
    assert path == "/v1/namespaces/ns/rltrainingjobs/job/steps"
    assert auth == "Bearer tok"
    assert body["groupSize"] == 8 and body["lengths"]["p90"] == 20
    assert body["roundKind"] == "Short" and body["nextRoundKind"] == "Short"
    first = ctl.plan()
    assert first.rollout.state is RolloutState.SCALING_UP
    ready = ctl.wait_ready(first)
    assert ready.rollout.state is RolloutState.READY and server.gets == 3
    assert ready.rollout.usable_replicas == [0, 2] and plan.rollout.usable_replicas is None
    with pytest.raises(ControllerError, match="422"):
        ctl.report(_report(7, 8))


class _Newer(JSONHandler):
    """An operator of a newer protocol revision: extra plan fields, and a 429 first."""

    server: Any

    def do_POST(self) -> None:
        s = self.server
        s.posts.append(self.read_json())
        if len(s.posts) == 1:
            data = b'{"code": 429, "reason": "TooManyRequests", "message": "slow down"}'
            self.send_response(429)
            self.send_header("Content-Type", "application/json")
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_json(200, {
            "step": 1, "groupSize": 8, "lambda": 0.1, "futureKnob": {"a": 1},
            "rollout": {"desiredReplicas": 2, "readyReplicas": 2, "state": "Ready",
                        "zone": "b"}})


def test_http_tolerates_a_newer_operators_plan_and_waits_out_429(
        caplog: pytest.LogCaptureFixture) -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Newer)
    srv.posts = []  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        ctl = HTTPController(f"http://127.0.0.1:{srv.server_address[1]}", "ns", "job", "tok",
                             retries=1, backoff_s=0.01)
        with caplog.at_level("WARNING", logger="rlpacer_trainer.controller"):
            plan = ctl.report(_report(0, 8))
            again = ctl.report(_report(0, 8))
        assert plan == again and plan.step == 1 and plan.rollout.ready_replicas == 2
        assert len(srv.posts) == 3 and srv.posts[0] == srv.posts[1]  # the 429 retried as is
        assert ctl.unknown_plan_fields == 2
        logged = [r.getMessage() for r in caplog.records]
        assert len(logged) == 1 and "futureKnob, rollout.zone" in logged[0]  # logged once
    finally:
        srv.shutdown()


class _Outage(JSONHandler):
    """An operator whose API server is away: 503 with Retry-After for ``down`` answers."""

    server: Any

    def do_POST(self) -> None:
        import time

        s = self.server
        s.posts.append((time.monotonic(), self.read_json()))
        if len(s.posts) <= s.down:
            data = b'{"code": 503, "reason": "Unavailable", "message": "not persisted"}'
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Retry-After", s.retry_after)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_json(200, {"step": 1, "groupSize": 8, "lambda": 0.1,
                             "rollout": {"desiredReplicas": 1, "readyReplicas": 1,
                                         "state": "Ready"}})


@pytest.fixture
def outage() -> Iterator[Any]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Outage)
    srv.posts, srv.down, srv.retry_after = [], 0, "0"  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()


def test_http_retries_503_past_the_count_within_the_window_after_retry_after(
        outage: Any) -> None:
    url = f"http://127.0.0.1:{outage.server_address[1]}"
    # 6 answers of 503 with a count of 1: the window (5 s) keeps the same report going
    outage.down, outage.retry_after = 6, "0"
    ctl = HTTPController(url, "ns", "job", "tok", retries=1, backoff_s=0.01,
                         retry_window_s=5.0)
    assert ctl.report(_report(0, 8)).step == 1
    assert len(outage.posts) == 7 and all(b == outage.posts[0][1] for _, b in outage.posts)
    # Retry-After is the least wait: 1 s between the two POSTs despite a 10 ms backoff
    outage.posts.clear()
    outage.down, outage.retry_after = 1, "1"
    ctl.report(_report(0, 8))
    assert outage.posts[1][0] - outage.posts[0][0] >= 0.95
    # past the window (and the count) the 503 is raised: the driver fails, nothing hangs
    outage.posts.clear()
    outage.down, outage.retry_after = 10**6, "0"
    short = HTTPController(url, "ns", "job", "tok", retries=1, backoff_s=0.05,
                           retry_window_s=0.3)
    with pytest.raises(ControllerError, match="503"):
        short.report(_report(0, 8))
    assert 2 <= len(outage.posts) <= 8


class _Dropping(JSONHandler):
    """An operator that closes the first ``drop`` connections with no answer (it is
    stopping: its Lease given up), then answers."""

    server: Any

    def do_POST(self) -> None:
        s = self.server
        s.posts.append(self.read_json())
        if len(s.posts) <= s.drop:
            self.close_connection = True
            return  # no status line at all: the client sees the connection closed
        self.send_json(200, {"step": 1, "groupSize": 8, "lambda": 0.1,
                             "rollout": {"desiredReplicas": 1, "readyReplicas": 1,
                                         "state": "Ready"}})


def test_an_operator_that_does_not_answer_is_retried_within_the_window_not_the_count() -> None:
    """Issue 32: the operator restarting (connection refused) or stopping mid-request
    (connection closed with no answer) is waited out like a 503, within retry_window_s,
    whatever the count of retries; past the window it is raised."""
    import socket
    import time

    from rlpacer_trainer.controller_client import unreachable

    # closed without an answer, 4 times, with a count of 1
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Dropping)
    srv.posts, srv.drop = [], 4  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        ctl = HTTPController(f"http://127.0.0.1:{srv.server_address[1]}", "ns", "job", "tok",
                             retries=1, backoff_s=0.01, retry_window_s=30.0)
        assert ctl.report(_report(0, 8)).step == 1
        assert len(srv.posts) == 5 and all(b == srv.posts[0] for b in srv.posts)
    finally:
        srv.shutdown()
        srv.server_close()
    # refused (nothing listens yet), then an operator comes up on that port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    up: list[ThreadingHTTPServer] = []

    def come_up() -> None:
        time.sleep(1.5)
        late = ThreadingHTTPServer(("127.0.0.1", port), _Dropping)
        late.posts, late.drop = [], 0  # type: ignore[attr-defined]
        up.append(late)
        late.serve_forever()

    threading.Thread(target=come_up, daemon=True).start()
    ctl = HTTPController(f"http://127.0.0.1:{port}", "ns", "job", "tok", retries=1,
                         backoff_s=0.05, retry_window_s=30.0)
    try:
        assert ctl.report(_report(0, 8)).step == 1
    finally:
        for late in up:
            late.shutdown()
            late.server_close()
    # past the window, the count spent: raised, nothing hangs
    t0 = time.monotonic()
    short = HTTPController(f"http://127.0.0.1:{port}", "ns", "job", "tok", retries=1,
                           backoff_s=0.05, retry_window_s=0.5)
    with pytest.raises(OSError):
        short.report(_report(0, 8))
    assert time.monotonic() - t0 < 5
    # what counts as "no answer" and what does not (a wrong name, a certificate)
    import http.client
    import ssl

    assert unreachable(ConnectionRefusedError()) and unreachable(TimeoutError())
    assert unreachable(http.client.RemoteDisconnected("closed"))
    assert not unreachable(socket.gaierror(-2, "Name or service not known"))
    assert not unreachable(ssl.SSLCertVerificationError("bad"))


class _Releases(JSONHandler):
    """``POST release``: a newer operator takes it; an older one (``old``) has no such path."""

    server: Any

    def do_POST(self) -> None:
        s = self.server
        body = self.read_json()
        s.posts.append((self.path, body))
        if s.old:
            return self.send_json(404, {"code": 404, "reason": "NotFound", "message": "no"})
        if body["step"] == 2:
            return self.send_json(422, {"code": 422, "reason": "NotALongRound",
                                        "message": "no"})
        self.send_json(200, {"step": body["step"], "groupSize": 8, "roundKind": "Long",
                             "rollout": {"desiredReplicas": 1, "readyReplicas": 1,
                                         "state": "Ready"}})


@pytest.mark.parametrize("old", [False, True])
def test_http_release_is_best_effort_and_an_older_operator_is_asked_once(old: bool) -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Releases)
    srv.posts, srv.old = [], old  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        ctl = HTTPController(f"http://127.0.0.1:{srv.server_port}", "team", "job", "tok",
                             backoff_s=0.01)
        assert ctl.release(3, 1) is (not old)
        path, body = srv.posts[0]  # type: ignore[attr-defined]
        assert path.endswith("/rltrainingjobs/job/release") and body == {"attempt": 3, "step": 1}
        assert ctl.release(3, 2) is False  # refused (422), or the older operator again
        # an older operator is asked once: its 404 is remembered
        assert len(srv.posts) == (1 if old else 2)  # type: ignore[attr-defined]
    finally:
        srv.shutdown()
    assert InProcessController(JobControllerConfig(), total_steps=3).release(0, 1) is False
