"""Applying RLTrainingPolicies to jobs: pure functions, no I/O.

Four questions, one function each; the admission webhook and the operator only translate
between Kubernetes objects and these calls:

* :func:`validate_job`: which fields of a job break a policy (admission; ``Enforce`` rejects,
  ``Warn`` admits with warnings). Each :class:`Violation` names the field, the value, the
  limit and the policy, so the API server's message tells the user what to change.
* :func:`apply_defaults`: the job's spec with the policy's defaults filled into fields the job
  leaves unset (mutating admission). Never produces a spec the job model rejects.
* :func:`clamp`: run-time enforcement. A policy may be created or tightened after a job was
  admitted; in ``Enforce`` mode the controller's straggler target, its group-size candidates
  and the long-round replica count are clamped to the policy before they are used.
* :func:`slo_status`: whether a job's windowed straggler rate or step time breaks the SLO
  (the operator turns that into the SLOViolated condition, an Event and a metric).

Every function accepts one policy or a sequence of them (all the policies of a namespace):
limits compose by intersection (the strictest wins), defaults by the first policy (in the
order given, name order from the caller) that sets a field.
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlpacer.api._base import decimal, format_decimal
from rlpacer.api.job import (
    GroupControlMode,
    GroupControlSpec,
    RLTrainingJobSpec,
    extra_replica_gpus,
)
from rlpacer.api.policy import LabelSelector, PolicyAction, RLTrainingPolicy, SelectorOperator

Policies = RLTrainingPolicy | Sequence[RLTrainingPolicy]


def _as_list(policy: Policies) -> list[RLTrainingPolicy]:
    return [policy] if isinstance(policy, RLTrainingPolicy) else list(policy)


# --- which policies apply ----------------------------------------------------------------


def selector_matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics: every matchLabels pair and every expression must
    hold; the empty selector matches everything."""
    for key, value in (selector.match_labels or {}).items():
        if labels.get(key) != value:
            return False
    for req in selector.match_expressions or []:
        present = req.key in labels
        values = req.values or []
        ok = {
            SelectorOperator.IN: present and labels.get(req.key) in values,
            SelectorOperator.NOT_IN: not present or labels.get(req.key) not in values,
            SelectorOperator.EXISTS: present,
            SelectorOperator.DOES_NOT_EXIST: not present,
        }[req.operator]
        if not ok:
            return False
    return True


# --- admission: validation ---------------------------------------------------------------


@dataclass(frozen=True)
class Violation:
    """One field of a job that breaks one limit of one policy."""

    field: str  # the job's field, e.g. "spec.groupControl.targetStragglerRate"
    value: str  # the job's value, as written in the message
    limit: str  # the policy's limit, e.g. "<= 0.25 (stragglerSLO.maxTargetStragglerRate)"
    policy: str  # "RLTrainingPolicy <namespace>/<name>"
    action: PolicyAction

    @property
    def message(self) -> str:
        return f"{self.field}: {self.value} breaks {self.limit} of {self.policy}"


def validate_job(spec: RLTrainingJobSpec, policy: Policies) -> list[Violation]:
    """Every violation of every given policy by a job's (defaulted, validated) spec."""
    out: list[Violation] = []
    for p in _as_list(policy):
        out.extend(_validate_one(spec, p))
    return out


