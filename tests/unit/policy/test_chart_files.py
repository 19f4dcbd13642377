"""The Helm chart's files, without Helm: CRDs in sync with the models, every value documented
(values.yaml and README), values.yaml valid under its own schema, ids shared with the code.

Rendering, linting and installing the chart are in tests/integration/test_chart.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from rlpacer.api import crd
from rlpacer.operator import admission

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "rlpacer"


def documented_values() -> list[str]:
    """Dotted keys of values.yaml that carry a ``# --`` comment (helm-docs convention)."""
    stack: list[str] = []
    pending = False
    out = []
    for line in (CHART / "values.yaml").read_text().splitlines():
        if not line.strip():
            continue
        if re.match(r"^\s*# -- ", line):
            pending = True
            continue
        if re.match(r"^\s*#", line):
            continue
        m = re.match(r"^(\s*)([A-Za-z0-9_]+):", line)
        if not m:
            continue
        depth = len(m.group(1)) // 2
        stack = [*stack[:depth], m.group(2)]
        if pending:
            out.append(".".join(stack))
            pending = False
    return out


def leaf_values(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.extend(leaf_values(v, path + "."))
        else:
            out.append(path)
    return out


def test_chart_crds_are_the_generated_crds() -> None:
    # Helm installs crds/ verbatim; they must be exactly what the models generate.
    fix = "run: rlpacer crds --out crds/ --out charts/rlpacer/crds/"
    assert crd.check([CHART / "crds"]) == [], fix
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(crd.rendered())


def test_every_value_is_documented_in_values_yaml_and_readme() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented = set(documented_values())
    # A documented parent (e.g. `resources`) covers its free-form children.
    undocumented = [
        leaf for leaf in leaf_values(values)
        if not any(leaf == d or leaf.startswith(d + ".") for d in documented)
    ]
    assert undocumented == []
    readme = (CHART / "README.md").read_text()
    missing = [d for d in documented if f"| `{d}` |" not in readme]
    assert missing == []


def test_values_yaml_is_valid_under_its_schema_and_the_schema_is_strict() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(values, schema)
    # Every documented key is known to the schema (unknown keys are rejected at install).
    for key in documented_values():
        node = schema
        for part in key.split("."):
            assert part in node.get("properties", {}), f"{key} missing from values.schema.json"
            node = node["properties"][part]
    bad = {**values, "rbac": {**values["rbac"], "scope": "cluster"}}
    with pytest.raises(jsonschema.ValidationError, match="'Cluster', 'Namespaced'"):
        jsonschema.validate(bad, schema)


def test_webhook_paths_in_the_chart_are_the_handler_ids() -> None:
    text = (CHART / "templates" / "webhook.yaml").read_text()
    ids = set(re.findall(r'"id" "([a-z-]+)"', text))
    assert ids == set(admission.WEBHOOK_IDS)




def exported_metrics() -> set[str]:
    from rlpacer.operator.metrics import Metrics

    out = set()
    for fam in Metrics().registry.collect():
        out.add(fam.name)
        if fam.type == "counter":
            out.add(fam.name + "_total")
        if fam.type == "histogram":
            out |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
    return out


def referenced_metrics(text: str) -> set[str]:
    return set(re.findall(r"\b(rlpacer_[a-z_]+)", text))


def test_dashboard_and_alerts_use_the_operators_metric_names() -> None:
    dash = json.loads((CHART / "dashboards" / "rlpacer.json").read_text())
    assert dash["uid"] == "rlpacer-jobs"
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = referenced_metrics("\n".join(exprs))
    used |= referenced_metrics((CHART / "templates" / "prometheusrule.yaml").read_text())
    unknown = used - exported_metrics()
    assert unknown == set(), f"not exported by rlpacer.operator.metrics: {sorted(unknown)}"
