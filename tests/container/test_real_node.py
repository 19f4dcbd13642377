"""The chart and a whole job on a real node: a kubelet with containerd and runc, CNI bridge
networking, kube-proxy and CoreDNS (``rlpacer.testing.node``), beside the local control plane.

* ``helm install`` of the chart with the locally built operator image: the operator runs as a
  pod (a runc container on the node) with the chart's ServiceAccount, its probes pass, the
  admission webhook answers through its Service, and its metrics are scraped from the pod.
* The CPU example job (``examples/tiny-cluster.yaml``) runs as containers of the trainer image:
  head, learner, rollout and driver pods find each other through Services (cluster DNS), a long
  round adds a rollout pod whose engine generates part of that round, and the job reaches
  Succeeded; ``kubectl logs`` of each pod shows its role's work.
* NetworkPolicies enforced (the chart with ``networkPolicy.enabled``; kube-router on the node):
  while the job runs, a pod with no job labels and a pod of another job reach neither the job's
  Ray head nor the operator's step-report port, and the job's pods reach nothing outside the
  job, while the job's own pods reach its head, the driver reports every step, and the webhook
  still answers the API server. A job's policy deleted by hand comes back.

Nothing here is simulated: no KWOK node is in this cluster, so every pod is scheduled to the real
node and run by its kubelet. A machine without the node's parts fails with what to install
(``bash scripts/setup.sh``); it never skips.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.testing import LocalCluster
from rlpacer.testing.cluster import (
    REAL_NODE_SERVICE_CIDR,
    SERVICE_CIDR,
    find_kubectl,
    repo_root,
)
from rlpacer.testing.node import (
    NODE_NAME,
    PAUSE_IMAGE,
    NodeError,
    missing_prerequisites,
    preload,
)

pytestmark = [pytest.mark.container, pytest.mark.slow]

ROOT = repo_root()
CHART = ROOT / "charts" / "rlpacer"
SYSTEM = "rlpacer-system"
JOBS = "team-real"
JOB = "tiny-cluster"


#: what the preload before the cluster's start imported (ref -> seconds, None: was there)
PRELOADED: dict[str, float | None] = {}


@pytest.fixture(scope="module")
def cluster(images: dict[str, str]) -> Iterator[LocalCluster]:
    missing = missing_prerequisites()
    if missing:
        pytest.fail("the real node needs: " + "; ".join(missing), pytrace=False)
    t0 = time.monotonic()
    try:
        # what set-up does after building the images (a no-op when it has)
        PRELOADED.update(preload(tuple(images.values())) or {})
        t1 = time.monotonic()
        c = LocalCluster(nodes=(), real_node=True, node_images=tuple(images.values()),
                         startup_timeout=300)
        c.start()
    except NodeError as e:
        pytest.fail(str(e), pytrace=False)
    print(f"\nimages preloaded in {t1 - t0:.0f} s ({PRELOADED}); cluster with a real node up in"
          f" {time.monotonic() - t1:.0f} s; imports at its start: {c.node.import_seconds}")
    try:
        yield c
    finally:
        c.stop()
    # the node's stop leaves nothing of kube-proxy's or kube-router's in the host's tables
    chains = [r for t in ("filter", "nat", "mangle") for r in subprocess.run(
        ["iptables", "-t", t, "-S"], capture_output=True, text=True).stdout.splitlines()
        if "KUBE-" in r]
    sets = [n for n in subprocess.run(["ipset", "list", "-n"], capture_output=True,
                                      text=True).stdout.split() if n.startswith("KUBE-")]
    assert not chains and not sets, (chains, sets)


def kubectl(c: LocalCluster, *args: str, check: bool = True, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
    return c.kubectl(*args, check=check, timeout=timeout, input=input)


def get(c: LocalCluster, *args: str) -> Any:
    return json.loads(kubectl(c, "get", "-o", "json", *args).stdout)


def ctr_tasks(c: LocalCluster) -> dict[str, int]:
    """containerd's running containers on the node: id -> host PID."""
    out = subprocess.run(["ctr", "--address", str(c.node.socket), "-n", "k8s.io", "tasks", "ls"],
                         capture_output=True, text=True, check=True).stdout.splitlines()[1:]
    return {f[0]: int(f[1]) for f in (ln.split() for ln in out) if len(f) >= 3
            and f[2] == "RUNNING"}


