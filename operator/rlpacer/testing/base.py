"""What the local control plane's launcher (``rlpacer.testing.cluster``) and its real node
(``rlpacer.testing.node``) share: the launcher's errors, where the checkout, the cache and the
built binaries are, free ports, and a stdlib HTTP client for the API server.

It imports no other module of ``rlpacer.testing``, so the launcher, the real node and the
project's images (``rlpacer.testing.containers``) import it without an import cycle; the
launcher re-exports every public name here (``from rlpacer.testing.cluster import repo_root``
keeps working).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SETUP_COMMAND = "bash scripts/setup.sh"
BUILD_COMMAND = "bash hack/build-binaries.sh"


# --------------------------------------------------------------------------------------------
# errors


class ClusterError(RuntimeError):
    """Base class of the launcher's errors."""


class MissingBinaryError(ClusterError):
    """A binary the control plane needs is not built."""


class PortInUseError(ClusterError):
    """A port the control plane needs is taken."""


class ClusterStartError(ClusterError):
    """A component failed to start or become ready (the message carries its log's tail)."""


# --------------------------------------------------------------------------------------------
# locations and versions


def repo_root() -> Path:
    """The checkout this module lives in (operator/rlpacer/testing/base.py -> ../../..)."""
    return Path(__file__).resolve().parents[3]


def cache_dir() -> Path:
    return Path(os.environ.get("RLPACER_CACHE") or Path.home() / ".cache" / "rlpacer")


def bin_dir() -> Path:
    return Path(os.environ.get("RLPACER_BIN_DIR") or cache_dir() / "bin")


def pinned_versions() -> dict[str, str]:
    """KEY=VALUE pairs of hack/versions.env (empty if the file is not there)."""
    path = repo_root() / "hack" / "versions.env"
    out: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip().strip("\"'")
    return out


def find_binary(name: str, directory: Path | None = None) -> Path:
    """Path of a built binary, or MissingBinaryError saying how to build it."""
    d = directory or bin_dir()
    p = d / name
    if p.is_file() and os.access(p, os.X_OK):
        _check_stamp(name, d)
        return p
    raise MissingBinaryError(
        f"{name} not found at {p}. The local Kubernetes control plane's binaries (etcd, "
        f"kube-apiserver, kube-controller-manager, kube-scheduler, kwok, helm; kubelet and "
        f"kube-proxy for a real node), Prometheus' (promtool, prometheus) and Kueue's "
        f"are built at the versions pinned in hack/versions.env by `{SETUP_COMMAND}` "
        f"(or only this one: `{BUILD_COMMAND} {name}`; a cold build takes a "
        f"while). Set RLPACER_BIN_DIR or RLPACER_CACHE if they live elsewhere."
    )


_VERSION_KEYS = {
    "etcd": "ETCD_VERSION",
    "kube-apiserver": "KUBERNETES_VERSION",
    "kube-controller-manager": "KUBERNETES_VERSION",
    "kube-scheduler": "KUBERNETES_VERSION",
    "kubelet": "KUBERNETES_VERSION",
    "kube-proxy": "KUBERNETES_VERSION",
    "coredns": "COREDNS_VERSION",
    "kwok": "KWOK_VERSION",
    "helm": "HELM_VERSION",
    "promtool": "PROMETHEUS_VERSION",
    "prometheus": "PROMETHEUS_VERSION",
    "kueue": "KUEUE_VERSION",
}


def _check_stamp(name: str, d: Path) -> None:
    """A binary built for another pinned version (hack/versions.env was bumped) is stale."""
    stamp = d / f".{name}.stamp"
    want = pinned_versions().get(_VERSION_KEYS.get(name, ""))
    if not want or not stamp.is_file():
        return  # built elsewhere (RLPACER_BIN_DIR) or no versions file: trust it
    fields = stamp.read_text().split()
    if len(fields) >= 2 and fields[1] != want:
        raise MissingBinaryError(
            f"{name} in {d} was built at {fields[1]}, but hack/versions.env pins {want}: "
            f"rebuild with `{SETUP_COMMAND}` (or `{BUILD_COMMAND} {name}`)."
        )


def find_kubectl() -> Path:
    env = os.environ.get("RLPACER_KUBECTL")
    found = (
        env
        or shutil.which("kubectl")
        or ("/usr/bin/kubectl" if Path("/usr/bin/kubectl").exists() else None)
    )
    if not found:
        raise MissingBinaryError(
            "kubectl not found on PATH (expected the machine's preinstalled kubectl, e.g. "
            "/usr/bin/kubectl); install it or set RLPACER_KUBECTL"
        )
    return Path(found)


# --------------------------------------------------------------------------------------------
# ports


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_port_free(port: int, what: str) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
    except OSError as e:
        raise PortInUseError(
            f"port {port} on 127.0.0.1, wanted for {what}, is already in use ({e.strerror}). "
            f"Another local cluster may be running (`python -m rlpacer.testing.cluster down`), "
            f"or choose another port (omit it to get a free one)."
        ) from None
    finally:
        s.close()


# --------------------------------------------------------------------------------------------
# HTTP to the API server (stdlib only, so the launcher needs no client library)


class ApiError(ClusterError):
    def __init__(self, status: int, body: Any, method: str, path: str) -> None:
        msg = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{method} {path}: HTTP {status}: {msg}")
        self.status = status
        self.body = body


class _Http:
    def __init__(
        self,
        server: str,
        ca_file: Path | None,
        cert: tuple[Path, Path] | None = None,
        token: str | None = None,
        verify: bool = True,
    ) -> None:
        self.server = server.rstrip("/")
        ctx = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        if not verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if cert:
            ctx.load_cert_chain(str(cert[0]), str(cert[1]))
        self.ctx = ctx
        self.token = token

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float = 10.0,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        data = (
            None
            if body is None
            else (body if isinstance(body, bytes) else json.dumps(body).encode())
        )
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            parsed: Any = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        return status, parsed

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        ok: Sequence[int] = (200, 201, 202),
        **kw: Any,
    ) -> Any:
        status, parsed = self.request(method, path, body, **kw)
        if status not in ok:
            raise ApiError(status, parsed, method, path)
        return parsed
