"""Models: load HF causal LMs by path or id; build the tiny offline model; per-token log-probs."""

from .loader import load_model
from .logprobs import completion_logprobs
from .text import completion_text
from .tiny import TINY_MODEL_DIR, build_tiny_model, build_tokenizer, ensure_model

__all__ = [
    "TINY_MODEL_DIR",
    "build_tiny_model",
    "ensure_model",
    "build_tokenizer",
    "completion_logprobs",
    "completion_text",
    "load_model",
]
