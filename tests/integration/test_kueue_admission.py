"""Jobs admitted through Kueue (spec.scheduling.queueName) on the real local control plane.

Kueue is the real controller manager, built from its Go module at the version pinned in
hack/versions.env, with its own admission webhooks registered (so every Workload the operator
makes passes Kueue's validation and defaulting); the operator is ``rlpacer operator`` as a
process; pods run on KWOK GPU nodes (8 GPUs each). ClusterQueues here cover only
``nvidia.com/gpu``, so the GPU counts decide who is admitted.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart_alerts import KUEUE_SERIES
from test_operator import (  # noqa: F401 (fixtures)
    Driver,
    OperatorProc,
    _sample,
    apply,
    bound_claim,
    crds,
    get,
    kube_events,
    report,
    small_job,
    status,
    token,
    wait,
)

from rlpacer.operator import names, queue
from rlpacer.testing.cluster import LocalCluster
from rlpacer.testing.kueue import GROUP, KueueProc

pytestmark = pytest.mark.integration

KUEUE = f"/apis/{queue.API_VERSION}"
CHART = Path(__file__).resolve().parents[2] / "charts" / "rlpacer"
FLAVOR_LABEL = "node.kubernetes.io/instance-type"
#: seconds for a job's driver pod to be admitted, created and running: 10-50 s alone, once
#: over 90 s beside the e2e tier and the dev cluster's tests on 2 cores (a bound only: a
#: job that never runs still fails the test)
RUNNING_S = 180
CQS: list[str] = []


def _kueue_crds(cluster: LocalCluster) -> list[str]:
    out = cluster.kubectl("get", "crd", "-o", "name").stdout.split()
    return [c for c in out if c.endswith("." + GROUP)]


def _remove_kueue(cluster: LocalCluster) -> None:
    """Kueue's CRDs gone (an earlier run on a cluster started by hand left them): the
    objects' finalizers first, which only Kueue's controllers would remove."""
    for crd in _kueue_crds(cluster):
        resource = crd.split("/", 1)[1]
        listed = cluster.kubectl("get", resource, "-A", "-o", "json", check=False)
        for item in (json.loads(listed.stdout or "{}").get("items") or []):
            meta = item["metadata"]
            where = ["-n", meta["namespace"]] if meta.get("namespace") else []
            cluster.kubectl("patch", resource, meta["name"], *where, "--type=merge",
                            "-p", '{"metadata":{"finalizers":null}}', check=False)
        cluster.kubectl("delete", crd, "--wait=true")


@pytest.mark.usefixtures("crds")
def test_a_job_that_names_a_queue_without_kueue_installed_gets_a_condition_and_no_pods(
    cluster: LocalCluster, namespace: str
) -> None:
    # before this module's Kueue: a cluster without Kueue's API
    _remove_kueue(cluster)
    op = OperatorProc(cluster, namespace).start()
    op.wait_ready()
    try:
        apply(cluster, gpu_job("nok", namespace, "lq"))
        st = wait(cluster, lambda: (s := status(cluster, namespace, "nok")).get("summary")
                  == "Queued" and s, "Queued")
        cond = _cond(st, "QueueAdmitted")
        assert cond["status"] == "False" and cond["reason"] == "KueueNotInstalled", cond
        assert "Kueue is not installed" in cond["message"], cond
        assert "spec.scheduling.queueName" in cond["message"], cond
        assert _pods(cluster, namespace, "nok") == []
        assert get(cluster, _sts_path(namespace, "nok", "rollout")) is None
    finally:
        op.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def kueue(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[KueueProc]:
    request.getfixturevalue("crds")  # the operator's CRDs
    k = KueueProc(cluster).start()
    try:
        yield k
    finally:
        for cq in CQS:
            cluster.kubectl("delete", "clusterqueue", cq, "--ignore-not-found", "--wait=false")
        k.stop()


@pytest.fixture
def operator(cluster: LocalCluster, kueue: KueueProc, namespace: str) -> Iterator[OperatorProc]:
    """The operator with exactly the chart's RBAC (``kueue.enabled=true``): its
    ServiceAccount and roles rendered by ``helm template`` and applied, its kubeconfig that
    account's token."""
    name = f"rlpk-{namespace[-6:]}"
    out = cluster.helm("template", name, str(CHART), "--namespace", namespace,
                       "--show-only", "templates/rbac.yaml",
                       "--show-only", "templates/serviceaccount.yaml",
                       "--set", "kueue.enabled=true", "--set", f"fullnameOverride={name}",
                       "--set", "rbac.aggregateToDefaultRoles=false")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert any(d["kind"] == "ClusterRole" and d["metadata"]["name"] == f"{name}-kueue-reader"
               for d in docs)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": docs}))
    sa = next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    # the chart's setting with kueue.enabled: the jobs' Workloads watched
    env = next(d for d in yaml.safe_load_all(cluster.helm(
        "template", name, str(CHART), "--namespace", namespace, "--show-only",
        "templates/deployment.yaml", "--set", "kueue.enabled=true").stdout) if d)
    names_set = {e["name"] for e in
                 env["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "RLPACER_OPERATOR_KUEUE" in names_set
    # a resync as slow as a cluster's: what moves a queued job is the watch of its Workloads
    op = OperatorProc(cluster, namespace, lease=name, extra_args=("--kueue",), resync_seconds=60,
                      kubeconfig=cluster.kubeconfig_for_service_account(namespace, sa)).start()
    op.wait_ready()
    try:
        yield op
    finally:
        op.kill(signal.SIGTERM)
        for d in docs:
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"],
                                "--ignore-not-found")


# --- helpers -------------------------------------------------------------------------------


def gpu_job(name: str, ns: str, queue_name: str, **spec: Any) -> dict[str, Any]:
    """A job of 2 GPUs (one rollout replica, one learner) in ``queue_name``."""
    base = {"scheduling": {"queueName": queue_name},
            "rollout": {"replicas": 1, "gpusPerReplica": 1, "maxResponseTokens": 1024},
            "trainer": {"replicas": 1, "gpusPerReplica": 1}}
    return small_job(name, ns, **{**base, **spec})


def setup_queues(cluster: LocalCluster, ns: str, gpus: int, *, cq: str | None = None,
                 preempt: bool = False, lq: str = "lq", flavor: str = "h100",
                 cohort: str | None = None, fair_sharing: bool = False) -> str:
    """A ResourceFlavor for the KWOK GPU nodes, a ClusterQueue of ``gpus`` GPUs and a
    LocalQueue ``lq`` in ``ns`` pointing at it. Returns the ClusterQueue's name."""
    cq = cq or f"cq-{ns}"[:63]
    CQS.append(cq)
    spec: dict[str, Any] = {
        "namespaceSelector": {},
        "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
            {"name": flavor, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}],
    }
    if preempt:
        spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
    if cohort:
        spec["cohortName"] = cohort
    if fair_sharing:  # read when Kueue first sees the ClusterQueue: a later patch is ignored
        spec["admissionScope"] = {"admissionMode": "UsageBasedAdmissionFairSharing"}
    items = [
        {"apiVersion": queue.API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": flavor},
         "spec": {"nodeLabels": {FLAVOR_LABEL: "p5.48xlarge"}}},
        {"apiVersion": queue.API_VERSION, "kind": "ClusterQueue", "metadata": {"name": cq},
         "spec": spec},
        {"apiVersion": queue.API_VERSION, "kind": "LocalQueue",
         "metadata": {"name": lq, "namespace": ns}, "spec": {"clusterQueue": cq}},
    ]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": items}))
    wait(cluster, lambda: _cq_active(cluster, cq), f"ClusterQueue {cq} active")
    return cq


