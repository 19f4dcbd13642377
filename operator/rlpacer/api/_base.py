"""Base model and small types shared by every rlpacer API object.

Kubernetes API conventions (CONVENTIONS.md item 5): camelCase on the wire, unknown fields
rejected, enums rather than booleans for modes, no floats in a CRD. Decimals travel as
strings (``"0.2"``) and are parsed once, here, by :func:`decimal`.
"""

from __future__ import annotations

import copy
import math
import types
import typing
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError, field_validator
from pydantic.alias_generators import to_camel

M = TypeVar("M", bound=BaseModel)

#: A decimal number written as a string, as Kubernetes APIs carry non-integers.
DECIMAL_PATTERN = r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$"
Decimal = Annotated[str, StringConstraints(pattern=DECIMAL_PATTERN, max_length=32)]


class APIModel(BaseModel):
    """Base for API objects: camelCase aliases, Python names accepted too, unknown fields
    rejected (a typo in a manifest is an error, not a silently ignored field)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_enum_values=False,
    )

    def to_wire(self) -> dict[str, object]:
        """The JSON-ready camelCase dict, without unset optional fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class TypedObject(APIModel):
    """A top-level object: ``apiVersion`` and ``kind`` must be the subclass's own."""

    expected_api_version: ClassVar[str]
    expected_kind: ClassVar[str]

    @field_validator("api_version", check_fields=False)
    @classmethod
    def _check_api_version(cls, v: str) -> str:
        if v != cls.expected_api_version:
            raise ValueError(f"apiVersion must be {cls.expected_api_version}")
        return v

    @field_validator("kind", check_fields=False)
    @classmethod
    def _check_kind(cls, v: str) -> str:
        if v != cls.expected_kind:
            raise ValueError(f"kind must be {cls.expected_kind}")
        return v


def decimal(value: str) -> float:
    """Parse an API decimal string; finite values only."""
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{value!r} is not a finite number")
    return out


def format_decimal(value: float, digits: int = 6) -> str:
    """Write a float as an API decimal string (fixed significant digits, no exponent noise)."""
    if not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    text = f"{value:.{digits}g}"
    return "0" if text in ("-0", "+0") else text


# --- reading stored objects ------------------------------------------------------------------
#
# The models forbid unknown fields: a typo in a manifest is an error. An object *stored* in the
# API server is another matter: written under another version of the schema (a newer one,
# after an operator downgrade; fields a newer operator wrote into status), it must still be
# read, never crash-loop the operator. These read it tolerantly: fields this version does not
# know are left out (and named, for a log line); see README "API versions and stored objects".


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the API model inside ``annotation``, whether it is a list of it)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _model_of(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found[0] is not None:
                return found
        return None, False
    if origin is list:
        inner, _ = _model_of(typing.get_args(annotation)[0])
        return inner, inner is not None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def strip_unknown(model: type[BaseModel], data: Any, path: str = "") -> tuple[Any, list[str]]:
    """``data`` without the fields ``model`` does not know (recursively), and their paths."""
    if not isinstance(data, dict) or model.model_config.get("extra") == "allow":
        return data, []
    known: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        known[name] = known[f.alias or name] = f.annotation
    out: dict[str, Any] = {}
    ignored: list[str] = []
    for k, v in data.items():
        if k not in known:
            ignored.append(f"{path}{k}")
            continue
        sub, many = _model_of(known[k])
        if sub is not None and many and isinstance(v, list):
            items = []
            for i, item in enumerate(v):
                clean, more = strip_unknown(sub, item, f"{path}{k}[{i}].")
                items.append(clean)
                ignored += more
            v = items
        elif sub is not None and not many:
            v, more = strip_unknown(sub, v, f"{path}{k}.")
            ignored += more
        out[k] = v
    return out, ignored


def _item(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` up to its innermost list index (a bad value in a list item drops the item)."""
    cut = max((i for i, p in enumerate(loc) if isinstance(p, int)), default=None)
    return loc if cut is None else loc[: cut + 1]


def _order(loc: tuple[int | str, ...]) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, p) if isinstance(p, int) else (1, p) for p in loc)


def _path(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _drop(data: Any, loc: tuple[int | str, ...]) -> bool:
    """Remove what ``loc`` points at."""
    node = data
    for p in loc[:-1]:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            return False
    try:
        del node[loc[-1]]
    except (KeyError, IndexError, TypeError):
        return False
    return True


def read_stored(model: type[M], data: Any, *, drop_invalid: bool) -> tuple[M, list[str]]:
    """Validate a stored object's part (spec, status) tolerantly: unknown fields are ignored;
    with ``drop_invalid`` also values this version cannot read (an enum value a newer version
    added, ...), dropped to their defaults. Returns the model and what was left out.
    Raises ``ValidationError`` for what remains invalid (without ``drop_invalid``: any)."""
    clean, ignored = strip_unknown(model, copy.deepcopy(data) if data is not None else {})
    for _ in range(32):
        try:
            return model.model_validate(clean), ignored
        except ValidationError as err:
            if not drop_invalid:
                raise
            # the highest list index first, so the others still point where they did
            locs = sorted({_item(e["loc"]) for e in err.errors() if e["loc"]}, key=_order,
                          reverse=True)
            dropped = [loc for loc in locs if _drop(clean, loc)]
            if not dropped:
                raise
            ignored += [_path(loc) + " (unreadable)" for loc in dropped]
    return model.model_validate(clean), ignored
