"""Run-time policy enforcement, the pure part: what a job may use and whether it meets its SLO.

Called on every accepted step report (``rlpacer.operator.reports.accept_report``) with the
RLTrainingPolicies of the job's namespace (cached by ``rlpacer.operator.policies``):

* :func:`limits`: the controller configuration and long-round replicas the job may use.
  ``Enforce`` policies clamp the straggler target (delta) to ``maxTargetStragglerRate``, the
  candidates to ``groupSizes.allowed`` and the long-round rollout replicas to
  ``maxRolloutReplicas`` / ``maxGPUs`` (``rlpacer.control.policy.clamp_job``); ``Warn``
  policies clamp nothing and only leave notes.
* :func:`judge_slo`: the SLOViolated condition from ``rlpacer.control.policy.slo_status`` on
  the controller's windowed straggler rate and mean step time, with an Event on transitions.
* :func:`record_notes`: the clamps and warnings in ``status.policyNotes``, with an Event
  whenever they change.
* :func:`judge_straggler_slo`: the job's own straggler SLO (``targetStragglerRate`` over
  short rounds, policy or not) into the StragglerSLOMet condition from
  ``JobController.slo_verdict``, with an Event on each transition.

Decision (restart safety): a clamped SAGC configuration is **persisted in the controller
state** (the state carries its config), not re-derived on load. The clamp is a deterministic
state transition (``JobController.reconfigure``) applied inside the report's compare-and-swap
before the state is written, so the persisted bytes are exactly what a restarted operator
continues from, even if the policy changed or vanished meanwhile; the next report re-derives
the limits from spec + current policies (a loosened or deleted policy restores the spec's
values). Re-deriving on every load instead would make the restored state depend on the
policies at restore time, so the same bytes could mean different controllers.

Because the limits start from the spec, an edit of a running job's ``groupControl`` (delta,
candidates, tau, ...) also reaches its controller at the next report, in the same way.

Fixed-mode jobs use neither delta nor candidates: a Fixed G outside ``groupSizes.allowed``
(possible only when the policy came after the job) is noted, not changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from rlpacer.api.job import GroupControlMode, RLTrainingJobSpec, extra_replica_gpus
from rlpacer.api.policy import RLTrainingPolicy
from rlpacer.api.status import (
    MAX_POLICY_NOTES,
    ConditionStatus,
    ConditionType,
    Reason,
    RLTrainingJobStatus,
    find,
    set_condition,
    truncate,
)
from rlpacer.control.plan import JobController, SLOState
from rlpacer.control.policy import SLOReason, SLOStatus, clamp, clamp_job, slo_status
from rlpacer.control.sagc import SAGCConfig
from rlpacer.operator import hosting, scaler
from rlpacer.operator.scaler import Event

#: Longest policy note kept in status.
MAX_NOTE = 512


@dataclass(frozen=True)
class Limits:
    """What a job may use under its namespace's policies."""

    sagc: SAGCConfig  # the controller's SAGC configuration (the spec's when nothing binds)
    long_round_replicas: int  # rollout replicas of a long round (>= rollout.replicas)
    notes: tuple[str, ...] = ()  # one line per limit that binds (Warn ones start "Warn: ")

    @property
    def clamped(self) -> bool:
        return any(not n.startswith("Warn: ") for n in self.notes)


def limits(spec: RLTrainingJobSpec, policies: Sequence[RLTrainingPolicy]) -> Limits:
    """The controller config and long-round replicas the job may use (pure)."""
    base = hosting.controller_config(spec).sagc
    long_r = scaler.long_replicas(spec)
    if not policies:
        return Limits(base, long_r)
    gc = spec.group_control
    if gc.mode is GroupControlMode.SAGC:
        c = clamp_job(spec, policies)
        cands = tuple(c.candidates)
        initial = base.initial if base.initial in cands else min(
            cands, key=lambda g: (abs(g - base.initial), g))
        sagc = dataclasses.replace(base, candidates=cands, delta=c.target_straggler_rate,
                                   initial=initial)
        notes = c.notes
    else:
        c = clamp(  # Fixed: no delta to clamp; the one G is noted, never changed
            policies, target_straggler_rate=0.0, candidates=[gc.initial],
            long_round_replicas=long_r, rollout_gpus_per_replica=spec.rollout.gpus_per_replica,
            trainer_gpus=spec.trainer.replicas * spec.trainer.gpus_per_replica,
            short_replicas=spec.rollout.replicas, extra_gpus_per_replica=extra_replica_gpus(spec),
        )
        sagc = base
        notes = tuple(
            n if n.startswith("Warn: ") or not n.startswith("candidates")
            else "Warn: " + n + " (Fixed mode: not applied)" for n in c.notes)
    # A long round never has fewer replicas than a short one (the policy's maxRolloutReplicas
    # at or below rollout.replicas means: no scale-up at all).
    return Limits(sagc, max(spec.rollout.replicas, c.long_round_replicas), notes)


