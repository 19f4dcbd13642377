"""The real `rlpacer operator` as the chart configures it: installed with `helm install`, run as
a local process (KWOK pods execute nothing) with the environment the chart's Deployment
carries, the certificate the chart's Secret holds (as the kubelet would mount it) and the
chart's ServiceAccount token. It must win its Lease and serve the policy webhooks with no
permission errors: the chart's RBAC is sufficient for what the operator does at start.
"""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlpacer.api import contract
from rlpacer.api.protocol import plan_path
from rlpacer.operator import names
from rlpacer.testing import LocalCluster
from rlpacer.testing.cluster import free_ports, repo_root

pytestmark = pytest.mark.integration

CHART = repo_root() / "charts" / "rlpacer"


def deployment_env(dep: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's env as the kubelet would resolve it (fieldRefs of this pod)."""
    meta = {"metadata.namespace": dep["metadata"]["namespace"], "metadata.name": pod_name}
    out = {}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    for e in c["env"]:
        if "value" in e:
            out[e["name"]] = e["value"]
        else:
            out[e["name"]] = meta[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


@pytest.fixture
def operator_process(cluster: LocalCluster, tmp_path: Path) -> Iterator[dict[str, Any]]:
    suffix = uuid.uuid4().hex[:6]
    rel, system, jobs = f"op-{suffix}", f"op-sys-{suffix}", f"op-jobs-{suffix}"
    metrics, reports, webhook = free_ports(3)
    cluster.create_namespace(system)
    cluster.create_namespace(jobs)
    proc: subprocess.Popen[bytes] | None = None
    log = tmp_path / "operator.log"
    try:
        cluster.helm(
            "install", rel, str(CHART), "-n", system, "--wait=false",
            "--set", "rbac.scope=Namespaced", "--set", f"rbac.watchNamespaces={{{jobs}}}",
            "--set", f"service.ports.metrics={metrics}",
            "--set", f"service.ports.reports={reports}",
            "--set", f"webhook.port={webhook}", "--set", f"webhook.url=https://127.0.0.1:{webhook}",
        )
        dep = json.loads(cluster.kubectl("get", "deploy", f"{rel}-rlpacer", "-n", system,
                                         "-o", "json").stdout)
        env = deployment_env(dep, pod_name=f"{rel}-local")
        # The kubelet's part: mount the Secret at the path the Deployment names (the one
        # serving certificate of the webhooks and of step reports).
        assert (env["RLPACER_OPERATOR_WEBHOOK_CERT_DIR"] == env["RLPACER_OPERATOR_REPORT_CERT_DIR"]
                == "/etc/rlpacer/tls")
        assert "RLPACER_OPERATOR_REPORT_INSECURE_HTTP" not in env
        cert_dir = tmp_path / "tls"
        cert_dir.mkdir()
        secret = json.loads(cluster.kubectl("get", "secret", f"{rel}-rlpacer-webhook-tls", "-n",
                                            system, "-o", "json").stdout)
        for key, value in secret["data"].items():
            (cert_dir / key).write_bytes(base64.b64decode(value))
        env["RLPACER_OPERATOR_WEBHOOK_CERT_DIR"] = str(cert_dir)
        env["RLPACER_OPERATOR_REPORT_CERT_DIR"] = str(cert_dir)
        env["RLPACER_OPERATOR_WEBHOOK_HOST"] = "127.0.0.1"
        env["RLPACER_OPERATOR_REPORT_HOST"] = "127.0.0.1"
        env["RLPACER_OPERATOR_METRICS_HOST"] = "127.0.0.1"
        # ... and the in-cluster credentials: the chart's ServiceAccount token.
        env["RLPACER_OPERATOR_KUBECONFIG"] = str(
            cluster.kubeconfig_for_service_account(system, f"{rel}-rlpacer"))
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("RLPACER_OPERATOR_", "KUBECONFIG"))}
        full_env.update(env)
        proc = subprocess.Popen([sys.executable, "-m", "rlpacer.cli", "operator"],
                                env=full_env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"operator exited:\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        yield {"release": rel, "system": system, "jobs": jobs, "log": log, "env": env,
               "metrics": metrics, "reports": reports, "ca": cert_dir / "ca.crt"}
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        cluster.helm("uninstall", rel, "-n", system, check=False)
        cluster.delete_namespace(jobs)
        cluster.delete_namespace(system)


