"""Models: load HF causal LMs by path or id; build the tiny offline model; per-token log-probs."""

from .loader import load_model
from .logprobs import completion_logprobs
from .tiny import build_tiny_model, build_tokenizer

__all__ = ["build_tiny_model", "build_tokenizer", "completion_logprobs", "load_model"]
