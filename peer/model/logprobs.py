"""Per-token log-probs of completions under a model: the learner's recompute and the sampler's record.

Both sides use this one layout (left-padded prompt, completion, right padding; positions from the
attention mask) and the same temperature, so behaviour and learner log-probs agree to float error.
"""

from __future__ import annotations

import torch
from torch import Tensor


def left_pad(prompts: list[list[int]], pad_id: int, extra: int = 0) -> tuple[Tensor, Tensor, int]:
    """Left-pad token lists into ids [N, W+extra] and attention mask; returns them and the width W."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    width = int(lengths.max()) if len(prompts) else 0
    ids = torch.full((len(prompts), width + extra), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    # one scatter instead of a tensor per row: row r's tokens go to columns width-len(r) .. width-1
    rows = torch.repeat_interleave(torch.arange(len(prompts)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = width - lengths[rows] + torch.arange(len(rows)) - starts[rows]
    ids[rows, cols] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    attn[rows, cols] = 1
    return ids, attn, width


def pack(
    prompts: list[list[int]], completions: Tensor, completion_mask: Tensor, pad_id: int
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Build input ids [N, P+T], attention mask and position ids; returns them and P (prompt width)."""
    ids, attn, width = left_pad(prompts, pad_id, extra=completions.shape[1])
    ids[:, width:] = torch.where(completion_mask > 0, completions, torch.full_like(completions, pad_id))
    attn[:, width:] = (completion_mask > 0).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return ids, attn, pos, width


def completion_logprobs(
    model,
    prompts: list[list[int]],
    completions: Tensor,
    completion_mask: Tensor,
    pad_id: int,
    temperature: float = 1.0,
) -> Tensor:
    """log softmax(logits / temperature) of each completion token -> [N, T] (0 on padding)."""
    ids, attn, pos, width = pack(prompts, completions, completion_mask, pad_id)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    t = completions.shape[1]
    step_logits = logits[:, width - 1 : width - 1 + t].float() / temperature
    logp = torch.log_softmax(step_logits, -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    return torch.where(completion_mask > 0, logp, torch.zeros_like(logp))