def in_real_container(c: LocalCluster, pod: dict[str, Any]) -> int:
    """The host PID of the pod's (first) container, checked to be a containerd task in PID and
    network namespaces other than this test's."""
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    assert cid.startswith("containerd://"), cid
    pid = ctr_tasks(c)[cid.removeprefix("containerd://")]
    for ns in ("pid", "net"):
        assert Path(f"/proc/{pid}/ns/{ns}").readlink() != Path(f"/proc/self/ns/{ns}").readlink()
    return pid


@pytest.fixture(scope="module")
def release(cluster: LocalCluster) -> dict[str, Any]:
    kubectl(cluster, "create", "namespace", SYSTEM)
    t0 = time.monotonic()
    # NetworkPolicies on: the operator pod's and every job's (the node enforces them)
    r = cluster.helm("install", "rlpacer", str(CHART), "-n", SYSTEM, "--wait", "--timeout",
                     "240s", "--set", "networkPolicy.enabled=true", check=False)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n" + kubectl(
        cluster, "-n", SYSTEM, "describe", "pods", check=False).stdout[-4000:]
    (pod,) = get(cluster, "pods", "-n", SYSTEM, "-l", "app.kubernetes.io/name=rlpacer")["items"]
    return {"pod": pod, "install_seconds": time.monotonic() - t0}


def test_the_chart_runs_the_operator_as_a_pod_on_the_real_node(
        cluster: LocalCluster, release: dict[str, Any]) -> None:
    pod = release["pod"]
    name = pod["metadata"]["name"]
    assert pod["spec"]["nodeName"] == NODE_NAME
    assert pod["spec"]["serviceAccountName"] == "rlpacer"
    # the kubelet ran its probes: Ready only after the readiness probe (/readyz, the leader)
    conds = {x["type"]: x["status"] for x in pod["status"]["conditions"]}
    assert conds["Ready"] == "True", pod["status"]
    (cs,) = pod["status"]["containerStatuses"]
    assert cs["ready"] and cs["restartCount"] == 0, cs
    pid = in_real_container(cluster, pod)
    assert b"rlpacer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    # its own log, through the API server and the kubelet: it leads under its pod's name
    logs = kubectl(cluster, "-n", SYSTEM, "logs", name).stdout
    assert f"leading as {name}" in logs, logs[-3000:]
    # the Service routes to this pod
    (ep,) = get(cluster, "endpointslices", "-n", SYSTEM,
                "-l", "kubernetes.io/service-name=rlpacer")["items"]
    assert [a for e in ep["endpoints"] for a in e["addresses"]] == [pod["status"]["podIP"]]


def test_the_webhook_answers_through_its_service(cluster: LocalCluster,
                                                 release: dict[str, Any]) -> None:
    kubectl(cluster, "create", "namespace", "team-webhook")
    kubectl(cluster, "-n", "team-webhook", "apply", "-f",
            str(ROOT / "examples" / "tiny-cluster-policy.yaml"))
    job = yaml.safe_load((ROOT / "examples" / "tiny-cluster.yaml").read_text())
    job["spec"]["groupControl"]["targetStragglerRate"] = "0.9"
    deadline = time.monotonic() + 60
    while True:
        r = kubectl(cluster, "-n", "team-webhook", "apply", "-f", "-", check=False,
                    input=json.dumps(job))  # JSON: YAML would turn "5e-5" into a number
        # the API server serves the policy CRD a few seconds after helm created it: the
        # operator refuses to admit what it cannot check until then ("storage is
        # (re)initializing"), and says so
        if "(re)initializing" not in r.stderr or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r.returncode != 0
    # the API server called the operator's pod through the webhook's Service (kube-proxy)
    assert 'admission webhook "validate.rltrainingjob.rlpacer.io" denied the request' in r.stderr
    assert "0.9 breaks <= 0.3 (stragglerSLO.maxTargetStragglerRate)" in r.stderr, r.stderr