def _cq_active(cluster: LocalCluster, cq: str) -> bool:
    obj = get(cluster, f"{KUEUE}/clusterqueues/{cq}") or {}
    return any(c.get("type") == "Active" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def _cond(st: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in st.get("conditions") or []:
        if c["type"] == type_:
            return c  # type: ignore[no-any-return]
    raise AssertionError(f"no {type_} condition in {st.get('conditions')}")


def _wl(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any] | None:
    return get(cluster, f"{KUEUE}/namespaces/{ns}/workloads/{name}")


def _wl_cond(wl: dict[str, Any] | None, type_: str) -> str | None:
    for c in ((wl or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return str(c.get("status"))
    return None


def _pods(cluster: LocalCluster, ns: str, job: str) -> list[dict[str, Any]]:
    sel = ",".join(f"{k}={v}" for k, v in names.selector(job).items())
    body = get(cluster, f"/api/v1/namespaces/{ns}/pods?labelSelector={sel}") or {}
    return body.get("items") or []


def _sts_path(ns: str, job: str, role: str) -> str:
    return f"/apis/apps/v1/namespaces/{ns}/statefulsets/{job}-{role}"


def _driver_running(cluster: LocalCluster, ns: str, job: str, attempt: int) -> bool:
    pod = get(cluster, f"/api/v1/namespaces/{ns}/pods/{names.driver_pod(job, attempt)}")
    return bool(pod and pod.get("status", {}).get("phase") == "Running")


def _cluster_queue_usage(cluster: LocalCluster, cq: str) -> int:
    obj = get(cluster, f"{KUEUE}/clusterqueues/{cq}") or {}
    total = 0
    for fu in (obj.get("status") or {}).get("flavorsReservation") or []:
        for r in fu.get("resources") or []:
            if r.get("name") == "nvidia.com/gpu":
                total += int(r.get("total") or 0)
    return total


# --- tests ---------------------------------------------------------------------------------


def test_a_job_waits_for_quota_runs_on_its_flavor_and_gives_the_quota_back_when_done(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    cq = setup_queues(cluster, namespace, gpus=2)
    apply(cluster, gpu_job("qa", namespace, "lq"))
    st = wait(cluster, lambda: (s := status(cluster, namespace, "qa")).get("summary")
              in ("Starting", "Running") and s, "qa admitted and started")
    cond = _cond(st, "QueueAdmitted")
    assert cond["status"] == "True" and cond["reason"] == "AdmittedByKueue", cond
    assert cq in cond["message"] and "h100" in cond["message"], cond
    # the Workload: one pod set per role, counted as the job runs, owned by the job
    wl = _wl(cluster, namespace, queue.workload_name("qa"))
    assert wl is not None
    counts = {ps["name"]: ps["count"] for ps in wl["spec"]["podSets"]}
    assert counts == {"head": 1, "learner": 1, "rollout": 1, "driver": 1}, counts
    assert wl["spec"]["queueName"] == "lq"
    assert wl["metadata"]["ownerReferences"][0]["kind"] == "RLTrainingJob"
    wait(cluster, lambda: _cluster_queue_usage(cluster, cq) == 2,
         "2 GPUs in use in cq")
    # the admitted flavor's node labels are on the GPU pods
    wait(cluster, lambda: len(_pods(cluster, namespace, "qa")) == 4, "qa's 4 pods")
    for pod in _pods(cluster, namespace, "qa"):
        role = pod["metadata"]["labels"]["rlpacer.io/role"]
        sel = pod["spec"].get("nodeSelector") or {}
        if role in ("learner", "rollout"):
            assert sel.get(FLAVOR_LABEL) == "p5.48xlarge", (role, sel)
        # no per-pod queue label: Kueue's pod integration would gate them a second time
        assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"]

    # a second job of 2 GPUs waits: Queued, Kueue's reason, no pod
    apply(cluster, gpu_job("qb", namespace, "lq"))
    st = wait(cluster, lambda: (s := status(cluster, namespace, "qb")).get("summary")
              == "Queued" and "quota" in _cond(s, "QueueAdmitted")["message"] and s,
              "qb queued on quota")
    assert _cond(st, "QueueAdmitted")["reason"] == "WaitingForQueue"
    assert _pods(cluster, namespace, "qb") == []
    assert get(cluster, _sts_path(namespace, "qb", "rollout")) is None
    assert st.get("startTime") is None and st.get("attempt", 0) == 0
    # the series the dashboard's Kueue panels plot
    wait(cluster, lambda: _sample(operator.metrics(), "rlpacer_job_queued",
                                  namespace=namespace, job="qb") == 1, "qb queued (metric)")
    # waiting costs no polling: the Workloads are watched (30 s safety net, not every 2 s).
    # Measured once qa's pods have settled (their events start passes of qa, which read
    # Workloads too); polled, qb alone would make 10 GETs in these 10 s
    wait(cluster, lambda: _driver_running(cluster, namespace, "qa", 0), "qa driver running",
         RUNNING_S)
    wait(cluster, lambda: (get(cluster, _sts_path(namespace, "qa", "rollout")) or {})
         .get("status", {}).get("readyReplicas") == 1, "qa's rollout ready", 60)
    time.sleep(2)
    gets = _sample(operator.metrics(), "rlpacer_kube_requests_total", verb="GET",
                   resource="workloads")
    time.sleep(10)
    more = _sample(operator.metrics(), "rlpacer_kube_requests_total", verb="GET",
                   resource="workloads") - gets
    assert more <= 4, f"{more} GETs of workloads in 10 s while qb waits"
    assert _sample(operator.metrics(), "rlpacer_job_queued", namespace=namespace,
                   job="qa") == 0

    # qa completes: its Workload Finished, the quota goes to qb, which starts as attempt 0
    wait(cluster, lambda: _driver_running(cluster, namespace, "qa", 0), "qa driver running",
         RUNNING_S)
    cluster.mark_pod_exit(namespace, names.driver_pod("qa", 0), 0)
    wait(cluster, lambda: status(cluster, namespace, "qa").get("summary") == "Succeeded",
         "qa Succeeded")
    wait(cluster, lambda: _wl_cond(_wl(cluster, namespace, queue.workload_name("qa")),
                                   "Finished") == "True", "qa's Workload Finished")
    st = wait(cluster, lambda: (s := status(cluster, namespace, "qb")).get("summary")
              in ("Starting", "Running") and s, "qb admitted after qa", 60)
    assert st["attempt"] == 0 and st.get("startTime")
    # qb's wait was seen (qa's admission came before its first look: not counted)
    assert _sample(operator.metrics(), "rlpacer_queue_wait_seconds_count",
                   namespace=namespace, workload="job") >= 1
    wait(cluster, lambda: len(_pods(cluster, namespace, "qb")) == 4, "qb's pods")
    wait(cluster, lambda: _cluster_queue_usage(cluster, cq) == 2,
         "2 GPUs in use in cq")


def _priority_classes(cluster: LocalCluster) -> None:
    for name, value in (("rlpacer-test-low", 100), ("rlpacer-test-high", 1000)):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
             "metadata": {"name": name}, "value": value}))


def test_a_higher_priority_job_preempts_and_the_evicted_job_resumes_with_its_state(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    _priority_classes(cluster)
    cq = setup_queues(cluster, namespace, gpus=2, preempt=True)
    apply(cluster, gpu_job("low", namespace, "lq",
                           scheduling={"queueName": "lq",
                                       "priorityClassName": "rlpacer-test-low"}))
    wait(cluster, lambda: _driver_running(cluster, namespace, "low", 0), "low running", RUNNING_S)
    assert _wl(cluster, namespace, queue.workload_name("low"))["spec"]["priority"] == 100
    drv = Driver(operator, namespace, "low", token(cluster, namespace, "low"))
    g = drv.plan()["groupSize"]
    for step in range(3):
        code, plan = drv.post(report(step, g, 150.0))
        assert code == 200, plan
        g = plan["groupSize"]
    before = status(cluster, namespace, "low")
    assert before["step"] == 3

    apply(cluster, gpu_job("high", namespace, "lq",
                           scheduling={"queueName": "lq",
                                       "priorityClassName": "rlpacer-test-high"}))
    # Kueue evicts low: its pods go, a report from its driver is refused, its quota goes back
    st = wait(cluster, lambda: (s := status(cluster, namespace, "low")).get("summary")
              == "Queued" and s, "low evicted")
    cond = _cond(st, "QueueAdmitted")
    assert cond["reason"] == "Evicted" and "Preempted" in cond["message"], cond
    code, err = drv.post(report(3, g, 150.0))
    assert code == 409 and err["reason"] == "JobSuspended", err
    assert "held by Kueue (Evicted" in err["message"], err
    wait(cluster, lambda: _pods(cluster, namespace, "low") == [], "low's pods gone")
    wait(cluster, lambda: _wl_cond(_wl(cluster, namespace, queue.workload_name("low")),
                                   "QuotaReserved") == "False", "low's quota given back")
    wl = _wl(cluster, namespace, queue.workload_name("low"))
    assert _wl_cond(wl, "Requeued") == "True", wl["status"]
    wait(cluster, lambda: _driver_running(cluster, namespace, "high", 0), "high running", RUNNING_S)
    assert status(cluster, namespace, "low")["step"] == 3

    # high ends: low is admitted again and resumes as a new attempt, at its step, state kept
    cluster.mark_pod_exit(namespace, names.driver_pod("high", 0), 0)
    st = wait(cluster, lambda: (s := status(cluster, namespace, "low")).get("attempt") == 1
              and s.get("summary") in ("Starting", "Running") and s, "low resumed", RUNNING_S)
    assert st["step"] == 3 and st["failures"] == 0
    assert st["controllerState"] is not None
    assert st["groupSize"] == before["groupSize"]
    code, plan = drv.post(report(3, g, 150.0, attempt=1))
    assert code == 200 and plan["step"] == 4, plan
    wait(cluster, lambda: _cluster_queue_usage(cluster, cq) == 2,
         "2 GPUs in use in cq")


def test_an_evicted_job_checkpoints_at_its_next_report_and_resumes_there(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """checkpoint.evictionGraceSeconds: preempted while its driver runs, a job with a
    checkpoint claim keeps its pods (and so the quota) until its driver's next report, which
    is accepted and answered ``done`` (any trainer then checkpoints at that step and exits
    0); once the driver has stopped the pods go and the quota goes back; admitted again, the
    job resumes as a new attempt at that step: nothing the driver did is lost. (Without a
    claim, as in the test above, the pods go at once and that report is refused.)"""
    _priority_classes(cluster)
    cq = setup_queues(cluster, namespace, gpus=2, preempt=True)
    bound_claim(cluster, namespace, "ckpt")
    apply(cluster, gpu_job("low", namespace, "lq",
                           scheduling={"queueName": "lq",
                                       "priorityClassName": "rlpacer-test-low"},
                           checkpoint={"volumeClaim": "ckpt", "evictionGraceSeconds": 90}))
    wait(cluster, lambda: _driver_running(cluster, namespace, "low", 0), "low running", RUNNING_S)
    drv = Driver(operator, namespace, "low", token(cluster, namespace, "low"))
    g = drv.plan()["groupSize"]
    for step in range(3):
        code, plan = drv.post(report(step, g, 150.0))
        assert code == 200 and plan["done"] is False, plan
        g = plan["groupSize"]
    apply(cluster, gpu_job("high", namespace, "lq",
                           scheduling={"queueName": "lq",
                                       "priorityClassName": "rlpacer-test-high"}))
    st = wait(cluster, lambda: (s := status(cluster, namespace, "low")).get("summary")
              == "Queued" and s, "low evicted")
    assert _cond(st, "QueueAdmitted")["reason"] == "Evicted"
    held = wait(cluster, lambda: (c := _cond(status(cluster, namespace, "low"), "Suspended"))
                and "checkpoints at its next step report" in c["message"] and c,
                "the Suspended condition says the driver may checkpoint")
    assert held["reason"] == "Evicted", held
    # its pods stay, so the quota stays with it: high waits
    time.sleep(2)
    assert _driver_running(cluster, namespace, "low", 0)
    assert not _driver_running(cluster, namespace, "high", 0)
    assert drv.plan()["done"] is True  # a driver that polls the plan is told to stop too
    # the driver's next report is accepted and answered as the last: it checkpoints at 4
    code, plan = drv.post(report(3, g, 150.0))
    assert code == 200 and plan["done"] is True and plan["step"] == 4, plan
    assert status(cluster, namespace, "low")["step"] == 4
    wait(cluster, lambda: "EvictionCheckpoint" in {
        e["reason"] for e in kube_events(cluster, namespace, "low")}, "EvictionCheckpoint")
    code, again = drv.post(report(3, g, 150.0))  # its retry: the same answer
    assert code == 200 and again == plan, again
    # the driver stops (exit 0 after its checkpoint): the pods go, the quota goes back, high
    # runs; low did not succeed
    cluster.mark_pod_exit(namespace, names.driver_pod("low", 0), 0)
    wait(cluster, lambda: _pods(cluster, namespace, "low") == [], "low's pods gone", 60)
    wait(cluster, lambda: _driver_running(cluster, namespace, "high", 0), "high running", RUNNING_S)
    st = status(cluster, namespace, "low")
    assert st["summary"] == "Queued" and st["step"] == 4, st
    # high ends: low resumes as attempt 1 at step 4, the step its driver checkpointed at
    cluster.mark_pod_exit(namespace, names.driver_pod("high", 0), 0)
    st = wait(cluster, lambda: (s := status(cluster, namespace, "low")).get("attempt") == 1
              and s.get("summary") in ("Starting", "Running") and s, "low resumed", RUNNING_S)
    assert st["step"] == 4 and st["failures"] == 0
    plan = drv.plan()
    assert plan["step"] == 4 and plan["done"] is False, plan
    code, plan = drv.post(report(4, g, 150.0, attempt=1))
    assert code == 200 and plan["step"] == 5, plan
    wait(cluster, lambda: _cluster_queue_usage(cluster, cq) == 2, "2 GPUs in use in cq")


def test_a_long_rounds_extra_replicas_wait_for_their_own_workload(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    setup_queues(cluster, namespace, gpus=2)
    # the long round's extra replicas come from a second queue, with room for 1 of 2 at first
    burst = setup_queues(cluster, namespace, gpus=1, cq=f"burst-{namespace}"[:63], lq="burst")
    apply(cluster, gpu_job("lr", namespace, "lq", tailBatching={"longRound": {
        "rolloutReplicas": 3, "scaleUpTimeoutSeconds": 8, "queueName": "burst"}}))
    wait(cluster, lambda: _driver_running(cluster, namespace, "lr", 0), "lr running", RUNNING_S)
    drv = Driver(operator, namespace, "lr", token(cluster, namespace, "lr"))
    g = drv.plan()["groupSize"]
    code, plan = drv.post(report(0, g, 150.0, nxt="Long"))
    assert code == 200 and plan["rollout"]["desiredReplicas"] == 3, plan
    g = plan["groupSize"]
    long_name = queue.long_round_name("lr")
    wl = wait(cluster, lambda: _wl(cluster, namespace, long_name), "long-round Workload")
    # the round's wait, in Kueue's words, on the job
    cond = wait(cluster, lambda: (c := _cond(status(cluster, namespace, "lr"), "LongRound"))
                ["message"].startswith("waiting for Kueue") and "quota" in c["message"] and c,
                "LongRound says why, in Kueue's words")
    assert "2 extra rollout replicas (queue burst)" in cond["message"], cond
    assert "quota" in cond["message"], cond
    # more than the queue can ever hold, in the words the pool's order reads (such an ask
    # holds no lower-priority long round back)
    assert queue.NEVER_FITS in cond["message"], cond
    assert _sample(operator.metrics(), "rlpacer_long_round_queued", namespace=namespace,
                   job="lr") == 1
    assert wl["spec"]["queueName"] == "burst"
    assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("rollout", 2)]
    # its template asks for the rollout flavor's nodes (the StatefulSet has one template)
    tpl = wl["spec"]["podSets"][0]["template"]["spec"]
    assert tpl["nodeSelector"][FLAVOR_LABEL] == "p5.48xlarge"
    # not admitted (2 GPUs asked, 1 in the queue): the StatefulSet stays at 1, then the round
    # stops waiting and runs on what is there
    st = wait(cluster, lambda: (s := status(cluster, namespace, "lr"))["rollout"]["state"]
              == "TimedOut" and s, "scale-up timed out", 30)
    sts = get(cluster, _sts_path(namespace, "lr", "rollout"))
    assert sts is not None and sts["spec"]["replicas"] == 1
    assert _cond(st, "LongRound")["reason"] == "ScaleUpTimedOut"
    code, plan = drv.post(report(1, g, 150.0, kind="Long", nxt="Short"))
    assert code == 200, plan
    g = plan["groupSize"]
    wait(cluster, lambda: _wl(cluster, namespace, long_name) is None,
         "long-round Workload deleted after the round")

    # room for both extras: an early scale-up (the next round short, a long one forecast)
    # asks Kueue early too; admitted, the StatefulSet grows to 3 (Ready on KWOK)
    assert _sample(operator.metrics(), "rlpacer_long_round_queued", namespace=namespace,
                   job="lr") == 0
    cluster.kubectl("patch", "clusterqueue", burst, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota",
          "value": 2}]))
    code, plan = drv.post({**report(2, g, 150.0), "prepareLongRound": True})
    assert code == 200 and plan["roundKind"] == "Short", plan
    g = plan["groupSize"]
    wl = wait(cluster, lambda: _wl(cluster, namespace, long_name), "asked early")
    st = wait(cluster, lambda: (s := status(cluster, namespace, "lr"))["rollout"]["state"]
              == "Ready" and s["rollout"]["readyReplicas"] == 3 and s, "scaled up to 3", 60)
    assert _wl_cond(_wl(cluster, namespace, long_name), "Admitted") == "True"
    wait(cluster, lambda: _cluster_queue_usage(cluster, burst) == 2,
         "2 GPUs in use in burst")
    assert _sample(operator.metrics(), "rlpacer_queue_wait_seconds_count",
                   namespace=namespace, workload="long_round") == 1
    reasons = {e["reason"] for e in kube_events(cluster, namespace, "lr")}
    assert {"LongRoundQueued", "LongRoundAdmitted", "LongRoundReleased"} <= reasons, reasons

    # an operator restart keeps the grant: the same Workload, still admitted, nothing scaled
    operator.kill()
    again = OperatorProc(cluster, namespace, lease=operator.lease,
                         kubeconfig=operator.kubeconfig, report_url=operator.report_url)
    again.report_port = operator.report_port
    again.start()
    again.wait_ready()
    try:
        drv.op = again
        wait(cluster, lambda: 'rlpacer_reconciles_total{job="lr"' in again.metrics(),
             "the new operator reconciled lr")
        after = _wl(cluster, namespace, long_name)
        assert after is not None and after["metadata"]["uid"] == wl["metadata"]["uid"]
        assert _wl_cond(after, "Admitted") == "True"
        sts = get(cluster, _sts_path(namespace, "lr", "rollout"))
        assert sts is not None and sts["spec"]["replicas"] == 3
        assert status(cluster, namespace, "lr")["rollout"]["state"] == "Ready"
        code, plan = drv.post(report(3, g, 150.0, nxt="Long"))
        assert code == 200 and plan["roundKind"] == "Long", plan
        assert plan["rollout"]["state"] == "Ready" and plan["rollout"]["desiredReplicas"] == 3
        code, plan = drv.post(report(4, plan["groupSize"], 150.0, kind="Long", nxt="Short"))
        assert code == 200, plan
        wait(cluster, lambda: _wl(cluster, namespace, long_name) is None, "extras returned")
        wait(cluster, lambda: _cluster_queue_usage(cluster, burst) == 0, "burst quota free")
    finally:
        again.kill(signal.SIGTERM)


def test_short_rounds_run_in_a_long_rounds_place_while_the_burst_pool_is_busy(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    """tailBatching.longRound.maxDeferredRounds: the burst pool has no room for the long
    round's 2 extra replicas; the driver runs short rounds in its place (reports of Short
    rounds to a Long/ScalingUp plan), so the job trains while its Workload waits: the
    operator keeps the Workload and the scale-up pending past scaleUpTimeoutSeconds (each
    deferred round restarts that wait), counts the rounds in status and Events, and, once the
    pool has room, scales up for the long round, which runs on the granted replicas."""
    setup_queues(cluster, namespace, gpus=2)
    burst = setup_queues(cluster, namespace, gpus=0, cq=f"busy-{namespace}"[:63], lq="burst")
    timeout = 12
    apply(cluster, gpu_job("df", namespace, "lq", tailBatching={"longRound": {
        "rolloutReplicas": 3, "scaleUpTimeoutSeconds": timeout, "queueName": "burst",
        "maxDeferredRounds": 3}}))
    wait(cluster, lambda: _driver_running(cluster, namespace, "df", 0), "df running", RUNNING_S)
    drv = Driver(operator, namespace, "df", token(cluster, namespace, "df"))
    g = drv.plan()["groupSize"]
    t0 = time.monotonic()
    code, plan = drv.post(report(0, g, 150.0, nxt="Long"))
    assert code == 200 and plan["roundKind"] == "Long", plan
    assert plan["rollout"]["state"] == "ScalingUp", plan
    long_name = queue.long_round_name("df")
    wait(cluster, lambda: _wl(cluster, namespace, long_name), "long-round Workload")
    for step in (1, 2):
        # a short round in the long round's place, reported well inside the restarted wait
        time.sleep(max(0.0, t0 + step * (timeout * 0.55) - time.monotonic()))
        code, plan = drv.post(report(step, plan["groupSize"], 150.0, nxt="Long"))
        assert code == 200 and plan["roundKind"] == "Long", plan
        assert plan["rollout"]["state"] == "ScalingUp", (step, plan)
        st = status(cluster, namespace, "df")
        assert st["rollout"]["deferredRounds"] == step, st["rollout"]
        assert st["step"] == step + 1
    # past the first ask's timeout, the scale-up still pends: the deferred rounds restarted it
    assert time.monotonic() - t0 > timeout
    st = status(cluster, namespace, "df")
    assert st["rollout"]["state"] == "ScalingUp", st["rollout"]
    assert not any(a["reason"] == "ScaleUpTimedOut" for a in st.get("scaleActions") or [])
    assert _wl_cond(_wl(cluster, namespace, long_name), "Admitted") != "True"
    events = [e for e in kube_events(cluster, namespace, "df")
              if e["reason"] == "LongRoundDeferred"]
    assert len(events) == 2 and "2 of at most 3" in " ".join(e["message"] for e in events)
    # the pool gets room: Kueue admits the Workload, the StatefulSet grows, the plan is Ready
    cluster.kubectl("patch", "clusterqueue", burst, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota",
          "value": 2}]))
    st = wait(cluster, lambda: (s := status(cluster, namespace, "df"))["rollout"]["state"]
              == "Ready" and s["rollout"]["readyReplicas"] == 3 and s, "scaled up to 3", 60)
    assert _wl_cond(_wl(cluster, namespace, long_name), "Admitted") == "True"
    plan = drv.plan()
    assert plan["roundKind"] == "Long" and plan["rollout"]["desiredReplicas"] == 3, plan
    code, plan = drv.post(report(3, plan["groupSize"], 150.0, kind="Long", nxt="Short"))
    assert code == 200, plan
    assert status(cluster, namespace, "df")["rollout"].get("deferredRounds", 0) == 0
    wait(cluster, lambda: _wl(cluster, namespace, long_name) is None, "extras returned")