def _validate_one(spec: RLTrainingJobSpec, p: RLTrainingPolicy) -> list[Violation]:
    out: list[Violation] = []
    ps = p.spec

    def add(field_: str, value: object, limit: str) -> None:
        out.append(Violation(field_, str(value), limit, p.ref, ps.action))

    gc = spec.group_control
    if ps.group_sizes is not None:
        allowed = ps.group_sizes.allowed
        limit = f"groupSizes.allowed {allowed}"
        if gc.mode is GroupControlMode.SAGC:
            bad = [g for g in gc.candidates if g not in allowed]
            if bad:
                add("spec.groupControl.candidates", f"{gc.candidates} (has {bad})", limit)
        if gc.initial not in allowed and not (
            gc.mode is GroupControlMode.SAGC and any(g not in allowed for g in gc.candidates)
        ):
            # initial is one of the candidates, so a bad initial in SAGC mode is reported once.
            add("spec.groupControl.initial", gc.initial, limit)

    slo = ps.straggler_slo
    max_delta = slo.max_target_straggler_rate if slo is not None else None
    # Fixed jobs do not use delta: only SAGC jobs are held to the straggler target.
    sagc = gc.mode is GroupControlMode.SAGC
    if sagc and max_delta is not None and decimal(gc.target_straggler_rate) > decimal(max_delta):
        add(
            "spec.groupControl.targetStragglerRate", gc.target_straggler_rate,
            f"<= {max_delta} (stragglerSLO.maxTargetStragglerRate)",
        )

    lr = ps.long_rounds
    if lr is not None:
        long_replicas = _long_round_replicas(spec)
        if lr.max_rollout_replicas is not None:
            lim = f"<= {lr.max_rollout_replicas} (longRounds.maxRolloutReplicas)"
            if spec.rollout.replicas > lr.max_rollout_replicas:
                add("spec.rollout.replicas", spec.rollout.replicas, lim)
            if spec.tail_batching.enabled and long_replicas > lr.max_rollout_replicas:
                add("spec.tailBatching.longRound.rolloutReplicas", long_replicas, lim)
        if lr.max_gpus is not None:
            peak = peak_gpus(spec)
            if peak > lr.max_gpus:
                add(
                    "spec (peak GPUs = trainer.replicas*trainer.gpusPerReplica"
                    " + longRound.rolloutReplicas*rollout.gpusPerReplica, each replica a"
                    " long round adds counted at longRound.tensorParallelSize when set)",
                    peak, f"<= {lr.max_gpus} (longRounds.maxGPUs)",
                )
    return out


def _long_round_replicas(spec: RLTrainingJobSpec) -> int:
    tb = spec.tail_batching
    return max(spec.rollout.replicas, tb.long_round.rollout_replicas) if tb.enabled else (
        spec.rollout.replicas)


def peak_gpus(spec: RLTrainingJobSpec) -> int:
    """GPUs a job holds at its peak (a long round, or always when tail batching is off)."""
    trainer = spec.trainer.replicas * spec.trainer.gpus_per_replica
    extra = _long_round_replicas(spec) - spec.rollout.replicas
    return (trainer + spec.rollout.replicas * spec.rollout.gpus_per_replica
            + extra * extra_replica_gpus(spec))


# --- admission: defaults -----------------------------------------------------------------


@dataclass(frozen=True)
class Defaulted:
    spec: dict[str, Any]  # a new dict; the input is not changed
    filled: tuple[str, ...]  # the fields filled in, e.g. ("spec.groupControl.candidates",)
    policies: tuple[str, ...] = ()  # the policies that contributed


def apply_defaults(spec: dict[str, Any], policy: Policies) -> Defaulted:
    """Fill the policies' defaults into the fields a job's spec (a wire dict) leaves unset.

    "Unset" means absent from the dict (after the API server's own CRD defaulting). The result
    stays valid for the job model: a default that would contradict what the job did set
    (an initial group size outside the job's candidates, long-round replicas below the job's
    rollout.replicas) is not filled in.
    """
    out = copy.deepcopy(spec)
    filled: list[str] = []
    contributors: list[str] = []
    for p in _as_list(policy):
        d = p.spec.defaults
        if d is None:
            continue
        before = len(filled)
        wire: dict[str, Any] = d.to_wire()
        gc_defaults = wire.pop("groupControl", None)
        tb_defaults = wire.pop("tailBatching", None)
        # Plain fields and flat objects first.
        for key, value in wire.items():
            if key == "scheduling":
                _fill_object(out, ["scheduling"], value, filled)
            elif key not in out:
                out[key] = value
                filled.append(f"spec.{key}")
        if gc_defaults:
            _fill_group_control(out, gc_defaults, filled)
        if tb_defaults:
            _fill_tail_batching(out, tb_defaults, filled)
        if len(filled) > before:
            contributors.append(p.ref)
    return Defaulted(out, tuple(filled), tuple(contributors))


def _fill_object(
    out: dict[str, Any], path: list[str], values: dict[str, Any], filled: list[str]
) -> dict[str, Any]:
    node = out
    for part in path:
        node = node.setdefault(part, {})
    for key, value in values.items():
        if key not in node:
            node[key] = copy.deepcopy(value)
            filled.append("spec." + ".".join([*path, key]))
    return node


