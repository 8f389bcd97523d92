"""Built-in reward functions by name; `load_reward` for names and, where allowed, ``module:function`` paths.

A custom reward is code: importing its module runs it. Whoever names it must not be the one who allows it, so
`load_reward` imports one only if the caller's allow-list has it: a volunteer's peer allows what its own
``--allow-reward`` flags name (a run's RunSpec names rewards, but cannot allow them); tools that run the
user's own settings (``heterorl train --local``, the benches) allow what those settings name
(:func:`named_reward`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Collection, Mapping
from types import MappingProxyType

from .answers import gsm8k
from .arithmetic import arithmetic_answer, arithmetic_exact
from .base import RewardFn
from .countdown import countdown
from .math_reward import math_verify_reward

REWARDS: Mapping[str, RewardFn] = MappingProxyType(
    {
        "arithmetic_answer": arithmetic_answer,
        "arithmetic_exact": arithmetic_exact,
        "countdown": countdown,
        "gsm8k": gsm8k,
        "math_verify": math_verify_reward,  # needs the `tasks` extra; imports math-verify when it scores
    }
)


def reward_names() -> list[str]:
    """Names of the built-in rewards."""
    return sorted(REWARDS)


def is_custom_reward(spec: str) -> bool:
    """True for a ``"package.module:function"`` path (code to import), False for anything else."""
    module_name, sep, attr = spec.partition(":")
    return bool(sep and module_name and attr)


def named_reward(params: Mapping[str, object]) -> tuple[str, ...]:
    """The custom reward task parameters ``params`` name, as an allow-list for :func:`load_reward`: for
    callers whose parameters are the user's own (a local run, a bench), never a run's RunSpec."""
    reward = params.get("reward")
    return (reward,) if isinstance(reward, str) and is_custom_reward(reward) else ()


def load_reward(spec: str, allowed: Collection[str] = ()) -> RewardFn:
    """A built-in reward by name, or ``"package.module:function"`` (attribute may be dotted) if ``allowed``
    names it; ValueError otherwise, before anything is imported."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    if spec in REWARDS:
        return REWARDS[spec]
    builtins = ", ".join(reward_names())
    if not is_custom_reward(spec):
        raise ValueError(f"unknown reward {spec!r}: use a built-in ({builtins}) or 'package.module:function'")
    if spec not in allowed:
        raise ValueError(
            f"reward {spec!r} is code to import, not a built-in ({builtins}), and not among the rewards "
            "allowed here"
        )
    module_name, _, attr = spec.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: {attr!r} is not callable")
    try:
        inspect.signature(obj).bind("", "", "")
    except TypeError as e:
        raise ValueError(f"reward {spec!r}: must accept (prompt, completion, reference): {e}") from e
    except ValueError:  # no introspectable signature (some builtins): trust it
        pass
    return obj  # type: ignore[return-value]
