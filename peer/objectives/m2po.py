"""M2PO: Second-Moment Trust Policy Optimization (Zheng, Zhao, Chen 2025, arXiv 2510.01161).

The rule implemented here is the one of AReaL's M2PO (``areal/trainer/ppo/actor.py``,
``_apply_m2po_masking`` / ``_get_m2po_loss_mask``; docs/en/algorithms/m2po.md), which states the paper's
second moment M̂₂ = (1/N) Σ_i (log r_i)² and objective J = (1/Σ|o_i|) Σ_{i,t} M_{i,t} r_{i,t} A_{i,t}:

* d_t = log π_θ − log π_behaviour per response token (detached for the mask), M2_t = d_t².
* Over all the batch's valid tokens, sort M2 descending (stable: ties keep row-major order, so the mask is
  deterministic) and mask the shortest prefix whose removal leaves a suffix with mean M2 < τ (strict, as
  AReaL). Suffix means come from one reversed cumulative sum: O(N log N).
* Loss per kept token −r_t·A_t, r_t = exp(d_t) carrying the gradient: no ε clip. Masked tokens contribute
  0 and stay in the ``token_mean`` denominator (AReaL's doc formula and the authors' verl ``token-mean``;
  AReaL's code divides by the kept count instead: a difference of the masked fraction, ~0.1%).
* ``weight_cap`` C (off by default): AReaL's example (``examples/math/gsm8k_m2po.yaml``) sets
  ``behav_imp_weight_cap: 5.0`` (now ``rejection_sampling: {metric: ratio, upper: 5.0}``). In AReaL that is
  not a truncation: tokens whose detached weight exceeds C are rejected (weight set to 0, still counted in
  the denominator). Here the same: tokens with sg(r_t) > C contribute 0.

Differences kept on purpose, or not confirmed:

* When even the smallest M2 is ≥ τ, AReaL keeps the single smallest token; here every token is masked
  (the constraint holds, the step's gradient is 0).
* The authors' own code (github.com/Infini-AI-Lab/M2PO, ``verl/trainer/ppo/core_algos.py``,
  ``compute_m2po_policy_loss``) differs: only "harmful" tokens (A>0 & r>1, A<0 & r<1) enter M2; it finds the
  |d| level τ' at which *capping* those tokens brings their M2 to the budget, then applies a PPO clip with
  bounds e^{±τ'}, which zeroes the gradient of harmful tokens beyond it. The paper's own algorithm text
  could not be read here; this module follows AReaL's masking rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._batch import PolicyBatch
from ._params import ClipArg, CommonParams
from ._registry import Terms, register
from ._surrogates import flat_valid

M2_THRESHOLD = 0.04  # τ of AReaL's gsm8k_m2po.yaml and the authors' M2_budget in their training scripts


@dataclass(frozen=True, eq=False)
class M2POParams(CommonParams):
    """M2PO parameters.

    m2_threshold: τ > 0, the bound on the mean M2 of the kept tokens.
    weight_cap: C > 0 or ``None``: tokens whose detached ratio exceeds C are rejected (contribute 0).
    clip: must stay ``None`` (M2PO has no ε clip).
    """

    clip: ClipArg = None
    m2_threshold: float = M2_THRESHOLD
    weight_cap: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip is not None:
            raise ValueError("m2po has no ε clip: clip must be None (use m2_threshold / weight_cap)")
        tau = self.m2_threshold
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
            raise ValueError(f"m2_threshold must be a number > 0, got {tau!r}")
        cap = self.weight_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"weight_cap must be a number > 0 or None, got {cap!r}")


def m2_keep_mask(m2: Tensor, threshold: float) -> Tensor:
    """Bool [N]: which of the values ``m2`` (≥ 0) M2PO keeps.

    Sort descending (stable), then mask the shortest prefix such that the mean of what remains is below
    ``threshold``; if no non-empty suffix qualifies, mask everything. Empty input: empty mask.
    """
    n = m2.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=m2.device)
    order = torch.sort(m2, descending=True, stable=True).indices
    s = m2[order]
    suffix_sum = s.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, device=m2.device, dtype=m2.dtype)
    below = (suffix_sum / counts) < threshold
    k = int(torch.argmax(below.to(torch.uint8))) if bool(below.any()) else n  # tokens to mask
    keep_sorted = torch.arange(n, device=m2.device) >= k
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


@register("m2po", params=M2POParams, aggregation="token_mean", token_advantages=True)
def m2po(batch: PolicyBatch, p: M2POParams) -> Terms:
    """M2PO (arXiv 2510.01161; AReaL's rule): mask top-M2 tokens until mean d² < τ, then unclipped r·A."""
    valid = batch.mask > 0
    d = batch.logratio.detach()
    m2_valid = (d * d)[valid]
    keep_valid = m2_keep_mask(m2_valid, p.m2_threshold)
    keep = torch.zeros_like(valid)
    keep[valid] = keep_valid

    ratio = torch.exp(batch.logratio)
    w = ratio.detach()
    capped = valid & keep & (w > p.weight_cap) if p.weight_cap is not None else torch.zeros_like(valid)
    used = (keep & ~capped).to(ratio.dtype)
    token_loss = -(ratio * batch.token_advantages) * used * batch.mask

    masked = valid & ~keep
    n = max(int(valid.sum()), 1)
    n_kept = int(keep_valid.sum())
    zero = d.new_zeros(())
    extra = {
        "m2po/masked_frac": masked.to(d.dtype).sum() / n,
        "m2po/m2": m2_valid.mean() if m2_valid.numel() else zero,
        "m2po/m2_kept": m2_valid[keep_valid].sum() / n_kept if n_kept else zero,
    }
    if p.weight_cap is not None:
        extra["m2po/capped_frac"] = capped.to(d.dtype).sum() / n
    return Terms(
        token_loss=token_loss,
        weights=flat_valid(w, batch.mask),
        clipped_low=flat_valid(masked & (d < 0), batch.mask),
        clipped_high=flat_valid((masked & (d >= 0)) | capped, batch.mask),
        extra=extra,
    )
