"""The pods the operator's builders make are admitted by the real API server under the
"restricted" Pod Security Standard, and the same pods without the builders' security settings
are not (so this fails if the hardening does nothing).

Pods (the driver, and one Pod built from each StatefulSet's template) go through server-side
dry-run create in a namespace that enforces ``restricted`` (version ``latest``); the
StatefulSets themselves are only warned about by Pod Security admission, so their warnings are
checked as well. The driver Pod is also created for real.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rlpacer.api import contract
from rlpacer.api.job import load_manifest
from rlpacer.operator import builders
from rlpacer.testing import LocalCluster
from rlpacer.testing.cluster import ClusterError

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PSS = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
    "pod-security.kubernetes.io/warn": "restricted",
    "pod-security.kubernetes.io/warn-version": "latest",
}
VIOLATES = 'violates PodSecurity "restricted:latest"'
WOULD_VIOLATE = 'would violate PodSecurity "restricted:latest"'


def _children(namespace: str, claim: str | None) -> list[dict[str, Any]]:
    spec = load_manifest(ROOT / "examples" / "rltrainingjob.yaml").spec
    if claim:
        spec = spec.model_copy(
            update={"checkpoint": spec.checkpoint.model_copy(update={"volume_claim": claim})})
    inputs = builders.BuildInputs(
        name="hard", namespace=namespace, uid="00000000-0000-0000-0000-000000000001",
        spec=spec, attempt=0, rollout_replicas=2, report_url="http://op.rlpacer-system.svc:8080")
    return builders.build_children(inputs)


def _pod_from_template(sts: dict[str, Any]) -> dict[str, Any]:
    tpl = sts["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{sts['metadata']['name']}-0",
            "namespace": sts["metadata"]["namespace"],
            "labels": {**tpl["metadata"]["labels"], builders.POD_INDEX_LABEL: "0"},
        },
        "spec": copy.deepcopy(tpl["spec"]),
    }


def _unhardened(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The pod spec without any of the builders' security settings."""
    out = copy.deepcopy(pod_spec)
    out.pop("securityContext", None)
    out.pop("automountServiceAccountToken", None)
    for c in out["containers"]:
        c.pop("securityContext", None)
    return out


def _create(cluster: LocalCluster, obj: dict[str, Any], *, dry_run: bool = True
            ) -> tuple[int, str]:
    args = ["create", "-f", "-", "-o", "name"]
    if dry_run:
        args.append("--dry-run=server")
    r = cluster.kubectl(*args, input=json.dumps(obj), check=False)
    return r.returncode, r.stderr


@pytest.fixture
def restricted(cluster: LocalCluster, namespace: str) -> str:
    cluster.kubectl("label", "namespace", namespace, *(f"{k}={v}" for k, v in PSS.items()))
    return namespace


@pytest.mark.parametrize("claim", [None, "ckpt"], ids=["emptydir", "claim"])
def test_builders_pods_are_admitted_as_restricted(
    cluster: LocalCluster, restricted: str, claim: str | None
) -> None:
    children = _children(restricted, claim)
    workloads = [c for c in children if c["kind"] in ("Pod", "StatefulSet")]
    roles = {c["metadata"]["labels"][contract.LABEL_ROLE] for c in workloads}
    assert roles == {r.value for r in contract.Role}

    for obj in workloads:
        pods = [obj] if obj["kind"] == "Pod" else [_pod_from_template(obj)]
        if obj["kind"] == "StatefulSet":
            rc, err = _create(cluster, obj)
            assert rc == 0, err
            assert "PodSecurity" not in err, err
            # control: the same StatefulSet without the settings is warned about
            bare = copy.deepcopy(obj)
            bare["spec"]["template"]["spec"] = _unhardened(obj["spec"]["template"]["spec"])
            rc, err = _create(cluster, bare)
            assert rc == 0 and WOULD_VIOLATE in err, err
        for pod in pods:
            name = pod["metadata"]["name"]
            rc, err = _create(cluster, pod)
            assert rc == 0, f"{name} refused under restricted: {err}"
            assert "Warning" not in err, err
            # control: without the builders' security settings the API server refuses it
            bare = copy.deepcopy(pod)
            bare["spec"] = _unhardened(pod["spec"])
            rc, err = _create(cluster, bare)
            assert rc != 0 and VIOLATES in err, f"{name} admitted without hardening: {err}"
            for what in ("allowPrivilegeEscalation", "runAsNonRoot", "seccompProfile",
                         "capabilities"):
                assert what in err, err

    # each setting matters on its own: dropping one of them is refused
    driver = next(c for c in workloads if c["kind"] == "Pod")
    for drop in ("allowPrivilegeEscalation", "capabilities", "runAsNonRoot", "seccompProfile"):
        bare = copy.deepcopy(driver)
        bare["spec"]["securityContext"].pop(drop, None)
        bare["spec"]["containers"][0]["securityContext"].pop(drop, None)
        rc, err = _create(cluster, bare)
        assert rc != 0 and VIOLATES in err, f"admitted without {drop}: {err}"

    # and the driver Pod is really created (owner reference dropped: the job does not exist)
    real = copy.deepcopy(driver)
    real["metadata"].pop("ownerReferences")
    rc, err = _create(cluster, real, dry_run=False)
    assert rc == 0, err
    got = json.loads(cluster.kubectl("get", "pod", "-n", restricted,
                                     real["metadata"]["name"], "-o", "json").stdout)
    assert got["spec"]["automountServiceAccountToken"] is False
    # the ServiceAccount admission mounted no API token
    assert not any(v["name"].startswith("kube-api-access") for v in got["spec"]["volumes"])
    assert not any(m["mountPath"].startswith("/var/run/secrets/kubernetes.io")
                   for m in got["spec"]["containers"][0]["volumeMounts"])
    token = next(v for v in got["spec"]["volumes"] if "secret" in v)
    assert token["secret"]["defaultMode"] == 0o440


def test_restricted_namespace_really_enforces(cluster: LocalCluster, restricted: str) -> None:
    """Sanity of the control: a root pod with nothing set is refused outright."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "plain", "namespace": restricted},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    with pytest.raises(ClusterError, match="PodSecurity"):
        cluster.kubectl("create", "-f", "-", "--dry-run=server", input=json.dumps(pod))
