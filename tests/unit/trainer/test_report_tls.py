"""The driver's side of TLS step reports: the operator's CA verifies, any other CA fails fast
with a message that names the CA file, and a renewed certificate is followed on both sides."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rlpacer.operator import tls
from rlpacer.testing.jsonhttp import JSONHandler
from rlpacer_trainer.controller_client import HTTPController, ReportTLSError

pytestmark = pytest.mark.unit

PLAN = {"step": 3, "groupSize": 8, "roundKind": "Short", "lambda": 0.1,
        "rollout": {"desiredReplicas": 1, "readyReplicas": 1, "state": "Ready"}}


class _Plan(JSONHandler):
    def do_GET(self) -> None:
        self.server.gets += 1  # type: ignore[attr-defined]
        self.send_json(200, PLAN)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("certs")
    return {"op": tls.generate(root / "op", ["127.0.0.1", "localhost"]),
            "other": tls.generate(root / "other", ["127.0.0.1"], ca_name="another-ca")}


@pytest.fixture
def served(certs: dict[str, Path], tmp_path: Path) -> Iterator[tuple[Any, tls.ServingCert]]:
    live = tmp_path / "live"
    shutil.copytree(certs["op"], live)
    cert = tls.ServingCert(live)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Plan)
    srv.gets = 0  # type: ignore[attr-defined]
    srv.socket = cert.context.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, cert
    srv.shutdown()


def _url(srv: Any) -> str:
    return f"https://127.0.0.1:{srv.server_address[1]}"


def test_the_operators_ca_verifies(served: tuple[Any, tls.ServingCert],
                                   certs: dict[str, Path]) -> None:
    srv, _ = served
    ctl = HTTPController(_url(srv), "ns", "job", "tok", ca_file=str(certs["op"] / "ca.crt"))
    assert ctl.plan().step == 3 and srv.gets == 1


def test_another_ca_fails_with_the_file_named(served: tuple[Any, tls.ServingCert],
                                              certs: dict[str, Path]) -> None:
    srv, _ = served
    wrong = str(certs["other"] / "ca.crt")
    ctl = HTTPController(_url(srv), "ns", "job", "tok", ca_file=wrong, retries=1,
                         backoff_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(ReportTLSError) as e:
        ctl.plan()
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert wrong in msg and "RLPACER_REPORT_CA_FILE" in msg and "report-ca.crt" in msg
    assert "certificate verify failed" in msg
    assert srv.gets == 0  # no request was answered: the token never left the client
    # ... and without a CA file the system's CAs do not know the operator's CA either
    with pytest.raises(ReportTLSError, match="system's CAs"):
        HTTPController(_url(srv), "ns", "job", "tok", retries=0).plan()


def test_a_missing_ca_file_is_named(served: tuple[Any, tls.ServingCert], tmp_path: Path) -> None:
    srv, _ = served
    with pytest.raises(ReportTLSError, match=r"cannot load the step-report CA .*nope\.crt"):
        HTTPController(_url(srv), "ns", "job", "tok", ca_file=str(tmp_path / "nope.crt"),
                       retries=0).plan()


def test_a_renewed_certificate_is_followed_by_server_and_driver(
        served: tuple[Any, tls.ServingCert], tmp_path: Path) -> None:
    """The operator re-reads renewed files; the driver re-reads its CA file on every call
    (the kubelet updates the mounted ConfigMap), so neither needs a restart."""
    srv, cert = served
    ca_file = tmp_path / "report-ca.crt"
    ca_file.write_text(cert.ca_pem())
    ctl = HTTPController(_url(srv), "ns", "job", "tok", ca_file=str(ca_file), retries=0)
    assert ctl.plan().step == 3
    assert not cert.reload()  # nothing changed
    renewed = tls.generate(tmp_path / "renewed", ["127.0.0.1"], ca_name="renewed-ca")
    for f in ("tls.crt", "tls.key", "ca.crt"):
        shutil.copy(renewed / f, cert.dir / f)
    assert cert.reload() and "BEGIN CERTIFICATE" in cert.ca_pem()
    assert cert.ca_pem() == (renewed / "ca.crt").read_text()
    with pytest.raises(ReportTLSError):  # the driver still holds the old CA
        ctl.plan()
    ca_file.write_text(cert.ca_pem())  # the ConfigMap carries the new one
    assert ctl.plan().step == 3


def test_a_half_written_renewal_keeps_the_old_certificate(
        served: tuple[Any, tls.ServingCert], certs: dict[str, Path]) -> None:
    srv, cert = served
    before = cert.ca_pem()
    other = tls.generate(cert.dir.parent / "half", ["127.0.0.1"])
    shutil.copy(other / "tls.crt", cert.dir / "tls.crt")  # the new certificate, the old key
    assert not cert.reload() and cert.ca_pem() == before
    ctl = HTTPController(_url(srv), "ns", "job", "tok", ca_file=str(certs["op"] / "ca.crt"))
    assert ctl.plan().step == 3


def test_a_folder_without_its_ca_is_refused(certs: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "noca"
    shutil.copytree(certs["op"], d)
    (d / "ca.crt").unlink()
    with pytest.raises(tls.CertError, match=r"report_cert_dir: .*noca has no ca.crt"):
        tls.ServingCert(d)


def test_plain_http_urls_need_no_ca() -> None:
    ctl = HTTPController("http://127.0.0.1:1", "ns", "job", "tok")
    assert ctl._context() is None
