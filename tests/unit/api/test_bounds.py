"""Every number of the API is bounded on both sides (issue 32, defect 2): a spec the API server
accepts must be one the operator can compute with.

Walks the generated CRDs (RLTrainingJob, RLTrainingPolicy, ClusterRLTrainingPolicy): every
integer has a minimum and a maximum; every decimal string of a spec carries a CEL rule with a
lower and an upper bound, generated from the same :class:`DecimalRange` pydantic checks (the
webhook and ``rlpacer run``), so the two sides agree at each end.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from rlpacer.api import crd, job, policy
from rlpacer.api._base import DECIMAL_PATTERN, DecimalRange, field_range
from rlpacer.api.status import RLTrainingJobStatus

pytestmark = pytest.mark.unit


def _root(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def _walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any],
                                                                  dict[str, Any] | None]]:
    """(path, schema node, the object node holding it) for every node under ``node``."""
    yield path, node, None
    for k, v in (node.get("properties") or {}).items():
        for p, n, parent in _walk(v, f"{path}.{k}"):
            yield p, n, parent if parent is not None or p != f"{path}.{k}" else node
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")


CRDS = {f.filename: _root(crd.structural_root(f.build())) for f in crd.CRDS}
BOUNDED_DECIMAL = re.compile(
    r"double\(self\.(\w+)\) (>=|>) (-?[\d.e+]+) && double\(self\.\1\) (<=|<) (-?[\d.e+]+)")


@pytest.mark.parametrize("name", sorted(CRDS))
def test_every_integer_has_both_bounds(name: str) -> None:
    integers = [(p, n) for p, n, _ in _walk(CRDS[name]) if n.get("type") == "integer"]
    assert integers, name
    missing = [p for p, n in integers if "minimum" not in n or "maximum" not in n]
    assert missing == [], f"{name}: integers without both bounds: {missing}"
    for p, n in integers:  # within the API server's int64, and not an empty range
        assert crd.INT64_MIN <= n["minimum"] <= n["maximum"] <= crd.INT64_MAX, (p, n)


@pytest.mark.parametrize("name", sorted(CRDS))
def test_no_floats_and_every_spec_decimal_has_both_bounds(name: str) -> None:
    decimals = []
    for p, n, parent in _walk(CRDS[name]):
        assert n.get("type") != "number", p
        if n.get("type") == "string" and n.get("pattern") == DECIMAL_PATTERN:
            decimals.append((p, parent))
    spec = [(p, parent) for p, parent in decimals if p.startswith(".spec.")]
    assert spec, name
    for p, parent in spec:
        field = p.rsplit(".", 1)[-1]
        rules = [r for r in (parent or {}).get("x-kubernetes-validations") or []
                 if r.get("fieldPath") == f".{field}" and BOUNDED_DECIMAL.search(r["rule"])]
        assert len(rules) == 1, f"{name}: {p} has no CEL rule bounding it on both sides"
        lo, hi = map(float, BOUNDED_DECIMAL.search(rules[0]["rule"]).group(3, 5))  # type: ignore[union-attr]
        assert -1e6 <= lo < hi <= 1e7, (p, lo, hi)  # finite, and far from overflowing
    # status decimals are written by the operator only (finite: format_decimal)
    assert all(p.startswith(".status.") for p, _ in decimals if not p.startswith(".spec.")), \
        decimals


def _models(root: type[BaseModel]) -> Iterator[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo = [root]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        yield m
        for f in m.model_fields.values():
            for t in re.findall(r"\b([A-Z]\w+)\b", str(f.annotation)):
                sub = getattr(job, t, None) or getattr(policy, t, None)
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    todo.append(sub)


RANGED = [(m, name, rng) for root in (job.RLTrainingJobSpec, policy.ClusterRLTrainingPolicySpec)
          for m in _models(root) for name in m.model_fields
          if (rng := field_range(m, name)) is not None]


def test_the_ranges_cover_the_spec_decimals() -> None:
    fields = {f"{m.__name__}.{n}" for m, n, _ in RANGED}
    assert {"TailBatchingSpec.prompt_overprovision", "GroupControlSpec.lambda_max",
            "RewardSpec.failure_score", "StragglerSLO.max_target_straggler_rate",
            "GroupControlDefaults.straggler_ratio", "DataSpec.eval_fraction"} <= fields
    # (that no spec decimal lacks one: the CRD walk above, its rules come from these ranges)


def _edge_values(rng: DecimalRange) -> tuple[list[str], list[str]]:
    """(values inside, values outside) the range, at and around each end."""
    eps_lo = max(abs(rng.low), 1.0) * 1e-6
    eps_hi = max(abs(rng.high), 1.0) * 1e-6
    inside = [repr(rng.low + eps_lo), repr(rng.high - eps_hi)]
    outside = [repr(rng.low - eps_lo), repr(rng.high + eps_hi), "1e308", "-1e308", "1e999"]
    if not rng.low_open:
        inside.append(repr(float(rng.low)))
    else:
        outside.append(repr(float(rng.low)))
    if not rng.high_open:
        inside.append(repr(float(rng.high)))
    else:
        outside.append(repr(float(rng.high)))
    return inside, outside


@pytest.mark.parametrize(("model", "name", "rng"), RANGED,
                         ids=[f"{m.__name__}.{n}" for m, n, _ in RANGED])
def test_pydantic_refuses_what_the_rule_refuses_naming_the_field(
        model: type[BaseModel], name: str, rng: DecimalRange) -> None:
    alias = model.model_fields[name].alias or name
    rule = rng.cel(alias, optional=False)["rule"]
    inside, outside = _edge_values(rng)
    for value in inside:
        assert rng.problem(alias, value) is None, (value, rule)
    for value in outside:
        bad = rng.problem(alias, value)
        assert bad is not None and bad.startswith(alias), (value, rule)
        # the model itself refuses it, naming the field (other fields left at defaults)
        with pytest.raises(ValidationError) as exc:
            model.model_validate({alias: value}, context=None)
        locs = [e["loc"] for e in exc.value.errors()]
        assert (alias,) in locs or (name,) in locs, (value, locs)


def test_a_spec_with_promptoverprovision_1e308_is_refused_naming_the_field() -> None:
    spec = {"model": {"source": "builtin://tiny-adder"}, "data": {"source": "builtin://adder"},
            "steps": 5, "promptsPerStep": 2, "tailBatching": {"promptOverprovision": "1e308"}}
    with pytest.raises(job.ManifestError,
                       match=r"spec\.tailBatching\.promptOverprovision: promptOverprovision"
                             r" must be <= 16"):
        job.parse_spec(spec)


def test_status_maxima_are_the_schemas_not_the_models() -> None:
    """The operator computes the status: a model that raised on a value past the schema's
    bound would fail a report half way; the writer checks the schema instead (422)."""
    st = RLTrainingJobStatus(long_rounds=crd.INT64_MAX)
    st.long_rounds += 1  # no ValidationError
    assert crd.schema_violations(crd.status_schema(), {"longRounds": st.long_rounds})
    assert crd.schema_violations(crd.status_schema(), {"step": job.MAX_STEPS + 1}) == [
        f".step: {job.MAX_STEPS + 1} > maximum {job.MAX_STEPS}"]
