"""Argument checks shared by the engine, the DataModule and the module: errors name the value and what is allowed."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``, else raise a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value
