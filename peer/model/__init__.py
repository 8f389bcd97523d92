"""Models: load HF causal LMs by path or id; build the tiny offline model; per-token log-probs."""

from .loader import load_model
from .logprobs import completion_logprobs
from .text import completion_text, prompt_text
from .tiny import build_tiny_model, build_tokenizer

__all__ = [
    "build_tiny_model",
    "build_tokenizer",
    "completion_logprobs",
    "completion_text",
    "load_model",
    "prompt_text",
]
