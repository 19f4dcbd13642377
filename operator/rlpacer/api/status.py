"""The RLTrainingJob status: conditions (the truth), readable progress, the controller state.

Conditions follow Kubernetes API conventions (``metav1.Condition``): a type, a status
(True/False/Unknown), a CamelCase reason from the documented sets below, a message truncated to
a bound, ``observedGeneration`` and ``lastTransitionTime`` (changed only when the status
flips). The one-word ``summary`` (the printer column) is *derived* from the conditions by
:func:`summarize`, never set independently.

The controller state is kept bit-exactly as a JSON string (``controllerState``): the operator
writes exactly the bytes the control layer serialised, and restores from exactly those bytes
after a restart. Readable copies of the interesting numbers (group size, lambda, posteriors,
straggler rate) sit beside it; decimals are strings, as everywhere in the API.

Every integer is bounded on both sides in the CRD: by the spec's own bounds where the operator
derives the value from the spec (step, group size), by Kubernetes' int32 where it counts
replicas or pod ordinals, and by 2**53 - 1 for counters (attempts, failures, generations: the
largest integer the API server's float64 bounds hold exactly).

Pure: no I/O. The operator writes status through one path (``rlpacer.operator.runtime``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import Field, StringConstraints

from rlpacer.api._base import INT32_MAX, MAX_COUNT, APIModel, Decimal, read_stored
from rlpacer.api.job import MAX_GROUP_SIZE, MAX_STEPS, EffectiveAlgorithm


def _most(n: int) -> dict[str, Any]:
    """The CRD's maximum of a status integer. Only the schema's: the operator computes these
    values, and a status model that raised on an assignment past the bound would fail the
    report or the pass half way; the writer checks the changed fields against the schema
    before writing instead (``schema_violations``: a report that would break it is a 422)."""
    return {"maximum": n}


#: Messages are truncated to this many characters (Events and conditions stay readable).
MAX_MESSAGE = 1024
#: How many scale actions status keeps (newest last).
MAX_SCALE_ACTIONS = 10


class ConditionType(enum.StrEnum):
    """Condition types of an RLTrainingJob."""

    #: The spec was accepted and the children were created. Reasons: Created, InvalidSpec.
    ADMITTED = "Admitted"
    #: The short-round rollout capacity is ready. Reasons: ReplicasReady, WaitingForReplicas.
    ROLLOUT_READY = "RolloutReady"
    #: The driver runs steps. Reasons: Starting, Running, Restarting, Stopped.
    TRAINING = "Training"
    #: A long round is planned or running. Reasons: ScalingUp, Running, ScaleUpTimedOut,
    #: Finished.
    LONG_ROUND = "LongRound"
    #: The pods are gone, the state kept: spec.suspend is true (Suspended), or Kueue holds the
    #: job (WaitingForQueue: not admitted yet; Evicted: preempted or its queue stopped).
    #: False reason: Resumed.
    SUSPENDED = "Suspended"
    #: Only for a job with spec.scheduling.queueName: Kueue admitted the job's Workload
    #: (True reason AdmittedByKueue); False reasons WaitingForQueue (the message is Kueue's),
    #: Evicted, KueueNotInstalled, Suspended (spec.suspend: the Workload given back).
    QUEUE_ADMITTED = "QueueAdmitted"
    #: The job breaks its namespace policy's SLO (windowed straggler rate or mean step time),
    #: judged on each step report. True reasons: StragglerRateAboveSLO, StepTimeAboveSLO;
    #: False reasons: WithinSLO, NotEnoughSteps, NoSLO. Absent while no policy sets an SLO.
    SLO_VIOLATED = "SLOViolated"
    #: The job's own straggler SLO (groupControl.targetStragglerRate over short rounds),
    #: judged on each step report from SAGC's evidence (rlpacer.control.plan). True reason:
    #: WithinTarget; False reasons: Exceeded, Infeasible (no candidate G can meet it at
    #: stragglerRatio). Absent until enough short rounds were seen.
    STRAGGLER_SLO_MET = "StragglerSLOMet"
    #: status.controllerState was found unreadable or missing (edited by someone else) and
    #: the operator rebuilt it from the spec and the status's readable fields (step, attempt,
    #: group size, lambda, posteriors); True from then on, the message says what was kept.
    #: Reasons: ControllerStateUnreadable, ControllerStateMissing. Absent while never rebuilt.
    STATE_REBUILT = "StateRebuilt"
    #: Terminal: the driver finished every step. Reason: Completed.
    SUCCEEDED = "Succeeded"
    #: Terminal. Reasons: BackoffLimitExceeded, DeadlineExceeded, InvalidSpec,
    #: ControllerStateLost (the controller state could not be rebuilt).
    FAILED = "Failed"


class ConditionStatus(enum.StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Reason(enum.StrEnum):
    """Documented condition reasons (CamelCase, machine-readable)."""

    CREATED = "Created"
    INVALID_SPEC = "InvalidSpec"
    REPLICAS_READY = "ReplicasReady"
    WAITING_FOR_REPLICAS = "WaitingForReplicas"
    STARTING = "Starting"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    STOPPED = "Stopped"
    SCALING_UP = "ScalingUp"
    SCALE_UP_TIMED_OUT = "ScaleUpTimedOut"
    FINISHED = "Finished"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    COMPLETED = "Completed"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    DATA_INVALID = "DataInvalid"  # the driver found bad data at start (no retry)
    # the learner's estimated memory per rank exceeds a rank's (checked at start, no retry)
    LEARNER_DOES_NOT_FIT = "LearnerDoesNotFit"
    # StateRebuilt (True), and Failed when no rebuild was possible
    CONTROLLER_STATE_UNREADABLE = "ControllerStateUnreadable"
    CONTROLLER_STATE_MISSING = "ControllerStateMissing"
    CONTROLLER_STATE_LOST = "ControllerStateLost"
    # SLOViolated (the values of rlpacer.control.policy.SLOReason)
    STRAGGLER_RATE_ABOVE_SLO = "StragglerRateAboveSLO"
    STEP_TIME_ABOVE_SLO = "StepTimeAboveSLO"
    WITHIN_SLO = "WithinSLO"
    NOT_ENOUGH_STEPS = "NotEnoughSteps"
    NO_SLO = "NoSLO"
    # StragglerSLOMet (the values of rlpacer.control.plan.SLOState, Met as WithinTarget)
    WITHIN_TARGET = "WithinTarget"
    EXCEEDED = "Exceeded"
    INFEASIBLE = "Infeasible"
    # QueueAdmitted (and Suspended while Kueue holds the job)
    ADMITTED_BY_KUEUE = "AdmittedByKueue"
    WAITING_FOR_QUEUE = "WaitingForQueue"
    EVICTED = "Evicted"
    KUEUE_NOT_INSTALLED = "KueueNotInstalled"


#: Reasons with which SLOViolated is True (one per metric series rlpacer_slo_violated{reason}).
SLO_BREACH_REASONS = (Reason.STRAGGLER_RATE_ABOVE_SLO, Reason.STEP_TIME_ABOVE_SLO)
#: How many policy notes (clamps, warnings) status keeps.
MAX_POLICY_NOTES = 8


class Summary(enum.StrEnum):
    """One word for ``kubectl get`` (derived from the conditions by :func:`summarize`)."""

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    LONG_ROUND = "LongRound"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Condition(APIModel):
    """One observation of the job's state (Kubernetes ``metav1.Condition`` shape)."""

    type: ConditionType = Field(description="Kind of condition (Admitted, RolloutReady, ...).")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase machine-readable cause of the last transition.",
    )
    message: str = Field(
        default="", max_length=MAX_MESSAGE, description="Human-readable detail of the reason."
    )
    last_transition_time: str = Field(
        description="When status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(
        default=None, ge=0, json_schema_extra=_most(MAX_COUNT),
        description="metadata.generation the condition was set from.",
    )


