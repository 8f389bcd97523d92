"""Validation helpers for task parameters: each raises ValueError with a readable message."""

from __future__ import annotations

from typing import Any


def check_int(task: str, name: str, value: Any, lo: int, hi: int) -> int:
    """Return `value` if it is an int (not bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{task}: {name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{task}: {name} must be in [{lo}, {hi}], got {value}")
    return value


def check_bool(task: str, name: str, value: Any) -> bool:
    """Return `value` if it is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{task}: {name} must be True or False, got {value!r}")
    return value


def check_str(task: str, name: str, value: Any, *, nonempty: bool = True) -> str:
    """Return `value` if it is a (non-empty, by default) str."""
    if not isinstance(value, str) or (nonempty and not value):
        raise ValueError(f"{task}: {name} must be a non-empty string, got {value!r}")
    return value
