"""Learner peers' gradients into one: the writer's reduction, the same bytes for every member.

Each learner's gradient is the mean over its own batch (its objective's normaliser); the step's gradient is
their token-weighted mean, summed in the learners' key order in float32 so that the result does not depend
on arrival order, then clipped once to the run's norm (a learner never clips its own part: the clip is of the
step). Exactly the union batch's gradient for objectives normalised per token over the batch; for those with
group or sequence normalisers it weighs each learner's mean by its tokens, a close approximation.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import torch
from torch import Tensor

log = logging.getLogger(__name__)


class Part(Protocol):
    learner: bytes
    batch_ids: list[bytes]
    tokens: int


P = TypeVar("P", bound=Part)


def parts_for_step(parts: Iterable[P], trained: Callable[[list[bytes]], set[bytes]]) -> list[P]:
    """The parts one version trains on, taken in the order given (the writer's own first). Left out: a part
    without tokens; one naming a batch an earlier part names (it waits for the next step); one naming a
    batch the lineage already trained (``trained(ids)``: those of ``ids`` it did; a member that heard every
    commit never sends one, so this is logged as a fault)."""
    taken: set[bytes] = set()
    chosen: list[P] = []
    for p in parts:
        if not p.tokens or taken & set(p.batch_ids):
            continue
        if trained(p.batch_ids):
            log.warning(
                "lineage: %s's part names batches the lineage trained; left out", p.learner.hex()[:16]
            )
            continue
        taken.update(p.batch_ids)
        chosen.append(p)
    return chosen


def combine_gradients(
    parts: list[tuple[bytes, int, dict[str, Tensor]]], max_norm: float
) -> tuple[dict[str, Tensor], float]:
    """``parts``: (learner key, tokens, float32 gradients by name) of each contribution with tokens. Returns
    the clipped token-weighted mean and its norm before clipping."""
    if not parts:
        raise ValueError("no gradient to combine")
    ordered = sorted(parts, key=lambda p: p[0])
    total = sum(tokens for _, tokens, _ in ordered)
    names = sorted(ordered[0][2])
    out = {n: torch.zeros_like(ordered[0][2][n], dtype=torch.float32) for n in names}
    for _, tokens, grads in ordered:
        weight = tokens / total
        for n in names:
            out[n].add_(grads[n], alpha=weight)
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(out[n]) for n in names])))
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for n in names:
                out[n].mul_(coef)
    return out, norm


def weighted_lr_scale(parts: list[tuple[int, float]]) -> float:
    """The step's lr scale (VCPO's ESS factor) from (tokens, lr_scale) of each contribution: their token-
    weighted mean."""
    total = sum(t for t, _ in parts)
    return sum(t * s for t, s in parts) / total if total else 1.0


def state_sha256(named: list[tuple[str, Tensor]]) -> bytes:
    """SHA-256 of the named tensors' float32 bytes in name order: the exact state a commit is taken on."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda x: x[0]):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).numpy())
    return h.digest()
