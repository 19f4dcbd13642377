"""The control plane going away mid-job: kube-apiserver stopped for 20 s and started again
(etcd's data kept), then etcd alone the same way, while a driver keeps reporting steps.

Shown: the step-report endpoint answers 200 or 503 with ``Retry-After`` the whole time (or is
briefly not listening while the operator restarts after losing its Lease, as its Deployment
restarts it), never 500; the trainer's own client retries each report with the same body and
gets every one answered once persisted; the stored controller state equals the library's
replay of the reports, each counted once; the job then succeeds, its children and metric
series go with it. Runs on a cluster of its own (the session's is never stopped).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_operator import (
    OperatorProc,
    _series,
    _sts,
    apply,
    get,
    report,
    report_certs,
    small_job,
    status,
    token,
    wait,
)

from rlpacer.api.job import parse_spec
from rlpacer.api.protocol import StepReport, plan_path, steps_path
from rlpacer.control.plan import JobController
from rlpacer.operator import hosting, names
from rlpacer.testing.cluster import LocalCluster
from rlpacer_trainer.controller_client import HTTPController

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
OUTAGE_S = 20.0
STEPS = 40


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[LocalCluster]:
    with LocalCluster() as c:
        c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
        c.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                  "crd/rltrainingjobs.rlpacer.io")
        c.create_namespace("outage")
        yield c


class Supervised:
    """The operator under a restart-on-exit loop, as its Deployment's kubelet runs it."""

    def __init__(self, op: OperatorProc) -> None:
        self.op = op
        self.exits: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Supervised:
        self.op.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            p = self.op.proc
            if p is not None and p.poll() is not None and not self._stop.is_set():
                self.exits.append((time.monotonic(), p.returncode))
                self.op.start()
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.op.kill(signal.SIGTERM)