def test_operator_from_chart_values_serves_the_policy_webhook(
    cluster: LocalCluster, operator_process: dict[str, Any]
) -> None:
    jobs, system = operator_process["jobs"], operator_process["system"]
    lease = json.loads(cluster.kubectl("get", "lease", operator_process["env"][
        "RLPACER_OPERATOR_LEASE_NAME"], "-n", system, "-o", "json").stdout)
    assert lease["spec"]["holderIdentity"] == operator_process["env"]["RLPACER_OPERATOR_IDENTITY"]
    policy = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
              "metadata": {"name": "default", "namespace": jobs},
              "spec": {"stragglerSLO": {"maxTargetStragglerRate": "0.25"}}}
    deadline = time.monotonic() + 30
    while True:  # the webhook server starts once Kopf has discovered the resources
        r = cluster.kubectl("apply", "-f", "-", input=json.dumps(policy), check=False)
        if r.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r.returncode == 0, r.stderr
    job = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingJob",
           "metadata": {"name": "greedy", "namespace": jobs},
           "spec": {"model": {"source": "builtin://tiny-adder"},
                    "data": {"source": "builtin://adder"}, "steps": 3, "promptsPerStep": 2,
                    "groupControl": {"targetStragglerRate": "0.5"}}}
    r = cluster.kubectl("apply", "-f", "-", input=json.dumps(job), check=False)
    assert r.returncode != 0
    assert "spec.groupControl.targetStragglerRate: 0.5 breaks <= 0.25" in r.stderr
    assert f"RLTrainingPolicy {jobs}/default" in r.stderr
    # Nothing the operator needs was refused by RBAC. The one refusal allowed is Kopf's
    # optional discovery (listing namespaces and CRDs), which the chart deliberately does not
    # grant; the operator should turn it off (kopf settings.scanning.disabled), and then this
    # test tolerates nothing.
    # (an HTTP 403, not the digits of a port such as :40375)
    forbidden = [line for line in operator_process["log"].read_text().splitlines()
                 if "Forbidden" in line or re.search(r"(?<![\d:])403(?!\d)", line)]
    unexpected = [
        line for line in forbidden
        if not (("kopf._core.reactor.observation" in line or "kopf._cogs.clients.watching" in line)
                and ("/api/v1/namespaces ->" in line or "/customresourcedefinitions ->" in line))
    ]
    assert unexpected == [], "\n".join(unexpected)[-4000:]


def test_step_reports_are_served_over_tls_with_the_charts_certificate(
    cluster: LocalCluster, operator_process: dict[str, Any]
) -> None:
    """The Helm-generated certificate serves the report port too, and its CA (the Secret's
    ca.crt) is what the operator hands each job in its ConfigMap."""
    jobs = operator_process["jobs"]
    ca = operator_process["ca"].read_text()
    job = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingJob",
           "metadata": {"name": "tls", "namespace": jobs},
           "spec": {"model": {"source": "builtin://tiny-adder"},
                    "data": {"source": "builtin://adder"}, "steps": 3, "promptsPerStep": 2}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(job))
    path = f"/api/v1/namespaces/{jobs}/configmaps/{names.config_map('tls')}"

    def config_map() -> dict[str, Any] | None:
        code, body = cluster.request("GET", path)
        return body if code == 200 else None

    cm = cluster.wait_for(config_map, timeout=60, what="the job's ConfigMap")
    assert cm["data"][contract.REPORT_CA_KEY] == ca
    url = (f"https://127.0.0.1:{operator_process['reports']}"
           f"{plan_path(jobs, 'tls')}")
    ctx = ssl.create_default_context(cafile=str(operator_process["ca"]))
    with pytest.raises(urllib.error.HTTPError) as e:  # TLS verified; no token: 401
        urllib.request.urlopen(url, timeout=10, context=ctx)
    assert e.value.code == 401
