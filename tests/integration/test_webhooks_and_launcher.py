"""Admission webhooks reached by URL on loopback (as the operator's policy webhook is in tests),
helm v3 against the cluster, and the launcher's own guarantees (clear errors, never skips)."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from rlpacer.testing import LocalCluster, MissingBinaryError, PortInUseError
from rlpacer.testing.cluster import ENV_KUBECONFIG, repo_root

pytestmark = pytest.mark.integration


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        req = review["request"]
        obj = req["object"]
        resp: dict[str, Any] = {"uid": req["uid"], "allowed": True}
        path = self.path.split("?", 1)[0]  # the API server appends ?timeout=...
        if path == "/validate" and "forbidden" in (obj.get("data") or {}):
            resp = {
                "uid": req["uid"],
                "allowed": False,
                "status": {"code": 403, "message": "configmaps may not carry the key 'forbidden'"},
            }
        elif path == "/mutate":
            patch = [
                {
                    "op": "add",
                    "path": "/metadata/labels",
                    "value": {
                        **(obj["metadata"].get("labels") or {}),
                        "mutated-by": "test-webhook",
                    },
                }
            ]
            resp.update(
                patchType="JSONPatch", patch=base64.b64encode(json.dumps(patch).encode()).decode()
            )
        body = json.dumps(
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def webhook_server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """An HTTPS admission webhook on 127.0.0.1; yields (base URL, caBundle)."""
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "wh.key",
            "-out",
            "wh.crt",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "wh.crt", tmp_path / "wh.key")
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield (
            f"https://127.0.0.1:{srv.server_address[1]}",
            base64.b64encode((tmp_path / "wh.crt").read_bytes()).decode(),
        )
    finally:
        srv.shutdown()


def test_admission_webhooks_by_loopback_url(
    cluster: LocalCluster, namespace: str, webhook_server: tuple[str, str]
) -> None:
    url, ca = webhook_server
    adm = client.AdmissionregistrationV1Api(cluster.api_client())
    common: dict[str, Any] = {
        "rules": [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": ["CREATE"],
                "resources": ["configmaps"],
            }
        ],
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "objectSelector": {"matchLabels": {"webhook-test": "yes"}},
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 5,
    }
    name = f"{namespace}-wh"
    adm.create_validating_webhook_configuration(
        {
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "validate.test.rlpacer.io",
                    "clientConfig": {"url": f"{url}/validate", "caBundle": ca},
                    **common,
                }
            ],
        }
    )
    adm.create_mutating_webhook_configuration(
        {
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "mutate.test.rlpacer.io",
                    "clientConfig": {"url": f"{url}/mutate", "caBundle": ca},
                    **common,
                }
            ],
        }
    )
    core = client.CoreV1Api(cluster.api_client())
    try:

        def cm(n: str, data: dict[str, str]) -> dict[str, Any]:
            return {"metadata": {"name": n, "labels": {"webhook-test": "yes"}}, "data": data}

        # Webhook configurations take effect asynchronously: wait for the mutation to show.
        def mutated() -> bool:
            n = f"probe-{os.urandom(3).hex()}"
            got = core.create_namespaced_config_map(namespace, cm(n, {"a": "b"}))
            return (got.metadata.labels or {}).get("mutated-by") == "test-webhook"

        cluster.wait_for(mutated, 30, "the mutating webhook to be called")
        with pytest.raises(ApiException) as ei:
            core.create_namespaced_config_map(namespace, cm("denied", {"forbidden": "x"}))
        assert ei.value.status == 403
        msg = json.loads(ei.value.body)["message"]
        assert 'admission webhook "validate.test.rlpacer.io" denied the request' in msg, msg
        assert "configmaps may not carry the key 'forbidden'" in msg
    finally:
        adm.delete_validating_webhook_configuration(name)
        adm.delete_mutating_webhook_configuration(name)


def test_helm_installs_and_uninstalls_a_chart(
    cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        "apiVersion: v2\nname: tiny\nversion: 0.1.0\nappVersion: '1.0'\n"
    )
    (chart / "values.yaml").write_text("greeting: hello\nreplicas: 2\n")
    (chart / "templates" / "cm.yaml").write_text(
        textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata:
          name: {{ .Release.Name }}-cfg
        data:
          greeting: {{ .Values.greeting | quote }}
        """)
    )
    (chart / "templates" / "deploy.yaml").write_text(
        textwrap.dedent("""\
        apiVersion: apps/v1
        kind: Deployment
        metadata:
          name: {{ .Release.Name }}-app
        spec:
          replicas: {{ .Values.replicas }}
          selector:
            matchLabels: {app: {{ .Release.Name }}}
          template:
            metadata:
              labels: {app: {{ .Release.Name }}}
            spec:
              containers:
              - name: app
                image: example.invalid/app:1
        """)
    )
    assert "v3." in cluster.helm("version", "--short").stdout
    cluster.helm("lint", str(chart))
    # --wait: helm polls until the Deployment is available, which needs scheduler + KWOK.
    cluster.helm(
        "install",
        "rel",
        str(chart),
        "-n",
        namespace,
        "--set",
        "greeting=hi",
        "--wait",
        "--timeout",
        "90s",
    )
    core = client.CoreV1Api(cluster.api_client())
    assert core.read_namespaced_config_map("rel-cfg", namespace).data == {"greeting": "hi"}
    releases = json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("rel", "deployed")]
    dep = client.AppsV1Api(cluster.api_client()).read_namespaced_deployment("rel-app", namespace)
    assert dep.status.available_replicas == 2

    cluster.helm("uninstall", "rel", "-n", namespace, "--wait", "--timeout", "60s")
    assert json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout) == []
    with pytest.raises(ApiException) as ei:
        core.read_namespaced_config_map("rel-cfg", namespace)
    assert ei.value.status == 404


