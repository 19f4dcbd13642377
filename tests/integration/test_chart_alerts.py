"""The chart's alerts and dashboard against the pinned promtool (no cluster needed).

* The PrometheusRule is rendered with the pinned helm (the rules under test are the chart's, not
  a copy); its groups pass ``promtool check rules``, and ``promtool test rules`` runs
  tests/promtool/alerts.test.yaml: every alert fires on a series that should trigger it, with the
  labels and annotations charts/rlpacer/README.md's runbook promises, and stays silent on healthy
  series, across operator restarts and leader changes too.
* Every dashboard query (panel targets and template variables) is turned into a rule: it must
  parse (``promtool check rules``) and return data (``promtool test rules``) on the series a
  real operator's /metrics exposes, as the chart's ServiceMonitor stores them.

promtool and helm come from ``bash scripts/setup.sh`` (hack/build-binaries.sh); a missing one
fails with the command that builds it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rlpacer.operator.metrics import Metrics
from rlpacer.testing.cluster import find_binary, pinned_versions, repo_root

pytestmark = pytest.mark.integration

ROOT = repo_root()
CHART = ROOT / "charts" / "rlpacer"
PROMTOOL_TESTS = ROOT / "tests" / "promtool"
KUBE_VERSION = pinned_versions().get("KUBERNETES_VERSION", "v1.33.0")
RELEASE, NAMESPACE = "rlpacer", "rlpacer-system"
# The labels Prometheus adds to each series scraped through the chart's ServiceMonitor
# (honorLabels: true keeps the series' own namespace and job).
TARGET = {"namespace": NAMESPACE, "job": RELEASE, "service": RELEASE, "endpoint": "metrics",
          "pod": "rlpacer-5d8c7b9f6-x2v4k", "instance": "10.0.0.1:9090", "container": "operator"}


def run(binary: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(find_binary(binary)), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def rendered_rule(namespace: str = NAMESPACE, **values: Any) -> dict[str, Any]:
    """The chart's PrometheusRule; ``values``: more metrics.prometheusRule values (set as JSON,
    so a float stays a number)."""
    sets = [f"--set-json=metrics.prometheusRule.{k}={json.dumps(v)}" for k, v in values.items()]
    r = run("helm", "template", RELEASE, str(CHART), "--namespace", namespace,
            "--kube-version", KUBE_VERSION, "--set", "metrics.prometheusRule.enabled=true",
            *sets, "--show-only", "templates/prometheusrule.yaml")
    assert r.returncode == 0, r.stderr
    (rule,) = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert rule["kind"] == "PrometheusRule"
    return rule


def promtool_ok(*args: str, cwd: Path) -> str:
    r = run("promtool", *args, cwd=cwd)
    assert r.returncode == 0, f"promtool {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_alert_rules_pass_check_and_their_unit_tests(tmp_path: Path) -> None:
    rule = rendered_rule()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    shutil.copy(PROMTOOL_TESTS / "alerts.test.yaml", tmp_path)
    promtool_ok("check", "rules", "rules.yaml", cwd=tmp_path)
    promtool_ok("test", "rules", "alerts.test.yaml", cwd=tmp_path)

    # Each alert has a case where it fires and one where it is expected silent.
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    cases = [c for t in yaml.safe_load((tmp_path / "alerts.test.yaml").read_text())["tests"]
             for c in t.get("alert_rule_test", [])]
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == alerts
    assert {c["alertname"] for c in cases if not c["exp_alerts"]} == alerts


def test_promtool_test_fails_on_a_wrong_expectation(tmp_path: Path) -> None:
    # The harness itself: a test expecting the stuck alert on a healthy job must fail.
    (tmp_path / "rules.yaml").write_text(
        yaml.safe_dump({"groups": rendered_rule()["spec"]["groups"]}))
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [
            {"series": 'rlpacer_job_active{namespace="a", job="b"}', "values": "1x90"},
            {"series": 'rlpacer_steps_total{namespace="a", job="b"}', "values": "0+1x90"}],
            "alert_rule_test": [{"eval_time": "80m", "alertname": "RLPacerJobStuck",
                                 "exp_alerts": [{"exp_labels": {"namespace": "a", "job": "b",
                                                                "severity": "warning"}}]}]}]}))
    r = run("promtool", "test", "rules", "t.yaml", cwd=tmp_path)
    assert r.returncode != 0 and "RLPacerJobStuck" in r.stdout + r.stderr


# --- the dashboard -----------------------------------------------------------------------------


def dashboard_queries(variables: dict[str, str] | None = None) -> dict[str, str]:
    """name -> PromQL of every panel target and query variable, Grafana's variables set to
    ``variables`` (name -> regex; by default "All": a regex matching every value)."""
    dash = json.loads((CHART / "dashboards" / "rlpacer.json").read_text())

    def panels(ps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [x for p in ps for x in (p, *panels(p.get("panels", [])))]

    out: dict[str, str] = {}
    for p in panels(dash["panels"]):
        for t in p.get("targets", []):
            out[f"panel {p['title']!r} target {t.get('refId', '?')}"] = t["expr"]
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_]\w*)\)", q.strip())
            assert m, f"variable {v['name']}: unexpected query {q!r}"
            out[f"variable {v['name']}"] = m.group(1)

    def value(m: re.Match[str]) -> str:
        return (variables or {}).get(m.group(1), ".*")

    for name, expr in out.items():
        out[name] = re.sub(r"\$\{?([A-Za-z_]\w*)(?::\w+)?\}?", value, expr)
        assert "$" not in out[name], f"{name}: an unhandled Grafana variable in {expr!r}"
    return out


#: Kueue's series the dashboard's burst-pool panel reads (name, labels, value).
KUEUE_SERIES: list[tuple[str, dict[str, str], float]] = [
    ("kueue_cluster_queue_nominal_quota", {
        "cohort": "", "cluster_queue": "burst", "flavor": "h100", "resource": "nvidia.com/gpu",
        "replica_role": "standalone"}, 8),
    ("kueue_cluster_queue_resource_reservation", {
        "cohort": "", "cluster_queue": "burst", "flavor": "h100", "resource": "nvidia.com/gpu",
        "replica_role": "standalone"}, 4),
    ("kueue_pending_workloads", {
        "cluster_queue": "burst", "status": "inadmissible", "replica_role": "standalone"}, 1),
]


def operator_series() -> list[dict[str, str]]:
    """promtool input series for every sample a busy operator's /metrics holds (one job), with the
    labels the ServiceMonitor adds: counters grow by their value each minute, gauges stay."""
    m = Metrics()
    lab = ("team-a", "grpo")
    for g, v in ((m.group_size, 8), (m.lambda_, 0.3), (m.straggler_rate, 0.1),
                 (m.long_queue, 3), (m.rollout_desired, 4), (m.rollout_ready, 3),
                 (m.job_active, 1), (m.job_queued, 0), (m.long_round_queued, 1)):
        g.labels(*lab).set(v)
    for c in (m.stragglers, m.steps, m.long_rounds, m.scale_actions, m.reconciles,
              m.reconcile_errors):
        c.labels(*lab).inc(2)
    m.step_duration.labels(*lab).observe(42)
    m.step_duration.labels(*lab).observe(75)
    m.queue_wait.labels("team-a", "job").observe(40)  # a job that names a Kueue queue
    m.queue_wait.labels("team-a", "long_round").observe(12)
    m.slo_violated.labels(*lab, "StragglerRateAboveSLO").set(1)
    m.slo_violated.labels(*lab, "StepTimeAboveSLO").set(0)
    m.report_latency.labels("steps", "200").observe(0.012)
    m.report_errors.labels("steps", "409", "StepOutOfOrder").inc()
    m.status_write.labels("ok").observe(0.004)
    m.leader.set(1)
    out = [{"series": "up" + labels_text(TARGET), "values": "1x30"}]
    # Kueue's own series, as the Kueue of hack/versions.env serves them (their names and
    # labels checked on its real /metrics in tests/integration/test_kueue_admission.py)
    kueue = {"job": "kueue", "namespace": "kueue-system"}
    for name, labels, value in KUEUE_SERIES:
        out.append({"series": name + labels_text({**kueue, **labels}), "values": f"{value}x30"})
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = {**TARGET, **s.labels}  # honorLabels: the series' own labels win
            grows = fam.type in ("counter", "histogram")
            values = f"0+{s.value}x30" if grows else f"{s.value}x30"
            out.append({"series": s.name + labels_text(labels), "values": values})
    return out


def labels_text(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"


def test_every_dashboard_query_parses_and_returns_data(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 10
    names = {f"Dashboard{i:02d}": (name, expr) for i, (name, expr) in
             enumerate(sorted(queries.items()))}
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"alert": alert, "expr": f"count({expr}) > 0", "labels": {"query": name}}
        for alert, (name, expr) in names.items()]}]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    promtool_ok("check", "rules", "rules.yaml", cwd=tmp_path)
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": operator_series(),
        "alert_rule_test": [
            {"eval_time": "20m", "alertname": alert,
             "exp_alerts": [{"exp_labels": {"query": name}}]}
            for alert, (name, _) in names.items()]}]}
    (tmp_path / "dashboard.test.yaml").write_text(yaml.safe_dump(tests))
    promtool_ok("test", "rules", "dashboard.test.yaml", cwd=tmp_path)


def test_a_dashboard_query_with_a_syntax_error_fails_the_check(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [
        {"record": "x", "expr": 'rate(rlpacer_steps_total{namespace=~".*"}[5m] * 60'}]}]}))
    r = run("promtool", "check", "rules", "rules.yaml", cwd=tmp_path)
    assert r.returncode != 0
