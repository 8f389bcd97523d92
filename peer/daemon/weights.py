"""The run's model as a directory to load (the tiny offline model is built where it is missing), and its
weights as bytes."""

from __future__ import annotations

import fcntl
import hashlib
import logging
from pathlib import Path

import torch

from heterorl.protocol.settings import TINY_MODEL, Run
from heterorl.protocol.wire.checkpoint import deserialize_state_dict, serialize_state_dict

from ..model.loader import check_model_dir
from .consent import MODEL_DIR_FLAG, RunSpecRefused, model_kind, model_path_refusal

log = logging.getLogger(__name__)


def resolve_model(name: str, cache_dir: Path, model_dir: str | Path | None = None) -> str:
    """The one way a RunSpec's ``model`` becomes a directory to load, checked by
    :func:`~heterorl.peer.model.loader.check_model_dir` (no custom code, safetensors weights):

    - ``model_dir`` when given (``--model-dir``: the volunteer's own copy, whatever the run names);
    - "tiny": the offline tiny model, built once under ``cache_dir``;
    - a plain ``org/name`` hub id: its snapshot in this machine's Hugging Face cache (nothing is downloaded);
    - a path: refused (:class:`~.consent.RunSpecRefused`), as the host's directories are not this peer's.
    """
    if model_dir is not None:
        path = Path(model_dir).expanduser().resolve()
    elif name == TINY_MODEL:
        path = _tiny_model(Path(cache_dir))
    elif model_kind(name) == "hub":
        path = _hub_snapshot(name)
    else:
        raise RunSpecRefused(model_path_refusal(name))
    try:
        check_model_dir(path)
    except ValueError as e:
        raise RunSpecRefused(f"model {name[:200]!r}: {e}") from None
    return str(path)


def _tiny_model(cache_dir: Path) -> Path:
    from heterorl.peer.model import build_tiny_model

    path = cache_dir / "tiny-model"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "tiny-model.lock", "w") as lock:  # several peers on one host build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").exists():
            log.info("building the tiny offline model in %s", path)
            build_tiny_model(path, progress=False)
    return path


def _hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot of hub model ``repo_id``; ValueError saying how to get it when it is not cached."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # not cached (LocalEntryNotFoundError), or a cache it cannot read
        raise ValueError(
            f"model {repo_id!r} is not in this machine's Hugging Face cache ({type(e).__name__}) and peers "
            f"download nothing: fetch it with `hf download {repo_id}` (safetensors weights), or pass "
            f"{MODEL_DIR_FLAG} DIR"
        ) from None


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
    run the initial adapter), the vocabulary size, and for an adapter run the base weights' hash. Runs on the
    host, whose run.toml may name a directory of its own."""
    from heterorl.peer.model import load_model

    own = cfg.model.path if model_kind(cfg.model.path) == "path" else None  # the host's own directory
    model, _tok = load_model(resolve_model(cfg.model.path, cache_dir, own))
    vocab_size = model.config.vocab_size
    if cfg.adapter is None:
        return weights_hash(weights_bytes(model, cfg.learner.checkpoint_dtype)), vocab_size, None
    from heterorl.peer.model.adapter import initial_hashes  # version 0 is the initial adapter

    initial, base = initial_hashes(model, cfg.adapter, cfg.learner.checkpoint_dtype)
    return initial, vocab_size, base
