"""Pure policy logic: validation messages, defaults, run-time clamping, SLO status."""

from __future__ import annotations

from typing import Any

import pytest

from rlpacer.api.job import RLTrainingJobSpec, parse_spec
from rlpacer.api.policy import PolicyAction, RLTrainingPolicy, parse_policy
from rlpacer.control.policy import (
    SLOReason,
    apply_defaults,
    clamp,
    peak_gpus,
    slo_status,
    validate_job,
)

pytestmark = pytest.mark.unit


def policy(name: str = "default", **spec: Any) -> RLTrainingPolicy:
    return parse_policy({"metadata": {"name": name, "namespace": "team"}, "spec": spec})


def job(**over: Any) -> RLTrainingJobSpec:
    spec: dict[str, Any] = {"model": {"source": "builtin://tiny-adder"},
                            "data": {"source": "builtin://adder"},
                            "steps": 10, "promptsPerStep": 4}
    spec.update(over)
    return parse_spec(spec)


STRICT = dict(
    groupSizes={"allowed": [4, 8, 16]},
    stragglerSLO={"maxTargetStragglerRate": "0.25"},
    longRounds={"maxRolloutReplicas": 8, "maxGPUs": 32},
)


# --- validate_job ------------------------------------------------------------------------


def test_a_job_within_the_policy_has_no_violations() -> None:
    assert validate_job(job(), policy(**STRICT)) == []


def test_violation_names_field_value_limit_and_policy() -> None:
    spec = job(groupControl={"candidates": [8, 32], "initial": 8, "targetStragglerRate": "0.3"})
    found = {v.field: v for v in validate_job(spec, policy(**STRICT))}
    assert set(found) == {"spec.groupControl.candidates", "spec.groupControl.targetStragglerRate"}
    rate = found["spec.groupControl.targetStragglerRate"]
    assert rate.message == (
        "spec.groupControl.targetStragglerRate: 0.3 breaks <= 0.25"
        " (stragglerSLO.maxTargetStragglerRate) of RLTrainingPolicy team/default"
    )
    assert "[32]" in found["spec.groupControl.candidates"].message
    assert rate.action is PolicyAction.ENFORCE


def test_fixed_mode_is_judged_on_initial_only() -> None:
    spec = job(groupControl={"mode": "Fixed", "candidates": [32], "initial": 32,
                             "targetStragglerRate": "0.9"})
    assert [v.field for v in validate_job(spec, policy(**STRICT))] == ["spec.groupControl.initial"]


def test_replica_and_gpu_limits() -> None:
    spec = job(
        rollout={"replicas": 9, "gpusPerReplica": 2, "tensorParallelSize": 2},
        trainer={"replicas": 1, "gpusPerReplica": 8},
        tailBatching={"longRound": {"rolloutReplicas": 14}},
    )
    assert peak_gpus(spec) == 8 + 14 * 2
    fields = [v.field for v in validate_job(spec, policy(**STRICT))]
    assert fields[:2] == ["spec.rollout.replicas", "spec.tailBatching.longRound.rolloutReplicas"]
    assert fields[2].startswith("spec (peak GPUs")
    # Without tail batching the long-round size does not count.
    spec2 = job(rollout={"replicas": 4, "gpusPerReplica": 2, "tensorParallelSize": 2},
                tailBatching={"enabled": False, "longRound": {"rolloutReplicas": 12}})
    assert validate_job(spec2, policy(**STRICT)) == []


def test_every_policy_of_the_namespace_applies() -> None:
    loose = policy("a-loose", stragglerSLO={"maxTargetStragglerRate": "0.5"})
    tight = policy("b-tight", action="Warn", stragglerSLO={"maxTargetStragglerRate": "0.1"})
    out = validate_job(job(), [loose, tight])
    assert [(v.policy, v.action) for v in out] == [("RLTrainingPolicy team/b-tight",
                                                     PolicyAction.WARN)]


# --- apply_defaults ----------------------------------------------------------------------


DEFAULTS = {"groupControl": {"mode": "SAGC", "candidates": [4, 8, 16],
                             "targetStragglerRate": "0.2"},
            "activeDeadlineSeconds": 5, "scheduling": {"queueName": "gpu-queue"}}


def test_defaults_fill_only_unset_fields_and_keep_the_input() -> None:
    spec = {"model": {"source": "x"}, "data": {"source": "y"}, "steps": 1, "promptsPerStep": 1,
            "groupControl": {"targetStragglerRate": "0.1"}, "activeDeadlineSeconds": 60}
    before = repr(spec)
    out = apply_defaults(spec, policy(defaults=DEFAULTS))
    assert repr(spec) == before
    assert out.spec["groupControl"] == {"targetStragglerRate": "0.1", "mode": "SAGC",
                                        "candidates": [4, 8, 16]}
    assert out.spec["activeDeadlineSeconds"] == 60  # set by the job
    assert out.spec["scheduling"] == {"queueName": "gpu-queue"}
    assert set(out.filled) == {"spec.groupControl.mode", "spec.groupControl.candidates",
                               "spec.scheduling.queueName"}
    assert out.policies == ("RLTrainingPolicy team/default",)
    parse_spec(out.spec)  # still a valid job


