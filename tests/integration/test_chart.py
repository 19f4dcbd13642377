"""The Helm chart with the pinned helm: lint, render, reject bad values, install into the real
local control plane, prove its RBAC least-privilege with real API requests made with the
chart's ServiceAccount token, upgrade the CRDs, and uninstall without orphans.

Every release here selects only its own test namespaces in the webhook configurations, so the
shared session cluster's other tests never meet these webhooks.
"""

from __future__ import annotations

import base64
import json
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.testing import LocalCluster
from rlpacer.testing.cluster import find_binary, pinned_versions, repo_root

pytestmark = pytest.mark.integration

CHART = repo_root() / "charts" / "rlpacer"
# helm template/lint assume a cluster version; use the one the local control plane runs
# (a helm built without Helm's own ldflags would otherwise assume v1.20).
KUBE_VERSION = pinned_versions().get("KUBERNETES_VERSION", "v1.33.0")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(find_binary("helm")), *args], capture_output=True, text=True,
                       timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def sets(values: dict[str, Any]) -> list[str]:
    return [a for k, v in values.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]


def render(values: dict[str, Any] | None = None, namespace: str = "rlpacer-system"
           ) -> list[dict[str, Any]]:
    out = helm("template", "rlpacer", str(CHART), "--namespace", namespace,
               "--kube-version", KUBE_VERSION, *sets(values or {}))
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs
            if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def container_env(deployment: dict[str, Any]) -> dict[str, str | None]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in c["env"]}


# --- lint and template (no cluster) ------------------------------------------------------


VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"rbac.scope": "Namespaced", "rbac.watchNamespaces": ["team-a", "team-b"]},
    "loopback": {"webhook.url": "https://127.0.0.1:9443"},
    "cert-manager": {"webhook.certs.mode": "CertManager"},
    "own-secret": {"webhook.certs.mode": "Secret", "webhook.certs.existingSecret": "tls",
                   "webhook.certs.caBundle": "Zm9v"},
    "monitoring": {"metrics.serviceMonitor.enabled": True,
                   "metrics.prometheusRule.enabled": True},
    "minimal": {"webhook.enabled": False, "leaderElection.enabled": False,
                "rbac.aggregateToDefaultRoles": False, "metrics.dashboard.enabled": False},
    "network-policy": {"networkPolicy.enabled": True},
    "network-policy-namespaced": {
        "networkPolicy.enabled": True, "rbac.scope": "Namespaced",
        "rbac.watchNamespaces": ["team-a", "team-b"],
        "networkPolicy.webhookFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
        "networkPolicy.metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_is_clean(variant: str) -> None:
    r = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION,
             *sets(VARIANTS[variant]))
    assert "0 chart(s) failed" in r.stdout, r.stdout


