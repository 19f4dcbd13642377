"""The admission handlers with a fake policy lister: what they reject, warn, patch, and skip.

The same handlers behind a real API server are tested in tests/integration/test_admission.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import kopf
import pytest

from rlpacer.operator.admission import (
    DEFAULTED_BY,
    PolicyAdmission,
    PolicyLookupError,
    webhook_server,
)

pytestmark = pytest.mark.unit

NS = "team"


def _policy(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingPolicy",
            "metadata": {"name": name, "namespace": NS, "uid": "u", "resourceVersion": "1"},
            "spec": spec}


def _job(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"source": "builtin://tiny-adder"},
                            "data": {"source": "builtin://adder"}, "steps": 5, "promptsPerStep": 2}
    spec.update(over)
    return {"apiVersion": "rlpacer.io/v1alpha1", "kind": "RLTrainingJob",
            "metadata": {"name": "j", "namespace": NS}, "spec": spec}


def _admission(*items: dict[str, Any]) -> PolicyAdmission:
    async def lister(namespace: str) -> Sequence[Mapping[str, Any]]:
        assert namespace == NS
        return list(items)
    return PolicyAdmission(lister)


def _call(handler: Any, obj: dict[str, Any], *, old: dict[str, Any] | None = None,
          operation: str = "CREATE") -> tuple[list[str], kopf.Patch]:
    body = kopf.Body(obj)
    patch = kopf.Patch(body=body)
    warnings: list[str] = []
    asyncio.run(handler(body=body, old=kopf.Body(old) if old else None, operation=operation,
                        name=obj["metadata"]["name"], namespace=NS, warnings=warnings,
                        patch=patch))
    return warnings, patch


STRICT = {"stragglerSLO": {"maxTargetStragglerRate": "0.25"}, "groupSizes": {"allowed": [4, 8, 16]}}


def test_enforce_rejects_naming_field_limit_and_policy() -> None:
    adm = _admission(_policy("default", **STRICT))
    job = _job(groupControl={"targetStragglerRate": "0.3"})
    with pytest.raises(kopf.AdmissionError) as err:
        _call(adm.validate_job, job)
    assert err.value.code == 403
    msg = str(err.value)
    assert "spec.groupControl.targetStragglerRate: 0.3" in msg
    assert "<= 0.25 (stragglerSLO.maxTargetStragglerRate)" in msg
    assert "RLTrainingPolicy team/default" in msg


def test_warn_admits_with_a_warning() -> None:
    adm = _admission(_policy("default", action="Warn", **STRICT))
    warnings, _ = _call(adm.validate_job, _job(groupControl={"targetStragglerRate": "0.3"}))
    assert len(warnings) == 1 and "targetStragglerRate" in warnings[0]


def test_metadata_only_updates_and_deletions_are_never_blocked() -> None:
    adm = _admission(_policy("default", **STRICT))
    bad = _job(groupControl={"targetStragglerRate": "0.3"})  # admitted before the policy
    relabelled = json.loads(json.dumps(bad))
    relabelled["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
    _call(adm.validate_job, relabelled, old=bad, operation="UPDATE")
    deleting = json.loads(json.dumps(bad))
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    deleting["spec"]["steps"] = 9
    _call(adm.validate_job, deleting, old=bad, operation="UPDATE")
    # A spec change is judged.
    changed = json.loads(json.dumps(bad))
    changed["spec"]["steps"] = 9
    with pytest.raises(kopf.AdmissionError):
        _call(adm.validate_job, changed, old=bad, operation="UPDATE")


def test_invalid_spec_and_invalid_stored_policy_reject() -> None:
    with pytest.raises(kopf.AdmissionError) as err:
        _call(_admission().validate_job, _job(steps=0))
    assert err.value.code == 422 and "spec.steps" in str(err.value)
    broken = _policy("broken", groupSizes={"allowed": [8, 4]})
    with pytest.raises(RuntimeError, match="team/broken is invalid"):
        _call(_admission(broken).validate_job, _job())


def test_lookup_failure_fails_closed() -> None:
    async def lister(namespace: str) -> Sequence[Mapping[str, Any]]:
        raise ConnectionError("apiserver unreachable")
    with pytest.raises(PolicyLookupError, match="apiserver unreachable"):
        _call(PolicyAdmission(lister).validate_job, _job())


def test_mutation_fills_defaults_annotates_and_warns() -> None:
    adm = _admission(_policy("b-second", defaults={"ttlSecondsAfterFinished": 1}),
                     _policy("a-first", defaults={"groupControl": {"candidates": [2, 4],
                                                                   "initial": 2},
                                                  "ttlSecondsAfterFinished": 600}))
    job = _job()
    warnings, patch = _call(adm.mutate_job, job)
    ops = {op["path"]: op for op in patch.as_json_patch()}
    assert ops["/spec/groupControl"]["value"] == {"candidates": [2, 4], "initial": 2}
    assert ops["/spec/ttlSecondsAfterFinished"]["value"] == 600  # name order: a-first wins
    assert ops["/metadata/annotations"]["value"] == {DEFAULTED_BY: "a-first"}
    assert "spec.groupControl.candidates" in warnings[0]
    # Nothing to fill: no patch at all.
    _, patch = _call(_admission().mutate_job, job)
    assert patch.as_json_patch() == []


def test_policy_validation_rejects_self_contradicting_policies() -> None:
    adm = _admission()
    _call(adm.validate_policy, _policy("ok", **STRICT))
    bad = _policy("bad", **STRICT, defaults={"groupControl": {"targetStragglerRate": "0.3"}})
    with pytest.raises(kopf.AdmissionError, match="looser than"):
        _call(adm.validate_policy, bad)


def test_webhook_server_uses_the_mounted_certificate(tmp_path: Path) -> None:
    server = webhook_server(host="127.0.0.1", port=0, cert_dir=None, url="https://127.0.0.1:1")
    assert server.certfile is not None and Path(server.certfile).is_file()
    with pytest.raises(RuntimeError, match=r"no tls\.crt"):
        webhook_server(cert_dir=tmp_path)
    # The self-signed certificate names the loopback address as an IP SAN.
    import ssl
    pem = Path(server.certfile).read_text()
    der = ssl.PEM_cert_to_DER_cert(pem)
    assert bytes([127, 0, 0, 1]) in der
    assert base64.b64encode(der)  # a well-formed certificate


def _cluster_policy(name: str, selector: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "rlpacer.io/v1alpha1", "kind": "ClusterRLTrainingPolicy",
            "metadata": {"name": name}, "spec": {"namespaceSelector": selector, **spec}}


def test_cluster_policies_apply_to_the_namespaces_they_select() -> None:
    async def lister(namespace: str) -> Sequence[Mapping[str, Any]]:
        return [_policy("own", defaults={"ttlSecondsAfterFinished": 5})]

    async def cluster_lister(namespace: str) -> tuple[Sequence[Mapping[str, Any]],
                                                      Mapping[str, str]]:
        return ([
            _cluster_policy("research", {"matchLabels": {"tier": "research"}}, **STRICT,
                            defaults={"ttlSecondsAfterFinished": 60,
                                      "activeDeadlineSeconds": 600}),
            _cluster_policy("prod-only", {"matchLabels": {"tier": "prod"}},
                            stragglerSLO={"maxTargetStragglerRate": "0.01"}),
            _cluster_policy("by-name", {"matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [NS]}]},
                action="Warn", longRounds={"maxRolloutReplicas": 1}),
        ], {"tier": "research"})

    adm = PolicyAdmission(lister, cluster_lister)
    refs = [p.ref for p in asyncio.run(adm.policies(NS))]
    assert refs == ["RLTrainingPolicy team/own", "ClusterRLTrainingPolicy by-name",
                    "ClusterRLTrainingPolicy research"]
    with pytest.raises(kopf.AdmissionError, match="of ClusterRLTrainingPolicy research"):
        _call(adm.validate_job, _job(groupControl={"targetStragglerRate": "0.3"}))
    warnings, _ = _call(adm.validate_job, _job(rollout={"replicas": 2},
                                               tailBatching={"enabled": False}))
    assert "ClusterRLTrainingPolicy by-name" in warnings[0]
    # The namespace's own policy comes first for defaults; the cluster one fills the rest.
    _, patch = _call(adm.mutate_job, _job())
    ops = {op["path"]: op["value"] for op in patch.as_json_patch()}
    assert ops["/spec/ttlSecondsAfterFinished"] == 5
    assert ops["/spec/activeDeadlineSeconds"] == 600
    assert ops["/metadata/annotations"] == {DEFAULTED_BY: "own,research"}


def test_cluster_policy_validation() -> None:
    adm = _admission()
    adm_call = adm.validate_cluster_policy
    _call(adm_call, {**_cluster_policy("ok", {}), "metadata": {"name": "ok", "namespace": ""}})
    with pytest.raises(kopf.AdmissionError, match=r"spec\.namespaceSelector"):
        _call(adm_call, {"apiVersion": "rlpacer.io/v1alpha1", "kind": "ClusterRLTrainingPolicy",
                         "metadata": {"name": "x", "namespace": ""}, "spec": {}})


def test_tensor_parallel_size_is_refused_unless_it_equals_the_gpus_ratcheted_on_update() -> None:
    adm = _admission()
    bad = _job(rollout={"gpusPerReplica": 4, "tensorParallelSize": 2})
    with pytest.raises(kopf.AdmissionError, match=r"spec\.rollout: tensorParallelSize must"
                                                  r" equal gpusPerReplica \(4\)") as info:
        _call(adm.validate_job, bad)
    assert info.value.code == 422
    with pytest.raises(kopf.AdmissionError, match="tensorParallelSize must be 1 when"):
        _call(adm.validate_job, _job(rollout={"gpusPerReplica": 0, "tensorParallelSize": 2}))
    _call(adm.validate_job, _job(rollout={"gpusPerReplica": 4, "tensorParallelSize": 4}))
    # a job stored before the rule: an update that leaves spec.rollout as it is passes (as the
    # API server ratchets the CRD's rule); one that touches the rollout is judged
    _call(adm.validate_job, _job(rollout=bad["spec"]["rollout"], steps=6), old=bad,
          operation="UPDATE")
    with pytest.raises(kopf.AdmissionError, match="tensorParallelSize"):
        _call(adm.validate_job, _job(rollout={"gpusPerReplica": 4, "tensorParallelSize": 3}),
              old=bad, operation="UPDATE")
