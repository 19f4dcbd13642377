"""Leader election with a ``coordination.k8s.io/v1`` Lease (the client-go algorithm).

Kopf's peering is not leader election (replicas of equal priority all pause), so the operator
elects with a Lease and starts Kopf and the report endpoint's writes only while it leads:

* acquire: create the Lease, or take it over when its holder has not renewed it for
  ``leaseDurationSeconds`` *as observed on our clock* (the record's own times are another
  node's clock; we time how long the record stayed unchanged), with the resourceVersion as
  precondition so two standbys cannot both win;
* renew every ``renew`` seconds, each attempt cut off when the Lease it renews would expire;
  if a renewal cannot be written for ``duration`` seconds (or another holder shows up),
  leadership is lost: the process stops acting and exits (the
  Deployment restarts it as a standby), as controller-runtime does;
* on a clean shutdown the Lease is released (holder cleared) so the standby takes over at once.

Status writes also carry resourceVersion preconditions, so even a leader that lost the Lease
without noticing cannot overwrite a newer controller state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

from rlpacer.operator.kube import ApiError, KubeClient

log = logging.getLogger("rlpacer.operator.lease")


def _micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self, kube: KubeClient, namespace: str, name: str, identity: str,
        duration: float, renew: float, retry: float,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration = duration
        self.renew = renew
        self.retry = retry
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._rv = ""

    def _body(self, rv: str | None, holder: str | None, transitions: int) -> dict[str, Any]:
        now = _micro_now()
        spec: dict[str, Any] = {
            "holderIdentity": holder,
            "leaseDurationSeconds": max(1, round(self.duration)),
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        if holder == self.identity:
            spec["acquireTime"] = now
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if rv:
            meta["resourceVersion"] = rv
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": spec}

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True if we hold the Lease afterwards."""
        lease = await self.kube.get(self.path)
        if lease is None:
            try:
                obj = await self.kube.request(
                    "POST", f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases",
                    self._body(None, self.identity, 0))
            except ApiError as e:
                if e.status == 409:
                    return False
                raise
            self._rv = obj["metadata"]["resourceVersion"]
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime") or "")
        now = time.monotonic()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.duration)
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder and holder != self.identity and now - self._observed_at < duration:
            return False  # someone else holds a live lease
        if holder != self.identity:
            transitions += 1
        body = self._body(lease["metadata"]["resourceVersion"], self.identity, transitions)
        if holder == self.identity and spec.get("acquireTime"):
            body["spec"]["acquireTime"] = spec["acquireTime"]
        try:
            obj = await self.kube.request("PUT", self.path, body)
        except ApiError as e:
            if e.status == 409:
                return False
            raise
        self._rv = obj["metadata"]["resourceVersion"]
        self._observed = (self.identity, obj["spec"].get("renewTime") or "")
        self._observed_at = time.monotonic()
        return True

    async def acquire(self) -> None:
        """Wait until this replica leads."""
        while True:
            try:
                if await self.try_acquire_or_renew():
                    log.info("leading as %s (lease %s/%s)", self.identity, self.namespace,
                             self.name)
                    return
            except (ApiError, OSError) as e:
                log.warning("lease: %s", e)
            await asyncio.sleep(self.retry)

    async def hold(self) -> None:
        """Renew until leadership is lost; then return (the caller stops acting)."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.renew)
            # A renewal must end before the Lease it renews could expire: an API server that
            # hangs (its etcd away) would otherwise keep this replica acting on a lapsed Lease
            # for the whole HTTP timeout (client-go's renew deadline).
            left = last_ok + self.duration - time.monotonic()
            try:
                async with asyncio.timeout(max(left, 0.1)):  # not wait_for: see handlers
                    renewed = await self.try_acquire_or_renew()
                if renewed:
                    last_ok = time.monotonic()
                    continue
                log.error("lease taken by another replica")
                return
            except TimeoutError:
                log.warning("lease renewal got no answer within the lease's %.0fs",
                            self.duration)
            except (ApiError, OSError) as e:
                log.warning("lease renewal failed: %s", e)
            if time.monotonic() - last_ok >= self.duration:
                log.error("lease not renewed for %.0fs", self.duration)
                return

    async def release(self) -> None:
        """Give up the Lease (clean shutdown): the standby need not wait for expiry."""
        try:
            lease = await self.kube.get(self.path)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            body = self._body(lease["metadata"]["resourceVersion"], None,
                              int(lease["spec"].get("leaseTransitions") or 0))
            body["spec"]["leaseDurationSeconds"] = 1
            await self.kube.request("PUT", self.path, body)
        except (ApiError, OSError) as e:
            log.warning("lease release failed: %s", e)
