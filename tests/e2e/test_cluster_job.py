"""A whole job on the local control plane, from `helm install` to Succeeded.

What a platform team and a user do, command for command (README "Quick start on a GPU
cluster"): `helm install` the chart, `kubectl apply -f examples/tiny-cluster.yaml`,
`kubectl get rltj -w`. What the cluster cannot do here is played locally:

* the operator runs as a local process with the env of the chart's rendered Deployment, the
  chart's webhook certificate and the chart's ServiceAccount token (so the chart's RBAC is what
  it gets), listening on loopback where its Service would route;
* the job's driver pod is played by the trainer's pod entrypoint as a local process
  (``rlpacer.testing.harness``: the pod's env and mounted files, Service addresses rewritten to
  loopback, Ray started in the process); its exit marks the KWOK pod Succeeded/Failed. The Ray
  head, learner and rollout pods are played by nothing: KWOK runs them, and the operator's
  rollout scaler reads their readiness for long rounds.

The release is scoped to one job namespace (scope Namespaced), so the shared session cluster's
other tests never meet this operator or its webhooks. One job runs for the module; the tests
after it check what was observed while it ran. Runtime: about 2-3 minutes on 2 shared cores
(one vLLM engine start, six small steps, one operator restart); RLPACER_E2E_TIMEOUT bounds the
job (default 1200 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.api import contract
from rlpacer.api.status import ConditionType
from rlpacer.devcluster import OperatorProcess as Operator
from rlpacer.devcluster import helm_values
from rlpacer.operator import names
from rlpacer.testing import LocalCluster
from rlpacer.testing.cluster import find_kubectl, free_ports, repo_root
from rlpacer.testing.harness import PlayedPod, PodHarness
from rlpacer.testing.netns import TestHosts

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

CHART = repo_root() / "charts" / "rlpacer"
EXAMPLE = repo_root() / "examples" / "tiny-cluster.yaml"
JOB = "tiny-cluster"
RESUME = "resume"  # the second job: a learner pod dies mid-job
USER_MODEL = "user-model"  # the third: a user's model and data on claims
RUN_TIMEOUT = float(os.environ.get("RLPACER_E2E_TIMEOUT", "1200"))
ALL_ROLES = [r.value for r in contract.Role]
# The namespace's policy (the example job fits it; see the file's comments).
POLICY = repo_root() / "examples" / "tiny-cluster-policy.yaml"


@dataclass
class Release:
    cluster: LocalCluster
    name: str
    system: str
    jobs: str
    values: list[str]
    operator: Operator
    harness: PodHarness
    tmp: Path
    uninstalled: bool = False

    def kubectl(self, *args: str, check: bool = True,
                input: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, check=check, input=input)

    def get(self, *args: str) -> Any:
        r = self.kubectl("get", *args, "-o", "json", check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None


@pytest.fixture(scope="module")
def release(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Release]:
    suffix = uuid.uuid4().hex[:6]
    name, system, jobs = f"e2e-{suffix}", f"e2e-sys-{suffix}", f"e2e-jobs-{suffix}"
    tmp = tmp_path_factory.mktemp("cluster-job")
    cluster.create_namespace(system)
    # the jobs' namespace enforces the "restricted" Pod Security Standard: every pod the operator
    # creates (driver, and the StatefulSets' head, learner and rollout pods) must pass it
    cluster.create_namespace(jobs, labels={
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest"})
    values = helm_values(jobs, free_ports(3))
    op = Operator(cluster, name, system, tmp)
    # every pod of the job played on a host of its own; the operator's Service resolves to
    # the hosts' gateway, where the operator (a process of this namespace) listens
    hosts = TestHosts().start()
    op.report_host = hosts.gateway
    svc = f"{name}-rlpacer.{system}.svc"
    harness = PodHarness(cluster, jobs, tmp / "harness", roles=ALL_ROLES, hosts=hosts,
                         names={svc: hosts.gateway, f"{svc}.cluster.local": hosts.gateway},
                         label_selector=f"{contract.LABEL_JOB} in ({JOB},{RESUME},{USER_MODEL})")
    rel = Release(cluster, name, system, jobs, values, op, harness, tmp)
    try:
        # helm install rlpacer charts/rlpacer -n rlpacer-system --create-namespace, plus the
        # local run's values (loopback webhook URL, free ports, one watched namespace)
        cluster.helm("install", name, str(CHART), "-n", system, *values)
        op.start()
        harness.start()
        # kubectl apply -n team-a -f examples/tiny-cluster-policy.yaml (the platform team).
        # The webhook server starts with Kopf: retry the first apply briefly.
        deadline = time.monotonic() + 60
        while (r := rel.kubectl("apply", "-n", jobs, "-f", str(POLICY),
                                check=False)).returncode != 0:
            assert time.monotonic() < deadline, r.stderr
            time.sleep(1)
        yield rel
    finally:
        harness.stop()
        hosts.close()
        op.stop()
        if not rel.uninstalled:
            cluster.helm("uninstall", name, "-n", system, check=False)
        cluster.delete_namespace(jobs)
        cluster.delete_namespace(system)
        print(f"\noperator log: {op.log}\nharness root: {tmp / 'harness'}")


def test_a_job_breaking_the_namespace_policy_is_rejected_at_apply(release: Release) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "too-greedy"
    doc["spec"]["groupControl"]["targetStragglerRate"] = "0.5"
    doc["spec"]["tailBatching"]["longRound"]["rolloutReplicas"] = 4
    r = release.kubectl("apply", "-n", release.jobs, "-f", "-", input=json.dumps(doc),
                        check=False)
    assert r.returncode != 0, r.stdout
    assert "admission webhook" in r.stderr and "denied the request" in r.stderr, r.stderr
    assert "spec.groupControl.targetStragglerRate: 0.5 breaks <= 0.3" in r.stderr, r.stderr
    assert "spec.tailBatching.longRound.rolloutReplicas" in r.stderr, r.stderr
    assert f"RLTrainingPolicy {release.jobs}/team-limits" in r.stderr, r.stderr
    assert release.get("rltj", "too-greedy", "-n", release.jobs) is None


# --- the job, run once ------------------------------------------------------------------


@dataclass
class Run:
    """What was observed while the example job ran."""

    job: dict[str, Any] = field(default_factory=dict)  # the final object
    statuses: list[dict[str, Any]] = field(default_factory=list)
    rollout: list[tuple[int, int]] = field(default_factory=list)  # (spec, ready) replicas
    watch: str = ""  # what `kubectl get rltj -w` printed
    events: list[dict[str, Any]] = field(default_factory=list)
    drivers: list[PlayedPod] = field(default_factory=list)
    restart: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _restart_operator_after_upgrade(rel: Release, run: Run) -> None:
    """`helm upgrade` with changed values, then the operator restarted from the upgraded
    Deployment; the trainer is frozen meanwhile, so the controller state can be compared
    exactly (its reports then resume against the new operator)."""
    (driver,) = rel.harness.by_role(contract.Role.DRIVER.value)
    running_at_pause = driver.proc.poll() is None
    rel.harness.pause(driver)
    try:
        prev, same = None, 0
        for _ in range(30):  # a report in flight settles: the status unchanged for 2 s
            cur = rel.get("rltj", JOB, "-n", rel.jobs)["status"]
            same = same + 1 if cur == prev else 0
            if same == 2:
                break
            prev = cur
            time.sleep(1)
        before = prev
        rel.operator.stop()
        # helm upgrade rlpacer charts/rlpacer -n rlpacer-system --reuse-values --set ...
        rel.cluster.helm("upgrade", rel.name, str(CHART), "-n", rel.system, "--reuse-values",
                         "--set", "operator.logLevel=DEBUG", "--set", "operator.resyncSeconds=3")
        rel.operator.start()
        time.sleep(8)  # at least two resyncs of the new operator
        after = rel.get("rltj", JOB, "-n", rel.jobs)["status"]
        run.restart = {"before": before, "after": after, "env": dict(rel.operator.env),
                       "driver_running": driver.proc.poll() is None,
                       "driver_running_at_pause": running_at_pause,
                       "driver_exit": driver.proc.poll(), "driver_log": driver.log_tail(1500)}
    finally:
        rel.harness.resume(driver)


@pytest.fixture(scope="module")
def run(release: Release) -> Run:
    rel, out = release, Run()
    watch_log = rel.tmp / "watch.txt"
    # kubectl get rltj -n team-a -w, as a user watches it
    with watch_log.open("w") as wl:
        watch = subprocess.Popen(
            [str(find_kubectl()), f"--kubeconfig={rel.cluster.kubeconfig}", "get", "rltj",
             "-n", rel.jobs, "-w"], stdout=wl, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    try:
        # kubectl apply -n team-a -f examples/tiny-cluster.yaml
        rel.kubectl("apply", "-n", rel.jobs, "-f", str(EXAMPLE))
        sts = names.statefulset(JOB, contract.Role.ROLLOUT)
        while True:
            job = rel.get("rltj", JOB, "-n", rel.jobs)
            assert job is not None, "the job disappeared"
            st = job.get("status") or {}
            if not out.statuses or st != out.statuses[-1]:
                out.statuses.append(st)
            s = rel.get("statefulset", sts, "-n", rel.jobs)
            if s is not None:
                obs = (s["spec"]["replicas"], s.get("status", {}).get("readyReplicas", 0))
                if not out.rollout or obs != out.rollout[-1]:
                    out.rollout.append(obs)
            if st.get("summary") in ("Succeeded", "Failed"):
                break
            # mid-job: early enough that the (fast) driver is still running when it is paused
            if not out.restart and st.get("step", 0) >= 1 and rel.harness.by_role("driver"):
                _restart_operator_after_upgrade(rel, out)
            assert not rel.harness.errors, rel.harness.describe()
            assert time.monotonic() - t0 < RUN_TIMEOUT, (
                f"job not finished after {RUN_TIMEOUT} s: {st}\n{rel.harness.describe()}\n"
                f"operator:\n{rel.operator.tail()}")
            time.sleep(1)
        out.seconds = time.monotonic() - t0
        out.job = job
        # the watch prints the last row (once: nothing is written after the job finishes)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
                ln.startswith(JOB) and ln.split()[1:2] == [job["status"]["summary"]]
                for ln in watch_log.read_text().splitlines()):
            time.sleep(0.2)
    finally:
        watch.terminate()
        watch.wait(10)
    out.watch = watch_log.read_text()
    ev = rel.get("events", "-n", rel.jobs, "--field-selector",
                 f"involvedObject.kind=RLTrainingJob,involvedObject.name={JOB}")
    out.events = ev["items"] if ev else []
    out.drivers = rel.harness.by_role(contract.Role.DRIVER.value)
    print(f"\njob finished in {out.seconds:.0f} s; rollout (spec, ready): {out.rollout}")
    return out


def _cond(job: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in job["status"].get("conditions", []) if c["type"] == type_), None)


def _metrics(driver: PlayedPod) -> list[dict[str, Any]]:
    ckpt = driver.mount(contract.CHECKPOINT_DIR)
    lines = (ckpt / "metrics-attempt0.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def test_job_succeeds_because_the_trainer_finished_its_steps(
    release: Release, run: Run
) -> None:
    job = run.job
    assert job["status"]["summary"] == "Succeeded", (
        f"{job['status']}\n{release.harness.describe()}\n{release.operator.tail()}")
    succeeded = _cond(job, ConditionType.SUCCEEDED.value)
    assert succeeded is not None and succeeded["status"] == "True"
    assert job["status"]["step"] == job["spec"]["steps"] == 6
    # One driver, never restarted (the operator restart did not disturb it), and it is its
    # exit that the harness reported to the API as the pod's.
    (driver,) = run.drivers
    assert driver.name == names.driver_pod(JOB, 0)
    assert driver.exit_code == 0 and driver.marked and not driver.killed
    assert "done: 6 steps" in driver.log_tail(), driver.log_tail()
    # The trainer's own outputs, in the folder that stood in for its checkpoint volume.
    recs = _metrics(driver)
    assert [r["step"] for r in recs] == list(range(6))
    ckpt = driver.mount(contract.CHECKPOINT_DIR)
    final = ckpt / (ckpt / "latest").read_text().strip()
    assert final.name == "step-000006"
    assert (final / "learner.pt").stat().st_size > 0
    assert json.loads((final / "state.json").read_text())["step"] == 6
    # The operator deletes the finished job's workloads (KWOK pods included).
    pod = release.get("pod", driver.name, "-n", release.jobs)  # read once: it may go between
    assert pod is None or pod["status"]["phase"] == "Succeeded", pod


def test_every_pod_did_its_roles_work_on_its_own_host(release: Release, run: Run) -> None:
    """Head, learner, rollout and driver pods each played on a host of its own: the engine
    and the learner report (from inside their own processes) the host of their pod."""
    h = release.harness
    head, learner, rollout0 = (h.played(names.statefulset(JOB, r) + "-0")[0] for r in (
        contract.Role.HEAD, contract.Role.LEARNER, contract.Role.ROLLOUT))
    (driver,) = run.drivers
    addresses = [p.address for p in (head, learner, rollout0, driver)]
    assert None not in addresses and len(set(addresses)) == 4, addresses
    topo = json.loads((driver.mount(contract.CHECKPOINT_DIR) / "topology-attempt0.json"
                       ).read_text())
    (engine,) = topo["engines"]
    assert (engine["replica"], engine["address"], engine["hostname"]) == \
        (0, rollout0.address, rollout0.name), engine
    (lrn,) = topo["learners"]
    assert (lrn["rank"], lrn["address"], lrn["hostname"]) == \
        (0, learner.address, learner.name), lrn
    assert topo["driver"]["hostname"] == driver.name
    # every step the engine on rollout-0 generated, at the learner's previous weights; each
    # long round's extra rollout pod was played on a host of its own (a fresh one per
    # scale-up: the pod is deleted at the scale-down), joined Ray, and its engine generated
    # part of the long round there, at the same weights (elastic long rounds)
    extras = h.played(names.statefulset(JOB, contract.Role.ROLLOUT) + "-1")
    assert extras and all(x.address not in addresses for x in extras), extras
    assert len({x.address for x in extras}) == len(extras)
    extra_addresses = {x.address for x in extras}
    # each was added for a long round the job ran (the last step's report, whose plan says
    # done, scales nothing up: issue 34), and its Ray node came up on its own address
    for x in extras:
        assert f"Local node IP: {x.address}" in x.log_tail(50000), x.log_tail()
    held = topo["policy_version"]
    served_by_extra = 0
    for r in _metrics(driver):
        by_replica = {e["replica"]: e for e in r["engines"]}
        assert by_replica[0]["address"] == rollout0.address, r["engines"]
        assert by_replica[0]["responses"] > 0
        assert all(e["policy_version"] == held for e in r["engines"]), (held, r["engines"])
        if r["round_kind"] == "Short":
            assert set(by_replica) == {0}, r["engines"]  # released before the scale-down
        elif 1 in by_replica:
            assert by_replica[1]["address"] in extra_addresses, by_replica[1]
            served_by_extra += by_replica[1]["responses"]
        held = r["policy_version"]
    assert served_by_extra > 0, "no long round was served by the added replica"


def test_sagc_and_tail_batching_drive_the_run(run: Run) -> None:
    (driver,) = run.drivers
    recs = _metrics(driver)
    spec = run.job["spec"]
    # Every step ran the group size the operator's SAGC planned (a G it did not plan would
    # have been refused with 422 and crashed the driver).
    assert {r["group_size"] for r in recs} <= set(spec["groupControl"]["candidates"])
    state = json.loads(run.job["status"]["controllerState"])
    assert state["controller"]["kind"] == "sagc", state["controller"]
    assert state["steps_observed"] == 6 and state["long_rounds"] >= 1
    assert {p["groupSize"] for p in run.job["status"]["posteriors"]} == {4, 8, 16}
    # Tail batching: short rounds defer prompts, then a long round trains them.
    kinds = [r["round_kind"] for r in recs]
    assert "Short" in kinds and "Long" in kinds, kinds
    assert any(r["aborted"] > 0 for r in recs if r["round_kind"] == "Short"), recs
    assert run.job["status"]["longRounds"] >= 1


def test_long_round_scales_the_rollout_up_then_down(run: Run) -> None:
    desired = [spec for spec, _ in run.rollout]
    assert desired[0] == 1 and 2 in desired, run.rollout
    up = desired.index(2)
    assert 1 in desired[up:], f"never scaled back down: {run.rollout}"
    # KWOK made the extra replica Ready: the scaler saw real readiness, not a timeout.
    assert (2, 2) in run.rollout, run.rollout
    actions = run.job["status"]["scaleActions"]
    reasons = [(a["reason"], a["fromReplicas"], a["toReplicas"]) for a in actions]
    assert ("LongRound", 1, 2) in reasons and ("LongRoundDone", 2, 1) in reasons, reasons
    # every scale-up was for a step the job ran: none for the round the last step's report
    # asked for (its plan says done)
    long_steps = [a["step"] for a in actions if a["reason"] == "LongRound"]
    assert long_steps and max(long_steps) < run.job["spec"]["steps"], actions
    assert "ScaleUpTimedOut" not in json.dumps(run.statuses)
    seen = {e["reason"] for e in run.events}
    assert {"ScalingUp", "ScaledDown"} <= seen, seen
    assert any(s.get("summary") == "LongRound" or s.get("roundKind") == "Long"
               for s in run.statuses)


def test_kubectl_get_rltj_shows_progress(run: Run) -> None:
    lines = [ln.split() for ln in run.watch.splitlines() if ln.startswith(JOB)]
    header = next(ln.split() for ln in run.watch.splitlines() if ln.startswith("NAME"))
    assert header[:6] == ["NAME", "STATUS", "STEP", "STEPS", "G", "STRAGGLERS"], run.watch
    steps = {int(ln[2]) for ln in lines if ln[2].isdigit()}
    sizes = {ln[4] for ln in lines if len(ln) > 4}
    assert {1, 2, 3, 4, 5, 6} <= steps, run.watch
    assert sizes & {"4", "8", "16"}, run.watch
    assert lines[-1][1] == "Succeeded", run.watch


def test_helm_upgrade_and_operator_restart_keep_the_controller_state(run: Run) -> None:
    r = run.restart
    assert r, "the operator was never restarted (the job finished before step 2?)"
    # The upgraded values reached the restarted operator.
    assert r["env"]["RLPACER_OPERATOR_LOG_LEVEL"] == "DEBUG"
    assert r["env"]["RLPACER_OPERATOR_RESYNC_SECONDS"] == "3"
    before, after = r["before"], r["after"]
    assert before["controllerState"] and after["controllerState"] == before["controllerState"]
    for k in ("step", "attempt", "groupSize", "posteriors", "failures"):
        assert after.get(k) == before.get(k), k
    assert r["driver_running"]
    # ... and the run continued past the restart to the end (one attempt, see above).
    assert run.job["status"]["attempt"] == 0


def test_every_slo_verdict_of_the_job_matches_its_numbers(run: Run) -> None:
    """Every status write carries the SLO verdict and the numbers it was judged on
    (stepSeconds and stragglerRate, each over the policy's window): they agree in every
    snapshot. Whether this job breaks an SLO depends on the machine (its steps take 0.4-2.2 s
    against the 1 s minimum step-time SLO) and on the seeds (tail batching keeps its short
    rounds free of stragglers); the job that breaks one for sure is the next one
    (test_a_job_without_tail_batching_breaks_the_namespaces_straggler_slo)."""
    spec = yaml.safe_load(POLICY.read_text())["spec"]
    limit = float(spec["stepTimeSLO"]["maxSeconds"])
    max_rate = float(spec["stragglerSLO"]["maxTargetStragglerRate"])
    window = int(spec["stragglerSLO"]["windowSteps"])
    judged = [(float(s["stepSeconds"]), c) for s in run.statuses if s.get("stepSeconds")
              for c in s.get("conditions", []) if c["type"] == "SLOViolated"]
    assert judged, run.statuses[-1]
    for mean, c in judged:
        if c["reason"] == "StragglerRateAboveSLO":
            continue
        assert (c["status"] == "True") == (mean > limit), (mean, c)
        assert c["reason"] == ("StepTimeAboveSLO" if mean > limit else "WithinSLO"), (mean, c)
    # status.sloBreaches names a breach exactly when its number is above the limit
    checked = 0
    for s in run.statuses:
        if s.get("stepSeconds") and s.get("sloBreaches") is not None:
            over = float(s["stepSeconds"]) > limit
            assert ("StepTimeAboveSLO" in s["sloBreaches"]) == over, s
            if s.get("stragglerRate") is not None and s.get("step", 0) >= window:
                assert ("StragglerRateAboveSLO" in s["sloBreaches"]) == \
                    (float(s["stragglerRate"]) > max_rate), s
            checked += 1
    assert checked, [(s.get("stepSeconds"), s.get("sloBreaches")) for s in run.statuses]
    if any(c["status"] == "True" for _, c in judged):
        assert "SLOViolated" in {e["reason"] for e in run.events}, run.events


def test_dead_learner_then_dead_driver_each_attempt_resumes_from_the_last_checkpoint(
    release: Release, run: Run
) -> None:
    """A second job (checkpoints on a claim, every step, backoffLimit 2). Mid-job its learner
    pod's container is killed: the driver's attempt fails on the dead learner, the operator
    starts the next attempt, the StatefulSet replaces the learner pod. Two steps later that
    attempt's driver is killed mid-step: the operator starts a third. Each attempt resumes
    from the last checkpoint: the steps after it are re-run on the same prompts (the data
    order and the planner come from the checkpoint), the engines start from the checkpointed
    weights, no prompt of a checkpointed step is drawn again, and the job Succeeds."""
    rel = release
    claim = f"{RESUME}-checkpoints"
    _bound_claim(rel, claim, "ReadWriteMany")
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = RESUME
    spec = doc["spec"]
    spec["steps"] = STEPS = 8  # room for the second crash two steps after the first
    spec["tailBatching"]["enabled"] = False
    spec["checkpoint"] = {"everySteps": 1, "volumeClaim": claim}
    spec["backoffLimit"] = 2
    rel.kubectl("apply", "-n", rel.jobs, "-f", "-", input=json.dumps(doc))
    h = rel.harness
    learner_name = names.statefulset(RESUME, contract.Role.LEARNER) + "-0"
    t0 = time.monotonic()
    crashes: list[tuple[str, int]] = []  # (what, status.step when it was killed)
    while True:
        st = (rel.get("rltj", RESUME, "-n", rel.jobs) or {}).get("status") or {}
        if st.get("summary") in ("Succeeded", "Failed"):
            break
        step, attempt = st.get("step", 0), st.get("attempt", 0)
        # at status.step 3, step 1's checkpoint is complete (a step is reported, then
        # checkpointed; step 2 ran after it): the next attempt resumes from step 2 or 3
        if not crashes and step >= 3:
            (learner,) = [p for p in h.played(learner_name) if p.exit_code is None]
            h.crash(learner)
            crashes.append(("learner", step))
        elif len(crashes) == 1 and attempt == 1 and step >= crashes[0][1] + 2:
            live = [p for p in h.played(names.driver_pod(RESUME, 1)) if p.exit_code is None]
            if live:
                h.crash(live[0])
                crashes.append(("driver", step))
        assert not h.errors, h.describe()
        assert time.monotonic() - t0 < RUN_TIMEOUT, f"{st}\n{h.describe()}"
        time.sleep(0.3)
    assert [c[0] for c in crashes] == ["learner", "driver"], (crashes, st)
    assert st["summary"] == "Succeeded", f"{st}\n{h.describe()}\n{rel.operator.tail()}"
    assert st["attempt"] == 2 and st["step"] == STEPS, st
    drivers = [h.played(names.driver_pod(RESUME, a)) for a in range(3)]
    assert [len(d) for d in drivers] == [1, 1, 1], h.describe()
    (d0,), (d1,), (d2,) = drivers
    assert d0.exit_code not in (0, None) and d1.exit_code == 137 and d2.exit_code == 0, \
        h.describe()
    learners = h.played(learner_name)
    assert len(learners) >= 2 and learners[0].exit_code == 137, h.describe()
    ckpt = d0.mount(contract.CHECKPOINT_DIR)  # the claim: one folder for every pod
    assert ckpt == d1.mount(contract.CHECKPOINT_DIR) == d2.mount(contract.CHECKPOINT_DIR)
    recs = [[json.loads(x) for x in (ckpt / f"metrics-attempt{a}.jsonl").read_text()
             .splitlines()] for a in range(3)]
    print(json.dumps([[(r["step"], r["prompts"], r["policy_version"]) for r in a]
                      for a in recs]))
    kept: list[dict[str, Any]] = []  # the surviving history: each step from its last attempt
    for a in range(3):
        steps = [r["step"] for r in recs[a]]
        start = 0 if a == 0 else recs[a][0]["step"]
        assert steps == list(range(start, start + len(steps))), (a, steps)
        if a > 0:
            log = (d1 if a == 1 else d2).log_tail(50000)
            assert f"resumed from checkpoint at step {start} (attempt {a})" in log
            # the last checkpoint: every step the attempt before finished, or all but the last
            # (killed between its record and its checkpoint); the redone step draws the same
            # prompts, and the engines start on the checkpointed weights
            redone = [r for r in recs[a - 1] if r["step"] >= start]
            assert len(redone) <= 1, (a, [r["step"] for r in recs[a - 1]])
            if redone:
                assert redone[0]["prompts"] == recs[a][0]["prompts"]
            kept = [r for r in kept if r["step"] < start]
            assert kept[-1]["step"] == start - 1
            assert {e["policy_version"] for e in recs[a][0]["engines"]} == \
                {kept[-1]["policy_version"]}
        kept += recs[a]
    assert crashes[0][1] >= 3 and recs[1][0]["step"] >= 2
    assert [r["step"] for r in kept] == list(range(STEPS))
    # no prompt skipped or drawn twice in the surviving history
    prompts = [p for r in kept for p in r["prompts"]]
    assert len(prompts) == len(set(prompts)), prompts
    assert (ckpt / "latest").read_text().strip() == f"step-{STEPS:06d}"


def test_a_job_without_tail_batching_breaks_the_namespaces_straggler_slo(
    release: Release,
) -> None:
    """The second job (the example with tail batching off) straggles on every step: each
    round's longest response is more than stragglerRatio (6) times its median (80-192 tokens
    against 6-12), so its straggler rate is 1 against the namespace policy's 0.3 and its own
    target of 0.2. The operator says so where a platform team looks: the SLOViolated
    condition (reason StragglerRateAboveSLO, naming the policy), status.sloBreaches, a
    Warning Event; and the job's own StragglerSLOMet is False. Beside the example job (tail
    batching on, straggler rate 0 on the same prompts' distribution), this is the SLO the
    feature exists to keep."""
    rel = release
    st = rel.get("rltj", RESUME, "-n", rel.jobs)["status"]
    assert st["summary"] == "Succeeded", st
    assert float(st["stragglerRate"]) == 1.0, st
    assert "StragglerRateAboveSLO" in st["sloBreaches"], st
    slo = next(c for c in st["conditions"] if c["type"] == "SLOViolated")
    assert (slo["status"], slo["reason"]) == ("True", "StragglerRateAboveSLO"), slo
    assert "straggler rate" in slo["message"] and \
        f"RLTrainingPolicy {rel.jobs}/team-limits" in slo["message"], slo
    own = next(c for c in st["conditions"] if c["type"] == "StragglerSLOMet")
    assert (own["status"], own["reason"]) == ("False", "Exceeded"), own
    ev = rel.get("events", "-n", rel.jobs, "--field-selector",
                 f"involvedObject.kind=RLTrainingJob,involvedObject.name={RESUME}")
    warnings = [e for e in (ev or {}).get("items", []) if e["reason"] == "SLOViolated"]
    assert warnings and all(e["type"] == "Warning" for e in warnings), ev
    assert any("StragglerRateAboveSLO" in e["message"] for e in warnings), warnings


def _bound_claim(rel: Release, claim: str, mode: str = "ReadOnlyMany") -> None:
    """A PersistentVolumeClaim bound to a PersistentVolume of its own (no provisioner here):
    the pods mounting it schedule; the harness plays it with its claim folder."""
    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
          "metadata": {"name": f"{rel.jobs}-{claim}"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [mode],
                   "storageClassName": "manual", "hostPath": {"path": str(rel.tmp / claim)},
                   "claimRef": {"namespace": rel.jobs, "name": claim}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": claim, "namespace": rel.jobs},
           "spec": {"accessModes": [mode], "storageClassName": "manual",
                    "volumeName": pv["metadata"]["name"],
                    "resources": {"requests": {"storage": "1Gi"}}}}
    rel.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                      "items": [pv, pvc]}))


def test_a_users_model_and_parquet_data_from_claims(release: Release) -> None:
    """A third job names its model and data on claims, as a user's job does: a Hugging
    Face-format model (the project's recipe: a small Qwen2 with its own BPE tokenizer and
    chat template) at pvc://models/user-model and word problems as Parquet at
    pvc://datasets/wp.parquet. The operator mounts both claims read-only into the pods that
    read them; the played pods (each on a host of its own) load the model through the claim
    (engine and learner), train on the file's prompts with a held-out split and the math
    reward, and checkpoint the trained model in Hugging Face format, which has the user
    model's architecture and tokenizer; the job Succeeds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlpacer.api import sources
    from rlpacer.testing.harness import claim_dir
    from rlpacer_trainer import hfrecipe, wordproblems

    rel, job = release, USER_MODEL
    root = rel.harness.root
    for claim in ("models", "datasets"):
        _bound_claim(rel, claim)
    model = hfrecipe.make(claim_dir(root, rel.jobs, "models") / "user-model")
    rows = wordproblems.make(160, seed=11)
    data = claim_dir(root, rel.jobs, "datasets") / "wp.parquet"
    data.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), data, row_group_size=50)
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = job
    spec = doc["spec"]
    spec["model"] = {"source": "pvc://models/user-model"}
    spec["data"] = {"source": "pvc://datasets/wp.parquet", "promptField": "question",
                    "answerField": "answer", "evalFraction": "0.125", "seed": 0,
                    "systemPrompt": "Solve the problem. Put the final answer in \\boxed{}."}
    # GRPO, as examples/user-model-local.yaml: the untrained recipe model rarely answers
    # right, and DAPO's dynamic sampling (the example's) would drop every all-wrong group
    spec["algorithm"] = {"name": "GRPO"}
    spec["reward"] = {"type": "MathAnswer", "timeoutSeconds": 10}
    spec["rollout"].update({"maxPromptTokens": 128, "maxResponseTokens": 64})
    spec["steps"] = 2
    spec["groupControl"] = {"mode": "SAGC", "candidates": [4, 8], "initial": 4}
    spec["tailBatching"] = {"enabled": False}
    spec["checkpoint"] = {"everySteps": 2}
    rel.kubectl("apply", "-n", rel.jobs, "-f", "-", input=json.dumps(doc))
    h, t0 = rel.harness, time.monotonic()
    pods: dict[contract.Role, dict[str, Any]] = {}  # the pod specs, read while they exist
    while True:
        st = (rel.get("rltj", job, "-n", rel.jobs) or {}).get("status") or {}
        if st.get("summary") in ("Succeeded", "Failed"):
            break
        for role in (contract.Role.DRIVER, contract.Role.LEARNER, contract.Role.ROLLOUT):
            if role in pods:
                continue
            obj = (rel.get("pod", names.driver_pod(job, 0), "-n", rel.jobs)
                   if role is contract.Role.DRIVER
                   else rel.get("statefulset", names.statefulset(job, role), "-n", rel.jobs))
            if obj is not None:
                pods[role] = (obj["spec"] if role is contract.Role.DRIVER
                              else obj["spec"]["template"]["spec"])
        assert not h.errors, h.describe()
        assert time.monotonic() - t0 < RUN_TIMEOUT, f"{st}\n{h.describe()}"
        time.sleep(0.5)
    assert st["summary"] == "Succeeded", f"{st}\n{h.describe()}\n{rel.operator.tail()}"
    # each claim mounted read-only, at the claims' root, into the pods that read it: the
    # model's into the driver (tokenizer), learner and rollout pods, the data's into the
    # driver's alone
    assert len(pods) == 3, pods.keys()
    for role, pod in pods.items():
        (c,) = pod["containers"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        if role is not contract.Role.DRIVER:
            assert sources.claim_mount("datasets") not in mounts, role
        for claim in ("models", "datasets") if role is contract.Role.DRIVER else ("models",):
            m = mounts[sources.claim_mount(claim)]
            assert m.get("readOnly") is True, (role, m)
            vol = next(v for v in pod["volumes"] if v["name"] == m["name"])
            assert vol["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
    (driver,) = [p for p in h.played(names.driver_pod(job, 0))]
    assert driver.exit_code == 0, h.describe()
    ckpt = driver.mount(contract.CHECKPOINT_DIR)
    recs = [json.loads(x) for x in (ckpt / "metrics-attempt0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:  # the file's 140 training prompts (160 less 1/8 held out)
        assert r["kept"] > 0 and r["learner_samples"] > 0, r
        assert all(0 <= p < 140 for p in r["prompts"]), r["prompts"]
    # the learner trained the user's model: the checkpoint is it, in Hugging Face format
    hf = ckpt / (ckpt / "latest").read_text().strip() / "model"
    got, want = (json.loads((d / "config.json").read_text()) for d in (hf, model))
    for key in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers"):
        assert got[key] == want[key], key
    assert (hf / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    # the engine ran on the rollout pod's host and served the user's model from its claim
    log = driver.log_tail(200000)
    assert "Traceback" not in log, log[-3000:]
    print(f"user-model job: {time.monotonic() - t0:.0f} s")


def test_helm_uninstall_leaves_no_orphans(release: Release, run: Run) -> None:
    rel = release
    # The operator deletes a finished job's workloads after it marks the job finished; the
    # test before this one returns once its driver is done, possibly before that deletion:
    # let the operator finish it before it is stopped (the check below is unchanged).
    kept = sorted(f"pod/{names.driver_pod(RESUME, a)}" for a in (0, 1))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sorted(rel.kubectl(
            "get", "statefulsets,pods", "-n", rel.jobs, "-o", "name").stdout.split()) != kept:
        time.sleep(1)
    rel.operator.stop()
    rel.cluster.helm("uninstall", rel.name, "-n", rel.system)
    rel.uninstalled = True
    selector = f"app.kubernetes.io/instance={rel.name}"
    for kinds, scope in [
        ("clusterroles,clusterrolebindings,validatingwebhookconfigurations,"
         "mutatingwebhookconfigurations", []),
        ("deployments,services,secrets,configmaps,serviceaccounts,roles,rolebindings",
         ["-A"]),
    ]:
        left = rel.kubectl("get", kinds, "-l", selector, *scope, "-o", "name").stdout
        assert left.strip() == "", left
    # In the release namespace only the operator's Lease remains (created at run time, not by
    # Helm; it goes with the namespace), besides what every namespace has.
    left = set(rel.kubectl("get", "deployments,services,secrets,configmaps,serviceaccounts,"
                           "roles,rolebindings,leases", "-n", rel.system, "-o", "name"
                           ).stdout.split())
    assert left == {"configmap/kube-root-ca.crt", "serviceaccount/default",
                    f"lease.coordination.k8s.io/{rel.name}-rlpacer"}, left
    # The finished job's workloads are gone (the operator deleted them); the job object and
    # its config remain, as do the CRDs (Helm never deletes crds/): users' jobs and policies
    # survive an uninstall, and a reinstalled operator picks them up.
    left = rel.kubectl("get", "statefulsets,pods", "-n", rel.jobs, "-o", "name").stdout.split()
    # ... but for the failed attempts' driver pods, kept (phase Failed) for their logs
    assert sorted(left) == [f"pod/{names.driver_pod(RESUME, a)}" for a in (0, 1)], left
    for a in (0, 1):
        pod = rel.get("pod", names.driver_pod(RESUME, a), "-n", rel.jobs)
        assert pod["status"]["phase"] == "Failed", pod["status"]
    assert rel.get("rltj", JOB, "-n", rel.jobs) is not None
    assert rel.get("rltj", RESUME, "-n", rel.jobs) is not None
    assert rel.get("rltp", "team-limits", "-n", rel.jobs) is not None
    rel.kubectl("get", "crd", "rltrainingjobs.rlpacer.io")
