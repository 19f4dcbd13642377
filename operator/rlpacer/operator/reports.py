"""Step reports, the pure part: fold one accepted report into the job's status.

:func:`accept_report` is called inside the runtime's compare-and-swap loop: it reads only its
arguments, so when the status write loses a race the loop re-runs it on the fresh status
(whose controller state may have been advanced by another writer; then the report is either
a repeat, answered identically, or validated against the new state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from rlpacer.api._base import decimal, field_range
from rlpacer.api.crd import schema_violations, status_schema
from rlpacer.api.job import RLTrainingJobSpec, TailBatchingSpec, algorithm_knob
from rlpacer.api.policy import RLTrainingPolicy
from rlpacer.api.protocol import Plan, ReleaseRequest, RoundKind, StepReport
from rlpacer.api.status import (
    ConditionType,
    Reason,
    RLTrainingJobStatus,
    find,
    is_terminal,
    is_true,
    set_condition,
    summarize,
)
from rlpacer.control.plan import ControlPlan, JobController, ReportRejected
from rlpacer.operator import enforce, hosting, scaler
from rlpacer.operator.decide import (
    StateUnreadable,
    eviction_grace_left,
    load_controller,
    record_scale_actions,
)
from rlpacer.operator.scaler import Event
from rlpacer.operator.timeutil import fmt_time, utcnow


class JobSuspended(Exception):
    """A report to a suspended job (``spec.suspend``, or the Suspended condition not yet
    cleared by the resume): refused, nothing changed (HTTP 409 ``JobSuspended``). The
    driver stops; resuming the job starts a new attempt that reports again."""

    reason = "JobSuspended"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Accepted:
    """The outcome of an accepted report (new or an idempotent repeat)."""

    plan: Plan
    events: list[Event] = field(default_factory=list)
    new: bool = True
    straggler: bool = False
    #: The live controller, whose state is the returned status's controllerState.
    controller: JobController | None = None


def _plan(spec: RLTrainingJobSpec, st: RLTrainingJobStatus, cp: ControlPlan,
          stop: bool = False) -> Plan:
    """``stop``: the job was evicted and its driver may checkpoint (eviction grace): the plan
    says done, so any trainer checkpoints at its step and stops."""
    return Plan(
        step=cp.step,
        group_size=cp.group_size,
        round_kind=cp.round_kind,
        rollout=scaler.capacity(st.rollout),
        lambda_=cp.lambda_,
        straggler_rate=cp.straggler_rate,
        done=cp.step >= spec.steps or stop,
    )


def current_plan(
    spec: RLTrainingJobSpec, status: RLTrainingJobStatus, ctl: JobController | None = None,
    now: datetime | None = None,
) -> Plan:
    """``GET plan``: the plan for the next step from the persisted state (changes nothing).
    ``ctl``: a live controller whose state is ``status.controllerState``. ``now``: for the
    eviction grace (default: the clock)."""
    if ctl is None:
        # raises StateUnreadable (503 while the reconciler rebuilds the state)
        ctl = load_controller(status) or hosting.load(hosting.new_state(spec))
    stop = eviction_grace_left(spec, status, now or utcnow()) > 0
    return _plan(spec, status, ctl.plan(), stop=stop)


def accept_release(
    spec: RLTrainingJobSpec, status: RLTrainingJobStatus, req: ReleaseRequest, now: datetime,
    ctl: JobController | None = None,
) -> tuple[RLTrainingJobStatus, Accepted]:
    """``POST release``: a long round's added replicas given back while it runs (the new
    status, and the current plan to answer with). Only the current attempt's driver, only
    for the step under way, and only while that step's round is long; an answer with
    nothing to release changes nothing (a repeat is harmless). Raises
    :class:`ReportRejected` otherwise (422: nothing changed)."""
    if is_terminal(status.conditions):
        raise ReportRejected("JobFinished", f"the job is {summarize(status.conditions).value}")
    if req.attempt != status.attempt:
        raise ReportRejected(
            "AttemptMismatch",
            f"attempt {req.attempt} is not the job's current attempt {status.attempt}")
    if req.step != status.step or status.round_kind != RoundKind.LONG.value:
        raise ReportRejected(
            "NotALongRound",
            f"step {req.step} is not a long round under way (the job's step {status.step} is"
            f" {status.round_kind or 'unplanned'}): nothing to release")
    st = status.model_copy(deep=True)
    rollout, actions, events = scaler.release(st.rollout, spec, req.step, now)
    st.rollout = rollout
    record_scale_actions(st, actions)
    return st, Accepted(plan=current_plan(spec, st, ctl, now), events=events,
                        new=bool(actions))


def accept_report(
    spec: RLTrainingJobSpec,
    status: RLTrainingJobStatus,
    report: StepReport,
    now: datetime,
    generation: int | None,
    ctl: JobController | None = None,
    policies: Sequence[RLTrainingPolicy] | None = None,
) -> tuple[RLTrainingJobStatus, Accepted]:
    """Return (new status, what to answer).

    ``policies``: the RLTrainingPolicies of the job's namespace (``[]``: none), or None when
    they could not be read (then nothing is enforced or judged on this report). Enforce
    policies clamp the controller's config (persisted in the new controller state, so the
    answer, the state and a restarted operator agree) and the long round's replicas; every
    policy's SLO is judged into the SLOViolated condition (see ``rlpacer.operator.enforce``).

    Raises :class:`ReportRejected` (nothing changed) for an impossible report, a report of
    an attempt the operator did not start, or a report to a finished job;
    :class:`JobSuspended` for a report to a suspended job; :class:`StateUnreadable` when
    ``status.controllerState`` cannot be used (the reconciler rebuilds it).
    """
    if is_terminal(status.conditions):
        raise ReportRejected("JobFinished", f"the job is {summarize(status.conditions).value}")
    held = find(status.conditions, ConditionType.SUSPENDED)
    # evicted by Kueue or suspended within checkpoint.evictionGraceSeconds: the report is
    # accepted and answered as the job's last, so the driver checkpoints at its step and stops
    stopping = eviction_grace_left(spec, status, now) > 0
    if (not spec.suspend and held is not None and held.status == "True"
            and held.reason != Reason.SUSPENDED.value and not stopping):
        # held by Kueue (waiting, or evicted): the same, with Kueue's word
        raise JobSuspended(
            f"the job is held by Kueue ({held.reason}: {held.message}): no step report is"
            " accepted and its pods are deleted; this driver should stop. Admitted again,"
            " the job starts a new attempt, from the last checkpoint, that reports again")
    if not stopping and (spec.suspend or is_true(status.conditions, ConditionType.SUSPENDED)):
        # Its pods are being deleted: a step accepted now would be one the resumed attempt
        # (from the last checkpoint) runs again, counted twice.
        raise JobSuspended(
            "the job is suspended (spec.suspend): no step report is accepted and its pods"
            " are deleted; this driver should stop. Resuming the job (spec.suspend=false)"
            " starts a new attempt, from the last checkpoint, that reports again")
    if report.attempt != status.attempt:
        raise ReportRejected(
            "AttemptMismatch",
            f"attempt {report.attempt} is not the job's current attempt {status.attempt}"
            " (RLPACER_ATTEMPT of the running driver)",
        )
    if status.controller_state is None:
        load_controller(status)  # raises StateUnreadable for a job that has run
        state = hosting.new_state(spec)
        ctl = None  # a live controller always matches a persisted state
    else:
        state = status.controller_state
        if ctl is None:
            ctl = load_controller(status)
    # A live ``ctl`` was taken from the job's runtime: if this raises, it is dropped, so an
    # in-memory controller that observed a rejected report is never used again.
    new_state, cp, ctl = hosting.apply_report(state, report, ctl)
    # A shallow copy: below, fields of ``st`` are only ever replaced, never changed in place
    # (statuses are values throughout the operator), so ``status`` is left as it was, and an
    # unchanged field is the very object of ``status``.
    st = status.model_copy()
    if new_state == state and status.controller_state is not None:
        # an idempotent repeat (checked first: a replay of an accepted step always gets the
        # same answer, even when the spec's bounds changed since)
        return st, Accepted(_plan(spec, st, cp, stop=stopping), [], new=False, controller=ctl)
    check_report(spec, report)

    t = fmt_time(now)
    gen = generation
    lim = enforce.limits(spec, policies) if policies is not None else None
    if lim is not None and ctl.reconfigure(lim.sagc):
        # Deterministic in (state, spec, policies): the clamped config lives in the state.
        p = ctl.plan(straggler=cp.straggler)
        cp, new_state = p, hosting.dumps(ctl.state_dict())
    # The step just reported was the job's last (the plan says done): no round follows. A
    # long round the planner asks for now would scale the rollout up for a round that never
    # runs, so a done job's capacity is only ever planned down (a short round next: the
    # driver released its long-round engines before this report, as on every other step);
    # what stays is released with the job's end.
    done = cp.step >= spec.steps or stopping
    events: list[Event] = []
    stop_events: list[Event] = []
    if stopping:
        stop_events.append(Event(
            "Normal", "EvictionCheckpoint",
            f"step {report.step} reported after"
            f" {'the suspend' if spec.suspend else 'the eviction by Kueue'} (within"
            f" checkpoint.evictionGraceSeconds): answered as the last step of attempt"
            f" {status.attempt}; its driver checkpoints at step {cp.step} and stops, and the"
            " next attempt resumes there"))
    prepare = report.prepare_long_round and not done
    # a short round run in place of the planned long one while its scale-up pended
    # (tailBatching.longRound.maxDeferredRounds): the plan was for this step, Long, ScalingUp
    deferred = scaler.deferred_round(report.round_kind, report.step, status.step,
                                     status.round_kind, status.rollout.state)
    if not (done and cp.round_kind is RoundKind.LONG):
        rollout, actions, events = scaler.plan_round(
            st.rollout, spec, cp.round_kind, cp.step, now,
            long_target=None if lim is None else lim.long_round_replicas, prepare=prepare,
            deferred=deferred, ran_long=report.round_kind is RoundKind.LONG)
        st.rollout = rollout
        record_scale_actions(st, actions)
    st.controller_state = new_state
    hosting.fill_status(st, ctl, cp)
    st.long_queue = report.long_queue
    st.last_report_time = t
    if cp.round_kind is RoundKind.LONG and not done:
        rollout = st.rollout
        if rollout.state == "ScalingUp":
            reason = Reason.SCALING_UP
            msg = f"step {cp.step}: waiting for {rollout.desired_replicas} rollout replicas"
            if rollout.deferred_rounds:
                msg += (f" ({rollout.deferred_rounds} short rounds run in the long round's"
                        " place meanwhile)")
        else:
            reason, msg = Reason.RUNNING, f"step {cp.step} is a long round"
        flipped = set_condition(st.conditions, ConditionType.LONG_ROUND, True, reason, msg, t, gen)
        st.conditions = flipped[0]
        if flipped[1]:
            st.long_rounds += 1
    else:
        lr = find(st.conditions, ConditionType.LONG_ROUND)
        if lr is not None and lr.status == "True":
            st.conditions, _ = set_condition(
                st.conditions, ConditionType.LONG_ROUND, False, Reason.FINISHED,
                f"long round done at step {report.step}", t, gen,
            )
    training = find(st.conditions, ConditionType.TRAINING)
    if not stopping and (training is None or training.status != "True"):
        st.conditions, _ = set_condition(
            st.conditions, ConditionType.TRAINING, True, Reason.RUNNING,
            f"attempt {st.attempt} reporting", t, gen,
        )
    if policies is not None and lim is not None:
        _, slo_events = enforce.judge_slo(
            st, policies, straggler_rate=cp.straggler_rate, step_seconds=ctl.mean_step_seconds,
            steps=ctl.steps_observed, now=t, generation=gen)
        events = [*events, *enforce.record_notes(st, lim.notes), *slo_events]
    events = [*stop_events, *events,
              *enforce.judge_straggler_slo(st, ctl, now=t, generation=gen)]
    st.summary = summarize(st.conditions)
    # Only the fields this report replaced: the rest is ``status`` as the API server stored
    # it (so within its schema), and checking the whole status on every report cost more
    # than the rest of this function.
    changed = {name for name in type(st).model_fields
               if getattr(st, name) is not getattr(status, name)}
    bad = schema_violations(status_schema(), st.model_dump(
        mode="json", by_alias=True, exclude_none=True, include=changed))
    if bad:
        # The API server would refuse this status on every retry: answer 422, not 503.
        raise ReportRejected(
            "StatusOutOfRange",
            "the report would make the job's status break its schema: " + "; ".join(bad))
    return st, Accepted(_plan(spec, st, cp, stop=stopping), events, new=True,
                        straggler=bool(cp.straggler),
                        controller=ctl)


#: Rounds one step may run at most (a short round plus DAPO dynamic sampling's refill
#: rounds; the trainer refills at most 2 by default): bounds a report's counts.
MAX_ROUNDS_PER_STEP = 16


_eta = field_range(TailBatchingSpec, "prompt_overprovision")
assert _eta is not None, "TailBatchingSpec.prompt_overprovision has a DecimalRange"
#: promptOverprovision's range, as the model and the CRD check it (for the message).
_ETA_RANGE = _eta.interval()


def report_bounds(spec: RLTrainingJobSpec, group_size: int) -> dict[str, tuple[int, str]]:
    """The largest value the spec allows for each bounded field of a report with this group
    size, with how it follows from the spec (for the message)."""
    p0 = spec.prompts_per_step
    tb = spec.tail_batching
    try:
        # The only float arithmetic on the spec here. The models bound promptOverprovision
        # (so does the CRD); should an unchecked value get this far all the same, the answer
        # names the field (422), never an OverflowError (500).
        eta = decimal(tb.prompt_overprovision) if tb.enabled else 1.0
        launched = math.ceil(eta * p0 - 1e-9)
    except (ArithmeticError, ValueError):
        raise ReportRejected(
            "InvalidSpec",
            f"spec.tailBatching.promptOverprovision {tb.prompt_overprovision!r} x"
            f" spec.promptsPerStep {p0} is no finite prompt count; fix the job's spec"
            f" (promptOverprovision must be in {_ETA_RANGE})") from None
    per_prompt = group_size + (tb.extra_responses_per_prompt if tb.enabled else 0)
    dynamic = algorithm_knob(spec.algorithm, "dynamic_sampling")
    rounds = MAX_ROUNDS_PER_STEP if dynamic else 1
    times = f" x {rounds} rounds" if rounds > 1 else ""
    # a long round runs up to longRound.prompts prompts (promptsPerStep unset), all kept,
    # and up to longRound.fillPrompts fresh ones beside them
    lr = tb.long_round
    long_p = max(p0, lr.prompts or p0) if tb.enabled else p0
    fill = int(lr.fill_prompts or 0) if tb.enabled else 0
    trained, trained_why = (
        (long_p, f"spec.tailBatching.longRound.prompts {long_p}") if long_p > p0
        else (p0, f"spec.promptsPerStep {p0}"))
    if fill and long_p + fill > trained:
        trained, trained_why = (long_p + fill, f"a long round's prompts {long_p} +"
                                f" spec.tailBatching.longRound.fillPrompts {fill}")
    if tb.enabled and tb.keep_near_cap is not None and launched > trained:
        # a short round that reached the cap keeps every prompt it launched
        trained, trained_why = (launched, f"ceil(promptOverprovision x promptsPerStep)"
                                f" {launched} (spec.tailBatching.keepNearCap)")
    # the queue before a long round: up to long_p - 1 prompts, plus what a short round adds
    # (its deferred prompts, and as many routed ones with the length prior's routing), for
    # the round itself and each short round run in a held long round's place
    per_round = (launched - p0) * (2 if tb.length_prior is not None
                                   and tb.length_prior.route else 1)
    # (a filled long round queues the fill prompts it aborts)
    queued = long_p + (1 + lr.max_deferred_rounds) * per_round + fill
    aborted, aborted_why = (
        launched * per_prompt,
        f"ceil(promptOverprovision x promptsPerStep) {launched} x (groupSize"
        f" + extraResponsesPerPrompt) {per_prompt}")
    if fill * group_size > aborted:
        aborted, aborted_why = (fill * group_size, f"spec.tailBatching.longRound.fillPrompts"
                                f" {fill} x groupSize {group_size}")
    return {
        "lengths.max": (spec.rollout.max_response_tokens, "spec.rollout.maxResponseTokens"),
        "lengths.count": (group_size * trained * rounds,
                          f"groupSize {group_size} x {trained_why}{times}"),
        "lengths.aborted": (aborted * rounds, f"{aborted_why}{times}"),
        "longQueue": (queued * rounds,
                      f"a long round's prompts {long_p} + {1 + lr.max_deferred_rounds} short"
                      f" round(s) x {per_round} deferred or routed"
                      + (f" + fillPrompts {fill}" if fill else "") + times),
    }


def check_report(spec: RLTrainingJobSpec, report: StepReport) -> None:
    """Reject (:class:`ReportRejected`) a new report the job's spec makes impossible: a step
    after the last one (``spec.steps``; the plan said done), a response longer than the
    length cap, counts beyond what the step could launch. Such a report would move SAGC."""
    if report.step >= spec.steps:
        raise ReportRejected(
            "JobDone",
            f"step {report.step} is past the job's last step {spec.steps - 1} (spec.steps"
            f" {spec.steps}): the plan said done; the driver should exit")
    values = {
        "lengths.max": report.lengths.max,
        "lengths.count": report.lengths.count,
        "lengths.aborted": report.lengths.aborted,
        "longQueue": report.long_queue,
    }
    for name, (bound, why) in report_bounds(spec, report.group_size).items():
        if values[name] > bound:
            raise ReportRejected(
                "OutOfBounds", f"{name} {values[name]} exceeds {bound} ({why})")


__all__ = [
    "Accepted", "JobSuspended", "ReportRejected", "StateUnreadable", "accept_report",
    "check_report", "current_plan", "report_bounds",
]
