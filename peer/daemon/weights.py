"""The run's model by name (the tiny offline model is built where it is missing) and its weights as bytes."""

from __future__ import annotations

import fcntl
import hashlib
import logging
from pathlib import Path

import torch

from heterorl.protocol.settings import TINY_MODEL, Run
from heterorl.protocol.wire.checkpoint import deserialize_state_dict, serialize_state_dict

log = logging.getLogger(__name__)


def resolve_model(name: str, cache_dir: Path) -> str:
    """A loadable path or hub id for the RunSpec's ``model``; "tiny" is built once under ``cache_dir``."""
    if name != TINY_MODEL:
        return name
    from heterorl.peer.model import build_tiny_model

    path = Path(cache_dir) / "tiny-model"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "tiny-model.lock", "w") as lock:  # several peers on one host build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").exists():
            log.info("building the tiny offline model in %s", path)
            build_tiny_model(path, progress=False)
    return str(path)


CHECKPOINT_DTYPES = ("float32", "bfloat16")


def checkpoint_state(model: torch.nn.Module, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The model's state as a checkpoint carries it, on the model's device: floating tensors cast to ``dtype``
    (what samplers run: the learner trains a float32 master copy and publishes its rounding). Tensors already
    in ``dtype`` are the model's own, not copies: clone them to keep a version (a parent for device_delta)."""
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"checkpoint dtype must be one of {', '.join(CHECKPOINT_DTYPES)}, got {dtype!r}")
    target = getattr(torch, dtype)
    return {k: v.to(target) if v.is_floating_point() else v for k, v in model.state_dict().items()}


def weights_bytes(model: torch.nn.Module, dtype: str = "float32") -> bytes:
    """safetensors bytes of :func:`checkpoint_state`."""
    return serialize_state_dict(checkpoint_state(model, dtype))


def weights_hash(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def load_weights(model: torch.nn.Module, data: bytes) -> None:
    """Load safetensors bytes into ``model``; ValueError if names or shapes differ from the model's."""
    state = deserialize_state_dict(data)
    own = model.state_dict()
    if set(state) != set(own):
        missing, extra = sorted(set(own) - set(state))[:3], sorted(set(state) - set(own))[:3]
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {extra}")
    for name, t in state.items():
        if t.shape != own[name].shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(t.shape)}, model {tuple(own[name].shape)}"
            )
    model.load_state_dict(state)


def initial_state(cfg: Run, cache_dir: Path) -> tuple[bytes, int, bytes | None]:
    """What a new RunSpec names: the hash of version 0 (the weights in the checkpoint dtype, or for an adapter
    run the initial adapter), the vocabulary size, and for an adapter run the base weights' hash."""
    from heterorl.peer.model import load_model

    model, _tok = load_model(resolve_model(cfg.model.path, cache_dir))
    vocab_size = model.config.vocab_size
    if cfg.adapter is None:
        return weights_hash(weights_bytes(model, cfg.learner.checkpoint_dtype)), vocab_size, None
    from heterorl.peer.model.adapter import initial_hashes  # version 0 is the initial adapter

    initial, base = initial_hashes(model, cfg.adapter, cfg.learner.checkpoint_dtype)
    return initial, vocab_size, base
