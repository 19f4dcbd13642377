"""Policy admission webhooks for RLTrainingJobs and RLTrainingPolicies (Kopf handlers).

Thin handlers: each translates an admission request into a call of the pure logic in
:mod:`rlpacer.control.policy` and the answer back into Kopf's terms (``kopf.AdmissionError``
to reject, ``warnings`` to warn, ``patch`` to mutate). Three webhooks, each at the URL path
``/<id>`` of the operator's webhook server (Kopf routes a request to the handler whose id is
the path; the Helm chart's webhook configurations use the same ids):

* ``validate-rltrainingjob`` (CREATE, UPDATE): a job that breaks an ``Enforce`` policy of its
  namespace is rejected with every violation named (field, value, limit, policy); ``Warn``
  policies add warnings (``kubectl`` prints them) and admit. Updates that leave the spec
  unchanged (finalizers, annotations, Kopf's own bookkeeping) and objects being deleted are
  always admitted, so a policy tightened later can never wedge a running job's lifecycle.
* ``mutate-rltrainingjob`` (CREATE): fills the policies' defaults into fields the job leaves
  unset, records which policies did so in the ``rlpacer.io/defaulted-by`` annotation and
  tells the user in a warning.
* ``validate-rltrainingpolicy`` and ``validate-clusterrltrainingpolicy`` (CREATE, UPDATE):
  reject a policy whose cross-field checks fail (defaults that break the policy's own
  limits); the CRD's schema and CEL rules catch the rest even while the operator is down.

The policies that govern a job: every RLTrainingPolicy of its namespace, then every
ClusterRLTrainingPolicy whose namespaceSelector matches the namespace's labels (only when a
cluster lister is given: reading namespace labels needs cluster-scope RBAC).

Design decisions:

* Webhook configurations belong to the Helm chart, not to Kopf (``settings.admission.managed``
  stays None): the operator needs no RBAC on admissionregistration objects, and
  ``failurePolicy`` is a reviewed chart value, not code.
* Policies are looked up from the API server on each request (one namespaced list), not from
  an in-memory index: an index is empty for a moment after each start, and a validating
  webhook must not admit what it has not checked.
* TLS: the chart mounts the serving certificate (``tls.crt``, ``tls.key``) into
  ``webhook_cert_dir``; Kopf's server re-reads the files when they change (renewals).
  Without a certificate directory, :func:`webhook_server` generates a CA and a certificate
  with ``openssl`` (:mod:`rlpacer.operator.tls`; local runs only), the CA next to it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import kopf

from rlpacer.api import policy as policy_api
from rlpacer.api.job import GROUP, PLURAL, VERSION, ManifestError, parse_spec
from rlpacer.api.policy import (
    PolicyAction,
    RLTrainingPolicy,
    parse_cluster_policy,
    parse_policy,
)
from rlpacer.control.policy import apply_defaults, selector_matches, validate_job
from rlpacer.operator import tls

logger = logging.getLogger(__name__)

#: Handler ids = URL paths (``/<id>``) of the three webhooks; the chart uses the same.
VALIDATE_JOB = "validate-rltrainingjob"
MUTATE_JOB = "mutate-rltrainingjob"
VALIDATE_POLICY = "validate-rltrainingpolicy"
VALIDATE_CLUSTER_POLICY = "validate-clusterrltrainingpolicy"
WEBHOOK_IDS = (VALIDATE_JOB, MUTATE_JOB, VALIDATE_POLICY, VALIDATE_CLUSTER_POLICY)

#: Annotation naming the policies whose defaults the mutating webhook filled in.
DEFAULTED_BY = "rlpacer.io/defaulted-by"

#: Returns the raw RLTrainingPolicy objects of a namespace.
PolicyLister = Callable[[str], Awaitable[Sequence[Mapping[str, Any]]]]

#: Returns every raw ClusterRLTrainingPolicy and the labels of a namespace.
ClusterPolicyLister = Callable[
    [str], Awaitable[tuple[Sequence[Mapping[str, Any]], Mapping[str, str]]]
]


class PolicyLookupError(RuntimeError):
    """The namespace's policies could not be read; the job is not admitted unchecked."""


class InvalidStoredPolicyError(RuntimeError):
    """A stored policy does not validate (e.g. created before a stricter operator version)."""


