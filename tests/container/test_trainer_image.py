"""The trainer image (CPU flavour) as the operator's pods run it: a sample job's children from
``rlpacer.operator.builders``, and for each workload (Ray head, rollout, learner StatefulSets
and the driver Pod) a podman container with exactly the pod's image, command, env (fieldRefs
resolved as the kubelet would), user and groups, read-only root file system, dropped
capabilities, emptyDirs, ConfigMap and Secrets at their paths. Each container gets its own
address on a podman network (its ``status.podIP``) and the job's Service names resolve to the
head's address and to this machine (the operator). All four start; the driver joins the
head's Ray cluster, places its engine on the rollout container and its learner on the learner
container, runs one step of the tiny job reporting to a stand-in of the operator's
step-report endpoint (the real JobController), checkpoints, and exits 0."""

from __future__ import annotations

import json
import random
import secrets
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlpacer.api import contract
from rlpacer.api.job import load_manifest
from rlpacer.operator import builders, names
from rlpacer.testing.containers import (
    ROOT,
    ULIMITS,
    entrypoint_args,
    env_args,
    mount_args,
    podman,
    security_args,
)
from rlpacer.testing.report_stub import ReportStub
from rlpacer_trainer.config import RunConfig

pytestmark = [pytest.mark.container, pytest.mark.slow]
EXAMPLE = ROOT / "examples" / "tiny-local.yaml"
JOB, NAMESPACE, TOKEN = "tiny", "team-a", "s3cret"
OPERATOR_HOST = "rel-rlpacer.rlpacer-system.svc"


@pytest.fixture
def network() -> Iterator[tuple[str, str]]:
    """A podman network of its own: (name, the /24 prefix of its addresses)."""
    name = f"rlpacer-test-{uuid.uuid4().hex[:6]}"
    for _ in range(20):
        prefix = f"10.{random.randint(90, 250)}.{random.randint(0, 255)}"
        if podman("network", "create", "--subnet", f"{prefix}.0/24", name,
                  check=False).returncode == 0:
            break
    else:
        raise AssertionError("could not create a podman network")
    yield name, prefix
    podman("network", "rm", "-f", name, check=False)


