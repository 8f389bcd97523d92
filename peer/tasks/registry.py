"""`get_task`: build a task from a spec string such as ``"countdown"``, ``"reasoning_gym"`` or
``"jsonl:/data/gsm8k.jsonl"``, or a ``"jsonl"`` task from a data set's bytes (what a peer builds from the data
set a RunSpec names by hash)."""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping
from typing import Any

from .arithmetic import ArithmeticTask
from .base import Task
from .countdown import CountdownTask
from .jsonl import JsonlTask
from .math_reward import math_verify_reward
from .math_reward import missing as math_verify_missing
from .reasoning_gym import ReasoningGymTask
from .rewards import REWARDS, load_reward

_TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "jsonl": JsonlTask,
    "reasoning_gym": ReasoningGymTask,
}
_SPECS = "arithmetic, countdown, jsonl:/path/to/file.jsonl, reasoning_gym"


def task_names() -> list[str]:
    """Names of the task kinds (``jsonl`` takes a path after a colon)."""
    return list(_TASKS)


def get_task(
    spec: str, *, allow_rewards: Collection[str] = (), data: bytes | None = None, **params: Any
) -> Task:
    """Build a task; `reward` may be a built-in reward name, a callable, or ``"module:function"`` when
    ``allow_rewards`` names it (:func:`~.rewards.load_reward`). ``data``: the records of a ``"jsonl"`` task
    (a ``"jsonl:PATH"`` task reads them from PATH).

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
        if bool(arg) == (data is not None):
            raise ValueError(
                f"task {name!r} reads a file ('jsonl:/path/to/file.jsonl') or a data set's bytes"
            )
        args = (arg or data,)
    elif sep or data is not None:
        raise ValueError(f"task {name!r} takes no ':' argument or data, got {spec!r}")
    accepted = [p for p in inspect.signature(cls).parameters if p != "source"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"{name}: unknown parameter(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}"
        )
    if isinstance(params.get("reward"), str):
        params["reward"] = load_reward(params["reward"], allow_rewards)
    if params.get("reward") is math_verify_reward and math_verify_missing():
        raise ValueError(math_verify_missing())
    return cls(*args, **params)


def check_jsonl(data: bytes, params: Mapping[str, Any]) -> int:
    """How many records data set ``data`` holds as a ``"jsonl"`` task with ``params`` (a custom reward left
    out: a host checks its data set, not its code; a built-in one kept, since it chooses what a record's
    reference is); ValueError naming the first bad record or parameter."""
    kept = {k: v for k, v in params.items() if k != "reward" or (isinstance(v, str) and v in REWARDS)}
    task = get_task("jsonl", data=data, **kept)
    return len(task.examples)  # type: ignore[attr-defined]
