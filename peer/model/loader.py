"""Load any HF causal LM and its tokenizer from a local path or a hub id (same code for the tiny model)."""

from __future__ import annotations

import torch


def load_tokenizer(path_or_id: str):
    """The model's tokenizer; left padding for batched generation, pad token set."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(path_or_id: str):
    """The model's config alone (no weights): vocabulary, layers, heads."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path_or_id)


def load_model(path_or_id: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Return ``(model, tokenizer)``; left padding for batched generation, pad token set."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path_or_id)
    model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype).to(device)
    model.eval()
    return model, tokenizer
