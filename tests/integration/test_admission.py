"""The policy webhooks end to end on the real API server: the chart (loopback URL mode,
Helm-generated certificate) registers them; the admission handlers run in a Kopf operator
in this process, authenticated with the chart's ServiceAccount token and serving TLS with the
certificate from the chart's Secret; users' requests go through kubectl.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from rlpacer.api import policy as policy_api
from rlpacer.operator.admission import (
    DEFAULTED_BY,
    ClusterPolicyLister,
    PolicyAdmission,
    PolicyLister,
    configure,
)
from rlpacer.testing import LocalCluster
from rlpacer.testing.cluster import free_ports, repo_root

pytestmark = pytest.mark.integration

CHART = repo_root() / "charts" / "rlpacer"


# The webhook here reads policies through the official client (the operator reads them
# with its own): the admission logic, not the listing, is under test.
def kubernetes_lister(api_client: Any) -> PolicyLister:
    """A :data:`PolicyLister` over the ``kubernetes`` client (blocking calls in a thread)."""
    from kubernetes import client as k8s

    api = k8s.CustomObjectsApi(api_client)

    def _list(namespace: str) -> list[Mapping[str, Any]]:
        out: Any = api.list_namespaced_custom_object(
            policy_api.GROUP, policy_api.VERSION, namespace, policy_api.PLURAL
        )
        return list(out.get("items", []))

    async def lister(namespace: str) -> Sequence[Mapping[str, Any]]:
        return await asyncio.to_thread(_list, namespace)

    return lister


def kubernetes_cluster_lister(api_client: Any) -> ClusterPolicyLister:
    """A :data:`ClusterPolicyLister` over the ``kubernetes`` client (needs list
    clusterrltrainingpolicies and get namespaces: the chart's cluster-scope RBAC)."""
    from kubernetes import client as k8s

    custom = k8s.CustomObjectsApi(api_client)
    core = k8s.CoreV1Api(api_client)

    def _list(namespace: str) -> tuple[list[Mapping[str, Any]], dict[str, str]]:
        out: Any = custom.list_cluster_custom_object(
            policy_api.GROUP, policy_api.VERSION, policy_api.CLUSTER_PLURAL
        )
        items = list(out.get("items", []))
        if not items:
            return [], {}
        ns: Any = core.read_namespace(namespace)
        return items, dict(ns.metadata.labels or {})

    async def lister(namespace: str) -> tuple[Sequence[Mapping[str, Any]], Mapping[str, str]]:
        return await asyncio.to_thread(_list, namespace)

    return lister


@dataclass
class Setup:
    cluster: LocalCluster
    release: str
    system: str  # the release namespace
    jobs: str  # the watched namespace
    stop: threading.Event
    thread: threading.Thread

    def apply(self, obj: dict[str, Any], check: bool = True) -> Any:
        return self.cluster.kubectl("apply", "-f", "-", input=json.dumps(obj), check=check)

    def get(self, kind: str, name: str) -> dict[str, Any]:
        out = self.cluster.kubectl("get", kind, name, "-n", self.jobs, "-o", "json").stdout
        return dict(json.loads(out))


def job(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": {"source": "builtin://tiny-adder"},
                            "data": {"source": "builtin://adder"}, "steps": 5,
                            "promptsPerStep": 2}
    base.update(spec)
    return {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingJob",
            "metadata": {"name": name, "namespace": ns}, "spec": base}


def policy(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}


def _connection(kubeconfig: Path, namespace: str) -> kopf.ConnectionInfo:
    kc = yaml.safe_load(kubeconfig.read_text())
    cl = kc["clusters"][0]["cluster"]
    user = kc["users"][0]["user"]
    ca = cl.get("certificate-authority-data")
    return kopf.ConnectionInfo(
        server=cl["server"],
        ca_data=base64.b64decode(ca) if ca else None,
        ca_path=None if ca else cl.get("certificate-authority"),
        scheme="Bearer", token=user["token"], default_namespace=namespace,
    )


def _run_operator(kubeconfig: Path, namespace: str, port: int, cert_dir: Path,
                  stop: threading.Event, ready: threading.Event) -> None:
    from kubernetes import config as k8s_config

    registry = kopf.OperatorRegistry()
    api_client = k8s_config.new_client_from_config(config_file=str(kubeconfig))
    PolicyAdmission(kubernetes_lister(api_client),
                    kubernetes_cluster_lister(api_client)).register(registry)

    @kopf.on.login(registry=registry)
    def _login(**_: Any) -> kopf.ConnectionInfo:
        return _connection(kubeconfig, namespace)

    @kopf.on.startup(registry=registry)
    def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings, host="127.0.0.1", port=port, cert_dir=cert_dir)
        settings.scanning.disabled = True  # no namespace/CRD watching rights, none needed

    asyncio.run(kopf.operator(registry=registry, namespaces=[namespace], standalone=True,
                              stop_flag=stop, ready_flag=ready))


