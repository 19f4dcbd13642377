"""The RLTrainingPolicy API (group ``rlpacer.io``, version ``v1alpha1``, short name ``rltp``).

A platform team applies one or more policies per namespace: which group sizes jobs may use,
the loosest straggler target (delta) a job may ask for, how far long rounds may scale, the
straggler and step-time SLOs the operator watches at run time, and defaults filled into jobs
that leave fields unset. ``action`` says whether breaking it rejects (``Enforce``) or only
warns (``Warn``).

Design decisions:

* Namespaced, so RBAC on the namespace decides who may set it and ``kubectl get rltp -n team``
  shows what applies. Every policy in a job's namespace applies (the strictest wins: limits
  compose by intersection; defaults are taken from policies in name order, first set wins).
* The limits are checked by the validating webhook and enforced again at run time (clamping
  the controller and the scaler), so a policy created after a job still binds it.
* Field names follow the shape in ``shared/examples/policy.yaml``; acronyms stay upper case on
  the wire (``stragglerSLO``, ``maxGPUs``) as in Kubernetes' own APIs (``podIP``).
* Decimals are strings (no floats in a CRD) and parsed by :func:`rlpacer.api._base.decimal`;
  every number is bounded on both sides (:class:`rlpacer.api._base.DecimalRange`, ``ge``/``le``).
* Models only: the CRD documents are built from them by :mod:`rlpacer.api.crd`.

The pure logic that applies a policy to a job lives in :mod:`rlpacer.control.policy`.
"""

from __future__ import annotations

import enum
import itertools
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationError, field_validator, model_validator

from rlpacer.api._base import (
    MAX_DURATION_SECONDS,
    APIModel,
    Decimal,
    DecimalRange,
    TypedObject,
    decimal,
)
from rlpacer.api.job import (
    API_VERSION,
    GROUP,
    MAX_GROUP_SIZE,
    MAX_TOKENS,
    VERSION,
    GroupControlMode,
    GroupSize,
    ManifestError,
    ObjectMeta,
    format_validation_error,
)

__all__ = [
    "API_VERSION",
    "CLUSTER_KIND",
    "CLUSTER_PLURAL",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "ClusterRLTrainingPolicy",
    "LabelSelector",
    "PolicyAction",
    "RLTrainingPolicy",
    "RLTrainingPolicySpec",
    "parse_cluster_policy",
    "parse_policy",
]

KIND = "RLTrainingPolicy"
PLURAL = "rltrainingpolicies"
SINGULAR = "rltrainingpolicy"
SHORT_NAMES = ["rltp"]

CLUSTER_KIND = "ClusterRLTrainingPolicy"
CLUSTER_PLURAL = "clusterrltrainingpolicies"
CLUSTER_SINGULAR = "clusterrltrainingpolicy"
CLUSTER_SHORT_NAMES = ["crltp"]


class PolicyAction(enum.StrEnum):
    ENFORCE = "Enforce"  # reject violating jobs at admission; clamp running jobs
    WARN = "Warn"  # admit with a warning; report SLO breaches; never change a job


class GroupSizePolicy(APIModel):
    allowed: list[GroupSize] = Field(
        min_length=1, max_length=16,
        description=(
            "Group sizes jobs may use: every entry of a job's groupControl.candidates (and its"
            " initial size) must be one of these. Strictly increasing."
        ),
    )

    @field_validator("allowed")
    @classmethod
    def _sorted_unique(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in itertools.pairwise(v)):
            raise ValueError("allowed must be strictly increasing, e.g. [4, 8, 16]")
        return v


class StragglerSLO(APIModel):
    max_target_straggler_rate: Annotated[Decimal, DecimalRange(0, 1, True, True)] | None = Field(
        default=None,
        description=(
            "The loosest straggler target (groupControl.targetStragglerRate, delta) a job may ask"
            " for, in (0, 1). Unset: any target."
        ),
    )
    max_observed_straggler_rate: Annotated[
        Decimal, DecimalRange(0, 1, low_open=True)] | None = Field(
        default=None,
        description=(
            "A job whose windowed straggler rate exceeds this breaks the SLO (condition"
            " SLOViolated, an Event, a metric), in (0, 1]. Unset: maxTargetStragglerRate."
        ),
    )
    window_steps: int = Field(
        default=50, ge=1, le=10_000,
        description=(
            "Steps in the window over which the straggler rate is measured; a job is not judged"
            " before it has run this many steps."
        ),
    )

    def observed_limit(self) -> float | None:
        """The windowed straggler rate above which the SLO is broken, or None (no SLO)."""
        text = self.max_observed_straggler_rate or self.max_target_straggler_rate
        return None if text is None else decimal(text)


class StepTimeSLO(APIModel):
    max_seconds: int = Field(
        ge=1, le=7 * 86_400,
        description=(
            "A job whose windowed mean step time (one policy update, rollout to weight sync)"
            " exceeds this many seconds breaks the SLO."
        ),
    )


