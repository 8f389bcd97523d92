"""Parameter dataclasses shared by the objectives, and their validation.

Every objective accepts the common parameters below; each variant subclasses
:class:`CommonParams` to change defaults or add its own. Unknown keys are an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor

ClipArg = float | tuple[float | None, float | None] | None

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant", "delta_l")
LOGRATIO_CLAMP = 20.0  # |log p - log q| window before exp (spec §1.2 rule 3)


@dataclass(frozen=True, eq=False)
class CommonParams:
    """Parameters every objective understands.

    clip: ``float`` = symmetric epsilon; ``(eps_low, eps_high)`` with ``None`` = unbounded side;
        ``None`` = no clipping. Its space (ratio, log-ratio, IS cap) is the objective's own.
    aggregation: one of ``AGGREGATIONS``; ``None`` = the objective's default.
    max_len: the constant M of ``constant`` (Dr. GRPO) and ``delta_l``: the generation budget,
        never the padded length of the batch.
    delta_l_alpha: ΔL normalisation exponent (1 = minimum variance, 0.75 suggested for math).
    logratio_clamp: log-ratios are clamped to ±this before any exp.
    staleness: [B] learner version minus behaviour version of each row, or ``None``.
    tis_cap: C of truncated importance sampling (Yao et al. 2025, :mod:`.tis`); ``None`` = TIS off.
    tis_logp: [B,T] the learner's detached recompute of the behaviour policy; required iff ``tis_cap``.
    tis_rows: [B] bool, rows whose ``tis_logp`` is valid (the learner holds their version);
        ``None`` = all rows. Other rows keep the engine's log q and weight 1.
    """

    clip: ClipArg = 0.2
    aggregation: str | None = None
    max_len: int | None = None
    delta_l_alpha: float = 1.0
    logratio_clamp: float = LOGRATIO_CLAMP
    staleness: Tensor | None = None
    tis_cap: float | None = None
    tis_logp: Tensor | None = None
    tis_rows: Tensor | None = None

    def __post_init__(self) -> None:
        clip_bounds(self.clip)  # validates
        if self.tis_cap is None:
            if self.tis_logp is not None or self.tis_rows is not None:
                raise ValueError("tis_logp / tis_rows given without tis_cap (None turns TIS off)")
        else:
            cap = self.tis_cap
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
                raise ValueError(f"tis_cap must be a number > 0, got {cap!r}")
            if self.tis_logp is None:
                raise ValueError("tis_cap needs tis_logp, the learner's recompute of the behaviour policy")
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
        if self.max_len is not None and int(self.max_len) < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")
        if self.delta_l_alpha < 0:
            raise ValueError(f"delta_l_alpha must be >= 0, got {self.delta_l_alpha}")
        if not self.logratio_clamp > 0:
            raise ValueError(f"logratio_clamp must be > 0, got {self.logratio_clamp}")

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        return clip_bounds(self.clip)


@dataclass(frozen=True, eq=False)
class TokenClipParams(CommonParams):
    """PPO-style token clip (GRPO family). ``dual_clip`` c > 1 bounds A<0 units at c·A."""

    dual_clip: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")


def clip_bounds(clip: ClipArg) -> tuple[float | None, float | None]:
    """Normalise a ``clip`` argument to ``(eps_low, eps_high)``; either may be ``None``."""
    if clip is None:
        return None, None
    if isinstance(clip, (int, float)):
        lo = hi = float(clip)
    elif isinstance(clip, (tuple, list)) and len(clip) == 2:
        lo = None if clip[0] is None else float(clip[0])
        hi = None if clip[1] is None else float(clip[1])
    else:
        raise ValueError(f"clip must be a float, a (low, high) pair or None, got {clip!r}")
    for side in (lo, hi):
        if side is not None and not side >= 0:
            raise ValueError(f"clip epsilons must be >= 0, got {clip!r}")
    return lo, hi


def build_params(cls: type[CommonParams], given: dict[str, Any], objective: str) -> CommonParams:
    """Instantiate ``cls`` from keyword arguments, rejecting unknown names with the valid list."""
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - valid)
    if unknown:
        raise ValueError(
            f"objective {objective!r} got unknown parameter(s) {', '.join(unknown)}; "
            f"valid: {', '.join(sorted(valid))}"
        )
    return cls(**given)
