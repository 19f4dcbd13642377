"""Where the driver gets each step's plan: one interface, two transports.

* :class:`InProcessController` (``rlpacer run``): wraps :class:`rlpacer.control.plan.JobController`
  directly, the same plan logic the operator hosts. Its state goes into the trainer's
  checkpoints (locally nobody else persists it).
* :class:`HTTPController` (a pod): the operator's step-report protocol (DESIGN.md; models in
  :mod:`rlpacer.api.protocol`): ``GET .../plan``, ``POST .../steps`` with the job's bearer
  token. Network errors and 5xx are retried with the *same* (attempt, step) body (the
  endpoint is idempotent), ``retries`` times with exponential backoff; a 503 (the operator
  on standby, or its API server or etcd away: nothing persisted) no sooner than its
  ``Retry-After`` and for at least ``retry_window_s`` (5 minutes) whatever the count, and
  so is an endpoint that gives no answer at all (connection refused or cut, none within
  ``timeout_s``: the operator restarting; :func:`unreachable`); a 429 (over the job's
  request rate) after its ``Retry-After``; other 4xx are raised with the operator's message
  (409: the job was suspended, :class:`JobSuspended`; the driver exits). While a plan says
  ``ScalingUp`` the driver polls ``GET plan`` until Ready or TimedOut. An ``https://`` URL
  is verified with the CA in ``ca_file`` (the job's ConfigMap, re-read on every call so a
  renewed CA is picked up; unset: the system's CAs). A certificate that does not verify is
  retried like a network error (the operator may be mid-renewal and the ConfigMap a minute
  behind), then raised as :class:`ReportTLSError`, which says which CA file was used. A
  plan's fields this version does not know (a newer operator's additions) are ignored,
  logged once and counted (``unknown_plan_fields``).
"""

from __future__ import annotations

import errno
import http.client
import json
import logging
import socket
import ssl
import time
import urllib.error
import urllib.request
from typing import Any, Protocol

from rlpacer.api.protocol import (
    PLAN_FIELDS_HEADER,
    USABLE_REPLICAS,
    Plan,
    ReleaseRequest,
    RolloutCapacity,
    RolloutState,
    StepReport,
    plan_path,
    release_path,
    steps_path,
    unknown_fields,
)
from rlpacer.control.plan import (
    ControlPlan,
    JobController,
    JobControllerConfig,
    LengthStats,
    StepReportData,
    StepSecondsData,
)
from rlpacer_trainer import contract as c

log = logging.getLogger("rlpacer_trainer.controller")

#: Longest wait a 429's Retry-After can impose on one retry, seconds.
MAX_RETRY_AFTER_S = 60.0


def _retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header's delay in seconds (the delta-seconds form), or None."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


def unreachable(err: object) -> bool:
    """Whether a request's error means the step-report endpoint gave no answer at all (the
    operator restarting, a connection refused, reset or cut mid-answer, no answer within
    the timeout), not a wrong URL (a name that does not resolve) or certificate."""
    if isinstance(err, (ssl.SSLCertVerificationError, socket.gaierror)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError, http.client.HTTPException,
                        ssl.SSLEOFError)):
        return True
    return isinstance(err, OSError) and err.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)


def _reason(text: str) -> str:
    try:
        return str(json.loads(text).get("reason", "")) or text[:80]
    except (ValueError, AttributeError):
        return text[:80]


class ControllerClient(Protocol):
    def plan(self) -> Plan: ...
    def report(self, report: StepReport) -> Plan: ...
    def wait_ready(self, plan: Plan) -> Plan: ...
    def release(self, attempt: int, step: int) -> bool: ...


class ReportTLSError(RuntimeError):
    """The step-report endpoint's certificate did not verify with the CA the driver has."""


class ControllerError(RuntimeError):
    """The controller refused a report (4xx): a bug or a stale attempt, not a network blip."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"controller answered {status}: {body}")
        self.status = status
        self.body = body


class JobSuspended(ControllerError):
    """409 ``JobSuspended``: the job was suspended (``spec.suspend``) and the operator accepts
    no step report; it is deleting this attempt's pods. Not retried: the driver stops (a
    resume starts a new attempt from the last checkpoint)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(status, body)
        self.args = (f"the job is suspended (the operator answered {status} JobSuspended to"
                     " the step report): this attempt stops; resuming the job starts a new"
                     " attempt from the last checkpoint",)


