"""The operator's serving certificates: the step-report endpoint's TLS and generated test CAs.

A certificate folder holds ``tls.crt`` (the serving certificate, chain first), ``tls.key`` and
``ca.crt`` (the CA that signed ``tls.crt``: what the job pods verify the operator with). The
chart mounts one from the Secret of ``webhook.certs`` (Helm-generated, cert-manager or your
own); the same Service names serve webhooks and step reports.

* :class:`ServingCert` serves from a folder and follows renewals: :meth:`ServingCert.reload`
  re-reads the files when they change (the kubelet updates a mounted Secret in place), new
  handshakes then use the new certificate, and :meth:`ServingCert.ca_pem` is what the
  reconciler writes into each job's ConfigMap (key :data:`~rlpacer.api.contract.REPORT_CA_KEY`),
  so running drivers pick up a new CA with the mounted ConfigMap.
* :func:`generate` makes a CA and a certificate signed by it (``openssl``), for local runs
  without the chart and for tests. A proper CA and leaf, not one self-signed leaf: strict
  verifiers (Python 3.13's default ``VERIFY_X509_STRICT``) refuse a CA certificate used as a
  server certificate.
"""

from __future__ import annotations

import logging
import shutil
import ssl
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("rlpacer.operator.tls")

CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"


class CertError(RuntimeError):
    """A certificate folder the endpoint cannot serve from (named, with the fix)."""


def _is_ip(host: str) -> bool:
    return host.replace(".", "").isdigit() or ":" in host


def generate(cert_dir: Path, hostnames: Sequence[str], days: int = 365,
             ca_name: str = "rlpacer-local-ca") -> Path:
    """Write ``ca.crt`` (a new CA, its key ``ca.key``), and ``tls.crt``/``tls.key`` signed by it
    for ``hostnames`` (DNS names and IP addresses; the first is the subject) into ``cert_dir``.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise CertError(
            "generating a TLS certificate needs openssl on PATH: install it, or give a"
            " certificate folder (tls.crt, tls.key, ca.crt; the chart mounts one)")
    if not hostnames:
        raise CertError("generate: at least one hostname is needed")
    cert_dir.mkdir(parents=True, exist_ok=True)
    sans = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in hostnames)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        r = subprocess.run([openssl, *args], cwd=cert_dir, capture_output=True, text=True)
        if r.returncode != 0:
            raise CertError(f"openssl {args[0]} failed: {r.stderr.strip()[-500:]}")

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", CA, "-days", str(days),
        "-subj", f"/CN={ca_name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    (cert_dir / "leaf.ext").write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName={sans}\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n")
    run("req", "-new", *ec, "-keyout", KEY, "-out", "tls.csr", "-subj", f"/CN={hostnames[0]}")
    run("x509", "-req", "-in", "tls.csr", "-CA", CA, "-CAkey", "ca.key", "-CAcreateserial",
        "-out", CERT, "-days", str(days), "-extfile", "leaf.ext")
    for f in ("tls.csr", "leaf.ext", "ca.srl"):
        (cert_dir / f).unlink(missing_ok=True)
    (cert_dir / KEY).chmod(0o600)
    (cert_dir / "ca.key").chmod(0o600)
    return cert_dir


def generate_temporary(hostnames: Sequence[str], what: str) -> Path:
    """:func:`generate` into a new temporary folder (local runs), with a warning saying so."""
    d = generate(Path(tempfile.mkdtemp(prefix=f"rlpacer-{what}-")), hostnames)
    log.warning("%s: generated a CA and a serving certificate for %s in %s (local runs only:"
                " in a cluster the chart mounts one)", what, ", ".join(hostnames), d)
    return d


class ServingCert:
    """A server TLS context from ``cert_dir`` that follows the files (see the module doc)."""

    def __init__(self, cert_dir: str | Path, *, setting: str = "report_cert_dir") -> None:
        self.dir = Path(cert_dir)
        self.setting = setting
        missing = [f for f in (CERT, KEY, CA) if not (self.dir / f).is_file()]
        if missing:
            raise CertError(
                f"{setting}: {self.dir} has no {', '.join(missing)}: the folder must hold the"
                " serving certificate (tls.crt), its key (tls.key) and the CA that signed it"
                " (ca.crt; the job pods verify the operator with it)")
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._stamp: tuple[float, ...] = ()
        self._ca = ""
        self.reload()

    def _mtimes(self) -> tuple[float, ...]:
        return tuple((self.dir / f).stat().st_mtime_ns for f in (CERT, KEY, CA))

    def reload(self) -> bool:
        """Re-read the files if they changed since the last read; True when they did. A
        half-written renewal (a key that does not match) keeps the old certificate, logged."""
        try:
            stamp = self._mtimes()
        except OSError as e:
            log.warning("%s: cannot read %s (%s); serving the certificate read before",
                        self.setting, self.dir, e)
            return False
        if stamp == self._stamp:
            return False
        try:
            # Loaded into a fresh context first: a certificate whose key does not match (a
            # renewal written half) must not replace the served one (a failed load can leave
            # a context with the new certificate and the old key).
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                str(self.dir / CERT), str(self.dir / KEY))
            self.context.load_cert_chain(str(self.dir / CERT), str(self.dir / KEY))
            ca = (self.dir / CA).read_text()
        except (ssl.SSLError, OSError, ValueError) as e:
            if not self._stamp:
                raise CertError(f"{self.setting}: cannot load the certificate in {self.dir}:"
                                f" {e}") from None
            log.warning("%s: the certificate in %s does not load (%s); serving the one read"
                        " before", self.setting, self.dir, e)
            return False
        if "BEGIN CERTIFICATE" not in ca:
            raise CertError(f"{self.setting}: {self.dir / CA} holds no PEM certificate")
        first = not self._stamp
        self._stamp, self._ca = stamp, ca
        if not first:
            log.info("%s: re-read the renewed certificate in %s", self.setting, self.dir)
        return True

    def ca_pem(self) -> str:
        """The CA the job pods verify this endpoint with (PEM)."""
        return self._ca
