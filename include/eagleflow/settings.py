"""Numeric settings from the environment or a DAG's Params: a bad one is refused, never replaced by a default.

``window_s: 0`` read as "unset, use 600" silently turns an operator's choice into
another one; here it is an error that names where the setting is, its value
and what is allowed.
"""
from __future__ import annotations

import os
from typing import Any


def positive_number(name: str, value: Any, *, where: str, upper: float | None = None, unit: str = "") -> float:
    """``value`` as a number in (0, upper]; otherwise ValueError naming ``where``/``name``, the value and the range."""
    try:
        number = float(value)
        ok = number > 0 and (upper is None or number <= upper) and number == number
    except (TypeError, ValueError):
        ok = False
    if not ok:
        allowed = f"a number > 0{f' and <= {upper:g}' if upper is not None else ''}{f' ({unit})' if unit else ''}"
        raise ValueError(f"{where}: {name}={value!r} is not allowed: it must be {allowed}")
    return number


def env_positive(var: str, default: float, *, upper: float | None = None, unit: str = "") -> float:
    """$var as a positive number; ``default`` only when the variable is not set at all."""
    raw = os.environ.get(var)
    if raw is None:
        return float(default)
    return positive_number(var, raw, where="environment", upper=upper, unit=f"{unit}, default {default:g}".lstrip(", "))
