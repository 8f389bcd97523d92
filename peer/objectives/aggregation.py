"""Loss aggregations: how per-token losses [B,T] become one scalar (spec §1.4).

Sequence-level objectives place their per-sequence loss on every response token, so
``seq_mean_token_mean`` of such a tensor is the plain mean over sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._params import AGGREGATIONS

_AGGREGATORS: dict[str, Callable[..., Tensor]] = {}


def _register(name: str) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    def deco(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        if name in _AGGREGATORS:
            raise ValueError(f"aggregation {name!r} registered twice")
        _AGGREGATORS[name] = fn
        return fn

    return deco


def _lengths(mask: Tensor) -> Tensor:
    return mask.sum(-1).clamp_min(1.0)


@_register("token_mean")
def token_mean(token_loss: Tensor, mask: Tensor, **_: object) -> Tensor:
    """Σ m·ℓ / Σ m over the whole batch (DAPO, CISPO)."""
    return (token_loss * mask).sum() / mask.sum().clamp_min(1.0)


@_register("seq_mean_token_mean")
def seq_mean_token_mean(token_loss: Tensor, mask: Tensor, **_: object) -> Tensor:
    """(1/B) Σ_b (1/L_b) Σ_t m·ℓ (original GRPO; GSPO/GEPO/GMPO sequence losses)."""
    return ((token_loss * mask).sum(-1) / _lengths(mask)).mean()


@_register("seq_mean_token_sum")
def seq_mean_token_sum(token_loss: Tensor, mask: Tensor, **_: object) -> Tensor:
    """(1/B) Σ_b Σ_t m·ℓ (TOPR's trajectory log-likelihood, BNPO's official runs)."""
    return (token_loss * mask).sum(-1).mean()


def _require_max_len(max_len: int | None, name: str) -> float:
    if max_len is None:
        raise ValueError(f"aggregation {name!r} needs max_len (the generation budget M, a constant)")
    return float(max_len)


@_register("constant")
def constant(token_loss: Tensor, mask: Tensor, max_len: int | None = None, **_: object) -> Tensor:
    """Σ m·ℓ / (B·M) with M the configured generation budget (Dr. GRPO, arXiv 2503.20783 §3.2)."""
    m_const = _require_max_len(max_len, "constant")
    return (token_loss * mask).sum() / (token_loss.shape[0] * m_const)


@_register("delta_l")
def delta_l(
    token_loss: Tensor, mask: Tensor, max_len: int | None = None, alpha: float = 1.0, **_: object
) -> Tensor:
    """Σ_b x_b Σ_t m·ℓ, x_b = L_b^-α / (M Σ_j L_j^-α) (ΔL normalisation, arXiv 2509.07558).

    Lengths are divided by their mean before the power, which leaves x unchanged and keeps
    L^-α representable for long responses (as the authors' verl code does).
    """
    m_const = _require_max_len(max_len, "delta_l")
    lengths = _lengths(mask)
    scaled = (lengths / lengths.mean()) ** (-alpha)
    x = scaled / (m_const * scaled.sum())
    return (x.detach() * (token_loss * mask).sum(-1)).sum()


assert set(_AGGREGATORS) == set(AGGREGATIONS), "aggregation registry out of sync with AGGREGATIONS"


def aggregation_names() -> list[str]:
    """Names accepted by :func:`aggregate` and the ``aggregation=`` parameter."""
    return list(AGGREGATIONS)


def aggregate(
    name: str, token_loss: Tensor, mask: Tensor, max_len: int | None = None, alpha: float = 1.0
) -> Tensor:
    """Reduce per-token losses [B,T] (zero where ``mask`` is 0) to a scalar with the named mode."""
    fn = _AGGREGATORS.get(name)
    if fn is None:
        raise ValueError(f"unknown aggregation {name!r}; valid: {', '.join(AGGREGATIONS)}")
    return fn(
        token_loss,
        mask.to(token_loss.dtype) if torch.is_floating_point(token_loss) else mask,
        max_len=max_len,
        alpha=alpha,
    )