def test_template_renders_a_hardened_operator_wired_to_its_settings() -> None:
    docs = render()
    (dep,) = find(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    env = {e["name"]: e.get("value") for e in c["env"]}
    # Every variable the chart sets is a field of the operator's settings object.
    from rlpacer.operator.settings import ENV_PREFIX, OperatorSettings
    fields = {ENV_PREFIX + f.upper() for f in OperatorSettings.model_fields}
    ours = {k for k in env if k.startswith(ENV_PREFIX)}
    assert ours <= fields, ours - fields
    assert env["RLPACER_OPERATOR_NAMESPACES"] == ""  # cluster scope: everything
    # The Lease identity is the pod's name: stable across the container's restarts (after
    # a lost Lease, an OOM kill), so a restarted operator takes its own Lease back at once
    # instead of waiting out leaseDurationSeconds with 503 NotLeader (issue 32)
    ident = next(e for e in c["env"] if e["name"] == "RLPACER_OPERATOR_IDENTITY")
    assert ident["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, ident
    assert env["RLPACER_OPERATOR_WEBHOOK_ENABLED"] == "true"
    # the per-job step-report rate (token bucket) and its burst
    assert env["RLPACER_OPERATOR_REPORT_RATE_PER_SECOND"] == "20"
    assert env["RLPACER_OPERATOR_REPORT_BURST"] == "50"
    # The mounted certificate directory holds what the operator's webhook server loads.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["tls"] == env["RLPACER_OPERATOR_WEBHOOK_CERT_DIR"]
    # ... and step reports are served over TLS with the same certificate (with its ca.crt)
    assert mounts["tls"] == env["RLPACER_OPERATOR_REPORT_CERT_DIR"]
    assert "RLPACER_OPERATOR_REPORT_INSECURE_HTTP" not in env
    vol = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert vol["secret"]["secretName"] == "rlpacer-webhook-tls" and "items" not in vol["secret"]
    # Monitoring objects are off by default; the dashboard is on.
    assert not find(docs, "ServiceMonitor") and not find(docs, "PrometheusRule")
    (dash,) = find(docs, "ConfigMap", "rlpacer-dashboard")
    assert json.loads(dash["data"]["rlpacer.json"])["uid"] == "rlpacer-jobs"


def test_report_tls_values() -> None:
    """Step reports over TLS are on by default and need no webhook; the generated certificate
    names the report URL's host; reportTLS=false serves plain HTTP (and says so to the
    operator); mode Secret needs no caBundle when only reports use the certificate."""
    docs = render({"webhook.enabled": False, "operator.reportURL": "https://reports.example:8443"})
    (dep,) = find(docs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["RLPACER_OPERATOR_REPORT_CERT_DIR"] == "/etc/rlpacer/tls"
    assert "RLPACER_OPERATOR_WEBHOOK_CERT_DIR" not in env
    assert not find(docs, "ValidatingWebhookConfiguration")
    (tls,) = find(docs, "Secret", "rlpacer-webhook-tls")
    cert = base64.b64decode(tls["data"]["tls.crt"])
    ca = base64.b64decode(tls["data"]["ca.crt"])
    san = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName"], input=cert,
                         capture_output=True, check=True).stdout.decode()
    assert "DNS:reports.example" in san and "DNS:rlpacer.rlpacer-system.svc" in san, san
    with tempfile.TemporaryDirectory() as d:  # the certificate is signed by the Secret's CA
        Path(d, "ca.crt").write_bytes(ca)
        Path(d, "tls.crt").write_bytes(cert)
        subprocess.run(["openssl", "verify", "-CAfile", f"{d}/ca.crt", f"{d}/tls.crt"],
                       check=True, capture_output=True)
    plain = render({"operator.reportTLS": False, "webhook.enabled": False})
    (dep,) = find(plain, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["RLPACER_OPERATOR_REPORT_INSECURE_HTTP"] == "true"
    assert "RLPACER_OPERATOR_REPORT_CERT_DIR" not in env
    assert (not find(plain, "Secret") and "volumeMounts" not in c) or all(
        m["name"] != "tls" for m in c.get("volumeMounts", []))
    own = render({"webhook.enabled": False, "webhook.certs.mode": "Secret",
                  "webhook.certs.existingSecret": "my-tls"})
    (dep,) = find(own, "Deployment")
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert vol["secret"]["secretName"] == "my-tls"


def test_template_webhooks_failure_policy_scope_and_ca() -> None:
    docs = render({"webhook.url": "https://127.0.0.1:9443"})
    (vwc,) = find(docs, "ValidatingWebhookConfiguration")
    (mwc,) = find(docs, "MutatingWebhookConfiguration")
    hooks = {h["name"]: h for h in vwc["webhooks"] + mwc["webhooks"]}
    assert {n: h["failurePolicy"] for n, h in hooks.items()} == {
        "validate.rltrainingjob.rlpacer.io": "Fail",
        "validate.rltrainingpolicy.rlpacer.io": "Fail",
        "validate.clusterrltrainingpolicy.rlpacer.io": "Fail",
        "mutate.rltrainingjob.rlpacer.io": "Ignore",
    }
    for name, h in hooks.items():
        assert h["clientConfig"]["url"].startswith("https://127.0.0.1:9443/")
        assert "DELETE" not in h["rules"][0]["operations"]
        if "cluster" in name:  # cluster-scoped objects have no namespace to select on
            assert h["rules"][0]["scope"] == "Cluster" and "namespaceSelector" not in h
            continue
        assert h["namespaceSelector"]["matchExpressions"][0] == {
            "key": "kubernetes.io/metadata.name", "operator": "NotIn",
            "values": ["rlpacer-system", "kube-system"]}
    # caBundle is the CA in the Secret, and it signed a certificate naming the loopback IP.
    (ca_secret,) = find(docs, "Secret", "rlpacer-webhook-ca")
    (tls,) = find(docs, "Secret", "rlpacer-webhook-tls")
    ca = ca_secret["data"]["ca.crt"]
    assert all(h["clientConfig"]["caBundle"] == ca for h in hooks.values())
    assert tls["data"]["ca.crt"] == ca
    pem = base64.b64decode(tls["data"]["tls.crt"]).decode()
    text = subprocess.run(["openssl", "x509", "-noout", "-text"], check=True, text=True,
                          capture_output=True, input=pem).stdout
    assert "IP Address:127.0.0.1" in text and "DNS:rlpacer.rlpacer-system.svc" in text
    # Service mode: the Service, the webhook port, the handler id as path.
    (svc_hook,) = [h for h in find(render(), "ValidatingWebhookConfiguration")[0]["webhooks"]
                   if h["name"].startswith("validate.rltrainingjob")]
    assert svc_hook["clientConfig"]["service"] == {
        "name": "rlpacer", "namespace": "rlpacer-system", "port": 443,
        "path": "/validate-rltrainingjob"}


def test_template_namespaced_scope_has_no_cluster_wide_operator_rights() -> None:
    docs = render(VARIANTS["namespaced"], namespace="ops")
    assert [d["metadata"]["name"] for d in find(docs, "ClusterRole")] == [
        "rlpacer-rltrainingjob-editor", "rlpacer-rltrainingjob-viewer",
        "rlpacer-rltrainingpolicy-admin"]  # for people; none is bound to the operator
    assert not find(docs, "ClusterRoleBinding")
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in find(docs, "Role")}
    assert roles == {("team-a", "rlpacer-operator"), ("team-b", "rlpacer-operator"),
                     ("ops", "rlpacer-leader-election")}
    (dep,) = find(docs, "Deployment")
    assert container_env(dep)["RLPACER_OPERATOR_NAMESPACES"] == "team-a,team-b"
    (vwc,) = find(docs, "ValidatingWebhookConfiguration")
    assert vwc["webhooks"][0]["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]
    # Cluster policies need cluster-wide reads: not part of a namespaced install.
    assert not [h for h in vwc["webhooks"] if "cluster" in h["name"]]


def test_template_monitoring_objects() -> None:
    docs = render(VARIANTS["monitoring"])
    (rule,) = find(docs, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"RLPacerStragglerSLOBurn", "RLPacerStepTimeSLOBreached",
                           "RLPacerJobStuck", "RLPacerOperatorDown"}
    assert 'reason="StragglerRateAboveSLO"' in alerts["RLPacerStragglerSLOBurn"]["expr"]
    assert "{{ $labels.job }}" in alerts["RLPacerJobStuck"]["annotations"]["summary"]
    (sm,) = find(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    # The per-job series keep the job's namespace/job (not exported_*): alerts and dashboard.
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True


def _accepted_as_is(cluster: LocalCluster, obj: dict[str, Any]) -> None:
    """The API server accepts ``obj`` (server-side dry run) and keeps its spec as given."""
    r = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                        input=json.dumps(obj))
    assert json.loads(r.stdout)["spec"] == obj["spec"]


def _create_job_pods(cluster: LocalCluster, namespace: str) -> None:
    """Create the pods the builders make for a job (without owner: no job object exists)."""
    for pod in _job_pods(namespace).values():
        pod["metadata"].pop("ownerReferences", None)
        cluster.kubectl("create", "-f", "-", input=json.dumps(pod))


def _job_pods(namespace: str) -> dict[str, dict[str, Any]]:
    """role -> a Pod as the operator's builders make it (the driver, and one Pod from each
    StatefulSet's template, as the StatefulSet controller would create it)."""
    from rlpacer.api import contract
    from rlpacer.api.job import load_manifest
    from rlpacer.operator import builders

    spec = load_manifest(repo_root() / "examples" / "rltrainingjob.yaml").spec
    inputs = builders.BuildInputs(name="np", namespace=namespace, uid="u-1", spec=spec,
                                  attempt=0, rollout_replicas=1, report_url="http://op:8080")
    out = {}
    for c in builders.build_children(inputs):
        if c["kind"] == "Pod":
            pod = c
        elif c["kind"] == "StatefulSet":
            tpl = c["spec"]["template"]
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": c["metadata"]["name"] + "-0", "namespace": namespace,
                                "labels": {**tpl["metadata"]["labels"],
                                           builders.POD_INDEX_LABEL: "0"}},
                   "spec": tpl["spec"]}
        else:
            continue
        out[pod["metadata"]["labels"][contract.LABEL_ROLE]] = pod
    return out


def _container_ports(dep: dict[str, Any]) -> dict[str, int]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def _rules_by_port(policy: dict[str, Any]) -> dict[int, dict[str, Any]]:
    out = {}
    for rule in policy["spec"]["ingress"]:
        ((port,),) = [[p["port"] for p in rule["ports"]]]
        assert all(p["protocol"] == "TCP" for p in rule["ports"])
        out[port] = rule
    return out


def test_template_network_policy_matches_the_builders_labels_and_the_ports() -> None:
    assert not find(render(), "NetworkPolicy")  # off by default
    pods = _job_pods("team-a")
    for variant in ("network-policy", "network-policy-namespaced"):
        values = VARIANTS[variant]
        docs = render(values, namespace="ops")
        (pol,) = find(docs, "NetworkPolicy")
        (dep,) = find(docs, "Deployment")
        (svc,) = find(docs, "Service")
        assert pol["metadata"]["namespace"] == "ops"
        assert pol["spec"]["policyTypes"] == ["Ingress"]
        # it selects the operator's pod
        sel = pol["spec"]["podSelector"]["matchLabels"]
        assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert sel == svc["spec"]["selector"]
        ports = _container_ports(dep)
        # the Service's target ports are these container ports (what the policy must name)
        assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {
            n: n for n in ports}
        rules = _rules_by_port(pol)
        expect = {ports["reports"], ports["webhook"]}
        if "networkPolicy.metricsFrom" in values:
            expect.add(ports["metrics"])
        assert set(rules) == expect
        assert ports["webhook"] == 9443 and ports["reports"] == 8080
        # step reports: from the builders' driver pods, and from no other role's pods
        (peer,) = rules[ports["reports"]]["from"]
        want = peer["podSelector"]["matchLabels"]
        assert want.items() <= pods["driver"]["metadata"]["labels"].items()
        for role in ("head", "learner", "rollout"):
            assert not want.items() <= pods[role]["metadata"]["labels"].items(), role
        if values.get("rbac.scope") == "Namespaced":
            assert peer["namespaceSelector"] == {"matchExpressions": [{
                "key": "kubernetes.io/metadata.name", "operator": "In",
                "values": ["team-a", "team-b"]}]}
            assert rules[ports["webhook"]]["from"] == values["networkPolicy.webhookFrom"]
            assert rules[ports["metrics"]]["from"] == values["networkPolicy.metricsFrom"]
        else:
            assert peer["namespaceSelector"] == {}
            assert "from" not in rules[ports["webhook"]]  # every source: see the README
    # without webhooks there is no webhook rule
    (pol,) = find(render({"networkPolicy.enabled": True, "webhook.enabled": False}),
                  "NetworkPolicy")
    assert set(_rules_by_port(pol)) == {8080}


def test_network_policy_is_accepted_and_selects_only_driver_pods(
    cluster: LocalCluster, namespace: str
) -> None:
    """The API server accepts the rendered NetworkPolicy (server-side dry run), and evaluates
    its step-report peer selector to exactly the driver among pods the builders make."""
    values = {"networkPolicy.enabled": True, "rbac.scope": "Namespaced",
              "rbac.watchNamespaces": [namespace],
              "networkPolicy.metricsFrom": [{"podSelector": {"matchLabels": {"app": "prom"}}}]}
    (pol,) = find(render(values, namespace=namespace), "NetworkPolicy")
    _accepted_as_is(cluster, pol)
    _create_job_pods(cluster, namespace)
    (peer,) = [rule["from"][0] for rule in pol["spec"]["ingress"]
               if rule["ports"][0]["port"] == 8080]
    selector = ",".join(f"{k}={v}" for k, v in peer["podSelector"]["matchLabels"].items())
    got = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", selector,
                                     "-o", "json").stdout)
    assert [p["metadata"]["name"] for p in got["items"]] == ["np-driver-0"]
    ns = json.loads(cluster.kubectl("get", "namespace", namespace, "-o", "json").stdout)
    (expr,) = peer["namespaceSelector"]["matchExpressions"]
    assert ns["metadata"]["labels"][expr["key"]] in expr["values"]