def _fill_group_control(out: dict[str, Any], d: dict[str, Any], filled: list[str]) -> None:
    gc = out.setdefault("groupControl", {})
    initial = d.pop("initial", None)
    _fill_object(out, ["groupControl"], d, filled)
    candidates = gc.get("candidates")
    if "initial" not in gc:
        if initial is not None and (candidates is None or initial in candidates):
            gc["initial"] = initial
            filled.append("spec.groupControl.initial")
        elif candidates and _model_default_initial() not in candidates:
            # The model's default initial is not among the filled candidates: pick the middle
            # one rather than produce a job that fails validation.
            gc["initial"] = candidates[len(candidates) // 2]
            filled.append("spec.groupControl.initial")


def _model_default_initial() -> int:
    return GroupControlSpec().initial


def _fill_tail_batching(out: dict[str, Any], d: dict[str, Any], filled: list[str]) -> None:
    lr = d.pop("longRound", None)
    _fill_object(out, ["tailBatching"], d, filled)
    if lr:
        replicas = lr.get("rolloutReplicas")
        short = int(out.get("rollout", {}).get("replicas", 1))
        if replicas is not None and replicas < short:
            lr = {k: v for k, v in lr.items() if k != "rolloutReplicas"}
        _fill_object(out, ["tailBatching", "longRound"], lr, filled)


# --- run time: clamping ------------------------------------------------------------------


@dataclass(frozen=True)
class Clamp:
    """What the controller and the scaler may use under the policies."""

    target_straggler_rate: float
    candidates: tuple[int, ...]
    long_round_replicas: int
    notes: tuple[str, ...] = field(default=())  # one line per limit that bound (for an Event)

    @property
    def changed(self) -> bool:
        return any(not n.startswith("Warn: ") for n in self.notes)


def clamp(
    policy: Policies,
    *,
    target_straggler_rate: float,
    candidates: Sequence[int],
    long_round_replicas: int,
    rollout_gpus_per_replica: int,
    trainer_gpus: int,
    short_replicas: int = 0,
    extra_gpus_per_replica: int | None = None,
) -> Clamp:
    """Clamp a running job's controller target, candidates and long-round replicas.

    ``short_replicas`` / ``extra_gpus_per_replica``: the rollout replicas of a short round
    and the GPUs of each replica a long round adds (a wide engine's,
    ``tailBatching.longRound.tensorParallelSize``; default ``rollout_gpus_per_replica``).

    ``Enforce`` policies change the values (the strictest wins); ``Warn`` policies only add a
    note starting with ``"Warn: "``. The result keeps at least one candidate (the allowed size
    nearest the job's smallest) and at least one long-round replica, so a job that a tightened
    policy no longer admits still runs, within the limits where it can.
    """
    delta = float(target_straggler_rate)
    cands = tuple(candidates)
    replicas = int(long_round_replicas)
    notes: list[str] = []
    for p in _as_list(policy):
        enforce = p.spec.action is PolicyAction.ENFORCE
        prefix = "" if enforce else "Warn: "
        ps = p.spec
        slo = ps.straggler_slo
        if slo is not None and slo.max_target_straggler_rate is not None:
            cap = decimal(slo.max_target_straggler_rate)
            if delta > cap:
                notes.append(
                    f"{prefix}targetStragglerRate {format_decimal(delta)} clamped to"
                    f" {format_decimal(cap)} by {p.ref}"
                )
                if enforce:
                    delta = cap
        if ps.group_sizes is not None:
            allowed = ps.group_sizes.allowed
            kept = tuple(g for g in cands if g in allowed)
            if kept != cands:
                if not kept:
                    smallest = min(cands) if cands else allowed[0]
                    kept = (min(allowed, key=lambda g: (abs(g - smallest), g)),)
                notes.append(f"{prefix}candidates {list(cands)} clamped to {list(kept)} by {p.ref}")
                if enforce:
                    cands = kept
        lr = ps.long_rounds
        if lr is not None:
            cap_r = replicas
            if lr.max_rollout_replicas is not None:
                cap_r = min(cap_r, lr.max_rollout_replicas)
            if lr.max_gpus is not None and rollout_gpus_per_replica > 0:
                budget = lr.max_gpus - trainer_gpus - short_replicas * rollout_gpus_per_replica
                per = extra_gpus_per_replica or rollout_gpus_per_replica
                cap_r = min(cap_r, short_replicas + math.floor(budget / per))
            cap_r = max(1, cap_r)
            if cap_r < replicas:
                notes.append(f"{prefix}long-round rollout replicas {replicas} clamped to {cap_r}"
                             f" by {p.ref}")
                if enforce:
                    replicas = cap_r
    return Clamp(delta, cands, replicas, tuple(notes))


def clamp_job(
    spec: RLTrainingJobSpec, policy: Policies, *, long_round_replicas: int | None = None
) -> Clamp:
    """:func:`clamp` for a job's spec: its delta, candidates and (unless given, e.g. what the
    scaler is about to ask for) its long-round replicas, with its own GPU sizes."""
    gc = spec.group_control
    return clamp(
        policy,
        target_straggler_rate=decimal(gc.target_straggler_rate),
        candidates=gc.candidates if gc.mode is GroupControlMode.SAGC else [gc.initial],
        long_round_replicas=(long_round_replicas if long_round_replicas is not None
                             else _long_round_replicas(spec)),
        rollout_gpus_per_replica=spec.rollout.gpus_per_replica,
        trainer_gpus=spec.trainer.replicas * spec.trainer.gpus_per_replica,
        short_replicas=spec.rollout.replicas,
        extra_gpus_per_replica=extra_replica_gpus(spec),
    )


# --- run time: SLO -----------------------------------------------------------------------


class SLOReason(enum.StrEnum):
    """Reasons of the SLOViolated condition (its status is True for the first two)."""

    STRAGGLER_RATE = "StragglerRateAboveSLO"
    STEP_TIME = "StepTimeAboveSLO"
    WITHIN = "WithinSLO"
    NOT_ENOUGH_STEPS = "NotEnoughSteps"  # fewer steps than the SLO window: not judged yet
    NO_SLO = "NoSLO"  # no policy sets an SLO


@dataclass(frozen=True)
class SLOStatus:
    violated: bool
    reason: SLOReason  # the first breach (a condition has one reason)
    message: str  # every breach
    #: every SLO broken now, in judging order (straggler rate first): a job breaking both
    #: is reported for both, not only for the first
    breaches: tuple[SLOReason, ...] = ()


def slo_status(
    straggler_rate: float | None,
    step_seconds: float | None,
    policy: Policies,
    *,
    steps: int | None = None,
) -> SLOStatus:
    """Whether a job's windowed straggler rate or mean step time breaks any policy's SLO.

    ``straggler_rate``: the fraction of straggler steps in the last ``windowSteps`` steps;
    ``step_seconds``: the mean step time over the same window; ``steps``: steps the job has
    run (when given, a straggler SLO is not judged before its window is full). Either may be
    None (not measured yet). Warn and Enforce policies are judged alike: the SLO is reported
    either way; only clamping depends on the action.
    """
    breaches: list[tuple[SLOReason, str]] = []
    judged = False
    waiting = False
    for p in _as_list(policy):
        slo = p.spec.straggler_slo
        limit = slo.observed_limit() if slo is not None else None
        if slo is not None and limit is not None:
            if steps is not None and steps < slo.window_steps:
                waiting = True
            elif straggler_rate is not None:
                judged = True
                if straggler_rate > limit:
                    breaches.append((
                        SLOReason.STRAGGLER_RATE,
                        f"straggler rate {format_decimal(straggler_rate, 3)} over the last"
                        f" {slo.window_steps} steps exceeds {format_decimal(limit)} ({p.ref})",
                    ))
        st = p.spec.step_time_slo
        if st is not None and step_seconds is not None:
            judged = True
            if step_seconds > st.max_seconds:
                breaches.append((
                    SLOReason.STEP_TIME,
                    f"mean step time {format_decimal(step_seconds, 4)}s exceeds"
                    f" {st.max_seconds}s ({p.ref})",
                ))
        elif st is not None:
            waiting = True
    if breaches:
        kinds = tuple(dict.fromkeys(r for r, _ in breaches))
        return SLOStatus(True, breaches[0][0], "; ".join(m for _, m in breaches), kinds)
    if judged:
        return SLOStatus(False, SLOReason.WITHIN, "within the SLO")
    if waiting:
        return SLOStatus(False, SLOReason.NOT_ENOUGH_STEPS, "not enough steps to judge the SLO")
    return SLOStatus(False, SLOReason.NO_SLO, "no policy sets an SLO")
