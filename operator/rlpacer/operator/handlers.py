"""Kopf handlers: thin translations of watch events into calls on :class:`Jobs`.

Kopf watches the children (pods, StatefulSets, ConfigMaps, Services, the token Secret) and
serves admission webhooks; the jobs themselves are list+watched by :func:`watch_jobs`
(cheaper per event, see there). The decisions are pure (``decide``, ``accept_report``,
``build_children``) and the writes go through ``rlpacer.operator.runtime``. Each job gets a
*level-based* reconcile loop (an asyncio task owned by :class:`JobLoops`): it reconciles on
start, whenever something relevant changes (the job's spec, its pods or StatefulSets, a step
report that changed the desired rollout replicas), when a deadline or timeout falls due, and
at least every ``resync_seconds``. The watches also say what a pass must read again: the job
when its watch saw a resourceVersion other than the one in memory (:meth:`Jobs.saw`), the
children after one of their events (``JobRuntime.children_changed``); so the periodic pass of
an idle job makes no request (``Jobs.reconcile``), and a full pass every ``reapply_seconds``
is the safety net.

Why not ``@kopf.daemon``: Kopf puts a finalizer on every object with a daemon, so deleting a
job would hang while the operator is down. Nothing outside the API needs flushing on delete
(children go by owner references; the metrics series are in this process), so rlpacer uses
no finalizer: the loops are started from watch events and stopped on ``DELETED``.

Admission webhooks (the policy webhook of issue 6) register on the same registry in
:func:`build_registry` (``kopf.on.validate`` / ``kopf.on.mutate``), served by Kopf's webhook
server configured from ``OperatorSettings.webhook_*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from rlpacer.api import contract
from rlpacer.api.job import GROUP, PLURAL, VERSION
from rlpacer.operator.kube import (
    METADATA_ONLY,
    METADATA_ONLY_LIST,
    ApiError,
    ChildRefused,
    Credentials,
)
from rlpacer.operator.kueue import POLL_SECONDS
from rlpacer.operator.runtime import JobGone, Jobs, namespace_terminating
from rlpacer.operator.settings import OperatorSettings

log = logging.getLogger("rlpacer.operator")

#: Backoff after a reconcile that raised (seconds, capped).
ERROR_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)


def resync_wait(period: float, first: bool, rng: random.Random) -> float:
    """Seconds until a job's next periodic reconcile: jittered, and never above ``period``.

    The loops of all jobs start together when the operator starts (or takes over the Lease),
    so unjittered periodic passes would run as one burst every ``period``: 50 jobs' GETs and
    child builds at once, with every step report in the operator's event loop and the API
    server queued behind them (measured: reports answered in 200+ ms during each burst, p99
    ~50 ms otherwise). The first wait is spread over the whole period, later ones over its
    last fifth, as controller-runtime jitters its resyncs.
    """
    return period * (rng.uniform(0.05, 1.0) if first else rng.uniform(0.8, 1.0))


class JobLoops:
    """One reconcile task per job."""

    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}

    def ensure(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        task = self._tasks.get(key)
        if task is None or task.done():
            self._tasks[key] = asyncio.create_task(self._run(namespace, name),
                                                   name=f"reconcile:{namespace}/{name}")
        else:
            self.jobs.poke(namespace, name)

    def known(self) -> list[tuple[str, str]]:
        return list(self._tasks)

    def running(self, namespace: str, name: str) -> bool:
        task = self._tasks.get((namespace, name))
        return task is not None and not task.done()

    async def stop(self, namespace: str, name: str) -> None:
        task = self._tasks.pop((namespace, name), None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.jobs.forget(namespace, name)

    async def stop_all(self) -> None:
        for key in list(self._tasks):
            task = self._tasks.pop(key)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self, namespace: str, name: str) -> None:
        jobs = self.jobs
        errors = 0
        first = True
        rng = random.Random()
        while True:
            rt = await jobs.get(namespace, name)
            if rt is None:
                jobs.forget(namespace, name)
                return
            rt.wake.clear()
            try:
                requeue = await jobs.reconcile(rt)
                errors = 0
            except JobGone:
                jobs.forget(namespace, name)
                return
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                # The API server unreachable (restarting, its etcd away): expected, retried
                # with backoff, one line each time, no traceback.
                requeue = ERROR_BACKOFF[min(errors, len(ERROR_BACKOFF) - 1)]
                log.warning("reconcile %s/%s: API server unreachable, retrying in %.1fs: %s",
                            namespace, name, requeue, e)
                jobs.metrics.reconcile_errors.labels(namespace, name).inc()
                errors += 1
            except ChildRefused as e:  # the spec's doing (or a quota's): said, then retried
                await jobs.child_refused(rt, e)
                requeue = ERROR_BACKOFF[min(errors, len(ERROR_BACKOFF) - 1)]
                errors += 1
            except ApiError as e:
                if e.status in (429, 500, 502, 503, 504):  # the API server's own trouble
                    requeue = ERROR_BACKOFF[min(errors, len(ERROR_BACKOFF) - 1)]
                    log.warning("reconcile %s/%s: API server answered %d, retrying in %.1fs:"
                                " %s", namespace, name, e.status, requeue, e)
                    jobs.metrics.reconcile_errors.labels(namespace, name).inc()
                    errors += 1
                elif not namespace_terminating(e):
                    log.exception("reconcile %s/%s failed", namespace, name)
                    jobs.metrics.reconcile_errors.labels(namespace, name).inc()
                    requeue = ERROR_BACKOFF[min(errors, len(ERROR_BACKOFF) - 1)]
                    errors += 1
                else:  # its namespace is going, and the job and children with it: the
                    # API server refuses to re-create anything there, which is not an error.
                    # The next pass reads the job (gone: its loop ends, its series go) rather
                    # than wait for a DELETED event that a restarting watch can miss.
                    log.info("reconcile %s/%s: namespace is being deleted", namespace, name)
                    rt.reread = True
                    requeue = ERROR_BACKOFF[min(errors, len(ERROR_BACKOFF) - 1)]
                    errors += 1
            except Exception:
                log.exception("reconcile %s/%s failed", namespace, name)
                jobs.metrics.reconcile_errors.labels(namespace, name).inc()
                requeue = ERROR_BACKOFF[min(errors, len(ERROR_BACKOFF) - 1)]
                errors += 1
            resync = resync_wait(jobs.settings.resync_seconds, first, rng)
            first = False
            wait = resync if requeue is None else min(max(requeue, 0.05), resync)
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that arrives as the wake fires (a child's DELETED event with the job's), and
            # the loop ran on after its job was deleted, its stop() waiting for it forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await rt.wake.wait()


async def on_job_event(jobs: Jobs, loops: JobLoops, type_: str, obj: dict[str, Any]) -> None:
    """One watch event of an RLTrainingJob: start, poke or stop its reconcile loop."""
    meta = obj.get("metadata") or {}
    namespace, name = meta.get("namespace"), meta.get("name")
    if not namespace or not name:
        return
    if type_ == "DELETED":
        await loops.stop(namespace, name)
        return
    rv = meta.get("resourceVersion")
    if rv:
        jobs.saw(namespace, name, rv)
    rt = jobs.peek(namespace, name)
    # Status writes (one per step report) change nothing here; a spec change (generation)
    # pokes the loop. A step report may have loaded the job before its first watch event (a
    # restarted operator serves reports before the watch starts): start the loop then too.
    if rt is None or rt.generation != meta.get("generation") or not loops.running(
        namespace, name
    ):
        loops.ensure(namespace, name)


async def watch_jobs(jobs: Jobs, loops: JobLoops, namespaces: list[str]) -> None:
    """List+watch RLTrainingJobs (all namespaces, or each of ``namespaces``).

    Not a Kopf handler on purpose: every step report writes the job's status, so its watch
    carries ~one event per report, and Kopf deep-copies each event's body several times to
    diff it (about 7 ms of CPU per event, measured with cProfile in bench-operator). This
    loop only looks at type and generation, so it lists and watches metadata only
    (PartialObjectMetadata): the API server neither serializes nor sends spec and status.
    """
    base = f"/apis/{GROUP}/{VERSION}"
    scopes: list[tuple[str, str | None]] = (
        [(f"{base}/namespaces/{ns}/{PLURAL}", ns) for ns in namespaces]
        if namespaces else [(f"{base}/{PLURAL}", None)]
    )
    await asyncio.gather(*[_watch_one(jobs, loops, p, ns) for p, ns in scopes])


async def _watch_one(jobs: Jobs, loops: JobLoops, path: str, namespace: str | None) -> None:
    backoff = 0.5
    while True:
        try:
            listing = await jobs.kube.request("GET", path, accept=METADATA_ONLY_LIST)
            seen = set()
            # A metadata-only list of an empty collection has "items": null (the API server
            # omits nothing; PartialObjectMetadataList's items is not omitempty).
            for item in listing.get("items") or []:
                meta = item.get("metadata") or {}
                seen.add((meta.get("namespace"), meta.get("name")))
                await on_job_event(jobs, loops, "ADDED", item)
            for key in loops.known():  # deleted while we were not watching
                if (namespace is None or key[0] == namespace) and key not in seen:
                    await loops.stop(*key)
            rv = listing.get("metadata", {}).get("resourceVersion", "")
            backoff = 0.5
            while True:
                async for ev in jobs.kube.watch(path, rv, accept=METADATA_ONLY):
                    kind, obj = ev.get("type"), ev.get("object") or {}
                    if kind == "ERROR":
                        raise ApiError(int(obj.get("code") or 500), obj.get("reason", ""),
                                       obj.get("message", ""))
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if kind != "BOOKMARK":
                        await on_job_event(jobs, loops, str(kind), obj)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # 410 Gone, network, ...: relist
            log.info("job watch %s restarts: %s", path, e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)


@dataclass
class OperatorContext:
    settings: OperatorSettings
    creds: Credentials
    jobs: Jobs
    loops: JobLoops


def build_registry(ctx: OperatorContext) -> kopf.OperatorRegistry:
    """The operator's Kopf handlers, on a registry of their own (no global state)."""
    registry = kopf.OperatorRegistry()
    jobs, loops = ctx.jobs, ctx.loops
    managed = {contract.LABEL_MANAGED_BY: contract.MANAGED_BY}

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Kopf's own bookkeeping in annotations under our group (status has a strict schema).
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        settings.posting.level = logging.WARNING
        # Leader election is the Lease's job (rlpacer.operator.lease), not peering's.
        settings.peering.standalone = True
        # No discovery of namespaces and CRDs: the chart deliberately grants neither (list
        # namespaces, list CRDs), and Kopf would retry them for about a minute before its
        # watches start, while the step-report endpoint already answers (a restarted operator
        # could then not scale for long rounds). The CRDs exist before the operator starts.
        settings.scanning.disabled = True
        settings.watching.server_timeout = 300
        # Watch only our children, filtered by the API server (not every pod of the cluster).
        selector = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY}"
        settings.watching.label_selectors[("v1", "pods")] = selector
        settings.watching.label_selectors[("apps", "v1", "statefulsets")] = selector
        for plural in ("configmaps", "services", "secrets"):
            settings.watching.label_selectors[("v1", plural)] = selector
        settings.watching.label_selectors[("kueue.x-k8s.io", "v1beta2", "workloads")] = selector
        settings.networking.request_timeout = 60
        if ctx.settings.webhook_enabled:
            from rlpacer.operator import admission

            s = ctx.settings
            admission.configure(settings, host=s.webhook_host, port=s.webhook_port,
                                url=s.webhook_url, cert_dir=s.webhook_cert_dir)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        c = ctx.creds
        c.refresh()  # an exec credential about to expire (Kopf logs in again on a 401)
        return kopf.ConnectionInfo(
            server=c.server, ca_path=c.ca_path, insecure=c.insecure or None,
            scheme="Bearer" if c.token else None, token=c.token,
            certificate_path=c.cert_path, private_key_path=c.key_path,
        )


    def child_event(kind: str) -> Callable[..., Any]:
        async def handler(
            type: str | None, labels: kopf.Labels, namespace: str, name: str = "",
            meta: kopf.Meta | None = None, **_: Any
        ) -> None:
            job = labels.get(contract.LABEL_JOB)
            if job:
                jobs.child_event(namespace, job, kind, name, type, dict(meta or {}))

        handler.__name__ = f"{kind.lower()}_event"
        return handler

    kopf.on.event("v1", "pods", labels=managed, registry=registry)(child_event("Pod"))
    kopf.on.event("apps", "v1", "statefulsets", labels=managed, registry=registry)(
        child_event("StatefulSet"))
    # Every other child too: a deleted ConfigMap, Service or token Secret is re-created on
    # the next pass, not after reapply_seconds (the Secret with the same token); a changed
    # ConfigMap or Service is applied again.
    for plural, kind in (("configmaps", "ConfigMap"), ("services", "Service"),
                         ("secrets", "Secret")):
        kopf.on.event("v1", plural, labels=managed, registry=registry)(child_event(kind))
    if ctx.settings.kueue:
        # the jobs' Kueue Workloads: an admission, an eviction or a grant starts a pass at
        # once (kopf resolves the resource when it starts: absent then, not watched)
        kopf.on.event("kueue.x-k8s.io", "v1beta2", "workloads", labels=managed,
                      registry=registry)(child_event("Workload"))

        @kopf.on.startup(registry=registry)
        async def kueue_served(**_: Any) -> None:
            jobs.kueue_watched = await jobs.kueue.served()
            if not jobs.kueue_watched:
                log.warning("kueue: the Workload API is not served; jobs that name a queue"
                            " are polled every %.0fs (restart the operator after installing"
                            " Kueue to watch their Workloads)", POLL_SECONDS)
    if ctx.settings.job_network_policy:
        # the job's NetworkPolicies: one deleted or edited by hand is restored on the next pass
        kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=managed,
                      registry=registry)(child_event("NetworkPolicy"))

    if ctx.settings.webhook_enabled:
        from rlpacer.operator.policies import policy_admission

        policy_admission(jobs.kube, ctx.settings).register(registry)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await loops.stop_all()

    return registry
