"""TOML text of settings data (what :func:`.tree.to_dict` gives), for the value types settings hold: strings,
numbers, booleans, lists and tables of those. ``tomllib`` reads it back; nothing here parses."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def dumps(data: Mapping[str, Any]) -> str:
    """Top-level values first, then one ``[table]`` per table; tables within tables are written inline. A
    None is an absent setting: left out where it is a table's value, refused inside a list or inline table."""
    lines = [f"{_key(k)} = {_value(v, k)}" for k, v in data.items() if v is not None and not _table(v)]
    for name, table in data.items():
        if _table(table):
            lines += ["", f"[{_key(name)}]"]
            lines += [f"{_key(k)} = {_value(v, f'{name}.{k}')}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def _table(value: Any) -> bool:
    return isinstance(value, Mapping)


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise ValueError(f"{key!r}: a TOML key is a string")
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    out = (_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)
    return '"' + "".join(out) + '"'


def _value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v, f"{where}[{i}]") for i, v in enumerate(value)) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{_key(k)} = {_value(v, f'{where}.{k}')}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise ValueError(f"{where}: {value!r} has no TOML form here")
