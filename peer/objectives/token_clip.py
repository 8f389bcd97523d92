"""Token-level PPO-clip objectives: GRPO, DAPO, Dr. GRPO.

One surrogate, three defaults (GRPO is DAPO with a symmetric clip):
token ratio ρ = exp(log p − log q), objective min(ρA, clip(ρ, 1−ε_lo, 1+ε_hi)A), then the
method's aggregation. No reference-model KL term: β = 0, as in DAPO, Dr. GRPO and HeteroRL runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._batch import PolicyBatch
from ._params import ClipArg, TokenClipParams
from ._registry import Terms, register
from ._surrogates import flat_valid, ppo_clip


def _token_ppo(batch: PolicyBatch, p: TokenClipParams) -> Terms:
    ratio = torch.exp(batch.logratio)
    lo, hi = p.bounds
    obj, zlow, zhigh = ppo_clip(ratio, batch.token_advantages, lo, hi, p.dual_clip)
    valid = batch.mask
    return Terms(
        token_loss=-obj * valid,
        weights=flat_valid(ratio.detach(), valid),
        clipped_low=flat_valid(zlow, valid),
        clipped_high=flat_valid(zhigh, valid),
    )


@dataclass(frozen=True, eq=False)
class GRPOParams(TokenClipParams):
    clip: ClipArg = 0.2


@dataclass(frozen=True, eq=False)
class DAPOParams(TokenClipParams):
    clip: ClipArg = (0.2, 0.28)


@dataclass(frozen=True, eq=False)
class DrGRPOParams(TokenClipParams):
    clip: ClipArg = 0.2


@register("grpo", params=GRPOParams, aggregation="seq_mean_token_mean", token_advantages=True)
def grpo(batch: PolicyBatch, p: TokenClipParams) -> Terms:
    """GRPO (DeepSeekMath, arXiv 2402.03300 eq. 3): token PPO clip ε=0.2, per-sequence token mean."""
    return _token_ppo(batch, p)


@register("dapo", params=DAPOParams, aggregation="token_mean", token_advantages=True)
def dapo(batch: PolicyBatch, p: TokenClipParams) -> Terms:
    """DAPO (arXiv 2503.14476 eq. 8): clip-higher (0.2, 0.28), token mean over the batch."""
    return _token_ppo(batch, p)


@register("dr_grpo", params=DrGRPOParams, aggregation="constant", token_advantages=True)
def dr_grpo(batch: PolicyBatch, p: TokenClipParams) -> Terms:
    """Dr. GRPO (arXiv 2503.20783 §3.2): token PPO clip, constant normaliser B·M, mean-only advantage."""
    return _token_ppo(batch, p)
