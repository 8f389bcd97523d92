"""Per-group reductions over rows labelled by ``group_ids`` (any integer labels).

Pure tensor helpers shared by advantage estimators and GEPO's group denominator.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group labels [B] to dense indices 0..n-1; returns (index [B], n)."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def segment_sum(x: Tensor, index: Tensor, n: int) -> Tensor:
    """Sum of ``x`` [B] per group -> [n]."""
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, index, x)


def segment_mean(x: Tensor, index: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Mean of ``x`` [B] per group and the group sizes, both [n]."""
    counts = segment_sum(torch.ones_like(x), index, n)
    return segment_sum(x, index, n) / counts, counts


def segment_logsumexp(x: Tensor, index: Tensor, n: int) -> Tensor:
    """log Σ exp(x) per group -> [n], stable for any finite or -inf inputs."""
    neg_inf = torch.full((n,), float("-inf"), dtype=x.dtype, device=x.device)
    peak = neg_inf.scatter_reduce(0, index, x, reduce="amax", include_self=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = segment_sum(torch.exp(x - peak[index]), index, n)
    return torch.log(total) + peak
