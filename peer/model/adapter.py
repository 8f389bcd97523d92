"""LoRA adapter runs: train adapters on a frozen base with ``peft``, publish only the adapters, apply them.

An adapter state holds, per target Linear layer, ``base_model.model.<module>.lora_A.weight`` [rank, in] and
``...lora_B.weight`` [out, rank] (peft's saved names), so a published checkpoint can be written as a peft
adapter directory as it is (:func:`write_peft_dir`, for vLLM's LoRA). A sampler that merges instead computes
W = W0 + (alpha / rank) · B @ A in float32 on the base weights and casts to their dtype (:func:`merge`), what
peft's forward computes unmerged. Version 0 is the initial adapter: A from a fixed seed (peft's Kaiming
bound, drawn on the CPU, so every device makes the same bytes), B = 0, i.e. the base model itself.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from heterorl.protocol.settings import AdapterSettings
from heterorl.protocol.wire.checkpoint import serialize_state_dict

PREFIX = "base_model.model."  # peft's prefix of saved adapter names
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"
INIT_SEED = 0


def target_modules(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Names of the Linear layers ``targets`` select (name equal to a target, or ending in ``.target``);
    ValueError naming a target that matches nothing, or a layer that is not Linear or shares its weight."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    chosen = []
    for target in targets:
        hits = [n for n, _ in model.named_modules() if n == target or n.endswith("." + target)]
        if not hits:
            raise ValueError(f"adapter target {target!r} matches no module of the model")
        for name in hits:
            mod = model.get_submodule(name)
            if type(mod) is not nn.Linear:
                raise ValueError(f"adapter target {name} is a {type(mod).__name__}, not a Linear layer")
            if counts.get(id(mod.weight), 0) > 1:
                raise ValueError(f"adapter target {name} shares its weight (tied embeddings): not supported")
            chosen.append(name)
    return sorted(set(chosen))


def wrap(model: nn.Module, adapter: AdapterSettings):
    """``model`` as a peft LoRA model: base frozen, adapters trainable, at the initial adapter (B = 0)."""
    from peft import LoraConfig, get_peft_model

    names = target_modules(model, adapter.target_modules)
    config = LoraConfig(
        r=adapter.rank, lora_alpha=adapter.alpha, target_modules=names, lora_dropout=0.0, bias="none"
    )
    with torch.random.fork_rng(devices=[]):  # peft's own init draws; the caller's RNG stream stays as it was
        peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(INIT_SEED)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if ".lora_A." in name:  # peft's init: kaiming_uniform_(a=sqrt(5)), bound 1/sqrt(in)
                bound = 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
            elif ".lora_B." in name:
                p.zero_()
    return peft_model


def for_training(model: nn.Module, adapter: AdapterSettings, dtype: str):
    """The learner's model: ``model`` checked to be the run's base (ValueError otherwise), then wrapped."""
    check_base(base_state(model, dtype), adapter)
    return wrap(model, adapter)


def adapter_state(peft_model) -> dict[str, Tensor]:
    """The adapter tensors alone, in peft's saved names (``base_model.model.<module>.lora_A.weight``)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(peft_model).items()}


def adapter_bytes(peft_model, dtype: str = "float32") -> bytes:
    """safetensors bytes of the adapter state, cast to the checkpoint dtype."""
    target = getattr(torch, dtype)
    return serialize_state_dict({k: v.to(target) for k, v in adapter_state(peft_model).items()})


def base_state(model: nn.Module, dtype: str = "float32") -> dict[str, Tensor]:
    """The base model's state as published: floating tensors in the checkpoint dtype (what is hashed)."""
    target = getattr(torch, dtype)
    return {k: v.to(target) if v.is_floating_point() else v for k, v in model.state_dict().items()}


def state_hash(state: Mapping[str, Tensor]) -> bytes:
    """sha256 of a state's safetensors bytes (of a base: what a full run's initial checkpoint hash is)."""
    return hashlib.sha256(serialize_state_dict(dict(state))).digest()


