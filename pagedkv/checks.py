"""Generic argument checks: no silent conversions.

A wrong *type* is a `TypeError`, a wrong *value* a `ValueError`; both name the argument, show
the value and say what would work. Integers are Python ints or integer numpy / torch scalars
(`bool` is refused although Python counts it as an int: `max_tokens=True` is a mistake, not 1);
reals are ints or floats, and must be finite. A leaf: every layer (configs, attention layers,
the engine, the widgets) checks its arguments with these.
"""

from __future__ import annotations

import math
import numbers
import operator
import reprlib
from typing import SupportsIndex

import torch


def describe(value: object) -> str:
    """A value for an error message: its (shortened) repr and its type."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _range_text(low: float | None, high: float | None, low_open: bool = False) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"<= {high}"
    return f"in {'(' if low_open else '['}{low}, {high}]"


def check_int(name: str, value: object, low: int | None = None, high: int | None = None, hint: str = "") -> int:
    """`value` as a Python int in [low, high] (either bound may be None)."""
    is_bool = isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    try:
        if is_bool or not isinstance(value, SupportsIndex):
            raise TypeError
        number = operator.index(value)  # ints, numpy / torch integer scalars; never floats or strings
    except TypeError:
        raise TypeError(f"{name} must be an int{hint}, got {describe(value)}.") from None
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name} must be an int {_range_text(low, high)}{hint}, got {reprlib.repr(value)}.")
    return number


def check_optional_int(
    name: str, value: object, low: int | None = None, high: int | None = None, hint: str = ""
) -> int | None:
    """None, or `check_int`."""
    return None if value is None else check_int(name, value, low, high, hint)


def check_float(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    hint: str = "",
) -> float:
    """`value` (an int or a float, not a bool) as a finite float in the range; `low_open` excludes low."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number{hint}, got {describe(value)}.")
    number = float(value)
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and number > high
    if not math.isfinite(number) or below or above:
        raise ValueError(
            f"{name} must be a finite number {_range_text(low, high, low_open)}{hint}, got {reprlib.repr(value)}."
        )
    return number


def check_bool(name: str, value: object) -> bool:
    """Exactly True or False (1, "no" and None are mistakes, not flags)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {describe(value)}.")
    return value


def check_optional_bool(name: str, value: object, hint: str = "") -> bool | None:
    """None (`hint` says what it picks), True or False."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None{hint}, got {describe(value)}.")
    return value
