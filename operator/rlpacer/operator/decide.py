"""The reconcile decision for one job: pure, from (spec, status, what is observed, now).

``decide`` returns the new status, the Events to record, whether the workloads should exist,
whether the job itself should be deleted (TTL) and when to look again. The I/O around it
(observe children, apply, write status, post Events) is in :mod:`rlpacer.operator.runtime`.

Lifecycle (conditions, see ``rlpacer.api.status``):

* Admitted on first sight (attempt 0, ``startTime``); children created.
* ``spec.suspend``: workloads deleted, Suspended=True; on resume a new attempt (the trainer
  restarts from its last checkpoint; a resume does not count against ``backoffLimit``) and the
  active-deadline clock restarts (as Kubernetes Jobs do).
* The operator stops a running driver itself (:func:`restart_attempt`: it runs with a Ray
  token the job's pods no longer share): a new attempt, not counted against ``backoffLimit``.
* Driver pod of the current attempt gone without having failed (Kubernetes Jobs'
  ``podFailurePolicy`` convention for ``DisruptionTarget``): deleted (``kubectl delete pod``, a
  drain, an eviction, a preemption) after its attempt reported a step, being deleted when it
  ended Failed, or Failed with the ``DisruptionTarget`` condition (a node-pressure eviction):
  a new attempt from the last checkpoint, not counted against ``backoffLimit``. Never the
  same attempt again: a driver restarted from its checkpoint reports a step behind the
  controller, which a new attempt may do and the same attempt may not. A driver pod deleted
  before its attempt reported anything is created again under the same attempt.
* Driver pod of the current attempt Failed: ``failures`` += 1; within ``backoffLimit`` a new
  attempt (new driver pod, the controller state kept: it continues from what it learnt), else
  Failed/BackoffLimitExceeded. Driver Failed with ``contract.EXIT_DATA_INVALID`` (bad data,
  checked at start): Failed/DataInvalid with the driver's message, no retry; with
  ``contract.EXIT_LEARNER_DOES_NOT_FIT`` (the learner's memory per rank exceeds a rank's,
  checked at start): Failed/LearnerDoesNotFit with the driver's message, no retry. Driver
  Succeeded: Succeeded/Completed.
* ``activeDeadlineSeconds`` past ``startTime``: Failed/DeadlineExceeded.
* Terminal: workloads deleted (GPUs released); after ``ttlSecondsAfterFinished`` the job is
  deleted (children follow by garbage collection).
* ``status.controllerState`` unreadable or missing (someone else wrote the status):
  :func:`recover_controller_state` rebuilds it from the spec and the status's readable fields
  (StateRebuilt=True and a Warning Event, the job carries on); only a state that cannot be
  rebuilt fails the job (Failed/ControllerStateLost).

Why rebuild rather than fail: the step sequence is never lost with the state. ``step`` and
``attempt`` are plain status fields that ``read_status`` keeps whatever else is unreadable,
and the trainer resumes from its own checkpoint at any step up to the next one, so a
controller at the status's step and attempt, with the status's group size pending, accepts
the running driver's next report as if nothing happened. What the status also shows of the
controller (lambda, each candidate's Beta posterior, the straggler rate, the mean step time)
is put back, so SAGC continues from nearly where it was; what only the state held is lost:
the Thompson sampler's generator position (reseeded from the spec's seed), the per-step
straggler window (approximated from the rate) and the record of the last answered report (a
retry of a report persisted just before the state was broken is refused as out of order).
Failing a user's job for a status edit would throw away hours of training for none of that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from rlpacer.api import contract
from rlpacer.api._base import decimal
from rlpacer.api.job import RLTrainingJobSpec, effective_algorithm
from rlpacer.api.protocol import RolloutState
from rlpacer.api.status import (
    MAX_SCALE_ACTIONS,
    ConditionType,
    Reason,
    RLTrainingJobStatus,
    RolloutStatus,
    ScaleAction,
    find,
    is_terminal,
    is_true,
    set_condition,
    summarize,
)
from rlpacer.control.plan import JobController
from rlpacer.control.sagc import GroupControlMode
from rlpacer.operator import hosting, queue, scaler
from rlpacer.operator.queue import QueueView
from rlpacer.operator.scaler import Event
from rlpacer.operator.timeutil import fmt_time, parse_time

#: Driver exit codes that fail the job at once, without a retry: the reason, and the message
#: when the driver's termination message has none.
PERMANENT_EXITS: dict[int, tuple[Reason, str]] = {
    contract.EXIT_DATA_INVALID: (Reason.DATA_INVALID, "data invalid: see the driver pod's log"),
    contract.EXIT_LEARNER_DOES_NOT_FIT: (
        Reason.LEARNER_DOES_NOT_FIT, "the learner does not fit: see the driver pod's log"),
}


@dataclass(frozen=True)
class Observed:
    """What the operator saw of the job's children just now."""

    attempt: int = 0  # the attempt whose driver pod was looked at
    driver_phase: str | None = None  # phase of <job>-driver-<attempt>; None: absent
    driver_message: str = ""
    #: exit code of the driver's container when it terminated (None: running, or not seen)
    driver_exit_code: int | None = None
    #: the driver pod is being deleted (``metadata.deletionTimestamp``): by someone, a drain,
    #: an eviction or a preemption; its end is then no failure of the trainer
    driver_deleting: bool = False
    #: the reason of the driver pod's ``DisruptionTarget`` condition when it is True (e.g.
    #: ``TerminationByKubelet``, ``PreemptionByScheduler``); None: not disrupted
    driver_disruption: str | None = None
    #: False: the pod of ``attempt`` was not looked at (the status moved to another attempt
    #: since the look), so its absence says nothing
    driver_looked: bool = True
    rollout_ready: int = 0
    #: ordinals of the rollout StatefulSet's Ready pods (None: not looked at)
    rollout_ordinals: tuple[int, ...] | None = None
    #: long-round rollout replicas the namespace's policies allow now (None: not enforced)
    long_round_cap: int | None = None
    #: the job's Kueue Workload as seen (None: the job names no queue, or it was not looked at)
    queue: QueueView | None = None
    #: its long round's Workload (None: not looked at)
    long_round_queue: QueueView | None = None
    #: pods of the job that exist, in any phase (None: not counted)
    job_pods: int | None = None
    #: ordinals of the rollout StatefulSet's pods that exist, in any phase (None: not looked)
    rollout_pods: tuple[int, ...] | None = None


