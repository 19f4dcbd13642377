"""A stand-in step-report endpoint for tests that run a driver without an operator: the
protocol's two routes over the real :class:`~rlpacer.control.plan.JobController` (bearer token
checked, 422 with the controller's reason on a rejected report), one rollout replica, and every
report it was sent kept in :attr:`ReportStub.reports`."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer
from typing import Any

from rlpacer.api.protocol import Plan, RolloutCapacity, StepReport
from rlpacer.control.plan import JobController, JobControllerConfig, ReportRejected
from rlpacer.testing.jsonhttp import JSONHandler
from rlpacer_trainer.controller_client import to_data


class _Handler(JSONHandler):
    server: ReportStub

    def _plan(self) -> dict[str, Any]:
        cp = self.server.jc.plan()
        return Plan(step=cp.step, group_size=cp.group_size, round_kind=cp.round_kind,
                    rollout=RolloutCapacity(desired_replicas=1, ready_replicas=1),
                    lambda_=cp.lambda_, straggler_rate=cp.straggler_rate).to_wire()

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.server.token}":
            return True
        self.send_json(401, {"code": 401, "reason": "BadToken", "message": "no"})
        return False

    def do_GET(self) -> None:
        if self._authorized():
            self.send_json(200, self._plan())

    def do_POST(self) -> None:
        if not self._authorized():
            return
        body = self.read_json()
        self.server.reports.append(body)
        try:
            self.server.jc.observe(to_data(StepReport.model_validate(body)))
        except ReportRejected as err:
            return self.send_json(422, {"code": 422, "reason": err.reason, "message": err.message})
        self.send_json(200, self._plan())


class ReportStub(ThreadingHTTPServer):
    """Serves on ``host:port`` (0: a free port) in a daemon thread once :meth:`start` ran."""

    def __init__(self, config: JobControllerConfig, token: str, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        super().__init__((host, port), _Handler)
        self.jc = JobController(config)
        self.token = token
        self.reports: list[dict[str, Any]] = []

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> ReportStub:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self
