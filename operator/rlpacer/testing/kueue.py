"""Kueue on the local control plane: its CRDs, its webhooks and its controller manager.

``KueueProc(cluster).start()`` installs Kueue's CRDs (``bin/kueue-manifests/crds``, copied from
the pinned module by ``hack/build-binaries.sh``), runs ``bin/kueue`` against the cluster as a
local process, and registers Kueue's own admission webhooks for its API group (Workload,
ClusterQueue, ResourceFlavor, LocalQueue, Cohort: defaulting and validation) with the API
server at the process's address, so every Workload the operator makes passes Kueue's real
validation. What differs from Kueue's deployment, and why:

* no Service in front of the webhook server: the webhook configurations carry a URL
  (``https://127.0.0.1:<port>/...``) and the CA of a certificate made for that address;
* Kueue's internal certificate management is off (it signs for the in-cluster Service name);
  with it off Kueue reads its metrics server's certificate from the fixed path
  ``/etc/kueue/metrics/certs`` (its Deployment mounts one there): the launcher writes one
  there when none is present (a test machine's path, as in Kueue's own image);
* its metrics served on 127.0.0.1 with the ClusterQueues' resources on
  (``enableClusterQueueResources``), read by :meth:`KueueProc.metrics` with a token RBAC
  allows to get ``/metrics``, as a Prometheus with Kueue's ServiceMonitor would;
* ``VisibilityOnDemand`` off: the on-demand visibility API is an aggregated API server with
  certificates of its own, which nothing here reads;
* the integrations: ``batch/job`` only, and the job's kind as an external framework
  (``RLTrainingJob.v1alpha1.rlpacer.io``), as docs/kueue.md tells platform teams to set;
* admission fair sharing configured with a one-minute usage half-life sampled every second (a
  cluster's would be hours and minutes): it applies only to ClusterQueues that opt in with
  ``admissionScope``.

``stop()`` stops the process and removes the webhook configurations (the CRDs and Kueue's
objects stay: the next start reuses them).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from rlpacer.operator import tls
from rlpacer.testing.base import bin_dir, find_binary, free_ports
from rlpacer.testing.cluster import LocalCluster

GROUP = "kueue.x-k8s.io"
NAMESPACE = "kueue-system"
EXTERNAL_FRAMEWORK = "RLTrainingJob.v1alpha1.rlpacer.io"
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
WEBHOOK_PREFIX = "rlpacer-test-kueue"
METRICS_READER = "rlpacer-test-kueue-metrics-reader"


def manifests_dir() -> Path:
    d = bin_dir() / "kueue-manifests"
    if not (d / "crds").is_dir() or not (d / "webhooks.yaml").is_file():
        find_binary("kueue")  # the missing-binary message says how to build both
        raise FileNotFoundError(f"{d}: Kueue's manifests are missing; run"
                                " `bash hack/build-binaries.sh kueue`")
    return d


def webhook_configurations(url: str, ca_pem: str) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, reduced to its own API group's webhooks, each at
    ``url`` + its path with ``ca_pem`` as the CA bundle."""
    docs = [d for d in yaml.safe_load_all((manifests_dir() / "webhooks.yaml").read_text()) if d]
    out = []
    bundle = base64.b64encode(ca_pem.encode()).decode()
    for doc in docs:
        hooks = []
        for h in doc.get("webhooks") or []:
            if not any(GROUP in (r.get("apiGroups") or []) for r in h.get("rules") or []):
                continue
            path = h["clientConfig"]["service"]["path"]
            h["clientConfig"] = {"url": url + path, "caBundle": bundle}
            hooks.append(h)
        if hooks:
            kind = doc["kind"]
            out.append({"apiVersion": doc["apiVersion"], "kind": kind,
                        "metadata": {"name": f"{WEBHOOK_PREFIX}-{kind.lower()}"},
                        "webhooks": hooks})
    return out


