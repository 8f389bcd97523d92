"""Truncated importance sampling (TIS) for the inference/training mismatch, and the mismatch's size.

The sampler's engine (vLLM, another precision, other kernels) and the learner give the same weights
different token probabilities, so even "on-policy" rows are off-policy for the learner. Yao et al. 2025,
"Your efficient RL framework secretly brings you off-policy RL training"
(https://fengyao.notion.site/off-policy-rl), correct the policy gradient with the per-token weight

    w_t = min(π_old_learner(y_t) / π_engine(y_t), C)        (detached)

and, in their PPO form, let the objective's own ratio be π_θ / π_old_learner. Here:

* :func:`tis_correction` — the behaviour log-probs the objective should use and the weights w_t, for
  the rows whose behaviour version the learner can recompute (``rows``); other rows are left alone.
  :func:`heterorl.peer.objectives.compute` applies it to every objective (``tis_cap``, ``tis_logp``,
  ``tis_rows`` in :class:`~._params.CommonParams`): the objective sees the replaced log q, and each
  token's loss is multiplied by w_t before aggregation. For sequence-level objectives (loss placed on
  every token) this scales a sequence's loss by the mean of its w_t under the per-sequence token mean.
* :func:`mismatch_stats` — |log π_learner − log q| per token: mean, 99th percentile, max.

Pure tensor functions; computing π_old_learner (a forward pass) is the learner's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MISMATCH_QUANTILE = 0.99  # the tail reported as mismatch/abs_p99
MISMATCH_KEYS = ("mismatch/abs_mean", "mismatch/abs_p99", "mismatch/abs_max", "mismatch/tokens")


@dataclass(frozen=True, eq=False)
class TISCorrection:
    """logq: [B,T] behaviour log-probs for the objective (learner recompute on TIS rows' tokens).
    weights: [B,T] detached w_t on TIS rows' response tokens, 1 elsewhere.
    stats: ``tis/mean``, ``tis/max``, ``tis/frac_capped``, ``tis/tokens`` over TIS rows' response tokens
        (all 0 when there are none).
    """

    logq: Tensor
    weights: Tensor
    stats: dict[str, Tensor]


def tis_correction(
    logq: Tensor, mask: Tensor, tis_logp: Tensor, tis_rows: Tensor | None, cap: float
) -> TISCorrection:
    """TIS for the rows ``tis_rows`` (bool [B], ``None`` = all) of a batch (Yao et al. 2025).

    logq: [B,T] engine (sampler) log-probs.   mask: [B,T] response tokens.
    tis_logp: [B,T] the learner's no-grad recompute of the behaviour policy; read on TIS rows only.
    cap: C > 0. Raises ``ValueError`` on shapes, dtypes, or non-finite ``tis_logp`` where it is read.
    """
    shape = tuple(logq.shape)
    if logq.dim() != 2:
        raise ValueError(f"logq must be [B,T], got shape {shape}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask must have logq's shape {shape}, got {tuple(mask.shape)}")
    if tuple(tis_logp.shape) != shape:
        raise ValueError(f"tis_logp must have logq's shape {shape}, got {tuple(tis_logp.shape)}")
    if not torch.is_floating_point(tis_logp):
        raise ValueError(f"tis_logp must be floating point, got {tis_logp.dtype}")
    if tis_rows is None:
        rows = torch.ones(shape[0], dtype=torch.bool, device=logq.device)
    else:
        if tuple(tis_rows.shape) != shape[:1] or tis_rows.dtype != torch.bool:
            raise ValueError(
                f"tis_rows must be a bool tensor of shape ({shape[0]},), "
                f"got {tis_rows.dtype} {tuple(tis_rows.shape)}"
            )
        rows = tis_rows.to(logq.device)
    if not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0):
        raise ValueError(f"tis_cap must be a number > 0, got {cap!r}")

    dtype = torch.promote_types(torch.promote_types(logq.dtype, tis_logp.dtype), torch.float32)
    lq = logq.detach().to(dtype)
    lp_old = tis_logp.detach().to(dtype=dtype, device=logq.device)
    on = rows[:, None] & (mask > 0)
    if not bool(torch.isfinite(lp_old[on]).all()):
        raise ValueError("tis_logp has non-finite values on the TIS rows' response tokens")
    raw = torch.exp(torch.where(on, lp_old - lq, torch.zeros_like(lq)))
    weights = torch.where(on, raw.clamp(max=float(cap)), torch.ones_like(raw))
    w_on = weights[on]
    n = w_on.numel()
    zero = lq.new_zeros(())
    stats = {
        "tis/mean": w_on.mean() if n else zero,
        "tis/max": w_on.max() if n else zero,
        "tis/frac_capped": (raw[on] > cap).to(dtype).mean() if n else zero,
        "tis/tokens": lq.new_tensor(float(n)),
    }
    return TISCorrection(logq=torch.where(on, lp_old, lq), weights=weights, stats=stats)


@torch.no_grad()
def mismatch_stats(
    logp_learner: Tensor, logq: Tensor, mask: Tensor, rows: Tensor | None = None
) -> dict[str, float]:
    """Per-token |log π_learner − log q| over the response tokens of ``rows`` (bool [B]; ``None`` = all).

    logp_learner: [B,T] the learner's log-probs under the version the rows were sampled with.
    logq: [B,T] the engine's log-probs.   mask: [B,T] response tokens.
    Keys ``mismatch/abs_mean``, ``mismatch/abs_p99`` (linear interpolation, as ``torch.quantile``),
    ``mismatch/abs_max``, ``mismatch/tokens``. No tokens: every key is present and 0 (a metrics row
    keeps its columns; read the others only where ``mismatch/tokens`` > 0).
    """
    if logp_learner.shape != logq.shape or mask.shape != logq.shape or logq.dim() != 2:
        raise ValueError(
            f"logp_learner, logq and mask must share one [B,T] shape, got {tuple(logp_learner.shape)}, "
            f"{tuple(logq.shape)}, {tuple(mask.shape)}"
        )
    sel = mask > 0
    if rows is not None:
        if tuple(rows.shape) != tuple(logq.shape[:1]):
            raise ValueError(f"rows must have shape ({logq.shape[0]},), got {tuple(rows.shape)}")
        sel = sel & rows.to(device=sel.device, dtype=torch.bool)[:, None]
    d = (logp_learner.double() - logq.to(logp_learner.device).double()).abs()[sel.to(logp_learner.device)]
    n = d.numel()
    if n == 0:
        return dict.fromkeys(MISMATCH_KEYS, 0.0)
    return {
        "mismatch/abs_mean": float(d.mean()),
        "mismatch/abs_p99": float(_quantile(d, MISMATCH_QUANTILE)),
        "mismatch/abs_max": float(d.max()),
        "mismatch/tokens": float(n),
    }


def _quantile(x: Tensor, q: float) -> Tensor:
    """``torch.quantile(x, q)`` (linear) by sorting: no size limit on ``x`` (1-D, non-empty)."""
    s = torch.sort(x).values
    pos = q * (s.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, s.numel() - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
