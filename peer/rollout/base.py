"""What a rollout backend returns, and the interface every backend implements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    # one per prompt: draw each row's tokens reproducibly from its seed (protocol/wire/seeds.py); None: the
    # engine's own randomness
    seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Rollouts:
    """N completions: ids [N,T] (pad where mask is 0), mask [N,T] (incl. EOS), behaviour log-probs
    [N,T] = log softmax(logits/temperature) of the sampled token, lengths [N]."""

    prompt_ids: list[list[int]]
    completion_ids: Tensor
    completion_mask: Tensor
    logprobs: Tensor
    lengths: Tensor
    texts: list[str]


class RolloutBackend(Protocol):
    """Generates completions of already-encoded prompts (``PromptFormat.encode``) with the weights it holds.

    ``name`` ("hf", "vllm") and ``dtype`` ("float32", "bfloat16") travel with each batch, so the learner knows
    which engine made the behaviour log-probs. ``load_weights`` takes a full state dict in the model's own
    (Hugging Face) names between batches; a state dict that does not fit the model raises ValueError and
    leaves the held weights as they were.
    """

    name: str
    dtype: str

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollouts: ...

    def load_weights(self, state: Mapping[str, Tensor]) -> None: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...
