"""Elastic rollout capacity for long rounds: a small pure state machine.

States of ``status.rollout.state`` (also the plan's ``rollout.state``):

* ``Ready``     desired replicas are what the next round needs (or nothing is pending).
* ``ScalingUp`` the plan asked for a long round's replicas; the driver polls ``GET plan``.
* ``TimedOut``  the long round's extra replicas were not all ready within
  ``tailBatching.longRound.scaleUpTimeoutSeconds``: the pending ones above the highest ready
  replica are scaled back (never a deadlock when GPUs are short; never a ready replica lost)
  and the round runs on what is ready.

Transitions happen in two places: :func:`plan_round` when a step report says which kind of
round comes next (scale up for Long, back down for Short), and :func:`observe` when the
operator sees how many replicas are ready (ScalingUp -> Ready, or -> TimedOut past the
deadline). Every change of the desired count is a :class:`ScaleAction` (kept in status) and an
Event. The reconciler applies ``desiredReplicas`` to the rollout StatefulSet; nothing here
waits or does I/O, so the step-report endpoint never blocks on scaling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from rlpacer.api.job import RLTrainingJobSpec
from rlpacer.api.protocol import RolloutCapacity, RolloutState, RoundKind
from rlpacer.api.status import RolloutStatus, ScaleAction
from rlpacer.operator.timeutil import fmt_time, parse_time


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to record on the job."""

    type: str  # Normal | Warning
    reason: str
    message: str


def short_replicas(spec: RLTrainingJobSpec) -> int:
    return spec.rollout.replicas


def long_replicas(spec: RLTrainingJobSpec) -> int:
    if not spec.tail_batching.enabled:
        return spec.rollout.replicas
    return max(spec.rollout.replicas, spec.tail_batching.long_round.rollout_replicas)


def deferred_round(ran: RoundKind, step: int, planned_step: int, planned_kind: str | None,
                   state: str) -> bool:
    """Whether a report of a ``ran`` round at ``step`` is a short round the driver ran in
    place of the planned long one (``tailBatching.longRound.maxDeferredRounds``): the plan it
    answers was for that step, Long, with its scale-up pending."""
    return (ran is RoundKind.SHORT and step == planned_step
            and planned_kind == RoundKind.LONG.value
            and state == RolloutState.SCALING_UP.value)


def plan_round(
    rollout: RolloutStatus, spec: RLTrainingJobSpec, next_kind: RoundKind, step: int,
    now: datetime, long_target: int | None = None, prepare: bool = False,
    deferred: bool = False, ran_long: bool = False,
) -> tuple[RolloutStatus, list[ScaleAction], list[Event]]:
    """Desired capacity for the next round (called when a report is accepted).

    ``long_target``: a long round's replicas when a policy clamps them (default: the spec's).
    ``prepare``: the report forecasts a long round within its replicas' join time (an early
    scale-up: the long round's capacity now, though the next round is short; held while the
    reports keep saying so).
    ``deferred``: the reported round was a short one the driver ran in place of the planned
    long round while its scale-up pended (``tailBatching.longRound.maxDeferredRounds``): the
    pending scale-up is kept, its timeout restarts, and ``deferredRounds`` counts it.
    ``ran_long``: the reported round was a long one (the count of deferrals starts over).
    """
    events: list[Event] = []
    if ran_long and rollout.deferred_rounds:
        rollout = rollout.model_copy(update={"deferred_rounds": None})
    if (deferred and next_kind is RoundKind.LONG
            and rollout.state == RolloutState.SCALING_UP.value):
        n = (rollout.deferred_rounds or 0) + 1
        rollout = rollout.model_copy(update={"deferred_rounds": n,
                                             "scale_up_started_at": fmt_time(now)})
        most = spec.tail_batching.long_round.max_deferred_rounds
        extra = rollout.desired_replicas - short_replicas(spec)
        events.append(Event(
            "Normal", "LongRoundDeferred",
            f"step {step - 1} ran a short round in place of the long round ({n} of at most"
            f" {most}): its {extra} extra rollout replicas are not ready; their wait"
            f" ({spec.tail_batching.long_round.scale_up_timeout_seconds}s) starts over"))
    new, actions, evs = _plan_round(rollout, spec, next_kind, step, now, long_target, prepare)
    return new, actions, [*events, *evs]


