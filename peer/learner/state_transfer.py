"""A learner's whole training state as bytes for another learner of its lineage: weights and AdamW state.

A learner that joins a lineage (or comes back to it) at another version loads the writer's state instead of
its own: the float32 weights of every trainable parameter, and the optimiser's per-parameter state
(``step``, ``exp_avg``, ``exp_avg_sq``), each as safetensors keyed by parameter name (never pickled: a
save's ``torch.save`` stays on the learner's own disk). Loading checks the names, shapes, dtypes and finite
values against the learner's own model; its learning rate and other hyperparameters are the run's own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heterorl.protocol.wire.checkpoint import deserialize_state_dict, serialize_state_dict
from heterorl.protocol.wire.errors import ProtocolError

OPTIMIZER_FIELDS = ("step", "exp_avg", "exp_avg_sq")  # AdamW's state per parameter


def state_bytes(named: list[tuple[str, Tensor]], optimizer_state: dict) -> tuple[bytes, bytes]:
    """safetensors of the trainable weights (float32) and of the optimiser state of ``optimizer_state`` (a
    ``state_dict()`` whose parameter indices follow ``named``)."""
    weights = serialize_state_dict({n: t.detach().to(torch.float32) for n, t in named})
    names = [n for n, _ in named]
    opt = {}
    for index, fields in optimizer_state["state"].items():
        for field in OPTIMIZER_FIELDS:
            if field in fields:
                opt[f"{field}/{names[index]}"] = torch.as_tensor(fields[field]).detach().to(torch.float32)
    return weights, serialize_state_dict(opt)


def load_state_bytes(trainer, version: int, weights: bytes, optimizer: bytes) -> None:
    """Load another learner's :func:`state_bytes` into ``trainer`` (a :class:`~.trainer.Trainer`) as its
    state at ``version``; ProtocolError naming what does not fit this learner's model."""
    named = trainer.named_trainable()
    try:
        w, o = deserialize_state_dict(weights), deserialize_state_dict(optimizer)
    except Exception as e:  # safetensors raises its own types on malformed bytes
        raise ProtocolError(f"state is not safetensors: {type(e).__name__}: {e}") from None
    if set(w) != {n for n, _ in named}:
        raise ProtocolError("the offered weights are not this model's parameters")
    state: dict[int, dict] = {}
    for i, (name, p) in enumerate(named):
        _check(name, w[name], tuple(p.shape))
        fields = {f: o.pop(f"{f}/{name}") for f in OPTIMIZER_FIELDS if f"{f}/{name}" in o}
        if fields and set(fields) != set(OPTIMIZER_FIELDS):
            raise ProtocolError(f"optimiser state of {name}: {sorted(fields)}, not {list(OPTIMIZER_FIELDS)}")
        if fields:
            _check(f"step/{name}", fields["step"], ())
            for f in ("exp_avg", "exp_avg_sq"):
                _check(f"{f}/{name}", fields[f], tuple(p.shape))
            state[i] = {f: t.to(p.device) for f, t in fields.items()}
    if o:
        raise ProtocolError(f"optimiser state of no parameter of this model: {sorted(o)[:3]}")
    current = trainer.optimizer.state_dict()
    with torch.no_grad():
        for name, p in named:
            p.copy_(w[name].to(p.device, p.dtype))
    trainer.optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
    trainer.version = version


def _check(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.float32 or tuple(t.shape) != shape:
        raise ProtocolError(f"{name}: {t.dtype} {tuple(t.shape)}, this model's is float32 {shape}")
    if not torch.isfinite(t).all():
        raise ProtocolError(f"{name} holds a value that is not finite")