def judge_slo(
    st: RLTrainingJobStatus,
    policies: Sequence[RLTrainingPolicy],
    *,
    straggler_rate: float | None,
    step_seconds: float | None,
    steps: int | None,
    now: str,
    generation: int | None,
) -> tuple[SLOStatus, list[Event]]:
    """Set or clear SLOViolated on ``st`` (in place); Events on transitions.

    The condition is written only when its status, reason or observedGeneration changes
    (its message keeps the numbers of that moment; the current ones are in
    ``status.stragglerRate`` and ``status.stepSeconds``). No condition is added while no
    policy sets an SLO.
    """
    slo = slo_status(straggler_rate, step_seconds, policies, steps=steps)
    st.slo_breaches = [b.value for b in slo.breaches] if slo.reason is not SLOReason.NO_SLO \
        else None
    cur = find(st.conditions, ConditionType.SLO_VIOLATED)
    if cur is None and slo.reason is SLOReason.NO_SLO:
        return slo, []
    want = ConditionStatus.TRUE if slo.violated else ConditionStatus.FALSE
    if cur is not None and (cur.status, cur.reason, cur.observed_generation) == (
        want, slo.reason.value, generation
    ):
        return slo, []
    was_true = cur is not None and cur.status == ConditionStatus.TRUE
    st.conditions, _ = set_condition(st.conditions, ConditionType.SLO_VIOLATED, want,
                                     slo.reason.value, slo.message, now, generation)
    events: list[Event] = []
    if slo.violated and (not was_true or cur is None or cur.reason != slo.reason.value):
        events.append(Event("Warning", "SLOViolated", f"{slo.reason.value}: {slo.message}"))
    elif not slo.violated and was_true:
        events.append(Event("Normal", "WithinSLO", f"{slo.reason.value}: {slo.message}"))
    return slo, events


_SLO_REASON = {SLOState.MET: Reason.WITHIN_TARGET, SLOState.EXCEEDED: Reason.EXCEEDED,
               SLOState.INFEASIBLE: Reason.INFEASIBLE}


def judge_straggler_slo(
    st: RLTrainingJobStatus, ctl: JobController, *, now: str, generation: int | None
) -> list[Event]:
    """Set StragglerSLOMet on ``st`` (in place) from the controller's SLO verdict; an Event
    on each transition (into Exceeded or Infeasible, between them, back to WithinTarget).

    The condition stays absent while the verdict is Unknown; its message follows the
    current numbers (the rates per G, the target). The verdict's hysteresis starts from the
    condition as stored, so a restarted operator judges as the running one would.
    """
    cur = find(st.conditions, ConditionType.STRAGGLER_SLO_MET)
    previous = None
    if cur is not None and cur.status == ConditionStatus.FALSE:
        previous = {Reason.EXCEEDED.value: SLOState.EXCEEDED,
                    Reason.INFEASIBLE.value: SLOState.INFEASIBLE}.get(cur.reason)
    verdict = ctl.slo_verdict(previous=previous)
    if verdict.state is SLOState.UNKNOWN:
        return []
    reason = _SLO_REASON[verdict.state]
    met = verdict.state is SLOState.MET
    message = verdict.message()
    want = ConditionStatus.TRUE if met else ConditionStatus.FALSE
    if cur is not None and (cur.status, cur.reason, cur.message, cur.observed_generation) == (
        want, reason.value, truncate(message), generation
    ):
        return []
    st.conditions, _ = set_condition(st.conditions, ConditionType.STRAGGLER_SLO_MET, want,
                                     reason, message, now, generation)
    if cur is not None and cur.reason == reason.value:
        return []  # the same verdict, new numbers
    if not met:
        return [Event("Warning", f"StragglerSLO{reason.value}", message)]
    if cur is not None:  # back within the target after a breach
        return [Event("Normal", "StragglerSLOMet", message)]
    return []


def record_notes(st: RLTrainingJobStatus, notes: Sequence[str]) -> list[Event]:
    """Keep the policy notes in ``st`` (in place); an Event when they change."""
    kept = [truncate(n, MAX_NOTE) for n in notes][:MAX_POLICY_NOTES]
    if kept == st.policy_notes:
        return []
    st.policy_notes = kept
    if not kept:
        return [Event("Normal", "PolicyLifted", "the job is within its namespace's policies")]
    clamped = any(not n.startswith("Warn: ") for n in kept)
    return [Event("Warning", "PolicyClamped" if clamped else "PolicyWarning", "; ".join(kept))]


__all__ = ["Limits", "judge_slo", "judge_straggler_slo", "limits", "record_notes"]