def _plan_round(
    rollout: RolloutStatus, spec: RLTrainingJobSpec, next_kind: RoundKind, step: int,
    now: datetime, long_target: int | None, prepare: bool,
) -> tuple[RolloutStatus, list[ScaleAction], list[Event]]:
    long_r = long_replicas(spec) if long_target is None else long_target
    early = prepare and next_kind is not RoundKind.LONG
    target = long_r if next_kind is RoundKind.LONG or early else short_replicas(spec)
    cur = rollout.desired_replicas
    t = fmt_time(now)
    if target > cur:
        ready = _ready_within(rollout.model_copy(update={"desired_replicas": target}),
                              rollout.ready_replicas) >= target
        new = rollout.model_copy(update={
            "desired_replicas": target,
            "state": RolloutState.READY.value if ready else RolloutState.SCALING_UP.value,
            "scale_up_started_at": None if ready else t, "deferred_rounds": None,
        })
        action = ScaleAction(time=t, from_replicas=cur, to_replicas=target,
                             reason="EarlyScaleUp" if early else "LongRound", step=step)
        clamped = (f" (clamped from {long_replicas(spec)} by the namespace's policy)"
                   if target < long_replicas(spec) else "")
        what = ("a long round is forecast within its replicas' join time" if early
                else f"step {step} is a long round")
        ev = Event("Normal", "ScalingUp",
                   f"{what}: rollout replicas {cur} -> {target}{clamped}")
        return new, [action], [ev]
    if early and target == cur:
        return rollout, [], []  # held for the forecast long round (pending or ready)
    if target < cur or (next_kind is RoundKind.SHORT and rollout.state != RolloutState.READY):
        update: dict[str, Any] = {
            "desired_replicas": target, "state": RolloutState.READY.value,
            "scale_up_started_at": None, "deferred_rounds": None,
        }
        if rollout.ready_ordinals is not None:
            # the replicas cut here are being deleted: not ready for any later round, though
            # no pod has been seen going yet. Kept, a long round asked for right after (a
            # one-second short round) would be Ready at once on the terminating pods' stale
            # readiness, and run without the replicas it named usable
            kept = sorted(i for i in set(rollout.ready_ordinals) if i < target)
            update |= {"ready_ordinals": kept,
                       "ready_replicas": min(rollout.ready_replicas, len(kept))}
        new = rollout.model_copy(update=update)
        if target == cur:
            return new, [], []
        action = ScaleAction(time=t, from_replicas=cur, to_replicas=target,
                             reason="LongRoundDone", step=step)
        ev = Event("Normal", "ScaledDown",
                   f"step {step} is a short round: rollout replicas {cur} -> {target}")
        return new, [action], [ev]
    return rollout, [], []


def release(
    rollout: RolloutStatus, spec: RLTrainingJobSpec, step: int, now: datetime,
) -> tuple[RolloutStatus, list[ScaleAction], list[Event]]:
    """The driver gave a long round's added replicas back while the round runs (``POST
    release``): desired back to the short rounds' count now, rather than at the step's
    report; a pending scale-up ends with it. Nothing when nothing was added."""
    target, cur = short_replicas(spec), rollout.desired_replicas
    if cur <= target:
        return rollout, [], []
    update: dict[str, Any] = {"desired_replicas": target, "state": RolloutState.READY.value,
                              "scale_up_started_at": None, "deferred_rounds": None}
    if rollout.ready_ordinals is not None:  # the cut replicas are going: never usable again
        kept = sorted(i for i in set(rollout.ready_ordinals) if i < target)
        update |= {"ready_ordinals": kept,
                   "ready_replicas": min(rollout.ready_replicas, len(kept))}
    t = fmt_time(now)
    action = ScaleAction(time=t, from_replicas=cur, to_replicas=target,
                         reason="LongRoundReleased", step=step)
    ev = Event("Normal", "ScaledDown",
               f"step {step}'s long round gave its added replicas back (its rest fits on"
               f" the rollout's own replicas, or it is over): released before the step's"
               f" report, rollout replicas {cur} -> {target}")
    return rollout.model_copy(update=update), [action], [ev]


