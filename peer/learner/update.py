"""One learner update from decoded TrajectoryBatches: tensors, advantages, the run's objective, a step.

Staleness is per row: the learner's current version minus the version the batch was sampled with; GEPO's
defensive sampling turns on by itself for stale rows. Group ids are made unique across batches, so each
sampler's prompt groups stay groups.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import objectives
from ..model import completion_logprobs


@dataclasses.dataclass
class Rows:
    prompts: list[list[int]]
    completions: torch.Tensor  # [N, T] padded
    mask: torch.Tensor  # [N, T]
    logq: torch.Tensor  # [N, T] behaviour log-probs, 0 on padding
    rewards: torch.Tensor  # [N]
    group_ids: torch.Tensor  # [N]
    versions: torch.Tensor  # [N] policy version each row was sampled with


def rows_from_bodies(bodies: list[dict], pad_id: int) -> Rows:
    flat = [(b, r, bi) for bi, b in enumerate(bodies) for r in b["rows"]]
    width = max(1, max(len(r["completion_ids"]) for _, r, _ in flat))
    n = len(flat)
    completions = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    logq = torch.zeros((n, width), dtype=torch.float32)
    for i, (_, r, _) in enumerate(flat):
        k = len(r["completion_ids"])
        if k:
            completions[i, :k] = torch.tensor(r["completion_ids"])
            mask[i, :k] = 1
            logq[i, :k] = torch.tensor(r["logprobs"], dtype=torch.float32)
    groups = {}
    group_ids = torch.tensor([groups.setdefault((bi, r["group"]), len(groups)) for _, r, bi in flat])
    return Rows(
        prompts=[list(r["prompt_ids"]) for _, r, _ in flat],
        completions=completions,
        mask=mask,
        logq=logq,
        rewards=torch.tensor([float(r["reward"]) for _, r, _ in flat]),
        group_ids=group_ids,
        versions=torch.tensor([b["policy_version"] for b, _, _ in flat]),
    )


def staleness_bucket(delta: int) -> str:
    """0, 1, 2-3, 4-7, 8-15, 16+: the histogram buckets every view uses."""
    if delta <= 1:
        return str(max(0, delta))
    for lo, hi in ((2, 3), (4, 7), (8, 15)):
        if delta <= hi:
            return f"{lo}-{hi}"
    return "16+"


STALENESS_BUCKETS = ("0", "1", "2-3", "4-7", "8-15", "16+")


def staleness_refusal(
    step: int, policy_version: int, published_version: int, max_staleness: int
) -> str | None:
    """Why the learner at ``step`` refuses a batch sampled with ``policy_version``, or None to admit it.

    A version newer than any published is a forgery or a bug; beyond ``max_staleness`` versions behind
    (``-1``: no limit) the run drops the batch.
    """
    if policy_version > published_version:
        return f"sampled with version {policy_version}, newer than any published"
    lag = step - policy_version
    if max_staleness >= 0 and lag > max_staleness:
        return f"{lag} versions stale, the run drops beyond {max_staleness}"
    return None


def update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: Rows,
    *,
    version: int,
    objective: str,
    advantage: str | None,
    objective_params: dict,
    temperature: float,
    max_new_tokens: int,
    pad_id: int,
    grad_clip: float,
) -> dict[str, float]:
    """One optimiser step of ``objective`` on ``rows``; the objective's stats plus reward and staleness."""
    adv_name = advantage or objectives.default_advantage(objective)
    adv = objectives.advantages(adv_name, rows.rewards, rows.group_ids)
    staleness = (version - rows.versions).clamp_min(0).float()
    policy.train()
    logp = completion_logprobs(policy, rows.prompts, rows.completions, rows.mask, pad_id, temperature)
    params = {"max_len": max_new_tokens, **objective_params}
    loss, stats = objectives.compute(
        objective, logp, rows.logq, rows.mask, adv, rows.group_ids, staleness=staleness, **params
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip))
    optimizer.step()
    policy.eval()
    return {
        **{k: float(v) for k, v in stats.items()},
        "loss": float(loss.detach()),
        "grad_norm": grad_norm,
        "reward/mean": float(rows.rewards.mean()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": float(staleness.max()),
        "rows": float(len(rows.rewards)),
    }
