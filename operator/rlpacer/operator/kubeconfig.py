"""Where the operator's credentials come from: a kubeconfig, or the pod's service account.

The operator image carries no Kubernetes client library (the official one is 128 MB with its
dependencies, more than the rest of the operator together), so this module reads what the
operator needs itself, the way ``kubectl`` does:

* the file: ``--kubeconfig`` if given, else the files of ``$KUBECONFIG`` (merged, first one
  wins for each name and for ``current-context``), else ``~/.kube/config``; with none of
  them present, the in-cluster service account (``KUBERNETES_SERVICE_HOST``/``_PORT``, the
  mounted token and CA);
* the current context's cluster (``server``, ``certificate-authority[-data]``,
  ``insecure-skip-tls-verify``) and user (``token``, ``tokenFile``,
  ``client-certificate[-data]``, ``client-key[-data]``, or an ``exec`` credential plugin,
  as EKS, GKE and AKS kubeconfigs use, run again before its token expires).

Relative paths are relative to the kubeconfig file that names them. Inline ``*-data`` is
written to private temporary files (TLS libraries read certificates from files), removed at
exit. What it cannot do (``auth-provider``, basic auth, ``tls-server-name``, ``proxy-url``, a
missing context) is an error that
names the field.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

IN_CLUSTER_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
IN_CLUSTER_TOKEN = str(IN_CLUSTER_DIR / "token")

#: Seconds before an exec credential's expiry at which it is fetched again.
EXEC_REFRESH_MARGIN_S = 60.0


class KubeconfigError(Exception):
    """A kubeconfig the operator cannot use; the message names the file and the field."""


@dataclass
class ExecPlugin:
    """A ``users[].user.exec`` credential plugin (client.authentication.k8s.io)."""

    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    api_version: str = "client.authentication.k8s.io/v1"
    where: str = ""  # the user's name, for messages
    cwd: str | None = None

    def run(self) -> tuple[dict[str, Any], float | None]:
        """The plugin's ExecCredential ``status`` and when it expires (epoch seconds)."""
        info = {"apiVersion": self.api_version, "kind": "ExecCredential",
                "spec": {"interactive": False}}
        env = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": json.dumps(info)}
        try:
            out = subprocess.run(
                [self.command, *self.args], env=env, cwd=self.cwd, capture_output=True,
                text=True, timeout=60, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KubeconfigError(
                f"user {self.where!r}: exec credential plugin {self.command!r} could not run:"
                f" {e}") from e
        if out.returncode != 0:
            raise KubeconfigError(
                f"user {self.where!r}: exec credential plugin {self.command!r} exited"
                f" {out.returncode}: {out.stderr.strip()[-500:]}")
        try:
            cred = json.loads(out.stdout)
            status = cred["status"]
            if not isinstance(status, dict):
                raise TypeError("status is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise KubeconfigError(
                f"user {self.where!r}: exec credential plugin {self.command!r} printed no"
                f" ExecCredential with a status ({e})") from e
        expiry = None
        if status.get("expirationTimestamp"):
            ts = str(status["expirationTimestamp"]).replace("Z", "+00:00")
            expiry = datetime.fromisoformat(ts).timestamp()
        return status, expiry


@dataclass
class Loaded:
    """What :func:`load` found (the fields of ``kube.Credentials``)."""

    server: str
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    token: str | None = None
    token_path: str | None = None
    insecure: bool = False
    exec_plugin: ExecPlugin | None = None
    token_expiry: float | None = None


def load(kubeconfig: str | None = None) -> Loaded:
    """The credentials of ``kubeconfig``, or of ``$KUBECONFIG`` / ``~/.kube/config``, or the
    in-cluster service account when none of those files exists."""
    if kubeconfig:
        path = Path(kubeconfig).expanduser()
        if not path.is_file():
            raise KubeconfigError(f"kubeconfig {kubeconfig}: no such file")
        return from_files([path])
    env = os.environ.get("KUBECONFIG", "")
    paths = [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    if not paths:
        paths = [Path.home() / ".kube" / "config"]
    present = [p for p in paths if p.is_file()]
    if present:
        return from_files(present)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster()
    looked = ", ".join(str(p) for p in paths)
    raise KubeconfigError(
        f"no kubeconfig ({looked}) and not in a pod (KUBERNETES_SERVICE_HOST unset): pass"
        " --kubeconfig or set KUBECONFIG")


def in_cluster(directory: Path = IN_CLUSTER_DIR) -> Loaded:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise KubeconfigError("in-cluster: KUBERNETES_SERVICE_HOST is unset")
    token_path = directory / "token"
    if not token_path.is_file():
        raise KubeconfigError(
            f"in-cluster: no service account token at {token_path} (is"
            " automountServiceAccountToken false, with no projected token mounted there?)")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    ca = directory / "ca.crt"
    return Loaded(
        server=f"https://{host}:{port}",
        ca_path=str(ca) if ca.is_file() else None,
        token=token_path.read_text().strip(),
        token_path=str(token_path),
    )


def _named(doc: dict[str, Any], key: str, item: str, path: Path,
           into: dict[str, tuple[dict[str, Any], Path]]) -> None:
    for entry in doc.get(key) or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise KubeconfigError(f"{path}: every entry of {key} needs a name")
        body = entry.get(item) or {}
        if not isinstance(body, dict):
            raise KubeconfigError(f"{path}: {key}[{entry['name']}].{item} must be a mapping")
        into.setdefault(entry["name"], (body, path))  # the first file that names it wins


def from_files(paths: list[Path]) -> Loaded:
    clusters: dict[str, tuple[dict[str, Any], Path]] = {}
    users: dict[str, tuple[dict[str, Any], Path]] = {}
    contexts: dict[str, tuple[dict[str, Any], Path]] = {}
    current: str | None = None
    for path in paths:
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise KubeconfigError(f"kubeconfig {path}: cannot read it: {e}") from e
        if not isinstance(doc, dict):
            raise KubeconfigError(f"kubeconfig {path}: not a mapping")
        _named(doc, "clusters", "cluster", path, clusters)
        _named(doc, "users", "user", path, users)
        _named(doc, "contexts", "context", path, contexts)
        if current is None and doc.get("current-context"):
            current = str(doc["current-context"])
    files = ", ".join(str(p) for p in paths)
    if not current:
        raise KubeconfigError(
            f"kubeconfig {files}: no current-context (set one: kubectl config use-context)")
    if current not in contexts:
        raise KubeconfigError(f"kubeconfig {files}: current-context {current!r} is not among"
                              f" its contexts ({', '.join(sorted(contexts)) or 'none'})")
    ctx, _ = contexts[current]
    cname, uname = ctx.get("cluster"), ctx.get("user")
    if not cname or cname not in clusters:
        raise KubeconfigError(
            f"kubeconfig {files}: context {current!r} names cluster {cname!r}, which is not"
            " among its clusters")
    cluster, cpath = clusters[cname]
    server = str(cluster.get("server") or "").rstrip("/")
    if not server:
        raise KubeconfigError(f"kubeconfig {cpath}: clusters[{cname}].cluster.server is empty")
    for unsupported in ("tls-server-name", "proxy-url"):
        if cluster.get(unsupported):
            raise KubeconfigError(
                f"kubeconfig {cpath}: clusters[{cname}].cluster.{unsupported} is not supported"
                " by the operator: connect to the server's own name, without a proxy")
    out = Loaded(
        server=server,
        ca_path=_file_or_data(cluster, "certificate-authority", cpath, f"clusters[{cname}]"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )
    if not uname:
        return out  # anonymous
    if uname not in users:
        raise KubeconfigError(f"kubeconfig {files}: context {current!r} names user {uname!r},"
                              " which is not among its users")
    user, upath = users[uname]
    where = f"users[{uname}].user"
    if user.get("auth-provider"):
        name = (user["auth-provider"] or {}).get("name", "?")
        raise KubeconfigError(
            f"kubeconfig {upath}: {where}.auth-provider ({name}) is not supported (kubectl"
            " dropped it too): use an exec credential plugin (for OIDC: kubelogin)")
    if user.get("username") or user.get("password"):
        raise KubeconfigError(
            f"kubeconfig {upath}: {where}.username/password (basic auth) is not supported by"
            " Kubernetes since 1.19: use a token, a client certificate or an exec plugin")
    out.cert_path = _file_or_data(user, "client-certificate", upath, where)
    out.key_path = _file_or_data(user, "client-key", upath, where)
    if bool(out.cert_path) != bool(out.key_path):
        raise KubeconfigError(f"kubeconfig {upath}: {where} has a client certificate without"
                              " its key, or a key without its certificate: give both")
    if user.get("token"):
        out.token = str(user["token"])
    elif user.get("tokenFile"):
        tf = _resolve(str(user["tokenFile"]), upath)
        try:
            out.token = Path(tf).read_text().strip()
        except OSError as e:
            raise KubeconfigError(f"kubeconfig {upath}: {where}.tokenFile: {e}") from e
        out.token_path = tf
    elif user.get("exec"):
        ex = user["exec"]
        if not isinstance(ex, dict) or not ex.get("command"):
            raise KubeconfigError(f"kubeconfig {upath}: {where}.exec.command is missing")
        env_list = ex.get("env") or []
        out.exec_plugin = ExecPlugin(
            command=str(ex["command"]),
            args=[str(a) for a in ex.get("args") or []],
            env={str(e["name"]): str(e.get("value", "")) for e in env_list},
            api_version=str(ex.get("apiVersion") or "client.authentication.k8s.io/v1"),
            where=uname, cwd=str(upath.parent),
        )
        refresh_exec(out)
    return out


def refresh_exec(creds: Any) -> None:
    """Run ``creds.exec_plugin`` and take its token (or client certificate) and expiry."""
    status, expiry = creds.exec_plugin.run()
    if status.get("token"):
        creds.token = str(status["token"])
    elif status.get("clientCertificateData") and status.get("clientKeyData"):
        creds.cert_path = _private_file(str(status["clientCertificateData"]).encode())
        creds.key_path = _private_file(str(status["clientKeyData"]).encode())
    else:
        raise KubeconfigError(
            f"user {creds.exec_plugin.where!r}: exec credential plugin"
            f" {creds.exec_plugin.command!r} gave neither a token nor clientCertificateData"
            " with clientKeyData")
    creds.token_expiry = expiry


def exec_due(creds: Any, now: float | None = None) -> bool:
    """Whether an exec credential is to be fetched again (it expires within the margin)."""
    if creds.exec_plugin is None or creds.token_expiry is None:
        return False
    t = time.time() if now is None else now
    return bool(t >= creds.token_expiry - EXEC_REFRESH_MARGIN_S)


def _resolve(value: str, kubeconfig: Path) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (kubeconfig.parent / p))


def _file_or_data(body: dict[str, Any], key: str, path: Path, where: str) -> str | None:
    data = body.get(f"{key}-data")
    if data:
        try:
            raw = base64.b64decode(str(data), validate=True)
        except ValueError as e:
            raise KubeconfigError(
                f"kubeconfig {path}: {where}.{key}-data is not base64 ({e})") from e
        return _private_file(raw)
    if body.get(key):
        f = _resolve(str(body[key]), path)
        if not Path(f).is_file():
            raise KubeconfigError(f"kubeconfig {path}: {where}.{key}: no such file {f}")
        return f
    return None


_TEMP: list[str] = []


def _private_file(data: bytes) -> str:
    fd, name = tempfile.mkstemp(prefix="rlpacer-kube-", suffix=".pem")  # mode 0600
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if not _TEMP:
        atexit.register(_remove_temp)
    _TEMP.append(name)
    return name


def _remove_temp() -> None:
    for name in _TEMP:
        with contextlib.suppress(OSError):
            os.unlink(name)
    _TEMP.clear()
