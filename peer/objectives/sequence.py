"""Sequence-level ratio objectives: GSPO, GSPO-token, GMPO.

All work on length-normalised log-ratios d̄_b = Σ_t m·d / L_b, never on raw sequence
probabilities (which underflow, spec §1.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._batch import PolicyBatch
from ._params import ClipArg, CommonParams, TokenClipParams
from ._registry import Terms, register
from ._surrogates import broadcast_seq, clamp_opt, flat_valid, ppo_clip

GSPO_CLIP = (3e-4, 4e-4)  # GSPO paper §5.1: left/right clip ranges for the length-normalised ratio
GMPO_CLIP = 0.4  # GMPO paper: token log-ratio clip (e^-0.4, e^0.4)


@dataclass(frozen=True, eq=False)
class GSPOParams(CommonParams):
    clip: ClipArg = GSPO_CLIP


@dataclass(frozen=True, eq=False)
class GSPOTokenParams(TokenClipParams):
    clip: ClipArg = GSPO_CLIP


@dataclass(frozen=True, eq=False)
class GMPOParams(CommonParams):
    clip: ClipArg = GMPO_CLIP


def _require_seq_adv(batch: PolicyBatch, name: str) -> torch.Tensor:
    if batch.advantages.dim() != 1:
        raise ValueError(f"{name} takes one advantage per sequence ([B])")
    return batch.advantages


@register("gspo", params=GSPOParams, aggregation="seq_mean_token_mean")
def gspo(batch: PolicyBatch, p: CommonParams) -> Terms:
    """GSPO (arXiv 2507.18071 eq. 5-7): s_b = exp(d̄_b), sequence PPO clip (3e-4, 4e-4)."""
    adv = _require_seq_adv(batch, "gspo")
    s = torch.exp(batch.seq_mean(batch.logratio))
    lo, hi = p.bounds
    obj, zlow, zhigh = ppo_clip(s, adv, lo, hi)
    return Terms(broadcast_seq(-obj, batch.mask), s.detach(), zlow, zhigh)


@register(
    "gspo_token",
    params=GSPOTokenParams,
    aggregation="seq_mean_token_mean",
    token_advantages=True,
)
def gspo_token(batch: PolicyBatch, p: TokenClipParams) -> Terms:
    """GSPO-token (arXiv 2507.18071 eq. 13): s_t = sg(s_b)·exp(lp_t − sg(lp_t)), allows per-token A.

    Equal to GSPO in value and gradient when the advantage is constant over a sequence.
    """
    s_seq = torch.exp(batch.seq_mean(batch.logratio)).detach()
    s_tok = s_seq[:, None] * torch.exp(batch.logp - batch.logp.detach())
    lo, hi = p.bounds
    obj, zlow, zhigh = ppo_clip(s_tok, batch.token_advantages, lo, hi, p.dual_clip)
    valid = batch.mask
    return Terms(
        -obj * valid, flat_valid(s_tok.detach(), valid), flat_valid(zlow, valid), flat_valid(zhigh, valid)
    )


@register("gmpo", params=GMPOParams, aggregation="seq_mean_token_mean")
def gmpo(batch: PolicyBatch, p: CommonParams) -> Terms:
    """GMPO (arXiv 2507.20673 eq. 4): A_b·exp(mean_t sign(A)·min(sign(A)d, sign(A)clip(d,−ε,ε))).

    The clip lives in log space (default ±0.4), applied per token with PPO's pessimism, then
    geometric-averaged. Not HeteroRL's variant (which clamps to [1−ε, 1+ε] in log space, spec §2.7).
    """
    adv = _require_seq_adv(batch, "gmpo")
    lo, hi = p.bounds
    d = batch.logratio
    sign = torch.sign(adv)[:, None]
    d_clip = clamp_opt(d, None if lo is None else -lo, hi)
    c = sign * torch.minimum(sign * d, sign * d_clip)
    ratio = torch.exp(batch.seq_mean(c))
    obj = adv * ratio
    dd = d.detach()
    a_tok = batch.token_advantages
    zlow = (a_tok < 0) & (dd < -lo) if lo is not None else torch.zeros_like(dd, dtype=torch.bool)
    zhigh = (a_tok > 0) & (dd > hi) if hi is not None else torch.zeros_like(dd, dtype=torch.bool)
    valid = batch.mask
    return Terms(
        broadcast_seq(-obj, valid), ratio.detach(), flat_valid(zlow, valid), flat_valid(zhigh, valid)
    )
