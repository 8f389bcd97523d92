"""GEPO: Group Expectation Policy Optimization (HeteroRL, arXiv 2508.17850), with defensive sampling.

What is built, and from where (spec §2.10):

* Weight (paper eq. for w_GEPO; authors' code ``_compute_loss``): w_b = p̃_b / Ê_q[q̃], where
  p̃_b = exp(mean_t log p), q̃_b = exp(mean_t log q) are length-normalised (per-token geometric-mean)
  probabilities and Ê_q[q̃] = Σ_i q̃_i² / Σ_i q̃_i over the prompt's group. Computed in log space,
  log Ê = LSE(2ℓq) − LSE(ℓq), so nothing underflows for any log-prob. Gradient flows through the
  numerator only. Sequence-level PPO clip, mean over sequences, mean-only advantages (the authors'
  ``scale_rewards=False``).
* The clip is on the lower side only by default, ε_low = 0.2 and no upper bound (the authors' runs use
  TRL's symmetric 0.2; ``gepo_plus`` keeps it). On stale rows the upper clip zeroes the gradient of every
  rewarded answer the current policy already likes 1.2× more than the stale sampler did, so a learner fed
  old rollouts stops learning from them; the defensive mixture already bounds the weight by 1/λ there. On
  the staleness grid to 1 024 versions (docs/benchmarks.md) the open upper side learns from stale rollouts
  as fast as from fresh ones and ends as high; dropping the lower clip too collapses (``clip=None``).
* Group scope: ``"prompt"`` (the paper's definition, per ``group_ids``) or ``"microbatch"`` (the whole
  batch is one group: what the authors' code effectively computes after shuffling rows, §2.10.2 item 6).
* Defensive sampling: the README's "Appendix F" could not be found in any public revision, so this is
  the classical defensive mixture (Hesterberg 1995) applied to GEPO's denominator, as the spec
  recommends (§2.10.5): w_b = p̃_b / (λ_b·sg(p̃_b) + (1−λ_b)·Ê), bounded by 1/λ_b in value. λ_b is
  either fixed, or scheduled by the row's staleness Δ_b: λ_b = λ·Δ_b/(Δ_b + Δ_half), so fresh data is
  plain GEPO and very stale data gets the tightest bound. On by default whenever a staleness > 0 is given.
* ``gepo_plus``: the authors' opt-in per-sequence KL switch (``gepo+`` in their code): sequences whose
  learner–sampler KL mean_t(e^{lq−lp} − (lq−lp) − 1) is below τ use their own q̃_b (GSPO's denominator),
  the others the group expectation.
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
from ._surrogates import broadcast_seq, ppo_clip

GROUP_SCOPES = ("prompt", "microbatch")
DEFENSIVE_SCHEDULES = ("staleness", "fixed")
GEPO_PLUS_KL_THRESHOLD = 0.002  # authors' ``kl_temp`` default


@dataclass(frozen=True, eq=False)
class GEPOParams(CommonParams):
    """GEPO parameters.

    clip: (ε_low, ε_high) = (0.2, None): the lower side only (the module docstring says why).
    group_scope: ``"prompt"`` (denominator per group_ids group) or ``"microbatch"`` (whole batch).
    defensive_sampling: ``None`` = on iff ``staleness`` is given and some row is stale; or a bool.
    defensive_lambda: mixture weight λ (fixed) or its limit for infinitely stale data (schedule).
    defensive_schedule: ``"staleness"`` (λ·Δ/(Δ+Δ_half)) or ``"fixed"`` (λ for every row).
    defensive_half_staleness: Δ_half, the staleness at which the schedule reaches λ/2.
    """

    clip: ClipArg = (0.2, None)
    group_scope: str = "prompt"
    defensive_sampling: bool | None = None
    defensive_lambda: float = 0.5
    defensive_schedule: str = "staleness"
    defensive_half_staleness: float = 8.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_scope not in GROUP_SCOPES:
            raise ValueError(f"group_scope must be one of {GROUP_SCOPES}, got {self.group_scope!r}")
        if self.defensive_schedule not in DEFENSIVE_SCHEDULES:
            raise ValueError(
                f"defensive_schedule must be one of {DEFENSIVE_SCHEDULES}, got {self.defensive_schedule!r}"
            )
        if not 0.0 <= self.defensive_lambda <= 1.0:
            raise ValueError(f"defensive_lambda must lie in [0, 1], got {self.defensive_lambda}")
        if not self.defensive_half_staleness > 0:
            raise ValueError(f"defensive_half_staleness must be > 0, got {self.defensive_half_staleness}")
        if self.defensive_sampling and self.defensive_schedule == "staleness" and self.staleness is None:
            raise ValueError("defensive_schedule='staleness' needs the staleness tensor (or use 'fixed')")


@dataclass(frozen=True, eq=False)
class GEPOPlusParams(GEPOParams):
    """``kl_threshold`` τ: sequences with learner–sampler KL below τ use their own q̃. The clip is the
    authors' symmetric 0.2 (TRL's default), as in their code."""

    clip: ClipArg = 0.2
    kl_threshold: float = GEPO_PLUS_KL_THRESHOLD


def group_log_expectation(logq_seq: Tensor, group_ids: Tensor) -> Tensor:
    """log Ê_q[q̃] = LSE_g(2ℓq) − LSE_g(ℓq) per row's group; ``logq_seq`` = ℓq [B] -> [B]."""
    index, n = group_index(group_ids)
    log_e = segment_logsumexp(2.0 * logq_seq, index, n) - segment_logsumexp(logq_seq, index, n)
    return log_e[index]