#: TCP connects from inside a pod to one address, each port in turn: "<port> open|blocked
#: <error> <seconds>" per line.
PROBE = """import socket, sys, time
for port in sys.argv[2:]:
    t = time.monotonic()
    try:
        socket.create_connection((sys.argv[1], int(port)), timeout=4).close()
        print(port, "open", round(time.monotonic() - t, 2))
    except OSError as e:
        print(port, "blocked", type(e).__name__, round(time.monotonic() - t, 2))
"""
#: The TCP ports a pod listens on, on addresses other than loopback (its /proc/net/tcp{,6}).
LISTENING = """listen = set()
for f, loopback in (("/proc/net/tcp", {"0100007F"}),
                    ("/proc/net/tcp6", {"00000000000000000000000001000000",
                                        "0000000000000000FFFF00000100007F"})):
    try:
        lines = open(f).read().splitlines()[1:]
    except OSError:
        continue
    for ln in lines:
        local, state = ln.split()[1], ln.split()[3]
        ip, port = local.split(":")
        if state == "0A" and ip not in loopback:
            listen.add(int(port, 16))
print(" ".join(str(p) for p in sorted(listen)))
"""
#: Pods that do not belong to the job: one with no job labels (it also serves HTTP on
#: STRANGER_PORT, the job pods' egress target), one labelled as a pod of another job.
STRANGERS = {"stranger": {}, "other-job": {"rlpacer.io/job": "another-job",
                                           "app.kubernetes.io/managed-by": "rlpacer-operator"}}
STRANGER_PORT = 8000


def stranger_pods(c: LocalCluster) -> None:
    for name, labels in STRANGERS.items():
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": JOBS, "labels": labels},
            "spec": {
                "nodeSelector": {"rlpacer.io/node": "real"},
                "terminationGracePeriodSeconds": 1,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "probe", "image": "ghcr.io/rlpacer/trainer:0.1.0",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-m", "http.server", str(STRANGER_PORT)],
                    "securityContext": {"allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}},
                }],
            },
        }
        kubectl(c, "apply", "-f", "-", input=json.dumps(pod))


def probe(c: LocalCluster, pod: str, ip: str, *ports: int) -> dict[int, str]:
    r = kubectl(c, "-n", JOBS, "exec", pod, "--", "python3", "-c", PROBE, ip,
                *map(str, ports), check=False, timeout=120)
    out = {int(ln.split()[0]): ln.split(None, 1)[1] for ln in r.stdout.splitlines() if ln}
    return {p: out.get(p, f"exec failed: {r.stderr.strip()[-300:]}") for p in ports}


def probe_network(c: LocalCluster, ips: dict[str, str], operator_ip: str) -> dict[str, str]:
    """Connections tried while the job runs: "<from> -> <what>" -> "open ..." / "blocked ...".
    First the job's learner to its head's GCS, until it answers (the head pod runs before Ray
    listens), and the head's own list of listening ports until its raylet's are in it; then
    every one of those ports, from the learner (open: the job's own) and from each stranger
    (each port known open to the job's pods at that moment)."""
    head, learner = ips[f"{JOB}-head-0"], f"{JOB}-learner-0"
    out: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while True:
        out["learner -> head 6379"] = probe(c, learner, head, 6379)[6379]
        if out["learner -> head 6379"].startswith("open") or time.monotonic() > deadline:
            break
        time.sleep(1)
    while True:  # the head's raylet and agents listen seconds after its GCS
        listening = kubectl(c, "-n", JOBS, "exec", f"{JOB}-head-0", "--", "python3", "-c",
                            LISTENING, check=False).stdout.split()
        if len(listening) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(1)
    ports = [int(p) for p in listening]
    out["head listens on"] = " ".join(listening)
    for port, got in probe(c, learner, head, *ports).items():
        out[f"learner -> head {port}"] = got
    for who in STRANGERS:
        for port, got in probe(c, who, head, *ports).items():
            out[f"{who} -> head {port}"] = got
        got2 = probe(c, who, operator_ip, 8080, 9443)
        out[f"{who} -> operator reports"] = got2[8080]
        # where the chart allows every source: the stranger's network itself works
        out[f"{who} -> operator webhook"] = got2[9443]
    out["other-job -> stranger"] = probe(c, "other-job", ips["stranger"], STRANGER_PORT)[
        STRANGER_PORT]
    out["learner -> stranger"] = probe(c, learner, ips["stranger"], STRANGER_PORT)[
        STRANGER_PORT]
    # the head's GCS still serves the job (the strangers were refused while it listened)
    out["learner -> head 6379, after"] = probe(c, learner, head, 6379)[6379]
    return out


