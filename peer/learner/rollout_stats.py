"""Statistics that tell rollouts sampled from the run's policy from anything else: pure tensor functions.

A verifier recomputes the logits of a batch's completions under the version the batch claims and compares:

- **Log-prob agreement** (Grail's check, per token): ``exp(|log q - log π|) - 1`` between the claimed
  behaviour log-prob ``log q`` and the recomputed ``log π = log softmax(z / T)`` (the very quantity a sampler
  reports, before top-p). Honest engines differ by float noise only: bf16 kernels move it by ~1e-3 on the tiny
  model and ~5e-2 (mean) on a 135M model. A *median* over tokens is robust to the rare large bf16 outliers;
  forged log-probs (shifted, copied, from another model or version) move every token. The batch's mean
  ``|log q - log π|`` adds what a median misses: a forgery right on most tokens (a constant near the log-prob
  of the many near-certain tokens) and far off on the rest.
- **Typicality** (a likelihood test of the token choices against the sampling distribution p, softmax(z / T)
  within the top-p nucleus, renormalised): for tokens drawn from p the surprise ``s = -log p(x)`` has mean
  ``H(p)`` and variance ``Var_p[log p]``, so ``z = Σ (s - H) / sqrt(Σ Var)`` is about N(0, 1) for honest rows
  (central limit over tokens) whatever the model's entropy. Text from another model, a phrase inserted by
  hand or a higher temperature makes tokens less likely than p says (z ≫ 0); a lower temperature, greedy
  decoding or cherry-picking the likeliest tokens makes them more likely (z ≪ 0). Recomputed-honest
  log-probs do not hide either: the test reads only the token choices.
- **Nucleus**: the share of tokens outside the top-p nucleus (with a little slack for float noise at its
  edge), which a sampler honouring top-p never emits.

What none of this sees: a choice among honest samples (sending only some of the rows sampled), and a
difference smaller than the engines' own noise (a slightly perturbed copy of the weights). Those are bounded
(docs/trust.md), not caught.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..model.sampling import gumbel_noise, nucleus_logprobs

__all__ = ["NUCLEUS_SLACK", "RowStats", "nucleus_logprobs", "row_stats"]

NUCLEUS_SLACK = 0.02  # top-p mass added when deciding "outside the nucleus": float noise at its edge


@dataclasses.dataclass(frozen=True)
class RowStats:
    """Per-row statistics of checked rows (each a tensor [N], float64 where it sums)."""

    tokens: Tensor  # completion tokens per row
    logprob_dev_median: Tensor  # median over tokens of exp(|log q - log π|) - 1
    logprob_dev_max: Tensor  # max over tokens of the same
    logprob_gap: Tensor  # Σ |log q - log π| over tokens
    surprise: Tensor  # Σ -log p(x) over tokens inside the nucleus
    entropy: Tensor  # Σ H(p) over the same tokens
    variance: Tensor  # Σ Var_p[log p] over the same tokens
    outside: Tensor  # tokens outside the (slackened) top-p nucleus
    reproduced: Tensor | None = None  # seeded rows: tokens the row's seed reproduces (Gumbel-max)
    # seeded rows: the largest Gumbel-max margin of a token its seed does not reproduce (0: all reproduced)
    seed_margin: Tensor | None = None

    def row_logprob_gap_mean(self) -> Tensor:
        """Each row's mean |log q - log π| over its tokens."""
        return self.logprob_gap / self.tokens.clamp_min(1)

    def reproduced_share(self) -> float | None:
        """Share of the batch's tokens its seeds reproduce (None: not seeded)."""
        if self.reproduced is None:
            return None
        return float(self.reproduced.sum() / self.tokens.sum().clamp_min(1))

    def typicality_z(self) -> Tensor:
        """Each row's z = (Σ s - Σ H) / sqrt(Σ Var) (0 where the variance is 0: a deterministic row)."""
        return _z(self.surprise - self.entropy, self.variance)

    def batch_typicality_z(self) -> float:
        """The rows' z taken together: every token of the batch in one test."""
        return float(_z((self.surprise - self.entropy).sum(), self.variance.sum()))

    def batch_logprob_gap_mean(self) -> float:
        """Mean |log q - log π| over all the batch's tokens (catches forgeries close to the truth on most
        tokens, which a median lets through: a constant near the log-prob of a near-certain token)."""
        return float(self.logprob_gap.sum() / self.tokens.sum().clamp_min(1))

    def batch_logprob_dev_median(self) -> float:
        """Median over the rows' medians (robust to a few rows with bf16 outliers)."""
        return float(self.logprob_dev_median.median()) if len(self.tokens) else 0.0


def _z(num: Tensor, var: Tensor) -> Tensor:
    return torch.where(var > 0, num / var.clamp_min(1e-12).sqrt(), torch.zeros_like(num))