def test_defaults_never_make_a_job_invalid() -> None:
    # Candidates without 8 (the model's default initial): the middle candidate is chosen.
    out = apply_defaults({}, policy(defaults={"groupControl": {"candidates": [2, 4, 32]}}))
    assert out.spec["groupControl"]["initial"] == 4
    # A default initial outside the job's own candidates is not filled in.
    out = apply_defaults({"groupControl": {"candidates": [4, 16], "initial": 4}},
                         policy(defaults={"groupControl": {"initial": 8}}))
    assert out.spec["groupControl"] == {"candidates": [4, 16], "initial": 4}
    # Long-round replicas below the job's short-round replicas are not filled in.
    out = apply_defaults(
        {"rollout": {"replicas": 6}},
        policy(defaults={"tailBatching": {"longRound": {"rolloutReplicas": 4,
                                                        "scaleUpTimeoutSeconds": 60}}}),
    )
    assert out.spec["tailBatching"]["longRound"] == {"scaleUpTimeoutSeconds": 60}


def test_first_policy_that_sets_a_default_wins() -> None:
    a = policy("a", defaults={"ttlSecondsAfterFinished": 0})
    b = policy("b", defaults={"ttlSecondsAfterFinished": 60, "activeDeadlineSeconds": 600})
    out = apply_defaults({}, [a, b])
    # 0 is a value, not "unset".
    assert out.spec == {"ttlSecondsAfterFinished": 0, "activeDeadlineSeconds": 600}


# --- clamp -------------------------------------------------------------------------------


def test_clamp_in_enforce_mode_binds_every_limit() -> None:
    out = clamp(policy(**STRICT), target_straggler_rate=0.4, candidates=[4, 8, 32],
                long_round_replicas=20, rollout_gpus_per_replica=2, trainer_gpus=8)
    assert out.target_straggler_rate == 0.25
    assert out.candidates == (4, 8)
    assert out.long_round_replicas == 8  # min(20, maxRolloutReplicas 8, (32-8)//2 = 12)
    assert out.changed and len(out.notes) == 3


def test_clamp_uses_the_gpu_budget_and_keeps_one_replica_and_one_candidate() -> None:
    p = policy(groupSizes={"allowed": [4, 8]}, longRounds={"maxGPUs": 10})
    out = clamp(p, target_straggler_rate=0.2, candidates=[16, 32], long_round_replicas=6,
                rollout_gpus_per_replica=4, trainer_gpus=8)
    assert out.candidates == (8,)  # the allowed size nearest the job's smallest
    assert out.long_round_replicas == 1
    within = clamp(p, target_straggler_rate=0.2, candidates=[4, 8], long_round_replicas=1,
                   rollout_gpus_per_replica=1, trainer_gpus=0)
    assert not within.changed and within.notes == ()


def test_clamp_in_warn_mode_changes_nothing_but_notes() -> None:
    out = clamp(policy(action="Warn", **STRICT), target_straggler_rate=0.4, candidates=[32],
                long_round_replicas=20, rollout_gpus_per_replica=1, trainer_gpus=0)
    assert (out.target_straggler_rate, out.candidates, out.long_round_replicas) == (0.4, (32,), 20)
    assert not out.changed
    assert out.notes and all(n.startswith("Warn: ") for n in out.notes)


def test_strictest_of_several_policies_wins() -> None:
    a = policy("a", stragglerSLO={"maxTargetStragglerRate": "0.3"})
    b = policy("b", stragglerSLO={"maxTargetStragglerRate": "0.15"})
    out = clamp([a, b], target_straggler_rate=0.4, candidates=[8], long_round_replicas=1,
                rollout_gpus_per_replica=1, trainer_gpus=0)
    assert out.target_straggler_rate == 0.15


# --- slo_status --------------------------------------------------------------------------


SLO = dict(stragglerSLO={"maxTargetStragglerRate": "0.25", "windowSteps": 20},
           stepTimeSLO={"maxSeconds": 900})


def test_slo_breaches_name_the_reason_and_the_policy() -> None:
    st = slo_status(0.4, 100.0, policy(**SLO), steps=50)
    assert st.violated and st.reason is SLOReason.STRAGGLER_RATE
    assert "0.4" in st.message and "team/default" in st.message
    st = slo_status(0.1, 901.0, policy(**SLO), steps=50)
    assert st.violated and st.reason is SLOReason.STEP_TIME
    both = slo_status(0.4, 901.0, policy(**SLO), steps=50)
    assert both.reason is SLOReason.STRAGGLER_RATE and "step time" in both.message


