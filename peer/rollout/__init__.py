"""Rollout backends behind one small interface and a factory with lazy imports: ``hf`` and ``vllm``.

``make_backend("auto", ...)`` takes vLLM where it is installed and supports the model on this device, else
``hf``, and says why in the log. vLLM is imported only when that backend is chosen.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .base import RolloutBackend, Rollouts, SamplingParams

BACKENDS = ("hf", "vllm")
CHOICES = ("auto", *BACKENDS)

log = logging.getLogger(__name__)


def make_backend(
    name: str,
    model_dir: str | Path,
    tokenizer,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    model=None,
    **engine: object,
) -> RolloutBackend:
    """Build a backend by name (``auto``, ``hf``, ``vllm``) for the model in ``model_dir``.

    ``model``: an already loaded HF model for ``hf`` (else it is loaded from ``model_dir``). ``engine``:
    vLLM settings (``memory_bytes``, ``threads``, ``max_rows``, ``max_model_len``, ``seed``). ``vllm`` that
    cannot serve the model raises :class:`BackendUnavailable` with the reason; ``auto`` falls back to ``hf``.
    """
    if name not in CHOICES:
        raise ValueError(f"unknown rollout backend {name!r}; available: {', '.join(CHOICES)}")
    if name in ("vllm", "auto"):
        from .vllm import BackendUnavailable, VLLMBackend, unsupported_reason

        reason = unsupported_reason(model_dir, device)
        if reason is None:
            try:
                return VLLMBackend(model_dir, tokenizer, device=device, dtype=dtype, **engine)
            except BackendUnavailable as e:
                reason = str(e)
        if name == "vllm":
            raise BackendUnavailable(reason)
        log.warning("rollout backend: hf, because %s", reason)
    from .hf import HFBackend

    if model is None:
        import torch

        from ..model import load_model

        model, _ = load_model(str(model_dir), dtype=getattr(torch, dtype), device=device)
    return HFBackend(model, tokenizer)


__all__ = ["BACKENDS", "CHOICES", "RolloutBackend", "Rollouts", "SamplingParams", "make_backend"]