def row_stats(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    claimed: Tensor,
    temperature: float,
    top_p: float,
    seeds: list[int] | None = None,
) -> RowStats:
    """The statistics of rows whose completion ``targets`` [N, T] (``mask`` [N, T]: 1 on real tokens) a
    sampler claims to have drawn with behaviour log-probs ``claimed`` [N, T]; ``logits`` [N, T, V] are the
    verifier's recomputation under the claimed version (the logits that predict each target). ``seeds``: the
    rows' sampling seeds, when the sampler drew them by Gumbel-max (``reproduced`` counts its tokens the
    seeds give back)."""
    targets, mask, claimed = (t.to(logits.device) for t in (targets, mask, claimed))
    valid = mask > 0
    n = targets.shape[0]
    row_of = torch.arange(n, device=logits.device)[:, None].expand_as(targets)[valid]
    z, x, q = logits[valid], targets[valid].long(), claimed[valid].float()  # [M, V], [M], [M]
    per = {k: [] for k in ("dev", "surprise", "entropy", "variance", "inside", "outside")}
    step = max(1, TOKENS_ELEMENTS // max(1, z.shape[-1]))
    for c in range(0, len(x), step):  # a bounded [chunk, V] of float32 at a time
        for k, v in _token_stats(
            z[c : c + step], x[c : c + step], q[c : c + step], temperature, top_p
        ).items():
            per[k].append(v)
    tok = {k: torch.cat(v) if v else torch.zeros(0, device=logits.device) for k, v in per.items()}
    inside = tok["inside"].bool() if len(x) else torch.zeros(0, dtype=torch.bool, device=logits.device)

    def per_row(values: Tensor) -> Tensor:
        return torch.zeros(n, dtype=torch.float64).index_add_(0, row_of.cpu(), values.double().cpu())

    where = inside.double()
    tokens = valid.sum(-1).cpu()
    med, dmax = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for i, d in enumerate(torch.split(tok["dev"].double().cpu(), tokens.tolist())):
        if len(d):
            med[i], dmax[i] = d.median(), d.max()
    reproduced = margin = None
    if seeds is not None:
        reproduced, margin = _reproduced(logits, targets, valid, seeds, temperature, top_p)
    return RowStats(
        reproduced=reproduced,
        seed_margin=margin,
        tokens=tokens.double(),
        logprob_dev_median=med,
        logprob_dev_max=dmax,
        logprob_gap=per_row(torch.log1p(tok["dev"])),
        surprise=per_row(tok["surprise"] * where),
        entropy=per_row(tok["entropy"] * where),
        variance=per_row(tok["variance"] * where),
        outside=per_row(tok["outside"]),
    )


def _reproduced(
    logits: Tensor, targets: Tensor, valid: Tensor, seeds: list[int], temperature: float, top_p: float
) -> tuple[Tensor, Tensor]:
    """Per row: positions where argmax(log p + g(seed, step)) is the row's token, and the largest margin
    ``max_y (log p(y) + g_y) - (log p(x) + g_x)`` of a token ``x`` it does not reproduce. An honest engine of
    another dtype misses only near-ties (a margin within its float noise of 0); a token drawn from anything
    else lies anywhere. A token in the slack band at the nucleus' edge is scored as if inside it (its
    un-truncated log-prob, shifted by the nucleus' renormalisation)."""
    out = torch.zeros(len(seeds), dtype=torch.float64)
    margins = torch.zeros(len(seeds), dtype=torch.float64)
    for i, seed in enumerate(seeds):
        n = int(valid[i].sum())
        if n == 0:
            continue
        logp = nucleus_logprobs(logits[i, :n], temperature, top_p)
        noise = torch.stack([gumbel_noise(seed, t, logp.shape[-1]) for t in range(n)]).to(logp.device)
        best, drawn = (logp + noise).max(-1)
        x = targets[i, :n].long()
        out[i] = float((drawn == x).sum())
        plain = torch.log_softmax(logits[i, :n].float() / temperature, -1)
        shift = (logp - plain).gather(-1, drawn[:, None])[:, 0]  # -log(nucleus mass): 0 at top-p 1
        mine = plain.gather(-1, x[:, None])[:, 0] + shift + noise.gather(-1, x[:, None])[:, 0]
        gap = torch.where(drawn == x, torch.zeros_like(best), best - mine)
        margins[i] = float(gap.max())
    return out, margins


TOKENS_ELEMENTS = 2**25  # float32 logits per chunk of tokens (128 MiB)


def _token_stats(z: Tensor, x: Tensor, q: Tensor, temperature: float, top_p: float) -> dict[str, Tensor]:
    """Per token: exp(|q - log π|) - 1; within the top-p nucleus the surprise, entropy and variance of log p
    (a token in the slack band at its edge is in neither the sums nor the count outside)."""
    recomputed = torch.log_softmax(z.float() / temperature, -1).gather(-1, x[:, None])[:, 0]
    dev = torch.expm1((q - recomputed).abs())
    logp = nucleus_logprobs(z, temperature, top_p)
    inside = torch.isfinite(logp.gather(-1, x[:, None])[:, 0])  # in the typicality sums
    if top_p < 1.0:  # outside even the nucleus with a little slack for float noise at its edge: never emitted
        slack = nucleus_logprobs(z, temperature, min(1.0, top_p + NUCLEUS_SLACK)).gather(-1, x[:, None])[:, 0]
        outside = ~torch.isfinite(slack)
    else:
        outside = torch.zeros_like(inside)
    p = logp.exp().double()
    safe = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp)).double()
    entropy = -(p * safe).sum(-1)
    variance = ((p * safe.square()).sum(-1) - entropy.square()).clamp_min(0)
    surprise = -safe.gather(-1, x[:, None])[:, 0]
    return {
        "dev": dev,
        "surprise": surprise,
        "entropy": entropy,
        "variance": variance,
        "inside": inside.double(),
        "outside": outside.double(),
    }
