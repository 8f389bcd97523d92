"""Validated, masked, float-promoted view of the tensors an objective consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class PolicyBatch:
    """Inputs after validation (spec §1.2 numerics rules).

    logp: [B,T] current log-probs, zero on padding, carries grad.
    logq: [B,T] behaviour log-probs, zero on padding, detached.
    mask: [B,T] float 0/1.   lengths: [B] response lengths clamped to >= 1.
    logratio: [B,T] clamp(logp - logq, ±c), zero on padding (carries grad).
    advantages: [B] (or [B,T] for token-advantage objectives), detached.
    group_ids: [B] integer labels.   staleness: [B] float or None.
    """

    logp: Tensor
    logq: Tensor
    mask: Tensor
    lengths: Tensor
    logratio: Tensor
    advantages: Tensor
    group_ids: Tensor
    staleness: Tensor | None

    @property
    def token_advantages(self) -> Tensor:
        """Advantages broadcast to [B,T]."""
        a = self.advantages
        return a if a.dim() == 2 else a[:, None].expand_as(self.logp)

    def seq_mean(self, x: Tensor) -> Tensor:
        """Masked per-sequence mean of a [B,T] tensor -> [B]."""
        return (x * self.mask).sum(-1) / self.lengths


def build_batch(
    logp: Tensor,
    logq: Tensor,
    mask: Tensor,
    advantages: Tensor,
    group_ids: Tensor,
    *,
    logratio_clamp: float,
    staleness: Tensor | None = None,
    token_advantages_ok: bool = False,
) -> PolicyBatch:
    """Check shapes and finiteness, promote to >= float32, zero padding, clamp log-ratios."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B,T], got shape {tuple(logp.shape)}")
    shape = logp.shape
    for name, t in (("logq", logq), ("mask", mask)):
        if t.shape != shape:
            raise ValueError(f"{name} must have logp's shape {tuple(shape)}, got {tuple(t.shape)}")
    n = shape[0]
    if n == 0:
        raise ValueError("empty batch")
    allowed = [(n,), tuple(shape)] if token_advantages_ok else [(n,)]
    if tuple(advantages.shape) not in allowed:
        raise ValueError(
            f"advantages must have shape {' or '.join(map(str, allowed))}, got {tuple(advantages.shape)}"
        )
    if tuple(group_ids.shape) != (n,):
        raise ValueError(f"group_ids must have shape ({n},), got {tuple(group_ids.shape)}")
    if staleness is not None and tuple(staleness.shape) != (n,):
        raise ValueError(f"staleness must have shape ({n},), got {tuple(staleness.shape)}")

    dtype = torch.promote_types(logp.dtype, torch.float32)
    m = mask.to(dtype)
    valid = m > 0
    lq_raw = logq.detach().to(dtype)
    if not bool(torch.isfinite(lq_raw[valid]).all()):
        raise ValueError("logq has non-finite values on response tokens")
    adv = advantages.detach().to(dtype)
    if not bool(torch.isfinite(adv).all()):
        raise ValueError("advantages must be finite")
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    lp = torch.where(valid, logp.to(dtype), zero)
    lq = torch.where(valid, lq_raw, zero)
    logratio = torch.where(valid, (lp - lq).clamp(-logratio_clamp, logratio_clamp), zero)
    return PolicyBatch(
        logp=lp,
        logq=lq,
        mask=m,
        lengths=m.sum(-1).clamp_min(1.0),
        logratio=logratio,
        advantages=adv,
        group_ids=group_ids,
        staleness=None if staleness is None else staleness.detach().to(dtype),
    )
