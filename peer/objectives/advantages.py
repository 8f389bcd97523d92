"""Advantage estimators: rewards [B] of groups -> constant advantages [B] (spec §1.3).

Rows with equal ``group_ids`` are responses to the same prompt. A group of one, or a group
whose rewards are all equal, gets advantage 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from heterorl.protocol.settings import ADVANTAGES

from ._segments import group_index, segment_mean, segment_sum

BNPO_MAX_WEIGHT = 1e6  # clamp of 1/f_Beta, as in the BNPO authors' code


@dataclass(frozen=True)
class GRPOAdvParams:
    """eps: added to the std; unbiased: sample (n−1) std as TRL, else population std."""

    eps: float = 1e-6
    unbiased: bool = True


@dataclass(frozen=True)
class NoParams:
    pass


@dataclass(frozen=True)
class BNPOParams:
    """r_min, r_max: the reward range, mapped affinely to [0, 1]."""

    r_min: float = 0.0
    r_max: float = 1.0
    max_weight: float = BNPO_MAX_WEIGHT

    def __post_init__(self) -> None:
        if not self.r_max > self.r_min:
            raise ValueError(f"bnpo needs r_max > r_min, got {self.r_min}, {self.r_max}")


_ESTIMATORS: dict[str, tuple[Callable[..., Tensor], type]] = {}


def _register(name: str, params: type) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    def deco(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} registered twice")
        if name not in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is not in heterorl.protocol.settings.ADVANTAGES")
        _ESTIMATORS[name] = (fn, params)
        return fn

    return deco


def _centered(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    index, n = group_index(group_ids)
    mean, counts = segment_mean(rewards, index, n)
    return rewards - mean[index], counts, index, n


@_register("grpo", GRPOAdvParams)
def grpo_advantages(rewards: Tensor, group_ids: Tensor, p: GRPOAdvParams) -> Tensor:
    """(R − mean_g R) / (std_g R + ε) (DeepSeekMath §4.1.2)."""
    centered, counts, index, n = _centered(rewards, group_ids)
    dof = (counts - 1.0) if p.unbiased else counts
    var = segment_sum(centered * centered, index, n) / dof.clamp_min(1.0)
    std = var.sqrt()[index]
    adv = centered / (std + p.eps)
    return torch.where((counts[index] > 1) & (std > 0), adv, torch.zeros_like(adv))


@_register("dr_grpo", NoParams)
def mean_advantages(rewards: Tensor, group_ids: Tensor, p: NoParams) -> Tensor:
    """R − mean_g R, no std division (Dr. GRPO §3.2; GEPO's runs)."""
    return _centered(rewards, group_ids)[0]


@_register("rloo", NoParams)
def rloo_advantages(rewards: Tensor, group_ids: Tensor, p: NoParams) -> Tensor:
    """R_i − mean_{j≠i} R_j = G/(G−1)·(R_i − mean_g R) (leave-one-out baseline, Kool et al. 2019)."""
    centered, counts, index, _ = _centered(rewards, group_ids)
    g = counts[index]
    return torch.where(g > 1, centered * g / (g - 1.0).clamp_min(1.0), torch.zeros_like(centered))


@_register("bnpo", BNPOParams)
def bnpo_advantages(rewards: Tensor, group_ids: Tensor, p: BNPOParams) -> Tensor:
    """BNPO (arXiv 2506.02864 §4, authors' code): (R̃ − p̂) / f_Beta(p̂; α, β), α = 1 + a/3, β = 1 + b/3.

    (a, b) is the method-of-moments Beta fit of the per-prompt success rates p̂ across the batch;
    with fewer than two prompts or zero spread, a = b = 0 (weight 1, REINFORCE with group baseline).
    """
    r = (rewards - p.r_min) / (p.r_max - p.r_min)
    centered, _, index, n = _centered(r, group_ids)
    p_hat, _ = segment_mean(r, index, n)
    mu = p_hat.mean()
    var = p_hat.var(unbiased=True) if n > 1 else p_hat.new_tensor(0.0)
    if n > 1 and float(var) > 0:
        k = mu * (1 - mu) / var - 1
        a, b = k * mu, k * (1 - mu)
    else:
        a = b = p_hat.new_tensor(0.0)
    alpha = torch.clamp(1 + a / 3, min=1.0)
    beta = torch.clamp(1 + b / 3, min=1.0)
    x = p_hat.clamp(0.0, 1.0)
    log_pdf = (
        torch.xlogy(alpha - 1, x)
        + torch.xlogy(beta - 1, 1 - x)
        - (torch.lgamma(alpha) + torch.lgamma(beta) - torch.lgamma(alpha + beta))
    )
    weight = torch.exp(-log_pdf).clamp(max=p.max_weight)
    weight = torch.where(torch.isfinite(weight), weight, torch.full_like(weight, p.max_weight))
    return weight[index] * centered


def advantage_names() -> list[str]:
    """Names accepted by :func:`advantages`."""
    return sorted(_ESTIMATORS)


def advantages(name: str, rewards: Tensor, group_ids: Tensor, **params: Any) -> Tensor:
    """Advantages [B] for rewards [B] grouped by ``group_ids`` [B] with the named estimator."""
    entry = _ESTIMATORS.get(name)
    if entry is None:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(advantage_names())}")
    fn, cls = entry
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - valid)
    if unknown:
        raise ValueError(
            f"advantage {name!r} got unknown parameter(s) {', '.join(unknown)}; "
            f"valid: {', '.join(sorted(valid)) or '(none)'}"
        )
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B], got {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    return fn(r, group_ids, cls(**params))