def scrape(pod_ip: str, port: int = 9090) -> str:
    with urllib.request.urlopen(f"http://{pod_ip}:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


@pytest.fixture(scope="module")
def job_run(cluster: LocalCluster, release: dict[str, Any],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example job, applied as a user would, watched to its end: every pod seen (by name,
    each incarnation), and each one's whole log, followed with ``kubectl logs -f`` from its
    start (the operator deletes a finished job's pods)."""
    logdir = tmp_path_factory.mktemp("pod-logs")
    kubectl(cluster, "create", "namespace", JOBS)
    stranger_pods(cluster)
    kubectl(cluster, "-n", JOBS, "wait", "--for=condition=Ready", "pod", *STRANGERS,
            "--timeout=120s")
    strangers = {n: get(cluster, "pod", n, "-n", JOBS)["status"]["podIP"] for n in STRANGERS}
    kubectl(cluster, "-n", JOBS, "apply", "-f", str(ROOT / "examples" / "tiny-cluster-policy.yaml"),
            "-f", str(ROOT / "examples" / "tiny-cluster.yaml"))
    pods: dict[str, list[dict[str, Any]]] = {}  # name -> each incarnation (by uid)
    followers: dict[str, subprocess.Popen[bytes]] = {}  # pod uid -> kubectl logs -f
    t0 = time.monotonic()
    deadline = t0 + 900
    job: dict[str, Any] = {}
    # the network probes run beside the watch (they take seconds; the watch must not miss a
    # short-lived pod's log), once the head and the learner run
    probes: dict[str, str] = {}
    prober: threading.Thread | None = None
    try:
        while time.monotonic() < deadline:
            job = get(cluster, "rltrainingjob", JOB, "-n", JOBS)
            for p in get(cluster, "pods", "-n", JOBS)["items"]:
                uid, name = p["metadata"]["uid"], p["metadata"]["name"]
                if name in STRANGERS:
                    continue
                seen = pods.setdefault(name, [])
                uids = [x["metadata"]["uid"] for x in seen]
                if uid in uids:
                    seen[uids.index(uid)] = p
                else:
                    seen.append(p)
                started = any("running" in (cs.get("state") or {}) or
                              "terminated" in (cs.get("state") or {})
                              for cs in p["status"].get("containerStatuses") or [])
                running = {
                    q[-1]["metadata"]["name"]: q[-1]["status"].get("podIP")
                    for q in pods.values() if q[-1]["status"].get("phase") == "Running"}
                if prober is None and {f"{JOB}-head-0", f"{JOB}-learner-0"} <= set(
                        k for k, v in running.items() if v):
                    prober = threading.Thread(target=lambda ips=running: probes.update(
                        probe_network(cluster, {**ips, **strangers},
                                      release["pod"]["status"]["podIP"])),
                        daemon=True)
                    prober.start()
                if started and uid not in followers:
                    with open(logdir / f"{uid}.log", "wb") as out:
                        followers[uid] = subprocess.Popen(
                            [str(find_kubectl()), f"--kubeconfig={cluster.kubeconfig}", "-n",
                             JOBS, "logs", "-f", name], stdout=out, stderr=subprocess.STDOUT)
            if (job.get("status") or {}).get("summary") in ("Succeeded", "Failed"):
                break
            time.sleep(1)
        if prober is not None:
            prober.join(timeout=120)
        for f in followers.values():  # each stream ends with its container (or its pod)
            try:
                f.wait(timeout=60)
            except subprocess.TimeoutExpired:
                f.kill()
    finally:
        for f in followers.values():
            if f.poll() is None:
                f.kill()
    seconds = time.monotonic() - t0
    print(f"\nthe example job ran as containers in {seconds:.0f} s:"
          f" {(job.get('status') or {}).get('summary')}")
    logs = {uid: (logdir / f"{uid}.log").read_text(errors="replace") for uid in followers}
    metrics = scrape(release["pod"]["status"]["podIP"])
    return {"job": job, "pods": pods, "logs": logs, "seconds": seconds, "metrics": metrics,
            "probes": probes}


def _log(run: dict[str, Any], pod: dict[str, Any]) -> str:
    return str(run["logs"].get(pod["metadata"]["uid"], ""))


def _generated(log: str, replica: int) -> int:
    """Responses the engine of ``replica`` says (in its pod's log) it generated."""
    mark = f"rollout engine replica {replica}: generated "
    return sum(int(ln.split(mark, 1)[1].split()[0]) for ln in log.splitlines() if mark in ln)


def test_the_example_job_runs_as_containers_to_succeeded(
        cluster: LocalCluster, job_run: dict[str, Any]) -> None:
    job = job_run["job"]
    st = job.get("status") or {}
    desc = kubectl(cluster, "-n", JOBS, "describe", "pods", check=False).stdout[-6000:]
    assert st.get("summary") == "Succeeded", f"{st}\n{desc}"
    assert st["step"] == job["spec"]["steps"] == 6
    pods = job_run["pods"]
    for role in ("head", "learner", "rollout", "driver"):
        assert f"{JOB}-{role}-0" in pods, sorted(pods)
    for name, incarnations in pods.items():
        for p in incarnations:
            assert p["spec"]["nodeName"] == NODE_NAME, (name, p["spec"].get("nodeName"))
            assert p["spec"]["containers"][0]["image"].startswith("ghcr.io/rlpacer/trainer:")
            for cs in p["status"].get("containerStatuses") or []:
                assert cs.get("containerID", "containerd://").startswith("containerd://")
    conds = {c["type"]: c for c in st.get("conditions") or []}
    done = conds["Succeeded"]
    assert (done["status"], done["reason"]) == ("True", "Completed"), conds


def test_each_pod_shows_its_roles_work_in_kubectl_logs(job_run: dict[str, Any]) -> None:
    pods, run = job_run["pods"], job_run
    head = pods[f"{JOB}-head-0"][0]
    ips = {n: p[0]["status"]["podIP"] for n, p in pods.items() if p[0]["status"].get("podIP")}
    assert len(set(ips.values())) == len(ips), ips  # each pod on an address of its own
    head_log = _log(run, head)
    assert "Ray runtime started" in head_log, head_log[-3000:]
    for role in ("learner", "rollout"):
        log = _log(run, pods[f"{JOB}-{role}-0"][0])
        # joined the head through its Service's DNS name (CoreDNS), on its own pod IP
        assert "Ray runtime started" in log, log[-3000:]
        assert f"Local node IP: {ips[f'{JOB}-{role}-0']}" in log, log[-3000:]
    # the actors Ray placed on each pod wrote their work into that pod's own log
    learner_log = _log(run, pods[f"{JOB}-learner-0"][0])
    updates = [ln for ln in learner_log.splitlines() if "learner rank 0: update " in ln]
    assert len(updates) >= 6 and all(" loss " in ln for ln in updates), learner_log[-3000:]
    rollout_log = _log(run, pods[f"{JOB}-rollout-0"][0])
    assert f"rollout engine replica 0 started on {JOB}-rollout-0" in rollout_log
    assert _generated(rollout_log, 0) > 0, rollout_log[-3000:]
    driver_log = _log(run, pods[f"{JOB}-driver-0"][0])
    assert f"Connecting to existing Ray cluster at address: {JOB}-head.{JOBS}.svc" in driver_log
    steps = [ln for ln in driver_log.splitlines() if ln.startswith("step ")]
    assert len(steps) == 6, driver_log[-4000:]
    # every step generated by the engine in rollout-0's container (its hostname is the pod's)
    assert all(f"replica 0 on {JOB}-rollout-0 (" in ln for ln in steps), steps
    assert "done: 6 steps" in driver_log
    # no claim: each pod's /checkpoints is an emptyDir of its own, and the learner's part of
    # the checkpoint (learner.pt, the Hugging Face model/) reached the driver's through Ray
    assert not run["job"]["spec"]["checkpoint"].get("volumeClaim")
    ckpt = next((ln for ln in driver_log.splitlines()
                 if ln.startswith("checkpoint step-000006 in /checkpoints: ")), "")
    held = ckpt.split(": ", 1)[-1].split(", ")
    assert {"learner.pt", "model", "state.json"} <= set(held), driver_log[-3000:]


def test_a_long_round_adds_a_rollout_pod_that_joins_and_generates(
        job_run: dict[str, Any]) -> None:
    pods, run = job_run["pods"], job_run
    extras = pods.get(f"{JOB}-rollout-1", [])
    assert extras, "no long round added a rollout pod"
    actions = run["job"]["status"]["scaleActions"]
    from_its_log = 0
    idle = 0
    for p in extras:
        log = _log(run, p)
        n = _generated(log, 1)
        if n == 0:
            # an incarnation that served nothing: only one whose scale-up timed out (the
            # round ran on what was ready). Not one added for a round the job never ran (the
            # last step's report scales nothing up: asserted below), nor one for a long round
            # right after a one-second short round: the cut replicas' readiness is dropped
            # with the cut (scaler.plan_round), so that round waits for its new pod
            idle += 1
            continue
        # one that served joined Ray from its own pod's address
        assert "Ray runtime started" in log and \
            f"Local node IP: {p['status'].get('podIP')}" in log, (p["status"], log[-3000:])
        from_its_log += n
    driver_log = _log(run, pods[f"{JOB}-driver-0"][0])
    long_steps = [ln for ln in driver_log.splitlines()
                  if ln.startswith("step ") and " Long " in ln]
    assert long_steps, driver_log[-4000:]
    served = 0
    for ln in long_steps:
        mark = f"replica 1 on {JOB}-rollout-1 ("
        if mark in ln:
            served += int(ln.split(mark, 1)[1].split()[0])
    assert served > 0, f"the added rollout pod generated nothing: {long_steps}"
    # and its own log says so: its engine's lines, written from inside its container (it may
    # count a response the driver had aborted while it was in flight)
    assert from_its_log >= served, (from_its_log, served)
    timed_out = sum(1 for a in actions if a["reason"] == "ScaleUpTimedOut")
    assert idle <= timed_out, (idle, actions)
    moves = [(a["reason"], a["fromReplicas"], a["toReplicas"]) for a in actions]
    assert ("LongRound", 1, 2) in moves and ("LongRoundDone", 2, 1) in moves, moves
    # no scale-up for the round the last step's report asked for (its plan says done)
    steps = run["job"]["spec"]["steps"]
    assert all(a["step"] < steps for a in actions if a["reason"] == "LongRound"), actions


def test_network_policies_keep_the_jobs_ports_to_its_own_pods(
        cluster: LocalCluster, job_run: dict[str, Any]) -> None:
    """Enforced, on the node, while the job ran: what the operator's policies (the job's
    ``<job>-pods`` and ``<job>-driver``, the chart's for the operator pod) say."""
    probes = job_run["probes"]
    assert probes, "the job never ran its head and learner together: nothing was probed"
    print("\n" + "\n".join(f"  {k}: {v}" for k, v in probes.items()))

    def blocked(key: str) -> None:
        got = probes[key].split()
        # refused at once (kube-router's REJECT) or dropped; never connected
        assert got[0] == "blocked" and float(got[-1]) < 5, (key, probes)

    ports = [int(p) for p in probes["head listens on"].split()]
    assert 6379 in ports and len(ports) >= 3, probes["head listens on"]  # GCS, raylet, ...
    # every port the head listens on: open to the job's own learner, refused to the others
    open_to_job = [p for p in ports if probes[f"learner -> head {p}"].startswith("open")]
    assert 6379 in open_to_job and len(open_to_job) >= 3, probes
    for who in STRANGERS:
        for port in open_to_job:
            blocked(f"{who} -> head {port}")
        blocked(f"{who} -> operator reports")
        # the strangers' own traffic works where a policy allows it
        assert probes[f"{who} -> operator webhook"].startswith("open"), probes
    assert probes["other-job -> stranger"].startswith("open"), probes
    # the job's own pods reach each other, before and after, and nothing outside the job
    assert probes["learner -> head 6379, after"].startswith("open"), probes
    blocked("learner -> stranger")
    # the policies that did it, as the operator built them
    pol = {p["metadata"]["name"]: p for p in get(cluster, "networkpolicies", "-n", JOBS)["items"]}
    assert {f"{JOB}-pods", f"{JOB}-driver"} <= set(pol), sorted(pol)
    assert pol[f"{JOB}-pods"]["metadata"]["ownerReferences"][0]["name"] == JOB
    # and the driver, allowed only to the operator's pods, reported every step through them
    assert job_run["job"]["status"]["step"] == 6


def test_a_jobs_network_policy_deleted_by_hand_comes_back(
        cluster: LocalCluster, job_run: dict[str, Any]) -> None:
    name = f"{JOB}-pods"
    before = get(cluster, "networkpolicy", name, "-n", JOBS)
    kubectl(cluster, "-n", JOBS, "delete", "networkpolicy", name, "--wait=true")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = kubectl(cluster, "-n", JOBS, "get", "networkpolicy", name, "-o", "json", check=False)
        if r.returncode == 0:
            after = json.loads(r.stdout)
            assert after["metadata"]["uid"] != before["metadata"]["uid"]
            assert after["spec"] == before["spec"]
            return
        time.sleep(0.5)
    pytest.fail(f"the operator did not restore NetworkPolicy {JOBS}/{name} within 60 s")


def test_operator_metrics_scraped_from_its_pod_count_the_jobs_steps(
        job_run: dict[str, Any]) -> None:
    text = job_run["metrics"]
    line = next((ln for ln in text.splitlines() if ln.startswith("rlpacer_steps_total{")
                 and f'job="{JOB}"' in ln and f'namespace="{JOBS}"' in ln), None)
    assert line is not None, text[:3000]
    assert float(line.rsplit(" ", 1)[1]) == 6.0, line


def test_the_sandbox_image_is_the_locally_built_pause(cluster: LocalCluster) -> None:
    out = subprocess.run(["ctr", "--address", str(cluster.node.socket), "-n", "k8s.io",
                          "images", "ls", "-q"], capture_output=True, text=True, check=True)
    assert PAUSE_IMAGE in out.stdout.split()


def test_the_node_finds_the_preloaded_images_and_imports_nothing_at_start(
        cluster: LocalCluster, images: dict[str, str]) -> None:
    """Set-up puts the images into the node's store (``rlpacer.testing.node preload``) beside
    the control plane's build; the node's start then imports none of them (the trainer image's
    import is minutes), because each is recognised as the very image podman holds."""
    assert set(PRELOADED) == {PAUSE_IMAGE, *images.values()}
    assert cluster.node.import_seconds == {}
    refs = subprocess.run(["ctr", "--address", str(cluster.node.socket), "-n", "k8s.io",
                           "images", "ls", "-q"], capture_output=True, text=True,
                          check=True).stdout.split()
    assert set(images.values()) <= set(refs)


def test_the_kubelet_is_a_node_identity_held_to_the_node_authorizer(
        cluster: LocalCluster) -> None:
    """The kubelet's credentials are ``system:node:<name>`` in ``system:nodes``: the Node
    authorizer lets it read its own Node, and refuses it a Secret that no pod on it uses."""
    node_kc = str(cluster.data_dir / "node.kubeconfig")

    def as_node(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([find_kubectl(), "--kubeconfig", node_kc, *args],
                              capture_output=True, text=True, timeout=60)

    who = json.loads(as_node("auth", "whoami", "-o", "json").stdout)["status"]["userInfo"]
    assert who["username"] == f"system:node:{NODE_NAME}", who
    assert "system:nodes" in who["groups"], who
    assert as_node("get", "node", NODE_NAME, "-o", "name").returncode == 0
    kubectl(cluster, "create", "namespace", "node-authz", check=False)
    kubectl(cluster, "-n", "node-authz", "create", "secret", "generic", "unused",
            "--from-literal=k=v")
    assert kubectl(cluster, "-n", "node-authz", "get", "secret", "unused").returncode == 0
    denied = as_node("-n", "node-authz", "get", "secret", "unused")
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    assert "no relationship found between node" in denied.stderr, denied.stderr


def test_its_services_are_apart_from_other_local_clusters(cluster: LocalCluster) -> None:
    """The node's kube-proxy writes the host's iptables rules for this cluster's Services:
    they come from REAL_NODE_SERVICE_CIDR, never another local cluster's SERVICE_CIDR (whose
    10.96.0.1 is every such cluster's ``kubernetes`` Service), so a local cluster started
    beside it keeps its own Service traffic."""
    svc = get(cluster, "service", "kubernetes", "-n", "default")
    assert svc["spec"]["clusterIP"] == "10.97.0.1", svc["spec"]
    rules = subprocess.run(["iptables", "-t", "nat", "-S", "KUBE-SERVICES"], capture_output=True,
                           text=True, check=True).stdout.splitlines()


    def dest(rule: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        return ipaddress.ip_network(rule.split("-d ", 1)[1].split()[0])

    cluster_ips = [dest(r) for r in rules if "-d " in r and "cluster IP" in r]
    assert cluster_ips, rules  # the Services' rules are there, all in the node's range
    assert all(d.subnet_of(ipaddress.ip_network(REAL_NODE_SERVICE_CIDR))  # type: ignore[arg-type]
               for d in cluster_ips), cluster_ips
    # and no rule of any kind catches the other local clusters' Service addresses
    others = ipaddress.ip_network(SERVICE_CIDR)
    assert not any(dest(r).overlaps(others) for r in rules if "-d " in r), rules