def observe(
    rollout: RolloutStatus, spec: RLTrainingJobSpec, ready: int, step: int, now: datetime,
    ordinals: Sequence[int] | None = None, long_cap: int | None = None,
) -> tuple[RolloutStatus, list[ScaleAction], list[Event]]:
    """Fold in the observed ready replicas (and, when known, which ordinals are ready);
    resolve a pending scale-up (ready or timed out). ``long_cap``: the long-round replicas the
    namespace's policies allow now; a pending scale-up above it (a policy tightened after the
    report that asked for it) is cut down to it at once, not at the next report.

    With the ordinals known, the ready count is theirs (the pods seen Ready and not being
    deleted): the StatefulSet's ``readyReplicas`` lags its pods (on a busy control plane, a
    scale-up's pods are Ready seconds before it counts them) and counts terminating ones, and
    the plan must not say Ready with fewer ready replicas than it names usable."""
    if ordinals is not None:
        ready = len(set(ordinals))
    update: dict[str, Any] = {"ready_replicas": ready}
    if ordinals is not None:
        update["ready_ordinals"] = sorted(set(ordinals))
    new = rollout.model_copy(update=update)
    if new.state != RolloutState.SCALING_UP.value:
        return new, [], []
    actions: list[ScaleAction] = []
    events: list[Event] = []
    cap = None if long_cap is None else max(long_cap, short_replicas(spec))
    if cap is not None and new.desired_replicas > cap:
        actions.append(ScaleAction(time=fmt_time(now), from_replicas=new.desired_replicas,
                                   to_replicas=cap, reason="PolicyClamped", step=step))
        events.append(Event("Warning", "PolicyClamped",
                            f"the namespace's policy now allows {cap} rollout replicas for a"
                            f" long round: pending scale-up {new.desired_replicas} -> {cap}"))
        new = new.model_copy(update={"desired_replicas": cap})
    if _ready_within(new, ready) >= new.desired_replicas:
        started = parse_time(new.scale_up_started_at) if new.scale_up_started_at else now
        secs = max(0.0, (now - started).total_seconds())
        new = new.model_copy(update={"state": RolloutState.READY.value,
                                     "scale_up_started_at": None})
        return new, actions, [*events, Event("Normal", "ScaledUp",
                                             f"{ready}/{new.desired_replicas} rollout replicas"
                                             f" ready after {secs:.0f}s")]
    deadline = _deadline(new, spec, now)
    if now >= deadline:
        back_to = timed_out_replicas(new, spec, ready)
        t = fmt_time(now)
        # recorded even when nothing is scaled back (a ready replica above a pending one):
        # the history says when the round stopped waiting
        action = ScaleAction(time=t, from_replicas=new.desired_replicas, to_replicas=back_to,
                             reason="ScaleUpTimedOut", step=step)
        kept = ("" if back_to == new.desired_replicas else
                f"pending replicas scaled back to {back_to}; ")
        ev = Event(
            "Warning", "ScaleUpTimedOut",
            f"only {ready} of {new.desired_replicas} rollout replicas ready after"
            f" {spec.tail_batching.long_round.scale_up_timeout_seconds}s: {kept}the long"
            " round runs on what is ready",
        )
        new = new.model_copy(update={"desired_replicas": back_to,
                                     "state": RolloutState.TIMED_OUT.value,
                                     "scale_up_started_at": None})
        return new, [*actions, action], [*events, ev]
    return new, actions, events