class KueueProc:
    """Kueue's controller manager for one LocalCluster."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.dir = Path(tempfile.mkdtemp(prefix="rlpacer-kueue-"))
        self.log = self.dir / "kueue.log"
        self.health_port, self.webhook_port, self.metrics_port = free_ports(3)
        self.proc: subprocess.Popen[bytes] | None = None
        self._metrics_token: str | None = None

    def _kubectl(self, *args: str, input: str | None = None) -> None:
        self.cluster.kubectl(*args, input=input)

    def start(self, timeout: float = 90.0) -> KueueProc:
        exe = find_binary("kueue")
        m = manifests_dir()
        self._kubectl("apply", "--server-side", "--force-conflicts", "-f", str(m / "crds"))
        def established() -> bool:
            for p in ("workloads", "clusterqueues", "localqueues", "resourceflavors",
                      "cohorts", "workloadpriorityclasses"):
                code, crd = self.cluster.http.request(
                    "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{p}.{GROUP}")
                st = (crd or {}).get("status") or {} if code == 200 else {}
                conds = st.get("conditions") or []
                if not any(c.get("type") == "Established" and c.get("status") == "True"
                           for c in conds):
                    return False
            return True

        self.cluster.wait_for(established, timeout=60, what="Kueue's CRDs established")
        self._kubectl("apply", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}))
        certs = tls.generate(self.dir / "certs", ["127.0.0.1"], days=2)
        if not (METRICS_CERTS / "tls.crt").is_file():
            METRICS_CERTS.mkdir(parents=True, exist_ok=True)
            for f in ("tls.crt", "tls.key"):
                shutil.copy(certs / f, METRICS_CERTS / f)
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            # its metrics (HTTPS, a bearer token RBAC allows to get /metrics: metrics()), with
            # the ClusterQueues' quota and reservation per resource (a burst pool's size, use)
            "metrics": {"bindAddress": f"127.0.0.1:{self.metrics_port}",
                        "enableClusterQueueResources": True},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1",
                        "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "integrations": {"frameworks": ["batch/job"],
                             "externalFrameworks": [EXTERNAL_FRAMEWORK]},
            # admission fair sharing, for the ClusterQueues that opt in (admissionScope):
            # usage sampled every second, halved every minute (a test's time scale)
            "admissionFairSharing": {"usageHalfLifeTime": "1m", "usageSamplingInterval": "1s"},
        }
        cfg = self.dir / "config.yaml"
        cfg.write_text(yaml.safe_dump(config))
        self.proc = subprocess.Popen(
            [str(exe), "--config", str(cfg), "--kubeconfig", str(self.cluster.kubeconfig),
             "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kueue exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kueue not ready after {timeout:.0f}s: {self.log_tail()}")
            time.sleep(0.3)
        hooks = webhook_configurations(f"https://127.0.0.1:{self.webhook_port}",
                                       (certs / "ca.crt").read_text())
        self._kubectl("apply", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": hooks}))
        return self

    def _ready(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz",
                                        timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self) -> str:
        """Kueue's /metrics, read as a Prometheus would: over HTTPS with a ServiceAccount's
        token that RBAC allows ``get`` on the ``/metrics`` URL (Kueue checks it with a
        TokenReview and a SubjectAccessReview). The certificate is not verified (a test's)."""
        import ssl
        import urllib.request

        if self._metrics_token is None:
            reader = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                      "metadata": {"name": METRICS_READER},
                      "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]}
            binding = {"apiVersion": "rbac.authorization.k8s.io/v1",
                       "kind": "ClusterRoleBinding", "metadata": {"name": METRICS_READER},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                   "kind": "ClusterRole", "name": METRICS_READER},
                       "subjects": [{"kind": "ServiceAccount", "name": METRICS_READER,
                                     "namespace": NAMESPACE}]}
            sa = {"apiVersion": "v1", "kind": "ServiceAccount",
                  "metadata": {"name": METRICS_READER, "namespace": NAMESPACE}}
            self._kubectl("apply", "-f", "-", input=json.dumps(
                {"apiVersion": "v1", "kind": "List", "items": [sa, reader, binding]}))
            self._metrics_token = self.cluster.service_account_token(NAMESPACE, METRICS_READER)
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        req = urllib.request.Request(f"https://127.0.0.1:{self.metrics_port}/metrics",
                                     headers={"Authorization": f"Bearer {self._metrics_token}"})
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return str(r.read().decode())

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            with contextlib.suppress(Exception):  # the cluster may be gone already
                self._kubectl("delete", kind, f"{WEBHOOK_PREFIX}-{kind}",
                              "--ignore-not-found")
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.dir / "certs", ignore_errors=True)


def dev_queues(cluster: LocalCluster, namespace: str, gpus: int = 16) -> None:
    """The dev cluster's queues: ResourceFlavor ``gpu`` (no node labels: any node), ClusterQueue
    ``dev`` covering CPU, memory and ``gpus`` GPUs (a workload of higher priority preempts),
    LocalQueue ``default`` in ``namespace``."""
    quota = {"cpu": "128", "memory": "1Ti", "nvidia.com/gpu": gpus}
    items = [
        {"apiVersion": f"{GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "gpu"},
         "spec": {}},
        {"apiVersion": f"{GROUP}/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "dev"},
         "spec": {"namespaceSelector": {},
                  "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{
             "coveredResources": list(quota),
             "flavors": [{"name": "gpu", "resources": [
                 {"name": k, "nominalQuota": v} for k, v in quota.items()]}]}]}},
        {"apiVersion": f"{GROUP}/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "default", "namespace": namespace},
         "spec": {"clusterQueue": "dev"}},
    ]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": items}))