class Posterior(APIModel):
    """SAGC's belief about the straggler probability at one group size."""

    group_size: int = Field(
        ge=1, json_schema_extra=_most(MAX_GROUP_SIZE), description="The candidate group size G."
    )
    alpha: Decimal | None = Field(
        default=None, description="Beta posterior alpha (straggler pseudo-count); SAGC only."
    )
    beta: Decimal | None = Field(
        default=None, description="Beta posterior beta (non-straggler pseudo-count); SAGC only."
    )
    mean: Decimal = Field(description="Posterior mean straggler probability p(G).")


class RolloutStatus(APIModel):
    """Rollout capacity: what the plan asks for and what is ready."""

    desired_replicas: int = Field(
        default=0, ge=0, json_schema_extra=_most(INT32_MAX),
        description="Replicas the plan asks for now.",
    )
    ready_replicas: int = Field(
        default=0, ge=0, json_schema_extra=_most(INT32_MAX),
        description="Replicas ready (observed).",
    )
    state: str = Field(
        default="Ready",
        description="Ready, ScalingUp or TimedOut (the plan's rollout state).",
        json_schema_extra={"enum": ["Ready", "ScalingUp", "TimedOut"]},
    )
    scale_up_started_at: str | None = Field(
        default=None, description="When the pending scale-up began (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    ready_ordinals: list[Annotated[int, Field(
        ge=0, json_schema_extra=_most(INT32_MAX))]] | None = Field(
        default=None,
        description=(
            "Ordinals of the rollout StatefulSet's pods that are Ready (observed), in order;"
            " the plan's usableReplicas are those below desiredReplicas."
        ),
        json_schema_extra={"maxItems": 4096},
    )
    deferred_rounds: int | None = Field(
        default=None, ge=0, json_schema_extra=_most(INT32_MAX),
        description=(
            "Short rounds the driver ran in place of the pending long round while its extra"
            " replicas were not ready (tailBatching.longRound.maxDeferredRounds); absent once"
            " the long round runs or the replicas go back."
        ),
    )


