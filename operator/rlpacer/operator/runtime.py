"""Per-job runtime: the one path through which the operator writes a job's status.

Every status write, from the reconciler or from a step report, goes through
:meth:`Jobs.commit` under the job's asyncio lock:

1. run a *pure* mutation (``decide`` or ``accept_report``) on the last known status;
2. ``PUT .../status`` the whole new status with ``metadata.resourceVersion`` of that status
   (optimistic concurrency: the API server answers 409 if anyone wrote the object since);
3. on 409, re-read the object and re-run the mutation on what is really stored (a concurrent
   writer, e.g. a second operator replica in a split brain, can never lose an update: its
   controller state is the input of our retry);
4. only after the write succeeded does the caller answer the step report or apply children.

The status is the durable truth (attempt, controller state, desired rollout replicas); the
children are applied from it after each successful write, so a crash between the two is
repaired by the next reconcile without double counting.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import json
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlpacer.api import contract
from rlpacer.api import job as job_api
from rlpacer.api.job import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    ManifestError,
    RLTrainingJobSpec,
    read_spec,
)
from rlpacer.api.policy import RLTrainingPolicy
from rlpacer.api.protocol import RolloutState
from rlpacer.api.status import (
    MAX_TOKEN_HASHES,
    ConditionType,
    Reason,
    RLTrainingJobStatus,
    is_terminal,
    is_true,
    read_status,
    set_condition,
    summarize,
)
from rlpacer.control.plan import JobController
from rlpacer.operator import builders, enforce, names, queue, scaler
from rlpacer.operator.decide import (
    Decision,
    Observed,
    StateUnreadable,
    decide,
    load_controller,
    recover_controller_state,
    restart_attempt,
)
from rlpacer.operator.kube import (
    METADATA_ONLY,
    ApiError,
    ChildRefused,
    KubeClient,
    object_path,
)
from rlpacer.operator.kueue import POLL_SECONDS, WATCHED_POLL_SECONDS, Kueue
from rlpacer.operator.metrics import Metrics
from rlpacer.operator.policies import PolicyCache
from rlpacer.operator.scaler import Event
from rlpacer.operator.settings import OperatorSettings
from rlpacer.operator.timeutil import fmt_time, utcnow

log = logging.getLogger("rlpacer.operator")

T = TypeVar("T")
MAX_CAS_RETRIES = 10
#: The resourceVersions of a job this process wrote or read, remembered to tell someone
#: else's write apart on the job watch (which may lag behind a burst of status writes).
KNOWN_RVS = 64
#: How long after the job watch shows a resourceVersion this process does not know it looks
#: again before taking it for someone else's write: the watch event of the operator's own
#: status write may arrive before the write's answer does.
FOREIGN_WRITE_CHECK_S = 0.25



def last_error_line(log_tail: str, limit: int = 1024) -> str:
    """The driver's error from its termination message (the log's tail): the last line that
    starts with ``error:``, else the last non-empty line; at most ``limit`` characters."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:")]
    line = (errs or lines or [""])[-1].removeprefix("error:").strip()
    return line[:limit]

class JobGone(Exception):
    """The job does not exist (any more)."""


class ConflictLoop(Exception):
    """Too many write conflicts in a row (the caller answers 503; the driver retries)."""