def _ready_within(rollout: RolloutStatus, ready: int) -> int:
    """Ready replicas a round of ``rollout.desired_replicas`` can use: the ready ordinals
    below that count when they are known. The StatefulSet's ``readyReplicas`` also counts a
    ready replica above it (2 of 0..2 came up first while 1 pends; a cut to 2 deletes it), so
    counting that one would call a scale-up Ready that is one replica short."""
    if rollout.ready_ordinals is None:
        return ready
    return sum(1 for i in set(rollout.ready_ordinals) if i < rollout.desired_replicas)


def timed_out_replicas(rollout: RolloutStatus, spec: RLTrainingJobSpec, ready: int) -> int:
    """The replica count a timed-out scale-up falls back to: every ready replica kept.

    A StatefulSet scales down from its highest ordinal, and its Parallel pods come up in any
    order: with 0 and 2 ready and 1 pending, scaling back to the ready *count* (2) would delete
    the ready replica 2 and keep the pending 1. So the count keeps the highest ready ordinal
    (3 here; the pending 1 holds no accelerator and is never used until Ready). Without the
    ordinals (never observed, or pruned by an older CRD) it is the ready count.
    """
    keep = max(rollout.ready_ordinals) + 1 if rollout.ready_ordinals else ready
    return min(rollout.desired_replicas, max(keep, short_replicas(spec)))


def _deadline(rollout: RolloutStatus, spec: RLTrainingJobSpec, now: datetime) -> datetime:
    started = parse_time(rollout.scale_up_started_at) if rollout.scale_up_started_at else now
    return started + timedelta(seconds=spec.tail_batching.long_round.scale_up_timeout_seconds)


def seconds_to_deadline(rollout: RolloutStatus, spec: RLTrainingJobSpec, now: datetime) -> float:
    """Seconds until a pending scale-up times out (for requeueing); inf when none pends."""
    if rollout.state != RolloutState.SCALING_UP.value:
        return float("inf")
    return max(0.0, (_deadline(rollout, spec, now) - now).total_seconds())


def pod_ordinal(pod: Mapping[str, Any], statefulsets: str | Sequence[str]) -> int | None:
    """The ordinal of a pod of one of ``statefulsets`` (``<statefulset>-<i>``), else None.
    The rollout's replicas span two StatefulSets when long rounds have wide engines, their
    ordinals one range (the wide one's start at ``rollout.replicas``)."""
    name = str((pod.get("metadata") or {}).get("name") or "")
    for sts in (statefulsets,) if isinstance(statefulsets, str) else statefulsets:
        prefix = sts + "-"
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return int(name[len(prefix):])
    return None


def ready_ordinals(pods: Sequence[Mapping[str, Any]],
                   statefulsets: str | Sequence[str]) -> list[int]:
    """Ordinals of the StatefulSets' pods (``<statefulset>-<i>``) that are Ready and not
    being deleted. A scale-up that timed out is scaled back from the highest ordinal down,
    so a higher replica may be ready while a lower one is still pending: [0, 2]."""
    out = set()
    for pod in pods:
        i = pod_ordinal(pod, statefulsets)
        if i is None or (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        conds = (pod.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds):
            out.add(i)
    return sorted(out)


def usable_replicas(rollout: RolloutStatus) -> list[int] | None:
    """The replicas the next round may use: the ready ordinals within the desired count
    (None when the ordinals were never observed)."""
    if rollout.ready_ordinals is None:
        return None
    return [i for i in sorted(set(rollout.ready_ordinals)) if i < rollout.desired_replicas]


def capacity(rollout: RolloutStatus) -> RolloutCapacity:
    return RolloutCapacity(
        desired_replicas=rollout.desired_replicas,
        ready_replicas=rollout.ready_replicas,
        state=RolloutState(rollout.state),
        usable_replicas=usable_replicas(rollout),
    )
