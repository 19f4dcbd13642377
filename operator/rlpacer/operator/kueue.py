"""The operator's reads and writes of Kueue objects (the pure part is
:mod:`rlpacer.operator.queue`).

Reads are cached briefly where they are cluster-wide and rarely change (whether Kueue's API is
served, ResourceFlavors, PriorityClass values); a job's Workloads are read on every pass of a
job that names a queue (the operator polls them every :data:`POLL_SECONDS` while Kueue holds
the job or a long round's replicas wait for admission).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from rlpacer.api import contract
from rlpacer.operator import queue
from rlpacer.operator.kube import ApiError, ChildRefused, KubeClient, object_path

log = logging.getLogger("rlpacer.operator")

Obj = dict[str, Any]

#: How often a job held by Kueue (or a long round waiting for its Workload) is looked at.
POLL_SECONDS = 2.0
#: The same while the operator watches the jobs' Workloads (operator setting ``kueue``): a
#: safety net beside the watch.
WATCHED_POLL_SECONDS = 30.0
#: How long cluster-wide reads (API served, flavors, priority classes) are reused.
CACHE_SECONDS = 30.0


class Kueue:
    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube
        self._served: tuple[float, bool] | None = None
        self._flavors: dict[str, tuple[float, Obj]] = {}
        self._priorities: dict[str, tuple[float, int | None]] = {}
        self._local_queues: dict[tuple[str, str], tuple[float, str | None]] = {}

    async def served(self) -> bool:
        """Whether Kueue's Workload API is served (Kueue's CRDs are installed)."""
        now = time.monotonic()
        if self._served is not None and now - self._served[0] < CACHE_SECONDS:
            return self._served[1]
        try:
            body = await self.kube.get("/apis/" + queue.API_VERSION)
            ok = body is not None and any(
                r.get("name") == queue.WORKLOADS for r in body.get("resources") or [])
        except ApiError as e:
            if e.status not in (403, 503):
                raise
            ok = False
        self._served = (now, ok)
        return ok

    def forget_served(self) -> None:
        self._served = None

    @staticmethod
    def path(namespace: str, name: str | None = None) -> str:
        return object_path(queue.API_VERSION, queue.WORKLOADS, namespace, name)

    async def get(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self.kube.get(self.path(namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def view(self, namespace: str, name: str, uid: str) -> tuple[queue.QueueView,
                                                                      Obj | None]:
        """The Workload's view and the object (absent, or not the job's: ABSENT)."""
        obj = await self.get(namespace, name)
        if obj is None:
            if not await self.served():
                return queue.NOT_INSTALLED, None
            return queue.ABSENT, None
        owners = (obj.get("metadata") or {}).get("ownerReferences") or []
        if not any(o.get("uid") == uid for o in owners):
            # someone else's Workload of that name: never admitted on it
            return queue.QueueView(exists=True, owned=False, message=(
                f"a Workload named {name} exists that this job does not own:"
                " delete it, or rename the job")), None
        return queue.parse(obj), obj

    async def create(self, obj: Obj) -> None:
        """Create a Workload (with the API server's strict field validation); one that exists
        already (an earlier pass's answer lost) is fine. Refused (Kueue's webhook or the
        schema: 400/403/422) raises ChildRefused: said on the job (Warning FailedCreate),
        retried on the error backoff."""
        try:
            # strict: a field Kueue's API does not know is refused, not silently dropped
            await self.kube.request(
                "POST", self.path(obj["metadata"]["namespace"]), obj,
                params={"fieldValidation": "Strict"})
        except ApiError as e:
            if e.status == 409:
                return
            if e.status in (400, 403, 422):
                raise ChildRefused(obj["kind"], obj["metadata"]["name"], e) from None
            raise

    async def put_status(self, obj: Obj) -> bool:
        """PUT the Workload's status (False: it changed since it was read; the next pass
        reads it again)."""
        meta = obj["metadata"]
        try:
            await self.kube.request("PUT", self.path(meta["namespace"], meta["name"]) + "/status",
                                    obj)
        except ApiError as e:
            if e.status in (404, 409):
                return False
            raise
        return True

    async def deactivate(self, namespace: str, name: str) -> None:
        """``spec.active: false``: Kueue evicts the Workload (reason Deactivated)."""
        try:
            await self.kube.request("PATCH", self.path(namespace, name),
                                    {"spec": {"active": False}},
                                    content_type="application/merge-patch+json")
        except ApiError as e:
            if e.status != 404:
                raise

    async def delete(self, namespace: str, name: str) -> bool:
        return await self.kube.delete(self.path(namespace, name))

    async def flavors(self, names: Iterable[str]) -> dict[str, Obj]:
        """ResourceFlavor name -> its spec (an absent flavor: an empty spec)."""
        out: dict[str, Obj] = {}
        now = time.monotonic()
        for name in sorted(set(names)):
            hit = self._flavors.get(name)
            if hit is None or now - hit[0] >= CACHE_SECONDS:
                obj = await self.kube.get(object_path(queue.API_VERSION,
                                                      queue.RESOURCE_FLAVORS, None, name))
                hit = (now, dict((obj or {}).get("spec") or {}))
                self._flavors[name] = hit
            out[name] = hit[1]
        return out

    async def priority(self, class_name: str | None) -> int | None:
        """The value of a PriorityClass (None: no class named, or it does not exist)."""
        if not class_name:
            return None
        now = time.monotonic()
        hit = self._priorities.get(class_name)
        if hit is None or now - hit[0] >= CACHE_SECONDS:
            obj = await self.kube.get(object_path("scheduling.k8s.io/v1", "priorityclasses",
                                                  None, class_name))
            value = obj.get("value") if obj is not None else None
            hit = (now, int(value) if isinstance(value, int) else None)
            self._priorities[class_name] = hit
        return hit[1]

    async def cluster_queue(self, namespace: str, local_queue: str) -> str | None:
        """The ClusterQueue a LocalQueue points at (None: no such LocalQueue)."""
        now = time.monotonic()
        key = (namespace, local_queue)
        hit = self._local_queues.get(key)
        if hit is None or now - hit[0] >= CACHE_SECONDS:
            obj = await self.kube.get(object_path(queue.API_VERSION, queue.LOCAL_QUEUES,
                                                  namespace, local_queue))
            target = ((obj or {}).get("spec") or {}).get("clusterQueue")
            hit = (now, str(target) if target else None)
            self._local_queues[key] = hit
        return hit[1]

    async def managed(self, namespaces: list[str]) -> list[Obj]:
        """Every Workload this operator made (by label), in ``namespaces`` (empty: all)."""
        params = {"labelSelector": f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY}"}
        out: list[Obj] = []
        where: list[str | None] = list(namespaces) or [None]
        for ns in where:
            body = await self.kube.request(
                "GET", object_path(queue.API_VERSION, queue.WORKLOADS, ns, None), params=params)
            out.extend(body.get("items") or [])
        return out

    async def hold(self, namespace: str, name: str, behind: str | None) -> None:
        """Hold a long round's Workload behind ``behind`` (``spec.active: false``, the
        annotation naming it), or let it go (None: active again, the annotation removed)."""
        patch = {"metadata": {"annotations": {queue.HELD_BY_ANNOTATION: behind}},
                 "spec": {"active": behind is None}}
        try:
            await self.kube.request("PATCH", self.path(namespace, name), patch,
                                    content_type="application/merge-patch+json")
        except ApiError as e:
            if e.status != 404:
                raise
