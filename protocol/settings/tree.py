"""One parser for every settings tree: TOML sections, a RunSpec's JSON and command-line overrides.

A settings tree is a frozen dataclass whose fields are settings (:func:`~.base.setting`) or sections
(another such dataclass, or ``Section | None`` for one that may be absent, e.g. ``[adapter]``).
:func:`from_dict` reads a tree from nested mappings (parsed TOML or JSON): it checks every value's type
against the field's annotation, names the setting in every error, refuses unknown keys (or, for data from a
newer peer, returns them as ignored), and lets each class check its own values in ``__post_init__``.
:func:`to_dict` writes a tree back as plain data. A command-line override is a dotted path and a value
(``learner.publish_every=2``), set into the data before it is parsed (:func:`apply_overrides`), so a flag and
a TOML key are parsed by the same code.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any


class Unset:
    """Marks an override whose flag was not given (argparse default): nothing is set."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset()


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_type(annotation: Any) -> tuple[type | None, bool]:
    """(the dataclass a field holds, whether it may be None), or (None, _) for a plain setting."""
    args = typing.get_args(annotation)
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args
    inner = [a for a in args if a is not type(None)] if optional else [annotation]
    if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
        return inner[0], optional
    return None, optional


def is_section(cls: type, name: str) -> bool:
    return _section_type(_hints(cls)[name])[0] is not None


def from_dict(
    cls: type, data: Mapping[str, Any], where: str = "", *, strict: bool = True
) -> tuple[Any, list[str]]:
    """A ``cls`` tree from ``data``; ValueError naming the setting that is wrong. Returns the tree and the
    dotted names of the keys ignored because ``cls`` does not know them (``strict``: refuse them instead)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"[{where or 'top'}] must be a table of settings, got {type(data).__name__}")
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(data) - set(fields))
    if unknown and strict:
        raise ValueError(
            f"{_at(where)}unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}"
        )
    ignored = [_join(where, k) for k in unknown]
    kwargs: dict[str, Any] = {}
    for name in fields:
        if name not in data:
            continue
        value, path = data[name], _join(where, name)
        section, optional = _section_type(_hints(cls)[name])
        if section is not None:
            if value is None and optional:
                kwargs[name] = None
                continue
            kwargs[name], more = from_dict(section, value, path, strict=strict)
            ignored += more
        else:
            kwargs[name] = _coerce(_hints(cls)[name], value, path)
    try:
        return cls(**kwargs), ignored
    except TypeError as e:
        raise ValueError(f"{_at(where)}{e}") from None


def to_dict(tree: Any) -> dict[str, Any]:
    """A tree as plain data (tuples as lists), what :func:`from_dict` reads back into an equal tree."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(tree):
        value = getattr(tree, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        elif isinstance(value, dict):
            out[f.name] = dict(value)
        else:
            out[f.name] = value
    return out


def paths(cls: type, where: str = "") -> list[str]:
    """Every setting's dotted path in a tree class (sections opened), in field order."""
    out = []
    for f in dataclasses.fields(cls):
        section, _ = _section_type(_hints(cls)[f.name])
        out += paths(section, _join(where, f.name)) if section is not None else [_join(where, f.name)]
    return out


def field_at(cls: type, path: str) -> tuple[type, str]:
    """The class that holds setting ``path`` and the setting's name there; ValueError for an unknown path.
    A path may go on into a table setting (``task.params.digits``): its holder and name are the table's."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        hints = _hints(cls)
        if part not in hints or part not in {f.name for f in dataclasses.fields(cls)}:
            break
        section = _section_type(hints[part])[0]
        if section is None:  # a setting: the path ends here, or goes on into a table's keys
            if i == len(parts) - 1 or typing.get_origin(hints[part]) is dict or hints[part] is dict:
                return cls, part
            break
        cls = section
    raise ValueError(f"unknown setting {path!r}")


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with each ``path -> value`` of ``overrides`` set (sections made where missing); values that
    are :data:`UNSET` are left out. Nothing is checked here: :func:`from_dict` parses the result."""
    out = _deep_copy(data)
    for path, value in overrides.items():
        if value is UNSET:
            continue
        *sections, name = path.split(".")
        node = out
        for s in sections:
            if not isinstance(node.get(s), dict):
                node[s] = {}
            node = node[s]
        node[name] = _deep_copy(value) if isinstance(value, Mapping) else value
    return out


def from_overrides(cls: type, overrides: Mapping[str, Any], data: Mapping[str, Any] | None = None) -> Any:
    """A ``cls`` tree from ``data`` (default: none, every default) with ``overrides`` applied, unknown keys
    refused: ``from_overrides(Run, {"objective.lr": 1e-3, "learner.group_size": 4})``."""
    return from_dict(cls, apply_overrides(data or {}, overrides), strict=True)[0]


def parse_assignment(text: str) -> tuple[str, Any]:
    """``path=value`` (``--set learner.publish_every=2``): the value is read as a TOML value (numbers,
    true/false, "strings", [lists], {tables}), or taken as a plain string if it is none."""
    path, sep, raw = text.partition("=")
    path = path.strip()
    if not sep or not path:
        raise ValueError(f"--set wants SECTION.KEY=VALUE, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def parse_assignments(texts: Iterable[str], cls: type) -> dict[str, Any]:
    """Several ``path=value`` overrides, each path checked to name a setting of ``cls``."""
    out = {}
    for text in texts:
        path, value = parse_assignment(text)
        field_at(cls, path)
        out[path] = value
    return out


# ---- values ----


def _coerce(annotation: Any, value: Any, path: str) -> Any:
    """``value`` as the annotation's type; ValueError naming ``path`` if it is not one."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _coerce(a, value, path)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits none of {annotation}")
    origin = typing.get_origin(annotation) or annotation
    if origin is bool:
        if isinstance(value, bool):
            return value
    elif origin is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif origin is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif origin is str:
        if isinstance(value, str):
            return value
    elif origin is bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            item = args[0] if args else Any
            return tuple(
                value if item is Any else (_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
            )
    elif origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
    elif annotation is Any:
        return value
    raise ValueError(f"{path} must be {_type_name(annotation)}, got {value!r}")


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation) or annotation
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             tuple: "a list", dict: "a table"}  # fmt: skip
    return names.get(origin, str(annotation))


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _at(where: str) -> str:
    return f"[{where}]: " if where else ""


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
