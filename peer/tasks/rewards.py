"""Built-in reward functions by name, and `load_reward` for names or ``module:function`` paths."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from types import MappingProxyType

from .answers import gsm8k
from .arithmetic import arithmetic_answer, arithmetic_exact
from .base import RewardFn
from .countdown import countdown

REWARDS: Mapping[str, RewardFn] = MappingProxyType(
    {
        "arithmetic_answer": arithmetic_answer,
        "arithmetic_exact": arithmetic_exact,
        "countdown": countdown,
        "gsm8k": gsm8k,
    }
)


def reward_names() -> list[str]:
    """Names of the built-in rewards."""
    return sorted(REWARDS)


def load_reward(spec: str) -> RewardFn:
    """A built-in reward by name, or ``"package.module:function"`` (attribute may be dotted)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    if spec in REWARDS:
        return REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        builtins = ", ".join(reward_names())
        raise ValueError(f"unknown reward {spec!r}: use a built-in ({builtins}) or 'package.module:function'")
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
