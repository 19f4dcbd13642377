"""A real Prometheus (the pinned build) scraping a running operator: every dashboard query
returns data for a job that steps, runs a long round and breaks its policy's step-time SLO, and
every rule of the chart's PrometheusRule evaluates without error on the real series; with the
burn alert's window shortened (chart values), RLPacerStragglerSLOBurn fires for the job that
breaks its namespace's straggler SLO and not for the one beside it that keeps it.

The scrape config is what the chart's ServiceMonitor makes (honor_labels, the target's namespace
and service labels); the operator is a local process (tests/integration/test_operator.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart_alerts import dashboard_queries, rendered_rule
from test_operator import (  # noqa: F401  (crds, operator: fixtures)
    Driver,
    OperatorProc,
    _sts,
    apply,
    crds,
    operator,
    report,
    small_job,
    status,
    token,
    wait,
)

from rlpacer.testing import LocalCluster
from rlpacer.testing.cluster import find_binary, free_ports

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = "dash"


class Prometheus:
    def __init__(self, workdir: Path, target: str, namespace: str, **rule_values: Any) -> None:
        """``rule_values``: metrics.prometheusRule values the chart's rules are rendered with."""
        (self.port,) = free_ports(1)
        self.workdir = workdir
        rules = {"groups": rendered_rule(namespace, **rule_values)["spec"]["groups"]}
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(workdir / "rules.yaml")],
            "scrape_configs": [{
                "job_name": "rlpacer", "honor_labels": True, "metrics_path": "/metrics",
                "static_configs": [{"targets": [target], "labels": {
                    "namespace": namespace, "service": "rlpacer", "pod": "rlpacer-0",
                    "endpoint": "metrics"}}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [str(find_binary("prometheus")), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def running_prometheus(operator: OperatorProc, namespace: str,  # noqa: F811
                       workdir: Path, **rule_values: Any) -> Iterator[Prometheus]:
    prom = Prometheus(workdir, f"127.0.0.1:{operator.metrics_port}", namespace, **rule_values)
    try:
        deadline = time.monotonic() + 60
        while not prom.ready():
            assert time.monotonic() < deadline, prom.log.read_text()[-3000:]
            time.sleep(0.3)
        yield prom
    finally:
        prom.stop()


@pytest.fixture
def prometheus(operator: OperatorProc, namespace: str,  # noqa: F811
               tmp_path: Path) -> Iterator[Prometheus]:
    with running_prometheus(operator, namespace, tmp_path) as prom:
        yield prom


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def test_every_dashboard_query_returns_data_from_a_real_scrape(
    cluster: LocalCluster, operator: OperatorProc, namespace: str,  # noqa: F811
    prometheus: Prometheus,
) -> None:
    apply(cluster, {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
                    "metadata": {"name": "limits", "namespace": namespace},
                    "spec": {"action": "Warn", "stepTimeSLO": {"maxSeconds": 10}}})
    apply(cluster, small_job(JOB, namespace))
    drv = Driver(operator, namespace, JOB, token(cluster, namespace, JOB))
    wait(cluster, lambda: (_sts(cluster, namespace, JOB).get("status") or {})
         .get("readyReplicas") == 1, "rollout replica 1 ready", 90)
    # A long round (rlpacer_long_rounds_total, the scale-up), then short steps spread over
    # several scrapes (rates need two samples that differ).
    code, plan = drv.post(report(0, drv.plan()["groupSize"], 150.0, nxt="Long"))
    assert code == 200 and plan["roundKind"] == "Long", plan
    wait(cluster, lambda: drv.plan()["rollout"]["state"] == "Ready", "long-round capacity", 90)
    code, plan = drv.post(report(1, drv.plan()["groupSize"], 400.0, kind="Long"))
    assert code == 200, plan
    for step in range(2, 14):
        code, plan = drv.post(report(step, plan["groupSize"], 800.0 if step % 2 else 150.0))
        assert code == 200, plan
        time.sleep(0.7)

    up = prometheus.api("query", query='up{job="rlpacer"}')["result"]
    assert [r["value"][1] for r in up] == ["1"], up
    # The Kueue panels plot series only a job that names a queue has: their series are
    # checked on the operator that queues jobs (tests/integration/test_kueue_admission.py).
    queries = {k: v for k, v in dashboard_queries({"namespace": namespace, "job": JOB}).items()
               if not k.startswith("panel 'Kueue:")}
    missing: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while True:
        missing = {name: expr for name, expr in queries.items()
                   if not finite(prometheus.api("query", query=expr)["result"])}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert missing == {}, f"dashboard queries without data: {json.dumps(missing, indent=1)}"
    # The per-job series keep the job's own labels (honor_labels), as the dashboard expects.
    (s,) = prometheus.api("query", query=f'rlpacer_group_size{{job="{JOB}"}}')["result"]
    assert s["metric"]["namespace"] == namespace

    # The chart's rules, evaluated on these series: no errors, and no alert fires for this
    # healthy-but-slow job except the step-time SLO one (pending: it needs 15 minutes).
    groups = prometheus.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["name"] for r in rules} == {
        "RLPacerStragglerSLOBurn", "RLPacerStepTimeSLOBreached", "RLPacerJobStuck",
        "RLPacerOperatorDown"}
    assert all(r["lastEvaluation"] and r["health"] == "ok" for r in rules), rules
    states = {r["name"]: r["state"] for r in rules}
    assert states["RLPacerStepTimeSLOBreached"] == "pending", states
    assert {states[n] for n in states if n != "RLPacerStepTimeSLOBreached"} == {"inactive"}


# The burn alert at a test's scale: the last minute sampled every 5 s, firing when more than half
# of it (7 of 12 samples) was violated. The chart's default is 1h sampled every minute.
BURN = {"burnWindow": "1m", "burnResolution": "5s", "burnThreshold": 0.5}


def slo_condition(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    conds = status(cluster, ns, name).get("conditions") or []
    return next((c for c in conds if c["type"] == "SLOViolated"), {})


def test_straggler_slo_burn_fires_for_the_job_that_breaks_it_and_not_the_one_that_keeps_it(
    cluster: LocalCluster, operator: OperatorProc, namespace: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    apply(cluster, {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
                    "metadata": {"name": "team-limits", "namespace": namespace},
                    "spec": {"action": "Enforce", "stragglerSLO": {
                        "maxTargetStragglerRate": "0.3", "windowSteps": 4}}})
    gc = {"stragglerRatio": "4", "targetStragglerRate": "0.2", "seed": 3, "windowSteps": 4}
    jobs = ("breaks", "keeps")
    for name in jobs:
        apply(cluster, small_job(name, namespace, steps=500, groupControl=gc))
    drivers = {n: Driver(operator, namespace, n, token(cluster, namespace, n)) for n in jobs}
    plans = {n: d.plan() for n, d in drivers.items()}
    step = 0

    def tick() -> None:
        # One step of each job: "breaks" reports a longest response 8x the median (a straggler
        # step at stragglerRatio 4), "keeps" 1.5x.
        nonlocal step
        for n, d in drivers.items():
            code, plans[n] = d.post(report(step, plans[n]["groupSize"],
                                           800.0 if n == "breaks" else 150.0))
            assert code == 200, plans[n]
        step += 1

    def burn_alerts(prom: Prometheus) -> dict[str, dict[str, Any]]:
        return {a["labels"].get("job", ""): a for a in prom.api("alerts")["alerts"]
                if a["labels"]["alertname"] == "RLPacerStragglerSLOBurn"}

    with running_prometheus(operator, namespace, tmp_path, **BURN) as prom:
        while slo_condition(cluster, namespace, "breaks").get("status") != "True":
            assert step < 10, slo_condition(cluster, namespace, "breaks")
            tick()
            time.sleep(0.5)
        violated_at = time.monotonic()
        cond = slo_condition(cluster, namespace, "breaks")
        assert cond["reason"] == "StragglerRateAboveSLO" and "team-limits" in cond["message"], cond
        # A fresh violation is not yet a burn: it must hold for more than half the window.
        assert burn_alerts(prom) == {}

        fired: dict[str, Any] = {}
        while not fired:
            assert time.monotonic() - violated_at < 90, (
                f"no burn alert 90 s into the violation: {prom.api('alerts')}")
            tick()
            alerts = burn_alerts(prom)
            assert "keeps" not in alerts, alerts
            if alerts.get("breaks", {}).get("state") == "firing":
                fired = alerts["breaks"]
            time.sleep(1)
        took = time.monotonic() - violated_at
        print(f"RLPacerStragglerSLOBurn fired {took:.1f}s into the violation")
        assert took > 20, took  # >30 s of a 1m window (less a scrape and a status poll)
        assert {k: fired["labels"][k] for k in ("namespace", "job", "severity")} == {
            "namespace": namespace, "job": "breaks", "severity": "warning"}, fired
        assert fired["annotations"]["summary"] == (
            f"RLTrainingJob {namespace}/breaks is burning its straggler SLO")

        # The job that keeps the SLO is judged (its condition False, its series 0), not unseen.
        keep = slo_condition(cluster, namespace, "keeps")
        assert keep.get("status") == "False" and keep["reason"] == "WithinSLO", keep
        (s,) = prom.api("query", query=(
            'rlpacer_slo_violated{job="keeps",reason="StragglerRateAboveSLO"}'))["result"]
        assert s["value"][1] == "0" and s["metric"]["namespace"] == namespace, s
        assert "keeps" not in burn_alerts(prom)
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert all(r["health"] == "ok" for r in rules), rules
