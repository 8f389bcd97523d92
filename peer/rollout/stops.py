"""Where a completion ends: up to and including its first EOS, or the token budget."""

from __future__ import annotations

import torch
from torch import Tensor


def eos_mask(completions: Tensor, eos_token_id: int | None) -> Tensor:
    """[N,T] long mask: 1 on every token up to and including the first EOS of each row."""
    if eos_token_id is None:
        return torch.ones_like(completions, dtype=torch.long)
    is_eos = (completions == eos_token_id).long()
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after_eos).long()