def to_data(r: StepReport) -> StepReportData:
    ln, s = r.lengths, r.seconds
    return StepReportData(
        attempt=r.attempt, step=r.step, group_size=r.group_size, round_kind=r.round_kind,
        lengths=LengthStats(max=ln.max, median=ln.median, p90=ln.p90, count=ln.count,
                            aborted=ln.aborted, mean=ln.mean),
        seconds=StepSecondsData(rollout=s.rollout, reward=s.reward, train=s.train, sync=s.sync),
        long_queue=r.long_queue, next_round_kind=r.next_round_kind, reward=r.reward,
        next_straggler_risk=(None if r.next_straggler_risk is None else tuple(
            (x.group_size, x.probability) for x in r.next_straggler_risk)),
    )


class InProcessController:
    """The plan logic in this process. Capacity is whatever engines this process runs, so the
    rollout is always Ready (there is nothing to scale locally)."""

    def __init__(self, cfg: JobControllerConfig, total_steps: int, replicas: int = 1) -> None:
        self.jc = JobController(cfg)
        self.total_steps = total_steps
        self.replicas = replicas
        self.last_straggler: bool | None = None

    def _to_plan(self, cp: ControlPlan) -> Plan:
        return Plan(
            step=cp.step, group_size=cp.group_size, round_kind=cp.round_kind,
            rollout=RolloutCapacity(desired_replicas=self.replicas, ready_replicas=self.replicas,
                                    state=RolloutState.READY),
            lambda_=cp.lambda_, straggler_rate=cp.straggler_rate,
            done=cp.step >= self.total_steps,
        )

    def plan(self) -> Plan:
        return self._to_plan(self.jc.plan())

    def report(self, report: StepReport) -> Plan:
        cp = self.jc.observe(to_data(report))
        self.last_straggler = cp.straggler
        return self._to_plan(cp)

    def wait_ready(self, plan: Plan) -> Plan:
        return plan

    def release(self, attempt: int, step: int) -> bool:
        """No operator in-process: the capacity is whatever the engines are."""
        return False

    def posterior_means(self) -> dict[int, float]:
        return self.jc.posterior_means()

    def step_seconds(self) -> dict[int, float]:
        """SAGC's measured seconds of a step per group size (``groupControl.objective``)."""
        return self.jc.step_seconds()

    def step_prices(self) -> dict[int, float]:
        """What SAGC per second prices a step of each candidate size at now."""
        return self.jc.step_prices()

    def state_dict(self) -> dict[str, Any]:
        return self.jc.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.jc = JobController.from_state_dict(state)


