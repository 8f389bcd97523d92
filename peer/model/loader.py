"""Load any HF causal LM and its tokenizer from a local path or a hub id (same code for the tiny model).

Only data is loaded, never code: ``trust_remote_code`` is always False, weights come from safetensors files
only (a pickled ``pytorch_model.bin`` could run code as it loads), and a local directory is checked first by
:func:`check_model_dir`, which refuses one that asks for custom code (``auto_map``) or holds only pickled
weights, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SAFE_WEIGHTS = "*.safetensors"
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")  # torch.load unpickles these
CODE_CONFIGS = ("config.json", "tokenizer_config.json")  # where `auto_map` asks for the directory's own code
MAX_CONFIG_BYTES = 4 << 20


def check_model_dir(path: str | Path) -> None:
    """ValueError unless ``path`` is a model directory this code may load: a config.json, no ``auto_map``
    (custom model or tokenizer code) in it or in tokenizer_config.json, and safetensors weights."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"{p} is not a model directory (no config.json)")
    for name in CODE_CONFIGS:
        f = p / name
        if not f.is_file():
            continue
        try:
            if f.stat().st_size > MAX_CONFIG_BYTES:
                raise ValueError(f"over {MAX_CONFIG_BYTES} bytes")
            config = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{f}: not a readable JSON config ({e})") from None
        if isinstance(config, dict) and "auto_map" in config:
            raise ValueError(
                f"{f} has auto_map: the model needs its own Python code (trust_remote_code), which HeteroRL "
                "never runs"
            )
    if not any(p.glob(SAFE_WEIGHTS)):
        pickled = sorted(f.name for pattern in PICKLED_WEIGHTS for f in p.glob(pattern))
        if pickled:
            raise ValueError(
                f"{p} holds only pickled weights ({', '.join(pickled[:3])}), which can run code as they "
                "load; HeteroRL loads *.safetensors weights only"
            )
        raise ValueError(f"{p} holds no *.safetensors weights")


def _checked(path_or_id: str) -> str:
    if Path(path_or_id).is_dir():
        check_model_dir(path_or_id)
    return path_or_id


def load_tokenizer(path_or_id: str):
    """The model's tokenizer; left padding for batched generation, pad token set."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_checked(path_or_id), trust_remote_code=False)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(path_or_id: str):
    """The model's config alone (no weights): vocabulary, layers, heads."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_checked(path_or_id), trust_remote_code=False)


def load_model(path_or_id: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Return ``(model, tokenizer)``; left padding for batched generation, pad token set."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path_or_id)
    model = AutoModelForCausalLM.from_pretrained(
        _checked(path_or_id), dtype=dtype, trust_remote_code=False, use_safetensors=True
    ).to(device)
    model.eval()
    return model, tokenizer
