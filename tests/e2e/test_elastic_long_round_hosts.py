"""An elastic long round across played hosts: the added rollout replica serves it.

The job's pods each on a host of their own (as in ``test_runtime_hosts.py``): a Ray head, a
learner, rollout-0 and the driver, and a played operator (``elastic_plan_server.py``: the
step-report protocol over the real plan logic, with the capacity of an operator that scales
the rollout StatefulSet from 1 to 2 replicas for each long round). ``rollout-1``'s pod is
started only when a report asks for a long round (the plan says ScalingUp until then), and
deleted once the long round is reported done. From the driver's metrics records:

* the long round ran on replicas 0 and 1, and rollout-1's engine, on rollout-1's host (as
  the engine reports itself), generated part of it at the learner's weights;
* the short rounds ran on replica 0 only (the added engine was released after the long
  round), and the driver finished every step after rollout-1's pod was deleted.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlpacer.api import contract
from rlpacer.testing import netns
from rlpacer.testing.netns import TestHosts

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-local.yaml"
SERVER = Path(__file__).with_name("elastic_plan_server.py")
JOB, NS = "elastic", "team-a"
HEAD_SVC = f"{JOB}-head.{NS}.svc"
PORT = 8080
STEPS = 3


def _manifest(path: Path, replicas: int = 1) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["rollout"]["replicas"] = replicas
    spec["tailBatching"]["longRound"]["rolloutReplicas"] = 2
    # 8 prompts race for 4 places: the 4 slowest are deferred, so step 1 is a long round
    spec["tailBatching"]["promptOverprovision"] = "2"
    spec["algorithm"]["dynamicSampling"] = False
    spec["steps"] = STEPS
    spec["promptsPerStep"] = 4
    spec["checkpoint"]["everySteps"] = 10
    path.write_text(yaml.safe_dump(doc))


def _start(hosts: TestHosts, pods: dict[str, contract.Role], name: str, tmp_path: Path,
           base_env: dict[str, str], ray_temp: Path) -> subprocess.Popen[bytes]:
    """Starts pod ``name`` (``python -m rlpacer_trainer.pod``) on its played host."""
    role = pods[name]
    home = tmp_path / "home" / ray_temp.name
    home.mkdir(parents=True)
    env = {
        **base_env, "HOME": str(home),
        contract.ENV_JOB: JOB, contract.ENV_NAMESPACE: NS,
        contract.ENV_ROLE: role.value, contract.ENV_POD_IP: hosts.address(name),
        contract.ENV_RAY_TEMP_DIR: str(ray_temp),
        contract.ENV_RANK: name.rsplit("-", 1)[-1] if "-" in name else "0",
    }
    if role is not contract.Role.HEAD:
        env[contract.ENV_RAY_ADDRESS] = f"{HEAD_SVC}:{contract.RAY_GCS_PORT}"
    if role is contract.Role.DRIVER:
        env |= {contract.ENV_CONFIG: str(tmp_path / "job.yaml"),
                contract.ENV_CHECKPOINT_DIR: str(tmp_path / "checkpoints"),
                contract.ENV_ATTEMPT: "0",
                contract.ENV_REPORT_URL: f"http://{hosts.address('operator')}:{PORT}",
                contract.ENV_TOKEN_FILE: str(tmp_path / "report-token")}
    log = open(tmp_path / "logs" / f"{ray_temp.name}.log", "wb")  # noqa: SIM115
    return hosts.popen(name, [sys.executable, "-m", contract.POD_ENTRYPOINT_MODULE],
                       env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_file(path: Path, procs: dict[str, subprocess.Popen[bytes]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if any(p.poll() is not None for p in procs.values()):
            return False
        time.sleep(0.3)
    return False


def test_long_round_is_served_by_the_replica_that_joined(tmp_path: Path) -> None:
    token = secrets.token_hex(32)
    logs = tmp_path / "logs"
    logs.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    ckpt = tmp_path / "checkpoints"
    (tmp_path / "report-token").write_text("job-token\n")
    _manifest(tmp_path / "job.yaml")
    hosts = TestHosts()
    temp_root = Path(f"/tmp/{hosts.tag}")
    pods = {"head": contract.Role.HEAD, "learner-0": contract.Role.LEARNER,
            "rollout-0": contract.Role.ROLLOUT, "rollout-1": contract.Role.ROLLOUT,
            "driver": contract.Role.DRIVER}
    python = sys.executable
    try:
        with hosts:
            for name in [*pods, "operator"]:
                hosts.add(name)
            hosts.alias("head", HEAD_SVC, f"{HEAD_SVC}.cluster.local")
            base_env = {
                "PATH": f"{Path(python).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
                "RAY_AUTH_TOKEN": token, "PYTHONUNBUFFERED": "1",
                "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
            op_log = open(logs / "operator.log", "wb")  # noqa: SIM115
            hosts.popen("operator", [python, str(SERVER), str(tmp_path / "job.yaml"),
                                     hosts.address("operator"), str(PORT), str(state)],
                        env={**base_env, "HOME": str(tmp_path)}, stdout=op_log,
                        stderr=subprocess.STDOUT)

            def start(name: str, temp: str | None = None) -> subprocess.Popen[bytes]:
                return _start(hosts, pods, name, tmp_path, base_env, temp_root / (temp or name))

            procs = {"head": start("head")}
            netns.wait_port(hosts.address("head"), contract.RAY_GCS_PORT, procs["head"], 90)
            for name in ("learner-0", "rollout-0", "driver"):
                procs[name] = start(name)

            def logs_text() -> str:
                return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                                 for p in sorted(logs.iterdir()))

            # the operator scales up for the long round: rollout-1's pod starts only now
            assert _wait_file(state / "scale-up", procs, 600), "no long round:\n" + logs_text()
            procs["rollout-1"] = start("rollout-1")
            (state / "rollout-1-ready").write_text("1")
            # the long round done: the operator scales back down and the pod goes
            assert _wait_file(state / "scale-down", {"driver": procs["driver"]}, 600), \
                "the long round never ended:\n" + logs_text()
            rollout1 = procs.pop("rollout-1")
            os.killpg(rollout1.pid, signal.SIGKILL)  # the pod deleted (its whole host)
            rollout1.wait(timeout=30)
            try:
                rc = procs["driver"].wait(timeout=600)
            except subprocess.TimeoutExpired:
                procs["driver"].kill()
                rc = -1
            assert rc == 0, "driver failed:\n" + logs_text()
            recs = [json.loads(x) for x in
                    (ckpt / "metrics-attempt0.jsonl").read_text().splitlines()]
            inode = {n: hosts.hosts[n].netns_inode() for n in pods}
            addr = {n: hosts.address(n) for n in pods}
            driver_log = (logs / "driver.log").read_text(errors="replace")
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    print(json.dumps([{k: r[k] for k in ("step", "round_kind", "replicas", "engines")}
                      for r in recs], indent=1))

    assert [r["step"] for r in recs] == list(range(STEPS))
    longs = [r for r in recs if r["round_kind"] == "Long"]
    assert longs, [r["round_kind"] for r in recs]
    held = {r["step"]: prev["policy_version"] for prev, r in itertools.pairwise(recs)}
    for r in recs:
        if r["round_kind"] == "Long":
            assert r["replicas"] == [0, 1], r
            by = {e["replica"]: e for e in r["engines"]}
            assert sorted(by) == [0, 1], r["engines"]
            for i, e in by.items():
                host = f"rollout-{i}"
                assert (e["address"], e["netns"], e["hostname"]) == \
                    (addr[host], inode[host], host), e
                assert e["responses"] > 0 and e["tokens"] > 0
                assert e["policy_version"] == held[r["step"]], (e, held[r["step"]])
        else:
            assert r["replicas"] == [0] and [e["replica"] for e in r["engines"]] == [0], r
    assert "rollout engine of replica 1 joined" in driver_log
    assert "rollout engine of replica 1 released" in driver_log


def test_an_engine_whose_pod_died_is_started_again_when_the_pod_is_back(
    tmp_path: Path,
) -> None:
    """Two rollout replicas; between steps 0 and 1 (the played operator holds the driver in
    ScalingUp) rollout-1's pod is killed, host and all, and a new one started in its place:
    the driver finds its engine dead and starts one on the new pod, at the learner's weights,
    which serves the remaining steps."""
    token = secrets.token_hex(32)
    logs = tmp_path / "logs"
    logs.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    ckpt = tmp_path / "checkpoints"
    (tmp_path / "report-token").write_text("job-token\n")
    _manifest(tmp_path / "job.yaml", replicas=2)
    hosts = TestHosts()
    temp_root = Path(f"/tmp/{hosts.tag}")
    pods = {"head": contract.Role.HEAD, "learner-0": contract.Role.LEARNER,
            "rollout-0": contract.Role.ROLLOUT, "rollout-1": contract.Role.ROLLOUT,
            "driver": contract.Role.DRIVER}
    python = sys.executable
    try:
        with hosts:
            for name in [*pods, "operator"]:
                hosts.add(name)
            hosts.alias("head", HEAD_SVC, f"{HEAD_SVC}.cluster.local")
            base_env = {
                "PATH": f"{Path(python).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
                "RAY_AUTH_TOKEN": token, "PYTHONUNBUFFERED": "1",
                "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
            op_log = open(logs / "operator.log", "wb")  # noqa: SIM115
            hosts.popen("operator", [python, str(SERVER), str(tmp_path / "job.yaml"),
                                     hosts.address("operator"), str(PORT), str(state),
                                     "restart"],
                        env={**base_env, "HOME": str(tmp_path)}, stdout=op_log,
                        stderr=subprocess.STDOUT)

            def start(name: str, temp: str | None = None) -> subprocess.Popen[bytes]:
                return _start(hosts, pods, name, tmp_path, base_env, temp_root / (temp or name))

            procs = {"head": start("head")}
            netns.wait_port(hosts.address("head"), contract.RAY_GCS_PORT, procs["head"], 90)
            for name in ("learner-0", "rollout-0", "rollout-1", "driver"):
                procs[name] = start(name)

            def logs_text() -> str:
                return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                                 for p in sorted(logs.iterdir()))

            assert _wait_file(state / "paused", procs, 600), "no step 0:\n" + logs_text()
            old = procs.pop("rollout-1")
            os.killpg(old.pid, signal.SIGKILL)  # the pod and every process on it
            old.wait(timeout=30)
            procs["rollout-1"] = start("rollout-1", temp="rollout-1-new")  # its replacement
            (state / "go").write_text("1")
            try:
                rc = procs["driver"].wait(timeout=600)
            except subprocess.TimeoutExpired:
                procs["driver"].kill()
                rc = -1
            assert rc == 0, "driver failed:\n" + logs_text()
            recs = [json.loads(x) for x in
                    (ckpt / "metrics-attempt0.jsonl").read_text().splitlines()]
            addr = {n: hosts.address(n) for n in pods}
            driver_log = (logs / "driver.log").read_text(errors="replace")
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    print(json.dumps([{k: r[k] for k in ("step", "round_kind", "replicas", "engines")}
                      for r in recs], indent=1))
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert "rollout engine of replica 1 died" in driver_log, driver_log[-3000:]
    assert "rollout engine of replica 1 joined" in driver_log
    held = {r["step"]: prev["policy_version"] for prev, r in itertools.pairwise(recs)}
    for r in recs:
        assert r["replicas"] == [0, 1], r
        by = {e["replica"]: e for e in r["engines"]}
        assert sorted(by) == [0, 1] and all(e["responses"] > 0 for e in by.values()), r
        assert by[1]["address"] == addr["rollout-1"]
        if r["step"] in held:
            assert {e["policy_version"] for e in by.values()} == {held[r["step"]]}
