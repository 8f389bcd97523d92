"""Gradients between learner peers: float32 safetensors of exactly the model's trainable parameters.

A learner's gradient (a Contribution) and the writer's reduced one (a Commit) travel as one frame after their
signed message, which names the frame's SHA-256. :func:`decode_gradient` checks, before a tensor is used:
the size (exactly what the parameters' schema implies, so a frame's cap is known before it is read), the hash,
the safetensors header (never unpickled), the names, shapes and dtype (float32, every parameter, nothing
else) and that every value is finite.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from heterorl.protocol.wire.checkpoint import deserialize_state_dict, serialize_state_dict
from heterorl.protocol.wire.errors import ProtocolError

Schema = tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) of each trainable parameter, sorted by name
HEADER_SLACK_BYTES = 1 << 20  # a safetensors header's JSON: names, shapes, offsets (a 135M model: ~20 KB)


def parameter_schema(named_parameters) -> Schema:
    """The (name, shape) of each parameter that trains, sorted by name (every learner of a run shares it)."""
    return tuple(sorted((n, tuple(p.shape)) for n, p in named_parameters if p.requires_grad))


def schema_sha256(schema: Schema) -> bytes:
    """A digest of ``schema`` (and the float32 dtype gradients travel in): the Hello compares it."""
    h = hashlib.sha256(b"heterorl-grad-schema/float32")
    for name, shape in schema:
        h.update(struct.pack(f"<I{len(name.encode())}sI{len(shape)}q", len(name.encode()), name.encode(),
                             len(shape), *shape))  # fmt: skip
    return h.digest()


def gradient_frame_cap(schema: Schema) -> int:
    """The largest gradient frame of ``schema``: its float32 payload plus a header."""
    return sum(4 * _numel(shape) for _, shape in schema) + HEADER_SLACK_BYTES


def encode_gradient(grads: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    """safetensors bytes of ``grads`` (float32, on CPU) and their SHA-256."""
    data = serialize_state_dict({k: v.detach().to(torch.float32) for k, v in grads.items()})
    return data, hashlib.sha256(data).digest()


def decode_gradient(data: bytes, sha256: bytes, schema: Schema) -> dict[str, torch.Tensor]:
    """The tensors of a gradient frame, checked against the signed ``sha256`` and the run's ``schema``;
    ProtocolError naming what is wrong."""
    if len(data) > gradient_frame_cap(schema):
        raise ProtocolError(f"gradient of {len(data)} bytes exceeds the model's {gradient_frame_cap(schema)}")
    if hashlib.sha256(data).digest() != sha256:
        raise ProtocolError("gradient bytes do not hash to the signed grad_sha256")
    try:
        tensors = deserialize_state_dict(data)
    except Exception as e:  # safetensors raises its own types on malformed bytes
        raise ProtocolError(f"gradient is not safetensors: {type(e).__name__}: {e}") from None
    want = dict(schema)
    if set(tensors) != set(want):
        extra, lacking = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
        raise ProtocolError(
            f"gradient's tensors are not the model's (extra {extra[:3]}, lacking {lacking[:3]})"
        )
    for name, t in tensors.items():
        if t.dtype != torch.float32 or tuple(t.shape) != want[name]:
            raise ProtocolError(
                f"gradient {name}: {t.dtype} {tuple(t.shape)}, the model's is float32 {want[name]}"
            )
        if not torch.isfinite(t).all():
            raise ProtocolError(f"gradient {name} holds a value that is not finite")
    return tensors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
