"""Argument checks shared by the whole package.

Each `require_*` returns the value in its checked type or raises a ValueError whose message starts
with `name`, so a caller that reads a file passes `f"{path}:{line}: field 'count'"` as the name and
the error points at the file and line. Booleans are never numbers here (True would pass as 1).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Collection


def is_finite_number(value) -> bool:
    """A finite real number: int, float or numpy scalar, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_positive_number(value) -> bool:
    """A finite real number > 0 (see is_finite_number)."""
    return is_finite_number(value) and value > 0


def require_int(name: str, value, minimum: int = 1) -> int:
    """`value` as an int; a ValueError naming `name` unless it is a whole number >= minimum
    (int, numpy integer or integral float)."""
    whole = isinstance(value, numbers.Integral) or (is_finite_number(value) and float(value).is_integer())
    if isinstance(value, bool) or not whole or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def require_number(name: str, value, *, minimum: float | None = None, positive: bool = False) -> float:
    """`value` as a float; a ValueError naming `name` unless it is a finite number, > 0 when
    `positive`, >= `minimum` when given."""
    if positive:
        ok, bound = is_positive_number(value), " > 0"
    elif minimum is not None:
        ok, bound = is_finite_number(value) and value >= minimum, f" >= {minimum}"
    else:
        ok, bound = is_finite_number(value), ""
    if not ok:
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


def require_choice(name: str, value, options: Collection[str]) -> str:
    """`value` if it is one of the strings `options`, else a ValueError listing them."""
    if isinstance(value, str) and value in options:
        return value
    raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
