"""The sampling distribution and reproducible draws from it.

:func:`nucleus_logprobs` is what a sampler draws from: softmax(logits / T) within the top-p nucleus. A seeded
draw is Gumbel-max: ``argmax(log p + g)`` with ``g = -log(-log u)``, u uniform from a generator seeded by the
row's seed and the step, which is an exact sample from p; with the seed, anyone holding the same logits
reproduces it (:func:`gumbel_noise`).
"""

from __future__ import annotations

import torch
from torch import Tensor

_STEP_MIX = 0x9E3779B97F4A7C15  # a step's seed: the row's, mixed with the step (odd, 64-bit golden ratio)


def nucleus_logprobs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """log p of the sampling distribution: softmax(logits / T) restricted to the top-p nucleus (the smallest
    set of likeliest tokens holding at least ``top_p`` of the mass) and renormalised; -inf outside it.
    ``logits`` [..., V] -> [..., V] float32."""
    logp = torch.log_softmax(logits.float() / temperature, -1)
    if top_p >= 1.0:
        return logp
    sorted_lp, order = logp.sort(-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
    keep_sorted = mass_before < top_p  # the likeliest token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, logp, torch.full_like(logp, float("-inf")))
    return kept - torch.logsumexp(kept, -1, keepdim=True)


def gumbel_noise(seed: int, step: int, vocab: int) -> Tensor:
    """Gumbel(0, 1) noise [V] (float32, CPU) of a row's step: the same on every machine for the same seed."""
    g = torch.Generator().manual_seed((seed + step * _STEP_MIX) % (1 << 63))
    u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    return (-torch.log(-torch.log(u))).float()


def seeded_choice(logits: Tensor, seeds: list[int], step: int, temperature: float, top_p: float) -> Tensor:
    """The token each row draws at ``step`` from ``logits`` [N, V] with its seed: argmax(log p + g) [N]."""
    logp = nucleus_logprobs(logits, temperature, top_p)
    noise = torch.stack([gumbel_noise(s, step, logits.shape[-1]) for s in seeds]).to(logp.device)
    return (logp + noise).argmax(-1)
