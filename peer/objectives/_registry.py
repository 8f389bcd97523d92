"""The objective registry: one decorator, one lookup, clear errors for unknown names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from heterorl.protocol.settings import OBJECTIVES

from ._batch import PolicyBatch
from ._params import CommonParams


@dataclass
class Terms:
    """What an objective hands back to the shared pipeline.

    token_loss: [B,T] per-token loss (sequence losses broadcast over response tokens), zero on padding.
    weights: detached importance weights the method applies, flattened over its units
        (valid tokens or sequences).
    clipped_low / clipped_high: [units] bool, units whose gradient the clip zeroes (or, for
        truncation methods, whose weight was capped) on the low / high side.
    extra: further detached diagnostics (0-d tensors), namespaced keys.
    """

    token_loss: Tensor
    weights: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    extra: dict[str, Tensor] = field(default_factory=dict)


ObjectiveFn = Callable[[PolicyBatch, CommonParams], Terms]


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    fn: ObjectiveFn
    params: type[CommonParams]
    default_aggregation: str
    default_advantage: str
    token_advantages: bool = False
    doc: str = ""


_OBJECTIVES: dict[str, ObjectiveSpec] = {}


def register(
    name: str,
    *,
    params: type[CommonParams],
    aggregation: str,
    token_advantages: bool = False,
) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Register an objective under ``name``; a duplicate name is an error. Its default advantage estimator
    comes from :data:`heterorl.protocol.settings.OBJECTIVES`, the torch-free list a run config is checked
    against, so a name exists there first."""

    def deco(fn: ObjectiveFn) -> ObjectiveFn:
        if name in _OBJECTIVES:
            raise ValueError(f"objective {name!r} registered twice")
        if name not in OBJECTIVES:
            raise ValueError(f"objective {name!r} is not in heterorl.protocol.settings.OBJECTIVES")
        advantage = OBJECTIVES[name]
        doc = (fn.__doc__ or "").strip().splitlines()
        _OBJECTIVES[name] = ObjectiveSpec(
            name, fn, params, aggregation, advantage, token_advantages, doc[0] if doc else ""
        )
        return fn

    return deco


def get(name: str) -> ObjectiveSpec:
    """Look up an objective; unknown names raise ``ValueError`` listing the valid ones."""
    spec = _OBJECTIVES.get(name)
    if spec is None:
        raise ValueError(f"unknown objective {name!r}; valid: {', '.join(sorted(_OBJECTIVES))}")
    return spec


def all_specs() -> dict[str, ObjectiveSpec]:
    return dict(_OBJECTIVES)
