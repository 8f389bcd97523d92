"""Learner peers' parts into one step: the writer's checks of a part, and its streamed, bounded reduction.

Each learner's gradient is the mean over its own batch (its objective's normaliser). The writer adds each part
as it arrives (:class:`Accumulator`, one part in memory at a time): clipped to the run's norm first (so that
no one part, however large its gradient, moves the step more than its share), weighed by its tokens, summed in
float32; the step's gradient is that sum over the parts' total tokens, checked finite before it is committed.
The weights are the tokens of the batches a part names, each bounded by what one batch of the run can hold
(:func:`part_refusal`): a member cannot outweigh the others by saying its batches were large.

Exactly the union batch's gradient for objectives normalised per token over the batch, when no part is
clipped; for those with group or sequence normalisers it weighs each learner's mean by its tokens, a close
approximation.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterable

import torch
from torch import Tensor


def part_refusal(
    batches: Iterable[tuple[bytes, bytes, int]], lr_scale: float, has_gradient: bool, batch_tokens: int
) -> str | None:
    """Why the writer leaves a part out of the step (pure), or None. ``batches``: (id, sha256, tokens) of each
    batch it names; ``batch_tokens``: the most tokens one batch of the run holds (rows × new tokens)."""
    batches = list(batches)
    if not batches:
        return "a gradient without batches" if has_gradient else None
    if not has_gradient:
        return "batches without a gradient"
    if len({b for b, _, _ in batches}) != len(batches):
        return "it names a batch twice"
    worst = max(t for _, _, t in batches)
    if worst > batch_tokens or min(t for _, _, t in batches) < 1:
        return f"a batch of {worst} tokens: the run's batches hold 1 to {batch_tokens}"
    if not 0.0 <= lr_scale <= 1.0 or not math.isfinite(lr_scale):
        return f"lr_scale {lr_scale} outside [0, 1]"
    return None


def clip_(grads: dict[str, Tensor], max_norm: float) -> float:
    """Scale ``grads`` in place to norm at most ``max_norm`` (0: no clip); their norm before."""
    norm = float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()]))
    )
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads.values():
            g.mul_(coef)
    return norm


class Accumulator:
    """Σ tokens × clip(gradient) over the parts of one step, in float32 (thread-safe: parts arrive on the
    writer's network threads, its own from the training thread)."""

    def __init__(self, max_norm: float):
        self.max_norm = max_norm
        self._lock = threading.Lock()
        self._sum: dict[str, Tensor] | None = None
        self.tokens = 0
        self.lr_weighted = 0.0  # Σ tokens × lr_scale
        self.norms: list[float] = []  # each part's norm before its clip

    def add(self, tokens: int, grads: dict[str, Tensor], lr_scale: float = 1.0) -> None:
        """One part of ``tokens`` tokens. ``grads`` (float32 CPU tensors by name) is consumed: clipped and
        scaled in place."""
        if tokens < 1:
            raise ValueError("a part without tokens")
        norm = clip_(grads, self.max_norm)
        for g in grads.values():
            g.mul_(float(tokens))
        with self._lock:
            if self._sum is None:
                self._sum = grads
            else:
                if set(grads) != set(self._sum):
                    raise ValueError("a part of another model's parameters")
                for n, g in grads.items():
                    self._sum[n].add_(g)
            self.tokens += tokens
            self.lr_weighted += tokens * lr_scale
            self.norms.append(norm)

    def __len__(self) -> int:
        with self._lock:
            return len(self.norms)

    def result(self) -> tuple[dict[str, Tensor], float, float]:
        """The step's gradient (the sum over the total tokens), its norm and the token-weighted lr scale;
        ValueError if there is nothing, or it is not finite (a part the checks let through overflowed)."""
        with self._lock:
            if self._sum is None:
                raise ValueError("no part to combine")
            out = {n: g / self.tokens for n, g in self._sum.items()}
            lr = self.lr_weighted / self.tokens
        norm = float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in out.values()]))
        )
        if not math.isfinite(norm):
            raise ValueError("the combined gradient is not finite")
        return out, norm, lr


def state_sha256(named: list[tuple[str, Tensor]]) -> bytes:
    """SHA-256 of the named tensors' float32 bytes in name order: the exact state a commit is taken on."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda x: x[0]):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy())
    return h.digest()
