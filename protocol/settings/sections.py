"""The run's own sections of run.toml: ``[model]``, ``[task]``, ``[objective]``, ``[sampling]``, ``[limits]``
(the roles' ``[learner]``, ``[sampler]`` and ``[adapter]`` are in :mod:`.roles`). Each field is documented
and checked when the object is made: a bad value is a ValueError naming the setting."""

from __future__ import annotations

import dataclasses

from .base import ADVANTAGES, CHAT_MODES, OBJECTIVES, TINY_MODEL, check_int, check_number, setting

TIS_PARAMS = ("tis_cap", "tis_logp", "tis_rows")  # the learner sets these (learner.tis_cap), never a run


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """``[model]``: the policy every peer loads, and how prompts reach it."""

    path: str = setting(
        TINY_MODEL,
        "'tiny' (the offline tiny model), a hub id org/name (from each peer's HF cache) or a directory on "
        "the host (peers pass --model-dir)",
    )
    chat: str = setting("auto", "prompts via the chat template: auto (if the tokenizer has one) | on | off")

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"model.path must be a model path or hub id, got {self.path!r}")
        if self.chat not in CHAT_MODES:
            raise ValueError(f"model.chat must be one of {', '.join(CHAT_MODES)}, got {self.chat!r}")


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """``[task]``: where prompts come from and how completions are rewarded."""

    name: str = setting(
        "arithmetic",
        "arithmetic | countdown | jsonl:PATH (peers fetch the file by hash) | reasoning_gym (params.dataset, "
        "or params.datasets: a mixture; needs the tasks extra)",
    )
    params: dict = setting(None, "task parameters (and reward)", factory=lambda: {"digits": 1})

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"task.name must be a task name, got {self.name!r}")
        if not isinstance(self.params, dict):
            raise ValueError(f"task.params must be a table, got {self.params!r}")


@dataclasses.dataclass(frozen=True)
class ObjectiveSettings:
    """``[objective]``: the loss the learner minimises, its advantage estimator and the optimiser's lr."""

    name: str = setting(
        "gepo", "gepo (defensive sampling on stale data) | " + " | ".join(list(OBJECTIVES)[1:])
    )
    lr: float = setting(5e-4, "learning rate (AdamW)")
    params: dict = setting(
        None,
        'objective parameters, e.g. {"clip": 0.3} (tis_* are the learner\'s: learner.tis_cap)',
        factory=dict,
    )
    advantage: str | None = setting(None, "grpo | dr_grpo | bnpo | rloo (default: the objective's)")

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(
                f"objective.name: unknown objective {self.name!r}; valid: {', '.join(sorted(OBJECTIVES))}"
            )
        if self.advantage is not None and self.advantage not in ADVANTAGES:
            raise ValueError(
                f"objective.advantage: unknown advantage {self.advantage!r}; valid: {', '.join(ADVANTAGES)}"
            )
        check_number("objective.lr", self.lr, 0)
        if not isinstance(self.params, dict):
            raise ValueError(f"objective.params must be a table, got {self.params!r}")
        learners = sorted(set(TIS_PARAMS) & set(self.params))
        if learners:
            raise ValueError(f"objective.params {', '.join(learners)} are the learner's: use learner.tis_cap")


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """``[sampling]``: how samplers generate completions (and how the learner re-scores them)."""

    temperature: float = setting(1.0, "sampling temperature")
    top_p: float = setting(1.0, "nucleus sampling mass")
    max_new_tokens: int = setting(6, "completion length cap (tokens)")

    def __post_init__(self) -> None:
        check_number("sampling.temperature", self.temperature, 0)
        check_number("sampling.top_p", self.top_p, 0)
        if self.top_p > 1:
            raise ValueError(f"sampling.top_p must be at most 1, got {self.top_p!r}")
        check_int("sampling.max_new_tokens", self.max_new_tokens, 1)


@dataclasses.dataclass(frozen=True)
class LimitsSettings:
    """``[limits]``: bounds every peer holds what it receives to."""

    max_batch_rows: int = setting(256, "most rows one TrajectoryBatch may carry")

    def __post_init__(self) -> None:
        check_int("limits.max_batch_rows", self.max_batch_rows, 1)