def initial_hashes(model: nn.Module, adapter: AdapterSettings, dtype: str) -> tuple[bytes, bytes]:
    """(hash of version 0, the initial adapter; hash of the base weights) for a RunSpec. Wraps ``model``."""
    base = state_hash(base_state(model, dtype))
    return hashlib.sha256(adapter_bytes(wrap(model, adapter), dtype)).digest(), base


def check_base(state: Mapping[str, Tensor], adapter: AdapterSettings) -> None:
    """ValueError unless ``state`` (a base in the checkpoint dtype) is the base the run names."""
    have = state_hash(state).hex()
    if have != adapter.base_hash:
        raise ValueError(
            f"the base model here (sha256 {have[:16]}…) is not the run's base ({adapter.base_hash[:16]}…): "
            "adapters trained on another base do not apply to it"
        )


def load_base(model_dir: str, adapter: AdapterSettings, dtype: str) -> dict[str, Tensor]:
    """A sampler's base state from ``model_dir`` (CPU, checkpoint dtype), checked against the run's hash."""
    from .loader import load_model

    model, _ = load_model(model_dir)
    state = base_state(model, dtype)
    check_base(state, adapter)
    return state


def check_fits(
    base_shapes: Mapping[str, tuple[int, ...]], state: Mapping[str, Tensor], adapter: AdapterSettings
) -> dict[str, tuple[Tensor, Tensor]]:
    """{base weight name: (A, B)} when ``state`` is an adapter of the run's rank for this base; else
    ValueError with the reason (an adapter for another base has other names or shapes)."""
    pairs: dict[str, tuple[Tensor, Tensor]] = {}
    for name in state:
        if not (name.startswith(PREFIX) and name.endswith(A_SUFFIX)):
            if not (name.startswith(PREFIX) and name.endswith(B_SUFFIX)):
                raise ValueError(f"adapter tensor {name[:80]!r} is not a LoRA A/B weight")
            continue
        module = name[len(PREFIX) : -len(A_SUFFIX)]
        b_name = PREFIX + module + B_SUFFIX
        if b_name not in state:
            raise ValueError(f"adapter has {name} without its {b_name}")
        base_name = module + ".weight"
        if base_name not in base_shapes:
            raise ValueError(
                f"adapter for {base_name}, which this base does not have: an adapter for another base"
            )
        a, b = state[name], state[b_name]
        out_f, in_f = base_shapes[base_name]
        r = adapter.rank
        if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
            raise ValueError(
                f"adapter for {base_name} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base weight is "
                f"{(out_f, in_f)} and the run's rank {r}: an adapter for another base"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"adapter tensors for {base_name} are not floating point")
        pairs[base_name] = (a, b)
    if len(pairs) * 2 != len(state):
        raise ValueError("adapter has lora_B weights without their lora_A")
    if not pairs:
        raise ValueError("adapter holds no LoRA weights")
    return pairs


def merge(
    base: Mapping[str, Tensor], state: Mapping[str, Tensor], adapter: AdapterSettings
) -> dict[str, Tensor]:
    """A full state: the base with every adapted weight replaced by W0 + (alpha/rank) · B @ A, computed in
    float32 and cast to W0's dtype. ValueError (nothing merged) if the adapter does not fit the base."""
    pairs = check_fits({k: tuple(v.shape) for k, v in base.items()}, state, adapter)
    out = dict(base)
    for name, (a, b) in pairs.items():
        w0 = base[name]
        out[name] = (w0.float() + adapter.scale * (b.float() @ a.float())).to(w0.dtype)
    return out


def write_peft_dir(path: Path, state: Mapping[str, Tensor], adapter: AdapterSettings) -> Path:
    """A peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) for engines that
    serve LoRA adapters themselves (vLLM). ``state`` must have been checked with :func:`check_fits`."""
    path.mkdir(parents=True, exist_ok=True)
    modules = sorted({k[len(PREFIX) :].rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in state})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (path / "adapter_model.safetensors").write_bytes(serialize_state_dict(dict(state)))
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return path