def _workloads(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """role -> pod spec (a StatefulSet's template, or the driver Pod's)."""
    out = {}
    for obj in children:
        if obj["kind"] == "StatefulSet":
            spec = obj["spec"]["template"]["spec"]
            role = obj["spec"]["template"]["metadata"]["labels"][contract.LABEL_ROLE]
        elif obj["kind"] == "Pod":
            spec, role = obj["spec"], obj["metadata"]["labels"][contract.LABEL_ROLE]
        else:
            continue
        out[role] = spec
    return out


def _wait_port(host: str, port: int, timeout: float, alive: Any) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            alive()
            assert time.monotonic() < deadline, f"{host}:{port} not open in {timeout} s"
            time.sleep(1)


def test_every_role_runs_in_the_trainer_image_and_the_driver_makes_a_step(
    images: dict[str, str], containers: list[str], network: tuple[str, str], tmp_path: Path
) -> None:
    net, prefix = network
    gateway = f"{prefix}.1"
    # Checkpoints as a job gets them by default: no claim, so each pod's checkpoint folder is
    # its own emptyDir and the learner's part of a checkpoint reaches the driver's folder
    # through Ray (the learner cannot see that folder).
    spec = load_manifest(EXAMPLE).spec
    spec = spec.model_copy(update={"steps": 1})
    assert spec.checkpoint.volume_claim is None
    assert spec.trainer.image == spec.rollout.image == images["trainer"]  # the spec's default
    # the stand-in operator, on this machine (the network's gateway)
    srv = ReportStub(RunConfig.load(EXAMPLE).controller_config(), TOKEN, host="0.0.0.0").start()
    ray_token = secrets.token_hex(32)
    inputs = builders.BuildInputs(
        name=JOB, namespace=NAMESPACE, uid="u1", spec=spec, attempt=0, rollout_replicas=1,
        report_url=f"http://{OPERATOR_HOST}:{srv.port}")
    children = builders.build_children(inputs)
    config = next(o for o in children if o["kind"] == "ConfigMap")
    files = {
        names.config_map(JOB): config["data"],
        names.secret(JOB): {contract.TOKEN_KEY: TOKEN},
        names.ray_secret(JOB): {contract.RAY_TOKEN_KEY: ray_token},
    }
    pods = _workloads(children)
    assert sorted(pods) == sorted(r.value for r in contract.Role)
    ips = {"head": f"{prefix}.10", "rollout": f"{prefix}.11", "learner": f"{prefix}.12",
           "driver": f"{prefix}.13"}
    hosts = ["--add-host", f"{names.head_service(JOB)}.{NAMESPACE}.svc:{ips['head']}",
             "--add-host", f"{OPERATOR_HOST}:{gateway}"]
    suffix = uuid.uuid4().hex[:6]

    def start(role: str) -> str:
        pod = pods[role]
        (c,) = pod["containers"]
        assert c["image"] == images["trainer"] and c["command"] == builders.POD_COMMAND
        env_flags, _ = env_args(c, {
            "status.podIP": ips[role],
            f"metadata.labels['{builders.POD_INDEX_LABEL}']": "0",
        })
        name = f"rlpacer-test-{suffix}-{role}"
        containers.append(name)
        podman(
            "run", "--detach", "--name", name, "--network", net, "--ip", ips[role],
            "--hostname", pod.get("hostname", name), *hosts, *ULIMITS,
            *security_args(pod, c),
            *mount_args(pod, c, tmp_path / role, files, claims=tmp_path / "claims"),
            *env_flags, *entrypoint_args(c), c["image"],
        )
        return name

    def logs(name: str) -> str:
        p = podman("logs", name, check=False)
        return (p.stdout + p.stderr)[-3000:]

    def running(*names_: str) -> None:
        for n in names_:
            state = podman("inspect", "--format", "{{.State.Status}}", n).stdout.strip()
            assert state == "running", f"{n} {state}:\n{logs(n)}"

    try:
        head = start("head")
        _wait_port(ips["head"], contract.RAY_GCS_PORT, 120, lambda: running(head))
        workers = [start("rollout"), start("learner")]
        driver = start("driver")
        deadline = time.monotonic() + 600
        while podman("inspect", "--format", "{{.State.Status}}", driver).stdout.strip() in (
                "running", "created", "configured"):
            running(head, *workers)
            assert time.monotonic() < deadline, f"the driver did not finish:\n{logs(driver)}"
            time.sleep(2)
        code = podman("inspect", "--format", "{{.State.ExitCode}}", driver).stdout.strip()
        assert code == "0", f"driver exit {code}:\n{logs(driver)}\n--- head:\n{logs(head)}"
        running(head, *workers)  # the Ray nodes stayed up through the run
        reports = srv.reports
        assert [(r["attempt"], r["step"]) for r in reports] == [(0, 0)], reports
        assert reports[0]["lengths"]["count"] > 0
        ckpt = tmp_path / "driver" / "checkpoints"  # the driver pod's emptyDir
        assert (ckpt / "latest").read_text().strip() == "step-000001"
        step = ckpt / "step-000001"
        assert (step / "learner.pt").is_file() and (step / "model" / "config.json").is_file()
        theirs = tmp_path / "learner" / "checkpoints"  # the learner pod's own emptyDir
        assert not theirs.exists() or not any(theirs.iterdir())
        topo = json.loads((ckpt / "topology-attempt0.json").read_text())
        # the engine ran on the rollout container, the learner on the learner container
        assert [e["address"] for e in topo["engines"]] == [ips["rollout"]], topo
        assert ips["learner"] in json.dumps(topo["learners"]), topo
        # SIGTERM (the kubelet stopping a pod) ends a Ray node's container promptly
        for n in (*workers, head):
            podman("stop", "-t", "30", n, timeout=90)
            code = podman("inspect", "--format", "{{.State.ExitCode}}", n).stdout.strip()
            assert code in ("0", "143"), f"{n} exit {code}:\n{logs(n)}"
    finally:
        srv.shutdown()