def defensive_lambdas(p: GEPOParams, staleness: Tensor | None, like: Tensor) -> Tensor | None:
    """Per-row mixture weights λ_b, or ``None`` when defensive sampling is off for this batch."""
    on = p.defensive_sampling
    if on is None:
        on = staleness is not None and bool((staleness > 0).any())
    if not on:
        return None
    if p.defensive_schedule == "fixed":
        return torch.full_like(like, p.defensive_lambda)
    delta = staleness.to(like.dtype).clamp_min(0.0)
    return p.defensive_lambda * delta / (delta + p.defensive_half_staleness)


def _gepo(batch: PolicyBatch, p: GEPOParams, kl_threshold: float | None) -> Terms:
    if batch.advantages.dim() != 1:
        raise ValueError("gepo takes one advantage per sequence ([B])")
    lp_seq = batch.seq_mean(batch.logp)  # log p̃, differentiable
    lq_seq = batch.seq_mean(batch.logq)  # log q̃, constant
    groups = batch.group_ids if p.group_scope == "prompt" else torch.zeros_like(batch.group_ids)
    log_denom = group_log_expectation(lq_seq, groups)
    extra: dict[str, Tensor] = {"gepo/log_expectation": log_denom.mean()}

    if kl_threshold is not None:  # gepo+: per-sequence switch to the sample's own q̃
        d = batch.logratio.detach()
        kl = batch.seq_mean(torch.expm1(-d) + d)
        own = kl < kl_threshold
        log_denom = torch.where(own, lq_seq, log_denom)
        extra["gepo_plus/own_frac"] = own.float().mean()

    lam = defensive_lambdas(p, batch.staleness, lp_seq)
    if lam is not None:  # log(λ·sg(p̃) + (1−λ)·D), exact at λ ∈ {0, 1}
        sg_lp = lp_seq.detach()
        mix_p = torch.where(
            lam > 0, torch.log(lam.clamp_min(1e-38)) + sg_lp, torch.full_like(sg_lp, -math.inf)
        )
        mix_d = torch.where(
            lam < 1, torch.log1p(-lam.clamp_max(1 - 1e-16)) + log_denom, torch.full_like(sg_lp, -math.inf)
        )
        log_denom = torch.logaddexp(mix_p, mix_d)
        extra["defensive/lambda"] = lam.mean()

    log_w = torch.clamp(lp_seq - log_denom.detach(), -p.logratio_clamp, p.logratio_clamp)
    w = torch.exp(log_w)
    lo, hi = p.bounds
    obj, zlow, zhigh = ppo_clip(w, batch.advantages, lo, hi)
    return Terms(broadcast_seq(-obj, batch.mask), w.detach(), zlow, zhigh, extra)


@register("gepo", params=GEPOParams, aggregation="seq_mean_token_mean")
def gepo(batch: PolicyBatch, p: GEPOParams) -> Terms:
    """GEPO (arXiv 2508.17850): w = p̃/Ê_q[q̃] per prompt group, sequence clip, defensive sampling."""
    return _gepo(batch, p, None)


@register("gepo_plus", params=GEPOPlusParams, aggregation="seq_mean_token_mean")
def gepo_plus(batch: PolicyBatch, p: GEPOPlusParams) -> Terms:
    """GEPO+ (authors' code): per-sequence KL switch between q̃_b and the group expectation."""
    return _gepo(batch, p, p.kl_threshold)
