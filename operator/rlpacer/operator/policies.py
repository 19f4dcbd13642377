"""The RLTrainingPolicies of a namespace for run-time enforcement: a small TTL cache.

Step reports arrive every few seconds per job while policies change rarely, so the report path
reads a namespace's policies through :class:`PolicyCache`: one list request per namespace per
``policy_cache_seconds`` (the same lookup as the admission webhook,
``rlpacer.operator.admission.PolicyAdmission.policies``), never one per report. A policy change
therefore binds running jobs within that TTL.

Failure handling (deliberately different from admission, which fails closed): when the
policies cannot be read or one of them is invalid, the last good answer is used (stale), and
without one the report is accepted without enforcement (None): a run-time policy outage must
not stop training. It is logged each time the lookup fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from rlpacer.api import policy as policy_api
from rlpacer.api.policy import RLTrainingPolicy
from rlpacer.operator.admission import ClusterPolicyLister, PolicyAdmission
from rlpacer.operator.kube import KubeClient
from rlpacer.operator.settings import OperatorSettings

log = logging.getLogger("rlpacer.operator")

#: namespace -> its policies (name order), raising on failure.
Resolver = Callable[[str], Awaitable[list[RLTrainingPolicy]]]


def namespace_lister(kube: KubeClient) -> Callable[[str], Awaitable[Sequence[Mapping[str, Any]]]]:
    """Lists the raw RLTrainingPolicies of a namespace with the operator's client."""

    async def list_policies(namespace: str) -> list[dict[str, Any]]:
        path = (f"/apis/{policy_api.GROUP}/{policy_api.VERSION}/namespaces/{namespace}/"
                f"{policy_api.PLURAL}")
        out = await kube.request("GET", path)
        return list(out.get("items", []))

    return list_policies


def cluster_lister(kube: KubeClient) -> ClusterPolicyLister:
    """Lists every ClusterRLTrainingPolicy and reads the labels of a job's namespace (only
    when there is a cluster policy): the chart grants both in ``rbac.scope=Cluster`` only."""

    async def list_cluster(
        namespace: str,
    ) -> tuple[Sequence[Mapping[str, Any]], Mapping[str, str]]:
        out = await kube.request(
            "GET", f"/apis/{policy_api.GROUP}/{policy_api.VERSION}/{policy_api.CLUSTER_PLURAL}")
        items = list(out.get("items", []))
        if not items:
            return [], {}
        ns = await kube.request("GET", f"/api/v1/namespaces/{namespace}")
        return items, dict((ns.get("metadata") or {}).get("labels") or {})

    return list_cluster


def policy_admission(kube: KubeClient, settings: OperatorSettings) -> PolicyAdmission:
    """The policy lookup shared by the admission webhook and run-time enforcement: the
    namespace's RLTrainingPolicies, plus the matching ClusterRLTrainingPolicies when the
    operator watches the whole cluster (``namespaces`` empty, the chart's Cluster scope; a
    Namespaced install has no right to read cluster policies or namespaces)."""
    cluster = None if settings.namespaces else cluster_lister(kube)
    return PolicyAdmission(namespace_lister(kube), cluster)


class PolicyCache:
    def __init__(self, resolve: Resolver, ttl_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._resolve = resolve
        self._ttl = ttl_seconds
        self._clock = clock
        self._entries: dict[str, tuple[float, list[RLTrainingPolicy]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._refreshing: dict[str, asyncio.Future[list[RLTrainingPolicy] | None]] = {}

    async def get(self, namespace: str) -> list[RLTrainingPolicy] | None:
        """The namespace's policies; None when never readable.

        Stale-while-revalidate: an entry older than the TTL is returned at once while one
        background read refreshes it, so a step report never waits on a policy LIST (only
        the first lookup of a namespace, or one after :meth:`invalidate`, does). Entries are
        at most TTL + one read old."""
        entry = self._entries.get(namespace)
        if entry is not None:
            if self._clock() - entry[0] >= self._ttl and namespace not in self._refreshing:
                self._refreshing[namespace] = asyncio.ensure_future(
                    self._refresh(namespace, background=True))
            return entry[1]
        lock = self._locks.setdefault(namespace, asyncio.Lock())
        async with lock:
            entry = self._entries.get(namespace)
            if entry is not None:
                return entry[1]
            return await self._refresh(namespace)

    async def _refresh(self, namespace: str, background: bool = False
                       ) -> list[RLTrainingPolicy] | None:
        entry = self._entries.get(namespace)
        try:
            found = await self._resolve(namespace)
        except Exception as err:  # API errors, invalid stored policies: keep the last
            log.warning("policies of namespace %s not read (%s): %s", namespace,
                        "using the last ones" if entry else "not enforcing", err)
            return entry[1] if entry is not None else None
        finally:
            if background:
                self._refreshing.pop(namespace, None)
        self._entries[namespace] = (self._clock(), found)
        return found

    def invalidate(self, namespace: str | None = None) -> None:
        if namespace is None:
            self._entries.clear()
        else:
            self._entries.pop(namespace, None)


__all__ = ["PolicyCache", "Resolver", "cluster_lister", "namespace_lister", "policy_admission"]
