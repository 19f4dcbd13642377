"""The pod -> local process contract of rlpacer.testing.harness, on the operator's own pod
builders (so a change of the pod contract that the harness cannot play fails here)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from rlpacer.api import contract, sources
from rlpacer.api.job import load_manifest
from rlpacer.operator import builders, names
from rlpacer.testing.harness import (
    HarnessError,
    claim_dir,
    local_command,
    pod_dir,
    rewrite_addresses,
)

pytestmark = pytest.mark.unit
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-cluster.yaml"


class Lookup:
    def __init__(self, cms: Mapping[str, Mapping[str, bytes]],
                 secrets: Mapping[str, Mapping[str, bytes]]) -> None:
        self.cms, self.secrets = cms, secrets

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        return self.cms.get(name)

    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        return self.secrets.get(name)

    def service_account_token(self, namespace: str, name: str, audience: str | None,
                              expiration_seconds: int) -> str:
        return f"token-of-{namespace}/{name}"


def _inputs(claim: str | None = None) -> builders.BuildInputs:
    spec = load_manifest(EXAMPLE).spec
    if claim:
        spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
            update={"volume_claim": claim})})
    return builders.BuildInputs(
        name="tiny", namespace="team-a", uid="u1", spec=spec, attempt=2, rollout_replicas=1,
        report_url="http://rel-rlpacer.rlpacer-system.svc:8080")


def _pod(obj: dict) -> dict:  # type: ignore[type-arg]
    obj["metadata"]["uid"] = "pod-uid"
    obj["spec"]["nodeName"] = "kwok-cpu-0"
    return obj


def _lookup(inputs: builders.BuildInputs) -> Lookup:
    return Lookup({names.config_map("tiny"): {contract.CONFIG_KEY: b"kind: RLTrainingJob\n"}},
                  {names.secret("tiny"): {contract.TOKEN_KEY: b"tok"},
                   names.ray_secret("tiny"): {contract.RAY_TOKEN_KEY: b"ray-tok"}})


def test_driver_pod_maps_to_the_entrypoint_with_local_files_and_loopback(tmp_path: Path) -> None:
    inputs = _inputs()
    pod = _pod(builders.driver_pod(inputs))
    cmd = local_command(pod, _lookup(inputs), root=tmp_path, python="/venv/bin/python",
                        drop_env=[contract.ENV_RAY_ADDRESS])
    assert cmd.argv == ["/venv/bin/python", "-m", contract.POD_ENTRYPOINT_MODULE]
    home = pod_dir(tmp_path, "team-a", names.driver_pod("tiny", 2))
    env = cmd.env
    assert env[contract.ENV_ROLE] == "driver" and env[contract.ENV_ATTEMPT] == "2"
    assert env[contract.ENV_JOB] == "tiny" and env[contract.ENV_NAMESPACE] == "team-a"
    # the operator's Service address becomes loopback, same port
    assert env[contract.ENV_REPORT_URL] == "http://127.0.0.1:8080"
    assert contract.ENV_RAY_ADDRESS not in env  # Ray starts in the process
    # mounted files are written locally and the env points at them
    cfg, tok = Path(env[contract.ENV_CONFIG]), Path(env[contract.ENV_TOKEN_FILE])
    assert cmd.files[cfg] == b"kind: RLTrainingJob\n" and cmd.files[tok] == b"tok"
    assert cfg.is_relative_to(home) and tok.is_relative_to(home)
    # the Ray token: its own mounted file, token mode
    ray_tok = Path(env[contract.ENV_RAY_AUTH_TOKEN_PATH])
    assert cmd.files[ray_tok] == b"ray-tok" and ray_tok.is_relative_to(home)
    assert env[contract.ENV_RAY_AUTH_MODE] == contract.RAY_AUTH_MODE_TOKEN
    ckpt = Path(env[contract.ENV_CHECKPOINT_DIR])
    assert ckpt in cmd.dirs and ckpt.is_relative_to(home)
    assert cmd.mounts[contract.CHECKPOINT_DIR] == ckpt
    assert cmd.cwd.is_relative_to(home)
    assert not any(v.startswith(("/etc/rlpacer", "/var/run", "/checkpoints"))
                   for v in env.values())
    # the writable emptyDirs of the read-only root (HOME, caches, /tmp, /dev/shm) are the
    # pod's own folders; HOME and the caches follow them
    for path in (contract.TMP_DIR, contract.HOME_DIR, contract.SHM_DIR):
        assert cmd.mounts[path] in cmd.dirs and cmd.mounts[path].is_relative_to(home)
    assert env[contract.ENV_HOME] == str(cmd.mounts[contract.HOME_DIR])
    assert Path(env[contract.ENV_XDG_CACHE_HOME]).is_relative_to(cmd.mounts[contract.HOME_DIR])


def test_claims_are_shared_folders_and_ray_address_is_kept_when_the_head_is_played(
    tmp_path: Path,
) -> None:
    inputs = _inputs(claim="ckpt-pvc")
    pod = _pod(builders.driver_pod(inputs))
    cmd = local_command(pod, _lookup(inputs), root=tmp_path,
                        services={"rel-rlpacer.rlpacer-system": "127.0.0.1:18080"})
    assert Path(cmd.env[contract.ENV_CHECKPOINT_DIR]) == claim_dir(tmp_path, "team-a",
                                                                   "ckpt-pvc")
    assert cmd.env[contract.ENV_REPORT_URL] == "http://127.0.0.1:18080"
    assert cmd.env[contract.ENV_RAY_ADDRESS] == f"127.0.0.1:{contract.RAY_GCS_PORT}"
    assert cmd.argv[0] == sys.executable


def test_model_and_data_claims_resolve_to_the_claim_folders(tmp_path: Path) -> None:
    """pvc:// sources are named in the job's spec file, not in env: the played pod gets the
    trainer's claims-root override, so the trainer resolves them to the harness's claim
    folders (the ones every pod mounting the claim shares); a pod without such claims does
    not get it."""
    inputs = _inputs()
    plain = local_command(_pod(builders.driver_pod(inputs)), _lookup(inputs), root=tmp_path)
    assert sources.ENV_CLAIMS_DIR not in plain.env
    spec = inputs.spec.model_copy(update={
        "model": inputs.spec.model.model_copy(update={"source": "pvc://models/m1"}),
        "data": inputs.spec.data.model_copy(update={"source": "pvc://datasets/d/x.parquet"})})
    inputs = dataclasses.replace(inputs, spec=spec)
    cmd = local_command(_pod(builders.driver_pod(inputs)), _lookup(inputs), root=tmp_path)
    model = sources.local_path("pvc://models/m1", "spec.model.source", cmd.env)
    data = sources.local_path("pvc://datasets/d/x.parquet", "spec.data.source", cmd.env)
    assert model == str(claim_dir(tmp_path, "team-a", "models") / "m1")
    assert data == str(claim_dir(tmp_path, "team-a", "datasets") / "d" / "x.parquet")
    assert cmd.mounts[sources.claim_mount("models")] == claim_dir(tmp_path, "team-a", "models")


def test_statefulset_pod_resolves_field_refs(tmp_path: Path) -> None:
    inputs = _inputs()
    sts = builders.statefulset(inputs, contract.Role.ROLLOUT, 2, "img", 0)
    pod = {"metadata": {"name": "tiny-rollout-1", "namespace": "team-a",
                        "labels": {**sts["spec"]["template"]["metadata"]["labels"],
                                   builders.POD_INDEX_LABEL: "1"}},
           "spec": sts["spec"]["template"]["spec"]}
    cmd = local_command(_pod(pod), _lookup(inputs), root=tmp_path)
    assert cmd.env[contract.ENV_RANK] == "1" and cmd.env[contract.ENV_ROLE] == "rollout"


def test_env_expansion_key_refs_and_errors(tmp_path: Path) -> None:
    pod = {"metadata": {"name": "p", "namespace": "n", "uid": "u", "labels": {"a": "b"}},
           "spec": {"containers": [{
               "name": "c", "command": ["sh", "-c", "echo $(X)"],
               "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
               "env": [{"name": "X", "value": "x-$(CM_K)-$$"},
                       {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                       {"name": "O", "valueFrom": {"secretKeyRef": {
                           "name": "s", "key": "nope", "optional": True}}},
                       {"name": "L", "valueFrom": {"fieldRef": {
                           "fieldPath": "metadata.labels['a']"}}},
                       {"name": "U", "value": "db.other.svc.cluster.local:5432/x"}]}]}}
    lk = Lookup({"cm": {"K": b"v"}}, {"s": {"k": b"secret"}})
    cmd = local_command(pod, lk, root=tmp_path)
    assert cmd.env == {"CM_K": "v", "X": "x-v-$", "S": "secret", "L": "b",
                       "U": "127.0.0.1:5432/x"}
    assert cmd.argv == ["sh", "-c", "echo x-v-$"]
    pod["spec"]["containers"][0]["env"][1]["valueFrom"]["secretKeyRef"]["key"] = "missing"
    with pytest.raises(HarnessError, match="key 'missing' missing"):
        local_command(pod, lk, root=tmp_path)
    del pod["spec"]["containers"][0]["command"]
    with pytest.raises(HarnessError, match="has no command"):
        local_command(pod, lk, root=tmp_path)


def test_projected_service_account_volume(tmp_path: Path) -> None:
    """The kube-api-access volume the ServiceAccount admission plugin adds to every pod."""
    mount = "/var/run/secrets/kubernetes.io/serviceaccount"
    pod = {"metadata": {"name": "p", "namespace": "n"},
           "spec": {"serviceAccountName": "default", "containers": [{
               "name": "c", "command": ["true"],
               "volumeMounts": [{"name": "kube-api-access-x", "mountPath": mount}]}],
               "volumes": [{"name": "kube-api-access-x", "projected": {"sources": [
                   {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                   {"configMap": {"name": "kube-root-ca.crt",
                                  "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                   {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                       "fieldPath": "metadata.namespace"}}]}}]}}]}}
    cmd = local_command(pod, Lookup({"kube-root-ca.crt": {"ca.crt": b"PEM"}}, {}),
                        root=tmp_path)
    folder = cmd.mounts[mount]
    assert cmd.files == {folder / "token": b"token-of-n/default", folder / "ca.crt": b"PEM",
                         folder / "namespace": b"n"}


def test_rewrite_addresses() -> None:
    assert rewrite_addresses("http://op.sys.svc:8080/x") == "http://127.0.0.1:8080/x"
    assert rewrite_addresses("op.sys.svc") == "127.0.0.1"
    assert rewrite_addresses("example.com:80 op.sys.svc.cluster.local:1",
                             {"op.sys:1": "127.0.0.1:2"}) == "example.com:80 127.0.0.1:2"
    assert rewrite_addresses("not.a.svcx:1") == "not.a.svcx:1"


class _PodList:
    """What :class:`PodHarness` asks of a cluster, serving a pod list the test sets."""

    def __init__(self) -> None:
        self.pods: list[dict] = []  # type: ignore[type-arg]
        self.exits: list[tuple[str, int]] = []

    def request(self, method: str, path: str) -> tuple[int, dict]:  # type: ignore[type-arg]
        assert method == "GET" and "/pods?" in path, path
        return 200, {"items": self.pods}

    def mark_pod_exit(self, namespace: str, name: str, exit_code: int) -> None:
        self.exits.append((name, exit_code))


def test_a_pod_replaced_under_its_name_gets_empty_emptydirs_and_keeps_its_claims(
    tmp_path: Path,
) -> None:
    """A kubelet gives every new pod fresh emptyDir volumes, also one that replaces a deleted
    pod of the same name (a driver or a StatefulSet pod): what the pod before wrote there is
    gone, while a claim's folder outlives both. (A driver that found its predecessor's
    emptyDir checkpoint would resume from it, which no cluster allows.)"""
    from rlpacer.testing.harness import PodHarness

    script = ("import os, pathlib, sys; e, c = os.environ['SCRATCH'], os.environ['CLAIM'];"
              " print('found', sorted(os.listdir(e)), sorted(os.listdir(c)));"
              " [pathlib.Path(d, os.environ['ME']).write_text('x') for d in (e, c)]")

    def pod(uid: str) -> dict:  # type: ignore[type-arg]
        return {"metadata": {"name": "job-driver-0", "namespace": "n", "uid": uid,
                             "labels": {contract.LABEL_ROLE: "driver"}},
                "spec": {"containers": [{
                    "name": "main", "command": ["python3", "-c", script],
                    "env": [{"name": "SCRATCH", "value": "/scratch"},
                            {"name": "CLAIM", "value": "/ckpt"}, {"name": "ME", "value": uid}],
                    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"},
                                     {"name": "ckpt", "mountPath": "/ckpt"}]}],
                    "volumes": [{"name": "scratch", "emptyDir": {}},
                                {"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}]},
                "status": {"phase": "Running"}}

    cluster = _PodList()
    h = PodHarness(cluster, "n", tmp_path, grace_seconds=5)  # type: ignore[arg-type]
    try:
        for uid in ("uid-1", "uid-2"):
            cluster.pods = [pod(uid)]
            h.sync()  # plays the pod (the one before is gone from the list)
            (played,) = [p for p in h.played("job-driver-0") if p.uid == uid]
            assert played.proc.wait(60) == 0, played.log_tail()
            h.sync()  # its exit is reported
        first, second = sorted(h.played("job-driver-0"), key=lambda p: p.started)
        assert "found [] []" in first.log_tail()
        # the emptyDir is empty again, the claim keeps what the first pod wrote
        assert "found [] ['uid-1']" in second.log_tail(), second.log_tail()
        assert cluster.exits == [("job-driver-0", 0), ("job-driver-0", 0)]
        assert first.mount("/scratch") == second.mount("/scratch")  # the same pod folder
    finally:
        h.stop()