@dataclass
class Decision:
    status: RLTrainingJobStatus
    events: list[Event] = field(default_factory=list)
    workloads: bool = True
    #: leave the children as they are (neither applied nor deleted): an evicted job's pods
    #: while its driver may still checkpoint (checkpoint.evictionGraceSeconds)
    keep_children: bool = False
    delete_job: bool = False
    requeue_after: float | None = None


def _cond(
    st: RLTrainingJobStatus, type_: ConditionType, value: bool, reason: Reason, msg: str,
    now: str, gen: int | None,
) -> bool:
    conds, flipped = set_condition(st.conditions, type_, value, reason, msg, now, gen)
    st.conditions = conds
    return flipped


def _finish(st: RLTrainingJobStatus, now: str) -> None:
    st.completion_time = st.completion_time or now
    st.rollout = RolloutStatus(
        desired_replicas=0, ready_replicas=st.rollout.ready_replicas, state="Ready"
    )


def decide(
    spec: RLTrainingJobSpec,
    status: RLTrainingJobStatus,
    observed: Observed,
    now: datetime,
    generation: int | None,
) -> Decision:
    st = status.model_copy(deep=True)
    t = fmt_time(now)
    gen = generation
    d = Decision(status=st)
    ev = d.events

    # --- terminal: keep nothing running; TTL cleanup -------------------------------------
    if is_terminal(st.conditions):
        d.workloads = False
        ttl = spec.ttl_seconds_after_finished
        if ttl is not None and st.completion_time:
            due = parse_time(st.completion_time) + timedelta(seconds=ttl)
            if now >= due:
                d.delete_job = True
            else:
                d.requeue_after = (due - now).total_seconds()
        st.observed_generation = gen
        st.summary = summarize(st.conditions)
        return d

    st.algorithm = effective_algorithm(spec)  # what the trainer resolves from the same spec

    # --- Kueue: the job runs only while its Workload is admitted ---------------------------
    queued = _queue_hold(spec, st, observed.queue, t, gen, ev)

    # --- admission ------------------------------------------------------------------------
    if not is_true(st.conditions, ConditionType.ADMITTED):
        _cond(st, ConditionType.ADMITTED, True, Reason.CREATED, "children created", t, gen)
        _cond(st, ConditionType.TRAINING, False, Reason.STARTING, "waiting for the driver",
              t, gen)
        st.start_time = None if spec.suspend or queued else t
        hosting.init_status(st, spec)
        st.rollout = RolloutStatus(desired_replicas=scaler.short_replicas(spec),
                                   ready_replicas=observed.rollout_ready)
        ev.append(Event("Normal", "Created", f"attempt {st.attempt}: children created"))

    # --- suspend / resume -----------------------------------------------------------------
    suspended = is_true(st.conditions, ConditionType.SUSPENDED)
    if spec.suspend or queued is not None:
        d.workloads = False
        if spec.suspend:
            reason, msg = Reason.SUSPENDED, "spec.suspend is true: pods deleted, state kept"
        else:
            assert queued is not None
            reason, msg = queued
        held = find(st.conditions, ConditionType.SUSPENDED)
        entered = not suspended or held is None or held.reason != reason.value
        if entered:
            _cond(st, ConditionType.SUSPENDED, True, reason, msg, t, gen)
            _cond(st, ConditionType.TRAINING, False, Reason.STOPPED,
                  "suspended" if spec.suspend else "held by Kueue", t, gen)
            _cond(st, ConditionType.LONG_ROUND, False, Reason.FINISHED,
                  "suspended" if spec.suspend else "held by Kueue", t, gen)
        left = eviction_grace_left(spec, st, now)
        keep = (left > 0 and observed.driver_looked and observed.driver_phase == "Running"
                and not observed.driver_deleting)
        if entered and spec.suspend:
            ev.append(Event("Normal", "Suspended",
                            "pods deleted once the driver has checkpointed; resume with"
                            " spec.suspend=false" if keep else
                            "pods deleted; resume with spec.suspend=false"))
        if keep:
            # checkpoint.evictionGraceSeconds: the pods stay while the driver reaches its next
            # report, which is answered as its last (it checkpoints there and stops)
            msg += (f"; the driver checkpoints at its next step report and stops (it has"
                    f" {spec.checkpoint.eviction_grace}s from the"
                    f" {'suspend' if spec.suspend else 'eviction'}), then the pods are"
                    " deleted")
            if entered:
                ev.append(Event("Normal", "EvictionCheckpoint",
                                f"{'suspended' if spec.suspend else 'evicted'} with the driver"
                                " running: the pods are kept up to"
                                f" {spec.checkpoint.eviction_grace}s"
                                " (checkpoint.evictionGraceSeconds) while the driver checkpoints"
                                " at its next step report or plan and stops"))
            d.workloads, d.keep_children = True, True
            d.requeue_after = left + 0.5
        cur = find(st.conditions, ConditionType.SUSPENDED)
        if cur is not None and cur.message != msg:
            _cond(st, ConditionType.SUSPENDED, True, reason, msg, t, gen)
        st.rollout = RolloutStatus(desired_replicas=scaler.short_replicas(spec),
                                   ready_replicas=observed.rollout_ready)
        st.observed_generation = gen
        st.summary = summarize(st.conditions)
        return d
    if suspended:
        # held from the start (spec.suspend, or waiting for Kueue): attempt 0 never ran and
        # starts now; else a new attempt resumes from the last checkpoint
        fresh = st.start_time is None
        if not fresh:
            st.attempt += 1
            st.start_time = t
        what = ("starts" if fresh else "from the last checkpoint")
        _cond(st, ConditionType.SUSPENDED, False, Reason.RESUMED,
              f"started as attempt {st.attempt}" if fresh
              else f"resumed as attempt {st.attempt} from the last checkpoint", t, gen)
        _cond(st, ConditionType.TRAINING, False, Reason.STARTING, "waiting for the driver",
              t, gen)
        ev.append(Event("Normal", "Resumed", f"attempt {st.attempt} {what}"))
        observed = Observed(attempt=st.attempt, rollout_ready=observed.rollout_ready,
                            rollout_ordinals=observed.rollout_ordinals)
    if st.start_time is None:
        st.start_time = t

    # --- active deadline -----------------------------------------------------------------
    ads = spec.active_deadline_seconds
    if ads is not None:
        due = parse_time(st.start_time) + timedelta(seconds=ads)
        if now >= due:
            msg = f"running longer than activeDeadlineSeconds={ads}"
            _cond(st, ConditionType.FAILED, True, Reason.DEADLINE_EXCEEDED, msg, t, gen)
            _cond(st, ConditionType.TRAINING, False, Reason.STOPPED, msg, t, gen)
            ev.append(Event("Warning", "DeadlineExceeded", msg))
            _finish(st, t)
            d.workloads = False
            if spec.ttl_seconds_after_finished is not None:
                d.requeue_after = float(spec.ttl_seconds_after_finished)
            st.observed_generation = gen
            st.summary = summarize(st.conditions)
            return d
        d.requeue_after = (due - now).total_seconds()

    # --- the driver of the current attempt -----------------------------------------------
    phase = observed.driver_phase
    if phase == "Succeeded":
        _cond(st, ConditionType.SUCCEEDED, True, Reason.COMPLETED,
              f"finished {st.step} steps", t, gen)
        _cond(st, ConditionType.TRAINING, False, Reason.STOPPED, "completed", t, gen)
        _cond(st, ConditionType.LONG_ROUND, False, Reason.FINISHED, "completed", t, gen)
        ev.append(Event("Normal", "Completed", f"finished {st.step} steps"))
        _finish(st, t)
        d.workloads = False
        if spec.ttl_seconds_after_finished is not None:
            d.requeue_after = float(spec.ttl_seconds_after_finished)
    elif (phase == "Failed" and (observed.driver_deleting or observed.driver_disruption)) or (
            phase is None and observed.driver_looked and attempt_reported(st)):
        # gone without having failed: a new attempt resumes the job, not counted
        n = st.attempt
        how = (f"was stopped by a disruption ({observed.driver_disruption})"
               if observed.driver_disruption else "was deleted" if phase == "Failed"
               else "is gone (deleted, drained, evicted or preempted)")
        msg = (f"the driver pod of attempt {n} {how} without having failed; attempt {n + 1}"
               " resumes from the last checkpoint (not counted against backoffLimit)")
        _next_attempt(spec, st, msg, t, gen)
        ev.append(Event("Warning", "Restarting", msg))
    elif phase == "Failed" and observed.driver_exit_code in PERMANENT_EXITS:
        # permanent: the data is bad, or the learner does not fit; another attempt would
        # fail the same way
        reason, default = PERMANENT_EXITS[observed.driver_exit_code]
        msg = observed.driver_message or default
        _cond(st, ConditionType.FAILED, True, reason, msg, t, gen)
        _cond(st, ConditionType.TRAINING, False, Reason.STOPPED, msg, t, gen)
        _cond(st, ConditionType.LONG_ROUND, False, Reason.FINISHED, "failed", t, gen)
        ev.append(Event("Warning", reason.value, msg))
        _finish(st, t)
        d.workloads = False
        if spec.ttl_seconds_after_finished is not None:
            d.requeue_after = float(spec.ttl_seconds_after_finished)
    elif phase == "Failed":
        st.failures += 1
        why = observed.driver_message or "driver pod failed"
        if st.failures > spec.backoff_limit:
            msg = (f"driver failed {st.failures} times (backoffLimit={spec.backoff_limit}):"
                   f" {why}")
            _cond(st, ConditionType.FAILED, True, Reason.BACKOFF_LIMIT_EXCEEDED, msg, t, gen)
            _cond(st, ConditionType.TRAINING, False, Reason.STOPPED, msg, t, gen)
            _cond(st, ConditionType.LONG_ROUND, False, Reason.FINISHED, "failed", t, gen)
            ev.append(Event("Warning", "BackoffLimitExceeded", msg))
            _finish(st, t)
            d.workloads = False
        else:
            msg = (f"driver of attempt {st.attempt} failed ({why}); attempt {st.attempt + 1}"
                   f" restarts from the last checkpoint ({st.failures}/{spec.backoff_limit})")
            _next_attempt(spec, st, msg, t, gen)
            ev.append(Event("Warning", "Restarting", msg))
    elif phase == "Running" and not observed.driver_deleting:
        training = find(st.conditions, ConditionType.TRAINING)
        if training is None or training.status != "True":
            _cond(st, ConditionType.TRAINING, True, Reason.RUNNING,
                  f"attempt {st.attempt} running", t, gen)
            ev.append(Event("Normal", "Running", f"attempt {st.attempt} running"))

    # --- rollout capacity ----------------------------------------------------------------
    if not is_terminal(st.conditions):
        rollout, actions, events = scaler.observe(
            st.rollout, spec, observed.rollout_ready, st.step, now, observed.rollout_ordinals,
            long_cap=observed.long_round_cap,
        )
        st.rollout = rollout
        _record(st, actions)
        ev.extend(events)
        for e in events:
            if e.reason == "ScaleUpTimedOut":
                _cond(st, ConditionType.LONG_ROUND, True, Reason.SCALE_UP_TIMED_OUT,
                      e.message, t, gen)
            elif e.reason == "ScaledUp":
                _cond(st, ConditionType.LONG_ROUND, True, Reason.RUNNING, e.message, t, gen)
        lv = observed.long_round_queue
        lr = find(st.conditions, ConditionType.LONG_ROUND)
        if (lv is not None and lv.exists and not lv.admitted and lr is not None
                and lr.status == "True" and lr.reason == Reason.SCALING_UP.value
                and st.rollout.state == RolloutState.SCALING_UP.value):
            # the long round's wait, as Kueue words it
            extra = st.rollout.desired_replicas - scaler.short_replicas(spec)
            _cond(st, ConditionType.LONG_ROUND, True, Reason.SCALING_UP,
                  f"waiting for Kueue to admit {extra} extra rollout replicas (queue"
                  f" {queue.long_round_queue(spec)})" + (f": {lv.message}" if lv.message
                                                          else ""), t, gen)
        short = scaler.short_replicas(spec)
        if observed.rollout_ready >= short:
            _cond(st, ConditionType.ROLLOUT_READY, True, Reason.REPLICAS_READY,
                  f"{observed.rollout_ready} rollout replicas ready", t, gen)
        else:
            _cond(st, ConditionType.ROLLOUT_READY, False, Reason.WAITING_FOR_REPLICAS,
                  f"{observed.rollout_ready}/{short} rollout replicas ready", t, gen)
        wait = scaler.seconds_to_deadline(st.rollout, spec, now)
        if wait != float("inf"):
            d.requeue_after = min(wait + 0.5, d.requeue_after or wait + 0.5)
    else:
        d.workloads = False

    st.observed_generation = gen
    st.summary = summarize(st.conditions)
    return d


