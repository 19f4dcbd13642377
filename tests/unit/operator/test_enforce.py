"""Run-time policy enforcement: the pure parts (controller reconfiguration, limits, the
SLOViolated condition, notes, metrics) and the report path with a namespace's policies."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from rlpacer.api.job import RLTrainingJobSpec, parse_spec
from rlpacer.api.policy import RLTrainingPolicy, parse_policy
from rlpacer.api.protocol import StepReport
from rlpacer.api.status import ConditionType, RLTrainingJobStatus, find
from rlpacer.control.plan import JobController, LengthStats, StepReportData, StepSecondsData
from rlpacer.control.policy import SLOReason
from rlpacer.control.sagc import SAGCConfig, SAGCController
from rlpacer.operator import enforce, hosting
from rlpacer.operator.metrics import Metrics
from rlpacer.operator.policies import PolicyCache
from rlpacer.operator.reports import accept_report

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def policy(name: str = "limits", **spec: Any) -> RLTrainingPolicy:
    return parse_policy({"metadata": {"name": name, "namespace": "team"}, "spec": spec})


def job(**over: Any) -> RLTrainingJobSpec:
    spec: dict[str, Any] = {
        "model": {"source": "builtin://tiny-adder"}, "data": {"source": "builtin://adder"},
        "steps": 100, "promptsPerStep": 4, "rollout": {"replicas": 1},
        "groupControl": {"candidates": [4, 8, 16, 32], "initial": 16, "stragglerRatio": "4",
                         "targetStragglerRate": "0.4", "seed": 7, "windowSteps": 4},
        "tailBatching": {"longRound": {"rolloutReplicas": 4}},
    }
    spec.update(over)
    return parse_spec(spec)


def data(step: int, g: int, mx: float, kind: str = "Short", nxt: str = "Short",
         seconds: float = 1.5) -> StepReportData:
    from rlpacer.api.protocol import RoundKind
    return StepReportData(attempt=0, step=step, group_size=g, round_kind=RoundKind(kind),
                          lengths=LengthStats(max=mx, median=10.0, p90=min(mx, 20.0),
                                              count=4 * g),
                          seconds=StepSecondsData(rollout=seconds), next_round_kind=RoundKind(nxt))


def wire(step: int, g: int, mx: float, nxt: str = "Short", seconds: float = 1.5) -> StepReport:
    return StepReport.model_validate({
        "attempt": 0, "step": step, "groupSize": g, "roundKind": "Short",
        "lengths": {"max": int(mx), "median": 10.0, "p90": min(mx, 20.0), "count": 4 * g},
        "seconds": {"rollout": seconds}, "longQueue": 0, "nextRoundKind": nxt})


# --- the controller: reconfiguration and the step-time window ----------------------------


def test_sagc_reconfigure_keeps_what_was_learnt_and_is_deterministic() -> None:
    cfg = SAGCConfig(candidates=(4, 8, 16, 32), initial=32, delta=0.4, seed=3)
    a = SAGCController(cfg)
    for _ in range(5):
        g = a.decide()
        a.observe(g, 50.0, 10.0)
    a.decide()
    b = SAGCController.from_state_dict(json.loads(json.dumps(a.state_dict())))
    post = a.posterior()
    new = SAGCConfig(candidates=(4, 8), initial=8, delta=0.2, seed=3)
    a.reconfigure(new)
    b.reconfigure(new)
    assert a.state_dict() == b.state_dict()  # a function of (state, config)
    assert a.config == new and a.current in (4, 8) and a.pending in (4, 8)
    assert a.posterior() == {g: post[g] for g in (4, 8)}
    text = json.dumps(a.state_dict())
    assert json.dumps(SAGCController.from_state_dict(json.loads(text)).state_dict()) == text
    # loosening again brings the dropped sizes back at the prior
    a.reconfigure(cfg)
    assert a.posterior()[32] == (cfg.alpha0, cfg.beta0)


def test_job_controller_reconfigure_updates_the_answer_to_the_last_report() -> None:
    spec = job()
    jc = JobController(hosting.controller_config(spec))
    g = jc.plan().group_size
    jc.observe(data(0, g, 15.0, seconds=3.0))
    jc.observe(data(1, jc.plan().group_size, 15.0, seconds=5.0))
    assert jc.mean_step_seconds == 4.0
    last = jc.last_report
    assert last is not None
    assert jc.reconfigure(SAGCConfig(**{**jc.config.sagc.to_dict(), "candidates": (4,),
                                        "initial": 4}))
    assert jc.plan().group_size == 4
    assert jc.observe(last).group_size == 4  # the repeat gets the plan the host answered
    state = hosting.dumps(jc.state_dict())
    assert hosting.dumps(hosting.load(state).state_dict()) == state
    assert hosting.load(state).mean_step_seconds == 4.0
    # a state written before the step-time window existed still loads (empty window)
    old = json.loads(state)
    del old["step_seconds"]
    assert JobController.from_state_dict(old).mean_step_seconds is None


# --- limits -----------------------------------------------------------------------------


STRICT = dict(groupSizes={"allowed": [4, 8, 16]},
              stragglerSLO={"maxTargetStragglerRate": "0.25"},
              longRounds={"maxRolloutReplicas": 2})


def test_limits_enforce_clamps_delta_candidates_and_long_round() -> None:
    spec = job()
    lim = enforce.limits(spec, [policy(**STRICT)])
    assert lim.sagc.delta == 0.25 and lim.sagc.candidates == (4, 8, 16)
    assert lim.sagc.initial == 16 and lim.long_round_replicas == 2
    assert lim.clamped and len(lim.notes) == 3


def test_limits_warn_changes_nothing_and_no_policy_is_the_spec() -> None:
    spec = job()
    base = hosting.controller_config(spec).sagc
    for pols in ([], [policy(action="Warn", **STRICT)]):
        lim = enforce.limits(spec, pols)
        assert lim.sagc == base and lim.long_round_replicas == 4
    warned = enforce.limits(spec, [policy(action="Warn", **STRICT)])
    assert warned.notes and not warned.clamped
    assert all(n.startswith("Warn: ") for n in warned.notes)


def test_limits_fixed_mode_notes_the_group_size_and_never_below_short_replicas() -> None:
    spec = job(groupControl={"mode": "Fixed", "initial": 32, "candidates": [4, 8, 16, 32]},
               rollout={"replicas": 3})
    lim = enforce.limits(spec, [policy(**STRICT)])
    assert lim.sagc == hosting.controller_config(spec).sagc
    assert lim.long_round_replicas == 3  # policy max 2 < rollout.replicas 3: no scale-up
    assert any("Fixed mode: not applied" in n for n in lim.notes)


# --- SLOViolated, notes -------------------------------------------------------------------


def test_judge_slo_sets_clears_and_writes_only_on_change() -> None:
    pols = [policy(stepTimeSLO={"maxSeconds": 10})]
    st = RLTrainingJobStatus()
    slo, ev = enforce.judge_slo(st, pols, straggler_rate=0.0, step_seconds=12.0, steps=3,
                                now="t1", generation=1)
    c = find(st.conditions, ConditionType.SLO_VIOLATED)
    assert slo.violated and c is not None and c.status == "True"
    assert c.reason == "StepTimeAboveSLO" and c.observed_generation == 1
    assert [e.reason for e in ev] == ["SLOViolated"] and ev[0].type == "Warning"
    before = st.model_copy(deep=True)
    _, ev = enforce.judge_slo(st, pols, straggler_rate=0.0, step_seconds=13.0, steps=4,
                              now="t2", generation=1)
    assert ev == [] and st == before  # unchanged: not rewritten, no Event
    _, ev = enforce.judge_slo(st, pols, straggler_rate=0.0, step_seconds=5.0, steps=5,
                              now="t3", generation=1)
    c = find(st.conditions, ConditionType.SLO_VIOLATED)
    assert c is not None and c.status == "False" and c.reason == "WithinSLO"
    assert c.last_transition_time == "t3" and [e.reason for e in ev] == ["WithinSLO"]


def test_judge_slo_adds_no_condition_without_an_slo() -> None:
    st = RLTrainingJobStatus()
    _, ev = enforce.judge_slo(st, [policy(groupSizes={"allowed": [4, 8]})],
                              straggler_rate=0.9, step_seconds=99.0, steps=100, now="t",
                              generation=1)
    assert st.conditions == [] and ev == []


def test_record_notes_events_on_change_only() -> None:
    st = RLTrainingJobStatus()
    assert [e.reason for e in enforce.record_notes(st, ["a clamped"])] == ["PolicyClamped"]
    assert enforce.record_notes(st, ["a clamped"]) == []
    assert [e.reason for e in enforce.record_notes(st, ["Warn: b"])] == ["PolicyWarning"]
    assert [e.reason for e in enforce.record_notes(st, [])] == ["PolicyLifted"]


def test_metrics_follow_the_condition_and_are_removed_with_the_job() -> None:
    m = Metrics()
    st = RLTrainingJobStatus()
    enforce.judge_slo(st, [policy(stepTimeSLO={"maxSeconds": 1})], straggler_rate=None,
                      step_seconds=2.0, steps=1, now="t", generation=1)
    m.observe_status("team", "j", st)
    text = m.exposition().decode()
    assert 'rlpacer_slo_violated{job="j",namespace="team",reason="StepTimeAboveSLO"} 1.0' in text
    assert ('rlpacer_slo_violated{job="j",namespace="team",reason="StragglerRateAboveSLO"} 0.0'
            in text)
    assert 'rlpacer_job_active{job="j",namespace="team"} 0.0' in text  # not admitted yet
    # The step counter is exported from 0 before the first step (an operator that took over
    # makes the next step an increase Prometheus sees: RLPacerJobStuck relies on it).
    assert 'rlpacer_steps_total{job="j",namespace="team"} 0.0' in text
    m.forget("team", "j")
    assert m.series_for("team", "j") == 0


# --- the report path ------------------------------------------------------------------------


def _status(spec: RLTrainingJobSpec) -> RLTrainingJobStatus:
    st = RLTrainingJobStatus()
    hosting.init_status(st, spec)
    st.rollout.desired_replicas = 1
    return st


def test_enforce_clamps_the_controller_and_the_long_round_scale_up() -> None:
    spec = job()
    st = _status(spec)
    pols = [policy(**STRICT)]
    g = hosting.load(st.controller_state or "").plan().group_size
    st2, acc = accept_report(spec, st, wire(0, g, 15.0, nxt="Long"), NOW, 1, None, pols)
    assert acc.plan.group_size in (4, 8, 16)
    assert st2.rollout.desired_replicas == 2  # the policy's maxRolloutReplicas, not 4
    ev = {e.reason: e.message for e in acc.events}
    assert "clamped from 4" in ev["ScalingUp"] and "PolicyClamped" in ev
    assert len(st2.policy_notes) == 3
    ctl = hosting.load(st2.controller_state or "")
    assert ctl.config.sagc.delta == 0.25 and ctl.config.sagc.candidates == (4, 8, 16)
    # the clamp is in the persisted state: a restarted operator continues from it
    assert hosting.dumps(ctl.state_dict()) == st2.controller_state
    # once the policy is gone, the next report restores the spec's configuration
    st3, _ = accept_report(spec, st2, wire(1, acc.plan.group_size, 15.0), NOW, 1, None, [])
    assert hosting.load(st3.controller_state or "").config.sagc.candidates == (4, 8, 16, 32)
    assert st3.policy_notes == []


def test_warn_mode_clamps_nothing_and_no_policies_match_the_library() -> None:
    spec = job()
    st = _status(spec)
    g = hosting.load(st.controller_state or "").plan().group_size
    r = wire(0, g, 15.0, nxt="Long")
    warned, acc = accept_report(spec, st, r, NOW, 1, None, [policy(action="Warn", **STRICT)])
    assert warned.rollout.desired_replicas == 4
    assert "PolicyWarning" in {e.reason for e in acc.events}
    plain, _ = accept_report(spec, st, r, NOW, 1, None, [])
    unenforced, _ = accept_report(spec, st, r, NOW, 1, None, None)
    assert warned.controller_state == plain.controller_state == unenforced.controller_state


def test_a_report_beyond_the_step_time_slo_sets_slo_violated() -> None:
    spec = job()
    st = _status(spec)
    pols = [policy(stepTimeSLO={"maxSeconds": 2})]
    ctl = hosting.load(st.controller_state or "")
    st, acc = accept_report(spec, st, wire(0, ctl.plan().group_size, 15.0, seconds=3.0),
                            NOW, 1, None, pols)
    c = find(st.conditions, ConditionType.SLO_VIOLATED)
    assert c is not None and c.status == "True" and c.reason == "StepTimeAboveSLO"
    assert st.step_seconds == "3" and "SLOViolated" in {e.reason for e in acc.events}


# --- the cache ----------------------------------------------------------------------------


def test_policy_cache_ttl_and_failures() -> None:
    calls: list[str] = []
    clock = [0.0]
    fail = [False]

    async def resolve(ns: str) -> list[RLTrainingPolicy]:
        calls.append(ns)
        if fail[0]:
            raise RuntimeError("apiserver down")
        return [policy()]

    async def body() -> None:
        cache = PolicyCache(resolve, 10.0, clock=lambda: clock[0])
        assert len(await cache.get("a") or []) == 1
        assert len(await cache.get("a") or []) == 1 and calls == ["a"]
        clock[0] = 11.0
        fail[0] = True
        # stale: answered at once from the cache while one background read refreshes it
        assert len(await cache.get("a") or []) == 1 and calls == ["a"]
        assert len(await cache.get("a") or []) == 1  # no second refresh while one runs
        await asyncio.sleep(0)
        assert calls == ["a", "a"]  # the refresh failed: the stale entry stays
        assert len(await cache.get("a") or []) == 1  # stale beats nothing
        await asyncio.sleep(0)
        assert await cache.get("b") is None  # never read: not enforced (waits for the read)
        fail[0] = False
        cache.invalidate("a")
        await cache.get("a")  # after invalidate: read before answering
        assert calls == ["a", "a", "a", "b", "a"]
        n = len(calls)
        clock[0] = 30.0
        await cache.get("a")
        await asyncio.sleep(0)
        clock[0] = 31.0
        await cache.get("a")  # refreshed at 30: fresh again, no read
        assert len(calls) == n + 1

    asyncio.run(body())


def test_the_lookup_adds_cluster_policies_only_in_cluster_scope() -> None:
    from operator_fakekube import FakeKube

    from rlpacer.operator.policies import policy_admission
    from rlpacer.operator.settings import OperatorSettings

    fk = FakeKube()
    base = "/apis/rlpacer.io/v1alpha1"
    own = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
           "metadata": {"name": "own", "namespace": "team"}, "spec": {"action": "Warn"}}
    wide = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "ClusterRLTrainingPolicy",
            "metadata": {"name": "prod"},
            "spec": {"namespaceSelector": {"matchLabels": {"tier": "prod"}},
                     "stepTimeSLO": {"maxSeconds": 5}}}
    fk.objects[f"{base}/namespaces/team/rltrainingpolicies"] = {"items": [own]}
    fk.objects[f"{base}/clusterrltrainingpolicies"] = {"items": [wide]}
    fk.objects["/api/v1/namespaces/team"] = {"metadata": {"name": "team",
                                                          "labels": {"tier": "prod"}}}

    async def body() -> None:
        cluster = OperatorSettings(leader_election=False, namespaces=[])
        got = await policy_admission(fk, cluster).policies("team")  # type: ignore[arg-type]
        assert [p.metadata.name for p in got] == ["own", "prod"]
        scoped = OperatorSettings(leader_election=False, namespaces=["team"])
        got = await policy_admission(fk, scoped).policies("team")  # type: ignore[arg-type]
        assert [p.metadata.name for p in got] == ["own"]

    asyncio.run(body())


def test_a_job_breaking_both_slos_is_reported_for_both() -> None:
    """The condition has one reason (the first breach), but status.sloBreaches and the
    per-reason metric name both, so the step-time alert is not hidden by stragglers."""
    m = Metrics()
    st = RLTrainingJobStatus()
    pols = [policy(stragglerSLO={"maxTargetStragglerRate": "0.3", "windowSteps": 2},
                   stepTimeSLO={"maxSeconds": 1})]
    slo, _ = enforce.judge_slo(st, pols, straggler_rate=0.9, step_seconds=2.0, steps=5,
                               now="t", generation=1)
    assert slo.violated and slo.breaches == (SLOReason.STRAGGLER_RATE, SLOReason.STEP_TIME)
    c = find(st.conditions, ConditionType.SLO_VIOLATED)
    assert c is not None and c.reason == "StragglerRateAboveSLO"
    assert "mean step time" in c.message and "straggler rate" in c.message
    assert st.slo_breaches == ["StragglerRateAboveSLO", "StepTimeAboveSLO"]
    m.observe_status("team", "j", st)
    text = m.exposition().decode()
    for reason in ("StragglerRateAboveSLO", "StepTimeAboveSLO"):
        assert f'rlpacer_slo_violated{{job="j",namespace="team",reason="{reason}"}} 1.0' in text
    # within both: every series back at 0
    enforce.judge_slo(st, pols, straggler_rate=0.0, step_seconds=0.5, steps=6, now="t2",
                      generation=1)
    assert st.slo_breaches == []
    m.observe_status("team", "j", st)
    assert ' 1.0' not in "\n".join(ln for ln in m.exposition().decode().splitlines()
                                   if ln.startswith("rlpacer_slo_violated"))
    # a status an older operator wrote (no sloBreaches): the condition's reason alone
    old = RLTrainingJobStatus.model_validate(
        {"conditions": [c.model_dump(by_alias=True, exclude_none=True)]})
    assert old.slo_breaches is None
    m.observe_status("team", "old", old)
    text = m.exposition().decode()
    assert ('rlpacer_slo_violated{job="old",namespace="team",reason="StragglerRateAboveSLO"} 1.0'
            in text)
    assert ('rlpacer_slo_violated{job="old",namespace="team",reason="StepTimeAboveSLO"} 0.0'
            in text)