def _operator_settings(docs: list[dict[str, Any]]) -> Any:
    """The OperatorSettings the rendered Deployment's env gives (fieldRef values as the pod
    would see them)."""
    from rlpacer.operator.settings import OperatorSettings

    (dep,) = find(docs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    env["RLPACER_OPERATOR_OPERATOR_NAMESPACE"] = dep["metadata"]["namespace"]
    return OperatorSettings.load(env)


def _network_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for d in docs if d["kind"] in ("ClusterRole", "Role")
            for r in d.get("rules") or [] if "networkpolicies" in r["resources"]]


def test_template_job_network_policies_follow_the_values() -> None:
    """networkPolicy.enabled (with jobs.enabled, the default) turns on the jobs' policies: the
    operator gets the settings (the driver may report to this release's operator pods only;
    metricsFrom may scrape the job pods) and the RBAC to manage them; neither without."""
    assert _operator_settings(render()).job_network() is None
    assert not _network_rules(render())
    for variant in ("network-policy", "network-policy-namespaced"):
        values = {**VARIANTS[variant],
                  "networkPolicy.jobs.egress": [{"ports": [{"port": 443, "protocol": "TCP"}]}]}
        docs = render(values, namespace="ops")
        net = _operator_settings(docs).job_network()
        assert net is not None
        (dep,) = find(docs, "Deployment")
        ports = _container_ports(dep)
        assert ports["reports"] in net.report_ports
        (peer,) = net.report_to
        assert peer["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": "ops"}}
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert peer["podSelector"]["matchLabels"].items() <= labels.items()
        assert list(net.egress) == values["networkPolicy.jobs.egress"]
        rules = _network_rules(docs)
        assert rules and all(set(r["verbs"]) >= {"create", "patch", "delete", "watch"}
                             for r in rules)
    off = render({"networkPolicy.enabled": True, "networkPolicy.jobs.enabled": False})
    assert _operator_settings(off).job_network() is None and not _network_rules(off)
    assert find(off, "NetworkPolicy")  # the operator pod's own stays