class HTTPController:
    """The operator's step-report endpoint (see the module docstring)."""

    def __init__(self, base_url: str, namespace: str, name: str, token: str, *,
                 retries: int = 8, backoff_s: float = 0.5, poll_s: float = 2.0,
                 timeout_s: float = 30.0, ca_file: str | None = None,
                 retry_window_s: float = 300.0) -> None:
        self.base = base_url.rstrip("/")
        self.ca_file = ca_file
        self.tls = self.base.lower().startswith("https://")
        self.ns, self.name, self.token = namespace, name, token
        self.retries, self.backoff_s, self.poll_s, self.timeout_s = (
            retries, backoff_s, poll_s, timeout_s)
        #: 503s ("not persisted, retry") are retried at least this long, whatever the count.
        self.retry_window_s = retry_window_s
        self._no_release = False  # the operator answered 404/405 to a release once
        self.last_straggler: bool | None = None
        #: Plans read with fields this version does not know (ignored).
        self.unknown_plan_fields = 0
        self._unknown_logged: tuple[str, ...] = ()

    def _read_plan(self, raw: dict[str, Any]) -> Plan:
        plan = Plan.model_validate(raw)
        extra = tuple(unknown_fields(Plan, raw))
        if extra:
            self.unknown_plan_fields += 1
            if extra != self._unknown_logged:
                self._unknown_logged = extra
                log.warning("the operator's plan has fields this trainer does not know,"
                            " ignored (a newer operator?): %s", ", ".join(extra))
        return plan

    def _context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        try:
            return ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ReportTLSError(
                f"cannot load the step-report CA {self.ca_file} ({e}): the job's ConfigMap"
                " carries it as report-ca.crt when the operator serves TLS") from None

    def _tls_error(self, err: BaseException) -> ReportTLSError:
        ca = (f"the CA in {self.ca_file} ({c.ENV_REPORT_CA_FILE})" if self.ca_file
              else f"the system's CAs ({c.ENV_REPORT_CA_FILE} is unset)")
        return ReportTLSError(
            f"the step-report endpoint {self.base} presented a certificate that does not verify"
            f" with {ca}: {err}. The operator's CA is in the job's ConfigMap (key"
            " report-ca.crt); a driver of another release or an operator with a new"
            " certificate is the usual cause")

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, *,
              retries: int | None = None, retry_window_s: float | None = None
              ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        delay = self.backoff_s
        start = time.monotonic()
        attempt = 0
        max_tries = self.retries if retries is None else retries
        window = self.retry_window_s if retry_window_s is None else retry_window_s
        while True:
            ctx = self._context()
            req = urllib.request.Request(self.base + path, data=data, method=method)
            req.add_header("Authorization", f"Bearer {self.token}")
            req.add_header(PLAN_FIELDS_HEADER, USABLE_REPLICAS)  # optional fields we read
            if data is not None:
                req.add_header("Content-Type", "application/json")
            last = attempt >= max_tries
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s, context=ctx) as resp:
                    return json.loads(resp.read().decode() or "{}")  # type: ignore[no-any-return]
            except urllib.error.HTTPError as err:
                text = err.read().decode(errors="replace")
                if err.code == 409:  # the job is suspended: stop, a resume restarts it
                    raise JobSuspended(err.code, text) from None
                if err.code < 500 and err.code != 429:
                    raise ControllerError(err.code, text) from None
                # A 503 says "not persisted, retry" (standby, API server or etcd away): it is
                # retried for at least retry_window_s, so an outage of the control plane
                # longer than the retry count's backoff does not fail the job.
                if last and not (err.code == 503 and time.monotonic() - start < window):
                    raise ControllerError(err.code, text) from None
                wait = _retry_after(err.headers.get("Retry-After"))
                if err.code == 429:  # over the job's request rate: wait as told
                    time.sleep(min(wait if wait is not None else delay, MAX_RETRY_AFTER_S))
                    attempt += 1
                    continue
                if err.code == 503:
                    log.info("step-report endpoint: %d, retrying the same report (%s)",
                             err.code, _reason(text))
                    delay = max(delay, min(wait or 0.0, MAX_RETRY_AFTER_S))
            except (urllib.error.URLError, ConnectionError, TimeoutError,
                    http.client.HTTPException) as err:
                reason = getattr(err, "reason", err)
                if isinstance(reason, ssl.SSLCertVerificationError):
                    if last:
                        raise self._tls_error(reason) from None
                    log.warning("step-report endpoint: certificate does not verify (attempt"
                                " %d of %d): %s", attempt + 1, max_tries + 1, reason)
                elif unreachable(reason):
                    # The operator not answering (restarting after it lost its Lease, or its
                    # connection cut): like a 503, retried within retry_window_s whatever the
                    # count, so a restart during a control-plane outage fails no job.
                    if last and time.monotonic() - start >= window:
                        raise
                    log.info("step-report endpoint: no answer, retrying the same report (%s)",
                             f"{type(reason).__name__}: {reason}"[:200])
                elif last:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
            attempt += 1

    def plan(self) -> Plan:
        return self._read_plan(self._call("GET", plan_path(self.ns, self.name)))

    def report(self, report: StepReport) -> Plan:
        return self._read_plan(
            self._call("POST", steps_path(self.ns, self.name), report.to_wire()))

    def release(self, attempt: int, step: int) -> bool:
        """``POST release``: the long round of ``step`` gives its added replicas back now
        (``tailBatching.longRound.releaseWhenFits``). Best effort, tried twice at most: False
        when the operator did not take it (one without the endpoint answers 404 or 405; the
        step's report releases them then, as before)."""
        if self._no_release:
            return False
        try:
            self._call("POST", release_path(self.ns, self.name),
                       ReleaseRequest(attempt=attempt, step=step).to_wire(), retries=1,
                       retry_window_s=0.0)
        except ControllerError as err:
            if err.status in (404, 405):
                self._no_release = True
                log.info("the operator has no release endpoint (an older operator): the"
                         " long round's replicas go at the step's report")
            else:
                log.warning("release of step %d's added replicas refused: %s", step, err)
            return False
        except Exception as err:  # unreachable, 5xx past its one retry: the report will
            log.warning("release of step %d's added replicas not sent: %s", step, err)
            return False
        return True

    def wait_ready(self, plan: Plan) -> Plan:
        while plan.rollout.state is RolloutState.SCALING_UP:
            time.sleep(self.poll_s)
            plan = self.plan()
        return plan
