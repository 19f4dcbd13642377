"""Pydantic models to Kubernetes structural schemas: the generator behind ``rlpacer crds``.

The models are the source of truth; this module turns their JSON schema into a Kubernetes
*structural* schema (``apiextensions.k8s.io/v1``):

* every ``$ref`` inlined, ``Optional`` unwrapped (unset fields are simply absent), titles
  dropped, ``additionalProperties: false`` dropped (forbidden beside ``properties``: the API
  server prunes unknown fields and ``kubectl`` rejects them with strict field validation);
* a description on every property (the field's, else the model's docstring), so
  ``kubectl explain rltj.spec.groupControl`` teaches the API; :func:`missing_descriptions`
  lists gaps and a unit test keeps it empty;
* no floats: a ``number`` anywhere is an error (decimals are strings, CONVENTIONS.md item 5);
* defaults only for scalars and lists of scalars (object defaults would freeze today's
  nested defaults into stored objects);
* the range of every bounded decimal string (:class:`rlpacer.api._base.DecimalRange`) becomes
  a CEL rule (``x-kubernetes-validations``) on the object holding it, with a ``fieldPath`` so
  the API server's message names the field; rules a caller passes by model name (cross-field
  checks) are added beside them.

It knows none of the API's models: :mod:`rlpacer.api.crd` applies it to them and writes the
CRD documents (the model modules import neither, so no import circle can form).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from pydantic import BaseModel

from rlpacer.api._base import INT64_MAX, INT64_MIN, DecimalRange

Schema = dict[str, Any]
Rules = dict[str, list[dict[str, str]]]

__all__ = [
    "INT64_MAX", "INT64_MIN", "Rules", "Schema", "SchemaError", "missing_descriptions",
    "model_schema", "rule", "schema_violations", "to_structural",
]


class SchemaError(ValueError):
    """The models cannot be expressed as a structural schema (e.g. a float field)."""


def rule(rule: str, message: str, field: str | None = None) -> dict[str, str]:
    """A CEL rule; with ``field`` the API server's message names that field."""
    out = {"rule": rule, "message": message}
    if field:
        out["fieldPath"] = f".{field}"
        out["reason"] = "FieldValueInvalid"
    return out


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _take_range(node: Schema) -> DecimalRange | None:
    """The decimal range a property's raw schema carries (also inside ``Optional``'s anyOf),
    removed from it."""
    found = DecimalRange.from_schema(node)
    for key in ("anyOf", "allOf"):
        for branch in node.get(key) or []:
            found = DecimalRange.from_schema(branch) or found
    return found


class _Missing:
    pass


_MISSING: Any = _Missing()


def _scalar_default(value: Any) -> bool:
    if isinstance(value, (str, int, bool)):
        return True
    return isinstance(value, list) and all(isinstance(v, (str, int, bool)) for v in value)


