"""Detached diagnostics every objective reports (spec §4.2 item 7)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._batch import PolicyBatch
from ._registry import Terms


@torch.no_grad()
def diagnostics(batch: PolicyBatch, terms: Terms, loss: Tensor) -> dict[str, float]:
    """Importance-weight moments and ESS, clip fraction, KL(q‖p) estimates, sizes.

    ``is/ess`` is the normalised effective sample size (Σw)² / (n·Σw²) ∈ (0, 1] of the weights
    the method applies over its units. ``kl/k3`` = mean(e^d − 1 − d), ``kl/k1`` = mean(−d), with
    d = log p − log q over response tokens: estimates of KL(q‖p) under the behaviour samples.
    """
    w = terms.weights.to(batch.logp.dtype)
    n = max(w.numel(), 1)
    valid = batch.mask > 0
    d = batch.logratio.detach()[valid]
    if w.numel() and bool((w > 0).any()):  # (Σw)²/Σw² in log space: tiny weights must not underflow
        log_w = torch.log(w)
        ess = torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)) / n
    else:
        ess = w.new_tensor(0.0)
    dt = batch.logp.dtype
    low = terms.clipped_low.to(dt)
    high = terms.clipped_high.to(dt)
    out: dict[str, Tensor] = {
        "loss": loss.detach(),
        "is/mean": w.mean() if w.numel() else w.new_tensor(0.0),
        "is/var": w.var(unbiased=False) if w.numel() else w.new_tensor(0.0),
        "is/max": w.max() if w.numel() else w.new_tensor(0.0),
        "is/min": w.min() if w.numel() else w.new_tensor(0.0),
        "is/ess": ess,
        "clip/frac": ((terms.clipped_low | terms.clipped_high).to(dt).sum() / n),
        "clip/frac_low": low.sum() / n,
        "clip/frac_high": high.sum() / n,
        "kl/k3": (torch.expm1(d) - d).mean() if d.numel() else d.new_tensor(0.0),
        "kl/k1": (-d).mean() if d.numel() else d.new_tensor(0.0),
        "adv/mean": batch.advantages.mean(),
        "adv/abs_mean": batch.advantages.abs().mean(),
        "len/mean": batch.mask.sum(-1).mean(),
    }
    if batch.staleness is not None:
        out["staleness/mean"] = batch.staleness.mean()
        out["staleness/max"] = batch.staleness.max()
    out.update(terms.extra)
    return {k: float(v) for k, v in out.items()}
