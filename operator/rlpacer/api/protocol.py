"""The step-report protocol between a job's trainer (driver) and the operator.

Versioned: the paths carry ``/v1/``. DESIGN.md "Step-report protocol" is the prose contract;
these models are its single implementation on both sides (the operator's endpoint and the
trainer's client, and the in-process transport of ``rlpacer run``).

* ``GET  /v1/namespaces/{ns}/rltrainingjobs/{name}/plan``  -> :class:`Plan`
* ``POST /v1/namespaces/{ns}/rltrainingjobs/{name}/steps`` (Bearer job token) with a
  :class:`StepReport` -> :class:`Plan` for the next step, sent only after the controller
  state is persisted.

Idempotency key: ``(attempt, step)``. Errors: 401 bad token, 404 unknown job, 413 body over
64 KiB, 422 malformed or impossible report (including values the job's spec rules out and
steps after the plan said done: charts/rlpacer/README.md "Step reports"); each answered
with an :class:`ErrorBody` and no state change; 408 a body too slow, 409 a suspended job; 429
(``Retry-After``) over the job's request rate. 5xx only for what a retry can fix (docs/protocol.md,
"Answers and limits").

Version tolerance (docs/protocol.md, "Versions"): within ``/v1/`` a peer may add
optional fields. Every model here ignores fields it does not know when reading (unlike the
CRD's models, which reject them), so a newer trainer's report reaches an older operator and
a newer operator's plan reaches an older trainer; :func:`unknown_fields` names what was
ignored, for the reader to log and count. A change an older peer cannot ignore (a new
required field, a changed meaning) takes a new path version.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from rlpacer.api._base import APIModel

PROTOCOL_VERSION = "v1"


def plan_path(namespace: str, name: str) -> str:
    return f"/{PROTOCOL_VERSION}/namespaces/{namespace}/rltrainingjobs/{name}/plan"


def steps_path(namespace: str, name: str) -> str:
    return f"/{PROTOCOL_VERSION}/namespaces/{namespace}/rltrainingjobs/{name}/steps"


def release_path(namespace: str, name: str) -> str:
    return f"/{PROTOCOL_VERSION}/namespaces/{namespace}/rltrainingjobs/{name}/release"


class WireModel(APIModel):
    """A protocol message: like :class:`APIModel` (camelCase), but a field this version does
    not know is ignored rather than refused (a newer peer's addition)."""

    model_config = ConfigDict(extra="ignore")


# The protocol is JSON with integers: a report's numbers are taken as they are typed, never
# coerced (pydantic's default would take "8", 8.0 and true for the integer 8, and "1.5" for
# a float). Every trainer builds its report from these models, whose JSON writes integers
# as integers, so only a hand-made or broken body is refused (422, the field named).
#: An integer field of a report: a JSON integer (not a string, a float such as 0.0, a bool).
WireInt = Annotated[int, Strict()]
#: A number field of a report: a JSON number, integer or not (not a string, not a bool).
WireFloat = Annotated[float, Strict()]


#: At most this many unknown field names are reported per message (a hostile body may
#: carry thousands).
MAX_UNKNOWN_REPORTED = 16


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def unknown_fields(model: type[BaseModel], raw: Any, prefix: str = "") -> list[str]:
    """Dotted names of the fields of ``raw`` (the JSON read) that ``model`` ignores, nested
    models included; at most :data:`MAX_UNKNOWN_REPORTED`, each cut to 64 characters."""
    out: list[str] = []
    if not isinstance(raw, dict):
        return out
    known: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        known[name] = f.annotation
        if f.alias:
            known[f.alias] = f.annotation
    for key, value in raw.items():
        if len(out) >= MAX_UNKNOWN_REPORTED:
            break
        if key not in known:
            out.append(f"{prefix}{str(key)[:64]}")
            continue
        sub = _model_of(known[key])
        if sub is not None:
            out.extend(unknown_fields(sub, value, f"{prefix}{key}."))
    return out[:MAX_UNKNOWN_REPORTED]


class RoundKind(enum.StrEnum):
    """Kind of a rollout round (one round = one step = one policy update)."""

    SHORT = "Short"  # over-provisioned race: keep the first finishers, defer the rest
    LONG = "Long"  # deferred long-tail prompts, everything runs to completion


class RolloutState(enum.StrEnum):
    """Whether the rollout capacity the plan asks for is there."""

    READY = "Ready"
    SCALING_UP = "ScalingUp"  # the driver polls GET plan until Ready or TimedOut
    TIMED_OUT = "TimedOut"  # run on what is ready (never a deadlock when GPUs are short)


class LengthSummary(WireModel):
    """Response-length statistics (tokens) of one step's kept responses."""

    max: WireInt = Field(ge=0, description="Longest kept response, in tokens.")
    median: WireFloat = Field(ge=0, description="Median kept response length, in tokens.")
    p90: WireFloat = Field(
        ge=0, description="90th percentile of kept response lengths, in tokens.")
    count: WireInt = Field(ge=0, description="Number of kept (scored and trained) responses.")
    aborted: WireInt = Field(
        default=0, ge=0, description="Responses aborted by tail batching in this round."
    )
    mean: WireFloat | None = Field(
        default=None, ge=0,
        description="Mean kept response length, in tokens (optional; with it SAGC per second"
                    " prices a step from its tokens: count x mean).")

    @model_validator(mode="after")
    def _ordered(self) -> LengthSummary:
        if self.max < self.median:
            raise ValueError(f"lengths.max ({self.max}) < lengths.median ({self.median})")
        if self.p90 > self.max:
            raise ValueError(f"lengths.p90 ({self.p90}) > lengths.max ({self.max})")
        if self.mean is not None and self.mean > self.max:
            raise ValueError(f"lengths.mean ({self.mean}) > lengths.max ({self.max})")
        return self


#: Largest value of each ``seconds`` field (about 31.7 years): any real step is far below,
#: and it keeps their sum, and the operator's mean of a window of them, a finite float.
MAX_SECONDS = 1e9


class StepSeconds(WireModel):
    """Where the step's wall-clock time went."""

    rollout: WireFloat = Field(default=0.0, ge=0, le=MAX_SECONDS,
                           description="Generation time, seconds.")
    reward: WireFloat = Field(default=0.0, ge=0, le=MAX_SECONDS,
                          description="Reward time not hidden by rollout.")
    train: WireFloat = Field(default=0.0, ge=0, le=MAX_SECONDS,
                         description="Policy update time, seconds.")
    sync: WireFloat = Field(default=0.0, ge=0, le=MAX_SECONDS,
                        description="Weight sync to engines, seconds.")

    @property
    def total(self) -> float:
        return self.rollout + self.reward + self.train + self.sync


class StragglerRisk(WireModel):
    """The next round's predicted straggler probability at one candidate group size."""

    group_size: WireInt = Field(ge=1, description="A candidate group size G.")
    probability: WireFloat = Field(
        ge=0, le=1, description="P(the round straggles at this G), from the length prior.")


class ReleaseRequest(WireModel):
    """``POST release``: the driver of a long round under way gives its added rollout
    replicas back before the step's report (``tailBatching.longRound.releaseWhenFits``:
    the round's unfinished requests fit on the rollout's own replicas, moved there and the
    added engines shut down). The operator scales the rollout back to ``rollout.replicas``
    at once; the step's report then finds nothing to scale down."""

    attempt: WireInt = Field(ge=0, description="The trainer's restart count (RLPACER_ATTEMPT).")
    step: WireInt = Field(ge=0, description="The step whose long round is under way.")


class StepReport(WireModel):
    """What the driver reports after each step (short or long round)."""

    attempt: WireInt = Field(ge=0, description="The trainer's restart count (RLPACER_ATTEMPT).")
    step: WireInt = Field(ge=0, description="The step just finished; steps count from 0.")
    group_size: WireInt = Field(
        ge=1, description="The group size G the plan gave for this step.")
    round_kind: RoundKind = Field(description="Kind of the round just run.")
    lengths: LengthSummary
    seconds: StepSeconds = Field(default_factory=StepSeconds)
    long_queue: WireInt = Field(
        default=0, ge=0, description="Prompts waiting for a long round.")
    next_round_kind: RoundKind = Field(
        default=RoundKind.SHORT, description="Kind of round the tail-batching planner wants next."
    )
    reward: WireFloat | None = Field(
        default=None, description="Mean reward of the step, if known.")
    prepare_long_round: bool = Field(
        default=False, strict=True,
        description=(
            "The next round is short, but a long round is forecast within the time its extra"
            " rollout replicas take to join (tailBatching.longRound.scaleUpLeadSeconds, or as"
            " measured): the operator scales the rollout up now and the short rounds in"
            " between do not wait for it. Older trainers never send it (the scale-up is then"
            " asked at the report before the long round)."))
    next_straggler_risk: list[StragglerRisk] | None = Field(
        default=None, max_length=64,
        description=(
            "The next round's predicted straggler probability per candidate group size, from"
            " the per-prompt length prior (tailBatching.lengthPrior.context): SAGC's context"
            " for its choice of the next G. Absent: SAGC decides without one (older trainers,"
            " or the use off); an older operator ignores it."))

    @model_validator(mode="after")
    def _distinct_sizes(self) -> StepReport:
        risk = self.next_straggler_risk
        if risk is not None and len({r.group_size for r in risk}) != len(risk):
            raise ValueError("nextStragglerRisk names a groupSize twice")
        return self


class RolloutCapacity(WireModel):
    desired_replicas: int = Field(ge=0, description="Rollout replicas the plan asks for.")
    ready_replicas: int = Field(ge=0, description="Rollout replicas ready now.")
    state: RolloutState = RolloutState.READY
    usable_replicas: list[int] | None = Field(
        default=None,
        description=(
            "The rollout replica indexes (StatefulSet ordinals) the next round may use: the"
            " ready ones within the desired count, in order (a gap is possible: [0, 2])."
            " Sent only to trainers that ask for it (header X-RLPacer-Plan-Fields:"
            " usableReplicas); absent, a trainer uses 0..min(ready, desired)-1."
        ),
    )

    @model_validator(mode="after")
    def _usable(self) -> RolloutCapacity:
        u = self.usable_replicas
        if u is not None and (any(i < 0 for i in u) or len(set(u)) != len(u)):
            raise ValueError(f"rollout.usableReplicas must be distinct ordinals >= 0: {u}")
        return self


#: The request header by which a trainer says which optional plan fields it understands
#: (comma-separated). Plans are validated strictly (unknown fields are errors), so the
#: operator sends an optional field only to a trainer that names it here.
PLAN_FIELDS_HEADER = "X-RLPacer-Plan-Fields"
USABLE_REPLICAS = "usableReplicas"


def plan_for_client(plan: Plan, accepted: str | None) -> dict[str, object]:
    """The plan's wire form for a client whose ``X-RLPacer-Plan-Fields`` header is
    ``accepted``: optional fields it does not name are left out (older trainers)."""
    wire = plan.to_wire()
    names = {f.strip() for f in (accepted or "").split(",")}
    rollout = wire.get("rollout")
    if USABLE_REPLICAS not in names and isinstance(rollout, dict):
        rollout.pop(USABLE_REPLICAS, None)
    return wire


class Plan(WireModel):
    """The plan for the next step."""

    step: int = Field(ge=0, description="The step this plan is for.")
    group_size: int = Field(ge=1, description="G to use for this step.")
    round_kind: RoundKind = RoundKind.SHORT
    rollout: RolloutCapacity
    lambda_: float = Field(default=0.0, alias="lambda", description="SAGC's dual variable.")
    straggler_rate: float = Field(default=0.0, description="Windowed straggler rate.")
    done: bool = Field(default=False, description="True once the job has run all its steps.")


class ErrorBody(WireModel):
    """Body of every error answer (401, 404, 422)."""

    code: int
    reason: str = Field(description="Machine-readable reason, e.g. StepOutOfOrder.")
    message: str = Field(description="What was wrong and how to fix it.")
