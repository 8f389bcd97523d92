"""Load any HF causal LM and its tokenizer from a local path or a hub id (same code for the tiny model)."""

from __future__ import annotations

import torch


def load_model(path_or_id: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Return ``(model, tokenizer)``; left padding for batched generation, pad token set."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype).to(device)
    model.eval()
    return model, tokenizer
