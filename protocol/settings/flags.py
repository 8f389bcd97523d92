"""Command-line flags made from settings. A flag names a setting's dotted path (``--lr`` sets
``objective.lr``): its help and the default it shows are the setting's, and it stays unset
(:data:`.tree.UNSET`) unless given. ``--set PATH=VALUE`` reaches every setting, future ones included.
:func:`overrides_of` turns a parsed command line into overrides for :func:`.tree.apply_overrides`, read with
the rest of the data by the one parser, :func:`.tree.from_dict`: a flag, ``--set`` and a run.toml key are
checked by the same code. Torch-free: the CLI builds its parser from here.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any

from .base import default_of, help_of
from .roles import ADAPTER_FLAG_HELP, parse_adapter_flag
from .tree import UNSET, field_at, parse_assignments

DEST = "setting:"  # a setting flag's argparse dest: this, then the setting's path
SET_DEST = "setting_assignments"  # where --set keeps its assignments, in the order given

# Flags named otherwise than ``--`` and the setting's own name (the names from before the settings tree).
FLAG_NAMES = {
    "model.path": "--model",
    "model.chat": "--chat",
    "task.name": "--task",
    "task.params": "--task-params",
    "objective.name": "--objective",
    "objective.lr": "--lr",
    "objective.params": "--objective-params",
    "objective.advantage": "--advantage",
}


def flag_name(path: str) -> str:
    """A setting's flag: :data:`FLAG_NAMES`'s, or ``--`` and its name (learner.group_size: --group-size)."""
    return FLAG_NAMES.get(path) or "--" + path.rsplit(".", 1)[-1].replace("_", "-")


def _json_table(text: str) -> Any:
    """A table setting's flag value, in JSON (``--task-params '{"digits": 2}'``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


_TYPES: dict[type, Any] = {int: int, float: float, str: str, dict: _json_table}


def add_flag(
    ap: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    path: str,
    flag: str | None = None,
    **kw: Any,
) -> argparse.Action:
    """``flag`` (default: :func:`flag_name`) for setting ``path`` of the tree class ``cls``, with the
    setting's help, default (shown, not set) and type; ``kw`` go to ``add_argument`` (choices, an action)."""
    holder, name = field_at(cls, path)
    if path.rsplit(".", 1)[-1] != name:
        raise TypeError(f"{path}: a flag sets a whole setting, not a key of a table")
    flag = flag or flag_name(path)
    default = default_of(holder, name)
    text = help_of(holder, name)
    if default is not None and default is not False and default not in ("", {}, ()):
        shown = json.dumps(default) if isinstance(default, (dict, tuple)) else default
        text += f" (default: {shown})"
    spec: dict[str, Any] = {"dest": DEST + path, "default": UNSET, "help": text.replace("%", "%%")}
    if "action" not in kw:
        annotation = typing.get_type_hints(holder)[name]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        kind = typing.get_origin(annotation) or annotation
        if kind is bool:
            spec["action"] = argparse.BooleanOptionalAction
        elif kind in _TYPES:
            spec["type"] = _TYPES[kind]
            if "choices" not in kw:
                spec["metavar"] = flag.lstrip("-").replace("-", "_").upper()
        else:
            raise TypeError(f"{path}: no flag for a {annotation} setting; --set sets it")
    spec.update(kw)
    action = ap.add_argument(flag, **spec)
    action.help = spec["help"]  # BooleanOptionalAction would add "(default: UNSET)"
    return action


def add_set_flag(ap: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> argparse.Action:
    """``--set PATH=VALUE``, repeatable: any setting of the tree class ``cls``, those without a flag of their
    own included; applied after the other flags, in the order given."""

    def assignment(text: str) -> dict[str, Any]:
        try:
            return parse_assignments([text], cls)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return ap.add_argument(
        "--set",
        dest=SET_DEST,
        action="append",
        default=[],
        type=assignment,
        metavar="SECTION.KEY=VALUE",
        help="set any setting as run.toml would, the value in TOML (--set learner.publish_every=2, "
        "--set 'task.params={digits=2}'); repeatable; wins over the other flags",
    )


def _adapter_section(text: str) -> dict[str, Any]:
    try:
        a = parse_adapter_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return {"rank": a.rank, "alpha": a.alpha, "target_modules": list(a.target_modules)}


def add_adapter_flag(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> argparse.Action:
    """``--adapter SPEC`` (``rank=8,alpha=16,targets=q_proj,v_proj``): the ``[adapter]`` section."""
    return ap.add_argument(
        "--adapter",
        dest=DEST + "adapter",
        default=UNSET,
        type=_adapter_section,
        metavar="SPEC",
        help=ADAPTER_FLAG_HELP,
    )


def overrides_of(args: argparse.Namespace) -> dict[str, Any]:
    """What a parsed command line sets: ``path -> value`` of the setting flags given, then of ``--set``."""
    out = {
        dest.removeprefix(DEST): value
        for dest, value in vars(args).items()
        if dest.startswith(DEST) and value is not UNSET
    }
    for assignment in getattr(args, SET_DEST, None) or []:
        for path, value in assignment.items():
            out.pop(path, None)  # set again: applied in its new place
            out[path] = value
    return out
