"""The operator's own kubeconfig / in-cluster loader (its image has no Kubernetes client)."""

from __future__ import annotations

import base64
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.operator import kubeconfig
from rlpacer.operator.kube import Credentials, KubeClient
from rlpacer.operator.kubeconfig import KubeconfigError

pytestmark = pytest.mark.unit

CA = b"-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n"
CERT = b"-----BEGIN CERTIFICATE-----\nCLIENT\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN PRIVATE KEY-----\nKEY\n-----END PRIVATE KEY-----\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write(path: Path, ctx: str, cluster: dict[str, Any], user: dict[str, Any] | None,
          current: str | None = None, name: str = "c") -> Path:
    doc: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "contexts": [{"name": ctx, "context": {"cluster": name,
                                               **({"user": name} if user is not None else {})}}],
        "users": [{"name": name, "user": user}] if user is not None else [],
    }
    if current is not None:
        doc["current-context"] = current
    path.write_text(yaml.safe_dump(doc))
    return path


def test_inline_data_and_token(tmp_path: Path) -> None:
    kc = write(tmp_path / "config", "dev",
               {"server": "https://10.0.0.1:6443/", "certificate-authority-data": b64(CA)},
               {"token": "abc", "client-certificate-data": b64(CERT),
                "client-key-data": b64(KEY)}, current="dev")
    c = Credentials.load(str(kc))
    assert c.server == "https://10.0.0.1:6443" and c.token == "abc" and not c.insecure
    assert c.ca_path and Path(c.ca_path).read_bytes() == CA
    assert c.cert_path and Path(c.cert_path).read_bytes() == CERT
    assert c.key_path and Path(c.key_path).read_bytes() == KEY
    # the key is readable by its owner only
    assert stat.S_IMODE(os.stat(c.key_path).st_mode) == 0o600


def test_matches_the_kubernetes_client(tmp_path: Path) -> None:
    """Differential: what the official client reads from the same file."""
    from kubernetes import config as kconfig
    from kubernetes.client import Configuration

    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "ca.crt").write_bytes(CA)
    kc = write(tmp_path / "config", "dev",
               {"server": "https://kube.example:443", "certificate-authority": "pki/ca.crt",
                "insecure-skip-tls-verify": False},
               {"token": "t0k", "client-certificate-data": b64(CERT),
                "client-key-data": b64(KEY)}, current="dev")
    ref = Configuration()
    kconfig.load_kube_config(config_file=str(kc), client_configuration=ref,
                             persist_config=False)
    c = Credentials.load(str(kc))
    assert c.server == ref.host
    assert Path(c.ca_path or "").read_bytes() == Path(ref.ssl_ca_cert).read_bytes() == CA
    assert Path(c.cert_path or "").read_bytes() == Path(ref.cert_file).read_bytes()
    assert Path(c.key_path or "").read_bytes() == Path(ref.key_file).read_bytes()
    header = ref.api_key.get("authorization") or ref.api_key.get("BearerToken")
    assert header.split(" ", 1)[-1] == c.token
    assert c.insecure == (not ref.verify_ssl)


def test_relative_paths_and_token_file(tmp_path: Path) -> None:
    d = tmp_path / "kube"
    d.mkdir()
    (d / "ca.crt").write_bytes(CA)
    (d / "tok").write_text("from-file\n")
    kc = write(d / "config", "x", {"server": "https://a:1", "certificate-authority": "ca.crt"},
               {"tokenFile": "tok"}, current="x")
    c = Credentials.load(str(kc))
    assert c.ca_path == str(d / "ca.crt")
    assert c.token == "from-file" and c.token_path == str(d / "tok")