def test_job_network_policies_are_accepted_and_select_the_jobs_pods(
    cluster: LocalCluster, namespace: str
) -> None:
    """The policies the builders make with the chart's settings pass the API server's
    validation (server-side dry run), and its label selection picks exactly the job's pods
    (``<job>-pods``) and its driver (``<job>-driver``)."""
    from rlpacer.api.job import load_manifest
    from rlpacer.operator import builders

    values = {"networkPolicy.enabled": True,
              "networkPolicy.metricsFrom": [{"podSelector": {"matchLabels": {"app": "prom"}}}],
              "networkPolicy.jobs.egress": [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
                                             "ports": [{"port": 443, "protocol": "TCP"}]}]}
    net = _operator_settings(render(values)).job_network()
    spec = load_manifest(repo_root() / "examples" / "rltrainingjob.yaml").spec
    inputs = builders.BuildInputs(name="np", namespace=namespace, uid="u-1", spec=spec,
                                  attempt=0, rollout_replicas=1, report_url="http://op:8080",
                                  network=net)
    pols = builders.network_policies(inputs)
    assert len(pols) == 2
    for pol in pols:
        pol["metadata"].pop("ownerReferences")
        _accepted_as_is(cluster, pol)
    _create_job_pods(cluster, namespace)
    other = _job_pods(namespace)["head"]
    other["metadata"]["name"] = "another-job-head"
    other["metadata"]["labels"]["rlpacer.io/job"] = "another"
    cluster.kubectl("create", "-f", "-", input=json.dumps(other))

    def selected(pol: dict[str, Any]) -> list[str]:
        sel = ",".join(f"{k}={v}" for k, v in pol["spec"]["podSelector"]["matchLabels"].items())
        got = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", sel,
                                         "-o", "json").stdout)
        return sorted(p["metadata"]["name"] for p in got["items"])

    by_name = {p["metadata"]["name"]: p for p in pols}
    assert selected(by_name["np-pods"]) == ["np-driver-0", "np-head-0", "np-learner-0",
                                            "np-rollout-0"]
    assert selected(by_name["np-driver"]) == ["np-driver-0"]


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"networkPolicy.jobs.egress": [{"port": 443}]},
         "additional properties 'port' not allowed"),
        ({"networkPolicy.jobs.egress": [{"to": [{"cidr": "10.0.0.0/8"}]}]},
         "additional properties 'cidr' not allowed"),
        ({"rbac.scope": "cluster"},
         "at '/rbac/scope': value must be one of 'Cluster', 'Namespaced'"),
        ({"webhook.failurePolicy.validating": "Maybe"},
         "at '/webhook/failurePolicy/validating': value must be one of 'Fail', 'Ignore'"),
        ({"replicas": 0}, "at '/replicas': minimum: got 0, want 1"),
        ({"webhook.url": "http://127.0.0.1:9443"}, "at '/webhook/url'"),
        ({"rbac.watchNamespaces": ["Team_A"]}, "at '/rbac/watchNamespaces/0'"),
        ({"typo": 1}, "additional properties 'typo' not allowed"),
        ({"operator.reportBurst": 0}, "at '/operator/reportBurst': minimum: got 0, want 1"),
        ({"operator.reportRatePerSecond": -1}, "at '/operator/reportRatePerSecond'"),
        ({"networkPolicy.metricsFrom": [{"podSelecter": {}}]},
         "additional properties 'podSelecter' not allowed"),
        ({"networkPolicy.webhookFrom": [{"ipBlock": {}}]}, "missing property 'cidr'"),
    ],
)
def test_wrong_values_fail_with_a_clear_message(values: dict[str, Any], needle: str) -> None:
    r = helm("template", "rlpacer", str(CHART), "--kube-version", KUBE_VERSION, *sets(values),
             check=False)
    assert r.returncode != 0
    assert "values don't meet the specifications of the schema" in r.stderr
    assert needle in r.stderr, r.stderr


