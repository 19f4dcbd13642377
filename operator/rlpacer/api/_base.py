"""Base model and small types shared by every rlpacer API object.

Kubernetes API conventions (CONVENTIONS.md item 5): camelCase on the wire, unknown fields
rejected, enums rather than booleans for modes, no floats in a CRD. Decimals travel as
strings (``"0.2"``) and are parsed once, here, by :func:`decimal`.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, StringConstraints, field_validator
from pydantic.alias_generators import to_camel

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