def eviction_grace_left(
    spec: RLTrainingJobSpec, status: RLTrainingJobStatus, now: datetime
) -> float:
    """Seconds left of ``checkpoint.evictionGraceSeconds`` for a job Kueue evicted or a job
    suspended (``spec.suspend``) while it ran (0: no grace, none left, or neither). While
    some is left and its driver runs, the job's pods are kept and the driver's next step
    report is accepted and answered as its last (``done``), so it checkpoints at that step
    and stops; then the pods are deleted (and Kueue's quota given back), and the next attempt
    resumes from that checkpoint."""
    grace = spec.checkpoint.eviction_grace
    held = find(status.conditions, ConditionType.SUSPENDED)
    why = Reason.SUSPENDED if spec.suspend else Reason.EVICTED
    if grace <= 0 or held is None or held.status != "True" or held.reason != why.value:
        return 0.0
    since = parse_time(held.last_transition_time)
    return max(0.0, grace - (now - since).total_seconds())


def _queue_hold(
    spec: RLTrainingJobSpec, st: RLTrainingJobStatus, view: QueueView | None, t: str,
    gen: int | None, ev: list[Event],
) -> tuple[Reason, str] | None:
    """For a job that names a Kueue queue: the QueueAdmitted condition from its Workload, and
    why the job is held (None: admitted, or no queue). ``view`` None (not looked at): the
    condition as it stands decides."""
    name = queue.queue_of(spec)
    if name is None:
        return None
    cond = find(st.conditions, ConditionType.QUEUE_ADMITTED)
    if spec.suspend:  # the suspend block holds the job; its Workload is given back
        _cond(st, ConditionType.QUEUE_ADMITTED, False, Reason.SUSPENDED,
              "spec.suspend is true: the job's Workload and its quota are given back; resumed,"
              " the job queues again", t, gen)
        return None
    if view is None:
        if cond is not None and cond.status == "True":
            return None
        if cond is not None:
            return Reason(cond.reason), cond.message
        return Reason.WAITING_FOR_QUEUE, f"waiting for Kueue to admit the job (queue {name})"
    if not view.installed:
        reason = Reason.KUEUE_NOT_INSTALLED
        msg = (f"spec.scheduling.queueName is {name!r} but Kueue is not installed (the API"
               f" {queue.API_VERSION} is not served): install Kueue, or remove"
               " spec.scheduling.queueName to run without admission")
        if _cond(st, ConditionType.QUEUE_ADMITTED, False, reason, msg, t, gen) or cond is None:
            ev.append(Event("Warning", "KueueNotInstalled", msg))
        return reason, msg
    if view.evicted is not None:
        why, text = view.evicted
        reason = Reason.EVICTED
        msg = (f"evicted by Kueue ({why}: {text}): state kept; the job resumes from its last"
               " checkpoint when admitted again")
        was = cond is not None and cond.reason == reason.value
        _cond(st, ConditionType.QUEUE_ADMITTED, False, reason, msg, t, gen)
        if not was:
            ev.append(Event("Warning", "Evicted", msg))
        return reason, msg
    if view.admitted:
        flavors = ", ".join(sorted(queue.flavor_names(view))) or "none"
        msg = f"admitted by ClusterQueue {view.cluster_queue} (flavors: {flavors})"
        if _cond(st, ConditionType.QUEUE_ADMITTED, True, Reason.ADMITTED_BY_KUEUE, msg, t, gen):
            ev.append(Event("Normal", "QueueAdmitted", msg))
        return None
    reason = Reason.WAITING_FOR_QUEUE
    msg = (f"waiting for Kueue to admit the job (queue {name})"
           + (f": {view.message}" if view.message else ""))
    first = cond is None or cond.status == "True"
    _cond(st, ConditionType.QUEUE_ADMITTED, False, reason, msg, t, gen)
    if first:
        ev.append(Event("Normal", "Queued", f"waiting for Kueue to admit the job (queue {name})"))
    return reason, msg