class LongRoundPolicy(APIModel):
    max_rollout_replicas: int | None = Field(
        default=None, ge=1, le=1024,
        description=(
            "Most rollout replicas a job may run, in short rounds (rollout.replicas) and in long"
            " rounds (tailBatching.longRound.rolloutReplicas). Unset: no limit."
        ),
    )
    max_gpus: int | None = Field(
        default=None, ge=0, le=100_000, alias="maxGPUs",
        description=(
            "Most GPUs a job may hold at its peak, a long round: trainer.replicas x"
            " trainer.gpusPerReplica + longRound.rolloutReplicas x rollout.gpusPerReplica."
            " Unset: no limit."
        ),
    )


class GroupControlDefaults(APIModel):
    mode: GroupControlMode | None = Field(default=None, description="Default groupControl.mode.")
    candidates: list[GroupSize] | None = Field(
        default=None, min_length=1, max_length=16,
        description="Default groupControl.candidates, strictly increasing.",
    )
    initial: int | None = Field(
        default=None, ge=1, le=MAX_GROUP_SIZE,
        description=(
            "Default groupControl.initial; when unset and candidates are filled in, the job's"
            " initial must be among them (the webhook then picks the middle candidate)."
        ),
    )
    target_straggler_rate: Annotated[Decimal, DecimalRange(0, 1, True, True)] | None = Field(
        default=None, description="Default groupControl.targetStragglerRate (delta), in (0, 1)."
    )
    straggler_ratio: Annotated[
        Decimal, DecimalRange(1, MAX_TOKENS, low_open=True)] | None = Field(
        default=None,
        description="Default groupControl.stragglerRatio (tau), in (1, 1048576].",
    )
    window_steps: int | None = Field(
        default=None, ge=1, le=10_000, description="Default groupControl.windowSteps."
    )

    @field_validator("candidates")
    @classmethod
    def _sorted_unique(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(b <= a for a, b in itertools.pairwise(v)):
            raise ValueError("candidates must be strictly increasing, e.g. [4, 8, 16]")
        return v

    @model_validator(mode="after")
    def _initial(self) -> GroupControlDefaults:
        c = self.candidates
        if self.initial is not None and c is not None and self.initial not in c:
            raise ValueError(f"initial ({self.initial}) must be one of {self.candidates}")
        return self


class LongRoundDefaults(APIModel):
    rollout_replicas: int | None = Field(
        default=None, ge=1, le=1024, description="Default tailBatching.longRound.rolloutReplicas."
    )
    scale_up_timeout_seconds: int | None = Field(
        default=None, ge=1, le=86_400,
        description="Default tailBatching.longRound.scaleUpTimeoutSeconds.",
    )


class TailBatchingDefaults(APIModel):
    enabled: bool | None = Field(default=None, description="Default tailBatching.enabled.")
    long_round: LongRoundDefaults | None = Field(
        default=None, description="Defaults of tailBatching.longRound."
    )


class SchedulingDefaults(APIModel):
    priority_class_name: str | None = Field(
        default=None, max_length=253, description="Default scheduling.priorityClassName."
    )
    queue_name: str | None = Field(
        default=None, max_length=253, description="Default scheduling.queueName (Kueue)."
    )


class PolicyDefaults(APIModel):
    """Values the mutating webhook fills into a job's spec where the job leaves them unset.

    The API server applies the CRD's own scalar defaults before admission webhooks run, so a
    policy default lands where no CRD default exists: a ``groupControl`` or
    ``tailBatching.longRound`` the job leaves out entirely (inside one the job writes, the
    CRD's defaults already filled the rest), and the scheduling and deadline fields.
    """

    group_control: GroupControlDefaults | None = Field(
        default=None, description="Defaults of spec.groupControl."
    )
    tail_batching: TailBatchingDefaults | None = Field(
        default=None, description="Defaults of spec.tailBatching."
    )
    scheduling: SchedulingDefaults | None = Field(
        default=None, description="Defaults of spec.scheduling."
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, le=MAX_DURATION_SECONDS,
        description="Default spec.activeDeadlineSeconds (at most ten years).",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, le=MAX_DURATION_SECONDS,
        description="Default spec.ttlSecondsAfterFinished (at most ten years).",
    )


class RLTrainingPolicySpec(APIModel):
    action: PolicyAction = Field(
        default=PolicyAction.ENFORCE,
        description=(
            "Enforce: the webhook rejects violating jobs and the operator clamps running jobs to"
            " the limits. Warn: violating jobs are admitted with a warning and only reported."
        ),
    )
    group_sizes: GroupSizePolicy | None = Field(
        default=None, description="Allowed group sizes. Unset: any."
    )
    straggler_slo: StragglerSLO | None = Field(
        default=None, alias="stragglerSLO",
        description="Straggler target limit and the run-time straggler SLO. Unset: none.",
    )
    step_time_slo: StepTimeSLO | None = Field(
        default=None, alias="stepTimeSLO", description="Run-time step-time SLO. Unset: none."
    )
    long_rounds: LongRoundPolicy | None = Field(
        default=None, description="Capacity limits of rollout replicas and GPUs. Unset: none."
    )
    defaults: PolicyDefaults | None = Field(
        default=None, description="Values filled into jobs that leave the fields unset."
    )

    @model_validator(mode="after")
    def _defaults_obey_limits(self) -> RLTrainingPolicySpec:
        # A policy whose own defaults break its limits would reject every job that relies on
        # them: refuse it when it is applied, naming the conflict.
        gc = self.defaults.group_control if self.defaults else None
        if gc is not None and self.group_sizes is not None:
            allowed = set(self.group_sizes.allowed)
            bad = [g for g in (gc.candidates or []) if g not in allowed]
            if gc.initial is not None and gc.initial not in allowed:
                bad.append(gc.initial)
            if bad:
                raise ValueError(
                    f"defaults.groupControl uses group sizes {sorted(set(bad))} not in"
                    f" groupSizes.allowed {self.group_sizes.allowed}"
                )
        limit = self.straggler_slo.max_target_straggler_rate if self.straggler_slo else None
        t = gc.target_straggler_rate if gc is not None else None
        if t is not None and limit is not None and decimal(t) > decimal(limit):
            raise ValueError(
                f"defaults.groupControl.targetStragglerRate {t} is"
                f" looser than stragglerSLO.maxTargetStragglerRate {limit}"
            )
        lr = self.defaults.tail_batching.long_round if (
            self.defaults and self.defaults.tail_batching) else None
        cap = self.long_rounds.max_rollout_replicas if self.long_rounds else None
        r = lr.rollout_replicas if lr is not None else None
        if r is not None and cap is not None and r > cap:
            raise ValueError(
                f"defaults.tailBatching.longRound.rolloutReplicas {r}"
                f" exceeds longRounds.maxRolloutReplicas {cap}"
            )
        return self


class RLTrainingPolicy(TypedObject):
    expected_api_version: ClassVar[str] = API_VERSION
    expected_kind: ClassVar[str] = KIND

    api_version: str = Field(default=API_VERSION, description="rlpacer.io/v1alpha1")
    kind: str = Field(default=KIND, description="RLTrainingPolicy")
    metadata: ObjectMeta
    spec: RLTrainingPolicySpec = Field(default_factory=RLTrainingPolicySpec)

    @property
    def ref(self) -> str:
        """How messages name the policy: ``RLTrainingPolicy <namespace>/<name>``."""
        return f"{KIND} {self.metadata.namespace}/{self.metadata.name}"


class SelectorOperator(enum.StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(APIModel):
    key: str = Field(min_length=1, max_length=317, description="The label key.")
    operator: SelectorOperator = Field(description="In, NotIn, Exists or DoesNotExist.")
    values: list[str] | None = Field(
        default=None, max_length=64,
        description="Label values: non-empty for In and NotIn, empty for Exists/DoesNotExist.",
    )

    @model_validator(mode="after")
    def _values(self) -> LabelSelectorRequirement:
        needs = self.operator in (SelectorOperator.IN, SelectorOperator.NOT_IN)
        if needs and not self.values:
            raise ValueError(f"values must be non-empty for operator {self.operator.value}")
        if not needs and self.values:
            raise ValueError(f"values must be empty for operator {self.operator.value}")
        return self


class LabelSelector(APIModel):
    """A Kubernetes label selector; the empty selector ``{}`` selects everything."""

    match_labels: dict[str, str] | None = Field(
        default=None, description="Labels the namespace must carry, exactly."
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, max_length=32, description="Set-based requirements, all of which must hold."
    )


class ClusterRLTrainingPolicySpec(RLTrainingPolicySpec):
    namespace_selector: LabelSelector = Field(
        description=(
            "The namespaces (by their labels) whose RLTrainingJobs this policy governs; {}"
            " selects every namespace. A namespace's own RLTrainingPolicies apply as well."
        ),
    )


class ClusterRLTrainingPolicy(RLTrainingPolicy):
    """A cluster-scoped policy for the namespaces its selector matches (platform-wide limits
    without one object per namespace). Reading namespace labels needs ``get namespaces``,
    which only the chart's cluster-scope install grants."""

    expected_kind: ClassVar[str] = CLUSTER_KIND

    kind: str = Field(default=CLUSTER_KIND, description="ClusterRLTrainingPolicy")
    spec: ClusterRLTrainingPolicySpec = Field(
        description="Limits, SLOs, defaults and the namespaces they apply to."
    )

    @property
    def ref(self) -> str:
        return f"{CLUSTER_KIND} {self.metadata.name}"


def parse_cluster_policy(obj: dict[str, Any]) -> ClusterRLTrainingPolicy:
    """Validate a cluster policy; raise :class:`ManifestError` naming fields."""
    try:
        return ClusterRLTrainingPolicy.model_validate(obj)
    except ValidationError as err:
        raise ManifestError(
            "invalid ClusterRLTrainingPolicy:\n" + format_validation_error(err)
        ) from None


def parse_policy(obj: dict[str, Any]) -> RLTrainingPolicy:
    """Validate a policy manifest or live object; raise :class:`ManifestError` naming fields."""
    try:
        return RLTrainingPolicy.model_validate(obj)
    except ValidationError as err:
        raise ManifestError("invalid RLTrainingPolicy:\n" + format_validation_error(err)) from None
