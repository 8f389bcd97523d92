"""Token ids back to text, the one way both the sampler (to score) and the learner (to re-score) do it."""

from __future__ import annotations

from collections.abc import Sequence


def completion_text(tokenizer, ids: Sequence[int]) -> str:
    """Text of a completion: tokens up to (not including) the first EOS, pads dropped."""
    ids = list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode([t for t in ids if t != tokenizer.pad_token_id])
