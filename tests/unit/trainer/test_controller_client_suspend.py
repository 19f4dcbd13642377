"""The driver told its job is suspended (409 JobSuspended) stops at once: no retry of the
report, a clear message, and the pod's entrypoint exits with the "operator refused" code
(3) rather than a traceback; the pod is being deleted anyway (restartPolicy Never)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from rlpacer.api.protocol import LengthSummary, RoundKind, StepReport
from rlpacer.testing.jsonhttp import JSONHandler
from rlpacer_trainer import pod
from rlpacer_trainer.controller_client import ControllerError, HTTPController, JobSuspended

pytestmark = pytest.mark.unit


class _Suspended(JSONHandler):
    server: Any

    def do_POST(self) -> None:
        self.read_json()
        self.server.posts += 1
        self.send_json(409, {"code": 409, "reason": "JobSuspended",
                             "message": "the job is suspended (spec.suspend)"})


@pytest.fixture
def server() -> Iterator[Any]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Suspended)
    srv.posts = 0  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()


def test_a_suspended_jobs_409_stops_the_driver_without_retrying(
    server: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    ctl = HTTPController(url, "ns", "job", "tok", backoff_s=0.01, retries=8)
    report = StepReport(attempt=0, step=3, group_size=8, round_kind=RoundKind.SHORT,
                        lengths=LengthSummary(max=40, median=8, p90=20, count=32),
                        next_round_kind=RoundKind.SHORT)
    with pytest.raises(JobSuspended) as caught:
        ctl.report(report)
    assert server.posts == 1  # not retried
    err = caught.value
    assert isinstance(err, ControllerError) and err.status == 409
    assert "JobSuspended" in err.body and "suspended" in str(err)

    def driver(env: Any) -> int:
        raise err

    monkeypatch.setattr(pod, "run_driver", driver)
    assert pod.main({"RLPACER_ROLE": "driver"}) == 3
    out = capsys.readouterr().err
    assert out.startswith("error: the job is suspended") and "Traceback" not in out
