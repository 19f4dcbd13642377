"""Running the project's images as a pod would run them: podman flags for a pod spec's
securityContext, volumes, env and command (the container test tier, tests/container)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from rlpacer.testing.cluster import repo_root

ROOT = repo_root()
CHART = ROOT / "charts" / "rlpacer"
BUILD = ["bash", str(ROOT / "scripts" / "build-images.sh")]
#: podman's default rlimits ask for more than many machines' hard limits allow.
ULIMITS = ["--ulimit", "nofile=1024:4096", "--ulimit", "nproc=4096:4096"]


def chart_app_version() -> str:
    import yaml

    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def project_images() -> dict[str, str]:
    """The images scripts/build-images.sh builds, by role (the chart's and the spec's
    default images)."""
    v = chart_app_version()
    return {"operator": f"ghcr.io/rlpacer/operator:{v}", "trainer": f"ghcr.io/rlpacer/trainer:{v}"}


class PodmanMissing(RuntimeError):
    pass


def podman_base() -> list[str]:
    """podman, with runc where crun refuses the host's cgroups (v1 or hybrid): the same choice
    scripts/build-images.sh makes."""
    if shutil.which("podman") is None:
        raise PodmanMissing(
            "podman is not installed: run bash scripts/setup.sh (it installs podman and builds"
            " the images), or apt-get install -y podman buildah debootstrap runc")
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    if not v2 and shutil.which("runc"):
        return ["podman", "--runtime", "runc"]
    return ["podman"]


def podman(*args: str, check: bool = True, timeout: float = 120,
           input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*podman_base(), *args], capture_output=True, text=True,
                          timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} -> {proc.returncode}\n"
                             f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


def security_args(pod_spec: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """podman flags for a pod's and its container's securityContext (the fields the builders
    and the chart set; anything else fails here so that it gets mapped)."""
    pod_sc, sc = pod_spec.get("securityContext", {}), container.get("securityContext", {})
    known = {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "fsGroupChangePolicy",
             "seccompProfile", "allowPrivilegeEscalation", "privileged",
             "readOnlyRootFilesystem", "capabilities"}
    assert set(pod_sc) | set(sc) <= known, set(pod_sc) | set(sc)
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    assert uid is not None and gid is not None and uid != 0
    out = ["--user", f"{uid}:{gid}"]
    if "fsGroup" in pod_sc:
        out += ["--group-add", str(pod_sc["fsGroup"])]
    if sc.get("readOnlyRootFilesystem"):
        # no tmpfs of podman's own on /tmp, /run, /var/tmp: only the pod's mounts are writable
        out += ["--read-only", "--read-only-tmpfs=false"]
    if sc.get("allowPrivilegeEscalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    if "ALL" in sc.get("capabilities", {}).get("drop", []):
        out += ["--cap-drop", "all"]
    assert not sc.get("privileged")
    return out


def mount_args(pod_spec: dict[str, Any], container: dict[str, Any], root: Path,
               files: dict[str, dict[str, str]], claims: Path | None = None) -> list[str]:
    """podman flags for the container's volumeMounts, as the kubelet would make them: an
    emptyDir is an empty folder of this pod (under ``root``) writable by anyone; a
    persistentVolumeClaim is one folder per claim under ``claims``, shared by every pod that
    mounts it; a Secret's or ConfigMap's keys are files (Secrets in their defaultMode,
    group-owned by the pod's fsGroup), ``files`` holding each one's data by object name.
    ``/dev/shm`` (a memory emptyDir) is the container's shared memory."""
    fs_group = int(pod_spec.get("securityContext", {}).get("fsGroup", 0))
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    out: list[str] = []
    for m in container["volumeMounts"]:
        vol = volumes[m["name"]]
        ro = ":ro" if m.get("readOnly") else ""
        if m["mountPath"] == "/dev/shm":
            assert vol.get("emptyDir", {}).get("medium") == "Memory", vol
            out += ["--shm-size", "2g"]
            continue
        host = root / m["name"]
        if "persistentVolumeClaim" in vol:
            assert claims is not None, f"a claim needs a folder for claims: {vol}"
            host = claims / vol["persistentVolumeClaim"]["claimName"]
        host.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in vol or "persistentVolumeClaim" in vol:
            host.chmod(0o777)
        elif "secret" in vol or "configMap" in vol:
            src = vol.get("secret", {}).get("secretName") or vol["configMap"]["name"]
            mode = (vol.get("secret") or vol.get("configMap") or {}).get("defaultMode", 0o644)
            for key, value in files[src].items():
                (host / key).write_text(value)
                os.chown(host / key, 0, fs_group)
                (host / key).chmod(mode)
            host.chmod(0o755)
        else:
            raise AssertionError(f"volume kind not mapped: {vol}")
        out += ["--volume", f"{host}:{m['mountPath']}{ro}"]
    return out


def env_args(container: dict[str, Any],
             field_refs: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``--env`` flags for the container's env, fieldRefs resolved as the kubelet would."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = field_refs[e["valueFrom"]["fieldRef"]["fieldPath"]]
    out: list[str] = []
    for k, v in env.items():
        out += ["--env", f"{k}={v}"]
    return out, env


def entrypoint_args(container: dict[str, Any]) -> list[str]:
    """The container's command as the entrypoint: a pod's command replaces the image's
    ENTRYPOINT (the containers here have no args)."""
    assert not container.get("args"), container.get("args")
    return ["--entrypoint", json.dumps(container["command"])]