def restart_attempt(
    spec: RLTrainingJobSpec,
    status: RLTrainingJobStatus,
    why: str,
    now: datetime,
    generation: int | None,
) -> tuple[RLTrainingJobStatus, Event]:
    """A new attempt the operator starts itself (its driver was stopped for ``why``, e.g. it
    runs with a Ray token the job's pods no longer share): like a resume, it restarts from the
    last checkpoint and does not count against ``backoffLimit``."""
    st = status.model_copy(deep=True)
    t = fmt_time(now)
    msg = (f"attempt {st.attempt} stopped ({why}); attempt {st.attempt + 1} restarts from the"
           " last checkpoint")
    _next_attempt(spec, st, msg, t, generation)
    st.summary = summarize(st.conditions)
    return st, Event("Warning", "Restarting", msg)


def _next_attempt(
    spec: RLTrainingJobSpec, st: RLTrainingJobStatus, msg: str, t: str, gen: int | None
) -> None:
    """Start attempt ``st.attempt + 1`` (in place): a new driver pod resumes from the last
    checkpoint with the controller state kept (it continues from what it learnt); a long
    round in flight is abandoned, back to short-round capacity."""
    st.attempt += 1
    _cond(st, ConditionType.TRAINING, False, Reason.RESTARTING, msg, t, gen)
    _cond(st, ConditionType.LONG_ROUND, False, Reason.FINISHED, "restarting", t, gen)
    st.rollout = st.rollout.model_copy(update={
        "desired_replicas": scaler.short_replicas(spec), "state": "Ready",
        "scale_up_started_at": None,
    })