# ---- the launcher's own guarantees (no running cluster needed) -------------------------------


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(MissingBinaryError) as ei:
        LocalCluster(tmp_path / "data", binaries=tmp_path / "empty-bin").start()
    msg = str(ei.value)
    assert "etcd not found at" in msg and "bash scripts/setup.sh" in msg
    assert not list((tmp_path / "data").glob("logs/*"))  # nothing was started


def test_missing_binary_fails_tests_and_never_skips(tmp_path: Path) -> None:
    test_file = tmp_path / "test_needs_cluster.py"
    test_file.write_text("def test_x(cluster):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != ENV_KUBECONFIG}
    env["RLPACER_BIN_DIR"] = str(tmp_path / "no-binaries-here")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "rlpacer.testing.pytest_plugin",
            "-q",
            "-rA",
            "--rootdir",
            str(tmp_path),
            "-c",
            os.devnull,
            str(test_file),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "kube-apiserver not found" in out or "etcd not found" in out, out
    assert "bash scripts/setup.sh" in out
    assert "skipped" not in out.lower() and re.search(r"\b1 error\b", out), out


def test_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        with pytest.raises(PortInUseError) as ei:
            LocalCluster(tmp_path, ports={"apiserver": port}).start()
        assert f"port {port}" in str(ei.value) and "kube-apiserver" in str(ei.value)
    finally:
        s.close()


def test_versions_file_pins_every_binary() -> None:
    text = (repo_root() / "hack" / "versions.env").read_text()
    for key in (
        "KUBERNETES_VERSION=v1.33.",
        "ETCD_VERSION=v3.5.",
        "KWOK_VERSION=",
        "HELM_VERSION=v3.",
        "PROMETHEUS_VERSION=v0.3",  # Prometheus 3.x's module versions
        "COREDNS_VERSION=v1.",  # the real node's DNS (kubelet, kube-proxy: KUBERNETES_VERSION)
    ):
        assert key in text


def test_binary_built_for_another_version_is_a_clear_error(tmp_path: Path) -> None:
    from rlpacer.testing.cluster import find_binary

    exe = tmp_path / "kube-apiserver"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (tmp_path / ".kube-apiserver.stamp").write_text("kube-apiserver v1.0.0 toolchain=local rev=1\n")
    with pytest.raises(MissingBinaryError, match=r"built at v1\.0\.0, but hack/versions.env pins"):
        find_binary("kube-apiserver", tmp_path)
