"""Kueue admission for jobs with ``spec.scheduling.queueName``: the Workloads, pure.

A job that names a queue is admitted the way Kueue's own integrations (batch/Job, JobSet,
RayJob) are, with the operator playing the integration's part:

* **The job's Workload** ``<job>-workload`` (``kueue.x-k8s.io/v1beta2``, owned by the job):
  one pod set per role (head 1, learner ``trainer.replicas``, rollout ``rollout.replicas``,
  driver 1) whose templates carry each role's resources, node selector, tolerations and
  priority class; ``spec.queueName`` is the job's LocalQueue and ``spec.priority`` the value
  of the job's PriorityClass (looked up when the Workload is made). The job runs no pod until
  Kueue reserves quota and admits it (condition ``QueueAdmitted``); the admitted flavors'
  node labels and tolerations (``ResourceFlavor.spec``) are added to each role's pods.
* **Eviction** (Kueue's ``Evicted`` condition: preemption by a higher-priority workload, a
  stopped queue, a deactivated Workload): the job's pods are deleted, and once none is left the
  operator gives the quota back as Kueue's job reconciler does (``QuotaReserved`` and
  ``Admitted`` False, the admission cleared, ``Requeued`` True for a preemption or a node
  failure so that Kueue queues it again). Admitted again, the job resumes as a new attempt from
  its last checkpoint, its controller state kept (not counted against ``backoffLimit``).
* **Finished**: a terminal job marks its Workload ``Finished`` (Kueue releases the quota).
* **A long round's extra replicas** ``<job>-long-round``: a second Workload of one pod set,
  the rollout replicas above ``rollout.replicas`` (in
  ``tailBatching.longRound.queueName``'s LocalQueue, default the job's), made when a scale-up
  is asked (a long round, or an early scale-up) and deleted when the replicas go back.
  The StatefulSet grows only once Kueue admits it; not admitted within
  ``scaleUpTimeoutSeconds``, the long round runs on what is there (``ScaleUpTimedOut``). Its
  template carries the job's admitted rollout flavor's node labels, so Kueue gives the extra
  replicas a flavor the rollout StatefulSet's one template can run on.

* **The burst pool's order** (:func:`pool_holds`): Kueue orders a ClusterQueue's waiting
  Workloads by priority then arrival, or, with admission fair sharing, by the namespace's
  usage first and priority only after it. rlpacer's rule for long rounds is priority first:
  among the long-round Workloads waiting in one ClusterQueue, those below the highest waiting
  priority are held (``spec.active: false``, annotation :data:`HELD_BY_ANNOTATION` naming the
  ask they wait behind) until no higher ask waits; Kueue then orders the asks of one
  priority by its own rule (fair share by namespace where the ClusterQueue opts into it, then
  arrival: a held Workload keeps its creation time, so its place). An ask Kueue has found
  larger than the pool can ever hold holds no one back.

Kueue must know the job's kind as an external framework (its configuration's
``integrations.externalFrameworks: [RLTrainingJob.v1alpha1.rlpacer.io]``) where its webhooks
run; docs/kueue.md. Nothing here does I/O: :mod:`rlpacer.operator.runtime` reads and writes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rlpacer.api import contract
from rlpacer.api.job import RLTrainingJobSpec
from rlpacer.operator import names

Obj = dict[str, Any]

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"
WORKLOADS = "workloads"
RESOURCE_FLAVORS = "resourceflavors"
#: A Workload's reference to the job's PriorityClass (v1beta2 ``spec.priorityClassRef``).
PRIORITY_CLASS_GROUP, PRIORITY_CLASS_KIND = "scheduling.k8s.io", "PriorityClass"
#: Kueue's condition types on a Workload.
QUOTA_RESERVED, ADMITTED, EVICTED, FINISHED, REQUEUED = (
    "QuotaReserved", "Admitted", "Evicted", "Finished", "Requeued")
#: Eviction reasons after which Kueue queues the Workload again (its job reconciler's rule).
REQUEUE_REASONS = ("Preempted", "NodeFailures")
#: Pod set of a long round's extra rollout replicas.
LONG_ROUND_POD_SET = "rollout"
LOCAL_QUEUES = "localqueues"
#: On a long round's Workload held by the pool's order (module doc): the ask it waits behind
#: (``<namespace>/<workload>``). The operator reactivates only Workloads it held.
HELD_BY_ANNOTATION = "rlpacer.io/pool-held-by"
#: Kueue's word (the QuotaReserved message) for a request the ClusterQueue can never hold.
NEVER_FITS = "> maximum capacity"


def workload_name(job: str) -> str:
    return names.child_name(job, "workload")


#: The suffix of a long round's Workload name (``<job>-long-round``, kept when the name is cut)
LONG_ROUND_SUFFIX = "long-round"


def long_round_name(job: str) -> str:
    return names.child_name(job, LONG_ROUND_SUFFIX)


def queue_of(spec: RLTrainingJobSpec) -> str | None:
    return spec.scheduling.queue_name


def long_round_queue(spec: RLTrainingJobSpec) -> str | None:
    """The LocalQueue a long round's extra replicas are asked from (None: no Kueue)."""
    if spec.scheduling.queue_name is None:
        return None
    return spec.tail_batching.long_round.queue_name or spec.scheduling.queue_name


