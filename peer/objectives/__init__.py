"""The loss zoo: pure tensor objectives for group-based policy-gradient RL, behind one call.

``compute(name, logp, logq, mask, advantages, group_ids, **params) -> (loss, stats)``:

    logp [B,T]   current-policy token log-probs (carries grad)
    logq [B,T]   behaviour (sampler) token log-probs
    mask [B,T]   1 on response tokens
    advantages [B] (or [B,T] where a method allows per-token advantages)
    group_ids [B]  rows with the same id answer the same prompt

Every objective = importance weight × surrogate × aggregation; ``stats`` carries
IS-weight mean/var/max, ESS, clip fraction and KL(q‖p) estimates. No I/O, no model.
Any objective takes truncated importance sampling against the inference/training mismatch
(``tis_cap``, ``tis_logp``, ``tis_rows``; Yao et al. 2025, see :mod:`.tis`), applied here, once.
Formulas, papers, defaults and pitfalls: docs/objectives.md; test vectors: tests/test_objectives_vectors.py.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from . import gepo as _gepo  # noqa: F401  (registration)
from . import m2po as _m2po  # noqa: F401
from . import sequence as _sequence  # noqa: F401
from . import token_clip as _token_clip  # noqa: F401
from . import truncated as _truncated  # noqa: F401
from . import vcpo as _vcpo  # noqa: F401
from ._batch import build_batch
from ._diagnostics import diagnostics
from ._params import build_params
from ._registry import all_specs, get
from .advantages import advantage_names, advantages
from .aggregation import aggregate, aggregation_names
from .tis import mismatch_stats, tis_correction

__all__ = [
    "advantage_names",
    "advantages",
    "aggregate",
    "aggregation_names",
    "compute",
    "default_advantage",
    "describe",
    "mismatch_stats",
    "names",
    "tis_correction",
]

DEFAULT_OBJECTIVE = "gepo"


def names() -> list[str]:
    """All registered objective names."""
    return sorted(all_specs())


def default_advantage(name: str) -> str:
    """The advantage estimator the objective's paper (or authors' code) uses."""
    return get(name).default_advantage


def describe(name: str) -> str:
    """One line: what the objective is and where it comes from."""
    return get(name).doc


def compute(
    name: str,
    logp: Tensor,
    logq: Tensor,
    mask: Tensor,
    advantages: Tensor,
    group_ids: Tensor,
    **params: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Loss (to minimise) and detached diagnostics of objective ``name``; see the module docstring.

    With ``tis_cap`` set, the TIS rows' behaviour log-probs become ``tis_logp`` and every token's loss
    is multiplied by w_t = min(exp(tis_logp − logq), C) before aggregation (Yao et al. 2025).
    """
    spec = get(name)
    p = build_params(spec.params, params, name)
    tis = None
    if p.tis_cap is not None:
        tis = tis_correction(logq, mask, p.tis_logp, p.tis_rows, p.tis_cap)
        logq = tis.logq
    batch = build_batch(
        logp,
        logq,
        mask,
        advantages,
        group_ids,
        logratio_clamp=p.logratio_clamp,
        staleness=p.staleness,
        token_advantages_ok=spec.token_advantages,
    )
    terms = spec.fn(batch, p)
    token_loss = terms.token_loss
    if tis is not None:
        token_loss = token_loss * tis.weights.to(device=token_loss.device, dtype=token_loss.dtype)
    loss = aggregate(
        p.aggregation or spec.default_aggregation,
        token_loss,
        batch.mask,
        max_len=p.max_len,
        alpha=p.delta_l_alpha,
    )
    stats = diagnostics(batch, terms, loss)
    if tis is not None:
        stats.update({k: float(v) for k, v in tis.stats.items()})
    return loss, stats