# --- against the cluster -----------------------------------------------------------------


def _release_values(namespaces: list[str]) -> dict[str, Any]:
    # Only these test namespaces are selected by the webhooks (no effect on other tests).
    return {"webhook.namespaceSelectorExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces}]}


@pytest.fixture
def cluster_release(cluster: LocalCluster) -> Iterator[tuple[str, str, str]]:
    """A cluster-scope release in its own namespace; yields (release, release ns, job ns)."""
    suffix = uuid.uuid4().hex[:6]
    rel, ns, jobs = f"rlp-{suffix}", f"rlp-sys-{suffix}", f"rlp-jobs-{suffix}"
    cluster.create_namespace(ns)
    cluster.create_namespace(jobs)
    cluster.helm("install", rel, str(CHART), "-n", ns, "--wait=false",
                 *sets(_release_values([jobs])))
    try:
        yield rel, ns, jobs
    finally:
        cluster.helm("uninstall", rel, "-n", ns, check=False)
        cluster.delete_namespace(jobs)
        cluster.delete_namespace(ns)


def _can(cluster: LocalCluster, token: str, method: str, path: str, body: Any = None) -> int:
    """The HTTP status of one request made with `token` (retrying the API server's 429 while
    a freshly installed CRD's storage initialises)."""
    ctype = "application/merge-patch+json" if method == "PATCH" else "application/json"
    deadline = time.monotonic() + 30
    while True:
        status, _ = cluster.request(method, path, body, token=token, content_type=ctype)
        if status != 429 or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def test_install_rbac_is_sufficient_and_not_excessive(
    cluster: LocalCluster, cluster_release: tuple[str, str, str]
) -> None:
    rel, ns, jobs = cluster_release
    sa = f"{rel}-rlpacer"
    token = cluster.service_account_token(ns, sa)
    # Sufficient: what the operator does, in a job namespace, as the chart's ServiceAccount.
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "run-config"}}
    assert _can(cluster, token, "POST", f"/api/v1/namespaces/{jobs}/configmaps", cm) == 201
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "job-token"}}
    assert _can(cluster, token, "POST", f"/api/v1/namespaces/{jobs}/secrets", secret) == 201
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    assert _can(cluster, token, "POST", f"/api/v1/namespaces/{jobs}/pods", pod) == 201
    for path in (f"/apis/rlpacer.io/v1alpha1/namespaces/{jobs}/rltrainingjobs",
                 "/apis/rlpacer.io/v1alpha1/rltrainingjobs",
                 f"/apis/rlpacer.io/v1alpha1/namespaces/{jobs}/rltrainingpolicies",
                 f"/apis/apps/v1/namespaces/{jobs}/statefulsets",
                 f"/api/v1/namespaces/{jobs}/services",
                 "/apis/rlpacer.io/v1alpha1/clusterrltrainingpolicies",
                 f"/api/v1/namespaces/{jobs}"):  # a job namespace's labels, by name
        assert _can(cluster, token, "GET", path) == 200, path
    # ttlSecondsAfterFinished deletes the job: authorised (404: no such job, not 403).
    assert _can(cluster, token, "DELETE",
                f"/apis/rlpacer.io/v1alpha1/namespaces/{jobs}/rltrainingjobs/gone") == 404
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e"},
             "involvedObject": {"kind": "Pod", "name": "p", "namespace": jobs},
             "reason": "Test", "message": "m", "type": "Normal"}
    assert _can(cluster, token, "POST", f"/api/v1/namespaces/{jobs}/events", event) == 201
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": sa}}
    assert _can(cluster, token, "POST",
                f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", lease) == 201
    assert _can(cluster, token, "GET",
                f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{sa}") == 200
    # Not excessive: RBAC, nodes, namespaces, CRDs, webhooks, policies, other Leases.
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": f"{rel}-escalate"}, "rules": []}
    denied = [
        ("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", role),
        ("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{jobs}/roles",
         {**role, "kind": "Role"}),
        ("GET", "/api/v1/nodes", None),
        ("PATCH", "/api/v1/nodes/any", {}),
        ("GET", "/api/v1/namespaces", None),
        ("DELETE", f"/api/v1/namespaces/{jobs}", None),
        ("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", None),
        ("GET", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations", None),
        ("POST", f"/apis/rlpacer.io/v1alpha1/namespaces/{jobs}/rltrainingpolicies",
         {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
          "metadata": {"name": "mine"}, "spec": {}}),
        ("DELETE", "/apis/rlpacer.io/v1alpha1/clusterrltrainingpolicies/any", None),
        ("GET", "/api/v1/namespaces?watch=true", None),
        ("GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/someone-else", None),
        ("GET", f"/apis/coordination.k8s.io/v1/namespaces/{jobs}/leases", None),
    ]
    for method, path, body in denied:
        assert _can(cluster, token, method, path, body) == 403, (method, path)


def test_namespaced_install_cannot_touch_other_namespaces(cluster: LocalCluster) -> None:
    suffix = uuid.uuid4().hex[:6]
    rel, ns, watched, other = (f"rlp-{suffix}", f"rlp-sys-{suffix}", f"rlp-w-{suffix}",
                               f"rlp-o-{suffix}")
    for n in (ns, watched, other):
        cluster.create_namespace(n)
    try:
        cluster.helm("install", rel, str(CHART), "-n", ns, "--wait=false",
                     *sets({"rbac.scope": "Namespaced", "rbac.watchNamespaces": [watched]}))
        token = cluster.service_account_token(ns, f"{rel}-rlpacer")
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
        assert _can(cluster, token, "POST", f"/api/v1/namespaces/{watched}/configmaps", cm) == 201
        assert _can(cluster, token, "GET",
                    f"/apis/rlpacer.io/v1alpha1/namespaces/{watched}/rltrainingjobs") == 200
        assert _can(cluster, token, "DELETE",  # TTL deletion (404: authorised, no such job)
                    f"/apis/rlpacer.io/v1alpha1/namespaces/{watched}/rltrainingjobs/gone") == 404
        for method, path, body in [
            ("POST", f"/api/v1/namespaces/{other}/configmaps", cm),
            ("GET", f"/api/v1/namespaces/{other}/secrets", None),
            ("GET", f"/api/v1/namespaces/{other}/pods", None),
            ("GET", f"/apis/rlpacer.io/v1alpha1/namespaces/{other}/rltrainingjobs", None),
            ("DELETE", f"/apis/rlpacer.io/v1alpha1/namespaces/{other}/rltrainingjobs/x", None),
            ("GET", "/apis/rlpacer.io/v1alpha1/rltrainingjobs", None),  # cluster-wide list
            ("GET", "/api/v1/pods", None),
            ("GET", f"/api/v1/namespaces/{ns}/secrets", None),  # not even its own namespace
            ("GET", "/apis/rlpacer.io/v1alpha1/clusterrltrainingpolicies", None),
            ("GET", f"/api/v1/namespaces/{watched}", None),
        ]:
            assert _can(cluster, token, method, path, body) == 403, (method, path)
        # The webhooks select exactly the watched namespace.
        vwc = json.loads(cluster.kubectl("get", "validatingwebhookconfiguration",
                                         f"{rel}-rlpacer-validating", "-o", "json").stdout)
        assert vwc["webhooks"][0]["namespaceSelector"]["matchExpressions"] == [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [watched]}]
    finally:
        cluster.helm("uninstall", rel, "-n", ns, check=False)
        for n in (ns, watched, other):
            cluster.delete_namespace(n)


def test_ttl_deletion_works_with_the_charts_token(cluster: LocalCluster) -> None:
    """The operator as the chart's ServiceAccount (Namespaced scope) deletes a finished job
    after ttlSecondsAfterFinished: the chart grants `delete` on rltrainingjobs."""
    import os
    import signal
    import sys

    from rlpacer.operator import names
    from rlpacer.testing.cluster import free_ports

    suffix = uuid.uuid4().hex[:6]
    rel, ns, watched = f"rlp-{suffix}", f"rlp-sys-{suffix}", f"rlp-w-{suffix}"
    for n in (ns, watched):
        cluster.create_namespace(n)
    proc: subprocess.Popen[bytes] | None = None
    try:
        cluster.helm("install", rel, str(CHART), "-n", ns, "--wait=false",
                     *sets({"rbac.scope": "Namespaced", "rbac.watchNamespaces": [watched],
                            "webhook.enabled": False}))
        kubeconfig = cluster.kubeconfig_for_service_account(ns, f"{rel}-rlpacer")
        report, metrics = free_ports(2)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RLPACER_OPERATOR_", "KUBECONFIG"))}
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlpacer.cli", "operator", "--kubeconfig", str(kubeconfig),
             "--namespaces", watched, "--operator-namespace", ns, "--lease-name",
             f"{rel}-rlpacer", "--report-host", "127.0.0.1", "--report-port", str(report),
             "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics),
             "--resync-seconds", "1", "--lease-duration-seconds", "4",
             "--lease-renew-seconds", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        job = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingJob",
               "metadata": {"name": "ttl", "namespace": watched},
               "spec": {"model": {"source": "builtin://tiny-adder"},
                        "data": {"source": "builtin://adder"}, "steps": 2,
                        "promptsPerStep": 4, "rollout": {"replicas": 1, "gpusPerReplica": 0},
                        "trainer": {"replicas": 1, "gpusPerReplica": 0},
                        "ttlSecondsAfterFinished": 1}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(job))
        pod = names.driver_pod("ttl", 0)

        def phase() -> str | None:
            code, body = cluster.http.request("GET", f"/api/v1/namespaces/{watched}/pods/{pod}")
            return (body.get("status") or {}).get("phase") if code == 200 else None

        cluster.wait_for(lambda: phase() == "Running", timeout=90, what="driver pod running")
        cluster.mark_pod_exit(watched, pod, 0)
        path = f"/apis/rlpacer.io/v1alpha1/namespaces/{watched}/rltrainingjobs/ttl"
        cluster.wait_for(lambda: cluster.http.request("GET", path)[0] == 404, timeout=60,
                         what="job deleted after ttlSecondsAfterFinished")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        cluster.helm("uninstall", rel, "-n", ns, check=False)
        for n in (ns, watched):
            cluster.delete_namespace(n)


def test_upgrade_keeps_the_ca_and_uninstall_leaves_no_orphans(
    cluster: LocalCluster, cluster_release: tuple[str, str, str]
) -> None:
    rel, ns, jobs = cluster_release

    def ca_bundles() -> set[str]:
        out = set()
        for kind in ("validatingwebhookconfiguration", "mutatingwebhookconfiguration"):
            obj = json.loads(cluster.kubectl("get", kind, f"{rel}-rlpacer-{kind[:-20]}",
                                             "-o", "json").stdout)
            out |= {h["clientConfig"]["caBundle"] for h in obj["webhooks"]}
        return out

    before = ca_bundles()
    assert len(before) == 1
    cluster.helm("upgrade", rel, str(CHART), "-n", ns, "--wait=false",
                 *sets({**_release_values([jobs]), "operator.logLevel": "DEBUG",
                        "webhook.url": "https://127.0.0.1:9443"}))
    assert ca_bundles() == before  # the CA was read back and reused
    dep = json.loads(cluster.kubectl("get", "deploy", f"{rel}-rlpacer", "-n", ns, "-o",
                                     "json").stdout)
    assert container_env(dep)["RLPACER_OPERATOR_LOG_LEVEL"] == "DEBUG"

    cluster.helm("uninstall", rel, "-n", ns)
    selector = f"app.kubernetes.io/instance={rel}"
    for kinds, scope in [
        ("clusterroles,clusterrolebindings,validatingwebhookconfigurations,"
         "mutatingwebhookconfigurations", []),
        ("deployments,services,secrets,configmaps,serviceaccounts,roles,rolebindings", ["-A"]),
    ]:
        left = cluster.kubectl("get", kinds, "-l", selector, *scope, "-o", "name").stdout
        assert left.strip() == "", left
    # CRDs stay (Helm never deletes crds/), so users' jobs and policies survive.
    for name in ("rltrainingjobs.rlpacer.io", "rltrainingpolicies.rlpacer.io",
                 "clusterrltrainingpolicies.rlpacer.io"):
        cluster.kubectl("get", "crd", name)


def test_crds_upgrade_with_server_side_apply(cluster: LocalCluster, namespace: str) -> None:
    """The documented upgrade path: `kubectl apply --server-side --force-conflicts -f crds/`
    over an older CRD that holds live objects."""
    path = CHART / "crds" / "rlpacer.io_rltrainingpolicies.yaml"
    new = yaml.safe_load(path.read_text())
    old = json.loads(json.dumps(new))
    version = old["spec"]["versions"][0]
    del version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["defaults"]
    version["additionalPrinterColumns"] = version["additionalPrinterColumns"][:1]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=old-chart",
                    "-f", "-", input=yaml.safe_dump(old))
    cluster.kubectl("wait", "--for=condition=Established", "crd/" + new["metadata"]["name"])
    policy = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
              "metadata": {"name": "p", "namespace": namespace},
              "spec": {"action": "Warn", "stepTimeSLO": {"maxSeconds": 60}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))

    r = cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    assert "serverside-applied" in r.stdout
    live = json.loads(cluster.kubectl("get", "crd", new["metadata"]["name"], "-o", "json").stdout)
    assert "defaults" in live["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"]["spec"]["properties"]
    # The old object is intact, and the new field is now stored rather than pruned.
    policy["spec"]["defaults"] = {"ttlSecondsAfterFinished": 60}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))
    got = json.loads(cluster.kubectl("get", "rltp", "p", "-n", namespace, "-o", "json").stdout)
    assert got["spec"]["stepTimeSLO"] == {"maxSeconds": 60}
    assert got["spec"]["defaults"] == {"ttlSecondsAfterFinished": 60}
