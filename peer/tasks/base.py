"""Core types shared by every task: an `Example`, the `Task` interface, the reward signature."""

from __future__ import annotations

import abc
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

RewardFn = Callable[[str, str, str], float]
"""A reward function: ``(prompt, completion, reference) -> float`` in [0, 1]."""

HELD_OUT_BUCKETS = 50  # a large prompt space holds out the prompts whose hash falls in 1 of 50 buckets (2 %)
HELD_OUT_MAX = 200  # held-out prompts an evaluation scores at most
ENUMERATE_MAX = (
    256  # a prompt space this small is evaluated whole (the exact expected reward), nothing held out
)
_DRAWS_PER_SAMPLE = 1000  # rejection draws before a task whose prompts are all held out is called broken


def in_held_out_split(prompt: str) -> bool:
    """Whether ``prompt`` belongs to the held-out split of a large prompt space: a fixed hash of its text,
    the same on every peer, so no sampler trains on a prompt the learner evaluates on."""
    return hashlib.sha256(prompt.encode("utf-8")).digest()[0] % HELD_OUT_BUCKETS == 0


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
        self.scorer: RewardFn | None = None  # where `reward` runs reward_fn: a worker process (.sandbox)

    @abc.abstractmethod
    def draw(self, rng: random.Random) -> Example:
        """Draw one example from the whole prompt space; all randomness comes from `rng`."""

    def all_examples(self) -> list[Example] | None:
        """Every example, where the prompt space is small enough to list (<= ENUMERATE_MAX); else None."""
        return None

    def is_held_out(self, prompt: str) -> bool:
        """Whether ``prompt`` is kept out of training for evaluation (never in a small, listed prompt
        space, which is evaluated whole)."""
        return self.all_examples() is None and in_held_out_split(prompt)

    def sample(self, rng: random.Random) -> Example:
        """A training example: drawn until it is not held out; a seed fixes the stream."""
        listed = self.all_examples() is not None
        for _ in range(_DRAWS_PER_SAMPLE):
            ex = self.draw(rng)
            if listed or not in_held_out_split(ex.prompt):
                return ex
        raise ValueError(f"{self.name}: every prompt drawn is held out for evaluation; the task is too small")

    def held_out(self) -> list[Example]:
        """The evaluation prompts, fixed for the task's parameters: the whole prompt space where it is listed
        (so the score is the exact expected reward), else up to HELD_OUT_MAX prompts of the held-out split,
        drawn with a fixed seed (the same list on every peer). Empty where none could be found."""
        listed = self.all_examples()
        if listed is not None:
            return listed
        rng, found = random.Random(0x48454C44), {}
        for _ in range(HELD_OUT_MAX * HELD_OUT_BUCKETS * 4):
            ex = self.draw(rng)
            if in_held_out_split(ex.prompt):
                found.setdefault(ex.prompt, ex)
                if len(found) >= HELD_OUT_MAX:
                    break
        return list(found.values())

    def rewarded_completions(self, example: Example, max_chars: int) -> list[str] | None:
        """Every completion of at most ``max_chars`` characters that earns reward 1 (all others earn 0), where
        the task can list them, so an evaluation takes the exact probability of reward instead of sampling;
        None where it cannot (a reward of the user's own, a free-form answer)."""
        return None

    def reward(self, prompt: str, completion: str, reference: str) -> float:
        """Score `completion` (in the sandbox's worker where :func:`~.sandbox.sandbox` gave the task one);
        raises ValueError if the reward function leaves [0, 1]."""
        value = float((self.scorer or self.reward_fn)(prompt, completion, reference))
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
