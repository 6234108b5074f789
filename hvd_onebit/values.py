"""Checks of option values, shared by every module that validates options: one meaning of "an
int" and of "a positive number" everywhere, and messages that name the option and the value
(or, for a wrong argument, what it is)."""
from __future__ import annotations

import math


def is_int(value) -> bool:
    """An int that is not a bool (``True`` is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def plain_number(value):
    """A numpy (or any ``numbers.Real``) scalar as Python's int or float, e.g. a run length
    computed with numpy; a bool or anything else as it is, for the checks to refuse."""
    import numbers

    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


def is_number(value) -> bool:
    """A finite int or float that is not a bool."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def described(value) -> str:
    """What ``value`` is, for an error about a wrong argument: its type, and a dict's first
    keys."""
    if isinstance(value, dict):
        return f"{type(value).__name__} with keys {sorted(map(str, value))[:6]}"
    return type(value).__name__


def check_positive_int(name: str, value, minimum: int = 1) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an int >= ``minimum`` (1: positive,
    0: non-negative)."""
    if not is_int(value) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        if minimum == 0:
            what = "a non-negative int"
        raise ValueError(f"{name} must be {what}, got {value!r}")


def check_positive_number(name: str, value, what: str = "a positive number") -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a finite number > 0."""
    if not is_number(value) or value <= 0:
        raise ValueError(f"{name} must be {what}, got {value!r}")
