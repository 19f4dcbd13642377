"""HTTP servers in the operator process (aiohttp, same event loop as Kopf).

* Step reports (DESIGN.md "Step-report protocol"), on ``report_port``:
  ``GET  /v1/namespaces/{ns}/rltrainingjobs/{name}/plan`` and
  ``POST /v1/namespaces/{ns}/rltrainingjobs/{name}/steps`` (``Authorization: Bearer``).
  A POST is answered only after the new controller state is persisted in the job's status.
  Errors carry an :class:`~rlpacer.api.protocol.ErrorBody`: 401 bad/missing token (a token is
  valid for its own job only), 404 unknown job, 422 impossible report (reason from the control
  layer), 503 while this replica is not the leader or the API server is unavailable (the
  driver retries; reports are idempotent).
* ``/metrics``, ``/healthz`` and ``/readyz`` on ``metrics_port``. ``/readyz`` is 200 only on
  the leader, so a Service in front of several replicas routes reports to the active one.

GET plan is authenticated too (it reveals the job's controller decisions only to its trainer).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from rlpacer.api.job import ManifestError, format_validation_error
from rlpacer.api.protocol import PROTOCOL_VERSION, ErrorBody, StepReport
from rlpacer.operator import reports
from rlpacer.operator.kube import ApiError
from rlpacer.operator.metrics import CONTENT_TYPE, Metrics
from rlpacer.operator.runtime import ConflictLoop, JobGone, Jobs
from rlpacer.operator.timeutil import utcnow

log = logging.getLogger("rlpacer.operator.reports")

BASE = f"/{PROTOCOL_VERSION}/namespaces/{{namespace}}/rltrainingjobs/{{name}}"


class LeaderState:
    """Whether this replica may act (set by the Lease loop)."""

    def __init__(self, leader: bool = False) -> None:
        self.leader = leader


def _error(code: int, reason: str, message: str) -> web.Response:
    body = ErrorBody(code=code, reason=reason, message=message).to_wire()
    return web.json_response(body, status=code)


def _bearer(request: web.Request) -> str | None:
    h = request.headers.get("Authorization", "")
    if not h.startswith("Bearer "):
        return None
    return h[len("Bearer "):].strip() or None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def report_app(jobs: Jobs, leader: LeaderState, metrics: Metrics) -> web.Application:
    async def timed(request: web.Request, fn: Handler, route: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        resp = await fn(request)
        metrics.report_latency.labels(route, str(resp.status)).observe(time.perf_counter() - t0)
        return resp

    async def authorize(request: web.Request) -> Any:
        if not leader.leader:
            return _error(503, "NotLeader", "this operator replica is on standby; retry")
        ns, name = request.match_info["namespace"], request.match_info["name"]
        rt = await jobs.get(ns, name)
        if rt is None:
            return _error(404, "NotFound", f"rltrainingjob {ns}/{name} not found")
        presented = _bearer(request)
        if presented is None or not await jobs.check_token(rt, presented):
            return _error(401, "Unauthorized", "missing or wrong bearer token for this job")
        return rt

    async def get_plan(request: web.Request) -> web.StreamResponse:
        rt = await authorize(request)
        if isinstance(rt, web.Response):
            return rt
        if rt.spec is None:
            return _error(422, "InvalidSpec", rt.spec_error or "invalid spec")
        plan = reports.current_plan(rt.spec, rt.status,
                                    rt.peek_controller(rt.status.controller_state))
        return web.json_response(plan.to_wire())

    async def post_steps(request: web.Request) -> web.StreamResponse:
        rt = await authorize(request)
        if isinstance(rt, web.Response):
            return rt
        try:
            raw = await request.json()
            report = StepReport.model_validate(raw)
        except json.JSONDecodeError as e:
            return _error(422, "InvalidReport", f"body is not JSON: {e}")
        except ValidationError as e:
            reason = "ImpossibleLengths" if "lengths" in str(e) else "InvalidReport"
            return _error(422, reason, format_validation_error(e))
        now = utcnow()
        try:
            policies = await jobs.policies_for(rt.namespace)  # cached (TTL), never per report
            async with rt.lock:
                acc = await jobs.commit(
                    rt, lambda spec, st: reports.accept_report(
                        spec, st, report, now, rt.generation,
                        rt.take_controller(st.controller_state), policies),
                )
                rt.keep_controller(acc.controller)
        except reports.ReportRejected as e:
            return _error(422, e.reason, e.message)
        except JobGone:
            jobs.forget(rt.namespace, rt.name)
            return _error(404, "NotFound", f"rltrainingjob {rt.namespace}/{rt.name} not found")
        except ManifestError as e:
            return _error(422, "InvalidSpec", str(e))
        except (ConflictLoop, ApiError, OSError) as e:
            log.warning("report for %s/%s not persisted: %s", rt.namespace, rt.name, e)
            return _error(503, "Unavailable", f"state not persisted, retry: {e}")
        if acc.new:
            lab = (rt.namespace, rt.name)
            metrics.steps.labels(*lab).inc()
            metrics.step_duration.labels(*lab).observe(report.seconds.total)
            if acc.straggler:
                metrics.stragglers.labels(*lab).inc()
            if any(e.reason == "ScalingUp" for e in acc.events):
                metrics.long_rounds.labels(*lab).inc()
            if acc.events:
                rt.wake.set()  # a scale action: the reconciler applies the new replicas now
                _spawn(jobs.post_events(rt, acc.events))
        return web.json_response(acc.plan.to_wire())

    async def plan_route(request: web.Request) -> web.StreamResponse:
        return await timed(request, get_plan, "plan")

    async def steps_route(request: web.Request) -> web.StreamResponse:
        return await timed(request, post_steps, "steps")

    @web.middleware
    async def unavailable(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (ApiError, aiohttp.ClientError, OSError) as e:
            # The API server is unreachable or failing: nothing was persisted, retry.
            log.warning("step-report endpoint: API server unavailable: %s", e)
            return _error(503, "Unavailable", f"API server unavailable, retry: {e}")

    app = web.Application(middlewares=[unavailable])
    app.router.add_get(BASE + "/plan", plan_route)
    app.router.add_post(BASE + "/steps", steps_route)
    return app


_background: set[Any] = set()


def _spawn(coro: Awaitable[None]) -> None:
    import asyncio

    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


def metrics_app(metrics: Metrics, leader: LeaderState) -> web.Application:
    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        if leader.leader:
            return web.Response(text="leader")
        return web.Response(text="standby", status=503)

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start ``app``; returns the runner and the bound port (``port`` 0 picks one)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server: Any = site._server
    bound = port
    if server is not None and getattr(server, "sockets", None):
        bound = int(server.sockets[0].getsockname()[1])
    return runner, bound
