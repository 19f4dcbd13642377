"""A driver pod gone without having failed, against the real control plane (issue 32, defect
1): `kubectl delete pod`, the Eviction API (what `kubectl drain` calls), each with backoffLimit
0. The job resumes as a new attempt, not counted, its controller state continuous; the pod of
an attempt that has reported never comes back under that attempt.

The first test plays the trainer's step reports itself (the operator's side, a few seconds);
the second plays the driver pods with the real trainer (``rlpacer.testing.harness``, vLLM on
the CPU): a replacement without a checkpoint (emptyDir) starts a new attempt at step 0, one
with a checkpoint claim resumes from the latest checkpoint the job's plan can take, and both
jobs succeed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_operator import (  # noqa: F401 (fixtures)
    Driver,
    OperatorProc,
    apply,
    bound_claim,
    crds,
    get,
    kube_events,
    operator,
    report,
    small_job,
    status,
    token,
    wait,
)

from rlpacer.api import contract
from rlpacer.operator import names
from rlpacer.testing.cluster import LocalCluster
from rlpacer.testing.harness import PodHarness

pytestmark = pytest.mark.integration


def _pod(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any] | None:
    return get(cluster, f"/api/v1/namespaces/{ns}/pods/{name}")


def _running(cluster: LocalCluster, ns: str, name: str) -> bool:
    return ((_pod(cluster, ns, name) or {}).get("status") or {}).get("phase") == "Running"


def _attempt_env(pod: dict[str, Any]) -> str:
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    return str(env[contract.ENV_ATTEMPT])


def test_a_deleted_or_evicted_driver_resumes_as_a_new_attempt_not_counted(
    cluster: LocalCluster, operator: OperatorProc, namespace: str  # noqa: F811
) -> None:
    ns, name = namespace, "dis"
    apply(cluster, small_job(name, ns, backoffLimit=0, steps=4))
    drv = Driver(operator, ns, name, token(cluster, ns, name))
    pod0, pod1, pod2 = (names.driver_pod(name, a) for a in range(3))
    wait(cluster, lambda: _running(cluster, ns, pod0), "driver 0 running", 90)
    g = drv.plan()["groupSize"]
    for step in range(2):
        code, plan = drv.post(report(step, g, 150.0))
        assert code == 200, plan
        g = plan["groupSize"]

    # kubectl delete pod <job>-driver-0: attempt 1, not a failure
    cluster.kubectl("delete", "pod", pod0, "-n", ns, "--wait=false")
    st = wait(cluster, lambda: (s := status(cluster, ns, name)).get("attempt") == 1 and s,
              "attempt 1", 60)
    assert st.get("failures", 0) == 0 and st["summary"] != "Failed", st
    p1 = wait(cluster, lambda: _pod(cluster, ns, pod1), "driver 1", 30)
    assert _attempt_env(p1) == "1"
    wait(cluster, lambda: _running(cluster, ns, pod1), "driver 1 running", 90)
    assert _pod(cluster, ns, pod0) is None  # never again under the attempt that reported
    # its replacement found no checkpoint: step 0 of the new attempt is accepted, and the
    # controller went on from step 2 (continuous: the plan's step follows the report)
    assert drv.plan()["step"] == 2
    code, plan = drv.post(report(0, g, 150.0, attempt=1))
    assert code == 200 and plan["step"] == 1, plan
    g = plan["groupSize"]

    # the Eviction API (kubectl drain): DisruptionTarget, then deleted: attempt 2
    code, body = cluster.http.request(
        "POST", f"/api/v1/namespaces/{ns}/pods/{pod1}/eviction",
        {"apiVersion": "policy/v1", "kind": "Eviction",
         "metadata": {"name": pod1, "namespace": ns}})
    assert code == 201, body
    st = wait(cluster, lambda: (s := status(cluster, ns, name)).get("attempt") == 2 and s,
              "attempt 2", 60)
    assert st.get("failures", 0) == 0, st
    wait(cluster, lambda: _running(cluster, ns, pod2), "driver 2 running", 90)
    # this one resumes from a checkpoint at step 1 (a new attempt may take any step up to
    # the controller's)
    code, plan = drv.post(report(1, g, 150.0, attempt=2))
    assert code == 200 and plan["step"] == 2, plan
    code, err = drv.post(report(2, plan["groupSize"], 150.0, attempt=1))
    assert code == 422 and err["reason"] == "AttemptMismatch", err

    # the job ends well: backoffLimit 0 was never spent
    cluster.mark_pod_exit(ns, pod2, 0)
    st = wait(cluster, lambda: (s := status(cluster, ns, name)).get("summary") == "Succeeded"
              and s, "Succeeded", 60)
    assert (st["attempt"], st.get("failures", 0)) == (2, 0), st
    msgs = [e["message"] for e in kube_events(cluster, ns, name) if e["reason"] == "Restarting"]
    assert len(msgs) == 2 and all("without having failed" in m for m in msgs), msgs


# --- with the real trainer ------------------------------------------------------------------

STEPS = 30  # room for the driver to be frozen late: a step can take a tenth of a second,
# and two status reads of a busy API server can take longer than ten of them


def _trainer_job(name: str, ns: str, claim: str | None) -> dict[str, Any]:
    """The tiny job a played driver trains for real: no long rounds (nothing else is played),
    a checkpoint after every step, on ``claim`` or on the driver's emptyDir."""
    obj = small_job(
        name, ns, model={"source": "builtin://tiny-chain"}, data={"source": "builtin://chain"},
        steps=STEPS, promptsPerStep=4, backoffLimit=0,
        rollout={"replicas": 1, "gpusPerReplica": 0, "maxResponseTokens": 192},
        groupControl={"mode": "Fixed", "initial": 4},
        tailBatching={"enabled": False},
        algorithm={"name": "GRPO"},
        checkpoint={"everySteps": 1, **({"volumeClaim": claim} if claim else {})})
    return obj