def job_path(namespace: str, name: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"


@dataclass
class JobRuntime:
    namespace: str
    name: str
    uid: str = ""
    rv: str = ""
    generation: int | None = None
    raw_spec: dict[str, Any] = field(default_factory=dict)
    spec: RLTrainingJobSpec | None = None
    spec_error: str | None = None
    status: RLTrainingJobStatus = field(default_factory=RLTrainingJobStatus)
    token: str | None = None
    #: The job's Ray token, as read from or written to its Secret by this process.
    ray_token: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: name -> canonical JSON of the child last applied (skip unchanged applies; cleared on
    #: a child's deletion and every reapply_seconds so drift is repaired).
    applied: dict[str, str] = field(default_factory=dict)
    #: name -> :func:`child_version` of the child as the last apply left it: a watch event
    #: with another version is someone else's change, re-applied on the next pass.
    applied_version: dict[str, str] = field(default_factory=dict)
    #: time.monotonic() of the last full pass; -inf: the first pass is a full one, whatever
    #: the machine's uptime (monotonic time starts at boot, and may be below reapply_seconds)
    applied_at: float = float("-inf")
    #: (controllerState, the live controller in exactly that state): saves restoring the
    #: controller from JSON on every report. Taken (removed) by the writer that uses it, so
    #: a failed write can never leave a controller ahead of the persisted state.
    live: tuple[str, JobController] | None = None
    #: The token hash this process last tried to record in status (see _record_token_hash).
    hash_tried: str | None = None
    #: The job's step-report request budget (``rlpacer.operator.server.TokenBucket``).
    bucket: Any = None
    #: The unknown report fields last logged for this job (logged again only when they change).
    unknown_logged: tuple[str, ...] = ()
    #: the API server pruned status.rollout.readyOrdinals (a CRD older than the operator):
    #: no longer observed, so the plans carry no usableReplicas and no pass writes for it
    ordinals_pruned: bool = False
    #: The last child refusal reported (Event and warning) for this job: the same refusal
    #: again is not reported again; cleared by a pass that applies every child.
    refused: str | None = None
    #: What of the stored status this operator could not read (logged when it changes).
    status_left_out: list[str] = field(default_factory=list)
    #: What the last pass saw of the children (:meth:`Jobs.observe`: the observation and the
    #: driver pod), reused by a pass that no event of a child preceded: the children are
    #: watched (Kopf's events set ``children_changed``), so an idle job's periodic pass makes
    #: no request. None: look.
    observation: tuple[Observed, dict[str, Any] | None] | None = None
    children_changed: bool = True
    #: The next pass reads the job again, whatever the watch says (set when the API server
    #: refused a write because the job's namespace is going: the job may be gone with it,
    #: its DELETED event late or lost).
    reread: bool = False
    #: The job's Kueue Workloads as the last observation read them ("job", "long"; None:
    #: absent), for the status writes an eviction or the job's end makes.
    workload_objs: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    #: Whether the last pass saw each Workload ("job", "long_round") admitted: an admission
    #: this process sees happen is counted (rlpacer_queue_wait_seconds) and announced.
    workload_admitted: dict[str, bool] = field(default_factory=dict)

    #: :func:`status_shape` of a status the API server stored exactly as this process sent
    #: it: a write of a status of this shape needs no echo of the stored object.
    verified_shape: frozenset[str] | None = None
    #: The resourceVersions this process last wrote or read the job at (:meth:`foreign`).
    known_rvs: deque[str] = field(default_factory=lambda: deque(maxlen=KNOWN_RVS))

    def foreign(self, resource_version: str) -> bool:
        """Whether ``resource_version`` is one this process neither wrote nor read: someone
        else wrote the job (a user's edit of its status or spec, another replica)."""
        return resource_version != self.rv and resource_version not in self.known_rvs

    def _know(self) -> None:
        if self.rv and (not self.known_rvs or self.known_rvs[-1] != self.rv):
            self.known_rvs.append(self.rv)

    def take_controller(self, state: str | None) -> JobController | None:
        live, self.live = self.live, None
        return live[1] if live is not None and state is not None and live[0] == state else None

    def peek_controller(self, state: str | None) -> JobController | None:
        live = self.live
        return live[1] if live is not None and state is not None and live[0] == state else None

    def keep_controller(self, ctl: JobController | None) -> None:
        """After a successful write: ``ctl`` is in the state just persisted."""
        state = self.status.controller_state
        self.live = (state, ctl) if ctl is not None and state is not None else None

    def absorb(self, obj: dict[str, Any], status: RLTrainingJobStatus | None = None) -> None:
        """Take the job as read from the API server. ``status``: the model of
        ``obj["status"]`` when the caller has it (saves validating it again)."""
        meta = obj.get("metadata", {})
        uid = meta.get("uid", "")
        if self.uid and uid != self.uid:
            self.token = self.ray_token = None  # a new object with the same name
        self.uid = uid
        self.rv = meta.get("resourceVersion", "")
        self._know()
        self.generation = meta.get("generation")
        raw_spec = obj.get("spec") or {}
        if raw_spec != self.raw_spec or self.spec is None:
            self.raw_spec = raw_spec
            try:
                self.spec, ignored = read_spec(raw_spec)
                self.spec_error = None
            except ManifestError as err:
                self.spec, self.spec_error, ignored = None, str(err), []
            if ignored:  # written under a newer schema (this operator is older than the CRD)
                log.warning("%s/%s: spec fields this operator does not know, ignored: %s",
                            self.namespace, self.name, ", ".join(ignored))
        if status is not None:
            self.status = status
            return
        self.verified_shape = None  # read again: the next write checks the stored echo
        try:
            self.status, left_out = read_status(obj.get("status") or {})
        except ValueError:
            log.warning("%s/%s: unreadable status; starting from an empty one",
                        self.namespace, self.name)
            self.status, left_out = RLTrainingJobStatus(), []
        if left_out and left_out != self.status_left_out:
            # a newer operator's status: what this one cannot read is dropped on its next write
            log.warning("%s/%s: status fields this operator cannot read, left out: %s",
                        self.namespace, self.name, ", ".join(left_out))
        self.status_left_out = left_out

    def absorb_write(self, meta: dict[str, Any], status: RLTrainingJobStatus) -> None:
        """Take a status write's answer given as metadata only (``meta``) with the status
        written, which a write of a verified shape stores as sent. The spec cannot have
        changed: the write carried the resourceVersion it was read at."""
        self.rv = meta.get("resourceVersion", self.rv)
        self._know()
        self.status = status


def status_shape(wire: Any) -> frozenset[str]:
    """The field paths of a JSON value (lists: the union of their items', as ``path[]``):
    what the API server's pruning and defaulting act on."""
    out: set[str] = set()
    todo: list[tuple[str, Any]] = [("", wire)]
    while todo:
        path, v = todo.pop()
        if type(v) is dict:
            for k, x in v.items():
                q = path + "." + k
                out.add(q)
                if type(x) is dict or type(x) is list:
                    todo.append((q, x))
        else:  # a list
            item = path + "[]"
            todo.extend((item, x) for x in v if type(x) is dict or type(x) is list)
    return frozenset(out)


class Jobs:
    """All jobs this operator hosts, with the kube client and metrics they share."""

    def __init__(self, kube: KubeClient, settings: OperatorSettings, metrics: Metrics,
                 policies: PolicyCache | None = None) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        #: The namespaces' RLTrainingPolicies for run-time enforcement (None: not enforced).
        self.policies = policies
        #: Kueue's objects, for jobs that name a queue (rlpacer.operator.queue).
        self.kueue = Kueue(kube)
        #: The jobs' Workloads are watched (operator setting ``kueue`` and Kueue's API served
        #: at start): a queued job is then looked at every WATCHED_POLL_SECONDS, not
        #: POLL_SECONDS.
        self.kueue_watched = False
        #: The pool's order was refused by RBAC (logged once).
        self._pool_order_refused = False
        self._jobs: dict[tuple[str, str], JobRuntime] = {}
        self._loading: dict[tuple[str, str], asyncio.Lock] = {}
        #: The resourceVersion of each job last seen on the operator's job watch: a pass
        #: re-reads the job only when it differs from the one in memory (someone else wrote).
        self._seen_rv: dict[tuple[str, str], str] = {}
        #: The CA (PEM) of the step-report endpoint's certificate, for the jobs' ConfigMaps
        #: (None: plain HTTP). ``main.serve`` points it at the served certificate, which
        #: follows renewals.
        self.report_ca: Callable[[], str | None] = lambda: None
        #: Ask for the whole object in every status write's answer (the API server refused
        #: to answer one with metadata only).
        self.echo_writes = False

    # --- lookup -------------------------------------------------------------------------
    async def get(self, namespace: str, name: str) -> JobRuntime | None:
        key = (namespace, name)
        rt = self._jobs.get(key)
        if rt is not None:
            return rt
        lock = self._loading.setdefault(key, asyncio.Lock())
        async with lock:
            rt = self._jobs.get(key)
            if rt is not None:
                return rt
            obj = await self.kube.get(job_path(namespace, name))
            if obj is None:
                # no lock kept for a name that is no job (else every unknown name a client
                # tries would stay in memory)
                self._loading.pop(key, None)
                return None
            rt = JobRuntime(namespace, name)
            rt.absorb(obj)
            self._jobs[key] = rt
            return rt

    async def policies_for(self, namespace: str) -> list[RLTrainingPolicy] | None:
        """The namespace's policies (cached), or None: not enforced on this report."""
        return None if self.policies is None else await self.policies.get(namespace)

    def peek(self, namespace: str, name: str) -> JobRuntime | None:
        return self._jobs.get((namespace, name))

    def poke(self, namespace: str, name: str) -> None:
        rt = self._jobs.get((namespace, name))
        if rt is not None:
            rt.wake.set()

    def saw(self, namespace: str, name: str, resource_version: str) -> None:
        """The job watch saw this resourceVersion of the job. One this process did not write
        (nor read) is someone else's write: the job's loop is woken (after
        :data:`FOREIGN_WRITE_CHECK_S`, if still unknown then) and its pass reads the job
        again, so an edit of the status (a broken controller state) is acted on at once, not
        at the next full pass."""
        key = (namespace, name)
        self._seen_rv[key] = resource_version
        rt = self._jobs.get(key)
        if rt is None or not rt.foreign(resource_version):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: nobody to wake
            return
        loop.call_later(FOREIGN_WRITE_CHECK_S, self._foreign_write, rt, resource_version)

    def _foreign_write(self, rt: JobRuntime, resource_version: str) -> None:
        if self._jobs.get((rt.namespace, rt.name)) is rt and rt.foreign(resource_version):
            rt.wake.set()

    def child_event(self, namespace: str, job: str, kind: str, name: str,
                    event: str | None, meta: dict[str, Any]) -> None:
        """A watch event of one of the job's children (Kopf's handlers): the next pass looks
        at the children again; a deleted child, or one someone else changed (another
        :func:`child_version` than the operator's last apply left), is applied again."""
        rt = self._jobs.get((namespace, job))
        if rt is not None:
            rt.children_changed = True
            key = f"{kind}/{name}"
            if event == "DELETED":
                rt.applied.clear()  # re-apply everything on the next pass
            elif key in rt.applied_version and child_version(kind, meta) not in (
                    None, rt.applied_version[key]):
                rt.applied.pop(key, None)
                rt.applied_version.pop(key, None)
            rt.wake.set()

    def forget(self, namespace: str, name: str) -> None:
        self._jobs.pop((namespace, name), None)
        self._loading.pop((namespace, name), None)
        self._seen_rv.pop((namespace, name), None)
        self.metrics.forget(namespace, name)

    async def refresh(self, rt: JobRuntime) -> None:
        obj = await self.kube.get(job_path(rt.namespace, rt.name))
        if obj is None:
            raise JobGone(f"{rt.namespace}/{rt.name}")
        rt.absorb(obj)
        if rt.live is not None and rt.live[0] != rt.status.controller_state:
            # Someone else wrote the controller state, read here (e.g. on a write's conflict,
            # mid-pass): its resourceVersion is now known, so the watch's event of it wakes
            # nothing; the job's next pass, at once, checks it (and rebuilds it if broken).
            rt.wake.set()

    # --- the one status write path ------------------------------------------------------
    async def commit(
        self,
        rt: JobRuntime,
        mutate: Callable[[RLTrainingJobSpec, RLTrainingJobStatus], tuple[RLTrainingJobStatus, T]],
    ) -> T:
        """Run ``mutate`` and persist its status with a resourceVersion precondition;
        re-read and re-run on conflict. Caller holds ``rt.lock``."""
        for _ in range(MAX_CAS_RETRIES):
            if rt.spec is None:
                raise ManifestError(rt.spec_error or "invalid spec")
            new_status, result = mutate(rt.spec, rt.status)
            if new_status == rt.status:
                self.metrics.observe_status(rt.namespace, rt.name, rt.status)
                return result
            wire = new_status.to_wire()
            body = {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": {"name": rt.name, "namespace": rt.namespace,
                             "resourceVersion": rt.rv},
                "status": wire,
            }
            # The API server answers a write with the whole object unless asked for its
            # metadata only (the resourceVersion is all the next write needs): that saves
            # it encoding and this process parsing ~6 KB per report. The whole answer is
            # asked for when the status's shape (its set of field paths) is one not seen
            # stored as sent: a CRD older than this operator prunes the fields it lacks, and
            # only the stored status may then be kept.
            shape = status_shape(wire)
            echo = shape != rt.verified_shape or self.echo_writes
            t0 = time.perf_counter()
            try:
                obj = await self.kube.request(
                    "PUT", job_path(rt.namespace, rt.name) + "/status", body,
                    accept="application/json" if echo else METADATA_ONLY,
                )
            except ApiError as e:
                self.metrics.status_write.labels(
                    "conflict" if e.status == 409 else "error").observe(time.perf_counter() - t0)
                if e.status == 406 and not echo:
                    # an API server that cannot answer a write with metadata only (it
                    # negotiates the answer's type before writing: nothing was written)
                    log.warning("the API server answers status writes only with the whole"
                                " object (406 to metadata only): %s", e)
                    self.echo_writes = True
                    continue
                if e.status == 409:
                    await self.refresh(rt)
                    continue
                if e.status == 404:
                    raise JobGone(f"{rt.namespace}/{rt.name}") from e
                raise
            self.metrics.status_write.labels("ok").observe(time.perf_counter() - t0)
            if not echo:
                rt.absorb_write(obj.get("metadata") or {}, new_status)
            elif obj.get("status") == wire:
                # stored as sent (nothing pruned or defaulted): the model written is the status
                rt.verified_shape = shape
                rt.absorb(obj, new_status)
            else:
                rt.absorb(obj)
            self.metrics.observe_status(rt.namespace, rt.name, rt.status)
            return result
        raise ConflictLoop(f"{rt.namespace}/{rt.name}: {MAX_CAS_RETRIES} write conflicts")

    # --- token --------------------------------------------------------------------------
    async def token(self, rt: JobRuntime) -> str | None:
        """The job's step-report token (from its Secret; None if not created yet)."""
        if rt.token is None:
            sec = await self.kube.get(
                object_path("v1", "secrets", rt.namespace, names.secret(rt.name))
            )
            if sec is not None and _owned_by(sec, rt.uid):
                rt.token = base64.b64decode(sec["data"][contract.TOKEN_KEY]).decode()
        return rt.token

    async def check_token(self, rt: JobRuntime, presented: str) -> bool:
        """Whether ``presented`` is a token of this job: one whose hash is in
        ``status.tokenHashes`` (survives the Secret's deletion and operator restarts), or,
        for a job whose status has none yet (made by an older operator), its Secret's."""
        hashes = rt.status.token_hashes
        if hashes:
            h = token_hash(presented)
            return any(hmac.compare_digest(h, k) for k in hashes)
        tok = await self.token(rt)
        return tok is not None and hmac.compare_digest(tok.encode(), presented.encode())

    async def _ensure_token(self, rt: JobRuntime, inputs: builders.BuildInputs) -> None:
        """Make sure the job's token Secret exists and its token's hash is in status.

        Checked (one GET) whenever the applied cache was cleared: on the Secret's deletion
        event and every ``reapply_seconds``. A deleted Secret is re-created with the token
        this process knows, so the running driver (which read its token once) and the next
        attempts agree. Only a token that is lost (the Secret deleted while no operator
        held it in memory) is replaced by a new one; the old hash stays in status, so the
        running driver keeps reporting.
        """
        key = f"Secret/{names.secret(rt.name)}"
        if key in rt.applied:
            return
        path = object_path("v1", "secrets", rt.namespace, names.secret(rt.name))
        sec = await self.kube.get(path)
        if sec is not None:
            if not _owned_by(sec, rt.uid):
                log.warning("%s/%s: Secret %s is not this job's; not using it", rt.namespace,
                            rt.name, names.secret(rt.name))
                return
            rt.token = base64.b64decode(sec["data"][contract.TOKEN_KEY]).decode()
            await self._record_token_hash(rt, rt.token)
            rt.applied[key] = ""
            return
        tok = rt.token
        if tok is None or (rt.status.token_hashes
                           and token_hash(tok) not in rt.status.token_hashes):
            tok = secrets.token_urlsafe(32)
            if rt.status.token_hashes:
                log.warning("%s/%s: token Secret lost while its token was unknown; a new"
                            " token for new pods, the running driver's stays valid",
                            rt.namespace, rt.name)
        else:
            log.info("%s/%s: re-creating the token Secret with the same token", rt.namespace,
                     rt.name)
        # Hash first: a pod can never mount a token the endpoint would refuse.
        await self._record_token_hash(rt, tok)
        try:
            await self.kube.create(builders.token_secret(inputs, tok))
            rt.token = tok
        except ApiError as e:
            if e.status != 409:
                raise
            rt.token = None
            return  # created meanwhile: read (and its hash recorded) on the next pass
        rt.applied[key] = ""

    async def _record_token_hash(self, rt: JobRuntime, tok: str) -> None:
        h = token_hash(tok)
        if h in rt.status.token_hashes or rt.hash_tried == h:
            return

        def mutate(
            spec: RLTrainingJobSpec, st: RLTrainingJobStatus
        ) -> tuple[RLTrainingJobStatus, None]:
            if h in st.token_hashes:
                return st, None
            new = st.model_copy(deep=True)
            new.token_hashes = [*st.token_hashes, h][-MAX_TOKEN_HASHES:]
            return new, None

        async with rt.lock:
            await self.commit(rt, mutate)
        # Written once per token and process: with a CRD older than the operator the API
        # server prunes the field, and a write on every pass would follow.
        rt.hash_tried = h

    # --- Ray token ----------------------------------------------------------------------
    async def _ensure_ray_token(self, rt: JobRuntime, inputs: builders.BuildInputs) -> str | None:
        """Make sure the job's Ray-token Secret exists; return its token (None: the Secret of
        that name is not this job's, or has no token).

        Every pod of the job mounts this Secret, so every Ray process of the job presents the
        same token. The token is minted once per job and kept in the Secret (immutable); a
        deleted Secret is re-created with the token this process knows (from the Secret, read
        on its first pass), so the running Ray cluster and new pods agree. Only a token that is
        lost (the Secret deleted while no operator held it in memory: there is no other copy,
        on purpose; status is readable by anyone who can read the job) is replaced by a new
        one: every pod then carries the new token's hash (builders), so the StatefulSets roll
        their pods, and a driver still running with the old token is restarted as a new
        attempt that does not count against backoffLimit (:meth:`reconcile`). A job made by
        an older operator (no such Secret) gets one this way on its first pass.
        """
        key = f"Secret/{names.ray_secret(rt.name)}"
        if key in rt.applied and rt.ray_token is not None:
            return rt.ray_token
        path = object_path("v1", "secrets", rt.namespace, names.ray_secret(rt.name))
        sec = await self.kube.get(path)
        if sec is None:
            tok = rt.ray_token
            if tok is None:
                tok = secrets.token_hex(32)
                log.info("%s/%s: minting the job's Ray token", rt.namespace, rt.name)
            else:
                log.info("%s/%s: re-creating the Ray-token Secret with the same token",
                         rt.namespace, rt.name)
            try:
                await self.kube.create(builders.ray_token_secret(inputs, tok))
            except ApiError as e:
                if e.status != 409:
                    raise
                sec = await self.kube.get(path)  # created meanwhile: that one is the token
                if sec is None:
                    raise
            else:
                rt.ray_token = tok
                rt.applied[key] = ""
                return tok
        if not _owned_by(sec, rt.uid):
            log.warning("%s/%s: Secret %s is not this job's; not using it", rt.namespace,
                        rt.name, names.ray_secret(rt.name))
            return None
        raw = (sec.get("data") or {}).get(contract.RAY_TOKEN_KEY)
        if not raw:
            log.warning("%s/%s: Secret %s has no %r", rt.namespace, rt.name,
                        names.ray_secret(rt.name), contract.RAY_TOKEN_KEY)
            return None
        rt.ray_token = base64.b64decode(raw).decode()
        rt.applied[key] = ""
        return rt.ray_token

    async def _restart_attempt(
        self, rt: JobRuntime, inputs: builders.BuildInputs, why: str
    ) -> builders.BuildInputs:
        """Stop the current attempt's driver and start the next attempt (not counted against
        backoffLimit); the inputs of the new attempt. The driver pod is deleted before the
        status write: a crash in between leaves a driver that is gone or failed, which the
        next pass handles as any other (re-created, or a counted failure)."""
        old = inputs.attempt
        log.warning("%s/%s: %s; restarting attempt %d as %d", rt.namespace, rt.name, why,
                    old, old + 1)
        await self.kube.delete(object_path("v1", "pods", rt.namespace,
                                           names.driver_pod(rt.name, old)))
        now = utcnow()

        def mutate(
            spec: RLTrainingJobSpec, st: RLTrainingJobStatus
        ) -> tuple[RLTrainingJobStatus, Event | None]:
            if st.attempt != old:
                return st, None
            return restart_attempt(spec, st, why, now, rt.generation)

        async with rt.lock:
            ev = await self.commit(rt, mutate)
            inputs = dataclasses.replace(
                inputs, attempt=rt.status.attempt,
                rollout_replicas=rt.status.rollout.desired_replicas)
        if ev is not None:
            await self.post_events(rt, [ev])
        return inputs

    # --- events -------------------------------------------------------------------------
    async def post_events(self, rt: JobRuntime, events: list[Event]) -> None:
        for ev in events:
            now = fmt_time(utcnow())
            body = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{rt.name[:200]}.", "namespace": rt.namespace},
                "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": rt.name,
                                   "namespace": rt.namespace, "uid": rt.uid},
                "reason": ev.reason,
                "message": ev.message[:1024],
                "type": ev.type,
                "source": {"component": "rlpacer-operator"},
                "reportingComponent": "rlpacer.io/operator",
                "reportingInstance": self.settings.identity[:128],
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
            try:
                await self.kube.request(
                    "POST", f"/api/v1/namespaces/{rt.namespace}/events", body
                )
            except Exception as e:  # Events are best effort
                log.warning("event %s on %s/%s not posted: %s", ev.reason, rt.namespace,
                            rt.name, e)
            if ev.reason in ("ScalingUp", "ScaledDown", "ScaleUpTimedOut"):
                self.metrics.scale_actions.labels(rt.namespace, rt.name).inc()

    # --- reconcile ----------------------------------------------------------------------
    async def observe(self, rt: JobRuntime) -> tuple[Observed, dict[str, Any] | None]:
        """What decide() needs, and the current attempt's driver pod (None: absent)."""
        attempt = rt.status.attempt
        pod = await self.kube.get(
            object_path("v1", "pods", rt.namespace, names.driver_pod(rt.name, attempt))
        )
        phase, message, exit_code = None, "", None
        deleting, disruption = False, None
        if pod is not None and not _owned_by(pod, rt.uid):
            pod = None
        if pod is not None:
            st = pod.get("status") or {}
            phase = st.get("phase") or "Pending"  # None is for an absent pod
            message = st.get("message") or st.get("reason") or ""
            deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
            disruption = disruption_reason(pod)
            for cs in st.get("containerStatuses") or []:
                term = (cs.get("state") or {}).get("terminated")
                if term:
                    code, why = term.get("exitCode"), term.get("reason", "")
                    exit_code = code if isinstance(code, int) else None
                    if code in (contract.EXIT_DATA_INVALID,
                                contract.EXIT_LEARNER_DOES_NOT_FIT) and term.get("message"):
                        message = last_error_line(str(term["message"]))
                    message = message or f"exit code {code}: {why}"
        rollout_sts = names.rollout_statefulsets(rt.name)
        ready = 0
        wide = rt.spec is not None and job_api.wide_long_rounds(rt.spec)
        for sts_name in rollout_sts if wide else rollout_sts[:1]:
            sts = await self.kube.get(object_path(
                "apps/v1", "statefulsets", rt.namespace, sts_name))
            if sts is not None and _owned_by(sts, rt.uid):
                ready += int((sts.get("status") or {}).get("readyReplicas") or 0)
        # which rollout pods are Ready (the plan's usableReplicas): a timed-out scale-up may
        # leave a higher ordinal ready while a lower one is pending
        selector = ",".join(f"{k}={v}" for k, v in sorted(
            names.selector(rt.name, contract.Role.ROLLOUT).items()))
        listed = await self.kube.request(
            "GET", object_path("v1", "pods", rt.namespace, None),
            params={"labelSelector": selector})
        items = listed.get("items") or []
        ordinals = tuple(scaler.ready_ordinals(items, rollout_sts))
        seen = Observed(attempt=attempt, driver_phase=phase, driver_message=message,
                        driver_exit_code=exit_code, driver_deleting=deleting,
                        driver_disruption=disruption,
                        rollout_ready=ready, rollout_ordinals=ordinals)
        if rt.spec is not None and queue.queue_of(rt.spec) is not None:
            seen = await self._observe_queue(rt, seen, items, rollout_sts)
        return seen, pod

    async def _observe_queue(self, rt: JobRuntime, seen: Observed, rollout_items: list[Any],
                             rollout_sts: Sequence[str]) -> Observed:
        """The job's Kueue Workloads, and the pods an eviction waits for."""
        view, obj = await self.kueue.view(rt.namespace, queue.workload_name(rt.name), rt.uid)
        long_view, long_obj = queue.ABSENT, None
        if view.installed:
            long_view, long_obj = await self.kueue.view(
                rt.namespace, queue.long_round_name(rt.name), rt.uid)
        rt.workload_objs = {"job": obj, "long": long_obj}
        present = [i for i in (scaler.pod_ordinal(p, rollout_sts) for p in rollout_items)
                   if i is not None]
        job_pods = None
        if view.evicted is not None and view.reserved:
            listed = await self.kube.request(
                "GET", object_path("v1", "pods", rt.namespace, None),
                params={"labelSelector": ",".join(
                    f"{k}={v}" for k, v in sorted(names.selector(rt.name).items()))})
            job_pods = len(listed.get("items") or [])
        return dataclasses.replace(seen, queue=view, long_round_queue=long_view,
                                   job_pods=job_pods, rollout_pods=tuple(sorted(present)))

    async def reconcile(self, rt: JobRuntime) -> float | None:
        """One level-based pass; returns seconds until the next needed look (or None).

        The job's lock is held only around reading and writing its status, so step reports
        never wait for the child applies. Passes of one job never overlap (one loop task per
        job), so the applies, made from the status just written, are never stale.
        """
        self.metrics.reconciles.labels(rt.namespace, rt.name).inc()
        # Every reapply_seconds a full pass (everything read and re-applied: drift repair and
        # the safety net of the watches); otherwise the pass reads only what the watches say
        # changed, so an idle job costs no request.
        full = time.monotonic() - rt.applied_at > self.settings.reapply_seconds
        async with rt.lock:
            if (full or rt.reread or not rt.rv
                    or self._seen_rv.get((rt.namespace, rt.name)) != rt.rv):
                await self.refresh(rt)
                rt.reread = False
        if rt.spec is None:
            async with rt.lock:
                await self._invalid(rt)
            return None
        await self._recover_state(rt)
        seen = rt.observation
        # While a scale-up pends, every pass looks: its deadline is decided on the replicas
        # ready now, not on the last event's view (a short, rare state: no cost at rest).
        pending = rt.status.rollout.state == RolloutState.SCALING_UP.value
        # A live job's driver last seen absent is looked at again: an absent driver whose
        # attempt reported is taken as gone (a new attempt), which must never follow from a
        # view older than the pod (created by the last pass, its watch event not in yet).
        no_driver = (seen is not None and seen[1] is None and not rt.spec.suspend
                     and not is_terminal(rt.status.conditions))
        # A job that names a Kueue queue looks at its Workloads on every pass (Kueue's
        # decisions come with no event of the job's children).
        queued = queue.queue_of(rt.spec) is not None
        if (full or pending or no_driver or queued or rt.children_changed or seen is None
                or seen[0].attempt != rt.status.attempt):
            rt.children_changed = False  # an event from now on is seen by the next pass
            try:
                seen = await self.observe(rt)
            except BaseException:
                rt.children_changed = True
                raise
            rt.observation = seen
        observed, driver = seen
        now = utcnow()

        if rt.ordinals_pruned:
            observed = dataclasses.replace(observed, rollout_ordinals=None)
        # the policies as they are now (cached): a tightened one cuts a pending scale-up
        policies = await self.policies_for(rt.namespace)

        def mutate(
            spec: RLTrainingJobSpec, st: RLTrainingJobStatus
        ) -> tuple[RLTrainingJobStatus, Decision]:
            cap = None if policies is None else enforce.limits(spec, policies).long_round_replicas
            obs = dataclasses.replace(observed, long_round_cap=cap)
            if st.attempt != observed.attempt:  # the driver seen belongs to another attempt
                obs = Observed(attempt=st.attempt, rollout_ready=observed.rollout_ready,
                               rollout_ordinals=observed.rollout_ordinals, long_round_cap=cap,
                               driver_looked=False, queue=observed.queue,
                               long_round_queue=observed.long_round_queue)
            d = decide(spec, st, obs, now, rt.generation)
            return d.status, d

        async with rt.lock:
            dec = await self.commit(rt, mutate)
            if (observed.rollout_ordinals is not None
                    and rt.status.rollout.ready_ordinals is None):
                rt.ordinals_pruned = True  # written once, dropped by the API server
            spec = rt.spec
            inputs = builders.BuildInputs(
                name=rt.name, namespace=rt.namespace, uid=rt.uid, spec=spec,
                attempt=rt.status.attempt,
                rollout_replicas=rt.status.rollout.desired_replicas,
                report_url=self.settings.pod_report_url(),
                workloads=dec.workloads,
                report_ca=self.report_ca(),
                network=self.settings.job_network(),
            )
        poll = None
        if queue.queue_of(spec) is not None:
            inputs, poll = await self._sync_queue(rt, inputs, observed, dec.events)
            if poll is not None:
                dec.requeue_after = min(poll, dec.requeue_after or poll)
        if dec.events:
            await self.post_events(rt, dec.events)
        if dec.delete_job:
            log.info("%s/%s: ttlSecondsAfterFinished passed; deleting", rt.namespace, rt.name)
            await self.kube.delete(job_path(rt.namespace, rt.name))
            return None
        if dec.keep_children:
            # evicted, within checkpoint.evictionGraceSeconds: the pods stay as they are (not
            # re-applied: the admitted flavor's placement is gone) while the driver reaches
            # its next report, answered as its last
            return dec.requeue_after
        if full:
            rt.applied.clear()
            # jittered: jobs created (or loaded by a new leader) together do not make their
            # full passes together ever after
            rt.applied_at = time.monotonic() - random.uniform(0.0, 0.2) * (
                self.settings.reapply_seconds)
        await self._ensure_token(rt, inputs)
        ray_token = await self._ensure_ray_token(rt, inputs)
        if ray_token is not None:
            want = token_hash(ray_token)
            inputs = dataclasses.replace(inputs, ray_token_sha256=want)
            if dec.workloads and _runs_other_ray_token(driver, inputs.attempt, want):
                # Its Ray node cannot join the cluster the pods roll to (the Ray token was
                # replaced, or the job predates Ray tokens): a new attempt, not a failure.
                inputs = await self._restart_attempt(
                    rt, inputs, "the driver runs with another Ray token than the job's")
        for obj in builders.build_children(inputs):
            key = f"{obj['kind']}/{obj['metadata']['name']}"
            text = json.dumps(obj, sort_keys=True)
            if rt.applied.get(key) == text:
                continue
            if (obj["kind"] == "Pod" and driver is not None
                    and driver["metadata"]["name"] == obj["metadata"]["name"]):
                # The driver pod is applied only where this pass saw none: a pod's spec is
                # immutable (a changed report URL reaches the next attempt), and an apply
                # after its deletion would bring it back under an attempt that has reported,
                # whose steps a driver restarted from its checkpoint can no longer report
                # (decide starts a new attempt instead).
                rt.applied[key] = text
                continue
            try:
                out = await self.kube.apply(obj, self.settings.field_manager)
            except ApiError as e:
                if e.status in (400, 403, 422) and not namespace_terminating(e):
                    raise ChildRefused(obj["kind"], obj["metadata"]["name"], e) from None
                else:
                    raise
            rt.applied[key] = text
            version = child_version(obj["kind"], (out or {}).get("metadata") or {})
            if version is not None:
                rt.applied_version[key] = version
            else:
                rt.applied_version.pop(key, None)
        rt.refused = None
        if not dec.workloads:
            for api, plural, child in builders.workload_names(rt.name, inputs.attempt):
                if await self.kube.delete(object_path(api, plural, rt.namespace, child)):
                    rt.applied.clear()
        return dec.requeue_after

    def _saw_admission(self, rt: JobRuntime, which: str, view: queue.QueueView,
                       obj: dict[str, Any] | None) -> float | None:
        """Seconds the Workload waited, when this pass is the first to see it admitted after
        seeing it wait (None otherwise; a first look after a restart counts nothing)."""
        before = rt.workload_admitted.get(which)
        rt.workload_admitted[which] = view.admitted
        if before is not False or not view.admitted or obj is None:
            return None
        wait = queue.admission_wait(obj)
        if wait is not None:
            self.metrics.queue_wait.labels(rt.namespace, which).observe(wait)
        return wait

    async def _sync_queue(
        self, rt: JobRuntime, inputs: builders.BuildInputs, observed: Observed,
        events: list[Event],
    ) -> tuple[builders.BuildInputs, float | None]:
        """Kueue's side of the pass (``rlpacer.operator.queue``): make the job's Workload,
        give its quota back after an eviction once its pods are gone, mark it Finished when
        the job ends; place the pods on the admitted flavors; ask for a long round's extra
        replicas with a Workload of their own and grow the StatefulSet only once it is
        admitted. Returns the inputs to apply with, and when to look again (None: no need)."""
        spec, st = inputs.spec, rt.status
        view = observed.queue
        every = WATCHED_POLL_SECONDS if self.kueue_watched else POLL_SECONDS
        if view is None:
            return inputs, every
        lab = (rt.namespace, rt.name)
        if not view.installed:
            self.kueue.forget_served()
            return inputs, 10 * POLL_SECONDS  # Kueue may be installed later
        if not view.owned:
            return inputs, every  # someone else's Workload of the name: held, never touched
        self._saw_admission(rt, "job", view, rt.workload_objs.get("job"))
        now = fmt_time(utcnow())
        objs = rt.workload_objs
        long_view = observed.long_round_queue or queue.ABSENT
        if is_terminal(st.conditions):
            self.metrics.long_round_queued.labels(*lab).set(0)
            obj = objs.get("job")
            again = None
            if obj is not None and not view.finished:
                ok = is_true(st.conditions, ConditionType.SUCCEEDED)
                if not await self.kueue.put_status(queue.finish(
                        obj, ok, f"the job {summarize(st.conditions).value}", now)):
                    again = every  # changed since read: read again, write again
            await self._withdraw_long_round(rt, spec, long_view, events, "the job ended")
            return inputs, again
        if spec.suspend:
            # suspended: no Workload while the job is (it would hold its quota for nothing);
            # one holding quota is deactivated first, so that Kueue evicts it and the quota
            # goes back below once the pods are gone; resumed, the job queues again
            await self._withdraw_long_round(rt, spec, long_view, events, "the job is suspended")
            name = queue.workload_name(rt.name)
            if view.exists and not view.reserved:
                await self.kueue.delete(rt.namespace, name)
                rt.workload_admitted.pop("job", None)
                return inputs, None
            if view.exists and view.evicted is None:
                await self.kueue.deactivate(rt.namespace, name)
                return inputs, every
        pod_specs = {role: builders.pod_template_spec(inputs, role) for role in contract.Role}
        priority = await self.kueue.priority(spec.scheduling.priority_class_name)
        if not view.exists and spec.suspend:
            return inputs, None
        if not view.exists:
            await self.kueue.create(queue.job_workload(
                rt.name, rt.namespace, rt.uid, spec, pod_specs, priority, API_VERSION, KIND))
            rt.workload_admitted["job"] = False
            return inputs, every
        want = queue.pod_set_counts(spec)
        if view.counts != want:
            # the job's pods changed (an edit of its replicas): its Workload is asked again,
            # a reserved one given back first (deactivated, evicted, pods gone, returned)
            if not view.reserved:
                await self.kueue.delete(rt.namespace, queue.workload_name(rt.name))
                events.append(Event("Normal", "Requeued",
                                    f"the job's pods changed ({_counts(view.counts)} ->"
                                    f" {_counts(want)}): its Workload is asked again"))
                return inputs, every
            if view.evicted is None:
                await self.kueue.deactivate(rt.namespace, queue.workload_name(rt.name))
                return inputs, every
        poll: float | None = None
        if view.evicted is not None:
            obj = objs.get("job")
            if view.reserved and obj is not None and observed.job_pods == 0:
                # every pod gone: the quota goes back
                await self.kueue.put_status(queue.give_back(obj, now))
                log.info("%s/%s: evicted by Kueue; pods gone, quota given back",
                         rt.namespace, rt.name)
            poll = every
        if not view.admitted:
            self.metrics.long_round_queued.labels(*lab).set(0)
            await self._withdraw_long_round(rt, spec, long_view, events,
                                            "the job is not admitted (held or evicted)")
            return inputs, every
        placement = queue.placement(view, await self.kueue.flavors(queue.flavor_names(view)))
        inputs = dataclasses.replace(inputs, placement=placement)
        # a long round's extra replicas
        short = scaler.short_replicas(spec)
        extra = inputs.rollout_replicas - short
        long_name = queue.long_round_name(rt.name)
        if extra <= 0:
            self.metrics.long_round_queued.labels(*lab).set(0)
            rt.workload_admitted.pop("long_round", None)
            if (long_view.exists and long_view.owned
                    and await self.kueue.delete(rt.namespace, long_name)):
                events.append(Event("Normal", "LongRoundReleased",
                                    "the long round's extra rollout replicas went back: their"
                                    f" Workload {long_name} deleted (quota returned)"))
                await self._order_pool(rt, spec)
            return inputs, poll
        if not long_view.owned:  # someone else's Workload of the name: never touched
            return dataclasses.replace(inputs, rollout_replicas=short), every
        if not long_view.exists:
            ask = queue.long_round_workload(
                rt.name, rt.namespace, rt.uid, spec,
                builders.pod_template_spec(inputs, contract.Role.ROLLOUT, extra=True), extra,
                priority, placement.get(contract.Role.ROLLOUT.value), API_VERSION, KIND)
            behind = await self._order_pool(rt, spec, ask)
            if behind is not None:
                ask["metadata"]["annotations"] = {queue.HELD_BY_ANNOTATION: behind}
                ask["spec"]["active"] = False
            await self.kueue.create(ask)
            events.append(Event("Normal", "LongRoundQueued",
                                f"{extra} extra rollout replicas asked from Kueue (Workload"
                                f" {long_name}, queue {queue.long_round_queue(spec)})"
                                + (f", held behind {behind}: a higher-priority long round"
                                   " waits for the same ClusterQueue" if behind else "")))
            rt.workload_admitted["long_round"] = False
            long_view = queue.ABSENT
        elif long_view.counts.get(queue.LONG_ROUND_POD_SET) != extra:
            # asked for another count (a policy clamp): asked again
            await self.kueue.delete(rt.namespace, long_name)
            long_view = queue.ABSENT
        elif not long_view.admitted:
            await self._order_pool(rt, spec)  # held, let go, or holding others back
        waited = self._saw_admission(rt, "long_round", long_view, objs.get("long"))
        if waited is not None:
            events.append(Event("Normal", "LongRoundAdmitted",
                                f"Kueue admitted the long round's {extra} extra rollout"
                                f" replicas after {waited:.0f}s (ClusterQueue"
                                f" {long_view.cluster_queue})"))
            await self._order_pool(rt, spec)  # no longer waiting: lower asks may go
        self.metrics.long_round_queued.labels(*lab).set(0 if long_view.admitted else 1)
        if not long_view.admitted:
            # the extra replicas wait for Kueue; the scale-up's deadline runs meanwhile
            inputs = dataclasses.replace(inputs, rollout_replicas=short)
            obj = objs.get("long")
            if (long_view.evicted is not None and long_view.reserved and obj is not None
                    and observed.rollout_pods is not None
                    and all(i < short for i in observed.rollout_pods)):
                await self.kueue.put_status(queue.give_back(obj, now))
            return inputs, every
        return inputs, poll

    async def _withdraw_long_round(self, rt: JobRuntime, spec: RLTrainingJobSpec,
                                   long_view: queue.QueueView, events: list[Event],
                                   why: str) -> None:
        """Delete the job's long-round Workload (its extra replicas' quota goes back, or its
        ask is withdrawn); Event LongRoundReleased when it had been granted."""
        if not (long_view.exists and long_view.owned):
            return
        name = queue.long_round_name(rt.name)
        rt.workload_admitted.pop("long_round", None)
        if await self.kueue.delete(rt.namespace, name) and long_view.reserved:
            events.append(Event("Normal", "LongRoundReleased",
                                "the long round's extra rollout replicas went back: their"
                                f" Workload {name} deleted (quota returned; {why})"))
        await self._order_pool(rt, spec)

    async def _order_pool(self, rt: JobRuntime, spec: RLTrainingJobSpec,
                          new: dict[str, Any] | None = None) -> str | None:
        """The burst pool's order (``rlpacer.operator.queue``, :func:`~queue.pool_holds`)
        over the long-round Workloads this operator made that wait for the ClusterQueue the
        job's long rounds ask in: each held behind the first waiting ask of a higher
        priority, or let go. ``new``: the job's ask about to be made; returns the ask it must
        be held behind (None: made active). Without the permission to read LocalQueues or to
        list Workloads (an older chart's RBAC) nothing is held: Kueue's order alone."""
        lq = queue.long_round_queue(spec)
        if lq is None:
            return None
        try:
            pool = await self.kueue.cluster_queue(rt.namespace, lq)
            if pool is None:
                return None
            asks = [] if new is None else [queue.pool_ask(new)]
            new_key = asks[0].key if asks and asks[0] is not None else None
            for wl in await self.kueue.managed(self.settings.namespaces):
                a = queue.pool_ask(wl)
                if (a is not None and a.key != new_key
                        and await self.kueue.cluster_queue(a.namespace, a.local_queue) == pool):
                    asks.append(a)
            order = [a for a in asks if a is not None]
            holds = queue.pool_holds(order)
            # hold first, then let go: never two priorities active at once
            for a in sorted(order, key=lambda a: holds.get(a.key) is None):
                if a.key == new_key or a.key not in holds:
                    continue
                behind = holds[a.key]
                if behind is not None and (a.active or a.held_by != behind):
                    log.info("%s: held behind %s (the pool's order: priority first)",
                             a.key, behind)
                    await self.kueue.hold(a.namespace, a.name, behind)
                elif behind is None and a.held_by is not None:
                    log.info("%s: let go (no higher-priority long round waits)", a.key)
                    await self.kueue.hold(a.namespace, a.name, None)
            return holds.get(new_key) if new_key is not None else None
        except ApiError as e:
            if e.status != 403:
                raise
            if not self._pool_order_refused:
                self._pool_order_refused = True
                log.warning("kueue: the long rounds' pool order is off: %s (the chart's"
                            " kueue.enabled grants get on localqueues and list on workloads)",
                            e)
            return None

    async def _recover_state(self, rt: JobRuntime) -> None:
        """Rebuild the job's controller state if it cannot be used (someone else wrote the
        status): condition StateRebuilt and a Warning Event (``decide`` module docstring).
        A usable state is kept as the job's live controller, so checking costs one parse
        only after the status was read from the API server, and none on the next report."""
        async with rt.lock:
            st = rt.status
            if rt.peek_controller(st.controller_state) is not None:
                return
            try:
                ctl = load_controller(st)
            except StateUnreadable as e:
                log.warning("%s/%s: %s; rebuilding it", rt.namespace, rt.name, e.message)
            else:
                if ctl is not None and st.controller_state is not None:
                    rt.live = (st.controller_state, ctl)
                return
            now = utcnow()
            rt.live = None
            events = await self.commit(rt, lambda spec, s: recover_controller_state(
                spec, s, now, rt.generation))
        if events:
            await self.post_events(rt, events)

    async def child_refused(self, rt: JobRuntime, err: ChildRefused) -> None:
        """Report a refused child once per distinct refusal (warning and Event)."""
        msg = str(err)
        if msg == rt.refused:
            return
        rt.refused = msg
        log.warning("%s/%s: the API server refused %s", rt.namespace, rt.name, msg)
        await self.post_events(rt, [Event("Warning", "FailedCreate", msg)])

    async def _invalid(self, rt: JobRuntime) -> None:
        msg = rt.spec_error or "invalid spec"
        st = rt.status.model_copy(deep=True)
        now = fmt_time(utcnow())
        st.conditions, flipped = set_condition(
            st.conditions, ConditionType.ADMITTED, False, Reason.INVALID_SPEC, msg, now,
            rt.generation)
        st.observed_generation = rt.generation
        st.summary = summarize(st.conditions)
        if st != rt.status:
            body = {"apiVersion": API_VERSION, "kind": KIND,
                    "metadata": {"name": rt.name, "namespace": rt.namespace,
                                 "resourceVersion": rt.rv},
                    "status": st.to_wire()}
            try:
                rt.absorb(await self.kube.request(
                    "PUT", job_path(rt.namespace, rt.name) + "/status", body))
            except ApiError as e:
                if e.status != 409:
                    raise
        if flipped:
            await self.post_events(rt, [Event("Warning", "InvalidSpec", msg)])


