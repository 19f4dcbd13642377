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
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

M = TypeVar("M", bound=BaseModel)

#: A decimal number written as a string, as Kubernetes APIs carry non-integers.
DECIMAL_PATTERN = r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$"
Decimal = Annotated[str, StringConstraints(pattern=DECIMAL_PATTERN, max_length=32)]

# --- bounds of numeric fields ------------------------------------------------------------------
#
# Every number a user writes is bounded on both sides, by what the code computes with (issue
# 32: a promptOverprovision of "1e308" passed the CRD and made every step report overflow).
# Integers carry ``ge``/``le`` (the CRD's minimum/maximum); decimal strings carry a
# :class:`DecimalRange`, which pydantic checks and from which the CRD generator writes the
# CEL rule (``rlpacer.api.schema``), so the two cannot drift.

#: The API server's integers are int64 (a larger JSON integer fails "must be of type integer").
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Largest status counter (attempts, failures, generations, long rounds): 2**53 - 1, the
#: largest integer a float64 holds exactly. The API server keeps a schema's bounds as float64
#: (a maximum of 2**63 - 1 becomes 2**63, outside int64, and the CRD is refused).
MAX_COUNT = 2**53 - 1
#: Kubernetes' replica counts (StatefulSet ``replicas``, its status) and pod ordinals are int32.
INT32_MAX = 2**31 - 1
#: Largest seed: every random generator the trainer and the controller seed accepts it
#: (numpy's legacy seeding stops at 2**32 - 1).
MAX_SEED = 2**32 - 1
#: Largest duration of a job-level timer (deadline, TTL, toleration): ten years, longer than
#: any training run, and far inside what date arithmetic (``datetime``) can represent.
MAX_DURATION_SECONDS = 10 * 365 * 86_400


def _num(x: float) -> str:
    """A bound as a message writes it: ``1``, ``0.5``, ``1000000``."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class DecimalRange:
    """The interval a decimal-string field must lie in (both ends finite).

    As ``Annotated`` metadata it validates the field (pydantic; the message names the field
    and the side broken) and marks its JSON schema so the CRD generator writes the same
    check as a CEL rule (:meth:`cel`)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    #: The JSON-schema key that carries the range to the CRD generator (removed there).
    SCHEMA_KEY: ClassVar[str] = "x-rlpacer-decimal-range"

    def interval(self) -> str:
        return (f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
                f"{')' if self.high_open else ']'}")

    def problem(self, name: str, text: str) -> str | None:
        """What is wrong with ``text`` as a value of the field ``name`` (None: nothing)."""
        try:
            value = decimal(text)
        except ValueError:
            return f"{name} {text!r} must be a finite number in {self.interval()}"
        if value < self.low or (self.low_open and value == self.low):
            return f"{name} must be {'>' if self.low_open else '>='} {_num(self.low)}"
        if value > self.high or (self.high_open and value == self.high):
            return f"{name} must be {'<' if self.high_open else '<='} {_num(self.high)}"
        return None

    def cel(self, field: str, optional: bool) -> dict[str, str]:
        """The CEL rule (on the object holding ``field``) the API server checks."""
        x = f"double(self.{field})"
        lo, hi = float(self.low), float(self.high)
        rule = (f"{x} {'>' if self.low_open else '>='} {lo!r}"
                f" && {x} {'<' if self.high_open else '<='} {hi!r}")
        if optional:
            rule = f"!has(self.{field}) || ({rule})"
        return {"rule": rule, "message": f"{field} must be in {self.interval()}",
                "fieldPath": f".{field}", "reason": "FieldValueInvalid"}

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        def check(value: str, info: ValidationInfo) -> str:
            bad = self.problem(to_camel(info.field_name or "value"), value)
            if bad is not None:
                raise ValueError(bad)
            return value

        return core_schema.with_info_after_validator_function(check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = handler(schema)
        out[self.SCHEMA_KEY] = {"low": self.low, "high": self.high,
                                "lowOpen": self.low_open, "highOpen": self.high_open}
        return out

    @classmethod
    def from_schema(cls, node: dict[str, Any]) -> DecimalRange | None:
        """The range a JSON-schema node carries (popped from it), or None."""
        raw = node.pop(cls.SCHEMA_KEY, None)
        if raw is None:
            return None
        return cls(raw["low"], raw["high"], raw["lowOpen"], raw["highOpen"])


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


def field_range(model: type[BaseModel], name: str) -> DecimalRange | None:
    """The :class:`DecimalRange` of ``model``'s field ``name`` (also inside ``Optional``)."""
    f = model.model_fields[name]
    found = [m for m in f.metadata if isinstance(m, DecimalRange)]
    for arg in typing.get_args(f.annotation):
        if typing.get_origin(arg) is Annotated:
            found += [m for m in typing.get_args(arg)[1:] if isinstance(m, DecimalRange)]
    return found[0] if found else None


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
# know are left out (and named, for a log line); see docs/api-versions.md.


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


#: Validation context of a *stored* object (:func:`read_stored`, a driver's config): rules
#: added after an object could have been admitted without them are enforced at admission only
#: (see :func:`stored`), as the API server ratchets the CRD's rules for unchanged objects.
STORED_CONTEXT: dict[str, Any] = {"stored": True}


def stored(info: Any) -> bool:
    """In a validator (its ``ValidationInfo``): is a stored object being read?"""
    context = getattr(info, "context", None)
    return isinstance(context, dict) and bool(context.get("stored"))


def read_stored(model: type[M], data: Any, *, drop_invalid: bool) -> tuple[M, list[str]]:
    """Validate a stored object's part (spec, status) tolerantly: unknown fields are ignored;
    with ``drop_invalid`` also values this version cannot read (an enum value a newer version
    added, ...), dropped to their defaults; rules newer than the object may be are not
    enforced (:data:`STORED_CONTEXT`). Returns the model and what was left out.
    Raises ``ValidationError`` for what remains invalid (without ``drop_invalid``: any)."""
    clean, ignored = strip_unknown(model, copy.deepcopy(data) if data is not None else {})
    for _ in range(32):
        try:
            return model.model_validate(clean, context=STORED_CONTEXT), ignored
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
    return model.model_validate(clean, context=STORED_CONTEXT), ignored