class ScaleAction(APIModel):
    """A change of the rollout StatefulSet's replicas."""

    time: str = Field(description="When (RFC 3339).", json_schema_extra={"format": "date-time"})
    from_replicas: int = Field(
        ge=0, json_schema_extra=_most(INT32_MAX), description="Replicas before.")
    to_replicas: int = Field(
        ge=0, json_schema_extra=_most(INT32_MAX), description="Replicas after.")
    reason: str = Field(max_length=64, description=(
        "LongRound, EarlyScaleUp (a long round forecast within its replicas' join time),"
        " ScaleUpTimedOut, LongRoundDone or PolicyClamped (a policy tightened while the"
        " scale-up was pending)."))
    step: int = Field(
        ge=0, json_schema_extra=_most(MAX_STEPS), description="The step the action was for.")


#: Token hashes kept in status (a new one is added only when the Secret's token was lost).
MAX_TOKEN_HASHES = 4
TokenHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$", max_length=64)]


class RLTrainingJobStatus(APIModel):
    """Observed state of an RLTrainingJob, written only by the operator."""

    observed_generation: int | None = Field(
        default=None, ge=0, json_schema_extra=_most(MAX_COUNT),
        description="The metadata.generation last reconciled.",
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16,
        description="Current conditions, one per type.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    summary: Summary | None = Field(
        default=None, description="One word derived from the conditions (the STATUS column)."
    )
    attempt: int = Field(
        default=0, ge=0, json_schema_extra=_most(MAX_COUNT),
        description="The trainer's incarnation (RLPACER_ATTEMPT); grows on restart and resume.",
    )
    failures: int = Field(
        default=0, ge=0, json_schema_extra=_most(MAX_COUNT),
        description="Driver failures so far (compared with spec.backoffLimit).",
    )
    start_time: str | None = Field(
        default=None,
        description="When the job (last) started running (RFC 3339); reset on resume.",
        json_schema_extra={"format": "date-time"},
    )
    completion_time: str | None = Field(
        default=None, description="When the job reached a terminal state (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    step: int = Field(
        default=0, ge=0, json_schema_extra=_most(MAX_STEPS),
        description="The next step to run (= steps completed).",
    )
    group_size: int | None = Field(
        default=None, ge=1, json_schema_extra=_most(MAX_GROUP_SIZE),
        description="G the plan gives now.",
    )
    round_kind: str | None = Field(
        default=None, description="Kind of the next round: Short or Long.",
        json_schema_extra={"enum": ["Short", "Long"]},
    )
    lambda_: Decimal | None = Field(
        default=None, alias="lambda", description="SAGC's dual variable (the straggler price)."
    )
    straggler_rate: Decimal | None = Field(
        default=None,
        description="The straggler SLO's rate: straggler steps over the last"
        " groupControl.windowSteps short rounds (long rounds are counted apart).",
    )
    long_round_straggler_rate: Decimal | None = Field(
        default=None,
        description="Straggler steps over the last groupControl.windowSteps long rounds (they"
        " straggle by design and are not part of the SLO); absent before any long round.",
    )
    step_seconds: Decimal | None = Field(
        default=None,
        description="Mean step time (seconds) over the last groupControl.windowSteps steps.",
    )
    slo_breaches: list[str] | None = Field(
        default=None, max_length=2,
        description="Every SLO the job breaks now (StragglerRateAboveSLO, StepTimeAboveSLO);"
        " the SLOViolated condition's reason names the first.",
        json_schema_extra={"items": {"type": "string",
                                     "enum": ["StragglerRateAboveSLO", "StepTimeAboveSLO"]}},
    )
    posteriors: list[Posterior] = Field(
        default_factory=list, max_length=16, description="SAGC's belief per candidate G."
    )
    algorithm: EffectiveAlgorithm | None = Field(
        default=None,
        description=("The algorithm the job runs: spec.algorithm's preset with the knobs the"
                     " spec sets."),
    )
    long_queue: int = Field(
        default=0, ge=0, json_schema_extra=_most(MAX_COUNT),
        description="Prompts waiting for a long round.",
    )
    long_rounds: int = Field(
        default=0, ge=0, json_schema_extra=_most(MAX_COUNT),
        description="Long rounds started so far.",
    )
    rollout: RolloutStatus = Field(
        default_factory=RolloutStatus, description="Rollout capacity: desired and ready."
    )
    scale_actions: list[ScaleAction] = Field(
        default_factory=list, max_length=MAX_SCALE_ACTIONS,
        description=f"The last {MAX_SCALE_ACTIONS} rollout scale actions, newest last.",
    )
    policy_notes: list[str] = Field(
        default_factory=list, max_length=MAX_POLICY_NOTES,
        description=(
            "What the namespace's RLTrainingPolicies changed at run time (Enforce: the straggler"
            " target, group sizes or long-round replicas clamped) or would change (Warn: lines"
            " starting with 'Warn: '); empty when the job is within every policy."
        ),
    )
    last_report_time: str | None = Field(
        default=None, description="When the last step report was accepted (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    token_hashes: list[TokenHash] = Field(
        default_factory=list, max_length=MAX_TOKEN_HASHES,
        description=(
            "SHA-256 (hex) of the step-report tokens the job's Secret has held, newest last"
            f" (at most {MAX_TOKEN_HASHES}): a report must present one of them. The operator"
            " re-creates a deleted Secret with the same token; only when it no longer knows"
            " the token (the Secret was deleted while no operator held it) does it mint a new"
            " one, and the running driver's token stays valid."
        ),
    )
    controller_state: str | None = Field(
        default=None, max_length=1_048_576,
        description=(
            "The job controller's state as the control layer serialised it (JSON, bit-exact):"
            " an operator restart continues from exactly this."
        ),
    )


