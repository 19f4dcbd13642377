"""Small checks shared by the control layer's config types (each error names the field)."""

from __future__ import annotations

import math
from typing import Any

from rlpacer.control.errors import ConfigError


def require_int(field: str, value: Any, *, minimum: int | None = None) -> int:
    """An integer (not a bool), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(field, f"must be >= {minimum}, got {value}")
    return value


def require_float(
    field: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> float:
    """A finite real number within [low, high] (ends open where asked)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(field, f"must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ConfigError(field, f"must be finite, got {value!r}")
    bad = (
        (low is not None and (out < low or (low_open and out == low)))
        or (high is not None and (out > high or (high_open and out == high)))
    )
    if bad:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        left = "(" if low_open or low is None else "["
        right = ")" if high_open or high is None else "]"
        extra = f"; {hint}" if hint else ""
        raise ConfigError(field, f"must be in {left}{lo}, {hi}{right}, got {value!r}{extra}")
    return out


def require_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be true or false, got {value!r}")
    return value
