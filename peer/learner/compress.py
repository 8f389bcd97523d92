"""A learner's compressed contribution: top-k of each chunk with 2-bit values, and local error feedback.

Pure tensor functions (the frame's bytes are :mod:`heterorl.protocol.wire.sparse_gradient`'s). Each learner
keeps a residual ``r`` of what it has not sent yet (error feedback, as in SparseLoCo, arXiv 2508.15706, and
DeMo's momentum): for a new gradient ``g`` it sends ``c = Q(topk(r + g))`` and keeps ``r ← r + g − c``, so
nothing is dropped, only delayed. ``Q`` is the 2-bit quantiser of :func:`compress`: per chunk, the ``k``
largest values by magnitude, each sent as its sign and one of two magnitudes: the smaller half of the ``k`` as
their mean, the larger half as theirs, so that the sent chunk keeps the selected values' total magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from heterorl.protocol.wire.sparse_gradient import CHUNK, DEFAULT_K, chunks_of, dense_of, pack_frame


@dataclass(frozen=True)
class Compressed:
    """One contribution: the selected positions (chunks × k, increasing per chunk), their 2-bit codes and
    each chunk's (lo, hi) magnitudes; ``dense`` is what it stands for, as the receiver decodes it."""

    indices: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    dense: Tensor

    def frame(self) -> bytes:
        return pack_frame(self.indices, self.codes, self.scales)


def flatten(tensors: dict[str, Tensor], schema) -> Tensor:
    """The float32 concatenation of ``tensors`` in ``schema`` order (names and shapes checked)."""
    parts = []
    for name, shape in schema:
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, the schema's is {tuple(shape)}")
        parts.append(t.detach().reshape(-1).to("cpu", torch.float32))
    return torch.cat(parts) if parts else torch.zeros(0)


def unflatten(vector: Tensor, schema) -> dict[str, Tensor]:
    """``vector`` cut back into tensors of ``schema`` (views of it)."""
    out, at = {}, 0
    for name, shape in schema:
        n = int(np.prod(shape)) if shape else 1
        out[name] = vector[at : at + n].reshape(shape)
        at += n
    if at != vector.numel():
        raise ValueError(f"a vector of {vector.numel()} values for a schema of {at}")
    return out


def compress(vector: Tensor, k: int = DEFAULT_K, chunk: int = CHUNK) -> Compressed:
    """Top-``k`` of each chunk of ``vector`` by magnitude, quantised to 2 bits (see the module doc)."""
    numel = vector.numel()
    c = chunks_of(numel, chunk)
    padded = torch.zeros(c * chunk, dtype=torch.float32)
    padded[:numel] = vector.to(torch.float32)
    rows = padded.view(c, chunk)
    _, idx = torch.topk(rows.abs(), k, dim=1, sorted=False)
    idx, _ = torch.sort(idx, dim=1)
    picked = torch.gather(rows, 1, idx)
    mags = picked.abs()
    ordered, order = torch.sort(mags, dim=1)
    lo = ordered[:, : k // 2].mean(dim=1)
    hi = ordered[:, k // 2 :].mean(dim=1)
    big = torch.zeros_like(mags, dtype=torch.bool).scatter_(1, order[:, k // 2 :], True)  # the larger half
    codes = big.to(torch.uint8) | ((picked < 0).to(torch.uint8) << 1)
    scales = torch.stack([lo, hi], dim=1)
    indices, codes_np, scales_np = idx.numpy().astype(np.uint16), codes.numpy(), scales.numpy()
    return Compressed(indices, codes_np, scales_np, dense_of(indices, codes_np, scales_np, numel, chunk))


class ErrorFeedback:
    """One learner's residual: :meth:`step` sends top-k of (residual + gradient) and keeps the rest."""

    def __init__(self, numel: int, k: int = DEFAULT_K, chunk: int = CHUNK) -> None:
        self.residual = torch.zeros(numel, dtype=torch.float32)
        self.k, self.chunk = k, chunk

    def step(self, gradient: Tensor) -> Compressed:
        self.residual += gradient.to(torch.float32)
        sent = compress(self.residual, self.k, self.chunk)
        self.residual -= sent.dense
        return sent