def test_kubeconfig_env_merges_first_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = write(tmp_path / "a", "ctx-a", {"server": "https://first:1"}, {"token": "A"},
              current="ctx-b", name="shared")
    b = tmp_path / "b"
    b.write_text(yaml.safe_dump({
        "current-context": "ctx-a",
        "clusters": [{"name": "shared", "cluster": {"server": "https://second:2"}},
                     {"name": "bc", "cluster": {"server": "https://b:3"}}],
        "contexts": [{"name": "ctx-b", "context": {"cluster": "bc", "user": "shared"}}],
        "users": [{"name": "shared", "user": {"token": "B"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(a), str(tmp_path / "absent"), str(b)]))
    c = Credentials.load()
    # current-context from the first file (ctx-b, defined only in the second); user "shared"
    # from the first file that names it
    assert (c.server, c.token) == ("https://b:3", "A")


def test_in_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "ca.crt").write_bytes(CA)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    got = kubeconfig.in_cluster(tmp_path)
    assert got.server == "https://[fd00::1]:443" and got.token == "sa-token"
    assert got.token_path == str(tmp_path / "token") and got.ca_path == str(tmp_path / "ca.crt")
    # no kubeconfig anywhere and no pod: a clear error, not a connection to nowhere
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    with pytest.raises(KubeconfigError, match="--kubeconfig or set KUBECONFIG"):
        Credentials.load()


def _plugin(tmp_path: Path, ttl_s: float) -> Path:
    script = tmp_path / "plugin.py"
    script.write_text(f"""
import json, os, sys, time
from datetime import datetime, timezone
n_path = {str(tmp_path / 'calls')!r}
n = int(open(n_path).read()) + 1 if os.path.exists(n_path) else 1
open(n_path, "w").write(str(n))
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert info["spec"]["interactive"] is False, info
exp = datetime.fromtimestamp(time.time() + {ttl_s}, timezone.utc)
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential", "status": {{
    "token": os.environ["PREFIX"] + str(n) + sys.argv[1],
    "expirationTimestamp": exp.strftime("%Y-%m-%dT%H:%M:%SZ")}}}}))
""")
    return script


def test_exec_plugin_and_its_refresh(tmp_path: Path) -> None:
    script = _plugin(tmp_path, ttl_s=30)  # inside the refresh margin: due at once
    kc = write(tmp_path / "config", "eks", {"server": "https://eks:443"},
               {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1",
                         "command": sys.executable, "args": [str(script), "-x"],
                         "env": [{"name": "PREFIX", "value": "tok"}]}}, current="eks")
    c = Credentials.load(str(kc))
    assert c.token == "tok1-x" and c.token_expiry and c.token_expiry > time.time()
    # the client fetches it again before it expires, for every request's header
    headers = KubeClient(c)._headers()
    assert headers["Authorization"] == "Bearer tok2-x"
    # a credential far from expiry is not fetched again
    _plugin(tmp_path, ttl_s=3600)
    kubeconfig.refresh_exec(c)  # tok3, an hour to live
    assert KubeClient(c)._headers()["Authorization"] == "Bearer tok3-x"
    assert KubeClient(c)._headers()["Authorization"] == "Bearer tok3-x"
    assert (tmp_path / "calls").read_text() == "3"


def test_exec_plugin_failure_names_the_user(tmp_path: Path) -> None:
    kc = write(tmp_path / "config", "x", {"server": "https://a:1"},
               {"exec": {"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]}},
               current="x")
    with pytest.raises(KubeconfigError, match=r"user 'c'.*exited 3"):
        Credentials.load(str(kc))


@pytest.mark.parametrize(("cluster", "user", "current", "match"), [
    ({"server": "https://a:1"}, {"token": "t"}, None, "no current-context"),
    ({"server": "https://a:1"}, {"token": "t"}, "other", "current-context 'other'"),
    ({"server": ""}, {"token": "t"}, "x", r"clusters\[c\].cluster.server is empty"),
    ({"server": "https://a:1", "certificate-authority-data": "%%%"}, {}, "x",
     r"clusters\[c\].certificate-authority-data is not base64"),
    ({"server": "https://a:1", "certificate-authority": "missing.crt"}, {}, "x",
     r"certificate-authority: no such file"),
    ({"server": "https://a:1", "tls-server-name": "k"}, {}, "x", "tls-server-name"),
    ({"server": "https://a:1"}, {"auth-provider": {"name": "oidc"}}, "x",
     r"users\[c\].user.auth-provider \(oidc\).*kubelogin"),
    ({"server": "https://a:1"}, {"username": "u", "password": "p"}, "x", "basic auth"),
    ({"server": "https://a:1"}, {"client-certificate-data": b64(CERT)}, "x",
     "without its key"),
])
def test_errors_name_the_field(tmp_path: Path, cluster: dict[str, Any],
                               user: dict[str, Any], current: str | None, match: str) -> None:
    kc = write(tmp_path / "config", "x", cluster, user, current=current)
    with pytest.raises(KubeconfigError, match=match):
        Credentials.load(str(kc))


def test_a_missing_kubeconfig_file(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match="no such file"):
        Credentials.load(str(tmp_path / "nope"))


def test_no_user_is_anonymous(tmp_path: Path) -> None:
    kc = write(tmp_path / "config", "x", {"server": "http://127.0.0.1:8080"}, None, current="x")
    c = Credentials.load(str(kc))
    assert c.token is None and c.cert_path is None and KubeClient(c)._headers() == {}
    assert c.server == "http://127.0.0.1:8080"
