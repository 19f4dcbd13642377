"""`rlpacer dev-cluster`: what a person runs to watch a job train on a laptop, command for
command (README "Watch it on a laptop"): up, kubectl apply the policy and the tiny job,
kubectl get rltj until Succeeded, down, and nothing left behind."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.testing.cluster import find_kubectl, repo_root

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
RLPACER = Path(sys.executable).with_name("rlpacer")
NS = "team-a"


def _netns(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.startswith(tag + "-")]


def _finished(kubectl: Callable[..., subprocess.CompletedProcess[str]],
              timeout: float = 600) -> dict[str, Any]:
    """The tiny job's status once Succeeded or Failed (or as it stands at the timeout)."""
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = kubectl("get", "rltj", "tiny-cluster", "-n", NS, "-o", "json")
        status = json.loads(r.stdout).get("status", {}) if r.returncode == 0 else {}
        if status.get("summary") in ("Succeeded", "Failed"):
            break
        time.sleep(2)
    return status


def _kubectl(up_stdout: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """kubectl against the dev cluster whose ``up`` printed ``up_stdout`` (its env line)."""
    kubeconfig = up_stdout.split("\n")[0].split("=", 1)[1]
    env = dict(os.environ, KUBECONFIG=kubeconfig)

    def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(find_kubectl()), *args], env=env, input=input,
                              capture_output=True, text=True, timeout=60)
    return kubectl


def _apply_job(kubectl: Callable[..., subprocess.CompletedProcess[str]],
               job: dict[str, Any]) -> None:
    until = time.monotonic() + 60
    while True:  # a CRD just installed answers 429 while its storage initialises
        r = kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(job))
        if r.returncode == 0 or "initializing" not in r.stderr or time.monotonic() > until:
            break
        time.sleep(1)
    assert r.returncode == 0, r.stderr


Kubectl = Callable[..., subprocess.CompletedProcess[str]]
DRIVER = Path(NS) / "pods" / "tiny-cluster-driver-0"  # the played driver pod, under pods/


def _driver_records(d: Path) -> list[dict[str, Any]]:
    """The played driver's step records (its checkpoint volume's metrics file)."""
    path = d / "pods" / DRIVER / "volumes" / "checkpoints" / "metrics-attempt0.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


