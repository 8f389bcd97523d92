"""VCPO: Variance Controlled Policy Optimization ("Stable Asynchrony", Huang et al. 2026, arXiv 2602.17616).

Sources: the paper's abstract (ESS-scaled learning rate; closed-form minimum-variance off-policy baseline)
and the authors' code, github.com/mit-han-lab/vcpo: README.md (both formulas),
``recipe/fully_async_policy/staleness_utils.py`` (``compute_is_info``, ``compute_ess_info``,
``compute_opob_baseline``), ``verl/workers/actor/megatron_actor.py`` (``_optimizer_step_with_buffer``) and
``recipe/fully_async_policy/shell/vcpo/math/vcpo_k=10.sh`` (the defaults below). The paper's body and its
equation numbers could not be read here; every formula is the README's, checked against the code.

With S_b = Σ_t (log π − log μ) over row b's response tokens (π = the learner's policy, μ the sampler's):

* Sequence IS weight w_b = exp(S_b); the loss uses it truncated, w̄_b = sg(min(w_b, C)), C = ``is_cap`` = 8
  (verl's ``rollout_is="sequence"``, ``rollout_is_threshold=8.0``). No PPO clip (the scripts set
  ``clip_ratio_low=1.0``, ``clip_ratio_high=1e9``).
* Off-policy optimal baseline (README "OPOB"; ``compute_opob_baseline``, group scope, mean):
  b*_g = Σ_{i∈g} w_i² ‖∇_θ log π_θ(τ_i)‖² R_i / Σ_{i∈g} w_i² ‖∇_θ log π_θ(τ_i)‖², with the *untruncated* w_i
  (``use_clipped_is_ratios=False``). The baseline is a weighted mean, so applying it to advantages that are
  rewards shifted (and scaled) per group gives the same result: A'_i = A_i − Σ W A / Σ W equals (R_i − b*)/σ_g
  for GRPO advantages, the authors' ``norm_by_std=True``. ‖∇ log π(τ_i)‖² needs one backward pass per row,
  which a pure tensor objective cannot take: the caller passes it as ``grad_sq_norms`` [B]; without it every
  row's norm is taken as equal (W_i = w_i²), an approximation that is *not* the paper's baseline.
* Loss (seq_mean_token_mean, the scripts' ``loss_agg_mode``): −(1/B) Σ_b w̄_b A'_b (1/L_b) Σ_t π/sg(π).
* ESS-scaled step: ρ = (Σ_b w_b)² / (B Σ_b w_b²) over the batch (untruncated w, ``use_clipped=False``), then
  lr × sqrt(min(1, ρ/ρ₀)) (``scaling_rule="sqrt"``, ``base_ess_ratio`` ρ₀ = 1). The objective only reports
  the factor as ``step/lr_scale``; :meth:`heterorl.peer.learner.trainer.Trainer.step` applies it to one step.

Not confirmed: whether the authors' per-row gradient norm already includes the truncated IS weight (their
code comment says g_i = w_i ∇log π, which would count the weight twice in W_i); the README's formula is
implemented. Their GRPO std is the population std; HeteroRL's ``grpo`` estimator is its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._batch import PolicyBatch
from ._params import ClipArg, CommonParams
from ._registry import Terms, register
from ._segments import group_index, segment_logsumexp

VCPO_IS_CAP = 8.0  # rollout_is_threshold of the authors' scripts
ESS_RULES = ("sqrt", "linear")


@dataclass(frozen=True, eq=False)
class VCPOParams(CommonParams):
    """VCPO parameters.

    is_cap: C > 0, truncation of the sequence IS weight in the loss; ``None`` = untruncated.
    baseline: ``True`` = re-centre advantages on the off-policy optimal baseline per group.
    grad_sq_norms: [B] ‖∇_θ log π_θ(τ_b)‖² (detached, ≥ 0) or ``None`` (equal norms, an approximation).
    ess_scaling: report ``step/lr_scale`` < 1 from the ESS ratio (``False``: always 1).
    ess_rule: ``"sqrt"`` (the authors' AdamW rule) or ``"linear"``.   ess_base_ratio: ρ₀ ∈ (0, 1].
    clip: must stay ``None`` (the authors disable the PPO clip).
    """

    clip: ClipArg = None
    is_cap: float | None = VCPO_IS_CAP
    baseline: bool = True
    grad_sq_norms: Tensor | None = None
    ess_scaling: bool = True
    ess_rule: str = "sqrt"
    ess_base_ratio: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip is not None:
            raise ValueError("vcpo has no PPO clip: clip must be None (is_cap truncates the sequence weight)")
        cap = self.is_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"is_cap must be a number > 0 or None, got {cap!r}")
        if self.ess_rule not in ESS_RULES:
            raise ValueError(f"ess_rule must be one of {ESS_RULES}, got {self.ess_rule!r}")
        if not 0.0 < self.ess_base_ratio <= 1.0:
            raise ValueError(f"ess_base_ratio must lie in (0, 1], got {self.ess_base_ratio}")
        g = self.grad_sq_norms
        if g is not None:
            if not isinstance(g, Tensor) or g.dim() != 1:
                raise ValueError("grad_sq_norms must be a 1-d tensor [B]")
            if not bool(torch.isfinite(g).all()) or bool((g < 0).any()):
                raise ValueError("grad_sq_norms must be finite and >= 0")


def ess_ratio(log_w: Tensor) -> Tensor:
    """(Σw)² / (n·Σw²) of the weights exp(log_w) [n], in log space (no overflow for any log weight)."""
    n = log_w.numel()
    return torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0) - math.log(n))


def opob_baseline(adv: Tensor, log_w: Tensor, grad_sq_norms: Tensor | None, group_ids: Tensor) -> Tensor:
    """Per-row b*_g = Σ_g W·A / Σ_g W, W = w²·‖g‖² (log-space softmax per group) -> [B].

    A group whose every W is 0 (all gradient norms 0) gets baseline 0.
    """
    log_W = 2 * log_w
    if grad_sq_norms is not None:
        log_W = log_W + torch.log(grad_sq_norms.to(log_w.dtype))
    index, n = group_index(group_ids)
    lse = segment_logsumexp(log_W, index, n)[index]
    share = torch.where(torch.isfinite(lse), torch.exp(log_W - lse), torch.zeros_like(log_W))
    out = torch.zeros(n, dtype=adv.dtype, device=adv.device).index_add_(0, index, share * adv)
    return out[index]


@register("vcpo", params=VCPOParams, aggregation="seq_mean_token_mean")
def vcpo(batch: PolicyBatch, p: VCPOParams) -> Terms:
    """VCPO (arXiv 2602.17616, authors' code): truncated sequence IS, off-policy optimal baseline, ESS lr."""
    adv = batch.advantages
    if adv.dim() != 1:
        raise ValueError("vcpo takes one advantage per sequence ([B])")
    if p.grad_sq_norms is not None and tuple(p.grad_sq_norms.shape) != tuple(adv.shape):
        raise ValueError(
            f"grad_sq_norms must have shape {tuple(adv.shape)}, got {tuple(p.grad_sq_norms.shape)}"
        )
    S = (batch.logratio.detach() * batch.mask).sum(-1)  # log w_b
    log_cap = math.inf if p.is_cap is None else math.log(p.is_cap)
    w_bar = torch.exp(torch.clamp(S, max=log_cap))  # may underflow to 0, never overflows
    truncated = log_cap < S

    extra: dict[str, Tensor] = {}
    if p.baseline:
        gsq = None if p.grad_sq_norms is None else p.grad_sq_norms.detach().to(S.device)
        b = opob_baseline(adv, S, gsq, batch.group_ids)
        adv = adv - b
        extra["vcpo/baseline_abs_mean"] = b.abs().mean()
    rho = ess_ratio(S)
    scale = torch.clamp(rho / p.ess_base_ratio, max=1.0)
    if p.ess_rule == "sqrt":
        scale = torch.sqrt(scale)
    extra["vcpo/ess_ratio"] = rho
    extra["step/lr_scale"] = scale if p.ess_scaling else torch.ones_like(scale)

    tok_ratio = torch.exp(batch.logp - batch.logp.detach())  # value 1, gradient ∇ log π
    token_loss = -(w_bar * adv)[:, None] * tok_ratio * batch.mask
    return Terms(token_loss, w_bar, torch.zeros_like(truncated), truncated, extra)