def parse_policies(
    items: Sequence[Mapping[str, Any]], *, cluster: bool = False
) -> list[RLTrainingPolicy]:
    """Policies in name order (the order defaults are taken in); invalid ones raise."""
    out: list[RLTrainingPolicy] = []

    def _name(o: Mapping[str, Any]) -> str:
        return str((o.get("metadata") or {}).get("name", ""))

    for item in sorted(items, key=_name):
        raw = {k: item[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in item}
        raw["metadata"] = {k: v for k, v in raw.get("metadata", {}).items()
                           if k in ("name", "namespace", "labels", "annotations")}
        try:
            out.append(parse_cluster_policy(raw) if cluster else parse_policy(raw))
        except ManifestError as err:
            meta = item.get("metadata", {})
            ref = (f"{policy_api.CLUSTER_KIND} {meta.get('name')}" if cluster
                   else f"{policy_api.KIND} {meta.get('namespace')}/{meta.get('name')}")
            raise InvalidStoredPolicyError(
                f"{ref} is invalid, so jobs it governs cannot be checked; fix or delete it: {err}"
            ) from None
    return out


class PolicyAdmission:
    """The admission handlers, bound to a way of listing a namespace's policies."""

    def __init__(
        self, lister: PolicyLister, cluster_lister: ClusterPolicyLister | None = None
    ) -> None:
        self._lister = lister
        self._cluster_lister = cluster_lister

    async def policies(self, namespace: str) -> list[RLTrainingPolicy]:
        """The namespace's own policies (name order), then the cluster policies whose
        namespaceSelector matches it (name order): the order defaults are taken in."""
        try:
            items = await self._lister(namespace)
            cluster_items: Sequence[Mapping[str, Any]] = ()
            labels: Mapping[str, str] = {}
            if self._cluster_lister is not None:
                cluster_items, labels = await self._cluster_lister(namespace)
        except Exception as err:  # API errors of any client: fail closed, say why
            raise PolicyLookupError(
                f"cannot read the policies that govern namespace {namespace}: {err}"
            ) from err
        labels = {**labels, "kubernetes.io/metadata.name": namespace}
        cluster = [
            p for p in parse_policies(cluster_items, cluster=True)
            if selector_matches(p.spec.namespace_selector, labels)  # type: ignore[attr-defined]
        ]
        return parse_policies(items) + cluster

    def register(self, registry: kopf.OperatorRegistry | None = None) -> None:
        """Attach the four handlers to a Kopf registry (default: Kopf's global one)."""
        reg = registry if registry is not None else kopf.get_default_registry()
        kopf.on.validate(GROUP, VERSION, PLURAL, id=VALIDATE_JOB,
                         operations=["CREATE", "UPDATE"], registry=reg)(self.validate_job)
        kopf.on.mutate(GROUP, VERSION, PLURAL, id=MUTATE_JOB,
                       operations=["CREATE"], registry=reg)(self.mutate_job)
        kopf.on.validate(policy_api.GROUP, policy_api.VERSION, policy_api.PLURAL,
                         id=VALIDATE_POLICY, operations=["CREATE", "UPDATE"],
                         registry=reg)(self.validate_policy)
        kopf.on.validate(policy_api.GROUP, policy_api.VERSION, policy_api.CLUSTER_PLURAL,
                         id=VALIDATE_CLUSTER_POLICY, operations=["CREATE", "UPDATE"],
                         registry=reg)(self.validate_cluster_policy)

    # -- handlers (Kopf calls them with keyword arguments) --------------------------------

    async def validate_job(self, **kw: Any) -> None:
        body: kopf.Body = kw["body"]
        old: kopf.Body | None = kw.get("old")
        operation: str | None = kw.get("operation")
        name: str | None = kw.get("name")
        namespace: str | None = kw.get("namespace")
        warnings: list[str] = kw["warnings"]
        spec = body.get("spec") or {}
        if operation == "UPDATE" and (
            body.get("metadata", {}).get("deletionTimestamp")
            or (old is not None and (old.get("spec") or {}) == spec)
        ):
            return  # not a change a user asks for: never block a job's own lifecycle
        # ratcheting, as the API server does for the CRD's rules: an update that leaves
        # spec.rollout as stored is not refused for a rule newer than the job
        # (tensorParallelSize == gpusPerReplica)
        ratchet = (operation == "UPDATE" and old is not None
                   and (old.get("spec") or {}).get("rollout") == spec.get("rollout"))
        try:
            parsed = parse_spec(copy.deepcopy(dict(spec)), stored=ratchet)
        except ManifestError as err:
            raise kopf.AdmissionError(str(err), code=422) from None
        ns = namespace or "default"
        policies = await self.policies(ns)
        violations = validate_job(parsed, policies)
        warned = [v for v in violations if v.action is PolicyAction.WARN]
        enforced = [v for v in violations if v.action is PolicyAction.ENFORCE]
        warnings.extend(f"policy (Warn): {v.message}" for v in warned)
        if enforced:
            raise kopf.AdmissionError(
                f"RLTrainingJob {ns}/{name} breaks its namespace's policy: "
                + "; ".join(v.message for v in enforced),
                code=403,
            )

    async def mutate_job(self, **kw: Any) -> None:
        body: kopf.Body = kw["body"]
        patch: kopf.Patch = kw["patch"]
        namespace: str | None = kw.get("namespace")
        warnings: list[str] = kw["warnings"]
        spec = copy.deepcopy(dict(body.get("spec") or {}))
        policies = await self.policies(namespace or "default")
        out = apply_defaults(spec, policies)
        if not out.filled:
            return
        for key, value in out.spec.items():
            if spec.get(key) != value:
                patch.setdefault("spec", {})[key] = value
        patch.setdefault("metadata", {}).setdefault("annotations", {})[DEFAULTED_BY] = ",".join(
            ref.rsplit(" ", 1)[-1].rsplit("/", 1)[-1] for ref in out.policies
        )
        warnings.append(
            f"defaults filled in by {', '.join(out.policies)}: {', '.join(out.filled)}"
        )

    async def validate_policy(self, **kw: Any) -> None:
        self._check_policy(kw["body"], cluster=False)

    async def validate_cluster_policy(self, **kw: Any) -> None:
        self._check_policy(kw["body"], cluster=True)

    @staticmethod
    def _check_policy(body: kopf.Body, *, cluster: bool) -> None:
        raw = {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
        raw["metadata"] = {k: v for k, v in dict(raw.get("metadata", {})).items()
                           if k in ("name", "namespace", "labels", "annotations")}
        try:
            (parse_cluster_policy if cluster else parse_policy)(copy.deepcopy(raw))
        except ManifestError as err:
            raise kopf.AdmissionError(str(err), code=422) from None


# --- the webhook server --------------------------------------------------------------


def self_signed(cert_dir: Path, hostnames: Sequence[str], days: int = 365) -> Path:
    """Write a CA (``ca.crt``) and ``tls.crt``/``tls.key`` signed by it for ``hostnames``
    (:func:`rlpacer.operator.tls.generate`). For local runs without the chart."""
    return tls.generate(cert_dir, hostnames, days)


def webhook_server(
    *,
    host: str = "0.0.0.0",
    port: int = 9443,
    url: str | None = None,
    cert_dir: str | Path | None = None,
) -> kopf.WebhookServer:
    """Kopf's HTTPS webhook server on ``host:port`` with the certificate in ``cert_dir``.

    ``url`` (the chart's ``webhook.url``, loopback in local runs) only names the host a
    generated certificate must cover; the API server's URL comes from the chart's webhook
    configurations.
    """
    from urllib.parse import urlsplit

    if cert_dir is None:
        names = [urlsplit(url).hostname or "127.0.0.1"] if url else ["127.0.0.1"]
        if "127.0.0.1" not in names:
            names.append("127.0.0.1")
        cert_dir = tls.generate_temporary(names, "webhook")
    d = Path(cert_dir)
    for f in ("tls.crt", "tls.key"):
        if not (d / f).is_file():
            raise RuntimeError(f"webhook certificate directory {d} has no {f}")
    return kopf.WebhookServer(
        addr=host, port=port, certfile=str(d / "tls.crt"), pkeyfile=str(d / "tls.key"),
        cafile=str(d / "ca.crt") if (d / "ca.crt").is_file() else None,
    )


def configure(
    settings: kopf.OperatorSettings,
    *,
    host: str = "0.0.0.0",
    port: int = 9443,
    url: str | None = None,
    cert_dir: str | Path | None = None,
) -> None:
    """Set Kopf's admission settings for the chart-managed webhooks (call from a startup
    handler): serve on ``host:port`` over TLS; never create or patch webhook configurations."""
    settings.admission.server = webhook_server(host=host, port=port, url=url, cert_dir=cert_dir)
    settings.admission.managed = None