@contextlib.contextmanager
def _slow_dev_cluster(tmp_path: Path) -> Iterator[tuple[Path, Kubectl]]:
    """`rlpacer dev-cluster up` with every engine step made 0.4 s longer (the testing setting
    ``RLPACER_TEST_ENGINE_STEP_SLEEP_S``, given to ``up``, which passes it to every played
    pod) so a long round lasts long enough to act in; (its folder, kubectl against it); down
    after, which must succeed."""
    d = tmp_path / "dev"
    up = subprocess.run([str(RLPACER), "dev-cluster", "up", "--dir", str(d)],
                        capture_output=True, text=True, timeout=400,
                        env=dict(os.environ, RLPACER_TEST_ENGINE_STEP_SLEEP_S="0.4"))
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield d, _kubectl(up.stdout)
    finally:
        down = subprocess.run([str(RLPACER), "dev-cluster", "down", "--dir", str(d)],
                              capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr


def test_up_apply_watch_down(tmp_path: Path) -> None:
    d = tmp_path / "dev"
    up = subprocess.run([str(RLPACER), "dev-cluster", "up", "--dir", str(d)],
                        capture_output=True, text=True, timeout=400)
    assert up.returncode == 0, up.stdout + up.stderr
    tag = (d / "ready").read_text().strip()
    try:
        env_out = subprocess.run([str(RLPACER), "dev-cluster", "env", "--dir", str(d)],
                                 capture_output=True, text=True, check=True).stdout
        assert env_out == up.stdout and env_out.startswith("export KUBECONFIG=")
        kubectl = _kubectl(env_out)

        r = kubectl("apply", "-n", NS, "-f", str(repo_root() / "examples"
                                               / "tiny-cluster-policy.yaml"))
        assert r.returncode == 0, r.stderr
        job = yaml.safe_load((repo_root() / "examples" / "tiny-cluster.yaml").read_text())
        # short (the point is that it trains, played for real), with one long round of two
        # steps' prompts (tailBatching.longRound.prompts 16 at promptsPerStep 8: 4 deferred
        # a short round, so step 4 is long) and 8 fresh prompts beside them (fillPrompts)
        # on the rollout's own replica, every group trained (no dynamic sampling: the
        # report's counts are the round's up to 24 x G, past what a step of 8 prompts could
        # report, which the operator must take)
        spec = job["spec"]
        spec["steps"] = 5
        spec["algorithm"]["dynamicSampling"] = False
        spec["tailBatching"]["longRound"] = {"rolloutReplicas": 1, "prompts": 16,
                                             "fillPrompts": 8}
        r = kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(job))
        assert r.returncode == 0, r.stderr
        status = _finished(kubectl)
        log = (d / "supervisor.log").read_text(errors="replace")
        assert status.get("summary") == "Succeeded", f"{status}\n{log[-3000:]}"
        assert status.get("step") == 5 and status.get("longRounds") == 1, status
        # the driver pod was played on a host of its own and trained
        pods = d / "pods" / NS / "pods"
        driver_log = (pods / "tiny-cluster-driver-0" / "log.txt").read_text()
        assert "done: 5 steps" in driver_log, driver_log[-2000:]
        recs = _driver_records(d)
        assert [r["round_kind"] for r in recs] == ["Short"] * 4 + ["Long"], recs
        long, short = recs[4], recs[0]
        # the 16 queued prompts and the fill groups done by the time theirs were, trained;
        # the fill's others aborted (and queued)
        fill = long["fill_kept"]
        assert long["fill_prompts"] == 8 and 1 <= fill <= 8, long
        assert len(long["prompts"]) == 16 + fill, long
        assert long["kept"] == (16 + fill) * long["group_size"], long
        assert long["aborted"] == (8 - fill) * long["group_size"], long
        # three steps' prompts launched, three steps' optimizer updates
        assert long["learner_updates"] == 3 * short["learner_updates"] > 0, long
        for role in ("head", "learner", "rollout"):
            assert (pods / f"tiny-cluster-{role}-0" / "log.txt").exists(), role
        r = kubectl("get", "rltj", "-n", NS)
        assert "tiny-cluster" in r.stdout and "Succeeded" in r.stdout, r.stdout
    finally:
        down = subprocess.run([str(RLPACER), "dev-cluster", "down", "--dir", str(d)],
                              capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not d.exists()
    assert _netns(tag) == []  # every played host is gone
    gone = subprocess.run([str(RLPACER), "dev-cluster", "env", "--dir", str(d)],
                          capture_output=True, text=True)
    assert gone.returncode == 1 and "no dev cluster is up" in gone.stderr


def test_up_with_kueue_admits_the_job_and_its_long_rounds_extra_replica(tmp_path: Path) -> None:
    """`rlpacer dev-cluster up --kueue`: the tiny job with ``scheduling.queueName: default``
    is admitted through the real Kueue (the operator with the chart's RBAC,
    ``kueue.enabled``) and trains on played pods. Its long round's extra rollout replica is
    asked from a burst pool held at first (its ClusterQueue stopped): the real driver runs
    short rounds in the long round's place (``maxDeferredRounds: 2``) instead of waiting;
    the pool is released, Kueue admits the replica with a Workload of its own, the long round
    runs on it. Then a higher-priority workload takes the queue's quota: Kueue preempts the
    job, whose real driver checkpoints at its next step report on the job's claim and stops
    (``checkpoint.evictionGraceSeconds``); the quota goes to the other workload; once it is
    gone the job is admitted again and a new attempt resumes from that checkpoint, its
    controller state continuous, and Succeeds; its Workload is marked Finished."""
    d = tmp_path / "dev"
    up = subprocess.run([str(RLPACER), "dev-cluster", "up", "--kueue", "--dir", str(d)],
                        capture_output=True, text=True, timeout=400)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        kubectl = _kubectl(up.stdout)

        def status() -> dict[str, Any]:
            r = kubectl("get", "rltj", "tiny-cluster", "-n", NS, "-o", "json")
            return json.loads(r.stdout).get("status", {}) if r.returncode == 0 else {}

        # the burst pool: a ClusterQueue held (stopPolicy Hold) until the test releases it
        pool = [
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
             "metadata": {"name": "burst"},
             "spec": {"namespaceSelector": {}, "stopPolicy": "Hold", "resourceGroups": [{
                 "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                 "flavors": [{"name": "gpu", "resources": [
                     {"name": "cpu", "nominalQuota": "64"},
                     {"name": "memory", "nominalQuota": "512Gi"},
                     {"name": "nvidia.com/gpu", "nominalQuota": 8}]}]}]}},
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
             "metadata": {"name": "burst", "namespace": NS}, "spec": {"clusterQueue": "burst"}},
        ]
        # the checkpoints' claim (bound by hand: no provisioner), and the priority of the
        # workload that will preempt the job
        claim = "tiny-checkpoints"
        pool += [
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": claim},
             "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                      "storageClassName": "manual", "hostPath": {"path": str(d / claim)},
                      "claimRef": {"namespace": NS, "name": claim}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": claim, "namespace": NS},
             "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual",
                      "volumeName": claim, "resources": {"requests": {"storage": "1Gi"}}}},
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
             "metadata": {"name": "dev-urgent"}, "value": 1000},
        ]
        r = kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                           "items": pool}))
        assert r.returncode == 0, r.stderr
        job = yaml.safe_load((repo_root() / "examples" / "tiny-cluster.yaml").read_text())
        # the first short rounds (and DAPO's refill rounds) fill the long queue: the long
        # round is due at step 1 or 2, run in two short rounds' place while the pool is held,
        # then on the granted replica
        job["spec"]["steps"] = STEPS = 10
        job["spec"]["scheduling"] = {"queueName": "default"}
        # every step checkpointed on the claim (evictionGraceSeconds defaults to 120 s)
        job["spec"]["checkpoint"] = {"everySteps": 1, "volumeClaim": claim}
        # the driver asks for a little of the queue's CPU: what the urgent workload preempts
        job["spec"]["driver"] = {"resources": {"requests": {"cpu": "100m"}}}
        job["spec"]["tailBatching"]["longRound"].update(
            {"queueName": "burst", "maxDeferredRounds": 2})
        _apply_job(kubectl, job)
        until = time.monotonic() + 400
        while (status().get("rollout") or {}).get("deferredRounds", 0) < 2:
            assert time.monotonic() < until, status()
            assert status().get("summary") not in ("Succeeded", "Failed"), status()
            time.sleep(1)
        held = status()
        assert held["rollout"]["state"] == "ScalingUp", held
        due = held["step"] - 2  # the step the long round was first due at (deferred twice)
        assert due >= 1, held
        r = kubectl("patch", "clusterqueue", "burst", "--type=merge", "-p",
                    '{"spec": {"stopPolicy": "None"}}')
        assert r.returncode == 0, r.stderr
        # once the long round has run: a workload of higher priority asks for all of the
        # queue's CPU, and Kueue preempts the job to make room
        pods = d / "pods" / NS / "pods"
        driver0 = pods / "tiny-cluster-driver-0" / "log.txt"
        until = time.monotonic() + 300
        while not any(ln.startswith("step ") and " Long " in ln for ln in
                      driver0.read_text(errors="replace").splitlines()):
            assert time.monotonic() < until, status()
            assert status().get("summary") not in ("Succeeded", "Failed"), status()
            time.sleep(0.5)
        urgent = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                  "metadata": {"name": "urgent", "namespace": NS},
                  "spec": {"queueName": "default", "priorityClassRef": {
                               "group": "scheduling.k8s.io", "kind": "PriorityClass",
                               "name": "dev-urgent"},
                           "priority": 1000, "podSets": [{"name": "main", "count": 1,
                           "template": {"spec": {"restartPolicy": "Never", "containers": [{
                               "name": "main", "image": "busybox", "resources": {
                                   "requests": {"cpu": "128"}}}]}}}]}}
        r = kubectl("apply", "-f", "-", input=json.dumps(urgent))
        assert r.returncode == 0, r.stderr
        until = time.monotonic() + 180
        while True:  # the preempted driver checkpoints at its next report and stops
            wl = json.loads(kubectl("get", "workloads.kueue.x-k8s.io", "urgent", "-n", NS,
                                    "-o", "json").stdout)
            if any(c["type"] == "Admitted" and c["status"] == "True"
                   for c in (wl.get("status") or {}).get("conditions") or []):
                break
            assert time.monotonic() < until, (status(), wl.get("status"))
            assert status().get("summary") not in ("Succeeded", "Failed"), status()
            time.sleep(0.5)
        evicted = status()
        assert evicted["attempt"] == 0 and evicted["summary"] == "Queued", evicted
        stopped_at = evicted["step"]
        assert 1 <= stopped_at < STEPS, evicted
        log0 = driver0.read_text(errors="replace")
        assert f"done: {stopped_at} steps" in log0, log0[-3000:]
        assert (d / "pods" / NS / "pvc" / claim / "latest").read_text().strip() \
            == f"step-{stopped_at:06d}"
        r = kubectl("delete", "workloads.kueue.x-k8s.io", "urgent", "-n", NS)
        assert r.returncode == 0, r.stderr
        status_ = _finished(kubectl)
        log = (d / "supervisor.log").read_text(errors="replace")
        assert status_.get("summary") == "Succeeded", f"{status_}\n{log[-3000:]}"
        assert status_.get("step") == STEPS and status_.get("longRounds", 0) >= 1, status_
        # a new attempt, from the checkpoint written at the eviction, not from step 0
        assert status_["attempt"] == 1, status_
        log1 = (pods / "tiny-cluster-driver-1" / "log.txt").read_text(errors="replace")
        assert f"resumed from checkpoint at step {stopped_at} (attempt 1)" in log1, log1[-3000:]
        assert f"step {stopped_at} G=" in log1 and f"step {stopped_at - 1} G=" not in log1
        conds = {c["type"]: c for c in status_["conditions"]}
        assert conds["QueueAdmitted"]["status"] == "True", conds["QueueAdmitted"]
        assert "ClusterQueue dev" in conds["QueueAdmitted"]["message"]
        wl = json.loads(kubectl("get", "workloads.kueue.x-k8s.io", "tiny-cluster-workload",
                                "-n", NS, "-o", "json").stdout)
        finished = [c for c in wl["status"]["conditions"] if c["type"] == "Finished"]
        assert finished and finished[0]["status"] == "True", wl["status"]
        r = kubectl("get", "events", "-n", NS, "--field-selector",
                    "involvedObject.name=tiny-cluster", "-o", "json")
        reasons = [e["reason"] for e in json.loads(r.stdout)["items"]]
        for want in ("Queued", "QueueAdmitted", "LongRoundQueued", "LongRoundAdmitted",
                     "LongRoundReleased", "ScaledUp", "EvictionCheckpoint"):
            assert want in reasons, (want, reasons)
        assert reasons.count("LongRoundDeferred") >= 2, reasons  # 2 before the eviction
        driver_log = log0
        # the real driver ran two steps as short rounds in the long round's place
        for step in (due, due + 1):
            assert f"step {step}: a short round in place of the long round" in driver_log
            line = next(ln for ln in driver_log.splitlines() if ln.startswith(f"step {step} G="))
            assert " Short " in line, line
        # the extra replica Kueue granted generated part of the long round: the driver's
        # step lines name it with responses, and its own pod's log says it generated them
        served = 0
        for ln in driver_log.splitlines():
            if ln.startswith("step ") and " Long " in ln and "replica 1 on " in ln:
                served += int(ln.split("replica 1 on ", 1)[1].split("(", 1)[1].split()[0])
        assert served > 0, driver_log[-3000:]
        extra_log = (pods / "tiny-cluster-rollout-1" / "log.txt").read_text(errors="replace")
        mark = "rollout engine replica 1: generated "
        generated = sum(int(ln.split(mark, 1)[1].split()[0])
                        for ln in extra_log.splitlines() if mark in ln)
        assert generated >= served, (generated, served, extra_log[-2000:])
    finally:
        down = subprocess.run([str(RLPACER), "dev-cluster", "down", "--dir", str(d)],
                              capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr


def test_a_rollout_pod_deleted_mid_long_round_has_its_requests_redispatched(
        tmp_path: Path) -> None:
    """The real operator (`rlpacer dev-cluster`: API server, StatefulSet controller, the
    chart's operator, every pod played on a host of its own): the tiny job scales its rollout
    to 2 for its first long round, every engine step 0.4 s longer (``_slow_dev_cluster``).
    Once rollout-1's engine has joined and the round is under way, its pod is deleted
    (``kubectl delete --force``): the driver finds the engine dead with requests unfinished
    and re-dispatches them to rollout-0 (counted, in the step's record and the log), every
    response of the round is counted once, and the job Succeeds."""
    with _slow_dev_cluster(tmp_path) as (d, kubectl):
        job = yaml.safe_load((repo_root() / "examples" / "tiny-cluster.yaml").read_text())
        job["spec"]["steps"] = 4
        _apply_job(kubectl, job)
        log_path = d / "pods" / DRIVER / "log.txt"

        def driver_log() -> str:
            return log_path.read_text(errors="replace") if log_path.exists() else ""

        until = time.monotonic() + 500
        while "rollout engine of replica 1 joined" not in driver_log():
            assert time.monotonic() < until, driver_log()[-3000:]
            assert "done:" not in driver_log(), driver_log()[-3000:]
            time.sleep(0.5)
        time.sleep(4.0)  # the long round under way on both engines (0.4 s a decode step)
        assert "\nstep " not in driver_log().split("rollout engine of replica 1 joined")[1]
        r = kubectl("delete", "pod", "tiny-cluster-rollout-1", "-n", NS, "--grace-period=0",
                    "--force")
        assert r.returncode == 0, r.stderr
        status = _finished(kubectl)
        log = driver_log()
        assert status.get("summary") == "Succeeded", f"{status}\n{log[-3000:]}"
        recs = _driver_records(d)
    long = next(r for r in recs if r["round_kind"] == "Long")
    print(json.dumps({k: long[k] for k in ("step", "replicas", "engines", "kept")}, indent=1))
    dead = [e for e in long["engines"] if e.get("died")]
    live = [e for e in long["engines"] if not e.get("died")]
    assert [e["replica"] for e in dead] == [1], long["engines"]
    assert [e["replica"] for e in live] == [0], long["engines"]
    (gone,) = dead
    assert gone["redispatched"] > 0, gone  # it died with requests unfinished
    assert f"rollout replica 1: {gone['redispatched']} unfinished requests re-dispatched" in log
    assert gone["responses"] + live[0]["responses"] == long["kept"], long
    assert long["replicas"] == [0, 1], long
    # the operator scaled up for the long round and back down after it
    reasons = [a["reason"] for a in status.get("scaleActions", [])]
    assert reasons[:2] == ["LongRound", "LongRoundDone"], reasons


def test_a_long_round_gives_its_added_replica_back_to_the_real_operator(tmp_path: Path) -> None:
    """``tailBatching.longRound.releaseWhenFits`` with the real operator (`rlpacer
    dev-cluster`: the chart's operator, its report Service, the StatefulSet controller, every
    pod played on a host of its own, real vLLM): the tiny job's first long round runs on
    rollout-0 and the added rollout-1; once its unfinished requests fit on rollout-0 at the
    load it began with, rollout-1's move there with their tokens and the driver's ``POST
    release`` reaches the operator, which scales the rollout back then (scale action
    LongRoundReleased, before the step's report: the report finds nothing to scale down).
    Engine steps are 0.4 s longer (``_slow_dev_cluster``) so the round has a tail to act in.
    Every response of the round is answered once and the job Succeeds."""
    with _slow_dev_cluster(tmp_path) as (d, kubectl):
        job = yaml.safe_load((repo_root() / "examples" / "tiny-cluster.yaml").read_text())
        job["spec"]["steps"] = 3  # two short rounds fill the queue: step 2 is the long one
        job["spec"]["tailBatching"]["longRound"]["releaseWhenFits"] = True
        _apply_job(kubectl, job)
        status = _finished(kubectl)
        log = (d / "pods" / DRIVER / "log.txt").read_text(errors="replace")
        assert status.get("summary") == "Succeeded", f"{status}\n{log[-3000:]}"
        recs = _driver_records(d)
    (long,) = [r for r in recs if r["round_kind"] == "Long"]
    print(json.dumps({k: long[k] for k in ("step", "replicas", "released_mid_round",
                                           "seconds_rollout", "engines", "kept")}, indent=1))
    t, *gone = long["released_mid_round"]
    assert gone == [1] and 0 < t < long["seconds_rollout"], long["released_mid_round"]
    by = {e["replica"]: e for e in long["engines"]}
    assert by[1].get("released") and by[1]["responses"] > 0 and by[0]["responses"] > 0, by
    assert by[0]["responses"] + by[1]["responses"] == long["kept"], long
    assert "the operator scales back now" in log, log[-2000:]
    # the operator took the release: scaled back at it, not at the step's report
    actions = [(a["reason"], a["step"], a["fromReplicas"], a["toReplicas"])
               for a in status.get("scaleActions", [])]
    assert actions[:2] == [("LongRound", long["step"], 1, 2),
                           ("LongRoundReleased", long["step"], 2, 1)], actions
    assert ("LongRoundDone", long["step"], 2, 1) not in actions, actions
