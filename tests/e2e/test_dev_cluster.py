"""`rlpacer dev-cluster`: what a person runs to watch a job train on a laptop, command for
command (README "Watch it on a laptop"): up, kubectl apply the policy and the tiny job,
kubectl get rltj until Succeeded, down, and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
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
        kubeconfig = env_out.split("\n")[0].split("=", 1)[1]
        env = dict(os.environ, KUBECONFIG=kubeconfig)

        def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
            return subprocess.run([str(find_kubectl()), *args], env=env, input=input,
                                  capture_output=True, text=True, timeout=60)

        r = kubectl("apply", "-n", NS, "-f", str(repo_root() / "examples"
                                               / "tiny-cluster-policy.yaml"))
        assert r.returncode == 0, r.stderr
        job = yaml.safe_load((repo_root() / "examples" / "tiny-cluster.yaml").read_text())
        job["spec"]["steps"] = 2  # short: the point is that it trains, played for real
        r = kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(job))
        assert r.returncode == 0, r.stderr
        status = _finished(kubectl)
        log = (d / "supervisor.log").read_text(errors="replace")
        assert status.get("summary") == "Succeeded", f"{status}\n{log[-3000:]}"
        assert status.get("step") == 2
        # the driver pod was played on a host of its own and trained
        pods = d / "pods" / NS / "pods"
        driver_log = (pods / "tiny-cluster-driver-0" / "log.txt").read_text()
        assert "done: 2 steps" in driver_log, driver_log[-2000:]
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
    ``kueue.enabled``), trains on played pods through a long round whose extra rollout replica
    Kueue admits with a Workload of its own, and marks its Workload Finished."""
    d = tmp_path / "dev"
    up = subprocess.run([str(RLPACER), "dev-cluster", "up", "--kueue", "--dir", str(d)],
                        capture_output=True, text=True, timeout=400)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        kubeconfig = up.stdout.split("\n")[0].split("=", 1)[1]
        env = dict(os.environ, KUBECONFIG=kubeconfig)

        def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
            return subprocess.run([str(find_kubectl()), *args], env=env, input=input,
                                  capture_output=True, text=True, timeout=60)

        job = yaml.safe_load((repo_root() / "examples" / "tiny-cluster.yaml").read_text())
        job["spec"]["steps"] = 4  # two short rounds fill the long queue: step 2 is long
        job["spec"]["scheduling"] = {"queueName": "default"}
        until = time.monotonic() + 60
        while True:  # a CRD just installed answers 429 while its storage initialises
            r = kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(job))
            if r.returncode == 0 or "initializing" not in r.stderr or time.monotonic() > until:
                break
            time.sleep(1)
        assert r.returncode == 0, r.stderr
        status = _finished(kubectl)
        log = (d / "supervisor.log").read_text(errors="replace")
        assert status.get("summary") == "Succeeded", f"{status}\n{log[-3000:]}"
        assert status.get("step") == 4 and status.get("longRounds", 0) >= 1, status
        conds = {c["type"]: c for c in status["conditions"]}
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
                     "LongRoundReleased", "ScaledUp"):
            assert want in reasons, (want, reasons)
        # the extra replica was played and served the long round
        pods = d / "pods" / NS / "pods"
        assert (pods / "tiny-cluster-rollout-1" / "log.txt").exists()
    finally:
        down = subprocess.run([str(RLPACER), "dev-cluster", "down", "--dir", str(d)],
                              capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
