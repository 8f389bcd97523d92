"""`get_task`: build a task from a spec string such as ``"countdown"`` or ``"jsonl:/data/gsm8k.jsonl"``."""

from __future__ import annotations

import inspect
from typing import Any

from .arithmetic import ArithmeticTask
from .base import Task
from .countdown import CountdownTask
from .jsonl import JsonlTask
from .rewards import load_reward

_TASKS: dict[str, type[Task]] = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "jsonl": JsonlTask}
_SPECS = "arithmetic, countdown, jsonl:/path/to/file.jsonl"


def task_names() -> list[str]:
    """Names of the task kinds (``jsonl`` takes a path after a colon)."""
    return list(_TASKS)


def get_task(spec: str, **params: Any) -> Task:
    """Build a task; `reward` may be a built-in reward name, ``"module:function"``, or a callable.

    Raises ValueError for an unknown spec, an unknown parameter, or a bad parameter value.
    """
    if not isinstance(spec, str):
        raise ValueError(f"task spec must be a string, got {spec!r}; valid: {_SPECS}")
    name, sep, arg = spec.partition(":")
    if name not in _TASKS:
        raise ValueError(f"unknown task {spec!r}; valid: {_SPECS}")
    cls = _TASKS[name]
    args: tuple[Any, ...] = ()
    if cls is JsonlTask:
        if not arg:
            raise ValueError(f"task {name!r} needs a path: 'jsonl:/path/to/file.jsonl'")
        args = (arg,)
    elif sep:
        raise ValueError(f"task {name!r} takes no ':' argument, got {spec!r}")
    accepted = [p for p in inspect.signature(cls).parameters if p != "path"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"{name}: unknown parameter(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}"
        )
    if isinstance(params.get("reward"), str):
        params["reward"] = load_reward(params["reward"])
    return cls(*args, **params)
