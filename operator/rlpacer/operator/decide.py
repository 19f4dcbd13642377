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
* Driver pod of the current attempt Failed: ``failures`` += 1; within ``backoffLimit`` a new
  attempt (new driver pod, the controller state kept: it continues from what it learnt), else
  Failed/BackoffLimitExceeded. Driver Failed with ``contract.EXIT_DATA_INVALID`` (bad data,
  checked at start): Failed/DataInvalid with the driver's message, no retry. Driver
  Succeeded: Succeeded/Completed.
* ``activeDeadlineSeconds`` past ``startTime``: Failed/DeadlineExceeded.
* Terminal: workloads deleted (GPUs released); after ``ttlSecondsAfterFinished`` the job is
  deleted (children follow by garbage collection).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from rlpacer.api import contract
from rlpacer.api.job import RLTrainingJobSpec, effective_algorithm
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
from rlpacer.operator import hosting, scaler
from rlpacer.operator.scaler import Event
from rlpacer.operator.timeutil import fmt_time, parse_time


@dataclass(frozen=True)
class Observed:
    """What the operator saw of the job's children just now."""

    attempt: int = 0  # the attempt whose driver pod was looked at
    driver_phase: str | None = None  # phase of <job>-driver-<attempt>; None: absent
    driver_message: str = ""
    #: exit code of the driver's container when it terminated (None: running, or not seen)
    driver_exit_code: int | None = None
    rollout_ready: int = 0
    #: ordinals of the rollout StatefulSet's Ready pods (None: not looked at)
    rollout_ordinals: tuple[int, ...] | None = None
    #: long-round rollout replicas the namespace's policies allow now (None: not enforced)
    long_round_cap: int | None = None


@dataclass
class Decision:
    status: RLTrainingJobStatus
    events: list[Event] = field(default_factory=list)
    workloads: bool = True
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

    # --- admission ------------------------------------------------------------------------
    if not is_true(st.conditions, ConditionType.ADMITTED):
        _cond(st, ConditionType.ADMITTED, True, Reason.CREATED, "children created", t, gen)
        _cond(st, ConditionType.TRAINING, False, Reason.STARTING, "waiting for the driver",
              t, gen)
        st.start_time = None if spec.suspend else t
        hosting.init_status(st, spec)
        st.rollout = RolloutStatus(desired_replicas=scaler.short_replicas(spec),
                                   ready_replicas=observed.rollout_ready)
        ev.append(Event("Normal", "Created", f"attempt {st.attempt}: children created"))

    # --- suspend / resume -----------------------------------------------------------------
    suspended = is_true(st.conditions, ConditionType.SUSPENDED)
    if spec.suspend:
        d.workloads = False
        if not suspended:
            _cond(st, ConditionType.SUSPENDED, True, Reason.SUSPENDED,
                  "spec.suspend is true: pods deleted, state kept", t, gen)
            _cond(st, ConditionType.TRAINING, False, Reason.STOPPED, "suspended", t, gen)
            _cond(st, ConditionType.LONG_ROUND, False, Reason.FINISHED, "suspended", t, gen)
            ev.append(Event("Normal", "Suspended", "pods deleted; resume with spec.suspend=false"))
        st.rollout = RolloutStatus(desired_replicas=scaler.short_replicas(spec),
                                   ready_replicas=observed.rollout_ready)
        st.observed_generation = gen
        st.summary = summarize(st.conditions)
        return d
    if suspended:
        st.attempt += 1
        st.start_time = t
        _cond(st, ConditionType.SUSPENDED, False, Reason.RESUMED,
              f"resumed as attempt {st.attempt} from the last checkpoint", t, gen)
        _cond(st, ConditionType.TRAINING, False, Reason.STARTING, "waiting for the driver",
              t, gen)
        ev.append(Event("Normal", "Resumed", f"attempt {st.attempt} from the last checkpoint"))
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
    elif phase == "Failed" and observed.driver_exit_code == contract.EXIT_DATA_INVALID:
        # permanent: the data is bad; another attempt would fail the same way
        msg = observed.driver_message or "data invalid: see the driver pod's log"
        _cond(st, ConditionType.FAILED, True, Reason.DATA_INVALID, msg, t, gen)
        _cond(st, ConditionType.TRAINING, False, Reason.STOPPED, msg, t, gen)
        _cond(st, ConditionType.LONG_ROUND, False, Reason.FINISHED, "failed", t, gen)
        ev.append(Event("Warning", "DataInvalid", msg))
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
            st.attempt += 1
            msg = (f"driver of attempt {st.attempt - 1} failed ({why}); attempt {st.attempt}"
                   f" restarts from the last checkpoint ({st.failures}/{spec.backoff_limit})")
            _cond(st, ConditionType.TRAINING, False, Reason.RESTARTING, msg, t, gen)
            _cond(st, ConditionType.LONG_ROUND, False, Reason.FINISHED, "restarting", t, gen)
            ev.append(Event("Warning", "Restarting", msg))
            # A long round in flight is abandoned: back to short-round capacity.
            st.rollout = st.rollout.model_copy(update={
                "desired_replicas": scaler.short_replicas(spec), "state": "Ready",
                "scale_up_started_at": None,
            })
    elif phase == "Running":
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
    st.attempt += 1
    msg = (f"attempt {st.attempt - 1} stopped ({why}); attempt {st.attempt} restarts from the"
           " last checkpoint")
    _cond(st, ConditionType.TRAINING, False, Reason.RESTARTING, msg, t, generation)
    _cond(st, ConditionType.LONG_ROUND, False, Reason.FINISHED, "restarting", t, generation)
    st.rollout = st.rollout.model_copy(update={
        "desired_replicas": scaler.short_replicas(spec), "state": "Ready",
        "scale_up_started_at": None,
    })
    st.summary = summarize(st.conditions)
    return st, Event("Warning", "Restarting", msg)


def _record(st: RLTrainingJobStatus, actions: list[ScaleAction]) -> None:
    if actions:
        st.scale_actions = (list(st.scale_actions) + actions)[-MAX_SCALE_ACTIONS:]


record_scale_actions = _record
