"""Seeded sampling for the ``hf`` backend: each row's tokens drawn by Gumbel-max with the row's own seed
(:func:`heterorl.protocol.wire.seeds.row_seed`), so a verifier holding the same version reproduces them.

``generate`` runs greedy decoding over scores this logits processor makes: ``log p + g``, with p the run's
sampling distribution (temperature, top-p nucleus) and g the row's Gumbel noise for the step; the argmax of
that is an exact draw from p. The behaviour log-probs still come from the raw logits (``output_logits``).
"""

from __future__ import annotations

import torch

from ..model.sampling import seeded_choice


class GumbelDraw:
    """A ``transformers`` logits processor: scores whose argmax is each row's seeded draw."""

    def __init__(self, seeds: list[int], prompt_width: int, temperature: float, top_p: float):
        self.seeds, self.width = list(seeds), prompt_width
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        choice = seeded_choice(scores, self.seeds, step, self.temperature, self.top_p)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, choice[:, None].to(out.device), 0.0)
        return out
