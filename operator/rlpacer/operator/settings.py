"""The operator's configuration: one documented pydantic object, from env and flags.

Every field reads ``RLPACER_OPERATOR_<FIELD>`` from the environment (the Helm chart sets
these), and ``rlpacer operator --<field>`` overrides it. Lists are comma-separated in env; a
list flag may be repeated, each comma-separated too (``--namespaces a,b --namespaces c``).
Lists of objects (the ``job_*`` NetworkPolicy fields) are one JSON array, in env and flag.
Invalid values fail at start with the field named.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlpacer.operator.builders import JobNetwork

ENV_PREFIX = "RLPACER_OPERATOR_"


class OperatorSettings(BaseModel):
    """Configuration of one operator process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespaces: list[str] = Field(
        default_factory=list,
        description="Namespaces to watch; empty watches the whole cluster.",
    )
    kubeconfig: str | None = Field(
        default=None,
        description="Kubeconfig file; unset uses KUBECONFIG, then in-cluster credentials.",
    )
    report_host: str = Field(default="0.0.0.0", description="Listen address of step reports.")
    report_port: int = Field(default=8080, ge=0, le=65535, description="Step-report port (0: any).")
    report_url: str | None = Field(
        default=None,
        description=(
            "Base URL the pods use to reach the step-report endpoint (RLPACER_REPORT_URL);"
            " default https://<service_name>.<operator_namespace>.svc:<report_port> (http://"
            " with report_insecure_http)."
        ),
    )
    report_cert_dir: str | None = Field(
        default=None,
        description=(
            "Folder with tls.crt, tls.key and ca.crt: step reports are served over TLS with"
            " this certificate (re-read when the files change) and every job's driver"
            " verifies it with ca.crt. Unset: a CA and certificate are generated at start"
            " for the Service's names, the report URL's host and 127.0.0.1 (local runs)."
        ),
    )
    report_insecure_http: bool = Field(
        default=False,
        description=(
            "Serve step reports over plain HTTP (bearer tokens in clear text): local runs"
            " only; the chart sets it only with operator.reportTLS=false."
        ),
    )
    report_rate_per_second: float = Field(
        default=20.0, ge=0,
        description=(
            "Step-report requests (reports and plan reads) each job may make per second on"
            " average (a token bucket per job; a driver makes about one per step); over it:"
            " 429 with Retry-After. 0: unlimited."
        ),
    )
    report_burst: int = Field(
        default=50, ge=1, description="Requests a job may make at once above the rate."
    )
    http_header_timeout_seconds: float = Field(
        default=10.0, gt=0, le=3600,
        description=(
            "A client of the step-report and metrics servers must finish its TLS handshake,"
            " and then send a request's headers, within this many seconds each (the next"
            " request's within this long of the last answer); else the connection is closed."
        ),
    )
    report_body_timeout_seconds: float = Field(
        default=30.0, gt=0, le=3600,
        description=(
            "A step report's body must arrive within this many seconds of its headers; else"
            " 408 RequestTimeout and the connection is closed."
        ),
    )
    report_write_timeout_seconds: float = Field(
        default=5.0, gt=0, le=3600,
        description=(
            "A step report (or plan read) whose state the API server has not returned or"
            " confirmed written within this many seconds (it, or its etcd, stalled) is"
            " answered 503 with Retry-After, and the driver sends the same report again (it"
            " is idempotent). Keep it below lease_duration_seconds: a replica that cannot"
            " renew its Lease gives up and closes its connections after that long."
        ),
    )
    metrics_host: str = Field(default="0.0.0.0", description="Listen address of /metrics.")
    metrics_port: int = Field(
        default=9090, ge=0, le=65535,
        description="Port of /metrics, /healthz and /readyz (0: any).",
    )
    service_name: str = Field(default="rlpacer-operator", description="The operator's Service.")
    operator_namespace: str = Field(
        default_factory=lambda: os.environ.get("POD_NAMESPACE", "rlpacer-system"),
        description="Namespace the operator runs in (its Lease lives there).",
    )
    leader_election: bool = Field(
        default=True,
        description="Act only while holding the Lease (two replicas never act at once).",
    )
    lease_name: str = Field(default="rlpacer-operator", description="Name of the Lease.")
    lease_duration_seconds: float = Field(
        default=15.0, gt=0, description="A leader silent this long is replaced."
    )
    lease_renew_seconds: float = Field(default=5.0, gt=0, description="Renewal period.")
    lease_retry_seconds: float = Field(default=2.0, gt=0, description="Standby poll period.")
    identity: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}",
        description="This replica's identity in the Lease.",
    )
    field_manager: str = Field(
        default="rlpacer-operator", description="Field manager of every server-side apply."
    )
    resync_seconds: float = Field(
        default=30.0, gt=0,
        description=(
            "Each job is reconciled at least this often (and on every child event); such a"
            " pass reads from the API server only what the watches say changed."
        ),
    )
    reapply_seconds: float = Field(
        default=3600.0, gt=0,
        description=(
            "About this often (jittered by up to a fifth) a job's pass is a full one: it reads"
            " the job and its children again and re-applies every child (the safety net of"
            " the watches). A child deleted, or a ConfigMap, Service or StatefulSet spec"
            " changed by someone else, is applied again on the next pass (its watch event)."
        ),
    )
    finished_grace_seconds: float = Field(
        default=0.0, ge=0, description="Extra wait before ttlSecondsAfterFinished deletion."
    )
    policy_cache_seconds: float = Field(
        default=10.0, gt=0,
        description=(
            "A namespace's RLTrainingPolicies are re-read for run-time enforcement at most"
            " this often (a policy change binds running jobs within it)."
        ),
    )
    webhook_enabled: bool = Field(
        default=False, description="Serve admission webhooks (policy; issue 6)."
    )
    webhook_host: str = Field(default="0.0.0.0", description="Webhook listen address.")
    webhook_port: int = Field(default=9443, ge=0, le=65535, description="Webhook port.")
    webhook_url: str | None = Field(
        default=None, description="URL the API server uses for webhooks (tests: loopback)."
    )
    webhook_cert_dir: str | None = Field(
        default=None,
        description="Folder with tls.crt/tls.key (ca.crt) for webhooks; unset: self-signed.",
    )
    log_level: str = Field(default="INFO", description="Python logging level.")
    job_network_policy: bool = Field(
        default=False,
        description=(
            "Give each job NetworkPolicies (enforced only by a CNI that enforces them): its"
            " pods accept traffic only from the same job's pods and send only to the same job's"
            " pods and DNS (port 53), the driver"
            " also to the step-report endpoint (job_report_to); job_egress widens the egress."
            " The operator needs permission on networking.k8s.io networkpolicies."
        ),
    )
    kueue: bool = Field(
        default=False,
        description=(
            "Watch Kueue's Workloads (kueue.x-k8s.io v1beta2, the job's own, by label) so that"
            " an admission, an eviction or a long round's grant reaches its job at once, and"
            " look at a queued job's Workloads every 30 s besides; off (or Kueue's API not"
            " served when the operator started: restart it after installing Kueue), they are"
            " looked at every 2 s. Jobs may name a Kueue queue either way. Needs list and"
            " watch on workloads (the chart's kueue.enabled)."
        ),
    )
    job_report_to: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "NetworkPolicyPeers (JSON array) a job's driver may send step reports to, on the"
            " report port and the report URL's port; empty: any address on those ports."
        ),
    )
    job_egress: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "NetworkPolicyEgressRules (JSON array, each with `to` and/or `ports`) added for"
            " every pod of every job, e.g. a model store or an experiment tracker."
        ),
    )

    @model_validator(mode="after")
    def _network(self) -> OperatorSettings:
        for name, keys in (("job_report_to", _PEER_KEYS), ("job_egress", _EGRESS_KEYS)):
            for i, item in enumerate(getattr(self, name)):
                wrong = sorted(set(item) - keys)
                if not item or wrong:
                    raise ValueError(
                        f"{name}[{i}]: {json.dumps(item)} is not a NetworkPolicy"
                        f" {'peer' if keys is _PEER_KEYS else 'egress rule'}"
                        + (f" (unknown: {', '.join(wrong)})" if wrong else " (empty)")
                        + f"; give an object with {' and/or '.join(sorted(keys))}")
        for i, rule in enumerate(self.job_egress):
            for j, peer in enumerate(rule.get("to") or []):
                if not isinstance(peer, dict) or not peer or set(peer) - _PEER_KEYS:
                    raise ValueError(
                        f"job_egress[{i}].to[{j}]: {json.dumps(peer)} is not a NetworkPolicy"
                        f" peer; give an object with {' and/or '.join(sorted(_PEER_KEYS))}")
        return self

    def job_network(self) -> JobNetwork | None:
        """What :func:`rlpacer.operator.builders.network_policies` builds from (None: no
        policies)."""
        if not self.job_network_policy:
            return None
        from urllib.parse import urlsplit

        url = urlsplit(self.pod_report_url())
        ports = [p for p in (self.report_port, url.port or (443 if url.scheme == "https"
                                                             else 80)) if p]
        return JobNetwork(
            report_ports=tuple(dict.fromkeys(ports)),
            report_to=tuple(self.job_report_to),
            egress=tuple(self.job_egress),
        )

    @model_validator(mode="after")
    def _lease(self) -> OperatorSettings:
        if self.lease_renew_seconds >= self.lease_duration_seconds:
            raise ValueError("lease_renew_seconds must be < lease_duration_seconds")
        return self

    @model_validator(mode="after")
    def _report_tls(self) -> OperatorSettings:
        if self.report_insecure_http and self.report_cert_dir:
            raise ValueError(
                "report_cert_dir and report_insecure_http exclude each other: unset one"
                " (TLS with that certificate, or plain HTTP for local runs)")
        if self.report_url:
            scheme = self.report_url.split("://", 1)[0].lower() if "://" in self.report_url \
                else ""
            want = "http" if self.report_insecure_http else "https"
            if scheme != want:
                raise ValueError(
                    f"report_url {self.report_url!r} must start with {want}:// (step reports"
                    f" are served over {'plain HTTP' if want == 'http' else 'TLS'}; "
                    + ("unset report_insecure_http for TLS)" if want == "http"
                       else "set report_insecure_http for plain HTTP, local runs only)"))
        return self

    def report_hostnames(self) -> list[str]:
        """Names a generated report certificate covers: the Service's, the report URL's host
        and loopback."""
        from urllib.parse import urlsplit

        svc, ns = self.service_name, self.operator_namespace
        names = [f"{svc}.{ns}.svc", svc, f"{svc}.{ns}", f"{svc}.{ns}.svc.cluster.local"]
        host = urlsplit(self.report_url).hostname if self.report_url else None
        for h in (host, "127.0.0.1", "localhost"):
            if h and h not in names:
                names.append(h)
        return names

    def pod_report_url(self) -> str:
        if self.report_url:
            return self.report_url.rstrip("/")
        scheme = "http" if self.report_insecure_http else "https"
        return (
            f"{scheme}://{self.service_name}.{self.operator_namespace}.svc:{self.report_port}"
        )

    @classmethod
    def load(
        cls, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
    ) -> OperatorSettings:
        """Settings from ``env`` (default ``os.environ``) then ``overrides`` (flags)."""
        env = os.environ if env is None else env
        raw: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            key = ENV_PREFIX + name.upper()
            if key in env:
                value: Any = env[key]
                if field.annotation == list[str]:
                    value = [v.strip() for v in value.split(",") if v.strip()]
                elif field.annotation == list[dict[str, Any]]:
                    value = _json_list(key, value)
                raw[name] = value
        for k, v in (overrides or {}).items():
            if v is not None:
                spec = cls.model_fields.get(k)
                if spec is not None and spec.annotation == list[dict[str, Any]]:
                    v = _json_list("--" + k.replace("_", "-"), v)
                elif isinstance(v, list):  # a repeated flag; each may list several, too
                    v = [x.strip() for item in v for x in str(item).split(",") if x.strip()]
                raw[k] = v
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]
            raise SystemExit("invalid operator settings:\n" + "\n".join(lines)) from None


_PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})
_EGRESS_KEYS = frozenset({"to", "ports"})


def _json_list(where: str, value: Any) -> Any:
    """A JSON array from env or a flag (a flag's value is a string, or a string per repeat:
    the last wins); anything else is left to the model's validation, which names the field."""
    if isinstance(value, list):
        value = value[-1] if value else "[]"
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value) if value.strip() else []
    except json.JSONDecodeError as e:
        raise SystemExit(
            f"invalid operator settings:\n  {where}: not JSON ({e.msg} at character {e.pos});"
            " give a JSON array, e.g. [{\"ipBlock\": {\"cidr\": \"10.0.0.0/8\"}}]") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per settings field (overrides the env)."""
    for name, field in OperatorSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = f"{field.description} (env {ENV_PREFIX}{name.upper()})"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_)
        elif field.annotation == list[str]:
            parser.add_argument(flag, dest=name, default=None, action="append", help=help_)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_)


def from_args(args: argparse.Namespace) -> OperatorSettings:
    overrides = {
        name: getattr(args, name) for name in OperatorSettings.model_fields if hasattr(args, name)
    }
    return OperatorSettings.load(overrides=overrides)
