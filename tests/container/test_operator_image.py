"""The operator image as the chart deploys it: the Deployment rendered by `helm install`
against the local control plane, its container run with podman exactly as specified (image,
command, env, user and group, read-only root file system, dropped capabilities, the /tmp
emptyDir and the serving-certificate Secret at their paths) and the in-cluster credentials the
kubelet gives a pod (the chart ServiceAccount's token at
/var/run/secrets/kubernetes.io/serviceaccount, KUBERNETES_SERVICE_HOST/PORT). It must start,
answer /healthz and /readyz, and win its Lease.

One deviation from a pod: the container shares this machine's network (a pod has its own), so
the listen addresses are loopback and the ports free ones."""

from __future__ import annotations

import base64
import json
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from rlpacer.testing import LocalCluster
from rlpacer.testing.cluster import free_ports
from rlpacer.testing.containers import (
    CHART,
    ULIMITS,
    entrypoint_args,
    env_args,
    mount_args,
    podman,
    security_args,
)

pytestmark = pytest.mark.container

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
#: The operator image's size bound (measured: see README "Container images").
MAX_OPERATOR_IMAGE_MIB = 260


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status)
    except OSError:
        return 0


def test_operator_image_runs_the_charts_deployment(
    cluster: LocalCluster, images: dict[str, str], containers: list[str], tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:6]
    rel, system, jobs = f"img-{suffix}", f"img-sys-{suffix}", f"img-jobs-{suffix}"
    metrics, reports, webhook = free_ports(3)
    cluster.create_namespace(system)
    cluster.create_namespace(jobs)
    try:
        cluster.helm(
            "install", rel, str(CHART), "-n", system, "--wait=false",
            "--set", "rbac.scope=Namespaced", "--set", f"rbac.watchNamespaces={{{jobs}}}",
            "--set", f"service.ports.metrics={metrics}",
            "--set", f"service.ports.reports={reports}",
            "--set", f"webhook.port={webhook}", "--set", f"webhook.url=https://127.0.0.1:{webhook}",
        )
        dep = json.loads(cluster.kubectl("get", "deploy", f"{rel}-rlpacer", "-n", system,
                                         "-o", "json").stdout)
        pod_spec: dict[str, Any] = dep["spec"]["template"]["spec"]
        (c,) = pod_spec["containers"]
        # the chart's default image is the one scripts/build-images.sh tags
        assert c["image"] == images["operator"]
        assert c["command"] == ["rlpacer", "operator"] and not c.get("args")
        pod_name = f"{rel}-rlpacer-0"
        env_flags, env = env_args(c, {"metadata.namespace": system, "metadata.name": pod_name})
        for what in ("WEBHOOK", "REPORT", "METRICS"):
            env_flags += ["--env", f"RLPACER_OPERATOR_{what}_HOST=127.0.0.1"]
        # The kubelet's part: the Secret's keys as files, the ServiceAccount's token, the CA
        # and the namespace where client libraries look for them, the API server's address.
        secret = json.loads(cluster.kubectl("get", "secret", f"{rel}-rlpacer-webhook-tls", "-n",
                                            system, "-o", "json").stdout)
        tls = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        tls_secret = next(v["secret"]["secretName"] for v in pod_spec["volumes"]
                          if "secret" in v)
        mounts = mount_args(pod_spec, c, tmp_path / "volumes", {tls_secret: tls})
        sa = tmp_path / "serviceaccount"
        sa.mkdir()
        sa_name = pod_spec["serviceAccountName"]
        (sa / "token").write_text(cluster.service_account_token(system, sa_name))
        (sa / "ca.crt").write_text(Path(cluster.ca_file).read_text())
        (sa / "namespace").write_text(system)
        for f in sa.iterdir():
            f.chmod(0o644)
        api = urlparse(cluster.server)
        name = f"rlpacer-test-operator-{suffix}"
        containers.append(name)
        podman(
            "run", "--detach", "--name", name, "--network", "host", *ULIMITS,
            *security_args(pod_spec, c), *mounts, "--volume", f"{sa}:{SA_DIR}:ro",
            "--env", f"KUBERNETES_SERVICE_HOST={api.hostname}",
            "--env", f"KUBERNETES_SERVICE_PORT={api.port}",
            *env_flags, *entrypoint_args(c), c["image"],
        )

        def logs() -> str:
            p = podman("logs", name, check=False)
            return (p.stdout + p.stderr)[-4000:]

        deadline = time.monotonic() + 120
        while _get(f"http://127.0.0.1:{metrics}/readyz") != 200:
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running", f"the operator container {state}:\n{logs()}"
            assert time.monotonic() < deadline, f"not ready in 120 s:\n{logs()}"
            time.sleep(1)
        assert _get(f"http://127.0.0.1:{metrics}/healthz") == 200, logs()
        # it runs as the chart's user, on a root file system it cannot write
        user = podman("exec", name, "python3", "-c",
                      "import os, pathlib\n"
                      "try:\n pathlib.Path('/opt/x').write_text('x'); rw = 'rw'\n"
                      "except OSError: rw = 'ro'\n"
                      "print(os.getuid(), os.getgid(), rw)").stdout.split()
        sc = pod_spec["securityContext"]
        assert user == [str(sc["runAsUser"]), str(sc["runAsGroup"]), "ro"]
        # ... and acts with the ServiceAccount's rights: it holds the Lease
        lease = json.loads(cluster.kubectl("get", "lease", env["RLPACER_OPERATOR_LEASE_NAME"],
                                           "-n", system, "-o", "json").stdout)
        assert lease["spec"]["holderIdentity"] == env["RLPACER_OPERATOR_IDENTITY"] == pod_name
        assert "Traceback" not in logs(), logs()
        # small: no Kubernetes client library (the operator reads its credentials itself, as
        # above), no documentation or apt caches
        spec = podman("exec", name, "python3", "-c",
                      "import importlib.util as u; print(u.find_spec('kubernetes'))").stdout
        assert spec.strip() == "None", spec
        size = int(podman("image", "inspect", "--format", "{{.Size}}", c["image"]).stdout)
        print(f"operator image: {size / 2**20:.0f} MiB")
        assert size < MAX_OPERATOR_IMAGE_MIB * 2**20, size
    finally:
        for n in containers:
            podman("rm", "-f", "-t", "5", n, check=False)
        cluster.helm("uninstall", rel, "-n", system, check=False)
        cluster.delete_namespace(jobs)
        cluster.delete_namespace(system)