class Prober:
    """Reads the job's plan every 0.2 s and records each answer (code, Retry-After)."""

    def __init__(self, url: str, tok: str, ctx: ssl.SSLContext) -> None:
        self.url, self.tok, self.ctx = url, tok, ctx
        self.answers: list[tuple[float, int | str, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            req = urllib.request.Request(self.url)
            req.add_header("Authorization", f"Bearer {self.tok}")
            t = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=40, context=self.ctx) as r:
                    self.answers.append((t, r.status, None))
            except urllib.error.HTTPError as e:
                self.answers.append((t, e.code, e.headers.get("Retry-After")))
            except (urllib.error.URLError, OSError) as e:
                self.answers.append((t, f"no answer: {getattr(e, 'reason', e)}", None))

    def between(self, t0: float, t1: float) -> list[int | str]:
        return [code for t, code, _ in self.answers if t0 <= t <= t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(45)


class Retries(logging.Handler):
    """The trainer client's log of each 503 it retried (the same report again)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "retrying the same report" in msg:
            self.reasons.append(msg.rsplit("(", 1)[-1].rstrip(")"))


def test_api_server_then_etcd_stopped_20s_mid_job_loses_and_doubles_nothing(
        own_cluster: LocalCluster) -> None:
    c, ns, name = own_cluster, "outage", "steady"
    obj = small_job(name, ns, steps=STEPS)
    op = Supervised(OperatorProc(c, ns)).start()
    op.op.wait_ready()
    apply(c, obj)
    tok = token(c, ns, name)
    ctx = ssl.create_default_context(cafile=str(report_certs() / "ca.crt"))
    ctl = HTTPController(op.op.base, ns, name, tok, ca_file=str(report_certs() / "ca.crt"),
                         backoff_s=0.2, timeout_s=60)
    prober = Prober(op.op.base + plan_path(ns, name), tok, ctx).start()
    retries = Retries()
    client_log = logging.getLogger("rlpacer_trainer.controller")
    client_log.addHandler(retries)
    client_log.setLevel(logging.INFO)
    lib = JobController(hosting.controller_config(parse_spec(obj["spec"])))
    accepted: list[tuple[int, float]] = []  # (step, seconds the report took)
    failures: list[BaseException] = []
    progress = threading.Condition()

    def drive() -> None:
        try:
            g = ctl.plan().group_size
            for step in range(STEPS):
                body = report(step, g, 800.0 if step % 4 == 0 else 150.0)
                t = time.monotonic()
                plan = ctl.report(StepReport.model_validate(body))
                want = lib.observe(hosting.to_data(StepReport.model_validate(body)))
                assert (plan.group_size, plan.lambda_) == (want.group_size, want.lambda_)
                g = plan.group_size
                with progress:
                    accepted.append((step, time.monotonic() - t))
                    progress.notify_all()
                time.sleep(0.3)
        except BaseException as e:  # re-raised by the test below
            failures.append(e)
            with progress:
                progress.notify_all()

    def reach(n: int, timeout: float) -> None:
        with progress:
            assert progress.wait_for(lambda: len(accepted) >= n or failures, timeout), (
                f"{len(accepted)} reports answered, waiting for {n}")
        assert not failures, failures

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    windows: dict[str, tuple[float, float]] = {}
    try:
        for component, at in (("apiserver", 5), ("etcd", 18)):
            reach(at, 120)
            t_stop = time.monotonic()
            c.stop_component(component)
            t0 = time.monotonic()
            time.sleep(OUTAGE_S)
            c.start_component(component)
            t1 = time.monotonic()
            windows[component] = (t0, t1)
            # reports go on after the outage
            reach(len(accepted) + 3, 90)
            print(f"{component}: stopping took {t0 - t_stop:.1f}s, down {t1 - t0:.1f}s (start"
                  f" until ready included); {len(accepted)} reports answered"
                  f" {time.monotonic() - t1:.1f}s after it was back")
        driver.join(180)
        assert not failures, failures
        assert [s for s, _ in accepted] == list(range(STEPS))
        prober.stop()

        # every answer was 200 or 503 with Retry-After (or none while restarting), never 500
        codes = [code for _, code, _ in prober.answers]
        odd = [(code, ra) for _, code, ra in prober.answers if code not in (200, 503)]
        # the longest stretch with no answer: the operator restarting after its Lease lapsed
        gaps, run = [], 0.0
        for (t, code, _), (t2, _, _) in zip(prober.answers, prober.answers[1:], strict=False):
            run = run + (t2 - t) if isinstance(code, str) else 0.0
            gaps.append(run)
        assert all(isinstance(code, str) for code, _ in odd), odd
        assert max(gaps) < 10, f"the endpoint did not answer for {max(gaps):.1f}s"
        assert all(ra == "1" for _, code, ra in prober.answers if code == 503)
        for component, (t0, t1) in windows.items():
            during = prober.between(t0 + 8, t1)
            assert 503 in during, (component, during)  # "retry", not silence or 500
        # the driver was told "retry" and sent the same report again (the client logs each)
        assert retries.reasons, "the driver never retried a 503 during the outages"
        # each report counted once: the stored state is the library's replay, bit-exact
        st = status(c, ns, name)
        assert st["step"] == STEPS
        assert st["controllerState"] == hosting.dumps(lib.state_dict())
        # the operator only ever exited for its Lease (status 1), and was restarted
        assert all(code == 1 for _, code in op.exits), op.exits
        slowest = max(s for _, s in accepted)
        print(f"{len(prober.answers)} probes: {codes.count(200)} x 200, {codes.count(503)} x"
              f" 503, {sum(isinstance(x, str) for x in codes)} unanswered; driver retried"
              f" {len(retries.reasons)} x 503 ({', '.join(sorted(set(retries.reasons)))});"
              f" operator exits {[code for _, code in op.exits]}; longest silence {max(gaps):.1f}s;"
              f" slowest report {slowest:.1f}s")

        # the job ends as usual, and its children and metric series go with it
        c.mark_pod_exit(ns, names.driver_pod(name, 0), 0)
        wait(c, lambda: status(c, ns, name).get("summary") == "Succeeded", "Succeeded", 90)
        assert _series(op.op, ns, name)
        c.kubectl("delete", "rltrainingjob", name, "-n", ns, "--wait=true", "--timeout=60s")
        wait(c, lambda: not _sts(c, ns, name) and get(
            c, f"/api/v1/namespaces/{ns}/configmaps/{names.config_map(name)}") is None,
            "children deleted", 60)
        wait(c, lambda: not _series(op.op, ns, name), "metric series removed", 30)
        log = op.op.log.read_text()
        assert "Traceback" not in log, log[-4000:]
    finally:
        client_log.removeHandler(retries)
        prober.stop()
        op.stop()


def test_a_stalled_api_server_gets_a_report_its_503_in_bounded_time_and_a_restart_its_lease(
        own_cluster: LocalCluster) -> None:
    """kube-apiserver frozen (SIGSTOP: its connections stay open, nothing answers) for 8 s,
    shorter than the operator's Lease (15 s, so it keeps acting): a report whose status write
    hangs is answered 503 with Retry-After within report_write_timeout_seconds (3 s here),
    not held until the Lease is given up and closed unanswered; its retry after the API
    server is back is counted once. Then the operator is killed and started again with the
    same identity (the chart's: the pod's name): it takes its own Lease back at once, not
    after the Lease's duration (issue 32, defect 3)."""
    c, ns, name = own_cluster, "outage", "stall"
    op = OperatorProc(c, ns, lease="stall-lease", identity="op-stall", extra_args=(
        "--lease-duration-seconds", "15", "--lease-renew-seconds", "2",
        "--report-write-timeout-seconds", "3")).start()
    pid = c.pids()["apiserver"]
    try:
        op.wait_ready()
        obj = small_job(name, ns, steps=10)
        apply(c, obj)
        tok = token(c, ns, name)
        ca = str(report_certs() / "ca.crt")
        ctl = HTTPController(op.base, ns, name, tok, ca_file=ca, backoff_s=0.2, timeout_s=60)
        lib = JobController(hosting.controller_config(parse_spec(obj["spec"])))
        g = ctl.plan().group_size
        for step in range(2):
            body = report(step, g, 150.0)
            assert ctl.report(StepReport.model_validate(body)).step == step + 1
            g = lib.observe(hosting.to_data(StepReport.model_validate(body))).group_size
        body = report(2, g, 150.0)
        ctx = ssl.create_default_context(cafile=ca)
        req = urllib.request.Request(op.base + steps_path(ns, name), method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {tok}",
                                              "Content-Type": "application/json"})
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            t0 = time.monotonic()
            with pytest.raises(urllib.error.HTTPError) as ei:
                urllib.request.urlopen(req, timeout=30, context=ctx)
            took = time.monotonic() - t0
            err = json.loads(ei.value.read())
            assert ei.value.code == 503 and ei.value.headers.get("Retry-After") == "1", err
            assert err["reason"] == "Unavailable" and "within 3 s" in err["message"], err
            assert 2.5 <= took < 6.0, took
            time.sleep(max(0.0, 8.0 - (time.monotonic() - t_stop)))
        finally:
            os.kill(pid, signal.SIGCONT)
        # the same report again once the API server answers: persisted, counted once
        plan = ctl.report(StepReport.model_validate(body))
        lib.observe(hosting.to_data(StepReport.model_validate(body)))
        assert plan.step == 3 and status(c, ns, name)["controllerState"] == hosting.dumps(
            lib.state_dict())
        assert op.proc is not None and op.proc.poll() is None, op.log.read_text()[-3000:]
        print(f"report answered 503 after {took:.1f}s of an {time.monotonic() - t_stop:.0f}s"
              " API-server stall")
        # SIGKILL, then the same identity again: its own Lease, taken back at once
        op.kill(signal.SIGKILL)
        t0 = time.monotonic()
        op.start()
        op.wait_ready()
        back = time.monotonic() - t0
        assert back < 10.0, back  # the Lease's 15 s not waited out
        assert ctl.plan().step == 3
        print(f"operator killed and started again with its identity: leading after {back:.1f}s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        op.kill(signal.SIGTERM)