def attempt_reported(st: RLTrainingJobStatus) -> bool:
    """Whether the current attempt's driver had a step report accepted (the controller is at
    this attempt and has observed steps): its pod ran, so a driver pod of this attempt that
    is gone was deleted, and one started again under the same attempt would restart from its
    checkpoint behind the controller, which the step-report protocol refuses within an attempt.
    A rebuilt controller state (:func:`rebuild_state`) stands at the status's attempt and step
    with no record of who reported: then True once the job has run a step (a new attempt where
    none was needed costs nothing; the same attempt where one was needed fails the driver).
    Reads the controller state only when asked (a driver pod absent from a live job is rare)."""
    if st.controller_state is None:
        return False
    try:
        ctl = hosting.load(st.controller_state)
    except ValueError:  # unreadable state (StateError is one): nothing to go by
        return False
    return ctl.attempt == st.attempt and (ctl.last_report is not None or ctl.steps_observed > 0)


class StateUnreadable(Exception):
    """``status.controllerState`` cannot be used: unreadable (not JSON, another kind or
    version, a broken field) or missing from a job that has run. Nothing is changed; the
    step-report endpoint answers 503 (retry) while the reconciler rebuilds the state
    (:func:`recover_controller_state`)."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _why(err: BaseException) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"not JSON ({err.msg} at character {err.pos})"
    text = str(err) or type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def load_controller(status: RLTrainingJobStatus) -> JobController | None:
    """The controller persisted in ``status.controllerState``; None for a job that has none
    yet (not admitted: it starts from the spec). Raises :class:`StateUnreadable`."""
    state = status.controller_state
    if state is None:
        if (is_true(status.conditions, ConditionType.ADMITTED) or status.step > 0
                or status.attempt > 0 or status.last_report_time is not None):
            raise StateUnreadable(Reason.CONTROLLER_STATE_MISSING,
                                  "status.controllerState is missing")
        return None
    try:
        return hosting.load(state)
    except Exception as e:  # any content at all may have been written there
        raise StateUnreadable(Reason.CONTROLLER_STATE_UNREADABLE,
                              f"status.controllerState is unreadable: {_why(e)}") from None


def _finite(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return decimal(value)
    except ValueError:
        return None


def rebuild_state(
    spec: RLTrainingJobSpec, status: RLTrainingJobStatus, readable: bool = True
) -> tuple[JobController, str]:
    """A controller for the job rebuilt from its spec and its status's readable fields, and
    a note of what was taken over. Pure and deterministic.

    The controller stands at ``status.step`` and ``status.attempt`` with ``status.groupSize``
    pending (the G the running driver was given), so the driver's next report is accepted.
    With ``readable``, the status's lambda, Beta posteriors, straggler rate and mean step time
    are put back too (the straggler windows, short and long rounds, as that many straggler
    steps of the last ``windowSteps``). Raises ``ValueError`` if even that cannot make a
    valid state.
    """
    cfg = hosting.controller_config(spec)
    d: dict[str, Any] = JobController(cfg).state_dict()
    inner: dict[str, Any] = d["controller"]
    sagc = cfg.mode is GroupControlMode.SAGC
    candidates = cfg.sagc.candidates if sagc else (cfg.sagc.initial,)
    step, attempt = status.step, status.attempt
    d["next_step"], d["attempt"] = step, attempt
    if status.round_kind in ("Short", "Long"):
        d["next_round_kind"] = status.round_kind
    d["long_rounds"] = status.long_rounds
    d["steps_observed"] = step
    inner["steps"] = step
    kept = [f"step {step}", f"attempt {attempt}"]
    g = status.group_size
    if g in candidates:
        inner["pending"] = g
        if sagc:
            inner["current"] = g
        kept.append(f"group size {g}")
    if readable:
        n = min(step, cfg.straggler_window)
        rate = _finite(status.straggler_rate)
        if rate is not None and n > 0:
            k = min(n, max(0, round(rate * n)))
            d["window"] = [True] * k + [False] * (n - k)
            inner["stragglers"] = k
            # the SLO's rate is over short rounds; the long rounds' is apart
            ns = min(max(0, step - status.long_rounds), cfg.straggler_window)
            ks = min(ns, max(0, round(rate * ns)))
            d["short_window"] = [True] * ks + [False] * (ns - ks)
            kept.append(f"straggler rate {status.straggler_rate}")
        long_rate = _finite(status.long_round_straggler_rate)
        nl = min(status.long_rounds, cfg.straggler_window)
        if long_rate is not None and nl > 0:
            kl = min(nl, max(0, round(long_rate * nl)))
            d["long_window"] = [True] * kl + [False] * (nl - kl)
            kept.append(f"long-round straggler rate {status.long_round_straggler_rate}")
        mean = _finite(status.step_seconds)
        if mean is not None and mean >= 0 and n > 0:
            d["step_seconds"] = [mean] * n
            kept.append(f"step time {status.step_seconds}s")
        posteriors = {p.group_size: (_finite(p.alpha), _finite(p.beta))
                      for p in status.posteriors}
        restored = []
        for i, c in enumerate(candidates):
            a, b = posteriors.get(c, (None, None))
            if a is None or b is None or not (a > 0 and b > 0):
                continue
            if sagc:
                inner["alpha"][i], inner["beta"][i] = a, b
            else:
                inner["alpha"], inner["beta"] = a, b
            restored.append(c)
        if restored:
            kept.append("posteriors of G " + ", ".join(map(str, restored)))
        lam = _finite(status.lambda_)
        if sagc and lam is not None:
            inner["lambda"] = min(max(lam, 0.0), cfg.sagc.lambda_max)
            kept.append(f"lambda {status.lambda_}")
    return JobController.from_state_dict(d), ", ".join(kept)  # validates every field


def recover_controller_state(
    spec: RLTrainingJobSpec,
    status: RLTrainingJobStatus,
    now: datetime,
    generation: int | None,
) -> tuple[RLTrainingJobStatus, list[Event]]:
    """Rebuild an unusable ``status.controllerState`` (a no-op when it is usable).

    Sets StateRebuilt=True (reason ControllerStateUnreadable or ControllerStateMissing) and
    returns a Warning Event ``ControllerStateRebuilt``, both saying what was kept and lost.
    If no valid state can be made from the status (not expected: the fallback takes only
    step and attempt), the job fails with reason ControllerStateLost.
    """
    try:
        load_controller(status)
        return status, []
    except StateUnreadable as e:
        problem = e
    st = status.model_copy(deep=True)
    t = fmt_time(now)
    ctl: JobController | None = None
    kept = ""
    for readable in (True, False):  # the readable fields, else the step sequence alone
        try:
            ctl, kept = rebuild_state(spec, st, readable)
            break
        except ValueError:
            continue
    if ctl is None:
        if is_terminal(st.conditions):
            return status, []
        msg = (f"{problem.message}, and no controller state can be rebuilt from the status"
               f" (step {st.step}, attempt {st.attempt}): the job fails")
        _cond(st, ConditionType.FAILED, True, Reason.CONTROLLER_STATE_LOST, msg, t, generation)
        _cond(st, ConditionType.TRAINING, False, Reason.STOPPED, msg, t, generation)
        _finish(st, t)
        st.summary = summarize(st.conditions)
        return st, [Event("Warning", "ControllerStateLost", msg)]
    st.controller_state = hosting.dumps(ctl.state_dict())
    hosting.fill_status(st, ctl, ctl.plan())
    msg = (f"{problem.message}; rebuilt from the spec and the status ({kept}). Lost: the"
           " group-size sampler's random stream (reseeded), the per-step straggler window"
           " (approximated from the rate) and the record of the last answered report")
    _cond(st, ConditionType.STATE_REBUILT, True, problem.reason, msg, t, generation)
    st.summary = summarize(st.conditions)
    return st, [Event("Warning", "ControllerStateRebuilt", msg)]


def _record(st: RLTrainingJobStatus, actions: list[ScaleAction]) -> None:
    if actions:
        st.scale_actions = (list(st.scale_actions) + actions)[-MAX_SCALE_ACTIONS:]


record_scale_actions = _record
