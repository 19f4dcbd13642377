"""The data plane across played hosts: every pod of a job on a host of its own.

A Ray head, two learner pods, two rollout pods and a driver pod run the pod entrypoint
(``python3 -m rlpacer_trainer.pod``), each in its own network, UTS and PID namespace
(:class:`rlpacer.testing.netns.TestHosts`), reaching each other only through the job's Service
name and their own addresses, with the job's Ray token. The driver trains a few steps of the
word-problem example (its Hugging Face Qwen2 model, JSONL data) with its in-process
controller. From what the engines and learners report about themselves (the driver's
``topology-attempt0.json`` and metrics records):

* each rollout replica's engine ran on that replica's host (address and network namespace
  read inside the engine's actor) and generated responses in every step;
* every engine held the learner's weight fingerprint after each sync (the version each engine
  generated with is the previous update's), computed inside the engine's worker;
* the four learner ranks ran two on each learner host, FSDP-sharded over all four (gloo across
  hosts): each holds a quarter of the parameters and optimizer state, the engines loaded the
  gathered weights in buckets, and every rank wrote its shards of the checkpoint;
* with ``trainer.streamTraining`` each step's groups went to the four ranks on the learner
  hosts as they finished, and every sample of every step's update was streamed (none trained
  whole instead);
* the driver's process holds no learner or engine (they are on other hosts).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlpacer.api import contract
from rlpacer.testing import netns
from rlpacer.testing.netns import TestHosts

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
#: the word-problem Qwen2 example (a Hugging Face model, BPE tokenizer, chat template, JSONL
#: data): the model the sharded learner is checked on step by step in test_learners_ray.py
EXAMPLE = ROOT / "examples" / "wordproblems-local.yaml"
JOB, NS = "hosts", "team-a"
HEAD_SVC = f"{JOB}-head.{NS}.svc"
STEPS = 3


def _manifest(path: Path) -> None:
    from rlpacer_trainer import wordproblems

    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["model"]["source"] = str(ROOT / spec["model"]["source"])
    spec["data"]["source"] = str(wordproblems.write(path.parent / "train.jsonl", 256, seed=0))
    del spec["data"]["evalSource"]
    spec["rollout"]["replicas"] = 2
    spec["tailBatching"].setdefault("longRound", {})["rolloutReplicas"] = 2
    spec["trainer"]["replicas"] = 2
    spec["trainer"]["cpuRanksPerReplica"] = 2  # 4 learner ranks, FSDP across 2 hosts
    spec["trainer"]["streamTraining"] = True  # each part to all four ranks, as they finish
    spec["steps"] = STEPS
    spec["promptsPerStep"] = 16
    spec["checkpoint"]["everySteps"] = 2
    path.write_text(yaml.safe_dump(doc))


def test_every_pod_does_its_roles_work_on_its_own_host(tmp_path: Path) -> None:
    token = secrets.token_hex(32)
    logs = tmp_path / "logs"
    logs.mkdir()
    ckpt = tmp_path / "checkpoints"  # the checkpoint claim: driver and learner pods mount it
    _manifest(tmp_path / "job.yaml")
    hosts = TestHosts()
    temp_root = Path(f"/tmp/{hosts.tag}")  # short: Ray's unix socket paths
    pods = {"head": contract.Role.HEAD, "learner-0": contract.Role.LEARNER,
            "learner-1": contract.Role.LEARNER, "rollout-0": contract.Role.ROLLOUT,
            "rollout-1": contract.Role.ROLLOUT, "driver": contract.Role.DRIVER}
    python = sys.executable
    try:
        with hosts:
            for name in pods:
                hosts.add(name)
            hosts.alias("head", HEAD_SVC, f"{HEAD_SVC}.cluster.local")

            def start(name: str) -> subprocess.Popen[bytes]:
                role = pods[name]
                home = tmp_path / "home" / name
                home.mkdir(parents=True)
                env = {
                    "PATH": f"{Path(python).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
                    "HOME": str(home), "RAY_AUTH_TOKEN": token, "PYTHONUNBUFFERED": "1",
                    "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                    contract.ENV_JOB: JOB, contract.ENV_NAMESPACE: NS,
                    contract.ENV_ROLE: role.value, contract.ENV_POD_IP: hosts.address(name),
                    contract.ENV_RAY_TEMP_DIR: str(temp_root / name),
                    contract.ENV_RANK: name.rsplit("-", 1)[-1] if "-" in name else "0",
                }
                if role is not contract.Role.HEAD:
                    env[contract.ENV_RAY_ADDRESS] = f"{HEAD_SVC}:{contract.RAY_GCS_PORT}"
                if role is contract.Role.DRIVER:
                    env |= {contract.ENV_CONFIG: str(tmp_path / "job.yaml"),
                            contract.ENV_CHECKPOINT_DIR: str(ckpt), contract.ENV_ATTEMPT: "0"}
                log = open(logs / f"{name}.log", "wb")  # noqa: SIM115
                return hosts.popen(name, [python, "-m", contract.POD_ENTRYPOINT_MODULE],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)

            head = start("head")
            netns.wait_port(hosts.address("head"), contract.RAY_GCS_PORT, head, 90)
            for name in ("learner-0", "learner-1", "rollout-0", "rollout-1"):
                start(name)
            driver = start("driver")
            try:
                rc = driver.wait(timeout=780)
            except subprocess.TimeoutExpired:
                driver.kill()
                rc = -1
            assert rc == 0, "driver failed:\n" + "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                for p in sorted(logs.iterdir()))
            topo = json.loads((ckpt / "topology-attempt0.json").read_text())
            recs = [json.loads(x) for x in
                    (ckpt / "metrics-attempt0.jsonl").read_text().splitlines()]
            inode = {n: hosts.hosts[n].netns_inode() for n in pods}
            addr = {n: hosts.address(n) for n in pods}
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    print(json.dumps(topo, indent=1))
    sync = [round(r["seconds_sync"], 4) for r in recs]
    print("weight sync seconds per update across hosts:", sync)
    figures = Path(os.environ.get("RLPACER_TEST_FIGURES", "/tmp/rlpacer-trainer-figures.json"))
    data = json.loads(figures.read_text()) if figures.exists() else {}
    data["played_hosts_weight_sync_seconds"] = sync
    figures.write_text(json.dumps(data, indent=1, sort_keys=True))

    # each engine on its rollout replica's host, as the engine itself reports it
    for e in topo["engines"]:
        host = f"rollout-{e['replica']}"
        assert (e["address"], e["netns"], e["hostname"]) == (addr[host], inode[host], host), e
    assert sorted(e["replica"] for e in topo["engines"]) == [0, 1]
    # each learner rank on its learner host, two per host, each holding a quarter
    for x in topo["learners"]:
        host = f"learner-{x['rank'] // 2}"
        assert (x["address"], x["netns"], x["hostname"]) == (addr[host], inode[host], host), x
        assert x["sharded"] and x["world"] == 4
    assert sorted(x["rank"] for x in topo["learners"]) == [0, 1, 2, 3]
    held_bytes = [x["bytes"]["parameters"] for x in topo["learners"]]
    assert max(held_bytes) - min(held_bytes) <= 0.02 * max(held_bytes), held_bytes
    assert topo["driver"]["hostname"] == "driver"

    # every step: both engines generated, at the weights of the previous update
    held = topo["policy_version"]
    assert [r["step"] for r in recs] == list(range(STEPS))
    for r in recs:
        assert sorted(e["replica"] for e in r["engines"]) == [0, 1], r["engines"]
        for e in r["engines"]:
            assert e["responses"] > 0 and e["tokens"] > 0
            assert e["address"] == addr[f"rollout-{e['replica']}"]
            assert e["policy_version"] == held, (r["step"], e, held)
        held = r["policy_version"]
        # streamed: the learner ranks had every sample before the step's finish
        assert r["stream_training"] and r["learner_samples"] > 0, r
        assert r["learner_streamed"] == r["learner_samples"], r
        assert "learner_stream_refused" not in r, r
    # the checkpoint: each learner rank wrote its shards, rank 0 the gathered model, the
    # driver the rest
    latest = ckpt / (ckpt / "latest").read_text().strip()
    assert len(list((latest / "learner-dcp").glob("*.distcp"))) == 4
    assert (latest / "learner.pt").exists() and (latest / "model" / "config.json").exists()
    assert (latest / "state.json").exists() and (latest / "driver.pt").exists()