@dataclass(frozen=True)
class Placement:
    """What an admitted flavor adds to one role's pods (ResourceFlavor nodeLabels and
    tolerations)."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Obj, ...] = ()


@dataclass(frozen=True)
class QueueView:
    """What the operator saw of a job's Workload (one of the two)."""

    #: Kueue's Workload API is served (False: Kueue is not installed)
    installed: bool = True
    exists: bool = False
    #: quota reserved and admitted, and not being evicted
    admitted: bool = False
    #: the Evicted condition's reason and message while True
    evicted: tuple[str, str] | None = None
    #: quota still held (QuotaReserved True): what an eviction must give back
    reserved: bool = False
    finished: bool = False
    #: Kueue's latest word (the QuotaReserved condition's message; the ClusterQueue admitted)
    message: str = ""
    cluster_queue: str | None = None
    #: pod set -> resource -> flavor name, while admitted
    flavors: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: pod set -> count (what the Workload asks for)
    counts: Mapping[str, int] = field(default_factory=dict)
    #: False: a Workload of that name that the job does not own (never touched)
    owned: bool = True
    #: held by the burst pool's order: the ask it waits behind (module doc)
    held_by: str | None = None


NOT_INSTALLED = QueueView(installed=False)
ABSENT = QueueView()


def _cond(wl: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for c in (wl.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c  # type: ignore[no-any-return]
    return None


def _true(wl: Mapping[str, Any], type_: str) -> bool:
    c = _cond(wl, type_)
    return c is not None and c.get("status") == "True"


def parse(wl: Mapping[str, Any] | None) -> QueueView:
    """The view of a Workload as read (None: absent)."""
    if wl is None:
        return ABSENT
    status = wl.get("status") or {}
    admission = status.get("admission") or None
    reserved = _true(wl, QUOTA_RESERVED) and admission is not None
    ev = _cond(wl, EVICTED)
    evicted = ((str(ev.get("reason") or ""), str(ev.get("message") or ""))
               if ev is not None and ev.get("status") == "True" else None)
    qr = _cond(wl, QUOTA_RESERVED)
    message = str((qr or {}).get("message") or "")
    flavors: dict[str, dict[str, str]] = {}
    cq = None
    if admission is not None:
        cq = admission.get("clusterQueue")
        for psa in admission.get("podSetAssignments") or []:
            flavors[str(psa.get("name"))] = {str(k): str(v)
                                             for k, v in (psa.get("flavors") or {}).items()}
    counts = {str(ps.get("name")): int(ps.get("count") or 0)
              for ps in (wl.get("spec") or {}).get("podSets") or []}
    held_by = _held_by(wl)
    if held_by is not None:
        message = (f"held behind {held_by}, a higher-priority long round waiting for the same"
                   " ClusterQueue (rlpacer's pool order: priority first)")
    return QueueView(
        exists=True,
        admitted=reserved and _true(wl, ADMITTED) and evicted is None,
        evicted=evicted, reserved=reserved, finished=_true(wl, FINISHED),
        message=message, cluster_queue=cq, flavors=flavors, counts=counts, held_by=held_by,
    )


def _held_by(wl: Mapping[str, Any]) -> str | None:
    """The ask a Workload is held behind (None: not held by the pool's order)."""
    if (wl.get("spec") or {}).get("active", True) is not False:
        return None
    held = ((wl.get("metadata") or {}).get("annotations") or {}).get(HELD_BY_ANNOTATION)
    return str(held) if held else None


@dataclass(frozen=True)
class PoolAsk:
    """A long round's Workload as the burst pool's order sees it."""

    namespace: str
    name: str
    #: the LocalQueue it asks in (its namespace's)
    local_queue: str
    priority: int
    #: creationTimestamp as written (RFC 3339 UTC: sorts as text)
    created: str
    #: quota reserved (admitted, or an eviction not yet given back): not waiting
    reserved: bool
    #: Kueue found it larger than the ClusterQueue can ever hold
    never_fits: bool
    #: the ask it is held behind now (None: active, or inactive for another reason)
    held_by: str | None
    active: bool = True

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def pool_ask(wl: Mapping[str, Any]) -> PoolAsk | None:
    """A Workload as a pool ask (None: not a long round's, finished, or being deleted)."""
    meta = wl.get("metadata") or {}
    spec = wl.get("spec") or {}
    sets = spec.get("podSets") or []
    if (not str(meta.get("name") or "").endswith("-" + LONG_ROUND_SUFFIX) or len(sets) != 1
            or sets[0].get("name") != LONG_ROUND_POD_SET or _true(wl, FINISHED)
            or meta.get("deletionTimestamp")):
        return None
    qr = _cond(wl, QUOTA_RESERVED)
    return PoolAsk(
        namespace=str(meta.get("namespace") or ""), name=str(meta.get("name")),
        local_queue=str(spec.get("queueName") or ""), priority=int(spec.get("priority") or 0),
        created=str(meta.get("creationTimestamp") or "~"),  # not yet made: after every other
        reserved=_true(wl, QUOTA_RESERVED) and bool((wl.get("status") or {}).get("admission")),
        never_fits=NEVER_FITS in str((qr or {}).get("message") or ""),
        held_by=_held_by(wl), active=spec.get("active", True) is not False,
    )


def pool_holds(asks: list[PoolAsk]) -> dict[str, str | None]:
    """The burst pool's order (module doc) over one ClusterQueue's long-round asks: for each
    waiting ask, the ask it must wait behind (None: free to be admitted by Kueue's order).
    Reserved asks are not waiting, nor are asks inactive for another reason than this order
    (Kueue's own deactivation): neither is in the answer."""
    waiting = [a for a in asks if not a.reserved and (a.active or a.held_by is not None)]
    blockers = [a for a in waiting if not a.never_fits]
    if not blockers:
        return {a.key: None for a in waiting}
    top = max(a.priority for a in blockers)
    first = min((a for a in blockers if a.priority == top), key=lambda a: (a.created, a.key))
    return {a.key: (first.key if a.priority < top else None) for a in waiting}


def admission_wait(wl: Mapping[str, Any]) -> float | None:
    """Seconds from the Workload's creation to its latest admission (None: not admitted,
    or the times are not readable)."""
    adm = _cond(wl, ADMITTED)
    created = (wl.get("metadata") or {}).get("creationTimestamp")
    if adm is None or adm.get("status") != "True" or not created:
        return None
    try:
        t0 = datetime.fromisoformat(str(created).replace("Z", "+00:00"))
        t1 = datetime.fromisoformat(str(adm.get("lastTransitionTime")).replace("Z", "+00:00"))
    except ValueError:
        return None
    return max(0.0, (t1 - t0).total_seconds())


def flavor_names(view: QueueView) -> set[str]:
    return {f for per in view.flavors.values() for f in per.values()}


def placement(view: QueueView, flavors: Mapping[str, Mapping[str, Any]]) -> dict[str, Placement]:
    """Per pod set (role), the admitted flavors' node labels and tolerations
    (``flavors``: ResourceFlavor name -> its spec)."""
    out: dict[str, Placement] = {}
    for pod_set, per_resource in view.flavors.items():
        sel: dict[str, str] = {}
        tol: list[Obj] = []
        for name in sorted(set(per_resource.values())):
            spec = flavors.get(name) or {}
            sel.update({str(k): str(v) for k, v in (spec.get("nodeLabels") or {}).items()})
            for t in spec.get("tolerations") or []:
                if t not in tol:
                    tol.append(dict(t))
        out[pod_set] = Placement(node_selector=sel, tolerations=tuple(tol))
    return out


def _template(pod_spec: Mapping[str, Any], extra_selector: Mapping[str, str] | None = None
              ) -> Obj:
    """A pod set's template: what Kueue reads of a pod (resources, where it may run)."""
    containers = []
    for c in pod_spec.get("containers") or []:
        res = copy.deepcopy(c.get("resources") or {})
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        for k, v in limits.items():  # as the API server defaults a pod's requests
            requests.setdefault(k, v)
        if requests:
            res["requests"] = requests
        out: Obj = {"name": c["name"], "image": c["image"]}
        if res:
            out["resources"] = res
        containers.append(out)
    spec: Obj = {"containers": containers,
                 "restartPolicy": pod_spec.get("restartPolicy", "Always")}
    selector = {**(pod_spec.get("nodeSelector") or {}), **(extra_selector or {})}
    if selector:
        spec["nodeSelector"] = selector
    for key in ("tolerations", "priorityClassName"):
        if pod_spec.get(key):
            spec[key] = copy.deepcopy(pod_spec[key])
    return {"spec": spec}


def _meta(job: str, namespace: str, uid: str, name: str, api_version: str, kind: str) -> Obj:
    return {
        "name": name,
        "namespace": namespace,
        "labels": names.labels(job),
        "ownerReferences": [{"apiVersion": api_version, "kind": kind, "name": job, "uid": uid,
                             "controller": True, "blockOwnerDeletion": True}],
    }


def _spec(spec: RLTrainingJobSpec, queue: str, priority: int | None,
          pod_sets: list[Obj]) -> Obj:
    out: Obj = {"queueName": queue, "podSets": pod_sets}
    if spec.scheduling.priority_class_name and priority is not None:
        out["priorityClassRef"] = {"group": PRIORITY_CLASS_GROUP, "kind": PRIORITY_CLASS_KIND,
                                   "name": spec.scheduling.priority_class_name}
        out["priority"] = priority
    return out


def pod_set_counts(spec: RLTrainingJobSpec) -> dict[str, int]:
    """The job's pod sets and their counts as its Workload asks for them."""
    return {contract.Role.HEAD.value: 1, contract.Role.LEARNER.value: spec.trainer.replicas,
            contract.Role.ROLLOUT.value: spec.rollout.replicas, contract.Role.DRIVER.value: 1}


def job_workload(job: str, namespace: str, uid: str, spec: RLTrainingJobSpec,
                 pod_specs: Mapping[contract.Role, Mapping[str, Any]], priority: int | None,
                 api_version: str, kind: str) -> Obj:
    """The job's Workload: one pod set per role, counted as the job runs its short rounds.
    ``pod_specs``: each role's pod spec as the builders make it."""
    queue = queue_of(spec)
    assert queue is not None
    pod_sets = [{"name": role, "count": n,
                 "template": _template(pod_specs[contract.Role(role)])}
                for role, n in pod_set_counts(spec).items()]
    return {"apiVersion": API_VERSION, "kind": "Workload",
            "metadata": _meta(job, namespace, uid, workload_name(job), api_version, kind),
            "spec": _spec(spec, queue, priority, pod_sets)}


def long_round_workload(job: str, namespace: str, uid: str, spec: RLTrainingJobSpec,
                        rollout_pod_spec: Mapping[str, Any], extra: int, priority: int | None,
                        rollout_placement: Placement | None, api_version: str, kind: str
                        ) -> Obj:
    """A long round's extra rollout replicas, on the node labels of the rollout flavor the
    job was admitted with (the StatefulSet has one template)."""
    queue = long_round_queue(spec)
    assert queue is not None and extra > 0
    sel = dict(rollout_placement.node_selector) if rollout_placement else {}
    pod_sets = [{"name": LONG_ROUND_POD_SET, "count": extra,
                 "template": _template(rollout_pod_spec, sel)}]
    return {"apiVersion": API_VERSION, "kind": "Workload",
            "metadata": _meta(job, namespace, uid, long_round_name(job), api_version, kind),
            "spec": _spec(spec, queue, priority, pod_sets)}


def _set(conds: list[Obj], type_: str, status: str, reason: str, message: str, now: str,
         generation: int | None) -> None:
    for c in conds:
        if c.get("type") == type_:
            if c.get("status") != status:
                c["lastTransitionTime"] = now
            c.update(status=status, reason=reason, message=message[:32768])
            if generation is not None:
                c["observedGeneration"] = generation
            return
    new: Obj = {"type": type_, "status": status, "reason": reason, "message": message[:32768],
                "lastTransitionTime": now}
    if generation is not None:
        new["observedGeneration"] = generation
    conds.append(new)


def give_back(wl: Mapping[str, Any], now: str) -> Obj:
    """The Workload with its quota given back after an eviction, as Kueue's job reconciler
    writes it once the job's pods are gone: QuotaReserved and Admitted False, the admission
    cleared, Requeued True after a preemption or a node failure (Kueue queues it again)."""
    out = copy.deepcopy(dict(wl))
    status = out.setdefault("status", {})
    conds = status.setdefault("conditions", [])
    gen = (out.get("metadata") or {}).get("generation")
    ev = _cond(out, EVICTED) or {}
    reason, msg = str(ev.get("reason") or "Evicted"), str(ev.get("message") or "evicted")
    _set(conds, REQUEUED, "True" if reason in REQUEUE_REASONS else "False", reason, msg, now,
         gen)
    _set(conds, QUOTA_RESERVED, "False", "Pending", msg, now, gen)
    if _cond(out, ADMITTED) is not None:
        _set(conds, ADMITTED, "False", "NoReservation", "The workload has no reservation", now,
             gen)
    status.pop("admission", None)  # a PUT of the status: absent is cleared
    return out


def finish(wl: Mapping[str, Any], succeeded: bool, message: str, now: str) -> Obj:
    """The Workload marked Finished (Kueue releases its quota)."""
    out = copy.deepcopy(dict(wl))
    conds = out.setdefault("status", {}).setdefault("conditions", [])
    gen = (out.get("metadata") or {}).get("generation")
    _set(conds, FINISHED, "True", "Succeeded" if succeeded else "Failed", message, now, gen)
    return out