def _held_behind(cluster: LocalCluster, ns: str, job: str) -> str | None:
    """What the job's long-round Workload is held behind by the pool's order (None: not
    held: active, no annotation)."""
    wl = _wl(cluster, ns, queue.long_round_name(job)) or {}
    if wl.get("spec", {}).get("active", True):
        return None
    return ((wl.get("metadata") or {}).get("annotations") or {}).get(queue.HELD_BY_ANNOTATION)


def _kueue_samples(kueue: KueueProc, name: str, cq: str) -> list[tuple[dict[str, str], float]]:
    """The samples of Kueue's metric ``name`` for ClusterQueue ``cq``, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(dict(smp.labels), smp.value)
            for fam in text_string_to_metric_families(kueue.metrics())
            for smp in fam.samples if smp.name == name and smp.labels.get("cluster_queue") == cq]


def test_the_burst_pool_goes_to_the_higher_priority_long_round_first(
    cluster: LocalCluster, operator: OperatorProc, namespace: str, kueue: KueueProc
) -> None:
    """Three jobs, short rounds sized in their own queue, long rounds from one burst pool of
    2 GPUs: while c's long round holds the pool, a (low priority) and then b (high) ask;
    when c's round ends the pool goes to b, then to a (docs/kueue.md: priority, then
    arrival)."""
    _priority_classes(cluster)
    setup_queues(cluster, namespace, gpus=6)
    burst = setup_queues(cluster, namespace, gpus=2, cq=f"pool-{namespace}"[:63], lq="burst")
    long_round = {"longRound": {"rolloutReplicas": 3, "scaleUpTimeoutSeconds": 300,
                                "queueName": "burst"}}
    classes = {"c": None, "a": "rlpacer-test-low", "b": "rlpacer-test-high"}
    drivers = {}
    for name, cls in classes.items():
        sched = {"queueName": "lq", **({"priorityClassName": cls} if cls else {})}
        apply(cluster, gpu_job(name, namespace, "lq", scheduling=sched, tailBatching=long_round))
    for name in classes:
        wait(cluster, lambda n=name: _driver_running(cluster, namespace, n, 0),
             f"{name} running", RUNNING_S)
        drivers[name] = Driver(operator, namespace, name, token(cluster, namespace, name))
    gs = {n: d.plan()["groupSize"] for n, d in drivers.items()}

    def ask(name: str, step: int) -> None:
        code, plan = drivers[name].post(report(step, gs[name], 150.0, nxt="Long"))
        assert code == 200, plan
        gs[name] = plan["groupSize"]
        wait(cluster, lambda: _wl(cluster, namespace, queue.long_round_name(name)),
             f"{name}'s long round asked")

    def admitted(name: str) -> bool:
        return _wl_cond(_wl(cluster, namespace, queue.long_round_name(name)),
                        "Admitted") == "True"

    ask("c", 0)
    wait(cluster, lambda: admitted("c"), "c holds the pool")
    ask("a", 0)  # first in line, low priority
    ask("b", 0)  # later, high priority
    wait(cluster, lambda: "quota" in (_cond(status(cluster, namespace, "b"), "LongRound")
                                      ["message"]), "b waits on the pool")
    # a is held behind b by the operator (with the chart's RBAC): inactive, annotated, said
    held = wait(cluster, lambda: _held_behind(cluster, namespace, "a"), "a held behind b")
    assert held == f"{namespace}/{queue.long_round_name('b')}", held
    assert _held_behind(cluster, namespace, "b") is None
    wait(cluster, lambda: "held behind" in (_cond(status(cluster, namespace, "a"), "LongRound")
                                            ["message"]), "a's status says it is held")
    assert not admitted("a") and not admitted("b")
    assert get(cluster, _sts_path(namespace, "a", "rollout"))["spec"]["replicas"] == 1
    # the pool's size, use and queue, in Kueue's own series as the dashboard's burst-pool
    # panel reads them (their names and labels are the ones its promtool check feeds it)
    def gpu(name: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, v) for lab, v in _kueue_samples(kueue, name, burst)
                if lab.get("resource") == "nvidia.com/gpu"]

    quota = wait(cluster, lambda: gpu("kueue_cluster_queue_nominal_quota"), "pool quota", 30)
    assert sum(v for _, v in quota) == 2, quota
    used = wait(cluster, lambda: [x for x in gpu("kueue_cluster_queue_resource_reservation")
                                  if x[1] == 2], "pool reservation 2", 30)
    # Kueue's pending count is b's ask alone: a's, held by the operator, is inactive
    pending = wait(cluster, lambda: (p := _kueue_samples(kueue, "kueue_pending_workloads",
                                                         burst))
                   and sum(v for _, v in p) == 1 and p, "1 long round pending in Kueue", 30)
    for name, labels, _ in KUEUE_SERIES:
        seen = {"kueue_cluster_queue_nominal_quota": quota,
                "kueue_cluster_queue_resource_reservation": used,
                "kueue_pending_workloads": pending}[name]
        assert any(set(labels) <= set(lab) for lab, _ in seen), (name, labels, seen)
    code, plan = drivers["c"].post(report(1, gs["c"], 150.0, kind="Long", nxt="Short"))
    assert code == 200, plan
    wait(cluster, lambda: admitted("b"), "the pool goes to b (higher priority)")
    assert not admitted("a")
    # b no longer waits: a is let go (active again) and waits for the pool by Kueue's order
    wait(cluster, lambda: (w := _wl(cluster, namespace, queue.long_round_name("a")))
         and w["spec"].get("active", True) and _held_behind(cluster, namespace, "a") is None,
         "a let go once b is admitted")
    wait(cluster, lambda: status(cluster, namespace, "b")["rollout"]["readyReplicas"] == 3,
         "b's extra replicas ready", 60)
    assert get(cluster, _sts_path(namespace, "a", "rollout"))["spec"]["replicas"] == 1
    code, plan = drivers["b"].post(report(1, gs["b"], 150.0, kind="Long", nxt="Short"))
    assert code == 200, plan
    wait(cluster, lambda: admitted("a"), "then to a")
    wait(cluster, lambda: status(cluster, namespace, "a")["rollout"]["readyReplicas"] == 3,
         "a's extra replicas ready", 60)
    wait(cluster, lambda: _cluster_queue_usage(cluster, burst) == 2, "the pool in use by a")


def test_the_pool_goes_by_priority_then_fair_share_by_namespace_then_arrival(
    cluster: LocalCluster, kueue: KueueProc, namespace: str
) -> None:
    """rlpacer's contention rule for a burst pool (docs/kueue.md) on a ClusterQueue that opts
    into Kueue's admission fair sharing (``admissionScope: UsageBasedAdmissionFairSharing``),
    one LocalQueue per team namespace: team A's first job holds the pool; A's second job
    asks, then team B's, then A's third at a higher priority. The pool goes to A's third
    (priority: Kueue alone would have ordered B first, fair share before priority), then to
    B (fair share: A has used the pool, B has not), then to A's second, though it asked
    first (arrival alone, the priority test above, would have given it to A)."""
    _priority_classes(cluster)
    ns_b = f"{namespace[:50]}-b"
    cluster.create_namespace(ns_b)
    op = OperatorProc(cluster, namespace, lease=f"rlpf-{namespace[-6:]}", also_watch=(ns_b,),
                      extra_args=("--kueue",), resync_seconds=60).start()
    try:
        op.wait_ready()
        setup_queues(cluster, namespace, gpus=8)  # the jobs' own pods: room for all three
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": queue.API_VERSION, "kind": "LocalQueue",
            "metadata": {"name": "lq", "namespace": ns_b},
            "spec": {"clusterQueue": f"cq-{namespace}"[:63]}}))
        pool = f"fair-{namespace}"[:63]
        setup_queues(cluster, namespace, gpus=2, cq=pool, lq="burst", fair_sharing=True)
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": queue.API_VERSION, "kind": "LocalQueue",
            "metadata": {"name": "burst", "namespace": ns_b}, "spec": {"clusterQueue": pool}}))
        long_round = {"longRound": {"rolloutReplicas": 3, "scaleUpTimeoutSeconds": 300,
                                    "queueName": "burst"}}
        jobs = {"a1": namespace, "a2": namespace, "b1": ns_b, "a3": namespace}
        for name, ns in jobs.items():
            sched = {"queueName": "lq",
                     **({"priorityClassName": "rlpacer-test-high"} if name == "a3" else {})}
            apply(cluster, gpu_job(name, ns, "lq", scheduling=sched, tailBatching=long_round))
        drivers, gs = {}, {}
        for name, ns in jobs.items():
            wait(cluster, lambda n=name, s=ns: _driver_running(cluster, s, n, 0),
                 f"{name} running", RUNNING_S)
            drivers[name] = Driver(op, ns, name, token(cluster, ns, name))
            gs[name] = drivers[name].plan()["groupSize"]

        def ask(name: str) -> None:
            code, plan = drivers[name].post(report(0, gs[name], 150.0, nxt="Long"))
            assert code == 200, plan
            gs[name] = plan["groupSize"]
            wait(cluster, lambda: _wl(cluster, jobs[name], queue.long_round_name(name)),
                 f"{name}'s long round asked")

        def admitted(name: str) -> bool:
            return _wl_cond(_wl(cluster, jobs[name], queue.long_round_name(name)),
                            "Admitted") == "True"

        ask("a1")
        wait(cluster, lambda: admitted("a1"), "a1 holds the pool")
        # team A's usage of the pool, as Kueue keeps it on A's LocalQueue (sampled each second)
        def a_used() -> bool:
            lq = get(cluster, f"{KUEUE}/namespaces/{namespace}/localqueues/burst") or {}
            fs = ((lq.get("status") or {}).get("fairSharing") or {})
            used = ((fs.get("admissionFairSharingStatus") or {}).get("consumedResources")
                    or {}).get("nvidia.com/gpu")
            return used not in (None, "0")

        wait(cluster, a_used, "team A's pool usage recorded", 30)
        ask("a2")  # first in line
        time.sleep(1.1)  # a later creation second
        ask("b1")  # later, from a team that has not used the pool
        wait(cluster, lambda: "quota" in (_cond(status(cluster, ns_b, "b1"), "LongRound")
                                          ["message"]), "b1 waits on the pool")
        ask("a3")  # last, from the team that used the pool, at a higher priority
        behind = f"{namespace}/{queue.long_round_name('a3')}"
        for name in ("a2", "b1"):
            wait(cluster, lambda n=name: _held_behind(cluster, jobs[n], n) == behind,
                 f"{name} held behind a3")
        assert not admitted("a2") and not admitted("b1") and not admitted("a3")
        code, plan = drivers["a1"].post(report(1, gs["a1"], 150.0, kind="Long", nxt="Short"))
        assert code == 200, plan
        wait(cluster, lambda: admitted("a3"), "the pool goes to a3 (higher priority)")
        assert not admitted("a2") and not admitted("b1")
        wait(cluster, lambda: status(cluster, namespace, "a3")["rollout"]["readyReplicas"]
             == 3, "a3's extra replicas ready", 60)
        code, plan = drivers["a3"].post(report(1, gs["a3"], 150.0, kind="Long", nxt="Short"))
        assert code == 200, plan
        wait(cluster, lambda: admitted("b1"), "the pool goes to team B (less usage)")
        assert not admitted("a2")
        wait(cluster, lambda: status(cluster, ns_b, "b1")["rollout"]["readyReplicas"] == 3,
             "b1's extra replicas ready", 60)
        code, plan = drivers["b1"].post(report(1, gs["b1"], 150.0, kind="Long", nxt="Short"))
        assert code == 200, plan
        wait(cluster, lambda: admitted("a2"), "then to a2")
    finally:
        op.kill(signal.SIGTERM)
        cluster.delete_namespace(ns_b)


def test_suspending_an_admitted_job_gives_its_quota_to_the_next_and_resuming_queues_it(
    cluster: LocalCluster, operator: OperatorProc, namespace: str
) -> None:
    cq = setup_queues(cluster, namespace, gpus=2)
    apply(cluster, gpu_job("sa", namespace, "lq"))
    wait(cluster, lambda: _driver_running(cluster, namespace, "sa", 0), "sa running", RUNNING_S)
    apply(cluster, gpu_job("sb", namespace, "lq"))
    wait(cluster, lambda: status(cluster, namespace, "sb").get("summary") == "Queued",
         "sb queued")
    cluster.kubectl("patch", "rltj", "sa", "-n", namespace, "--type=merge",
                    "-p", '{"spec":{"suspend":true}}')
    # sa's Workload is deactivated, evicted, its quota returned once its pods are gone, then
    # deleted; the quota goes to sb
    wait(cluster, lambda: _wl(cluster, namespace, queue.workload_name("sa")) is None,
         "sa's Workload given back")
    assert _pods(cluster, namespace, "sa") == []
    st = status(cluster, namespace, "sa")
    assert st["summary"] == "Suspended"
    assert _cond(st, "QueueAdmitted")["reason"] == "Suspended"
    wait(cluster, lambda: _driver_running(cluster, namespace, "sb", 0), "sb runs on it", RUNNING_S)
    wait(cluster, lambda: _cluster_queue_usage(cluster, cq) == 2, "2 GPUs in use")
    # resumed: sa queues again behind sb, with a new Workload
    cluster.kubectl("patch", "rltj", "sa", "-n", namespace, "--type=merge",
                    "-p", '{"spec":{"suspend":false}}')
    st = wait(cluster, lambda: (s := status(cluster, namespace, "sa")).get("summary")
              == "Queued" and _cond(s, "QueueAdmitted")["reason"] == "WaitingForQueue" and s,
              "sa queued again")
    # its new Workload, within 30 s (one CI run of five read none at the instant the status
    # said Queued; the cause is not found yet: see the stop note of 2026-12-06)
    wait(cluster, lambda: _wl(cluster, namespace, queue.workload_name("sa")) is not None,
         "sa's new Workload", 30)
    assert _pods(cluster, namespace, "sa") == []
    # its replicas edited while it waits: the Workload is asked again with the new counts
    cluster.kubectl("patch", "rltj", "sa", "-n", namespace, "--type=merge",
                    "-p", '{"spec":{"rollout":{"replicas":2}}}')
    wait(cluster, lambda: (w := _wl(cluster, namespace, queue.workload_name("sa")))
              and {p["name"]: p["count"] for p in w["spec"]["podSets"]}["rollout"] == 2 and w,
              "sa's Workload asked again")
    assert "Requeued" in {e["reason"] for e in kube_events(cluster, namespace, "sa")}
    assert status(cluster, namespace, "sa")["summary"] == "Queued"