def _counts(counts: dict[str, int] | Any) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(dict(counts).items()))


def namespace_terminating(e: ApiError) -> bool:
    """The API server's refusal to create anything in a namespace being deleted (403, cause
    ``NamespaceTerminating``; its message is stable across releases) or already gone (404,
    ``namespaces "<name>" not found``, as a create in it is answered)."""
    msg = e.message or ""
    return ((e.status == 403 and "because it is being terminated" in msg)
            or (e.status == 404 and msg.startswith('namespaces "') and msg.endswith("not found")))


def child_version(kind: str, meta: dict[str, Any]) -> str | None:
    """What says a child was changed by someone: a StatefulSet's generation (its spec; the
    controller's status updates leave it), the resourceVersion of a ConfigMap, Service or
    NetworkPolicy (nothing else writes them). None for pods (their status changes all the time;
    their spec hardly can) and Secrets (written once): the full pass of reapply_seconds covers
    those."""
    if kind == "StatefulSet":
        gen = meta.get("generation")
        return None if gen is None else f"generation {gen}"
    if kind in ("ConfigMap", "Service", "NetworkPolicy"):
        rv = meta.get("resourceVersion")
        return None if not rv else f"resourceVersion {rv}"
    return None


def token_hash(token: str) -> str:
    """What ``status.tokenHashes`` keeps of a token: its SHA-256, hex. Safe to show to anyone
    who can read the job (the tokens are 256 random bits), unlike the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()


def _runs_other_ray_token(pod: dict[str, Any] | None, attempt: int, want: str) -> bool:
    """Whether ``pod`` is attempt ``attempt``'s driver, not finished, built with a Ray token
    other than the one whose hash is ``want`` (or none: made by an older operator)."""
    if pod is None:
        return False
    meta = pod.get("metadata") or {}
    if (meta.get("labels") or {}).get(contract.LABEL_ATTEMPT) != str(attempt):
        return False
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return False
    return (meta.get("annotations") or {}).get(contract.ANNOTATION_RAY_TOKEN_HASH) != want


def disruption_reason(pod: dict[str, Any]) -> str | None:
    """The reason of ``pod``'s ``DisruptionTarget`` condition when it is True (the pod is
    stopped, or about to be, by an eviction, a preemption, node pressure or its node's loss,
    not by its own failure; Kubernetes sets it since 1.26), else None."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            return str(cond.get("reason") or "DisruptionTarget")
    return None


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)
