"""Reading stored jobs tolerantly (rlpacer.api.job.read_spec, rlpacer.api.status.read_status):
an older operator's status (controllerState included) reads as it was written; fields and
values of a newer schema are left out, named, and nothing else is lost. Manifests stay strict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpacer.api.job import ManifestError, parse_spec, read_spec
from rlpacer.api.status import ConditionType, RLTrainingJobStatus, read_status
from rlpacer.operator import hosting

pytestmark = pytest.mark.unit

STORED = Path(__file__).resolve().parents[2] / "integration" / "data" / "stored"


@pytest.mark.parametrize("commit", ["94fcf50", "b485d2a"])
def test_an_older_operators_status_reads_back_exactly(commit: str) -> None:
    for job in json.loads((STORED / f"jobs-{commit}.json").read_text())["jobs"]:
        st, left_out = read_status(job["status"])
        assert left_out == []
        # nothing lost; what is new since reads as its default (empty lists)
        assert st.to_wire() == {"policyNotes": [], "tokenHashes": [], **job["status"]}
        # the controller restores from the old state (step seconds absent before the SLOs)
        ctl = hosting.load(st.controller_state or "")
        assert ctl.plan().step == job["status"]["step"]
        spec, ignored = read_spec(job["spec"])
        assert ignored == [] and spec == parse_spec(job["spec"])


def test_a_newer_status_keeps_what_this_version_reads() -> None:
    job = json.loads((STORED / "jobs-b485d2a.json").read_text())["jobs"][0]
    newer = {**job["status"], "futureCounter": 3,
             "rollout": {**job["status"]["rollout"], "futureZone": "a"}}
    newer["conditions"] = [
        {"type": "FutureReady", "status": "True", "reason": "Ready",
         "lastTransitionTime": "2026-11-30T12:00:00Z"},
        *job["status"]["conditions"],
        {**job["status"]["conditions"][0], "futureDetail": "x"},
    ]
    newer["conditions"][-1]["type"] = "AnotherNewType"
    with pytest.raises(ValueError):  # what the strict model says
        RLTrainingJobStatus.model_validate(newer)
    st, left_out = read_status(newer)
    assert st.controller_state == job["status"]["controllerState"]
    assert (st.attempt, st.step) == (job["status"]["attempt"], job["status"]["step"])
    assert [c.to_wire() for c in st.conditions] == job["status"]["conditions"]
    assert ConditionType.ADMITTED in {c.type for c in st.conditions}
    n = len(newer["conditions"]) - 1
    assert sorted(left_out) == sorted([
        "status.futureCounter", "status.rollout.futureZone",
        f"status.conditions[{n}].futureDetail",
        f"status.conditions[{n}] (unreadable)", "status.conditions[0] (unreadable)"])


def test_a_newer_spec_is_read_without_its_new_fields_and_bad_values_stay_errors() -> None:
    job = json.loads((STORED / "jobs-b485d2a.json").read_text())["jobs"][0]
    newer = {**job["spec"], "futureKnob": "on",
             "rollout": {**job["spec"]["rollout"], "futurePolicy": "spread"},
             "scheduling": {"tolerations": [{"key": "k", "futureField": 1}]}}
    with pytest.raises(ManifestError, match="futureKnob"):
        parse_spec(newer)  # a manifest: a typo is an error
    spec, ignored = read_spec(newer)
    assert spec.rollout == parse_spec(job["spec"]).rollout
    assert sorted(ignored) == ["spec.futureKnob", "spec.rollout.futurePolicy",
                               "spec.scheduling.tolerations[0].futureField"]
    with pytest.raises(ManifestError, match=r"spec\.steps"):
        read_spec({**newer, "steps": 0})  # a known field's bad value is not dropped
