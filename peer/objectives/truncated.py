"""Truncated, stop-gradient importance-weight objectives: CISPO and TOPR (spec §1.5, third form).

Their gradient never vanishes, it is only down-weighted; their loss values contain log π,
so compare gradients or surrogates across methods, not losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._batch import PolicyBatch
from ._params import ClipArg, CommonParams
from ._registry import Terms, register
from ._surrogates import clamp_opt, flat_valid

CISPO_CLIP = (None, 0.28)  # no lower bound (MiniMax-M1 §3.1); ε_high 0.28 as in Trinity-RFT / DAPO
TOPR_TRUNCATION = 1.0  # [π/μ]_0^1 on negatives (TOPR eq. 7)


@dataclass(frozen=True, eq=False)
class CISPOParams(CommonParams):
    clip: ClipArg = CISPO_CLIP


@dataclass(frozen=True, eq=False)
class TOPRParams(CommonParams):
    """``clip`` is the truncation level of negative-advantage weights (``None`` = plain IS)."""

    clip: float | None = TOPR_TRUNCATION

    def __post_init__(self) -> None:
        if self.clip is not None and not (isinstance(self.clip, (int, float)) and self.clip > 0):
            raise ValueError(
                f"topr clip (truncation level) must be a positive float or None, got {self.clip!r}"
            )
        CommonParams.__post_init__(self)


@register("cispo", params=CISPOParams, aggregation="token_mean", token_advantages=True)
def cispo(batch: PolicyBatch, p: CommonParams) -> Terms:
    """CISPO (MiniMax-M1, arXiv 2506.13585 eq. 4): sg(clip(ρ, 1−ε_lo, 1+ε_hi))·A·log π, token mean."""
    ratio = torch.exp(batch.logratio.detach())
    lo, hi = p.bounds
    w = clamp_opt(ratio, None if lo is None else 1.0 - lo, None if hi is None else 1.0 + hi)
    valid = batch.mask
    loss = -(w * batch.token_advantages * batch.logp) * valid
    low = ratio < 1.0 - lo if lo is not None else torch.zeros_like(ratio, dtype=torch.bool)
    high = ratio > 1.0 + hi if hi is not None else torch.zeros_like(ratio, dtype=torch.bool)
    surrogate = (w * batch.token_advantages * valid).sum() / valid.sum().clamp_min(1.0)
    return Terms(
        loss,
        flat_valid(w, valid),
        flat_valid(low, valid),
        flat_valid(high, valid),
        extra={"cispo/surrogate": surrogate},
    )


@register("topr", params=TOPRParams, aggregation="seq_mean_token_sum")
def topr(batch: PolicyBatch, p: CommonParams) -> Terms:
    """TOPR (arXiv 2503.14286 eq. 7): w=1 for A≥0 (SFT-like), sg([π/μ]_0^c) for A<0; w·A·log π(τ).

    The sequence ratio is exp(min(S_b, log c)) with S_b = Σ_t (log p − log q): it can underflow
    to 0 (harmless) but never overflow.
    """
    adv = batch.advantages
    if adv.dim() != 1:
        raise ValueError("topr takes one advantage per sequence ([B])")
    total = (batch.logratio.detach() * batch.mask).sum(-1)
    cap = p.logratio_clamp if p.clip is None else math.log(p.clip)
    neg_w = torch.exp(torch.clamp(total, max=cap))
    negative = adv < 0
    w = torch.where(negative, neg_w, torch.ones_like(neg_w))
    truncated = negative & (total > cap)
    loss = -(w * adv)[:, None] * batch.logp * batch.mask
    return Terms(
        loss, w, torch.zeros_like(truncated), truncated, extra={"topr/neg_frac": negative.float().mean()}
    )
