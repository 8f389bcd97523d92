"""One learner update from decoded TrajectoryBatches: tensors, advantages, the run's objective, a step.

Staleness is per row: the learner's current version minus the version the batch was sampled with; GEPO's
defensive sampling turns on by itself for stale rows. Group ids are made unique across batches, so each
sampler's prompt groups stay groups.

Sized for real models:

* Micro-batches under a token budget with the exact full-batch gradient for every objective, group-coupled
  ones included (GEPO's group expectation, batch-wide token-mean normalisers), by the two-pass cotangent
  method: pass 1 scores all rows without grad; the objective runs on the full batch with the log-probs as
  a leaf, giving g = ∂loss/∂logp [N,T]; pass 2 re-scores each micro-batch with grad and backpropagates
  Σ g·logp. Exact because pass 2's log-probs equal pass 1's (same parameters, deterministic forward: no
  active dropout). Everything in one micro-batch: the plain single pass, no extra forward.
* Gradient checkpointing (HF models), bf16 autocast on CUDA (float32 on CPU), chunked log-softmax
  (:func:`heterorl.peer.model.completion_logprobs`).
* The inference/training mismatch of fresh rows (sampled with the learner's current version): measured
  (``mismatch/*``) and, with ``tis_cap``, corrected by truncated importance sampling (Yao et al. 2025,
  :mod:`heterorl.peer.objectives.tis`). Both use log π_learner(version) before the step, which the update
  already has: pass 1 on the micro-batched path, the detached grad forward on the direct path (the same
  parameters, so the same numbers); no forward pass is added for them. Stale rows are not measured or
  corrected: the learner no longer holds their version, and the objective's IS on log q covers both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from heterorl.protocol.settings import LearnerSettings

from .. import objectives
from ..model import completion_logprobs
from ..model.logprobs import model_device

TIS_PARAMS = ("tis_cap", "tis_logp", "tis_rows")  # set by the learner, never by objective_params


class UpdateSettings(Protocol):
    """What :func:`update_options` reads: a peer's :class:`~heterorl.protocol.settings.RunSettings`, or the
    one-process loop's ``OneProcessConfig`` (same field names)."""

    objective: str
    advantage: str | None
    objective_params: dict
    temperature: float
    max_new_tokens: int

    @property
    def learner(self) -> LearnerSettings: ...


def update_options(s: UpdateSettings) -> dict[str, Any]:
    """The keyword arguments of :func:`update` that come from the run's settings (all but the model, the
    optimizer, the rows, the version and the pad id): the one place settings map onto an update."""
    ls = s.learner
    return {
        "objective": s.objective,
        "advantage": s.advantage,
        "objective_params": s.objective_params,
        "temperature": s.temperature,
        "max_new_tokens": s.max_new_tokens,
        "grad_clip": ls.grad_clip,
        "micro_batch_tokens": ls.micro_batch_tokens,
        "gradient_checkpointing": ls.gradient_checkpointing,
        "tis_cap": ls.tis_cap,
    }


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


def plan_micro_batches(
    prompt_lengths: list[int], completion_width: int, budget: int | None
) -> list[tuple[int, int]]:
    """Consecutive row spans ``(start, stop)`` whose packed size rows × (max prompt + completion width)
    stays within ``budget`` tokens; a row alone above it is its own span. ``None``: one span of all rows.
    """
    n = len(prompt_lengths)
    if budget is None or n == 0:
        return [(0, n)]
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    spans, start, widest = [], 0, 0
    for i, p in enumerate(prompt_lengths):
        w = max(widest, p)
        if i > start and (i - start + 1) * (w + completion_width) > budget:
            spans.append((start, i))
            start, w = i, p
        widest = w
    spans.append((start, n))
    return spans


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on a CUDA device that has bf16; otherwise a no-op (float32, e.g. on CPU)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def activation_checkpointing(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """HF gradient checkpointing (non-reentrant) while inside; restores the model's previous setting."""
    if not enabled or getattr(model, "is_gradient_checkpointing", False):
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        model.gradient_checkpointing_disable()


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory in MiB: CUDA's max allocated since the last reset; elsewhere the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


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
    micro_batch_tokens: int | None = None,
    gradient_checkpointing: bool = False,
    tis_cap: float | None = None,
    diagnose_mismatch: bool = True,
) -> dict[str, float]:
    """One optimiser step of ``objective`` on ``rows``; the objective's stats plus reward and staleness.

    micro_batch_tokens: token budget of one forward (rows × padded prompt+completion width); ``None`` =
        all rows at once. The gradient is the full batch's either way (module docstring).
    gradient_checkpointing: recompute activations in backward (HF models that support it).
    tis_cap: C of truncated importance sampling on fresh rows; ``None`` = off.
    diagnose_mismatch: report ``mismatch/*`` over fresh rows (costs no forward pass).
    Also reports ``learner/micro_batches`` and ``mem/peak_mib`` (CUDA: max allocated during this
    update; CPU: the process's peak RSS so far).
    """
    reserved = sorted(set(TIS_PARAMS) & set(objective_params))
    if reserved:
        raise ValueError(f"{', '.join(reserved)}: set by the learner (learner.tis_cap), not objective params")
    device = model_device(policy)
    spans = plan_micro_batches([len(p) for p in rows.prompts], rows.completions.shape[1], micro_batch_tokens)
    adv_name = advantage or objectives.default_advantage(objective)
    adv = objectives.advantages(adv_name, rows.rewards, rows.group_ids).to(device)
    staleness = (version - rows.versions).clamp_min(0).float()
    fresh = (rows.versions == version).to(device)
    logq, mask, group_ids = rows.logq.to(device), rows.mask.to(device), rows.group_ids.to(device)
    params = {"max_len": max_new_tokens, **objective_params}

    def objective_on(logp: Tensor, logp_old: Tensor) -> tuple[Tensor, dict[str, float]]:
        tis = {} if tis_cap is None else {"tis_cap": tis_cap, "tis_logp": logp_old, "tis_rows": fresh}
        return objectives.compute(
            objective, logp, logq, mask, adv, group_ids, staleness=staleness.to(device), **params, **tis
        )

    def score(start: int, stop: int) -> Tensor:
        with autocast_for(device):
            return completion_logprobs(
                policy,
                rows.prompts[start:stop],
                rows.completions[start:stop],
                rows.mask[start:stop],
                pad_id,
                temperature,
            )

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    with activation_checkpointing(policy, gradient_checkpointing):
        if len(spans) == 1:  # direct: one forward with grad; its detached values are π_learner(version)
            logp = score(0, len(rows.prompts))
            logp_old = logp.detach()
            loss, stats = objective_on(logp, logp_old)
            loss.backward()
        else:  # cotangent method: exact full-batch gradient from micro-batch forwards
            with torch.no_grad():
                logp_old = torch.cat([score(a, b) for a, b in spans])
            leaf = logp_old.clone().requires_grad_(True)
            loss, stats = objective_on(leaf, logp_old)
            loss.backward()
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for a, b in spans:
                (score(a, b) * g[a:b]).sum().backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip))
    optimizer.step()
    policy.eval()
    if diagnose_mismatch:
        stats.update(objectives.mismatch_stats(logp_old, logq, mask, fresh))
    return {
        **{k: float(v) for k, v in stats.items()},
        "loss": float(loss.detach()),
        "grad_norm": grad_norm,
        "reward/mean": float(rows.rewards.mean()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": float(staleness.max()),
        "rows": float(len(rows.rewards)),
        "learner/micro_batches": float(len(spans)),
        "mem/peak_mib": peak_memory_mib(device),
    }
