"""Core types shared by every task: an `Example`, the `Task` interface, the reward signature."""

from __future__ import annotations

import abc
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

RewardFn = Callable[[str, str, str], float]
"""A reward function: ``(prompt, completion, reference) -> float`` in [0, 1]."""


@dataclass(frozen=True)
class Example:
    """One task instance.

    prompt: text the policy is conditioned on.
    reference: what the reward compares a completion against.
    solution: one completion that earns reward 1.0 (for pre-training on the task format).
    """

    prompt: str
    reference: str
    solution: str


class Task(abc.ABC):
    """A verifiable-reward task: samples examples and scores completions."""

    name: ClassVar[str]

    def __init__(self, reward: RewardFn) -> None:
        if not callable(reward):
            raise ValueError(f"{self.name}: reward must be callable, got {reward!r}")
        self.reward_fn = reward

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """Draw one example; all randomness comes from `rng`, so a seed fixes the stream."""

    def reward(self, prompt: str, completion: str, reference: str) -> float:
        """Score `completion`; raises ValueError if the reward function leaves [0, 1]."""
        value = float(self.reward_fn(prompt, completion, reference))
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{self.name}: reward {value!r} is outside [0, 1]")
        return value

    @abc.abstractmethod
    def reference_for(self, prompt: str) -> str | None:
        """The reference answer for `prompt`, recomputed from the prompt text alone, or None if `prompt` is
        not one of this task's. A learner uses it to re-score a sampler's completions instead of trusting the
        sampler's reward."""

    @abc.abstractmethod
    def alphabet(self) -> str:
        """Sorted, de-duplicated characters that prompts and solutions can contain."""
