"""HTTP servers in the operator process (aiohttp, same event loop as Kopf).

* Step reports (DESIGN.md "Step-report protocol"), on ``report_port``, over TLS (the
  certificate of ``report_cert_dir``, or one generated at start: ``main.report_cert``; plain
  HTTP only with ``report_insecure_http``):
  ``GET  /v1/namespaces/{ns}/rltrainingjobs/{name}/plan`` and
  ``POST /v1/namespaces/{ns}/rltrainingjobs/{name}/steps`` (``Authorization: Bearer``), and
  ``POST .../release`` (a long round's added replicas given back before its report).
  A POST is answered only after the new controller state is persisted in the job's status.
  Errors carry an :class:`~rlpacer.api.protocol.ErrorBody`: 401 bad/missing token (a token is
  valid for its own job only), 404 unknown job, 413 a body over :data:`MAX_REPORT_BYTES`,
  422 malformed or impossible report (reason from the control layer), 503 with
  ``Retry-After`` while this replica is not the leader or the API server (or its etcd) is
  unavailable, failing or silent (a request whose state it has not returned or confirmed
  within ``report_write_timeout_seconds``: :func:`within`; the driver retries the same body;
  reports are idempotent), 429
  ``TooManyRequests`` with ``Retry-After`` over the job's request rate (:class:`TokenBucket`,
  ``report_rate_per_second``/``report_burst``), 409 ``JobSuspended`` to a report while the
  job is suspended (the driver stops; nothing changed), 503 ``ControllerStateUnreadable`` /
  ``ControllerStateMissing`` while the job's controller state, broken by someone else's
  write, is rebuilt (the reconciler does it at once). Every answer of this app is JSON: a wrong
  method (405), an unknown path or a path whose namespace or name cannot be a job's (404,
  without asking the API server) get an ErrorBody too. Fields of a report
  this version does not know are ignored, logged and counted (protocol versions).
  Every answer is counted by route and code, every error also by reason
  (``rlpacer_step_report_errors_total``); an unexpected exception is logged with its
  traceback and answered 500 with an ErrorBody, never with a traceback.
* ``/metrics``, ``/healthz`` and ``/readyz`` on ``metrics_port``. ``/readyz`` is 200 only on
  the leader, so a Service in front of several replicas routes reports to the active one.

GET plan is authenticated too (it reveals the job's controller decisions only to its trainer).

Slow or stuck clients are bounded (:func:`start_site`): a connection must finish its TLS
handshake, and then send a request's headers, within ``http_header_timeout_seconds`` each (and
the next request's within that long of the last answer), or it is closed; a report's body must
arrive within ``report_body_timeout_seconds`` (else 408). An answer given before the body was
read to its end (413, 408, 401, ...) drains the rest for at most :data:`LINGER_SECONDS`; after
413 and 408 the connection is closed (``Connection: close``), never kept for another request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from rlpacer.api.job import ManifestError, format_validation_error
from rlpacer.api.protocol import (
    PLAN_FIELDS_HEADER,
    PROTOCOL_VERSION,
    ErrorBody,
    ReleaseRequest,
    StepReport,
    plan_for_client,
    unknown_fields,
)
from rlpacer.operator import reports
from rlpacer.operator.kube import ApiError
from rlpacer.operator.metrics import CONTENT_TYPE, Metrics
from rlpacer.operator.runtime import ConflictLoop, JobGone, Jobs
from rlpacer.operator.timeutil import utcnow

log = logging.getLogger("rlpacer.operator.reports")
T = TypeVar("T")

BASE = f"/{PROTOCOL_VERSION}/namespaces/{{namespace}}/rltrainingjobs/{{name}}"

#: Largest step-report body accepted (413 beyond). A report is a few hundred bytes.
MAX_REPORT_BYTES = 64 * 1024
#: Default seconds a client has for its TLS handshake, then for a request's headers
#: (``OperatorSettings.http_header_timeout_seconds``).
HEADER_TIMEOUT_S = 10.0
#: Seconds the server keeps reading (and dropping) a request body it answered before reading
#: it all, so the client sees the answer rather than a reset; then the connection is closed.
LINGER_SECONDS = 1.0
#: JSON integers must fit the API server's int64 (a report's counts end up in the status).
INT64_MAX = 2**63 - 1


#: A namespace or a job name: a DNS label (jobs: a CRD rule). Anything else is no job: 404
#: without a request to the API server (a name like "job?x=1" or ".." would otherwise be
#: spliced into the API server's URL).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class TokenBucket:
    """``rate`` requests per second on average, ``burst`` at once."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.at = float(burst), now

    def take(self, now: float) -> float:
        """0.0 when a request may go now (and counts it); else seconds until one may."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class BadBody(ValueError):
    """A request body that is not a JSON document this endpoint can read (422)."""


def _parse_int(text: str) -> int:
    # Checked on the literal before int(): Python refuses literals over 4300 digits with a
    # ValueError of its own, and anything over 19 digits is outside int64 anyway.
    digits = text.lstrip("-")
    if len(digits) > 19 or abs(int(text)) > INT64_MAX:
        shown = text if len(text) <= 24 else f"{text[:20]}... ({len(digits)} digits)"
        raise BadBody(f"integer {shown} is out of range (at most {INT64_MAX})")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadBody(f"number {text[:32]} is out of range (not a finite double)")
    return value


def _parse_constant(text: str) -> float:
    raise BadBody(f"{text} is not a JSON number")


def parse_body(data: bytes) -> Any:
    """The JSON document in ``data``; raises :class:`BadBody` with what is wrong (not UTF-8,
    not JSON, NaN/Infinity, numbers out of the double or int64 range)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadBody(f"body is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_parse_constant)
    except BadBody:
        raise
    except (json.JSONDecodeError, RecursionError) as e:
        raise BadBody(f"body is not JSON: {str(e)[:200]}") from None


class LeaderState:
    """Whether this replica may act (set by the Lease loop)."""

    def __init__(self, leader: bool = False) -> None:
        self.leader = leader


#: ``Retry-After`` of every 503, seconds: nothing was persisted and the condition (standby,
#: API server or etcd unreachable, a conflict loop) is usually over within seconds.
RETRY_AFTER_UNAVAILABLE_S = 1


def _error(code: int, reason: str, message: str) -> web.Response:
    body = ErrorBody(code=code, reason=reason, message=message).to_wire()
    resp = web.json_response(body, status=code)
    resp[_REASON] = reason
    if code == 503:
        resp.headers["Retry-After"] = str(RETRY_AFTER_UNAVAILABLE_S)
    return resp


def _state_unreadable(rt: Any, err: reports.StateUnreadable) -> web.Response:
    """503 (nothing persisted, retry) while the job's loop, woken now, rebuilds the state."""
    rt.wake.set()
    return _error(503, err.reason.value, f"{err.message}; the operator is rebuilding it from"
                  " the job's spec and status: retry")


#: The ErrorBody's reason, kept on the response for the error counter.
_REASON = web.ResponseKey("rlpacer.reason", str)


def _bearer(request: web.Request) -> str | None:
    h = request.headers.get("Authorization", "")
    if not h.startswith("Bearer "):
        return None
    return h[len("Bearer "):].strip() or None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BodyTimeout(Exception):
    """A request body that did not arrive in time (408)."""


class ApiTimeout(Exception):
    """The API server did not answer what a request needs within
    ``report_write_timeout_seconds`` (it, or its etcd, stalled): 503 with Retry-After."""


async def within(aw: Awaitable[T], seconds: float, what: str) -> T:
    """``aw``'s result, or :class:`ApiTimeout` after ``seconds`` (``aw`` is cancelled: a status
    write cut off may still land; the report is idempotent, so its retry is then a repeat)."""
    try:
        async with asyncio.timeout(seconds):
            return await aw
    except TimeoutError:
        raise ApiTimeout(f"the API server did not {what} within {seconds:g} s (it or its"
                         " etcd may be stalled): nothing is known persisted; retry the same"
                         " report") from None


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The request's body, read within ``timeout`` seconds (else :class:`BodyTimeout`); over
    the app's ``client_max_size`` aiohttp raises its 413."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout:g} s") from None


def report_app(jobs: Jobs, leader: LeaderState, metrics: Metrics) -> web.Application:
    async def timed(request: web.Request, fn: Handler, route: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        resp: web.StreamResponse
        try:
            resp = await fn(request)
        except web.HTTPException as e:  # e.g. aiohttp's 413 for a body over client_max_size
            reason = "TooLarge" if e.status == 413 else "BadRequest"
            msg = (f"body over {MAX_REPORT_BYTES} bytes" if e.status == 413
                   else (e.text or e.reason))
            resp = _error(e.status, reason, msg)
            if e.status == 413:
                resp.force_close()  # the rest of the body is no request: never read it as one
        except BodyTimeout as e:
            resp = _error(408, "RequestTimeout", str(e))
            resp.force_close()
        except ApiTimeout as e:
            log.warning("step-report endpoint: %s", e)
            resp = _error(503, "Unavailable", str(e))
        except (ApiError, aiohttp.ClientError, OSError) as e:
            # The API server is unreachable or failing: nothing was persisted, retry.
            log.warning("step-report endpoint: API server unavailable: %s", e)
            resp = _error(503, "Unavailable", f"API server unavailable, retry: {e}")
        except Exception:
            log.exception("step-report endpoint: %s %s failed", request.method, request.path)
            resp = _error(500, "InternalError", "the operator failed to handle this request;"
                          " see its log")
        code = str(resp.status)
        metrics.report_latency.labels(route, code).observe(time.perf_counter() - t0)
        if resp.status >= 400:
            metrics.report_errors.labels(route, code, resp.get(_REASON, "")).inc()
        return resp

    async def authorize(request: web.Request) -> Any:
        if not leader.leader:
            return _error(503, "NotLeader", "this operator replica is on standby; retry")
        ns, name = request.match_info["namespace"], request.match_info["name"]
        if not (_DNS_LABEL.fullmatch(ns) and _DNS_LABEL.fullmatch(name)):
            return _error(404, "NotFound", f"no rltrainingjob is named {ns[:80]!r}/{name[:80]!r}"
                          " (namespace and name are DNS labels)")
        rt = await jobs.get(ns, name)
        if rt is None:
            return _error(404, "NotFound", f"rltrainingjob {ns}/{name} not found")
        presented = _bearer(request)
        if presented is not None and not presented.isascii():
            return _error(401, "Unauthorized", "the bearer token is not ASCII (a job's token"
                          " is URL-safe base64)")
        if presented is None or not await jobs.check_token(rt, presented):
            return _error(401, "Unauthorized", "missing or wrong bearer token for this job")
        # Counted after the token check: a stranger cannot spend a job's budget.
        rate = jobs.settings.report_rate_per_second
        if rate > 0:
            now = time.monotonic()
            if rt.bucket is None:
                rt.bucket = TokenBucket(rate, jobs.settings.report_burst, now)
            wait = rt.bucket.take(now)
            if wait > 0:
                metrics.report_throttled.labels(rt.namespace, rt.name).inc()
                resp = _error(429, "TooManyRequests",
                              f"over {rate:g} requests/s (burst {jobs.settings.report_burst})"
                              f" for rltrainingjob {ns}/{name}; retry after {wait:.2f}s")
                resp.headers["Retry-After"] = str(max(1, math.ceil(wait)))
                return resp
        return rt

    async def get_plan(request: web.Request) -> web.StreamResponse:
        rt = await within(authorize(request), jobs.settings.report_write_timeout_seconds,
                          "return the job")
        if isinstance(rt, web.Response):
            return rt
        if rt.spec is None:
            return _error(422, "InvalidSpec", rt.spec_error or "invalid spec")
        try:
            plan = reports.current_plan(rt.spec, rt.status,
                                        rt.peek_controller(rt.status.controller_state))
        except reports.StateUnreadable as e:
            return _state_unreadable(rt, e)
        return web.json_response(
            plan_for_client(plan, request.headers.get(PLAN_FIELDS_HEADER)))

    async def committed(rt: Any, persist: Callable[[], Awaitable[reports.Accepted]],
                        what: str) -> reports.Accepted | web.Response:
        """``persist()`` (a report's or a release's commit) within the write timeout, or the
        answer its failure gets, the same for both: bounded, the lock's wait included (a
        pass's write may hold it), so an answer, 503 at worst, comes well before this replica
        would give up a Lease it cannot renew and close the connection unanswered."""
        try:
            return await within(persist(), jobs.settings.report_write_timeout_seconds,
                                "confirm the new state")
        except reports.ReportRejected as e:
            return _error(422, e.reason, e.message)
        except reports.JobSuspended as e:
            return _error(409, e.reason, e.message)
        except reports.StateUnreadable as e:
            return _state_unreadable(rt, e)
        except JobGone:
            jobs.forget(rt.namespace, rt.name)
            return _error(404, "NotFound", f"rltrainingjob {rt.namespace}/{rt.name} not found")
        except ManifestError as e:  # the spec turned invalid since it was read
            return _error(422, "InvalidSpec", str(e))
        except ApiError as e:
            if e.status in (400, 422):
                # The API server refused the new status itself (invalid, not unavailable):
                # it would refuse it again on every retry.
                log.warning("%s for %s/%s refused by the API server: %s", what, rt.namespace,
                            rt.name, e)
                return _error(422, "StatusRejected",
                              f"the API server refused the status this {what} makes: {e}")
            log.warning("%s for %s/%s not persisted: %s", what, rt.namespace, rt.name, e)
            return _error(503, "Unavailable", f"state not persisted, retry: {e}")
        except (ConflictLoop, OSError) as e:
            log.warning("%s for %s/%s not persisted: %s", what, rt.namespace, rt.name, e)
            return _error(503, "Unavailable", f"state not persisted, retry: {e}")

    async def post_steps(request: web.Request) -> web.StreamResponse:
        rt = await within(authorize(request), jobs.settings.report_write_timeout_seconds,
                          "return the job")
        if isinstance(rt, web.Response):
            return rt
        try:
            raw = parse_body(await read_body(request, jobs.settings.report_body_timeout_seconds))
            report = StepReport.model_validate(raw)
            extra = unknown_fields(StepReport, raw)
        except BadBody as e:
            return _error(422, "InvalidReport", str(e))
        except ValidationError as e:
            reason = "ImpossibleLengths" if "lengths" in str(e) else "InvalidReport"
            return _error(422, reason, format_validation_error(e))
        if extra:
            metrics.report_unknown_fields.labels("steps").inc()
            if tuple(extra) != rt.unknown_logged:
                rt.unknown_logged = tuple(extra)
                log.info("report for %s/%s has fields this operator does not know, ignored"
                         " (a newer trainer?): %s", rt.namespace, rt.name, ", ".join(extra))
        now = utcnow()

        async def persist() -> reports.Accepted:
            policies = await jobs.policies_for(rt.namespace)  # cached (TTL), never per report
            async with rt.lock:
                acc = await jobs.commit(
                    rt, lambda spec, st: reports.accept_report(
                        spec, st, report, now, rt.generation,
                        rt.take_controller(st.controller_state), policies),
                )
                rt.keep_controller(acc.controller)
                return acc

        acc = await committed(rt, persist, "report")
        if isinstance(acc, web.Response):
            return acc
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
        return web.json_response(
            plan_for_client(acc.plan, request.headers.get(PLAN_FIELDS_HEADER)))

    async def post_release(request: web.Request) -> web.StreamResponse:
        rt = await within(authorize(request), jobs.settings.report_write_timeout_seconds,
                          "return the job")
        if isinstance(rt, web.Response):
            return rt
        if rt.spec is None:
            return _error(422, "InvalidSpec", rt.spec_error or "invalid spec")
        try:
            raw = parse_body(await read_body(request, jobs.settings.report_body_timeout_seconds))
            req = ReleaseRequest.model_validate(raw)
        except BadBody as e:
            return _error(422, "InvalidRelease", str(e))
        except ValidationError as e:
            return _error(422, "InvalidRelease", format_validation_error(e))
        now = utcnow()

        async def persist() -> reports.Accepted:
            async with rt.lock:
                return await jobs.commit(rt, lambda spec, st: reports.accept_release(
                    spec, st, req, now, rt.peek_controller(st.controller_state)))

        acc = await committed(rt, persist, "release")
        if isinstance(acc, web.Response):
            return acc
        if acc.events:
            rt.wake.set()  # the reconciler applies the smaller rollout now
            _spawn(jobs.post_events(rt, acc.events))
        return web.json_response(
            plan_for_client(acc.plan, request.headers.get(PLAN_FIELDS_HEADER)))

    async def release_route(request: web.Request) -> web.StreamResponse:
        return await timed(request, post_release, "release")

    async def plan_route(request: web.Request) -> web.StreamResponse:
        return await timed(request, get_plan, "plan")

    async def steps_route(request: web.Request) -> web.StreamResponse:
        return await timed(request, post_steps, "steps")

    @web.middleware
    async def unavailable(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            # the router's 404 (unknown path) and 405 (wrong method): JSON like every answer
            if e.status < 400:
                raise
            reason = {404: "NotFound", 405: "MethodNotAllowed"}.get(e.status, "BadRequest")
            resp = _error(e.status, reason, f"{request.method} {request.path[:200]}: {e.reason}"
                          + (f" (allowed: {e.headers['Allow']})" if "Allow" in e.headers
                             else ""))
            if "Allow" in e.headers:
                resp.headers["Allow"] = e.headers["Allow"]
            return resp
        except (ApiError, aiohttp.ClientError, OSError) as e:
            # The API server is unreachable or failing: nothing was persisted, retry.
            log.warning("step-report endpoint: API server unavailable: %s", e)
            return _error(503, "Unavailable", f"API server unavailable, retry: {e}")

    app = web.Application(middlewares=[unavailable], client_max_size=MAX_REPORT_BYTES)
    app.router.add_get(BASE + "/plan", plan_route)
    app.router.add_post(BASE + "/steps", steps_route)
    app.router.add_post(BASE + "/release", release_route)
    return app


_background: set[Any] = set()


def _spawn(coro: Awaitable[None]) -> None:
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


class _Site(web.TCPSite):
    """aiohttp's TCPSite with a bound on the TLS handshake (TCPSite leaves asyncio's 60 s, so
    a client that connects and says nothing would hold its connection that long)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *,
                 ssl_context: ssl.SSLContext | None, handshake_timeout: float) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self._handshake_timeout = handshake_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            ssl_handshake_timeout=self._handshake_timeout if self._ssl_context else None)


async def start_site(app: web.Application, host: str, port: int,
                     ssl_context: ssl.SSLContext | None = None, *,
                     header_timeout: float = HEADER_TIMEOUT_S) -> tuple[web.AppRunner, int]:
    """Start ``app`` (over TLS with ``ssl_context``); returns the runner and the bound port
    (``port`` 0 picks one).

    ``header_timeout`` bounds, each, the TLS handshake and the wait for a request's headers
    (aiohttp's ``keepalive_timeout``: in the aiohttp the images pin, its timer runs from the
    connection's start, so it also closes a connection that sends no request, or half of
    one, and from each answer on a kept-alive connection)."""
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=header_timeout,
                           lingering_time=LINGER_SECONDS)
    await runner.setup()
    site = _Site(runner, host, port, ssl_context=ssl_context, handshake_timeout=header_timeout)
    await site.start()
    server: Any = site._server
    bound = port
    if server is not None and getattr(server, "sockets", None):
        bound = int(server.sockets[0].getsockname()[1])
    return runner, bound
