"""A tiny declarative schema checker for decoded msgpack bodies: types, ranges, lengths, finiteness.

Each check takes (value, path) and returns the value or raises :class:`ProtocolError` naming the path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from heterorl.protocol.wire.errors import ProtocolError

Check = Callable[[Any, str], Any]


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    def check(v: Any, path: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ProtocolError(f"{path}: expected an integer, got {type(v).__name__}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ProtocolError(f"{path}: {v} outside [{lo}, {hi}]")
        return v

    return check


def number(lo: float | None = None, hi: float | None = None) -> Check:
    def check(v: Any, path: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ProtocolError(f"{path}: expected a number, got {type(v).__name__}")
        if not math.isfinite(v):
            raise ProtocolError(f"{path}: not finite")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ProtocolError(f"{path}: {v} outside [{lo}, {hi}]")
        return float(v)

    return check


def boolean() -> Check:
    def check(v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            raise ProtocolError(f"{path}: expected true or false, got {type(v).__name__}")
        return v

    return check


def text(max_len: int) -> Check:
    def check(v: Any, path: str) -> str:
        if not isinstance(v, str):
            raise ProtocolError(f"{path}: expected a string, got {type(v).__name__}")
        if len(v) > max_len:
            raise ProtocolError(f"{path}: longer than {max_len} characters")
        return v

    return check


def binary(min_len: int = 0, max_len: int = 1 << 20) -> Check:
    def check(v: Any, path: str) -> bytes:
        if not isinstance(v, bytes):
            raise ProtocolError(f"{path}: expected bytes, got {type(v).__name__}")
        if not min_len <= len(v) <= max_len:
            raise ProtocolError(f"{path}: length {len(v)} outside [{min_len}, {max_len}]")
        return v

    return check


def array(item: Check, max_len: int, min_len: int = 0) -> Check:
    def check(v: Any, path: str) -> list:
        if not isinstance(v, (list, tuple)):
            raise ProtocolError(f"{path}: expected a list, got {type(v).__name__}")
        if not min_len <= len(v) <= max_len:
            raise ProtocolError(f"{path}: {len(v)} items, allowed [{min_len}, {max_len}]")
        return [item(x, f"{path}[{i}]") for i, x in enumerate(v)]

    return check


def record(fields: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    """A map with exactly these string keys, plus any of the ``optional`` ones (added to the format later,
    so older peers' messages still decode)."""
    optional = optional or {}

    def check(v: Any, path: str) -> dict:
        if not isinstance(v, dict):
            raise ProtocolError(f"{path}: expected a map, got {type(v).__name__}")
        keys = set(v)
        if not set(fields) <= keys <= set(fields) | set(optional):
            missing = sorted(set(fields) - keys)
            extra = sorted(map(str, keys - set(fields) - set(optional)))
            raise ProtocolError(f"{path}: missing {missing or '-'}, unexpected {extra or '-'}")
        out = {k: c(v[k], f"{path}.{k}") for k, c in fields.items()}
        out.update({k: c(v[k], f"{path}.{k}") for k, c in optional.items() if k in v})
        return out

    return check
