"""The pieces every settings class is made of: documented fields, the names a run may use, value checks.

A setting is a dataclass field made with :func:`setting`: its default and its help text live in one place,
and everything else (run.toml, the RunSpec, command-line flags: :mod:`.flags`) reads them from there.
Torch-free: the CLI builds its parser from here without loading a model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

TINY_MODEL = "tiny"  # the offline tiny model, built where it is missing
CHAT_MODES = (
    "auto",
    "on",
    "off",
)  # prompts through the chat template: if the tokenizer has one | always | never

# Every objective a run may name, with the advantage estimator its paper uses (the default when a run names
# none). heterorl.peer.objectives registers the implementations and refuses a name missing here.
OBJECTIVES: dict[str, str] = {
    "gepo": "dr_grpo",
    "gepo_plus": "dr_grpo",
    "grpo": "grpo",
    "dapo": "grpo",
    "dr_grpo": "dr_grpo",
    "gspo": "grpo",
    "gspo_token": "grpo",
    "cispo": "grpo",
    "topr": "dr_grpo",
    "gmpo": "grpo",
    "m2po": "grpo",  # AReaL's M2PO doc: group (r − mean)/std; the authors' verl scripts: GRPO
    "vcpo": "grpo",  # the authors' scripts: adv_estimator=grpo (their baseline then re-centres it)
}
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "bnpo")  # advantage estimators (heterorl.peer.objectives.advantages)
CHECKPOINT_DTYPES = ("float32", "bfloat16")


REQUIRED = dataclasses.MISSING  # the default of a setting that has none: it must be given


def setting(default: Any, help: str, *, factory: Any = None) -> Any:
    """A documented dataclass field: ``x: int = setting(4, "what x does")``; ``factory`` makes a mutable
    default (a table, a section); a :data:`REQUIRED` one must be given (kw_only classes)."""
    meta = {"help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def field_of(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


def default_of(cls: type, name: str) -> Any:
    """The one default of a setting."""
    f = field_of(cls, name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    if f.default is dataclasses.MISSING:
        raise KeyError(f"{cls.__name__}.{name} has no default")
    return f.default


def help_of(cls: type, name: str) -> str:
    return field_of(cls, name).metadata.get("help", "")


def check_int(where: str, value: Any, low: int, high: int | None = None) -> None:
    """ValueError unless ``value`` is an integer (not a bool) in [low, high]."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{where} must be an integer {bound}, got {value!r}")


def check_number(where: str, value: Any, low: float, *, low_included: bool = False) -> None:
    """ValueError unless ``value`` is a number (not a bool) above ``low`` (or equal to it, if included)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value >= low if low_included else value > low):
        raise ValueError(f"{where} must be a number {'>=' if low_included else '>'} {low:g}, got {value!r}")


def check_update_fits(prompts_per_update: int, prompts_per_batch: int, buffer_batches: int) -> None:
    """ValueError unless a full buffer holds one update's prompt groups.

    The receiver says "busy" once ``buffer_batches`` batches wait, so with fewer than ``prompts_per_update``
    groups in them the learner would wait for an update that can never fill (found by ``heterorl simulate``).
    """
    if buffer_batches * prompts_per_batch < prompts_per_update:
        need = -(-prompts_per_update // prompts_per_batch)
        raise ValueError(
            f"learner.buffer_batches ({buffer_batches}) × sampler.prompts_per_batch ({prompts_per_batch}) = "
            f"{buffer_batches * prompts_per_batch} prompt groups, fewer than learner.prompts_per_update "
            f"({prompts_per_update}): the learner could never fill an update; set buffer_batches >= {need}"
        )
