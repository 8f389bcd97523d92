"""Rollout backends behind one small interface and a factory with lazy imports (``hf``; ``vllm`` later)."""

from .base import RolloutBackend, Rollouts, SamplingParams

BACKENDS = ("hf",)


def make_backend(name: str, tokenizer) -> RolloutBackend:
    """Build a backend by name; the vLLM backend is declared as an extra but not built yet."""
    if name == "hf":
        from .hf import HFBackend

        return HFBackend(tokenizer)
    raise ValueError(f"unknown rollout backend {name!r}; available: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "RolloutBackend", "Rollouts", "SamplingParams", "make_backend"]
