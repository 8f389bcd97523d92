"""Surrogate building blocks shared by several objectives (spec §1.5)."""

from __future__ import annotations

import torch
from torch import Tensor


def clamp_opt(x: Tensor, lo: float | None, hi: float | None) -> Tensor:
    """``torch.clamp`` that accepts both bounds ``None`` (no clamp)."""
    return x if lo is None and hi is None else torch.clamp(x, min=lo, max=hi)


def ppo_clip(
    weight: Tensor, adv: Tensor, eps_low: float | None, eps_high: float | None, dual_clip: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Pessimistic PPO objective min(w·A, clip(w, 1-ε_lo, 1+ε_hi)·A), elementwise.

    Returns (objective, zeroed_low, zeroed_high): the boolean masks mark units whose gradient
    the clip zeroes (A<0 and w<1-ε_lo; A>0 and w>1+ε_hi). With ``dual_clip`` c the A<0 branch
    is further bounded below by c·A (Ye et al. 2020), also zeroing the gradient there.
    """
    lo = None if eps_low is None else 1.0 - eps_low
    hi = None if eps_high is None else 1.0 + eps_high
    unclipped = weight * adv
    clipped = clamp_opt(weight, lo, hi) * adv
    obj = torch.minimum(unclipped, clipped)
    w = weight.detach()
    zeroed_low = (adv < 0) & (w < lo) if lo is not None else torch.zeros_like(w, dtype=torch.bool)
    zeroed_high = (adv > 0) & (w > hi) if hi is not None else torch.zeros_like(w, dtype=torch.bool)
    if dual_clip is not None:
        floor = dual_clip * adv
        dual = (adv < 0) & (obj.detach() < floor)
        obj = torch.where(dual, floor, obj)
        zeroed_high = zeroed_high | dual
    return obj, zeroed_low, zeroed_high


def broadcast_seq(seq_loss: Tensor, mask: Tensor) -> Tensor:
    """Place a per-sequence loss [B] on every response token -> [B,T]."""
    return seq_loss[:, None] * mask


def flat_valid(x: Tensor, mask: Tensor) -> Tensor:
    """Entries of a [B,T] tensor on response tokens, flattened."""
    return x[mask > 0]