def _driver_log(h: PodHarness, pod: str) -> str:
    return "\n".join(p.log_tail(100_000) for p in h.played(pod))


@pytest.mark.vllm
@pytest.mark.slow
def test_a_played_trainer_deleted_mid_job_resumes_with_and_without_a_checkpoint(
    cluster: LocalCluster, operator: OperatorProc, namespace: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two jobs at once, backoffLimit 0, a checkpoint after every step: ``claim`` keeps its
    checkpoints on a claim, ``empty`` on the driver's emptyDir. Once each has reported two
    steps its driver is frozen and its pod deleted. Each replacement is the next attempt,
    asks the plan where it may resume, and the job succeeds: ``claim``'s from its latest
    checkpoint, ``empty``'s (which finds none) from step 0."""
    ns = namespace
    bound_claim(cluster, ns, "ckpt")
    jobs = {"claim": "ckpt", "empty": None}
    with PodHarness(cluster, ns, tmp_path / "harness") as h:
        for name, claim in jobs.items():
            apply(cluster, _trainer_job(name, ns, claim))
        frozen: dict[str, int] = {}  # job -> status.step when its driver was deleted
        t0 = time.monotonic()
        while len(frozen) < len(jobs):
            for name in jobs:
                if name in frozen:
                    continue
                st = status(cluster, ns, name)
                assert st.get("summary") not in ("Succeeded", "Failed"), (
                    f"{name} ended before its driver was deleted: {st}\n{h.describe()}")
                live = [p for p in h.played(names.driver_pod(name, 0)) if p.exit_code is None]
                if st.get("step", 0) >= 2 and live:
                    h.pause(live[0])  # between two steps or in one: at most the report in
                    # flight still lands; the step is read after the pause (on a busy machine
                    # the driver may have reported more since the read above)
                    frozen[name] = status(cluster, ns, name)["step"]
                    cluster.kubectl("delete", "pod", names.driver_pod(name, 0), "-n", ns,
                                    "--wait=false")
            assert not h.errors, h.describe()
            assert time.monotonic() - t0 < 600, h.describe()
            time.sleep(0.1)
        done: dict[str, dict[str, Any]] = {}
        while len(done) < len(jobs):
            for name in jobs:
                st = status(cluster, ns, name)
                if st.get("summary") in ("Succeeded", "Failed"):
                    done[name] = st
            assert not h.errors, h.describe()
            assert time.monotonic() - t0 < 900, h.describe()
            time.sleep(0.5)
        for name, st in done.items():
            assert st["summary"] == "Succeeded", f"{name}: {st}\n{h.describe()}"
            assert (st["attempt"], st.get("failures", 0), st["step"]) == (1, 0, STEPS), st
            (d0,) = h.played(names.driver_pod(name, 0))
            (d1,) = h.played(names.driver_pod(name, 1))
            assert d0.killed and d1.exit_code == 0, h.describe()
            log = _driver_log(h, names.driver_pod(name, 1))
            recs = [json.loads(x) for x in (d1.mount(contract.CHECKPOINT_DIR)
                                            / "metrics-attempt1.jsonl").read_text().splitlines()]
            steps = [r["step"] for r in recs]
            assert steps, f"{name}: attempt 1 ran no step (frozen at {frozen[name]})\n{log}"
            if jobs[name] is None:  # the emptyDir went with the pod: from step 0
                assert "no checkpoint to resume from: attempt 1 starts at step 0" in log, log
                assert steps == list(range(STEPS)), steps
            else:  # the latest checkpoint on the claim (a step is reported, then saved)
                start = steps[0]
                assert f"resumed from checkpoint at step {start} (attempt 1)" in log, log
                assert 1 <= start <= frozen[name] + 1 and steps == list(range(start, STEPS))
                assert d1.mount(contract.CHECKPOINT_DIR) == d0.mount(contract.CHECKPOINT_DIR)
                saved = sorted(p.name for p in d0.mount(contract.CHECKPOINT_DIR).glob("step-*"))
                assert f"step-{start:06d}" in saved, saved