def test_slo_within_waiting_and_none() -> None:
    assert slo_status(0.25, 900.0, policy(**SLO), steps=50).reason is SLOReason.WITHIN
    # The straggler SLO waits for a full window; step time alone is judged meanwhile.
    early = slo_status(0.9, None, policy(**SLO), steps=5)
    assert not early.violated and early.reason is SLOReason.NOT_ENOUGH_STEPS
    assert slo_status(0.9, 10.0, policy(**SLO), steps=5).reason is SLOReason.WITHIN
    assert slo_status(0.9, 1e6, policy(), steps=500).reason is SLOReason.NO_SLO
    # The observed limit can be looser than the admission limit.
    p = policy(stragglerSLO={"maxTargetStragglerRate": "0.2", "maxObservedStragglerRate": "0.3"})
    assert not slo_status(0.25, None, p).violated


# --- selector_matches --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({}, {}, True),
        ({"matchLabels": {"tier": "research"}}, {"tier": "research", "x": "y"}, True),
        ({"matchLabels": {"tier": "research"}}, {"tier": "prod"}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]},
         {"tier": "b"}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]},
         {}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, {}, True),
        ({"matchLabels": {"a": "1"},
          "matchExpressions": [{"key": "b", "operator": "Exists"}]}, {"a": "1"}, False),
    ],
)
def test_selector_matches_like_kubernetes(selector: dict[str, Any], labels: dict[str, str],
                                          expected: bool) -> None:
    from rlpacer.api.policy import LabelSelector
    from rlpacer.control.policy import selector_matches

    assert selector_matches(LabelSelector.model_validate(selector), labels) is expected


def test_clamp_job_reads_the_spec() -> None:
    from rlpacer.control.policy import clamp_job

    spec = job(rollout={"replicas": 2, "gpusPerReplica": 4, "tensorParallelSize": 4},
               trainer={"replicas": 1, "gpusPerReplica": 8},
               groupControl={"candidates": [4, 8, 32], "initial": 8,
                             "targetStragglerRate": "0.4"},
               tailBatching={"longRound": {"rolloutReplicas": 10}})
    out = clamp_job(spec, policy(**STRICT))
    # (32 GPUs - 8 for the trainer) // 4 per replica = 6 < maxRolloutReplicas 8 < asked 10
    assert (out.target_straggler_rate, out.candidates, out.long_round_replicas) == (
        0.25, (4, 8), 6)
    assert clamp_job(spec, policy(**STRICT), long_round_replicas=3).long_round_replicas == 3


def test_wide_long_round_engines_count_at_their_own_gpus() -> None:
    """With tailBatching.longRound.tensorParallelSize, each replica a long round adds holds
    that many GPUs: the peak and the GPU budget's clamp count them so."""
    from rlpacer.control.policy import clamp_job

    spec = job(rollout={"replicas": 2, "gpusPerReplica": 2, "tensorParallelSize": 2},
               trainer={"replicas": 1, "gpusPerReplica": 8},
               tailBatching={"longRound": {"rolloutReplicas": 5, "tensorParallelSize": 8}})
    assert peak_gpus(spec) == 8 + 2 * 2 + 3 * 8
    fields = [v.field for v in validate_job(spec, policy(longRounds={"maxGPUs": 32}))]
    assert len(fields) == 1 and "tensorParallelSize" in fields[0], fields
    # 32 GPUs - 8 trainer - 2 x 2 short-round replicas = 20: two 8-GPU wide replicas fit
    assert clamp_job(spec, policy(longRounds={"maxGPUs": 32})).long_round_replicas == 4
    narrow = job(rollout={"replicas": 2, "gpusPerReplica": 2, "tensorParallelSize": 2},
                 trainer={"replicas": 1, "gpusPerReplica": 8},
                 tailBatching={"longRound": {"rolloutReplicas": 20}})
    # without wide engines the same budget is what it was: (32 - 8) // 2 = 12 replicas
    assert clamp_job(narrow, policy(longRounds={"maxGPUs": 32})).long_round_replicas == 12


@pytest.mark.parametrize(("over", "needle"), [
    ({"rollout": {"replicas": 2, "gpusPerReplica": 0},
      "tailBatching": {"longRound": {"rolloutReplicas": 2, "tensorParallelSize": 1}}},
     "tensorParallelSize needs tailBatching.longRound.rolloutReplicas > rollout.replicas"),
    ({"rollout": {"replicas": 1, "gpusPerReplica": 0},
      "tailBatching": {"longRound": {"rolloutReplicas": 2, "tensorParallelSize": 2}}},
     "tensorParallelSize must be 1 when rollout.gpusPerReplica is 0"),
])
def test_wide_long_round_engines_refuse_what_they_cannot_mean(over: dict[str, Any],
                                                             needle: str) -> None:
    from rlpacer.api.job import ManifestError

    with pytest.raises(ManifestError) as err:
        job(**over)
    assert needle in str(err.value) and "tailBatching.longRound" in str(err.value)