def to_structural(schema: Schema, defs: dict[str, Schema], rules: Rules, path: str) -> Schema:
    """Inline and clean a pydantic JSON schema node into a structural-schema node."""
    node = copy.deepcopy(schema)
    description = node.pop("description", None)
    default = node.pop("default", None) if "default" in node else _MISSING
    # Optional[X]: anyOf [X, null] -> X.
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise SchemaError(f"{path}: unions are not supported in a CRD")
        node = {**branches[0], **node}
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
    name: str | None = None
    if "$ref" in node:
        name = _ref_name(node.pop("$ref"))
        target = defs[name]
        node = {**copy.deepcopy(target), **node}
        if description is None:
            description = node.get("description")
        node.pop("description", None)
    node.pop("title", None)
    DecimalRange.from_schema(node)  # (its rule sits on the parent object)
    if node.get("additionalProperties") is False:
        node.pop("additionalProperties")

    t = node.get("type")
    if t == "number":
        raise SchemaError(f"{path}: floats are not allowed in the CRD; use a decimal string")
    if t == "object":
        props = node.get("properties")
        cel: list[dict[str, str]] = copy.deepcopy(rules.get(name, [])) if name else []
        if props is not None:
            required = set(node.get("required") or ())
            for k, v in props.items():
                rng = _take_range(v)
                if rng is not None:
                    present = k in required or v.get("default") is not None
                    cel.append(rng.cel(k, optional=not present))
            node["properties"] = {
                k: to_structural(v, defs, rules, f"{path}.{k}") for k, v in props.items()
            }
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            node["additionalProperties"] = to_structural(extra, defs, rules, f"{path}.*")
        if props is None and not isinstance(extra, dict):
            node["x-kubernetes-preserve-unknown-fields"] = True
        if cel:
            node["x-kubernetes-validations"] = cel
    elif t == "array":
        node["items"] = to_structural(node.get("items", {}), defs, rules, f"{path}[]")
    elif t is None and not node:
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"] = node.pop("exclusiveMinimum")
        node["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node and not isinstance(node["exclusiveMaximum"], bool):
        node["maximum"] = node.pop("exclusiveMaximum")
        node["exclusiveMaximum"] = True
    if default is not _MISSING and default is not None and _scalar_default(default):
        node["default"] = default
    out: Schema = {}
    if description:
        out["description"] = " ".join(str(description).split())
    # A stable, readable key order: description, type, then the rest as pydantic gave it.
    if "type" in node:
        out["type"] = node.pop("type")
    out.update(node)
    return out


def model_schema(model: type[BaseModel], rules: Rules, path: str) -> Schema:
    """The structural schema of ``model`` (``rules``: extra CEL rules by model name)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    defs[model.__name__] = raw
    return to_structural({"$ref": f"#/$defs/{model.__name__}"}, defs, rules, path)


def missing_descriptions(schema: Schema, path: str = "") -> list[str]:
    """Every property path without a description (a unit test keeps this empty)."""
    out: list[str] = []
    for key, sub in (schema.get("properties") or {}).items():
        p = f"{path}.{key}"
        if p == ".metadata":
            continue  # the API server forbids a description on the root's metadata
        if not sub.get("description"):
            out.append(p)
        out.extend(missing_descriptions(sub, p))
    if isinstance(schema.get("items"), dict):
        out.extend(missing_descriptions(schema["items"], f"{path}[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        out.extend(missing_descriptions(schema["additionalProperties"], f"{path}.*"))
    return out


def schema_violations(schema: Schema, value: Any, path: str = "", limit: int = 5) -> list[str]:
    """What in ``value`` (wire JSON) breaks the bounds of the structural ``schema``: int64
    and minimum/maximum of integers and numbers, maxLength/minLength/pattern of strings,
    maxItems of arrays. The API server refuses such an object every time (422), so a writer
    checks first instead of retrying. CEL rules are not evaluated. At most ``limit`` items."""
    out: list[str] = []
    _violations(schema, value, path, out, limit)
    return out


def _violations(schema: Schema, value: Any, path: str, out: list[str], limit: int) -> None:
    if len(out) >= limit or value is None:
        return
    t = schema.get("type")
    where = path or "."
    if t in ("integer", "number") and isinstance(value, int | float) and not isinstance(
        value, bool
    ):
        if t == "integer" and isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            out.append(f"{where}: {value} is outside int64")
            return  # (past int64 is past every bound too: one message)
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{where}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{where}: {value} > maximum {schema['maximum']}")
    elif t == "string" and isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{where}: {len(value)} characters > maxLength {schema['maxLength']}")
        if "minLength" in schema and len(value) < schema["minLength"]:
            out.append(f"{where}: {len(value)} characters < minLength {schema['minLength']}")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            out.append(f"{where}: {value[:40]!r} does not match {schema['pattern']}")
    elif t == "array" and isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{where}: {len(value)} items > maxItems {schema['maxItems']}")
        items = schema.get("items")
        if isinstance(items, dict):
            for i, v in enumerate(value):
                _violations(items, v, f"{path}[{i}]", out, limit)
    elif isinstance(value, dict):
        props = schema.get("properties") or {}
        for k, v in value.items():
            sub = props.get(k)
            if isinstance(sub, dict):
                _violations(sub, v, f"{path}.{k}", out, limit)