def _wait_tls(port: int, cafile: Path, timeout: float = 60) -> None:
    ctx = ssl.create_default_context(cafile=str(cafile))
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s, \
                    ctx.wrap_socket(s, server_hostname="127.0.0.1"):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


@pytest.fixture(scope="module")
def setup(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    suffix = uuid.uuid4().hex[:6]
    rel, system, jobs = f"adm-{suffix}", f"adm-sys-{suffix}", f"adm-jobs-{suffix}"
    (port,) = free_ports(1)
    cluster.create_namespace(system)
    cluster.create_namespace(jobs, labels={"rlpacer-test/tier": f"t-{suffix}"})
    stop, ready = threading.Event(), threading.Event()
    thread: threading.Thread | None = None
    try:
        # Cluster scope (cluster policies need it), with the webhooks narrowed to this
        # module's namespace so no other test meets them.
        only_jobs = [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": [jobs]}]
        cluster.helm(
            "install", rel, str(CHART), "-n", system, "--wait=false",
            "--set-json", f"webhook.namespaceSelectorExpressions={json.dumps(only_jobs)}",
            "--set", f"webhook.url=https://127.0.0.1:{port}",
        )
        # The operator's certificate is the one the chart generated (its CA is the caBundle).
        secret = json.loads(cluster.kubectl("get", "secret", f"{rel}-rlpacer-webhook-tls",
                                            "-n", system, "-o", "json").stdout)
        cert_dir = tmp_path_factory.mktemp("webhook-tls")
        for key in ("tls.crt", "tls.key", "ca.crt"):
            (cert_dir / key).write_bytes(base64.b64decode(secret["data"][key]))
        kubeconfig = cluster.kubeconfig_for_service_account(system, f"{rel}-rlpacer")
        thread = threading.Thread(target=_run_operator, daemon=True,
                                  args=(kubeconfig, jobs, port, cert_dir, stop, ready))
        thread.start()
        assert ready.wait(60), "the operator did not start"
        _wait_tls(port, cert_dir / "ca.crt")
        yield Setup(cluster, rel, system, jobs, stop, thread)
    finally:
        cluster.kubectl("delete", "crltp", "-l", f"rlpacer-test/run={suffix}",
                        "--ignore-not-found", check=False)
        stop.set()
        if thread is not None:
            thread.join(30)
        cluster.helm("uninstall", rel, "-n", system, check=False)
        cluster.delete_namespace(jobs)
        cluster.delete_namespace(system)


STRICT = {"stragglerSLO": {"maxTargetStragglerRate": "0.25"},
          "groupSizes": {"allowed": [4, 8, 16]},
          "longRounds": {"maxRolloutReplicas": 4}}


def test_a_violating_job_is_rejected_naming_field_limit_and_policy(setup: Setup) -> None:
    setup.apply(policy("strict", setup.jobs, **STRICT))
    r = setup.apply(job("greedy", setup.jobs, groupControl={"targetStragglerRate": "0.4"},
                        tailBatching={"longRound": {"rolloutReplicas": 6}}), check=False)
    assert r.returncode != 0
    err = r.stderr
    assert 'admission webhook "validate.rltrainingjob.rlpacer.io" denied the request' in err
    assert "spec.groupControl.targetStragglerRate: 0.4 breaks <= 0.25" in err
    assert "spec.tailBatching.longRound.rolloutReplicas: 6 breaks <= 4" in err
    assert f"RLTrainingPolicy {setup.jobs}/strict" in err
    # Within the policy: admitted.
    setup.apply(job("modest", setup.jobs, groupControl={"targetStragglerRate": "0.2"}))
    setup.cluster.kubectl("delete", "rltj", "modest", "-n", setup.jobs)
    setup.cluster.kubectl("delete", "rltp", "strict", "-n", setup.jobs)


def test_defaults_are_filled_into_unset_fields(setup: Setup) -> None:
    setup.apply(policy("defaults", setup.jobs, defaults={
        "groupControl": {"candidates": [2, 4, 8], "initial": 4, "targetStragglerRate": "0.1"},
        "ttlSecondsAfterFinished": 3600}))
    r = setup.apply(job("plain", setup.jobs))
    assert "defaults filled in by" in r.stderr  # kubectl prints the webhook's warning
    got = setup.get("rltj", "plain")
    gc = got["spec"]["groupControl"]
    assert (gc["candidates"], gc["initial"], gc["targetStragglerRate"]) == ([2, 4, 8], 4, "0.1")
    assert got["spec"]["ttlSecondsAfterFinished"] == 3600
    assert got["metadata"]["annotations"][DEFAULTED_BY] == "defaults"
    # A job that sets the fields keeps its own values.
    setup.apply(job("own", setup.jobs, groupControl={"candidates": [8, 16], "initial": 8},
                    ttlSecondsAfterFinished=5))
    own = setup.get("rltj", "own")
    assert own["spec"]["groupControl"]["candidates"] == [8, 16]
    assert own["spec"]["ttlSecondsAfterFinished"] == 5
    setup.cluster.kubectl("delete", "rltj", "plain", "own", "-n", setup.jobs)
    setup.cluster.kubectl("delete", "rltp", "defaults", "-n", setup.jobs)


def test_warn_policy_admits_with_a_warning(setup: Setup) -> None:
    setup.apply(policy("gentle", setup.jobs, action="Warn", **STRICT))
    r = setup.apply(job("loose", setup.jobs, groupControl={"targetStragglerRate": "0.4"}))
    assert "policy (Warn): spec.groupControl.targetStragglerRate: 0.4" in r.stderr
    setup.cluster.kubectl("delete", "rltj", "loose", "-n", setup.jobs)
    setup.cluster.kubectl("delete", "rltp", "gentle", "-n", setup.jobs)


def test_self_contradicting_policy_is_rejected(setup: Setup) -> None:
    bad = policy("bad", setup.jobs, **STRICT,
                 defaults={"groupControl": {"targetStragglerRate": "0.3"}})
    r = setup.apply(bad, check=False)
    assert r.returncode != 0
    assert "looser than stragglerSLO.maxTargetStragglerRate 0.25" in r.stderr


def test_tightened_policy_never_blocks_metadata_updates_or_deletion(setup: Setup) -> None:
    setup.apply(job("early", setup.jobs, groupControl={"targetStragglerRate": "0.4"}))
    setup.apply(policy("late", setup.jobs, **STRICT))
    c = setup.cluster
    c.kubectl("label", "rltj", "early", "-n", setup.jobs, "team=a")
    c.kubectl("patch", "rltj", "early", "-n", setup.jobs, "--type=merge",
              "-p", '{"metadata": {"finalizers": ["test.rlpacer.io/hold"]}}')
    r = c.kubectl("patch", "rltj", "early", "-n", setup.jobs, "--type=merge",
                  "-p", '{"spec": {"steps": 6}}', check=False)
    assert r.returncode != 0 and "targetStragglerRate" in r.stderr  # a spec change is judged
    c.kubectl("delete", "rltj", "early", "-n", setup.jobs, "--wait=false")
    c.kubectl("patch", "rltj", "early", "-n", setup.jobs, "--type=merge",
              "-p", '{"metadata": {"finalizers": null}}')
    c.kubectl("wait", "--for=delete", "rltj/early", "-n", setup.jobs, "--timeout=30s")
    c.kubectl("delete", "rltp", "late", "-n", setup.jobs)


def test_cluster_policy_governs_the_namespaces_it_selects(setup: Setup) -> None:
    labels = json.loads(setup.cluster.kubectl("get", "ns", setup.jobs, "-o", "json").stdout)[
        "metadata"]["labels"]
    tier = labels["rlpacer-test/tier"]
    run = tier.removeprefix("t-")
    cp = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "ClusterRLTrainingPolicy",
          "metadata": {"name": f"research-{run}", "labels": {"rlpacer-test/run": run}},
          "spec": {"namespaceSelector": {"matchLabels": {"rlpacer-test/tier": tier}},
                   "groupSizes": {"allowed": [4, 8]}}}
    setup.apply(cp)
    r = setup.apply(job("wide", setup.jobs, groupControl={"candidates": [8, 16], "initial": 8}),
                    check=False)
    assert r.returncode != 0
    assert f"spec.groupControl.candidates: [8, 16] (has [16]) breaks groupSizes.allowed [4, 8]" \
           f" of ClusterRLTrainingPolicy research-{run}" in r.stderr
    # A cluster policy is validated by its own webhook.
    bad = json.loads(json.dumps(cp))
    bad["metadata"]["name"] = f"bad-{run}"
    bad["spec"]["defaults"] = {"groupControl": {"candidates": [16]}}
    r = setup.apply(bad, check=False)
    assert r.returncode != 0 and "not in groupSizes.allowed [4, 8]" in r.stderr
    setup.cluster.kubectl("delete", "crltp", f"research-{run}")
    setup.apply(job("wide", setup.jobs, groupControl={"candidates": [8, 16], "initial": 8}))
    setup.cluster.kubectl("delete", "rltj", "wide", "-n", setup.jobs)


def test_zz_operator_down_fails_closed_but_deletion_works(setup: Setup) -> None:
    # Runs last in this module (it stops the operator).
    setup.apply(job("survivor", setup.jobs))
    setup.stop.set()
    setup.thread.join(30)
    assert not setup.thread.is_alive()
    r = setup.apply(job("during-outage", setup.jobs), check=False)
    assert r.returncode != 0
    assert "failed calling webhook" in r.stderr
    setup.cluster.kubectl("label", "rltj", "survivor", "-n", setup.jobs, "still=editable")
    setup.cluster.kubectl("delete", "rltj", "survivor", "-n", setup.jobs)