def read_status(data: Any) -> tuple[RLTrainingJobStatus, list[str]]:
    """Read a stored job's status, written by this operator or another version of it: fields
    it does not know are ignored, values it cannot read (a condition type or enum value a
    newer version added) are dropped to their defaults; both returned, by path. The controller
    state, attempt and step survive whatever else in the status is unreadable."""
    st, left_out = read_stored(RLTrainingJobStatus, data, drop_invalid=True)
    return st, [f"status.{p}" for p in left_out]


TERMINAL = (ConditionType.SUCCEEDED, ConditionType.FAILED)


def truncate(message: str, limit: int = MAX_MESSAGE) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def find(conditions: Sequence[Condition], type_: ConditionType) -> Condition | None:
    for c in conditions:
        if c.type == type_:
            return c
    return None


def is_true(conditions: Sequence[Condition], type_: ConditionType) -> bool:
    c = find(conditions, type_)
    return c is not None and c.status == ConditionStatus.TRUE


def is_terminal(conditions: Sequence[Condition]) -> bool:
    """Succeeded or Failed: nothing more happens to the job except TTL cleanup."""
    return any(is_true(conditions, t) for t in TERMINAL)


def set_condition(
    conditions: Sequence[Condition],
    type_: ConditionType,
    status: bool | ConditionStatus,
    reason: Reason | str,
    message: str,
    now: str,
    generation: int | None,
) -> tuple[list[Condition], bool]:
    """Return (new conditions, whether the status of this type flipped).

    ``lastTransitionTime`` changes only when the status flips; reason and message follow the
    latest call. Order is stable (new types are appended).
    """
    st = status if isinstance(status, ConditionStatus) else (
        ConditionStatus.TRUE if status else ConditionStatus.FALSE
    )
    reason_s = reason.value if isinstance(reason, Reason) else reason
    msg = truncate(message)
    out: list[Condition] = []
    flipped = True
    found = False
    for c in conditions:
        if c.type != type_:
            out.append(c)
            continue
        found = True
        flipped = c.status != st
        out.append(
            Condition(
                type=type_, status=st, reason=reason_s, message=msg,
                last_transition_time=now if flipped else c.last_transition_time,
                observed_generation=generation,
            )
        )
    if not found:
        out.append(
            Condition(
                type=type_, status=st, reason=reason_s, message=msg,
                last_transition_time=now, observed_generation=generation,
            )
        )
    return out, flipped


def summarize(conditions: Sequence[Condition]) -> Summary:
    """The one-word summary, derived from the conditions (first match wins)."""
    if is_true(conditions, ConditionType.FAILED):
        return Summary.FAILED
    if is_true(conditions, ConditionType.SUCCEEDED):
        return Summary.SUCCEEDED
    if is_true(conditions, ConditionType.SUSPENDED):
        held = find(conditions, ConditionType.SUSPENDED)
        if held is not None and held.reason in (Reason.WAITING_FOR_QUEUE.value,
                                                Reason.EVICTED.value,
                                                Reason.KUEUE_NOT_INSTALLED.value):
            return Summary.QUEUED
        return Summary.SUSPENDED
    training = find(conditions, ConditionType.TRAINING)
    if training is not None and training.reason == Reason.RESTARTING.value:
        return Summary.RESTARTING
    if is_true(conditions, ConditionType.LONG_ROUND):
        return Summary.LONG_ROUND
    if is_true(conditions, ConditionType.TRAINING):
        return Summary.RUNNING
    if is_true(conditions, ConditionType.ADMITTED):
        return Summary.STARTING
    return Summary.PENDING
