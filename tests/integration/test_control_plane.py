"""The local control plane behaves like a real cluster: scheduling onto KWOK nodes, GPU capacity
and taints, garbage collection, CRD schema validation, RBAC, pod exits, admission webhooks."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from rlpacer.testing import EXIT_ANNOTATION, GPU_RESOURCE, GPU_TOLERATION, LocalCluster

pytestmark = pytest.mark.integration


def _core(c: LocalCluster, kubeconfig: Any = None) -> client.CoreV1Api:
    return client.CoreV1Api(c.api_client(kubeconfig))


def _pod(
    name: str,
    *,
    gpus: int = 0,
    tolerate_gpu: bool = False,
    restart: str = "Never",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    if gpus:
        resources = {
            "requests": {"cpu": "1", GPU_RESOURCE: str(gpus)},
            "limits": {GPU_RESOURCE: str(gpus)},
        }
    spec: dict[str, Any] = {
        "restartPolicy": restart,
        "containers": [
            {"name": "main", "image": "example.invalid/rollout:1", "resources": resources}
        ],
    }
    if tolerate_gpu:
        spec["tolerations"] = [GPU_TOLERATION]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
    }


def _wait_phase(
    c: LocalCluster, ns: str, name: str, phase: str, timeout: float = 60
) -> client.V1Pod:
    core = _core(c)

    def check() -> client.V1Pod | None:
        p = core.read_namespaced_pod(name, ns)
        return p if p.status.phase == phase else None

    pod: client.V1Pod = c.wait_for(check, timeout, f"pod {ns}/{name} to be {phase}")
    return pod


def _unschedulable_message(c: LocalCluster, ns: str, name: str, timeout: float = 60) -> str:
    core = _core(c)

    def check() -> str | None:
        p = core.read_namespaced_pod(name, ns)
        for cond in p.status.conditions or []:
            if (
                cond.type == "PodScheduled"
                and cond.status == "False"
                and cond.reason == "Unschedulable"
            ):
                return str(cond.message)
        return None

    msg: str = c.wait_for(check, timeout, f"scheduler to report {ns}/{name} Unschedulable")
    return msg


def _node_names(c: LocalCluster, gpu: bool) -> set[str]:
    nodes = _core(c).list_node().items
    return {n.metadata.name for n in nodes if (GPU_RESOURCE in (n.status.capacity or {})) == gpu}


def _free_gpus(c: LocalCluster, gpu_nodes: set[str]) -> dict[str, int]:
    """Allocatable GPUs minus what non-terminated pods on each node request."""
    core = _core(c)
    free = {
        n.metadata.name: int(n.status.allocatable[GPU_RESOURCE])
        for n in core.list_node().items
        if n.metadata.name in gpu_nodes
    }
    for p in core.list_pod_for_all_namespaces().items:
        if p.spec.node_name in free and p.status.phase not in ("Succeeded", "Failed"):
            for ctr in p.spec.containers:
                req = (ctr.resources.requests or {}) if ctr.resources else {}
                free[p.spec.node_name] -= int(req.get(GPU_RESOURCE, 0))
    return free


# ------------------------------------------------------------------------------------------


def test_version_reports_pinned_release(cluster: LocalCluster) -> None:
    from rlpacer.testing.cluster import pinned_versions

    want = pinned_versions()["KUBERNETES_VERSION"]
    v = cluster.version()
    assert v["gitVersion"] == want
    assert (v["major"], v["minor"]) == tuple(want.lstrip("v").split(".")[:2])
    # The machine's kubectl sees the same through the admin kubeconfig.
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == want


def test_deployment_pods_are_scheduled_onto_kwok_nodes_and_run(
    cluster: LocalCluster, namespace: str
) -> None:
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "containers": [
                        {
                            "name": "web",
                            "image": "example.invalid/web:1",
                            "resources": {"requests": {"cpu": "100m"}},
                        }
                    ]
                },
            },
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    cluster.kubectl(
        "rollout", "status", "-n", namespace, "deployment/web", "--timeout=90s", timeout=120
    )
    pods = _core(cluster).list_namespaced_pod(namespace, label_selector="app=web").items
    assert len(pods) == 3
    cpu_nodes = _node_names(cluster, gpu=False)
    for p in pods:
        assert p.status.phase == "Running"
        # Scheduled by kube-scheduler onto a simulated CPU node (no toleration for GPU nodes).
        assert p.spec.node_name in cpu_nodes
        assert p.status.pod_ip and p.status.container_statuses[0].ready
    dep = client.AppsV1Api(cluster.api_client()).read_namespaced_deployment("web", namespace)
    assert dep.status.ready_replicas == 3 and dep.status.available_replicas == 3


def test_gpu_pods_land_only_on_gpu_nodes_and_wait_when_full(
    cluster: LocalCluster, namespace: str
) -> None:
    core = _core(cluster)
    gpu_nodes = _node_names(cluster, gpu=True)
    assert gpu_nodes, "the cluster should have simulated GPU nodes"
    node_objs = {n.metadata.name: n for n in core.list_node().items}
    for n in gpu_nodes:
        node = node_objs[n]
        assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
        assert "node.kubernetes.io/instance-type" in node.metadata.labels
        assert any(
            t.key == GPU_RESOURCE and t.effect == "NoSchedule" for t in node.spec.taints or []
        )
        assert node.status.allocatable[GPU_RESOURCE] == "8"

    # Without a toleration a GPU pod has nowhere to go: CPU nodes lack GPUs, GPU nodes are tainted.
    core.create_namespaced_pod(namespace, _pod("no-toleration", gpus=1))
    msg = _unschedulable_message(cluster, namespace, "no-toleration")
    assert "untolerated taint" in msg and GPU_RESOURCE in msg, msg

    # With the toleration it runs, on a GPU node.
    core.create_namespaced_pod(namespace, _pod("one-gpu", gpus=1, tolerate_gpu=True))
    pod = _wait_phase(cluster, namespace, "one-gpu", "Running")
    assert pod.spec.node_name in gpu_nodes

    # Fill every GPU node, then one more GPU pod stays Pending until capacity frees up.
    core.delete_namespaced_pod("one-gpu", namespace, grace_period_seconds=0)
    cluster.wait_for(
        lambda: (
            not [
                p for p in core.list_namespaced_pod(namespace).items if p.metadata.name == "one-gpu"
            ]
        ),
        60,
        "one-gpu to be deleted",
    )
    # Take every free GPU (other tests' pods may hold some), node by node.
    free = _free_gpus(cluster, gpu_nodes)
    fillers = {f"filler-{i}": (n, k) for i, (n, k) in enumerate(sorted(free.items())) if k > 0}
    assert fillers, f"no free GPUs left: {free}"
    for f, (node, k) in fillers.items():
        body = _pod(f, gpus=k, tolerate_gpu=True)
        body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
        core.create_namespaced_pod(namespace, body)
    for f, (node, _) in fillers.items():
        assert _wait_phase(cluster, namespace, f, "Running", timeout=90).spec.node_name == node
    assert set(_free_gpus(cluster, gpu_nodes).values()) == {0}
    core.create_namespaced_pod(namespace, _pod("waiting", gpus=1, tolerate_gpu=True))
    msg = _unschedulable_message(cluster, namespace, "waiting")
    assert f"Insufficient {GPU_RESOURCE}" in msg, msg
    time.sleep(2)
    assert core.read_namespaced_pod("waiting", namespace).status.phase == "Pending"
    core.delete_namespaced_pod(next(iter(fillers)), namespace, grace_period_seconds=0)
    pod = _wait_phase(cluster, namespace, "waiting", "Running", timeout=90)
    assert pod.spec.node_name in gpu_nodes
    # Leave GPU capacity free for later tests.
    core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
    cluster.wait_for(
        lambda: not core.list_namespaced_pod(namespace).items, 60, "GPU pods to be deleted"
    )


def test_deleting_an_owner_garbage_collects_dependents(
    cluster: LocalCluster, namespace: str
) -> None:
    core = _core(cluster)
    owner = core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "owner"}, "data": {"k": "v"}}
    )
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "child", "ownerReferences": [ref]}}
    )
    core.create_namespaced_secret(
        namespace,
        {"metadata": {"name": "child-secret", "ownerReferences": [ref]}, "stringData": {"a": "b"}},
    )
    core.delete_namespaced_config_map("owner", namespace)  # background propagation (the default)

    def gone() -> bool:
        names = {c.metadata.name for c in core.list_namespaced_config_map(namespace).items}
        secrets = {s.metadata.name for s in core.list_namespaced_secret(namespace).items}
        return "child" not in names and "child-secret" not in secrets

    cluster.wait_for(gone, 60, "the garbage collector to delete the dependents")

    # A Deployment deleted with foreground propagation takes its ReplicaSet and pods with it.
    apps = client.AppsV1Api(cluster.api_client())
    apps.create_namespaced_deployment(
        namespace,
        {
            "metadata": {"name": "gc"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "gc"}},
                "template": {
                    "metadata": {"labels": {"app": "gc"}},
                    "spec": {"containers": [{"name": "c", "image": "example.invalid/c:1"}]},
                },
            },
        },
    )
    cluster.wait_for(
        lambda: (
            len(
                [
                    p
                    for p in core.list_namespaced_pod(namespace, label_selector="app=gc").items
                    if p.status.phase == "Running"
                ]
            )
            == 2
        ),
        90,
        "2 running pods of gc",
    )
    apps.delete_namespaced_deployment("gc", namespace, propagation_policy="Foreground")
    cluster.wait_for(
        lambda: (
            not apps.list_namespaced_replica_set(namespace).items
            and not core.list_namespaced_pod(namespace, label_selector="app=gc").items
            and not [d for d in apps.list_namespaced_deployment(namespace).items]
        ),
        90,
        "deployment, replicaset and pods to be garbage-collected",
    )


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.rlpacer.io"},
    "spec": {
        "group": "test.rlpacer.io",
        "scope": "Namespaced",
        "names": {
            "plural": "widgets",
            "singular": "widget",
            "kind": "Widget",
            "shortNames": ["wdg"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1, "maximum": 64},
                                    "mode": {"type": "string", "enum": ["Short", "Long"]},
                                },
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.mode != 'Long' || self.size >= 8",
                                        "message": "Long needs size >= 8",
                                    },
                                ],
                            },
                            "status": {
                                "type": "object",
                                "properties": {"phase": {"type": "string"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}


def test_crd_is_served_and_schema_violations_are_rejected(
    cluster: LocalCluster, namespace: str
) -> None:
    ext = client.ApiextensionsV1Api(cluster.api_client())
    try:
        ext.delete_custom_resource_definition(CRD["metadata"]["name"])  # type: ignore[index]
        time.sleep(1)
    except ApiException as e:
        assert e.status == 404
    ext.create_custom_resource_definition(CRD)

    def established() -> bool:
        crd = ext.read_custom_resource_definition("widgets.test.rlpacer.io")
        return any(
            c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
        )

    cluster.wait_for(established, 30, "the CRD to be Established")
    co = client.CustomObjectsApi(cluster.api_client())
    args = ("test.rlpacer.io", "v1", namespace, "widgets")

    def create(spec: dict[str, Any], name: str) -> Any:
        body = {
            "apiVersion": "test.rlpacer.io/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": spec,
        }
        return cluster.wait_for(
            lambda: _try_create(co, args, body), 30, "the widgets resource to be served"
        )

    ok = create({"size": 4, "mode": "Short"}, "good")
    assert ok["spec"]["size"] == 4

    for name, spec, expected in [
        (
            "too-small",
            {"size": 0},
            "spec.size: Invalid value: 0: spec.size in body should be greater than or equal to 1",
        ),
        ("bad-enum", {"size": 2, "mode": "Medium"}, 'spec.mode: Unsupported value: "Medium"'),
        ("missing", {"mode": "Short"}, "spec.size: Required value"),
        ("cel", {"size": 2, "mode": "Long"}, "Long needs size >= 8"),
    ]:
        body = {
            "apiVersion": "test.rlpacer.io/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": spec,
        }
        with pytest.raises(ApiException) as ei:
            co.create_namespaced_custom_object(*args, body)
        assert ei.value.status == 422, ei.value.body
        message = json.loads(ei.value.body)["message"]
        assert expected in message, message

    # The status subresource: spec writes ignore status, /status writes set it.
    co.patch_namespaced_custom_object_status(*args, "good", {"status": {"phase": "Ready"}})
    got = co.get_namespaced_custom_object(*args, "good")
    assert got["status"] == {"phase": "Ready"}
    assert got["metadata"]["generation"] == 1  # status writes do not bump the generation
    # kubectl (1.32) discovers the new kind through the aggregated discovery.
    out = cluster.kubectl("get", "wdg", "-n", namespace, "-o", "name").stdout.split()
    assert out == ["widget.test.rlpacer.io/good"]

    # A watch sees changes.
    w = watch.Watch()
    events: list[str] = []
    rv = co.list_namespaced_custom_object(*args)["metadata"]["resourceVersion"]
    co.patch_namespaced_custom_object(*args, "good", {"spec": {"size": 5}})
    for ev in w.stream(
        co.list_namespaced_custom_object, *args, resource_version=rv, timeout_seconds=10
    ):
        events.append(ev["type"])
        if ev["object"]["spec"]["size"] == 5:
            w.stop()
    assert "MODIFIED" in events
    ext.delete_custom_resource_definition("widgets.test.rlpacer.io")


def _try_create(co: client.CustomObjectsApi, args: tuple[str, ...], body: dict[str, Any]) -> Any:
    try:
        return co.create_namespaced_custom_object(*args, body)
    except ApiException as e:
        if e.status == 404:  # discovery/handler not ready yet right after Established
            return None
        raise


def test_service_account_gets_exactly_rbac_rights(cluster: LocalCluster, namespace: str) -> None:
    cluster.create_service_account(namespace, "nobody")
    kc = cluster.kubeconfig_for_service_account(namespace, "nobody")
    core = _core(cluster, kc)
    with pytest.raises(ApiException) as ei:
        core.list_namespaced_pod(namespace)
    assert ei.value.status == 403
    msg = json.loads(ei.value.body)["message"]
    assert f'User "system:serviceaccount:{namespace}:nobody" cannot list resource "pods"' in msg, (
        msg
    )
    # The same through the raw API with the bearer token, and kubectl with the kubeconfig.
    token = cluster.service_account_token(namespace, "nobody")
    status, _ = cluster.request("GET", f"/api/v1/namespaces/{namespace}/secrets", token=token)
    assert status == 403
    assert (
        cluster.kubectl(
            "auth", "can-i", "list", "pods", "-n", namespace, kubeconfig=kc, check=False
        ).stdout.strip()
        == "no"
    )

    # Grant list on pods in this namespace only: now allowed there, still denied elsewhere.
    rbac = client.RbacAuthorizationV1Api(cluster.api_client())
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}],
        },
    )
    cluster.wait_for(lambda: _allowed(core, namespace), 30, "the RoleBinding to take effect")
    with pytest.raises(ApiException) as ei:
        core.list_namespaced_pod("default")
    assert ei.value.status == 403
    with pytest.raises(ApiException) as ei:
        core.list_namespaced_secret(namespace)
    assert ei.value.status == 403


def _allowed(core: client.CoreV1Api, ns: str) -> bool:
    try:
        core.list_namespaced_pod(ns)
        return True
    except ApiException as e:
        if e.status == 403:
            return False
        raise


def test_pods_exit_on_demand_succeeded_or_failed(cluster: LocalCluster, namespace: str) -> None:
    core = _core(cluster)
    for name in ("ok", "bad"):
        core.create_namespaced_pod(namespace, _pod(name))
        _wait_phase(cluster, namespace, name, "Running")
    time.sleep(1)
    assert (
        core.read_namespaced_pod("ok", namespace).status.phase == "Running"
    )  # no exit without the mark

    cluster.mark_pod_exit(namespace, "ok", 0)
    cluster.mark_pod_exit(namespace, "bad", 3)
    ok = _wait_phase(cluster, namespace, "ok", "Succeeded")
    term = ok.status.container_statuses[0].state.terminated
    assert term.exit_code == 0 and term.reason == "Completed"
    bad = _wait_phase(cluster, namespace, "bad", "Failed")
    term = bad.status.container_statuses[0].state.terminated
    assert term.exit_code == 3 and term.reason == "Error"

    # A Job sees its pod's outcome: the job controller marks the Job Complete.
    batch = client.BatchV1Api(cluster.api_client())
    batch.create_namespaced_job(
        namespace,
        {
            "metadata": {"name": "once"},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "c", "image": "example.invalid/c:1"}],
                    }
                },
            },
        },
    )
    pod_name = cluster.wait_for(
        lambda: next(
            (
                p.metadata.name
                for p in core.list_namespaced_pod(namespace, label_selector="job-name=once").items
                if p.status.phase == "Running"
            ),
            None,
        ),
        60,
        "the Job's pod to run",
    )
    time.sleep(1)
    job = batch.read_namespaced_job("once", namespace)
    assert not job.status.succeeded  # KWOK does not complete Job pods by itself here
    core.patch_namespaced_pod(
        pod_name, namespace, {"metadata": {"annotations": {EXIT_ANNOTATION: "0"}}}
    )

    def complete() -> bool:
        j = batch.read_namespaced_job("once", namespace)
        return any(c.type == "Complete" and c.status == "True" for c in j.status.conditions or [])

    cluster.wait_for(complete, 60, "the Job to be Complete")
