"""The RLTrainingPolicy model: the shared example parses, bad policies fail naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.api.job import ManifestError
from rlpacer.api.policy import PolicyAction, RLTrainingPolicy, parse_policy
from rlpacer.testing.checkout import shared_dir

pytestmark = pytest.mark.unit

# $RLPACER_SHARED, ../shared beside the checkout, or the folder set-up used
EXAMPLE = shared_dir(Path(__file__).resolve().parents[3]) / "examples" / "policy.yaml"


def _policy(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
            "metadata": {"name": "p", "namespace": "team"}, "spec": spec}


def test_shared_example_round_trips() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    policy = parse_policy(doc)
    assert policy.spec.action is PolicyAction.ENFORCE
    assert policy.spec.long_rounds is not None and policy.spec.long_rounds.max_gpus == 32
    # Upper-case acronyms stay on the wire as in the example (stragglerSLO, maxGPUs).
    assert policy.to_wire() == doc


def test_empty_spec_is_a_no_op_enforce_policy() -> None:
    policy = parse_policy(_policy())
    assert policy.spec.action is PolicyAction.ENFORCE
    assert policy.ref == "RLTrainingPolicy team/p"


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"action": "Block"}, "spec.action"),
        ({"groupSizes": {"allowed": [8, 4]}}, "strictly increasing"),
        ({"stragglerSLO": {"maxTargetStragglerRate": "1.5"}}, "maxTargetStragglerRate"),
        ({"stragglerSLO": {"maxTargetStragglerRate": 0.2}}, "spec.stragglerSLO"),  # no floats
        ({"stepTimeSLO": {"maxSeconds": 0}}, "spec.stepTimeSLO.maxSeconds"),
        ({"longRounds": {"maxGpus": 3}}, "maxGpus"),  # the wire name is maxGPUs
        ({"typo": 1}, "spec.typo"),
        (
            {"groupSizes": {"allowed": [4, 8]},
             "defaults": {"groupControl": {"candidates": [8, 16]}}},
            "not in groupSizes.allowed",
        ),
        (
            {"stragglerSLO": {"maxTargetStragglerRate": "0.1"},
             "defaults": {"groupControl": {"targetStragglerRate": "0.2"}}},
            "looser than stragglerSLO.maxTargetStragglerRate",
        ),
        (
            {"longRounds": {"maxRolloutReplicas": 2},
             "defaults": {"tailBatching": {"longRound": {"rolloutReplicas": 4}}}},
            "exceeds longRounds.maxRolloutReplicas",
        ),
    ],
)
def test_bad_policies_are_refused_naming_the_field(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(ManifestError, match="invalid RLTrainingPolicy") as err:
        parse_policy(_policy(**spec))
    assert needle in str(err.value)


def test_every_field_has_a_description() -> None:
    # kubectl explain rltp.spec teaches the API only if every field is described.
    schema = RLTrainingPolicy.model_json_schema(by_alias=True)
    missing = []
    for name, definition in schema.get("$defs", {}).items():
        if name == "ObjectMeta":  # Kubernetes' own, described by the API server
            continue
        for prop, body in definition.get("properties", {}).items():
            if "description" not in body:
                missing.append(f"{name}.{prop}")
    assert missing == []


def test_cluster_policy_needs_a_namespace_selector_and_names_itself() -> None:
    from rlpacer.api.policy import parse_cluster_policy

    doc = {"apiVersion": "rlpacer.io/v1alpha1", "kind": "ClusterRLTrainingPolicy",
           "metadata": {"name": "gpu-limits"},
           "spec": {"namespaceSelector": {"matchLabels": {"tier": "research"}},
                    "longRounds": {"maxGPUs": 64}}}
    p = parse_cluster_policy(doc)
    assert p.ref == "ClusterRLTrainingPolicy gpu-limits"
    with pytest.raises(ManifestError, match=r"spec\.namespaceSelector: Field required"):
        parse_cluster_policy({**doc, "spec": {}})
    bad = {**doc, "spec": {"namespaceSelector": {"matchExpressions": [
        {"key": "tier", "operator": "Exists", "values": ["x"]}]}}}
    with pytest.raises(ManifestError, match="values must be empty for operator Exists"):
        parse_cluster_policy(bad)
    with pytest.raises(ManifestError, match="kind must be ClusterRLTrainingPolicy"):
        parse_cluster_policy({**doc, "kind": "RLTrainingPolicy"})
