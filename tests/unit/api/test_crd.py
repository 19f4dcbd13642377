"""The CRD in crds/ is generated from the models: in sync, structural, described, float-free."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlpacer.api import crd, job

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def _schema() -> dict[str, Any]:
    return crd.rltrainingjob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for k, v in (node.get("properties") or {}).items():
        yield from _walk(v, f"{path}.{k}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")


def test_generated_crds_match_models() -> None:
    drift = crd.check([ROOT / "crds"])
    assert not drift, f"run `rlpacer crds --out crds/`: {drift}"


def test_every_field_has_a_description() -> None:
    assert crd.missing_descriptions(_schema()) == []


def test_structural_no_floats_no_refs_no_unions() -> None:
    for path, node in _walk(_schema()):
        assert node.get("type") != "number", path
        for bad in ("$ref", "anyOf", "allOf", "oneOf", "title", "$defs"):
            assert bad not in node, (path, bad)
        if node.get("type") == "object" and path != ".metadata":
            assert (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), path
            assert node.get("additionalProperties") is not False, path
        if node.get("type") == "array":
            assert "items" in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path


def test_enums_ranges_and_cel_rules_present() -> None:
    s = _schema()
    spec = s["properties"]["spec"]["properties"]
    assert spec["algorithm"]["properties"]["name"]["enum"] == ["GRPO", "DAPO"]
    assert spec["groupControl"]["properties"]["mode"]["enum"] == ["SAGC", "Fixed"]
    assert spec["rollout"]["properties"]["replicas"]["minimum"] == 1
    rules = [r["rule"] for r in spec["groupControl"]["x-kubernetes-validations"]]
    assert any("targetStragglerRate" in r for r in rules)
    assert any("self.initial in" in r for r in rules)
    spec_rules = s["properties"]["spec"]["x-kubernetes-validations"]
    assert spec_rules[0]["fieldPath"] == ".tailBatching.longRound.rolloutReplicas"
    assert "metadata.name" in s["x-kubernetes-validations"][0]["rule"]
    # Defaults only for scalars: object defaults would freeze nested defaults into objects.
    for path, node in _walk(s):
        if "default" in node:
            assert node.get("type") in ("string", "integer", "boolean", "array"), path


def test_status_subresource_and_printer_columns() -> None:
    v = crd.rltrainingjob_crd()["spec"]["versions"][0]
    assert v["subresources"] == {"status": {}}
    cols = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"]}
    assert cols["Status"] == ".status.summary"
    assert cols["G"] == ".status.groupSize"
    assert cols["Stragglers"] == ".status.stragglerRate"
    assert cols["Age"] == ".metadata.creationTimestamp"
    status = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["controllerState"]["type"] == "string"
    assert status["conditions"]["x-kubernetes-list-type"] == "map"


def test_write_to_several_places_and_check(tmp_path: Path) -> None:
    a, b = tmp_path / "crds", tmp_path / "chart" / "crds"
    written = crd.write([a, b])
    assert len(written) == 2 * len(crd.CRDS)
    assert crd.check([a, b]) == []
    (b / crd.CRDS[0].filename).write_text("stale")
    assert crd.check([a, b]) == [str(b / crd.CRDS[0].filename)]
    doc = yaml.safe_load((a / crd.CRDS[0].filename).read_text())
    assert doc["kind"] == "CustomResourceDefinition"


def test_cli_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlpacer.cli import main

    assert main(["crds", "--out", str(tmp_path), "--check"]) == 1
    assert main(["crds", "--out", str(tmp_path)]) == 0
    assert main(["crds", "--out", str(tmp_path), "--check"]) == 0


def test_float_field_is_rejected() -> None:
    from pydantic import BaseModel, Field

    class Bad(BaseModel):
        x: float = Field(description="no")

    with pytest.raises(crd.SchemaError, match="floats"):
        crd.model_schema(Bad, {}, "bad")


def test_reward_rules_mirror_the_model() -> None:
    """The API server's copy of RewardSpec's validators: the type rule's regex is the model's
    (no backslash escapes, which a CEL string literal would refuse), pattern goes with Regex."""
    reward = _schema()["properties"]["spec"]["properties"]["reward"]
    props = reward["properties"]
    assert props["workers"]["default"] == 2 and props["workers"]["minimum"] == 1
    assert props["failureScore"]["default"] == "0" and "pattern" in props["failureScore"]
    assert "default" not in props["pattern"]
    rules = {r["fieldPath"]: r for r in reward["x-kubernetes-validations"][:1]}
    type_rule = rules[".type"]["rule"]
    assert job.REWARD_ENTRY_POINT in type_rule and "\\" not in type_rule
    for name in job.BUILTIN_REWARDS:
        assert f"'{name}'" in type_rule
    for ok in ("my_rewards:score", "a.b_c.d:f2"):
        assert re.fullmatch(job.REWARD_ENTRY_POINT, ok)
    for bad in ("my rewards:score", "a:", ":f", "a:b:c", "1a:f", "a..b:f"):
        assert not re.fullmatch(job.REWARD_ENTRY_POINT, bad)
    pattern_rules = [r["rule"] for r in reward["x-kubernetes-validations"]
                     if r["fieldPath"] == ".pattern"]
    assert pattern_rules == ["self.type != 'Regex' || has(self.pattern)",
                             "!has(self.pattern) || self.type == 'Regex'"]
